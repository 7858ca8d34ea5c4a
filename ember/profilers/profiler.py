"""The ``Profiler`` base class: it times a run by wrapping, on instances and only while it profiles, the
strategy's step methods, the data loaders and logging (the hook caller times the hooks). With no profiler
nothing is wrapped, so the loop runs exactly the code it runs without one."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from ember.instrument import Patches

if TYPE_CHECKING:
    from ember.trainer import Trainer

_END = object()


class Profiler:
    """Times named actions. Subclasses implement ``start``, ``stop`` and ``summary``; as in Lightning, they may also
    override ``setup(stage, local_rank, log_dir)`` and ``teardown(stage)`` (calling ``super()``'s).

    For each stage (fit, validate, test, predict) the Trainer calls ``attach``, which makes these
    actions call ``start``/``stop``: ``<kind>: waiting for data`` (the loader producing a batch),
    ``<kind>: batch_to_device``, ``training_step`` (the forward pass; likewise ``validation_step``,
    ...), ``backward``, ``unscale_gradients``, ``clip_gradients``, ``optimizer_step``, ``logging``
    (writing to the loggers) and each overridden hook under Lightning's name for it (``hook_action``), from
    ``prepare_data`` to ``teardown``, with the datamodule's ``state_dict`` and ``load_state_dict`` (which the
    checkpoints call). User code can add its
    own with ``with self.trainer.profiler.profile("name"):``. At the end of the stage ``detach``
    removes the wrappers, and ``describe`` writes ``summary()`` to ``<dirpath>/<stage>-<filename>.txt`` (one file
    per rank, ``-rank<N>`` added when there are several), prints it on the global-zero process and calls
    ``teardown``. ``dirpath`` defaults to the run's log directory, which it keeps after the run.
    """

    #: Whether it records anything (the hook caller times the hooks of a stage only then).
    enabled: ClassVar[bool] = True

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = "profile") -> None:
        self.dirpath = dirpath  # kept as given, as Lightning's (a Path stays one)
        self.filename = filename
        self._patches = Patches()
        self._phase = "train"  # the kind of loader the latest batch came from
        self._stage: str | None = None
        self._local_rank: int | None = None
        self._report_path: str | None = None  # where the stage's summary goes (None: printed only)
        self._prints = True  # whether this process prints the summary (the global-zero one)

    def start(self, action: str) -> None:
        raise NotImplementedError

    def stop(self, action: str) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        """The report of the stage that just ended."""
        return ""

    @contextlib.contextmanager
    def profile(self, action: str) -> Iterator[None]:
        self.start(action)
        try:
            yield
        finally:
            self.stop(action)

    @property
    def local_rank(self) -> int:
        return 0 if self._local_rank is None else self._local_rank

    # ------------------------------------------------------------------------------ lifecycle
    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Called as ``stage`` starts, once the run reports its actions here (Lightning's hook)."""
        self._stage, self._local_rank = stage, local_rank

    def teardown(self, stage: str | None) -> None:
        """Called once the stage's summary is written (Lightning's hook)."""

    def describe(self) -> None:
        """Write the summary of the stage that ended and print it, then ``teardown``; a profiler used without a
        Trainer may call it too (it prints its summary, and writes it into ``dirpath`` when one is given)."""
        report, path = self.summary(), self._report_path
        if path is None and self.dirpath is not None and self.filename is not None:
            path = os.path.join(self.dirpath, f"{self.filename}.txt")
        if report and path is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as file:
                file.write(report + "\n")
        if report and self._prints:
            print(report if path is None else f"{report}\n(written to {path})")
        self.teardown(self._stage)

    def attach(self, trainer: Trainer, stage: str) -> None:
        """Start profiling ``stage``: wrap what the run calls so that it reports its actions here, then ``setup``."""
        self._phase = "train"
        strategy = trainer.strategy
        self._wrap(strategy, "batch_to_device", lambda *args: f"{self._phase}: batch_to_device")
        self._wrap(strategy, "step", lambda name, *args: name)
        for name in ("backward", "unscale_gradients", "clip_gradients", "optimizer_step"):
            self._wrap(strategy, name, name)
        self._wrap(trainer.run_metrics, "write", "logging")
        datamodule = trainer.datamodule
        if datamodule is not None:
            for name in ("state_dict", "load_state_dict"):
                self._wrap(datamodule, name, hook_action("LightningDataModule", type(datamodule).__name__, name))
        directory = run_directory(self.dirpath, trainer)
        if self.dirpath is None:  # as Lightning's, a profiler without one keeps the run's directory afterwards
            self.dirpath = directory
        rank = f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        if self.filename is not None:  # None: printed only, as Lightning's profilers without a filename
            self._report_path = os.path.join(directory, f"{stage}-{self.filename}{rank}.txt")
        self._prints = trainer.is_global_zero
        self.setup(stage, local_rank=trainer.local_rank, log_dir=directory)

    def timed_batches(self, batches: Iterable, kind: str) -> Iterator[Any]:
        """``batches`` (from a loader of ``kind``: "train", "val", "test", "predict"), each wait for one timed
        as ``<kind>: waiting for data``; the loops ask for this around every loader they iterate."""
        action = f"{kind}: waiting for data"
        iterator: Iterator[Any] | None = None
        while True:
            self.next_batch(kind)
            with self.profile(action):  # starting the loader's workers counts as waiting too
                if iterator is None:
                    iterator = iter(batches)
                batch = next(iterator, _END)
            if batch is _END:
                return
            yield batch

    def detach(self, trainer: Trainer, stage: str) -> None:
        """Stop profiling: remove the wrappers, then ``describe`` the stage."""
        self._patches.undo()
        self.describe()
        self._report_path = None

    def next_batch(self, kind: str) -> None:
        """Called as the run asks a loader of ``kind`` ("train", "val", "test" or "predict") for a batch."""
        self._phase = kind

    # ------------------------------------------------------------------------------- wrapping
    def _wrap(self, owner: Any, name: str, action: str | Callable[..., str]) -> None:
        """Make ``owner.<name>(...)`` report itself as ``action``, or as ``action(...)`` of its arguments,
        on this instance only, until ``teardown``."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def profiled(*args: Any, **kwargs: Any) -> Any:
            label = action if isinstance(action, str) else action(*args)
            self.start(label)
            try:
                return original(*args, **kwargs)
            finally:
                self.stop(label)

        self._patches.replace(owner, name, profiled)


class PassThroughProfiler(Profiler):
    """The profiler of a Trainer built without one: it wraps nothing and records nothing."""

    enabled = False

    def start(self, action: str) -> None:
        pass

    def stop(self, action: str) -> None:
        pass

    def attach(self, trainer: Trainer, stage: str) -> None:
        pass

    def detach(self, trainer: Trainer, stage: str) -> None:
        pass

    def timed_batches(self, batches: Iterable, kind: str) -> Iterator[Any]:
        return iter(batches)


def run_directory(dirpath: str | os.PathLike | None, trainer: Trainer) -> str:
    """Where a profiler's files go: its ``dirpath``, else the run's log directory."""
    return os.fspath(dirpath) if dirpath is not None else trainer.log_dir or trainer.config.root_dir


def hook_action(kind: str, owner: str, hook: str) -> str:
    """The action a hook is timed as, named as Lightning names it: ``[LightningModule]Net.on_train_start``,
    ``[LightningDataModule]Data.setup``, ``[Callback]<the callback's state_key>.on_train_epoch_end``."""
    return f"[{kind}]{owner}.{hook}"


def latest_start(started: list, action: str) -> int:
    """The index of the most recent entry of ``action`` in a list of started actions (tuples or lists
    whose first item is the name). Usually the last one; an action started in one hook and stopped in
    another is further down."""
    for index in range(len(started) - 1, -1, -1):
        if started[index][0] == action:
            return index
    raise ValueError(f"Attempting to stop recording an action ({action!r}) which was never started.")
