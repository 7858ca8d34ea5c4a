"""How checkpoint files are written: at once, or in the background after a snapshot in host memory.

``Trainer(async_checkpoint=True)`` makes the strategy write through an ``AsyncWriter``: a save blocks
training only while the state is copied to host memory (into buffers kept from one save to the next,
pinned when the state is on a GPU); a background thread then writes the file atomically and runs the
file operations queued behind it (``last`` links, the removal of checkpoints that left the top k), in
order. At most one save is in flight: the next one first waits for it. A failed background write is
raised by the next ``wait()``, and the operations queued behind it, before or after it failed, are
dropped, so nothing is removed or linked in place of a file that was never written.
"""

from __future__ import annotations

import contextlib
import os
import threading
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


class AsyncWriter(Writer):
    """Snapshots checkpoints to host memory and writes them in a background thread (see the module)."""

    in_background = True

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._tasks: list[Task] = []
        self._error: BaseException | None = None
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._from_gpu = False

    def write(self, checkpoint: Mapping[str, Any], path: str) -> None:
        self.wait()  # one save in flight at most: its snapshot's buffers are reused
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
