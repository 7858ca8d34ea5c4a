"""``StepRunner``: the one place that runs training steps, for ``fit``, the tuner and the doctor.

A window is k micro-batches (``accumulate_grad_batches``) and then one optimizer step. Every path (a window of
one, accumulation, a batch split to fit in memory, Lightning's order of hooks with its closure, manual
optimization, the tuner, the doctor) runs a micro-batch through ``forward_backward`` (``training_step``, then the
backward of its loss, with the gradients synchronised across ranks on a window's last micro-batch only) and
steps through ``optimizer_step`` (unscaling, the hooks, clipping, the step). Each training batch returns a
``StepResult``, what it did, for ``Progress.advance`` to count. Nothing here waits for the device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember._utils import batch_size_of, is_out_of_memory, split_batch, takes_batch_idx
from ember.exceptions import MisconfigurationException
from ember.loops.loss import shown_manual_loss, training_loss
from ember.loops.progress import Progress
from ember.optim import (
    LightningOptimizer,
    LRSchedulerConfig,
    check_optimization_flags,
    clear_gradients,
    monitored_value,
    needs_closure,
    refuse_optimizer_idx,
)

if TYPE_CHECKING:
    from ember.module import Module
    from ember.strategies import Strategy

Metrics = Callable[[], Mapping[str, torch.Tensor]]
Hook = Callable[..., Any]


@dataclasses.dataclass(slots=True)
class StepResult:
    """What a training batch did: ``Progress.advance`` counts it; callbacks read it as ``fit_loop.stepped``."""

    output: Any
    """What ``training_step`` returned."""
    loss: torch.Tensor | None
    """Its loss, detached (None: the step skipped the batch, or no batch ran)."""
    steps: int = 0
    """Optimizer steps taken: 0 or 1 under automatic optimization (0 when fault tolerance dropped the step: the
    replica groups did not commit it), as many as the module took under manual."""
    closes_window: bool = True
    """Whether the batch was the last micro-batch of its accumulation window."""
    batches: int = 1
    """Training batches run: 0 for a step of gradients whose batches all ran before (a loader that ended early)."""

    @property
    def stepped(self) -> bool:
        return self.steps > 0


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
        return any(bool(getattr(self, field.name)) for field in dataclasses.fields(self))

    @property
    def around_backward(self) -> bool:
        return bool(self.before_backward or self.after_backward or self.backward)


class Window:
    """The accumulation window being run: ``size`` micro-batches, the losses of each divided by it, then one
    optimizer step. One record serves the whole epoch: the window that follows starts once one closes.

    The epoch's last window may be shorter. When the loader's length is unknown that is found out only at
    its end: the gradients are then rescaled by ``gradient_scale`` before the step.
    """

    def __init__(self, length: int, batches_left: float, done: int = 0) -> None:
        self._length = length  # accumulate_grad_batches
        self._batches_left = batches_left  # the epoch's batches from this window's start on (inf: unknown)
        self.size = int(min(length, batches_left))
        self.seen = done  # micro-batches run (a resumed run may start in the middle of a window)
        self.has_gradients = done > 0
        #: True while the micro-batch being run is the window's last.
        self.closing = False

    def add(self, is_last: bool) -> None:
        """Count the micro-batch about to run (``is_last``: the epoch's last)."""
        self.seen += 1
        self.closing = is_last or self.seen >= self.size

    def next(self) -> None:
        """Start the window that follows this one."""
        self._batches_left -= self.seen
        self.size = int(min(self._length, self._batches_left))
        self.seen = 0
        self.has_gradients = self.closing = False

    @property
    def gradient_scale(self) -> float:
        return self.size / self.seen if 0 < self.seen < self.size else 1.0


class StepRunner:
    """Runs training steps of ``module`` through ``strategy``; each training batch returns a ``StepResult``.

    Args:
        progress: where the fit is, read for the hooks' arguments and the schedulers' counts (never written).
        accumulate: ``accumulate_grad_batches``, checked against the module and the strategy: "auto" splits each
            batch into as many pieces as it takes to fit in memory; a count is the size of the windows the fit loop
            gives ``micro_step``.
        clip_val, clip_algorithm: the Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm`` (None: "norm").
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
        accumulate: int | Literal["auto"] = 1,
        clip_val: float | None = None,
        clip_algorithm: Literal["norm", "value"] | None = None,
        before_step_hooks: Sequence[Callable[..., Any]] = (),
        metrics: Metrics = dict,
        hooks: StepHooks | None = None,
    ) -> None:
        check_optimization_flags(strategy, module, accumulate, clip_val)
        self.strategy = strategy
        self.module = module
        self.optimizers = list(optimizers)
        self.scheduler_configs = list(scheduler_configs)
        self._watches_per_step = any(c.interval == "step" and c.reads_metric for c in self.scheduler_configs)
        #: The optimizer step (its count) whose schedulers that watch a metric are still to step; 0: none. The
        #: fit loop steps them after that step's validation, as Lightning does, so they may watch its metrics.
        self.watched_step = 0
        self.progress = progress if progress is not None else Progress()
        self.clip_val = clip_val
        self.clip_algorithm = clip_algorithm
        self.before_step_hooks = list(before_step_hooks)
        self.metrics = metrics
        self.hooks = hooks = hooks or StepHooks()
        #: With ``accumulate_grad_batches="auto"``: the pieces each batch is cut into to fit in memory.
        self.micro_batches = 1
        #: What ``Module.optimizers()`` returns: the optimizers wrapped so that ``step()`` comes back here.
        self.lightning_optimizers = [LightningOptimizer(optimizer, self) for optimizer in self.optimizers]
        self._closing: Window | None = None  # the window whose step the module's optimizer_step hook is taking
        # Outputs of a forward that CUDA graphs replay are overwritten by the next replay: what outlives
        # the step must be a copy.
        self._copy_outputs = strategy.reuses_outputs
        self._calls = calls = strategy.step_calls()
        self._backward = self.backward if hooks.around_backward else calls.backward
        self._clips = bool(clip_val) or hooks.configure_gradient_clipping is not None
        # Whether a step has anything to do before the optimizer's (a plain step goes straight to it).
        self._prepares = self._clips or bool(self.before_step_hooks) or calls.unscale is not None
        #: Whether the optimizer must run the step's closure itself, maybe several times (LBFGS).
        self.closure_steps = module.automatic_optimization and needs_closure(self.optimizers)
        self._hooked = hooks.any or self.closure_steps  # Lightning's order of the hooks of a step, with its closure
        self._manual_steps = 0  # the optimizer steps of the manual batch being run
        #: Optimizer steps that fault tolerance dropped (the replica groups' vote did not commit them).
        self.dropped_steps = 0
        self._dropped = False  # the step under way was dropped
        step = getattr(module, "training_step", None)
        refuse_optimizer_idx(step)
        #: ``training_step(batch, batch_idx)`` as the strategy runs it (a step may leave ``batch_idx`` out).
        self.training_step = _calling(calls.forward, with_index=step is None or takes_batch_idx(step))
        # A window of one that is not a plain forward, backward and step: manual optimization, a batch split
        # to fit ("auto"), or Lightning's order of hooks.
        self._window_of_one: Callable[[Any, int, Window], StepResult] | None = None
        if not module.automatic_optimization:
            self._window_of_one = self._manual_batch
        elif accumulate == "auto":
            self._window_of_one = self._split_batch
        elif self._hooked:
            self._window_of_one = self._hooked_micro_batch

    # ----------------------------------------------------------------------------- the paths
    def step(self, batch: Any, batch_idx: int) -> StepResult:
        """A window of one micro-batch (no accumulation): its forward and backward, then the optimizer step
        when the step produced a loss. The common case, kept as short as a hand-written loop's step."""
        if self._window_of_one is not None:
            window = Window(1, 1)
            window.add(True)
            return self._window_of_one(batch, batch_idx, window)
        output, loss = self.forward_backward(batch, batch_idx)
        if loss is None:
            return StepResult(output, None)
        optimizer = self.optimizers[0]
        self.optimizer_step(optimizer)
        return StepResult(output, self._kept(loss), self._after_step(optimizer))

    def micro_step(self, batch: Any, batch_idx: int, window: Window, is_last: bool) -> StepResult:
        """One micro-batch of ``window`` (``is_last``: the epoch's last batch): its forward and backward, the
        optimizer step when it closes the window, and the start of the next window then."""
        window.add(is_last)
        if self._hooked:
            result = self._hooked_micro_batch(batch, batch_idx, window)
        else:
            output, loss = self.forward_backward(batch, batch_idx, divisor=window.size, sync=window.closing)
            window.has_gradients = window.has_gradients or loss is not None
            steps = self._close(window, batch_idx) if window.closing else 0
            result = StepResult(output, self._kept(loss), steps, window.closing)
        if window.closing:
            window.next()
        return result

    def close_window(self, window: Window) -> StepResult:
        """The step of a window whose batches have all run (the loader ended before the window was full)."""
        steps = self._close(window, self.progress.epoch_batches - 1)
        window.next()
        return StepResult(None, None, steps, batches=0)

    def _hooked_micro_batch(self, batch: Any, batch_idx: int, window: Window) -> StepResult:
        """A micro-batch in Lightning's order of hooks (see ``StepHooks``): on the window's last, the module's
        ``optimizer_step`` (where it overrides it) runs the micro-batch through the closure it receives."""
        closure = _Closure(self, batch, batch_idx, window)
        if window.closing:
            steps = self._close(window, batch_idx, closure)
        else:
            closure()
            steps = 0
        return StepResult(closure.output, closure.loss, steps, window.closing)

    def _split_batch(self, batch: Any, batch_idx: int, window: Window) -> StepResult:
        """``accumulate_grad_batches="auto"``: the batch in as many pieces as fit in memory, then the step."""
        output, loss = self._split_forward_backward(batch, batch_idx)
        window.has_gradients = loss is not None
        return StepResult(output, loss, self._close(window, batch_idx))

    def _manual_batch(self, batch: Any, batch_idx: int, window: Window) -> StepResult:
        """A training step that steps its optimizers itself (``LightningOptimizer.step``)."""
        self._manual_steps = 0
        output = self.training_step(batch, batch_idx)
        loss = shown_manual_loss(output, self.module)
        return StepResult(output, self._kept(loss) if loss is not None else None, self._manual_steps)

    # ----------------------------------------------------------- forward, backward and step
    def forward_backward(
        self, batch: Any, batch_idx: int, *, divisor: float = 1, sync: bool = True, reset: bool = False
    ) -> tuple[Any, torch.Tensor | None]:
        """The forward and backward of one micro-batch, for every path: ``training_step``, then (``reset``: a
        window's first micro-batch in Lightning's order of hooks) the gradient reset, then the backward of the
        loss divided by ``divisor``. Gradients are synchronised across ranks only when ``sync``. Returns the
        step's output and its loss (None: the step skipped the batch)."""
        if not sync:  # this micro-batch's gradients stay on this rank; the window's last averages them all
            with self.strategy.no_sync(True):
                return self.forward_backward(batch, batch_idx, divisor=divisor, reset=reset)
        output = self.training_step(batch, batch_idx)
        # A plain tensor is taken as it is: what backward rejects in it (not one number, or no graph) is
        # explained once backward has failed, so that a sound step pays for no check.
        loss = output if type(output) is torch.Tensor else training_loss(output, self.module)
        if reset:
            self.zero_grad(batch_idx)
        if loss is None:
            if self.strategy.world_size > 1:
                # The other ranks' backward would wait for this one's gradients forever: refuse, as Lightning does.
                raise RuntimeError(
                    "Skipping the `training_step` by returning None in distributed training is not supported: "
                    f"{type(self.module).__name__}.training_step returned None on rank {self.strategy.global_rank} of "
                    f"{self.strategy.world_size}. Rewrite the training logic so that every rank returns a loss "
                    "(multiply it by 0 to make a batch count for nothing)"
                )
            return output, None
        try:
            # Dividing by the window's size makes k micro-batches of b the same as one batch of k*b.
            self._backward(loss / divisor if divisor != 1 else loss)
        except RuntimeError:
            training_loss(output, self.module)  # raises the clear error where the loss was the cause
            raise
        return output, loss

    def optimizer_step(self, optimizer: torch.optim.Optimizer, gradient_scale: float = 1.0, clip: bool = True) -> None:
        """The optimizer step of every path: the gradients multiplied by ``gradient_scale`` (a window that turned
        out shorter than its losses were divided for), unscaled where the hooks or clipping must see them,
        shown to the ``on_before_optimizer_step`` hooks, clipped (``clip``: the Trainer's flag or the module's
        ``configure_gradient_clipping``; under manual optimization the module clips), then stepped."""
        calls = self._calls
        if calls.commit is not None and not self._committed():
            return
        if self._prepares or gradient_scale != 1.0:
            self._prepare(optimizer, gradient_scale, clip)
        calls.optimizer_step(optimizer)

    def _committed(self) -> bool:
        """Fault tolerance's vote on the step under way, once its gradients are complete."""
        assert self._calls.commit is not None
        if self._calls.commit():
            return True
        self._dropped = True  # the replica groups did not all apply these gradients: neither does this one
        return False

    def _prepare(self, optimizer: torch.optim.Optimizer, gradient_scale: float, clip: bool) -> None:
        calls = self._calls
        if gradient_scale != 1.0:
            _scale_gradients(optimizer, gradient_scale)
        if calls.unscale is not None and (clip or self.before_step_hooks):
            calls.unscale(optimizer)
        for hook in self.before_step_hooks:
            hook(optimizer)
        if clip and self._clips:
            if self.hooks.configure_gradient_clipping is not None:
                self.hooks.configure_gradient_clipping(optimizer, self.clip_val, self.clip_algorithm)
            else:
                self.strategy.clip_gradients(optimizer, self.clip_val or 0.0, self.clip_algorithm or "norm")

    def step_optimizer(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        """``LightningOptimizer.step``. In the module's ``optimizer_step`` hook: the step that closes the window,
        after ``closure`` (its last micro-batch) has run, skipped when no micro-batch produced a loss. In a manual
        ``training_step``: a step counted in the batch's ``StepResult``. Returns what ``closure`` returns."""
        window = self._closing
        if window is None:
            self._manual_steps += 1
            return self._step_with(optimizer, closure, kwargs, 1.0, clip=False)
        if self.closure_steps:
            return self._step_with(optimizer, closure, kwargs, window.gradient_scale, clip=True)
        result = closure() if closure is not None else None
        if window.has_gradients:
            self._step_with(optimizer, None, kwargs, window.gradient_scale, clip=True)
        return result

    def _step_with(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None, kwargs: dict[str, Any],
        gradient_scale: float, clip: bool,
    ) -> Any:  # fmt: skip
        """``optimizer.step(closure, **kwargs)`` as Lightning's: the optimizer runs the closure (LBFGS, several
        times), and each run then prepares the step (``optimizer_step``'s unscaling, hooks and clipping)."""

        def closure_then_prepare() -> Any:
            result = closure() if closure is not None else None
            self._prepare(optimizer, gradient_scale, clip)
            return result

        if self._calls.commit is None:
            return self.strategy.optimizer_step(optimizer, closure_then_prepare, **kwargs)
        result = closure() if closure is not None else None  # the replica groups vote on complete gradients
        if self._committed():
            self._prepare(optimizer, gradient_scale, clip)
            self.strategy.optimizer_step(optimizer, **kwargs)
        return result

    def _close(self, window: Window, batch_idx: int, closure: _Closure | None = None) -> int:
        """The optimizer step that ends ``window``, through the module's ``optimizer_step`` where it overrides it
        (handing it ``closure``, the last micro-batch, to run), with what follows a step; returns the steps
        taken (0 when no micro-batch of the window produced a loss)."""
        optimizer, hook = self.optimizers[0], self.hooks.optimizer_step
        if hook is not None:
            self._closing = window
            try:
                hook(self.progress.epoch, batch_idx, self.lightning_optimizers[0], closure)
            finally:
                self._closing = None
            if closure is not None and not closure.ran:
                raise MisconfigurationException(
                    "The closure hasn't been executed. HINT: did you call `optimizer_closure()` in your "
                    f"`optimizer_step` hook? ({type(self.module).__name__}.optimizer_step() did not call the "
                    "optimizer_closure it received; call optimizer.step(closure=optimizer_closure), or "
                    "optimizer_closure() to run the step's training_step and backward without stepping)"
                )
        elif self.closure_steps and closure is not None:
            self._step_with(optimizer, closure, {}, window.gradient_scale, clip=True)
        else:
            if closure is not None:
                closure()
            if window.has_gradients:
                self.optimizer_step(optimizer, window.gradient_scale)
        if not window.has_gradients:
            return 0
        return self._after_step(optimizer)

    def _after_step(self, optimizer: torch.optim.Optimizer) -> int:
        """The gradient reset (unless the hooks reset them when the next window starts) and the schedulers that
        step per optimizer step, the step being counted as the next global step; returns the steps taken (0: fault
        tolerance dropped the step)."""
        if not self._hooked:
            clear_gradients(optimizer)
        if self._dropped:
            self._dropped = False
            self.dropped_steps += 1
            return 0
        if self.scheduler_configs:
            self.step_schedulers("step", self.progress.global_step + 1, watching=False)
            if self._watches_per_step:
                self.watched_step = self.progress.global_step + 1
        return 1

    def zero_grad(self, batch_idx: int) -> None:
        """Reset the gradients at the start of a window, through the hooks that are overridden."""
        optimizer = self.optimizers[0]
        for hook in self.hooks.before_zero_grad:
            hook(optimizer)
        if self.hooks.optimizer_zero_grad is not None:
            self.hooks.optimizer_zero_grad(self.progress.epoch, batch_idx, optimizer)
        else:
            clear_gradients(optimizer)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """The strategy's backward of ``loss``, between the hooks around it (and through the module's own
        ``backward`` where it overrides it); ``Module.manual_backward`` too, whose further arguments
        (``retain_graph=True``, ...) go to that ``backward``, as in Lightning."""
        hooks = self.hooks
        for hook in hooks.before_backward:
            hook(loss)
        backward = hooks.backward
        if args or kwargs:
            own = backward or torch.Tensor.backward
            backward = functools.partial(_backward_with, own, args, kwargs)
        self.strategy.backward(loss, backward)
        for hook in hooks.after_backward:
            hook()

    def step_schedulers(self, interval: Literal["step", "epoch"], count: int, watching: bool | None = None) -> None:
        """Step the schedulers of ``interval`` that are due at its ``count``-th occurrence: those that watch a
        metric (``watching=True``), those that do not (False), or both (None)."""
        for config in self.scheduler_configs:
            if config.interval != interval or count % config.frequency or watching not in (None, config.reads_metric):
                continue
            step = self.hooks.lr_scheduler_step or _step_scheduler
            if not config.reads_metric:
                step(config.scheduler, None)
            elif (value := monitored_value(config, self.metrics())) is not None:
                step(config.scheduler, value)

    def step_watching_schedulers(self) -> None:
        """Step the schedulers that watch a metric and are due at the optimizer step ``watched_step`` names."""
        if self.watched_step:
            step, self.watched_step = self.watched_step, 0
            self.step_schedulers("step", step, watching=True)

    # ------------------------------------------------------------------- batches split to fit
    def _split_forward_backward(self, batch: Any, batch_idx: int) -> tuple[Any, torch.Tensor | None]:
        """Forward and backward of ``batch`` in ``micro_batches`` pieces; twice as many after running out
        of memory, until the step fits. Returns the last piece's output and the whole batch's loss.

        Each piece's loss is weighted by its share of the batch, so the gradients are the whole batch's.
        With several processes the ranks first compute their pieces without communicating, then agree
        on whether any ran out of memory (all retry with the larger count), and only then average
        gradients: a rank that failed mid-step must never leave the others waiting in an all-reduce.
        """
        strategy = self.strategy
        total = batch_size_of(batch)
        if self._hooked:
            self.zero_grad(batch_idx)
        while True:
            try:
                output, loss = self._pieces(batch, batch_idx, total)
                out_of_memory = False
            except RuntimeError as error:  # torch.OutOfMemoryError, or a CPU allocator's RuntimeError
                if not is_out_of_memory(error):
                    raise
                output = loss = None
                out_of_memory = True
            if strategy.world_size > 1:
                out_of_memory = bool(strategy.reduce(torch.tensor(float(out_of_memory)), reduce_op="max"))
            if not out_of_memory:
                strategy.sync_gradients()
                return output, loss
            self._more_pieces(total, batch_idx)

    def _pieces(self, batch: Any, batch_idx: int, total: int) -> tuple[Any, torch.Tensor | None]:
        output: Any = None
        loss: torch.Tensor | None = None
        for piece in split_batch(batch, self.micro_batches):
            size = batch_size_of(piece)
            output, piece_loss = self.forward_backward(piece, batch_idx, divisor=total / size, sync=False)
            if piece_loss is not None:
                weighted = piece_loss.detach() * (size / total)
                loss = weighted if loss is None else loss + weighted
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

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of the runner: the pieces a batch is cut into ("auto")."""
        return {"micro_batches": self.micro_batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.micro_batches = state["micro_batches"]

    def _kept(self, loss: torch.Tensor | None) -> torch.Tensor | None:
        if loss is None:
            return None
        loss = loss.detach()
        return loss.clone() if self._copy_outputs else loss


class _Closure:
    """One micro-batch's ``forward_backward``: what Lightning's ``optimizer_step`` hook receives as
    ``optimizer_closure``. Returns the loss (None: the step skipped the batch)."""

    def __init__(self, runner: StepRunner, batch: Any, batch_idx: int, window: Window) -> None:
        self._runner = runner
        self._batch = batch
        self._batch_idx = batch_idx
        self._window = window
        self.ran = False
        self.output: Any = None
        self.loss: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor | None:
        runner, window, again = self._runner, self._window, self.ran
        if again and not runner.closure_steps:
            raise RuntimeError("optimizer_closure was called twice; each micro-batch runs its step once")
        self.ran = True
        # An optimizer that runs the closure again (LBFGS) asks for the loss and gradients afresh each time. One
        # whose step is decorated with torch.no_grad() (Hugging Face's AdamW) runs it there: the step needs a graph.
        with torch.enable_grad():
            self.output, loss = runner.forward_backward(
                self._batch, self._batch_idx, divisor=window.size, sync=window.closing, reset=window.seen == 1 or again
            )
        if loss is not None:
            window.has_gradients = True
            self.loss = runner._kept(loss)
        return self.loss


def _calling(step: Callable[..., Any], with_index: bool) -> Callable[[Any, int], Any]:
    if with_index:
        return step

    def without_index(batch: Any, batch_idx: int) -> Any:
        return step(batch)

    return without_index


def _backward_with(backward: Hook, args: tuple[Any, ...], kwargs: dict[str, Any], loss: torch.Tensor) -> None:
    backward(loss, *args, **kwargs)


def _step_scheduler(scheduler: Any, metric: Any | None) -> None:
    if metric is None:
        scheduler.step()
    else:
        scheduler.step(metric)


def _scale_gradients(optimizer: torch.optim.Optimizer, factor: float) -> None:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
