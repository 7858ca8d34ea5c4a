"""``CSVLogger``: metrics in a CSV file, hyperparameters beside it. No dependency beyond the standard library."""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping
from typing import Any

from ember.loggers.logger import VersionedLogger


class CSVLogger(VersionedLogger):
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
        super().__init__(save_dir, name, version)
        self._flush_every = flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = []
        self._file_columns: list[str] | None = None  # the header of metrics.csv as written
        self._last_flush_step = 0

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, "metrics.csv")

    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        self.write_hparams_file(params)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        last = self._rows[-1] if self._rows else None
        # Values logged at the same step share a row, unless an epoch began in between (the
        # epoch-start values of the next epoch come at the step where the last one ended).
        if last is not None and last["step"] == step and last.get("epoch") == row.get("epoch"):
            last.update(row)
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
