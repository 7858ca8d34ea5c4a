"""The ``Callback`` base class: hooks into the Trainer's loop, each a no-op until overridden."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class Callback:
    """Subclass and override the hooks you need. ``state_dict`` goes into checkpoints."""

    #: Callbacks that act on epoch metrics (checkpointing, early stopping) run after the module's
    #: epoch-end hook and after the epoch's metrics are reduced, so they see this epoch's values.
    reads_epoch_metrics = False
    #: Whether the callback reads ``trainer.predict_loop.predictions`` when prediction ends (a prediction
    #: writer): the outputs are then kept even with ``predict(return_predictions=False)``.
    wants_predictions = False
    #: Whether the callback tunes the run (the batch size or learning rate finders): such callbacks come first in
    #: ``trainer.callbacks``, as in Lightning, so that the run they tune is the one the others see.
    tunes_the_run = False
    #: ``self.log`` and ``self.log_dict`` of a callback: the module's own, which the hook caller gives each callback
    #: when a stage starts (as Lightning attaches them), so that a callback logs from the hooks where the module
    #: may. They are attributes, not methods: the functions of ``Callback`` are the hooks that ``LambdaCallback`` takes.
    log: Callable[..., None]
    log_dict: Callable[..., None]

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint; unique among the Trainer's callbacks. A callback of
        which a Trainer may hold several returns ``settings_key(self, ...)`` with the settings that tell them apart."""
        return type(self).__qualname__

    def has_work_in(self, hook: str) -> bool:
        """Whether ``hook``, which this callback overrides, has work to do in the stage that is starting; the
        loops do not call one that has none (a batch hook whose schedule is unset then costs nothing per batch).
        Override it in the class: it is asked of the callback's class, not of the instance."""
        return True

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None: ...
    def teardown(self, trainer: Trainer, pl_module: Module, stage: str) -> None: ...
    def on_fit_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_fit_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_train_batch_start(self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int) -> None: ...

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_before_backward(self, trainer: Trainer, pl_module: Module, loss: torch.Tensor) -> None: ...
    def on_after_backward(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: Module, optimizer: torch.optim.Optimizer
    ) -> None: ...
    def on_before_zero_grad(self, trainer: Trainer, pl_module: Module, optimizer: torch.optim.Optimizer) -> None: ...

    def on_sanity_check_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_sanity_check_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_test_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_test_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_predict_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_predict_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_test_epoch_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_test_epoch_end(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: Module) -> None: ...
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: Module) -> None: ...

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_test_batch_start(
        self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_test_batch_end(
        self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]) -> None: ...
    def on_exception(self, trainer: Trainer, pl_module: Module, exception: BaseException) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def settings_key(callback: Callback, **settings: Any) -> str:
    """A ``state_key`` made of the callback's class name and ``settings``, written as Lightning writes it
    (``"EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"``), so that each framework's checkpoints give their
    callback states to the other's callbacks."""
    return f"{type(callback).__qualname__}{settings!r}"


def at_logging_step(trainer: Trainer) -> bool:
    """Whether the training batch that just ended stepped onto a ``log_every_n_steps`` multiple (of optimizer
    steps; under manual optimization, of training batches); never with ``log_every_n_steps=0``."""
    loop, every = trainer.fit_loop, trainer.log_every_n_steps
    return loop.stepped and every > 0 and loop.logging_step % every == 0
