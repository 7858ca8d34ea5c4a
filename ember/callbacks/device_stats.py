"""``DeviceStatsMonitor``: log what the device (and the host) reports of its use, as Lightning's does."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException
from ember.trainer_properties import Accelerator

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

_MB = 1e6


class DeviceStatsMonitor(Callback):
    """Log the device's figures under ``DeviceStatsMonitor.<hook>/<figure>`` (the logger's ``group_separator``) at
    the training, validation and test batch hooks (start and end) of a batch whose optimizer step (training) or
    index in its loop (evaluation) is a ``log_every_n_steps`` multiple, in rows of their own (no ``epoch``),
    labelled with the optimizer steps taken before the batch, as Lightning's.

    The figures are ``trainer.accelerator.get_device_stats(device)``'s: ``torch.cuda.memory_stats`` on a CUDA
    device; on the CPU ``cpu_percent``, ``cpu_vm_percent`` and ``cpu_swap_percent`` (with ``psutil``; without it,
    this process's resident memory in MB, ``cpu_rss_mb`` and ``cpu_peak_rss_mb``). ``cpu_stats`` None logs the
    CPU's figures when training on the CPU only, True always, False never. Reading them never waits for the device.
    """

    def __init__(self, cpu_stats: bool | None = None) -> None:
        if cpu_stats not in (None, True, False):
            raise MisconfigurationException(f"DeviceStatsMonitor(cpu_stats={cpu_stats!r}): choose None, True or False")
        self.cpu_stats = cpu_stats

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        if stage == "fit" and not trainer.loggers:
            raise MisconfigurationException(
                "Cannot use `DeviceStatsMonitor` callback with `Trainer(logger=False)`: it writes to the loggers"
            )

    def on_train_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int) -> None:
        step = trainer.fit_loop.logging_step
        self._log(trainer, "on_train_batch_start", step, step + 1)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = _steps_before_batch(trainer)
        self._log(trainer, "on_train_batch_end", step, step + 1)

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self._log_evaluation(trainer, "on_validation_batch_start", batch_idx)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: Module, *args: Any) -> None:
        self._log_evaluation(trainer, "on_validation_batch_end", args[2])  # outputs, batch, batch_idx

    def on_test_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int, *_: Any) -> None:
        self._log_evaluation(trainer, "on_test_batch_start", batch_idx)

    def on_test_batch_end(self, trainer: Trainer, pl_module: Module, *args: Any) -> None:
        self._log_evaluation(trainer, "on_test_batch_end", args[2])

    def _log_evaluation(self, trainer: Trainer, hook: str, batch_idx: int) -> None:
        """An evaluation batch's figures, due by its own index (as Lightning counts them, the sanity check's too),
        labelled with the training's steps."""
        step = _steps_before_batch(trainer) if trainer.stage == "fit" else trainer.fit_loop.logging_step
        self._log(trainer, hook, step, batch_idx + 1)

    def _log(self, trainer: Trainer, hook: str, step: int, count: int) -> None:
        every = trainer.log_every_n_steps  # 0: no step values are written
        due = every > 0 and (count % every == 0 or trainer.should_stop)
        if not due or not trainer.is_global_zero:
            return
        stats = self.stats(trainer.strategy.root_device)
        if not stats:  # cpu_stats=False on the CPU: nothing to write, as in Lightning
            return
        for logger in trainer.loggers:  # as Lightning's: to the loggers only, not to the trainer's metrics
            prefix = f"{type(self).__qualname__}.{hook}{logger.group_separator}"
            logger.log_metrics({prefix + name: value for name, value in stats.items()}, step)

    def stats(self, device: torch.device) -> dict[str, float]:
        """The figures for ``device`` (and the host's, as ``cpu_stats`` says), by name."""
        stats: dict[str, float] = {}
        if device.type != "cpu":
            stats.update(Accelerator(device.type).get_device_stats(device))
        if self.cpu_stats or (self.cpu_stats is None and device.type == "cpu"):
            stats.update(_host_stats())
        return stats


def _steps_before_batch(trainer: Trainer) -> int:
    """The optimizer steps taken before the latest training batch (the label Lightning gives its figures)."""
    loop = trainer.fit_loop
    return loop.logging_step - 1 if loop.stepped else loop.logging_step


def _host_stats() -> dict[str, float]:
    try:
        return Accelerator("cpu").get_device_stats("cpu")
    except ModuleNotFoundError:  # no psutil: this process's memory, where the platform tells it
        return _host_memory()


def _host_memory() -> dict[str, float]:
    """This process's resident memory now and at its peak, where the platform tells them."""
    stats = {}
    try:  # Linux
        with open("/proc/self/statm") as file:
            resident_pages = int(file.read().split()[1])
        stats["cpu_rss_mb"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / _MB
    except (OSError, ValueError, AttributeError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return stats
    peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # KiB
    peak = peak_bytes / _MB
    # The kernel updates the peak lazily, so it can lag a fresh reading of the current size.
    stats["cpu_peak_rss_mb"] = max(peak, stats.get("cpu_rss_mb", 0.0))
    return stats
