"""Values logged with ``self.log``: kept detached on the device, reduced across ranks, read at log time.

Nothing here calls ``.item()`` per step: step values are the latest detached tensor, epoch values
are running sums on the device, and both become Python numbers only when a logger writes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch

from ember._utils import to_floats
from ember.exceptions import MisconfigurationException
from ember.loggers import Logger
from ember.rank_zero import rank_zero_warn_once
from ember.utilities import logged_batch_size

ReduceFx = Literal["mean", "sum", "max", "min"]
#: The reductions ``self.log(reduce_fx=...)`` takes, as Lightning does: their names (in any case, "avg" for the
#: mean) and the functions that compute them.
_REDUCE_FX: dict[Any, ReduceFx] = {
    "mean": "mean", "avg": "mean", "sum": "sum", "max": "max", "min": "min",
    torch.mean: "mean", torch.sum: "sum", sum: "sum", torch.max: "max", max: "max", torch.min: "min", min: "min",
}  # fmt: skip
Number = torch.Tensor | float


def _logging_function() -> tuple[str, int, str] | None:
    """The code of the function outside Ember that called ``self.log`` (or ``log_dict``, or a callback's ``log``).

    The hooks of a training batch share the step's logging scope (one scope per epoch, not one per hook and
    batch, keeps the loop's per-batch cost down), so the scope alone cannot tell a name logged twice in one hook,
    which Lightning refuses with other options, from the same name logged in ``training_step`` and in
    ``on_train_batch_end``, which it takes. Only looked up when a call's options differ from the previous call's.
    The function is named by its place, not its code object, which would keep the Trainer from pickling.
    """
    frame = inspect.currentframe()
    while frame is not None and frame.f_globals.get("__name__", "").startswith("ember."):
        frame = frame.f_back
    if frame is None:
        return None
    code = frame.f_code
    return code.co_filename, code.co_firstlineno, code.co_name


def is_metric_object(value: Any) -> bool:
    """A ``torchmetrics.Metric``-like object: it updates per batch and computes its own (synced) value."""
    return callable(getattr(value, "compute", None)) and callable(getattr(value, "reset", None))


class _Logged:
    """One logged name: its options, latest step value and running epoch aggregate."""

    __slots__ = (
        "caller",
        "loaders",
        "metric",
        "name",
        "on_epoch",
        "on_step",
        "options",
        "prog_bar",
        "reduce_fx",
        "step_fresh",
        "step_since_epoch",
        "step_value",
        "sync_dist",
        "to_logger",
        "total",
        "weight",
    )

    on_step: bool
    on_epoch: bool
    prog_bar: bool
    to_logger: bool
    reduce_fx: ReduceFx
    sync_dist: bool

    def __init__(self, name: str) -> None:
        self.name = name  # as self.log got it (without a loader's suffix)
        self.options: tuple[Any, ...] = ()  # the scope and the arguments of the self.log call that set them
        self.caller: tuple[str, int, str] | None = None  # the function that made that call (see _logging_function)
        self.loaders: set[int] = set()  # the evaluation loaders whose steps logged it (none: all of them)
        self.step_value: Number | None = None
        self.step_fresh = False
        self.step_since_epoch = False  # logged per step since its epoch value was reduced: the newer of the two
        self.total: Number | None = None
        self.weight = 0
        self.metric: Any = None

    def resolved_options(self) -> tuple[Any, ...]:
        """The options as they apply (defaults resolved), to compare two calls by."""
        return self.on_step, self.on_epoch, self.prog_bar, self.reduce_fx, self.to_logger, self.sync_dist


class MetricStore:
    """What one stage (fit's training, validation, test) has logged since its epoch began."""

    def __init__(self, reduce: Callable[..., torch.Tensor]) -> None:
        self.reduce = reduce  # how epoch values are reduced (over the processes too)
        self._entries: dict[str, _Logged] = {}
        #: The batch being processed; its size is inferred only if a per-epoch mean needs it.
        self.batch: Any = None
        self._sized_batch: Any = None
        self._batch_size = 1
        #: Keep copies of logged tensors: the step's outputs are overwritten by the next (CUDA graphs).
        self.copy_values = False
        #: Epoch values reduced before the epoch's end hooks (``RunMetrics.reduce_epoch``), not yet published.
        self.reduced: dict[str, tuple[Number, _Logged]] = {}

    def record(self, entry: _Logged, value: Any, batch_size: int | None) -> None:
        """Record one ``self.log`` value in ``entry``, with the options ``RunMetrics.log`` gave it: called per step,
        possibly several times, the common case (a scalar tensor) taking the shortest path."""
        if type(value) is torch.Tensor and value.numel() == 1:  # the usual value, taken without a call more
            value = value.detach()  # logging must never keep the autograd graph alive
        elif is_metric_object(value):
            entry.metric = value  # computed, synced and reset by itself at epoch end
            cached = getattr(value, "_forward_cache", None)
            if entry.on_step and cached is not None:
                entry.step_value, entry.step_fresh = _as_number(entry.name, cached), True
                entry.step_since_epoch = True
            return
        else:
            value = _as_number(entry.name, value)
        if self.copy_values and isinstance(value, torch.Tensor):
            value = value.clone()
        if entry.on_step:
            entry.step_value, entry.step_fresh, entry.step_since_epoch = value, True, True
        if entry.on_epoch:
            self._add_to_epoch(entry, value, batch_size)

    def _add_to_epoch(self, entry: _Logged, value: Number, batch_size: int | None) -> None:
        if entry.reduce_fx != "mean":
            entry.total = _accumulate(entry.total, value, entry.reduce_fx, 1)
            return
        if batch_size is None:
            if self._sized_batch is not self.batch:  # an epoch's first batch has its tensors compared
                self._batch_size = logged_batch_size(self.batch, compare=self._sized_batch is None)
                self._sized_batch = self.batch
            batch_size = self._batch_size
        entry.total = _accumulate(entry.total, value, "mean", batch_size)
        entry.weight += batch_size

    # ------------------------------------------------------------------------------ reading
    def step_values(self, *, fresh_only: bool, for_logger: bool = False) -> dict[str, Number]:
        """The latest per-step values, named ``name`` (or ``name_step`` when also logged per epoch).

        ``fresh_only`` takes the values logged since the last such call and, being called at the same
        step on every rank, reduces those logged with ``sync_dist`` across ranks.
        """
        values = {}
        for key, entry in self._entries.items():
            if entry.step_value is None or (fresh_only and not entry.step_fresh):
                continue
            if for_logger and not entry.to_logger:
                continue
            if fresh_only:
                entry.step_fresh = False
                if entry.sync_dist:
                    reduced = torch.as_tensor(entry.step_value, dtype=torch.float32).reshape(())
                    entry.step_value = self.reduce(reduced, reduce_op=entry.reduce_fx)
            values[_step_name(key, entry)] = entry.step_value
        return values

    def newer_step_values(self) -> dict[str, Number]:
        """Under its plain name, the step value of each name logged per step and per epoch that is newer than its epoch
        value (Lightning's callback metrics hold it there while an epoch trains)."""
        return {key: entry.step_value for key, entry in self._entries.items()
                if entry.step_since_epoch and entry.on_epoch and entry.step_value is not None}  # fmt: skip

    def prog_bar_step_values(self) -> dict[str, Number]:
        return {
            _step_name(key, entry): entry.step_value
            for key, entry in self._entries.items()
            if entry.prog_bar and entry.step_value is not None
        }

    def epoch_values(self, final: bool = True) -> dict[str, tuple[Number, _Logged]]:
        """Reduce every per-epoch value (across ranks where ``sync_dist``) and reset the aggregates; metric
        objects are reset only when ``final`` (before the epoch's end hooks, the module may still read them)."""
        values = {}
        for key, entry in self._entries.items():
            if not entry.on_epoch:
                if entry.metric is not None and final:  # logged per step only: its state must not grow
                    entry.metric.reset()
                    entry.metric = None
                continue
            if entry.metric is not None:
                value = _as_number(key, entry.metric.compute())  # a metric object syncs across ranks itself
                if final:  # (computed again then: torchmetrics keeps the result until its next update)
                    entry.metric.reset()
                    entry.metric = None
            elif entry.total is None:
                continue
            else:
                value = self._reduce_epoch(entry)
            entry.total, entry.weight, entry.step_since_epoch = None, 0, False
            values[key] = (value, entry)
        return values

    def _reduce_epoch(self, entry: _Logged) -> Number:
        total = entry.total
        assert total is not None
        if not entry.sync_dist:
            return total / entry.weight if entry.reduce_fx == "mean" else total
        device = total.device if isinstance(total, torch.Tensor) else None
        if entry.reduce_fx == "mean":
            # The global mean weighs each rank by the number of samples it saw.
            pair = torch.stack([torch.as_tensor(total, dtype=torch.float32, device=device).reshape(()),
                                torch.tensor(float(entry.weight), device=device)])  # fmt: skip
            pair = self.reduce(pair, reduce_op="sum")
            return pair[0] / pair[1]
        return self.reduce(torch.as_tensor(total, dtype=torch.float32, device=device), reduce_op=entry.reduce_fx)

    def clear(self) -> None:
        for entry in self._entries.values():
            if entry.metric is not None:  # updated by batches whose values are dropped (the sanity check)
                entry.metric.reset()
        self._entries.clear()
        self.reduced.clear()
        self._sized_batch = None


def _step_name(key: str, entry: _Logged) -> str:
    return _suffixed(key, "_step") if entry.on_epoch else key


def epoch_name(key: str, entry: _Logged) -> str:
    return _suffixed(key, "_epoch") if entry.on_step else key


def _suffixed(key: str, suffix: str) -> str:
    # "loss/dataloader_idx_1" becomes "loss_step/dataloader_idx_1"
    name, separator, loader = key.partition("/dataloader_idx_")
    return name + suffix + separator + loader


def _as_number(name: str, value: Any) -> Number:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"`self.log({name}, ...)` was called, but the tensor must have a single element (its shape is "
                f"{tuple(value.shape)}): log a reduction of it, such as `self.log({name}, value.mean())`"
            )
        return value.detach()  # logging must never keep the autograd graph alive
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Mapping) and any(isinstance(item, Mapping) for item in value.values()):
        raise ValueError(f"`self.log({name}, {value})` was called, but nested dictionaries cannot be logged")
    raise ValueError(
        f"`self.log({name}, {value})` was called, but `{type(value).__name__}` values cannot be logged: log a "
        "number, a one-element tensor or a torchmetrics Metric (self.log_dict for several)"
    )


def reduction(name: str, reduce_fx: Any) -> ReduceFx:
    """What ``self.log(name, reduce_fx=...)`` asks for: a name (in any case) or a function of ``_REDUCE_FX``."""
    key = reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx
    try:
        return _REDUCE_FX[key]
    except (KeyError, TypeError):  # TypeError: an unhashable argument
        raise MisconfigurationException(
            f"Only `self.log(..., reduce_fx={{min,max,mean,sum}})` are supported (as names or as torch's and "
            f"Python's functions), not `self.log({name!r}, reduce_fx={reduce_fx!r})`: for another reduction, log a "
            "torchmetrics.Metric that computes it"
        ) from None


def _accumulate(total: Number | None, value: Number, reduce_fx: ReduceFx, weight: int) -> Number:
    if total is None:
        if isinstance(value, torch.Tensor):
            # A copy: the running total is updated in place and must not alias the logged tensor.
            return value.to(torch.float32, copy=True).reshape(()) * (weight if reduce_fx == "mean" else 1)
        return value * weight if reduce_fx == "mean" else value
    if isinstance(value, torch.Tensor) and not isinstance(total, torch.Tensor):
        total = torch.tensor(total, dtype=torch.float32, device=value.device)
    if isinstance(total, torch.Tensor):
        if reduce_fx == "mean":
            return total.add_(value.reshape(()) if isinstance(value, torch.Tensor) else value, alpha=weight)
        if reduce_fx == "sum":
            return total.add_(value.reshape(()) if isinstance(value, torch.Tensor) else value)
        value = torch.as_tensor(value, dtype=total.dtype, device=total.device).reshape(())
        return torch.maximum(total, value) if reduce_fx == "max" else torch.minimum(total, value)
    if reduce_fx == "mean":
        return total + value * weight
    if reduce_fx == "sum":
        return total + value
    return max(total, value) if reduce_fx == "max" else min(total, value)


@dataclasses.dataclass(frozen=True)
class LogScope:
    """Where ``self.log`` records a value now, and with which defaults: what the hook caller (``loops.hooks``)
    says of the hook it runs. Outside every hook, and in hooks where nothing may be logged, ``store`` is None."""

    hook: str | None = None
    """The hook (or step) being run."""
    store: MetricStore | None = None
    """The values of its stage: fit's training, or an evaluation's (None: logging is refused here)."""
    default_on_step: bool = False
    """``on_step`` when ``self.log`` leaves it out (``on_epoch`` is then its opposite)."""
    epoch_only: bool = False
    """Whether values must be epoch values (the hooks that start or end a stage or an epoch)."""
    suffix: str = ""
    """``/dataloader_idx_N`` while one of several evaluation loaders runs."""
    dataloader_idx: int | None = None
    """That loader's index."""
    predicting: bool = False
    """Whether the scope is prediction's, which logs nothing."""

    def refusal(self, name: str) -> str:
        """Why ``self.log(name, ...)`` is refused here, where nothing may be logged."""
        # Lightning's wording first, then which value and why
        if self.predicting:
            return (
                "You are trying to `self.log()` but the loop's result collection is not registered yet: "
                f"`self.log({name!r})` is in `{self.hook}`, a `predict` hook, but it doesn't support logging "
                "(return what to keep from predict_step)"
            )
        where = f"inside `{self.hook}`" if self.hook is not None else "outside fit, validate and test"
        return (
            f"You can't `self.log()` {where} (`self.log({name!r})`): values are logged in training_step, "
            "validation_step, test_step and the hooks of their epochs and batches. HINT: You can still log "
            "directly to the logger by using `self.logger.experiment`."
        )

    def check(self, name: str, on_step: bool, on_epoch: bool, add_dataloader_idx: bool) -> str | None:
        """Why ``self.log(name, on_step=..., on_epoch=...)`` is refused here (what the hook allows first), or None."""
        if self.epoch_only and (on_step or not on_epoch):
            given, allowed = ("on_step=True", "False") if on_step else ("on_epoch=False", "True")
            return (
                f"You can't `self.log({given})` inside `{self.hook}`, must be one of ({allowed},): it logs epoch "
                f"values only (`self.log({name!r}, on_step=False, on_epoch=True)`)"
            )
        if not on_step and not on_epoch:
            return f"`self.log(on_step=False, on_epoch=False)` is not useful: `self.log({name!r})` is kept nowhere"
        if add_dataloader_idx and "/dataloader_idx_" in name:
            return (
                f"You called `self.log` with the key `{name}`, which names a dataloader_idx: with several loaders "
                "Ember adds it (pass add_dataloader_idx=False to name each loader's values yourself)"
            )
        return None


class RunMetrics:
    """What a run has logged, and where it goes.

    ``self.log`` records where ``scope`` says (the hook caller sets it): the training store during ``fit``'s
    training, the evaluation store while validating or testing. The values of finished epochs are published as
    callback metrics; ``write`` hands values to the loggers (on the global-zero process) and keeps them as the
    logged metrics.

    Values are written with Lightning's step labels: while fitting, the index of the latest optimizer step (the
    first step's values, and those of the validation and the epoch end that follow it, are labelled 0); in
    ``validate`` and ``test``, the steps taken. An evaluation's per-step values are labelled with the batch's
    index among its loader's batches in the stage, and written when the evaluation's epoch ends.
    """

    def __init__(self, reduce: Callable[..., torch.Tensor], loggers: list[Logger],
                 is_global_zero: Callable[[], bool], copy_values: bool = False) -> None:  # fmt: skip
        self.train = MetricStore(reduce)
        self.eval = MetricStore(reduce)
        self.train.copy_values = self.eval.copy_values = copy_values
        #: Where ``self.log`` records values now, and with which defaults.
        self.scope = LogScope()
        self._loggers = loggers  # the Trainer's own list, which ``trainer.loggers = ...`` refills
        # Asked at each write: a process that a strategy starts from inside the caller learns its rank after this.
        self._is_global_zero = is_global_zero
        self._epoch_values: dict[str, Number] = {}  # finished epochs' values, read by callbacks
        self._prog_bar_epoch_values: dict[str, Number] = {}
        self._logged: dict[str, float] = {}  # the values last written to the loggers
        self._fitting = False  # whether the stage is fit's (see the class's step labels)
        self._eval_batches: dict[int, int] = {}  # per evaluation loader, its batches run in the stage
        self._eval_steps: list[tuple[int, dict[str, Number]]] = []  # evaluation step values to write, by label

    @contextlib.contextmanager
    def scoped(self, scope: LogScope) -> Iterator[None]:
        """``self.log`` records as ``scope`` says while the block runs."""
        previous, self.scope = self.scope, scope
        try:
            yield
        finally:
            self.scope = previous

    @contextlib.contextmanager
    def discarding(self, hook: str) -> Iterator[None]:
        """``self.log`` records as in the training hook ``hook`` while the block runs, into values that are then
        dropped: a pass over the training data that trains nothing (``StochasticWeightAveraging``'s BatchNorm
        statistics) changes no metric."""
        with self.scoped(LogScope(hook, MetricStore(self.train.reduce), default_on_step=True)):
            yield

    def log(self, name: str, value: Any, prog_bar: bool = False, logger: bool | None = None,
            on_step: bool | None = None, on_epoch: bool | None = None, reduce_fx: Any = "mean", sync_dist: bool = False,
            batch_size: int | None = None, add_dataloader_idx: bool = True) -> None:  # fmt: skip
        """Record one ``self.log`` call where the scope says (arguments as ``Module.log`` documents them)."""
        scope = self.scope
        store = scope.store
        if store is None:
            raise MisconfigurationException(scope.refusal(name))
        key = name + scope.suffix if scope.suffix and add_dataloader_idx else name
        options = (scope, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, add_dataloader_idx)
        entry = store._entries.get(key)
        if entry is None or entry.options != options:  # a name's first call, or other options: checked, then kept
            entry = self._configure(store, key, name, entry, options)
            if isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()):
                rank_zero_warn_once(
                    f"You called `self.log({name!r}, ...)` in your `{scope.hook}` but the value needs to be floating "
                    "to be reduced. Converting it to torch.float32. You can silence this warning by converting the "
                    "value to floating point yourself.",
                    stacklevel=3,
                )
        store.record(entry, value, batch_size)

    def _configure(self, store: MetricStore, key: str, name: str, entry: _Logged | None,
                   options: tuple[Any, ...]) -> _Logged:  # fmt: skip
        """Check the options of a ``self.log(name, ...)`` call, resolve their defaults and give them to the
        record of ``key`` in ``store`` (made on the name's first call). A name logged again in the same hook must
        keep its options, as in Lightning; in another hook (the hooks of a batch share its step's values) the
        latest call's options hold."""
        scope, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist, add_dataloader_idx = options
        on_step = scope.default_on_step if on_step is None else on_step
        on_epoch = (not scope.default_on_step) if on_epoch is None else on_epoch
        problem = scope.check(name, on_step, on_epoch, add_dataloader_idx)
        if problem is not None:
            raise MisconfigurationException(problem)
        reduce = reduction(name, reduce_fx)
        resolved = (on_step, on_epoch, prog_bar, reduce, logger is not False, sync_dist)
        caller = _logging_function()
        if entry is not None and (entry.options[0], entry.caller) == (scope, caller) \
                and resolved != entry.resolved_options():  # fmt: skip
            raise MisconfigurationException(
                f"You called `self.log({name}, ...)` twice in `{scope.hook}` with different arguments. This is not "
                "allowed: a name keeps the options of its first call in a hook"
            )
        index = scope.dataloader_idx
        if entry is not None and not add_dataloader_idx and index is not None and entry.loaders - {index}:
            raise MisconfigurationException(  # as Lightning's: the loaders' values would be mixed
                f"You called `self.log({name}, ...)` twice in `{scope.hook}` with different arguments. This is not "
                "allowed: with add_dataloader_idx=False, each loader's values need a name of their own"
            )
        if logger and not self._loggers:
            rank_zero_warn_once(
                f"You called `self.log({name!r}, ..., logger=True)` but have no logger configured: pass one to the "
                "Trainer (logger=True, or a Logger) to write the value",
                stacklevel=4,
            )
        if entry is None:
            entry = store._entries[key] = _Logged(name)
        if scope.dataloader_idx is not None:
            entry.loaders.add(scope.dataloader_idx)
        entry.on_step, entry.on_epoch, entry.prog_bar, entry.reduce_fx = on_step, on_epoch, prog_bar, reduce
        entry.to_logger, entry.sync_dist, entry.options = logger is not False, sync_dist, options
        entry.caller = caller
        return entry

    @property
    def logged(self) -> dict[str, torch.Tensor]:
        """The latest value of each metric meant for the loggers, as tensors, whether or not a logger wrote it
        yet (a training step's values are written every ``log_every_n_steps``); as Lightning's logged metrics."""
        live = self.train.step_values(fresh_only=False, for_logger=True)
        return {name: _as_tensor(value) for name, value in {**self._logged, **live}.items()}

    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every logged metric, as tensors; of a name logged per step and per epoch, the newer."""
        train = self.train
        metrics = {**self._epoch_values, **train.step_values(fresh_only=False), **train.newer_step_values()}
        return {name: _as_tensor(value) for name, value in metrics.items()}

    def progress_bar_metrics(self) -> dict[str, float]:
        """Values logged with ``prog_bar=True``, as floats (reading them synchronises with the device)."""
        return to_floats(self.progress_bar_values())

    def progress_bar_values(self) -> dict[str, Number]:
        """Values logged with ``prog_bar=True`` as they were logged (an evaluation's per-step ones too, as in
        Lightning): tensors stay on the device."""
        eval_steps = self.eval.prog_bar_step_values()
        return {**self._prog_bar_epoch_values, **eval_steps, **self.train.prog_bar_step_values()}

    def reduce_epoch(self, store: MetricStore, final: bool = True) -> None:
        """Reduce the epoch values ``store`` holds so far and make them callback metrics, kept for
        ``publish_epoch`` to write; not ``final``: before the epoch's end hooks, which read them, as in Lightning."""
        reduced = store.epoch_values(final)
        store.reduced.update(reduced)
        for key, (value, entry) in reduced.items():
            name = epoch_name(key, entry)
            self._epoch_values[name] = value
            if name != key:
                self._epoch_values[key] = value  # "loss" holds the epoch value when both were logged
            if entry.prog_bar:
                self._prog_bar_epoch_values[name] = value

    def publish_epoch(self, store: MetricStore, steps: int, epoch: int) -> dict[str, tuple[Number, set[int]]]:
        """Reduce ``store``'s epoch values, make them callback metrics, and write those meant for loggers (after
        the evaluation's step values), labelled as ``steps`` (the optimizer steps taken) says. Returns each
        value meant for loggers with the evaluation loaders that logged it (none: logged outside them, for all)."""
        if store is self.eval:
            self._write_evaluation_steps()
        self.reduce_epoch(store)
        reduced, store.reduced = store.reduced, {}
        for_loggers = {}
        published = {}
        for key, (value, entry) in reduced.items():
            if entry.to_logger:  # what an evaluation returns too, as Lightning's (logger=False: only for callbacks)
                name = epoch_name(key, entry)
                for_loggers[name] = value
                published[name] = value, entry.loaders
        self.write(for_loggers, self._label(steps), epoch)
        return published

    def log_values(self, values: Mapping[str, float], step: int) -> None:
        """Values a callback measured itself (learning rates): written to the loggers with the label ``step`` and
        no epoch (a row of their own, as Lightning's callbacks write them), and readable in the callback metrics
        (not in the logged metrics, as in Lightning)."""
        self._epoch_values.update(values)
        if values:  # not kept in the logged metrics, as Lightning's monitors write to the loggers themselves
            self._hand_over(to_floats(values), step, None, logged=False)

    def adopt(self, callback_metrics: Mapping[str, Number]) -> None:
        """Hold ``callback_metrics`` as the latest values: a stage's that ran in other processes (rank zero's)."""
        self.reset()
        self._epoch_values.update(callback_metrics)

    def reset(self, fitting: bool = False) -> None:
        """Forget everything logged: each stage (fit, validate, test, predict) starts with no metrics."""
        self.train.clear()
        self.eval.clear()
        self._epoch_values.clear()
        self._prog_bar_epoch_values.clear()
        self._logged.clear()
        self._fitting = fitting
        self._eval_batches.clear()
        self._eval_steps.clear()

    def write_step_values(self, steps: int, epoch: int) -> None:
        """Write the training values logged per step since the last call, ``steps`` optimizer steps into fit."""
        self.write(self.train.step_values(fresh_only=True, for_logger=True), self._label(steps), epoch)

    def evaluation_batch_done(self, dataloader_idx: int) -> None:
        """Keep the step values an evaluation batch logged, with its label, for the epoch's end to write (so that
        no batch waits for the device)."""
        step = self._eval_batches.get(dataloader_idx, 0)
        self._eval_batches[dataloader_idx] = step + 1
        values = self.eval.step_values(fresh_only=True, for_logger=True)
        if values:
            self._eval_steps.append((step, values))

    def _write_evaluation_steps(self) -> None:
        kept, self._eval_steps = self._eval_steps, []
        floats = to_floats({(index, name): value for index, (_, values) in enumerate(kept)
                            for name, value in values.items()})  # fmt: skip
        for index, (step, values) in enumerate(kept):
            self._hand_over({name: floats[index, name] for name in values}, step, None)

    def _label(self, steps: int) -> int:
        return max(steps - 1, 0) if self._fitting else steps

    def write(self, values: Mapping[str, Number], step: int, epoch: int | None) -> None:
        """Turn values into numbers (one device sync) and hand them to the loggers on rank zero, labelled
        ``step``, with the ``epoch`` (unless None, or logged by the module)."""
        if values:
            self._hand_over(to_floats(values), step, epoch)

    def _hand_over(self, floats: dict[str, float], step: int, epoch: int | None, logged: bool = True) -> None:
        if "step" in floats:  # a value logged as "step" labels the others instead of the step, as in Lightning
            floats = dict(floats)
            step, epoch = int(floats.pop("step")), None
        if logged:
            self._logged.update(floats)
        if not self._is_global_zero():
            return
        metrics: dict[str, float] = dict(floats)
        if epoch is not None:
            metrics.setdefault("epoch", epoch)
        for logger in self._loggers:
            logger.log_metrics(metrics=metrics, step=step)


def _as_tensor(value: Number) -> torch.Tensor:
    """``value`` as a tensor, a float one (an integer tensor logged per step is read as float32, as Lightning's)."""
    if not isinstance(value, torch.Tensor):
        return torch.tensor(value)
    return value if value.is_floating_point() else value.float()
