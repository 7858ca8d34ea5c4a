"""The Trainer's public behaviour as Lightning's: its loop's state, its interrupts and what it says it runs on."""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember.callbacks import Callback
from ember.trainer_state import RunningStage, TrainerFn, TrainerState, TrainerStatus


@pytest.mark.parametrize(
    ("max_epochs", "max_steps", "done"),
    [(-1, -1, False), (3, -1, False), (-1, 5, False), (0, -1, True), (-1, 0, True), (None, 0, True)],
)
def test_fit_loop_done_says_whether_a_limit_leaves_nothing_to_train(
    max_epochs: int | None, max_steps: int, done: bool
) -> None:
    trainer = quiet_trainer(max_epochs=max_epochs, max_steps=max_steps, logger=False)
    assert trainer.fit_loop.done is done


def test_fit_loop_done_once_the_fit_reached_its_limit() -> None:
    trainer = quiet_trainer(max_steps=2, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader(8), make_loader(8))
    assert trainer.global_step == 2 and trainer.fit_loop.done is True


class _EpochRecorder(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list[int] = []

    def on_train_epoch_end(self) -> None:
        self.epochs.append(self.current_epoch)


def test_raising_the_fit_loops_limits_lets_the_next_fit_train_on() -> None:
    trainer = quiet_trainer(max_epochs=2, logger=False, enable_checkpointing=False, limit_val_batches=0)
    first, second = _EpochRecorder(), _EpochRecorder()
    trainer.fit(first, make_loader(16))
    trainer.fit_loop.max_epochs = 4
    assert trainer.max_epochs == trainer.fit_loop.max_epochs == 4
    trainer.fit(second, make_loader(16))
    assert (first.epochs, second.epochs, trainer.global_step) == ([0, 1], [2, 3], 8)
    trainer.fit_loop.max_steps = 9
    trainer.fit_loop.max_epochs = -1
    trainer.fit(second, make_loader(16))
    assert trainer.global_step == trainer.max_steps == 9


def test_a_fit_loop_limit_out_of_range_is_refused_by_name() -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False)
    with pytest.raises(ember.exceptions.MisconfigurationException, match="max_epochs"):
        trainer.fit_loop.max_epochs = -5
    assert trainer.fit_loop.max_epochs == 1


class _Interrupting(Callback):
    """Raises ``error`` where a stage starts its batches (as a hook that is interrupted does)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.seen: list[BaseException] = []

    def on_train_batch_start(self, *_: Any) -> None:
        raise self.error

    def on_test_batch_start(self, *_: Any) -> None:
        raise self.error

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self.seen.append(exception)


class _Data(ember.DataModule):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[BaseException] = []

    def train_dataloader(self) -> Any:
        return make_loader(8)

    def test_dataloader(self) -> Any:
        return make_loader(8)

    def on_exception(self, exception: BaseException) -> None:
        self.seen.append(exception)


@pytest.mark.parametrize("stage", ["fit", "test"])
def test_a_keyboard_interrupt_runs_the_exception_hooks_then_exits_with_1(stage: str) -> None:
    interrupt = KeyboardInterrupt()
    callback, data = _Interrupting(interrupt), _Data()
    trainer = quiet_trainer(max_epochs=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                            callbacks=[callback])  # fmt: skip
    patched = mock.patch.object(type(trainer.strategy), "on_exception")
    with patched as on_exception, pytest.raises(SystemExit) as exited:
        getattr(trainer, stage)(Regressor(), datamodule=data)
    assert exited.value.code == 1 and exited.value.__cause__ is interrupt
    assert callback.seen == data.seen == [interrupt]
    on_exception.assert_called_once_with(interrupt)
    assert trainer.interrupted and trainer.state.status == "interrupted"


def test_another_exception_reaches_the_strategys_on_exception_and_propagates() -> None:
    error = RuntimeError("in a hook")
    trainer = quiet_trainer(max_epochs=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                            callbacks=[_Interrupting(error)])  # fmt: skip
    patched = mock.patch.object(type(trainer.strategy), "on_exception")
    with patched as on_exception, pytest.raises(RuntimeError) as raised:
        trainer.fit(Regressor(), make_loader(8))
    assert raised.value is error
    on_exception.assert_called_once_with(error)
    assert trainer.interrupted


def test_the_trainers_state_compares_with_a_record_built_from_keywords() -> None:
    trainer = quiet_trainer(max_steps=1, logger=False, enable_checkpointing=False, limit_val_batches=0)
    assert trainer.state == TrainerState(status=TrainerStatus.INITIALIZING, fn=None, stage=None)
    trainer.fit(Regressor(), make_loader(8))
    assert trainer.state == TrainerState(status=TrainerStatus.FINISHED, fn=TrainerFn.FITTING)
    assert trainer.state != TrainerState(status=TrainerStatus.FINISHED, fn=TrainerFn.TESTING)
    record = TrainerState(status=TrainerStatus.RUNNING, fn=TrainerFn.TESTING, stage=RunningStage.TESTING)
    assert record.stage == RunningStage.TESTING and record.testing and not record.finished
