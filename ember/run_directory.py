"""Where a run writes: its directory (the first logger's ``version_N``) and its checkpoints' directory (in it, or
``<default_root_dir>/checkpoints`` without a logger, as Lightning). Rank zero settles it once per Trainer, before
any work, and every rank uses the same."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ember import checkpoint as checkpoint_io
from ember.loggers.logger import Logger, VersionedLogger, default_name, run_directory_of, settle_versions

if TYPE_CHECKING:
    from ember.trainer import Trainer


class RunDirectory:
    """The run's directory of one Trainer: ``settle`` claims it, the rest reads it."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._settled = False
        #: The checkpoint the latest stage continues in place (a fit resumed with "last"), else None.
        self.continuing: str | None = None

    @property
    def log_dir(self) -> str | None:
        """As Lightning's ``trainer.log_dir``: the first logger's ``log_dir`` when it is a CSV or TensorBoard logger
        (a ``sub_dir`` included), another logger's ``save_dir`` (None: it keeps no files), or, without a logger,
        ``default_root_dir``."""
        loggers = self._trainer.loggers
        if not loggers:
            return self._trainer.config.root_dir
        first = loggers[0]
        return first.log_dir if isinstance(first, VersionedLogger) else getattr(first, "save_dir", None)

    @property
    def run_dir(self) -> str | None:
        """The first logger's run directory (``version_N``), where checkpoints go (None: no logger keeps files)."""
        loggers = self._trainer.loggers
        return run_directory_of(loggers[0]) if loggers else None

    @property
    def runs_dir(self) -> str:
        """Where this run's directory and its predecessors' are: the first file-keeping logger's
        ``<save_dir>/<name>``, else ``<default_root_dir>/ember_logs`` (see ``default_name``)."""
        for logger in self._trainer.loggers:
            if isinstance(logger, VersionedLogger):
                return logger.runs_dir
        return os.path.join(self._trainer.config.root_dir, default_name())

    @property
    def checkpoint_dir(self) -> str:
        """The first ModelCheckpoint's directory, else the default one."""
        callback = self._trainer.checkpoint_callback
        if callback is not None and callback.dirpath:
            return callback.dirpath
        return self.default_checkpoint_dir

    @property
    def default_checkpoint_dir(self) -> str:
        """Where checkpoints without a directory of their own go, as in Lightning: ``checkpoints`` in the first
        logger's run directory (see ``run_directory_of``), or in ``default_root_dir`` without a logger."""
        loggers, root = self._trainer.loggers, self._trainer.config.root_dir
        run_dir = run_directory_of(loggers[0], root) if loggers else None
        return os.path.join(run_dir or root, "checkpoints")

    def settle(self, continuing: str | None = None) -> None:
        """Rank zero claims this run's directory (or, continuing the checkpoint ``continuing`` in place, takes the
        one that holds it) and checks that it can write there, before any work; every rank then uses the same."""
        self.continuing = continuing
        if self._settled:
            return
        trainer = self._trainer
        outcome = self._claim(trainer, continuing) if trainer.is_global_zero else None
        # None reaches the ranks of a replica group other than the first (fault tolerance), which write no files.
        versions, problem = trainer.strategy.broadcast(outcome) or self._unwritten(trainer)
        if problem is not None:
            raise problem  # rank zero's, of its own type (PermissionError, ...), on every rank
        for logger, logger_version in zip(trainer.loggers, versions):
            if isinstance(logger, Logger):  # another object that logs keeps its own
                logger.use_version(logger_version)
        self._settled = True

    @staticmethod
    def _unwritten(trainer: Trainer) -> tuple[list[int | str], None]:
        """The versions of a replica group that writes nothing: named after it, never created."""
        return [f"replica_group_{trainer.replica_group}"] * len(trainer.loggers), None

    def _claim(self, trainer: Trainer, continuing: str | None) -> tuple[list[int | str], OSError | None]:
        try:
            versions = settle_versions(trainer.loggers, continuing)
            for directory in self._written(trainer):
                checkpoint_io.prepare_directory(directory)
            for logger in trainer.loggers:  # as Lightning, each starts its experiment (a W&B run) before any hook
                getattr(logger, "experiment", None)
        except OSError as error:
            return [], error
        return versions, None

    def _written(self, trainer: Trainer) -> list[str]:
        """The directories this run writes into: its run directory and its checkpoints' directories."""
        run_dir = self.run_dir
        directories = [run_dir] if run_dir is not None else []
        if trainer.stage == "fit" and not trainer.config.fast_dev_run:
            default = self.default_checkpoint_dir
            directories += [callback.dirpath or default for callback in trainer.checkpoint_callbacks]
        return directories
