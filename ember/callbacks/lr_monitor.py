"""``LearningRateMonitor``: log each optimizer's (and param group's) learning rate."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class LearningRateMonitor(Callback):
    """Log ``lr-<Optimizer>`` (``lr-<Optimizer>/pg<N>`` per param group, or ``lr-<Optimizer>/<name>`` for a group
    with a ``"name"``; a scheduler config's ``"name"`` replaces ``lr-<Optimizer>``) to the loggers and the callback
    metrics. Optimizers with a scheduler are named first, in the schedulers' order; the second of a kind gets
    ``-1``, the third ``-2``.

    ``logging_interval="step"`` logs, when a logging step begins, the rates that step uses; ``"epoch"`` logs
    them when each epoch starts. None does both, each for the optimizers whose scheduler steps at that
    interval (optimizers without a scheduler at both).

    ``lrs`` holds every rate logged, by name (a rate whose optimizer gains a second param group continues as
    ``.../pg1``); ``last_momentum_values`` and ``last_weight_decay_values`` the latest momentum (``betas[0]``
    for Adam-like optimizers, 0 for those without) and weight decay, by logged name (None: not logged).
    """

    def __init__(
        self,
        logging_interval: Literal["step", "epoch"] | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ) -> None:
        if logging_interval not in (None, "step", "epoch"):
            raise MisconfigurationException(
                f"LearningRateMonitor(logging_interval={logging_interval!r}): choose None, 'step' or 'epoch'"
            )
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.log_weight_decay = log_weight_decay
        self.lrs: dict[str, list[float]] = {}
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}

    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        if not trainer.loggers:
            raise MisconfigurationException(
                "LearningRateMonitor needs a logger; it cannot log with a `Trainer` that has no logger (logger=False)"
            )
        named = _named_optimizers(trainer)
        if self.log_momentum and any(not _has_momentum(optimizer) for optimizer, _, _ in named):
            warnings.warn(
                "LearningRateMonitor(log_momentum=True): some optimizers do not have momentum. Their momentum is "
                "logged as 0.",
                RuntimeWarning,
                stacklevel=2,
            )
        names = [name for _, _, group_names in named for name in group_names]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        if self.logging_interval != "step":
            self._log(trainer, "epoch" if self.logging_interval is None else None, trainer.fit_loop.logging_step)

    def on_train_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int) -> None:
        loop = trainer.fit_loop
        if self.logging_interval == "epoch" or loop.progress.window_batches:
            return  # once per optimizer step, when its first micro-batch starts
        # Written when the step that begins is a logging step, with the label its values get (the steps before it).
        every = trainer.log_every_n_steps  # 0: no step values are written
        if every and (loop.logging_step + 1) % every == 0:
            self._log(trainer, "step" if self.logging_interval is None else None, loop.logging_step)

    def _log(self, trainer: Trainer, interval: str | None, step: int) -> None:
        values = self._values(trainer, interval)
        if values:
            trainer.run_metrics.log_values(values, step)

    def _values(self, trainer: Trainer, interval: str | None) -> dict[str, float]:
        """The rates of the optimizers whose scheduler steps at ``interval`` (None: any), and of those without;
        each is also recorded in ``lrs`` and the ``last_*_values``."""
        values = {}
        for optimizer, scheduled, names in _named_optimizers(trainer):
            self._continue_history(names)
            if interval is not None and scheduled not in (None, interval):
                continue
            uses_betas = "betas" in optimizer.defaults
            for group, name in zip(optimizer.param_groups, names):
                values[name] = float(group["lr"])
                self.lrs[name].append(values[name])
                if self.log_momentum:
                    key = f"{name}-momentum"
                    values[key] = float(group["betas"][0] if uses_betas else group.get("momentum", 0.0))
                    self.last_momentum_values[key] = values[key]
                if self.log_weight_decay and "weight_decay" in group:
                    key = f"{name}-weight_decay"
                    values[key] = self.last_weight_decay_values[key] = float(group["weight_decay"])
        return values

    def _continue_history(self, names: list[str]) -> None:
        """Give every name a history; a rate whose optimizer gained param groups continues as its ``/pg1``."""
        for name in names:
            if name not in self.lrs:
                unsplit = name.removesuffix("/pg1")
                self.lrs[name] = self.lrs.pop(unsplit, []) if unsplit != name else []


def _named_optimizers(trainer: Trainer) -> list[tuple[torch.optim.Optimizer, str | None, list[str]]]:
    """Each optimizer, the interval its scheduler steps at (None: it has none) and the names of its param groups'
    rates: those with a scheduler first, in the schedulers' order (as Lightning names them)."""
    scheduled: list[tuple[torch.optim.Optimizer, str | None, str | None]] = []
    for config in trainer.lr_scheduler_configs:
        optimizer = getattr(config.scheduler, "optimizer", None)  # a scheduler of another library may not say
        if optimizer is not None:
            scheduled.append((optimizer, config.interval, config.name))
    held = {id(optimizer) for optimizer, _, _ in scheduled}
    scheduled += [(optimizer, None, None) for optimizer in trainer.optimizers if id(optimizer) not in held]
    seen: Counter[type] = Counter()
    named = []
    for optimizer, interval, given in scheduled:
        if given:
            name = given
        else:
            seen[type(optimizer)] += 1  # the second Adam is "lr-Adam-1", the third "lr-Adam-2"
            count = seen[type(optimizer)]
            name = f"lr-{type(optimizer).__name__}" + (f"-{count - 1}" if count > 1 else "")
        named.append((optimizer, interval, _group_names(name, optimizer.param_groups)))
    return named


def _group_names(name: str, groups: list[dict[str, Any]]) -> list[str]:
    """``name`` for a single unnamed group; else ``name/<group's "name">``, or ``name/pg<N>`` for an unnamed one."""
    if len(groups) == 1 and not groups[0].get("name"):
        return [name]
    names = [f"{name}/{group.get('name') or f'pg{index}'}" for index, group in enumerate(groups, start=1)]
    repeated = sorted({group_name for group_name in names if names.count(group_name) > 1})
    if repeated:
        raise MisconfigurationException(
            f"A single `Optimizer` cannot have multiple parameter groups with identical names: {name} has "
            f"{len(names)} groups, and {repeated} would each log the rates of several of them; give the groups "
            "distinct 'name's"
        )
    return names


def _has_momentum(optimizer: torch.optim.Optimizer) -> bool:
    return "momentum" in optimizer.defaults or "betas" in optimizer.defaults
