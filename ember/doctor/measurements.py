"""``Measurements``: the plain figures of one watched run, from which every finding is worked out."""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter


@dataclasses.dataclass(frozen=True)
class Timings:
    """A duration timed several times, in seconds: its figure is the median, its noise the range."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def above(self, other: Timings) -> bool:
        """Whether this is longer than ``other`` beyond the noise: leaving out one outlier on each side (its
        fastest timing, the other's slowest: a burst of other work on the machine), each of its timings is
        above each of the other's. Two sets of 9 timings of one duration come out so once in 600."""
        return sorted(self.samples)[1] > sorted(other.samples)[-2]

    def __str__(self) -> str:
        low, high = min(self.samples) * 1e3, max(self.samples) * 1e3
        return f"{self.median * 1e3:.3g} ms ({low:.3g}-{high:.3g} ms over {len(self.samples)} runs)"


@dataclasses.dataclass
class Measurements:
    """What the doctor measured. The watcher fills the first groups while the run goes on; the figures
    that cost something to measure are taken once at the end, and only where a finding can use them
    (they stay None otherwise). Times are in seconds, sizes in bytes."""

    #: Optimizer steps before the measured window (not measured: the first steps are slower).
    warmup: int = 5
    #: Optimizer steps the run made while watched.
    steps_seen: int = 0
    #: Optimizer steps in the measured window.
    measured_steps: int = 0
    #: Wall time of the measured window.
    window_seconds: float = 0.0
    #: Processes of the job (``WORLD_SIZE``).
    world_size: int = 1

    # ----------------------------------------------------------- data loading, in the window
    #: Time spent waiting for DataLoader batches.
    data_wait: float = 0.0
    #: Of which this thread computed (the rest it slept or waited for I/O).
    data_cpu: float = 0.0
    #: Batches fetched per loader setting: (num_workers, pin_memory, persistent_workers).
    loaders: Counter[tuple[int, bool, bool]] = dataclasses.field(default_factory=Counter)

    # --------------------------------------------------------------- host syncs, in the window
    #: Calls from the user's code that waited for a device tensor, by ``"file:line in function (call)"``.
    syncs: Counter[str] = dataclasses.field(default_factory=Counter)
    #: The time those calls took.
    sync_seconds: float = 0.0

    # ---------------------------------------------------------------- distributed data parallel
    #: DistributedDataParallel models alive at the end, and how many of them search for unused parameters.
    ddp_models: int = 0
    ddp_models_searching_unused: int = 0
    #: Forward calls with gradients on a module wrapped by DDP that bypassed the wrapper, by code location.
    bare_forwards: Counter[str] = dataclasses.field(default_factory=Counter)
    #: DDP forward passes in the window after which the gradients are all-reduced.
    syncing_forwards: int = 0
    #: Time DDP spent searching the autograd graph for unused parameters in the window.
    unused_search_seconds: float = 0.0
    #: Whether every parameter of the DDP models that search for unused ones got a gradient in each step.
    all_parameters_used: bool = True
    #: The ``epoch`` each shuffling DistributedSampler was iterated with, by sampler.
    sampler_epochs: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ measured at the end
    #: Tensors with an autograd graph made in the window and still alive, their storage, and what holds them.
    graph_tensors: int = 0
    graph_bytes: int = 0
    graph_holders: list[str] = dataclasses.field(default_factory=list)
    #: CPU compute threads of this process, the cores it may fairly use, and processes on this machine.
    threads: int = 1
    cores_per_process: int = 1
    local_processes: int = 1
    #: A matrix product's time with ``threads`` threads and with ``cores_per_process`` (only when more threads).
    matmul_seconds: tuple[Timings, Timings] | None = None
    #: One all-reduce of the gradients (only when DDP all-reduced on enough micro-batches per step for the finding).
    all_reduce_seconds: float | None = None
    #: Whether a CUDA device is available.
    cuda_available: bool = False
    #: In an Ember run on a GPU: the GPU's name, the peak memory allocated, its memory, the batch size.
    gpu_name: str | None = None
    peak_memory: int | None = None
    total_memory: int | None = None
    batch_size: int | None = None
    #: In an Ember run in float32 on a GPU with bfloat16: the training step's time in float32 and in bf16 autocast.
    precision_seconds: tuple[Timings, Timings] | None = None

    @property
    def step_seconds(self) -> float:
        """The mean time of a measured step."""
        return self.window_seconds / self.measured_steps if self.measured_steps else 0.0
