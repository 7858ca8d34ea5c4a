"""``ProgressBar``: a bar redrawn in place on a terminal, a short line every few seconds in logs and pipes."""

from __future__ import annotations

import io
import math
import os
import sys
import time
from typing import IO, TYPE_CHECKING, Any

import torch

from ember._utils import batch_size_of, is_overridden, to_floats
from ember.callbacks.progress_base import ProgressBarBase
from ember.exceptions import MisconfigurationException
from ember.metrics import Number

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

_MIN_BAR = 10  # narrower than this, a bar says nothing: the line goes without one
_MAX_BAR = 40


class ProgressBar(ProgressBarBase):
    """Shows the epoch, batch/total, elapsed and remaining time, the loss and samples/s on the global-zero
    process; values logged with ``prog_bar=True`` follow when they fit the line, and all of them are on
    the line that ends each epoch.

    On a terminal (``interactive=None`` asks whether ``stream`` is one) it draws a bar in the terminal's
    width, redrawn at most every ``refresh_rate`` seconds; elsewhere (log files, pipes) it prints one line
    every ``line_interval`` seconds and one at the end of each epoch and evaluation. Values are read from
    the device only when drawn, all in one transfer. Validation draws its own bar, removed when done
    inside ``fit`` and left in place by ``validate``; ``test`` and ``predict`` draw theirs. ``stream``
    defaults to stdout. Pass a subclass in ``callbacks`` to replace it, or
    ``Trainer(enable_progress_bar=False)`` to turn it off.
    """

    # It runs after the epoch's values are reduced, so that the line ending an epoch shows that epoch's.
    reads_epoch_metrics = True

    def __init__(
        self,
        refresh_rate: float = 0.1,
        line_interval: float = 5.0,
        stream: IO[str] | None = None,
        interactive: bool | None = None,
    ) -> None:
        for flag, value in (("refresh_rate", refresh_rate), ("line_interval", line_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise MisconfigurationException(f"ProgressBar({flag}={value!r}): expected a number of seconds >= 0")
        if interactive not in (None, True, False):
            raise MisconfigurationException(f"ProgressBar(interactive={interactive!r}): expected True, False or None")
        super().__init__()
        self.refresh_rate = refresh_rate
        self._redraw_seconds = refresh_rate  # a subclass may read refresh_rate as Lightning's count of batches
        self.line_interval = line_interval
        self._stream = stream
        self._interactive = interactive
        self._train: ProgressDisplay | None = None
        self._eval: ProgressDisplay | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Without the Trainer and the bars being drawn (a copy is set up again by the next stage it runs in)."""
        return {**super().__getstate__(), "_train": None, "_eval": None}

    @property
    def stream(self) -> IO[str]:
        return self._stream or sys.stdout

    @property
    def interactive(self) -> bool:
        """Whether the output is a terminal, where the bar is redrawn in place."""
        if self._interactive is not None:
            return self._interactive
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty()) if callable(isatty) else False

    def columns(self) -> int:
        """The width to fit: ``COLUMNS`` when set, else the terminal's, else 80."""
        given = os.environ.get("COLUMNS", "")
        if given.isdigit() and int(given) > 0:
            return int(given)
        try:
            width = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):  # not a terminal, or a stream without a file
            return 80
        return width or 80  # a pseudo-terminal nobody sized says 0

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print``; while bars are drawn on the terminal, above them (they are drawn again below), so that
        the text neither lands on a bar's line nor is overwritten by it. ``Trainer.print`` comes here."""
        if not any(display is not None and display.bar is not None for display in (self._train, self._eval)):
            print(*args, **kwargs)
            return
        from tqdm import tqdm

        text = io.StringIO()
        print(*args, **{**kwargs, "file": text})
        tqdm.write(text.getvalue(), file=kwargs.get("file") or sys.stdout, end="")

    def display(self, title: str, total: float) -> ProgressDisplay:
        """A new bar (or periodic lines), left in place when done, for steps outside the loops (the tuner's)."""
        return ProgressDisplay(self, title, total, keep=True, samples=None)

    # ------------------------------------------------------------------------------- training
    def on_train_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        if not (trainer.is_global_zero and self.is_enabled):
            return
        # Counted from 0, as everywhere an epoch is numbered (trainer.current_epoch, messages, checkpoint names):
        # "Epoch 2/14" is the third of 15.
        epochs = f"/{trainer.config.epoch_limit - 1}" if trainer.config.epoch_limit != -1 else ""
        progress = trainer.fit_loop.progress  # a resumed epoch starts part-way
        self._train = ProgressDisplay(
            self, f"Epoch {trainer.current_epoch}{epochs}", trainer.fit_loop.batches_this_epoch(), keep=True,
            done=progress.epoch_batches, samples=progress.epoch_samples,
        )  # fmt: skip
        if self._train.terminal:
            self._draw_train(trainer, pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Per batch only a clock is read (``due()`` spelled out: a call more per batch is measurable on small
        # models); the device is read when the line is drawn.
        display = self._train
        if display is not None and time.monotonic() >= display.next_draw:
            self._draw_train(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self._train is not None:
            self._draw_train(trainer, pl_module, final=True)
            self._train = None

    def _draw_train(self, trainer: Trainer, pl_module: Module, final: bool = False) -> None:
        display, progress = self._train, trainer.fit_loop.progress
        assert display is not None
        display.count, display.samples = progress.epoch_batches, progress.epoch_samples
        # Before the epoch's first batch, the latest loss is the last epoch's: it is not shown.
        shown, extras = _train_values(trainer, with_loss=display.count > display.first_count)
        if is_overridden("get_metrics", self, ProgressBar):  # a subclass chooses the items, as on Lightning's bar
            names = {text.split("=", 1)[0] for text in shown}
            items = self.get_metrics(trainer, pl_module).items()
            extras = [f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                      for name, value in items if name not in names]  # fmt: skip
        display.draw(shown, extras, final=final)

    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None:
        # An epoch cut short by a preemption signal ends its line here, before the report of what was saved.
        if self._train is not None:
            self._draw_train(trainer, pl_module, final=True)
            self._train = None

    # ----------------------------------------------------------------------------- evaluation
    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None:
        counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        self._start_eval(trainer, self.validation_description, counts)

    def on_validation_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:  # fmt: skip
        self.has_dataloader_changed(dataloader_idx)  # for a subclass that reads the current loader's total

    def on_validation_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance_eval(batch)

    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None:
        self._finish_eval()

    def on_test_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._start_eval(trainer, self.test_description, trainer.num_test_batches)

    def on_test_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:  # fmt: skip
        self.has_dataloader_changed(dataloader_idx)

    def on_test_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance_eval(batch)

    def on_test_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        self._finish_eval()

    def on_predict_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._start_eval(trainer, self.predict_description, trainer.num_predict_batches)

    def on_predict_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:  # fmt: skip
        self.has_dataloader_changed(dataloader_idx)

    def on_predict_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance_eval(batch)

    def on_predict_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        self._finish_eval()

    def on_exception(self, trainer: Trainer, pl_module: Module, exception: BaseException) -> None:
        # End the lines in place, so that the traceback starts on a line of its own.
        for display in (self._eval, self._train):
            if display is not None:
                display.close()
        self._eval = self._train = None

    def _start_eval(self, trainer: Trainer, title: str, batches: list[float]) -> None:
        if trainer.is_global_zero and self.is_enabled and not trainer.sanity_checking:
            # Inside fit the bar goes below the epoch's and away when done; validate and test leave theirs.
            inside_fit = trainer.stage == "fit"
            self._eval = ProgressDisplay(self, title, sum(batches), keep=not inside_fit, nested=inside_fit)

    def _advance_eval(self, batch: Any) -> None:
        display = self._eval
        if display is not None and display.samples is not None:
            display.count += 1
            display.samples += batch_size_of(batch)  # shapes only: the device is not touched
            if display.due():
                display.draw([], [])

    def _finish_eval(self) -> None:
        self.reset_dataloader_idx_tracker()
        if self._eval is not None:
            self._eval.draw([], [], final=True)
            self._eval = None


def _train_values(trainer: Trainer, with_loss: bool) -> tuple[list[str], list[str]]:
    """The loss and the other ``prog_bar`` values as ``name=value`` texts, read from the device in one transfer.

    A value logged as the step's loss itself (``self.log("train_loss", loss, prog_bar=True)``) is shown
    once, under the name it was logged with.
    """
    values: dict[str, Number] = dict(trainer.run_metrics.progress_bar_values())
    loss = trainer.fit_loop.last_loss if with_loss else None
    loss_name = None
    if loss is not None:
        loss_name = next((name for name, value in values.items() if _same_tensor(value, loss)), None)
        if loss_name is None:
            loss_name = "loss"
            values = {"loss": loss, **values}
    floats = to_floats(values)
    texts = {name: f"{name}={value:.4g}" for name, value in floats.items()}
    shown_loss = [texts.pop(loss_name)] if loss_name is not None else []
    return shown_loss, list(texts.values())


def _same_tensor(value: Number, loss: torch.Tensor) -> bool:
    """Whether ``value`` is the loss tensor (or a view of it): compared by storage, without reading it."""
    return (
        isinstance(value, torch.Tensor)
        and value.device == loss.device
        and value.dtype == loss.dtype
        and value.numel() == loss.numel()
        and value.data_ptr() == loss.data_ptr()
    )


class ProgressDisplay:
    """One progress display: a bar redrawn in place on a terminal, lines every ``line_interval`` elsewhere.

    Its owner sets ``count`` (batches or steps done) and ``samples`` (samples done; None: not counted)
    and calls ``draw`` with the values that are always shown and those shown when they fit. samples/s
    is the samples done over the time taken since the display began (``done`` and ``samples`` are where
    it began: a resumed epoch begins part-way).
    """

    def __init__(self, owner: ProgressBar, title: str, total: float, *, keep: bool, nested: bool = False,
                 done: int = 0, samples: int | None = 0) -> None:  # fmt: skip
        self.owner = owner
        self.title = title
        self.total = total
        self.keep = keep
        self.nested = nested
        self.count = self.first_count = done
        self.samples = self.first_samples = samples
        self.terminal = owner.interactive
        self.interval = owner._redraw_seconds if self.terminal else owner.line_interval
        self.started = time.monotonic()
        self.next_draw = self.started + self.interval
        self.bar: Any = None  # the tqdm bar, made at the first draw
        self.width = self.bar_width = 0

    def due(self) -> bool:
        """Whether it is time to draw again (each draw puts the next one an interval away)."""
        return time.monotonic() >= self.next_draw

    def draw(self, shown: list[str], extras: list[str], final: bool = False) -> None:
        """Draw the display; ``final`` draws its last line, with every value, and ends it."""
        now = time.monotonic()
        self.next_draw = now + self.interval
        elapsed = max(now - self.started, 1e-9)
        head = [self.title, f"{self.count}/{'?' if math.isinf(self.total) else int(self.total)}"]
        tail = [self._times(elapsed, final), *shown]
        if self.samples is not None and self.first_samples is not None:
            tail.append(_rate((self.samples - self.first_samples) / elapsed if self.count > self.first_count else None))
        if not self.terminal:
            _write(self.owner.stream, " ".join(_fitted(head + tail, extras, None if final else self.owner.columns())))
        elif not final:
            self._redraw(head, tail, extras)
        elif self.keep:
            self._keep(head, tail, extras)
        else:
            self.close(leave=False)

    def close(self, leave: bool = True) -> None:
        """End the bar: left as it is, or cleared."""
        if self.bar is not None:
            self.bar.leave = leave
            self.bar.close()
            self.bar = None

    def _times(self, elapsed: float, final: bool) -> str:
        done = self.count - self.first_count
        if final or math.isinf(self.total):
            return _clock(elapsed)
        remaining = _clock((self.total - self.count) * elapsed / done) if done else "?"
        return f"{_clock(elapsed)}<{remaining}"

    def _redraw(self, head: list[str], tail: list[str], extras: list[str], show: bool = True) -> bool:
        """Lay out the bar and draw it (a bar already shown: unless not ``show``); returns whether every
        extra value is on it."""
        width = self.owner.columns()
        left, right = " ".join(head), " ".join(tail)
        fitting = _fitted([], extras, width - len(left) - len(right) - 2 - _MIN_BAR)  # 2: the spaces around the bar
        right = " ".join([right, *fitting])
        # The bar only shrinks (while the terminal keeps its width), so that it does not jump as numbers change.
        widest = _MAX_BAR if width != self.width else self.bar_width
        self.width, self.bar_width = width, min(width - len(left) - len(right) - 2, widest)
        bar_width = self.bar_width
        if bar_width < _MIN_BAR or math.isinf(self.total):
            layout = _escaped(f"{left} {right}")
        else:
            layout = f"{_escaped(left)} {{bar:{bar_width}}} {_escaped(right)}"
        if self.bar is None:
            from tqdm import tqdm

            # tqdm hides bars below its idea of the screen's height, which is 0 rows on an unsized pseudo-terminal;
            # ours are on the first two rows.
            self.bar = tqdm(
                total=None if math.isinf(self.total) else int(self.total), initial=self.count, file=self.owner.stream,
                leave=self.keep, position=1 if self.nested else 0, ncols=width, nrows=24, bar_format=layout,
            )  # fmt: skip
        else:
            self.bar.ncols, self.bar.bar_format, self.bar.n = width, layout, self.count
            if show:
                self.bar.refresh()
        return len(fitting) == len(extras)

    def _keep(self, head: list[str], tail: list[str], extras: list[str]) -> None:
        """The last line, left in place: the bar when it was shown and every value fits on it, else a line
        of them all instead, broken between values to fit the terminal."""
        if self.bar is not None and self._redraw(head, tail, extras, show=False):
            self.close(leave=True)  # which draws it
            return
        self.close(leave=False)
        _write(self.owner.stream, _wrapped(head + tail + extras, self.owner.columns()))


def _fitted(pieces: list[str], extras: list[str], width: int | None) -> list[str]:
    """``pieces`` and, in order, the ``extras`` that keep the line (joined by spaces) within ``width``."""
    if width is None:
        return pieces + extras
    length = len(" ".join(pieces))
    kept = list(pieces)
    for extra in extras:
        if length + 1 + len(extra) <= width:
            kept.append(extra)
            length += 1 + len(extra)
    return kept


def _wrapped(pieces: list[str], width: int) -> str:
    """``pieces`` joined by spaces into lines of at most ``width`` columns, broken between pieces (the
    lines after the first indented by two)."""
    lines = [pieces[0]]
    for piece in pieces[1:]:
        if len(lines[-1]) + 1 + len(piece) <= width:
            lines[-1] += " " + piece
        else:
            lines.append("  " + piece)
    return "\n".join(line[:width] for line in lines)


def _escaped(text: str) -> str:
    """``text`` inside a tqdm ``bar_format``, which is a ``str.format`` template."""
    return text.replace("{", "{{").replace("}", "}}")


def _write(stream: IO[str], text: str) -> None:
    stream.write(text + "\n")
    stream.flush()


def _rate(samples_per_second: float | None) -> str:
    if samples_per_second is None:
        return "? samples/s"
    return f"{samples_per_second:.{1 if samples_per_second < 10 else 0}f} samples/s"


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"
