"""``ModelCheckpoint``: save the run every N steps, epochs or minutes, keeping the best or latest files."""

# The annotations stay real types, not strings (no postponed evaluation): argument parsers such as jsonargparse
# read them from the signature to convert command-line values (``--save_last link``).
import os
import re
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember import checkpoint as checkpoint_io
from ember.callbacks.callback import Callback, settings_key
from ember.callbacks.on_exception import save_after_failure
from ember.exceptions import MisconfigurationException
from ember.loggers.logger import run_directory_of
from ember.rank_zero import announce, rank_zero_warn_once

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

_PLACEHOLDER = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")  # s3://, gs://, memory://, ...: another file system than the local one


class ModelCheckpoint(Callback):
    """Write checkpoints during ``fit``; only the global-zero process writes, each file atomically.

    With the sharded strategies (fsdp, model_parallel, pipeline) a checkpoint is a directory to which
    every rank writes its shard; it is kept, replaced and removed like a file.

    Args:
        dirpath: directory for the files (default: ``<log_dir>/checkpoints``, or ``<default_root_dir>/checkpoints``
            without a logger); ``~`` is expanded. A local directory: another file system's URL (``s3://...``) is
            refused when ``fit`` starts.
        filename: a format such as ``"{epoch}-{val_loss:.3f}"``; ``epoch``, ``step`` and logged metrics
            can be used, a metric not logged yet counts as 0 (default ``"epoch={epoch}-step={step}"``).
        monitor: metric that ranks checkpoints (``"epoch"`` and ``"step"`` too); without it the latest is kept.
        verbose: log what is saved (the "ember" logger, at INFO).
        save_last: also keep ``last.ckpt`` (named by ``CHECKPOINT_NAME_LAST``), the newest complete checkpoint,
            written each time the callback is due; a link to the top-k file saved at the same time, if any
            (``"link"`` means the same).
        save_top_k: how many files to keep (-1 all, 0 none besides ``last``; without ``monitor`` only -1, 0 or 1:
            for the newest k, monitor ``"step"`` with ``mode="max"``).
        save_on_exception: when ``fit`` stops with an exception, save the work done since the last checkpoint
            (each process its own view, as ``OnExceptionCheckpoint``).
        save_weights_only: write only the module's weights.
        mode: ``"min"`` or ``"max"``: which direction of ``monitor`` is better.
        auto_insert_metric_name: ``"{epoch}"`` becomes ``"epoch=3"`` in file names.
        every_n_train_steps / every_n_epochs / train_time_interval: when to save (one of them; 0 is off;
            default every epoch). A save due by step or time that ``monitor``s a value not logged yet (or, saving
            after validations, falls just before one) waits for the next validation's end, to be ranked by a fresh
            value (as Lightning).
        save_on_train_epoch_end: True saves at the end of each epoch (after the epoch's validation, if any);
            False after each validation of ``fit`` instead, so an epoch without one saves nothing; None (the
            default) chooses as Lightning does: after each validation when there are validations but not one at
            the end of every epoch (``check_val_every_n_epoch`` other than 1, or ``val_check_interval`` other
            than 1.0), else at the end of each epoch.
        enable_version_counter: a new file whose name is taken by one the callback does not replace gets
            ``-v1`` (``-v2``, ...) appended; False overwrites it.
    """

    reads_epoch_metrics = True
    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = ".ckpt"
    STARTING_VERSION = 1
    _TIME_CHECK_EVERY = 10

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        save_top_k: int = 1,
        save_last: bool | Literal["link"] | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        train_time_interval: timedelta | None = None,
        save_weights_only: bool = False,
        auto_insert_metric_name: bool = True,
        verbose: bool = False,
        save_on_train_epoch_end: bool | None = None,
        save_on_exception: bool = False,
        enable_version_counter: bool = True,
    ) -> None:
        _check_options(mode, save_top_k, monitor, every_n_train_steps, every_n_epochs, train_time_interval)
        self.dirpath = _local_or_url(dirpath) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = train_time_interval
        no_trigger = every_n_train_steps is None and every_n_epochs is None and train_time_interval is None
        self.every_n_epochs = 1 if no_trigger else every_n_epochs or 0
        self.save_weights_only = save_weights_only
        self.auto_insert_metric_name = auto_insert_metric_name
        self.verbose = verbose
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.save_on_exception = save_on_exception
        self.enable_version_counter = enable_version_counter

        #: The kept files and their monitored values; the worst of them, and the value of the latest save.
        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value = torch.tensor(torch.inf if mode == "min" else -torch.inf)
        self.current_score: torch.Tensor | None = None
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.last_model_path = ""
        self._last_saved_step: int | None = None
        self._last_time_save = time.monotonic()
        self._steps_since_time_check = 0
        self._validated_at_epoch_end = False
        self._validated = False  # whether a validation of this fit has run (not the sanity check)
        self._deferred = False  # a save due by step or time waits for the next validation's monitored value

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

    def setup(self, trainer: "Trainer", pl_module: "Module", stage: str) -> None:
        if stage != "fit":
            return
        if self.dirpath is not None and _URL.match(self.dirpath):
            raise ValueError(
                f"ModelCheckpoint(dirpath={self.dirpath!r}, save_last={self.save_last!r}): {self.dirpath} is not a "
                "local directory; saving checkpoints is only supported for local file paths (each file is written "
                "atomically, and save_last links to the top-k file): mount the storage as a directory, or copy the "
                "files there after training"
            )
        # Decided once the run directory is, when the stage starts (reading it before would claim one).
        if self.dirpath is None and trainer.stage == "fit":
            root, first = trainer.default_root_dir, trainer.logger
            run_dir = run_directory_of(first, root) if first is not None else None  # not a sub_dir
            self.dirpath = os.path.join(run_dir or root, "checkpoints")
        self._last_time_save = time.monotonic()
        self._validated = self._deferred = False

    def on_train_batch_end(
        self, trainer: "Trainer", pl_module: "Module", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.every_n_train_steps:
            step = trainer.global_step
            if step > 0 and step % self.every_n_train_steps == 0:
                self._save_when_scored(trainer, batch_idx)
        elif self.train_time_interval is not None and trainer.fit_loop.stepped:
            # Every rank must take the same decision (saving involves all of them), so rank zero's
            # clock decides; with several processes it is consulted every few steps to keep the communication rare.
            self._steps_since_time_check += 1
            if self._steps_since_time_check < self._TIME_CHECK_EVERY and trainer.world_size > 1:
                return
            self._steps_since_time_check = 0
            elapsed = time.monotonic() - self._last_time_save
            if trainer.strategy.broadcast(elapsed >= self.train_time_interval.total_seconds()):
                self._save_when_scored(trainer, batch_idx)
                self._last_time_save = time.monotonic()

    def on_train_epoch_end(self, trainer: "Trainer", pl_module: "Module") -> None:
        validated, self._validated_at_epoch_end = self._validated_at_epoch_end, False
        deferred = validated and self._deferred
        if deferred or (self._epoch_due(trainer) and (validated or not self._after_validations(trainer))):
            self._deferred = False
            self._save(trainer)

    def on_validation_end(self, trainer: "Trainer", pl_module: "Module") -> None:
        if trainer.stage != "fit" or trainer.sanity_checking:
            return
        self._validated = True
        if not (self._deferred or (self._after_validations(trainer) and self._epoch_due(trainer))):
            return
        if trainer.fit_loop.at_epoch_end:
            # Saved at the epoch's end, just after this: a checkpoint then resumes at the next epoch.
            self._validated_at_epoch_end = True
        else:
            self._deferred = False
            self._save(trainer)

    def on_train_end(self, trainer: "Trainer", pl_module: "Module") -> None:
        # "last" is kept even when the schedule was never due (every_n_epochs beyond max_epochs, or 0).
        if self.save_last and not self.last_model_path and not trainer.fast_dev_run:
            self._save(trainer, top_k=False)

    def on_exception(self, trainer: "Trainer", pl_module: "Module", exception: BaseException) -> None:
        if not self.save_on_exception or trainer.stage != "fit" or trainer.fast_dev_run or trainer.preempted:
            return
        if not trainer.optimizers or self._last_saved_step == trainer.global_step:
            return  # training had not started, or nothing was trained since the last save
        metrics = self._candidates(trainer)
        previous_last = self.last_model_path
        linked = self.save_last and trainer.is_global_zero
        if linked:  # named first, so that the file saved records it (as in ``_save``)
            self.last_model_path = self._versioned(metrics, self.CHECKPOINT_NAME_LAST, previous_last)
        path = save_after_failure(trainer, pl_module, exception, self.format_checkpoint_name(metrics))
        if path is None:
            self.last_model_path = previous_last
        elif linked:
            # At once, not through the strategy's writer, which may hold the failed stage's write; no rank waits
            # for the others after a failure.
            checkpoint_io.link(path, self.last_model_path)

    def _save_when_scored(self, trainer: "Trainer", batch_idx: int) -> None:
        """A save due by step count or time, put off to the end of the next validation when that validation gives
        the monitored value (not logged yet, or, when saving after validations, validating right after this batch),
        as Lightning does: the checkpoint is then ranked by a value of its own weights, not by a stale one."""
        follows = self._after_validations(trainer) and _validates_after(trainer, batch_idx)
        scored_later = self.monitor not in self._candidates(trainer) or follows
        if self.monitor is not None and trainer.validation_enabled and scored_later:
            self._deferred = True
            return
        self._save(trainer)

    def _epoch_due(self, trainer: "Trainer") -> bool:
        return bool(self.every_n_epochs) and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    def _after_validations(self, trainer: "Trainer") -> bool:
        """Whether to save after each validation rather than at the end of each epoch (Lightning's choice)."""
        if self.save_on_train_epoch_end is not None:
            return not self.save_on_train_epoch_end
        every_epoch_end = trainer.check_val_every_n_epoch == 1 and trainer.val_check_interval == 1.0
        return trainer.validation_enabled and not every_epoch_end

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": self.dirpath,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A run continued in the same directory takes over its predecessor's files. A run with a directory of its
        # own (started from another run's checkpoint) only learns which checkpoint was the best: the other run's
        # files are not this run's to replace or delete.
        self.best_model_path = state_dict["best_model_path"]
        if state_dict.get("dirpath") != self.dirpath:
            warnings.warn(
                f"ModelCheckpoint: The dirpath has changed from {state_dict.get('dirpath')!r} to {self.dirpath!r}: "
                "only best_model_path is reloaded (not best_model_score, best_k_models, kth_best_model_path, "
                "kth_value nor last_model_path)",
                stacklevel=2,
            )
            return
        self.best_model_score = _score(state_dict["best_model_score"])
        self.best_k_models = {path: _tensor(score) for path, score in state_dict["best_k_models"].items()}
        self.kth_best_model_path = state_dict.get("kth_best_model_path", "")
        self.kth_value = _tensor(state_dict.get("kth_value", self.kth_value))
        self.last_model_path = state_dict["last_model_path"]

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Write ``best_k_models`` (path: monitored value) to a YAML file, ``<dirpath>/best_k_models.yaml`` by
        default."""
        import yaml  # only here: importing ember stays cheap

        if filepath is None:
            filepath = os.path.join(self.dirpath or ".", "best_k_models.yaml")
        with open(filepath, "w") as file:
            yaml.dump({path: score.item() for path, score in self.best_k_models.items()}, file)

    # ------------------------------------------------------------------------------- naming
    def format_checkpoint_name(
        self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None, prefix: str | None = None
    ) -> str:
        """The path of a checkpoint named by ``filename`` (default: the callback's), filled in from ``metrics``;
        ``prefix`` goes in front (``<prefix>-``), ``ver`` appends ``-v<ver>``."""
        template = filename or self.filename or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}"
        values: dict[str, Any] = {}

        def substitute(match: re.Match) -> str:
            name, spec = match.group(1), match.group(2) or ""
            value = metrics.get(name, 0)  # not logged yet: 0, as Lightning
            key = f"_{len(values)}"
            values[key] = value.item() if isinstance(value, torch.Tensor) else value
            prefix = name + self.CHECKPOINT_EQUALS_CHAR if self.auto_insert_metric_name else ""
            return prefix + "{" + key + spec + "}"

        name = _PLACEHOLDER.sub(substitute, template).format(**values)
        if prefix is not None:
            name = f"{prefix}{self.CHECKPOINT_JOIN_CHAR}{name}"
        if ver is not None:
            name += f"{self.CHECKPOINT_JOIN_CHAR}v{ver}"
        return os.path.join(self.dirpath or "", name + self.FILE_EXTENSION)

    def _candidates(self, trainer: "Trainer") -> dict[str, Any]:
        """What names and rankings read: the logged metrics, with the epoch and step (as logged, else the
        loop's)."""
        metrics: dict[str, Any] = dict(trainer.callback_metrics)
        for name, own in (("epoch", trainer.current_epoch), ("step", trainer.global_step)):
            logged = metrics.get(name)
            metrics[name] = logged.int() if isinstance(logged, torch.Tensor) else torch.tensor(own)
        return metrics

    def _free_path(self, trainer: "Trainer", metrics: dict[str, Any], filename: str | None, replacing: str) -> str:
        """``_versioned`` as rank zero sees the files, for every rank. Each rank computes its own first: a strategy
        whose broadcast does not reach global rank zero (a replica group of fault tolerance) keeps its own."""
        return trainer.strategy.broadcast(self._versioned(metrics, filename, replacing))

    def _versioned(self, metrics: dict[str, Any], filename: str | None, replacing: str) -> str:
        """The path for a new checkpoint: its name, with a version appended while the name is another file's
        (``replacing`` is the file the new one takes the place of)."""
        path = self.format_checkpoint_name(metrics, filename)
        if self.enable_version_counter:
            # The callback's own files count even before a write in the background has made them exist.
            taken = {*self.best_k_models, self.best_model_path, self.last_model_path} - {replacing, ""}
            version = self.STARTING_VERSION
            while path != replacing and (path in taken or os.path.lexists(path)):
                path = self.format_checkpoint_name(metrics, filename, ver=version)
                version += 1
        return path

    # ------------------------------------------------------------------------------- saving
    def _save(self, trainer: "Trainer", top_k: bool = True) -> None:
        if trainer.fast_dev_run:
            return  # a quick check that the code runs keeps nothing
        if self._last_saved_step == trainer.global_step:
            return  # nothing trained since the last save (accumulating micro-batches share a step)
        self._last_saved_step = trainer.global_step
        metrics = self._candidates(trainer)
        # The bookkeeping is final before each write, so each checkpoint carries its own save's state. With
        # async_checkpoint the write goes on in the background; the strategy links and removes files only
        # after it, so "last" and the top k never point at a file that is not complete.
        previous_last = self.last_model_path
        if self.save_last:
            # Named first, so that the top-k file, which "last" may link to, records it: a run resumed from it
            # then replaces that "last" rather than adding another (last-v1).
            self.last_model_path = self._free_path(trainer, metrics, self.CHECKPOINT_NAME_LAST, previous_last)
        saved = self._save_top_k(trainer, metrics) if top_k and self.save_top_k else None
        if self.save_last:
            self._save_last(trainer, previous_last, saved)
        trainer.strategy.barrier()

    def _save_top_k(self, trainer: "Trainer", metrics: dict[str, Any]) -> str | None:
        """Save a top-k checkpoint if this one ranks among them; return its path (None: not saved)."""
        if self.monitor is None:  # the newest is the best known
            previous = self.best_model_path
            path = self.best_model_path = self._free_path(trainer, metrics, None, previous)
            self._write(trainer, path)
            if self.save_top_k == 1:
                self._remove(trainer, previous, path)
            return path
        if self.monitor not in metrics:
            message = (
                f"`ModelCheckpoint(monitor={self.monitor!r})` could not find the monitored key in the returned "
                f"metrics: {list(metrics)}. HINT: Did you call `log({self.monitor!r}, value)` in the module?"
            )
            if self._validated:
                raise MisconfigurationException(message)
            # As Lightning: before the fit's first validation, the metric may be one that validation logs.
            rank_zero_warn_once(f"{message} Until it is logged, no top-k checkpoint is saved.", stacklevel=2)
            return None
        current = metrics[self.monitor].detach().cpu().clone()
        if torch.isnan(current):  # a NaN is kept as the worst value, as Lightning does
            current = torch.tensor(torch.inf if self.mode == "min" else -torch.inf)
        at = f"Epoch {int(metrics['epoch']):d}, global step {int(metrics['step']):d}"  # Lightning's words, below
        if not self.check_monitor_top_k(trainer, current):
            if self.verbose:
                announce(f"{at}: {self.monitor!r} was not in top {self.save_top_k}")
            return None
        evicted = self.kth_best_model_path if len(self.best_k_models) == self.save_top_k else ""
        self.best_k_models.pop(evicted, None)
        path = self._free_path(trainer, metrics, None, evicted)
        self._record(path, current)
        if self.verbose:
            top = f"top {self.save_top_k if self.save_top_k > 0 else len(self.best_k_models)}"
            best = f"(best {self.best_model_score if self.best_model_score is not None else current:0.5f})"
            announce(f"{at}: {self.monitor!r} reached {current:0.5f} {best}, saving model to {path!r} as {top}")
        self._write(trainer, path, said=True)
        self._remove(trainer, evicted, path)
        return path

    def _save_last(self, trainer: "Trainer", previous: str, saved: str | None) -> None:
        path = self.last_model_path
        if saved is not None:
            # The same state as the top-k file just saved: a link to it rather than a second write.
            trainer.strategy.link_checkpoint(saved, path)
            self._tell_loggers(trainer)
        else:
            self._write(trainer, path)
        self._remove(trainer, previous, path)

    def _write(self, trainer: "Trainer", path: str, said: bool = False) -> None:
        trainer.save_checkpoint(path, self.save_weights_only)
        if self.verbose and not said:
            announce(f"ModelCheckpoint: saved {path}")
        self._tell_loggers(trainer)

    def _tell_loggers(self, trainer: "Trainer") -> None:
        """Each logger's ``after_save_checkpoint``, after every file saved, as in Lightning (an object that logs may
        not have one)."""
        for logger in trainer.loggers:
            after_save = getattr(logger, "after_save_checkpoint", None)
            if callable(after_save):
                after_save(self)

    def _remove(self, trainer: "Trainer", path: str, kept: str) -> None:
        """Remove ``path``, which ``kept`` replaces, unless it is not this callback's to remove: outside its
        directory, or the checkpoint this fit started from (unless the fit continues its run in place)."""
        if not path or path == kept or self.dirpath is None:
            return
        started_from = trainer.ckpt_path
        if started_from is not None and _same(path, started_from) and trainer.continued_checkpoint is None:
            return
        if Path(self.dirpath).absolute() in Path(path).absolute().parents:
            trainer.strategy.remove_checkpoint(path)  # a file, or a sharded checkpoint's directory

    # -------------------------------------------------------------------------------- top k
    def check_monitor_top_k(self, trainer: "Trainer", current: torch.Tensor | None = None) -> bool:
        """Whether the score ``current`` would enter the top k (Lightning's method). The monitored metric is the same
        on every rank, so every rank answers alike."""
        if current is None:
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        return self._better(current, self.best_k_models[self.kth_best_model_path])

    def _better(self, score: torch.Tensor, other: torch.Tensor) -> bool:
        return bool(score < other) if self.mode == "min" else bool(score > other)

    def _record(self, path: str, score: torch.Tensor) -> None:
        """Keep ``path`` with its ``score`` among the top k, and update the best and the worst of them."""
        self.current_score = score
        self.best_k_models[path] = score
        value = {path: score.item() for path, score in self.best_k_models.items()}.__getitem__
        lowest, highest = min(self.best_k_models, key=value), max(self.best_k_models, key=value)
        if self.save_top_k == -1 or len(self.best_k_models) == self.save_top_k:
            self.kth_best_model_path = highest if self.mode == "min" else lowest
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        self.best_model_path = lowest if self.mode == "min" else highest
        self.best_model_score = self.best_k_models[self.best_model_path]


def _check_options(
    mode: str,
    save_top_k: int,
    monitor: str | None,
    every_n_train_steps: int | None,
    every_n_epochs: int | None,
    train_time_interval: timedelta | None,
) -> None:
    if mode not in ("min", "max"):
        raise MisconfigurationException(f"ModelCheckpoint(mode={mode!r}): `mode` can be min, max but got {mode}")
    if not isinstance(save_top_k, int) or save_top_k < -1:
        raise MisconfigurationException(
            f"ModelCheckpoint: invalid value for save_top_k={save_top_k!r}. Must be >= -1 (-1 keeps all)"
        )
    if monitor is None and save_top_k not in (-1, 0, 1):
        raise MisconfigurationException(
            f"ModelCheckpoint(save_top_k={save_top_k}, monitor=None) is not a valid configuration: no quantity "
            "ranks the checkpoints (to keep the newest k, monitor 'step' with mode='max')"
        )
    for flag, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise MisconfigurationException(f"ModelCheckpoint: invalid value for {flag}={value!r}. Must be >= 0")
    if bool(every_n_train_steps) + bool(every_n_epochs) + (train_time_interval is not None) > 1:
        raise MisconfigurationException(
            f"ModelCheckpoint: Combination of parameters every_n_train_steps={every_n_train_steps}, "
            f"every_n_epochs={every_n_epochs} and train_time_interval={train_time_interval} should be mutually "
            "exclusive (0 turns one off)"
        )


def _validates_after(trainer: "Trainer", batch_idx: int) -> bool:
    """Whether ``fit`` validates right after the training batch ``batch_idx`` of the current epoch. Not known for a
    ``val_check_interval`` that is a duration: each rank's clock would answer for itself, and ranks that disagree
    about saving would wait for each other."""
    loop = trainer.fit_loop
    if loop.data is None or trainer.val_check_batch is None:
        return False
    schedule = loop.data.validation
    return schedule.selects(loop.current_epoch) and schedule.due(loop.progress, batch_idx, loop.is_last_batch)


def _local_or_url(dirpath: str | os.PathLike) -> str:
    """``dirpath`` as an absolute local path (``~`` expanded, ``file://`` dropped); a URL of another file system
    stays as it is, for ``setup`` to refuse."""
    path = os.fspath(dirpath).removeprefix("file://")
    return path if _URL.match(path) else os.path.realpath(os.path.expanduser(path))


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)


def _score(value: Any) -> torch.Tensor | None:
    return None if value is None else _tensor(value)


def _same(path: str, other: str) -> bool:
    return os.path.abspath(path) == os.path.abspath(other)
