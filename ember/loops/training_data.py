"""What a fit trains on and when it validates: the training loader with its batches per epoch and the order it
reads, the validation loaders and their schedule. One ``TrainingData`` per fit, built again when the loaders are
reloaded (``reload_dataloaders_every_n_epochs``)."""

from __future__ import annotations

import math
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

from ember._utils import batch_size_of
from ember.combined_loader import CombinedLoader
from ember.data import (
    count_batches,
    data_replicas,
    epoch_batches,
    order_reads,
    with_last_flag,
)
from ember.data_failures import named_failures, numbered_batches
from ember.exceptions import MisconfigurationException
from ember.loops.progress import Progress

if TYPE_CHECKING:
    from ember.loops.evaluate import EvaluationLoop
    from ember.trainer import Trainer


class TrainingData:
    """The training loader of a fit (``loader``), the batches of an epoch (``num_batches``, ``math.inf`` when the
    loader has no length) and the validation (``validation``)."""

    def __init__(self, trainer: Trainer, loader: Iterable, val_loaders: list[Iterable]) -> None:
        config = trainer.config
        self.loader = loader
        self.num_batches = count_batches(loader, config.limit_train_batches, "limit_train_batches")
        if self.num_batches == 0 and config.limit_train_batches != 0:
            raise ValueError("the train dataloader is empty: it has no batches to train on")
        self.validation = ValidationSchedule.build(trainer, self.num_batches, val_loaders)
        self._replicas = data_replicas(loader)  # the ranks that read disjoint shards of the data
        # For a loader that reads an EpochOrder: (samples of the order a batch of every rank reads, its length).
        self._order = order_reads(loader)

    def batches(self, trainer: Trainer, progress: Progress, seed: int) -> Generator[tuple[int, Any, bool], None, None]:
        """``(batch_idx, batch, is_last)`` for the rest of the current epoch, from where ``progress`` is; the
        order follows from ``seed`` and the epoch."""
        if isinstance(self.loader, CombinedLoader) and self.loader.mode == "sequential":
            raise MisconfigurationException(
                "the `FitLoop` does not support a CombinedLoader in the 'sequential' mode: training reads its loaders "
                "together; choose 'max_size_cycle', 'max_size' or 'min_size'"
            )
        first = progress.epoch_batches
        batches = epoch_batches(
            self.loader, progress.epoch, first, seed, trainer.global_rank, start_sample=progress.epoch_samples
        )
        loader_batches = trainer.profiler.timed_batches(batches, "train")
        where = f"the train dataloader in epoch {progress.epoch}"
        if math.isinf(self.num_batches):
            # Without a length, the last batch is found by looking one batch ahead.
            flagged = with_last_flag(named_failures(loader_batches, where, first))
            return ((index, batch, is_last) for index, (batch, is_last) in enumerate(flagged, first))
        return numbered_batches(loader_batches, where, first, int(self.num_batches) - 1)

    @property
    def samples_per_batch(self) -> int:
        """The samples of the epoch's order that a batch of every rank reads together, but for the epoch's last
        (0: counted per batch, ``samples_of``)."""
        return self._order[0] if self._order is not None else 0

    def samples_of(self, batch: Any, progress: Progress) -> int:
        """The samples of the epoch's global order that this batch and those of the other ranks read: counted
        from the loader when it reads an ``EpochOrder`` (a batch's first tensor may not be batch-first)."""
        if self._order is None:
            return batch_size_of(batch) * self._replicas
        per_batch, length = self._order
        return max(0, min(per_batch, length - progress.epoch_samples))  # the order's end is padded


class ValidationSchedule:
    """When ``fit`` validates: every ``every`` training batches, or at the end of each epoch (``every`` is
    None), in the epochs ``check_val_every_n_epoch`` selects."""

    def __init__(self, every: int | None, every_n_epochs: int | None, loaders: list[Iterable],
                 counts: list[float]) -> None:  # fmt: skip
        self.every = every
        self.every_n_epochs = every_n_epochs
        self.loaders = loaders
        self.counts = counts
        self.enabled = sum(counts) > 0

    @classmethod
    def build(cls, trainer: Trainer, num_batches: float, loaders: list[Iterable]) -> ValidationSchedule:
        config = trainer.config
        interval, per_epoch = config.val_check_interval, config.check_val_every_n_epoch
        every: int | None
        if isinstance(interval, float):
            every = None if interval == 1.0 else _fraction_of_epoch(interval, num_batches)
        else:
            if per_epoch is not None and interval > num_batches:
                raise ValueError(
                    f"val_check_interval={interval} is more than the {num_batches} training batches of an epoch; "
                    "lower it, or set check_val_every_n_epoch=None to count batches across epochs"
                )
            every = interval
        return cls(every, per_epoch, loaders, trainer.validate_loop.count(loaders))

    def selects(self, epoch: int) -> bool:
        """Whether to validate at all in ``epoch`` (counted from 0)."""
        return self.enabled and (self.every_n_epochs is None or (epoch + 1) % self.every_n_epochs == 0)

    def due(self, progress: Progress, batch_idx: int, is_last: bool) -> bool:
        """Whether to validate after training batch ``batch_idx`` (``is_last``: the epoch's last) of an epoch
        that it ``selects``."""
        if self.every is None:
            return is_last
        if self.every_n_epochs is None:
            return progress.total_batches % self.every == 0
        return (batch_idx + 1) % self.every == 0

    def run(self, loop: EvaluationLoop, limit: int | None = None) -> None:
        """Validate, on at most ``limit`` batches of each loader (-1 or None: all)."""
        counts = self.counts if limit is None or limit == -1 else [min(count, limit) for count in self.counts]
        loop.run(self.loaders, counts, sanity_check=limit is not None)


def _fraction_of_epoch(fraction: float, num_batches: float) -> int:
    if math.isinf(num_batches):
        raise ValueError(
            f"val_check_interval={fraction} is a fraction of an epoch, but the train dataloader has no "
            "length; pass a number of batches instead"
        )
    return max(1, int(num_batches * fraction))
