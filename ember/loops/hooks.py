"""``Hooks``: every call of a hook of the module, the datamodule and the callbacks, in one place: the order of the
module and the callbacks, the profiler's range around each, the logging scope it opens (what ``self.log`` may
do there), and nothing paid for a hook nobody overrides."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ember._utils import is_overridden, replaces
from ember.callbacks import Callback
from ember.data import all_iterable, invalid_loaders
from ember.loops.step import StepHooks
from ember.metrics import LogScope
from ember.module import DataModule, Module
from ember.module_hooks import not_implemented
from ember.profilers.profiler import hook_action
from ember.trainer_state import TrainerFn

if TYPE_CHECKING:
    from ember.profilers.profiler import Profiler
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

_PER_STEP = ("training_step", "on_train_batch_start", "on_train_batch_end", "on_before_backward", "backward",
             "on_after_backward", "on_before_optimizer_step", "optimizer_step", "configure_gradient_clipping",
             "on_before_zero_grad", "optimizer_zero_grad")  # fmt: skip
_PER_EPOCH = ("validation_step", "test_step", "on_validation_batch_start", "on_validation_batch_end",
              "on_test_batch_start", "on_test_batch_end")  # fmt: skip
_EPOCH_ONLY = ("on_train_start", "on_validation_start", "on_test_start", "on_train_epoch_start",
               "on_validation_epoch_start", "on_test_epoch_start", "on_train_epoch_end", "on_validation_epoch_end",
               "on_test_epoch_end")  # fmt: skip
#: The hooks whose module implementation Lightning calls before the callbacks'; for every other hook the callbacks'
#: come first (``on_train_epoch_end``: the callbacks that read epoch metrics run after the module's, see ``call``).
MODULE_FIRST = frozenset({"on_load_checkpoint"})
#: Where ``self.log`` may record, with its defaults, as Lightning allows it: per step (``on_step=True``) in a
#: training step and the hooks around it, per epoch in evaluation steps and their batch hooks, epoch values only
#: where a stage or an epoch starts or ends. Anywhere else (setup, teardown, ``on_fit_start``, the hooks of
#: prediction, of checkpoints, of the sanity check, of the batch transfer, where a stage ends) logging is refused.
LOGGING = {
    **{hook: (True, False) for hook in _PER_STEP},
    **{hook: (False, False) for hook in _PER_EPOCH},
    **{hook: (False, True) for hook in _EPOCH_ONLY},
}  # hook -> (default on_step, epoch values only)


class Hooks:
    """The hooks of one stage: the module's, the datamodule's and each callback's implementations, where they
    override them. Built when the stage starts; each hook's list is found at its first call, so the loops call
    exactly what is there, and nothing for a hook nobody overrides. Under a profiler that records, each call is
    timed, under Lightning's name for it (``[LightningModule]Net.on_train_start``, ...)."""

    def __init__(
        self, trainer: Trainer, module: Module, callbacks: Sequence[Callback], datamodule: DataModule | None = None
    ) -> None:
        self._trainer = trainer
        self._module = module
        self._callbacks = list(callbacks)
        self._datamodule = datamodule
        self._profiler: Profiler | None = trainer.profiler if trainer.profiler.enabled else None
        for callback in self._callbacks:  # a callback's self.log is the stage's module's (see Callback.log)
            callback.log, callback.log_dict = module.log, module.log_dict
        self._cache: dict[tuple[str, bool, bool | None], list[Callable[..., Any]]] = {}
        self._scopes: dict[tuple[str, int | None], LogScope] = {}

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

    # ----------------------------------------------------------------------------- finding
    def implementations(
        self, name: str, include_module: bool = True, epoch_readers: bool | None = None
    ) -> list[Callable[..., Any]]:
        """What to call for hook ``name``, in Lightning's order (see ``MODULE_FIRST``): each callback's (only those
        that read epoch metrics, or only those that do not, when ``epoch_readers`` says so) and the module's (if
        ``include_module``)."""
        key = (name, include_module, epoch_readers)
        hooks = self._cache.get(key)
        if hooks is None:
            module = self._module
            own = [self._timed(module, name)] if include_module and is_overridden(name, module, Module) else []
            callbacks: list[Callable[..., Any]] = [
                functools.partial(self._timed(callback, name), self._trainer, module)
                for callback in self._callbacks
                if is_overridden(name, callback, Callback) and _has_work_in(callback, name)
                and epoch_readers in (None, bool(callback.reads_epoch_metrics))
            ]  # fmt: skip
            hooks = self._cache[key] = own + callbacks if name in MODULE_FIRST else callbacks + own
        return hooks

    def module_hook(self, name: str) -> Callable[..., Any] | None:
        """The module's own ``name``, if it overrides it."""
        return self._timed(self._module, name) if is_overridden(name, self._module, Module) else None

    def _datamodule_hook(self, name: str) -> Callable[..., Any] | None:
        datamodule = self._datamodule
        if datamodule is not None and replaces(name, datamodule, DataModule):
            return self._timed(datamodule, name)
        return None

    def _timed(self, owner: Any, name: str) -> Callable[..., Any]:
        """``owner.<name>``, in a range of the profiler (when one records) named as Lightning names it."""
        method = getattr(owner, name)
        profiler = self._profiler
        if profiler is None:
            return method
        if isinstance(owner, Callback):
            label = hook_action("Callback", owner.state_key, name)
        else:
            kind = "LightningDataModule" if isinstance(owner, DataModule) else "LightningModule"
            label = hook_action(kind, type(owner).__name__, name)

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with profiler.profile(label):
                return method(*args, **kwargs)

        return timed

    # ----------------------------------------------------------------------------- calling
    def call(
        self, name: str, *args: Any, include_module: bool = True, epoch_readers: bool | None = None, **kwargs: Any
    ) -> None:
        """Call ``name`` on every callback and the module, in Lightning's order (see ``implementations``), in its
        logging scope."""
        hooks = self.implementations(name, include_module, epoch_readers)
        if hooks:
            with self.scope(name):
                for hook in hooks:
                    hook(*args, **kwargs)

    def call_callbacks(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.call(name, *args, include_module=False, **kwargs)

    def call_module(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The module's ``name`` (what it returns), in its logging scope: its own, or the base class's."""
        return self._call_owner(self._module, name, args, kwargs)

    def call_datamodule(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The datamodule's ``name``, as ``call_module`` (nothing without a datamodule)."""
        if self._datamodule is None:
            return None
        return self._call_owner(self._datamodule, name, args, kwargs)

    def data_loaders(self, kind: str) -> Any:
        """What ``<kind>_dataloader()`` ("train", "val", ...) of the datamodule returns, or without one the
        module's (None: it does not define it)."""
        found = self._loader_owner(kind)
        if found is None:
            return None
        loaders = self._call_owner(found, f"{kind}_dataloader", (), {})
        if not all_iterable(loaders):
            raise invalid_loaders(loaders, f"returned from `{type(found).__name__}.{kind}_dataloader()`")
        return loaders

    def no_loaders(self, kind: str) -> Exception:
        """The error of a stage without ``kind`` loaders, in Lightning's words: a ``TypeError`` where fit's
        ``train_dataloader`` hook was set to None (as Lightning finds None there), else the hook's own error."""
        owner = self._datamodule if self._datamodule is not None else self._module
        if kind == "train" and owner is not None and getattr(owner, "train_dataloader", False) is None:
            return TypeError("An invalid dataloader was passed to `Trainer.fit(train_dataloaders=...)`. Found None. "
                             "Either pass the dataloader to the `.fit()` method OR implement "
                             "`def train_dataloader(self):` in your LightningModule/LightningDataModule.")  # fmt: skip
        return not_implemented(f"{kind}_dataloader", f": no {kind} data; pass dataloaders to the Trainer's method, "
                               "or define it on the DataModule given (else the Module)")  # fmt: skip

    def has_loaders(self, kind: str) -> bool:
        """Whether the datamodule (or without one the module) defines ``<kind>_dataloader()``."""
        return self._loader_owner(kind) is not None

    def _loader_owner(self, kind: str) -> Any:
        # As Lightning's: a datamodule is the stage's data, whose loaders alone are read (not the module's).
        owner, base = (self._datamodule, DataModule) if self._datamodule is not None else (self._module, Module)
        return owner if owner is not None and replaces(f"{kind}_dataloader", owner, base) else None

    def _call_owner(self, owner: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Timed (under a profiler) even where the base class's does nothing, as Lightning times these calls.
        hook = self._timed(owner, name)
        with self.scope(name):
            return hook(*args, **kwargs)

    def configure_model(self) -> None:
        """The module's ``configure_model()``, Lightning's form (the strategy calls the one that takes a mesh)."""
        hook = self.module_hook("configure_model")
        if hook is not None and _callable_without_arguments(hook):
            self.call_module("configure_model")

    def prepare_data(self) -> None:
        """``prepare_data()`` of the datamodule, then of the module: on each machine's local rank zero, or on global
        rank zero alone for one whose ``prepare_data_per_node`` is False (its data on storage the machines share)."""
        trainer = self._trainer
        for owner, call in ((self._datamodule, self.call_datamodule), (self._module, self.call_module)):
            per_node = getattr(owner, "prepare_data_per_node", True)
            if (trainer.local_rank if per_node else trainer.global_rank) == 0:
                call("prepare_data")

    def setup(self, stage: str) -> None:
        """``setup(stage=...)`` of the datamodule, each callback and the module; ``stage`` is a ``TrainerFn`` ("fit",
        ...: a ``str``, with Lightning's ``.value``)."""
        fn = TrainerFn(stage)
        self.call_datamodule("setup", stage=fn)
        self.call_callbacks("setup", stage=fn)
        self.call_module("setup", stage=fn)

    def teardown(self, stage: str) -> None:
        """``teardown(stage=...)`` of the datamodule, each callback and the module."""
        fn = TrainerFn(stage)
        self.call_datamodule("teardown", stage=fn)
        self.call_callbacks("teardown", stage=fn)
        self.call_module("teardown", stage=fn)

    def train_batch_start(self) -> Callable[[Any, int], bool] | None:
        """The ``on_train_batch_start`` hooks as one call, the callbacks' first, that says whether the module's asked
        to skip the rest of the epoch (by returning -1); None when nobody overrides the hook."""
        callbacks = self.implementations("on_train_batch_start", include_module=False)
        module = self.module_hook("on_train_batch_start")
        if module is None and not callbacks:
            return None

        def start(batch: Any, batch_idx: int) -> bool:
            for hook in callbacks:
                hook(batch, batch_idx)
            return module is not None and module(batch, batch_idx) == -1

        return start

    @contextlib.contextmanager
    def scope(self, hook: str, dataloader_idx: int | None = None) -> Iterator[None]:
        """While the block runs, ``self.log`` records as hook ``hook`` may (see ``LOGGING``), in the values of its
        stage, with ``/dataloader_idx_N`` added to names while one of several evaluation loaders runs."""
        scope = self._scopes.get((hook, dataloader_idx))
        if scope is None:
            scope = self._scopes[hook, dataloader_idx] = _scope(hook, self._trainer, dataloader_idx)
        with self._trainer.run_metrics.scoped(scope):
            yield

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
        module around it, where they are overridden, each in its own logging scope (which refuses ``self.log``,
        as Lightning does)."""
        before = self._data_hook("on_before_batch_transfer")
        transfer = self._data_hook("transfer_batch_to_device")
        after = self._data_hook("on_after_batch_transfer")
        if before is None and transfer is None and after is None:
            return strategy.batch_transfer()
        precision = strategy.precision

        def to_device(batch: Any) -> Any:
            if before is not None:
                with self.scope("on_before_batch_transfer"):
                    batch = before(batch, dataloader_idx)
            if transfer is None:
                batch = strategy.batch_to_device(batch)
            else:
                with self.scope("transfer_batch_to_device"):
                    batch = transfer(batch, strategy.root_device, dataloader_idx)
                if precision.converts_input:
                    batch = precision.convert_input(batch)
            if after is None:
                return batch
            with self.scope("on_after_batch_transfer"):
                return after(batch, dataloader_idx)

        return to_device

    def _data_hook(self, name: str) -> Callable[..., Any] | None:
        return self._datamodule_hook(name) or self.module_hook(name)


def _scope(hook: str, trainer: Trainer, dataloader_idx: int | None) -> LogScope:
    rule = LOGGING.get(hook)
    if rule is None or trainer.stage == "predict":
        return LogScope(hook, predicting=trainer.stage == "predict")
    default_on_step, epoch_only = rule
    metrics = trainer.run_metrics
    store = metrics.eval if "validation" in hook or "test" in hook else metrics.train
    suffix = f"/dataloader_idx_{dataloader_idx}" if dataloader_idx is not None else ""
    return LogScope(hook, store, default_on_step, epoch_only, suffix, dataloader_idx)


def _has_work_in(callback: Callback, hook: str) -> bool:
    """``callback.has_work_in(hook)``, asked of the callback's class and only where it overrides Callback's (which
    answers yes): code written for Lightning may set every public method of a callback on the instance, to record
    its calls, and ``has_work_in`` is Ember's, no hook. A stand-in whose class has none (a mock) has work in every
    hook it has."""
    has_work_in = getattr(type(callback), "has_work_in", None)
    return has_work_in is None or has_work_in is Callback.has_work_in or bool(has_work_in(callback, hook))


def _callable_without_arguments(function: Any) -> bool:
    return all(
        parameter.default is not parameter.empty or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        for parameter in inspect.signature(function).parameters.values()
    )
