"""``ModelCheckpoint``: save the run every N steps, epochs or minutes, keeping the best or latest files."""

from __future__ import annotations

import math
import os
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember.callbacks.callback import Callback, settings_key

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

_PLACEHOLDER = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


class ModelCheckpoint(Callback):
    """Write checkpoints during ``fit``; only the global-zero process writes, each file atomically.

    With the sharded strategies (fsdp, model_parallel, pipeline) a checkpoint is a directory to which
    every rank writes its shard; it is kept, replaced and removed like a file.

    Args:
        dirpath: directory for the files (default: ``<log_dir>/checkpoints``).
        filename: a format such as ``"{epoch}-{val_loss:.3f}"``; ``epoch``, ``step`` and logged metrics
            can be used (default ``"epoch={epoch}-step={step}"``).
        monitor: metric that ranks checkpoints; without it the latest ones are kept.
        mode: ``"min"`` or ``"max"``: which direction of ``monitor`` is better.
        save_top_k: how many files to keep (-1 all, 0 none besides ``last``).
        save_last: also keep ``last.ckpt``, always the newest complete checkpoint.
        every_n_train_steps / every_n_epochs / train_time_interval: when to save (one of them;
            default every epoch).
        save_weights_only: write only the module's weights.
        auto_insert_metric_name: ``"{epoch}"`` becomes ``"epoch=3"`` in file names.
        save_on_train_epoch_end: True saves at the end of each epoch (after the epoch's validation, if any);
            False after each validation of ``fit`` instead, so an epoch without one saves nothing; None (the
            default) chooses as Lightning does: after each validation when there are validations but not one at
            the end of every epoch (``check_val_every_n_epoch`` other than 1, or ``val_check_interval`` other
            than 1.0), else at the end of each epoch.
    """

    reads_epoch_metrics = True
    FILE_EXTENSION = ".ckpt"
    LAST_NAME = "last"
    _TIME_CHECK_EVERY = 10

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        save_top_k: int = 1,
        save_last: bool | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: timedelta | None = None,
        save_weights_only: bool = False,
        auto_insert_metric_name: bool = True,
        verbose: bool = False,
        save_on_train_epoch_end: bool | None = None,
    ) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"ModelCheckpoint(mode={mode!r}): choose 'min' or 'max'")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (all), 0, or a positive count")
        for flag, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"ModelCheckpoint({flag}={value!r}) must be a non-negative int")
        triggers = [every_n_train_steps, every_n_epochs, train_time_interval]
        if sum(trigger is not None for trigger in triggers) > 1:
            raise ValueError(
                "ModelCheckpoint: give only one of every_n_train_steps, every_n_epochs and train_time_interval"
            )
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        no_trigger = every_n_train_steps is None and train_time_interval is None
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (1 if no_trigger else 0)
        self.save_weights_only = save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self.verbose = verbose
        self.save_on_train_epoch_end = save_on_train_epoch_end

        self.best_k_models: dict[str, float] = {}
        self.best_model_path = ""
        self._best_model_score: float | None = None
        self.last_model_path = ""
        self._latest_paths: list[str] = []  # without a monitor: newest last
        self._last_saved_step: int | None = None
        self._last_time_save = time.monotonic()
        self._steps_since_time_check = 0
        self._validated_at_epoch_end = False

    @property
    def best_model_score(self) -> torch.Tensor | None:
        """The monitored value of the best checkpoint, as a tensor (Lightning's type), or None before one."""
        return None if self._best_model_score is None else torch.tensor(self._best_model_score)

    @best_model_score.setter
    def best_model_score(self, value: float | torch.Tensor | None) -> None:
        self._best_model_score = None if value is None else float(value)

    @property
    def state_key(self) -> str:
        return settings_key(
            self,
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self.every_n_train_steps,
            every_n_epochs=self.every_n_epochs,
            train_time_interval=self.train_time_interval,
        )

    # -------------------------------------------------------------------------------- hooks
    def has_work_in(self, hook: str) -> bool:
        # Its batch hook saves by step count or by time only; a subclass's own batch hook is always called.
        if hook == "on_train_batch_end" and type(self).on_train_batch_end is ModelCheckpoint.on_train_batch_end:
            return bool(self.every_n_train_steps) or self.train_time_interval is not None
        return True

    def setup(self, trainer: Trainer, module: Module, stage: str) -> None:
        if stage == "fit":
            self._last_time_save = time.monotonic()

    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.every_n_train_steps:
            step = trainer.global_step
            if step > 0 and step % self.every_n_train_steps == 0:
                self._save(trainer)
        elif self.train_time_interval is not None and trainer.fit_loop.stepped:
            # Every rank must take the same decision (saving involves all of them), so rank zero's
            # clock decides; it is consulted every few steps to keep the communication rare.
            self._steps_since_time_check += 1
            if self._steps_since_time_check < self._TIME_CHECK_EVERY:
                return
            self._steps_since_time_check = 0
            elapsed = time.monotonic() - self._last_time_save
            if trainer.strategy.broadcast(elapsed >= self.train_time_interval.total_seconds()):
                self._save(trainer)
                self._last_time_save = time.monotonic()

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        validated, self._validated_at_epoch_end = self._validated_at_epoch_end, False
        if self._epoch_due(trainer) and (validated or not self._after_validations(trainer)):
            self._save(trainer)

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        if trainer.stage != "fit" or trainer.sanity_checking or not self._after_validations(trainer):
            return
        if trainer.fit_loop.at_epoch_end:
            # Saved at the epoch's end, just after this: a checkpoint then resumes at the next epoch.
            self._validated_at_epoch_end = True
        elif self._epoch_due(trainer):
            self._save(trainer)

    def _epoch_due(self, trainer: Trainer) -> bool:
        return bool(self.every_n_epochs) and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _after_validations(self, trainer: Trainer) -> bool:
        """Whether to save after each validation rather than at the end of each epoch (Lightning's choice)."""
        if self.save_on_train_epoch_end is not None:
            return not self.save_on_train_epoch_end
        every_epoch_end = trainer.check_val_every_n_epoch == 1 and trainer.val_check_interval == 1.0
        return trainer.validation_enabled and not every_epoch_end

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "dirpath": self.dirpath,
            "best_model_path": self.best_model_path,
            "best_model_score": self._best_model_score,
            "best_k_models": dict(self.best_k_models),
            "last_model_path": self.last_model_path,
            "latest_paths": list(self._latest_paths),
        }

    def on_load_checkpoint(self, trainer: Trainer, module: Module, checkpoint: dict[str, Any]) -> None:
        self._default_dirpath(trainer)  # the state is this callback's own only if it was saved from here

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A run continued in place ("last") saves where its predecessor did and takes over its files. A
        # run started from another run's checkpoint has a directory of its own: the other run's bookkeeping
        # does not describe it, and its files are not this run's to replace or delete.
        if state.get("dirpath") != self.dirpath:
            return
        self.best_model_path = state["best_model_path"]
        self.best_model_score = state["best_model_score"]
        self.best_k_models = dict(state["best_k_models"])
        self.last_model_path = state["last_model_path"]
        self._latest_paths = list(state.get("latest_paths", []))

    # ------------------------------------------------------------------------------- saving
    def _save(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run:
            return  # a quick check that the code runs keeps nothing
        if self._last_saved_step == trainer.global_step:
            return  # nothing trained since the last save (accumulating micro-batches share a step)
        self._last_saved_step = trainer.global_step
        directory = self._default_dirpath(trainer)
        path, evicted = self._choose_path(trainer)
        last = os.path.join(directory, self.LAST_NAME + self.FILE_EXTENSION) if self.save_last else None
        if last is not None:
            self.last_model_path = last
        # The bookkeeping above is final before writing, so each checkpoint carries its own save's state.
        # With async_checkpoint the write goes on in the background; the strategy links and removes files
        # only after it, so "last" and the top k never point at a file that is not complete.
        strategy = trainer.strategy
        if path is not None:
            trainer.save_checkpoint(path, weights_only=self.save_weights_only)
            if last is not None:
                strategy.link_checkpoint(path, last)
        elif last is not None:
            trainer.save_checkpoint(last, weights_only=self.save_weights_only)
        if self.verbose and path is not None:
            trainer.print(f"ModelCheckpoint: saved {path}")
        for old in evicted:
            if old != path:
                strategy.remove_checkpoint(old)  # a file, or a sharded checkpoint's directory
        strategy.barrier()

    def _default_dirpath(self, trainer: Trainer) -> str:
        if self.dirpath is None:  # decided once the run directory is: "checkpoints" in it
            self.dirpath = os.path.join(trainer.log_dir or trainer.config.root_dir, "checkpoints")
        return self.dirpath

    def _choose_path(self, trainer: Trainer) -> tuple[str | None, list[str]]:
        """Where this save goes (None: only ``last``), and the kept files it pushes out of the top k."""
        metrics = trainer.callback_metrics
        if not self.save_top_k:
            return None, []
        if self.monitor is None:
            path = self._path(trainer, metrics)
            self.best_model_path = path  # without a monitor, the newest is the best we know
            self._latest_paths = [*(kept for kept in self._latest_paths if kept != path), path]
            evicted = []
            while self.save_top_k != -1 and len(self._latest_paths) > self.save_top_k:
                evicted.append(self._latest_paths.pop(0))
            return path, evicted
        if self.monitor not in metrics:
            raise KeyError(
                f"ModelCheckpoint(monitor={self.monitor!r}): no metric of that name was logged; "
                f"logged metrics are {sorted(metrics)}"
            )
        score = float(metrics[self.monitor])
        if not self._is_top_k(score):
            return None, []
        path = self._path(trainer, metrics)
        return path, self._record_top_k(path, score)

    def _path(self, trainer: Trainer, metrics: dict[str, torch.Tensor]) -> str:
        return os.path.join(self.dirpath or ".", self._format_name(trainer, metrics) + self.FILE_EXTENSION)

    def _format_name(self, trainer: Trainer, metrics: dict[str, torch.Tensor]) -> str:
        template = self.filename or "{epoch}-{step}"
        values: dict[str, Any] = {}

        def substitute(match: re.Match) -> str:
            name, spec = match.group(1), match.group(2) or ""
            if name == "epoch":
                value: Any = trainer.current_epoch
            elif name == "step":
                value = trainer.global_step
            elif name in metrics:
                value = float(metrics[name])
            else:
                raise KeyError(
                    f"ModelCheckpoint(filename={template!r}): {name!r} is not epoch, step or a logged "
                    f"metric (logged: {sorted(metrics)})"
                )
            key = f"_{len(values)}"
            values[key] = value
            prefix = f"{name}=" if self.auto_insert_metric_name else ""
            return prefix + "{" + key + spec + "}"

        return _PLACEHOLDER.sub(substitute, template).format(**values).replace(os.sep, "_")

    def _is_top_k(self, score: float) -> bool:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        return self._better(score, self._worst_kept()[1])

    def _better(self, score: float, other: float) -> bool:
        if math.isnan(score):
            return False
        if math.isnan(other):
            return True
        return score < other if self.mode == "min" else score > other

    def _worst_kept(self) -> tuple[str, float]:
        worst = None
        for path, score in self.best_k_models.items():
            if worst is None or self._better(worst[1], score):
                worst = (path, score)
        assert worst is not None
        return worst

    def _record_top_k(self, path: str, score: float) -> list[str]:
        """Add ``path`` to the kept files and return those that fall out of the top k."""
        self.best_k_models[path] = score
        evicted = []
        if self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            worst, _ = self._worst_kept()
            del self.best_k_models[worst]
            evicted.append(worst)
        best_path = path
        for candidate, candidate_score in self.best_k_models.items():
            if self._better(candidate_score, self.best_k_models[best_path]):
                best_path = candidate
        self.best_model_path = best_path
        self.best_model_score = self.best_k_models[best_path]
        return evicted
