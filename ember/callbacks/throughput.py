"""``ThroughputMonitor``: training speed (batches/s, samples/s) and, with FLOPs, TFLOP/s and MFU."""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember._utils import batch_size_of
from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException
from ember.rank_zero import rank_zero_warn_once

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

# Peak dense (no sparsity) FLOP/s per dtype, from NVIDIA's datasheets. "tf32" is float32 matmuls on tensor
# cores (float32_matmul_precision "high" or "medium"); 16-bit figures accumulate in float32, as autocast does.
# Matched in order against the words of torch.cuda.get_device_name(), so more specific names come first.
_PEAK_FLOPS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("h100", "nvl"), {"fp64": 60e12, "fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12}),
    (("h100", "pcie"), {"fp64": 51.2e12, "fp32": 51.2e12, "tf32": 378e12, "bf16": 756.5e12, "fp16": 756.5e12}),
    (("h100",), {"fp64": 67e12, "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),
    (("h200", "nvl"), {"fp64": 60e12, "fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12}),
    (("gh200",), {"fp64": 67e12, "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),
    (("h200",), {"fp64": 67e12, "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12}),
    (("a100",), {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}),
    (("a10g",), {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12}),
    (("a10",), {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12}),
    (("l40s",), {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12}),
    (("l40",), {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12}),
    (("l4",), {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12}),
    (("v100s",), {"fp64": 8.2e12, "fp32": 16.4e12, "fp16": 130e12}),
    (("v100", "pcie"), {"fp64": 7e12, "fp32": 14e12, "fp16": 112e12}),
    (("v100",), {"fp64": 7.8e12, "fp32": 15.7e12, "fp16": 125e12}),
    (("t4",), {"fp32": 8.1e12, "fp16": 65e12}),
    (("rtx", "4090"), {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12}),
    (("rtx", "3090"), {"fp32": 35.6e12, "tf32": 35.6e12, "bf16": 71e12, "fp16": 71e12}),
]  # fmt: skip

# The first batches compile the model, tune kernels and count FLOPs: they are not timed.
_WARMUP_BATCHES = 2


def peak_flops(device: torch.device, precision: str, *, convolutions: bool = False) -> float | None:
    """The peak FLOP/s of ``device`` at ``precision`` (a Trainer precision name), or None if unknown.

    In float32 that is TF32's where torch lets the operations use TF32 tensor cores: matrix products
    by the matmul precision, and with ``convolutions=True`` cuDNN's convolutions, which use them by
    default.
    """
    if device.type != "cuda":
        return None
    words = set(re.split(r"[^a-z0-9]+", torch.cuda.get_device_name(device).lower()))
    peaks = next((peaks for names, peaks in _PEAK_FLOPS if words.issuperset(names)), None)
    if peaks is None:
        return None
    if precision.startswith("bf16"):
        dtype = "bf16"
    elif precision.startswith("16"):
        dtype = "fp16"
    elif precision == "64-true":
        dtype = "fp64"
    else:
        dtype = "tf32" if _uses_tf32(convolutions) else "fp32"
    return peaks.get(dtype, peaks["fp32"] if dtype == "tf32" else None)  # no TF32 before Ampere


def step_peak_flops(device: torch.device, precision: str, flops: Mapping[Any, float]) -> float | None:
    """The peak FLOP/s of a step whose FLOPs per operator are ``flops`` (``FlopCounterMode``'s counts): its
    FLOPs over the time they take with convolutions and the rest each at their own peak."""
    matmuls, convolutions = peak_flops(device, precision), peak_flops(device, precision, convolutions=True)
    total = sum(flops.values())
    if matmuls is None or convolutions is None or not total:
        return matmuls
    in_convolutions = sum(count for op, count in flops.items() if "convolution" in str(op))
    return total / (in_convolutions / convolutions + (total - in_convolutions) / matmuls)


def _uses_tf32(convolutions: bool) -> bool:
    """Whether float32 matrix products (or cuDNN convolutions) may run on TF32 tensor cores.

    torch has two ways to say it: ``fp32_precision`` ("tf32", "ieee", or "none": as its parent says) on
    ``torch.backends`` and its backends, and the older flags. The older getters raise once the newer
    API has been used, so the newer settings are read first, the older flags only where none is set.
    """
    backends = torch.backends
    chain = [getattr(backends.cudnn, "conv", None), backends.cudnn] if convolutions else [backends.cuda.matmul]
    for backend in [*chain, backends]:
        setting = getattr(backend, "fp32_precision", "none")  # absent in older torch
        if setting != "none":
            return setting == "tf32"
    if convolutions:
        return bool(backends.cudnn.allow_tf32)
    return torch.get_float32_matmul_precision() != "highest"


class ThroughputMonitor(Callback):
    """Log how fast training runs: ``throughput/batches_per_sec`` and ``throughput/samples_per_sec`` (all
    processes together), and when the FLOPs of a sample are known, ``throughput/tflops_per_sec`` and
    ``throughput/mfu`` (model FLOPs utilisation: achieved over peak FLOP/s, both per device).

    Figures are averages over the training batches between two logging steps (every ``log_every_n_steps``
    optimizer steps), timed with ``time.perf_counter``; validation is left out, and so are the first two
    batches (compilation, kernel tuning, FLOP counting). The device is waited for only where a window
    ends, so no step is slowed down.

    Args:
        flops_per_sample: FLOPs of one training sample, forward and backward (6 x parameters x tokens is
            the usual estimate for transformers); ``"measure"`` counts them with ``torch.utils.flop_counter``
            on the first training batch (matrix products, convolutions and attention: the bulk); None logs no
            FLOP figures. Once measured, the attribute holds the count.
        peak_flops: the device's peak FLOP/s for MFU; by default looked up for common NVIDIA GPUs
            (H100, H200, A100, A10G, L4, L40S, V100, T4, RTX 4090, ...) in the dtype the precision uses.
            In float32, convolutions and matrix products may differ (cuDNN runs convolutions on TF32
            tensor cores by default, matrix products only with ``float32_matmul_precision="high"``): with
            measured FLOPs, each counts at its own peak; with given ones, the matrix products' peak is used.
        batch_size_fn: the number of samples in a batch; by default the first dimension of the first
            tensor in it (read from its shape, so the device is not waited for).
        log_every_n_steps: how often to log; by default the Trainer's ``log_every_n_steps`` (0 there: never).
    """

    def __init__(
        self,
        *,
        flops_per_sample: float | Literal["measure"] | None = "measure",
        peak_flops: float | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        log_every_n_steps: int | None = None,
    ) -> None:
        if flops_per_sample != "measure" and flops_per_sample is not None and not _is_positive(flops_per_sample):
            raise MisconfigurationException(
                f"ThroughputMonitor(flops_per_sample={flops_per_sample!r}): expected a positive number, "
                "'measure' or None"
            )
        if peak_flops is not None and not _is_positive(peak_flops):
            raise MisconfigurationException(
                f"ThroughputMonitor(peak_flops={peak_flops!r}): expected a positive number of FLOP/s"
            )
        if batch_size_fn is not None and not callable(batch_size_fn):
            raise MisconfigurationException(
                f"ThroughputMonitor(batch_size_fn={batch_size_fn!r}): expected a function of the batch"
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1
        ):
            raise MisconfigurationException(
                f"ThroughputMonitor(log_every_n_steps={log_every_n_steps!r}): expected an int >= 1"
            )
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops
        self.batch_size_fn = batch_size_fn or batch_size_of
        self.log_every_n_steps = log_every_n_steps
        self._counting: contextlib.ExitStack | None = None
        self._counter: Any = None
        self._device = torch.device("cpu")
        self._peak: float | None = None
        self._every = 1
        self._seen = 0  # training batches since the start of fit
        # The current window: training time before the running stretch, the stretch's start (None while
        # validating), and the batches and samples it holds.
        self._elapsed = 0.0
        self._start: float | None = None
        self._paused = False
        self._batches = 0
        self._samples = 0

    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        if not trainer.loggers:
            raise MisconfigurationException("ThroughputMonitor needs a logger; the Trainer was built with logger=False")
        self._device = trainer.strategy.root_device
        self._peak = self.peak_flops or peak_flops(self._device, trainer.precision)
        self._every = self.log_every_n_steps or trainer.log_every_n_steps
        self._seen = 0
        self._start = None
        self._paused = False

    def on_train_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int) -> None:
        if self.flops_per_sample != "measure" or self._seen:
            return
        eager = _eager()
        if eager is None:
            self.flops_per_sample = None
            rank_zero_warn_once(
                "ThroughputMonitor cannot count the FLOPs of a compiled model with torch < 2.6 (it needs "
                "torch.compiler.set_stance); pass flops_per_sample= to log TFLOP/s and MFU",
                stacklevel=2,
            )
            return
        from torch.utils.flop_counter import FlopCounterMode

        self._counting = contextlib.ExitStack()
        self._counting.enter_context(eager)
        self._counter = self._counting.enter_context(FlopCounterMode(display=False))

    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._counting is not None:
            self._stop_counting()
            self._set_measured_flops(self._counter.get_total_flops() / self.batch_size_fn(batch))
            if self.peak_flops is None:  # now the share of convolutions, whose peak may differ, is known
                self._peak = step_peak_flops(self._device, trainer.precision, self._counter.get_flop_counts()["Global"])
        self._seen += 1
        if self._seen <= _WARMUP_BATCHES:
            if self._seen == _WARMUP_BATCHES:
                self._open_window(self._now())
            return
        self._batches += 1
        self._samples += self.batch_size_fn(batch)
        every = self._every  # 0 (the Trainer's log_every_n_steps=0): never
        if self._start is not None and every and trainer.fit_loop.stepped and trainer.global_step % every == 0:
            now = self._now()
            figures = self._figures(self._elapsed + now - self._start, trainer)
            trainer.run_metrics.write(figures, trainer.global_step, trainer.current_epoch)
            self._open_window(now)

    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None:
        if self._start is not None:  # pause the window: validation is not training time
            self._elapsed += self._now() - self._start
            self._start = None
            self._paused = True

    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self._paused:
            self._start = self._now()
            self._paused = False

    def on_exception(self, trainer: Trainer, pl_module: Module, exception: BaseException) -> None:
        if self._counting is not None:
            self._stop_counting()

    # ------------------------------------------------------------------------------ internals
    def _now(self) -> float:
        if self._device.type == "cuda":
            # The kernels queued so far belong to the window that ends here: wait for them. This is the
            # only synchronisation, once per window, not per step.
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    def _open_window(self, now: float) -> None:
        self._elapsed, self._start, self._batches, self._samples = 0.0, now, 0, 0

    def _figures(self, seconds: float, trainer: Trainer) -> dict[str, float]:
        figures = {
            "throughput/batches_per_sec": self._batches / seconds,
            "throughput/samples_per_sec": self._samples * trainer.world_size / seconds,
        }
        if isinstance(self.flops_per_sample, (int, float)):
            flops = self.flops_per_sample * self._samples / seconds
            figures["throughput/tflops_per_sec"] = flops / 1e12
            if self._peak:
                figures["throughput/mfu"] = flops / self._peak
        return figures

    def _stop_counting(self) -> None:
        assert self._counting is not None
        self._counting.close()
        self._counting = None

    def _set_measured_flops(self, flops: float) -> None:
        if flops > 0:
            self.flops_per_sample = flops
            return
        self.flops_per_sample = None
        rank_zero_warn_once(
            "ThroughputMonitor counted no FLOPs in the first training batch (it counts matrix products, "
            "convolutions and attention); pass flops_per_sample= to log TFLOP/s and MFU",
            stacklevel=2,
        )


def _eager() -> contextlib.AbstractContextManager | None:
    """A context that runs the counted step without torch.compile (None where torch cannot): under a
    dispatch mode such as the FLOP counter, dynamo skips a frame it has not compiled yet, and then never
    compiles it."""
    if "torch._dynamo" not in sys.modules:  # torch.compile imports it, so nothing has been compiled
        return contextlib.nullcontext()
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else None


def _is_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
