"""Lightning names that are only types, and its exception class, for programs that import them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from ember.exceptions import MisconfigurationException
from ember.optim import LRSchedulerConfig

#: What a step may return: a loss tensor, a dict with "loss", or None.
STEP_OUTPUT = torch.Tensor | Mapping[str, Any] | None
#: What ``configure_optimizers`` may return.
OptimizerLRScheduler = Any
TRAIN_DATALOADERS = DataLoader | Iterable[Any] | Sequence[DataLoader] | Mapping[str, DataLoader]
EVAL_DATALOADERS = DataLoader | Sequence[DataLoader]
LRSchedulerTypeUnion = Any
LRSchedulerPLType = Any
#: What a dict that ``configure_optimizers`` returns holds: "optimizer", and "lr_scheduler" (a scheduler or a
#: dict of its configuration); Lightning's TypedDicts for them, as plain dicts.
OptimizerLRSchedulerConfig = dict[str, Any]
OptimizerConfig = dict[str, Any]
LRSchedulerConfigType = dict[str, Any]

__all__ = [
    "EVAL_DATALOADERS",
    "STEP_OUTPUT",
    "TRAIN_DATALOADERS",
    "LRSchedulerConfig",
    "LRSchedulerConfigType",
    "LRSchedulerPLType",
    "LRSchedulerTypeUnion",
    "MisconfigurationException",
    "OptimizerConfig",
    "OptimizerLRScheduler",
    "OptimizerLRSchedulerConfig",
]
