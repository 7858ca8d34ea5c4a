"""Python processes for the tests, started from a warm interpreter: ``run`` and ``Popen`` as ``subprocess``'s.

Most of the suite's time went into starting Python: each of its few hundred processes imported torch and the
compiler stack torch's optimizers load (about 3 s of CPU apiece), to run for a second. Here a helper process per
test worker imports them once and forks a child for each ``python SCRIPT ...`` or ``python -m MODULE ...``
command; the child takes the command's arguments, environment, directory and standard streams, runs the program
as its ``__main__`` and exits as Python would. It is a real process of its own (its own pid, signals, session and
exit status), so the tests kill, signal and wait for it as for any other.

Commands that the helper cannot run exactly as a fresh interpreter would (``-c``, interpreter options, another
``PYTHONPATH`` or an environment read when torch is imported) start a fresh interpreter instead, and so does
every command when ``EMBER_TESTS_COLD_START=1`` is set (run the suite so to compare).

The helper's own loop (``serve``) runs in a process that has imported torch but never computed with it: a process
that has run OpenMP threads cannot fork safely, which is why the test workers do not fork themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

PRELOADED = ("torch", "torch._dynamo", "ember", "torch.distributed.run", "torch.utils.tensorboard")
# Read when torch or Python starts, so a child forked from the helper would not see another value of them.
_READ_AT_START = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONOPTIMIZE", "PYTHONWARNINGS", "TORCH_LOGS",
                  "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONMALLOC", "PYTHONHASHSEED", "PYTHONIOENCODING",
                  "LD_PRELOAD", "LD_LIBRARY_PATH", "MKL_NUM_THREADS")  # fmt: skip

# Popen arguments the helper does not reproduce.
_NOT_SERVED = ("shell", "preexec_fn", "pass_fds", "process_group", "executable", "user", "group", "umask")


# ----------------------------------------------------------------------------------------------- the test side
class _Helper:
    """The connection to this test worker's helper process, started at first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.socket: socket.socket | None = None
        self.process: subprocess.Popen | None = None
        self.environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        self.failed = False

    def ask(self, request: dict[str, Any], fds: tuple[int, ...] = ()) -> Any:
        with self.lock:
            connection = self.socket or self._start()
            _send(connection, request, fds)
            return _receive(connection)

    def serves(self, env: dict[str, str]) -> bool:
        same_start = all(env.get(name) == self.environment.get(name) for name in _READ_AT_START)
        return same_start and not self.failed

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair()
        with tempfile.TemporaryFile() as log:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                env=self.environment, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
            theirs.close()
            try:
                ready = _receive(ours) == ["ready"]
            except ConnectionError:
                ready = False
            log.seek(0)
            said = log.read().decode()
        atexit.register(self.close)
        self.socket = ours
        if not ready or said:
            # A warning or message printed while importing would be missing from every child's output.
            self.failed = True
            raise RuntimeError(f"the warm helper did not start quietly (EMBER_TESTS_COLD_START=1 avoids it):\n{said}")
        return ours

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close()  # the helper ends when its connection does
            self.socket = None
        if self.process is not None:
            self.process.wait(timeout=10)
            self.process = None


_HELPER = _Helper()


def runs_warm(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the helper can run this command as a fresh ``python`` would."""
    if os.environ.get("EMBER_TESTS_COLD_START") == "1" or isinstance(args, (str, bytes)):
        return False
    args = [os.fspath(arg) for arg in args]
    if len(args) < 2 or args[0] != sys.executable or any(kwargs.get(name) for name in _NOT_SERVED):
        return False
    program = args[1:3] if args[1] == "-m" else args[1:2]
    if not (program[0].endswith(".py") or (len(program) == 2 and not program[1].startswith("-"))):
        return False
    environment = kwargs.get("env")
    return _HELPER.serves(dict(os.environ) if environment is None else environment)


class Popen(subprocess.Popen):
    """``subprocess.Popen``, whose ``python SCRIPT`` and ``python -m MODULE`` commands the warm helper runs."""

    def __init__(self, args: Any, **kwargs: Any) -> None:
        self._warm = runs_warm(args, kwargs)
        super().__init__(args, **kwargs)

    def _execute_child(self, args: Any, executable: Any, preexec_fn: Any, close_fds: Any, pass_fds: Any, cwd: Any,
                       env: Any, *rest: Any) -> None:  # fmt: skip
        if not self._warm:
            super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, *rest)
            return
        (_, _, _, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, _, _, _, _, _, new_session, _) = rest
        inherited = (p2cread, 0), (c2pwrite, 1), (errwrite, 2)  # a stream not given is this process's own
        streams = tuple(given if given != -1 else own for given, own in inherited)
        request = {
            "argv": [os.fspath(arg) for arg in args], "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": dict(os.environ if env is None else env), "new_session": bool(new_session),
        }  # fmt: skip
        try:
            answer = _HELPER.ask(request, streams)
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if answer[0] != "started":
            raise OSError(f"the warm helper could not start {args}: {answer[1]}")
        self.pid = answer[1]

    def _internal_poll(self, _deadstate: Any = None, **unused: Any) -> int | None:
        if not self._warm:
            return super()._internal_poll(_deadstate)
        if self.returncode is None:
            try:
                self.returncode = _HELPER.ask({"status": self.pid})
            except OSError:  # the helper is gone (the worker is ending)
                if _deadstate is not None:
                    self.returncode = _deadstate
        return self.returncode

    def _wait(self, timeout: float | None) -> int:
        if not self._warm:
            return super()._wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._internal_poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]


def run(args: Any, *, timeout: float | None = None, check: bool = False, input: Any = None,
        capture_output: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:  # fmt: skip
    """``subprocess.run`` on ``Popen`` above."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with Popen(args, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


# -------------------------------------------------------------------------------------------- the helper side
def _send(connection: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(message).encode()
    header = struct.pack("!I", len(data))
    if fds:
        socket.send_fds(connection, [header], list(fds))
    else:
        connection.sendall(header)
    connection.sendall(data)


def _receive(connection: socket.socket) -> Any:
    message, _ = _receive_with_fds(connection)
    return message


def _receive_with_fds(connection: socket.socket) -> tuple[Any, list[int]]:
    header, fds, _, _ = socket.recv_fds(connection, 4, 3)
    if not header:
        raise ConnectionError("the connection closed")
    while len(header) < 4:
        header += connection.recv(4 - len(header))
    (length,) = struct.unpack("!I", header)
    data = b""
    while len(data) < length:
        part = connection.recv(length - len(data))
        if not part:
            raise ConnectionError("the connection closed")
        data += part
    return json.loads(data), fds


def serve(fd: int) -> None:
    """Import what the tests' programs import, then fork a child for each request until the connection ends."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    connection = socket.socket(fileno=fd)
    base_path = sys.path[1:]  # without this file's directory
    _send(connection, ["ready"])
    ended: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([connection], [], [], 0.02)
        _reap(ended)
        if not readable:
            continue
        try:
            request, fds = _receive_with_fds(connection)
        except ConnectionError:
            return
        if "status" in request:
            _reap(ended)
            _send(connection, ended.get(request["status"]))
            continue
        try:
            pid = _fork(request, fds, connection, base_path)
        except OSError as error:
            _send(connection, ["failed", str(error)])
        else:
            _send(connection, ["started", pid])
        finally:
            for descriptor in fds:
                os.close(descriptor)


def _reap(ended: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        ended[pid] = os.waitstatus_to_exitcode(status)


def _fork(request: dict[str, Any], fds: list[int], connection: socket.socket, base_path: list[str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            connection.close()
            os._exit(_child(request, fds, base_path))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    return pid


def _child(request: dict[str, Any], fds: list[int], base_path: list[str]) -> int:
    """Become the requested program, as ``python`` would have started it; return its exit status."""
    for target, descriptor in enumerate(fds):
        os.dup2(descriptor, target)
    for descriptor in fds:
        if descriptor > 2:
            os.close(descriptor)
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    _standard_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")))
    if "OMP_NUM_THREADS" in os.environ:  # read by OpenMP when torch was imported, here as at a fresh start
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    argv = request["argv"][1:]
    try:
        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]  # as Python has it until runpy names the module's file
            sys.path[:] = [os.getcwd(), *base_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[:] = [os.path.dirname(os.path.abspath(argv[0])), *base_path]
            runpy.run_path(argv[0], run_name="__main__")
        status = 0
    except SystemExit as exit:
        status = _exit_status(exit.code)
    except BaseException as error:
        sys.excepthook(*sys.exc_info())
        status = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    _finish()
    if status == -signal.SIGINT:  # as Python ends on an uncaught Ctrl-C: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def _standard_streams(unbuffered: bool) -> None:
    """New sys.stdin/stdout/stderr on the child's descriptors, buffered as Python buffers them at start."""
    encoding = sys.__stdout__.encoding if sys.__stdout__ is not None else "utf-8"
    sys.stdin = sys.__stdin__ = _text_stream(0, encoding, writing=False, unbuffered=False, errors="strict")
    sys.stdout = sys.__stdout__ = _text_stream(1, encoding, writing=True, unbuffered=unbuffered, errors="strict")
    sys.stderr = sys.__stderr__ = _text_stream(2, encoding, writing=True, unbuffered=unbuffered,
                                               errors="backslashreplace", line_buffering=True)  # fmt: skip


def _text_stream(fd: int, encoding: str, writing: bool, unbuffered: bool, errors: str,
                 line_buffering: bool = False) -> io.TextIOWrapper:  # fmt: skip
    raw = io.FileIO(fd, "w" if writing else "r", closefd=False)
    binary: Any = raw if writing and unbuffered else io.BufferedWriter(raw) if writing else io.BufferedReader(raw)
    return io.TextIOWrapper(binary, encoding=encoding, errors=errors, line_buffering=line_buffering or raw.isatty(),
                            write_through=writing and unbuffered)  # fmt: skip


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish() -> None:
    """What Python does at exit: wait for the threads that are not daemons, run the exit functions, flush."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
