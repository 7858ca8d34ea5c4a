"""``ProgressBarBase``: the progress bar's API, drawing nothing (Lightning's ``ProgressBar``), for a bar of one's own;
``ember.callbacks.ProgressBar`` is the bar that draws."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ember.callbacks.callback import Callback

if TYPE_CHECKING:
    from ember.callbacks.progress import ProgressDisplay
    from ember.module import Module
    from ember.trainer import Trainer


class ProgressBarBase(Callback):
    """What a progress bar offers, as Lightning's ``ProgressBar`` (which Lightning programs subclass to draw a bar of
    their own): the Trainer it runs in, ``get_metrics``, ``enable()``/``disable()``, the batch totals and the
    evaluation bars' titles. It draws nothing; the Trainer takes one bar, and ``Trainer.print`` goes through it."""

    def __init__(self) -> None:
        self._enabled = True
        self._trainer: Trainer | None = None
        self._eval_loader: int | None = None  # the evaluation loader running now, told by has_dataloader_changed

    def __getstate__(self) -> dict[str, Any]:
        """Without the Trainer (a copy is set up again by the next stage it runs in)."""
        return {**self.__dict__, "_trainer": None}

    @property
    def trainer(self) -> Trainer:
        """The Trainer this bar shows the progress of (from the first stage it is set up in)."""
        if self._trainer is None:
            raise TypeError(  # Lightning's exception and words first
                f"The `{type(self).__name__}.trainer` reference has not been set yet: a stage (fit, validate, ...) "
                "sets it up"
            )
        return self._trainer

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        self._trainer = trainer
        if not trainer.is_global_zero:  # only global rank zero shows progress; its state says so, as Lightning's does
            self.disable()

    def get_metrics(self, trainer: Trainer, pl_module: Module) -> dict[str, float | int | str]:
        """Lightning's progress-bar items: the values logged with ``prog_bar=True`` (as floats: this reads the
        device), and ``v_num``, the loggers' version (see ``loggers_version``; of a version that is text, its last 4
        characters, as Lightning shows it). Ember's bar draws the same logged values beside the loss."""
        return {**standard_metrics(trainer), **trainer.progress_bar_metrics}

    # The titles of the bars, Lightning's properties: a subclass may override them.
    @property
    def sanity_check_description(self) -> str:
        return "Sanity Checking"

    @property
    def train_description(self) -> str:
        """The training bar's title before its first epoch (each epoch's says "Epoch N")."""
        return "Training"

    @property
    def validation_description(self) -> str:
        return "Validation"

    @property
    def test_description(self) -> str:
        return "Testing"

    @property
    def predict_description(self) -> str:
        return "Predicting"

    @property
    def is_enabled(self) -> bool:
        """Whether the bar draws (``disable()`` stops it, ``enable()`` starts it again), as Lightning's."""
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def total_train_batches(self) -> float:
        """The training batches of an epoch of ``fit`` (``inf`` for a loader without a length); as Lightning's,
        with ``max_epochs=-1``, no more than the steps left before ``max_steps``."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps > 0:
            return min(trainer.num_training_batches, trainer.max_steps - trainer.global_step)
        return trainer.num_training_batches

    @property
    def total_val_batches(self) -> float:
        """The validation batches of every loader that the current epoch of ``fit`` runs (0 in an epoch that
        ``check_val_every_n_epoch`` leaves out, or without validation)."""
        trainer = self.trainer
        every = trainer.check_val_every_n_epoch
        if not trainer.validation_enabled or (every is not None and (trainer.current_epoch + 1) % every):
            return 0
        return sum(trainer.num_val_batches)

    @property
    def total_val_batches_current_dataloader(self) -> float:
        """The batches of the validation loader that runs now (the sanity check's, in it), as Lightning's: the loader
        is the last one ``has_dataloader_changed`` was told of (Ember's bar tells it in ``on_validation_batch_start``).
        """
        trainer = self.trainer
        return self._current(trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches)

    @property
    def total_test_batches_current_dataloader(self) -> float:
        """The batches of the test loader that runs now (see ``total_val_batches_current_dataloader``)."""
        return self._current(self.trainer.num_test_batches)

    @property
    def total_predict_batches_current_dataloader(self) -> float:
        """The batches of the prediction loader that runs now (see ``total_val_batches_current_dataloader``)."""
        return self._current(self.trainer.num_predict_batches)

    def has_dataloader_changed(self, dataloader_idx: int) -> bool:
        """Note ``dataloader_idx`` as the evaluation loader that runs now; whether it differs from the one before (a
        bar starts a new line for it), as Lightning's."""
        changed = dataloader_idx != self._eval_loader
        self._eval_loader = dataloader_idx
        return changed

    def reset_dataloader_idx_tracker(self) -> None:
        """Forget the current evaluation loader (at the end of an evaluation), as Lightning's."""
        self._eval_loader = None

    def _current(self, batches: list[float]) -> float:
        if self._eval_loader is None:
            raise RuntimeError(
                f"{type(self).__name__}: no evaluation loader runs now; the batch totals of the current loader are "
                "known from on_validation_batch_start (on_test_..., on_predict_...) once has_dataloader_changed("
                "dataloader_idx) has been called there"
            )
        return batches[self._eval_loader]

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` (``Trainer.print`` comes here; a bar that draws keeps the text off its lines)."""
        print(*args, **kwargs)

    def display(self, title: str, total: float) -> ProgressDisplay | None:
        """A display for steps outside the loops (the tuner's): None, this bar draws nothing."""
        return None


def standard_metrics(trainer: Trainer) -> dict[str, float | int | str]:
    """The items every bar shows besides the logged values (Lightning's ``get_standard_metrics``): ``v_num``, the
    loggers' version (of a version that is text, its last 4 characters), where there is one."""
    version = loggers_version(trainer.loggers)
    version = version[-4:] if isinstance(version, str) else version
    return {} if version in ("", None) else {"v_num": version}


def loggers_version(loggers: Sequence[Any]) -> int | str | None:
    """The version of ``loggers``: the one they share, else their versions joined by "_" (as Lightning names a run
    that several loggers keep); None without a logger."""
    versions = list(dict.fromkeys(logger.version for logger in loggers))
    if len(versions) <= 1:
        return versions[0] if versions else None
    return "_".join(dict.fromkeys(str(version) for version in versions))
