"""``TQDMProgressBar``: Lightning's bar of that name, one tqdm bar per loop, moved every ``refresh_rate`` batches.

A program that uses Lightning's names gets it by default (Ember's own programs get ``ProgressBar``, redrawn by
time). Its parts are Lightning's public ones: the bars (``train_progress_bar``, ``val_progress_bar``, ...), made
by the ``init_*_tqdm`` methods a subclass may override, and ``Tqdm``, the tqdm class they are made of (this module
is also ``lightning.pytorch.callbacks.progress.tqdm_progress``, so replacing ``Tqdm`` here replaces the bars).
"""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from ember.callbacks.progress_base import ProgressBarBase
from ember.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

_PADDED = 5  # a float is shown in at least this many characters ("1.000"), so that the line does not jitter
_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class Tqdm(tqdm):
    """tqdm whose postfix shows floats with three decimals (``1.000``, ``0.100``), as Lightning's ``Tqdm``."""

    @staticmethod
    def format_num(n: int | float | str) -> str:
        text = n if isinstance(n, str) else tqdm.format_num(n)
        if isinstance(n, int) or "e" in text:
            return str(text)
        if "." not in text:
            try:
                float(text)
            except ValueError:  # not a number: shown as it is
                return text
            if len(text) >= _PADDED:  # a long whole number ("10000") gains nothing from a point
                return text
            text += "."
        return text + "0" * (_PADDED - len(text))


class _LoopBar:
    """A bar attribute of ``TQDMProgressBar`` (``train_progress_bar``, ...): the bar its loop made, settable."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.loop = name.removesuffix("_progress_bar")

    def __get__(self, progress: TQDMProgressBar | None, owner: type) -> Any:
        if progress is None:
            return self
        bar = progress._bars.get(self.loop)
        if bar is None:
            raise TypeError(f"The `{type(progress).__name__}.{self.loop}_progress_bar` has not been made yet: its loop "
                            "makes it")  # fmt: skip
        return bar

    def __set__(self, progress: TQDMProgressBar, bar: Any) -> None:
        progress._bars[self.loop] = bar


class TQDMProgressBar(ProgressBarBase):
    """Lightning's ``TQDMProgressBar(refresh_rate=1, process_position=0, leave=False)``.

    ``refresh_rate`` is a number of batches between updates (0 turns the bar off); ``process_position`` moves the
    bars down by two lines each (for several programs sharing a terminal); ``leave=True`` keeps each epoch's bar.
    """

    # The bar shows the epoch's values when the epoch ends, so it runs after they are reduced.
    reads_epoch_metrics = True

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False) -> None:
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise MisconfigurationException(
                f"{type(self).__name__}(refresh_rate={refresh_rate!r}): expected a number of batches >= 0"
            )
        super().__init__()
        self._refresh_rate = _tqdm_refresh_rate(refresh_rate)
        self._process_position = process_position
        self.leave = leave
        self._bars: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        """Without the Trainer and the bars (tqdm objects hold a lock and a stream)."""
        return {**super().__getstate__(), "_bars": {}}

    @property
    def refresh_rate(self) -> int:
        return self._refresh_rate

    @property
    def process_position(self) -> int:
        return self._process_position

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    # The bars, as Lightning names them; reading one before its loop has made it is a TypeError, as in Lightning.
    train_progress_bar = _LoopBar()
    val_progress_bar = _LoopBar()
    test_progress_bar = _LoopBar()
    predict_progress_bar = _LoopBar()

    # The bars' makers: a subclass may override them to change how a bar looks.
    def init_sanity_tqdm(self) -> Any:
        return self._new_bar(self.sanity_check_description, leave=False)

    def init_train_tqdm(self) -> Any:
        return self._new_bar(self.train_description, leave=True, smoothing=0)

    def init_predict_tqdm(self) -> Any:
        return self._new_bar(self.predict_description, leave=True, smoothing=0)

    def init_validation_tqdm(self) -> Any:
        # Inside fit the bar goes below the epoch's, and away when done.
        below = self.trainer.state.fn != "validate"
        return self._new_bar(self.validation_description, leave=not below, offset=int(below))

    def init_test_tqdm(self) -> Any:
        return self._new_bar(self.test_description, leave=True)

    def _new_bar(self, description: str, leave: bool, offset: int = 0, **kwargs: Any) -> Any:
        return Tqdm(
            desc=description, position=2 * self.process_position + offset, disable=self.is_disabled, leave=leave,
            dynamic_ncols=True, file=sys.stdout, bar_format=_FORMAT, **kwargs,
        )  # fmt: skip

    # ------------------------------------------------------------------------------- training
    def on_sanity_check_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.val_progress_bar = self.init_sanity_tqdm()
        self.train_progress_bar = Tqdm(disable=True)  # a stand-in, so that print() finds a bar in any loop

    def on_sanity_check_end(self, trainer: Trainer, pl_module: Module) -> None:
        self.val_progress_bar.close()
        self.train_progress_bar.close()

    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.train_progress_bar = self.init_train_tqdm()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        if self.leave:  # each epoch's bar stays on screen: a new one per epoch
            old = self.train_progress_bar
            old.leave = False  # the bar made when training started has shown nothing: it goes (an epoch's is closed)
            old.close()
            self.train_progress_bar = self.init_train_tqdm()
        _restart(self.train_progress_bar, self.total_train_batches, f"Epoch {trainer.current_epoch}")

    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if self._due(batch_idx + 1, bar.total):
            _move(bar, batch_idx + 1)
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
        if self.leave:
            self.train_progress_bar.close()

    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self._bars.get("train") is not None:  # none when training never started
            self.train_progress_bar.close()

    # ----------------------------------------------------------------------------- evaluation
    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None:
        if not trainer.sanity_checking:  # the sanity check's bar is made when it starts
            self.val_progress_bar = self.init_validation_tqdm()

    def on_validation_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:  # fmt: skip
        if self.has_dataloader_changed(dataloader_idx):
            title = self.sanity_check_description if trainer.sanity_checking else self.validation_description
            total = self.total_val_batches_current_dataloader
            _restart(self.val_progress_bar, total, f"{title} DataLoader {dataloader_idx}")

    def on_validation_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance(self.val_progress_bar, batch_idx)

    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self._bars.get("train") is not None and trainer.state.fn == "fit":  # the epoch's bar shows the results
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
        self.val_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    def on_test_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.test_progress_bar = self.init_test_tqdm()

    def on_test_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:  # fmt: skip
        if self.has_dataloader_changed(dataloader_idx):
            total = self.total_test_batches_current_dataloader
            _restart(self.test_progress_bar, total, f"{self.test_description} DataLoader {dataloader_idx}")

    def on_test_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance(self.test_progress_bar, batch_idx)

    def on_test_end(self, trainer: Trainer, pl_module: Module) -> None:
        self.test_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    def on_predict_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.predict_progress_bar = self.init_predict_tqdm()

    def on_predict_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None:  # fmt: skip
        if self.has_dataloader_changed(dataloader_idx):
            total = self.total_predict_batches_current_dataloader
            _restart(self.predict_progress_bar, total, f"{self.predict_description} DataLoader {dataloader_idx}")

    def on_predict_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:  # fmt: skip
        self._advance(self.predict_progress_bar, batch_idx)

    def on_predict_end(self, trainer: Trainer, pl_module: Module) -> None:
        self.predict_progress_bar.close()
        self.reset_dataloader_idx_tracker()

    def _advance(self, bar: Any, batch_idx: int) -> None:
        if self._due(batch_idx + 1, bar.total):
            _move(bar, batch_idx + 1)

    def _due(self, done: int, total: int | None) -> bool:
        """Whether the bar moves after ``done`` batches: every ``refresh_rate`` of them, and at the last."""
        return self.is_enabled and (done % self.refresh_rate == 0 or done == total)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` through the bar that is drawn (``tqdm.write``, which keeps the text off the bars' lines), or
        Python's ``print`` when none is."""
        bar = next((bar for bar in self._bars.values() if bar is not None and not bar.disable), None)
        if bar is None:
            print(*args, **kwargs)
            return
        sep = kwargs.pop("sep", " ")
        bar.write(sep.join(map(str, args)), **kwargs)


def _restart(bar: Any, total: float, description: str) -> None:
    """Start ``bar`` again from 0 with ``total`` batches (None: unknown, for an ``inf``) and ``description``."""
    bar.reset()
    bar.total = None if math.isinf(total) else total
    bar.initial = 0
    bar.set_description(description)


def _move(bar: Any, done: int) -> None:
    if not bar.disable:
        bar.n = done
        bar.refresh()


def _tqdm_refresh_rate(refresh_rate: int) -> int:
    """``refresh_rate`` as Lightning's TQDMProgressBar resolves it: 20 for the default on Google Colab (``COLAB_GPU``
    set), and at least tqdm's own ``TQDM_MINITERS`` when that is set."""
    if os.environ.get("COLAB_GPU") and refresh_rate == 1:
        return 20
    miniters = os.environ.get("TQDM_MINITERS", "")
    return max(int(miniters), refresh_rate) if miniters.isdigit() else refresh_rate
