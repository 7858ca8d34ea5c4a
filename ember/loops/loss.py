"""The training loss: what ``training_step`` returned, checked once where it could be wrong (``training_loss``),
and the losses of recent steps, checked for NaN and infinity at logging and checkpointing time
(``LossCheck``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ember.exceptions import MisconfigurationException


def training_loss(output: Any, module: torch.nn.Module | None = None) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (None skips the batch), or a clear error."""
    if output is None:
        return None
    loss: Any = output
    if not isinstance(output, torch.Tensor) and isinstance(output, Mapping):  # a tensor first: the cheaper test
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        if loss is None:  # Lightning's error (the dict must hold the loss to step on under automatic optimization)
            raise MisconfigurationException(
                "In automatic_optimization, when `training_step` returns a dict, the 'loss' key needs to be present "
                f"(its keys: {list(output)})"
            )
        # Lightning's exception and words; the dict case names the key's value, the only part that was wrong.
        what = f"a dict whose 'loss' is a {type(loss).__name__}" if loss is not output else type(output).__name__
        raise MisconfigurationException(
            "In automatic optimization, `training_step` must return a Tensor, a dict, or None (where the step will "
            f"be skipped): it returned {what}; return the loss tensor, or a dict with a 'loss' tensor"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"training_step returned a loss of shape {tuple(loss.shape)}; reduce it to one number "
            "(for example with .mean()) before returning it"
        )
    if not loss.requires_grad:
        raise ValueError(f"training_step returned a loss that does not require grad: {_why_no_grad(module)}")
    return loss


def shown_manual_loss(output: Any, module: torch.nn.Module) -> torch.Tensor | None:
    """The loss to show of what a manual-optimization ``training_step`` returned (a tensor, or a dict's "loss"), or
    None; anything but a tensor, a dict or None is refused, as Lightning refuses it. The module stepped already, so
    any scalar tensor will do."""
    if output is not None and not isinstance(output, (Mapping, torch.Tensor)):
        raise MisconfigurationException(
            "In manual optimization, `training_step` must either return a Tensor or have no return (or a dict): "
            f"{type(module).__name__}.training_step returned a {type(output).__name__}"
        )
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _why_no_grad(module: torch.nn.Module | None) -> str:
    if module is not None and not any(parameter.requires_grad for parameter in module.parameters()):
        return "every parameter of the module is frozen (requires_grad=False), so there is nothing to train"
    return (
        "it was computed under torch.no_grad() (or torch.inference_mode()), or from tensors cut off the graph "
        "(.detach(), .item(), .numpy(), torch.tensor(value)); compute it from the module's output as it is"
    )


class LossCheck:
    """The training losses since the last check, kept on the device, and where each was: a NaN or infinite loss
    stops training with the step where it first was, read at logging and checkpointing time only, so that the
    check costs one synchronisation per log interval instead of one per step.

    The loop appends to ``losses`` and, in pairs, the batch_idx and global step of each to ``positions``
    (one flat list: a tuple per loss, kept until the check, costs measurably more). Every check comes before
    the epoch ends: all are of this epoch.
    """

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.positions: list[int] = []

    def clear(self) -> None:
        self.losses.clear()  # in place: the training loop holds these lists
        self.positions.clear()

    def check(self, epoch: int) -> None:
        """Raise if a loss since the last check was NaN or infinite, naming the step where it first was."""
        losses = self.losses
        if not losses:
            return
        try:
            stacked = torch.stack(losses)
        except RuntimeError:  # mixed shapes, such as () and (1,)
            stacked = torch.stack([loss.reshape(()) for loss in losses])
        values = (stacked if stacked.dim() == 1 else stacked.reshape(-1)).tolist()  # one read of the device
        where_each = self.positions.copy()
        self.clear()
        if math.isfinite(sum(values)):  # the common case, in one pass (a sum that overflows is looked at below)
            return
        first = next((index for index, value in enumerate(values) if not math.isfinite(value)), None)
        if first is None:
            return
        batch_idx, step = where_each[2 * first], where_each[2 * first + 1]
        raise FloatingPointError(
            f"the training loss became {values[first]} at epoch {epoch}, batch {batch_idx} (global step {step}). "
            "Common causes: a learning rate that is too high, no gradient clipping (gradient_clip_val), "
            "a log or division of zero, or float16 overflow (precision='bf16-mixed' has a wider range). "
            "Trainer(detect_anomaly=True) names the operation that produced it."
        )


def batch_end_output(output: Any, loss: torch.Tensor | None, divisor: int) -> dict[str, Any]:
    """What ``on_train_batch_end`` receives, as in Lightning: the step's output as a dict (``{}`` for None) whose
    ``"loss"`` is the loss detached and divided by ``divisor`` (``accumulate_grad_batches``, as the gradients are)."""
    if divisor == 1 and type(output) is torch.Tensor:  # the usual step, per batch: no more work than the dict
        return {"loss": loss}
    extra = {key: item for key, item in output.items() if key != "loss"} if isinstance(output, Mapping) else {}
    if loss is None:
        return extra
    return {"loss": loss / divisor if divisor != 1 else loss, **extra}
