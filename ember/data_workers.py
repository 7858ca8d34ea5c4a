"""How many loader workers to use: ``suggest_num_workers`` measures a loader's throughput with each count."""

from __future__ import annotations

import os
import time
from itertools import islice
from typing import Any

from torch.utils.data import DataLoader


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
    from ember.launch import threads_per_process

    return threads_per_process(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def suggest_num_workers(loader: DataLoader, max_workers: int | None = None, batches: int = 30) -> WorkerSuggestion:
    """Measure ``loader``'s throughput with 0, 1, 2, ... workers (up to the cores available per process) and
    return the fastest count; a smaller count within 5% of the fastest is preferred (fewer processes).

    Each measurement skips a first batch per worker (their start) and times the next ``batches``.
    """
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
