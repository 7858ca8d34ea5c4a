"""GradientAccumulationScheduler: an accumulation factor per epoch, its checks, and exact resume under it."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from conftest import DropoutRegressor, Regressor, make_loader, parameters_of, quiet_trainer

import ember
from ember.callbacks import Callback, GradientAccumulationScheduler
from ember.exceptions import MisconfigurationException


def _fit(model: ember.Module, *callbacks: Callback, batches: int = 10, **flags: Any) -> ember.Trainer:
    ckpt_path = flags.pop("ckpt_path", None)
    flags = {"max_epochs": 3, "logger": False, "enable_checkpointing": False, **flags}
    trainer = quiet_trainer(callbacks=list(callbacks), **flags)
    trainer.fit(model, make_loader(4 * batches, batch_size=4, shuffle=True), ckpt_path=ckpt_path)
    return trainer


class _Steps(Callback):
    """Records, per epoch, the batches after which the optimizer stepped, and what the Trainer said at its start."""

    def __init__(self) -> None:
        self.stepped: dict[int, list[int]] = {}
        self.at_start: list[tuple[int, Any, float]] = []
        self._step = 0

    def on_train_epoch_start(self, trainer: ember.Trainer, module: Any) -> None:
        self.at_start.append((trainer.current_epoch, trainer.accumulate_grad_batches,
                              trainer.estimated_stepping_batches))  # fmt: skip

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step != self._step:
            self.stepped.setdefault(trainer.current_epoch, []).append(idx)
        self._step = trainer.global_step


@pytest.mark.parametrize(
    ("scheduling", "message", "error"),
    [
        ({}, "an empty schedule", TypeError),
        ([(0, 2)], "expected a dict", TypeError),
        ({1: 2, -3: 4}, r"Epoch should be an int greater than or equal to 0. Got \[1, -3\]", MisconfigurationException),
        ({0: 2, "2": 1}, "Epoch should be an int", MisconfigurationException),
        ({1: 0, 3: 4}, r"Accumulation factor should be an int greater than 0. Got \[0, 4\]", MisconfigurationException),
        ({0: 2.0}, "Accumulation factor should be an int", MisconfigurationException),
    ],
)
def test_a_schedule_is_a_dict_of_epochs_and_factors(scheduling: Any, message: str, error: type) -> None:
    with pytest.raises(error, match=message):
        GradientAccumulationScheduler(scheduling)


def test_epochs_before_the_first_key_accumulate_nothing() -> None:
    given = {2: 4, 5: 2}
    scheduler = GradientAccumulationScheduler(given)
    assert scheduler.scheduling == {0: 1, 2: 4, 5: 2} and scheduler.epochs == [0, 2, 5]
    assert given == {2: 4, 5: 2}  # the caller's dict is not changed
    assert [scheduler.get_accumulate_grad_batches(epoch) for epoch in range(7)] == [1, 1, 4, 4, 4, 2, 2]
    assert scheduler.going_to_accumulate_grad_batches()
    assert not GradientAccumulationScheduler({0: 1, 3: 1}).going_to_accumulate_grad_batches()


def test_each_epoch_steps_with_its_factor_and_its_last_short_window_steps() -> None:
    steps = _Steps()
    trainer = quiet_trainer(max_epochs=4, callbacks=[steps, GradientAccumulationScheduler({1: 2, 3: 4})])
    assert trainer.accumulate_grad_batches == 1  # the flag's, until an epoch starts
    trainer.fit(Regressor(), make_loader(40, batch_size=4))
    assert steps.stepped == {0: list(range(10)), 1: [1, 3, 5, 7, 9], 2: [1, 3, 5, 7, 9], 3: [3, 7, 9]}
    assert trainer.global_step == 10 + 5 + 5 + 3
    # estimated_stepping_batches reads the current factor, as Lightning's: 4 epochs of ceil(10 / factor) steps.
    assert steps.at_start == [(0, 1, 40), (1, 2, 20), (2, 2, 20), (3, 4, 12)]
    assert trainer.accumulate_grad_batches == 4  # the last epoch's, after the fit


def test_a_scheduled_factor_trains_as_the_same_flag_does() -> None:
    scheduled, fixed = Regressor(), Regressor()
    _fit(scheduled, GradientAccumulationScheduler({0: 3}), batches=8)
    _fit(fixed, batches=8, accumulate_grad_batches=3)
    assert all(torch.equal(a, b) for a, b in zip(parameters_of(scheduled), parameters_of(fixed), strict=True))


class _Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        optimizer.step()
        optimizer.zero_grad()


class _OwnStep(Regressor):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


def test_what_the_schedule_cannot_apply_to_is_refused_when_training_starts() -> None:
    with pytest.raises(RuntimeError, match="not supported for manual optimization"):
        _fit(_Manual(), GradientAccumulationScheduler({1: 2}))
    with pytest.raises(ValueError, match=r"Trainer\(accumulate_grad_batches=2\) and the schedule"):
        _fit(Regressor(), GradientAccumulationScheduler({1: 2}), accumulate_grad_batches=2)
    with pytest.warns(UserWarning, match="_OwnStep overrides optimizer_step: .* not be called on every batch"):
        _fit(_OwnStep(), GradientAccumulationScheduler({1: 2}), max_epochs=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*not be called on every batch")
        _fit(_OwnStep(), GradientAccumulationScheduler({0: 1}), max_epochs=1)  # it never accumulates


class _StopAt(Callback):
    """Saves a checkpoint after batch ``batch`` of epoch ``epoch`` (-1: at the epoch's end), then "dies"."""

    def __init__(self, epoch: int, batch: int, path: str) -> None:
        self.epoch, self.batch, self.path = epoch, batch, path

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if (trainer.current_epoch, idx) == (self.epoch, self.batch):
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt

    def on_train_epoch_end(self, trainer: ember.Trainer, module: Any) -> None:
        if (trainer.current_epoch, -1) == (self.epoch, self.batch):
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt


@pytest.mark.parametrize(("epoch", "batch"), [(1, 5), (0, -1)], ids=["inside-a-window", "at-an-epoch-end"])
def test_a_resumed_run_follows_the_schedule_of_its_epoch_exactly(
    epoch: int, batch: int, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    def scheduler() -> GradientAccumulationScheduler:
        return GradientAccumulationScheduler({1: 4, 2: 3})

    ember.seed_everything(3)
    reference = DropoutRegressor()
    _fit(reference, scheduler())
    path = str(tmp_path / "run.ckpt")
    ember.seed_everything(3)
    with pytest.raises(SystemExit):
        _fit(DropoutRegressor(), scheduler(), _StopAt(epoch, batch, path))
    capsys.readouterr()
    resumed = DropoutRegressor()
    trainer = _fit(resumed, scheduler(), ckpt_path=path)
    assert "resuming with accumulate" not in capsys.readouterr().out  # the layout of the epoch is the saved one
    assert trainer.global_step == 10 + 3 + 4
    assert all(torch.equal(a, b) for a, b in zip(parameters_of(resumed), parameters_of(reference), strict=True))


def test_a_run_resumed_with_another_factor_for_its_epoch_runs_the_unfinished_window_again(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "run.ckpt")
    with pytest.raises(SystemExit):
        _fit(Regressor(), GradientAccumulationScheduler({1: 4}), _StopAt(1, 5, path))  # 2 batches of a window of 4
    capsys.readouterr()
    trainer = _fit(Regressor(), GradientAccumulationScheduler({1: 2}), ckpt_path=path)
    assert "resuming with accumulate 4 -> 2: epoch 1 continues at sample 16" in capsys.readouterr().out
    assert trainer.global_step == 10 + 1 + 3 + 5  # epoch 1: its first window, then batches 4-9 in windows of 2


def test_each_fit_starts_from_the_flag_s_factor() -> None:
    estimates: list[float] = []

    class Model(Regressor):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            estimates.append(self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    trainer = quiet_trainer(max_epochs=2, logger=False, enable_checkpointing=False,
                            callbacks=[GradientAccumulationScheduler({1: 2})])  # fmt: skip
    for _ in range(2):
        trainer.fit(Model(), make_loader(40, batch_size=4))
    assert estimates == [20, 20]  # 2 epochs of 10 batches, each its own step, as for Lightning's first fit
