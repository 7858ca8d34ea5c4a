"""``CSVLogger``: metrics in a CSV file, hyperparameters beside it. No dependency beyond the standard library."""

from __future__ import annotations

import contextlib
import csv
import io
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import torch

from ember.loggers.dummy import rank_zero_experiment
from ember.loggers.logger import (
    DEFAULT_NAME,
    VersionedLogger,
    params_dict,
    prefixed,
    save_hparams_to_yaml,
    url_filesystem,
)
from ember.rank_zero import rank_zero_warn


class ExperimentWriter:
    """What a ``CSVLogger`` writes into its run directory (``logger.experiment``, as Lightning's): ``metrics.csv``,
    from the rows of ``metrics`` that ``save`` appends, and ``hparams.yaml``.

    The file is only ever appended to: a failed write (a full disk) is cut back to the rows written before. When a
    new metric appears, a complete file with the wider header replaces it at once (written beside it, then
    renamed), so the history is never truncated either. A ``metrics.csv`` left in the directory by an earlier run
    is replaced (with a warning), unless ``continues`` says this run continues that one (it is appended to).
    Under a URL (``s3://...``: an object store, which cannot append) each ``save`` writes the file whole.
    """

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str, continues: bool = False) -> None:
        self.log_dir = log_dir
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        #: The rows logged and not yet written.
        self.metrics: list[dict[str, Any]] = []
        #: The columns, in alphabetical order as Lightning writes them: the file's and those of new metrics.
        self.metrics_keys: list[str] = []
        self.hparams: dict[str, Any] = {}
        self._file_columns: list[str] | None = None  # the header of metrics.csv as written
        # metrics.csv's descriptor, open from the first append to ``close`` (an open per append took a measurable
        # share of a small model's steps)
        self._descriptor: int | None = None
        self._filesystem = url_filesystem(log_dir)  # None: a local directory
        if not continues and self._exists(self.metrics_file_path):
            rank_zero_warn(
                f"Experiment logs directory {log_dir} exists and is not empty: the metrics.csv an earlier run left "
                "there is replaced by this run's (continue a run with fit(ckpt_path=...) to append to it)"
            )
            self._remove(self.metrics_file_path)
        self._make_log_dir()

    def log_metrics(self, metrics_dict: Mapping[str, Any], step: int | None = None) -> None:
        """Add a row (``step`` None: the number of rows not yet written, as Lightning's writer numbers them).
        Each call is a row of its own, as in Lightning: a validation's values and the training epoch's, both
        logged at the epoch's last step, are two rows."""
        row = {name: value.item() if isinstance(value, torch.Tensor) else value for name, value in metrics_dict.items()}
        row["step"] = len(self.metrics) if step is None else step
        self.metrics.append(row)
        if not row.keys() <= set(self.metrics_keys):
            self.metrics_keys = sorted(row.keys() | set(self.metrics_keys))

    def log_hparams(self, params: Mapping[str, Any]) -> None:
        """Add ``params`` to the hyperparameters and write them all to ``hparams.yaml``."""
        self.hparams.update(params)
        save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)

    def save(self) -> None:
        """Append the rows of ``metrics`` to ``metrics.csv``."""
        if not self.metrics:
            return
        path = self.metrics_file_path
        if self._file_columns is None:  # first write: continue the file of the run this one continues, if any
            self._make_log_dir()
            self._file_columns = _header(self._read(path, header_only=True))
            self.metrics_keys = sorted({*self._file_columns, *self.metrics_keys})
        if self._filesystem is not None:
            rows = [*_rows(self._read(path)), *self.metrics]
            self._filesystem.pipe_file(path, _csv_text(self.metrics_keys, rows, header=True).encode())
        # New metrics, or a file whose columns are in another order (an earlier release's), get a new header.
        elif self.metrics_keys != self._file_columns:
            self.close()
            _replace(path, _csv_text(self.metrics_keys, [*_rows(self._read(path)), *self.metrics], header=True))
        else:
            _append(self._open(path), _csv_text(self.metrics_keys, self.metrics, header=False))
        self._file_columns = list(self.metrics_keys)
        self.metrics = []

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def _exists(self, path: str) -> bool:
        return self._filesystem.isfile(path) if self._filesystem is not None else os.path.isfile(path)

    def _remove(self, path: str) -> None:
        if self._filesystem is not None:
            self._filesystem.rm_file(path)
        else:
            os.unlink(path)

    def _make_log_dir(self) -> None:
        if self._filesystem is not None:
            self._filesystem.makedirs(self.log_dir, exist_ok=True)
        else:
            os.makedirs(self.log_dir, exist_ok=True)

    def _read(self, path: str, header_only: bool = False) -> str:
        """The text of the file ``path``, or of its first line when only its header is wanted ("": no file)."""
        if not self._exists(path):
            return ""
        if self._filesystem is not None:
            return self._filesystem.cat_file(path).decode()
        with open(path, newline="") as file:
            return file.readline() if header_only else file.read()

    def _open(self, path: str) -> int:
        if self._descriptor is None:
            self._descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        return self._descriptor


class CSVLogger(VersionedLogger):
    """Writes ``<save_dir>/<name>/version_<N>/metrics.csv`` (one row per logged step) and ``hparams.yaml``.

    Rows are buffered (``experiment.metrics``) and appended every ``flush_logs_every_n_steps`` steps (when the
    step after a row's is a multiple of N, as in Lightning, or N steps after the last write, for logging steps
    that skip the multiples) and at the end of a stage. ``prefix`` is put before each metric's name
    (``prefix-name``). ``name=None`` (or "") puts the versions in ``save_dir`` itself.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike = ".",
        name: str | None = DEFAULT_NAME,
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        super().__init__(save_dir, name, version)
        self._prefix = prefix
        self._flush_every = flush_logs_every_n_steps
        self._last_flush_step = -1
        self._experiment: ExperimentWriter | None = None

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        """The run directory's writer, created on first use (``experiment.metrics``: the rows not yet written);
        on other processes than global zero, an object that takes any call and does nothing."""
        if self._experiment is None:
            self._experiment = ExperimentWriter(self.log_dir, continues=self.continues)
        return self._experiment

    @property
    def metrics_file(self) -> str:
        return os.path.join(self.log_dir, ExperimentWriter.NAME_METRICS_FILE)

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace | None = None) -> None:
        self.experiment.log_hparams(params_dict(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        experiment = self.experiment
        if step is None:
            step = len(experiment.metrics)
        experiment.log_metrics(prefixed(metrics, self._prefix, self.LOGGER_JOIN_CHAR), step)
        if (step + 1) % self._flush_every == 0 or step - self._last_flush_step > self._flush_every:
            self.save()

    def save(self) -> None:
        """Append the buffered rows to ``metrics.csv``."""
        if self._experiment is not None and self._experiment.metrics:
            self._last_flush_step = self._experiment.metrics[-1]["step"]
            self._experiment.save()

    def finalize(self, status: str) -> None:
        super().finalize(status)
        if self._experiment is not None:
            self._experiment.close()


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


def _header(text: str) -> list[str]:
    return list(csv.DictReader(io.StringIO(text, newline="")).fieldnames or [])


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text, newline="")))
