"""The figures the doctor measures once, at the end of the window.

Some cost time (a garbage collection and a search of the heap, timed training steps, matrix products,
all-reduces), so each is measured only where a finding can use it. Some are measured by all ranks
together: every rank must call ``measure``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ember._utils import batch_size_of
from ember.data import cores_per_process
from ember.doctor.findings import KEPT_GRAPHS_PER_STEP, SYNCING_FORWARDS_PER_STEP
from ember.doctor.measurements import Measurements, Timings
from ember.loops.step import StepRunner

if TYPE_CHECKING:
    from ember.trainer import Trainer

#: Timings of each setting a finding compares: enough that one outlier on each side can be left out.
_REPEATS = 9


def measure(
    m: Measurements, graph_tensors_at_start: set[int], ddp_models: Iterable[Any], trainer: Trainer | None
) -> None:
    """Fill the figures of ``m`` taken at the end of a window of at least one step. ``graph_tensors_at_start``:
    the ids of the tensors with a graph when the window began; ``trainer``: the Ember run's, if it is one."""
    _graphs(m, graph_tensors_at_start)
    _gpu(m, trainer)
    _threads(m)
    if m.ddp_models and m.syncing_forwards >= SYNCING_FORWARDS_PER_STEP * m.measured_steps:
        m.all_reduce_seconds = _all_reduce_seconds(next(iter(ddp_models)))


def _graphs(m: Measurements, before: set[int]) -> None:
    gc.collect()
    new = [tensor for tensor in graph_tensors() if id(tensor) not in before]
    m.graph_tensors = len(new)
    m.graph_bytes = sum(tensor.untyped_storage().nbytes() for tensor in new)
    if len(new) >= KEPT_GRAPHS_PER_STEP * m.measured_steps:  # where they are kept: a search of the heap
        m.graph_holders = _holders(new[:20])


def _gpu(m: Measurements, trainer: Trainer | None) -> None:
    m.cuda_available = torch.cuda.is_available()
    if trainer is None or trainer.strategy.root_device.type != "cuda":
        return
    device = trainer.strategy.root_device
    batch = trainer.run_metrics.train.batch
    m.gpu_name = torch.cuda.get_device_name(device)
    if trainer.precision == "32-true" and torch.cuda.is_bf16_supported() and batch is not None:
        m.precision_seconds = (_time_step(trainer, batch, None), _time_step(trainer, batch, torch.bfloat16))
    m.peak_memory = torch.cuda.max_memory_allocated(device)
    m.total_memory = torch.cuda.get_device_properties(device).total_memory
    m.batch_size = batch_size_of(batch)


def _threads(m: Measurements) -> None:
    m.threads = torch.get_num_threads()
    m.local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    fair = m.cores_per_process = cores_per_process()
    if m.threads > fair:
        # Repeated and interleaved: other processes on the machine add noise to each timing, and a burst of
        # theirs then falls on both thread counts.
        timings = [(_matmul_seconds(m.threads), _matmul_seconds(fair)) for _ in range(_REPEATS)]
        m.matmul_seconds = (Timings(tuple(now for now, _ in timings)), Timings(tuple(fixed for _, fixed in timings)))


def graph_tensors() -> list[torch.Tensor]:
    """Every live tensor that keeps an autograd graph."""
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.grad_fn is not None]


def _holders(tensors: list[torch.Tensor]) -> list[str]:
    """Where tensors are kept: a global variable or an object's attribute holding the containers they are in.
    Each level is one search of the heap for the referrers of all its objects at once (a search takes as long as
    the heap is large, whatever it looks for)."""
    sampled = {id(tensor) for tensor in tensors}
    containers = [c for c in gc.get_referrers(*tensors) if isinstance(c, (list, dict, tuple, set))]
    held = {id(c): len(sampled.intersection(map(id, gc.get_referents(c)))) for c in containers}
    referrers = gc.get_referrers(*containers)
    dicts = [r for r in referrers if isinstance(r, dict)]
    # An object's attributes are in a dict of its own, found above, or (Python 3.11+, until that dict is first
    # asked for) in the object itself, found in its place.
    namespaces: dict[int, tuple[dict[str, Any], object]] = {id(d): (d, None) for d in dicts}
    for holder in [*referrers, *gc.get_referrers(*dicts)]:
        if (attributes := _attributes(holder)) is not None:
            namespaces[id(attributes)] = (attributes, holder)
    places: Counter[str] = Counter()
    for namespace, holder in namespaces.values():
        for name, value in namespace.items():
            if id(value) not in held:  # the containers are alive: no other object has their id
                continue
            if "__name__" in namespace and "__file__" in namespace:
                place = f"{type(value).__name__} {name!r}, a global of {namespace['__file__']}"
            else:
                kind = f" of a {type(holder).__name__}" if holder is not None else ""
                place = f"{type(value).__name__} in attribute {name!r}{kind}"
            places[place] += held[id(value)]
    return [f"{place} ({count} of the tensors sampled)" for place, count in places.most_common(3)]


def _attributes(holder: object) -> dict[str, Any] | None:
    try:  # whatever the heap holds: some objects compute their attributes, and may fail to
        attributes = getattr(holder, "__dict__", None)
    except Exception:
        return None
    return attributes if isinstance(attributes, dict) else None


def _time_step(trainer: Trainer, batch: Any, dtype: torch.dtype | None, repeats: int = _REPEATS) -> Timings:
    """Seconds for the module's training step and its backward on ``batch`` (gradients discarded), run by
    fit's own step runner, in autocast to ``dtype`` when given."""
    module = trainer.lightning_module
    assert module is not None
    runner = StepRunner(trainer.strategy, module, [])
    seconds = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            runner.forward_backward(batch, 0, sync=False)  # no gradient all-reduce
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
    return Timings(tuple(seconds[1:]))  # the first warms up


def _matmul_seconds(threads: int, size: int = 384, duration: float = 0.02) -> float:
    """A matrix product's time with ``threads`` threads: the mean of those made in ``duration`` seconds, all
    ranks at the same time (long enough that they overlap, although each starts when it leaves the barrier)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    _barrier()
    torch.mm(a, b)
    products, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < duration:
        torch.mm(a, b)
        products += 1
    torch.set_num_threads(previous)
    _barrier()
    return elapsed / products


def _all_reduce_seconds(ddp: Any, repeats: int = 5) -> float:
    """Time of one all-reduce of as many numbers as the model has parameters (all ranks together)."""
    import torch.distributed as dist

    parameter = next(ddp.module.parameters())
    numbers = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)
    buffer = torch.zeros(numbers, device=parameter.device)
    dist.all_reduce(buffer)
    _barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buffer)
    if buffer.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
