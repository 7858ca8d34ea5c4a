"""The watchdog of a multi-process run: it names the rank that stopped arriving, and ends a job quickly when
one rank failed.

Each rank runs a small thread that publishes, about once a second, where its main thread is (the step,
the code it is in, whether it is waiting for the other ranks) in the process group's store. When a rank
has waited for the others longer than the timeout, it reads what every rank published, says which ranks
never arrived and where they were last seen, and ends the job: a rank stuck in user code or in a data
loader otherwise holds every other rank in a collective until the backend's own timeout, with no word
of which rank it was. When one rank fails with an exception, the others stop at once and quietly, so
that the failed rank's traceback is the one the job shows.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

_PREFIX = "ember/watchdog"
# Code that is not the user's: the standard library, installed packages (torch among them), and Ember.
_LIBRARIES = tuple(
    directory + os.sep
    for directory in (
        os.path.dirname(os.__file__),
        os.path.dirname(os.path.dirname(torch.__file__)),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
)
_DATA_LOADING = os.sep + os.path.join("torch", "utils", "data") + os.sep
# Where the main thread waits for the other ranks: collectives, DDP's reducer (reached from autograd),
# and the store the ranks meet through.
_COMMUNICATION = (
    os.sep + os.path.join("torch", "distributed") + os.sep,
    os.sep + os.path.join("torch", "nn", "parallel") + os.sep,
    os.sep + os.path.join("torch", "autograd") + os.sep,
)
_INTERVAL = 0.5
_STOP_WAIT = 10.0  # seconds: a store call in flight, unless the store is gone
_FAILURE_GRACE = 3.0  # seconds for the failed rank to print its traceback before the others end the job


class Watchdog:
    """Watches this rank's main thread (see the module's docstring).

    ``progress()`` is a count that grows as the main thread gets on (batches run); ``position()`` says
    where the run is in words ("global step 38, epoch 2"); a rank that waits for the others, without
    progress, for longer than ``timeout`` seconds ends the job.
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float, progress: Callable[[], int]) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._timeout = timeout
        self._progress = progress
        #: Where the run is, in words; the Trainer tells it.
        self.position: Callable[[], str] = lambda: "setting up"
        self._main = threading.main_thread().ident
        self._host = socket.gethostname()
        self._waiting_since: float | None = None
        self._last_progress = -1
        self._moved_at = time.time()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ember-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """End the thread and wait for it. At exit this must come before the interpreter shuts down: a
        daemon thread that returns from a store call (C++, run without the GIL) into a finalizing interpreter
        is ended inside C++ destructors, which aborts the process ("terminate called without an active
        exception")."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=_STOP_WAIT)

    def announce_failure(self, error: BaseException) -> str | None:
        """Tell the other ranks that this one failed, so that they end the job without a traceback of theirs.

        Returns what an earlier failure of another rank was, when there was one: this rank's error (a closed
        connection, most likely) is then a consequence of it.
        """
        reason = f"rank {self._rank} ({self._host}) failed at {self.position()}: {type(error).__name__}: {error}"
        if self._abort("failure", reason):
            return None
        earlier = self._read_abort()
        return earlier["reason"] if earlier is not None else None

    # ------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        while not self._stopped.wait(_INTERVAL):
            try:
                self._beat()
                self._check()
            except Exception:  # a store that went away ends the watch, never the run
                return

    def _beat(self) -> None:
        waiting, where = _whereabouts(sys._current_frames().get(self._main))  # type: ignore[arg-type]
        now = time.time()
        progress = self._progress()
        if progress != self._last_progress:
            self._moved_at = now
        if not waiting or progress != self._last_progress:
            self._waiting_since = now if waiting else None
        self._last_progress = progress
        beat = {"host": self._host, "time": now, "moved": self._moved_at, "position": self.position(),
                "waiting": waiting, "where": where}  # fmt: skip
        self._store.set(f"{_PREFIX}/beat/{self._rank}", json.dumps(beat))

    def _check(self) -> None:
        abort = self._read_abort()
        if abort is not None:
            if abort["kind"] == "failure":
                time.sleep(_FAILURE_GRACE)
            _end()
        if self._waiting_since is not None and time.time() - self._waiting_since > self._timeout:
            report = self._hang_report()
            if self._abort("hang", report):
                print(f"[rank{self._rank}]: {report}", file=sys.stderr, flush=True)
            _end()

    def _hang_report(self) -> str:
        beats = self._beats()
        now = time.time()
        # The ranks the others wait for: not waiting themselves, or no longer reporting at all.
        absent = [rank for rank, beat in beats.items() if beat is None or not beat["waiting"] or _silent(beat, now)]
        lines = []
        for rank in absent or sorted(beats):
            beat = beats[rank]
            if beat is None:
                lines.append(f"rank {rank} never reported")
                continue
            silent = f", silent for the last {now - beat['time']:.0f} s" if _silent(beat, now) else ""
            lines.append(
                f"rank {rank} ({beat['host']}) has been at {beat['position']}, {beat['where']}, for "
                f"{now - beat['moved']:.0f} s{silent}"
            )
        return (
            f"the ranks waited for each other longer than the timeout ({self._timeout:.0f} s): "
            + "; ".join(lines)
            + ". Ending the job."
        )

    def _beats(self) -> dict[int, dict[str, Any] | None]:
        beats: dict[int, dict[str, Any] | None] = {}
        for rank in range(self._world_size):
            key = f"{_PREFIX}/beat/{rank}"
            beats[rank] = json.loads(self._store.get(key)) if self._store.check([key]) else None
        return beats

    def _read_abort(self) -> dict[str, Any] | None:
        key = f"{_PREFIX}/abort"
        if not self._store.check([key]):
            return None
        abort = json.loads(self._store.get(key))
        return abort if abort["rank"] != self._rank else None

    def _abort(self, kind: str, reason: str) -> bool:
        """Record why the job ends, unless a rank did already; returns whether this rank's reason stands."""
        record = json.dumps({"rank": self._rank, "kind": kind, "reason": reason})
        stored = self._store.compare_set(f"{_PREFIX}/abort", "", record)
        return bytes(stored).decode() == record


def _silent(beat: dict[str, Any], now: float) -> bool:
    return now - beat["time"] > 5 * _INTERVAL


def _end() -> None:
    """End this process now: its main thread is held in a collective that will never complete."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _whereabouts(frame: FrameType | None) -> tuple[bool, str]:
    """Whether ``frame``'s thread waits for the other ranks, and where it is: the user's code it is in
    (function and file:line), else the data loader, else the innermost function."""
    waiting, loading, innermost = False, False, None
    while frame is not None:
        filename = frame.f_code.co_filename
        waiting = waiting or any(part in filename for part in _COMMUNICATION)
        loading = loading or _DATA_LOADING in filename
        if not filename.startswith(_LIBRARIES) and not filename.startswith("<"):
            return waiting, f"in {frame.f_code.co_name} ({os.path.basename(filename)}:{frame.f_lineno})"
        innermost = innermost or f"in {frame.f_code.co_name} ({os.path.basename(filename)})"
        frame = frame.f_back
    if loading:
        return waiting, "waiting for the data loader"
    return waiting, innermost or "outside Python"
