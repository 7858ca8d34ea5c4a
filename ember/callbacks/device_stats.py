"""``DeviceStatsMonitor``: log the memory the run uses on its GPU and on the host."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback, at_logging_step
from ember.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

_MB = 1e6


class DeviceStatsMonitor(Callback):
    """Log memory figures in MB (10^6 bytes) at the Trainer's logging steps, under ``device_stats/``.

    On a CUDA device: ``cuda_memory_allocated_mb`` (held by tensors), ``cuda_memory_reserved_mb`` (held
    by PyTorch's caching allocator) and ``cuda_memory_peak_mb`` (the most allocated so far). On the host:
    ``cpu_rss_mb`` (this process's resident memory) and ``cpu_peak_rss_mb``; ``cpu_stats`` None logs these
    when training on the CPU only, True always, False never. Reading them never waits for the device.
    """

    def __init__(self, cpu_stats: bool | None = None) -> None:
        if cpu_stats not in (None, True, False):
            raise MisconfigurationException(f"DeviceStatsMonitor(cpu_stats={cpu_stats!r}): choose None, True or False")
        self.cpu_stats = cpu_stats

    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        if not trainer.loggers:
            raise MisconfigurationException(
                "DeviceStatsMonitor needs a logger; the Trainer was built with logger=False"
            )

    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if at_logging_step(trainer):
            stats = self.stats(trainer.strategy.root_device)
            # labelled as the batch's other values: with the index of its step
            trainer.run_metrics.write(stats, trainer.fit_loop.logging_step - 1, trainer.current_epoch)

    def stats(self, device: torch.device) -> dict[str, float]:
        """The figures for ``device`` (and the host), by name."""
        stats = {}
        if device.type == "cuda":
            stats["device_stats/cuda_memory_allocated_mb"] = torch.cuda.memory_allocated(device) / _MB
            stats["device_stats/cuda_memory_reserved_mb"] = torch.cuda.memory_reserved(device) / _MB
            stats["device_stats/cuda_memory_peak_mb"] = torch.cuda.max_memory_allocated(device) / _MB
        if self.cpu_stats or (self.cpu_stats is None and device.type == "cpu"):
            stats.update(_host_memory())
        return stats


def _host_memory() -> dict[str, float]:
    """This process's resident memory now and at its peak, where the platform tells them."""
    stats = {}
    try:  # Linux
        with open("/proc/self/statm") as file:
            resident_pages = int(file.read().split()[1])
        stats["device_stats/cpu_rss_mb"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / _MB
    except (OSError, ValueError, AttributeError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return stats
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # KiB
    peak = peak_bytes / _MB
    # The kernel updates the peak lazily, so it can lag a fresh reading of the current size.
    stats["device_stats/cpu_peak_rss_mb"] = max(peak, stats.get("device_stats/cpu_rss_mb", 0.0))
    return stats
