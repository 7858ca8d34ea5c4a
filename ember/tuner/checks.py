"""The tuner's argument checks, as Lightning's tuner makes them (its words first, then what to do)."""

from __future__ import annotations

from typing import Any

from ember.exceptions import MisconfigurationException
from ember.module import DataModule


def check_tuner_data(train_dataloaders: Any, val_dataloaders: Any, dataloaders: Any, datamodule: DataModule | None,
                      method: str, fit_only: bool) -> DataModule | None:  # fmt: skip
    """The datamodule to tune with (as in Lightning's stages, one may be given where the loaders go), once
    ``method`` and the loaders are checked as Lightning's tuner checks them (Lightning's words first)."""
    methods = ("fit", "validate", "test", "predict")
    if method not in methods:
        raise ValueError(f"method {method!r} is invalid. Should be one of {methods}.")
    if fit_only and method != "fit":
        raise MisconfigurationException(
            f"method='fit' is the only valid configuration to run lr finder (it tunes training): method={method!r}"
        )
    if method == "fit" and dataloaders is not None:
        raise MisconfigurationException(
            "In tuner with method='fit', `dataloaders` argument should be None, please consider setting "
            "`train_dataloaders` and `val_dataloaders` instead"
        )
    if method != "fit" and (train_dataloaders is not None or val_dataloaders is not None):
        raise MisconfigurationException(
            f"In tuner with `method`={method!r}, `train_dataloaders` and `val_dataloaders` arguments should be None, "
            "please consider setting `dataloaders` instead"
        )
    given = train_dataloaders if method == "fit" else dataloaders
    return given if isinstance(given, DataModule) else datamodule


def check_scale_batch_size(mode: str, lr_scaling: str | None, margin: float, **counts: int) -> None:
    if mode not in ("power", "binsearch"):
        raise MisconfigurationException(  # Lightning's words first
            f"`mode` should be either of ('power', 'binsearch'): scale_batch_size(mode={mode!r})"
        )
    if not 0.0 <= margin < 1.0:
        raise MisconfigurationException(f"scale_batch_size(margin={margin!r}): choose a fraction in [0, 1)")
    if lr_scaling not in (None, "linear", "sqrt"):
        raise MisconfigurationException(f"scale_batch_size(lr_scaling={lr_scaling!r}): choose None, 'linear' or 'sqrt'")
    for name, value in counts.items():
        least = 0 if name == "max_trials" else 1  # no trial: init_val is the size, as in Lightning
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            allowed = "an int >= 0" if least == 0 else "a positive int"
            raise MisconfigurationException(f"scale_batch_size({name}={value!r}) must be {allowed}")


def lowered(mode: Any) -> Any:
    """A search's ``mode`` as Lightning reads it, in any case ("Power" is "power")."""
    return mode.lower() if isinstance(mode, str) else mode


def check_lr_find(mode: str, min_lr: float, max_lr: float, num_training: int) -> None:
    """Refuse a sweep that cannot run (a ``min_lr`` above ``max_lr`` sweeps downwards, as Lightning's does)."""
    if mode not in ("exponential", "linear"):  # Lightning's words first
        raise MisconfigurationException(f"`mode` should be either of ('linear', 'exponential'): lr_find(mode={mode!r})")
    if not (min_lr > 0 and max_lr > 0):
        raise MisconfigurationException(f"lr_find(min_lr={min_lr}, max_lr={max_lr}): both must be positive")
    if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 1:
        raise MisconfigurationException(f"lr_find(num_training={num_training!r}) must be a positive int")
