"""The ``Logger`` base class and run versioning shared by the file-based loggers."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any


class Logger:
    """Where metrics and hyperparameters go. The Trainer calls loggers on the global-zero process only."""

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> int | str:
        return 0

    @property
    def save_dir(self) -> str | None:
        """The directory runs of this logger live under, or None if it keeps nothing on disk."""
        return None

    @property
    def log_dir(self) -> str | None:
        """This run's directory (checkpoints go under it by default)."""
        return None

    def use_version(self, version: int | str) -> None:
        """Adopt ``version`` (rank zero's choice), so that every rank names the same run directory."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        pass

    def save(self) -> None:
        """Flush what is buffered."""

    def finalize(self, status: str) -> None:
        """Called once at the end of a stage with "success", "failed" or "interrupted"."""
        self.save()


_VERSION_DIR = re.compile(r"^version_(\d+)$")


def next_version(root: str) -> int:
    """One more than the highest ``version_N`` directory under ``root`` (0 if there is none)."""
    if not os.path.isdir(root):
        return 0
    versions = [int(m.group(1)) for entry in os.listdir(root) if (m := _VERSION_DIR.match(entry))]
    return max(versions) + 1 if versions else 0
