"""``StepRunner``: the one place that runs training steps, for ``fit``, the tuner and the doctor.

A step is the forward and backward of each micro-batch of an accumulation window (gradients are
synchronised across ranks only on the window's last), then unscaling, clipping, the optimizer step,
``zero_grad`` and the schedulers that step per optimizer step. Nothing here waits for the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember._utils import batch_size_of, split_batch
from ember.loops.progress import Progress
from ember.optim import LRSchedulerConfig

if TYPE_CHECKING:
    from ember.module import Module
    from ember.strategies import Strategy

Metrics = Callable[[], Mapping[str, torch.Tensor]]
Hook = Callable[..., Any]


@dataclasses.dataclass
class StepHooks:
    """The hooks of an optimizer step that a module or callback overrides (empty: none, so none is called).

    With any of them, a step follows Lightning's order: per micro-batch ``training_step``, then (first
    micro-batch of a window) ``on_before_zero_grad`` and ``optimizer_zero_grad``, then
    ``on_before_backward``, ``backward``, ``on_after_backward``; on the window's last micro-batch all of
    that runs inside the closure that ``optimizer_step`` receives, whose ``optimizer.step(closure)``
    unscales, calls ``on_before_optimizer_step`` and ``configure_gradient_clipping``, and steps.
    """

    before_zero_grad: list[Hook] = dataclasses.field(default_factory=list)
    before_backward: list[Hook] = dataclasses.field(default_factory=list)
    after_backward: list[Hook] = dataclasses.field(default_factory=list)
    optimizer_step: Hook | None = None
    optimizer_zero_grad: Hook | None = None
    configure_gradient_clipping: Hook | None = None
    lr_scheduler_step: Hook | None = None
    backward: Hook | None = None

    @property
    def any(self) -> bool:
        return any(bool(value) for value in dataclasses.astuple(self))


class StepRunner:
    """Runs training steps of ``module`` through ``strategy`` and counts them in ``progress``.

    Args:
        clip_val, clip_algorithm: the Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm``.
        before_step_hooks: called with the optimizer once its gradients are complete and unscaled.
        metrics: the callback metrics, read by schedulers that watch one (``ReduceLROnPlateau``).
        hooks: the other hooks of a step that the module or callbacks override (see ``StepHooks``).
    """

    def __init__(
        self,
        strategy: Strategy,
        module: Module,
        optimizers: Sequence[torch.optim.Optimizer],
        scheduler_configs: Sequence[LRSchedulerConfig] = (),
        progress: Progress | None = None,
        *,
        clip_val: float | None = None,
        clip_algorithm: Literal["norm", "value"] = "norm",
        before_step_hooks: Sequence[Callable[..., Any]] = (),
        metrics: Metrics = dict,
        hooks: StepHooks | None = None,
    ) -> None:
        self.strategy = strategy
        self.module = module
        self.optimizers = list(optimizers)
        self.scheduler_configs = list(scheduler_configs)
        self.progress = progress if progress is not None else Progress()
        self.clip_val = clip_val
        self.clip_algorithm = clip_algorithm
        self.before_step_hooks = list(before_step_hooks)
        self.metrics = metrics
        self.hooks = hooks or StepHooks()
        #: Whether steps run the hooks of ``hooks`` (Lightning's order), or the shorter path without them.
        self.hooked = self.hooks.any
        #: With ``accumulate_grad_batches="auto"``: the pieces each batch is cut into to fit in memory.
        self.micro_batches = 1
        #: What ``Module.optimizers()`` returns under manual optimization.
        self.manual_optimizers = [ManualOptimizer(optimizer, self) for optimizer in self.optimizers]
        # Outputs of a forward that CUDA graphs replay are overwritten by the next replay: what outlives
        # the step must be a copy.
        self._copy_outputs = strategy.reuses_outputs
        self._calls = strategy.step_calls()
        # Nothing comes between the gradients and the step (no hook, loss scaling or clipping): a batch that is
        # its own window then steps as a plain loop does.
        self._steps_directly = not (self.hooked or self._calls.unscale or self.before_step_hooks or clip_val)
        step = getattr(module, "training_step", None)
        #: ``training_step(batch, batch_idx)`` as the strategy runs it (a step may leave ``batch_idx`` out).
        self.training_step = _calling(self._calls.forward, with_index=step is None or takes_batch_idx(step))

    # ------------------------------------------------------------------- automatic optimization
    def single_step(self, batch: Any, batch_idx: int) -> tuple[Any, Any]:
        """A window of one micro-batch (no accumulation): its forward and backward, then the optimizer step
        when the step produced a loss, in Lightning's order of hooks where any is overridden. Returns the
        step's output and its detached loss (None when the step skipped the batch).

        The common case: a window of one synchronises its gradients, so there is no ``no_sync`` to enter."""
        if self.hooked:
            return self.hooked_micro_batch(
                batch, batch_idx, 1, first=True, closing=True, had_gradients=False, gradient_scale=_one
            )
        output = self.training_step(batch, batch_idx)
        # A plain tensor is taken as it is: what backward rejects in it (not one number, or no graph) is
        # explained once backward has failed, so that a sound step pays for no check.
        loss = output if type(output) is torch.Tensor else training_loss(output, self.module)
        if loss is None:
            return output, None
        try:
            self._calls.backward(loss)
        except RuntimeError:
            training_loss(output, self.module)  # raises the clear error where the loss was the cause
            raise
        if not self._steps_directly:
            self.optimizer_step()
            return output, self._kept(loss)
        # The common case, with optimizer_step, _count_step and _kept spelled out: on a small model, each call
        # more per step costs about as much as a small kernel.
        optimizer, progress = self.optimizers[0], self.progress
        self._calls.optimizer_step(optimizer)
        clear_gradients(optimizer)
        progress.global_step += 1
        progress.epoch_steps += 1
        if self.scheduler_configs:
            self.step_schedulers("step", progress.global_step)
        kept = loss.detach()
        return output, kept.clone() if self._copy_outputs else kept

    def forward_backward(self, batch: Any, batch_idx: int, window_size: int, sync: bool) -> tuple[Any, Any]:
        """One micro-batch of a window of ``window_size``: its forward and backward. Gradients are
        synchronised across ranks only when ``sync`` (the window's last micro-batch). Returns the step's
        output and its detached loss (None when the step skipped the batch)."""
        with self.strategy.no_sync(not sync):
            output = self.training_step(batch, batch_idx)
            loss = training_loss(output, self.module)
            if loss is None:
                return output, None
            # Dividing by the window size makes k micro-batches of b the same as one batch of k*b.
            self._calls.backward(loss / window_size if window_size > 1 else loss)
        return output, self._kept(loss)

    def split_forward_backward(self, batch: Any, batch_idx: int) -> tuple[Any, Any]:
        """Forward and backward of ``batch`` in ``micro_batches`` pieces; twice as many after running out
        of memory, until the step fits. Returns the last piece's output and the whole batch's loss.

        Each piece's loss is weighted by its share of the batch, so the gradients are the whole batch's.
        With several processes the ranks first compute their pieces without communicating, then agree
        on whether any ran out of memory (all retry with the larger count), and only then average
        gradients: a rank that failed mid-step must never leave the others waiting in an all-reduce.
        """
        strategy = self.strategy
        total = batch_size_of(batch)
        if self.hooked:
            self.zero_grad(batch_idx)
        while True:
            try:
                output, loss = self._pieces(batch, batch_idx, total)
                out_of_memory = False
            except torch.OutOfMemoryError:
                output = loss = None
                out_of_memory = True
            if strategy.world_size > 1:
                out_of_memory = bool(strategy.reduce(torch.tensor(float(out_of_memory)), "max"))
            if not out_of_memory:
                strategy.sync_gradients()
                return output, loss
            self._more_pieces(total, batch_idx)

    def _pieces(self, batch: Any, batch_idx: int, total: int) -> tuple[Any, Any]:
        output: Any = None
        loss: torch.Tensor | None = None
        with self.strategy.no_sync(True):
            for piece in split_batch(batch, self.micro_batches):
                output = self.training_step(piece, batch_idx)
                piece_loss = training_loss(output, self.module)
                if piece_loss is not None:
                    weight = batch_size_of(piece) / total
                    self.backward(piece_loss * weight)
                    loss = piece_loss.detach() * weight + (0.0 if loss is None else loss)
        return output, loss

    def _more_pieces(self, total: int, batch_idx: int) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.micro_batches >= total:
            raise torch.OutOfMemoryError(
                f"accumulate_grad_batches='auto': one sample at a time still runs out of memory (batch {batch_idx})"
            )
        self.micro_batches = min(total, 2 * self.micro_batches)
        self.strategy.release_memory()
        if self.strategy.is_global_zero:
            print(
                f"out of memory at batch {batch_idx}: retrying with {self.micro_batches} micro-batches of about "
                f"{math.ceil(total / self.micro_batches)} samples"
            )

    def optimizer_step(self, gradient_scale: float = 1.0, batch_idx: int | None = None) -> None:
        """Step the optimizer with the gradients accumulated so far (multiplied by ``gradient_scale``
        first: a window that turned out shorter than its losses were divided for)."""
        optimizer = self.optimizers[0]
        if self.hooks.optimizer_step is not None:
            # The module steps in its own hook, with no closure: no micro-batch is left to run.
            batch_idx = self.progress.epoch_batches - 1 if batch_idx is None else batch_idx
            stepper = _StepOptimizer(optimizer, self, gradient_scale)
            self.hooks.optimizer_step(self.progress.epoch, batch_idx, stepper, None)
        else:
            self._apply_step(optimizer, gradient_scale)
        if not self.hooked:
            clear_gradients(optimizer)  # with hooks, optimizer_zero_grad runs when the next window starts
        self._count_step()

    def _apply_step(self, optimizer: torch.optim.Optimizer, gradient_scale: float = 1.0) -> None:
        calls = self._calls
        if gradient_scale != 1.0:
            _scale_gradients(optimizer, gradient_scale)
        if calls.unscale is not None:
            calls.unscale(optimizer)  # clipping and the hooks must see the true gradients
        for hook in self.before_step_hooks:
            hook(optimizer)
        if self.hooks.configure_gradient_clipping is not None:
            self.hooks.configure_gradient_clipping(optimizer, self.clip_val, self.clip_algorithm)
        elif self.clip_val:
            self.strategy.clip_gradients(optimizer, self.clip_val, self.clip_algorithm)
        calls.optimizer_step(optimizer)

    def _count_step(self) -> None:
        self.progress.count_step()
        if self.scheduler_configs:
            self.step_schedulers("step", self.progress.global_step)

    # ------------------------------------------------------------------ a step with hooks
    def hooked_micro_batch(
        self, batch: Any, batch_idx: int, window_size: int, *, first: bool, closing: bool,
        had_gradients: bool, gradient_scale: Callable[[], float],
    ) -> tuple[Any, Any]:  # fmt: skip
        """One micro-batch of a window, in Lightning's order of hooks (see ``StepHooks``); on the window's
        last (``closing``) the optimizer steps, if this or an earlier micro-batch (``had_gradients``) produced
        gradients. Returns the step's output and detached loss, like ``forward_backward``."""
        closure = _Closure(self, batch, batch_idx, window_size, sync=closing, zero_grad=first)
        if not closing:
            closure()
            return closure.output, closure.loss
        optimizer = self.optimizers[0]
        hook = self.hooks.optimizer_step
        if hook is None:
            closure()
            if had_gradients or closure.loss is not None:
                self._apply_step(optimizer, gradient_scale())
                self._count_step()
            return closure.output, closure.loss
        stepper = _StepOptimizer(optimizer, self, gradient_scale, lambda: had_gradients or closure.loss is not None)
        hook(self.progress.epoch, batch_idx, stepper, closure)
        if not closure.ran:
            raise RuntimeError(
                f"{type(self.module).__name__}.optimizer_step() did not call the optimizer_closure it received; "
                "call optimizer.step(closure=optimizer_closure), or optimizer_closure() to run the step's "
                "training_step and backward without stepping"
            )
        if had_gradients or closure.loss is not None:
            self._count_step()
        return closure.output, closure.loss

    def zero_grad(self, batch_idx: int) -> None:
        """Reset the gradients at the start of a window, through the hooks that are overridden."""
        optimizer = self.optimizers[0]
        for hook in self.hooks.before_zero_grad:
            hook(optimizer)
        if self.hooks.optimizer_zero_grad is not None:
            self.hooks.optimizer_zero_grad(self.progress.epoch, batch_idx, optimizer)
        else:
            clear_gradients(optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        """The strategy's backward of ``loss``, between the hooks around it (and through the module's own
        ``backward`` where it overrides it)."""
        hooks = self.hooks
        for hook in hooks.before_backward:
            hook(loss)
        self.strategy.backward(loss, hooks.backward)
        for hook in hooks.after_backward:
            hook()

    def step_schedulers(self, interval: Literal["step", "epoch"], count: int) -> None:
        """Step the schedulers of ``interval`` that are due at its ``count``-th occurrence."""
        for config in self.scheduler_configs:
            if config.interval != interval or count % config.frequency:
                continue
            step = self.hooks.lr_scheduler_step or _step_scheduler
            if not config.reads_metric:
                step(config.scheduler, None)
                continue
            metrics = self.metrics()
            if config.monitor is not None and config.monitor in metrics:
                step(config.scheduler, float(metrics[config.monitor]))
            elif config.strict:
                raise KeyError(
                    f"the lr_scheduler monitors {config.monitor!r}, which was not logged; logged metrics are "
                    f"{sorted(metrics)} (set 'strict': False in the scheduler dict to skip such steps)"
                )

    # ---------------------------------------------------------------------- manual optimization
    def manual_step(self, batch: Any, batch_idx: int) -> tuple[Any, Any]:
        """A training step that steps its optimizers itself; returns its output and the loss it returned."""
        output = self.training_step(batch, batch_idx)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        # Under manual optimization a returned loss is only shown and checked, so any scalar tensor will do.
        return output, self._kept(loss) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None

    def manual_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.before_step_hooks:
            self.strategy.unscale_gradients(optimizer)  # the hooks must see the true gradients
            for hook in self.before_step_hooks:
                hook(optimizer)
        self.strategy.optimizer_step(optimizer)
        self.progress.count_step()

    def _kept(self, loss: torch.Tensor) -> torch.Tensor:
        loss = loss.detach()
        return loss.clone() if self._copy_outputs else loss


class ManualOptimizer:
    """What ``Module.optimizers()`` returns: ``step()`` goes through the strategy (loss scaling) and
    counts ``trainer.global_step``; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, runner: StepRunner) -> None:
        self.optimizer = optimizer
        self._runner = runner

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            closure()
        self._runner.manual_optimizer_step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            clear_gradients(self.optimizer)
        else:
            self.optimizer.zero_grad(set_to_none=False)

    @contextlib.contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """As Lightning's: while active, only this optimizer's parameters receive gradients (the module's
        ``toggle_optimizer``), and ``manual_backward`` averages gradients across ranks only if ``sync_grad``:
        accumulate with ``sync_grad=False`` on all micro-batches but the last."""
        module = self._runner.module
        module.toggle_optimizer(self)
        try:
            with self._runner.strategy.no_sync(not sync_grad):
                yield
        finally:
            module.untoggle_optimizer(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


class _Closure:
    """One micro-batch's ``training_step``, gradient reset (at a window's first) and backward: what Lightning's
    ``optimizer_step`` hook receives as ``optimizer_closure``. Returns the loss (None: the step skipped)."""

    def __init__(self, runner: StepRunner, batch: Any, batch_idx: int, window_size: int, *, sync: bool,
                 zero_grad: bool) -> None:  # fmt: skip
        self._runner = runner
        self._batch = batch
        self._batch_idx = batch_idx
        self._window_size = window_size
        self._sync = sync
        self._zero_grad = zero_grad
        self.ran = False
        self.output: Any = None
        self.loss: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor | None:
        if self.ran:
            raise RuntimeError("optimizer_closure was called twice; each micro-batch runs its step once")
        self.ran = True
        runner = self._runner
        with runner.strategy.no_sync(not self._sync):
            self.output = runner.training_step(self._batch, self._batch_idx)
            loss = training_loss(self.output, runner.module)
            if self._zero_grad:
                runner.zero_grad(self._batch_idx)
            if loss is None:
                return None
            # Dividing by the window size makes k micro-batches of b the same as one batch of k*b.
            runner.backward(loss / self._window_size if self._window_size > 1 else loss)
        self.loss = runner._kept(loss)
        return self.loss


class _StepOptimizer:
    """The optimizer that a module's ``optimizer_step`` hook receives: ``step(closure)`` runs the closure,
    then unscales, runs the hooks, clips and steps through the strategy (skipping the step when no
    gradients were produced); everything else is the wrapped optimizer's."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        runner: StepRunner,
        gradient_scale: Callable[[], float] | float,
        has_gradients: Callable[[], bool] = lambda: True,
    ) -> None:
        self.optimizer = optimizer
        self._runner = runner
        self._gradient_scale = gradient_scale
        self._has_gradients = has_gradients

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        result = closure() if closure is not None else None
        if self._has_gradients():
            scale = self._gradient_scale
            self._runner._apply_step(self.optimizer, scale() if callable(scale) else scale)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


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
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = None


def _calling(step: Callable[..., Any], with_index: bool) -> Callable[[Any, int], Any]:
    if with_index:
        return step

    def without_index(batch: Any, batch_idx: int) -> Any:
        return step(batch)

    return without_index


def _one() -> float:
    return 1.0


def _step_scheduler(scheduler: Any, metric: float | None) -> None:
    if metric is None:
        scheduler.step()
    else:
        scheduler.step(metric)


def takes_batch_idx(step: Callable[..., Any]) -> bool:
    """Whether a step accepts ``batch_idx`` after the batch (Lightning lets a step leave it out)."""
    parameters = inspect.signature(step).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL or p.name == "batch_idx" for p in parameters)


def training_loss(output: Any, module: torch.nn.Module | None = None) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (None skips the batch), or a clear error."""
    if output is None:
        return None
    loss: Any = output
    if not isinstance(output, torch.Tensor) and isinstance(output, Mapping):  # a tensor first: the cheaper test
        loss = output.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            "training_step must return the loss tensor, a dict with a 'loss' tensor, or None to skip the "
            f"batch; it returned {type(output).__name__}"
            + (f" without a 'loss' key (keys: {sorted(output)})" if isinstance(output, Mapping) else "")
        )
    if loss.numel() != 1:
        raise ValueError(
            f"training_step returned a loss of shape {tuple(loss.shape)}; reduce it to one number "
            "(for example with .mean()) before returning it"
        )
    if not loss.requires_grad:
        raise ValueError(f"training_step returned a loss that does not require grad: {_why_no_grad(module)}")
    return loss


def _why_no_grad(module: torch.nn.Module | None) -> str:
    if module is not None and not any(parameter.requires_grad for parameter in module.parameters()):
        return "every parameter of the module is frozen (requires_grad=False), so there is nothing to train"
    return (
        "it was computed under torch.no_grad() (or torch.inference_mode()), or from tensors cut off the graph "
        "(.detach(), .item(), .numpy(), torch.tensor(value)); compute it from the module's output as it is"
    )


def _scale_gradients(optimizer: torch.optim.Optimizer, factor: float) -> None:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
