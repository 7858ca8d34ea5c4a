"""``CSVLogger``: metrics in a CSV file, hyperparameters beside it. No dependency beyond the standard library."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping
from typing import Any

from ember.loggers.logger import Logger, next_version


class CSVLogger(Logger):
    """Writes ``<save_dir>/<name>/version_<N>/metrics.csv`` (one row per logged step) and ``hparams.yaml``.

    Rows are buffered and written every ``flush_logs_every_n_steps`` steps and at the end of a stage;
    when a new metric appears, the file is rewritten with the wider header.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike = ".",
        name: str = "ember_logs",
        version: int | str | None = None,
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        self._save_dir = os.fspath(save_dir)
        self._name = name
        self._version = version
        self._flush_every = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []
        self._file_columns: list[str] | None = None  # the header of metrics.csv as written
        self._last_flush_step = 0

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

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, "metrics.csv")

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        # JSON is valid YAML, so YAML readers (and Lightning tooling) can read this file too.
        with open(os.path.join(self.log_dir, "hparams.yaml"), "w") as file:
            json.dump(dict(params), file, indent=2, default=repr)
            file.write("\n")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        if self._rows and self._rows[-1]["step"] == step:
            self._rows[-1].update(row)  # values logged at the same step share a row
        else:
            self._rows.append(row)
        for key in row:
            if key not in self._columns:
                self._columns.append(key)
        if step - self._last_flush_step >= self._flush_every:
            self.save()

    def save(self) -> None:
        if not self._rows:
            return
        os.makedirs(self.log_dir, exist_ok=True)
        path = self.metrics_file
        if self._file_columns is None:  # first write: continue a file a resumed run left, if any
            self._file_columns = _read_header(path)
        widened = self._file_columns == [] or any(column not in self._file_columns for column in self._columns)
        self._columns = self._file_columns + [column for column in self._columns if column not in self._file_columns]
        earlier_rows = _read_rows(path) if widened else []
        with open(path, "w" if widened else "a", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self._columns)
            if widened:
                writer.writeheader()
                writer.writerows(earlier_rows)
            writer.writerows(self._rows)
        self._file_columns = list(self._columns)
        self._last_flush_step = self._rows[-1]["step"]
        self._rows.clear()


def _read_header(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as file:
        return list(csv.DictReader(file).fieldnames or [])


def _read_rows(path: str) -> list[dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as file:
        return list(csv.DictReader(file))
