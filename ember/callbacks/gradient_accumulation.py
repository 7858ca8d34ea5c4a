"""``GradientAccumulationScheduler``: an ``accumulate_grad_batches`` that changes with the epoch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from ember._utils import is_overridden
from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException
from ember.module_hooks import ModuleHooks
from ember.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class GradientAccumulationScheduler(Callback):
    """Accumulate gradients over a number of batches that depends on the epoch, as Lightning's callback does.

    ``scheduling`` maps an epoch (counted from 0) to the accumulation factor from that epoch on:
    ``GradientAccumulationScheduler({0: 8, 4: 4, 8: 1})`` steps every 8 batches in epochs 0-3, every 4 in epochs
    4-7, then every batch. Epochs before the first key accumulate nothing (factor 1). Each epoch's windows start
    at its first batch, and a last window that the epoch's batches do not fill still steps. When an epoch starts,
    ``trainer.accumulate_grad_batches`` (and ``estimated_stepping_batches``, which reads it) becomes its factor.
    The Trainer's own ``accumulate_grad_batches`` must stay 1, and the module must optimize automatically.
    """

    def __init__(self, scheduling: Mapping[int, int]) -> None:
        if not scheduling:
            raise TypeError(
                f"GradientAccumulationScheduler(scheduling={scheduling!r}): an empty schedule gives no accumulation "
                "factor; give {epoch: accumulation factor}, such as {0: 8, 4: 4}"
            )
        if not isinstance(scheduling, Mapping):
            raise TypeError(
                f"GradientAccumulationScheduler(scheduling={scheduling!r}): expected a dict {{epoch: accumulation "
                "factor}, such as {0: 8, 4: 4}"
            )
        # (A bool is an int here, as in Lightning.)
        if any(not isinstance(key, int) or key < 0 for key in scheduling):
            raise MisconfigurationException(
                f"GradientAccumulationScheduler(scheduling={dict(scheduling)!r}): Epoch should be an int greater than "
                f"or equal to 0. Got {list(scheduling)}."
            )
        if any(not isinstance(value, int) or value < 1 for value in scheduling.values()):
            raise MisconfigurationException(
                f"GradientAccumulationScheduler(scheduling={dict(scheduling)!r}): Accumulation factor should be an "
                f"int greater than 0. Got {list(scheduling.values())}."
            )
        #: ``{epoch: factor}``, with epoch 0 (factor 1 unless given): the caller's dict is left as it was.
        self.scheduling: dict[int, int] = {0: 1, **scheduling}
        #: The epochs where the factor changes, in order.
        self.epochs = sorted(self.scheduling)

    def going_to_accumulate_grad_batches(self) -> bool:
        """Whether some epoch accumulates more than one batch per optimizer step."""
        return any(factor > 1 for factor in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The accumulation factor of ``epoch``: that of the latest scheduled epoch not after it."""
        return self.scheduling[max(start for start in self.epochs if start <= epoch)]

    def on_train_start(self, trainer: Trainer, pl_module: Module) -> None:
        """Refuse what the schedule cannot apply to, as Lightning does, before the first epoch."""
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "Automatic gradient accumulation and the `GradientAccumulationScheduler` is not supported for manual "
                f"optimization ({type(pl_module).__name__}.automatic_optimization is False): remove the callback, or "
                "switch to automatic optimization"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "You have set `accumulate_grad_batches` and are using the `GradientAccumulationScheduler` callback: "
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches!r}) and the schedule "
                f"{self.scheduling} cannot both decide; remove `accumulate_grad_batches` from the Trainer (1) or "
                "remove the callback"
            )
        overrides = [name for name in ("optimizer_step", "optimizer_zero_grad")
                     if is_overridden(name, pl_module, ModuleHooks)]  # fmt: skip
        if overrides and self.going_to_accumulate_grad_batches():
            rank_zero_warn(
                f"{type(pl_module).__name__} overrides {' and '.join(overrides)}: with a schedule that accumulates "
                "gradients (`accumulate_grad_batches != 1`), the hooks will not be called on every batch (rather, "
                "they are called on every optimization step)"
            )


def epoch_accumulation(callbacks: Sequence[Callback], flag: int | Literal["auto"], epoch: int) -> int | Literal["auto"]:
    """The ``accumulate_grad_batches`` of ``epoch``: the Trainer's ``flag``, or where the callbacks hold a
    ``GradientAccumulationScheduler``, its factor (the last one's: in Lightning each sets it in turn)."""
    schedulers = [callback for callback in callbacks if isinstance(callback, GradientAccumulationScheduler)]
    return schedulers[-1].get_accumulate_grad_batches(epoch) if schedulers else flag
