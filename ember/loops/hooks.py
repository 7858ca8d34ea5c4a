"""``Hooks``: calling a hook on the module and on each callback, paying nothing for those nobody overrides."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ember._utils import is_overridden
from ember.callbacks import Callback
from ember.loops.step import StepHooks
from ember.module import DataModule, Module

if TYPE_CHECKING:
    from ember.strategies import Strategy
    from ember.trainer import Trainer

#: Hooks that Lightning 1.x called and Lightning 2 removed (or deprecated), with what to use instead. Ember
#: calls none of them, so an object that defines one is refused when a stage starts instead of having its
#: code silently skipped.
RETIRED_HOOKS = {
    "training_epoch_end": "on_train_epoch_end (keep the step outputs it needs in an attribute)",
    "validation_epoch_end": "on_validation_epoch_end (keep the step outputs it needs in an attribute)",
    "test_epoch_end": "on_test_epoch_end (keep the step outputs it needs in an attribute)",
    "training_step_end": "training_step (each process runs its own steps)",
    "validation_step_end": "validation_step (each process runs its own steps)",
    "test_step_end": "test_step (each process runs its own steps)",
    "on_epoch_start": "on_train_epoch_start, on_validation_epoch_start or on_test_epoch_start",
    "on_epoch_end": "on_train_epoch_end, on_validation_epoch_end or on_test_epoch_end",
    "on_batch_start": "on_train_batch_start",
    "on_batch_end": "on_train_batch_end",
    "on_pretrain_routine_start": "on_fit_start",
    "on_pretrain_routine_end": "on_fit_start",
    "on_init_start": "the callback's __init__",
    "on_init_end": "setup",
    "on_keyboard_interrupt": "on_exception",
    "on_before_accelerator_backend_setup": "setup",
    "on_configure_sharded_model": "setup",
    "configure_sharded_model": "configure_model",
    "on_hpc_save": "on_save_checkpoint",
    "on_hpc_load": "on_load_checkpoint",
    "on_post_move_to_device": "setup",
    "on_train_dataloader": "train_dataloader",
    "on_val_dataloader": "val_dataloader",
    "on_test_dataloader": "test_dataloader",
    "on_predict_dataloader": "predict_dataloader",
    "get_progress_bar_dict": "self.log(..., prog_bar=True)",
}
#: A DataModule's hooks that Lightning 1.8 removed (a module's and a callback's of these names are called).
RETIRED_DATAMODULE_HOOKS = {"on_save_checkpoint": "state_dict", "on_load_checkpoint": "load_state_dict"}
_STEPS = ("training_step", "validation_step", "test_step", "predict_step")


class Hooks:
    """The implementations of each hook for one stage: the module's and each callback's, where they
    override it. Built when the stage starts (after a profiler has wrapped what it times), so the
    loops call exactly what is there, and nothing for a hook nobody overrides."""

    def __init__(
        self, trainer: Trainer, module: Module, callbacks: Sequence[Callback], datamodule: DataModule | None = None
    ) -> None:
        self._trainer = trainer
        self._module = module
        self._callbacks = list(callbacks)
        self._datamodule = datamodule
        self._cache: dict[tuple[str, bool], list[Callable[..., Any]]] = {}

    def check(self) -> None:
        """Refuse hooks that Ember would never call, naming each with what to use instead."""
        owners: list[Any] = [self._module, *self._callbacks]
        if self._datamodule is not None:
            owners.append(self._datamodule)
        for owner in owners:
            for name, instead in RETIRED_HOOKS.items():
                if callable(getattr(type(owner), name, None)):
                    raise NotImplementedError(
                        f"{type(owner).__name__}.{name}() is a hook that Ember never calls (Lightning 2 removed or "
                        f"deprecated it); move its code to {instead}"
                    )
        for name, instead in RETIRED_DATAMODULE_HOOKS.items():
            if callable(getattr(type(self._datamodule), name, None)):
                raise NotImplementedError(
                    f"{type(self._datamodule).__name__}.{name}() is a hook that Ember never calls on a DataModule "
                    f"(Lightning 1.8 removed it); return what to keep from {instead}() instead"
                )
        for step in _STEPS:
            method = getattr(self._module, step, None)
            if callable(method) and "dataloader_iter" in inspect.signature(method).parameters:
                raise NotImplementedError(
                    f"{type(self._module).__name__}.{step}(dataloader_iter): Ember passes each step its batch and "
                    "batch_idx; take them instead of the loader's iterator"
                )

    def implementations(self, name: str, include_module: bool = True) -> list[Callable[..., Any]]:
        """What to call for hook ``name``: the module's (if ``include_module``), then each callback's."""
        key = (name, include_module)
        hooks = self._cache.get(key)
        if hooks is None:
            module = self._module
            hooks = [getattr(module, name)] if include_module and is_overridden(name, module, Module) else []
            hooks += [
                functools.partial(getattr(callback, name), self._trainer, module)
                for callback in self._callbacks
                if is_overridden(name, callback, Callback) and callback.has_work_in(name)
            ]
            self._cache[key] = hooks
        return hooks

    def module_hook(self, name: str) -> Callable[..., Any] | None:
        """The module's own ``name``, if it overrides it."""
        return getattr(self._module, name) if is_overridden(name, self._module, Module) else None

    def call(self, name: str, *args: Any) -> None:
        """Call ``name`` on the module, then on every callback."""
        for hook in self.implementations(name):
            hook(*args)

    def call_callbacks(self, name: str, *args: Any) -> None:
        for hook in self.implementations(name, include_module=False):
            hook(*args)

    def step_hooks(self) -> StepHooks:
        """The hooks an optimizer step calls, where the module or a callback overrides them."""
        return StepHooks(
            before_zero_grad=self.implementations("on_before_zero_grad"),
            before_backward=self.implementations("on_before_backward"),
            after_backward=self.implementations("on_after_backward"),
            optimizer_step=self.module_hook("optimizer_step"),
            optimizer_zero_grad=self.module_hook("optimizer_zero_grad"),
            configure_gradient_clipping=self.module_hook("configure_gradient_clipping"),
            lr_scheduler_step=self.module_hook("lr_scheduler_step"),
            backward=self.module_hook("backward"),
        )

    def batch_transfer(self, strategy: Strategy, dataloader_idx: int = 0) -> Callable[[Any], Any] | None:
        """How the batches of loader ``dataloader_idx`` reach the device: the strategy's transfer itself (None:
        they are used as the loader makes them), or with the transfer hooks of the datamodule (first) or the
        module around it, where they are overridden."""
        before = self._data_hook("on_before_batch_transfer")
        transfer = self._data_hook("transfer_batch_to_device")
        after = self._data_hook("on_after_batch_transfer")
        if before is None and transfer is None and after is None:
            return strategy.batch_transfer()
        precision = strategy.precision

        def to_device(batch: Any) -> Any:
            if before is not None:
                batch = before(batch, dataloader_idx)
            if transfer is None:
                batch = strategy.batch_to_device(batch)
            else:
                batch = transfer(batch, strategy.root_device, dataloader_idx)
                if precision.converts_input:
                    batch = precision.convert_input(batch)
            return batch if after is None else after(batch, dataloader_idx)

        return to_device

    def _data_hook(self, name: str) -> Callable[..., Any] | None:
        datamodule = self._datamodule
        if datamodule is not None and is_overridden(name, datamodule, DataModule):
            return getattr(datamodule, name)
        return self.module_hook(name)

