"""How checkpoint files are written: at once, or in the background after a snapshot in host memory.

``Trainer(async_checkpoint=True)`` makes the strategy write through an ``AsyncWriter``: a save blocks
training only while the state is copied to host memory (into buffers kept from one save to the next,
pinned when the state is on a GPU); a background thread then writes the file atomically and runs the
file operations queued behind it (``last`` links, the removal of checkpoints that left the top k), in
order. At most one save is in flight: the next one first waits for it. A failed background write is
raised by the next ``wait()``, and the operations queued behind it, before or after it failed, are
dropped, so nothing is removed or linked in place of a file that was never written.

A background write needs a core that training leaves idle. When training's own thread waited for a core
(the loader's workers or other processes keep every core busy), a state in host memory is written at
once instead, as without ``async_checkpoint``: in the background, the write would take its CPU time from
training and the workers all the same, after a copy of the state that a write at once does without.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ember.checkpoint import io as checkpoint_io

Task = Callable[[], None]


class Writer:
    """Writes checkpoints at once; the operations that follow a write run right after it."""

    #: Whether writes go on after ``write`` returns.
    in_background = False

    def write(self, checkpoint: Mapping[str, Any], path: str) -> None:
        checkpoint_io.save(checkpoint, path)

    def snapshot(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """What to write later of ``checkpoint``: the checkpoint itself, when writes are done at once."""
        return dict(checkpoint)

    def then(self, task: Task) -> None:
        """Run ``task`` (a file operation) once the writes asked for before it are complete."""
        task()

    def submit(self, work: Task) -> None:
        """Run ``work`` (writing something the writer does not snapshot, such as a sharded save's end)."""
        work()

    def wait(self) -> None:
        """Return once every write asked for is complete; raise the error of one that failed."""


#: The share of its time training's thread may wait for a core before its cores count as all busy. With a
#: core idle it hardly waits (under 1% on 2 cores, training on both); with the loader's workers keeping
#: both busy it waited 30-50% of the time.
BUSY = 0.1


class AsyncWriter(Writer):
    """Snapshots checkpoints to host memory and writes them in a background thread (see the module).

    Args:
        at_once_when_busy: write at once when training waits for a core (for a state in host memory; a
            state on a GPU is copied to host memory either way).
    """

    in_background = True

    def __init__(self, *, at_once_when_busy: bool = True) -> None:
        self.at_once_when_busy = at_once_when_busy
        self._buffers: dict[str, torch.Tensor] = {}
        self._tasks: list[Task] = []
        self._error: BaseException | None = None
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._from_gpu = False
        self._core_waits = CoreWaits()
        self._at_once = False  # whether the last write was

    def write(self, checkpoint: Mapping[str, Any], path: str) -> None:
        self.wait()  # one save in flight at most: its snapshot's buffers are reused
        waited = self._core_waits.share()
        self._at_once = self.at_once_when_busy and waited is not None and waited > BUSY
        if self._at_once:
            checkpoint_io.save(checkpoint, path)
            return
        snapshot = self.snapshot(checkpoint)
        self.submit(lambda: checkpoint_io.save(snapshot, path))

    def snapshot(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with every tensor copied into host memory that training does not touch."""
        self._from_gpu = False
        snapshot = self._snapshot(checkpoint, "")
        if self._from_gpu:
            torch.cuda.synchronize()  # the copies were queued without waiting, one by one
        return snapshot

    def then(self, task: Task) -> None:
        with self._condition:
            idle = not self._tasks and self._error is None
        if self._at_once and idle:  # a thread that would wait for a core would only delay the task
            task()
        else:
            self.submit(task)

    def submit(self, work: Task) -> None:
        with self._condition:
            if self._error is not None:
                # A write failed, perhaps before the operations that depend on it were queued: they are
                # dropped like those queued in time, until ``wait()`` raises the error.
                return
            self._tasks.append(work)
            self._condition.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ember-checkpoint-writer", daemon=True)
                self._thread.start()

    def wait(self) -> None:
        with self._condition:
            while self._tasks:
                self._condition.wait()
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        # Training comes first: on a machine whose cores it keeps busy, the writer (and the threads it starts)
        # runs only where a core is idle. A mere lower priority still took a core from training's threads now
        # and then, which the others then waited for: 5-13% of the throughput on a 2-core machine, against
        # under 2% so. The write takes longer there (10 s instead of 0.5 s per 600 MB), and the next save or
        # the end of fit waits for it with a core idle.
        with contextlib.suppress(AttributeError, OSError):  # a thread's own scheduling: Linux only
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while True:
            with self._condition:
                while not self._tasks:
                    self._condition.wait()
                task = self._tasks[0]
            try:
                task()
            except BaseException as error:  # kept for the main thread, with the tasks that depended on it
                with self._condition:
                    self._error = error
                    self._tasks.clear()
                    self._condition.notify_all()
                continue
            with self._condition:
                self._tasks.pop(0)
                self._condition.notify_all()

    # ----------------------------------------------------------------------------- snapshots
    def _snapshot(self, value: Any, key: str) -> Any:
        """``value`` with every tensor copied into a host buffer of this writer's (reused across saves)."""
        if isinstance(value, torch.Tensor):
            return self._copy(value, key)
        if isinstance(value, Mapping):
            return {name: self._snapshot(item, f"{key}/{name}") for name, item in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._snapshot(item, f"{key}/{index}") for index, item in enumerate(value)]
            return tuple(items) if isinstance(value, tuple) else items
        return value

    def _copy(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            # Pinned host memory takes the copy from a GPU without blocking; the one wait is in `snapshot`.
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        self._from_gpu = self._from_gpu or tensor.is_cuda
        return buffer


class CoreWaits:
    """How much of its time the thread that asks spent waiting for a core (on a run queue, ready to run),
    from Linux's scheduler statistics of the thread; elsewhere, and for a thread other than the one that
    asked before, it is not known."""

    def __init__(self) -> None:
        self._last = self._read()

    def share(self) -> float | None:
        """The share of the time since the last call (or since this object was made) that the calling thread
        waited for a core; None where it is not known."""
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[0] != last[0] or now[1] <= last[1]:
            return None
        return (now[2] - last[2]) / (now[1] - last[1])

    @staticmethod
    def _read() -> tuple[int, float, float] | None:
        """(this thread, the time, the seconds it has waited for a core), or None where Linux does not say."""
        try:
            with open("/proc/thread-self/schedstat") as file:
                waited = int(file.read().split()[1]) / 1e9  # ns on a CPU, ns waiting for one, time slices
        except (OSError, ValueError, IndexError):
            return None
        return threading.get_ident(), time.perf_counter(), waited
