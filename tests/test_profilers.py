"""Profilers: the simple table adds up to the step time, the PyTorch trace is written, and without a
profiler nothing in the run is wrapped."""

from __future__ import annotations

import glob
import io
import json
import os
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import Regressor, make_loader, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ProgressBar
from ember.exceptions import MisconfigurationException
from ember.profilers import PassThroughProfiler, Profiler, PyTorchProfiler, SimpleProfiler


class _MLP(ember.Module):
    """Enough work per step (several ms) that the loop's own bookkeeping is a small part of it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters())


class _EpochClock(Callback):
    def on_train_epoch_start(self, trainer: ember.Trainer, module: Any) -> None:
        self.started = time.perf_counter()

    def on_train_epoch_end(self, trainer: ember.Trainer, module: Any) -> None:
        self.seconds = time.perf_counter() - self.started


def _mlp_loader(batches: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64 * batches, 64, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=64)


def test_simple_profiler_table_adds_up_to_the_step_time(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    clock = _EpochClock()
    bar = ProgressBar(stream=io.StringIO(), interactive=False, line_interval=0.0)
    trainer = ember.Trainer(
        accelerator="cpu", max_epochs=1, profiler="simple", default_root_dir=str(tmp_path), log_every_n_steps=5,
        callbacks=[clock, bar], enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(_MLP(), _mlp_loader(40))
    records = trainer.profiler.records
    for action in ("train: waiting for data", "train: batch_to_device", "training_step", "backward",
                   "optimizer_step", "[Callback]ProgressBar.on_train_batch_end"):  # fmt: skip
        assert records[action].calls == 40, action
    assert records["logging"].calls == 8 + 1  # every 5 steps, and the epoch's values
    # every action inside the epoch, each counting only its own time, covers the epoch's wall time
    in_epoch = sum(record.total for action, record in records.items() if not action.endswith("configure_optimizers"))
    assert 0.9 < in_epoch / clock.seconds < 1.1, (in_epoch, clock.seconds)

    assert trainer.profiler.dirpath == trainer.log_dir  # made without one, it keeps the run's directory
    path = os.path.join(trainer.log_dir, "fit-profile.txt")
    with open(path) as file:
        report = file.read()
    lines = report.splitlines()
    assert lines[0].startswith("Profile of fit: ") and lines[1].split()[:3] == ["Action", "Calls", "Mean"]
    percents = [float(line.split()[-1]) for line in lines[3:] if line[0] != "-" and not line.startswith("total")]
    assert sum(percents) == pytest.approx(100, abs=0.1 * len(percents))
    assert report.strip() in capsys.readouterr().out and f"(written to {path})"


def test_nested_actions_count_their_own_time_only() -> None:
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            with self.trainer.profiler.profile("waiting"):
                time.sleep(0.01)
            optimizer = self.optimizers()
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()
            optimizer.zero_grad()

    trainer = quiet_trainer(max_steps=4, logger=False, profiler=SimpleProfiler(), enable_checkpointing=False)
    trainer.fit(Manual(), make_loader(32))
    records = trainer.profiler.records
    assert records["waiting"].calls == records["backward"].calls == records["optimizer_step"].calls == 4
    assert records["waiting"].total >= 0.04 and records["training_step"].total < 0.02  # the sleep is not in it


def test_the_simple_table_without_extended_has_the_mean_and_total_only() -> None:
    tables = {}
    for extended in (True, False):
        profiler = SimpleProfiler(extended=extended)
        with profiler.profile("load"):
            pass
        tables[extended] = profiler.summary().splitlines()
    assert tables[True][1].split() == ["Action", "Calls", "Mean", "(ms)", "Max", "(ms)", "Total", "(s)", "%"]
    assert tables[False][1].split() == ["Action", "Mean", "(ms)", "Total", "(s)"]
    assert len(tables[False][3].split()) == 3  # "load", its mean and its total


def test_a_profiler_of_ones_own_overrides_lightnings_setup_and_teardown(tmp_path: Any, capsys: Any) -> None:
    class Counting(Profiler):
        def __init__(self) -> None:
            super().__init__(dirpath=tmp_path, filename=None)  # no file: the summary is printed only
            self.counts: dict[str, int] = {}
            self.stages: list[tuple[str, Any, Any]] = []

        def start(self, action: str) -> None:
            self.counts[action] = self.counts.get(action, 0) + 1

        def stop(self, action: str) -> None:
            pass

        def summary(self) -> str:
            return f"counted {self.counts['backward']} backward passes"

        def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
            super().setup(stage, local_rank=local_rank, log_dir=log_dir)
            self.stages.append(("setup", stage, local_rank))

        def teardown(self, stage: str | None) -> None:
            self.stages.append(("teardown", stage, self.local_rank))
            super().teardown(stage=stage)

    profiler = Counting()
    trainer = quiet_trainer(max_steps=3, logger=False, profiler=profiler, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader())
    assert profiler.stages == [("setup", "fit", 0), ("teardown", "fit", 0)]
    assert "counted 3 backward passes" in capsys.readouterr().out and not os.listdir(tmp_path)


def test_an_action_may_start_in_one_hook_and_stop_in_another() -> None:
    class EpochAction(Callback):
        def on_train_epoch_start(self, trainer: ember.Trainer, module: Any) -> None:
            trainer.profiler.start("epoch")

        def on_train_epoch_end(self, trainer: ember.Trainer, module: Any) -> None:
            trainer.profiler.stop("epoch")

    trainer = quiet_trainer(max_epochs=2, logger=False, callbacks=[EpochAction()], profiler="simple")
    trainer.fit(Regressor(), make_loader(32))
    assert trainer.profiler.records["epoch"].calls == 2
    assert trainer.profiler.records["training_step"].calls == 8
    with pytest.raises(ValueError, match=r"Attempting to stop recording an action \('never'\) which was never started"):
        trainer.profiler.stop("never")


def test_the_run_is_wrapped_only_while_profiling() -> None:
    seen: dict[str, Any] = {}

    class Look(Callback):
        def on_train_batch_end(self, trainer: ember.Trainer, module: Any, *args: Any) -> None:
            seen["wrapped"] = sorted(set(vars(trainer.strategy)) & {"step", "backward", "batch_to_device"})
            hooks = trainer.hooks.implementations("on_train_batch_end")
            seen["hook wrapped"] = any(hasattr(getattr(hook, "func", hook), "__wrapped__") for hook in hooks)

    trainer = quiet_trainer(max_steps=2, logger=False, callbacks=[Look()])
    assert isinstance(trainer.profiler, PassThroughProfiler)
    trainer.fit(Regressor(), make_loader())
    assert seen == {"wrapped": [], "hook wrapped": False}  # no profiler: the loop runs its plain code

    trainer = quiet_trainer(max_steps=2, logger=False, callbacks=[Look()], profiler="simple")
    trainer.fit(Regressor(), make_loader())
    assert seen == {"wrapped": ["backward", "batch_to_device", "step"], "hook wrapped": True}
    assert not set(vars(trainer.strategy)) & {"step", "backward", "batch_to_device"}  # taken off afterwards
    assert "_loaders" not in vars(trainer) and "on_train_batch_end" not in vars(trainer.callbacks[0])


def test_pytorch_profiler_writes_a_trace_with_the_trainers_actions(tmp_path: Any) -> None:
    trainer = quiet_trainer(max_epochs=1, profiler="pytorch", default_root_dir=str(tmp_path))
    trainer.fit(Regressor(), make_loader(64))
    (trace,) = glob.glob(os.path.join(trainer.log_dir, "fit-rank0.*.pt.trace.json"))
    with open(trace) as file:
        names = {event.get("name") for event in json.load(file)["traceEvents"]}
    assert {"training_step", "backward", "optimizer_step", "train: waiting for data"} <= names
    assert "[pl][module]torch.nn.modules.linear.Linear: layer" in names  # record_module_names, as Lightning
    assert any(name.startswith("aten::") for name in names if name)
    with open(os.path.join(trainer.log_dir, "fit-profile.txt")) as file:
        assert "Self CPU" in file.read()
    assert "training_step" in {event.name for event in trainer.profiler.function_events}  # Lightning's attribute
    with pytest.warns(UserWarning, match="recorded no trace of fit"):
        quiet_trainer(max_steps=1, profiler="pytorch", logger=False).fit(Regressor(), make_loader())


def test_pytorch_profiler_records_on_its_own_until_describe(tmp_path: Any) -> None:
    profiler = PyTorchProfiler(dirpath=tmp_path, filename="alone")
    with profiler.profile("outer"):
        ones = torch.ones(4)
        with profiler.profile("inner"):
            ones.sum()
    profiler.describe()
    names = {event.name for event in profiler.function_events}
    assert {"outer", "inner", "aten::ones", "aten::sum"} <= names
    assert "aten::sum" in profiler.summary()  # the report stays after describe, as Lightning's
    assert sorted(os.listdir(tmp_path)) == ["alone.pt.trace.json", "alone.txt"]
    assert profiler.dirpath is tmp_path  # kept as given, as Lightning's: a Path stays one
    profiler.start("again")  # a new recording
    profiler.stop("again")
    profiler.describe()
    assert {event.name for event in profiler.function_events} == {"again"}


def test_pytorch_profiler_takes_lightnings_arguments(tmp_path: Any) -> None:
    traces: list[Any] = []
    profiler = PyTorchProfiler(
        dirpath=tmp_path, export_to_chrome=False, on_trace_ready=traces.append, sort_by_key="cpu_time_total",
        record_module_names=False, table_kwargs={"max_name_column_width": 20}, with_flops=True,
    )  # fmt: skip
    trainer = quiet_trainer(max_steps=6, logger=False, profiler=profiler, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader())
    assert len(traces) == 1 and glob.glob(str(tmp_path / "*")) == [str(tmp_path / "fit-profile.txt")]
    with pytest.raises(MisconfigurationException, match=r"profiler_kwargs\) does not take \['trace_memory'\]"):
        PyTorchProfiler(trace_memory=True)


def test_hooks_are_timed_under_lightnings_names_from_prepare_data_to_teardown(tmp_path: Any) -> None:
    class Data(ember.DataModule):
        def prepare_data(self) -> None:
            pass

        def setup(self, stage: str) -> None:
            pass

        def train_dataloader(self) -> DataLoader:
            return make_loader()

        def state_dict(self) -> dict[str, Any]:
            return {"seen": 1}

    class Net(Regressor):
        def setup(self, stage: str) -> None:
            pass

    class Watch(Callback):
        def teardown(self, trainer: ember.Trainer, module: Any, stage: str) -> None:
            pass

    def fit(**options: Any) -> dict[str, list[float]]:
        trainer = quiet_trainer(max_epochs=1, profiler="simple", logger=False, callbacks=[Watch()],
                                default_root_dir=str(tmp_path))  # fmt: skip
        trainer.fit(Net(), datamodule=Data(), **options)
        with open(os.path.join(str(tmp_path), "fit-profile.txt")) as file:
            assert "[LightningDataModule]Data.teardown" in file.read()  # the report is written after teardown()
        assert isinstance(trainer.profiler, SimpleProfiler)
        return trainer.profiler.recorded_durations

    # Data.teardown is DataModule's, which does nothing: timed all the same, as Lightning times it. A callback's
    # actions are named by its state_key, its class's qualified name here.
    durations = fit()
    for action in ("[LightningDataModule]Data.prepare_data", "[LightningDataModule]Data.setup",
                   "[LightningDataModule]Data.state_dict", "[LightningDataModule]Data.teardown",
                   "[LightningModule]Net.setup", "[LightningModule]Net.configure_optimizers",
                   f"[Callback]{Watch.__qualname__}.teardown"):  # fmt: skip
        assert len(durations[action]) == 1 and durations[action][0] > 0, action
    assert len(durations["training_step"]) == 8
    saved = glob.glob(os.path.join(str(tmp_path), "**", "*.ckpt"), recursive=True)
    durations = fit(ckpt_path=saved[0])  # a resumed fit gives the datamodule its state back
    assert len(durations["[LightningDataModule]Data.load_state_dict"]) == 1
