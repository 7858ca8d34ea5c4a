"""``StageThroughputMonitor``: Lightning's ``ThroughputMonitor``, the running counts and rates of each stage."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ember.callbacks.callback import Callback
from ember.callbacks.throughput import peak_flops
from ember.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class _Window:
    """One stage's running totals since it started, and the last ``size`` of them, for the rates."""

    def __init__(self, size: int) -> None:
        self.samples = self.batches = self.lengths = 0
        self.logged = 0  # where the stage's batches are labelled on the loggers (they count across a fit)
        self.start = time.perf_counter()
        self.last = self.start
        self.points: deque[tuple[float, int, int, int]] = deque(maxlen=size)  # time, batches, samples, lengths
        self.flops: deque[float] = deque(maxlen=size)


class StageThroughputMonitor(Callback):
    """Log the throughput of each stage as Lightning's ``ThroughputMonitor`` does (the Lightning name serves this
    class; ``ThroughputMonitor`` is Ember's own, with TFLOP/s and MFU from counted FLOPs).

    At each logging step (every ``log_every_n_steps`` optimizer steps in training, every ``log_every_n_steps``
    batches of an evaluation or prediction) it logs ``<stage>/time`` (seconds since the stage started, training
    without its validations), ``<stage>/batches``, ``<stage>/samples`` and, with ``length_fn``, ``<stage>/lengths``,
    ``<stage>`` being ``train``, ``validate``, ``test`` or ``predict``. Once ``window_size`` batches are seen, the
    rates over the last ``window_size``: ``<stage>/device/batches_per_sec``, ``samples_per_sec``, ``items_per_sec``
    (with ``length_fn``), ``flops_per_sec`` (when the module has a ``flops_per_batch`` attribute) and ``mfu`` (where
    the device's peak is known); with several processes also the totals of all of them, without ``device/``.

    Args:
        batch_size_fn: the number of samples in a batch.
        length_fn: the number of items (tokens, ...) in a batch.
        window_size: how many of the latest batches the rates are measured over (at least 2).
        separator: what joins the parts of the names.
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int],
        length_fn: Callable[[Any], int] | None = None,
        *,
        window_size: int = 100,
        separator: str = "/",
    ) -> None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"ThroughputMonitor(window_size={window_size!r}): expected an int >= 2")
        self.batch_size_fn, self.length_fn = batch_size_fn, length_fn
        self.window_size, self.separator = window_size, separator
        self.available_flops: float | None = None
        self._windows: dict[str, _Window] = {}
        self._warned = False

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        self.available_flops = peak_flops(trainer.strategy.root_device, trainer.precision)

    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._start("train", trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._update("train", trainer, pl_module, batch)
        every = trainer.log_every_n_steps
        if trainer.fit_loop.stepped and every and (trainer.global_step % every == 0 or trainer.should_stop):
            self._log("train", trainer, max(trainer.global_step - 1, 0), trainer.current_epoch)

    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None:
        if not trainer.sanity_checking:
            self._start("validate", trainer)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, *_: Any) -> None:
        if not trainer.sanity_checking:
            self._evaluated("validate", trainer, pl_module, batch)

    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None:
        train, validate = self._windows.get("train"), self._windows.get("validate")
        if trainer.sanity_checking or train is None or validate is None:
            return
        train.start += validate.last - train.last  # the training time leaves out the validation's

    def on_test_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._start("test", trainer)

    def on_test_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, *_: Any) -> None:
        self._evaluated("test", trainer, pl_module, batch)

    def on_predict_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._start("predict", trainer)

    def on_predict_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, *_: Any) -> None:
        self._evaluated("predict", trainer, pl_module, batch)

    # ------------------------------------------------------------------------------ internals
    def _start(self, stage: str, trainer: Trainer) -> None:
        """Start the stage's clock and window. An evaluation's logging steps go on from its previous run's, so no
        step repeats; so do its counts when it is run again on its own (``trainer.test`` twice, as in Lightning),
        while a fit's validations each count their batches from zero."""
        previous = self._windows.get(stage)
        window = self._windows[stage] = _Window(self.window_size)
        if previous is None or stage == "train":
            return
        window.logged = previous.logged
        if trainer.state.fn != "fit":
            window.batches, window.samples, window.lengths = previous.batches, previous.samples, previous.lengths

    def _evaluated(self, stage: str, trainer: Trainer, pl_module: Module, batch: Any) -> None:
        window = self._update(stage, trainer, pl_module, batch)
        window.logged += 1
        every = trainer.log_every_n_steps
        if every and window.batches % every == 0:
            self._log(stage, trainer, window.logged, None)

    @torch.inference_mode()  # batch_size_fn and length_fn build no graph
    def _update(self, stage: str, trainer: Trainer, pl_module: Module, batch: Any) -> _Window:
        window = self._windows[stage]
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the batch's kernels are part of its time
        window.last = time.perf_counter()
        window.batches += 1
        window.samples += self.batch_size_fn(batch)
        if self.length_fn is not None:
            window.lengths += self.length_fn(batch)
        self._check_counts(window)
        window.points.append((window.last - window.start, window.batches, window.samples, window.lengths))
        flops = getattr(pl_module, "flops_per_batch", None)
        if flops is not None:
            window.flops.append(flops)
        elif not self._warned:
            self._warned = True
            rank_zero_warn(
                "When using the `ThroughputMonitor`, you need to define a `flops_per_batch` attribute or property in "
                f"{type(pl_module).__name__} to compute the FLOPs."
            )
        return window

    def _check_counts(self, window: _Window) -> None:
        """Refuse running totals that cannot be, as Lightning does: a sample holds at least one item, a batch at
        least one sample (by the totals, so that one empty batch among full ones passes, as there)."""
        if window.samples < window.batches:
            raise ValueError(
                f"Expected samples ({window.samples}) to be greater or equal than batches ({window.batches}): "
                "ThroughputMonitor(batch_size_fn=...) must give the number of samples in a batch"
            )
        if self.length_fn is not None and window.lengths < window.samples:
            raise ValueError(
                f"Expected lengths ({window.lengths}) to be greater or equal than samples ({window.samples}): "
                "ThroughputMonitor(length_fn=...) must give the number of items (such as tokens) in a batch, all "
                "its samples' together"
            )

    def _log(self, stage: str, trainer: Trainer, step: int, epoch: int | None) -> None:
        figures = {f"{stage}{self.separator}{name}": value for name, value in self._figures(stage, trainer).items()}
        trainer.run_metrics.write(figures, step, epoch)

    def _figures(self, stage: str, trainer: Trainer) -> dict[str, float]:
        window, sep, processes = self._windows[stage], self.separator, trainer.world_size
        seconds, batches, samples, lengths = window.points[-1]
        figures: dict[str, float] = {"time": seconds, "batches": batches, "samples": samples}
        if self.length_fn is not None:
            figures["lengths"] = lengths
        if len(window.points) < self.window_size:
            return figures
        first, last = window.points[0], window.points[-1]
        elapsed = last[0] - first[0]
        rates: dict[str, float] = {"batches_per_sec": last[1] - first[1], "samples_per_sec": last[2] - first[2]}
        if self.length_fn is not None:
            rates["items_per_sec"] = last[3] - first[3]
        if len(window.flops) == self.window_size:  # the first batch's work was done before the window's time
            rates["flops_per_sec"] = sum(window.flops) - window.flops[0]
        for name, amount in rates.items():
            figures[f"device{sep}{name}"] = amount / elapsed
            if processes > 1:
                figures[name] = amount / elapsed * processes
        if "flops_per_sec" in rates and self.available_flops:
            figures[f"device{sep}mfu"] = figures[f"device{sep}flops_per_sec"] / self.available_flops
        return figures
