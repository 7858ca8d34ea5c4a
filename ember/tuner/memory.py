"""The peak tensor memory of a block of work: the batch-size finder's measure of a trial under ``max_memory``."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@contextlib.contextmanager
def peak_memory(device: torch.device, measure: bool) -> Iterator[Callable[[], int]]:
    """The peak bytes of tensor memory while the block runs (measured only when asked)."""
    peak = 0
    if not measure:
        yield lambda: peak
        return
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        yield lambda: peak
        peak = torch.cuda.max_memory_allocated(device) - baseline
        return
    # On a CPU there are no allocator statistics: the tensors the ops make are followed until freed.
    with _LiveTensorBytes() as tensors:
        yield lambda: peak
    peak = tensors.peak


class _LiveTensorBytes(TorchDispatchMode):
    """While active, the bytes of the tensor storages the ops create and that are still alive, and their peak.

    (torch's profiler can follow the allocator, but it writes to stderr each time it starts and stops.)"""

    def __init__(self) -> None:
        super().__init__()
        self.alive = self.peak = 0
        self._followed: weakref.WeakSet[torch.UntypedStorage] = weakref.WeakSet()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(tensor.untyped_storage()) for tensor in tree_leaves((args, kwargs)) if _has_storage(tensor)}
        for tensor in tree_leaves(out):
            # A view or an in-place result shares an input's storage: only a new storage is new memory.
            if _has_storage(tensor) and id(storage := tensor.untyped_storage()) not in inputs:
                self._follow(storage)
        return out

    def _follow(self, storage: torch.UntypedStorage) -> None:
        if storage in self._followed:
            return
        self._followed.add(storage)
        size = storage.nbytes()
        self.alive += size
        self.peak = max(self.peak, self.alive)
        weakref.finalize(storage, self._freed, size)  # the storage's Python object lives as long as its memory

    def _freed(self, size: int) -> None:
        self.alive -= size


def _has_storage(value: Any) -> bool:
    """A dense tensor (a sparse one's memory is in its index and value tensors, which the ops made too)."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided
