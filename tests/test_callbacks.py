"""The model summary, DeviceStatsMonitor, Timer, and the progress bar's options."""

from __future__ import annotations

import csv
import logging
import os
import sys
import time
import types
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer
from torch import nn

import ember
from ember.callbacks import DeviceStatsMonitor, ModelSummary, ProgressBar, Timer
from ember.callbacks.model_summary import summarize
from ember.exceptions import MisconfigurationException
from ember.loggers import Logger
from ember.model_summary import ModelSummary as ModelSummaryObject
from ember.model_summary import readable_count


class _TwoLayers(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 300), nn.ReLU(), nn.Linear(300, 4))
        self.frozen = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.frozen(self.encoder(x)))


def test_model_summary_is_printed_when_fit_starts(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=True)
    trainer.fit(_TwoLayers(), make_loader(16))
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["|", "Name", "|", "Type", "|", "Params", "|", "Trainable"]
    # 4*300+300 + 300*4+4 = 2704 in the encoder; 20 frozen; 5 in the output layer
    assert lines[2].split() == ["0", "|", "layer", "|", "Linear", "|", "5", "|", "5"]
    assert lines[3].split() == ["1", "|", "encoder", "|", "Sequential", "|", "2.7", "K", "|", "2.7", "K"]
    assert lines[4].split() == ["2", "|", "frozen", "|", "Linear", "|", "20", "|", "0"]
    assert "2.7 K     Trainable params" in out and "20        Non-trainable params" in out
    assert "2.7 K     Total params" in out
    assert f"{(2704 + 20 + 5) * 4 / 1e6:<10.3f}Total estimated model params size (MB)" in out


def test_model_summary_depth_and_turning_it_off(capsys: pytest.CaptureFixture[str]) -> None:
    text = summarize(_TwoLayers(), max_depth=-1)
    assert "encoder.0 | Linear" in text and "encoder.1 | ReLU" in text
    assert summarize(_TwoLayers(), max_depth=0).splitlines()[0].endswith("Trainable params")
    ember.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_model_summary=False).fit(
        Regressor(), make_loader(16)
    )
    assert "Total params" not in capsys.readouterr().out
    # The flag turns off the default summary only: one given is kept, as in Lightning.
    given = ModelSummary(max_depth=2)
    trainer = ember.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_model_summary=False, callbacks=given)
    assert [callback for callback in trainer.callbacks if isinstance(callback, ModelSummary)] == [given]
    trainer.fit(_TwoLayers(), make_loader(16))
    assert "encoder.0 | Linear" in capsys.readouterr().out
    trainer = ember.Trainer(accelerator="cpu", max_epochs=1, logger=False, callbacks=[ModelSummary(max_depth=0)])
    trainer.fit(Regressor(), make_loader(16))
    assert "Total params" not in capsys.readouterr().out  # depth 0 turns it off, as in Lightning
    with pytest.raises(ValueError, match=r"ModelSummary\(max_depth=-2\): expected -1"):
        ModelSummary(max_depth=-2)


def test_a_model_summary_object_measures_layers_with_the_example_input() -> None:
    model = _TwoLayers()
    model.frozen.eval()
    model.register_parameter("scale", nn.Parameter(torch.ones(3)))  # the root's own: an "other params" row
    model.example_input_array = torch.zeros(2, 4)
    summary = ModelSummaryObject(model, max_depth=1)
    assert summary.layer_names == ["layer", "encoder", "frozen"]
    assert summary.layer_types == ["Linear", "Sequential", "Linear"] and summary.param_nums == [5, 2704, 20]
    assert summary.in_sizes == [[2, 4]] * 3 and summary.out_sizes == [[2, 1], [2, 4], [2, 4]]
    assert summary.training_modes == [True, True, False] and summary.total_training_modes == {"train": 5, "eval": 1}
    assert (summary.total_parameters, summary.trainable_parameters, summary.total_layer_params) == (2732, 2712, 2729)
    assert summary.model_size == pytest.approx(2732 * 4 / 1e6)
    assert summary.total_flops == 2 * 2 * (4 * 300 + 300 * 4 + 4 * 4 + 4) and model.training  # modes put back
    lines = str(summary).splitlines()
    assert [cell.strip() for cell in lines[0].split("|")] == ["", "Name", "Type", "Params", "Mode", "FLOPs",
                                                               "In sizes", "Out sizes"]  # fmt: skip
    assert [cell.strip() for cell in lines[3].split("|")] == ["1", "encoder", "Sequential", "2.7 K", "train",
                                                              "9.6 K", "[2, 4]", "[2, 4]"]  # fmt: skip
    assert [cell.strip() for cell in lines[5].split("|")][1:4] == ["other params", "n/a", "3"]
    assert lines[-7:] == ["2.7 K     Trainable params", "20        Non-trainable params", "2.7 K     Total params",
                          "0.011     Total estimated model params size (MB)", "5         Modules in train mode",
                          "1         Modules in eval mode", "9.7 K     Total Flops"]  # fmt: skip
    deep = ModelSummaryObject(_TwoLayers(), max_depth=-1)
    assert deep.layer_names[:3] == ["layer", "encoder", "encoder.0"] and set(deep.in_sizes) == {"?"}
    assert ModelSummaryObject(_TwoLayers(), max_depth=0).layer_names == []
    assert [readable_count(n) for n in (0, 999, 1234, 2e6, 4e14, 5e15)] == [
        "0  ", "999  ", "1.2 K", "2.0 M", "400 T", "5,000 T"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="`max_depth` can be -1, 0 or > 0, got -2"):
        ModelSummaryObject(model, max_depth=-2)


def test_a_summary_object_gives_its_layers_unknown_sizes_and_warns_of_lazy_layers() -> None:
    class AnyInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Identity()

        def forward(self, *args: Any) -> Any:
            return self.layer(*args) if args else None

    model = AnyInput()
    for example in ([], torch.tensor(0.0)):
        model.example_input_array = example  # type: ignore[assignment]
        assert ModelSummaryObject(model).in_sizes == ["?"]  # an empty size says nothing, as in Lightning
    summary = ModelSummaryObject(_TwoLayers())
    assert list(summary.summarize()) == summary.layer_names
    lazy = nn.Sequential(nn.LazyLinear(3))
    with pytest.warns(UserWarning, match="number of parameters detected may be inaccurate"):
        assert ModelSummaryObject(lazy).total_parameters == 0


def test_a_summary_callback_that_overrides_summarize_gets_the_columns_and_totals(caplog: Any) -> None:
    shown: list[dict[str, Any]] = []

    class Collecting(ModelSummary):
        @staticmethod
        def summarize(summary_data: Any, total_parameters: int, trainable_parameters: int, model_size: float,
                      total_training_modes: dict[str, int], **summarize_kwargs: Any) -> None:  # fmt: skip
            shown.append(dict(columns=dict(summary_data), total=total_parameters, kwargs=summarize_kwargs))
            ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                   total_training_modes, **summarize_kwargs)  # fmt: skip

    for depth in (1, 0):
        callbacks = [Collecting(max_depth=depth, width=3)]
        trainer = quiet_trainer(max_steps=1, logger=False, enable_model_summary=True, callbacks=callbacks)
        with caplog.at_level(logging.INFO, logger="ember"):
            trainer.fit(Regressor(), make_loader(8))
    assert len(shown) == 1  # at depth 0 there is nothing to show, as in Lightning
    assert shown[0]["columns"]["Name"] == ["layer"] and shown[0]["columns"]["Params"] == ["5  "]
    assert shown[0]["total"] == 5 and shown[0]["kwargs"] == {"width": 3, "total_flops": 0}
    assert "Total estimated model params size (MB)" in caplog.text and "| Name  | Type" in caplog.text


def test_device_stats_are_logged_at_the_logging_steps() -> None:
    trainer = quiet_trainer(max_epochs=1, callbacks=[DeviceStatsMonitor()], log_every_n_steps=2, limit_val_batches=2)
    trainer.fit(Regressor(), make_loader(64), make_loader(16))
    with open(os.path.join(trainer.log_dir, "metrics.csv"), newline="") as file:
        rows = [row for row in csv.DictReader(file) if any(v for k, v in row.items() if k.startswith("DeviceStats"))]
    hooks = ("on_train_batch_start", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end")
    names = {f"DeviceStatsMonitor.{hook}/cpu_{figure}" for hook in hooks for figure in ("rss_mb", "peak_rss_mb")}
    assert names <= set(rows[0]) and not any(row.get("epoch") for row in rows)  # no epoch, as Lightning writes them
    # Each logging step's figures, labelled with the steps before its batch; the epoch's validation (due at its
    # second batch) after step 7.
    written = [(row["step"], hook) for row in rows for hook in hooks if row[f"DeviceStatsMonitor.{hook}/cpu_rss_mb"]]
    assert written == [(step, hook) for step in "1357" for hook in hooks[:2]] + [("7", hook) for hook in hooks[2:]]
    assert "DeviceStatsMonitor.on_train_batch_end/cpu_rss_mb" not in trainer.logged_metrics
    assert DeviceStatsMonitor(cpu_stats=False).stats(torch.device("cpu")) == {}
    with pytest.raises(
        MisconfigurationException, match=r"Cannot use `DeviceStatsMonitor` callback with `Trainer\(logger"
    ):
        quiet_trainer(max_steps=1, logger=False, callbacks=[DeviceStatsMonitor()]).fit(Regressor(), make_loader())
    with pytest.raises(ValueError, match=r"cpu_stats='yes'"):
        DeviceStatsMonitor(cpu_stats="yes")  # type: ignore[arg-type]


class _HookCalls(Logger):
    """Keeps the hook of each ``log_metrics`` call of ``DeviceStatsMonitor``, with its step."""

    def __init__(self) -> None:
        self.calls: list[tuple[int | None, str]] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        hooks = {name.split("/")[0].split(".")[1] for name in metrics if name.startswith("DeviceStatsMonitor.")}
        self.calls += [(step, hook) for hook in sorted(hooks)]


def test_device_stats_of_evaluation_batches_are_due_by_their_index_in_every_stage() -> None:
    calls = _HookCalls()
    trainer = quiet_trainer(max_steps=3, callbacks=[DeviceStatsMonitor()], log_every_n_steps=2, logger=calls,
                            num_sanity_val_steps=2, limit_val_batches=3, val_check_interval=3)  # fmt: skip
    trainer.fit(Regressor(), make_loader(64), make_loader(32))
    both = ("batch_start", "batch_end")
    assert calls.calls == [
        *((0, f"on_validation_{hook}") for hook in both),  # the sanity check's second batch
        *((1, f"on_train_{hook}") for hook in both),
        *((2, f"on_validation_{hook}") for hook in both),
    ]
    calls.calls.clear()
    quiet_trainer(callbacks=[DeviceStatsMonitor()], log_every_n_steps=2, logger=calls).test(Regressor(), make_loader())
    assert calls.calls == [(0, f"on_test_{hook}") for hook in both] * 4  # the 2nd, 4th, 6th and 8th batches
    calls.calls.clear()
    trainer = quiet_trainer(max_steps=2, callbacks=[DeviceStatsMonitor(cpu_stats=False)], log_every_n_steps=1,
                            logger=calls)  # fmt: skip
    trainer.fit(Regressor(), make_loader())
    assert calls.calls == []  # nothing to log on the CPU: no empty rows


def test_device_stats_of_the_cpu_are_lightnings_with_psutil(monkeypatch: pytest.MonkeyPatch) -> None:
    usage = types.SimpleNamespace(percent=12.5)
    psutil = types.SimpleNamespace(cpu_percent=lambda: 50.0, virtual_memory=lambda: usage, swap_memory=lambda: usage)
    monkeypatch.setitem(sys.modules, "psutil", psutil)
    stats = {"cpu_percent": 50.0, "cpu_vm_percent": 12.5, "cpu_swap_percent": 12.5}
    assert DeviceStatsMonitor().stats(torch.device("cpu")) == stats
    assert quiet_trainer().accelerator.get_device_stats("cpu") == stats


@pytest.mark.cuda
def test_device_stats_on_a_gpu() -> None:
    stats = DeviceStatsMonitor().stats(torch.device("cuda", 0))
    assert "allocated_bytes.all.current" in stats and "cpu_rss_mb" not in stats  # torch.cuda.memory_stats's
    trainer = quiet_trainer(accelerator="cuda", devices=1, max_steps=4, callbacks=[DeviceStatsMonitor()],
                            log_every_n_steps=2)  # fmt: skip
    trainer.fit(Regressor(), make_loader())
    with open(os.path.join(trainer.log_dir, "metrics.csv"), newline="") as file:
        rows = list(csv.DictReader(file))
    assert any(
        float(row.get("DeviceStatsMonitor.on_train_batch_end/allocated_bytes.all.peak") or 0) > 0 for row in rows
    )


class _Slow(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        time.sleep(0.01)
        return super().training_step(batch, batch_idx)


def test_timer_stops_training_and_reports_stage_times(caplog: pytest.LogCaptureFixture) -> None:
    timer = Timer(duration={"seconds": 0.3})
    trainer = quiet_trainer(max_epochs=1000, callbacks=[timer], logger=False, enable_checkpointing=False)
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer.fit(_Slow(), make_loader(64), make_loader(16))
    assert 0 < trainer.global_step < 60  # 8 steps per epoch, 10 ms each: stopped within the fourth epoch
    assert 0.3 <= timer.time_elapsed("train") < 1.5 and timer.time_remaining("train") <= 0
    assert timer.start_time("validate") is not None and timer.time_elapsed("validate") > 0
    assert timer.time_elapsed("test") == 0 and timer.start_time("test") is None
    assert "Time limit reached. Elapsed time is 0." in caplog.text and "of 0.30 s." in caplog.text
    trainer.test(Regressor(), make_loader(16), verbose=False)
    assert timer.end_time("test") is not None and timer.end_time("test") >= timer.start_time("test")


def test_timer_with_epoch_interval_stops_at_an_epoch_end() -> None:
    timer = Timer(duration={"seconds": 0.1}, interval="epoch", verbose=False)
    trainer = quiet_trainer(max_epochs=1000, callbacks=[timer], logger=False, enable_checkpointing=False)
    trainer.fit(_Slow(), make_loader(64))
    assert trainer.global_step % 8 == 0 and 0 < trainer.current_epoch < 20


def test_timer_continues_the_count_of_a_resumed_run() -> None:
    timer = Timer(duration="00:00:01:00")
    timer.load_state_dict({"time_elapsed": {"train": 59.9}})  # as a checkpoint of a run 59.9 s in restores it
    trainer = quiet_trainer(max_epochs=1000, callbacks=[timer], logger=False, enable_checkpointing=False)
    trainer.fit(_Slow(), make_loader(64))
    assert trainer.global_step < 40 and timer.state_dict()["time_elapsed"]["train"] >= 60.0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Timer(duration="1 hour"), r"Timer\(duration\)='1 hour': expected 'DD:HH:MM:SS'"),
        (lambda: Timer(duration={"seconds": 1}, interval="batch"), r"Timer\(interval='batch'\)"),
        (lambda: ProgressBar(refresh_rate=-1), r"ProgressBar\(refresh_rate=-1\): expected a number of seconds"),
        (lambda: ProgressBar(line_interval="5"), r"ProgressBar\(line_interval='5'\)"),
    ],
)
def test_bad_callback_arguments_are_named(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
