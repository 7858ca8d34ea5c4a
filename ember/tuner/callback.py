"""``LearningRateFinder`` and ``BatchSizeFinder``: the tuner's searches as callbacks, run when ``fit`` starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException
from ember.hparams import set_field
from ember.loops.evaluate import EvaluationLoop
from ember.rank_zero import rank_zero_warn
from ember.tuner.checks import check_lr_find, check_scale_batch_size, lowered
from ember.tuner.lr_finder import LRFinder
from ember.tuner.tuner import attribute_owner, find_lr, search_batch_size, warn_duplicate_field

if TYPE_CHECKING:
    from ember.loops.training_data import TrainingData
    from ember.module import Module
    from ember.trainer import Trainer


class LearningRateFinder(Callback):
    """Run ``Tuner.lr_find``'s sweep on fit's training data when ``fit`` starts, then train at the suggestion.

    The sweep's steps are not counted as training (the weights and the random generators are put back
    afterwards, and ``global_step`` does not move). ``optimal_lr`` holds the sweep (an ``LRFinder``: ``results``,
    ``suggestion()``, ``plot()``). With ``update_attr`` the suggestion becomes the module's ``lr`` /
    ``learning_rate`` (or ``attr_name``) and the learning rate of every param group of fit's optimizers.
    Subclasses may call ``lr_find(trainer, pl_module)`` from other hooks (at given epochs, say).
    """

    tunes_the_run = True

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training_steps: int = 100,
        mode: Literal["exponential", "linear"] = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> None:
        mode = lowered(mode)
        check_lr_find(mode, min_lr, max_lr, num_training_steps)
        self.min_lr, self.max_lr, self.num_training_steps, self.mode = min_lr, max_lr, num_training_steps, mode
        self.early_stop_threshold = early_stop_threshold
        self.update_attr, self.attr_name = update_attr, attr_name
        #: The latest sweep (None before the first, or when ``fast_dev_run`` skipped it).
        self.optimal_lr: LRFinder | None = None

    def on_fit_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.lr_find(trainer, pl_module)

    def lr_find(self, trainer: Trainer, pl_module: Module) -> None:
        data = trainer.fit_loop.data
        if trainer.stage != "fit" or data is None:
            raise MisconfigurationException(
                f"{type(self).__name__}.lr_find(trainer, pl_module) sweeps on fit's training data: call it from a hook "
                "of fit (on_fit_start, on_train_epoch_start, ...)"
            )
        data.load()  # when fit starts, its training loader is not asked for yet
        self.optimal_lr = find_lr(
            trainer, pl_module, datamodule=trainer.datamodule, loader=data.loader,
            min_lr=self.min_lr, max_lr=self.max_lr, num_training=self.num_training_steps, mode=self.mode,
            early_stop_threshold=self.early_stop_threshold, update_attr=self.update_attr, attr_name=self.attr_name,
        )  # fmt: skip
        suggestion = self.optimal_lr.suggested_lr if self.optimal_lr is not None else None
        if self.update_attr and suggestion is not None:
            # fit built its optimizers before this hook, from the rate the module had then.
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = suggestion


class BatchSizeFinder(Callback):
    """Lightning's ``BatchSizeFinder``: when ``fit`` starts, ``Tuner.scale_batch_size``'s search (its arguments
    and meanings) on the training loader the module or datamodule makes, then the fit trains at the size found;
    when ``validate``, ``test`` or ``predict`` starts, the same search with that stage's steps and loader.

    The size is set where ``batch_arg_name`` is kept (the datamodule's or the module's attribute or hyperparameter)
    and held in ``optimal_batch_size`` (``init_val`` before a search; None when ``fast_dev_run`` skipped it). The
    trials put the weights and the random generators back and do not move ``global_step``. Subclasses may call
    ``scale_batch_size(trainer, pl_module)`` from other hooks (``on_train_epoch_start`` at chosen epochs, say):
    the stage's loaders are then made again at the new size.
    """

    tunes_the_run = True

    SUPPORTED_MODES = ("power", "binsearch")

    def __init__(
        self,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> None:
        mode = lowered(mode)
        check_scale_batch_size(mode, None, margin, init_val=init_val, max_trials=max_trials,
                               steps_per_trial=steps_per_trial, max_val=max_val)  # fmt: skip
        self.mode, self.steps_per_trial, self.init_val, self.max_trials = mode, steps_per_trial, init_val, max_trials
        self.batch_arg_name, self.margin, self.max_val = batch_arg_name, margin, max_val
        #: The size the latest search found (``init_val`` before one).
        self.optimal_batch_size: int | None = init_val

    def setup(self, trainer: Trainer, pl_module: Module, stage: str | None = None) -> None:
        if trainer.world_size > 1:
            raise MisconfigurationException(  # Lightning's words first
                "The Batch size finder is not supported with distributed strategies: its trials run inside the stage, "
                "where the processes step together; run Tuner(trainer).scale_batch_size(model) before fit instead"
            )
        attribute_owner(self.batch_arg_name, pl_module, trainer.datamodule, "batch size")  # missing: refused here
        warn_duplicate_field(pl_module, self.batch_arg_name)

    def on_fit_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.scale_batch_size(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None:
        if trainer.stage == "validate":  # not fit's validations
            self.scale_batch_size(trainer, pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.scale_batch_size(trainer, pl_module)

    def on_predict_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.scale_batch_size(trainer, pl_module)

    def scale_batch_size(self, trainer: Trainer, pl_module: Module) -> None:
        """Search for the largest batch size the stage's steps take, and make its loaders again at it."""
        data = _stage_data(trainer, f"{type(self).__name__}.scale_batch_size(trainer, pl_module)")
        if trainer.fast_dev_run:  # a batch or two: nothing to find
            rank_zero_warn("Skipping batch size scaler since `fast_dev_run` is enabled.")  # Lightning's words
            self.optimal_batch_size = None
            return
        name = self.batch_arg_name
        margin = self.margin if self.mode == "binsearch" else 0.0  # (power mode keeps the size that fit)
        size = search_batch_size(
            trainer, pl_module, trainer.datamodule, self.mode == "power", self.init_val, self.max_trials,
            self.steps_per_trial, name, None, self.max_val, margin, stage=trainer.stage or "fit", in_stage=True,
        )  # fmt: skip
        set_field(pl_module, name, size)  # (after the margin, below the last size tried)
        self.optimal_batch_size = size
        data.reload()


def _stage_data(trainer: Trainer, call: str) -> TrainingData | EvaluationLoop:
    """What the running stage reads its batches from (fit's training data, an evaluation's loop), once checked
    as Lightning's finder checks it."""
    stage = trainer.stage
    data = trainer.fit_loop.data if stage == "fit" else getattr(trainer, f"{stage}_loop", None)
    if data is None or (isinstance(data, EvaluationLoop) and not data.running):
        raise MisconfigurationException(
            f"{call} sizes the batches of the running stage: call it from one of its hooks (on_fit_start, "
            "on_train_epoch_start, on_test_start, ...)"
        )
    if data.loaders_given:
        raise MisconfigurationException(  # Lightning's words first
            f"The Batch size finder cannot be used with dataloaders passed directly to `.{stage}()`: it makes them "
            "again at each size. Define the loader hook on the LightningModule or a LightningDataModule instead"
        )
    if isinstance(data, EvaluationLoop) and len(data.num_batches) > 1:
        raise MisconfigurationException(  # Lightning's words first
            f"The Batch size finder cannot be used with multiple {data.kind} dataloaders: it sizes one loader"
        )
    return data
