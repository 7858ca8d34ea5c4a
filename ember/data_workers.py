"""Loader workers: how each starts (signals, seeds), and how many to use (``suggest_num_workers`` measures a
loader's throughput with each count)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader

from ember.exceptions import PossibleUserWarning
from ember.rank_zero import rank_zero_warn


class WorkerStart:
    """What a loader worker runs first: it leaves the signals that stop training to the main process, then
    seeds the worker (unless the user's ``worker_init_fn``, run instead, does its own seeding)."""

    def __init__(self, user_init: Callable[[int], None] | None) -> None:
        self.user_init = user_init
        self.main_pid = os.getpid()  # the process that reads the batches

    def __call__(self, worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _obey_only_the_main_process(self.main_pid)
        if self.user_init is not None:
            self.user_init(worker_id)
        else:
            _seed_worker(worker_id)


#: The signals that stop training, which only the main process may give a loader worker.
_STOPS = {signal.SIGTERM, signal.SIGUSR1} if hasattr(signal, "SIGUSR1") else {signal.SIGTERM}


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Blocks the signals that stop training in this thread while it starts loader workers, which inherit the
    block in each of their threads: those their first code starts, and also those a forked process has from the
    start (the OpenMP runtime's, started again at once in a child of a process that used more threads than it
    now does), which would otherwise take such a signal and die of it. A signal that comes meanwhile waits here,
    and is handled as this ends."""
    if not hasattr(signal, "sigwaitinfo"):  # the workers keep torch's handling (below): nothing to hold
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _obey_only_the_main_process(main_pid: int) -> None:
    """In a loader worker: end on SIGTERM (or SLURM's SIGUSR1) only when the main process sends it.

    A launcher or scheduler (torchrun's agent, SLURM's ``scancel``, often both, one after the other) signals
    every process of the job: were the workers to die of it, the main process could not fetch the batches
    it needs to reach the step where it saves. The main process ends its workers with the same SIGTERM
    (when it shuts the loader down, or at exit), so only the sender tells them apart, as torch's own
    handler in the worker does; Python's handlers are not told the sender, so the signals are blocked and
    a thread waits for them (programs a worker starts inherit them blocked, as they inherit Ctrl-C ignored).
    Where that cannot be done (no ``sigwaitinfo``), torch's handling stays.
    """
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)  # in the threads started from here on too
    threading.Thread(target=_wait_for_the_main_process, args=(_STOPS, main_pid), daemon=True).start()


def _wait_for_the_main_process(stops: set[signal.Signals], main_pid: int) -> None:
    while True:
        sender = signal.sigwaitinfo(stops).si_pid
        if sender in (main_pid, os.getppid()):
            os._exit(0)  # as torch's handler does: a clean exit, which the main process does not report


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


def check_workers(loader: object, kind: str) -> None:
    """Lightning's advice on a ``kind`` ("train", "val", ...) loader's workers, in its words: persistent workers
    where each epoch would spawn them again, else more workers where the machine has cores to spare for them."""
    if not isinstance(loader, DataLoader):
        return
    context = loader.multiprocessing_context
    start_method = context.get_start_method() if context is not None else torch.multiprocessing.get_start_method()
    spare = max(1, cores_per_process() - 1)  # one core left for the main process, as Lightning counts them
    if loader.num_workers > 0 and start_method == "spawn" and not loader.persistent_workers:
        rank_zero_warn(f"Consider setting `persistent_workers=True` in '{kind}_dataloader' to speed up the dataloader "
                       "worker initialization.", stacklevel=6)  # fmt: skip
    elif loader.num_workers < 2 and spare > 1:
        rank_zero_warn(
            f"The '{kind}_dataloader' does not have many workers which may be a bottleneck. Consider increasing the "
            f"value of the `num_workers` argument` to `num_workers={spare}` in the `DataLoader` to improve "
            "performance.", PossibleUserWarning, stacklevel=6)  # fmt: skip


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
