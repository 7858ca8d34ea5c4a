"""``LearningRateMonitor``: log each optimizer's (and param group's) learning rate."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class LearningRateMonitor(Callback):
    """Log ``lr-<Optimizer>`` (``lr-<Optimizer>/pg<N>`` per param group, or the group's ``"name"``; a scheduler
    config's ``"name"`` replaces the whole name) to the loggers and the callback metrics.

    ``logging_interval="step"`` logs, when a logging step begins, the rates that step uses; ``"epoch"`` logs
    them when each epoch starts. None does both, each for the optimizers whose scheduler steps at that
    interval (optimizers without a scheduler at both).
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
        self._names: list[str] = []

    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        if not trainer.loggers:
            raise ValueError("LearningRateMonitor needs a logger; the Trainer was built with logger=False")
        named = {id(_optimizer_of(config)): config.name for config in trainer.lr_scheduler_configs}
        seen: Counter[str] = Counter()
        self._names = []
        for optimizer in trainer.optimizers:
            given = named.get(id(optimizer))
            if given:
                self._names.append(given)
                continue
            kind = type(optimizer).__name__
            seen[kind] += 1  # the second Adam is "lr-Adam-1", the third "lr-Adam-2"
            self._names.append(f"lr-{kind}" + (f"-{seen[kind] - 1}" if seen[kind] > 1 else ""))

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        if self.logging_interval != "step":
            self._log(trainer, "epoch" if self.logging_interval is None else None, trainer.fit_loop.logging_step)

    def on_train_batch_start(self, trainer: Trainer, module: Module, batch: Any, batch_idx: int) -> None:
        loop = trainer.fit_loop
        if self.logging_interval == "epoch" or loop.progress.window_batches:
            return  # once per optimizer step, when its first micro-batch starts
        step = loop.logging_step + 1  # the step that begins, the label its other values get
        if step % trainer.log_every_n_steps == 0:
            self._log(trainer, "step" if self.logging_interval is None else None, step)

    def _log(self, trainer: Trainer, interval: str | None, step: int) -> None:
        values = self._values(trainer, interval)
        if values:
            trainer.run_metrics.log_values(values, step, trainer.current_epoch)

    def _values(self, trainer: Trainer, interval: str | None) -> dict[str, float]:
        """The rates of the optimizers whose scheduler steps at ``interval`` (None: any), and of those without."""
        scheduled = {id(_optimizer_of(config)): config.interval for config in trainer.lr_scheduler_configs}
        values = {}
        for name, optimizer in zip(self._names, trainer.optimizers):
            if interval is not None and scheduled.get(id(optimizer), interval) != interval:
                continue
            groups = optimizer.param_groups
            for index, group in enumerate(groups):
                key = name if len(groups) == 1 else f"{name}/{group.get('name', f'pg{index + 1}')}"
                values[key] = float(group["lr"])
                if self.log_momentum:
                    momentum = group.get("momentum", group.get("betas", (None,))[0])
                    if momentum is not None:
                        values[f"{key}-momentum"] = float(momentum)
                if self.log_weight_decay and "weight_decay" in group:
                    values[f"{key}-weight_decay"] = float(group["weight_decay"])
        return values


def _optimizer_of(config: Any) -> Any:
    return getattr(config.scheduler, "optimizer", None)  # a scheduler of another library may not say
