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
    """Times named actions. Subclasses implement ``start``, ``stop`` and ``summary``.

    For each stage (fit, validate, test, predict) the Trainer calls ``setup``, which makes these
    actions call ``start``/``stop``: ``<kind>: waiting for data`` (the loader producing a batch),
    ``<kind>: batch_to_device``, ``training_step`` (the forward pass; likewise ``validation_step``,
    ...), ``backward``, ``unscale_gradients``, ``clip_gradients``, ``optimizer_step``, ``logging``
    (writing to the loggers) and each overridden hook under Lightning's name for it (``hook_action``), from
    ``prepare_data`` to ``teardown``, with the datamodule's ``state_dict`` and ``load_state_dict`` (which the
    checkpoints call). User code can add its
    own with ``with self.trainer.profiler.profile("name"):``. At the end of the stage ``teardown``
    removes the wrappers, writes ``summary()`` to ``<dirpath>/<stage>-<filename>.txt`` (one file per
    rank, ``-rank<N>`` added when there are several) and prints it on the global-zero process.
    ``dirpath`` defaults to the run's log directory.
    """

    #: Whether it records anything (the hook caller times the hooks of a stage only then).
    enabled: ClassVar[bool] = True

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str = "profile") -> None:
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self._patches = Patches()
        self._phase = "train"  # the kind of loader the latest batch came from

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

    # ------------------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Trainer, stage: str) -> None:
        """Start profiling ``stage``: wrap what the run calls so that it reports its actions here."""
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

    def teardown(self, trainer: Trainer, stage: str) -> None:
        """Stop profiling: remove the wrappers, then write and print the summary."""
        self._patches.undo()
        report = self.summary()
        if not report:
            return
        directory = self.dirpath or trainer.log_dir or trainer.config.root_dir
        rank = f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        path = os.path.join(directory, f"{stage}-{self.filename}{rank}.txt")
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as file:
            file.write(report + "\n")
        if trainer.is_global_zero:
            print(f"{report}\n(written to {path})")

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

    def setup(self, trainer: Trainer, stage: str) -> None:
        pass

    def teardown(self, trainer: Trainer, stage: str) -> None:
        pass

    def timed_batches(self, batches: Iterable, kind: str) -> Iterator[Any]:
        return iter(batches)


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
    raise ValueError(f"profiler: stop({action!r}) without a matching start({action!r})")
