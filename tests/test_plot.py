"""``ember plot``: curves of one or several runs into an image, and its errors."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import warm_processes
from conftest import Regressor, make_loader, quiet_trainer

from ember.cli import main
from ember.plot import panel_of


def _runs(root: str, count: int) -> str:
    for lr in (0.02, 0.05)[:count]:
        quiet_trainer(max_epochs=3, default_root_dir=root, log_every_n_steps=2, enable_checkpointing=False).fit(
            Regressor(lr=lr), make_loader(64), make_loader(16)
        )
    return os.path.join(root, "ember_logs")


def _image_size(path: str) -> tuple[int, int]:
    from matplotlib.image import imread

    height, width, _ = imread(path).shape
    return width, height


def test_plot_writes_one_panel_per_metric(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    logs = _runs(str(tmp_path), count=2)
    capsys.readouterr()  # what the fits said
    output = str(tmp_path / "curves.png")
    assert main(["plot", logs, "-o", output]) == 0  # both runs; panels "loss" (train and val) and nothing else
    assert capsys.readouterr().out.strip() == f"wrote {output}"
    with open(output, "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"
    assert _image_size(output) == (660, 456)  # one panel of 5.5 x 3.8 inches at 120 dpi

    one_run = str(tmp_path / "one.png")
    metrics_csv = os.path.join(logs, "version_0", "metrics.csv")
    assert main(["plot", metrics_csv, "-o", one_run, "--metrics", "val_loss,epoch_x", "--x", "epoch"]) == 2
    assert "--metrics epoch_x: not logged; the runs have train_loss, val_loss" in capsys.readouterr().err
    assert main(["plot", metrics_csv, "-o", one_run, "--metrics", "val_loss", "--x", "epoch"]) == 0
    assert os.path.exists(one_run)
    capsys.readouterr()

    no_extension = str(tmp_path / "curves")  # matplotlib writes a PNG, named with .png added: so it says
    assert main(["plot", metrics_csv, "-o", no_extension]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {no_extension}.png" and os.path.exists(f"{no_extension}.png")


def test_metrics_share_a_panel_without_their_stage_and_suffix() -> None:
    names = ["train_loss_step", "train_loss_epoch", "val_loss", "loss", "val_acc/dataloader_idx_1", "lr-SGD"]
    assert [panel_of(name) for name in names] == ["loss", "loss", "loss", "loss", "acc/dataloader_idx_1", "lr-SGD"]


def test_plot_errors_name_the_problem(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "missing: no such file or directory" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.csv in this directory or below it" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    logs = _runs(str(tmp_path), count=1)
    assert main(["plot", logs]) == 2
    assert "ember plot needs the matplotlib package: pip install 'ember[plot]'" in capsys.readouterr().err


def test_plot_help_explains_every_flag() -> None:
    result = warm_processes.run([sys.executable, "-m", "ember", "plot", "--help"], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0
    for flag in ("RUN", "-o FILE, --output FILE", "--metrics A,B", "--x {step,epoch}"):
        assert flag in result.stdout, flag
    assert "examples:" in result.stdout and "matplotlib" in result.stdout
