"""DataLoaders as the Trainer uses them: prepared for the device and the process layout, counted, iterated."""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ember.strategies.strategy import Strategy


def prepare_loader(loader: Iterable, strategy: Strategy, shard: bool = True) -> Iterable:
    """A copy of ``loader`` as the run needs it; the user's loader itself is not changed.

    - with several processes, each reads its own shard: the sampler becomes a ``DistributedSampler``
      (shuffling as the loader did, the seed shared by all ranks); ``shard=False`` opts out;
    - batches bound for a GPU are pinned in host memory, so copies to the device run asynchronously;
    - workers are seeded from the global seed, the rank and their id after ``seed_everything(workers=True)``.
    """
    if not isinstance(loader, DataLoader):
        return loader
    sampler = _distributed_sampler(loader, strategy) if shard else None
    pin = strategy.root_device.type == "cuda" and not loader.pin_memory
    seed_workers = loader.num_workers > 0 and loader.worker_init_fn is None and _workers_seeded()
    if sampler is None and not pin and not seed_workers:
        return loader
    prepared = copy.copy(loader)
    # A loader with persistent workers keeps its iterator; the copy must start its own.
    object.__setattr__(prepared, "_iterator", None)
    if sampler is not None:
        # DataLoader forbids assigning samplers after construction; the copy is not shared with anyone.
        object.__setattr__(prepared, "sampler", sampler)
        object.__setattr__(prepared, "batch_sampler", BatchSampler(sampler, loader.batch_size, loader.drop_last))
    if pin:
        prepared.pin_memory = True
    if seed_workers:
        prepared.worker_init_fn = _WorkerSeeder(int(os.environ["EMBER_GLOBAL_SEED"]), strategy.global_rank)
    return prepared


def _distributed_sampler(loader: DataLoader, strategy: Strategy) -> DistributedSampler | None:
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
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        _warn_once(
            f"a DataLoader with a {type(loader.sampler).__name__} is left as it is: every rank draws from the "
            "whole dataset; give it a DistributedSampler of your own to shard it"
        )
        return None
    shuffle = isinstance(loader.sampler, RandomSampler)
    seed = int(os.environ.get("EMBER_GLOBAL_SEED", "0"))  # the same on every rank, so shards never overlap
    return DistributedSampler(loader.dataset, shuffle=shuffle, seed=seed, **options)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=4)


def _workers_seeded() -> bool:
    return os.environ.get("EMBER_SEED_WORKERS") == "1" and "EMBER_GLOBAL_SEED" in os.environ


class _WorkerSeeder:
    """Seeds Python, NumPy and torch in each worker from the global seed, the rank and the worker id."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed = seed
        self.rank = rank

    def __call__(self, worker_id: int) -> None:
        import random

        sequence = torch.Generator().manual_seed(self.seed ^ (self.rank << 16) ^ worker_id)
        seed = int(torch.randint(0, 2**32 - 1, (1,), generator=sequence))
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy
        except ImportError:
            return
        numpy.random.seed(seed)


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


def epoch_batches(loader: Iterable, epoch: int, skip: int) -> Iterator[Any]:
    """Iterate ``loader`` for ``epoch`` (samplers reshuffle per epoch), leaving out the first ``skip`` batches."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            break
    iterator = iter(loader)
    return islice(iterator, skip, None) if skip else iterator


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
