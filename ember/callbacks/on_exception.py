"""``OnExceptionCheckpoint``: keep the work done since the last checkpoint when ``fit`` dies of an exception."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ember import checkpoint as checkpoint_io
from ember.callbacks.callback import Callback
from ember.checkpoint.state import training_state

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class OnExceptionCheckpoint(Callback):
    """Write ``<dirpath>/<filename>.ckpt`` when ``fit`` stops with an exception (Ctrl-C included).

    The exception may have hit one rank only, so no rank waits for the others: each writes its own
    view (``<filename>-rank<N>.ckpt`` when there are several), with the position of the last
    finished batch. ``fit(ckpt_path="last")`` resumes from it when it is the newest checkpoint.
    """

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        self.dirpath = os.fspath(dirpath)
        self.filename = filename

    @property
    def state_key(self) -> str:
        return f"OnExceptionCheckpoint{{dirpath={self.dirpath!r}, filename={self.filename!r}}}"

    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None:
        if trainer.stage != "fit" or not trainer.optimizers:
            return  # nothing was trained yet
        suffix = f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        path = os.path.join(self.dirpath, f"{self.filename}{suffix}.ckpt")
        checkpoint_io.save(training_state(trainer, weights_only=False, gather=False), path)
        print(f"OnExceptionCheckpoint: {type(exception).__name__} stopped fit; saved {path}")
