"""DataLoaders as the Trainer uses them: prepared for the device and the process layout, counted, iterated."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader

from ember.strategies.strategy import Strategy


def prepare_loader(loader: Iterable, strategy: Strategy) -> Iterable:
    """A copy of ``loader`` that pins memory when batches go to a GPU and seeds its workers when asked."""
    if not isinstance(loader, DataLoader):
        return loader
    pin = strategy.root_device.type == "cuda" and not loader.pin_memory
    seed_workers = loader.num_workers > 0 and loader.worker_init_fn is None and _workers_seeded()
    if not (pin or seed_workers):
        return loader
    prepared = copy.copy(loader)
    if pin:
        # Page-locked host memory lets the host-to-device copy run asynchronously (non_blocking=True).
        prepared.pin_memory = True
    if seed_workers:
        prepared.worker_init_fn = _WorkerSeeder(int(os.environ["EMBER_GLOBAL_SEED"]), strategy.global_rank)
    return prepared


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
