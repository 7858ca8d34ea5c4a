"""``BasePredictionWriter``: write predictions as they are made, or all of them at the end."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class WriteInterval(str, Enum):
    """When a ``BasePredictionWriter`` writes; a ``str``, so ``writer.interval == "epoch"`` holds."""

    BATCH = "batch"
    EPOCH = "epoch"
    BATCH_AND_EPOCH = "batch_and_epoch"

    @property
    def on_batch(self) -> bool:
        return self is not WriteInterval.EPOCH

    @property
    def on_epoch(self) -> bool:
        return self is not WriteInterval.BATCH


class BasePredictionWriter(Callback):
    """Subclass it and define ``write_on_batch_end`` (``write_interval="batch"``), ``write_on_epoch_end``
    (``"epoch"``) or both (``"batch_and_epoch"``). Each process writes its own share of the predictions,
    with the sample indices of the dataset they belong to, so that they can be put back in order.
    """

    def __init__(self, write_interval: Literal["batch", "epoch", "batch_and_epoch"] = "batch") -> None:
        intervals = [interval.value for interval in WriteInterval]
        if write_interval not in intervals:
            raise MisconfigurationException(
                f"BasePredictionWriter: `write_interval` should be one of {intervals}, got {write_interval!r}"
            )
        self.interval = WriteInterval(write_interval)  # Lightning's attribute

    @property
    def wants_predictions(self) -> bool:  # type: ignore[override]
        return self.interval.on_epoch

    def write_on_batch_end(
        self, trainer: Trainer, pl_module: Module, prediction: Any, batch_indices: Sequence[int] | None, batch: Any,
        batch_idx: int, dataloader_idx: int,
    ) -> None:  # fmt: skip
        """Write one batch's ``prediction``; ``batch_indices`` are its samples' indices in the dataset."""
        raise NotImplementedError(f"{type(self).__name__} must define write_on_batch_end for write_interval='batch'")

    def write_on_epoch_end(
        self, trainer: Trainer, pl_module: Module, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        """Write every prediction (a list per loader when there are several); ``batch_indices`` holds, per
        loader, each batch's sample indices."""
        raise NotImplementedError(f"{type(self).__name__} must define write_on_epoch_end for write_interval='epoch'")

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.interval.on_batch:
            indices = trainer.predict_loop.current_batch_indices
            self.write_on_batch_end(trainer, pl_module, outputs, indices, batch, batch_idx, dataloader_idx)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self.interval.on_epoch:
            loop = trainer.predict_loop
            self.write_on_epoch_end(trainer, pl_module, loop.predictions, loop.epoch_batch_indices)
