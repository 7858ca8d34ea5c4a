"""The ``Logger`` base class, and the versioned run directories shared by the file-based loggers."""

from __future__ import annotations

import json
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


class VersionedLogger(Logger):
    """A logger that writes into ``<save_dir>/<name>/version_<N>``, N one more than the last run's.

    The version is picked when first asked for (by the Trainer, on rank zero, before anything is
    written), so loggers sharing ``save_dir`` and ``name`` write into the same run directory.
    """

    def __init__(self, save_dir: str | os.PathLike, name: str, version: int | str | None) -> None:
        self._save_dir = os.fspath(save_dir)
        self._name = name
        self._version = version

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = next_version(os.path.join(self._save_dir, self._name))
        return self._version

    def use_version(self, version: int | str) -> None:
        self._version = version

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def log_dir(self) -> str:
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        return os.path.join(self._save_dir, self._name, version)

    def write_hparams_file(self, params: Mapping[str, Any]) -> None:
        """Write ``hparams.yaml`` into the run directory."""
        os.makedirs(self.log_dir, exist_ok=True)
        # JSON is valid YAML, so YAML readers (and Lightning tooling) can read this file too.
        with open(os.path.join(self.log_dir, "hparams.yaml"), "w") as file:
            json.dump(dict(params), file, indent=2, default=repr)
            file.write("\n")


_VERSION_DIR = re.compile(r"^version_(\d+)$")


def next_version(root: str) -> int:
    """One more than the highest ``version_N`` directory under ``root`` (0 if there is none)."""
    if not os.path.isdir(root):
        return 0
    versions = [int(m.group(1)) for entry in os.listdir(root) if (m := _VERSION_DIR.match(entry))]
    return max(versions) + 1 if versions else 0


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level, their keys joined with "/": {"opt": {"lr": 1}} becomes {"opt/lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
