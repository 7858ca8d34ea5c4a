"""Where a run writes: its directory (``version_N``, the first file-keeping logger's, or one of its own for the
checkpoints of a run without such a logger) and its checkpoints' directory. Rank zero settles it once per
Trainer, before any work, and every rank uses the same."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ember import checkpoint as checkpoint_io
from ember.loggers.logger import VersionedLogger, claim_version, lineage_version, settle_versions

if TYPE_CHECKING:
    from ember.trainer import Trainer


class RunDirectory:
    """The run's directory of one Trainer: ``settle`` claims it, the rest reads it."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._settled = False
        self._version: int | None = None  # the run directory's version when no logger keeps one

    @property
    def log_dir(self) -> str | None:
        """The first logger's directory, or the one claimed for the run's checkpoints (None: neither)."""
        loggers = self._trainer.loggers
        log_dir = loggers[0].log_dir if loggers else None
        if log_dir is None and self._version is not None:
            return os.path.join(self.runs_dir, f"version_{self._version}")
        return log_dir

    @property
    def runs_dir(self) -> str:
        """Where this run's directory and its predecessors' are: the first file-keeping logger's
        ``<save_dir>/<name>``, else ``<default_root_dir>/ember_logs``."""
        for logger in self._trainer.loggers:
            if isinstance(logger, VersionedLogger):
                return logger.runs_dir
        return os.path.join(self._trainer.config.root_dir, "ember_logs")

    @property
    def checkpoint_dir(self) -> str:
        """The first ModelCheckpoint's directory, else ``<log_dir>/checkpoints``."""
        callback = self._trainer.checkpoint_callback
        if callback is not None and callback.dirpath:
            return callback.dirpath
        return os.path.join(self.log_dir or self._trainer.config.root_dir, "checkpoints")

    def claim_for_preemption(self) -> None:
        """A run that keeps no files otherwise (no logger, no ModelCheckpoint) claims its ``version_N`` for a
        preemption's checkpoint now, rank zero's for every rank, so that ``ckpt_path="last"`` finds it."""
        trainer = self._trainer
        if self.log_dir is None and trainer.checkpoint_callback is None:
            claimed = claim_version(self.runs_dir) if trainer.is_global_zero else None
            self._version = trainer.strategy.broadcast(claimed)

    def settle(self, continuing: str | None = None) -> None:
        """Rank zero claims this run's directory (or, continuing the checkpoint ``continuing`` in place, takes the
        one that holds it) and checks that it can write there, before any work; every rank then uses the same."""
        if self._settled:
            return
        trainer = self._trainer
        outcome = self._claim(trainer, continuing) if trainer.is_global_zero else None
        # None reaches the ranks of a replica group other than the first (fault tolerance), which write no files.
        versions, version, problem = trainer.strategy.broadcast(outcome) or self._unwritten(trainer)
        if problem is not None:
            raise problem  # rank zero's, of its own type (PermissionError, ...), on every rank
        for logger, logger_version in zip(trainer.loggers, versions):
            logger.use_version(logger_version)
        self._version = version
        self._settled = True

    @staticmethod
    def _unwritten(trainer: Trainer) -> tuple[list[int | str], None, None]:
        """The versions of a replica group that writes nothing: named after it, never created."""
        return [f"replica_group_{trainer.replica_group}"] * len(trainer.loggers), None, None

    def _claim(self, trainer: Trainer, continuing: str | None) -> tuple[list[int | str], int | None, OSError | None]:
        try:
            versions = settle_versions(trainer.loggers, continuing)
            # Without a logger that keeps files, checkpoints that have no directory of their own still get one
            # that belongs to this run alone.
            homeless = any(callback.dirpath is None for callback in trainer.checkpoint_callbacks)
            keeps_checkpoints = trainer.stage == "fit" and not trainer.config.fast_dev_run
            version = None
            if keeps_checkpoints and homeless and not any(logger.log_dir for logger in trainer.loggers):
                runs_dir = self.runs_dir
                version = lineage_version(runs_dir, continuing)
                version = claim_version(runs_dir) if version is None else version
            self._version = version
            for directory in self._written(trainer):
                checkpoint_io.prepare_directory(directory)
        except OSError as error:
            return [], None, error
        return versions, version, None

    def _written(self, trainer: Trainer) -> list[str]:
        """The directories this run writes into: its run directory and its checkpoints' directories."""
        log_dir = self.log_dir
        directories = [log_dir] if log_dir is not None else []
        default = os.path.join(log_dir or trainer.config.root_dir, "checkpoints")
        if trainer.stage == "fit" and not trainer.config.fast_dev_run:
            directories += [callback.dirpath or default for callback in trainer.checkpoint_callbacks]
        return directories
