"""Never lose work: a killed run resumes to the same parameters, bit for bit; checkpoints survive kills
mid-write; preemption signals save and exit; elastic restarts resume by themselves."""

from __future__ import annotations

import glob
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import warm_processes
from conftest import (
    DropoutRegressor,
    Regressor,
    built_once,
    descendants,
    make_data,
    make_loader,
    parameters_of,
    quiet_trainer,
    wait_for_workers,
)
from torch.utils.data import DataLoader, Sampler

import ember
from ember import checkpoint as checkpoint_io
from ember.callbacks import Callback, ModelCheckpoint, OnExceptionCheckpoint
from ember.checkpoint import io as file_io
from ember.checkpoint import state as checkpoint_state
from ember.checkpoint.writer import AsyncWriter, CoreWaits

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "resume_job.py")


def _job(
    out: str, *args: str, processes: int = 1, restarts: int = 0, timeout: float = 120
) -> subprocess.CompletedProcess:
    launcher = (
        [sys.executable, "-m", "ember", "run", "--nproc-per-node", str(processes)]
        if processes > 1
        else [sys.executable]
    )
    if restarts:
        launcher = [*launcher, "--max-restarts", str(restarts)]
    command = [*launcher, SCRIPT, "--out", out, *args]
    return warm_processes.run(command, cwd=out, capture_output=True, text=True, timeout=timeout)


def _final(out: str, rank: int = 0) -> list[torch.Tensor]:
    return torch.load(os.path.join(out, f"final-rank{rank}.pt"))


def _assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), [(x - y).abs().max() for x, y in zip(a, b)]


@pytest.fixture
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], str]:
    """The directory of an uninterrupted 70-step run, per (processes, accumulation); computed once."""

    def get(processes: int, accumulate: int) -> str:
        def build(out: str) -> None:
            result = _job(out, "--accumulate", str(accumulate), processes=processes)
            assert result.returncode == 0, result.stderr[-3000:]

        return built_once(tmp_path_factory, f"uninterrupted-{processes}-{accumulate}", build)

    return get


@pytest.mark.slow
@pytest.mark.timeout(240)
# Two processes killed so: test_an_elastic_restart_resumes_from_the_last_checkpoint, the same kill and resume with
# the agent restarting the job.
@pytest.mark.parametrize(("processes", "accumulate"), [(1, 1), (1, 2)])
def test_a_killed_run_resumes_to_the_same_parameters(
    processes: int, accumulate: int, uninterrupted: Callable[[int, int], str], tmp_path: Any
) -> None:
    out = str(tmp_path)
    killed = _job(out, "--accumulate", str(accumulate), "--kill-at", "37", processes=processes)
    assert killed.returncode != 0  # SIGKILL at step 37; the last checkpoint is from step 35
    resumed = _job(out, "--accumulate", str(accumulate), "--ckpt-path", "last", processes=processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "step=35" in resumed.stdout
    reference = uninterrupted(processes, accumulate)
    for rank in range(processes):
        _assert_identical(_final(out, rank), _final(reference, rank))


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("processes", [1, 2])
def test_a_kill_during_a_background_write_keeps_the_previous_last_and_resumes_exactly(
    processes: int, uninterrupted: Callable[[int, int], str], tmp_path: Any
) -> None:
    out, accumulate = str(tmp_path), str(processes)  # the uninterrupted runs the test above compares with
    written_later = ("--accumulate", accumulate, "--async-checkpoint")
    killed = _job(out, *written_later, "--kill-during-write", "35", processes=processes)
    assert killed.returncode != 0  # SIGKILL while step 35's checkpoint was written in the background
    last = checkpoint_state.find_checkpoint(quiet_trainer(default_root_dir=out), "last")
    assert last is not None and checkpoint_io.load(last)["global_step"] == 30  # the previous, complete one
    resumed = _job(out, *written_later, "--ckpt-path", "last", processes=processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step=30" in resumed.stdout
    for rank in range(processes):
        _assert_identical(_final(out, rank), _final(uninterrupted(processes, processes), rank))


def test_the_end_of_fit_waits_for_the_write_in_flight(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    original = file_io.save
    monkeypatch.setattr(file_io, "save", lambda checkpoint, path: (time.sleep(0.1), original(checkpoint, path)))
    # The writer at its usual priority: on a busy machine one that runs only on idle cores waits seconds for
    # each save (that it runs so has a test of its own).
    monkeypatch.setattr(os, "sched_setscheduler", lambda *args: None)
    every_two_steps = ModelCheckpoint(every_n_train_steps=2, save_top_k=-1, save_last=True)
    trainer = quiet_trainer(
        max_epochs=2, async_checkpoint=True, default_root_dir=str(tmp_path), callbacks=[every_two_steps]
    )
    trainer.strategy.checkpoint_writer.at_once_when_busy = False  # type: ignore[attr-defined]  # in the background
    trainer.fit(Regressor(), make_loader(32))
    last = os.path.join(trainer.checkpoint_dir, "last.ckpt")
    assert checkpoint_io.verify(last) and checkpoint_io.load(last)["global_step"] == 8
    assert len(os.listdir(trainer.checkpoint_dir)) == 5  # steps 2, 4, 6, 8 and last


def test_a_failed_background_write_is_raised_and_nothing_is_linked_or_removed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = file_io.save

    def failing(checkpoint: Any, path: Any) -> None:
        if "step=4" in str(path):
            raise checkpoint_io.CheckpointError(f"could not save {path!r}: No space left on device")
        original(checkpoint, path)

    monkeypatch.setattr(file_io, "save", failing)
    best_two = ModelCheckpoint(every_n_train_steps=2, save_top_k=1, save_last=True)
    trainer = quiet_trainer(max_epochs=2, async_checkpoint=True, default_root_dir=str(tmp_path), callbacks=[best_two])
    trainer.strategy.checkpoint_writer.at_once_when_busy = False  # type: ignore[attr-defined]  # in the background
    with pytest.raises(checkpoint_io.CheckpointError, match="No space left"):
        trainer.fit(Regressor(), make_loader(32))
    names = sorted(os.listdir(trainer.checkpoint_dir))
    assert names == ["epoch=0-step=2.ckpt", "last.ckpt"]  # step 2 kept: its successor was never written
    assert checkpoint_io.load(os.path.join(trainer.checkpoint_dir, "last.ckpt"))["global_step"] == 2


def test_what_follows_a_failed_background_write_never_runs_even_when_queued_after_the_failure(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(checkpoint: Any, path: Any) -> None:
        raise checkpoint_io.CheckpointError(f"could not save {path!r}: No space left on device")

    monkeypatch.setattr(file_io, "save", failing)
    writer = AsyncWriter(at_once_when_busy=False)  # in the background, however busy the machine running the tests
    writer.write({"step": torch.zeros(1)}, str(tmp_path / "step=4.ckpt"))
    with writer._condition:  # the write has failed before the loop queues what depends on it
        writer._condition.wait_for(lambda: not writer._tasks, timeout=60)
    ran: list[str] = []
    writer.then(lambda: ran.append("link last to step=4.ckpt"))
    with pytest.raises(checkpoint_io.CheckpointError, match="No space left"):
        writer.wait()
    assert ran == []
    writer.then(lambda: ran.append("after the error was raised"))  # a new save's operations run again
    writer.wait()
    assert ran == ["after the error was raised"]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="thread scheduling policies are Linux's")
def test_the_background_write_and_the_threads_it_starts_run_only_on_idle_cores(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    policies: list[int] = []
    original = file_io.save

    def watched(checkpoint: Any, path: Any) -> None:
        policies.append(os.sched_getscheduler(0))
        helper = threading.Thread(target=lambda: policies.append(os.sched_getscheduler(0)))
        helper.start()
        helper.join()
        original(checkpoint, path)

    monkeypatch.setattr(file_io, "save", watched)
    writer = AsyncWriter(at_once_when_busy=False)
    writer.write({"step": torch.zeros(1)}, str(tmp_path / "a.ckpt"))
    writer.wait()
    assert policies == [os.SCHED_IDLE, os.SCHED_IDLE]
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # training's own thread is left as it was
    assert checkpoint_io.verify(tmp_path / "a.ckpt")


def test_a_state_in_host_memory_is_written_at_once_while_training_waits_for_a_core(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shares = iter([0.4, None, 0.02])  # busy cores; not known (not Linux); an idle core
    monkeypatch.setattr(CoreWaits, "share", lambda self: next(shares))
    writers: list[str] = []
    original = file_io.save
    monkeypatch.setattr(
        file_io, "save", lambda *args: (writers.append(threading.current_thread().name), original(*args))
    )
    writer = AsyncWriter()
    ran: list[str] = []
    for name in ("a", "b", "c"):
        writer.write({"step": torch.zeros(1)}, str(tmp_path / f"{name}.ckpt"))
        writer.then(lambda: ran.append(threading.current_thread().name))
        writer.wait()
    background = "ember-checkpoint-writer"
    assert writers == ran == [threading.current_thread().name, background, background]
    assert all(checkpoint_io.verify(tmp_path / f"{name}.ckpt") for name in "abc")

    # Trainer(async_checkpoint=True) on CPU writes so; an AsyncWriter told otherwise writes in the background.
    assert quiet_trainer(async_checkpoint=True).strategy.checkpoint_writer.at_once_when_busy  # type: ignore[attr-defined]
    monkeypatch.setattr(CoreWaits, "share", lambda self: 1.0)
    always = AsyncWriter(at_once_when_busy=False)
    always.write({"step": torch.zeros(1)}, str(tmp_path / "d.ckpt"))
    always.wait()
    assert writers[-1] == background


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux's scheduler statistics")
def test_the_time_a_thread_waits_for_a_core_is_measured_and_sleeping_is_not_waiting() -> None:
    # This thread and a process spinning on the same core: each waits for it about half of the time.
    cores = os.sched_getaffinity(0)  # this thread's (Linux sets a thread's affinity for pid 0)
    core = min(cores)
    waits = CoreWaits()
    time.sleep(0.1)
    asleep = waits.share()
    spin = f"import os; os.sched_setaffinity(0, {{{core}}}); print(flush=True)\nwhile True: pass"
    spinner = subprocess.Popen([sys.executable, "-S", "-c", spin], stdout=subprocess.PIPE)
    try:
        os.sched_setaffinity(0, {core})
        assert spinner.stdout is not None and spinner.stdout.readline() == b"\n"  # it spins on the core
        waits.share()
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass
        spinning = waits.share()
    finally:
        os.sched_setaffinity(0, cores)
        spinner.kill()
        spinner.wait()
    assert asleep is not None and spinning is not None
    assert asleep < 0.2 < spinning < 1
    ran: list[float | None] = []
    other = threading.Thread(target=lambda: ran.append(waits.share()))
    other.start()
    other.join()
    assert ran == [None]  # another thread's time is not this thread's


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_elastic_restart_resumes_from_the_last_checkpoint(
    uninterrupted: Callable[[int, int], str], tmp_path: Any
) -> None:
    out = str(tmp_path)
    result = _job(out, "--accumulate", "2", "--kill-at", "37", processes=2, restarts=2, timeout=200)
    assert result.returncode == 0, result.stderr[-3000:]
    # The restarted workers found the checkpoint themselves: the last one before the SIGKILL at step 37.
    assert "resuming from" in result.stdout and "step=35" in result.stdout
    for rank in range(2):
        _assert_identical(_final(out, rank), _final(uninterrupted(2, 2), rank))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the workers in /proc")
@pytest.mark.parametrize(("processes", "accumulate"), [(1, 1), (2, 2)])
def test_sigterm_saves_at_a_step_boundary_and_exits_cleanly(
    processes: int, accumulate: int, uninterrupted: Callable[[int, int], str], tmp_path: Any
) -> None:
    out = str(tmp_path)
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "ember", "run", "--nproc-per-node", str(processes)]
    job = warm_processes.Popen(
        [*launcher, SCRIPT, "--out", out, "--pause", "0.05", "--accumulate", str(accumulate)],
        cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    workers = wait_for_workers(job, "resume_job", processes, settle=0) if processes > 1 else [job.pid]
    _wait_for_a_checkpoint(out)  # training has begun (the signal handlers are in place) and is far from done
    # With two processes only the last worker is told: the ranks must still agree to stop at the same step.
    os.kill(workers[-1], signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=60)
    assert job.returncode == 128 + signal.SIGTERM, stdout + stderr  # the usual status of a SIGTERM'd process
    assert "stopped by SIGTERM at global step" in stdout and 'ckpt_path="last"' in stdout
    assert "Traceback" not in stderr and "ChildFailedError" not in stderr
    last = checkpoint_state.find_checkpoint(quiet_trainer(default_root_dir=out), "last")
    assert last is not None and last.endswith("last.ckpt")
    assert 0 < checkpoint_io.load(last)["global_step"] < 70
    resumed = _job(out, "--ckpt-path", "last", "--accumulate", str(accumulate), processes=processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in range(processes):
        _assert_identical(_final(out, rank), _final(uninterrupted(processes, accumulate), rank))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("processes", "signal_name", "reach"),
    [(2, "SIGTERM", "group"), (1, "SIGINT", "group"), (2, "SIGTERM", "every process")],
)
def test_a_signal_to_the_whole_job_with_loader_workers_saves_and_resumes_exactly(
    processes: int, signal_name: str, reach: str, uninterrupted: Callable[[int, int], str], tmp_path: Any
) -> None:
    """What torchrun, SLURM's scancel and Ctrl-C in a terminal do: signal every process of the job, the
    DataLoader workers (two per rank here) and the launcher included. The save must not need the workers.

    "group" signals the launcher's process group, as a terminal or torchrun's own caller does (ember run's
    agent passes it on to each rank and its loader workers); "every process" signals each process, loader
    workers first, as SLURM's scancel does, after which the agent passes its own on: a worker gets two."""
    out = str(tmp_path)
    launcher = [sys.executable] + (["-m", "ember", "run", "--nproc-per-node", str(processes)] if processes > 1 else [])
    job = warm_processes.Popen(
        [*launcher, SCRIPT, "--out", out, "--pause", "0.05", "--accumulate", "2"],
        cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    _wait_for_a_checkpoint(out)
    number = getattr(signal, signal_name)
    if reach == "group":
        os.killpg(job.pid, number)
    else:
        for pid in [*reversed(descendants(job.pid)), job.pid]:
            os.kill(pid, number)
    stdout, stderr = job.communicate(timeout=90)
    assert job.returncode == 128 + number, stdout + stderr[-3000:]
    assert stdout.count("at global step") == 1, stdout  # one report, from rank zero
    assert "Traceback" not in stderr, stderr[-3000:]
    resumed = _job(out, "--ckpt-path", "last", "--accumulate", "2", processes=processes)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for rank in range(processes):
        _assert_identical(_final(out, rank), _final(uninterrupted(processes, 2), rank))


class _CtrlC(Callback):
    """Presses Ctrl-C (SIGINT to this process) ``times`` times at the end of batch ``at``."""

    def __init__(self, at: int, times: int) -> None:
        self.at, self.times = at, times

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.global_step == self.at:
            for _ in range(self.times):
                os.kill(os.getpid(), signal.SIGINT)


def test_ctrl_c_saves_at_the_step_boundary_and_exits_with_130(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = quiet_trainer(max_epochs=5, default_root_dir=str(tmp_path), callbacks=[_CtrlC(at=3, times=1)])
    before = signal.getsignal(signal.SIGINT)  # the process's own (a test worker's may differ from Python's default)
    with pytest.raises(SystemExit) as exited:
        trainer.fit(Regressor(), make_loader())
    assert exited.value.code == 130 and trainer.global_step == 3
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 3 and printed[0] == "stopped by SIGINT at global step 3; saved"
    assert printed[1].strip().endswith("last.ckpt") and 'ckpt_path="last"' in printed[2]
    assert checkpoint_io.load(os.path.join(trainer.checkpoint_dir, "last.ckpt"))["global_step"] == 3
    assert signal.getsignal(signal.SIGINT) is before  # put back after fit


def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path: Any) -> None:
    trainer = quiet_trainer(max_epochs=5, default_root_dir=str(tmp_path), callbacks=[_CtrlC(at=3, times=2)])
    with pytest.raises(SystemExit) as exited:  # the KeyboardInterrupt of the second, as Lightning ends it
        trainer.fit(Regressor(), make_loader())
    assert exited.value.code == 1 and trainer.interrupted
    assert trainer.global_step == 3 and not os.path.exists(os.path.join(trainer.checkpoint_dir, "last.ckpt"))


def _wait_for_a_checkpoint(directory: str) -> None:
    deadline = time.monotonic() + 60
    while not glob.glob(os.path.join(directory, "**", "*.ckpt"), recursive=True):
        if time.monotonic() > deadline:
            pytest.fail("no checkpoint was written within 60 s")
        time.sleep(0.1)


def _save_forever(directory: str) -> None:
    """Write checkpoints in a loop, as a run that is about to be killed does."""
    state = {"weights": torch.randn(256, 1024), "step": 0}
    while True:
        state["step"] += 1
        checkpoint_io.save(state, os.path.join(directory, "run.ckpt"))


@pytest.mark.skipif(sys.platform == "win32", reason="uses fork")
def test_a_kill_during_a_checkpoint_write_leaves_the_previous_checkpoint_loadable(tmp_path: Any) -> None:
    context = multiprocessing.get_context("fork")
    generator = random.Random(0)
    for trial in range(12):
        directory = str(tmp_path / str(trial))
        os.makedirs(directory)
        writer = context.Process(target=_save_forever, args=(directory,))
        writer.start()
        while not os.path.exists(os.path.join(directory, "run.ckpt")):
            time.sleep(0.005)
        time.sleep(generator.uniform(0.0, 0.2))  # somewhere in the middle of a later write
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
        assert checkpoint_io.load(os.path.join(directory, "run.ckpt"))["step"] >= 1
        assert all(name.startswith(".") or name == "run.ckpt" for name in os.listdir(directory))


# ------------------------------------------------------------------------------------ in one process
class _Dropout(DropoutRegressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class _SaveAt(Callback):
    """Saves a checkpoint after the given batch (of the first epoch) and stops the run there."""

    def __init__(self, batch: int, path: str) -> None:
        self.batch, self.path = batch, path

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if trainer.current_epoch == 0 and idx == self.batch:
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt  # the process "dies" right after the save


def _fit(model: ember.Module, **flags: Any) -> ember.Trainer:
    loader = flags.pop("loader", None) or make_loader(64, batch_size=4, shuffle=True)
    ckpt_path = flags.pop("ckpt_path", None)
    trainer = quiet_trainer(logger=False, enable_checkpointing=False, **flags)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer


def test_a_checkpoint_inside_an_accumulation_window_resumes_exactly(tmp_path: Any) -> None:
    ember.seed_everything(1)
    reference = _Dropout()
    _fit(reference, max_epochs=2, accumulate_grad_batches=4)
    path = str(tmp_path / "mid-window.ckpt")
    ember.seed_everything(1)
    with pytest.raises(SystemExit):
        _fit(_Dropout(), max_epochs=2, accumulate_grad_batches=4, callbacks=[_SaveAt(5, path)])  # 2 of 4 done
    assert checkpoint_io.load(path)["ranks"][0]["accumulated_gradients"] is not None
    resumed = _Dropout()
    _fit(resumed, max_epochs=2, accumulate_grad_batches=4, ckpt_path=path)
    _assert_identical(parameters_of(resumed), parameters_of(reference))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_resumes_from_its_own_state(workers: int, tmp_path: Any) -> None:
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def loader() -> Any:
        return stateful.StatefulDataLoader(make_data(64), batch_size=4, shuffle=True, num_workers=workers)

    ember.seed_everything(2)
    reference = _Dropout()
    _fit(reference, max_epochs=2, loader=loader())
    path = str(tmp_path / "stateful.ckpt")
    ember.seed_everything(2)
    with pytest.raises(SystemExit):
        _fit(_Dropout(), max_epochs=2, loader=loader(), callbacks=[_SaveAt(6, path)])
    assert checkpoint_io.load(path)["ranks"][0]["loader_state"] is not None
    resumed = _Dropout()
    _fit(resumed, max_epochs=2, loader=loader(), ckpt_path=path)
    _assert_identical(parameters_of(resumed), parameters_of(reference))


class _ReversedSampler(Sampler[int]):
    """A sampler the Trainer knows nothing about: it cannot tell whether a second pass repeats the first."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Any:
        return iter(range(self.size - 1, -1, -1))

    def __len__(self) -> int:
        return self.size


def test_a_loader_that_cannot_skip_ahead_resumes_at_the_next_epoch(tmp_path: Any) -> None:
    loader = DataLoader(make_data(64), batch_size=4, sampler=_ReversedSampler(64))
    path = str(tmp_path / "custom.ckpt")
    with pytest.raises(SystemExit):
        _fit(Regressor(), max_epochs=3, loader=loader, callbacks=[_SaveAt(6, path)])
    with pytest.warns(UserWarning, match=r"resuming at the start of epoch 1 instead of batch 7 of epoch 0: .* "
                      r"its _ReversedSampler may draw a different order"):  # fmt: skip
        trainer = _fit(Regressor(), max_epochs=3, loader=loader, ckpt_path=path)
    assert trainer.global_step == 7 + 2 * 16


def test_on_exception_checkpoint_keeps_the_work_and_last_finds_it(tmp_path: Any) -> None:
    class Failing(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 11:
                raise RuntimeError("disk full")
            return super().training_step(batch, batch_idx)

    root = str(tmp_path)
    on_exception = OnExceptionCheckpoint(os.path.join(root, "saved"))
    with pytest.raises(RuntimeError, match="disk full"):
        quiet_trainer(max_epochs=2, default_root_dir=root, callbacks=[on_exception]).fit(Failing(), make_loader())
    trainer = quiet_trainer(max_epochs=2, default_root_dir=root)
    trainer.fit(Regressor(), make_loader(), ckpt_path="last")
    assert trainer.global_step == 16  # resumed at step 11, not from scratch
    assert checkpoint_io.load(os.path.join(root, "saved", "on_exception.ckpt"))["global_step"] == 11


def test_last_best_and_the_run_directory(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path)
    fresh = quiet_trainer(max_epochs=1, default_root_dir=root, log_every_n_steps=1)  # (2 batches: logs each epoch)
    # A first start with "last" is the usual way to write a script: it trains afresh, saying so in one line (a
    # program that uses Lightning's names gets Lightning's warning instead: test_lightning_checkpointing).
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, logger="ember"):
        warnings.simplefilter("always")
        fresh.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert not [warning for warning in caught if "No checkpoint will be loaded" in str(warning.message)]
    assert 'ckpt_path="last": this run has saved no checkpoint yet, so the fit starts afresh' in caplog.messages
    assert fresh.global_step == 2

    more = quiet_trainer(max_epochs=3, default_root_dir=root, callbacks=[ModelCheckpoint(monitor="val_loss")])
    more.fit(Regressor(), make_loader(16), make_loader(16), ckpt_path="last")
    assert more.global_step == 6 and more.log_dir == fresh.log_dir  # the run continues in its directory
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        best = quiet_trainer(default_root_dir=root).validate(Regressor(), make_loader(16), ckpt_path="best")
    assert best[0]["val_loss"] == pytest.approx(float(more.checkpoint_callback.best_model_score))
    with pytest.raises(ValueError, match=r'"best"\)` is set but `ModelCheckpoint` is not configured to save'):
        quiet_trainer(default_root_dir=str(tmp_path / "empty")).validate(Regressor(), make_loader(), ckpt_path="best")


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_a_preemption_signal_under_slurm_saves_requeues_and_exits(
    signal_name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    commands: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: commands.append(command))

    class Preempted(Callback):
        def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
            if trainer.global_step == 5:
                os.kill(os.getpid(), getattr(signal, signal_name))  # what SLURM sends before preemption

    root = str(tmp_path)
    trainer = quiet_trainer(max_epochs=5, default_root_dir=root, slurm_requeue=True, callbacks=[Preempted()])
    with pytest.raises(SystemExit) as exited:
        trainer.fit(Regressor(), make_loader())
    assert exited.value.code == 128 + getattr(signal, signal_name) and trainer.preempted  # the usual status
    assert commands == [["scontrol", "requeue", "4242"]]
    saved = checkpoint_io.load(os.path.join(trainer.log_dir, "checkpoints", "last.ckpt"))
    progress = saved["loops"]["fit_loop"]["progress"]
    assert saved["global_step"] == 5 and progress["epoch_batches"] == 5  # the boundary ending that step
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers are put back after fit
