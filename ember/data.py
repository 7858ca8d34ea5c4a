"""DataLoaders as the Trainer uses them: prepared for the device and the process layout, counted, iterated,
and able to resume in the middle of an epoch.

The order of a training epoch depends only on a data seed (drawn once per run and saved in its
checkpoints) and the epoch number, never on the global random state. A resumed run can therefore
skip exactly the batches its predecessor consumed by skipping their indices, without reading them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from ember._utils import apply_to_tensors, sized_len
from ember.combined_loader import CombinedLoader
from ember.data_failures import DataLoadingError as DataLoadingError  # served here too (ember.data.X)
from ember.data_failures import SampleError as SampleError
from ember.data_failures import SampleNamed
from ember.data_workers import WorkerStart, check_workers, stop_signals_held
from ember.data_workers import WorkerSuggestion as WorkerSuggestion  # served here too (ember.data.X)
from ember.data_workers import cores_per_process as cores_per_process
from ember.data_workers import suggest_num_workers as suggest_num_workers
from ember.exceptions import MisconfigurationException, PossibleUserWarning
from ember.lightning_compat.hook import is_installed as lightning_names_served
from ember.rank_zero import rank_zero_warn, rank_zero_warn_once

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy


class EpochOrder(Sampler[int]):
    """This rank's part of an epoch's global order, from position ``start`` of it on.

    The global order is a function of the run's data seed, the epoch and the dataset's length only: a
    permutation drawn from ``seed + epoch`` when shuffling (the order ``DistributedSampler`` draws), or
    0..N-1. It is the same whatever the number of ranks or the batch size. Rank r of W reads positions
    r, r+W, r+2W, ... of what remains after ``start``, padded as ``DistributedSampler`` pads so that
    every rank reads as many. After every rank has read n batches of b, the ranks together have read
    exactly the first n*b*W positions: a resumed run, with any W and b, continues at that position.
    """

    def __init__(self, length: int, shuffle: bool, num_replicas: int = 1, rank: int = 0) -> None:
        self.length = length
        self.shuffle = shuffle
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = 0
        self.epoch = 0
        #: Positions of the epoch's global order already read (by a run this one resumes).
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        remaining = self.global_order()[self.start :]
        total = len(self) * self.num_replicas
        while remaining and len(remaining) < total:  # every rank reads as many
            remaining += remaining[: total - len(remaining)]
        return iter(remaining[self.rank : total : self.num_replicas])

    def __len__(self) -> int:
        return self.length_from(self.start)

    def length_from(self, start: int) -> int:
        """How many positions this rank reads of the epoch when it continues at position ``start``."""
        return math.ceil(max(0, self.length - start) / self.num_replicas)


class _Skippable(Sampler[Any]):
    """Yields what ``inner`` yields, leaving out the first ``skip`` items (in a resumed run's first epoch,
    the batches its predecessor already consumed); only indices are skipped, no data is read.

    ``skip`` is set at the start of every epoch: a DataLoader with workers iterates its sampler twice
    when it starts, so the skip must hold for the whole epoch rather than for one iteration.
    """

    def __init__(self, inner: Iterable[Any]) -> None:
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        return islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Code that inspects loader.batch_sampler (.batch_size, .sampler, ...) sees the wrapped sampler's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def prepare_loader(loader: Iterable, strategy: Strategy, *, train: bool, shard: bool = True) -> Iterable:
    """A copy of ``loader`` as the run needs it; the user's loader itself is not changed.

    - a map-style dataset read in order or shuffled is read through an ``EpochOrder``: with several
      processes each reads its own shard (``shard=False`` opts out), and a training loader's order
      comes from the run's data seed and the epoch, so that a resumed run continues at the very
      sample its predecessor stopped at, with any number of processes and any batch size;
    - other training loaders can at least skip batches (when nothing else changed);
    - a sample that fails to load is named: its index is added to the error;
    - workers are seeded from the data seed too (never from the global random state, which the loader
      would otherwise advance each time it is iterated), and ignore the signals that stop a run;
    - batches bound for a GPU are pinned in host memory, so copies to the device run asynchronously
      (unless the loader pins them already). Worker processes hand over CPU tensors, which the loader
      pins in its background thread (``pin_memory=True``); without workers the dataset runs in this
      process and may yield tensors that are on the GPU already, which cannot be pinned, so the collate
      function pins each batch's CPU tensors and leaves the others as they are.
    """
    if not isinstance(loader, DataLoader) or _is_stateful(loader):
        return loader
    prepared = copy.copy(loader)
    object.__setattr__(prepared, "_iterator", None)  # a loader with persistent workers keeps its iterator
    # DataLoader forbids assigning these after construction; the copy is not shared with anyone.
    if not isinstance(loader.dataset, IterableDataset):
        object.__setattr__(prepared, "dataset", SampleNamed(loader.dataset))
    order = _epoch_order(loader, strategy, train, shard)
    if order is not None:
        object.__setattr__(prepared, "sampler", order)
        if loader.batch_sampler is not None:
            object.__setattr__(prepared, "batch_sampler", BatchSampler(order, loader.batch_size or 1, loader.drop_last))
    elif train and prepared.batch_sampler is not None:
        object.__setattr__(prepared, "batch_sampler", _Skippable(prepared.batch_sampler))
    elif train:
        object.__setattr__(prepared, "sampler", _Skippable(prepared.sampler))
    prepared.generator = torch.Generator().manual_seed(0)  # reseeded per epoch for training
    if strategy.root_device.type == "cuda" and not loader.pin_memory:
        if loader.num_workers > 0:
            prepared.pin_memory = True
        else:
            prepared.collate_fn = functools.partial(_pinned, loader.collate_fn)
    if loader.num_workers > 0:
        prepared.worker_init_fn = WorkerStart(loader.worker_init_fn)
    return prepared


def prepare_loaders(
    given: Any, kind: str, strategy: Strategy, overfit_batches: float, shard: bool, stage: str | None = None
) -> tuple[Any, list[Iterable]]:
    """The loaders of ``kind`` ("train", "val", ...) that a Trainer's method was given (or a module made): as the
    Trainer shows them (``trainer.train_dataloader``, ...: what was given, in its structure), and each prepared
    (``prepare_loader``) for the loops.

    A dict, list or tuple of DataLoaders is several: validation, test and prediction read them one after the
    other; training reads them together, as one ``CombinedLoader`` (in its "max_size_cycle" mode unless one is
    given), so that the loop reads one loader whatever their number. Any other iterable (even a list of batches)
    is one loader. ``overfit_batches`` reads the training and validation data in order (the same batches each
    epoch): the loaders shown are then copies that do. ``stage`` (the Trainer's: "fit", "validate", ...) names, in
    the error for loaders that are not iterable, the method they were given to.
    """
    combined = _combined(given, kind)
    if kind == "predict" and combined is not None and combined.mode != "sequential":
        raise ValueError('`trainer.predict()` only supports the `CombinedLoader(mode="sequential")` mode: got '
                         f'mode="{combined.mode}"; prediction reads its loaders one after the other')  # fmt: skip
    if not all_iterable(given):
        raise invalid_loaders(given, f"passed to `Trainer.{_argument(kind, stage)}=...)`")
    loaders = combined.flattened if combined is not None else [given]
    if overfit_batches and kind in ("train", "val"):
        loaders = [in_order(loader, kind) for loader in loaders]
    if kind != "train" and any(isinstance(getattr(loader, "sampler", None), RandomSampler) for loader in loaders):
        rank_zero_warn(  # as Lightning's: an evaluation's order changes none of its results, so it is likely a slip
            f"Your `{kind}_dataloader`'s sampler has shuffling enabled, it is strongly recommended that you turn "
            "shuffling off for val/test dataloaders.", PossibleUserWarning, stacklevel=5)  # fmt: skip
    if lightning_names_served():  # Lightning's advice, for Lightning's programs (Ember's own have `ember doctor`)
        for loader in loaders:
            check_workers(loader, kind)
    prepared = [prepare_loader(loader, strategy, train=kind == "train", shard=shard) for loader in loaders]
    if combined is None:
        return loaders[0], prepared
    shown = combined.iterables if loaders == combined.flattened else combined.replaced(loaders).iterables
    if kind != "train" and combined.mode == "sequential":
        return shown, prepared
    return shown, [combined.replaced(prepared)]


def all_iterable(given: Any) -> bool:
    """Whether each of the loaders ``given`` is an iterable (checked when a stage starts, not at its first batch).
    A dict, list or tuple holding more than numbers or strings is a structure of loaders."""
    loaders = given.flattened if isinstance(given, CombinedLoader) else CombinedLoader(given).flattened
    return all(isinstance(loader, Iterable) for loader in loaders)


def invalid_loaders(given: Any, place: str) -> TypeError:
    """The error for loaders that are not ``all_iterable``, ``place`` saying where they came from ("passed to
    ...", "returned from ...")."""
    return TypeError(f"An invalid dataloader was {place}. Found {given}: a DataLoader (or another iterable of "
                     "batches, or a dict, list or tuple of them) is needed")  # (Lightning's words first)  # fmt: skip


def _argument(kind: str, stage: str | None) -> str:
    """The Trainer's method and argument that take the loaders of ``kind``, as in ``fit(val_dataloaders``: "val"
    loaders are fit's or validate's, as ``stage`` (the one in progress) says."""
    if kind == "train" or (kind == "val" and stage == "fit"):
        return f"fit({kind}_dataloaders"
    return f"{stage or kind}(dataloaders"


def _combined(given: Any, kind: str) -> CombinedLoader | None:
    """``given`` as a ``CombinedLoader`` when it is one or holds several DataLoaders (else None)."""
    if isinstance(given, CombinedLoader):
        return given
    if not isinstance(given, (Mapping, list, tuple)) or not given:
        return None
    combined = CombinedLoader(given, "max_size_cycle" if kind == "train" else "sequential")
    return combined if all(isinstance(loader, DataLoader) for loader in combined.flattened) else None


def _epoch_order(loader: DataLoader, strategy: Strategy, train: bool, shard: bool) -> EpochOrder | None:
    """The ``EpochOrder`` that replaces ``loader``'s sampler, or None when it keeps its own."""
    options = (strategy.training_sampler_kwargs if train else strategy.distributed_sampler_kwargs) if shard else None
    if options is not None and not _shardable(loader):
        return None
    plain = isinstance(loader.sampler, SequentialSampler) or _plain_shuffle(loader.sampler)
    if not plain or (options is None and not train) or type(loader.batch_sampler) not in (BatchSampler, type(None)):
        return None
    shuffle = isinstance(loader.sampler, RandomSampler)
    layout = options or {"num_replicas": 1, "rank": 0}
    return EpochOrder(len(loader.dataset), shuffle, layout["num_replicas"], layout["rank"])  # type: ignore[arg-type]


def _pinned(collate: Callable[[Any], Any], samples: Any) -> Any:
    """The batch ``collate`` makes of ``samples``, its CPU tensors pinned."""
    return apply_to_tensors(
        collate(samples), lambda tensor: tensor.pin_memory() if tensor.device.type == "cpu" else tensor
    )


def _plain_shuffle(sampler: Any) -> bool:
    """A ``RandomSampler`` that draws a permutation (not with replacement, not a subset)."""
    return isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None


def _shardable(loader: DataLoader) -> bool:
    """Whether a sampler can give each rank its shard of ``loader``'s data (a warning says why not)."""
    if isinstance(loader.sampler, DistributedSampler):
        return False  # the user sharded the data already
    if isinstance(loader.dataset, IterableDataset):
        rank_zero_warn_once(
            "an IterableDataset cannot be sharded by a sampler: each rank reads what its dataset yields, so "
            "shard it yourself (torch.utils.data.get_worker_info() and the rank) or every rank sees the same data",
            stacklevel=3,
        )
        return False
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        rank_zero_warn_once(
            "a DataLoader with a custom batch_sampler is left as it is: every rank gets the same batches unless "
            "the batch sampler shards them (use_distributed_sampler=False silences this)",
            stacklevel=3,
        )
        return False
    if not (isinstance(loader.sampler, SequentialSampler) or _plain_shuffle(loader.sampler)):
        rank_zero_warn_once(
            f"a DataLoader with a {type(loader.sampler).__name__} is left as it is: every rank draws from the "
            "whole dataset; give it a DistributedSampler of your own to shard it",
            stacklevel=3,
        )
        return False
    return True


def release_workers(loader: Iterable) -> None:
    """End the worker processes a loader with ``persistent_workers`` keeps between epochs (they would
    otherwise be left to the interpreter's exit, which waits for them)."""
    if isinstance(loader, CombinedLoader):
        for part in loader.flattened:
            release_workers(part)
    iterator = getattr(loader, "_iterator", None) if isinstance(loader, DataLoader) else None
    # A StatefulDataLoader keeps its iterator without workers too: that one has no workers to end.
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        object.__setattr__(loader, "_iterator", None)


def count_batches(loader: Iterable, limit: int | float | None, flag: str, strategy: Strategy | None = None) -> float:
    """How many batches of ``loader`` a run uses (``math.inf`` for loaders without a length). With the ``strategy``
    of the stage, its length is checked on every rank first (``has_len_all_ranks``, with its warnings)."""
    if limit == 0:
        return 0
    sized = has_len_all_ranks(loader, strategy) if strategy is not None else sized_len(loader) is not None
    available = len(loader) if sized else math.inf  # type: ignore[arg-type]
    if limit is None or available == 0:
        return available
    if isinstance(limit, int):
        return min(available, limit)
    if math.isinf(available):
        if limit == 1.0:
            return available
        raise MisconfigurationException(  # Lightning's words first
            f"When using an `IterableDataset`, `Trainer({flag})` must be `1.0` or an int: {flag}={limit} is a "
            "fraction, but the dataloader has no length; pass a number of batches instead"
        )
    if limit > 0 and available * limit < 1:  # as Lightning: not silently one batch more than was asked for
        loader = flag.removeprefix("limit_").removesuffix("_batches") + "_dataloader"
        raise MisconfigurationException(
            f"You requested to check {limit} of the `{loader}` but {limit} * {available} < 1: {flag}={limit} "
            f"takes no batch. Please increase it, to at least {flag}={1 / available:g}, or pass a number of batches"
        )
    return int(available * limit)


def has_iterable_dataset(dataloader: object) -> bool:
    """Whether ``dataloader`` reads an ``IterableDataset`` (Lightning's ``utilities.data.has_iterable_dataset``)."""
    return isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def has_len_all_ranks(
    dataloader: object, strategy: Strategy, allow_zero_length_dataloader_with_multiple_devices: bool = False
) -> bool:
    """Whether ``dataloader`` has a length (Lightning's ``utilities.data.has_len_all_ranks``); the lengths of all
    ranks are summed, so that a loader empty on every rank is warned about, and one empty on this rank only (where
    the others would wait for it at their first collective) is refused unless it is allowed. A length that an
    ``IterableDataset`` announces is warned about: it is only right if the dataset shards itself between
    workers. Call it on every rank alike (it is a collective once the processes are connected)."""
    local = sized_len(dataloader)
    if local is None:
        return False
    name = type(dataloader).__name__
    total = local
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        total = int(strategy.reduce(torch.tensor(local, device=strategy.root_device), reduce_op="sum").item())
    if total == 0:
        rank_zero_warn(f"Total length of `{name}` across ranks is zero: it has no batches to run.")
    elif local == 0:
        if not allow_zero_length_dataloader_with_multiple_devices:
            raise RuntimeError(
                f"`{name}` within local rank has zero length, while other ranks have batches (which would wait for "
                "this one): give every rank at least one batch"
            )
        # Said by the rank it concerns, which need not be rank zero.
        warnings.warn(f"`{name}` has zero length on this rank, but not on the others: the ranks run unevenly many "
                      "batches", stacklevel=2)  # fmt: skip
    if has_iterable_dataset(dataloader):
        rank_zero_warn(
            "Your `IterableDataset` has `__len__` defined: with several loader workers (num_workers > 1) or "
            "processes, that length is only right if the dataset gives each its own share "
            "(torch.utils.data.get_worker_info()); otherwise they yield the same samples."
        )
    return True


# ----------------------------------------------------------------------------- epochs and resuming
def epoch_batches(
    loader: Iterable, epoch: int, skip: int, seed: int, rank: int, *, start_sample: int | None = None
) -> Iterator[Any]:
    """Iterate ``loader`` for ``epoch``, continuing a resumed epoch: from position ``start_sample`` of the
    epoch's global order when the loader reads through an ``EpochOrder``, else after its first ``skip``
    batches (a ``CombinedLoader``'s are read again: its loaders read the epoch's order from its start).

    ``seed`` is the run's data seed: it sets the order of the training loaders the Trainer prepared,
    and the seeds of their workers, for this epoch and rank.
    """
    if isinstance(loader, CombinedLoader):
        for part in loader.flattened:
            _start_epoch(part, epoch, 0, seed, rank, None)
    else:
        skip = _start_epoch(loader, epoch, skip, seed, rank, start_sample)
    iterator = loader_batches(loader)
    return islice(iterator, skip, None) if skip and isinstance(loader, (Sequence, CombinedLoader)) else iterator


def _start_epoch(loader: Iterable, epoch: int, skip: int, seed: int, rank: int, start_sample: int | None) -> int:
    """Set a loader the Trainer prepared to read ``epoch`` (see ``epoch_batches``); returns how many of its first
    batches are still to be skipped by reading them."""
    if not isinstance(loader, DataLoader):
        return skip
    sampler = _unwrapped(loader.sampler)
    index_sampler = _unwrapped(loader.batch_sampler) if loader.batch_sampler is not None else sampler
    if isinstance(sampler, EpochOrder):
        sampler.seed = seed
        sampler.start, skip = (start_sample, 0) if start_sample is not None else (0, skip)
    for candidate in (sampler, getattr(index_sampler, "sampler", None)):
        set_epoch = getattr(candidate, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            break
    if loader.generator is not None and not _is_stateful(loader):
        # Persistent workers keep the seeds of the epoch that started them, in a resumed run too.
        worker_epoch = 0 if loader.persistent_workers else epoch
        loader.generator.manual_seed((seed * 1_000_003 + worker_epoch * 10_007 + rank) % 2**63)
    skipper = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    if isinstance(skipper, _Skippable):
        skipper.skip, skip = skip, 0
    return skip


def loader_batches(loader: Iterable) -> Iterator[Any]:
    """``iter(loader)``, but the batches alone for a ``CombinedLoader``; for a DataLoader with workers, one that
    ends them as soon as it is closed early (the loops close their batches when a step raises or training
    stops)."""
    if isinstance(loader, CombinedLoader):
        return loader.batches(loader_batches)
    starts_workers = isinstance(loader, DataLoader) and isinstance(loader.worker_init_fn, WorkerStart)
    with stop_signals_held() if starts_workers else contextlib.nullcontext():
        iterator = iter(loader)
    if isinstance(loader, DataLoader) and loader.num_workers > 0 and not loader.persistent_workers:
        return _ending_workers(iterator)
    return iterator


def limited(loader: Iterable, count: float) -> Generator[Any, None, None]:
    """The first ``count`` batches of ``loader`` (all of them for ``math.inf``), as ``loader_batches`` gives them;
    closed early, it closes them (ending the loader's workers)."""
    batches = loader_batches(loader)
    try:
        yield from (batches if math.isinf(count) else islice(batches, int(count)))
    finally:
        if isinstance(batches, Generator):
            batches.close()


def _ending_workers(iterator: Iterator[Any]) -> Iterator[Any]:
    """The batches of ``iterator``, whose workers end when this generator is closed.

    Left to the garbage collector, workers outlive an error for long: a traceback that refers to the loop
    keeps the DataLoader's iterator alive, and once the collector breaks such a cycle the iterator's queues
    are finalized before it can tell its workers to stop, so it waits 5 s for each. (Persistent workers
    outlive an epoch; the Trainer ends them with the stage.)
    """
    try:
        yield from iterator
    finally:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def batches_from(loader: Iterable, sample: int) -> int | None:
    """How many batches this rank reads of an epoch of ``loader`` that continues at position ``sample`` of
    its global order; None when ``loader`` cannot continue at a sample (it reads no ``EpochOrder``)."""
    order = _order_read_by(loader)
    if order is None:
        return None
    samples, batch_size = order.length_from(sample), getattr(loader, "batch_size", None)
    if batch_size is None:
        return samples
    return samples // batch_size if getattr(loader, "drop_last", False) else math.ceil(samples / batch_size)


def order_reads(loader: Iterable | None) -> tuple[int, int] | None:
    """For a loader that reads an ``EpochOrder``: ``(positions of the epoch's global order that a batch of
    every rank reads together, the order's length)``; they read fewer at the order's end, where the ranks'
    batches are padded (padding is not counted). None for another loader."""
    order = _order_read_by(loader)
    if order is None:
        return None
    return (getattr(loader, "batch_size", None) or 1) * order.num_replicas, order.length


def _order_read_by(loader: Iterable | None) -> EpochOrder | None:
    """The ``EpochOrder`` that ``loader`` reads its samples in, if it reads one."""
    order = _unwrapped(getattr(loader, "sampler", None))
    return order if isinstance(order, EpochOrder) else None


def data_replicas(loader: Iterable) -> int:
    """How many ranks read disjoint shards of ``loader``'s data (its sampler's replicas), else 1."""
    if isinstance(loader, CombinedLoader):
        return max((data_replicas(part) for part in loader.flattened), default=1)
    sampler = _unwrapped(getattr(loader, "sampler", None))
    return sampler.num_replicas if isinstance(sampler, (EpochOrder, DistributedSampler)) else 1


def dataset_length(loader: Iterable) -> int | list[Any] | None:
    """The length of ``loader``'s map-style dataset, or None (for a ``CombinedLoader``, a list: each loader's)."""
    if isinstance(loader, CombinedLoader):
        return [dataset_length(part) for part in loader.flattened]
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset):
        return None
    return sized_len(dataset)


def loader_batch_size(loader: Iterable) -> int | list[Any] | None:
    """``loader``'s batch size, or None (for a ``CombinedLoader``, a list: each loader's)."""
    if isinstance(loader, CombinedLoader):
        return [loader_batch_size(part) for part in loader.flattened]
    return getattr(loader, "batch_size", None)


def _unwrapped(sampler: Any) -> Any:
    return sampler.inner if isinstance(sampler, _Skippable) else sampler


def _is_stateful(loader: Any) -> bool:
    """A loader that saves and restores its own position (torchdata's ``StatefulDataLoader``, ...)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def loader_state(loader: Iterable) -> dict[str, Any] | None:
    """What a stateful loader needs to continue where it is (None for the others)."""
    return loader.state_dict() if _is_stateful(loader) else None  # type: ignore[attr-defined]


def restore_loader_state(loader: Iterable, state: dict[str, Any] | None) -> None:
    if state is not None and _is_stateful(loader):
        loader.load_state_dict(state)  # type: ignore[attr-defined]


def why_not_resumable(loader: Iterable) -> str | None:
    """Why ``loader`` cannot continue exactly in the middle of an epoch, or None if it can."""
    if isinstance(loader, CombinedLoader):  # its batches are read again: each loader must read them alike
        parts = [part for part in loader.flattened if not isinstance(part, Sequence)]
        if any(_is_stateful(part) for part in parts):
            return "a CombinedLoader does not save the state of its loaders (state_dict/load_state_dict)"
        return next(filter(None, map(why_not_resumable, parts)), None)
    if _is_stateful(loader) or isinstance(loader, Sequence):
        return None
    if not isinstance(loader, DataLoader):
        return f"a {type(loader).__name__} can only be replayed from its start"
    if isinstance(loader.dataset, IterableDataset):
        return (
            "an IterableDataset yields in its own order; a loader with state_dict/load_state_dict "
            "(torchdata's StatefulDataLoader) can resume it"
        )
    index_sampler = _unwrapped(loader.batch_sampler if loader.batch_sampler is not None else loader.sampler)
    sampler = _unwrapped(loader.sampler)
    deterministic = (SequentialSampler, EpochOrder, DistributedSampler)
    if loader.batch_sampler is not None and type(index_sampler) is not BatchSampler:
        return f"its {type(index_sampler).__name__} may order batches differently each time it is iterated"
    if not isinstance(sampler, deterministic):
        return f"its {type(sampler).__name__} may draw a different order each time it is iterated"
    return None


def with_last_flag(iterable: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)``, looking one item ahead: for loaders whose length is unknown."""
    iterator = iter(iterable)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


def in_order(loader: Iterable, kind: str) -> Iterable:
    """A copy of ``loader`` that reads its map-style dataset in order (``overfit_batches`` needs the same batches
    each epoch), with a warning, when its sampler would read it otherwise; else ``loader`` itself."""
    if not isinstance(loader, DataLoader) or isinstance(loader.sampler, SequentialSampler):
        return loader
    if isinstance(loader.dataset, IterableDataset) or type(loader.batch_sampler) not in (BatchSampler, type(None)):
        return loader  # no sampler to replace
    rank_zero_warn(
        f"You requested to overfit but enabled {kind} dataloader shuffling: overfit_batches reads it in order "
        "instead, the same batches each epoch",
        stacklevel=5,
    )
    ordered = copy.copy(loader)
    sampler = SequentialSampler(loader.dataset)  # type: ignore[arg-type]
    # DataLoader forbids assigning samplers after construction; the copy is not shared with anyone.
    object.__setattr__(ordered, "_iterator", None)
    object.__setattr__(ordered, "sampler", sampler)
    if loader.batch_sampler is not None:
        batch_sampler = BatchSampler(sampler, loader.batch_sampler.batch_size, loader.drop_last)  # type: ignore[attr-defined]
        object.__setattr__(ordered, "batch_sampler", batch_sampler)
    return ordered
