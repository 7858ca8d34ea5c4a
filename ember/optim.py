"""What ``configure_optimizers`` may return, parsed into optimizers and scheduler configurations and checked as
Lightning checks them; the Trainer's optimization flags that the module's optimization cannot honour; and
``LightningOptimizer``, the optimizers as the module's hooks and ``self.optimizers()`` give them."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler, OneCycleLR, ReduceLROnPlateau

from ember.exceptions import MisconfigurationException
from ember.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from ember.module import Module
    from ember.strategies import Strategy

_FORMS = (
    "an optimizer, a list of optimizers, ([optimizers], [schedulers]), "
    '{"optimizer": ..., "lr_scheduler": scheduler or {"scheduler": ..., "interval": "step"|"epoch", '
    '"frequency": N, "monitor": "metric"}}, or a list of such dicts'
)
_SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau"}
#: The keys of a scheduler dict that only the Trainer's stepping reads: ignored, with a warning, under manual
#: optimization, where ``training_step`` steps its schedulers itself.
_STEPPING_KEYS = ("monitor", "strict", "reduce_on_plateau")


@dataclass
class LRSchedulerConfig:
    """A scheduler and when it steps: every ``frequency`` optimizer steps or epochs (``interval``)."""

    scheduler: Any
    interval: Literal["step", "epoch"] = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None
    #: Whether ``step`` is given the ``monitor``ed metric (None: whether it is a ``ReduceLROnPlateau``).
    reduce_on_plateau: bool | None = None

    def __post_init__(self) -> None:
        if self.reduce_on_plateau is None:
            self.reduce_on_plateau = isinstance(self.scheduler, ReduceLROnPlateau)

    @property
    def reads_metric(self) -> bool:
        return bool(self.reduce_on_plateau)


class TrainerStep(Protocol):
    """What steps a ``LightningOptimizer`` during a fit (the Trainer's step runner)."""

    module: Module
    strategy: Strategy

    def step_optimizer(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """``optimizer.step(closure, **kwargs)`` through the precision and the hooks; returns what it returns."""


class LightningOptimizer:
    """An optimizer as ``Module.optimizers()`` and the module's ``optimizer_step`` hook give it, as Lightning's:
    ``step(closure=None, **kwargs)`` goes through the Trainer (loss scaling, ``on_before_optimizer_step``, the
    count of steps), and the wrapper is an instance of the optimizer's class too (``isinstance(opt,
    torch.optim.Adam)`` holds; its class is named ``LightningAdam``), whose other attributes are the optimizer's.

    Made by hand (``LightningOptimizer(optimizer)``), outside a fit, its ``step`` is the optimizer's own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trainer_step: TrainerStep | None = None) -> None:
        self._wrapped = optimizer
        self._trainer_step = trainer_step
        # A class of both, so that what checks the optimizer's class (isinstance, its repr) holds for the wrapper.
        self.__class__ = type(f"Lightning{type(optimizer).__name__}", (LightningOptimizer, type(optimizer)), {})

    def __reduce__(self) -> tuple[Any, ...]:
        # Its class is made here, so pickle could not find it by name: it is made again from what it wraps.
        return LightningOptimizer, (self._wrapped, self._trainer_step)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, as ``configure_optimizers`` returned it."""
        return self._wrapped

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One step of the optimizer, which runs ``closure`` (forward and ``manual_backward``) first; ``kwargs`` go
        to the optimizer's ``step``. Returns what the closure returns."""
        if closure is not None and not callable(closure):
            raise MisconfigurationException(
                f"When `optimizer.step(closure)` is called, the closure should be callable: got {_describe(closure)}"
            )
        if self._trainer_step is None:
            return self._wrapped.step(closure, **kwargs)
        return self._trainer_step.step_optimizer(self._wrapped, closure, **kwargs)

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """While active, only this optimizer's parameters receive gradients (the module's ``toggle_optimizer``),
        and ``manual_backward`` averages gradients across ranks only if ``sync_grad``: accumulate with
        ``sync_grad=False`` on all micro-batches but the last."""
        if self._trainer_step is None:
            raise RuntimeError("toggle_model() is available during fit only")
        module, strategy = self._trainer_step.module, self._trainer_step.strategy
        module.toggle_optimizer(self._wrapped)
        try:
            with strategy.no_sync(not sync_grad):
                yield
        finally:
            module.untoggle_optimizer(self._wrapped)

    # What changes the optimizer changes the wrapped one (the wrapper's class has the optimizer's methods).
    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            clear_gradients(self._wrapped)
        else:
            self._wrapped.zero_grad(set_to_none=False)

    def state_dict(self) -> dict[str, Any]:
        return self._wrapped.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._wrapped.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._wrapped.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        if name == "_wrapped":  # not set yet (a copy being made): no wrapped optimizer to ask
            raise AttributeError(name)
        return getattr(self._wrapped, name)


_TORCH_ZERO_GRAD = torch.optim.Optimizer.zero_grad


def clear_gradients(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``: the reset of the gradients between optimizer steps.

    Where that is torch's own method and no profiler records, its loop runs here without the profiler range
    that torch opens around it: entering and leaving the range costs about 5 µs whether or not anything
    records it, 2% of a small model's step. Under a profiler, the trace shows the range as it always did; an
    optimizer with a ``zero_grad`` of its own (in its class or on the instance) always has it called.
    """
    if getattr(optimizer.zero_grad, "__func__", None) is not _TORCH_ZERO_GRAD or torch.autograd._profiler_enabled():
        optimizer.zero_grad(set_to_none=True)
        return
    drop_gradients(optimizer)


def needs_closure(optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether the first of ``optimizers`` must be given a closure by its ``step``, which may run it several times
    (LBFGS)."""
    closure = inspect.signature(optimizers[0].step).parameters.get("closure") if optimizers else None
    return closure is not None and closure.default is inspect.Parameter.empty


def drop_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Set the gradients of ``optimizer``'s parameters to None without calling its ``zero_grad``, which the
    module's hooks (``optimizer_zero_grad``) and manual ``training_step`` call, as often as in Lightning."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = None


class NoOptimizer(torch.optim.Optimizer):
    """The optimizer of a fit whose ``configure_optimizers`` returned None: it holds no parameter of the module,
    and its step only runs the closure it is given."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(1)], {})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return closure() if closure is not None else None


def configure_optimization(
    result: Any, automatic: bool, lr_scheduler_step: Callable[..., Any] | None
) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
    """The optimizers and schedulers of ``configure_optimizers()``'s ``result``, checked for a module whose
    optimization is ``automatic`` (or manual) and whose ``lr_scheduler_step`` override (None: none) steps the
    schedulers. None, as in Lightning, is warned about: the fit then runs its steps and
    backward passes with an optimizer that changes nothing."""
    if result is None:
        rank_zero_warn(
            "`configure_optimizers` returned `None`, this fit will run with no optimizer: the steps and their "
            "backward run, and no parameter is updated"
        )
        return [NoOptimizer()], []
    optimizers, configs = parse_optimizers(result, automatic)
    if any(isinstance(optimizer, LightningOptimizer) for optimizer in optimizers):
        raise TypeError(
            "configure_optimizers returned a LightningOptimizer: return the torch.optim.Optimizer it wraps "
            "(the Trainer wraps it; self.optimizers() gives the wrapper)"
        )
    if automatic:
        check_automatic(optimizers)
    for config in configs:
        _check_scheduler(config, optimizers, automatic and lr_scheduler_step is None)
    return optimizers, configs


def parse_optimizers(
    result: Any, automatic: bool = True
) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
    """Split ``configure_optimizers()``'s return value; raise an error naming what was wrong (a form it is not:
    ``MisconfigurationException``, as in Lightning). Under manual optimization (not ``automatic``) the keys of a
    scheduler dict that only the Trainer's stepping reads are ignored, with a warning, as in Lightning."""
    if result is None:
        return [], []
    if isinstance(result, torch.optim.Optimizer):
        return [result], []
    if isinstance(result, Mapping):
        return _parse_dicts([result], automatic)
    if isinstance(result, Sequence) and not isinstance(result, str):
        items = list(result)
        if items and all(isinstance(item, Mapping) for item in items):
            return _parse_dicts(items, automatic)
        if items and all(isinstance(item, torch.optim.Optimizer) for item in items):
            return items, []
        if len(items) == 2 and isinstance(items[0], Sequence):
            # As Lightning, the second of ([optimizers], schedulers) may be a single scheduler.
            optimizers, schedulers = list(items[0]), items[1] if isinstance(items[1], Sequence) else [items[1]]
            _check_optimizers(optimizers)
            return optimizers, [_scheduler_config(item, automatic) for item in schedulers]
    raise MisconfigurationException(
        f"Unknown configuration for model optimizers: configure_optimizers() returned {_describe(result)}; "
        f"it must return {_FORMS}"
    )


def _parse_dicts(
    items: list[Mapping[str, Any]], automatic: bool
) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig]]:
    optimizers, configs = [], []
    for item in items:
        item = _known_keys(item, {"optimizer", "lr_scheduler", "monitor"}, "the optimizer configuration")
        if "optimizer" not in item:
            raise TypeError(f'configure_optimizers() returned a dict with no "optimizer" key; it must return {_FORMS}')
        _check_optimizers([item["optimizer"]])
        optimizers.append(item["optimizer"])
        if item.get("lr_scheduler") is not None:
            config = _scheduler_config(item["lr_scheduler"], automatic, default_monitor=item.get("monitor"))
            configs.append(config)
    return optimizers, configs


def _scheduler_config(value: Any, automatic: bool, default_monitor: str | None = None) -> LRSchedulerConfig:
    if not automatic:
        return _manual_scheduler_config(value)
    if isinstance(value, Mapping):
        config = LRSchedulerConfig(**{"monitor": default_monitor, **_scheduler_dict(value)})
    else:
        config = LRSchedulerConfig(scheduler=value, monitor=default_monitor)
    if config.interval not in ("step", "epoch"):
        raise MisconfigurationException(
            f'The "interval" key in lr scheduler dict must be "step" or "epoch" but is "{config.interval}" '
            "(configure_optimizers())"
        )
    if not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"configure_optimizers(): lr_scheduler frequency={config.frequency!r} must be a positive int")
    if config.reads_metric and config.monitor is None:
        raise MisconfigurationException(
            "`configure_optimizers` must include a monitor when a `ReduceLROnPlateau` scheduler is used: the "
            'metric it watches; return {"optimizer": ..., "lr_scheduler": {"scheduler": ..., "monitor": "val_loss"}}'
        )
    if isinstance(config.scheduler, OneCycleLR) and config.interval == "epoch":
        rank_zero_warn(
            "A `OneCycleLR` scheduler is using 'interval': 'epoch'. Are you sure you didn't mean 'interval': 'step'? "
            "Its schedule is usually counted in optimizer steps",
            RuntimeWarning,
            stacklevel=6,
        )
    return config


def _manual_scheduler_config(value: Any) -> LRSchedulerConfig:
    """A scheduler under manual optimization: ``training_step`` steps it, so nothing checks what would step it;
    ``interval`` and ``name`` are kept for ``LearningRateMonitor``."""
    if not isinstance(value, Mapping):
        return LRSchedulerConfig(scheduler=value, reduce_on_plateau=False)
    ignored = [key for key in value if key in _STEPPING_KEYS]
    if ignored:
        rank_zero_warn(
            f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be ignored. You need to call "
            "`lr_scheduler.step()` manually in manual optimization.",
            RuntimeWarning,
            stacklevel=6,
        )
    kept = {key: item for key, item in _scheduler_dict(value).items() if key not in _STEPPING_KEYS}
    return LRSchedulerConfig(**kept, reduce_on_plateau=False)


def _scheduler_dict(value: Mapping[str, Any]) -> Mapping[str, Any]:
    value = _known_keys(value, _SCHEDULER_KEYS, "the lr scheduler dict")
    if "scheduler" not in value:
        raise MisconfigurationException(
            'The lr scheduler dict must have the key "scheduler" with its item being an lr scheduler '
            f"(configure_optimizers() gave one with the keys {sorted(value)})"
        )
    return value


def _check_scheduler(config: LRSchedulerConfig, optimizers: list[torch.optim.Optimizer], stepped: bool) -> None:
    """Refuse a scheduler that cannot be saved, that schedules an optimizer the fit does not step, or (``stepped``:
    the Trainer steps it with PyTorch's call) whose ``step`` is not PyTorch's, with Lightning's errors."""
    scheduler = config.scheduler
    name = type(scheduler).__name__
    if not (callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None))):
        raise TypeError(
            f"The provided lr scheduler `{name}` is invalid. It should have `state_dict` and `load_state_dict` "
            "methods defined, to be saved in checkpoints and restored"
        )
    if stepped and not isinstance(scheduler, (LRScheduler, ReduceLROnPlateau)):
        raise MisconfigurationException(
            f"The provided lr scheduler `{name}` doesn't follow PyTorch's LRScheduler API. You should override the "
            "`LightningModule.lr_scheduler_step` hook with your own logic if you are using a custom LR scheduler "
            "(lr_scheduler_step(self, scheduler, metric) is called where the Trainer would step it)"
        )
    if getattr(scheduler, "optimizer", None) is not None and not any(
        scheduler.optimizer is optimizer for optimizer in optimizers
    ):
        raise MisconfigurationException(
            "Some schedulers are attached with an optimizer that wasn't returned from `configure_optimizers`: "
            f"`{name}` schedules an optimizer that is not among the {len(optimizers)} it returned"
        )


def monitored_value(config: LRSchedulerConfig, metrics: Mapping[str, Any]) -> Any | None:
    """The value of the metric that ``config``'s scheduler watches, as the callback metrics hold it (a tensor, given
    to ``lr_scheduler_step`` as in Lightning); when it was not logged, as in Lightning, a
    ``MisconfigurationException``, or with ``strict=False`` a ``RuntimeWarning`` and None (the step is skipped)."""
    if config.monitor is not None and config.monitor in metrics:
        return metrics[config.monitor]
    message = f"ReduceLROnPlateau conditioned on metric {config.monitor} which is not available"
    if config.strict:
        raise MisconfigurationException(
            f"{message}. Available metrics are: {sorted(metrics)}. Log it, or set 'strict': False in the lr "
            "scheduler dict to skip the scheduler's steps while it is missing"
        )
    warnings.warn(f"{message} but strict is set to `False`: the scheduler does not step", RuntimeWarning, stacklevel=2)
    return None


def check_automatic(optimizers: list[torch.optim.Optimizer]) -> None:
    """Automatic optimization steps exactly one optimizer (as in Lightning, several are a ``RuntimeError``)."""
    if len(optimizers) > 1:
        raise RuntimeError(
            f"Training with multiple optimizers is only supported with manual optimization: configure_optimizers() "
            f"returned {len(optimizers)}. For several (GANs, ...), set self.automatic_optimization = False and step "
            "them in training_step with self.optimizers() and self.manual_backward(loss)"
        )


def refuse_optimizer_idx(training_step: Callable[..., Any] | None) -> None:
    """Refuse Lightning 1.x's ``training_step(batch, batch_idx, optimizer_idx)``: nothing passes that argument now (as
    in Lightning 2, several optimizers are stepped by the module itself)."""
    if training_step is not None and "optimizer_idx" in inspect.signature(training_step).parameters:
        raise RuntimeError(
            f"{training_step.__qualname__}(..., optimizer_idx) is the signature of Lightning 1.x, whose automatic "
            "optimization looped over several optimizers. Training with multiple optimizers is only supported with "
            "manual optimization. Remove the `optimizer_idx` argument from `training_step`, set "
            "`self.automatic_optimization = False` and step each of `opt1, opt2, ... = self.optimizers()` there"
        )


def check_optimization_flags(
    strategy: Strategy, module: Module, accumulate: int | Literal["auto"], clip_val: float | None
) -> None:
    """Refuse flags that the strategy or the module's optimization cannot honour (under manual optimization, as
    Lightning, with a ``MisconfigurationException``)."""
    if accumulate == "auto" and not strategy.averages_split_gradients:
        raise ValueError(
            f"accumulate_grad_batches='auto' needs a strategy that can average gradients after splitting a "
            f"batch; strategy {strategy.name!r} with {strategy.world_size} processes cannot (use 'ddp', or a count)"
        )
    check_manual_optimization_flags(module, accumulate, clip_val)


def check_manual_optimization_flags(module: Module, accumulate: int | Literal["auto"], clip_val: float | None) -> None:
    """Refuse, under manual optimization, the flags by which the Trainer would accumulate or clip gradients."""
    if module.automatic_optimization:
        return
    # Under manual optimization the module steps and clips itself: the Trainer's flags for that would be ignored.
    if accumulate != 1:
        raise MisconfigurationException(
            "Automatic gradient accumulation is not supported for manual optimization: "
            f"accumulate_grad_batches={accumulate!r} with manual optimization (automatic_optimization = False): "
            "the module steps its optimizers itself; accumulate in training_step, or leave the flag at 1"
        )
    if clip_val:
        raise MisconfigurationException(
            "Automatic gradient clipping is not supported for manual optimization: "
            f"gradient_clip_val={clip_val!r} with manual optimization (automatic_optimization = False): clip in "
            "training_step with self.clip_gradients(optimizer, ...) before stepping, or leave the flag unset"
        )


def _known_keys(config: Mapping[str, Any], known: set[str], what: str) -> Mapping[str, Any]:
    """``config`` without the keys it may not have, which are warned about and ignored, as in Lightning."""
    unknown = set(config) - known
    if not unknown:
        return config
    warnings.warn(
        f"Found unsupported keys in {what}: {unknown}, ignored (configure_optimizers() may give {sorted(known)})",
        RuntimeWarning,
        stacklevel=4,
    )
    return {key: item for key, item in config.items() if key in known}


def _check_optimizers(optimizers: list[Any]) -> None:
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"configure_optimizers() returned {_describe(optimizer)} where an optimizer was expected; "
                f"it must return {_FORMS}"
            )


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}" if len(text) <= 80 else f"a {type(value).__name__}"
