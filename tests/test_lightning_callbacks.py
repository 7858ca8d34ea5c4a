"""The callbacks and the learning-rate finder as Lightning's users know them: public attributes, errors and
the behaviour Lightning's own callbacks have."""

from __future__ import annotations

import functools
import inspect
import io
import logging
import math
from datetime import timedelta
from typing import Any
from unittest.mock import Mock

import pytest
import torch
import torchmetrics
from conftest import Regressor, make_loader, quiet_trainer
from torch import nn

import ember
from ember.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    BasePredictionWriter,
    Callback,
    DeviceStatsMonitor,
    EarlyStopping,
    EarlyStoppingReason,
    LambdaCallback,
    LearningRateMonitor,
    ModelSummary,
    OnExceptionCheckpoint,
    ProgressBar,
    RichProgressBar,
    ThroughputMonitor,
    Timer,
    TQDMProgressBar,
)
from ember.callbacks.progress_base import standard_metrics
from ember.exceptions import MisconfigurationException
from ember.trainer_parts import with_module_callbacks
from ember.tuner import BatchSizeFinder, LearningRateFinder, Tuner


# --------------------------------------------------------------------------- LearningRateMonitor
class _Optimizers(Regressor):
    """Adam without a scheduler, then SGD (momentum 0.9, weight decay 0.01) with one halving it each epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for optimizer in self.optimizers():
            optimizer.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            optimizer.step()

    def on_train_epoch_end(self) -> None:
        self.lr_schedulers().step()  # under manual optimization the module steps its schedulers

    def configure_optimizers(self) -> Any:
        adam = torch.optim.Adam(self.head.parameters(), lr=0.5)
        sgd = torch.optim.SGD(self.layer.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        return [adam, sgd], [torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)]


def test_lr_monitor_keeps_what_it_logged() -> None:
    monitor = LearningRateMonitor(log_momentum=True, log_weight_decay=True)
    trainer = quiet_trainer(max_epochs=3, limit_val_batches=0, callbacks=[monitor])
    trainer.fit(_Optimizers(), make_loader())
    assert list(monitor.lrs) == ["lr-SGD", "lr-Adam"]  # the scheduled optimizers are named first
    assert monitor.lrs == {"lr-SGD": [0.1, 0.05, 0.025], "lr-Adam": [0.5, 0.5, 0.5]}
    assert monitor.last_momentum_values == {"lr-SGD-momentum": 0.9, "lr-Adam-momentum": 0.9}  # Adam's betas[0]
    assert monitor.last_weight_decay_values == {"lr-SGD-weight_decay": 0.01, "lr-Adam-weight_decay": 0.0}
    assert LearningRateMonitor().last_momentum_values == {}


def test_lr_monitor_logs_zero_momentum_for_an_optimizer_without() -> None:
    class Plain(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adagrad(self.parameters(), lr=0.1)

    monitor = LearningRateMonitor(log_momentum=True)
    trainer = quiet_trainer(max_epochs=1, limit_val_batches=0, callbacks=[monitor])
    with pytest.warns(RuntimeWarning, match="optimizers do not have momentum"):
        trainer.fit(Plain(), make_loader())
    assert monitor.last_momentum_values == {"lr-Adagrad-momentum": 0.0}
    assert float(trainer.callback_metrics["lr-Adagrad-momentum"]) == 0.0


def test_lr_monitor_names_param_groups() -> None:
    class Named(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([{"params": list(self.parameters()), "name": "linear"}], lr=0.1)

    monitor = LearningRateMonitor()
    quiet_trainer(max_epochs=1, limit_val_batches=0, callbacks=[monitor]).fit(Named(), make_loader())
    assert list(monitor.lrs) == ["lr-SGD/linear"]  # a named group keeps its name even when alone

    class SameNames(Regressor):
        def configure_optimizers(self) -> Any:
            groups = [{"params": [self.layer.weight], "name": "w"}, {"params": [self.layer.bias], "name": "w"}]
            return torch.optim.SGD(groups, lr=0.1)

    trainer = quiet_trainer(max_epochs=1, callbacks=[LearningRateMonitor()])
    with pytest.raises(MisconfigurationException, match="parameter groups with identical names"):
        trainer.fit(SameNames(), make_loader())


def test_lr_monitor_history_continues_when_a_param_group_is_added() -> None:
    class AddGroup(Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch == 1:
                trainer.optimizers[0].add_param_group({"params": list(pl_module.head.parameters()), "lr": 0.3})

    class Frozen(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 1)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.layer.parameters(), lr=0.1)

    monitor = LearningRateMonitor()
    trainer = quiet_trainer(max_epochs=3, limit_val_batches=0, callbacks=[AddGroup(), monitor])
    trainer.fit(Frozen(), make_loader())
    assert monitor.lrs == {"lr-SGD/pg1": [0.1, 0.1, 0.1], "lr-SGD/pg2": [0.3, 0.3]}


def test_lr_monitor_configuration_errors() -> None:
    with pytest.raises(MisconfigurationException, match="logging_interval"):
        LearningRateMonitor(logging_interval="batch")  # type: ignore[arg-type]
    trainer = quiet_trainer(max_steps=1, logger=False, callbacks=[LearningRateMonitor()])
    with pytest.raises(MisconfigurationException, match="no logger"):
        trainer.fit(Regressor(), make_loader())


# ------------------------------------------------------------------------------ EarlyStopping
class _Scores(Regressor):
    """Logs ``score``, one value per validation, from a list."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def on_validation_epoch_end(self) -> None:
        self.log("score", self.scores[self.current_epoch])


@pytest.mark.parametrize(
    ("options", "scores", "reason", "words", "epoch"),
    [
        ({"patience": 1}, [3.0, 3.0, 3.0], EarlyStoppingReason.PATIENCE_EXHAUSTED, "did not improve", 1),
        ({"stopping_threshold": 1.5}, [3.0, 1.0, 0.5], EarlyStoppingReason.STOPPING_THRESHOLD, "Stopping threshold", 1),
        ({"divergence_threshold": 5.0}, [3.0, 9.0, 1.0], EarlyStoppingReason.DIVERGENCE_THRESHOLD, "Divergence", 1),
        ({}, [3.0, 2.0, math.nan], EarlyStoppingReason.NON_FINITE_METRIC, "is not finite", 2),
        ({}, [3.0, 2.0, 1.0], EarlyStoppingReason.NOT_STOPPED, None, 0),
    ],
)
def test_early_stopping_says_why_it_stopped(
    options: dict[str, Any], scores: list[float], reason: EarlyStoppingReason, words: str | None, epoch: int
) -> None:
    stopping = EarlyStopping(monitor="score", **options)
    trainer = quiet_trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=1, callbacks=[stopping])
    trainer.fit(_Scores(scores), make_loader(), make_loader(16))
    assert stopping.stopping_reason is reason and stopping.stopped_epoch == epoch
    if words is None:
        assert stopping.stopping_reason_message is None
    else:
        assert words in str(stopping.stopping_reason_message)
    assert trainer.early_stopping_callbacks == [stopping] and trainer.early_stopping_callback is stopping


def test_early_stopping_reason_is_saved_and_restored() -> None:
    stopping = EarlyStopping(monitor="score")
    stopping.stopping_reason, stopping.stopping_reason_message = EarlyStoppingReason.PATIENCE_EXHAUSTED, "why"
    state = stopping.state_dict()
    assert state["stopping_reason"] == EarlyStoppingReason.PATIENCE_EXHAUSTED.value  # a plain int
    restored = EarlyStopping(monitor="score")
    restored.load_state_dict(state)
    assert (restored.stopping_reason, restored.stopping_reason_message) == (
        EarlyStoppingReason.PATIENCE_EXHAUSTED,
        "why",
    )
    older = {"wait_count": 1, "stopped_epoch": 0, "best_score": 0.5, "patience": 3}  # saved before reasons were
    restored.load_state_dict(older)
    assert restored.stopping_reason is EarlyStoppingReason.NOT_STOPPED and restored.stopping_reason_message is None


def test_early_stopping_keeps_min_delta_signed_so_that_a_negative_one_is_a_tolerance() -> None:
    assert EarlyStopping(monitor="score", min_delta=0.5).min_delta == -0.5  # an improvement lowers a "min" score
    assert EarlyStopping(monitor="score", min_delta=0.5, mode="max").min_delta == 0.5
    stopping = EarlyStopping(monitor="score", min_delta=-0.1, patience=1)
    trainer = quiet_trainer(max_epochs=5, limit_train_batches=1, limit_val_batches=1, callbacks=[stopping])
    trainer.fit(_Scores([5.0, 4.0, 4.05, 4.2, 4.2]), make_loader(), make_loader(16))
    # 4.05 is within the tolerance of 4.0, so it is the new best; 4.2 is not
    assert stopping.stopped_epoch == 3 and float(stopping.best_score) == pytest.approx(4.05)


def test_verbose_early_stopping_says_each_improvement_and_the_stop_in_lightnings_words(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stopping = EarlyStopping(monitor="score", patience=1, verbose=True, log_rank_zero_only=True)
    trainer = quiet_trainer(max_epochs=4, limit_train_batches=1, limit_val_batches=1, callbacks=[stopping])
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer.fit(_Scores([3.0, 2.0, 2.5, 1.0]), make_loader(), make_loader(16))
    said = [record.getMessage() for record in caplog.records if "etric score" in record.getMessage()]
    assert said == [
        "Metric score improved. New best score: 3.000",
        "Metric score improved by 1.000 >= min_delta = 0.0. New best score: 2.000",
        "Monitored metric score did not improve in the last 1 records. Best score: 2.000. Signaling Trainer to stop.",
    ]
    assert stopping.stopping_reason_message == said[-1]
    assert isinstance(stopping.best_score, torch.Tensor) and float(stopping.best_score) == 2.0


def test_early_stopping_without_its_metric_warns_when_not_strict_and_verbose() -> None:
    stopping = EarlyStopping(monitor="nope", strict=False, verbose=True)
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=1, callbacks=[stopping])
    with pytest.warns(RuntimeWarning, match="metric `nope` which is not available.*`score`"):
        trainer.fit(_Scores([3.0]), make_loader(), make_loader(16))
    assert not trainer.should_stop


def test_early_stopping_restores_its_patience_with_its_state() -> None:
    saved = EarlyStopping(monitor="score", patience=7).state_dict()
    restored = EarlyStopping(monitor="score", patience=2)
    restored.load_state_dict(saved)
    assert restored.patience == 7 and isinstance(restored.best_score, torch.Tensor)


class _EpochScores(Regressor):
    """Logs ``scores[epoch]`` as "train_score" over the training epoch, and validates as ``Regressor`` does."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("train_score", self.scores[self.current_epoch], on_step=False, on_epoch=True)
        return super().training_step(batch, batch_idx)


def test_early_stopping_checks_at_the_training_epochs_end_when_validation_runs_once_an_epoch() -> None:
    # So it sees the epoch's training metrics, which are not reduced yet when its validation ends.
    stopping = EarlyStopping(monitor="train_score", patience=1)
    trainer = quiet_trainer(max_epochs=4, limit_train_batches=2, callbacks=[stopping])
    trainer.fit(_EpochScores([3.0, 2.0, 2.5, 1.0]), make_loader(), make_loader(16))
    assert stopping.stopped_epoch == 2 and trainer.current_epoch == 3
    # Validating twice an epoch, it checks after each validation, where the training score is not there yet.
    stopping = EarlyStopping(monitor="train_score")
    trainer = quiet_trainer(max_epochs=4, limit_train_batches=2, val_check_interval=0.5, callbacks=[stopping])
    with pytest.raises(RuntimeError, match="metric `train_score` which is not available"):
        trainer.fit(_EpochScores([3.0, 2.0, 2.5, 1.0]), make_loader(), make_loader(16))


def test_early_stopping_configuration_errors() -> None:
    with pytest.raises(MisconfigurationException, match="`mode` can be 'min' or 'max', got maximum"):
        EarlyStopping(monitor="score", mode="maximum")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationException, match="patience"):
        EarlyStopping(monitor="score", patience=-1)


# -------------------------------------------------------------------------------------- Timer
@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_a_zero_duration_stops_training_before_its_first_step(interval: str) -> None:
    trainer = quiet_trainer(max_epochs=3, callbacks=[Timer(duration=timedelta(0), interval=interval)])  # type: ignore[arg-type]
    trainer.fit(Regressor(), make_loader())
    assert (trainer.global_step, trainer.current_epoch) == (0, 0)
    trainer = quiet_trainer(max_epochs=3, max_time={"seconds": 0})
    trainer.fit(Regressor(), make_loader())
    assert trainer.global_step == 0


def test_a_spent_timer_still_trains_min_steps_and_min_epochs() -> None:
    trainer = quiet_trainer(max_epochs=5, min_epochs=2, limit_train_batches=3, callbacks=[Timer(timedelta(0))])
    trainer.fit(Regressor(), make_loader())
    assert (trainer.global_step, trainer.current_epoch) == (6, 2)


def test_a_timer_resumed_with_its_time_spent_takes_no_step(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=3, limit_val_batches=0)
    trainer.fit(Regressor(), make_loader())
    path = str(tmp_path / "two-epochs.ckpt")
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["callbacks"] = {Timer().state_key: {"time_elapsed": {"train": 60.0}}}  # a minute spent of one
    torch.save(checkpoint, path)
    timer = Timer(duration={"minutes": 1})
    trainer = quiet_trainer(max_epochs=5, limit_train_batches=3, limit_val_batches=0, callbacks=[timer])
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer.fit(Regressor(), make_loader(), ckpt_path=path)
    assert trainer.global_step == 6 and timer.time_elapsed() >= 60.0
    assert "Time limit reached." in caplog.text and "Signaling Trainer to stop." in caplog.text


def test_a_timer_state_names_every_stage_from_the_start() -> None:
    stages = ["train", "sanity_check", "validate", "test", "predict"]
    assert Timer().state_dict() == {"time_elapsed": dict.fromkeys(stages, 0.0)}  # as Lightning's, before any stage
    timer = Timer()
    quiet_trainer(max_epochs=1, limit_train_batches=2, callbacks=[timer]).fit(Regressor(), make_loader())
    elapsed = timer.state_dict()["time_elapsed"]
    assert list(elapsed) == stages and elapsed["train"] > 0 and elapsed["test"] == 0.0
    with pytest.raises(ValueError, match="'fitting' is not a valid RunningStage"):
        timer.time_elapsed("fitting")  # type: ignore[arg-type]


def test_timer_configuration_errors() -> None:
    for duration in ("6:00:00", "60 minutes"):
        with pytest.raises(MisconfigurationException, match="format DD:HH:MM:SS"):
            Timer(duration=duration)
    with pytest.raises(MisconfigurationException, match="Unsupported parameter value"):
        Timer(interval="batch")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationException, match="must not be negative"):
        Timer(duration=timedelta(seconds=-1))


# ------------------------------------------------------------------------- callbacks of any kind
def test_a_mock_standing_in_for_a_callback_gets_the_hooks() -> None:
    given, returned = Mock(spec=Callback), Mock(spec=Callback)

    class WithCallbacks(Regressor):
        def configure_callbacks(self) -> Any:
            return returned

    trainer = quiet_trainer(
        max_epochs=1, limit_train_batches=2, limit_val_batches=1, enable_checkpointing=False, callbacks=[given]
    )
    trainer.fit(WithCallbacks(), make_loader(), make_loader(16))
    assert trainer.callbacks[-2:] == [given, returned]
    called = [call[0] for call in given.method_calls if call[0].startswith(("on_", "setup", "teardown"))]
    assert {"setup", "on_fit_start", "on_train_batch_end", "on_validation_end", "teardown"} <= set(called)
    assert returned.method_calls == given.method_calls


class _Stopping(EarlyStopping):
    pass


class _Checkpoint(ember.callbacks.ModelCheckpoint):
    pass


def test_the_defaults_follow_the_given_callbacks_in_lightnings_order() -> None:
    given = LambdaCallback()
    kinds = [type(callback) for callback in ember.Trainer(callbacks=given, max_time="00:01:00:00").callbacks]
    assert kinds == [LambdaCallback, Timer, ProgressBar, ModelSummary, ember.callbacks.ModelCheckpoint]
    summary = ModelSummary(max_depth=3)  # a given one takes the default's place, wherever it is given
    assert ember.Trainer(callbacks=[summary, given]).callbacks[:2] == [summary, given]


def test_the_tuner_s_callbacks_go_first_and_checkpoints_last_also_among_the_module_s() -> None:
    other, lr_finder, batch_size_finder = LambdaCallback(), LearningRateFinder(), BatchSizeFinder()
    checkpoint = ember.callbacks.ModelCheckpoint()
    trainer = ember.Trainer(callbacks=[checkpoint, other, lr_finder, batch_size_finder], enable_progress_bar=False)
    assert trainer.callbacks == [lr_finder, batch_size_finder, other, trainer.callbacks[3], checkpoint]
    returned = [ember.callbacks.ModelCheckpoint(monitor="loss"), BatchSizeFinder()]
    merged = with_module_callbacks([other, lr_finder, checkpoint], returned)
    assert merged == [lr_finder, returned[1], other, returned[0]]


def test_the_module_s_callbacks_replace_the_trainer_s_of_their_class_or_its_bases(
    caplog: pytest.LogCaptureFixture,
) -> None:
    returned: Any = None

    class Model(Regressor):
        def configure_callbacks(self) -> Any:
            return returned

    bare, stopping, other = Callback(), EarlyStopping("train_loss", mode="max"), LambdaCallback()
    trainer = quiet_trainer(max_steps=1, logger=False, callbacks=[bare, stopping, other])
    trainer.fit(Model(), make_loader(8))  # None: nothing to add
    callbacks = trainer.callbacks
    returned = [_Stopping("train_loss"), _Checkpoint(), Callback()]
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer.fit(Model(), make_loader(8))
    # A bare Callback replaces nothing and is replaced by nothing, as in Lightning.
    assert trainer.callbacks == [bare, other, returned[0], returned[2], returned[1]] != callbacks
    assert "will override existing callbacks passed to Trainer: EarlyStopping, ModelCheckpoint" in caplog.text


def test_hooks_set_on_a_callback_instance_are_called_and_has_work_in_is_the_classs() -> None:
    called: list[str] = []
    callback = Callback()
    for name in ("on_train_start", "has_work_in"):  # as code that records every public method of a Callback does
        setattr(callback, name, functools.partial(lambda name, *args: called.append(name), name))
    quiet_trainer(max_epochs=1, limit_train_batches=1, callbacks=[callback]).fit(Regressor(), make_loader())
    assert called == ["on_train_start"]


def test_lambda_callback_takes_every_hook_and_has_work_in() -> None:
    called: list[str] = []

    def record(name: str, *args: Any) -> None:
        called.append(name)  # answers None, also as has_work_in: the hooks stay on

    callback = LambdaCallback(**{name: functools.partial(record, name) for name in ("has_work_in", "on_train_end")})
    quiet_trainer(max_epochs=1, limit_train_batches=1, callbacks=[callback]).fit(Regressor(), make_loader())
    assert called == ["has_work_in", "on_train_end"]

    off = LambdaCallback(has_work_in=lambda hook: hook != "on_train_end", on_train_end=functools.partial(record, "off"))
    quiet_trainer(max_epochs=1, limit_train_batches=1, callbacks=[off]).fit(Regressor(), make_loader())
    assert "off" not in called
    for name in ("state_dict", "state_key", "reads_epoch_metrics", "on_epoch_end", "log"):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}': it is not a hook of Callback"):
            LambdaCallback(**{name: print})


def test_has_work_in_is_asked_only_where_a_callback_overrides_it() -> None:
    """A callback whose every function is wrapped to record its calls (as debugging code does) records hooks
    only: Callback's own ``has_work_in`` answers yes and is not called."""
    called: list[str] = []

    def record(name: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        called.append(name)
        return method(*args, **kwargs)

    class Recorded(Callback):
        def __init__(self) -> None:
            for name, method in inspect.getmembers(self, inspect.ismethod):
                if not name.startswith("_"):
                    setattr(self, name, functools.update_wrapper(functools.partial(record, name, method), method))

    trainer = quiet_trainer(max_epochs=1, limit_train_batches=1, logger=False, callbacks=[Recorded()])
    trainer.fit(Regressor(), make_loader())
    assert "has_work_in" not in called and {"setup", "on_fit_start", "on_train_batch_end", "teardown"} <= set(called)

    asked: list[str] = []

    class Deciding(Callback):
        def has_work_in(self, hook: str) -> bool:
            asked.append(hook)
            return True

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None: ...

    trainer = quiet_trainer(max_epochs=1, limit_train_batches=1, logger=False, callbacks=[Deciding()])
    trainer.fit(Regressor(), make_loader())
    assert asked == ["on_fit_start"]


def test_a_callback_reads_the_epochs_values_where_the_epoch_ends() -> None:
    class Reads(Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[str, bool, list[str]]] = []

        def on_validation_epoch_end(self, trainer: ember.Trainer, pl_module: Any) -> None:
            self.seen.append(("validation", trainer.sanity_checking, sorted(trainer.callback_metrics)))

        def on_train_epoch_end(self, trainer: ember.Trainer, pl_module: Any) -> None:
            self.seen.append(("train", False, sorted(trainer.callback_metrics)))

    class Logs(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.mean = torchmetrics.MeanMetric()
            self.computed: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.mean(float(batch_idx))
            self.log("mean", self.mean, on_step=False, on_epoch=True)
            return super().training_step(batch, batch_idx)

        def on_train_epoch_end(self) -> None:
            self.computed.append(float(self.mean.compute()))  # the metric is reset after the epoch's end hooks

    reads, module = Reads(), Logs()
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=1,
                            logger=False, enable_checkpointing=False, callbacks=[reads])  # fmt: skip
    trainer.fit(module, make_loader(), make_loader())
    assert reads.seen == [
        ("validation", True, ["val_loss"]),  # the sanity check's, dropped after it
        ("validation", False, ["train_loss", "val_loss"]),
        ("train", False, ["mean", "train_loss", "val_loss"]),
    ]
    assert float(trainer.callback_metrics["mean"]) == 0.5 and module.computed == [0.5]


def test_the_public_functions_of_callback_are_hooks_that_lambda_callback_takes() -> None:
    functions = {name for name, _ in inspect.getmembers(Callback, inspect.isfunction) if not name.startswith("_")}
    assert {"setup", "on_exception", "has_work_in"} <= functions and not {"log", "log_dict"} & functions
    LambdaCallback(**dict.fromkeys(functions - {"state_dict", "load_state_dict"}, print))  # none refused


# ------------------------------------------------------------------- finetuning, prediction writer
def test_adding_parameters_the_optimizer_holds_warns() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="already belong to a group.*Did you init your optimizer in"):
        BaseFinetuning.unfreeze_and_add_param_group(model, optimizer)
    assert [len(group["params"]) for group in optimizer.param_groups] == [2, 2]  # only the second layer's joined


class _Backbone(Regressor):
    """A frozen-at-first backbone under the regression's layer; the optimizer holds what trains."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.backbone(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_a_finetuning_run_resumes_with_the_groups_its_schedule_added(tmp_path: Any) -> None:
    def fit(epochs: int, ckpt_path: str | None = None) -> tuple[_Backbone, BackboneFinetuning]:
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
        saving = ember.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)
        trainer = quiet_trainer(max_epochs=epochs, limit_val_batches=0, logger=False, callbacks=[finetuning, saving])
        model = _Backbone()
        trainer.fit(model, make_loader(16), ckpt_path=ckpt_path)
        return model, finetuning

    whole, _ = fit(3)
    _, first = fit(2)
    groups = first.state_dict()["internal_optimizer_metadata"][0]
    assert [group["params"] for group in groups] == [
        ["layer.weight", "layer.bias"],
        ["backbone.weight", "backbone.bias"],
    ]
    assert groups[1]["lr"] == pytest.approx(0.01) and first.state_dict()["previous_backbone_lr"] == pytest.approx(0.01)
    resumed, again = fit(3, str(tmp_path / "last.ckpt"))
    assert again.previous_backbone_lr == pytest.approx(0.02)  # the schedule goes on
    for continued, uninterrupted in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(continued, uninterrupted)  # the backbone trains on, in its group


def test_prediction_writer_refuses_an_unknown_interval() -> None:
    with pytest.raises(MisconfigurationException, match=r"`write_interval` should be one of \['batch', 'epoch'"):
        BasePredictionWriter("step")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("interval", "on_batch", "on_epoch"),
    [("batch", True, False), ("epoch", False, True), ("batch_and_epoch", True, True)],
)
def test_prediction_writer_says_when_it_writes_in_its_interval(interval: str, on_batch: bool, on_epoch: bool) -> None:
    writer = BasePredictionWriter(interval)  # type: ignore[arg-type]
    assert writer.interval == interval and (writer.interval.on_batch, writer.interval.on_epoch) == (on_batch, on_epoch)


def test_on_exception_checkpoint_names_its_path_and_refuses_an_empty_filename(tmp_path: Any) -> None:
    assert OnExceptionCheckpoint(tmp_path, "crash").ckpt_path == str(tmp_path / "crash.ckpt")
    with pytest.raises(ValueError, match="filename cannot be empty"):
        OnExceptionCheckpoint(tmp_path, "")


# ----------------------------------------------------------------------------- learning-rate finder
class _Rates(ember.Module):
    """Keeps its learning rate in ``rate``, reads its data from the random generators when its loader is built,
    and counts its training steps."""

    def __init__(self, rate: float = 0.05) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.rate = rate
        self.steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.steps += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.rate)

    def train_dataloader(self) -> Any:
        x = torch.randn(64, 4)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def test_lr_find_updates_the_attribute_it_is_told() -> None:
    model = _Rates()
    finder = Tuner(quiet_trainer()).lr_find(model, min_lr=1e-4, max_lr=1.0, num_training=40, attr_name="rate")
    assert finder is not None and finder.suggested_lr is not None and model.rate == finder.suggested_lr

    unnamed = _Rates()
    with pytest.raises(AttributeError, match="should have one of these fields: lr, learning_rate"):
        Tuner(quiet_trainer()).lr_find(unnamed)
    assert unnamed.steps == 0  # refused before any step
    with pytest.raises(AttributeError, match="should have one of these fields: speed"):
        Tuner(quiet_trainer()).lr_find(unnamed, attr_name="speed")
    assert Tuner(quiet_trainer()).lr_find(unnamed, update_attr=False) is not None


def test_lr_find_sweeps_what_it_is_given() -> None:
    model = _Rates()
    one = Tuner(quiet_trainer()).lr_find(model, num_training=1, attr_name="rate")
    assert one is not None and one.results["lr"] == [1e-8] and one.suggested_lr is None and model.rate == 0.05
    down = Tuner(quiet_trainer()).lr_find(
        model, min_lr=1.0, max_lr=1e-3, num_training=4, early_stop_threshold=None, update_attr=False
    )
    assert down is not None and down.results["lr"] == pytest.approx([1.0, 0.1, 0.01, 0.001])


def test_lr_find_records_a_skipped_step_as_nan() -> None:
    class Skipping(_Rates):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return None if batch_idx in (3, 14) else super().training_step(batch, batch_idx)

    finder = Tuner(quiet_trainer()).lr_find(Skipping(), num_training=30, early_stop_threshold=None, attr_name="rate")
    assert finder is not None and len(finder.results["loss"]) == 30
    assert [i for i, loss in enumerate(finder.results["loss"]) if math.isnan(loss)] == [3, 14]
    assert finder.suggested_lr is not None and math.isfinite(finder.suggested_lr)


def test_lr_find_leaves_the_random_generators_as_they_were() -> None:
    torch.manual_seed(3)
    trainer = quiet_trainer()
    model = _Rates()
    first, second = (Tuner(trainer).lr_find(model, num_training=20, update_attr=False) for _ in range(2))
    assert first is not None and second is not None and first.results == second.results
    after = torch.rand(1)
    torch.manual_seed(3)
    _Rates()
    assert torch.equal(after, torch.rand(1))


def test_lr_find_refusals() -> None:
    with pytest.warns(UserWarning, match="Skipping learning rate finder"):
        assert Tuner(quiet_trainer(fast_dev_run=True)).lr_find(_Rates(), attr_name="rate") is None

    class Manual(_Rates):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(MisconfigurationException, match="only works with single optimizer"):
        Tuner(quiet_trainer()).lr_find(Manual(), attr_name="rate")


def test_learning_rate_finder_callback_trains_at_the_suggestion() -> None:
    finder = LearningRateFinder(num_training_steps=30, attr_name="rate")
    rates: list[float] = []

    class Watch(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    model = _Rates()
    trainer = quiet_trainer(max_epochs=1, limit_val_batches=0, callbacks=[finder, Watch()])
    trainer.fit(model, make_loader())
    assert finder.optimal_lr is not None and finder.optimal_lr.suggested_lr is not None
    assert rates == [finder.optimal_lr.suggested_lr] and model.rate == finder.optimal_lr.suggested_lr
    assert trainer.global_step == 8 and model.steps == 30 + 8  # the sweep's steps are not training's


def test_learning_rate_finder_callback_sweeps_on_the_loader_given_to_fit() -> None:
    finder = LearningRateFinder(num_training_steps=20)
    sizes: set[int] = set()

    class Given(Regressor):  # no train_dataloader(): the sweep can only read the loader fit was given
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            sizes.add(len(batch[0]))
            return super().training_step(batch, batch_idx)

    model = Given()
    trainer = quiet_trainer(max_epochs=1, limit_val_batches=0, logger=False, callbacks=[finder])
    trainer.fit(model, make_loader(40, batch_size=5))
    assert finder.optimal_lr is not None and len(finder.optimal_lr.results["lr"]) == 20
    assert sizes == {5}
    assert trainer.optimizers[0].param_groups[0]["lr"] == model.hparams.lr == finder.optimal_lr.suggested_lr
    with pytest.raises(MisconfigurationException, match=r"lr_find\(trainer, pl_module\) sweeps on fit's training"):
        finder.lr_find(trainer, model)  # fit has ended


def test_every_callback_names_the_module_pl_module() -> None:
    import inspect

    from ember.cli_lightning import SaveConfigCallback

    hooks = [name for name in vars(Callback) if name.startswith(("on_", "setup", "teardown"))]
    classes = [getattr(ember.callbacks, name) for name in ember.callbacks.__all__]
    classes = [cls for cls in classes if isinstance(cls, type) and issubclass(cls, Callback)]
    named = {
        f"{cls.__name__}.{hook}": list(inspect.signature(vars(cls)[hook]).parameters)[2]
        for cls in [*classes, SaveConfigCallback, LearningRateFinder]
        for hook in hooks
        if hook in vars(cls) and len(inspect.signature(vars(cls)[hook]).parameters) > 2
    }
    assert len(named) > 40 and {name: p for name, p in named.items() if p != "pl_module"} == {}
    # load_state_dict takes Lightning's keyword too (as the DataModule's does).
    for owner in [*classes, ember.DataModule]:
        assert list(inspect.signature(owner.load_state_dict).parameters)[1] == "state_dict", owner


def test_hooks_take_lightning_keywords() -> None:
    trainer, model = quiet_trainer(), Regressor()
    Callback().setup(trainer=trainer, pl_module=model, stage="fit")
    timer = Timer()
    timer.on_train_start(trainer=trainer, pl_module=model)
    assert timer.start_time() is not None
    monitor = LearningRateMonitor()
    monitor.on_train_epoch_start(trainer=trainer, pl_module=model)


# -------------------------------------------------------------------------------- ProgressBar
def test_progress_bar_tells_its_metrics_and_the_validation_batches_of_each_epoch() -> None:
    totals: list[float] = []

    class Shown(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("shown", 2.0, prog_bar=True)
            return super().training_step(batch, batch_idx)

        def on_train_epoch_end(self) -> None:
            assert self.trainer.progress_bar_callback is not None
            totals.append(self.trainer.progress_bar_callback.total_val_batches)

    bar = ProgressBar(stream=io.StringIO())
    trainer = quiet_trainer(
        max_epochs=4,
        limit_train_batches=2,
        limit_val_batches=3,
        check_val_every_n_epoch=2,
        callbacks=[bar],
        enable_progress_bar=True,
    )
    model = Shown()
    trainer.fit(model, make_loader(), make_loader(32))
    assert totals == [0, 3, 0, 3] and bar.trainer is trainer
    assert bar.get_metrics(trainer, model) == {"v_num": 0, "shown": 2.0} and standard_metrics(trainer) == {"v_num": 0}


def test_a_bar_knows_the_batches_of_the_evaluation_loader_that_runs_now() -> None:
    class Totals(TQDMProgressBar):
        def __init__(self) -> None:
            super().__init__()
            self.totals: list[tuple[str, int, float]] = []

        def on_validation_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, idx: int, loader: int = 0
        ) -> None:
            super().on_validation_batch_start(trainer, pl_module, batch, idx, loader)
            self.totals.append(("validate", loader, self.total_val_batches_current_dataloader))

        def on_test_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int, loader: int = 0) -> None:
            super().on_test_batch_start(trainer, pl_module, batch, idx, loader)
            self.totals.append(("test", loader, self.total_test_batches_current_dataloader))

    bar = Totals()
    trainer = quiet_trainer(callbacks=[bar], enable_progress_bar=True, limit_val_batches=2)
    trainer.validate(Regressor(), [make_loader(24), make_loader(8)], verbose=False)
    trainer.test(Regressor(), [make_loader(16)], verbose=False)
    assert bar.totals == [("validate", 0, 2), ("validate", 0, 2), ("validate", 1, 1), ("test", 0, 2), ("test", 0, 2)]
    with pytest.raises(RuntimeError, match="Totals: no evaluation loader runs now"):
        _ = bar.total_predict_batches_current_dataloader


@pytest.mark.parametrize(
    "make",
    [
        lambda: DeviceStatsMonitor(cpu_stats="yes"),  # type: ignore[arg-type]
        lambda: ModelSummary(max_depth=-2),
        lambda: ProgressBar(refresh_rate=-1),
        lambda: TQDMProgressBar(refresh_rate=-1),
        lambda: RichProgressBar(refresh_rate=-1),
        lambda: ThroughputMonitor(peak_flops=-1),
        lambda: Tuner(quiet_trainer()).scale_batch_size(Regressor(), mode="triple"),  # type: ignore[arg-type]
    ],
)
def test_configuration_errors_of_callbacks_and_the_tuner_are_misconfigurations(make: Any) -> None:
    with pytest.raises(MisconfigurationException):
        make()


def test_two_callbacks_whose_states_a_checkpoint_would_keep_under_one_key_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"more than one stateful callback of type `EarlyStopping`.*state_key"):
        quiet_trainer(callbacks=[EarlyStopping("score"), EarlyStopping("score")])
    # Told apart by their settings, or keeping no state, they are taken.
    quiet_trainer(callbacks=[EarlyStopping("score"), EarlyStopping("score", mode="max"), Callback(), Callback()])


def test_early_stopping_and_model_checkpoint_answer_lightnings_comparison_questions() -> None:
    assert EarlyStopping("score").monitor_op is torch.lt and EarlyStopping("score", mode="max").monitor_op is torch.gt
    assert EarlyStopping.order_dict == {"min": "<", "max": ">"}
    checkpoint = ember.callbacks.ModelCheckpoint(monitor="score", save_top_k=1)
    trainer = quiet_trainer()
    assert checkpoint.check_monitor_top_k(trainer, torch.tensor(5.0)) and not checkpoint.check_monitor_top_k(trainer)
    checkpoint.best_k_models, checkpoint.kth_best_model_path = {"a.ckpt": torch.tensor(2.0)}, "a.ckpt"
    assert checkpoint.check_monitor_top_k(trainer, torch.tensor(1.0))
    assert not checkpoint.check_monitor_top_k(trainer, torch.tensor(3.0))
