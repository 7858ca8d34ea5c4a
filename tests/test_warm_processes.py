"""The tests' warm process starts behave as fresh ``python`` processes: what a program sees of its command line,
directory, environment and streams, how it exits, and what is left to a fresh interpreter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import warm_processes


@pytest.fixture(autouse=True)
def _warm_starts_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare warm starts with fresh ones, also in a run told to start every process fresh."""
    monkeypatch.delenv("EMBER_TESTS_COLD_START", raising=False)


PROBE = textwrap.dedent(
    """
    import atexit, json, os, sys, threading, time

    def later():
        time.sleep(0.2)
        print("thread done", flush=True)

    atexit.register(lambda: print("atexit ran"))
    threading.Thread(target=later).start()  # not a daemon: Python waits for it before the exit functions
    seen = {
        "name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "probe": os.environ.get("PROBE"),
        "stdin": sys.stdin.readline(), "main_file": sys.modules["__main__"].__file__,
    }
    print(json.dumps(seen))
    if sys.argv[1] == "raise":
        raise ValueError("planted")
    if sys.argv[1] == "interrupt":
        raise KeyboardInterrupt
    if sys.argv[1] == "wait":
        time.sleep(60)
    sys.exit(int(sys.argv[1]))
    """
)


def _both(tmp_path: Path, *arguments: str, **kwargs: Any) -> tuple[Any, Any]:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    command = [sys.executable, str(probe), *arguments]
    options: dict[str, Any] = dict(capture_output=True, text=True, timeout=60, cwd=tmp_path, input="line\n",
                                   env={**os.environ, "PROBE": "yes"}, **kwargs)  # fmt: skip
    return warm_processes.run(command, **options), subprocess.run(command, **options)


@pytest.mark.parametrize("status", ["0", "3", "raise", "interrupt"])
def test_a_warm_start_is_seen_and_ends_as_a_fresh_python_process(status: str, tmp_path: Path) -> None:
    warm, cold = _both(tmp_path, status)
    assert warm.returncode == cold.returncode == {"0": 0, "3": 3, "raise": 1, "interrupt": -signal.SIGINT}[status]
    assert warm.stdout == cold.stdout
    assert json.loads(warm.stdout.splitlines()[0])["stdin"] == "line\n"
    assert warm.stdout.endswith("thread done\natexit ran\n")
    if status in ("raise", "interrupt"):
        last_line = "ValueError: planted" if status == "raise" else "KeyboardInterrupt"
        assert warm.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1] == last_line
        assert "Traceback (most recent call last)" in warm.stderr
    else:
        assert warm.stderr == cold.stderr == ""


def test_a_warm_process_is_signalled_and_waited_for_as_any_other(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    process = warm_processes.Popen([sys.executable, str(probe), "wait"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    assert process._warm
    process.stdin.write("line\n")  # type: ignore[union-attr]
    process.stdin.flush()  # type: ignore[union-attr]
    assert json.loads(process.stdout.readline())["argv"][1] == "wait"  # type: ignore[union-attr]
    assert os.getsid(process.pid) == process.pid and process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.1)
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
    process.stdin.close()  # type: ignore[union-attr]
    process.stdout.close()  # type: ignore[union-attr]


def test_what_a_fresh_interpreter_would_see_otherwise_starts_one(monkeypatch: pytest.MonkeyPatch) -> None:
    script = [sys.executable, "-m", "ember", "--version"]
    assert warm_processes.runs_warm(script, {})
    assert not warm_processes.runs_warm([sys.executable, "-c", "print(1)"], {})  # not a program the helper runs
    assert not warm_processes.runs_warm([sys.executable, "-X", "importtime", "-m", "ember"], {})
    assert not warm_processes.runs_warm(["bash", "-c", "true"], {})
    assert not warm_processes.runs_warm(script, {"env": {**os.environ, "PYTHONPATH": "/elsewhere"}})  # read at start
    assert not warm_processes.runs_warm(script, {"preexec_fn": os.setpgrp})
    monkeypatch.setenv("EMBER_TESTS_COLD_START", "1")
    assert not warm_processes.runs_warm(script, {})


WORKER = textwrap.dedent(
    """
    import os, sys, time
    print(os.getpid(), sys.argv[1:], flush=True)
    if sys.argv[1] == "wait":
        time.sleep(60)
    if sys.argv[1] == "interrupt":
        raise KeyboardInterrupt
    sys.exit(int(sys.argv[1]))
    """
)


def _as_a_launcher_starts_it(tmp_path: Path, argument: str, cold: bool = False) -> subprocess.Popen:
    """The worker script started as torchrun's agent starts it: ``PYTHON_EXEC -u SCRIPT ...`` in a new session."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, **warm_processes.worker_environment()}
    if cold:
        env[warm_processes.COLD_START] = "1"
    return subprocess.Popen([env["PYTHON_EXEC"], "-u", str(script), argument], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def _status(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, parent, ...); None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _gone(pid: int) -> bool:
    status = _status(pid)
    return status is None or status[0] == "Z"  # Z: ended, not yet waited for


def _state(pid: int) -> str:
    """A live process's state, parent and command line, to say which process is still there."""
    status = _status(pid)
    if status is None:
        return f"pid {pid}: gone"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            command = file.read().replace(bytes(1), b" ").decode()
    except OSError:
        command = "?"
    return f"pid {pid}: state {status[0]}, parent {status[1]}, {command!r}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("status", ["0", "3", "interrupt"])
def test_a_launcher_s_worker_started_warm_ends_as_a_fresh_one(status: str, tmp_path: Path) -> None:
    warm = _as_a_launcher_starts_it(tmp_path, status)
    stdout, stderr = warm.communicate(timeout=60)
    cold = subprocess.run([sys.executable, "-u", str(tmp_path / "worker.py"), status], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert warm.returncode == cold.returncode == {"0": 0, "3": 3, "interrupt": -signal.SIGINT}[status]
    worker, seen = stdout.split(" ", 1)
    assert int(worker) != warm.pid  # forked by the helper: the launcher's child stands in for it
    assert seen == cold.stdout.split(" ", 1)[1]
    assert stderr.splitlines()[-1:] == cold.stderr.splitlines()[-1:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_signal_to_a_warm_worker_s_stand_in_reaches_the_worker(number: int, tmp_path: Path) -> None:
    stand_in = _as_a_launcher_starts_it(tmp_path, "wait")
    worker = int(stand_in.stdout.readline().split()[0])  # type: ignore[union-attr]
    os.kill(stand_in.pid, number)
    assert stand_in.wait(timeout=30) == -number  # as the worker ended (SIGKILL: the stand-in itself)
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(worker), _state(worker)
    stand_in.communicate()


def test_a_worker_told_to_start_cold_is_the_stand_in_s_own_process(tmp_path: Path) -> None:
    process = _as_a_launcher_starts_it(tmp_path, "3", cold=True)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 3 and int(stdout.split()[0]) == process.pid
