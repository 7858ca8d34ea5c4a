"""``FitLoop``: epochs of accumulation windows, with validation when it is due, until a limit or a stop.

An epoch is a sequence of windows: k micro-batches (``accumulate_grad_batches``), then one optimizer step, run
by the step runner, which says what each batch did for ``Progress.advance`` to count. Nothing here waits for the
device per step: losses and logged values stay on it, detached, until logs are written (``log_every_n_steps``).
Resuming is ``checkpoint.resume``'s; stopping early (a request, a deadline, a signal) ``loops.stopping``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember.callbacks.gradient_accumulation import epoch_accumulation
from ember.checkpoint.resume import LoopState
from ember.exceptions import PossibleUserWarning
from ember.loops.loss import LossCheck, batch_end_output
from ember.loops.progress import Progress
from ember.loops.step import StepResult, StepRunner, Window
from ember.loops.stopping import FitLimits, Stopping, limit_message, reached_limit
from ember.loops.training_data import TrainingData
from ember.optim import LightningOptimizer, configure_optimization, drop_gradients
from ember.rank_zero import announce, rank_zero_warn, rank_zero_warn_once
from ember.seed import random_state, set_random_state
from ember.trainer_parts import log_hyperparameters

if TYPE_CHECKING:
    from ember.trainer import Trainer


class _Outcome(enum.Enum):
    """How an epoch's batches ended."""

    EPOCH_DONE = enum.auto()  # the epoch's data is used up (or the module skipped the rest)
    DATA_ENDED = enum.auto()  # the loader yielded no batch and no limit on epochs would end the fit: it ends here
    STOP = enum.auto()  # stop in the middle of the epoch (should_stop, max_steps, a deadline)
    PREEMPTED = enum.auto()  # saved for a preemption signal: leave at once


#: How often the losses are checked (otherwise when logs are written) with ``log_every_n_steps=0``.
_LOSS_CHECK_STEPS = 50


@dataclasses.dataclass
class _Fit:
    """What one fit looks up once and reads per batch (the hooks nobody overrides cost nothing per batch)."""

    to_device: Callable[[Any], Any] | None  # None: batches are used as the loader makes them
    batch_start: Callable[[Any, int], bool] | None  # the on_train_batch_start hooks: True skips the rest of the epoch
    batch_end_hooks: list[Callable[..., Any]]
    manual: bool  # the module steps its optimizers itself
    loss_divisor: int  # what the batch-end hooks' loss is divided by: accumulate_grad_batches, as Lightning's
    max_steps: float  # math.inf: no limit
    next_log_step: int  # when the logged step values are written next
    told_of_idle_epoch: bool = False


class FitLoop(FitLimits):
    """Trains ``trainer.lightning_module``: ``run`` is one ``fit``."""

    def __init__(self, trainer: Trainer) -> None:
        # Per Trainer: they outlive a fit (``trainer.global_step`` after it, a fit that continues another).
        self.trainer = trainer
        self.state = LoopState()  # where the run is: checkpoints save it, resuming sets it
        self.stopping = Stopping()
        self.losses = LossCheck()
        self.accumulate: int | Literal["auto"] = trainer.config.accumulate_grad_batches  # the epoch's (a schedule's)
        # Per fit: set when a fit starts, read by callbacks and the Trainer's properties.
        self.data: TrainingData | None = None
        self.runner: StepRunner | None = None
        self.last_result: StepResult | None = None  # what the latest training batch did
        self.last_loss: torch.Tensor | None = None  # the latest training loss, detached (on the device)
        self.is_last_batch = False  # whether the training batch being run is the epoch's last
        self.at_epoch_end = False  # while a validation runs at the end of an epoch
        self.sanity_checking = False

    # ---------------------------------------------------------------------------------- a fit
    def prepare(self, load_train: Callable[[], list[Iterable]], train_given: bool) -> None:
        """Before a fit's ``setup`` (where ``estimated_stepping_batches`` may ask for the training loader): it trains
        on the loader ``load_train`` gives (``train_given``: the loaders passed to ``fit``)."""
        self.last_result, self.last_loss, self.accumulate = None, None, self.trainer.config.accumulate_grad_batches
        self.data = TrainingData(self.trainer, load_train, train_given)

    def run(self, load_validation: Callable[[], list[Iterable]] | None, restore: Callable[[], None] | None) -> None:
        """The fit ``prepare`` began, validating on what ``load_validation`` gives (None: no validation);
        ``restore`` puts a checkpoint's state in place once the optimizers exist."""
        trainer, progress, config, hooks = self.trainer, self.progress, self.trainer.config, self.trainer.hooks
        assert self.data is not None, "prepare() comes first"
        self.data.validate_on(load_validation)
        self.runner = self._start_optimization()
        self.state.start(data_seed=trainer.strategy.broadcast(torch.initial_seed() % 2**63))
        if restore is not None:
            restore()  # may bring the gradients of an unfinished window
        trainer.strategy.join_replica_groups(trainer)  # fault tolerance: a group that is behind heals, before data
        hooks.call("on_fit_start")
        log_hyperparameters(trainer)  # after on_fit_start, as in Lightning
        if reached_limit(config, progress) is None and self.data.validation.enabled and config.num_sanity_val_steps:
            self._sanity_check()
        self.data.load_before_training()
        hooks.call("on_train_start")
        self.stopping.start(trainer.world_size, trainer.callbacks)
        fit = self._look_up(self.runner)
        with self.stopping.interruptions.catching_signals():
            while not self.done:
                self.data.start_epoch(progress.epoch)
                if not self.data.num_batches or self._run_epoch(fit) in (_Outcome.PREEMPTED, _Outcome.DATA_ENDED):
                    break
            else:  # no break: a limit or a stop ended the fit; which limit is said, as Lightning says it
                if (limit := reached_limit(config, progress)) is not None:  # (or that there was nothing to train)
                    announce(limit_message(limit, progress, trained=self.last_result is not None))
        hooks.call("on_train_end")
        hooks.call("on_fit_end")

    @property
    def done(self) -> bool:
        """Whether ``fit`` has nothing left to train: a limit is reached, or a stop was asked for that may happen."""
        limit = reached_limit(self.trainer.config, self.progress)
        return limit is not None or self.stopping.stop_allowed(self.trainer)

    def _start_optimization(self) -> StepRunner:
        """The optimizers of ``configure_optimizers``, set up by the strategy, in the step runner of this fit."""
        trainer = self.trainer
        config, strategy, module, hooks = trainer.config, trainer.strategy, trainer.lightning_module, trainer.hooks
        assert module is not None
        result, own_step = hooks.call_module("configure_optimizers"), hooks.module_hook("lr_scheduler_step")
        optimizers, scheduler_configs = configure_optimization(result, module.automatic_optimization, own_step)
        strategy.setup_optimizers(optimizers)
        for optimizer in optimizers:  # no gradient from before the fit reaches its first step
            drop_gradients(optimizer)
        return StepRunner(
            strategy, module, optimizers, scheduler_configs, self.progress, accumulate=config.accumulate_grad_batches,
            clip_val=config.gradient_clip_val, clip_algorithm=config.gradient_clip_algorithm,
            before_step_hooks=hooks.implementations("on_before_optimizer_step"),
            metrics=functools.partial(getattr, trainer, "callback_metrics"), hooks=hooks.step_hooks(),  # pickles
        )  # fmt: skip

    def _look_up(self, runner: StepRunner) -> _Fit:
        trainer, config, hooks = self.trainer, self.trainer.config, self.trainer.hooks
        return _Fit(
            to_device=hooks.batch_transfer(trainer.strategy),
            batch_start=hooks.train_batch_start(),
            batch_end_hooks=hooks.implementations("on_train_batch_end"),
            manual=not runner.module.automatic_optimization,
            loss_divisor=1,  # set as each epoch starts
            max_steps=config.max_steps if config.max_steps != -1 else math.inf,
            next_log_step=config.log_every_n_steps or _LOSS_CHECK_STEPS,
        )

    # ---------------------------------------------------------------------------------- an epoch
    def _run_epoch(self, fit: _Fit) -> _Outcome:
        hooks, self.stopping.inside_epoch = self.trainer.hooks, False  # (a fit that goes on in a stopped epoch)
        self.accumulate = accumulate = self.accumulation_of(self.progress.epoch)
        fit.loss_divisor = accumulate if isinstance(accumulate, int) else 1
        # The module's (and each submodule's) mode is the user's: validation restores it, nothing else sets it.
        hooks.call("on_train_epoch_start")
        outcome = _Outcome.EPOCH_DONE  # as Lightning: a stop asked for by then (if it may happen) trains no batch
        if not self.stopping.stop_allowed(self.trainer):
            # Closed early, the batches end the loader's workers. The steps and the hooks of each batch log per step.
            with contextlib.closing(self._epoch_batches()) as batches, hooks.scope("training_step"):
                outcome = self._train_batches(batches, fit)
        if outcome is not _Outcome.PREEMPTED:  # the process exits: no end-of-epoch work for half an epoch
            self._end_epoch(fit, completed=outcome in (_Outcome.EPOCH_DONE, _Outcome.DATA_ENDED))
        self.stopping.inside_epoch = outcome is _Outcome.STOP  # (a preempted epoch resumes: it is not done)
        return outcome

    def _epoch_batches(self) -> Generator[tuple[int, Any, bool], None, None]:
        assert self.data is not None
        batches = self.data.batches(self.trainer, self.progress, self.state.data_seed)
        if (random_state := self.state.take_random_state()) is not None:
            # A resumed run continues the random streams (dropout, ...) exactly where its predecessor stopped.
            set_random_state(random_state)
        return batches

    def _train_batches(self, batches: Generator[tuple[int, Any, bool], None, None], fit: _Fit) -> _Outcome:
        """Run the epoch's batches, an optimizer step closing each accumulation window. The per-batch path, as short
        as a hand-written loop's: what it needs is looked up once per fit, hooks nobody overrides are not called, what
        is rarely due (writing logs, validating, stopping) costs a comparison when it is not, and the common case
        (each batch a window of its own) runs in one call of the step runner."""
        progress, runner, data, stopping = self.progress, self.runner, self.data, self.stopping
        assert runner is not None and data is not None
        store, to_device, ends = self.trainer.run_metrics.train, fit.to_device, fit.batch_end_hooks
        losses, positions = self.losses.losses, self.losses.positions
        window, batch_start = self._first_window(), fit.batch_start
        validation = data.validation if data.validation.selects(progress.epoch) else None
        samples_per_batch = data.samples_per_batch
        for batch_idx, batch, is_last in batches:
            self.is_last_batch = is_last
            if to_device is not None:
                batch = to_device(batch)
            store.batch = batch
            if batch_start is not None and batch_start(batch, batch_idx):
                return _Outcome.EPOCH_DONE  # the module skips the rest of this epoch
            if window is None:  # each batch a window of its own: the common case, in one call
                result = runner.step(batch, batch_idx)
            else:
                result = runner.micro_step(batch, batch_idx, window, is_last)
            # Only the epoch's last batch may read fewer samples than a whole batch (the order's end is padded).
            progress.advance(result, samples_per_batch if samples_per_batch and not is_last
                             else data.samples_of(batch, progress))  # fmt: skip
            self.last_result = result
            if result.loss is not None:
                self.last_loss = result.loss
                losses.append(result.loss)
                positions += batch_idx, progress.global_step
            if ends:
                hook_output = batch_end_output(result.output, result.loss, fit.loss_divisor)
                for hook in ends:
                    hook(hook_output, batch, batch_idx)
            # Logs are written every log_every_n_steps, and at each optimizer step once stopping is asked (Lightning's)
            if (progress.total_batches if fit.manual else progress.global_step) >= fit.next_log_step \
                    or (stopping.requested and result.closes_window):  # fmt: skip
                self._write_step_logs(fit)
            validated = validation is not None and validation.due(progress, batch_idx, is_last)
            if validated or runner.watched_step:
                self._validate_and_schedule(runner, validated, is_last, result.closes_window)
            due = result.closes_window and stopping.interruptions.due()  # once per step boundary: it counts
            if (due or stopping.requested or progress.global_step >= fit.max_steps) \
                    and (outcome := self._stop(due, fit, validated)) is not None:  # fmt: skip
                # Signals and the deadline are seen at an epoch's last batch too (epochs of one batch), which ends it.
                return _Outcome.EPOCH_DONE if is_last and outcome is _Outcome.STOP else outcome
            if is_last:
                return _Outcome.EPOCH_DONE
        return self._loader_ended(window)

    def _first_window(self) -> Window | None:
        """The epoch's first accumulation window; None when each batch is a window of its own (one runner call)."""
        progress, data, accumulate = self.progress, self.data, self.accumulate
        if not isinstance(accumulate, int) or accumulate == 1 or data is None:
            return None
        left = data.num_batches - progress.epoch_batches + progress.window_batches  # from the window's start
        return Window(accumulate, left, done=progress.window_batches)

    def _loader_ended(self, window: Window | None) -> _Outcome:
        """The end of an epoch whose loader yielded no batch, or fewer than its length announced."""
        if self.progress.epoch_batches == 0:
            return self._empty_epoch()
        if window is not None and window.has_gradients and (runner := self.runner) is not None:
            self.progress.advance(runner.close_window(window), 0)  # with what was accumulated
            runner.step_watching_schedulers()
        return _Outcome.EPOCH_DONE

    def _empty_epoch(self) -> _Outcome:
        """An epoch whose loader yielded no batch counts, untrained (as Lightning); with no epoch limit, fit ends."""
        ends, epoch = self.trainer.config.epoch_limit == -1, self.progress.epoch
        then = "fit ends there, as no limit on epochs would end it" if ends else "the epoch trains nothing"
        rank_zero_warn(f"the train dataloader yielded no batches in epoch {epoch}: {then}", PossibleUserWarning)
        return _Outcome.DATA_ENDED if ends else _Outcome.EPOCH_DONE

    def _stop(self, interruptions_due: bool, fit: _Fit, validated: bool) -> _Outcome | None:
        """Whether training stops after this batch: a stop asked for (``should_stop``) that may happen, ``max_steps``
        reached, or ``interruptions_due`` (a step boundary: signals and the deadline checked by a collective)."""
        trainer, stopping, progress, data = self.trainer, self.stopping, self.progress, self.data
        asked = stopping.stop_allowed(trainer)
        if not asked and progress.global_step >= fit.max_steps:
            return _Outcome.STOP
        if not asked and not (interruptions_due and stopping.interrupted(trainer.strategy)):
            return None
        if stopping.preempted:
            stopping.save_for_preemption(trainer)
            return _Outcome.PREEMPTED
        # As in Lightning, a stop asked for (or a deadline) validates first, unless this batch just did.
        assert data is not None and self.last_result is not None
        if data.validation.selects(progress.epoch) and not validated:
            self._validate(at_epoch_end=False, after_step=self.last_result.closes_window)
        return _Outcome.STOP

    def _end_epoch(self, fit: _Fit, completed: bool) -> None:
        trainer, progress, runner = self.trainer, self.progress, self.runner
        metrics, hooks, module = trainer.run_metrics, trainer.hooks, trainer.lightning_module
        assert module is not None and runner is not None
        self.check_losses()
        self._report_idle_epoch(fit)
        metrics.reduce_epoch(metrics.train, final=False)  # as Lightning, the epoch's end hooks read its values
        hooks.call("on_train_epoch_end", epoch_readers=False)
        metrics.publish_epoch(metrics.train, self.logging_step, progress.epoch)
        if completed:
            if module.automatic_optimization:
                runner.step_schedulers("epoch", progress.epoch + 1)
            progress.finish_epoch()  # a checkpoint saved from here on resumes at the next epoch
        # Callbacks that act on epoch metrics (checkpointing, early stopping) see this epoch's, published.
        hooks.call("on_train_epoch_end", include_module=False, epoch_readers=True)
        if completed:
            progress.start_next_epoch()

    def _report_idle_epoch(self, fit: _Fit) -> None:
        """Say once when an epoch trained nothing: every training_step skipped its batch."""
        batches = self.progress.epoch_batches
        if fit.told_of_idle_epoch or not batches or self.progress.epoch_steps or fit.manual:
            return
        fit.told_of_idle_epoch = True
        message = f"epoch {self.progress.epoch} ended without an optimizer step: training_step returned None "
        rank_zero_warn_once(message + f"for each of its {batches} batches, so nothing was trained", stacklevel=5)

    # --------------------------------------------------------------------------- validation
    def _validate(self, at_epoch_end: bool, after_step: bool) -> None:
        assert self.data is not None
        if after_step:  # as Lightning: the gradients of a finished step go (not those of a window under way)
            self.trainer.hooks.call_module("on_validation_model_zero_grad")
        self.at_epoch_end = at_epoch_end
        self.data.validation.run(self.trainer.validate_loop)
        self.at_epoch_end = False

    def _validate_and_schedule(self, runner: StepRunner, validated: bool, at_epoch_end: bool, after_step: bool) -> None:
        """The batch's validation where it is due, then (as in Lightning) the schedulers that may watch its metrics."""
        if validated:
            self._validate(at_epoch_end, after_step)
        runner.step_watching_schedulers()

    def _sanity_check(self) -> None:
        """Run a few validation batches before training, so a broken validation_step fails in seconds; as in
        Lightning, the random generators are as if it had not run."""
        assert self.data is not None
        self.sanity_checking, generators = True, random_state()
        try:
            self.data.validation.sanity_check(self.trainer.validate_loop)
        finally:
            set_random_state(generators)
            self.sanity_checking = False

    # ------------------------------------------------------------------------------- logging
    def _write_step_logs(self, fit: _Fit) -> None:
        every, step = self.trainer.config.log_every_n_steps, self.logging_step
        interval = every or _LOSS_CHECK_STEPS
        fit.next_log_step = (step // interval + 1) * interval
        self.check_losses()
        if every:  # 0: the steps' values are never written (the epochs' are)
            self.trainer.run_metrics.write_step_values(step, self.progress.epoch)

    def check_losses(self) -> None:
        """Raise if a training loss since the last check was NaN or infinite (see ``LossCheck``)."""
        self.losses.check(self.progress.epoch)

    # ------------------------------------------------------------------ what others read
    @property
    def progress(self) -> Progress:
        return self.state.progress

    @property
    def current_epoch(self) -> int:
        """The epoch being trained, or the next once a stop ended the fit inside it (checkpoints resume inside it)."""
        return self.progress.epoch + self.stopping.inside_epoch

    @property
    def stepped(self) -> bool:
        """Whether the latest training batch ended with an optimizer step."""
        return self.last_result is not None and self.last_result.stepped

    @property
    def train_loader(self) -> Iterable | None:
        return self.data.loader if self.data is not None else None

    @property
    def num_training_batches(self) -> float:
        return self.data.num_batches if self.data is not None else math.inf  # inf before fit, as Lightning's

    @property
    def validation_enabled(self) -> bool:
        return self.data is not None and self.data.validation.enabled

    @property
    def logging_step(self) -> int:
        """What ``log_every_n_steps`` counts and logged values are labelled with: optimizer steps, or under
        manual optimization training batches (one per batch, however many optimizers it steps)."""
        manual = self.runner is not None and not self.runner.module.automatic_optimization
        return self.progress.total_batches if manual else self.progress.global_step

    def accumulation_of(self, epoch: int) -> int | Literal["auto"]:
        """The ``accumulate_grad_batches`` of ``epoch``: the flag's, or a ``GradientAccumulationScheduler``'s."""
        return epoch_accumulation(self.trainer.callbacks, self.trainer.config.accumulate_grad_batches, epoch)

    def batches_this_epoch(self) -> float:
        """The training batches the current epoch will have run when it ends: the loader's, or fewer when
        ``max_steps`` ends training inside it (known only where steps follow batches: automatic optimization)."""
        config, progress, runner = self.trainer.config, self.progress, self.runner
        if config.max_steps == -1 or runner is None or not runner.module.automatic_optimization:
            return self.num_training_batches
        window = self.accumulate if isinstance(self.accumulate, int) else 1
        start = progress.epoch_batches - progress.window_batches  # where the unfinished window began
        return min(self.num_training_batches, start + (config.max_steps - progress.global_step) * window)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.runner.optimizers if self.runner is not None else []

    @property
    def lightning_optimizers(self) -> list[LightningOptimizer]:
        return self.runner.lightning_optimizers if self.runner is not None else []

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``Module.manual_backward``: the backward of the step runner, with its hooks."""
        if self.runner is None:
            raise RuntimeError("manual_backward() is available during fit only")
        self.runner.backward(loss, *args, **kwargs)
