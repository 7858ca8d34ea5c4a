"""What ``configure_optimizers`` may return, parsed into optimizers and scheduler configurations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

_FORMS = (
    "an optimizer, a list of optimizers, ([optimizers], [schedulers]), "
    '{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ..., "interval": "step"|"epoch", '
    '"frequency": N, "monitor": "metric"}}, or a list of such dicts'
)
_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name"}


@dataclass
class LRSchedulerConfig:
    """A scheduler and when it steps: every ``frequency`` optimizer steps or epochs (``interval``)."""

    scheduler: Any
    interval: Literal["step", "epoch"] = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None

    @property
    def reads_metric(self) -> bool:
        return isinstance(self.scheduler, ReduceLROnPlateau)


def parse_optimizers(result: Any) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
    """Split ``configure_optimizers()``'s return value; raise a ``TypeError`` naming what was wrong."""
    if result is None:
        return [], []
    if isinstance(result, torch.optim.Optimizer):
        return [result], []
    if isinstance(result, Mapping):
        return _parse_dicts([result])
    if isinstance(result, Sequence) and not isinstance(result, str):
        items = list(result)
        if items and all(isinstance(item, Mapping) for item in items):
            return _parse_dicts(items)
        if items and all(isinstance(item, torch.optim.Optimizer) for item in items):
            return items, []
        if len(items) == 2 and all(isinstance(item, Sequence) for item in items):
            optimizers, schedulers = list(items[0]), list(items[1])
            _check_optimizers(optimizers)
            return optimizers, [_scheduler_config(item) for item in schedulers]
    raise TypeError(f"configure_optimizers() returned {_describe(result)}; it must return {_FORMS}")


def _parse_dicts(items: list[Mapping[str, Any]]) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
    optimizers, configs = [], []
    for item in items:
        unknown = set(item) - {"optimizer", "lr_scheduler", "monitor"}
        if "optimizer" not in item or unknown:
            problem = f"unknown keys {sorted(unknown)}" if unknown else 'no "optimizer" key'
            raise TypeError(f"configure_optimizers() returned a dict with {problem}; it must return {_FORMS}")
        _check_optimizers([item["optimizer"]])
        optimizers.append(item["optimizer"])
        if item.get("lr_scheduler") is not None:
            config = _scheduler_config(item["lr_scheduler"], default_monitor=item.get("monitor"))
            configs.append(config)
    return optimizers, configs


def _scheduler_config(value: Any, default_monitor: str | None = None) -> LRSchedulerConfig:
    if isinstance(value, Mapping):
        unknown = set(value) - _SCHEDULER_KEYS
        if unknown or "scheduler" not in value:
            problem = f"unknown keys {sorted(unknown)}" if unknown else 'no "scheduler" key'
            raise TypeError(
                f"configure_optimizers(): the lr_scheduler dict has {problem} (allowed: {sorted(_SCHEDULER_KEYS)})"
            )
        config = LRSchedulerConfig(**{"monitor": default_monitor, **value})
    else:
        config = LRSchedulerConfig(scheduler=value, monitor=default_monitor)
    if not (callable(getattr(config.scheduler, "step", None)) and hasattr(config.scheduler, "state_dict")):
        raise TypeError(f"configure_optimizers(): {_describe(config.scheduler)} is not a learning-rate scheduler")
    if config.interval not in ("step", "epoch"):
        raise ValueError(f'configure_optimizers(): lr_scheduler interval={config.interval!r}; use "step" or "epoch"')
    if not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"configure_optimizers(): lr_scheduler frequency={config.frequency!r} must be a positive int")
    if config.reads_metric and config.monitor is None:
        raise ValueError(
            'configure_optimizers(): ReduceLROnPlateau needs a metric to watch; return {"optimizer": ..., '
            '"lr_scheduler": {"scheduler": ..., "monitor": "val_loss"}}'
        )
    return config


def _check_optimizers(optimizers: list[Any]) -> None:
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"configure_optimizers() returned {_describe(optimizer)} where an optimizer was expected; "
                f"it must return {_FORMS}"
            )


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}" if len(text) <= 80 else f"a {type(value).__name__}"
