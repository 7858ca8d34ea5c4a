"""What a newcomer meets first: a misspelt flag or argument answered in one line, a batch of the wrong structure
described, a finished run that says so, one way of numbering epochs, and a Ctrl-C that can be picked up again."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import signal
from typing import Any

import pytest
import torch
from conftest import Regressor, make_data, make_loader, quiet_trainer
from torch.utils.data import DataLoader, Dataset

import ember
from ember.callbacks import ModelCheckpoint, ProgressBar
from ember.config import FlagError
from ember.loggers import CSVLogger

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


# ------------------------------------------------------------------------------ misspelt names
def test_an_unknown_trainer_flag_names_the_closest_ones_in_one_line() -> None:
    expected = r"^Trainer.__init__\(\) got an unexpected keyword argument 'max_epoch': Trainer\(max_epoch=\.\.\.\) is "
    expected += r"not a flag; did you mean max_epochs"
    with pytest.raises(TypeError, match=expected) as raised:
        ember.Trainer(max_epoch=3)
    assert isinstance(raised.value, FlagError) and "\n" not in str(raised.value)
    with pytest.raises(FlagError, match="docs/trainer-flags.md lists every flag"):
        ember.Trainer(colour="blue")


def test_an_unknown_argument_of_self_log_names_the_closest_ones() -> None:
    class Misspelt(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss, on_stp=True)
            return loss

    with pytest.raises(TypeError, match="on_stp") as raised:
        quiet_trainer(max_epochs=1, logger=False).fit(Misspelt(), make_loader(16))
    (note,) = raised.value.__notes__
    assert note.startswith("self.log(..., on_stp=...) takes no such argument; did you mean on_step")


# ----------------------------------------------------------------------------- a batch described
class _Dicts(Dataset):
    def __init__(self) -> None:
        self.data = make_data(16)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x, y = self.data[index]
        return {"input": x, "target": y}


def test_a_dict_batch_unpacked_as_a_tuple_is_described() -> None:
    with pytest.raises(TypeError, match="must be Tensor, not str") as raised:  # x, y = batch: two strings
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), DataLoader(_Dicts(), batch_size=8))
    (note,) = raised.value.__notes__
    assert note.startswith("training_step was given a batch that is a dict {'input': a tensor of shape (8, 4)")
    assert "unpacks its keys" in note and "batch['input']" in note


def test_a_list_where_a_tensor_was_expected_is_described() -> None:
    class Whole(Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self(batch).mean())  # the batch is [x, y], not x

    with pytest.raises(TypeError, match="not list") as raised:
        quiet_trainer(logger=False).validate(Whole(), make_loader(16), verbose=False)
    (note,) = raised.value.__notes__
    assert note == (
        "validation_step was given a batch that is a list of 2: [a tensor of shape (8, 4), a tensor of shape (8, 1)]"
    )


def test_an_error_the_batch_did_not_cause_gets_no_note() -> None:
    class Broken(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("the model is broken")

    with pytest.raises(RuntimeError, match="the model is broken") as raised:
        quiet_trainer(max_epochs=1, logger=False).fit(Broken(), make_loader(16))
    assert not getattr(raised.value, "__notes__", [])


# -------------------------------------------------------------------------------- a finished run
def test_a_run_resumed_after_it_finished_says_so_and_returns(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    quiet_trainer(max_epochs=2, default_root_dir=str(tmp_path)).fit(Regressor(), make_loader(32))
    validated: list[int] = []

    class Counted(Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            validated.append(batch_idx)

    again = quiet_trainer(max_epochs=2, default_root_dir=str(tmp_path), num_sanity_val_steps=2)
    again.fit(Counted(), make_loader(32), make_loader(16), ckpt_path="last")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "nothing to train: the run has reached max_epochs=2 (epoch 2, step 8)"
    assert again.global_step == 8 and validated == []  # no sanity check either

    steps = quiet_trainer(max_steps=3, default_root_dir=str(tmp_path / "steps"))
    steps.fit(Regressor(), make_loader(32))
    quiet_trainer(max_steps=3, default_root_dir=str(tmp_path / "steps")).fit(Regressor(), make_loader(32),
                                                                             ckpt_path="last")  # fmt: skip
    assert "the run has reached max_steps=3" in capsys.readouterr().out


# ------------------------------------------------------------------------------ epoch numbers
def test_epochs_are_numbered_from_zero_on_the_bar_in_checkpoints_and_metrics(tmp_path: Any) -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream=stream, interactive=False, line_interval=1e9)
    callbacks = [bar, ModelCheckpoint(save_top_k=-1)]
    trainer = ember.Trainer(max_epochs=2, default_root_dir=str(tmp_path), enable_model_summary=False,
                            callbacks=callbacks, logger=CSVLogger(str(tmp_path)), log_every_n_steps=1)  # fmt: skip
    trainer.fit(Regressor(), make_loader(32))
    bar_epochs = [int(line.split()[1].split("/")[0]) for line in stream.getvalue().splitlines()]
    names = sorted(os.listdir(trainer.checkpoint_dir))
    checkpoint_epochs = [int(re.match(r"epoch=(\d+)", name).group(1)) for name in names]  # type: ignore[union-attr]
    with open(os.path.join(trainer.log_dir or "", "metrics.csv")) as file:
        header, *rows = [line.strip().split(",") for line in file]
    logged_epochs = sorted({int(float(row[header.index("epoch")])) for row in rows})
    assert bar_epochs == checkpoint_epochs == logged_epochs == [0, 1]
    assert stream.getvalue().splitlines()[-1].startswith("Epoch 1/1 ")  # the last epoch of 0..1


# ---------------------------------------------------------------------------------- Ctrl-C
class _CtrlC(ember.callbacks.Callback):
    def on_train_batch_end(self, trainer: ember.Trainer, *args: Any) -> None:
        if trainer.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_ctrl_c_reports_in_80_columns_below_the_bar_which_is_not_drawn_again(tmp_path: Any) -> None:
    stream = _Terminal()
    bar = ProgressBar(stream=stream, refresh_rate=0.0)
    trainer = ember.Trainer(max_epochs=3, default_root_dir=str(tmp_path), enable_model_summary=False, logger=False,
                            callbacks=[bar, _CtrlC()])  # fmt: skip
    with contextlib.redirect_stdout(stream), pytest.raises(SystemExit):
        trainer.fit(Regressor(), make_loader(64))
    written = stream.getvalue()
    report = written[written.index("stopped by SIGINT") :]
    assert "Epoch" not in report and "\r" not in report  # nothing drawn over it, or after it
    assert [len(line) <= 80 for line in report.splitlines()] == [True, True, True]


def test_an_example_run_again_continues_its_run(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    spec = importlib.util.spec_from_file_location("digits_example", os.path.join(EXAMPLES, "digits.py"))
    assert spec is not None and spec.loader is not None
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)
    arguments = ["--root-dir", str(tmp_path), "--max-epochs", "1", "--target", "0"]
    assert digits.main(arguments) == 0
    assert digits.main(arguments) == 0  # as after an interruption: the same command continues the same run
    printed = capsys.readouterr().out
    assert "resuming from" in printed and "nothing to train: the run has reached max_epochs=1" in printed
