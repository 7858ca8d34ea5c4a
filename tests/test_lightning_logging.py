"""``self.log`` as Lightning defines it: the values and options it takes or refuses, where, and with which message."""

from __future__ import annotations

import copy
import csv
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
import torchmetrics
import yaml
from conftest import Regressor, make_data, make_loader, quiet_trainer
from torch.utils.data import DataLoader, default_collate

import ember
from ember.callbacks import Callback, DeviceStatsMonitor, StageThroughputMonitor, ThroughputMonitor
from ember.exceptions import MisconfigurationException
from ember.lightning_compat.hook import table_of
from ember.loggers import CSVLogger, DummyLogger, Logger, TensorBoardLogger
from ember.loggers.csv_logger import ExperimentWriter
from ember.loggers.dummy import DummyExperiment, rank_zero_experiment
from ember.rank_zero import rank_zero_only


class _LogsInStep(Regressor):
    """Logs ``value`` under "x" with ``options`` in each training step."""

    def __init__(self, value: Any = 1.0, **options: Any) -> None:
        super().__init__()
        self.value, self.options = value, options

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("x", self.value, **self.options)
        return super().training_step(batch, batch_idx)


def _fit(model: ember.Module, **flags: Any) -> ember.Trainer:
    flags = {"max_epochs": 1, "logger": False, "enable_checkpointing": False, **flags}
    trainer = quiet_trainer(**flags)
    trainer.fit(model, make_loader(32))
    return trainer


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "`NoneType` values cannot be logged"),
        ("text", "`str` values cannot be logged"),
        ([1, 2], "`list` values cannot be logged"),
        ({"a": 1}, "`dict` values cannot be logged"),
        ({"a": {"b": 1}}, "nested dictionaries cannot be logged"),
        (torch.ones(2), "the tensor must have a single element"),
    ],
)
def test_a_value_that_is_not_one_number_is_refused_with_a_value_error(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=rf"self.log\(x, .*\)` was called, but .*{message}"):
        _fit(_LogsInStep(value))


def test_booleans_and_numpy_numbers_are_numbers() -> None:
    trainer = _fit(_LogsInStep(np.float32(2.5)))
    assert trainer.callback_metrics["x"] == 2.5
    assert _fit(_LogsInStep(True)).callback_metrics["x"] == 1.0


@pytest.mark.parametrize(
    ("reduce_fx", "expected"),
    [(max, 3.0), (torch.max, 3.0), (min, 0.0), (torch.min, 0.0), ("AVG", 1.5), ("Mean", 1.5), ("SUM", 6.0),
     (sum, 6.0), (torch.sum, 6.0), (torch.mean, 1.5)],
)  # fmt: skip
def test_reduce_fx_takes_names_in_any_case_and_the_reducing_functions(reduce_fx: Any, expected: float) -> None:
    class Logs(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("batch", torch.tensor(batch_idx), on_step=False, on_epoch=True, reduce_fx=reduce_fx)
            return super().training_step(batch, batch_idx)

    trainer = _fit(Logs())  # 4 batches: 0, 1, 2, 3
    assert trainer.callback_metrics["batch"] == expected
    assert trainer.logged_metrics["batch"] == expected


def test_a_value_logged_per_step_and_per_epoch_is_the_newer_of_the_two_under_its_plain_name() -> None:
    class Logs(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("g", float(self.global_step), on_step=True, on_epoch=True)
            return super().training_step(batch, batch_idx)

    class Reads(Callback):
        seen: list[tuple[str, float, float | None]] = []

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            metrics = trainer.callback_metrics
            self.seen.append(("batch", float(metrics["g"]), float(metrics["g_step"])))

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.seen.append(("epoch end", float(trainer.callback_metrics["g"]), None))

    quiet_trainer(max_epochs=2, logger=False, callbacks=[Reads()]).fit(Logs(), make_loader(24))  # 3 batches
    # While an epoch trains, the latest step's value (checkpoints saved by step rank by it); at its end, the mean.
    first = [("batch", 0.0, 0.0), ("batch", 1.0, 1.0), ("batch", 2.0, 2.0), ("epoch end", 1.0, None)]
    second = [("batch", 3.0, 3.0), ("batch", 4.0, 4.0), ("batch", 5.0, 5.0), ("epoch end", 4.0, None)]
    assert Reads.seen == first + second


def test_another_reduction_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"^Only `self.log\(..., reduce_fx=\{min,max,mean,sum\}\)` are"):
        _fit(_LogsInStep(reduce_fx=torch.argmax))


def test_a_value_kept_neither_per_step_nor_per_epoch_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"^`self.log\(on_step=False, on_epoch=False\)` is not useful"):
        _fit(_LogsInStep(on_step=False, on_epoch=False))


def test_a_hook_that_logs_epoch_values_only_names_what_it_allows_before_anything_else() -> None:
    class LogsAtStart(Regressor):
        def on_train_start(self) -> None:
            self.log("x", 1.0, on_epoch=False)

    refusal = r"^You can't `self.log\(on_epoch=False\)` inside `on_train_start`, must be one of \(True,\)"
    with pytest.raises(MisconfigurationException, match=refusal):
        quiet_trainer(max_steps=1, logger=False).fit(LogsAtStart(), make_loader(8))


def test_logging_in_prediction_is_refused_with_lightnings_words() -> None:
    class LogsInPredict(Regressor):
        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("x", 1.0)
            return self(batch[0])

    with pytest.raises(MisconfigurationException, match=r"^You are trying to `self.log\(\)` but the loop's result"):
        quiet_trainer(logger=False).predict(LogsInPredict(), make_loader(8))


def test_a_name_holding_a_loader_index_is_refused_unless_the_index_is_left_to_the_caller() -> None:
    class Named(Regressor):
        def __init__(self, **options: Any) -> None:
            super().__init__()
            self.options = options

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("x/dataloader_idx_0", 1.0, **self.options)
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match="with the key `x/dataloader_idx_0`"):
        _fit(Named())
    assert _fit(Named(add_dataloader_idx=False)).callback_metrics["x/dataloader_idx_0"] == 1.0


def test_a_name_logged_in_two_hooks_of_a_batch_with_other_options_takes_the_latest() -> None:
    class TwoHooks(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("x", 1.0)
            return super().training_step(batch, batch_idx)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.log("x", 2.0, prog_bar=True)

    trainer = _fit(TwoHooks())
    assert trainer.callback_metrics["x"] == 2.0 and trainer.progress_bar_metrics["x"] == 2.0


def test_a_name_logged_again_in_the_same_hook_keeps_its_options() -> None:
    class Twice(Regressor):
        def __init__(self, **again: Any) -> None:
            super().__init__()
            self.again = again

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("x", 1.0)
            self.log("x", 2.0, **self.again)
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match=r"self.log\(x, ...\)` twice in `training_step` with differ"):
        _fit(Twice(prog_bar=True))
    # The same options once the defaults are applied: no other arguments.
    trainer = _fit(Twice(on_step=True, on_epoch=False, logger=True, reduce_fx=torch.mean))
    assert trainer.callback_metrics["x"] == 2.0


def test_a_logged_metric_must_be_an_attribute_of_the_module() -> None:
    def accuracy() -> torchmetrics.Metric:
        return torchmetrics.classification.BinaryAccuracy()

    class Unattached(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            metric = accuracy()
            metric(torch.tensor([0.9]), torch.tensor([1]))
            self.log("acc", metric)
            return super().training_step(batch, batch_idx)

    with pytest.raises(MisconfigurationException, match="fix this by setting an attribute for the metric in your"):
        _fit(Unattached())

    class OtherAttached(Unattached):
        def __init__(self) -> None:
            super().__init__()
            self.kept = accuracy()

    with pytest.raises(MisconfigurationException, match=r"metric_attribute=name\)` where `name` is one of \['kept'\]"):
        _fit(OtherAttached())

    class Attached(OtherAttached):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.kept(torch.tensor([0.9]), torch.tensor([1]))
            self.log("acc", self.kept)
            return Regressor.training_step(self, batch, batch_idx)

    assert _fit(Attached()).callback_metrics["acc"] == 1.0


def test_logging_without_a_trainer_warns_and_logging_to_no_logger_warns() -> None:
    with pytest.warns(UserWarning, match="`self.trainer` reference is not registered"):
        Regressor().log("x", 1.0)
    with pytest.warns(UserWarning, match=r"log\('x', ..., logger=True\)` but have no logger"):
        _fit(_LogsInStep(logger=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "You defined a `validation_step` but have no `val_dataloader`")
        _fit(_LogsInStep())  # logger left out: nothing to say


@pytest.mark.parametrize("hook", ["on_train_start", "on_train_epoch_start", "on_validation_start"])
def test_the_hooks_that_start_a_stage_or_an_epoch_log_epoch_values_only(hook: str) -> None:
    class Logs(Callback):
        pass

    def log(self: Any, trainer: Any, module: Any) -> None:
        module.log("x", 1.0, on_step=True)

    setattr(Logs, hook, log)
    with pytest.raises(MisconfigurationException, match=rf"self.log\(on_step=True\)` inside `{hook}`, must be one of"):
        quiet_trainer(max_epochs=1, logger=False, callbacks=[Logs()]).fit(Regressor(), make_loader(16), make_loader(8))


# ------------------------------------------------------------------------- what reaches the loggers, and when
class _Calls(Logger):
    """Keeps each ``log_metrics`` call; takes its arguments by keyword only, as Lightning passes them."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int | None]] = []

    def log_metrics(self, *, metrics: Mapping[str, float], step: int | None = None) -> None:  # type: ignore[override]
        self.calls.append((dict(metrics), step))


class _StepAndEpoch(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("t", float(batch_idx), on_step=True, on_epoch=True)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("v", float(batch_idx), on_step=True, on_epoch=True)


def test_values_are_labelled_and_handed_to_loggers_as_lightning_does() -> None:
    calls = _Calls()
    trainer = quiet_trainer(max_epochs=2, logger=calls, log_every_n_steps=1, enable_checkpointing=False)
    model = _StepAndEpoch()
    trainer.fit(model, make_loader(16), make_loader(16))  # 2 training and 2 validation batches an epoch
    # A training step's values carry the index of its step (0 for the first), the epoch's values its last step's;
    # a validation step's the batch's index among the stage's validation batches, without an epoch.
    step = ["epoch", "t_step", "train_loss"]
    assert [(sorted(metrics), step) for metrics, step in calls.calls] == [
        (step, 0), (step, 1), (["v_step"], 0), (["v_step"], 1), (["epoch", "v_epoch"], 1), (["epoch", "t_epoch"], 1),
        (step, 2), (step, 3), (["v_step"], 2), (["v_step"], 3), (["epoch", "v_epoch"], 3), (["epoch", "t_epoch"], 3),
    ]  # fmt: skip
    assert [metrics["epoch"] for metrics, _ in calls.calls if "epoch" in metrics] == [0, 0, 0, 0, 1, 1, 1, 1]

    calls.calls.clear()
    trainer.validate(model, make_loader(16), verbose=False)
    # outside fit, values carry the steps taken
    assert calls.calls == [({"v_step": 0.0}, 0), ({"v_step": 1.0}, 1), ({"v_epoch": 0.5, "epoch": 2}, 4)]


def test_a_logger_whose_finalize_leaves_out_save_is_saved_at_each_stages_end() -> None:
    # Lightning's template for a logger of one's own overrides finalize without calling super(): what save()
    # writes out must still be written, once the stage's last values are handed over.
    class Buffering(_Calls):
        def __init__(self) -> None:
            super().__init__()
            self.saved: list[int] = []

        def save(self) -> None:
            self.saved.append(len(self.calls))

        def finalize(self, status: str) -> None:
            pass

    logger = Buffering()
    trainer = quiet_trainer(max_epochs=1, logger=logger, log_every_n_steps=1, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader(16))
    trainer.validate(trainer.lightning_module, make_loader(8), verbose=False)
    assert logger.saved and logger.saved[-1] == len(logger.calls) and len(logger.saved) >= 2


def test_a_teardown_that_raises_fails_the_stage_for_the_callbacks_and_loggers() -> None:
    class Finalized(_Calls):
        status: list[str] = []

        def finalize(self, status: str) -> None:
            self.status.append(status)

    class Seen(Callback):
        exceptions: list[BaseException] = []

        def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
            self.exceptions.append(exception)

    class Failing(Regressor):
        def teardown(self, stage: str) -> None:
            raise RuntimeError("teardown failed")

    trainer = quiet_trainer(max_epochs=1, logger=Finalized(), callbacks=[Seen()], enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="teardown failed"):
        trainer.fit(Failing(), make_loader(16))
    assert Finalized.status == ["failed"] and [str(error) for error in Seen.exceptions] == ["teardown failed"]
    assert trainer.state.status == "interrupted"


def test_log_every_n_steps_0_writes_the_epochs_values_only() -> None:
    calls = _Calls()
    callbacks = [DeviceStatsMonitor(), ThroughputMonitor(flops_per_sample=None)]  # they log at logging steps
    trainer = quiet_trainer(max_epochs=2, logger=calls, log_every_n_steps=0, enable_checkpointing=False,
                            callbacks=callbacks)  # fmt: skip
    assert trainer.log_every_n_steps == 0
    trainer.fit(_StepAndEpoch(), make_loader(16), make_loader(16))
    # No training step's values (an evaluation step's are written whatever the flag, as in Lightning).
    epoch = [["v_step"], ["v_step"], ["epoch", "v_epoch"], ["epoch", "t_epoch"]]
    assert [sorted(metrics) for metrics, _ in calls.calls] == epoch * 2


def test_lightnings_throughput_monitor_logs_each_stages_counts_then_rates_at_its_logging_steps() -> None:
    calls = _Calls()
    monitor = StageThroughputMonitor(
        lambda batch: len(batch[0]), length_fn=lambda batch: 3 * len(batch[0]), window_size=3
    )
    trainer = quiet_trainer(max_steps=4, logger=calls, log_every_n_steps=2, val_check_interval=2, limit_val_batches=2,
                            enable_checkpointing=False, callbacks=[monitor])  # fmt: skip
    model = Regressor()
    with pytest.warns(UserWarning, match="define a `flops_per_batch` attribute or property in Regressor"):
        trainer.fit(model, make_loader(64), make_loader(16))  # batches of 8
    counts = ["batches", "lengths", "samples", "time"]
    rates = ["device/batches_per_sec", "device/items_per_sec", "device/samples_per_sec"]
    train, validate = sorted(["epoch", *(f"train/{name}" for name in counts)]), [f"validate/{n}" for n in counts]
    # training at every 2nd optimizer step (labelled as self.log's values), validation at its 2nd batch (labelled
    # by the fit's validation batches so far); the rates once 3 batches are seen
    logged = [(sorted(metrics), step) for metrics, step in calls.calls if any("/" in name for name in metrics)]
    assert logged == [
        (train, 1), (validate, 2), (sorted(train + [f"train/{n}" for n in rates]), 3),
        (validate, 4),
    ]  # fmt: skip
    assert [metrics["train/samples"] for metrics, _ in calls.calls if "train/samples" in metrics] == [16, 32]
    assert [metrics["validate/lengths"] for metrics, _ in calls.calls if "validate/lengths" in metrics] == [48, 48]
    model.flops_per_batch = 100
    calls.calls.clear()
    trainer.test(model, make_loader(32), verbose=False)  # 4 batches: the rates from the 3rd, FLOPs among them
    assert [sorted(metrics) for metrics, _ in calls.calls if "test/time" in metrics][-1] == sorted(
        [f"test/{n}" for n in counts] + [f"test/{n}" for n in rates] + ["test/device/flops_per_sec"]
    )
    trainer.test(model, make_loader(32), verbose=False)  # run again, its counts and steps go on, as Lightning's
    tested = [(m["test/batches"], m["test/samples"], step) for m, step in calls.calls if "test/batches" in m]
    assert tested == [(2, 16, 2), (4, 32, 4), (6, 48, 6), (8, 64, 8)]
    assert table_of("pytorch_lightning.callbacks")["ThroughputMonitor"] == "ember.callbacks:StageThroughputMonitor"
    with pytest.raises(ValueError, match=r"ThroughputMonitor\(window_size=1\): expected an int >= 2"):
        StageThroughputMonitor(len, window_size=1)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"batch_size_fn": lambda batch: 0}, r"Expected samples \(0\) to be greater or equal than batches \(1\)"),
        (
            {"batch_size_fn": lambda batch: 3, "length_fn": lambda batch: 2},
            r"Expected lengths \(2\) to be greater or equal than samples \(3\).*length_fn",
        ),
    ],
)
def test_lightnings_throughput_monitor_refuses_fewer_samples_than_batches_or_items_than_samples(
    sizes: dict[str, Any], message: str
) -> None:
    # Lightning's check: a batch holds at least one sample, a sample at least one item (by the running totals).
    monitor = StageThroughputMonitor(**sizes, window_size=2)
    trainer = quiet_trainer(max_steps=1, logger=False, enable_checkpointing=False, callbacks=[monitor])
    with warnings.catch_warnings(), pytest.raises(ValueError, match=message):
        warnings.simplefilter("ignore")  # no flops_per_batch: not what this is about
        trainer.fit(Regressor(), make_loader(16))


def test_logged_metrics_hold_the_step_and_the_epoch_values_whether_or_not_a_logger_wrote_them() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, log_every_n_steps=50, enable_checkpointing=False)
    trainer.fit(_StepAndEpoch(), make_loader(16), make_loader(16))
    logged = trainer.logged_metrics
    assert {"t_step", "t_epoch", "v_step", "v_epoch"} <= set(logged)
    assert logged["t_step"] == 1.0 and logged["v_step"] == 1.0 and logged["v_epoch"] == 0.5
    assert all(isinstance(value, torch.Tensor) for value in logged.values())


def test_an_epoch_mean_warns_as_lightning_when_the_batch_s_tensors_disagree_on_its_size() -> None:
    class WithIds(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("i", float(batch_idx), on_step=False, on_epoch=True)
            return super().training_step(batch[:2], batch_idx)

    # Each batch of 8 samples carries 3 ids: the mean is weighted by the first tensor's size, with Lightning's warning.
    loader = DataLoader(
        make_data(16), batch_size=8, collate_fn=lambda samples: [*default_collate(samples), torch.ones(3)]
    )
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="ambiguous collection. The batch size we found is 8. To avoid any"):
        trainer.fit(WithIds(), loader)
    assert trainer.callback_metrics["i"] == 0.5


def test_an_epoch_logged_by_the_module_is_kept() -> None:
    class LogsEpoch(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("epoch", -float(batch_idx))
            return super().training_step(batch, batch_idx)

    calls = _Calls()
    trainer = quiet_trainer(max_epochs=1, logger=calls, log_every_n_steps=1, enable_checkpointing=False)
    trainer.fit(LogsEpoch(), make_loader(16))
    assert [metrics["epoch"] for metrics, _ in calls.calls if "train_loss" in metrics] == [0.0, -1.0]
    assert trainer.logged_metrics["epoch"] == -1.0


# ---------------------------------------------------------------------------------------------- the loggers
def _csv_rows(path: str) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_the_csv_logger_has_lightnings_writer_and_optional_arguments(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path), name=None, prefix="train")
    assert os.path.normpath(logger.root_dir) == str(tmp_path)
    logger.log_hyperparams()  # nothing to write but the file
    logger.log_hyperparams({"lr": 0.1})
    logger.log_hyperparams({"layers": 2})  # added to what was logged
    writer = logger.experiment
    assert isinstance(writer, ExperimentWriter) and writer.log_dir == str(tmp_path / "version_0")
    with open(os.path.join(writer.log_dir, ExperimentWriter.NAME_HPARAMS_FILE)) as file:
        assert yaml.safe_load(file) == {"lr": 0.1, "layers": 2}
    logger.log_metrics({"loss": torch.tensor(0.5), "count": 3})  # no step: numbered by the rows not yet written
    assert writer.metrics == [{"step": 0, "train-loss": 0.5, "train-count": 3}]
    logger.save()
    assert writer.metrics == []
    assert _csv_rows(writer.metrics_file_path) == [{"step": "0", "train-loss": "0.5", "train-count": "3"}]
    assert os.path.basename(writer.metrics_file_path) == ExperimentWriter.NAME_METRICS_FILE


def test_the_csv_logger_writes_every_n_steps(tmp_path: Any) -> None:
    saves: list[int] = []

    class Recording(CSVLogger):
        def save(self) -> None:
            saves.append(self.experiment.metrics[-1]["step"])
            super().save()

    logger = Recording(str(tmp_path), flush_logs_every_n_steps=3)
    for step in range(7):
        logger.log_metrics({"loss": 1.0}, step=step)
    assert saves == [2, 5]  # when the next step is a multiple of 3
    logger = CSVLogger(str(tmp_path), flush_logs_every_n_steps=3)
    for step in (1, 3, 5, 7, 9):  # steps that skip the multiples still write every 3 or so
        logger.log_metrics({"loss": 1.0}, step=step)
        assert len(logger.experiment.metrics) <= 2


def test_an_earlier_runs_metrics_are_replaced_with_a_warning_unless_the_run_continues(tmp_path: Any) -> None:
    version_dir = tmp_path / "ember_logs" / "version_0"
    version_dir.mkdir(parents=True)
    (version_dir / "metrics.csv").write_text("step,old\n0,1\n")
    logger = CSVLogger(str(tmp_path), version=0)
    with pytest.warns(UserWarning, match="Experiment logs directory .* exists and is not empty"):
        _ = logger.experiment
    assert not (version_dir / "metrics.csv").exists()

    # a fit that continues its checkpoint appends to the file its run left
    flags = {"default_root_dir": str(tmp_path / "run"), "log_every_n_steps": 1}
    trainer = quiet_trainer(max_epochs=1, **flags)
    trainer.fit(Regressor(), make_loader(16))
    log_dir, first = trainer.log_dir, _csv_rows(os.path.join(str(trainer.log_dir), "metrics.csv"))
    trainer = quiet_trainer(max_epochs=2, **flags)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "You defined a `validation_step` but have no `val_dataloader`")
        trainer.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert trainer.log_dir == log_dir
    rows = _csv_rows(os.path.join(log_dir, "metrics.csv"))
    assert rows[: len(first)] == first and {row["epoch"] for row in rows} == {"0", "1"}


def test_the_tensorboard_logger_logs_lightnings_placeholder_metric_with_the_hyperparameters(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    calls: list[tuple[dict[str, float], int | None]] = []

    class Recording(TensorBoardLogger):
        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            calls.append((dict(metrics), step))

    Recording(str(tmp_path)).log_hyperparams({"lr": 0.1})
    Recording(str(tmp_path), default_hp_metric=False).log_hyperparams({"lr": 0.1})
    Recording(str(tmp_path)).log_hyperparams({"lr": 0.1}, {"accuracy": 0.5}, step=3)
    assert calls == [({"hp_metric": -1}, None), ({"accuracy": 0.5}, 3)]
    assert TensorBoardLogger.NAME_HPARAMS_FILE == "hparams.yaml"


# ------------------------------------------------------------------------------------- callbacks, loaders, bar
def test_a_callback_logs_with_self_log_in_the_hooks_where_the_module_may() -> None:
    class Logs(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.log("per_step", float(batch_idx))

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.log_dict({"a": 1.0, "b": 2.0})

        def on_fit_end(self, trainer: Any, module: Any) -> None:
            with pytest.raises(MisconfigurationException, match="inside `on_fit_end`"):
                self.log("refused", 1.0)

    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, callbacks=[Logs()])
    trainer.fit(Regressor(), make_loader(32))
    metrics = trainer.callback_metrics
    assert metrics["per_step"] == 3.0 and metrics["a"] == 1.0 and metrics["b"] == 2.0 and "refused" not in metrics
    with pytest.raises(AttributeError, match="log"):  # as in Lightning: the module's, given when a stage starts
        Logs().log("x", 1.0)


def test_each_loaders_results_hold_what_its_steps_logged_without_the_loader_index() -> None:
    class Named(Regressor):
        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("shared", 1.0)  # gets each loader's suffix
            self.log(f"own_{dataloader_idx}", float(dataloader_idx), add_dataloader_idx=False)

        def on_test_epoch_end(self) -> None:
            self.log("all", 5.0)

    results = quiet_trainer(logger=False).test(Named(), [make_loader(16), make_loader(16)], verbose=False)
    assert results == [
        {"shared/dataloader_idx_0": 1.0, "own_0": 0.0, "all": 5.0},
        {"shared/dataloader_idx_1": 1.0, "own_1": 1.0, "all": 5.0},
    ]


def test_a_name_without_the_loader_index_is_refused_where_a_second_loader_logs_it_too() -> None:
    class Mixed(Regressor):
        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("acc", 1.0, add_dataloader_idx=False)

        def on_test_epoch_end(self) -> None:
            self.log("acc", 2.0, add_dataloader_idx=False)  # outside the loaders' steps: its own value

    assert quiet_trainer(logger=False).test(Mixed(), make_loader(8), verbose=False) == [{"acc": 2.0}]
    with pytest.raises(MisconfigurationException, match="add_dataloader_idx=False, each loader's values need a name"):
        quiet_trainer(logger=False).test(Mixed(), [make_loader(8), make_loader(8)], verbose=False)


def test_an_evaluations_epoch_end_hooks_read_its_values_and_the_sanity_checks_are_forgotten_after_it() -> None:
    seen: list[tuple[str, list[str]]] = []

    class Reads(Callback):
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            seen.append(("validation_end", sorted(trainer.callback_metrics)))

        def on_sanity_check_end(self, trainer: Any, module: Any) -> None:
            seen.append(("sanity_check_end", sorted(trainer.callback_metrics)))

        def on_train_start(self, trainer: Any, module: Any) -> None:
            seen.append(("train_start", sorted(trainer.callback_metrics)))

    class Model(Regressor):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("val_loss", 1.0, on_step=True, prog_bar=True)

        def on_validation_epoch_end(self) -> None:
            seen.append(("epoch_end", sorted(self.trainer.callback_metrics)))
            assert self.trainer.progress_bar_metrics["val_loss_epoch"] == 1.0
            self.log("late", 2.0)

    trainer = quiet_trainer(
        max_epochs=1, limit_train_batches=1, num_sanity_val_steps=1, logger=False, callbacks=[Reads()]
    )
    trainer.fit(Model(), make_loader(8), make_loader(8))
    epoch_values = ["val_loss", "val_loss_epoch"]
    assert seen == [
        ("epoch_end", epoch_values),
        ("validation_end", ["late", *epoch_values]),
        ("sanity_check_end", ["late", *epoch_values]),
        ("train_start", []),
        ("epoch_end", ["train_loss", *epoch_values]),
        ("validation_end", ["late", "train_loss", *epoch_values]),
    ]


def test_an_evaluation_returns_the_values_meant_for_the_loggers_only() -> None:
    class Hides(Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("kept", 1.0)
            self.log("for_the_bar", 2.0, prog_bar=True, logger=False)

    trainer = quiet_trainer(logger=False)
    assert trainer.validate(Hides(), make_loader(8), verbose=False) == [{"kept": 1.0}]
    assert set(trainer.callback_metrics) == {"kept", "for_the_bar"}  # callbacks still see it


def test_an_evaluation_step_value_for_the_bar_is_a_progress_bar_metric() -> None:
    class Shows(Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("shown", float(batch_idx), on_step=True, on_epoch=False, prog_bar=True)

    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(Shows(), make_loader(16), make_loader(16))
    assert trainer.progress_bar_metrics["shown"] == 1.0 and "shown" not in trainer.callback_metrics


def test_an_object_that_logs_like_a_logger_is_taken_as_one(tmp_path: Any) -> None:
    class Duck:  # no Logger subclass: Lightning takes any object with the logger's methods
        name, version, save_dir = "duck", "run", str(tmp_path)

        def __init__(self) -> None:
            self.metrics: list[tuple[dict[str, float], int | None]] = []
            self.params: dict[str, Any] = {}
            self.status = ""

        def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
            self.metrics.append((dict(metrics), step))

        def log_hyperparams(self, params: Mapping[str, Any]) -> None:
            self.params.update(params)

        def finalize(self, status: str) -> None:
            self.status = status

    duck = Duck()
    trainer = quiet_trainer(max_epochs=1, logger=duck, log_every_n_steps=1)
    trainer.fit(Regressor(lr=0.02), make_loader(16))
    assert trainer.logger is duck and duck.params["lr"] == 0.02 and duck.status == "success"
    assert [step for metrics, step in duck.metrics if "train_loss" in metrics] == [0, 1]
    # its checkpoints go where Lightning puts them: <save_dir>/<name>/<version>/checkpoints
    assert os.listdir(tmp_path / "duck" / "run" / "checkpoints") == ["epoch=0-step=2.ckpt"]
    with pytest.raises(ValueError, match="logger=3: expected True, False, a Logger or a list of them"):
        ember.Trainer(logger=3)
    del Duck.finalize  # an object the Trainer could not close is refused when the Trainer is made, not at the end
    with pytest.raises(ValueError, match="expected True, False, a Logger or a list of them"):
        ember.Trainer(logger=[Duck()])


# ----------------------------------------------------------------- informational messages, through logging
def test_informational_messages_are_logged_by_ember_and_shown_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("ember").addHandler(handler)
    try:
        trainer = quiet_trainer(max_epochs=1, logger=False, enable_model_summary=True, fast_dev_run=True)
        trainer.fit(Regressor(), make_loader(16))
    finally:
        logging.getLogger("ember").removeHandler(handler)
    shown = capsys.readouterr().out
    assert "fast_dev_run: running 1 batch(es) of each loop" in shown and "Total params" in shown
    assert [record.levelno for record in records] == [logging.INFO] * 3
    assert records[0].getMessage().startswith("fast_dev_run") and "Total params" in records[1].getMessage()
    assert records[2].getMessage() == "`Trainer.fit` stopped: `max_steps=1` reached."  # as Lightning says it


def test_the_ember_loggers_level_silences_informational_messages(capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger("ember").setLevel(logging.WARNING)
    try:
        trainer = quiet_trainer(max_epochs=1, logger=False, enable_model_summary=True, fast_dev_run=True)
        trainer.fit(Regressor(), make_loader(16))
    finally:
        logging.getLogger("ember").setLevel(logging.INFO)
    assert trainer.global_step == 1 and capsys.readouterr().out == ""


def test_a_limit_of_one_batch_or_of_all_given_explicitly_is_said_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ember"):
        quiet_trainer(limit_train_batches=1, limit_val_batches=1.0, val_check_interval=1, overfit_batches=0.5)
    assert caplog.messages == [
        "`Trainer(limit_train_batches=1)` was configured so 1 batch per epoch will be used.",
        "`Trainer(val_check_interval=1)` was configured so validation will run after every batch.",
        "`Trainer(limit_val_batches=1.0)` was configured so 100% of the batches will be used.",
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ember"):
        quiet_trainer(barebones=True)  # and nothing for the default limits
    assert [message.split(":")[0] for message in caplog.messages] == ["running in `Trainer(barebones=True)` mode"]


def test_evaluation_results_print_as_a_table_with_a_column_per_loader(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")

    class PerLoader(Regressor):
        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("loss", float(dataloader_idx) + 0.5)
            self.log(f"only_{dataloader_idx}", 1.0)

    quiet_trainer(logger=False).test(PerLoader(), [make_loader(8), make_loader(8)])
    rule = "─" * 80
    assert capsys.readouterr().out.splitlines() == [
        rule,
        "       Test metric             DataLoader 0             DataLoader 1",
        rule,
        "          loss                      0.5                      1.5",
        "         only_0                     1.0",
        "         only_1                                              1.0",
        rule,
    ]
    quiet_trainer(logger=False).validate(Regressor(), make_loader(8), verbose=False)
    assert capsys.readouterr().out == ""


def test_an_integer_tensor_is_read_as_float32_with_a_warning() -> None:
    class LogsCounts(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("count", torch.tensor(batch_idx), on_step=True, on_epoch=True)
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(max_epochs=1, logger=False)
    with pytest.warns(UserWarning, match=r"`self.log\('count', ...\)` in your `training_step` but the value needs to"):
        trainer.fit(LogsCounts(), make_loader(16))
    for name in ("count_step", "count_epoch"):
        assert trainer.callback_metrics[name].dtype == torch.float32
    assert float(trainer.callback_metrics["count_step"]) == 1.0


class _Recording(Logger):
    """A logger written as Lightning users write theirs: it records what the Trainer hands it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        self.calls.append(("metrics", dict(metrics), step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("hparams", dict(params)))

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.calls.append(("saved", checkpoint_callback.last_model_path or checkpoint_callback.best_model_path))


def test_loggers_are_told_of_each_checkpoint_file_saved(tmp_path: Any) -> None:
    loggers = [_Recording(), _Recording()]
    trainer = quiet_trainer(max_epochs=2, logger=loggers, default_root_dir=str(tmp_path))
    trainer.fit(Regressor(), make_loader(16))
    for logger in loggers:
        saved = [call[1] for call in logger.calls if call[0] == "saved"]
        assert [os.path.basename(path) for path in saved] == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]


def test_a_value_logged_as_step_labels_the_others(tmp_path: Any) -> None:
    class StepLogging(Regressor):
        def on_train_epoch_end(self) -> None:
            self.log_dict({"step": float(10 * self.current_epoch + 7), "accuracy": 0.5})

    logger = _Recording()
    trainer = quiet_trainer(max_epochs=2, logger=logger, log_every_n_steps=100, enable_checkpointing=False)
    trainer.fit(StepLogging(), make_loader(16))
    written = [(metrics, step) for kind, *rest in logger.calls if kind == "metrics" for metrics, step in [rest]]
    assert written == [({"accuracy": 0.5}, 7), ({"accuracy": 0.5}, 17)]  # no "epoch" added, as in Lightning
    assert "step" not in trainer.logged_metrics


def test_the_loggers_can_be_replaced_after_the_trainer_is_made(tmp_path: Any) -> None:
    trainer = quiet_trainer(max_steps=2, logger=False, enable_checkpointing=False)
    assert (trainer.logger, trainer.loggers) == (None, [])
    first, second = _Recording(), _Recording()
    trainer.logger = first
    assert trainer.loggers == [first]
    trainer.loggers = [first, second]
    assert trainer.logger is first
    trainer.fit(Regressor(), make_loader(16))
    assert any(call[0] == "hparams" for call in second.calls)  # the stage wrote to the loggers set last
    trainer.logger = None
    assert trainer.loggers == []
    trainer.loggers = None
    assert (trainer.logger, trainer.loggers) == (None, [])


def test_evaluation_stages_give_the_loggers_the_hyperparameters(tmp_path: Any) -> None:
    logger = _Recording()
    trainer = quiet_trainer(logger=logger)
    trainer.test(Regressor(lr=0.2), make_loader(16), verbose=False)
    assert ("hparams", {"lr": 0.2, "features": 4}) in logger.calls


def test_the_dummy_logger_takes_any_call() -> None:
    logger = DummyLogger()
    logger.log_metrics("1", 2, three="three")
    logger.log_hyperparams("1", 2, three="three")
    assert logger.log_text("a", b=1) is None  # another logger's method, as code written for it calls
    assert logger[0] is logger
    logger.experiment["key"] = "value"
    assert logger.experiment["key"] is not None
    assert logger.version == ""
    with pytest.raises(AttributeError):
        logger.__deepcopy__  # noqa: B018  # copy and pickle find no such method
    experiment = logger.experiment
    assert isinstance(experiment, DummyExperiment) and experiment.add_image("a", None) is None
    assert experiment["run"] is experiment and copy.deepcopy(experiment) is not None


def test_an_experiment_is_a_dummy_one_on_other_ranks_than_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    class Experimenting(_Recording):
        @property
        @rank_zero_experiment
        def experiment(self) -> str:
            return "the run"

    assert Experimenting().experiment == "the run"
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert isinstance(Experimenting().experiment, DummyExperiment)


def test_tensorboard_expands_home_and_environment_variables_in_its_directories(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("EMBER_TEST_RUNS", str(tmp_path))
    logger = TensorBoardLogger("$EMBER_TEST_RUNS/logs", name="n", version="v", sub_dir="$EMBER_TEST_RUNS_SUB")
    monkeypatch.setenv("EMBER_TEST_RUNS_SUB", "sub")
    assert logger.log_dir == os.path.join(str(tmp_path), "logs", "n", "v", "sub")
    home = TensorBoardLogger("~/runs", name="n", version="v")
    assert home.log_dir == os.path.join(os.path.expanduser("~"), "runs", "n", "v")
    logger.log_metrics({"a": 1.0}, step=0)
    logger.finalize("success")
    assert os.listdir(os.path.join(str(tmp_path), "logs", "n", "v", "sub"))


def test_a_tensorboard_logger_that_has_written_can_be_pickled(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    import pickle

    logger = TensorBoardLogger(str(tmp_path))
    logger.log_metrics({"a": 1.0}, step=0)
    logger.save()
    copy = pickle.loads(pickle.dumps(logger))
    copy.log_metrics({"a": 2.0}, step=1)
    copy.finalize("success")
    assert copy.log_dir == logger.log_dir
    logger.finalize("success")


def test_tensorboard_traces_the_graph_of_a_module_no_trainer_holds(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(str(tmp_path), log_graph=True)
    model = Regressor()
    logger.log_graph(model, torch.zeros(2, 4))
    logger.finalize("success")
    with pytest.raises(RuntimeError, match="not attached"):
        model.trainer  # noqa: B018  # outside the trace, it is refused as before
    with pytest.warns(UserWarning, match="`model.example_input_array` attribute is not set"):
        logger.log_graph(model)
    model.example_input_array = {"x": torch.zeros(2, 4)}  # type: ignore[assignment]
    with pytest.warns(UserWarning, match="can't be traced by TensorBoard"):
        logger.log_graph(model)


def test_a_logger_of_one_s_own_places_checkpoints_as_lightning_does(tmp_path: Any) -> None:
    class Named(_Recording):
        def __init__(self, save_dir: str | None, version: int | str) -> None:
            super().__init__()
            self._save_dir, self._version = save_dir, version

        @property
        def name(self) -> str:
            return "mine"

        @property
        def version(self) -> int | str:
            return self._version

        @property
        def save_dir(self) -> str | None:
            return self._save_dir

    root, elsewhere = str(tmp_path / "root"), str(tmp_path / "elsewhere")
    for logger, run_dir, log_dir in [
        (Named(None, 3), os.path.join(root, "mine", "version_3"), None),
        (Named(elsewhere, "run-a"), os.path.join(elsewhere, "mine", "run-a"), elsewhere),
    ]:
        trainer = quiet_trainer(max_steps=1, logger=logger, default_root_dir=root)
        trainer.fit(Regressor(), make_loader(8))
        assert trainer.checkpoint_callback is not None
        assert trainer.checkpoint_callback.dirpath == os.path.join(run_dir, "checkpoints")
        assert os.listdir(trainer.checkpoint_callback.dirpath) == ["epoch=0-step=1.ckpt"]
        assert trainer.log_dir == log_dir  # a logger other than CSV and TensorBoard: its save_dir, as Lightning's


def test_a_prefix_is_joined_with_the_logger_s_join_char(tmp_path: Any) -> None:
    class Slashed(CSVLogger):
        LOGGER_JOIN_CHAR = "/"

    logger = Slashed(str(tmp_path), prefix="train")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    with open(os.path.join(logger.log_dir, "metrics.csv")) as file:
        assert file.readline().strip() == "step,train/loss"
    assert CSVLogger(str(tmp_path)).LOGGER_JOIN_CHAR == "-"
    assert (_Recording().root_dir, _Recording().group_separator) == (None, "/")  # the base class's, as Lightning's


def test_hyperparameters_named_by_numbers_and_held_in_tensors_reach_tensorboard(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")

    class Keeping(Regressor):
        def __init__(self, extra: dict[Any, Any]) -> None:
            super().__init__()
            self.save_hyperparameters(extra)

    class Data(ember.DataModule):
        def __init__(self, extra: dict[Any, Any]) -> None:
            super().__init__()
            self.save_hyperparameters(extra)

        def train_dataloader(self) -> Any:
            return make_loader(8)

    shared = {1: 1, "scale": torch.tensor(4)}
    trainer = quiet_trainer(max_steps=1, logger=TensorBoardLogger(str(tmp_path)), enable_checkpointing=False)
    trainer.fit(Keeping(shared), datamodule=Data(shared))  # a 0-dimensional tensor is written as its number
    with pytest.raises(RuntimeError, match=r"Error while merging hparams: the keys \[1, 'scale'\] are present in both"):
        trainer.fit(Keeping(shared), datamodule=Data({1: 0, "scale": torch.tensor(3)}))


def test_tensorboard_draws_a_dict_of_values_in_one_chart_and_refuses_text(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(str(tmp_path))
    logger.log_metrics({"loss": {"train": 1.0, "val": 2.0}, "lr": torch.tensor(0.1)}, step=1)
    logger.finalize("success")
    assert {"loss_train", "loss_val"} <= set(os.listdir(logger.log_dir))  # add_scalars' writers, one per line
    with pytest.raises(ValueError, match=r"log_metrics: note='text' cannot be logged; give a number, a tensor"):
        logger.log_metrics({"note": "text"}, step=2)
