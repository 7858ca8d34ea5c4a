"""The hooks a ``Module`` may override beyond its steps, each with Lightning's name, arguments and default.

The loops call a hook only where a module overrides it (see ``ember.loops.Hooks``): the defaults below
say what happens otherwise, so ``super().hook(...)`` inside an override does just that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember._utils import move_to_device
from ember.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from ember.callbacks import Callback


class DataHooks:
    """How batches reach the device; a ``DataModule``'s override wins over its ``Module``'s."""

    #: Whether ``prepare_data`` runs on every machine (on its local rank zero), as by default, or only on global
    #: rank zero (False: where the machines share the storage it writes to).
    prepare_data_per_node: bool = True

    def prepare_data(self) -> None:
        """Called once per machine (on local rank zero) when a stage starts: download, tokenize to disk."""

    # The loaders of each stage: a stage uses the datamodule's where it overrides one, else the module's. These
    # defaults are never called by the Trainer (a stage without its loader is refused when it starts); they say
    # what is missing to code that calls them.
    def train_dataloader(self) -> Any:
        """The training loader(s): a DataLoader, or a list or dict of them."""
        raise not_implemented("train_dataloader")

    def val_dataloader(self) -> Any:
        """The validation loader(s): a DataLoader or a list of them (``dataloader_idx`` in the steps)."""
        raise not_implemented("val_dataloader")

    def test_dataloader(self) -> Any:
        """The test loader(s), as ``val_dataloader``."""
        raise not_implemented("test_dataloader")

    def predict_dataloader(self) -> Any:
        """The prediction loader(s), as ``val_dataloader``."""
        raise not_implemented("predict_dataloader")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch before it goes to the device; returns the batch."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a batch to ``device``: tensors in lists, tuples, dicts and dataclasses, and objects with ``.to``.
        Override it for batches of your own types."""
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch on the device (augmentation on the GPU, ...); returns the batch."""
        return batch


class ModuleHooks(DataHooks):
    """Optional hooks of ``Module``: data transfer, the parts of an optimizer step, and the stages' edges."""

    # ----------------------------------------------------------------- the optimizer step
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Compute the gradients of ``loss`` (already multiplied by the fp16 loss scale, if any)."""
        loss.backward(*args, **kwargs)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Called with the loss (divided by the accumulation count) before ``backward``."""

    def on_after_backward(self) -> None:
        """Called after ``backward``, before gradients are unscaled or clipped."""

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before ``optimizer_zero_grad``, at the first micro-batch of each accumulation window."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Reset the gradients, at the first micro-batch of each accumulation window."""
        optimizer.zero_grad()

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Callable[[], Any] | None = None
    ) -> None:
        """Step ``optimizer``. ``optimizer_closure`` runs this micro-batch's ``training_step`` and backward: it
        must be called, by ``optimizer.step(closure=optimizer_closure)`` or directly. ``optimizer.step`` then
        unscales, calls ``on_before_optimizer_step`` and ``configure_gradient_clipping``, and steps."""
        optimizer.step(closure=optimizer_closure)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] | None = None,
    ) -> None:
        """Clip gradients before the optimizer steps; by default as the Trainer's ``gradient_clip_*`` flags say."""
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)  # type: ignore[attr-defined]

    def lr_scheduler_step(self, scheduler: Any, metric: Any | None) -> None:
        """Step a learning-rate scheduler (``metric``: the monitored value, for ``ReduceLROnPlateau``)."""
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    # --------------------------------------------------------------------------- the stages
    def configure_callbacks(self) -> Sequence[Callback] | Callback:
        """Callbacks this module needs; they join the Trainer's, replacing those of the same type."""
        return []

    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def on_validation_model_zero_grad(self) -> None:
        """Called before a validation during ``fit`` that follows an optimizer step (not in the sanity check, nor
        in the middle of an accumulation window): frees the gradients the step has used."""
        self.zero_grad()  # type: ignore[attr-defined]

    def on_validation_model_eval(self) -> None:
        """Put the module in evaluation mode for validation."""
        self.eval()  # type: ignore[attr-defined]

    def on_validation_model_train(self) -> None:
        """Put the module back in training mode after a validation during ``fit``."""
        self.train()  # type: ignore[attr-defined]

    def on_test_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]

    def on_test_model_train(self) -> None:
        self.train()  # type: ignore[attr-defined]

    def on_predict_model_eval(self) -> None:
        self.eval()  # type: ignore[attr-defined]


def not_implemented(hook: str, hint: str = "") -> MisconfigurationException:
    """Lightning's error for a hook that is needed and not overridden (``hint``: what else to do)."""
    return MisconfigurationException(f"`{hook}` must be implemented to be used with the Trainer{hint}")
