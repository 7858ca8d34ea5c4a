"""``TensorBoardLogger``: event files that TensorBoard reads, written through ``torch.utils.tensorboard``."""

from __future__ import annotations

import numbers
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import torch

from ember._utils import require, tracing_graph
from ember.loggers.logger import (
    DEFAULT_NAME,
    VersionedLogger,
    flatten,
    params_dict,
    prefixed,
    save_hparams_to_yaml,
)
from ember.rank_zero import rank_zero_warn


class TensorBoardLogger(VersionedLogger):
    """Writes TensorBoard event files into ``<save_dir>/<name>/version_<N>``, and ``hparams.yaml`` beside them.

    Scalars appear under their logged names; hyperparameters appear in TensorBoard's HPARAMS tab next
    to the metrics that ``log_hyperparams`` names (``hp_metric`` by default: log a value to it, or give
    ``log_hyperparams(params, {"hp/acc": 0})`` with ``default_hp_metric=False``), as in Lightning. Extra keyword
    arguments go to ``torch.utils.tensorboard.SummaryWriter``
    (for example ``flush_secs``). Needs the ``tensorboard`` package: ``pip install 'ember[tensorboard]'``.

    Logged scalars are handed to the writer every ``flush_logs_every_n_steps`` steps and at the end of a
    stage, then written before training goes on. The writer's background thread otherwise wakes for each
    scalar and takes Python's interpreter lock from the training loop at every step that logs (4% of
    the time of a small model's epoch).

    As in Lightning, ``prefix`` is put before each metric's name (``prefix-name``), and logging the
    hyperparameters logs the metric ``hp_metric`` (-1, a placeholder to overwrite) unless
    ``default_hp_metric=False`` or ``log_hyperparams`` is given metrics of its own; ``hparams`` holds every
    hyperparameter logged (``hparams.yaml``). ``sub_dir`` puts the event files in ``version_<N>/<sub_dir>``
    (``log_dir``; checkpoints stay in ``version_<N>``); ``log_graph=True`` records the model's graph when ``fit``
    starts, traced with ``example_input_array``.
    """

    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | os.PathLike = ".",
        name: str | None = DEFAULT_NAME,
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | os.PathLike | None = None,
        flush_logs_every_n_steps: int = 100,
        **writer_options: Any,
    ) -> None:
        require("tensorboard", "tensorboard", "TensorBoardLogger")  # torch.utils.tensorboard writes through it
        super().__init__(save_dir, name, version)
        self._log_graph = log_graph
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self.hparams: dict[str, Any] = {}
        self._hparams_saved = False  # whether hparams.yaml is written
        self._default_hp_metric = default_hp_metric
        self._prefix = prefix
        self._writer_options = writer_options
        self._writer: Any = None
        self._flush_every = flush_logs_every_n_steps
        self._pending: list[tuple[str, Any, int | None]] = []  # (name, value, step) not yet handed to the writer
        self._last_flush_step = 0

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    @property
    def runs_dir(self) -> str:
        """``<save_dir>/<name>``, with ``~`` and environment variables (``$SCRATCH``) expanded, as Lightning's
        TensorBoardLogger expands its ``log_dir``."""
        return _expanded(super().runs_dir)

    @property
    def log_dir(self) -> str:
        """``version_dir``, or the ``sub_dir`` in it (expanded as ``runs_dir``)."""
        return self.version_dir if self._sub_dir is None else _expanded(os.path.join(self.version_dir, self._sub_dir))

    @property
    def experiment(self) -> Any:
        """The ``SummaryWriter`` (created on first use), for images, histograms and the like."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, **self._writer_options)
        return self._writer

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Write ``metrics``: numbers (or one-number tensors), or dicts of them, each drawn as lines in one chart
        (``add_scalars``), as in Lightning."""
        named = prefixed(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
        for name, value in named.items():
            # Checked here, since the writer gets them later: the error then points at the call that logged them.
            if not isinstance(value, (numbers.Number, torch.Tensor, Mapping)):
                raise ValueError(
                    f"TensorBoardLogger.log_metrics: {name}={value!r} cannot be logged; give a number, a tensor or a "
                    "dict of them"
                )
        self._pending.extend((name, value, step) for name, value in named.items())
        if step is not None and step - self._last_flush_step >= self._flush_every:
            self.save()

    def log_hyperparams(
        self,
        params: Mapping[str, Any] | Namespace | None,
        metrics: Mapping[str, float] | float | None = None,
        step: int | None = None,
    ) -> None:
        from torch.utils.tensorboard.summary import hparams

        params = params_dict(params)
        self.hparams.update(params)
        save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)
        self._hparams_saved = True
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        elif metrics is not None and not isinstance(metrics, Mapping):
            metrics = {"hp_metric": metrics}
        if not metrics:  # as in Lightning: the HPARAMS tab shows a run with the metrics named here, none without
            return
        self.log_metrics(metrics, step)
        values = {key: _hparam_value(value) for key, value in flatten(params).items()}
        writer = self.experiment.file_writer
        for summary in hparams(values, dict(metrics)):  # the experiment (its metrics), the session's start and end
            writer.add_summary(summary, step)

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Record ``model``'s graph, traced with ``input_array`` (by default its ``example_input_array``: a tensor,
        or a tuple of ``forward``'s arguments), if the logger was made with ``log_graph=True``."""
        if not self._log_graph:
            return
        example = getattr(model, "example_input_array", None) if input_array is None else input_array
        if example is None:  # Lightning's words, as every refusal below
            rank_zero_warn(
                "Could not log computational graph to TensorBoard: The `model.example_input_array` attribute is not "
                "set or `input_array` was not given."
            )
            return
        if not isinstance(example, (torch.Tensor, tuple)):
            rank_zero_warn(
                "Could not log computational graph to TensorBoard: The `input_array` or `model.example_input_array` "
                f"has type {type(example)} which can't be traced by TensorBoard. Make the input array a tuple "
                "representing the positional arguments to the model's `forward()` implementation."
            )
            return
        device = next(model.parameters(), torch.empty(0)).device
        moved = tuple(_to(item, device) for item in example) if isinstance(example, tuple) else example.to(device)
        with tracing_graph():  # a model that no Trainer holds yet is traced too
            self.experiment.add_graph(model, moved)

    def save(self) -> None:
        """Write the scalars logged so far, and whatever else was added to the writer."""
        if self._pending:
            writer = self.experiment
            for name, value, step in self._pending:
                if isinstance(value, Mapping):
                    writer.add_scalars(name, value, step)
                else:
                    writer.add_scalar(name, value, step)
            last_step = self._pending[-1][2]
            self._last_flush_step = self._last_flush_step if last_step is None else last_step
            self._pending = []
        if self._writer is not None:
            self._writer.flush()  # waits for the writer's thread, which then has the interpreter to itself
        # As in Lightning, the run's directory holds an hparams.yaml (`{}` at least) once it exists.
        if not self._hparams_saved and self.has_version and os.path.isdir(self.log_dir):
            path = os.path.join(self.log_dir, self.NAME_HPARAMS_FILE)
            if not os.path.isfile(path):
                save_hparams_to_yaml(path, self.hparams)
            self._hparams_saved = True

    def __getstate__(self) -> dict[str, Any]:
        """Without the writer (its thread and lock do not pickle): a copy opens its own when it first writes."""
        return {**self.__dict__, "_writer": None}

    def finalize(self, status: str) -> None:
        self.save()
        if self._writer is not None:
            self._writer.close()
            self._writer = None  # a later stage (test after fit) opens a new event file in the same directory


def _expanded(path: str) -> str:
    return os.path.expanduser(os.path.expandvars(path))


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _hparam_value(value: Any) -> int | float | str | bool:
    """A value TensorBoard can show: numbers (NumPy's too), strings and booleans as they are, a one-element tensor
    as its number (TensorBoard's writer indexes a tensor, which a 0-dimensional one refuses), anything else as
    text."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (bool, int, float, str)):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:  # a NumPy scalar, as its number
        return value.item()
    return str(value)
