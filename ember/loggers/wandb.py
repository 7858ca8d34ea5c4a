"""``WandbLogger``: metrics and hyperparameters in a Weights & Biases run (``WANDB_MODE=offline`` keeps it local)."""

from __future__ import annotations

import json
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from ember._utils import require
from ember.loggers.logger import Logger, params_dict


class WandbLogger(Logger):
    """Logs to a W&B run (one run per Trainer): metrics with the Trainer's step as ``trainer/global_step``,
    hyperparameters in the run's config.

    ``project`` and ``name`` name the project and the run; ``id`` (or ``version``) continues an existing run;
    ``offline=True`` (or ``WANDB_MODE=offline``) writes the run under ``save_dir``/wandb for ``wandb sync``.
    ``version`` is the run id and ``name`` the project, as in Lightning; checkpoints go under
    ``save_dir/<project>/<run id>/checkpoints``. Other keyword arguments go to ``wandb.init``. The run starts
    on first use (on rank zero only: the Trainer calls loggers there). Needs the wandb package
    (``pip install 'ember[wandb]'``). Checkpoints are not uploaded as artifacts (``log_model`` is refused).
    """

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | os.PathLike = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | os.PathLike | None = None,  # Lightning's and wandb.init's names
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        log_model: bool | str = False,
        experiment: Any = None,
        prefix: str = "",
        **kwargs: Any,
    ) -> None:
        require("wandb", "wandb", "WandbLogger")
        if log_model:
            raise ValueError(
                "WandbLogger(log_model=...): Ember does not upload checkpoints to W&B; they stay in the run's "
                "checkpoints directory (log them yourself with wandb.log_artifact if you need them there)"
            )
        self._save_dir = os.fspath(dir if dir is not None else save_dir)
        self._project = project or os.environ.get("WANDB_PROJECT", "lightning_logs")
        self._init: dict[str, Any] = {
            "name": name,
            "project": self._project,
            "dir": self._save_dir,
            "id": version or id,
            "resume": "allow",
            "anonymous": "allow" if anonymous else None,
            **({"mode": "offline"} if offline else {}),
            **kwargs,
        }
        self._prefix = prefix
        self._experiment = experiment

    def __getstate__(self) -> dict[str, Any]:
        # A started run stays in this process; a copy sent to another (a spawned worker) continues it by its id.
        state = dict(self.__dict__, _experiment=None)
        if self._experiment is not None:
            state["_init"] = {**self._init, "id": self._experiment.id}
        return state

    @property
    def experiment(self) -> Any:
        """The ``wandb`` run (started on first use, or the run that ``wandb.init`` started already)."""
        if self._experiment is None:
            import wandb

            self._experiment = wandb.run if wandb.run is not None else wandb.init(**self._init)
            if hasattr(self._experiment, "define_metric"):  # the Trainer's step is the x axis of every metric
                self._experiment.define_metric("trainer/global_step")
                self._experiment.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        return self._experiment

    @property
    def name(self) -> str:
        """The project."""
        return self._project

    @property
    def version(self) -> str:
        """The run id (the run is started if it has not been)."""
        return self._init["id"] if self._init["id"] is not None else self.experiment.id

    def use_version(self, version: int | str) -> None:
        self._init["id"] = str(version)

    @property
    def save_dir(self) -> str:
        return self._save_dir

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        values = {f"{self._prefix}-{key}" if self._prefix else key: value for key, value in metrics.items()}
        self.experiment.log(values if step is None else {**values, "trainer/global_step": step})

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace | None) -> None:
        """Update the run's config with ``params``, nested dicts kept as they are (W&B shows them as groups), as in
        Lightning: a class or function as its name, any other value JSON cannot hold as its text."""
        config = {key: _config_value(value) for key, value in params_dict(params).items()}
        self.experiment.config.update(config, allow_val_change=True)

    def finalize(self, status: str) -> None:
        """Nothing to flush: wandb writes as it goes, and ends the run when the process exits (or at
        ``wandb.finish()``), so that later stages of the same Trainer log into the same run."""


def _config_value(value: Any) -> Any:
    """``value`` as a W&B config holds it: a class or function (an optimizer's class, an activation) as its name
    (Lightning tries calling a function first, which Ember does not do to a user's code), anything JSON cannot
    hold as its text."""
    if callable(value) and hasattr(value, "__name__"):
        return value.__name__
    if value is None or isinstance(value, (bool, int, float, str, list, dict)):
        return value
    try:
        json.dumps(value)
    except (TypeError, ValueError, OverflowError):
        return str(value)
    return value
