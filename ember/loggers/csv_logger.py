"""``CSVLogger``: metrics in a CSV file, hyperparameters beside it. No dependency beyond the standard library."""

from __future__ import annotations

import contextlib
import csv
import io
import os
from collections.abc import Mapping
from typing import Any

from ember.loggers.logger import VersionedLogger


class CSVLogger(VersionedLogger):
    """Writes ``<save_dir>/<name>/version_<N>/metrics.csv`` (one row per logged step) and ``hparams.yaml``.

    Rows are buffered and appended every ``flush_logs_every_n_steps`` steps and at the end of a stage;
    when a new metric appears, a complete file with the wider header replaces the old one atomically.
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
        # metrics.csv's path and descriptor, open from the first append to the end of the stage (an open per
        # append took a measurable share of a small model's steps)
        self._file: tuple[str, int] | None = None

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
        """Append the buffered rows to ``metrics.csv``.

        The file is only ever appended to: a failed write (a full disk) is cut back to the rows written
        before. When a new metric appears, a complete file with the wider header replaces it at once
        (written beside it, then renamed), so the history is never truncated either.
        """
        if not self._rows:
            return
        path = self.metrics_file
        if self._file_columns is None:  # first write: continue a file a resumed run left, if any
            os.makedirs(self.log_dir, exist_ok=True)
            self._file_columns = _read_header(path)
            known = self._file_columns
            self._columns = known + [column for column in self._columns if column not in known]
        # The known columns begin with the file's (new metrics are added at the end): more means new ones.
        widened = not self._file_columns or len(self._columns) > len(self._file_columns)
        if widened:
            self._close()
            _replace(path, _csv_text(self._columns, [*_read_rows(path), *self._rows], header=True))
        else:
            _append(self._descriptor(path), _csv_text(self._columns, self._rows, header=False))
        self._file_columns = list(self._columns)
        self._last_flush_step = self._rows[-1]["step"]
        self._rows.clear()

    def finalize(self, status: str) -> None:
        super().finalize(status)
        self._close()

    def _descriptor(self, path: str) -> int:
        if self._file is None or self._file[0] != path:
            self._close()
            self._file = (path, os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666))
        return self._file[1]

    def _close(self) -> None:
        if self._file is not None:
            os.close(self._file[1])
            self._file = None


def _csv_text(columns: list[str], rows: list[dict[str, Any]], header: bool) -> str:
    text = io.StringIO()
    writer = csv.writer(text)
    if header:
        writer.writerow(columns)
    writer.writerows([row.get(column, "") for column in columns] for row in rows)
    return text.getvalue()


def _append(fd: int, text: str) -> None:
    """Append ``text`` whole or not at all: a write cut short (a full disk) is truncated back to where it began."""
    start = os.lseek(fd, 0, os.SEEK_END)
    remaining = memoryview(text.encode())
    try:
        while remaining:
            remaining = remaining[os.write(fd, remaining) :]
    except OSError:
        os.ftruncate(fd, start)
        raise


def _replace(path: str, text: str) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w", newline="") as file:
            file.write(text)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


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
