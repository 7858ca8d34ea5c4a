"""Every example trains for real and checks its own target: each must exit with status 0.

Each runs in a subprocess, in its own session, with a timeout: on a hang, the whole process group
(launcher, workers, children) is killed and the test fails. They run with one compute thread per
process (as torchrun gives its workers): on a machine whose cores are shared with other jobs, spinning
OpenMP threads that wait for each other can make a run several times slower.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

import pytest
import warm_processes

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _run(arguments: list[str], cwd: Any, timeout: float) -> subprocess.CompletedProcess:
    """``python ARGUMENTS`` in ``cwd``; kills everything it started if it runs longer than ``timeout`` seconds."""
    process = warm_processes.Popen(
        [sys.executable, *arguments],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{arguments} did not finish in {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _example(name: str, *arguments: str, cwd: Any, timeout: float = 120) -> subprocess.CompletedProcess:
    result = _run([os.path.join(EXAMPLES, name), "--root-dir", str(cwd), *arguments], cwd, timeout)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_digits_reaches_its_accuracy_and_fails_below_its_target(tmp_path: Any) -> None:
    pytest.importorskip("sklearn")
    result = _example("digits.py", cwd=tmp_path)
    assert "best val_acc" in result.stdout
    assert os.path.exists(os.path.join(tmp_path, "ember_logs", "version_0", "metrics.csv"))
    # A run of its own: resuming the run above, which trained past one epoch, with max_epochs=1 is refused.
    short = os.path.join(tmp_path, "short")
    arguments = [os.path.join(EXAMPLES, "digits.py"), "--root-dir", short, "--max-epochs", "1"]
    failing = _run([*arguments, "--target", "0.999"], tmp_path, timeout=60)
    assert failing.returncode == 1 and "FAILED" in failing.stdout


def test_ddp_with_ember_run_on_two_processes(tmp_path: Any) -> None:
    pytest.importorskip("sklearn")
    command = ["-m", "ember", "run", "--nproc-per-node", "2", os.path.join(EXAMPLES, "ddp.py"), "--root-dir"]
    result = _run([*command, str(tmp_path)], tmp_path, timeout=150)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert "rank 0 of 2" in result.stdout and "rank 1 of 2" in result.stdout
    assert "best val_acc" in result.stdout


def test_fsdp_started_by_the_trainer(tmp_path: Any) -> None:
    result = _example("fsdp.py", cwd=tmp_path, timeout=150)  # Trainer(devices=2) starts the other process
    assert "holds" in result.stdout and "loaded whole" in result.stdout


def test_char_gpt_learns_from_context(tmp_path: Any) -> None:
    result = _example("char_gpt.py", cwd=tmp_path)
    assert "unigram entropy" in result.stdout and "sample:" in result.stdout


def test_resume_after_preemption_is_exact(tmp_path: Any) -> None:
    pytest.importorskip("sklearn")
    result = _example("resume.py", cwd=tmp_path)
    assert "stopped by SIGTERM at global step" in result.stdout and "bit for bit" in result.stdout


def test_tuning_finds_a_batch_size_and_a_learning_rate(tmp_path: Any) -> None:
    pytest.importorskip("sklearn")
    result = _example("tuning.py", cwd=tmp_path)
    assert "batch size:" in result.stdout and "learning rate:" in result.stdout


def test_doctor_names_the_planted_mistakes(tmp_path: Any) -> None:
    result = _example("doctor.py", cwd=tmp_path, timeout=90)
    for finding in ("input-bound", "graph-kept"):
        assert f"[{finding}]" in result.stdout
    # The planted thread count too, unless other work on the machine made the doctor's timings overlap.
    assert "[cpu-oversubscribed]" in result.stdout or "(cpu-oversubscribed not shown: " in result.stdout


@pytest.mark.parametrize(
    "arguments",
    [
        ["char_gpt.py", "--max-steps", "3"],  # a model that has not learnt yet
        ["tuning.py", "--max-epochs", "1", "--target", "0.999"],
    ],
    ids=lambda arguments: arguments[0],
)
def test_an_example_that_misses_its_target_fails(arguments: list[str], tmp_path: Any) -> None:
    name, *flags = arguments
    if name == "tuning.py":  # it reads the digits
        pytest.importorskip("sklearn")
    result = _run([os.path.join(EXAMPLES, name), "--root-dir", str(tmp_path), *flags], tmp_path, timeout=120)
    assert result.returncode == 1 and "FAILED" in result.stdout, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
