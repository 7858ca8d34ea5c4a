"""Where a job's processes come from: launcher detection, and ``ember run``, a front to torchrun.

Processes are started by PyTorch's elastic agent (``torch.distributed.run``, the engine behind
``torchrun``), by SLURM's ``srun`` or by ``mpirun``; Ember only reads what they set. A plain
``python script.py`` with ``Trainer(devices=2)`` re-executes itself under ``ember run``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NoReturn

_LOCAL_RANK_FLAG = re.compile(r"^--local[-_]rank(?:=(\d+))?$")


@dataclass(frozen=True)
class ClusterEnvironment:
    """How this process sits in a job, as its launcher described it."""

    launcher: str  # "torchelastic", "slurm" or "mpi"
    world_size: int
    global_rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    main_address: str
    main_port: int
    #: Under fault tolerance (``ember run --replica-groups``): this process's replica group, the number of groups,
    #: and the lighthouse's address (None: no fault tolerance).
    replica_group: int = 0
    num_replica_groups: int = 1
    lighthouse: str | None = None

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    @property
    def single_machine(self) -> bool:
        return self.num_nodes == 1


def detect_environment() -> ClusterEnvironment | None:
    """The launcher this process was started by, or None for a plain process."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or all(
        name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    ):
        world_size = int(env["WORLD_SIZE"])
        return ClusterEnvironment(
            launcher="torchelastic",
            world_size=world_size,
            global_rank=int(env["RANK"]),
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
            node_rank=int(env.get("GROUP_RANK", 0)),
            main_address=env["MASTER_ADDR"],
            main_port=int(env["MASTER_PORT"]),
            replica_group=int(env.get("EMBER_REPLICA_GROUP", "0")),
            num_replica_groups=int(env.get("EMBER_REPLICA_GROUPS", "1")),
            lighthouse=env.get("TORCHFT_LIGHTHOUSE") if "EMBER_REPLICA_GROUPS" in env else None,
        )
    if int(env.get("SLURM_NTASKS", "1")) > 1 and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        world_size = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        nodelist = env.get("SLURM_NODELIST", env.get("SLURM_JOB_NODELIST", "127.0.0.1"))
        return ClusterEnvironment(
            launcher="slurm",
            world_size=world_size,
            global_rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", "0")),
            local_world_size=world_size // max(1, nodes),
            node_rank=int(env.get("SLURM_NODEID", "0")),
            main_address=env.get("MASTER_ADDR", first_host(nodelist)),
            # the same on every task of the job, and different between jobs sharing a node
            main_port=int(env.get("MASTER_PORT", 10000 + job_id % 20000)),
        )
    for size, rank, local_rank, local_size in (
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ):
        if int(env.get(size, "1")) > 1:
            world_size, global_rank = int(env[size]), int(env[rank])
            local_world_size = int(env.get(local_size, world_size))
            if "MASTER_ADDR" not in env and local_world_size != world_size:
                raise RuntimeError(
                    "mpirun started processes on several machines, but MASTER_ADDR is not set: export the "
                    "address of rank 0's machine to every rank (mpirun -x MASTER_ADDR=host -x MASTER_PORT=port)"
                )
            return ClusterEnvironment(
                launcher="mpi",
                world_size=world_size,
                global_rank=global_rank,
                local_rank=int(env.get(local_rank, global_rank)),
                local_world_size=local_world_size,
                node_rank=global_rank // local_world_size,
                main_address=env.get("MASTER_ADDR", "127.0.0.1"),
                main_port=int(env.get("MASTER_PORT", "29500")),
            )
    return None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``gpu[03-05,09],cpu1``."""
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    first = nodelist[:end]
    match = re.match(r"^([^\[]*)\[([^\],-]+)[^\]]*\](.*)$", first)
    return match.group(1) + match.group(2) + match.group(3) if match else first


def strip_local_rank_argument() -> None:
    """Remove the ``--local-rank=N`` that the legacy ``torch.distributed.launch`` appends to argv.

    Scripts then parse their own arguments unchanged; the rank is kept in ``LOCAL_RANK``.
    """
    argv = sys.argv
    for index, argument in enumerate(argv[1:], start=1):
        match = _LOCAL_RANK_FLAG.match(argument)
        if not match:
            continue
        value = match.group(1)
        if value is None and index + 1 < len(argv) and argv[index + 1].isdigit():
            value = argv.pop(index + 1)
        del argv[index]
        if value is not None:
            os.environ.setdefault("LOCAL_RANK", value)
        return


def die_with_parent() -> None:
    """Ask Linux to kill this worker if its launcher dies, so that no orphaned process survives it."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if parent == 1:  # the launcher died before the request was registered
        os._exit(1)


@contextlib.contextmanager
def ctrl_c_ends_at_once() -> Iterator[None]:
    """Within the block, Ctrl-C (SIGINT) ends the process at once, as an uncaught ``KeyboardInterrupt`` would.

    Meeting the other ranks waits inside C++, where Python runs no signal handler: a ``KeyboardInterrupt`` would
    be raised only once every rank has arrived, never if another rank was stopped by the same Ctrl-C before it
    came. The job would then wait for the launcher's 30-second grace before it kills the rank. Nothing is lost:
    training has not begun. A handler the program installed itself is left alone."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def close_process_group() -> None:
    """Close the default process group, if one is open, while the interpreter is still whole.

    A gloo worker thread lets go of a collective's tensors a moment after the collective completes
    (later still for one that was never waited for). If that happens once the interpreter has begun
    to shut down, taking the GIL ends the thread inside a destructor and the whole process aborts
    ("terminate called without an active exception"), so the threads get that moment first.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    time.sleep(0.05)
    dist.destroy_process_group()


def loopback_interface() -> str | None:
    """The name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((name for name in names if name.startswith("lo")), None)


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host`` and listening: a store served from it is reachable there only."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


# ------------------------------------------------------------------------------- ember run
def processes_per_node(value: str) -> int:
    """``--nproc-per-node``: a count, or "auto" for one per GPU (one on a machine without GPUs)."""
    if value == "auto":
        import torch

        return max(1, torch.cuda.device_count())
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--nproc-per-node={value!r}: give a positive count or 'auto'")
    return int(value)


def check_run_arguments(nnodes: int, node_rank: int | None, rdzv_endpoint: str | None, max_restarts: int) -> None:
    """Raise ``ValueError`` naming the flag of ``ember run`` whose value cannot work, before anything starts
    (torchrun would fail later with a traceback, or wait for machines that never come)."""
    if nnodes < 1:
        raise ValueError(f"--nnodes={nnodes}: at least one node is needed")
    if max_restarts < 0:
        raise ValueError(f"--max-restarts={max_restarts}: give 0 or more restarts")
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank={node_rank}: give 0 to {nnodes - 1}, one per machine of --nnodes={nnodes}")
    if rdzv_endpoint is None:
        if nnodes > 1:
            raise ValueError(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT, reachable from every node")
        return
    host, _, port = rdzv_endpoint.rpartition(":")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"--rdzv-endpoint={rdzv_endpoint!r}: expected HOST:PORT, such as 10.0.0.1:29400")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except OSError as error:
        raise ValueError(f"--rdzv-endpoint={rdzv_endpoint!r}: no host {host!r} is known ({error})") from error


def run(
    *,
    nproc_per_node: str,
    nnodes: int,
    node_rank: int | None,
    rdzv_endpoint: str | None,
    rdzv_id: str,
    max_restarts: int,
    module: bool,
    script: str,
    script_args: list[str],
) -> int:
    """Start ``script`` in ``nproc_per_node`` processes with torch's elastic agent; return the exit status."""
    check_run_arguments(nnodes, node_rank, rdzv_endpoint, max_restarts)
    processes = processes_per_node(nproc_per_node)
    _share_cores(processes)
    argv = ["--nproc-per-node", str(processes), "--nnodes", str(nnodes)]
    argv += ["--max-restarts", str(max_restarts)]
    if nnodes == 1 and rdzv_endpoint is None:
        # One machine: every socket of the job listens on 127.0.0.1 only.
        _register_loopback_rendezvous()
        argv += ["--rdzv-backend", _LOOPBACK_BACKEND, "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", rdzv_id]
        interface = loopback_interface()
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)  # inherited by the workers
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    else:
        assert rdzv_endpoint is not None  # checked above
        if node_rank is not None:
            host, _, port = rdzv_endpoint.rpartition(":")
            argv += ["--node-rank", str(node_rank), "--master-addr", host, "--master-port", port]
        else:
            argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    if module:
        argv.append("--module")
    argv += [script, *script_args]
    return _launch(argv)


def _launch(argv: list[str]) -> int:
    """Run torchrun's agent on its command line ``argv``, the workers' stderr relayed; the exit status."""
    import logging

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from ember.worker_logs import WorkerLogs

    # The agent logs each worker it stops and each failure as a box; the failure is told below, in short.
    agent_logger = logging.getLogger("torch.distributed.elastic.multiprocessing")
    agent_logger.propagate = False
    agent_logger.addHandler(logging.NullHandler())
    config, entrypoint, arguments = torchrun.config_from_args(torchrun.parse_args(argv))
    config.logs_specs = logs = WorkerLogs()
    try:
        elastic_launch(config, entrypoint)(*arguments)
    except ChildFailedError as failure:
        logs.close()
        stopped = _stopped_by_signal(failure)
        if stopped is not None:  # the workers saved and exited as asked: one line, not a failure report
            print(f"ember run: the workers stopped on {stopped.name} after saving a checkpoint", file=sys.stderr)
            return 128 + int(stopped)
        lines, status = logs.failure_report(failure)
        print("\n".join(lines), file=sys.stderr)
        return status
    except SignalException as interrupted:
        logs.close()
        print(f"ember run: stopped by {interrupted.sigval.name}; all workers were ended", file=sys.stderr)
        return 128 + int(interrupted.sigval)
    finally:
        logs.close()  # also when the agent itself fails
    note = logs.note()
    if note is not None:
        print(note, file=sys.stderr)
    return 0


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_process(processes: int, cores: int | None = None) -> int:
    """The threads each of a machine's ``processes`` workers runs: the cores (this process may use), shared."""
    return max(1, (cores or _cores()) // processes)


def _share_cores(processes: int) -> None:
    """Set the workers' thread count (``OMP_NUM_THREADS``, which torch reads) unless the user did.

    Left unset, each of several processes would start a thread per core, and they would take turns.
    """
    if processes == 1 or "OMP_NUM_THREADS" in os.environ:
        return
    os.environ["OMP_NUM_THREADS"] = str(threads_per_process(processes))  # inherited by the workers
    if processes > _cores():
        print(
            f"ember run: {processes} processes share {_cores()} cores: each runs one thread, and they take turns "
            "(OMP_NUM_THREADS chooses the count)",
            file=sys.stderr,
        )


def _stopped_by_signal(failure: Exception) -> signal.Signals | None:
    """The signal the workers stopped on, when a Trainer saved and exited on it (SIGTERM, Ctrl-C or SLURM's
    SIGUSR1) with its usual status 128 + N; the agent may have ended the others with the same signal
    (status -N) as the first one left. None when any worker failed otherwise."""
    codes = {process.exitcode for process in getattr(failure, "failures", {}).values()}
    for name in ("SIGTERM", "SIGINT", "SIGUSR1"):
        number = int(getattr(signal, name, 0))
        if number and 128 + number in codes and codes <= {128 + number, -number}:
            return signal.Signals(number)
    return None


_LOOPBACK_BACKEND = "ember-loopback"
_earlier_stores: list[tuple[socket.socket, object]] = []


def _register_loopback_rendezvous() -> None:
    """A single-machine rendezvous whose store listens on 127.0.0.1 only (torchrun's own listens on every
    interface). Each attempt (the first and every restart) gets a fresh store, so that restarted workers
    never read the addresses their predecessors published."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import (
        RendezvousInfo,
        RendezvousParameters,
        rendezvous_handler_registry,
    )
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class LoopbackRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return _LOOPBACK_BACKEND

        def next_rendezvous(self) -> RendezvousInfo:
            server = listening_socket("127.0.0.1")
            self.master_port = server.getsockname()[1]
            self._store = TCPStore(
                self.master_addr, self.master_port, self.world_size, True, self.timeout,
                multi_tenant=True, master_listen_fd=server.fileno(),
            )  # fmt: skip
            # Earlier attempts' stores stay alive: destroying a store server the agent used aborts it.
            _earlier_stores.append((server, self._store))
            return super().next_rendezvous()

    def create(params: RendezvousParameters) -> StaticTCPRendezvous:
        return LoopbackRendezvous("127.0.0.1", 0, rank=0, world_size=1, run_id=params.run_id, timeout=600)

    rendezvous_handler_registry.register(_LOOPBACK_BACKEND, create)


def script_target() -> list[str] | None:
    """How ``python`` re-runs this process's program from the top: ``["-m", "package.module"]`` or the script's
    path. None where re-running it would not run the training again: an interactive session or notebook,
    ``python -c``, or a test session (pytest would run every test again)."""
    import __main__

    if "_pytest" in sys.modules:
        return None
    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return ["-m", spec.name]  # started as python -m package.module
    if getattr(__main__, "__file__", None) and sys.argv[0] not in ("", "-c"):
        return [os.path.abspath(sys.argv[0])]
    return None


def relaunch(nproc_per_node: int, target: list[str]) -> NoReturn:
    """Replace this process with ``ember run --nproc-per-node N`` running ``target`` (``script_target()``) with
    this process's arguments.

    The workers re-run the script with the rank environment, exactly as if ``ember run`` had started it.
    """
    from ember.lightning_compat import is_installed

    if is_installed():  # a Lightning script: its workers need the import hook too
        target = ["--lightning", *target]
    doctor = os.environ.get("EMBER_DOCTOR")
    if doctor is not None:  # the script runs under `ember doctor`: its workers must run under it too
        options = json.loads(doctor)
        target = ["-m", "ember", "doctor", "--steps", str(options["steps"]), *(["--json"] if options["json"] else []),
                  *target]  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", str(nproc_per_node), *target, *sys.argv[1:]]
    os.execv(sys.executable, command)
