"""self.log semantics, the CSV logger and the LR monitor; no retained graphs, no per-step syncs.

The progress bar is tested in test_progress.py.
"""

from __future__ import annotations

import csv
import gc
import os
import warnings
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, LearningRateMonitor
from ember.loggers import CSVLogger, Logger


def _rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_step_and_epoch_names_and_weighted_epoch_mean() -> None:
    class Logging(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            # the batch size as the value: the epoch mean must weigh it by the batch size
            self.log("size", float(len(x)), on_step=True, on_epoch=True)
            self.log("peak", torch.tensor(float(batch_idx)), on_epoch=True, on_step=False, reduce_fx="max")
            self.log("total", 1.0, on_epoch=True, on_step=False, reduce_fx="sum")
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(max_epochs=1, log_every_n_steps=1)
    trainer.fit(Logging(), make_loader(20, batch_size=8))  # batches of 8, 8 and 4
    metrics = trainer.callback_metrics
    assert float(metrics["size_epoch"]) == pytest.approx((8 * 8 + 8 * 8 + 4 * 4) / 20)
    assert float(metrics["size"]) == float(metrics["size_epoch"])
    assert float(metrics["size_step"]) == 4.0
    assert float(metrics["peak"]) == 2.0 and float(metrics["total"]) == 3.0
    rows = _rows(os.path.join(trainer.log_dir, "metrics.csv"))
    assert [row["size_step"] for row in rows if row["size_step"]] == ["8.0", "8.0", "4.0"]
    assert {"step", "epoch", "train_loss", "size_step", "size_epoch", "peak", "total"} <= set(rows[0])


def test_logged_values_hold_no_graph_and_memory_stays_flat() -> None:
    counts: list[int] = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            store = trainer.run_metrics.train
            for entry in store._entries.values():
                for value in (entry.step_value, entry.total):
                    assert not isinstance(value, torch.Tensor) or value.grad_fn is None
            assert outputs["loss"].grad_fn is None
            if trainer.global_step in (48, 144, 288):  # the same phase of the 16-step logging interval
                gc.collect()
                with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
                    warnings.simplefilter("ignore")
                    counts.append(sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor)))

    class Logging(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("loss_epoch_mean", loss, on_epoch=True, prog_bar=True)
            return loss

    trainer = quiet_trainer(max_steps=300, callbacks=[Probe()], log_every_n_steps=16)
    trainer.fit(Logging(), make_loader(64, batch_size=4))
    assert len(counts) == 3 and counts[0] == counts[1] == counts[2], counts
    assert all(value.grad_fn is None for value in trainer.callback_metrics.values())


def test_values_are_read_from_the_device_only_when_logs_are_written(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = {"count": 0}
    for method in ("item", "tolist", "__float__", "__bool__", "cpu"):
        original = getattr(torch.Tensor, method)

        def counting(self: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            reads["count"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counting)

    trainer = quiet_trainer(max_epochs=1, log_every_n_steps=50, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader(800, batch_size=4))  # 200 steps
    # a handful of reads per log write (4 writes) and at the epoch's end, never one per step
    assert reads["count"] < 40, reads


def test_non_scalar_log_value_and_bad_reduce_fx_are_refused() -> None:
    class Bad(Regressor):
        def __init__(self, value: Any, **options: Any) -> None:
            super().__init__()
            self.value, self.options = value, options

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("bad", self.value, **self.options)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"self.log\(bad, ...\)` was called, but the tensor must have a single"):
        quiet_trainer(max_steps=1).fit(Bad(torch.ones(3)), make_loader())
    with pytest.raises(ValueError, match="reduce_fx='median'"):
        quiet_trainer(max_steps=1).fit(Bad(1.0, reduce_fx="median"), make_loader())
    with pytest.raises(ValueError, match="`str` values cannot be logged"):
        quiet_trainer(max_steps=1).fit(Bad("text"), make_loader())


def test_csv_logger_versions_runs_and_writes_hyperparameters(tmp_path: Any) -> None:
    for expected in ("version_0", "version_1"):
        trainer = quiet_trainer(max_epochs=1, default_root_dir=str(tmp_path), log_every_n_steps=2)
        trainer.fit(Regressor(lr=0.02), make_loader(), make_loader())
        assert trainer.log_dir == os.path.join(str(tmp_path), "ember_logs", expected)
    open(os.path.join(str(tmp_path), "ember_logs", "version_7"), "w").close()  # a file of a run's name is no run
    assert CSVLogger(str(tmp_path)).version == 2
    with open(os.path.join(trainer.log_dir, "hparams.yaml")) as file:
        assert "lr: 0.02" in file.read().splitlines()
    rows = _rows(os.path.join(trainer.log_dir, "metrics.csv"))
    assert [row["step"] for row in rows if row["train_loss"]] == ["1", "3", "5", "7"]
    assert rows[-1]["val_loss"] and rows[-1]["epoch"] == "0"


def test_a_logger_subclass_places_its_runs_by_its_own_name_and_version(tmp_path: Any) -> None:
    class Named(CSVLogger):
        @property
        def name(self) -> str:
            return "project"

        @property
        def version(self) -> str:
            return "trial"

    logger = Named(str(tmp_path))
    assert logger.root_dir == os.path.join(str(tmp_path), "project")
    assert logger.log_dir == os.path.join(str(tmp_path), "project", "trial")


def test_a_stop_inside_an_accumulation_window_writes_no_step_values_of_its_batch() -> None:
    steps: list[int | None] = []

    class Recording(Logger):
        def log_metrics(self, metrics: Any, step: int | None = None) -> None:
            if "train_loss" in metrics:
                steps.append(step)

    class Stopping(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 4:  # the first batch of the third window: it accumulates
                self.trainer.should_stop = True
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(max_epochs=1, logger=Recording(), log_every_n_steps=2, accumulate_grad_batches=2)
    trainer.fit(Stopping(), make_loader())
    assert trainer.global_step == 2 and steps == [1]  # as Lightning: only the second step's, none at the stop


def test_a_logger_starts_its_experiment_before_setup_and_gets_the_hyperparameters_after_on_fit_start() -> None:
    events: list[str] = []

    class Recording(Logger):
        @property
        def experiment(self) -> Any:
            events.append("experiment")
            return self

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            events.append("log_hyperparams")

        def log_metrics(self, metrics: Any, step: int | None = None) -> None:
            pass

    class Tracing(Regressor):
        def setup(self, stage: str) -> None:
            events.append("setup")

        def on_fit_start(self) -> None:
            events.append("on_fit_start")

    quiet_trainer(max_steps=1, logger=Recording(), enable_checkpointing=False).fit(Tracing(), make_loader())
    assert events == ["experiment", "setup", "on_fit_start", "log_hyperparams"]  # Lightning's order


def test_csv_logger_widens_its_header_when_a_metric_appears(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path), flush_logs_every_n_steps=1)
    logger.log_metrics({"a": 1.0}, step=1)
    logger.log_metrics({"a": 2.0, "b": 3.0}, step=2)
    logger.log_metrics({"a": 4.0}, step=3)
    logger.save()
    assert _rows(logger.metrics_file) == [
        {"step": "1", "a": "1.0", "b": ""},
        {"step": "2", "a": "2.0", "b": "3.0"},
        {"step": "3", "a": "4.0", "b": ""},
    ]


def test_learning_rate_monitor_logs_each_param_group() -> None:
    class TwoGroups(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(
                [{"params": [self.layer.weight], "lr": 0.1}, {"params": [self.layer.bias], "lr": 0.01}],
                momentum=0.9,
            )
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    trainer = quiet_trainer(max_epochs=2, log_every_n_steps=2, callbacks=[LearningRateMonitor(log_momentum=True)])
    trainer.fit(TwoGroups(), make_loader(16))
    rows = [row for row in _rows(os.path.join(trainer.log_dir, "metrics.csv")) if row.get("lr-SGD/pg1")]
    assert [float(row["lr-SGD/pg1"]) for row in rows] == [0.1, 0.05]
    assert [float(row["lr-SGD/pg2"]) for row in rows] == [0.01, 0.005]
    assert float(rows[0]["lr-SGD/pg1-momentum"]) == 0.9
    # the rates are callback metrics, not logged metrics, and rows of their own, without the epoch, as Lightning's
    # monitor writes them
    assert "lr-SGD/pg1" in trainer.callback_metrics and "lr-SGD/pg1" not in trainer.logged_metrics
    assert [(row["step"], row["epoch"], row["train_loss"]) for row in rows] == [("0", "", ""), ("2", "", "")]


def test_nan_loss_is_reported_with_the_step_where_it_appeared() -> None:
    x = torch.ones(32, 4)
    x[21] = float("nan")  # in batch 5 (batch size 4)
    loader = DataLoader(TensorDataset(x, torch.ones(32, 1)), batch_size=4)
    with pytest.raises(FloatingPointError, match=r"became nan at epoch 0, batch 5 \(global step 6\)"):
        quiet_trainer(max_epochs=1, logger=False, log_every_n_steps=50).fit(Regressor(), loader)
