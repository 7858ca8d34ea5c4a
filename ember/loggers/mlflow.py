"""``MLflowLogger``: metrics and hyperparameters in an MLflow run, by default in a local ``mlruns/`` store."""

from __future__ import annotations

import os
import re
import time
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from ember._utils import require
from ember.loggers.logger import DEFAULT_NAME, Logger, default_name, flatten, params_dict, prefixed

_STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
_NOT_ALLOWED_IN_KEYS = re.compile(r"[^\w\-. /:]")  # what MLflow accepts in metric and param names
_MAX_PARAM_LENGTH = 6000  # MLflow refuses longer parameter values
_METRICS_PER_CALL, _PARAMS_PER_CALL = 1000, 100  # the most MLflow takes in one call


class MLflowLogger(Logger):
    """Logs to an MLflow run (one run per Trainer): metrics with their step, hyperparameters as params.

    Without ``tracking_uri`` (or the ``MLFLOW_TRACKING_URI`` variable) runs go to a local file store in
    ``save_dir``, which ``mlflow ui --backend-store-uri ./mlruns`` shows. ``run_id`` continues an existing
    run. ``version`` is the run id and ``name`` the experiment id, as in MLflow. Needs the mlflow package
    (``pip install 'ember[mlflow]'``, which installs mlflow-skinny). Characters MLflow does not accept
    in names become "_". As in Lightning, ``prefix`` is put before each metric's name (``prefix-name``).
    """

    #: What joins ``prefix`` and a metric's name (Lightning's class attribute: a subclass may change it).
    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        experiment_name: str = DEFAULT_NAME,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, Any] | None = None,
        save_dir: str | os.PathLike = "./mlruns",
        artifact_location: str | None = None,
        run_id: str | None = None,
        prefix: str = "",
    ) -> None:
        require("mlflow", "mlflow", "MLflowLogger")
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self._local_dir: str | None = None
        if not tracking_uri:
            self._local_dir = os.path.abspath(os.fspath(save_dir))
            tracking_uri = "file:" + self._local_dir
        elif tracking_uri.startswith("file:"):
            self._local_dir = os.path.abspath(tracking_uri.removeprefix("file:").removeprefix("//"))
        if self._local_dir is not None:
            # MLflow 3 keeps its file store only for those who opt in; a local store needs no server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._tracking_uri = tracking_uri
        self._experiment_name = default_name() if experiment_name == DEFAULT_NAME else experiment_name
        self._run_name = run_name
        self._tags = {key: str(value) for key, value in (tags or {}).items()}
        self._artifact_location = artifact_location
        self._run_id = run_id
        self._prefix = prefix
        self._experiment_id: str | None = None
        self._client: Any = None

    @property
    def experiment(self) -> Any:
        """The ``mlflow.MlflowClient`` this logger writes through."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self._tracking_uri)
        return self._client

    @property
    def name(self) -> str:
        """The experiment id (the experiment is created if it does not exist yet)."""
        if self._experiment_id is None:
            experiment = self.experiment.get_experiment_by_name(self._experiment_name)
            if experiment is not None:
                self._experiment_id = experiment.experiment_id
            else:
                self._experiment_id = self.experiment.create_experiment(
                    self._experiment_name, artifact_location=self._artifact_location
                )
        return self._experiment_id

    @property
    def version(self) -> str:
        """The run id (the run is created on first use)."""
        if self._run_id is None:
            run = self.experiment.create_run(self.name, run_name=self._run_name, tags=self._tags)
            self._run_id = run.info.run_id
        return self._run_id

    @property
    def run_id(self) -> str:
        return self.version

    def use_version(self, version: int | str) -> None:
        self._run_id = str(version)

    @property
    def save_dir(self) -> str | None:
        """The local store's directory, or None when runs go to a tracking server."""
        return self._local_dir

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        named = prefixed(metrics, self._prefix, self.LOGGER_JOIN_CHAR)
        entries = [Metric(_key(name), float(value), timestamp, step or 0) for name, value in named.items()]
        for start in range(0, len(entries), _METRICS_PER_CALL):
            self.experiment.log_batch(run_id=self.version, metrics=entries[start : start + _METRICS_PER_CALL])

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace | None, *args: Any, **kwargs: Any) -> None:
        from mlflow.entities import Param

        flat = flatten(params_dict(params))
        entries = [Param(_key(key), str(value)[:_MAX_PARAM_LENGTH]) for key, value in flat.items()]
        for start in range(0, len(entries), _PARAMS_PER_CALL):
            self.experiment.log_batch(run_id=self.version, params=entries[start : start + _PARAMS_PER_CALL])

    def finalize(self, status: str) -> None:
        if self._run_id is not None:
            self.experiment.set_terminated(self._run_id, _STATUS.get(status, "FINISHED"))


def _key(name: str) -> str:
    return _NOT_ALLOWED_IN_KEYS.sub("_", name)
