"""``Timer``: how long each stage ran, and an optional time limit for training."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args

from ember._utils import parse_max_time
from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

Stage = Literal["train", "sanity_check", "validate", "test", "predict"]


class Timer(Callback):
    """Time the stages, and stop training once ``duration`` has passed.

    ``duration`` is "DD:HH:MM:SS", a ``timedelta`` or a dict such as ``{"hours": 2}``. With
    ``interval="step"`` training stops after the batch during which time ran out (with several
    processes, within the next ten batches, every rank at the same one), with ``"epoch"`` at the end
    of that epoch; a duration already spent when training starts (zero, or used up by the run this one resumes)
    stops it before its first step. ``time_elapsed(stage)``,
    ``time_remaining(stage)``, ``start_time(stage)`` and ``end_time(stage)`` (``time.monotonic()``
    values) read the clock for "train", "validate", "test" or "predict". The training time is saved in
    checkpoints, so a resumed run continues the count.
    """

    def __init__(
        self,
        duration: str | timedelta | Mapping[str, int] | None = None,
        interval: Literal["step", "epoch"] = "step",
        verbose: bool = True,
    ) -> None:
        if interval not in ("step", "epoch"):
            raise MisconfigurationException(
                f"Unsupported parameter value Timer(interval={interval!r}): choose 'step' or 'epoch'"
            )
        self.duration = parse_max_time(duration, flag="Timer(duration)")
        self.interval = interval
        self.verbose = verbose
        self._start: dict[str, float] = {}
        self._end: dict[str, float] = {}
        self._offset = 0.0  # training time of the run this one resumed

    def start_time(self, stage: Stage = "train") -> float | None:
        return self._start.get(_known(stage))

    def end_time(self, stage: Stage = "train") -> float | None:
        return self._end.get(_known(stage))

    def time_elapsed(self, stage: Stage = "train") -> float:
        """Seconds ``stage`` has run (for "train", including the run this one resumed)."""
        offset = self._offset if _known(stage) == "train" else 0.0
        start = self._start.get(stage)
        if start is None:
            return offset
        return self._end.get(stage, time.monotonic()) - start + offset

    def time_remaining(self, stage: Stage = "train") -> float | None:
        return None if self.duration is None else self.duration - self.time_elapsed(stage)

    @property
    def spent(self) -> bool:
        """Whether the duration was all spent before this fit's training began: it is zero, or the run this one
        resumed used it up. Read from the checkpoint, not the clock, so every rank agrees."""
        return self.duration is not None and self._offset >= self.duration

    @property
    def deadline(self) -> float:
        """The ``time.monotonic()`` past which training stops after the batch under way (``math.inf``: none;
        with ``interval="epoch"`` the limit is checked at each epoch's end instead)."""
        start = self._start.get("train")
        if self.duration is None or self.interval != "step" or start is None:
            return math.inf
        return start + self.duration - self._offset

    def _begin(self, stage: Stage) -> None:
        self._start[stage] = time.monotonic()
        self._end.pop(stage, None)

    def _finish(self, stage: Stage) -> None:
        self._end[stage] = time.monotonic()

    # ---------------------------------------------------------------------------------- hooks
    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._begin("train")  # the loop reads ``deadline`` next, and stops every rank at the same batch

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self.duration is None or self.interval != "epoch":
            return
        if trainer.strategy.broadcast(self.time_elapsed("train") >= self.duration):  # rank zero's clock decides
            trainer.should_stop = True

    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None:
        self._finish("train")
        remaining = self.time_remaining("train")
        if self.verbose and remaining is not None and remaining <= 0 and trainer.is_global_zero:
            logging.getLogger("ember").info(
                "Time limit reached. Elapsed time is %s of %s. Signaling Trainer to stop.",
                _readable(self.time_elapsed("train")), _readable(self.duration or 0.0),
            )  # fmt: skip

    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._begin("validate")

    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None:
        self._finish("validate")

    def on_test_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._begin("test")

    def on_test_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        self._finish("test")

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._begin("predict")

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        self._finish("predict")

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in get_args(Stage)}}  # as Lightning: all

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._offset = state_dict.get("time_elapsed", {}).get("train", 0.0)


def _known(stage: str) -> str:
    if stage not in get_args(Stage):  # Lightning's error for a stage it does not know
        raise ValueError(f"{stage!r} is not a valid RunningStage: choose one of {get_args(Stage)}")
    return stage


def _readable(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 60 else str(timedelta(seconds=round(seconds)))
