"""``OnExceptionCheckpoint``: keep the work done since the last checkpoint when ``fit`` dies of an exception."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ember import checkpoint as checkpoint_io
from ember.callbacks.callback import Callback
from ember.checkpoint.state import FAILURE_MARK, nonfinite_parameters, training_state

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class OnExceptionCheckpoint(Callback):
    """Write ``<dirpath>/<filename>.ckpt`` when ``fit`` stops with an exception (Ctrl-C included).

    The exception may have hit one rank only, so no rank waits for the others: each writes its own
    view (``<filename>-rank<N>.ckpt`` when there are several), with the position of the last
    finished batch. The file is also linked into the run's checkpoint directory, where
    ``fit(ckpt_path="last")`` resumes from it when it is the newest checkpoint.

    Weights that hold a NaN or an infinity (after a diverging loss) are not resumable work: they are
    saved as ``<filename>.nonfinite.ckpt`` for a post-mortem, marked so, and "last" never picks them.
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
        checkpoint = training_state(trainer, weights_only=False, gather=False)
        nonfinite = nonfinite_parameters(module)
        if nonfinite:
            checkpoint["failure"] = {"exception": repr(exception), "nonfinite_parameters": nonfinite}
            suffix += FAILURE_MARK
        path = os.path.join(self.dirpath, f"{self.filename}{suffix}.ckpt")
        checkpoint_io.save(checkpoint, path)
        if nonfinite:
            print(f"OnExceptionCheckpoint: {type(exception).__name__} stopped fit with non-finite weights; saved "
                  f"{path} for a post-mortem (ckpt_path=\"last\" does not resume from it)")  # fmt: skip
            return
        run_copy = os.path.join(trainer.checkpoint_dir, os.path.basename(path))
        if os.path.abspath(run_copy) != os.path.abspath(path):
            checkpoint_io.link(path, run_copy)  # where "last" looks
        print(f"OnExceptionCheckpoint: {type(exception).__name__} stopped fit; saved {path}")
