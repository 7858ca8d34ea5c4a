"""The loops: ``fit`` (epochs of training steps, with validation), ``evaluate`` and ``predict``.

Each reads top to bottom. Nothing here waits for the device per step: losses and logged values
stay on it, detached, and are read only when logs are written (every ``log_every_n_steps``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from ember._utils import batch_size_of, is_overridden, split_batch
from ember.data import count_batches, epoch_batches, with_last_flag
from ember.metrics import MetricStore, epoch_name, to_floats
from ember.module import Module
from ember.optim import parse_optimizers
from ember.seed import set_random_state

if TYPE_CHECKING:
    from ember.trainer import Trainer


# ================================================================================== fitting
def fit(trainer: Trainer, train_loader: Iterable, val_loaders: list[Iterable], ckpt_path: str | None,
        weights_only: bool) -> None:  # fmt: skip
    from ember.trainer import _ManualOptimizer

    module, strategy = trainer.module, trainer.strategy
    assert module is not None
    trainer.num_training_batches = count_batches(train_loader, trainer.limit_train_batches, "limit_train_batches")
    if trainer.num_training_batches == 0 and trainer.limit_train_batches != 0:
        raise ValueError("the train dataloader is empty: it has no batches to train on")
    val_counts = [count_batches(loader, trainer.limit_val_batches, "limit_val_batches") for loader in val_loaders]
    trainer.validation_enabled = sum(val_counts) > 0
    val_every = _validation_interval(trainer)

    if trainer.accumulate_grad_batches == "auto" and not strategy.averages_split_gradients:
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
    strategy.setup_optimizers(optimizers)
    trainer.optimizers, trainer.lr_scheduler_configs = optimizers, scheduler_configs
    trainer._manual_optimizers = [_ManualOptimizer(optimizer, trainer) for optimizer in optimizers]

    trainer.should_stop = trainer.preempted = False
    # The order of the training data follows from this seed (the same on every rank) and the epoch.
    trainer._data_seed = strategy.broadcast(torch.initial_seed() % 2**63)
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    if ckpt_path is not None:
        trainer._restore(ckpt_path, weights_only)  # may bring the gradients of an unfinished window
    hyperparameters = {**module.hparams, **(trainer.datamodule.hparams if trainer.datamodule else {})}
    if hyperparameters and trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_hyperparams(hyperparameters)

    trainer._call_hook("on_fit_start")
    if trainer.validation_enabled and trainer.num_sanity_val_steps:
        _sanity_check(trainer, val_loaders, val_counts)
    trainer._call_hook("on_train_start")
    trainer._stop_agreement = StopAgreement()
    with _preemption_signals(trainer):
        while trainer.num_training_batches and not _fit_done(trainer):
            _train_epoch(trainer, train_loader, val_loaders, val_counts, val_every)
    trainer._call_hook("on_train_end")
    trainer._call_hook("on_fit_end")


def _train_epoch(trainer: Trainer, loader: Iterable, val_loaders: list[Iterable], val_counts: list[float],
                 val_every: int | None) -> None:  # fmt: skip
    module, strategy = trainer.module, trainer.strategy
    assert module is not None
    epoch = trainer.current_epoch
    num_batches = trainer.num_training_batches
    # "auto": each batch is one step, run in as many micro-batches as memory needs (see _split_step).
    split = trainer.accumulate_grad_batches == "auto"
    accumulate = 1 if split else trainer.accumulate_grad_batches
    automatic = module.automatic_optimization
    first_batch = trainer._position[1] if trainer._position[0] == epoch else 0
    validate_this_epoch = trainer.validation_enabled and (
        trainer.check_val_every_n_epoch is None or (epoch + 1) % trainer.check_val_every_n_epoch == 0
    )
    known_length = not math.isinf(num_batches)
    last_index = num_batches - 1 if known_length else -1
    # The last window of an epoch may hold fewer micro-batches than `accumulate`: its losses are divided
    # by its own size. (Without a known length it is found by looking one batch ahead, see below.)
    last_window_start = num_batches - num_batches % accumulate if known_length else math.inf
    max_steps = trainer.max_steps if trainer.max_steps != -1 else math.inf
    # Hooks nobody overrides are not called at all: this loop runs per batch and must stay lean.
    batch_start_hooks = trainer._hooks("on_train_batch_start", include_module=False)
    batch_end_hooks = trainer._hooks("on_train_batch_end")
    before_step_hooks = trainer._hooks("on_before_optimizer_step")
    module_batch_start = module.on_train_batch_start if is_overridden("on_train_batch_start", module, Module) else None

    results = trainer._train_results
    results.clear()
    results.default_on_step = True
    trainer._results = results
    module.train()
    trainer._call_hook("on_train_epoch_start")

    batches = epoch_batches(loader, epoch, first_batch, trainer._data_seed, trainer.global_rank)
    if trainer._pending_random_state is not None:
        # A resumed run continues the random streams (dropout, ...) exactly where its predecessor stopped.
        set_random_state(trainer._pending_random_state)
        trainer._pending_random_state = None
    pairs = zip(batches, repeat(False)) if known_length else with_last_flag(batches)
    completed = first_batch >= num_batches
    window_has_grad = False
    trained_a_batch = False
    for batch_idx, (batch, is_last) in enumerate(pairs, first_batch):
        trained_a_batch = True
        is_last = is_last or batch_idx == last_index
        stepping = is_last or (batch_idx + 1) % accumulate == 0
        batch = strategy.batch_to_device(batch)
        results.batch = batch
        if module_batch_start is not None and module_batch_start(batch, batch_idx) == -1:
            completed = True  # the module skips the rest of this epoch
            break
        for hook in batch_start_hooks:
            hook(batch, batch_idx)

        if automatic and split:
            output, loss = _split_step(trainer, batch, batch_idx)
            trainer._stepped = loss is not None
            if trainer._stepped:
                _optimizer_step(trainer, before_step_hooks)
        elif automatic:
            # Micro-batches that do not step accumulate gradients locally; only the stepping one syncs.
            with strategy.no_sync(not stepping):
                output = strategy.step("training_step", batch, batch_idx)
                loss = _training_loss(output)
                if loss is not None:
                    # Dividing by the window size makes k micro-batches of b equal one batch of k*b.
                    window = accumulate if batch_idx < last_window_start else num_batches - last_window_start
                    strategy.backward(loss / window if window > 1 else loss)
                    window_has_grad = True
            trainer._stepped = stepping and window_has_grad
            if trainer._stepped:
                seen = batch_idx % accumulate + 1
                if not known_length and seen < accumulate:
                    _scale_gradients(trainer.optimizers[0], accumulate / seen)  # a short last window
                _optimizer_step(trainer, before_step_hooks)
                window_has_grad = False
        else:
            steps_before = trainer.global_step
            output = strategy.step("training_step", batch, batch_idx)
            loss = _manual_loss(output)
            trainer._stepped = trainer.global_step != steps_before

        if loss is not None:
            trainer._last_loss = loss = loss.detach()
            trainer._recent_losses.append((loss, epoch, batch_idx, trainer.global_step))
        trainer._position = (epoch, batch_idx + 1)
        trainer._total_train_batches += 1
        if batch_end_hooks:
            hook_output = _with_detached_loss(output, loss)
            for hook in batch_end_hooks:
                hook(hook_output, batch, batch_idx)
        if trainer.global_step >= trainer._next_log_step:
            _write_step_logs(trainer)
        if validate_this_epoch and _validation_due(trainer, val_every, batch_idx, is_last):
            _validate(trainer, val_loaders, val_counts, at_epoch_end=is_last)
        completed = is_last
        if is_last or trainer.should_stop or trainer.global_step >= max_steps:
            break
        if (trainer._stepped or not automatic) and _interrupted(trainer):  # at a step boundary
            if trainer.preempted:
                _save_for_preemption(trainer)
                return  # the process exits when fit returns: no end-of-epoch work for half an epoch
            break
    else:
        if not trained_a_batch and first_batch == 0:
            raise ValueError("the train dataloader yielded no batches")
        completed = True

    # ----- the end of the epoch
    check_losses(trainer)
    results.default_on_step = False  # values logged in epoch-end hooks are epoch values
    module.on_train_epoch_end()
    for callback in trainer.callbacks:
        if not callback.reads_epoch_metrics:
            callback.on_train_epoch_end(trainer, module)
    _publish_epoch_metrics(trainer, results)
    if completed:
        if automatic:
            _step_schedulers(trainer, "epoch")
        trainer._position = (epoch + 1, 0)
    for callback in trainer.callbacks:
        if callback.reads_epoch_metrics:
            callback.on_train_epoch_end(trainer, module)
    if completed:
        trainer.current_epoch = epoch + 1


def _optimizer_step(trainer: Trainer, before_step_hooks: list[Callable[..., Any]]) -> None:
    strategy, optimizer = trainer.strategy, trainer.optimizers[0]
    strategy.unscale_gradients(optimizer)  # clipping and the hooks must see the true gradients
    for hook in before_step_hooks:
        hook(optimizer)
    if trainer.gradient_clip_val:
        strategy.clip_gradients(optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
    strategy.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    trainer.global_step += 1
    if trainer.lr_scheduler_configs:
        _step_schedulers(trainer, "step")


def _split_step(trainer: Trainer, batch: Any, batch_idx: int) -> tuple[Any, torch.Tensor | None]:
    """Forward and backward of ``batch`` in ``trainer._micro_batches`` pieces; twice as many after running
    out of memory, until the step fits. Returns the last piece's output and the whole batch's loss.

    Each piece's loss is weighted by its share of the batch, so the gradients are the whole batch's.
    With several processes the ranks first compute their pieces without communicating, then agree on
    whether any ran out of memory (all retry with the larger count), and only then average gradients:
    a rank that failed mid-step must never leave the others waiting in a gradient all-reduce.
    """
    strategy = trainer.strategy
    total = batch_size_of(batch)
    while True:
        output: Any = None
        loss: torch.Tensor | None = None
        try:
            with strategy.no_sync(True):
                for piece in split_batch(batch, trainer._micro_batches):
                    output = strategy.step("training_step", piece, batch_idx)
                    piece_loss = _training_loss(output)
                    if piece_loss is not None:
                        weight = batch_size_of(piece) / total
                        strategy.backward(piece_loss * weight)
                        loss = piece_loss.detach() * weight + (0.0 if loss is None else loss)
            out_of_memory = False
        except torch.OutOfMemoryError:
            out_of_memory = True
        if trainer.world_size > 1:
            out_of_memory = bool(strategy.reduce(torch.tensor(float(out_of_memory)), "max"))
        if not out_of_memory:
            strategy.sync_gradients()
            return output, loss
        output = loss = None
        for optimizer in trainer.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if trainer._micro_batches >= total:
            raise torch.OutOfMemoryError(
                f"accumulate_grad_batches='auto': one sample at a time still runs out of memory (batch {batch_idx})"
            )
        trainer._micro_batches = min(total, 2 * trainer._micro_batches)
        strategy.release_memory()
        trainer.print(
            f"out of memory at batch {batch_idx}: retrying with {trainer._micro_batches} micro-batches of about "
            f"{math.ceil(total / trainer._micro_batches)} samples"
        )


def _step_schedulers(trainer: Trainer, interval: Literal["step", "epoch"]) -> None:
    count = trainer.global_step if interval == "step" else trainer.current_epoch + 1
    for config in trainer.lr_scheduler_configs:
        if config.interval != interval or count % config.frequency:
            continue
        if not config.reads_metric:
            config.scheduler.step()
            continue
        metrics = trainer.callback_metrics
        if config.monitor in metrics:
            config.scheduler.step(float(metrics[config.monitor]))
        elif config.strict:
            raise KeyError(
                f"the lr_scheduler monitors {config.monitor!r}, which was not logged; logged metrics are "
                f"{sorted(metrics)} (set 'strict': False in the scheduler dict to skip such steps)"
            )


def _scale_gradients(optimizer: torch.optim.Optimizer, factor: float) -> None:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def _training_loss(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (None skips the batch), or a clear error."""
    if output is None:
        return None
    loss = output if type(output) is torch.Tensor else output.get("loss") if isinstance(output, Mapping) else output
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
        raise ValueError(
            "training_step returned a loss that does not require grad: it was computed under "
            "torch.no_grad(), from detached tensors, or from a module whose parameters are all frozen"
        )
    return loss


def _manual_loss(output: Any) -> torch.Tensor | None:
    """Under manual optimization a returned loss is only shown and checked, so any scalar tensor will do."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _with_detached_loss(output: Any, loss: torch.Tensor | None) -> Any:
    """What batch-end hooks receive: the step's output with its loss detached from the graph."""
    if isinstance(output, torch.Tensor):
        return loss
    if isinstance(output, Mapping) and loss is not None:
        return {**output, "loss": loss}
    return output


# ========================================================================= stopping and logging
def _fit_done(trainer: Trainer) -> bool:
    return (
        trainer.should_stop
        or (trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps)
        or (trainer.max_epochs != -1 and trainer.current_epoch >= trainer.max_epochs)
    )


@dataclasses.dataclass
class StopAgreement:
    """When the ranks of a multi-process run next agree on stopping (see ``_interrupted``).

    An agreement is a collective that makes every rank wait for the slowest (and, on a GPU, a sync):
    made every 10 steps of a small model over gloo, it cost 5% of the time. So the ranks agree about
    every ``SECONDS``, after a number of steps they settle on at each agreement, from the slowest pace.
    """

    SECONDS: ClassVar[float] = 0.5
    MAX_STEPS: ClassVar[int] = 1000

    steps: int = 10  # between the last agreement and the next
    countdown: int = 10  # steps left before the next
    since: float = dataclasses.field(default_factory=time.monotonic)  # when the last one was made


def _interrupted(trainer: Trainer) -> bool:
    """Whether training must stop now for ``max_time`` or a preemption signal (then ``preempted`` is set).

    Every rank must stop at the same step, or the others would wait forever in their next
    collective; with several processes the ranks agree on it about every half second.
    """
    signal_received = trainer._signal_received is not None
    now = time.monotonic()
    out_of_time = now >= trainer._deadline
    if trainer.world_size > 1:
        agreement = trainer._stop_agreement
        agreement.countdown -= 1
        if agreement.countdown > 0:
            return False
        pace = (now - agreement.since) / agreement.steps
        proposal = min(StopAgreement.MAX_STEPS, max(1, int(StopAgreement.SECONDS / max(pace, 1e-9))))
        # The "max" of the negated proposals is the fewest steps any rank proposes.
        flags = trainer.strategy.reduce(torch.tensor([float(signal_received), float(out_of_time), -proposal]), "max")
        signal_flag, time_flag, fewest = flags.tolist()
        signal_received, out_of_time = signal_flag > 0, time_flag > 0
        agreement.steps = agreement.countdown = int(-fewest)
        agreement.since = now
    if signal_received:
        trainer.preempted = True
    trainer.should_stop = trainer.should_stop or signal_received or out_of_time
    return signal_received or out_of_time


@contextlib.contextmanager
def _preemption_signals(trainer: Trainer) -> Iterator[None]:
    """While training, SIGTERM (and SIGUSR1, SLURM's warning before preemption) ask for a checkpoint and a
    clean exit at the next step boundary instead of killing the process mid-step."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python handles signals in the main thread only
        return
    names = ["SIGTERM"] + (["SIGUSR1"] if "SLURM_JOB_ID" in os.environ else [])
    numbers = [getattr(signal, name) for name in names if hasattr(signal, name)]

    def remember(number: int, frame: object) -> None:
        trainer._signal_received = number

    previous = {number: signal.signal(number, remember) for number in numbers}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _save_for_preemption(trainer: Trainer) -> None:
    """Save where "last" finds it first, and ask SLURM to requeue the job when the Trainer was told to."""
    callback = trainer.checkpoint_callback
    directory = callback.dirpath if callback is not None and callback.dirpath else None
    directory = directory or os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")
    path = os.path.join(directory, "last.ckpt")
    trainer.save_checkpoint(path)
    trainer.strategy.barrier()
    trainer.print(f"preemption signal received: saved {path} at global step {trainer.global_step}")
    if trainer.slurm_requeue and trainer.is_global_zero and "SLURM_JOB_ID" in os.environ:
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)


def _write_step_logs(trainer: Trainer) -> None:
    every = trainer.log_every_n_steps
    trainer._next_log_step = (trainer.global_step // every + 1) * every
    check_losses(trainer)
    values = trainer._train_results.step_values(fresh_only=True, for_logger=True)
    trainer._log_to_loggers(values, trainer.global_step)


def check_losses(trainer: Trainer) -> None:
    """Raise if a loss since the last check was NaN or infinite, naming the step where it first was.

    The losses are kept on the device and read here, at logging and checkpointing time, so the check
    costs one synchronisation per log interval instead of one per step.
    """
    recent = trainer._recent_losses
    if not recent:
        return
    trainer._recent_losses = []
    try:
        losses = torch.stack([loss for loss, *_ in recent])
    except RuntimeError:  # mixed shapes, such as () and (1,)
        losses = torch.stack([loss.reshape(()) for loss, *_ in recent])
    finite = torch.isfinite(losses)
    if bool(finite.all()):
        return
    first = int((~finite).nonzero()[0])
    loss, epoch, batch_idx, step = recent[first]
    raise FloatingPointError(
        f"the training loss became {float(loss)} at epoch {epoch}, batch {batch_idx} (global step {step}). "
        "Common causes: a learning rate that is too high, no gradient clipping (gradient_clip_val), "
        "a log or division of zero, or float16 overflow (precision='bf16-mixed' has a wider range). "
        "Trainer(detect_anomaly=True) names the operation that produced it."
    )


def _publish_epoch_metrics(trainer: Trainer, results: MetricStore) -> dict[str, Any]:
    """Reduce the epoch's values, make them callback metrics, and write those meant for loggers."""
    for_loggers = {}
    published = {}
    for key, (value, entry) in results.epoch_values().items():
        name = epoch_name(key, entry)
        published[name] = value
        trainer._epoch_metrics[name] = value
        if name != key:
            trainer._epoch_metrics[key] = value  # "loss" holds the epoch value when both were logged
        if entry.prog_bar:
            trainer._prog_bar_epoch_metrics[name] = value
        if entry.to_logger:
            for_loggers[name] = value
    trainer._log_to_loggers(for_loggers, trainer.global_step)
    return published


# ================================================================================== validation
def _validation_interval(trainer: Trainer) -> int | None:
    """Training batches between validations (None: once, at the end of each epoch)."""
    interval, num_batches = trainer.val_check_interval, trainer.num_training_batches
    if isinstance(interval, float):
        if interval == 1.0:
            return None
        if math.isinf(num_batches):
            raise ValueError(
                f"val_check_interval={interval} is a fraction of an epoch, but the train dataloader has no "
                "length; pass a number of batches instead"
            )
        return max(1, int(num_batches * interval))
    if trainer.check_val_every_n_epoch is not None and interval > num_batches:
        raise ValueError(
            f"val_check_interval={interval} is more than the {num_batches} training batches of an epoch; "
            "lower it, or set check_val_every_n_epoch=None to count batches across epochs"
        )
    return interval


def _validation_due(trainer: Trainer, every: int | None, batch_idx: int, is_last: bool) -> bool:
    if every is None:
        return is_last
    if trainer.check_val_every_n_epoch is None:
        return trainer._total_train_batches % every == 0
    return (batch_idx + 1) % every == 0


def _validate(trainer: Trainer, loaders: list[Iterable], counts: list[float], at_epoch_end: bool) -> None:
    trainer._at_epoch_end = at_epoch_end
    _evaluation_loop(trainer, "validate", loaders, counts)
    trainer._at_epoch_end = False


def _sanity_check(trainer: Trainer, loaders: list[Iterable], counts: list[float]) -> None:
    """Run a few validation batches before training, so a broken validation_step fails in seconds."""
    limit = trainer.num_sanity_val_steps
    trainer.sanity_checking = True
    try:
        _evaluation_loop(
            trainer, "validate", loaders, [count if limit == -1 else min(count, limit) for count in counts]
        )
    finally:
        trainer.sanity_checking = False


def evaluate(trainer: Trainer, stage: Literal["validate", "test"], loaders: list[Iterable]) -> list[dict[str, float]]:
    limit, flag = (
        (trainer.limit_val_batches, "limit_val_batches")
        if stage == "validate"
        else (trainer.limit_test_batches, "limit_test_batches")
    )
    counts = [count_batches(loader, limit, flag) for loader in loaders]
    return _evaluation_loop(trainer, stage, loaders, counts)


def _evaluation_loop(trainer: Trainer, stage: Literal["validate", "test"], loaders: list[Iterable],
                     counts: list[float]) -> list[dict[str, float]]:  # fmt: skip
    module, strategy = trainer.module, trainer.strategy
    assert module is not None
    hook = "validation" if stage == "validate" else "test"
    results = trainer._eval_results
    results.clear()
    results.default_on_step = False
    previous_results, trainer._results = trainer._results, results
    trainer._eval_batch_counts = counts
    was_training = module.training
    module.eval()
    if stage == "validate":
        trainer._call_callbacks("on_validation_start")
    pass_index = len(loaders) > 1 and _takes_dataloader_idx(getattr(module, f"{hook}_step"))
    with torch.inference_mode() if trainer.inference_mode else torch.no_grad():
        trainer._call_hook(f"on_{hook}_epoch_start")
        for dataloader_idx, (loader, count) in enumerate(zip(loaders, counts)):
            results.name_suffix = f"/dataloader_idx_{dataloader_idx}" if len(loaders) > 1 else ""
            for batch_idx, batch in enumerate(_limited(loader, count)):
                batch = strategy.batch_to_device(batch)
                results.batch = batch
                args = (batch, batch_idx, dataloader_idx) if pass_index else (batch, batch_idx)
                output = strategy.step(f"{hook}_step", *args)
                trainer._call_callbacks(f"on_{hook}_batch_end", output, batch, batch_idx, dataloader_idx)
        results.name_suffix = ""
        trainer._call_hook(f"on_{hook}_epoch_end")
    if trainer.sanity_checking:
        results.clear()
        published = {}
    else:
        published = _publish_epoch_metrics(trainer, results)
    if stage == "validate":
        trainer._call_callbacks("on_validation_end")
    trainer._results = previous_results
    module.train(was_training)
    return _per_dataloader(to_floats(published), len(loaders))


def _per_dataloader(metrics: dict[str, float], count: int) -> list[dict[str, float]]:
    per_loader: list[dict[str, float]] = [{} for _ in range(count)]
    for name, value in metrics.items():
        _, marker, index = name.partition("/dataloader_idx_")
        for position, loader_metrics in enumerate(per_loader):
            if not marker or int(index) == position:
                loader_metrics[name] = value
    return per_loader


def _takes_dataloader_idx(step: Callable[..., Any]) -> bool:
    """Whether a step accepts a third argument: with several loaders it then receives their index."""
    parameters = inspect.signature(step).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def _limited(loader: Iterable, count: float) -> Iterator[Any]:
    return iter(loader) if math.isinf(count) else islice(loader, int(count))


# ================================================================================== prediction
def predict(trainer: Trainer, loaders: list[Iterable], return_predictions: bool) -> list[Any] | None:
    module, strategy = trainer.module, trainer.strategy
    assert module is not None
    counts = [count_batches(loader, trainer.limit_predict_batches, "limit_predict_batches") for loader in loaders]
    trainer._eval_batch_counts = counts
    several = len(loaders) > 1
    pass_index = several and _takes_dataloader_idx(module.predict_step)
    predictions: list[list[Any]] = []
    module.eval()
    with torch.inference_mode() if trainer.inference_mode else torch.no_grad():
        trainer._call_hook("on_predict_epoch_start")
        for dataloader_idx, (loader, count) in enumerate(zip(loaders, counts)):
            outputs = []
            for batch_idx, batch in enumerate(_limited(loader, count)):
                batch = strategy.batch_to_device(batch)
                args = (batch, batch_idx, dataloader_idx) if pass_index else (batch, batch_idx)
                output = strategy.step("predict_step", *args)
                trainer._call_callbacks("on_predict_batch_end", output, batch, batch_idx, dataloader_idx)
                if return_predictions:
                    outputs.append(output)
            predictions.append(outputs)
        trainer._call_hook("on_predict_epoch_end")
    if not return_predictions:
        return None
    return predictions if several else predictions[0]
