"""``trainer.state``: what the Trainer is doing, in Lightning's terms: the entry point being run (``fn``), the loop
running inside it (``stage``) and how the latest entry point went (``status``)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember.trainer import Trainer


class TrainerFn(str, enum.Enum):
    """The entry point: ``fit``, ``validate``, ``test`` or ``predict`` (the same strings as ``trainer.stage``)."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    def __str__(self) -> str:
        return self.value  # "fit" in paths and messages, as the string it stands for


class RunningStage(str, enum.Enum):
    """The loop running in it."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.SANITY_CHECKING, RunningStage.VALIDATING, RunningStage.TESTING)

    @property
    def dataloader_prefix(self) -> str:
        """The kind of loader the loop reads ("train", "val", "test", "predict"), as in ``limit_val_batches``."""
        return "val" if self in (RunningStage.SANITY_CHECKING, RunningStage.VALIDATING) else self.value


class TrainerStatus(str, enum.Enum):
    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


class TrainerState:
    """Read from the Trainer's parts: ``fn`` and ``status`` are the latest entry point's (they stay once it has
    returned), ``stage`` the loop running now (None outside one). Built from keywords without a Trainer, it holds
    the values given, as Lightning's record, to compare a Trainer's with (``trainer.state == TrainerState(...)``)."""

    def __init__(
        self,
        trainer: Trainer | None = None,
        *,
        status: TrainerStatus = TrainerStatus.INITIALIZING,
        fn: TrainerFn | None = None,
        stage: RunningStage | None = None,
    ) -> None:
        self._trainer = trainer
        self.fn = fn
        self.status = status
        self._stage = stage  # the stage of a record made without a Trainer

    def begin(self, stage: str) -> None:
        """An entry point starts (the Trainer's stage, ``"fit"``, ...)."""
        self.fn, self.status = TrainerFn(stage), TrainerStatus.RUNNING

    def end(self, interrupted: bool) -> None:
        self.status = TrainerStatus.INTERRUPTED if interrupted else TrainerStatus.FINISHED

    @property
    def stage(self) -> RunningStage | None:
        trainer = self._trainer
        if trainer is None:
            return self._stage
        if trainer.stage is None:
            return None
        if trainer.stage != "fit":
            return RunningStage(trainer.stage)
        if trainer.fit_loop.sanity_checking:
            return RunningStage.SANITY_CHECKING
        return RunningStage.VALIDATING if trainer.validate_loop.running else RunningStage.TRAINING

    @property
    def finished(self) -> bool:
        return self.status == TrainerStatus.FINISHED

    @property
    def stopped(self) -> bool:
        return self.status == TrainerStatus.INTERRUPTED

    # The Trainer's flags of the loop running (Lightning's ``trainer.training`` and the like).
    @property
    def training(self) -> bool:
        """Whether ``fit`` is training (not validating, nor in its sanity check)."""
        return self.stage == RunningStage.TRAINING

    @property
    def validating(self) -> bool:
        """Whether a validation runs (in ``validate``, or in ``fit`` outside the sanity check)."""
        return self.stage == RunningStage.VALIDATING

    @property
    def testing(self) -> bool:
        return self.stage == RunningStage.TESTING

    @property
    def predicting(self) -> bool:
        return self.stage == RunningStage.PREDICTING

    @property
    def evaluating(self) -> bool:
        """Whether a validation (sanity check included) or a test runs."""
        return self.stage is not None and self.stage.evaluating

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrainerState):
            return NotImplemented
        return (self.status, self.fn, self.stage) == (other.status, other.fn, other.stage)

    def __repr__(self) -> str:
        return f"TrainerState(fn={self.fn}, stage={self.stage}, status={self.status})"
