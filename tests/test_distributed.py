"""Data parallel on CPU with Gloo on 127.0.0.1: launch ways, equivalence, communication, failures.

Every test that starts processes has a timeout, so that a hang fails fast.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import warm_processes
from conftest import quiet_trainer, wait_for_workers
from torch.utils.data import DataLoader

import ember
from ember.launch import detect_environment, first_host, strip_local_rank_argument, threads_per_process

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "train_ddp.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import train_ddp  # noqa: E402


def _start(command: list[str], out: str, env: dict[str, str] | None = None, **kwargs: Any) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return warm_processes.Popen(
        command, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, **kwargs,
    )  # fmt: skip


def _run(command: list[str], out: str, timeout: float = 90) -> subprocess.CompletedProcess:
    process = _start(command, out)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _results(out: str, world_size: int) -> list[tuple[list[torch.Tensor], dict[str, Any]]]:
    results = []
    for rank in range(world_size):
        with open(os.path.join(out, f"rank{rank}.json")) as file:
            results.append((torch.load(os.path.join(out, f"rank{rank}.pt")), json.load(file)))
    return results


def _single_process_parameters(batch_size: int, accumulate: int = 1) -> list[torch.Tensor]:
    model = train_ddp.Regressor()
    quiet_trainer(max_epochs=2, logger=False, accumulate_grad_batches=accumulate, enable_checkpointing=False).fit(
        model, DataLoader(train_ddp.dataset(), batch_size=batch_size)
    )
    return [p.detach() for p in model.parameters()]


def _assert_ranks_agree_with(reference: list[torch.Tensor], out: str) -> list[dict[str, Any]]:
    results = _results(out, 2)
    for parameters, _ in results:
        for got, expected in zip(parameters, reference, strict=True):
            assert (got - expected).abs().max() < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(results[0][0], results[1][0], strict=True))
    return [summary for _, summary in results]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


LAUNCHES = {
    "plain python, devices=2": lambda: [sys.executable, SCRIPT, "--devices", "2"],
    "ember run": lambda: [sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", SCRIPT],
    "torchrun": lambda: [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT,
    ],
    "legacy torch.distributed.launch": lambda: [
        sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), SCRIPT,
    ],
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
# ember run's launch: test_accumulation_all_reduces_only_on_the_stepping_micro_batch, which checks the same.
@pytest.mark.parametrize("launch", [launch for launch in LAUNCHES if launch != "ember run"])
def test_two_ranks_equal_one_process_with_twice_the_batch(launch: str, tmp_path: Any) -> None:
    out = str(tmp_path)
    result = _run([*LAUNCHES[launch](), "--out", out], out)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = _assert_ranks_agree_with(_single_process_parameters(batch_size=8), out)
    assert summaries[0]["global_step"] == 16
    _assert_a_two_rank_job(launch, result, summaries)


def _assert_a_two_rank_job(launch: str, result: subprocess.CompletedProcess, summaries: list[dict[str, Any]]) -> None:
    assert [s["world_size"] for s in summaries] == [2, 2]
    # validation metrics logged with sync_dist are reduced: the same on every rank
    assert summaries[0]["metrics"]["val_rank"] == summaries[1]["metrics"]["val_rank"] == 0.5
    assert summaries[0]["log_dir"] == summaries[1]["log_dir"]
    assert result.stdout.count("done") == 1  # trainer.print writes from rank zero only
    if launch in ("ember run", "plain python, devices=2"):  # Ember chose the thread count: no banner about it
        assert "OMP_NUM_THREADS" not in result.stderr, result.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_accumulation_all_reduces_only_on_the_stepping_micro_batch(tmp_path: Any) -> None:
    out = str(tmp_path)
    command = [*LAUNCHES["ember run"](), "--out", out, "--accumulate", "2", "--count-comms"]
    result = _run(command, out)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = _assert_ranks_agree_with(_single_process_parameters(batch_size=16), out)
    # 8 micro-batches per epoch and rank, 2 per step, 2 epochs: 8 steps, one gradient bucket each
    assert [s["global_step"] for s in summaries] == [8, 8]
    assert [s["comms"] for s in summaries] == [8, 8]
    _assert_a_two_rank_job("ember run", result, summaries)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_nodes_on_one_machine_train_together(tmp_path: Any) -> None:
    out = str(tmp_path)
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        _start(
            [
                sys.executable,
                "-m",
                "ember",
                "run",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--rdzv-endpoint",
                endpoint,
                SCRIPT,
                "--out",
                out,
                "--num-nodes",
                "2",
            ],
            out,
        )
        for rank in (0, 1)
    ]
    for node in nodes:
        _, stderr = node.communicate(timeout=120)
        assert node.returncode == 0, stderr[-3000:]
    summaries = _assert_ranks_agree_with(_single_process_parameters(batch_size=8), out)
    assert [s["world_size"] for s in summaries] == [2, 2]


def _failure_report(result: subprocess.CompletedProcess, rank: int) -> str:
    """Check the few lines ``ember run`` prints for a failed job; return the failed rank's log."""
    lines = result.stderr.splitlines()
    assert len(lines) <= 15, result.stderr
    assert "OMP_NUM_THREADS" not in result.stderr and "SIGTERM" not in result.stderr, result.stderr
    assert f"ember run: rank {rank} failed on {socket.gethostname()} " in result.stderr, result.stderr
    logs = re.findall(r"(/\S+stderr\.log)", result.stderr)
    assert logs, result.stderr
    with open(logs[-1]) as file:
        return file.read()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_failing_rank_ends_the_job_quickly_in_a_few_lines_that_say_where_its_traceback_is(tmp_path: Any) -> None:
    out = str(tmp_path)
    started = time.monotonic()
    result = _run([*LAUNCHES["ember run"](), "--out", out, "--fail-rank", "1", "--fail-step", "3"], out, timeout=60)
    elapsed = time.monotonic() - started
    assert elapsed < 30, f"the job took {elapsed:.0f} s to end"
    assert result.returncode == 1
    assert "(exit status 1): RuntimeError: boom on rank 1" in result.stderr
    assert "Traceback" not in result.stderr
    log = _failure_report(result, 1)
    assert "[rank1]: Traceback (most recent call last)" in log and "in training_step" in log


FAILING_WORKER = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank}: {os.environ.get('OMP_NUM_THREADS')} threads", flush=True)
def descend(depth):
    if depth == 0:
        raise ValueError(f"no value fits on rank {rank}")
    descend(depth - 1)
if rank == int(sys.argv[1]):
    time.sleep(0.5)
    sys.exit(int(sys.argv[2])) if len(sys.argv) > 2 else descend(30)
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("rank", "exit_status"), [(0, None), (1, 3)])
def test_the_job_ends_with_the_failed_rank_s_status_and_its_last_line(
    rank: int, exit_status: int | None, tmp_path: Any
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(FAILING_WORKER)
    command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", str(script), str(rank)]
    result = _run([*command, *([str(exit_status)] if exit_status else [])], str(tmp_path), timeout=50)
    # The launcher chose the threads: the machine's cores shared by the two processes.
    assert result.stdout.count(f"{threads_per_process(2)} threads") == 2, result.stdout
    assert result.returncode == (exit_status or 1)
    log = _failure_report(result, rank)
    if exit_status is None:
        assert f"(exit status 1): ValueError: no value fits on rank {rank}" in result.stderr
        assert "in descend" in log and "Traceback" not in result.stderr
    else:
        assert f"(exit status {exit_status})" in result.stderr


def test_the_cores_are_shared_among_the_processes_of_a_machine() -> None:
    assert threads_per_process(4, cores=16) == 4
    assert threads_per_process(3, cores=16) == 5
    assert threads_per_process(4, cores=2) == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_that_hangs_is_named_and_the_job_ends_within_the_timeout(tmp_path: Any) -> None:
    out = str(tmp_path)
    hang = ["--fail-rank", "1", "--fail-step", "3", "--hang", "--timeout", "8"]
    command = [*LAUNCHES["ember run"](), "--out", out, *hang]
    started = time.monotonic()
    result = _run(command, out, timeout=100)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
    report = [line for line in result.stderr.splitlines() if "waited for each other longer than the timeout" in line]
    assert len(report) == 1, result.stderr[-3000:]
    assert "rank 1" in report[0] and "global step 3" in report[0] and "in training_step (train_ddp.py:" in report[0]
    assert f"rank 1 ({socket.gethostname()})" in report[0]  # its host


def _listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses of the TCP sockets these processes listen on (from /proc)."""
    addresses = set()
    for address, _ in _listening(pids):
        addresses.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]) if len(address) == 8 else address)
    return addresses


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    """(hexadecimal address as /proc has it, port) of each TCP socket these processes listen on."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as file:
            for line in file.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state 0A is LISTEN
                    address, port = fields[1].split(":")
                    found.append((address, int(port, 16)))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_ends_every_rank_and_the_job_listens_on_loopback_only(tmp_path: Any) -> None:
    out = str(tmp_path)
    # The workers' own sockets are read: real processes, not the warm starts' stand-ins (tests/warm_processes.py)
    real_workers = {warm_processes.COLD_START: "1"}
    job = _start([*LAUNCHES["ember run"](), "--out", out, "--epochs", "1000", "--sleep", "0.01"], out, real_workers)
    workers = wait_for_workers(job, "train_ddp", 2, settle=0)
    while not all(_listening([worker]) for worker in workers):  # until the ranks have met: their sockets are open
        time.sleep(0.1)
    addresses = _listening_addresses([job.pid, *workers])
    assert addresses and addresses <= {"127.0.0.1"}, addresses
    os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    job.communicate(timeout=30)
    assert job.returncode != 0
    time.sleep(1)
    assert not [pid for pid in workers if _alive(pid)]


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_ends_a_rank_that_waits_for_the_others_to_meet(tmp_path: Any) -> None:
    # Rank zero of two, alone: it serves the rendezvous and waits inside C++ for a rank that never comes (in a job,
    # one the same Ctrl-C stopped first). A KeyboardInterrupt would wait for that rank too; the launcher would
    # kill the job only after its 30-second grace.
    out, port = str(tmp_path), _free_port()
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    job = _start([sys.executable, SCRIPT, "--out", out], out, env=env)
    deadline = time.monotonic() + 45
    while all(listening != port for _, listening in _listening([job.pid])) and time.monotonic() < deadline:
        assert job.poll() is None, job.communicate()
        time.sleep(0.1)
    time.sleep(0.5)  # from the store's start to the wait for the other rank
    os.kill(job.pid, signal.SIGINT)
    try:
        job.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        pytest.fail("a Ctrl-C did not end a rank waiting for the others")
    assert job.returncode == -signal.SIGINT


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses the parent-death signal")
def test_workers_do_not_outlive_a_killed_launcher(tmp_path: Any) -> None:
    out = str(tmp_path)
    # Real workers, not the warm starts' stand-ins: what ends them is the parent-death signal Ember asks for.
    real_workers = {warm_processes.COLD_START: "1"}
    job = _start([*LAUNCHES["ember run"](), "--out", out, "--epochs", "1000", "--sleep", "0.01"], out, real_workers)
    workers = wait_for_workers(job, "train_ddp", 2)
    os.kill(job.pid, signal.SIGKILL)  # the launcher dies without a chance to stop its workers
    job.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.2)
    assert not [pid for pid in workers if _alive(pid)], "orphaned workers survived"


SLURM_RANK = """
import datetime, os, torch
from ember.strategies import DDPStrategy, select_strategy
strategy = select_strategy(accelerator=os.environ.get("ACCELERATOR", "cpu"), devices="auto", num_nodes=1,
                           precision="32-true", sync_batchnorm=False,
                           strategy=DDPStrategy(timeout=datetime.timedelta(seconds=20)))
strategy.setup_environment()
summed = strategy.reduce(torch.tensor(float(strategy.global_rank + 1)), reduce_op="sum")
print("sum", float(summed), strategy.root_device)
"""


def _without_launcher_variables() -> dict[str, str]:
    launcher = ("SLURM_", "OMPI_", "PMI_", "MPI_", "TORCHELASTIC_", "GLOO_", "NCCL_")
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(launcher) and name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_single_node_slurm_job_meets_on_loopback_whatever_its_node_name_resolves_to(tmp_path: Any) -> None:
    # 192.0.2.1 (TEST-NET-1) stands for the node's LAN address: nothing listens there, and no packet reaches it.
    slurm = {"SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NODELIST": "192.0.2.1", "SLURM_JOB_ID": "41",
             "SLURM_JOB_NAME": "train", "MASTER_PORT": str(_free_port()), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    ranks = []
    for rank in (0, 1):
        env = {**_without_launcher_variables(), **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
        command = [sys.executable, "-c", SLURM_RANK]
        ranks.append(
            subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    for rank in ranks:
        stdout, stderr = rank.communicate(timeout=80)
        assert rank.returncode == 0 and "sum 3.0" in stdout, stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.timeout(120)
def test_a_slurm_job_with_one_gpu_per_task_meets_over_nccl(tmp_path: Any) -> None:
    """srun --gpus-per-task=1: each task sees its own GPU as cuda:0, and the tasks meet on loopback."""
    slurm = {"SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NODELIST": "192.0.2.1", "SLURM_JOB_ID": "42",
             "SLURM_JOB_NAME": "train", "MASTER_PORT": str(_free_port()), "ACCELERATOR": "cuda"}  # fmt: skip
    ranks = []
    for rank in (0, 1):
        env = {**_without_launcher_variables(), **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
               "CUDA_VISIBLE_DEVICES": str(rank)}  # fmt: skip
        ranks.append(subprocess.Popen([sys.executable, "-c", SLURM_RANK], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    for rank in ranks:
        stdout, stderr = rank.communicate(timeout=100)
        assert rank.returncode == 0 and "sum 3.0 cuda:0" in stdout, stderr[-3000:]


def test_on_one_machine_the_store_binds_and_every_rank_dials_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.launch import ClusterEnvironment
    from ember.strategies import ddp

    stores: list[tuple[str, bool, str | None]] = []

    def store(host: str, port: int, world_size: int, is_server: bool, timeout: Any, **options: Any) -> None:
        bound = None
        if "master_listen_fd" in options:
            with socket.socket(fileno=os.dup(options["master_listen_fd"])) as listener:
                bound = listener.getsockname()[0]
        stores.append((host, is_server, bound))

    monkeypatch.setattr(torch.distributed, "TCPStore", store)
    monkeypatch.setattr(ddp, "_keep_alive", [])  # closes the listening socket after the test
    ports = {nodes: _free_port() for nodes in (1, 2)}  # each free: a port next to a free one may be taken
    for rank, nodes in ((0, 1), (1, 1), (0, 2), (1, 2)):
        environment = ClusterEnvironment("slurm", 4, rank, rank, 4 // nodes, 0, "192.0.2.1", ports[nodes])
        ddp._make_store(environment, timedelta(seconds=1))
    assert stores == [
        ("127.0.0.1", True, "127.0.0.1"),
        ("127.0.0.1", False, None),
        ("192.0.2.1", True, None),  # across machines: the node list's first host, where rank zero runs
        ("192.0.2.1", False, None),
    ]


IN_FLIGHT_AT_EXIT = """
import atexit, torch, torch.distributed as dist
from ember.launch import close_process_group
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
atexit.register(close_process_group)  # as every Ember strategy with a process group does
dist.all_reduce(torch.randn(1_000_000), async_op=True)  # still running when the script ends
"""


@pytest.mark.timeout(60)
def test_a_collective_still_running_at_exit_does_not_abort_the_process() -> None:
    # Without closing first, gloo's thread releases the tensor during interpreter shutdown: SIGABRT.
    result = subprocess.run([sys.executable, "-c", IN_FLIGHT_AT_EXIT], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-3000:]


WATCHDOGS_AT_EXIT = """
import time
import torch.distributed as dist
from ember.strategies import watchdog
watchdog._INTERVAL = 0.0001  # each thread is in a store call, without the GIL, nearly all the time
store = dist.TCPStore("127.0.0.1", 0, 1, True)
for _ in range(8):
    watchdog.Watchdog(store.clone(), 0, 1, timeout=60.0, progress=lambda: 0).start()
time.sleep(0.2)
"""


@pytest.mark.timeout(60)
def test_the_watchdog_ends_before_the_interpreter_does() -> None:
    # A daemon thread that comes back from a store call into a finalizing interpreter aborts the process
    # ("terminate called without an active exception"): a two-process job failed so at its end now and then.
    result = subprocess.run([sys.executable, "-c", WATCHDOGS_AT_EXIT], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-3000:]


# ------------------------------------------------------------------------- without processes
# What a worker writes to stderr, write by write: a warning, a progress bar, two chained tracebacks (the second
# written by torch's excepthook, with the rank before each line) and a third whose first line comes in two writes.
_STDERR_WRITES = (
    "UserWarning: few workers\n", "\r 10%", "\r 50%", "\r100%\n",
    "Traceback (most recent call last):\n", '  File "a.py", line 1, in <module>\n', "    f()\n", "ValueError: first\n",
    "\n", "During handling of the above exception, another exception",
    " occurred:\n\n[rank1]: Traceback (most recent call last):\n[rank1]:   File \"b.py\", line 2, in f\n",
    "[rank1]: RuntimeError: second\n", "[rank1]: its message's second line\n",
    "Trace", "back (most recent call last):\n", "  ...\nKeyError: 'third'",
)  # fmt: skip


def test_a_worker_s_stderr_is_passed_on_as_it_grows_with_each_traceback_cut_to_its_last_line(tmp_path: Any) -> None:
    from ember.worker_logs import _Stream

    path = tmp_path / "stderr.log"
    stream = _Stream(str(path))
    assert stream.read() == ""  # the worker has not started yet
    with open(path, "w") as log:
        shown = []
        for text in _STDERR_WRITES:
            log.write(text)
            log.flush()
            shown.append(stream.read())
        shown.append(stream.read(final=True))
    assert shown[1:4] == ["\r 10%", "\r 50%", "\r100%\n"]  # the progress bar as it redraws, not once done
    assert "".join(shown) == (
        "UserWarning: few workers\n\r 10%\r 50%\r100%\nValueError: first\n\nDuring handling of the above exception, "
        "another exception occurred:\n\n[rank1]: RuntimeError: second\n[rank1]: its message's second line\n"
        "KeyError: 'third'"
    )
    assert stream.exception == "KeyError: 'third'" and stream.shortened


class _TwoRanks:
    """Just enough of a strategy for prepare_loader: the layout of one rank of two."""

    def __init__(self, rank: int) -> None:
        self.distributed_sampler_kwargs = {"num_replicas": 2, "rank": rank}
        self.training_sampler_kwargs = self.distributed_sampler_kwargs
        self.root_device = torch.device("cpu")
        self.global_rank = rank


def _batches(loader: Any, epoch: int = 0) -> list[int]:
    from ember.data import epoch_batches

    return torch.cat(list(epoch_batches(loader, epoch, 0, seed=7, rank=0))).tolist()


def test_each_rank_reads_its_own_shard_and_shuffles_per_epoch() -> None:
    from ember.data import prepare_loader

    loader = DataLoader(list(range(20)), batch_size=5, shuffle=True)
    shards = [prepare_loader(loader, _TwoRanks(rank), train=True) for rank in (0, 1)]  # type: ignore[arg-type]
    epochs = []
    for epoch in (0, 1):
        seen = [_batches(shard, epoch) for shard in shards]
        assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == list(range(20))
        epochs.append(seen[0])
    assert epochs[0] != epochs[1]
    ordered = DataLoader(list(range(20)), batch_size=5)
    assert _batches(prepare_loader(ordered, _TwoRanks(1), train=False)) == list(range(1, 20, 2))  # type: ignore[arg-type]
    assert _batches(prepare_loader(ordered, _TwoRanks(1), train=True, shard=False)) == list(range(20))  # type: ignore[arg-type]
    user_sampler = torch.utils.data.DistributedSampler(list(range(20)), 2, 0, shuffle=False)
    mine = DataLoader(list(range(20)), sampler=user_sampler, batch_size=5)
    assert _batches(prepare_loader(mine, _TwoRanks(1), train=True)) == list(range(0, 20, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
          "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "TORCHELASTIC_RUN_ID": "x"},
         ("torchelastic", 4, 3, 1, 2, 1, "10.0.0.1", 1234)),
        ({"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
          "SLURM_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123", "SLURM_JOB_NAME": "train"},
         ("slurm", 8, 5, 1, 4, 1, "gpu07", 10123)),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
         ("mpi", 2, 1, 1, 2, 0, "127.0.0.1", 29500)),
        ({"PMI_SIZE": "4", "PMI_RANK": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
          "MASTER_ADDR": "node1", "MASTER_PORT": "4000"},
         ("mpi", 4, 2, 0, 2, 1, "node1", 4000)),
    ],
)  # fmt: skip
def test_cluster_environments_are_read_from_their_variables(
    variables: dict[str, str], expected: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    env = detect_environment()
    assert env is not None
    got = (env.launcher, env.world_size, env.global_rank, env.local_rank, env.local_world_size, env.node_rank,
           env.main_address, env.main_port)  # fmt: skip
    assert got == expected


def test_mpi_across_machines_needs_a_main_address(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0",
                        "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        detect_environment()


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("node1", "node1"), ("gpu[03-05,09],cpu1", "gpu03"), ("a1,b[1-2]", "a1"), ("n[1-2]-ib", "n1-ib")],
)
def test_first_host_of_a_slurm_node_list(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_layout_must_match_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"num_nodes=2, but torchelastic started this job on 1 node"):
        ember.Trainer(accelerator="cpu", num_nodes=2)
    with pytest.raises(ValueError, match=r"devices=3, but torchelastic started 2 processes on this node"):
        ember.Trainer(accelerator="cpu", devices=3)
    trainer = ember.Trainer(accelerator="cpu")
    assert (trainer.world_size, trainer.strategy.name) == (2, "ddp")


@pytest.mark.parametrize("devices", ["auto", 2, "2"])
def test_a_process_that_sees_one_gpu_of_several_on_its_node_drives_that_one(
    devices: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """srun --gpus-per-task=1 (or CUDA_VISIBLE_DEVICES set per task): each of the node's tasks sees its own GPU,
    as cuda:0."""
    from ember.strategies import select_strategy

    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    for name, value in {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NNODES": "1",
                        "SLURM_NODELIST": "node1", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "train"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    strategy = select_strategy(accelerator="cuda", devices=devices, num_nodes=1, strategy="ddp",
                               precision="32-true", sync_batchnorm=False)  # fmt: skip
    assert strategy.root_device == torch.device("cuda", 0)
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank) == (2, 1, 1)
    with pytest.raises(ValueError, match=r"devices=1, but slurm started 2 processes on this node"):
        select_strategy(accelerator="cuda", devices=1, num_nodes=1, strategy="ddp", precision="32-true",
                        sync_batchnorm=False)  # fmt: skip


def test_legacy_local_rank_argument_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set before deleting so that the variable the function sets is undone after the test, even when unset before.
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(sys, "argv", ["train.py", "--local-rank=1", "--lr", "0.1"])
    strip_local_rank_argument()
    assert sys.argv == ["train.py", "--lr", "0.1"] and os.environ["LOCAL_RANK"] == "1"
    monkeypatch.setattr(sys, "argv", ["train.py", "--local_rank", "0"])
    strip_local_rank_argument()
    assert sys.argv == ["train.py"]


def test_data_parallel_needs_cuda_and_multi_node_needs_a_launcher() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="strategy='dp' splits each batch across GPUs.*use strategy='ddp'"):
            ember.Trainer(accelerator="cpu", strategy="dp")
    trainer = ember.Trainer(accelerator="cpu", devices=1, num_nodes=2, logger=False)
    with pytest.raises(RuntimeError, match="num_nodes=2: start a multi-node job with a launcher"):
        trainer.fit(train_ddp.Regressor(), DataLoader(train_ddp.dataset(), batch_size=4))


def test_ember_run_help_explains_every_flag() -> None:
    result = warm_processes.run(
        [sys.executable, "-m", "ember", "run", "--help"], capture_output=True, text=True, timeout=60
    )
    for flag in ("--nproc-per-node", "--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--max-restarts",
                 "--module"):  # fmt: skip
        assert flag in result.stdout
    bad = warm_processes.run([sys.executable, "-m", "ember", "run", "--nproc-per-node", "zero", "x.py"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--nproc-per-node='zero'" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_auto_micro_batching_agrees_across_ranks(tmp_path: Any) -> None:
    out = str(tmp_path)
    # Only rank 1 runs out of memory (above 2 samples); both must switch to the same split.
    result = _run([*LAUNCHES["ember run"](), "--out", out, "--accumulate", "auto", "--oom-above", "2"], out)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = _assert_ranks_agree_with(_single_process_parameters(batch_size=8), out)
    assert [s["micro_batches"] for s in summaries] == [2, 2] and summaries[0]["global_step"] == 16
