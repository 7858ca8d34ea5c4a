"""DataLoaders as the Trainer uses them: prepared for the device and the process layout, counted, iterated,
and able to resume in the middle of an epoch.

The order of a training epoch depends only on a data seed (drawn once per run and saved in its
checkpoints) and the epoch number, never on the global random state. A resumed run can therefore
skip exactly the batches its predecessor consumed by skipping their indices, without reading them.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence
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

if TYPE_CHECKING:
    from ember.strategies.strategy import Strategy


class _SeededRandomSampler(Sampler[int]):
    """A random permutation per epoch, drawn from ``seed + epoch``: any epoch can be drawn again."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.seed = 0
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())

    def __len__(self) -> int:
        return self.num_samples


class _ShardSampler(DistributedSampler):
    """A ``DistributedSampler`` whose seed the Trainer sets: the run's data seed, shared by all ranks."""


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

    - with several processes, each reads its own shard: the sampler becomes a ``DistributedSampler``
      (shuffling as the loader did, the seed shared by all ranks); ``shard=False`` opts out;
    - a training loader's order comes from the run's data seed and the epoch, and it can skip
      batches, so that a resumed run continues where its predecessor stopped;
    - workers are seeded from that seed too (never from the global random state, which the loader
      would otherwise advance each time it is iterated);
    - batches bound for a GPU are pinned in host memory, so copies to the device run asynchronously.
    """
    if not isinstance(loader, DataLoader) or _is_stateful(loader):
        return loader
    prepared = copy.copy(loader)
    object.__setattr__(prepared, "_iterator", None)  # a loader with persistent workers keeps its iterator
    sampler = _shard_sampler(loader, strategy) if shard else None
    if sampler is None and train and _plain_shuffle(loader.sampler):
        sampler = _SeededRandomSampler(len(loader.dataset))  # type: ignore[arg-type]
    # DataLoader forbids assigning samplers after construction; the copy is not shared with anyone.
    if sampler is not None:
        object.__setattr__(prepared, "sampler", sampler)
        if loader.batch_sampler is not None:
            object.__setattr__(prepared, "batch_sampler", BatchSampler(sampler, loader.batch_size, loader.drop_last))
    if train:
        if prepared.batch_sampler is not None:
            object.__setattr__(prepared, "batch_sampler", _Skippable(prepared.batch_sampler))
        else:
            object.__setattr__(prepared, "sampler", _Skippable(prepared.sampler))
    prepared.generator = torch.Generator().manual_seed(0)  # reseeded per epoch for training
    if strategy.root_device.type == "cuda" and not loader.pin_memory:
        prepared.pin_memory = True
    if loader.num_workers > 0 and loader.worker_init_fn is None:
        prepared.worker_init_fn = _seed_worker
    return prepared


def _plain_shuffle(sampler: Sampler) -> bool:
    """A ``RandomSampler`` that draws a permutation (not with replacement, not a subset)."""
    return isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None


def _shard_sampler(loader: DataLoader, strategy: Strategy) -> DistributedSampler | None:
    """The sampler that gives this rank its shard of ``loader``'s data, or None if it needs none."""
    options = strategy.distributed_sampler_kwargs
    if options is None or isinstance(loader.sampler, DistributedSampler):
        return None  # one process, or the user sharded the data already
    if isinstance(loader.dataset, IterableDataset):
        _warn_once(
            "an IterableDataset cannot be sharded by a sampler: each rank reads what its dataset yields, so "
            "shard it yourself (torch.utils.data.get_worker_info() and the rank) or every rank sees the same data"
        )
        return None
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        _warn_once(
            "a DataLoader with a custom batch_sampler is left as it is: every rank gets the same batches unless "
            "the batch sampler shards them (use_distributed_sampler=False silences this)"
        )
        return None
    if not (isinstance(loader.sampler, SequentialSampler) or _plain_shuffle(loader.sampler)):
        _warn_once(
            f"a DataLoader with a {type(loader.sampler).__name__} is left as it is: every rank draws from the "
            "whole dataset; give it a DistributedSampler of your own to shard it"
        )
        return None
    return _ShardSampler(loader.dataset, shuffle=isinstance(loader.sampler, RandomSampler), **options)


def _seed_worker(worker_id: int) -> None:
    """Seed Python's and NumPy's generators in a worker from its torch seed.

    The DataLoader gives each worker the torch seed base_seed + worker_id, and the base seed comes
    from the loader's generator, which the Trainer seeds from the run's data seed, the epoch and
    the rank: workers are seeded the same way again when a run resumes.
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def count_batches(loader: Iterable, limit: int | float | None, flag: str) -> float:
    """How many batches of ``loader`` a run uses (``math.inf`` for loaders without a length)."""
    try:
        available: float = len(loader)  # type: ignore[arg-type]
    except TypeError:
        available = math.inf
    if limit is None:
        return available
    if isinstance(limit, int):
        return min(available, limit)
    if math.isinf(available):
        if limit == 1.0:
            return available
        raise ValueError(
            f"{flag}={limit} is a fraction, but the dataloader has no length; pass a number of batches instead"
        )
    return max(1, int(available * limit)) if limit > 0 else 0


# ----------------------------------------------------------------------------- epochs and resuming
def epoch_batches(loader: Iterable, epoch: int, skip: int, seed: int, rank: int) -> Iterator[Any]:
    """Iterate ``loader`` for ``epoch``, leaving out its first ``skip`` batches.

    ``seed`` is the run's data seed: it sets the order of the training loaders the Trainer prepared,
    and the seeds of their workers, for this epoch and rank.
    """
    if isinstance(loader, DataLoader):
        sampler = _unwrapped(loader.sampler)
        index_sampler = _unwrapped(loader.batch_sampler) if loader.batch_sampler is not None else sampler
        if isinstance(sampler, (_SeededRandomSampler, _ShardSampler)):
            sampler.seed = seed
        for candidate in (sampler, getattr(index_sampler, "sampler", None)):
            if callable(getattr(candidate, "set_epoch", None)):
                candidate.set_epoch(epoch)
                break
        if loader.generator is not None and not _is_stateful(loader):
            # Persistent workers keep the seeds of the epoch that started them, in a resumed run too.
            worker_epoch = 0 if loader.persistent_workers else epoch
            loader.generator.manual_seed((seed * 1_000_003 + worker_epoch * 10_007 + rank) % 2**63)
        skipper = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        if isinstance(skipper, _Skippable):
            skipper.skip, skip = skip, 0
    iterator = iter(loader)
    return islice(iterator, skip, None) if skip and isinstance(loader, Sequence) else iterator


def data_replicas(loader: Iterable) -> int:
    """How many ranks read disjoint shards of ``loader``'s data: its ``DistributedSampler``'s replicas, else 1."""
    sampler = _unwrapped(getattr(loader, "sampler", None))
    return sampler.num_replicas if isinstance(sampler, DistributedSampler) else 1


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
    deterministic = (SequentialSampler, _SeededRandomSampler, DistributedSampler)
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


# ------------------------------------------------------------------------------- loader workers
class WorkerSuggestion:
    """How fast a loader delivers batches with each number of workers, and the count to use."""

    def __init__(self, num_workers: int, batches_per_second: dict[int, float]) -> None:
        self.num_workers = num_workers
        self.batches_per_second = batches_per_second

    def __repr__(self) -> str:
        figures = ", ".join(f"{workers}: {rate:.1f}" for workers, rate in self.batches_per_second.items())
        return f"WorkerSuggestion(num_workers={self.num_workers}, batches/s by workers: {figures})"


def cores_per_process() -> int:
    """The CPU cores this process may use, shared with the other processes of the job on this machine."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def suggest_num_workers(loader: DataLoader, max_workers: int | None = None, batches: int = 30) -> WorkerSuggestion:
    """Measure ``loader``'s throughput with 0, 1, 2, ... workers (up to the cores available per process) and
    return the fastest count; a smaller count within 5% of the fastest is preferred (fewer processes).

    Each measurement skips a first batch per worker (their start) and times the next ``batches``.
    """
    import time

    if not isinstance(loader, DataLoader):
        raise TypeError(f"suggest_num_workers needs a torch DataLoader; got {type(loader).__name__}")
    limit = cores_per_process() if max_workers is None else max_workers
    rates: dict[int, float] = {}
    for workers in range(limit + 1):
        trial = _with_workers(loader, workers)
        iterator = iter(trial)
        for _ in islice(iterator, max(1, workers)):
            pass
        start, count = time.perf_counter(), 0
        for _ in islice(iterator, batches):
            count += 1
        elapsed = time.perf_counter() - start
        rates[workers] = count / elapsed if count and elapsed > 0 else 0.0
        del iterator
    fastest = max(rates.values())
    best = min(workers for workers, rate in rates.items() if rate >= 0.95 * fastest)
    return WorkerSuggestion(best, rates)


def _with_workers(loader: DataLoader, workers: int) -> DataLoader:
    options: dict[str, Any] = {
        "num_workers": workers, "collate_fn": loader.collate_fn, "pin_memory": loader.pin_memory,
        "worker_init_fn": loader.worker_init_fn, "prefetch_factor": 2 if workers else None,
    }  # fmt: skip
    if loader.batch_sampler is not None:
        return DataLoader(loader.dataset, batch_sampler=loader.batch_sampler, **options)
    return DataLoader(loader.dataset, batch_size=None, sampler=loader.sampler, **options)


def in_order(loader: Iterable, flag: str) -> Iterable:
    """A copy of ``loader`` that reads its dataset in order instead of shuffling it (``flag`` needs that)."""
    if not isinstance(loader, DataLoader) or not isinstance(loader.sampler, RandomSampler):
        return loader
    warnings.warn(f"{flag}: the train dataloader shuffles; it is read in order instead", stacklevel=4)
    ordered = copy.copy(loader)
    sampler = SequentialSampler(loader.dataset)  # type: ignore[arg-type]
    # DataLoader forbids assigning samplers after construction; the copy is not shared with anyone.
    object.__setattr__(ordered, "_iterator", None)
    object.__setattr__(ordered, "sampler", sampler)
    if loader.batch_sampler is not None:
        batch_sampler = BatchSampler(sampler, loader.batch_sampler.batch_size, loader.drop_last)  # type: ignore[attr-defined]
        object.__setattr__(ordered, "batch_sampler", batch_sampler)
    return ordered
