"""``LearningRateMonitor``: log each optimizer's (and param group's) learning rate."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

from ember.callbacks.callback import Callback, at_logging_step

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class LearningRateMonitor(Callback):
    """Log ``lr-<Optimizer>`` (``lr-<Optimizer>/pg<N>`` per param group) to the Trainer's loggers.

    ``logging_interval="step"`` logs at the Trainer's logging steps, ``"epoch"`` at each epoch start;
    None picks "step" when a scheduler steps per step, else "epoch".
    """

    def __init__(
        self,
        logging_interval: Literal["step", "epoch"] | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise ValueError(
                f"LearningRateMonitor(logging_interval={logging_interval!r}): choose None, 'step' or 'epoch'"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self._interval: str = "epoch"
        self._names: list[str] = []

    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        if not trainer.loggers:
            raise ValueError("LearningRateMonitor needs a logger; the Trainer was built with logger=False")
        per_step = any(config.interval == "step" for config in trainer.lr_scheduler_configs)
        self._interval = self.logging_interval or ("step" if per_step else "epoch")
        counts = Counter(type(optimizer).__name__ for optimizer in trainer.optimizers)
        seen: Counter[str] = Counter()
        self._names = []
        for optimizer in trainer.optimizers:
            name = type(optimizer).__name__
            seen[name] += 1
            self._names.append(f"lr-{name}" + (f"-{seen[name] - 1}" if counts[name] > 1 else ""))

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        if self._interval == "epoch":
            trainer.run_metrics.log_values(self._values(trainer), trainer.global_step, trainer.current_epoch)

    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._interval == "step" and at_logging_step(trainer):
            trainer.run_metrics.log_values(self._values(trainer), trainer.global_step, trainer.current_epoch)

    def _values(self, trainer: Trainer) -> dict[str, float]:
        values = {}
        for name, optimizer in zip(self._names, trainer.optimizers):
            groups = optimizer.param_groups
            for index, group in enumerate(groups):
                key = name if len(groups) == 1 else f"{name}/pg{index + 1}"
                values[key] = float(group["lr"])
                if self.log_momentum:
                    momentum = group.get("momentum", group.get("betas", (None,))[0])
                    if momentum is not None:
                        values[f"{key}-momentum"] = float(momentum)
                if self.log_weight_decay and "weight_decay" in group:
                    values[f"{key}-weight_decay"] = float(group["weight_decay"])
        return values
