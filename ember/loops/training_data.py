"""What a fit trains on and when it validates: the training loader with its batches per epoch and the order it
reads, the validation loaders and their schedule. One ``TrainingData`` per fit; it asks for the loaders when they
are first needed, and again when ``reload_dataloaders_every_n_epochs`` says."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ember._utils import batch_size_of, parse_max_time
from ember.combined_loader import CombinedLoader
from ember.data import (
    count_batches,
    data_replicas,
    epoch_batches,
    order_reads,
    with_last_flag,
)
from ember.data_failures import named_failures, numbered_batches
from ember.exceptions import MisconfigurationException, PossibleUserWarning
from ember.loops.evaluate import EvaluationLoop, sanity_counts
from ember.loops.progress import Progress
from ember.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from ember.trainer import Trainer


class TrainingData:
    """The training loader of a fit (``loader``), the batches of an epoch (``num_batches``, ``math.inf`` when the
    loader has no length) and the validation (``validation``).

    As in Lightning, the training loader is asked for (``load``) when first needed: before ``on_train_start``,
    after the sanity check, unless something needs it earlier (``estimated_stepping_batches`` in
    ``configure_optimizers``, the position of a resumed checkpoint). It is asked for again every
    ``reload_dataloaders_every_n_epochs`` epochs, counted from the first epoch that reads it.
    """

    def __init__(self, trainer: Trainer, load: Callable[[], list[Iterable]], loaders_given: bool) -> None:
        self._trainer = trainer
        self._load = load
        #: Whether the training loaders were passed to ``fit`` (else the module or the datamodule makes them).
        self.loaders_given = loaders_given
        self.validation = ValidationSchedule(trainer, None)  # none until ``validate_on`` (after ``setup``) says
        self.loader: Iterable | None = None
        self.num_batches = 0.0
        self._first_epoch: int | None = None  # the first epoch that read the loader
        self._replicas = 1  # the ranks that read disjoint shards of the data
        # For a loader that reads an EpochOrder: (samples of the order a batch of every rank reads, its length).
        self._order: tuple[int, int] | None = None

    def validate_on(self, load: Callable[[], list[Iterable]] | None) -> None:
        """Validate on what ``load`` gives (None: no validation): known once ``setup`` has run, which may already
        have asked for the training loader."""
        self.validation = ValidationSchedule(self._trainer, load)
        if self.num_batches:
            self.validation.plan(self.num_batches)

    def load(self) -> None:
        """Ask for the training loader, unless it is there."""
        if self.loader is not None:
            return
        trainer = self._trainer
        config = trainer.config
        if config.limit_train_batches == 0:  # as Lightning: training turned off never asks for its loader
            return
        self.loader = loader = self._load()[0]  # the one loader (a CombinedLoader of several) the fit gets
        self.num_batches = count_batches(loader, config.limit_train_batches, "limit_train_batches", trainer.strategy)
        self._replicas = data_replicas(loader)
        self._order = order_reads(loader)
        if not self.num_batches:  # fit ends here: no batches to train on (an empty loader was warned about)
            return
        self.validation.plan(self.num_batches)
        if trainer.loggers and self.num_batches < config.log_every_n_steps and not config.fast_dev_run:
            rank_zero_warn(
                f"The number of training batches ({self.num_batches}) is smaller than the logging interval "
                f"Trainer(log_every_n_steps={config.log_every_n_steps}): step values are written less often than "
                "once an epoch; lower log_every_n_steps to see them every epoch.",
                PossibleUserWarning,
            )

    def reload(self) -> None:
        """Ask for the loaders again when next needed, those already asked for now (what they read has changed:
        the batch size a ``BatchSizeFinder`` found)."""
        loaded = self.loader is not None
        self.loader = self.validation.loaders = None
        if loaded:
            self.load()

    def load_before_training(self) -> None:
        """Ask for the training loader, and as Lightning (for the progress bar's counts) the validation loaders when
        the first epoch validates and the sanity check did not ask for them."""
        self.load()
        if self.num_batches and self.validation.selects(self._trainer.current_epoch):
            self.validation.load_when_due()

    def start_epoch(self, epoch: int) -> None:
        """As ``epoch`` starts, ask for the training loader if it is not there, or again when
        ``reload_dataloaders_every_n_epochs`` says it is time."""
        every = self._trainer.config.reload_dataloaders_every_n_epochs
        if self._first_epoch is not None and every and epoch - self._first_epoch >= every:
            self.loader = self._first_epoch = None
        self.load()
        if self._first_epoch is None:
            self._first_epoch = epoch

    def batches(self, trainer: Trainer, progress: Progress, seed: int) -> Generator[tuple[int, Any, bool], None, None]:
        """``(batch_idx, batch, is_last)`` for the rest of the current epoch, from where ``progress`` is; the
        order follows from ``seed`` and the epoch."""
        assert self.loader is not None
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
    """When ``fit`` validates (every ``every`` training batches, or at the end of each epoch when ``every`` is
    None, in the epochs ``check_val_every_n_epoch`` selects), and on which loaders.

    As in Lightning, the validation loaders are asked for when a validation (or the sanity check) first needs
    them, and again at the first validation ``reload_dataloaders_every_n_epochs`` epochs after the epoch they were
    asked for (a sanity check before an epoch that does not validate counts for none)."""

    def __init__(self, trainer: Trainer, load: Callable[[], list[Iterable]] | None) -> None:
        config = trainer.config
        self._trainer = trainer
        self._load = load
        self.every: int | None = None
        self.every_n_epochs = config.check_val_every_n_epoch
        #: Whether fit validates at all: there is a validation_step, something to validate on, and batches to take.
        self.enabled = load is not None and config.limit_val_batches != 0
        self.loaders: list[Iterable] | None = None
        self.counts: list[float] = []
        self._loaded_for = -math.inf  # the epoch whose validation asked for the loaders
        # A time-based val_check_interval: (its seconds, when training started or last validated: time.monotonic).
        self._timer: tuple[float, float] | None = None

    def plan(self, num_batches: float) -> None:
        """Set ``every`` from the training batches of an epoch (``num_batches``) and ``val_check_interval``."""
        interval = self._trainer.config.val_check_interval
        if isinstance(interval, (str, timedelta, Mapping)):
            seconds = parse_max_time(interval, flag="val_check_interval")
            assert seconds is not None  # (checked with the flags)
            since = self._timer[1] if self._timer is not None else time.monotonic()  # (a reload keeps the count)
            self.every, self._timer = None, (seconds, since)
            return
        if isinstance(interval, float):
            self.every = None if interval == 1.0 else _fraction_of_epoch(interval, num_batches)
            return
        if self.every_n_epochs is not None and interval > num_batches:
            raise ValueError(
                f"val_check_interval={interval} must be less than or equal to the number of the training batches "
                f"of an epoch ({num_batches}); lower it, or set check_val_every_n_epoch=None to count batches "
                "across epochs"
            )
        self.every = interval

    def selects(self, epoch: int) -> bool:
        """Whether to validate at all in ``epoch`` (counted from 0)."""
        return self.enabled and (self.every_n_epochs is None or (epoch + 1) % self.every_n_epochs == 0)

    def due(self, progress: Progress, batch_idx: int, is_last: bool) -> bool:
        """Whether to validate after training batch ``batch_idx`` (``is_last``: the epoch's last) of an epoch
        that it ``selects``."""
        if self._timer is not None:
            seconds, since = self._timer
            return time.monotonic() - since >= seconds
        if self.every is None:
            return is_last
        if self.every_n_epochs is None:
            return progress.total_batches % self.every == 0
        return (batch_idx + 1) % self.every == 0

    def run(self, loop: EvaluationLoop, sanity_check: bool = False) -> None:
        """Validate (the ``sanity_check``: on at most ``num_sanity_val_steps`` batches of each loader)."""
        self.load_when_due(sanity_check)
        steps = self._trainer.config.num_sanity_val_steps if sanity_check else -1
        if sum(sanity_counts(self.counts, steps)):
            loop.run(self.loaders or [], self.counts, sanity_check=sanity_check, fitting=True)
        if self._timer is not None and not sanity_check:  # the time counts again from the end of this validation
            self._timer = (self._timer[0], time.monotonic())

    def sanity_check(self, loop: EvaluationLoop) -> None:
        """The sanity check's validation between its hooks, which read its values; as in Lightning, they are
        forgotten once it ends (they describe nothing)."""
        hooks = self._trainer.hooks
        hooks.call_callbacks("on_sanity_check_start")
        self.run(loop, sanity_check=True)
        hooks.call_callbacks("on_sanity_check_end")
        self._trainer.run_metrics.reset(fitting=True)

    def load_when_due(self, sanity_check: bool = False) -> None:
        """Ask for the loaders if they are not there, or again when ``reload_dataloaders_every_n_epochs`` says."""
        epoch, every = self._trainer.current_epoch, self._trainer.config.reload_dataloaders_every_n_epochs
        if self.loaders is not None and not (every and epoch - self._loaded_for >= every):
            return
        assert self._load is not None
        self.loaders = self._load()
        loop = self._trainer.validate_loop  # trainer.num_val_batches counts them from here on, as Lightning's
        self.counts = loop.num_batches = loop.count(self.loaders)
        if not sanity_check or self.selects(epoch):
            self._loaded_for = epoch


def _fraction_of_epoch(fraction: float, num_batches: float) -> int:
    if math.isinf(num_batches):
        raise MisconfigurationException(  # Lightning's words first
            "When using an IterableDataset for `train_dataloader`, `Trainer(val_check_interval)` must be time based, "
            f"`1.0` or an int: val_check_interval={fraction} is a fraction of an epoch, but the train dataloader has "
            "no length; pass a number of batches (an int), 1.0, or a duration instead"
        )
    return max(1, int(num_batches * fraction))
