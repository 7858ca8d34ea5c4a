"""``LearningRateFinder``: the learning-rate sweep as a callback, run when ``fit`` starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException
from ember.tuner.lr_finder import LRFinder
from ember.tuner.tuner import check_lr_find, find_lr

if TYPE_CHECKING:
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
