"""What ``ember run`` shows of its workers' stderr: each worker's goes to a file of torch's log directory
(``<dir>/<run>/attempt_<n>/<local rank>/stderr.log``) and is passed on to the console as it grows, each
traceback cut down to its last line; a failed job ends with a few lines naming the rank and its file."""

from __future__ import annotations

import os
import re
import socket
import sys
import threading
from typing import TextIO

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

_TRACEBACK = "Traceback (most recent call last):"
# Once a process group is open, torch writes an uncaught exception with the rank before each line.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


class _Stream:
    """One worker's stderr file, read as it grows."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.exception: str | None = None  # the last line of the last traceback: the exception
        self.shortened = False
        self._file: TextIO | None = None
        self._pending = ""  # the start of a line not ended yet
        self._in_traceback = False
        self._midline = False  # the pending line's start was passed on already

    def read(self, final: bool = False) -> str:
        """What the worker wrote since the last call, to pass on; ``final``: the worker has ended."""
        if self._file is None:
            if not os.path.exists(self.path):
                return ""
            # newline="": the \r of a progress bar stays a \r. Kept open: read while the worker writes it.
            self._file = open(self.path, errors="replace", newline="")  # noqa: SIM115
        *lines, self._pending = (self._pending + self._file.read()).split("\n")
        shown = [line + "\n" for line in lines if self._passes(line)]
        if final and self._pending:  # a last line without its end
            shown += [self._pending] if self._passes(self._pending) else []
            self._pending = ""
        elif "\r" in self._pending and not self._in_traceback:
            # A progress bar redraws its line with \r and ends it only when done: shown as it goes.
            shown.append(self._pending)
            self._pending, self._midline = "", True
        return "".join(shown)

    def _passes(self, line: str) -> bool:
        if self._midline:  # the end of a line whose start was shown
            self._midline = False
            return True
        body = _RANK_PREFIX.sub("", line).rstrip()
        if body.endswith(_TRACEBACK):  # also "+ Exception Group Traceback ..."
            self._in_traceback = self.shortened = True
        elif self._in_traceback and body[:1] not in ("", " "):  # frames and source lines are indented
            self._in_traceback = False  # the exception's own line ends the traceback, and is shown
            self.exception = body
        return not self._in_traceback

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class WorkerLogs(DefaultLogsSpecs):
    """Torch's per-rank log files for stderr, relayed to this process's stderr by a thread."""

    def __init__(self) -> None:
        super().__init__(redirects=Std.ERR)
        self.streams: dict[int, _Stream] = {}  # this attempt's, by global rank
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._relay, name="ember-run-stderr", daemon=True)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The files of a new attempt (the first, or a restart)."""
        destinations = super().reify(envs)
        restart = int(envs[0]["TORCHELASTIC_RESTART_COUNT"]) if envs else 0
        if restart:
            limit = envs[0]["TORCHELASTIC_MAX_RESTARTS"]
            print(f"ember run: a worker failed; starting all again (restart {restart} of {limit})", file=sys.stderr)
        with self._lock:
            self._pass_on(final=True)  # the end of what the previous attempt's workers wrote
            self.streams = {int(envs[local]["RANK"]): _Stream(path) for local, path in destinations.stderrs.items()}
        if self._thread.ident is None:
            self._thread.start()
        return destinations

    def close(self) -> None:
        """Pass on the rest, once the workers have ended (once: later calls do nothing)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join()
        with self._lock:
            self._pass_on(final=True)

    def _relay(self) -> None:
        while not self._stop.wait(0.1):
            with self._lock:
                self._pass_on()

    def _pass_on(self, final: bool = False) -> None:
        for stream in self.streams.values():
            text = stream.read(final)
            if text:
                sys.stderr.write(text)
                sys.stderr.flush()
            if final:
                stream.close()

    def note(self) -> str | None:
        """After a job that succeeded: where the tracebacks cut short are, if any was."""
        cut = [stream.path for stream in self.streams.values() if stream.shortened]
        if not cut:
            return None
        attempt = os.path.dirname(os.path.dirname(cut[0]))
        return f"ember run: the full tracebacks are in the workers' stderr.log under {attempt}"

    def failure_report(self, failure: ChildFailedError) -> tuple[list[str], int]:
        """The lines that say which rank failed, where and why, and the exit status to end with: that rank's."""
        rank = min(failure.failures, key=lambda rank: self._blame_order(failure, rank))
        process = failure.failures[rank]
        status = process.exitcode if process.exitcode > 0 else 128 - process.exitcode
        killed = f", {process.signal_name()}" if process.exitcode < 0 else ""
        line = f"ember run: rank {rank} failed on {socket.gethostname()} (exit status {status}{killed})"
        stream = self.streams.get(rank)
        if stream is None:
            return [line], status
        if stream.exception is None:  # what it wrote last is on the screen already
            return [line, f"ember run: what it wrote to stderr is in {stream.path}"], status
        return [f"{line}: {stream.exception}", f"ember run: its full traceback is in {stream.path}"], status

    def _blame_order(self, failure: ChildFailedError, rank: int) -> tuple[bool, bool, int, int]:
        """The failed rank to report first: one that exited by itself (not stopped by a signal, as the agent
        stops the others) and with a traceback (not one that stopped because another rank failed)."""
        stream = self.streams.get(rank)
        process = failure.failures[rank]
        return process.exitcode < 0, stream is None or stream.exception is None, process.timestamp, rank
