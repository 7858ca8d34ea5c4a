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

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        if not filename:
            raise ValueError("OnExceptionCheckpoint: the filename cannot be empty")
        self.dirpath = os.fspath(dirpath)
        self.filename = filename

    @property
    def ckpt_path(self) -> str:
        """``<dirpath>/<filename>.ckpt``, where the checkpoint is written (with one process)."""
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def on_exception(self, trainer: Trainer, pl_module: Module, exception: BaseException) -> None:
        if trainer.stage != "fit" or not trainer.optimizers:
            return  # nothing was trained yet
        path = save_after_failure(trainer, pl_module, exception, self.ckpt_path)
        if path is not None:
            run_copy = os.path.join(trainer.checkpoint_dir, os.path.basename(path))
            if os.path.abspath(run_copy) != os.path.abspath(path):
                checkpoint_io.link(path, run_copy)  # where "last" looks


def save_after_failure(trainer: Trainer, module: Module, exception: BaseException, path: str) -> str | None:
    """Save this rank's view of the training state at ``path`` (``-rank<N>`` before the extension when there are
    several processes) without waiting for the other ranks, and return where; None when the weights are not
    finite: they are saved with ``FAILURE_MARK`` in the name instead, for a post-mortem that "last" never picks."""
    root, extension = os.path.splitext(path)
    suffix = f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
    checkpoint = training_state(trainer, weights_only=False, gather=False)
    nonfinite = nonfinite_parameters(module)
    if nonfinite:
        checkpoint["failure"] = {"exception": repr(exception), "nonfinite_parameters": nonfinite}
        suffix += FAILURE_MARK
    path = f"{root}{suffix}{extension}"
    checkpoint_io.save(checkpoint, path)
    if nonfinite:
        print(f"{type(exception).__name__} stopped fit with non-finite weights; saved {path} for a post-mortem "
              f"(ckpt_path=\"last\" does not resume from it)")  # fmt: skip
        return None
    print(f"{type(exception).__name__} stopped fit; saved {path}")
    return path
