"""``FitLoop``: epochs of accumulation windows, with validation when it is due.

An epoch is a sequence of windows; a window is k micro-batches (``accumulate_grad_batches``) and then
one optimizer step. Nothing here waits for the device per step: losses and logged values stay on it,
detached, and are read only when logs are written (every ``log_every_n_steps``).
"""

from __future__ import annotations

import contextlib
import enum
import math
import os
import signal
import subprocess
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ember._utils import batch_size_of
from ember.data import (
    batches_from,
    count_batches,
    data_replicas,
    dataset_length,
    epoch_batches,
    loader_state,
    named_failures,
    numbered_batches,
    order_reads,
    restore_loader_state,
    with_last_flag,
)
from ember.loops.evaluate import EvaluationLoop
from ember.loops.progress import Progress
from ember.loops.step import ManualOptimizer, StepRunner
from ember.loops.stopping import Interruptions
from ember.optim import parse_optimizers
from ember.rank_zero import rank_zero_warn_once
from ember.seed import random_state, set_random_state

if TYPE_CHECKING:
    from ember.trainer import Trainer


class _Outcome(enum.Enum):
    """How a window of training ended."""

    CONTINUE = enum.auto()  # on to the next window
    EPOCH_DONE = enum.auto()  # the epoch's data is used up (or the module skipped the rest)
    STOP = enum.auto()  # stop in the middle of the epoch (should_stop, max_steps, max_time)
    PREEMPTED = enum.auto()  # saved for a preemption signal: leave at once


class Window:
    """The accumulation window being run: ``size`` micro-batches, the losses of each divided by it, then one
    optimizer step. One record serves the whole epoch: ``next()`` starts the following window.

    The epoch's last window may be shorter. When the loader's length is unknown that is found out only at
    its end: the gradients are then rescaled by ``gradient_scale`` before the step.
    """

    def __init__(self, length: int, batches_left: float, done: int = 0) -> None:
        self._length = length  # accumulate_grad_batches (1 under manual optimization or "auto")
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


class FitLoop:
    """Trains: owns where the run is (``progress``) and everything else ``fit`` keeps between steps."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.progress = Progress()
        #: Set by callbacks (EarlyStopping, ...) to end training after the current step or epoch.
        self.should_stop = False
        #: True once a signal (SIGTERM, Ctrl-C, SLURM's SIGUSR1) made ``fit`` save a checkpoint and stop.
        self.preempted = False
        #: The number of that signal.
        self.stop_signal: int | None = None
        #: Whether the latest training batch ended with an optimizer step.
        self.stepped = False
        #: True while a validation runs at the end of an epoch (False in the middle of one).
        self.at_epoch_end = False
        #: Whether the training batch being run is the epoch's last (``trainer.is_last_batch``).
        self.is_last_batch = False
        self.sanity_checking = False
        self.validation_enabled = False
        self.num_training_batches: float = 0
        self.train_loader: Iterable | None = None
        self.runner: StepRunner | None = None
        #: The order of the training data follows from this seed (the same on every rank) and the epoch.
        self.data_seed = 0
        #: The latest training loss, detached (on the device).
        self.last_loss: torch.Tensor | None = None
        self.interruptions = Interruptions()
        # The training losses since the last finiteness check, kept on the device, and where each was: its
        # batch_idx and global step, in pairs in one flat list (a tuple per loss, kept until the check, costs
        # measurably more). Every check comes before the epoch ends: all are of this epoch.
        self._recent_losses: list[torch.Tensor] = []
        self._recent_positions: list[int] = []
        self._next_log_step = 0
        self._pending_random_state: dict[str, Any] | None = None  # restored when a resumed run starts
        self._validation = _ValidationSchedule(None, 0, [], [])
        # The per-batch hooks, found once per run: hooks nobody overrides cost nothing per batch.
        self._batch_start_hooks: list[Callable[..., Any]] = []
        self._batch_end_hooks: list[Callable[..., Any]] = []
        self._module_batch_start: Callable[..., Any] | None = None
        self._to_device: Callable[[Any], Any] | None = None  # None: batches are used as the loader makes them
        self._replicas = 1  # the ranks that read disjoint shards of the training data
        self._order: tuple[int, int] | None = None  # what order_reads says of the training loader
        # Flags read per batch, looked up once per run.
        self._split = False  # accumulate_grad_batches="auto"
        self._max_steps: float = math.inf
        self._reported_idle = False
        self._reload: Callable[[], tuple[Iterable, list[Iterable]]] | None = None
        self._loaded_at_epoch = 0  # the epoch whose start asked for the loaders last
        self._told_about_minimum = False
        self._manual = False  # whether the module steps its optimizers itself

    @property
    def logging_step(self) -> int:
        """What ``log_every_n_steps`` counts and logged values are labelled with: optimizer steps, or under
        manual optimization training batches (one per batch, however many optimizers it steps)."""
        return self.progress.total_batches if self._manual else self.progress.global_step

    def batches_this_epoch(self) -> float:
        """The training batches the current epoch will have run when it ends: the loader's, or fewer when
        ``max_steps`` ends training inside it (known only where steps follow batches: automatic optimization)."""
        config, progress = self.trainer.config, self.progress
        window = self._window_length()
        if config.max_steps == -1 or window is None:
            return self.num_training_batches
        start = progress.epoch_batches - progress.window_batches  # where the unfinished window began
        return min(self.num_training_batches, start + (config.max_steps - progress.global_step) * window)

    def _window_length(self) -> int | None:
        """Batches per optimizer step: ``accumulate_grad_batches`` (1 for "auto", which splits each batch
        instead); None under manual optimization, where the module steps when it chooses."""
        module, accumulate = self.trainer.lightning_module, self.trainer.config.accumulate_grad_batches
        if module is None or not module.automatic_optimization:
            return None
        return accumulate if isinstance(accumulate, int) else 1

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.runner.optimizers if self.runner is not None else []

    @property
    def manual_optimizers(self) -> list[ManualOptimizer]:
        if self.runner is None:
            raise RuntimeError("optimizers() is available during fit only")
        return self.runner.manual_optimizers

    # ------------------------------------------------------------------------------------ run
    def run(
        self,
        train_loader: Iterable,
        val_loaders: list[Iterable],
        restore: Callable[[], None] | None,
        reload: Callable[[], tuple[Iterable, list[Iterable]]] | None = None,
    ) -> None:
        """Train on ``train_loader``, validating on ``val_loaders``; ``restore`` puts a checkpoint's state in
        place once the optimizers exist; ``reload`` asks for new loaders (``reload_dataloaders_every_n_epochs``)."""
        trainer = self.trainer
        config, hooks = trainer.config, trainer.hooks
        self._reload = reload
        self._set_up(train_loader, val_loaders)
        if restore is not None:
            restore()  # may bring the gradients of an unfinished window
        self._log_hyperparameters()
        hooks.call("on_fit_start")
        if self._validation.enabled and config.num_sanity_val_steps:
            self._sanity_check()
        hooks.call("on_train_start")
        self._loaded_at_epoch = self.progress.epoch
        with self.interruptions.catching_signals():
            while not self.done():
                self._reload_loaders_when_due()
                if not self.num_training_batches:
                    break
                self._run_epoch()
        hooks.call("on_train_end")
        hooks.call("on_fit_end")

    def _set_loaders(self, train_loader: Iterable, val_loaders: list[Iterable]) -> None:
        trainer = self.trainer
        config = trainer.config
        self.train_loader = train_loader
        self._replicas = data_replicas(train_loader)
        self._order = order_reads(train_loader)
        self.num_training_batches = count_batches(train_loader, config.limit_train_batches, "limit_train_batches")
        if self.num_training_batches == 0 and config.limit_train_batches != 0:
            raise ValueError("the train dataloader is empty: it has no batches to train on")
        self._validation = _ValidationSchedule.build(trainer, self.num_training_batches, val_loaders)
        self.validation_enabled = self._validation.enabled

    def _reload_loaders_when_due(self) -> None:
        every = self.trainer.config.reload_dataloaders_every_n_epochs
        if every and self._reload is not None and self.progress.epoch - self._loaded_at_epoch >= every:
            self._set_loaders(*self._reload())
            self._loaded_at_epoch = self.progress.epoch

    def _set_up(self, train_loader: Iterable, val_loaders: list[Iterable]) -> None:
        trainer = self.trainer
        config, strategy, module = trainer.config, trainer.strategy, trainer.lightning_module
        assert module is not None
        self._set_loaders(train_loader, val_loaders)
        if config.accumulate_grad_batches == "auto" and not strategy.averages_split_gradients:
            raise ValueError(
                f"accumulate_grad_batches='auto' needs a strategy that can average gradients after splitting a "
                f"batch; strategy {strategy.name!r} with {trainer.world_size} processes cannot (use 'ddp', or a count)"
            )
        optimizers, scheduler_configs = parse_optimizers(module.configure_optimizers())
        if module.automatic_optimization and len(optimizers) != 1:
            raise ValueError(
                f"configure_optimizers() returned {len(optimizers)} optimizers; automatic optimization steps "
                "exactly one. For several (GANs, ...), set self.automatic_optimization = False and step them "
                "in training_step with self.optimizers() and self.manual_backward(loss)"
            )
        self._manual = not module.automatic_optimization
        if self._manual:
            _check_manual_flags(config.accumulate_grad_batches, config.gradient_clip_val)
        strategy.setup_optimizers(optimizers)
        hooks = trainer.hooks
        self.runner = StepRunner(
            strategy, module, optimizers, scheduler_configs, self.progress,
            clip_val=config.gradient_clip_val, clip_algorithm=config.gradient_clip_algorithm,
            before_step_hooks=hooks.implementations("on_before_optimizer_step"),
            metrics=lambda: trainer.callback_metrics, hooks=hooks.step_hooks(),
        )  # fmt: skip
        self._to_device = hooks.batch_transfer(strategy)
        self._batch_start_hooks = hooks.implementations("on_train_batch_start", include_module=False)
        self._batch_end_hooks = hooks.implementations("on_train_batch_end")
        self._module_batch_start = hooks.module_hook("on_train_batch_start")
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.should_stop = self.preempted = self._told_about_minimum = False
        self.stop_signal = None
        self.data_seed = strategy.broadcast(torch.initial_seed() % 2**63)
        self._next_log_step = config.log_every_n_steps
        self._split = config.accumulate_grad_batches == "auto"
        self._max_steps = config.max_steps if config.max_steps != -1 else math.inf
        self.interruptions.reset(config.max_time_seconds, strategy.world_size)

    def _log_hyperparameters(self) -> None:
        trainer = self.trainer
        module, datamodule = trainer.lightning_module, trainer.datamodule
        assert module is not None
        if not trainer.config.enable_autolog_hparams:
            return
        hyperparameters = {**module.hparams_for_logger, **(datamodule.hparams_for_logger if datamodule else {})}
        if hyperparameters and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_hyperparams(hyperparameters)

    def done(self) -> bool:
        config, progress = self.trainer.config, self.progress
        return (
            (self.should_stop and self._may_stop())
            or (config.max_steps != -1 and progress.global_step >= config.max_steps)
            or (config.epoch_limit != -1 and progress.epoch >= config.epoch_limit)
        )

    def _may_stop(self) -> bool:
        """Whether a request to stop (``should_stop``) may be followed: ``min_epochs`` and ``min_steps`` are done."""
        config, progress = self.trainer.config, self.progress
        if (config.min_epochs or 0) <= progress.epoch and (config.min_steps or 0) <= progress.global_step:
            return True
        if not self._told_about_minimum:
            self._told_about_minimum = True
            self.trainer.print(
                f"stopping was requested, but min_epochs={config.min_epochs} or min_steps={config.min_steps} "
                "is not reached yet: training goes on"
            )
        return False

    # ---------------------------------------------------------------------------------- epochs
    def _run_epoch(self) -> None:
        trainer = self.trainer
        module, metrics = trainer.lightning_module, trainer.run_metrics
        assert module is not None
        store = metrics.train
        store.clear()
        store.default_on_step = True
        metrics.active = store
        # The module's (and each submodule's) mode is the user's: validation restores it, nothing else sets it.
        trainer.hooks.call("on_train_epoch_start")
        with contextlib.closing(self._epoch_batches()) as batches:  # closed early, it ends the loader's workers
            outcome = self._train_batches(batches)
        if outcome is not _Outcome.PREEMPTED:  # the process exits: no end-of-epoch work for half an epoch
            self._end_epoch(completed=outcome is _Outcome.EPOCH_DONE)

    def _epoch_batches(self) -> Generator[tuple[int, Any, bool], None, None]:
        """``(batch_idx, batch, is_last)`` for the rest of this epoch's training batches."""
        trainer, progress = self.trainer, self.progress
        assert self.train_loader is not None
        first = progress.epoch_batches
        batches = epoch_batches(
            self.train_loader, progress.epoch, first, self.data_seed, trainer.global_rank,
            start_sample=progress.epoch_samples,
        )  # fmt: skip
        loader_batches = trainer.profiler.timed_batches(batches, "train")
        if self._pending_random_state is not None:
            # A resumed run continues the random streams (dropout, ...) exactly where its predecessor stopped.
            set_random_state(self._pending_random_state)
            self._pending_random_state = None
        where = f"the train dataloader in epoch {progress.epoch}"
        if math.isinf(self.num_training_batches):
            # Without a length, the last batch is found by looking one batch ahead.
            flagged = with_last_flag(named_failures(loader_batches, where, first))
            return ((index, batch, is_last) for index, (batch, is_last) in enumerate(flagged, first))
        return numbered_batches(loader_batches, where, first, int(self.num_training_batches) - 1)

    def _train_batches(self, batches: Iterator[tuple[int, Any, bool]]) -> _Outcome:
        """Run the epoch's batches, an optimizer step closing each accumulation window.

        This is the per-batch path, kept as short as a hand-written loop's: what it needs is looked up once
        per epoch, hooks nobody overrides are not called, what is rarely due (writing logs, validating,
        stopping) costs a comparison when it is not, and the common case (each batch a window of its own)
        runs in one call of the step runner."""
        progress, runner = self.progress, self.runner
        assert runner is not None
        losses, positions = self._recent_losses, self._recent_positions
        window = self._first_window()
        store, to_device = self.trainer.run_metrics.train, self._to_device
        has_start_hooks = self._module_batch_start is not None or bool(self._batch_start_hooks)
        ends = self._batch_end_hooks
        validation = self._validation if self._validation.selects(progress.epoch) else None
        # The samples of the epoch's order that a batch of every rank reads together (0: count each batch's)
        samples_per_batch = self._order[0] if self._order is not None else 0
        for batch_idx, batch, is_last in batches:
            self.is_last_batch = is_last
            if to_device is not None:
                batch = to_device(batch)
            store.batch = batch
            if has_start_hooks and self._start_batch(batch, batch_idx):
                return _Outcome.EPOCH_DONE  # the module skips the rest of this epoch
            # Only the epoch's last batch may read fewer samples than a whole batch (the order's end is padded).
            samples = samples_per_batch if samples_per_batch and not is_last else self._samples_of(batch)
            if window is None:  # each batch a window of its own: the common case, in one call
                output, loss = runner.single_step(batch, batch_idx)
                self.stepped, closing = loss is not None, True
            else:
                output, loss, closing = self._train_micro_batch(batch, batch_idx, is_last, samples, window)
            progress.total_batches += 1
            progress.epoch_batches += 1
            progress.epoch_samples += samples
            if loss is not None:
                self.last_loss = loss
                losses.append(loss)
                positions += batch_idx, progress.global_step
            if ends:  # with the step's loss detached
                hook_output = loss if type(output) is torch.Tensor else _with_detached_loss(output, loss)
                for hook in ends:
                    hook(hook_output, batch, batch_idx)
            # Logs are written every log_every_n_steps, and at each step once stopping is asked for (as Lightning);
            # the step they count is ``logging_step``'s.
            logging_step = progress.total_batches if self._manual else progress.global_step
            if logging_step >= self._next_log_step or self.should_stop:
                self._write_step_logs()
            if validation is not None and validation.due(progress, batch_idx, is_last):
                self._validate(at_epoch_end=is_last, after_step=closing)
            if is_last:
                return _Outcome.EPOCH_DONE
            due = closing and self.interruptions.due()  # once per step boundary: it counts them
            stopping = due or self.should_stop or progress.global_step >= self._max_steps
            if stopping and (outcome := self._stop(due)) is not _Outcome.CONTINUE:
                return outcome
        return self._loader_ended(window)

    def _loader_ended(self, window: Window | None) -> _Outcome:
        """The end of an epoch whose loader ran out before a batch flagged as its last: it yielded no batch, or
        fewer than its length announced."""
        if self.progress.epoch_batches == 0:
            raise ValueError("the train dataloader yielded no batches")
        if window is not None and window.has_gradients:
            assert self.runner is not None
            self.runner.optimizer_step(window.gradient_scale)  # with what was accumulated
        return _Outcome.EPOCH_DONE

    def _first_window(self) -> Window | None:
        """The epoch's first accumulation window; None when every batch is a window of its own (automatic
        optimization without accumulation nor splitting) and the step runner runs each in one call."""
        length, progress = self._window_length(), self.progress
        if length == 1 and not self._split:
            return None
        left = self.num_training_batches - progress.epoch_batches + progress.window_batches  # from the window's start
        return Window(length or 1, left, done=progress.window_batches)

    def _train_micro_batch(
        self, batch: Any, batch_idx: int, is_last: bool, samples: int, window: Window
    ) -> tuple[Any, torch.Tensor | None, bool]:
        """One micro-batch of ``window`` (``is_last``: the epoch's last batch), counted in the window's position;
        returns its output, its loss and whether it closed the window."""
        window.add(is_last)
        output, loss = self._train_batch(batch, batch_idx, window)
        closing = window.closing
        self.progress.track_window(samples, closing)
        if closing:
            window.next()
        return output, loss, closing

    def _train_batch(self, batch: Any, batch_idx: int, window: Window) -> tuple[Any, torch.Tensor | None]:
        runner = self.runner
        assert runner is not None
        if self._manual:
            steps_before = self.progress.global_step
            output, loss = runner.manual_step(batch, batch_idx)
            self.stepped = self.progress.global_step != steps_before
            return output, loss
        if self._split:
            output, loss = runner.split_forward_backward(batch, batch_idx)
        elif runner.hooked:  # the module or a callback overrides a hook of the step: Lightning's order
            had_gradients = window.has_gradients
            output, loss = runner.hooked_micro_batch(
                batch, batch_idx, window.size, first=window.seen == 1, closing=window.closing,
                had_gradients=had_gradients, gradient_scale=lambda: window.gradient_scale,
            )  # fmt: skip
            window.has_gradients = had_gradients or loss is not None
            self.stepped = window.closing and window.has_gradients
            return output, loss
        else:
            # Micro-batches that do not close the window accumulate gradients locally; only the last syncs.
            output, loss = runner.forward_backward(batch, batch_idx, window.size, sync=window.closing)
        window.has_gradients = window.has_gradients or loss is not None
        self.stepped = window.closing and window.has_gradients
        if self.stepped:
            runner.optimizer_step(window.gradient_scale)
        return output, loss

    def _start_batch(self, batch: Any, batch_idx: int) -> bool:
        """Call the batch-start hooks; True when the module's asks to skip the rest of the epoch."""
        if self._module_batch_start is not None and self._module_batch_start(batch, batch_idx) == -1:
            return True
        for hook in self._batch_start_hooks:
            hook(batch, batch_idx)
        return False

    def _samples_of(self, batch: Any) -> int:
        """The samples of the epoch's global order that this batch and those of the other ranks read: counted
        from the loader when it reads an ``EpochOrder`` (a batch's first tensor may not be batch-first)."""
        if self._order is None:
            return batch_size_of(batch) * self._replicas
        per_batch, length = self._order
        return max(0, min(per_batch, length - self.progress.epoch_samples))  # the order's end is padded

    def _stop(self, interruptions_due: bool) -> _Outcome:
        """Whether training stops after this batch, when it may: stopping was asked for (``should_stop``),
        ``max_steps`` is reached, or ``interruptions_due`` (a step boundary where the signals and the deadline
        are checked: with several processes, a collective that every rank reaches at the same batch)."""
        if (self.should_stop and self._may_stop()) or self.progress.global_step >= self._max_steps:
            return _Outcome.STOP
        if interruptions_due and self._interrupted():
            if self.preempted:
                self._save_for_preemption()
                return _Outcome.PREEMPTED
            return _Outcome.STOP
        return _Outcome.CONTINUE

    def _end_epoch(self, completed: bool) -> None:
        trainer, progress = self.trainer, self.progress
        module, metrics = trainer.lightning_module, trainer.run_metrics
        assert module is not None and self.runner is not None
        self.check_losses()
        self._report_idle_epoch()
        metrics.train.default_on_step = False  # values logged in epoch-end hooks are epoch values
        module.on_train_epoch_end()
        for callback in trainer.callbacks:
            if not callback.reads_epoch_metrics:
                callback.on_train_epoch_end(trainer, module)
        metrics.publish_epoch(metrics.train, self.logging_step, progress.epoch)
        if completed:
            if module.automatic_optimization:
                self.runner.step_schedulers("epoch", progress.epoch + 1)
            progress.epoch_finished = True  # a checkpoint saved from here on resumes at the next epoch
        for callback in trainer.callbacks:
            if callback.reads_epoch_metrics:
                callback.on_train_epoch_end(trainer, module)
        if completed:
            progress.start_next_epoch()

    def _report_idle_epoch(self) -> None:
        """Say once when an epoch trained nothing: every training_step skipped its batch."""
        module, batches = self.trainer.lightning_module, self.progress.epoch_batches
        if self._reported_idle or not batches or self.progress.epoch_steps or module is None:
            return
        if module.automatic_optimization:
            self._reported_idle = True
            rank_zero_warn_once(
                f"epoch {self.progress.epoch} ended without an optimizer step: training_step returned None "
                f"for each of its {batches} batches, so nothing was trained",
                stacklevel=4,
            )

    # --------------------------------------------------------------------------- validation
    def _validate(self, at_epoch_end: bool, after_step: bool) -> None:
        if after_step:  # as Lightning: the gradients of a finished step go (not those of a window under way)
            module = self.trainer.lightning_module
            assert module is not None
            module.on_validation_model_zero_grad()
        self.at_epoch_end = at_epoch_end
        self._validation.run(self.trainer.validate_loop)
        self.at_epoch_end = False

    def _sanity_check(self) -> None:
        """Run a few validation batches before training, so a broken validation_step fails in seconds."""
        trainer = self.trainer
        limit = trainer.config.num_sanity_val_steps
        self.sanity_checking = True
        try:
            trainer.hooks.call_callbacks("on_sanity_check_start")
            counts = [count if limit == -1 else min(count, limit) for count in self._validation.counts]
            trainer.validate_loop.run(self._validation.loaders, counts, sanity_check=True)
            trainer.hooks.call_callbacks("on_sanity_check_end")
        finally:
            self.sanity_checking = False

    def manual_backward(self, loss: torch.Tensor) -> None:
        """``Module.manual_backward``: the backward of the step runner, with its hooks."""
        if self.runner is None:
            raise RuntimeError("manual_backward() is available during fit only")
        self.runner.backward(loss)

    # ------------------------------------------------------------------- stopping and logging
    def _interrupted(self) -> bool:
        """Whether training must stop now for ``max_time`` or a signal (then ``stop_signal`` is set); every
        rank gets the same answer, at the same step."""
        stop, signal_number = self.interruptions.check(self.trainer.strategy)
        if signal_number is not None:
            self.preempted, self.stop_signal = True, signal_number
        self.should_stop = self.should_stop or stop
        return stop

    def _save_for_preemption(self) -> None:
        """Save where "last" finds it first, and ask SLURM to requeue the job when the Trainer was told to.

        The save needs no more data: the loader's workers may be gone (a launcher signals them too)."""
        trainer = self.trainer
        path = trainer.preemption_checkpoint_path()
        trainer.save_checkpoint(path)
        trainer.strategy.wait_for_checkpoints()  # the process exits next: the line below must be true
        trainer.strategy.barrier()
        name = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal"
        trainer.print(
            f"preemption signal received: saved {path} at global step {self.progress.global_step} ({name}); "
            'resume with Trainer.fit(..., ckpt_path="last")'
        )
        if trainer.config.slurm_requeue and trainer.is_global_zero and "SLURM_JOB_ID" in os.environ:
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)

    def _write_step_logs(self) -> None:
        every = self.trainer.config.log_every_n_steps
        step = self.logging_step
        self._next_log_step = (step // every + 1) * every
        self.check_losses()
        self.trainer.run_metrics.write_step_values(step, self.progress.epoch)

    def check_losses(self) -> None:
        """Raise if a loss since the last check was NaN or infinite, naming the step where it first was.

        The losses are kept on the device and read here, at logging and checkpointing time, so the check
        costs one synchronisation per log interval instead of one per step.
        """
        losses, positions = self._recent_losses, self._recent_positions
        if not losses:
            return
        try:
            stacked = torch.stack(losses)
        except RuntimeError:  # mixed shapes, such as () and (1,)
            stacked = torch.stack([loss.reshape(()) for loss in losses])
        values = (stacked if stacked.dim() == 1 else stacked.reshape(-1)).tolist()  # one read of the device
        where_each = positions.copy()
        losses.clear()  # in place: the training loop holds these lists
        positions.clear()
        if math.isfinite(sum(values)):  # the common case, in one pass (a sum that overflows is looked at below)
            return
        first = next((index for index, value in enumerate(values) if not math.isfinite(value)), None)
        if first is None:
            return
        batch_idx, step = where_each[2 * first], where_each[2 * first + 1]
        where = f"epoch {self.progress.epoch}, batch {batch_idx} (global step {step})"
        raise FloatingPointError(
            f"the training loss became {values[first]} at {where}. "
            "Common causes: a learning rate that is too high, no gradient clipping (gradient_clip_val), "
            "a log or division of zero, or float16 overflow (precision='bf16-mixed' has a wider range). "
            "Trainer(detect_anomaly=True) names the operation that produced it."
        )

    # ---------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this loop, the same on every rank."""
        return {
            "progress": self.progress.state_dict(),
            "micro_batches": self.runner.micro_batches if self.runner is not None else 1,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.progress.load_state_dict(state["progress"])
        if self.runner is not None:
            self.runner.micro_batches = state["micro_batches"]

    def data_state(self) -> dict[str, Any]:
        """What the saved position in the epoch is relative to: the data seed and the data's layout."""
        loader = self.train_loader
        accumulate = self.trainer.config.accumulate_grad_batches
        accumulate = accumulate if isinstance(accumulate, int) else 1
        batches = self.num_training_batches  # limit_train_batches and drop_last counted
        return {
            "seed": self.data_seed,
            "global_seed": os.environ.get("EMBER_GLOBAL_SEED"),  # set by seed_everything
            "dataset_length": dataset_length(loader) if loader is not None else None,
            "batch_size": getattr(loader, "batch_size", None),
            "replicas": self._replicas,
            "accumulate": accumulate,
            "steps_per_epoch": None if math.isinf(batches) else math.ceil(batches / accumulate),
        }

    def resume_data(self, saved: dict[str, Any], path: str) -> bool:
        """Continue the epoch where a checkpoint's data section ``saved`` says, with this run's data and
        layout; returns whether those are the checkpoint's own (then a stateful loader's position and the
        gradients of an unfinished accumulation window still apply)."""
        now = self.data_state()
        new_seed = _changes(saved, now, ("global_seed",))
        if not new_seed:
            self.data_seed = saved["seed"]  # else the new seed, once accepted, orders the data from now on
        changed = _changes(saved, now, ("dataset_length",)) + new_seed
        if changed:
            self._accept_data_change(changed, path)
            return False
        layout = _changes(saved, now, ("batch_size", "replicas", "accumulate"))
        if not layout:
            return True
        self._continue_with_new_layout(saved, now, layout)
        return False

    def _accept_data_change(self, changed: list[str], path: str) -> None:
        what = ", ".join(changed)
        if not self.trainer.config.restart_on_data_change:
            raise ValueError(
                f"ckpt_path={path!r} was saved with other data than this run's ({what}), so its position in "
                f"epoch {self.progress.epoch} would mean something else now; pass "
                "Trainer(restart_on_data_change=True) to resume anyway, starting that epoch over"
            )
        if self.progress.epoch_batches and not self.progress.epoch_finished:
            rank_zero_warn_once(f"the data changed ({what}): epoch {self.progress.epoch} starts over", stacklevel=5)
        self.progress.restart_epoch()

    def _continue_with_new_layout(self, saved: dict[str, Any], now: dict[str, Any], layout: list[str]) -> None:
        progress, loader = self.progress, self.train_loader
        assert loader is not None
        if progress.window_batches:  # its gradients were summed for another window: that window runs again
            progress.drop_unfinished_window()
        left = batches_from(loader, progress.epoch_samples)
        if left is not None:
            # The rest is numbered as the epoch's last batches in the new layout: the resumed epoch ends (and
            # validates) where an epoch of the new layout ends, whatever batch the position falls in.
            progress.epoch_batches = (batches_from(loader, 0) or 0) - left
            self.trainer.print(
                f"resuming with {', '.join(layout)}: epoch {progress.epoch} continues at sample "
                f"{progress.epoch_samples} of its order"
            )
        elif progress.epoch_batches:
            rank_zero_warn_once(
                f"resuming with {', '.join(layout)}: the train dataloader cannot continue at a sample (it does not "
                f"read a map-style dataset in order or shuffled), so epoch {progress.epoch} starts over",
                stacklevel=5,
            )
            progress.restart_epoch()
        before, after = saved.get("steps_per_epoch"), now["steps_per_epoch"]
        schedulers = self.runner is not None and self.runner.scheduler_configs
        if schedulers and None not in (before, after) and before != after:
            rank_zero_warn_once(
                f"an epoch is now {after} optimizer steps instead of {before}: learning-rate schedulers continue by "
                f"optimizer step (from global step {progress.global_step}), so a schedule planned in epochs no "
                "longer ends with an epoch",
                stacklevel=5,
            )

    def rank_state(self) -> dict[str, Any]:
        """What differs per rank: the random generators, a stateful loader's position, and the gradients
        of an unfinished accumulation window."""
        loader = self.train_loader
        return {
            "random_state": random_state(),
            "loader_state": loader_state(loader) if loader is not None else None,
            "accumulated_gradients": self._unfinished_window_gradients(),
        }

    def load_rank_state(self, state: dict[str, Any], same_setup: bool = True) -> None:
        """Put back what ``rank_state`` saved; a stateful loader's position and the unfinished window's
        gradients only with ``same_setup`` (else the window runs again, or the epoch starts over)."""
        self._pending_random_state = state["random_state"]  # applied when training resumes
        if not same_setup:
            return
        if self.train_loader is not None:
            restore_loader_state(self.train_loader, state["loader_state"])
        _restore_gradients(self.trainer.lightning_module, state["accumulated_gradients"])

    def _unfinished_window_gradients(self) -> list[torch.Tensor | None] | None:
        """The gradients accumulated so far in an accumulation window that has not stepped yet.

        After each optimizer step gradients are set to None, so gradients at a batch boundary belong to
        micro-batches whose step is still to come; a resumed run must start from them.
        """
        module = self.trainer.lightning_module
        if module is None or not module.automatic_optimization:
            return None
        # A sharded parameter's gradient is a DTensor: each rank keeps its own shard (rank-local, like the rest).
        gradients = [_local(parameter.grad) for parameter in module.parameters()]
        return gradients if any(gradient is not None for gradient in gradients) else None


class _ValidationSchedule:
    """When ``fit`` validates: every ``every`` training batches, or at the end of each epoch (``every`` is
    None), in the epochs ``check_val_every_n_epoch`` selects."""

    def __init__(self, every: int | None, every_n_epochs: int | None, loaders: list[Iterable],
                 counts: list[float]) -> None:  # fmt: skip
        self.every = every
        self.every_n_epochs = every_n_epochs
        self.loaders = loaders
        self.counts = counts
        self.enabled = sum(counts) > 0

    @classmethod
    def build(cls, trainer: Trainer, num_batches: float, loaders: list[Iterable]) -> _ValidationSchedule:
        config = trainer.config
        interval, per_epoch = config.val_check_interval, config.check_val_every_n_epoch
        every: int | None
        if isinstance(interval, float):
            every = None if interval == 1.0 else _fraction_of_epoch(interval, num_batches)
        else:
            if per_epoch is not None and interval > num_batches:
                raise ValueError(
                    f"val_check_interval={interval} is more than the {num_batches} training batches of an epoch; "
                    "lower it, or set check_val_every_n_epoch=None to count batches across epochs"
                )
            every = interval
        return cls(every, per_epoch, loaders, trainer.validate_loop.count(loaders))

    def selects(self, epoch: int) -> bool:
        """Whether to validate at all in ``epoch`` (counted from 0)."""
        return self.enabled and (self.every_n_epochs is None or (epoch + 1) % self.every_n_epochs == 0)

    def due(self, progress: Progress, batch_idx: int, is_last: bool) -> bool:
        """Whether to validate after training batch ``batch_idx`` (``is_last``: the epoch's last) of an epoch
        that it ``selects``."""
        if self.every is None:
            return is_last
        if self.every_n_epochs is None:
            return progress.total_batches % self.every == 0
        return (batch_idx + 1) % self.every == 0

    def run(self, loop: EvaluationLoop) -> None:
        loop.run(self.loaders, self.counts)


def _check_manual_flags(accumulate: int | str, clip_val: float | None) -> None:
    """Under manual optimization the module steps and clips itself: the Trainer's flags for that would be ignored."""
    if accumulate != 1:
        raise ValueError(
            f"accumulate_grad_batches={accumulate!r} with manual optimization (automatic_optimization = False): "
            "the module steps its optimizers itself; accumulate in training_step, or leave the flag at 1"
        )
    if clip_val:
        raise ValueError(
            f"gradient_clip_val={clip_val!r} with manual optimization (automatic_optimization = False): clip in "
            "training_step with self.clip_gradients(optimizer, ...) before stepping, or leave the flag unset"
        )


def _fraction_of_epoch(fraction: float, num_batches: float) -> int:
    if math.isinf(num_batches):
        raise ValueError(
            f"val_check_interval={fraction} is a fraction of an epoch, but the train dataloader has no "
            "length; pass a number of batches instead"
        )
    return max(1, int(num_batches * fraction))


def _changes(saved: dict[str, Any], now: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    """``"name old -> new"`` for each of ``names`` that both know and that differ."""
    return [
        f"{name.replace('_', ' ')} {saved[name]} -> {now[name]}"
        for name in names
        if saved.get(name) is not None and now.get(name) is not None and saved[name] != now[name]
    ]


def _with_detached_loss(output: Any, loss: torch.Tensor | None) -> Any:
    """What batch-end hooks receive: the step's output with its loss detached from the graph."""
    if isinstance(output, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and loss is not None:
        return {**output, "loss": loss}
    return output


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _restore_gradients(module: torch.nn.Module | None, gradients: list[torch.Tensor | None] | None) -> None:
    if gradients is None or module is None:
        return
    for parameter, gradient in zip(module.parameters(), gradients, strict=True):
        if gradient is not None and hasattr(parameter, "device_mesh"):  # a shard of a DTensor gradient
            from torch.distributed.tensor import DTensor

            mesh, placements = parameter.device_mesh, getattr(parameter, "placements")  # noqa: B009 (a DTensor's)
            gradient = DTensor.from_local(gradient.to(parameter.device), mesh, placements)
        parameter.grad = None if gradient is None else gradient.to(parameter.device)
