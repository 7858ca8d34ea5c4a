"""``EarlyStopping``: stop fitting when a monitored metric stops improving."""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from ember.callbacks.callback import Callback, settings_key
from ember.exceptions import MisconfigurationException
from ember.rank_zero import announce, log_info, rank_zero_warn

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class EarlyStoppingReason(Enum):
    """Why ``EarlyStopping`` stopped training (``NOT_STOPPED``: it did not, or another process decided to)."""

    NOT_STOPPED = 0
    STOPPING_THRESHOLD = 1
    DIVERGENCE_THRESHOLD = 2
    PATIENCE_EXHAUSTED = 3
    NON_FINITE_METRIC = 4


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by more than ``min_delta`` for ``patience`` checks.

    The check runs at the end of each training epoch when validation runs once an epoch, at its end, or not at
    all; after each validation otherwise (``check_on_train_epoch_end`` chooses). Every rank takes the same decision.
    Once it stops, ``stopping_reason`` says why (an ``EarlyStoppingReason``) and ``stopping_reason_message``
    says it in words; ``stopped_epoch`` is the epoch it stopped at. As in Lightning, ``min_delta`` is kept with
    the sign of an improvement (negative with ``mode="min"``; a tolerance when given with the other sign),
    ``best_score`` is a tensor, and ``verbose=True`` logs each improvement and the stop, with the rank in front
    when there are several processes (on every rank, or on rank zero only with ``log_rank_zero_only=True``).
    """

    reads_epoch_metrics = True
    #: Lightning's comparisons and their signs, by ``mode``.
    mode_dict: ClassVar[dict[str, Callable[..., torch.Tensor]]] = {"min": torch.lt, "max": torch.gt}
    order_dict: ClassVar[dict[str, str]] = {"min": "<", "max": ">"}

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        mode: Literal["min", "max"] = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        verbose: bool = False,
        log_rank_zero_only: bool = False,
    ) -> None:
        if mode not in ("min", "max"):
            raise MisconfigurationException(f"EarlyStopping: `mode` can be 'min' or 'max', got {mode}")
        if not isinstance(patience, int) or patience < 0:
            raise MisconfigurationException(f"EarlyStopping(patience={patience!r}) must be a non-negative int")
        self.monitor = monitor
        self.min_delta = min_delta if mode == "max" else -min_delta
        self.patience = patience
        self.mode = mode
        self.strict = strict
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.verbose = verbose
        self.log_rank_zero_only = log_rank_zero_only
        self.wait_count = 0
        self.stopped_epoch = 0
        self.best_score = torch.tensor(math.inf if mode == "min" else -math.inf)
        self.stopping_reason = EarlyStoppingReason.NOT_STOPPED
        self.stopping_reason_message: str | None = None

    @property
    def monitor_op(self) -> Callable[..., torch.Tensor]:
        """``torch.lt`` or ``torch.gt``: whether a score is better than another, as ``mode`` says."""
        return self.mode_dict[self.mode]

    @property
    def state_key(self) -> str:
        return settings_key(self, monitor=self.monitor, mode=self.mode)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self._checks_on_train_epoch_end(trainer):
            self._check(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None:
        if trainer.stage == "fit" and not trainer.sanity_checking and not self._checks_on_train_epoch_end(trainer):
            self._check(trainer)

    def _checks_on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self.check_on_train_epoch_end is not None:
            return self.check_on_train_epoch_end
        # As Lightning: at the end of each training epoch (after its validation, and with the epoch's training
        # metrics) when validation runs once an epoch, at its end, or not at all; else after each validation.
        once_an_epoch = trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1
        return once_an_epoch or not trainer.validation_enabled

    def _check(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run:
            return  # a quick check that the code runs never stops early
        metrics = trainer.callback_metrics
        if self.monitor not in metrics:
            self._skip_missing(metrics)
            return
        reason, message = self._stopping_reason(metrics[self.monitor].detach().squeeze().clone())
        stopping = reason is not EarlyStoppingReason.NOT_STOPPED
        # The same decision on every rank, or some would leave the loop while others wait for them.
        if trainer.strategy.reduce(torch.tensor(float(stopping)), reduce_op="max"):
            self.stopped_epoch = trainer.current_epoch
            self.stopping_reason = reason
            self.stopping_reason_message = message if stopping else "another process decided to stop"
            trainer.should_stop = True
        if message is not None and self.verbose:
            self._log(trainer, message)

    def _skip_missing(self, metrics: dict[str, Any]) -> None:
        """Refuse to go on without the monitored metric (``strict``), or skip the check, warning when ``verbose``."""
        missing = (
            f"Early stopping conditioned on metric `{self.monitor}` which is not available. Pass in or modify "
            f"your `EarlyStopping` callback to use any of the following: `{'`, `'.join(metrics)}`"
        )
        if self.strict:
            raise RuntimeError(f"{missing} (or pass strict=False to skip the check while it is missing)")
        if self.verbose:
            rank_zero_warn(missing, category=RuntimeWarning, stacklevel=4)

    def _log(self, trainer: Trainer, message: str) -> None:
        where = "callbacks.early_stopping"  # Lightning's logger of these messages, whose level a program may set
        if trainer.world_size == 1:
            announce(message, where)
        elif not self.log_rank_zero_only or trainer.global_rank == 0:
            log_info(f"[rank: {trainer.global_rank}] {message}", where)

    def _stopping_reason(self, current: torch.Tensor) -> tuple[EarlyStoppingReason, str | None]:
        """Why ``current`` stops training, and what to say about it (an improvement is said without stopping)."""
        score = float(current)
        better = (lambda a, b: a < b) if self.mode == "min" else (lambda a, b: a > b)
        beyond = self.order_dict[self.mode]
        stop = ". Signaling Trainer to stop."
        if self.check_finite and not math.isfinite(score):
            message = f"Monitored metric {self.monitor} = {score} is not finite. Previous best value was "
            return EarlyStoppingReason.NON_FINITE_METRIC, f"{message}{self.best_score:.3f}{stop}"
        if self.stopping_threshold is not None and better(score, self.stopping_threshold):
            message = f"Stopping threshold reached: {self.monitor} = {score} {beyond} {self.stopping_threshold}"
            return EarlyStoppingReason.STOPPING_THRESHOLD, message + stop
        if self.divergence_threshold is not None and better(self.divergence_threshold, score):
            worse = ">" if self.mode == "min" else "<"
            message = f"Divergence threshold reached: {self.monitor} = {score} {worse} {self.divergence_threshold}"
            return EarlyStoppingReason.DIVERGENCE_THRESHOLD, message + stop
        best = float(self.best_score)
        if better(score - self.min_delta, best):
            self.best_score, self.wait_count = current, 0
            if not math.isfinite(best):
                return EarlyStoppingReason.NOT_STOPPED, f"Metric {self.monitor} improved. New best score: {score:.3f}"
            gain = f"improved by {abs(best - score):.3f} >= min_delta = {abs(self.min_delta)}"
            return EarlyStoppingReason.NOT_STOPPED, f"Metric {self.monitor} {gain}. New best score: {score:.3f}"
        self.wait_count += 1
        if self.wait_count >= self.patience:
            message = f"Monitored metric {self.monitor} did not improve in the last {self.wait_count} records."
            return EarlyStoppingReason.PATIENCE_EXHAUSTED, f"{message} Best score: {best:.3f}{stop}"
        return EarlyStoppingReason.NOT_STOPPED, None

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait_count": self.wait_count,
            "stopped_epoch": self.stopped_epoch,
            # A tensor, as Lightning's EarlyStopping reads it; float64 keeps the value exactly, for resuming.
            "best_score": self.best_score.detach().to("cpu", torch.float64),
            "patience": self.patience,
            "stopping_reason": self.stopping_reason.value,  # a plain int: checkpoints load with weights_only
            "stopping_reason_message": self.stopping_reason_message,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = state_dict["wait_count"]
        self.stopped_epoch = state_dict["stopped_epoch"]
        self.best_score = torch.as_tensor(state_dict["best_score"])  # a float in Ember 0.1's checkpoints
        self.patience = state_dict["patience"]
        # Checkpoints of earlier releases have no reason.
        reason = state_dict.get("stopping_reason", EarlyStoppingReason.NOT_STOPPED.value)
        self.stopping_reason = EarlyStoppingReason(reason)
        self.stopping_reason_message = state_dict.get("stopping_reason_message")
