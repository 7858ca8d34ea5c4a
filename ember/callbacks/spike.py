"""``SpikeDetection``: stop training at a loss spike, and write down the batches to skip when rerunning."""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class TrainingSpikeException(RuntimeError):
    """Raised by ``SpikeDetection`` at the batch whose loss spiked."""

    def __init__(self, batch_idx: int, *args: Any) -> None:
        super().__init__(f"Training spike detected in batch {batch_idx}", *args)


class SpikeDetection(Callback):
    """Ends training with a ``TrainingSpikeException`` when a training loss spikes, as Lightning's callback.

    A loss spikes when it is not an improvement on the last loss (lower, with ``mode="min"``) and differs from the
    mean of the last ``window`` losses by at least ``atol`` and by at least ``rtol`` times that mean (a tolerance
    of None always holds), from batch ``warmup`` of an epoch on. With ``finite_only``, a NaN or infinite loss is a
    spike too; without, only an infinity on the wrong side (``+inf`` with ``mode="min"``) is. Each process checks
    its own loss, and a spike on any stops them all.

    Before raising, the batch and the one before it (which may have damaged the weights) are added to
    ``bad_batches`` and written, as a JSON list of batch indices, to ``exclude_batches_path``: a ``.json`` file,
    or a directory to hold ``skip_batches.json`` (by default the Trainer's ``default_root_dir``).
    """

    def __init__(
        self,
        mode: Literal["min", "max"] = "min",
        window: int = 10,
        warmup: int = 1,
        atol: float | None = None,
        rtol: float | None = 2.0,
        exclude_batches_path: str | os.PathLike[str] | None = None,
        finite_only: bool = True,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"Invalid mode. Has to be min or max, found {mode}: SpikeDetection(mode={mode!r})")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SpikeDetection(window={window!r}): expected a positive number of batches")
        self.mode = mode
        self.warmup = warmup
        self.atol = atol
        self.rtol = rtol
        self.exclude_batches_path = exclude_batches_path
        self.finite_only = finite_only
        self.bad_batches: list[int] = []
        self.last_val: float = 0.0
        self._recent: collections.deque[float] = collections.deque(maxlen=window)

    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        # Once, after a resumed fit has restored the path: a directory gets the file's name.
        if self.exclude_batches_path is None:
            self.exclude_batches_path = os.path.join(trainer.default_root_dir, "skip_batches.json")
        if not str(self.exclude_batches_path).endswith(".json"):
            self.exclude_batches_path = os.path.join(self.exclude_batches_path, "skip_batches.json")

    @torch.no_grad()
    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = _loss_of(outputs)
        value = float(loss.float().mean())  # one host sync per batch: the check needs the value
        spiked = batch_idx >= self.warmup and self._is_spike(value)
        # Each process checks its own loss; a spike on any stops all of them together.
        if trainer.strategy.reduce(torch.tensor(float(spiked), device=loss.device), reduce_op="max"):
            self._handle_spike(trainer, batch_idx)
        elif math.isfinite(value):
            self._recent.append(value)
            self.last_val = value

    def _is_spike(self, value: float) -> bool:
        if self.finite_only and not math.isfinite(value):
            return True
        # Otherwise a NaN is no spike (it compares with nothing) and -inf is an improvement, but +inf is as far
        # above the mean as a loss can be, as in Lightning.
        difference = value - self.last_val
        if (difference <= 0) if self.mode == "min" else (difference >= 0):
            return False
        mean = sum(self._recent) / len(self._recent) if self._recent else math.nan
        return (self.atol is None or abs(value - mean) >= abs(self.atol)) and (
            self.rtol is None or abs(value - mean) >= abs(self.rtol * mean)
        )

    def _handle_spike(self, trainer: Trainer, batch_idx: int) -> None:
        self.bad_batches.extend([batch_idx - 1, batch_idx])
        path = os.fspath(self.exclude_batches_path or "skip_batches.json")
        if trainer.is_global_zero:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as file:
                json.dump(self.bad_batches, file, indent=4)
        raise TrainingSpikeException(batch_idx=batch_idx)

    def state_dict(self) -> dict[str, Any]:
        path = self.exclude_batches_path
        return {
            "last_val": self.last_val,
            "mode": self.mode,
            "warmup": self.warmup,
            "atol": self.atol,
            "rtol": self.rtol,
            "bad_batches": list(self.bad_batches),
            "bad_batches_path": None if path is None else os.fspath(path),
            "recent": list(self._recent),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_val = state_dict["last_val"]
        self.mode = state_dict["mode"]
        self.warmup = state_dict["warmup"]
        self.atol = state_dict["atol"]
        self.rtol = state_dict["rtol"]
        self.bad_batches = list(state_dict["bad_batches"])
        self.exclude_batches_path = state_dict["bad_batches_path"]
        self._recent.clear()
        self._recent.extend(state_dict.get("recent", []))


def _loss_of(outputs: Any) -> torch.Tensor:
    """The training step's loss, from what ``on_train_batch_end`` receives."""
    if isinstance(outputs, torch.Tensor):
        return outputs.detach()
    if isinstance(outputs, Mapping):
        return outputs["loss"].detach()
    raise TypeError(f"outputs have to be of type torch.Tensor or Mapping, got {type(outputs).__qualname__}")
