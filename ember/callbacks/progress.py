"""``ProgressBar``: a live bar on a terminal, a compact line every few seconds in logs and CI output."""

from __future__ import annotations

import math
import sys
import time
from typing import IO, TYPE_CHECKING, Any

from ember._utils import batch_size_of
from ember.callbacks.callback import Callback
from ember.metrics import Number, to_floats

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class ProgressBar(Callback):
    """Shows epoch, batch/total, elapsed and remaining time, batches/s, samples/s, the loss and
    every value logged with ``prog_bar=True``, on the global-zero process only.

    On an interactive terminal it draws a tqdm bar (when tqdm is installed), redrawn every
    ``refresh_rate`` seconds; otherwise it prints one line every ``line_interval`` seconds and one
    at the end of each epoch and evaluation. Values are read from the device only when shown.
    During ``fit`` the validation bar is removed when it is done; values it logged with
    ``prog_bar=True`` show on the epoch's bar. ``stream`` defaults to stdout; ``interactive=None``
    asks whether ``stream`` is a terminal. Pass a subclass in ``callbacks`` to replace it, or
    ``Trainer(enable_progress_bar=False)`` to turn it off.
    """

    def __init__(
        self,
        refresh_rate: float = 0.25,
        line_interval: float = 5.0,
        stream: IO[str] | None = None,
        interactive: bool | None = None,
    ) -> None:
        for flag, value in (("refresh_rate", refresh_rate), ("line_interval", line_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"ProgressBar({flag}={value!r}): expected a number of seconds >= 0")
        self.refresh_rate = refresh_rate
        self.line_interval = line_interval
        self._stream = stream
        self._interactive = interactive
        self._train_line: _Line | None = None
        self._eval_line: _Line | None = None

    @property
    def stream(self) -> IO[str]:
        return self._stream or sys.stdout

    def _uses_tqdm(self) -> bool:
        interactive = self._interactive if self._interactive is not None else self.stream.isatty()
        if not interactive:
            return False
        try:
            import tqdm  # noqa: F401
        except ImportError:
            return False
        return True

    # ------------------------------------------------------------------------------- training
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        if trainer.is_global_zero:
            epochs = f"/{trainer.max_epochs}" if trainer.max_epochs not in (None, -1) else ""
            description = f"Epoch {trainer.current_epoch}{epochs}"
            self._train_line = _Line(self, description, trainer.num_training_batches, show_loss=True, keep=True)

    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._train_line is not None:
            self._train_line.advance(trainer, batch)

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self._train_line is not None:
            self._train_line.finish(trainer)
            self._train_line = None

    # ----------------------------------------------------------------------------- evaluation
    def on_validation_start(self, trainer: Trainer, module: Module) -> None:
        self._start_eval(trainer, "Validation")

    def on_validation_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance_eval(trainer, batch)

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        self._finish_eval(trainer)

    def on_test_epoch_start(self, trainer: Trainer, module: Module) -> None:
        self._start_eval(trainer, "Testing")

    def on_test_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance_eval(trainer, batch)

    def on_test_epoch_end(self, trainer: Trainer, module: Module) -> None:
        self._finish_eval(trainer)

    def on_predict_epoch_start(self, trainer: Trainer, module: Module) -> None:
        self._start_eval(trainer, "Predicting")

    def on_predict_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance_eval(trainer, batch)

    def on_predict_epoch_end(self, trainer: Trainer, module: Module) -> None:
        self._finish_eval(trainer)

    def _start_eval(self, trainer: Trainer, description: str) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            # During fit the validation bar goes away when done; its prog_bar values show on the epoch's bar.
            keep = trainer.stage != "fit"
            self._eval_line = _Line(self, description, sum(_eval_batches(trainer)), show_loss=False, keep=keep)

    def _advance_eval(self, trainer: Trainer, batch: Any) -> None:
        if self._eval_line is not None:
            self._eval_line.advance(trainer, batch)

    def _finish_eval(self, trainer: Trainer) -> None:
        if self._eval_line is not None:
            self._eval_line.finish(trainer)
            self._eval_line = None


class _Line:
    """One bar or line of progress: a training epoch, or a validation, test or predict run."""

    def __init__(self, owner: ProgressBar, description: str, total: float, show_loss: bool, keep: bool) -> None:
        self.owner = owner
        self.description = description
        self.total = total
        self.show_loss = show_loss
        self.count = 0
        self.shown_count = 0
        self.samples = 0
        self.started = time.monotonic()
        self.bar: Any = None
        self.interval = owner.refresh_rate
        if owner._uses_tqdm():
            from tqdm import tqdm

            self.bar = tqdm(
                total=None if math.isinf(total) else int(total), desc=description, file=owner.stream,
                dynamic_ncols=True, leave=keep, unit="batch",
            )  # fmt: skip
        else:
            self.interval = owner.line_interval
        self.next_refresh = self.started + self.interval
        self.last_batch: Any = None

    def advance(self, trainer: Trainer, batch: Any) -> None:
        self.count += 1
        self.last_batch = batch
        now = time.monotonic()
        if now >= self.next_refresh:
            self.next_refresh = now + self.interval
            self.show(trainer, now)

    def finish(self, trainer: Trainer) -> None:
        self.show(trainer, time.monotonic())
        if self.bar is not None:
            self.bar.close()

    def show(self, trainer: Trainer, now: float) -> None:
        # Samples are counted from the size of the latest batch, read only when the line is shown.
        new = self.count - self.shown_count
        if new and self.last_batch is not None:
            self.samples += new * batch_size_of(self.last_batch)
        self.shown_count = self.count
        elapsed = max(now - self.started, 1e-9)
        rates = f"{self.count / elapsed:.1f} batches/s, {self.samples / elapsed:.0f} samples/s"
        metrics = self._metrics(trainer)
        if self.bar is not None:
            self.bar.update(new)
            self.bar.set_postfix_str(f"{self.samples / elapsed:.0f} samples/s" + (f", {metrics}" if metrics else ""))
            return
        total = "?" if math.isinf(self.total) else str(int(self.total))
        remaining = ""
        if not math.isinf(self.total) and self.count:
            remaining = f"<{_clock((self.total - self.count) * elapsed / self.count)}"
        line = f"{self.description} {self.count}/{total} [{_clock(elapsed)}{remaining}, {rates}]"
        print(line + (f" {metrics}" if metrics else ""), file=self.owner.stream, flush=True)

    def _metrics(self, trainer: Trainer) -> str:
        values: dict[str, Number] = dict(trainer.progress_bar_metrics)
        last_loss = trainer.fit_loop.last_loss
        if self.show_loss and last_loss is not None:
            values = {"loss": last_loss, **values}
        floats = to_floats(values)
        return " ".join(f"{name}={value:.4g}" for name, value in floats.items())


def _eval_batches(trainer: Trainer) -> list[float]:
    """The batch counts of the evaluation in progress, per loader."""
    if trainer.stage == "predict":
        return trainer.num_predict_batches
    return trainer.num_test_batches if trainer.stage == "test" else trainer.num_val_batches


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
