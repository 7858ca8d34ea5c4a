"""Python processes for the tests, started from a warm interpreter: ``run`` and ``Popen`` as ``subprocess``'s.

Most of the suite's time went into starting Python: each of its few hundred processes imported torch and the
compiler stack torch's optimizers load (about 3 s of CPU apiece), to run for a second. Here a helper process per
test worker imports them once and forks a child for each ``python SCRIPT ...`` or ``python -m MODULE ...``
command; the child takes the command's arguments, environment, directory and standard streams, runs the program
as its ``__main__`` and exits as Python would. It is a real process of its own (its own pid, signals, session and
exit status), so the tests kill, signal and wait for it as for any other.

The workers of the launchers these programs start (``ember run``, torchrun) start warm too: the launcher is told
to start them as ``PYTHON_EXEC -u SCRIPT ...`` (torchrun's own setting), where ``PYTHON_EXEC`` is a stand-in
that has the helper fork the worker. The stand-in is the process the launcher sees (its child, with the
worker's command line): it passes each signal it gets on to the worker and ends as the worker does, and the
worker is killed when the stand-in is. What a test reads of a worker's own process (its sockets, its parent)
is the stand-in's: such a test starts its launcher with ``EMBER_TESTS_COLD_START=1`` in the environment.

Commands that the helper cannot run exactly as a fresh interpreter would (``-c``, interpreter options, another
``PYTHONPATH`` or an environment read when torch is imported) start a fresh interpreter instead, and so does
every command when ``EMBER_TESTS_COLD_START=1`` is set (run the suite so to compare), or in its environment.

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
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, NoReturn

# Ember is not among them: it reads its arguments and environment when imported (a launcher's --local-rank, the
# rank), so each child imports it afresh.
PRELOADED = ("torch", "torch._dynamo", "torch.distributed.run", "torch.utils.tensorboard")
# Read when torch or Python starts, so a child forked from the helper would not see another value of them.
_READ_AT_START = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONOPTIMIZE", "PYTHONWARNINGS", "TORCH_LOGS",
                  "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONMALLOC", "PYTHONHASHSEED", "PYTHONIOENCODING",
                  "LD_PRELOAD", "LD_LIBRARY_PATH", "MKL_NUM_THREADS")  # fmt: skip

# Popen arguments the helper does not reproduce.
_NOT_SERVED = ("shell", "preexec_fn", "pass_fds", "process_group", "executable", "user", "group", "umask")
COLD_START = "EMBER_TESTS_COLD_START"
# Where a stand-in finds the helper: the address of its socket for launchers' workers.
_WORKERS_ADDRESS = "EMBER_TESTS_WARM_WORKERS"
# The signals a stand-in passes on to its worker.
_FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


# ----------------------------------------------------------------------------------------------- the test side
class _Helper:
    """The connection to this test worker's helper process, started at first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.socket: socket.socket | None = None
        self.process: subprocess.Popen | None = None
        self.environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        self.failed = False
        self.directory: str | None = None  # the helper's socket for launchers' workers, and the stand-in

    def ask(self, request: dict[str, Any], fds: tuple[int, ...] = ()) -> Any:
        with self.lock:
            connection = self.socket or self._start()
            if "env" in request:  # the launchers the program starts start their workers warm
                request["env"] = {**self.for_workers(), **request["env"]}
            _send(connection, request, fds)
            return _receive(connection)

    def for_workers(self) -> dict[str, str]:
        """The variables that have torchrun's agent start its workers warm."""
        if self.directory is None:
            return {}
        return {"PYTHON_EXEC": os.path.join(self.directory, "python"),
                _WORKERS_ADDRESS: os.path.join(self.directory, "socket")}  # fmt: skip

    def serves(self, env: dict[str, str]) -> bool:
        same_start = all(env.get(name) == self.environment.get(name) for name in _READ_AT_START)
        return same_start and not self.failed

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair()
        self.directory = tempfile.mkdtemp(prefix="ember-warm-")
        _write_stand_in(os.path.join(self.directory, "python"))
        with tempfile.TemporaryFile() as log:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), str(theirs.fileno()), self.directory],
                pass_fds=(theirs.fileno(),), env=self.environment, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
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
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


_HELPER = _Helper()


def worker_environment() -> dict[str, str]:
    """What a launcher needs in its environment to start its workers warm (``PYTHON_EXEC``, the helper's address)."""
    with _HELPER.lock:
        if _HELPER.socket is None:
            _HELPER._start()
        return _HELPER.for_workers()


def runs_warm(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the helper can run this command as a fresh ``python`` would."""
    environment = dict(os.environ) if kwargs.get("env") is None else kwargs["env"]
    if "1" in (os.environ.get(COLD_START), environment.get(COLD_START)) or isinstance(args, (str, bytes)):
        return False
    args = [os.fspath(arg) for arg in args]
    if len(args) < 2 or args[0] != sys.executable or any(kwargs.get(name) for name in _NOT_SERVED):
        return False
    return _is_program(args[1:]) and _HELPER.serves(environment)


def _is_program(arguments: list[str]) -> bool:
    """Whether ``python ARGUMENTS`` runs a script or a module, with no interpreter option before it."""
    if arguments[:1] == ["-m"]:
        return len(arguments) > 1 and not arguments[1].startswith("-")
    return bool(arguments) and arguments[0].endswith(".py")


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


def serve(fd: int, directory: str) -> None:
    """Import what the tests' programs import, then fork a child for each request until the connection ends."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(directory, "socket"))
    listener.listen(64)
    server = _Server(socket.socket(fileno=fd), listener, base_path=sys.path[1:])  # without this file's directory
    _send(server.connection, ["ready"])
    server.run()


class _Server:
    """The helper's loop: requests from its test worker (start a program, how did it end) and from stand-ins."""

    def __init__(self, connection: socket.socket, listener: socket.socket, base_path: list[str]) -> None:
        self.connection, self.listener, self.base_path = connection, listener, base_path
        self.ended: dict[int, int] = {}  # exit status by pid, for the test worker
        self.stand_ins: dict[socket.socket, int | None] = {}  # a stand-in's connection: its worker, once started

    def run(self) -> None:
        while True:
            readable, _, _ = select.select([self.connection, self.listener, *self.stand_ins], [], [], 0.02)
            self._reap()
            for ready in readable:
                if ready is self.listener:
                    self.stand_ins[self.listener.accept()[0]] = None
                elif ready is not self.connection:
                    self._answer_stand_in(ready)
                elif not self._answer_test_worker():
                    return

    def _answer_test_worker(self) -> bool:
        try:
            request, fds = _receive_with_fds(self.connection)
        except ConnectionError:
            return False
        if "status" in request:
            self._reap()
            _send(self.connection, self.ended.get(request["status"]))
        else:
            _send(self.connection, self._start(request, fds))
        return True

    def _answer_stand_in(self, connection: socket.socket) -> None:
        worker = self.stand_ins[connection]
        try:
            request, fds = _receive_with_fds(connection)
        except (ConnectionError, OSError):  # the stand-in was killed: so is its worker
            if worker is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker, signal.SIGKILL)
            self._forget(connection)
            return
        same_start = all(request["env"].get(name) == os.environ.get(name) for name in _READ_AT_START)
        answer: list[Any] = self._start(request, fds) if worker is None and same_start else ["cold"]
        _send(connection, answer)
        if answer[0] == "started":
            self.stand_ins[connection] = answer[1]
        else:
            self._forget(connection)

    def _start(self, request: dict[str, Any], fds: list[int]) -> list[Any]:
        try:
            return ["started", _fork(request, fds, [self.connection, self.listener, *self.stand_ins], self.base_path)]
        except OSError as error:
            return ["failed", str(error)]
        finally:
            for descriptor in fds:
                os.close(descriptor)

    def _forget(self, connection: socket.socket) -> None:
        del self.stand_ins[connection]
        connection.close()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.ended[pid] = os.waitstatus_to_exitcode(status)
            for connection, worker in list(self.stand_ins.items()):
                if worker == pid:
                    with contextlib.suppress(OSError):
                        _send(connection, ["ended", self.ended[pid]])
                    self._forget(connection)


def _fork(request: dict[str, Any], fds: list[int], sockets: list[socket.socket], base_path: list[str]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            for helper_socket in sockets:
                helper_socket.close()
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
    _standard_streams(unbuffered=bool(os.environ.get("PYTHONUNBUFFERED")) or request.get("unbuffered", False))
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


# ----------------------------------------------------------------------------------- a launcher's worker, warm
def _write_stand_in(path: str) -> None:
    tests = os.path.dirname(os.path.abspath(__file__))
    with open(path, "w") as file:  # -S: the stand-in needs no site-packages, and starts in a few milliseconds
        file.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {tests!r})\n"
                   "import warm_processes\nwarm_processes.stand_in()\n")  # fmt: skip
    os.chmod(path, 0o755)


def stand_in() -> NoReturn:
    """A launcher's worker, started as ``PYTHON_EXEC [-u] SCRIPT ...``: the helper forks it, and this process
    stands in for it (see the module's docstring). A command the helper does not run becomes a fresh python."""
    arguments = sys.argv[1:]
    unbuffered = arguments[:1] == ["-u"]
    program = arguments[1:] if unbuffered else arguments
    address = os.environ.get(_WORKERS_ADDRESS)
    if not address or os.environ.get(COLD_START) == "1" or not _is_program(program):
        _become_python(arguments)
    worker: list[int] = []
    pending: list[int] = []  # signals that came before the worker

    def forward(number: int, frame: object) -> None:
        if not worker:
            pending.append(number)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker[0], number)

    for forwarded in _FORWARDED:
        signal.signal(forwarded, forward)
    connection = socket.socket(socket.AF_UNIX)
    request = {"argv": [sys.executable, *program], "cwd": os.getcwd(), "env": dict(os.environ),
               "new_session": True, "unbuffered": unbuffered}  # fmt: skip
    try:
        connection.connect(address)
        _send(connection, request, (0, 1, 2))
        answer = _receive(connection)
    except (OSError, ConnectionError):  # the helper is gone
        answer = ["cold"]
    if answer[0] != "started":
        if pending:  # a fresh python would have had it too
            _end_as(-pending[0])
        _become_python(arguments)
    worker.append(answer[1])
    for number in pending:
        forward(number, None)
    try:
        _end_as(_receive(connection)[1])  # ["ended", status]
    except ConnectionError:  # the helper ended (its test worker did): how the worker ends cannot be known
        _end_as(-signal.SIGKILL)


def _become_python(arguments: list[str]) -> NoReturn:
    os.execv(sys.executable, [sys.executable, *arguments])


def _end_as(status: int) -> NoReturn:
    """Exit with ``status``, as ``Popen.returncode`` has it: a negative one is the signal to die of."""
    if status < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL cannot be handled, nor need it be
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        status = 128 - status  # a signal whose default is not to end the process
    os._exit(status & 0xFF)


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
