"""When training stops before its planned end: a request (``trainer.should_stop``, from ``EarlyStopping`` and the
like), a deadline (``max_time``, a ``Timer``), and the signals that ask for a checkpoint and an exit (SIGTERM from a
scheduler or launcher, SLURM's SIGUSR1, Ctrl-C). Every rank must stop at the same step, so with several processes
the ranks agree on it. A preemption signal's checkpoint (and SLURM's requeue) is saved here too; a loss that is
no longer finite is ``loops.loss``'s."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ember.callbacks import Callback, Timer
from ember.rank_zero import announce

if TYPE_CHECKING:
    from ember.config import TrainerConfig
    from ember.loops.progress import Progress
    from ember.strategies import Strategy
    from ember.trainer import Trainer


@dataclasses.dataclass
class StopAgreement:
    """When the ranks of a multi-process run next agree on stopping.

    An agreement is a collective that makes every rank wait for the slowest (and, on a GPU, a sync):
    made every 10 steps of a small model over gloo, it cost 5% of the time. So the ranks agree about
    every ``SECONDS``, after a number of steps they settle on at each agreement, from the slowest pace.
    """

    SECONDS: ClassVar[float] = 0.5
    MAX_STEPS: ClassVar[int] = 1000

    steps: int = 10  # between the last agreement and the next
    countdown: int = 10  # steps left before the next
    since: float = dataclasses.field(default_factory=time.monotonic)  # when the last one was made


class Interruptions:
    """The stops that come from outside the loop's plan: a deadline and preemption signals."""

    def __init__(self) -> None:
        #: ``time.monotonic()`` past which training stops (the earliest ``Timer``'s, ``max_time`` being one).
        self.deadline = math.inf
        self.signal_received: int | None = None
        self._world_size = 1
        self._agreement = StopAgreement()

    def reset(self, deadline: float = math.inf, world_size: int = 1) -> None:
        self.deadline = deadline
        self.signal_received = None
        self._world_size = world_size
        self._agreement = StopAgreement()

    def due(self) -> bool:
        """Whether ``check`` must run at this step boundary (call once at each): alone, when a signal came or
        the deadline passed; with several processes, when the steps until the ranks' next agreement are done."""
        if self._world_size == 1:
            return self.signal_received is not None or time.monotonic() >= self.deadline
        self._agreement.countdown -= 1
        return self._agreement.countdown <= 0

    def check(self, strategy: Strategy) -> tuple[bool, int | None]:
        """``(stop now, the signal that asked for it or None)``, the same on every rank; call when ``due``.

        With several processes the ranks agree (a collective), and settle when to agree next: about every
        half second. A signal that reached some ranks only stops them all.
        """
        signal_number = self.signal_received or 0
        now = time.monotonic()
        out_of_time = now >= self.deadline
        if strategy.world_size > 1:
            agreement = self._agreement
            pace = (now - agreement.since) / agreement.steps
            proposal = min(StopAgreement.MAX_STEPS, max(1, int(StopAgreement.SECONDS / max(pace, 1e-9))))
            # The "max" of the negated proposals is the fewest steps any rank proposes.
            local = torch.tensor([float(signal_number), float(out_of_time), -proposal])
            flags = strategy.reduce(local, reduce_op="max")
            signal_flag, time_flag, fewest = flags.tolist()
            signal_number, out_of_time = int(signal_flag), time_flag > 0
            agreement.steps = agreement.countdown = int(-fewest)
            agreement.since = now
        return bool(signal_number) or out_of_time, signal_number or None

    @contextlib.contextmanager
    def catching_signals(self) -> Iterator[None]:
        """While training, SIGTERM, Ctrl-C (SIGINT) and, under SLURM, SIGUSR1 (its warning before preemption)
        ask for a checkpoint and an exit at the next step boundary instead of killing the process mid-step.
        A second Ctrl-C stops at once, without saving (under a launcher, which passes each Ctrl-C on to its
        workers, stopping at once is left to the launcher)."""
        if threading.current_thread() is not threading.main_thread():
            yield  # Python handles signals in the main thread only
            return
        names = ["SIGTERM", "SIGINT"] + (["SIGUSR1"] if "SLURM_JOB_ID" in os.environ else [])
        numbers = [getattr(signal, name) for name in names if hasattr(signal, name)]
        escalate = "TORCHELASTIC_RUN_ID" not in os.environ

        def remember(number: int, frame: object) -> None:
            self.signal_received = number
            if number == signal.SIGINT and escalate:
                signal.signal(signal.SIGINT, signal.default_int_handler)

        previous = {number: signal.signal(number, remember) for number in numbers}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)


class Stopping:
    """Why ``fit`` stops before its limits, one record per Trainer: ``requested`` (``trainer.should_stop``), honoured
    once ``min_epochs`` and ``min_steps`` are done; the deadline and the signals (``interruptions``); and
    ``stop_signal``, the signal that made the run save a checkpoint and stop."""

    def __init__(self) -> None:
        #: Set through ``trainer.should_stop`` (EarlyStopping, ...) to end training after the current step or epoch.
        self.requested = False
        #: The signal that made ``fit`` save a checkpoint and stop (None: none did), and where it saved.
        self.stop_signal: int | None = None
        self.saved_at: str | None = None
        #: Whether the latest fit stopped inside an epoch (as in Lightning, that epoch then counts as done).
        self.inside_epoch = False
        self.interruptions = Interruptions()
        self._told_about_minimum = False

    @property
    def preempted(self) -> bool:
        return self.stop_signal is not None

    def start(self, world_size: int, callbacks: Sequence[Callback]) -> None:
        """A fit's training starts: no signal yet, and no request unless a ``Timer`` is already spent; its
        deadline is the earliest ``Timer``'s (the ``Timer`` callbacks start their clocks in ``on_train_start``,
        which has run)."""
        timers = [callback for callback in callbacks if isinstance(callback, Timer)]
        self.requested = any(timer.spent for timer in timers)
        self._told_about_minimum = False
        self.stop_signal = self.saved_at = None
        deadlines = [timer.deadline for timer in timers]
        self.interruptions.reset(min(deadlines, default=math.inf), world_size)

    def stop_allowed(self, trainer: Trainer) -> bool:
        """Whether a stop was asked for (``should_stop``) and may happen: ``min_epochs`` and ``min_steps`` are done
        (said once if not)."""
        if not self.requested:
            return False
        config, progress = trainer.config, trainer.fit_loop.progress
        if (config.min_epochs or 0) <= progress.epoch and (config.min_steps or 0) <= progress.global_step:
            return True
        if not self._told_about_minimum:
            self._told_about_minimum = True
            announce(  # Lightning's words
                f"Trainer was signaled to stop but the required `min_epochs={config.min_epochs}` or "
                f"`min_steps={config.min_steps}` has not been met. Training will continue..."
            )
        return False

    def interrupted(self, strategy: Strategy) -> bool:
        """Whether training must stop now for the deadline or a signal (then ``stop_signal`` is set); every rank
        gets the same answer, at the same step. Call at a step boundary where ``interruptions.due()``."""
        stop, signal_number = self.interruptions.check(strategy)
        if signal_number is not None:
            self.stop_signal = signal_number
        self.requested = self.requested or stop
        return stop

    def save_for_preemption(self, trainer: Trainer) -> None:
        """Save where "last" finds it first, and ask SLURM to requeue the job when the Trainer was told to.

        The save needs no more data: the loader's workers may be gone (a launcher signals them too)."""
        self.saved_at = trainer.preemption_checkpoint_path()
        trainer.save_checkpoint(self.saved_at)
        trainer.strategy.wait_for_checkpoints()  # the process exits soon: the report must be true
        trainer.strategy.barrier()
        if trainer.config.slurm_requeue and trainer.is_global_zero and "SLURM_JOB_ID" in os.environ:
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)

    def report(self, global_step: int) -> str:
        """What a preemption saved and how to continue, in lines that fit 80 columns (but for a long path)."""
        name = signal.Signals(self.stop_signal).name if self.stop_signal else "a signal"
        path = self.saved_at or ""
        relative = os.path.relpath(path) if path else path
        return (
            f"stopped by {name} at global step {global_step}; saved\n"
            f"  {relative if len(relative) < len(path) else path}\n"
            'Trainer.fit(..., ckpt_path="last") continues from it'
        )


class _LimitFlag:
    """A limit flag of the Trainer's config, read and set on the fit loop (see ``FitLimits``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, loop: FitLimits | None, owner: type) -> Any:
        return self if loop is None else getattr(loop.trainer.config, self.name)

    def __set__(self, loop: FitLimits, value: int) -> None:
        # The flag is replaced in the config, checked anew, so that the Trainer and the loop read the one value.
        changed: dict[str, Any] = {self.name: value}
        loop.trainer.config = dataclasses.replace(loop.trainer.config, **changed)


class FitLimits:
    """Lightning's ``trainer.fit_loop.max_epochs`` and ``.max_steps``: set between two fits of one Trainer, the next
    fit trains on to the new limit from where the last one ended."""

    trainer: Trainer
    max_epochs = _LimitFlag()
    max_steps = _LimitFlag()


def reached_limit(config: TrainerConfig, progress: Progress) -> str | None:
    """The limit the run has reached (``"max_epochs=3"``, ``"max_steps=100"``), or None."""
    if config.max_steps != -1 and progress.global_step >= config.max_steps:
        return f"max_steps={config.max_steps}"
    if config.epoch_limit != -1 and progress.epoch >= config.epoch_limit:
        return f"max_epochs={config.epoch_limit}"
    return None


def limit_message(limit: str, progress: Progress, trained: bool) -> str:
    """What is said when ``fit`` ends at ``limit``: Lightning's words, or, when it ``trained`` no batch (a complete
    run, resumed), that there was nothing to train."""
    if trained:
        return f"`Trainer.fit` stopped: `{limit}` reached."
    return f"nothing to train: the run has reached {limit} (epoch {progress.epoch}, step {progress.global_step})"
