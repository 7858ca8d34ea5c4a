"""``ember run --replica-groups G``: torchft's lighthouse and G replica groups, each a torchrun job of its own (its
own agent, rendezvous and store) of N processes, that go on training when one of them fails; the strategy's side
is ``ember.strategies.fault_tolerant``.

On one machine the lighthouse runs in a process of its own, bound to 127.0.0.1; ``--lighthouse HOST:PORT`` joins
one that runs elsewhere (torchft's ``torchft_lighthouse``), for replica groups on several machines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import FrameType

from ember.launch import die_with_parent, listening_socket, threads_per_process


def check_arguments(replica_groups: int, replica_group: int | None, lighthouse: str | None, nnodes: int) -> None:
    """Raise ``ValueError`` naming the flag whose value cannot work, before anything starts."""
    if replica_groups < 1:
        raise ValueError(f"--replica-groups={replica_groups}: give 1 or more replica groups")
    if replica_group is not None:
        if not 0 <= replica_group < replica_groups:
            raise ValueError(f"--replica-group={replica_group}: give 0 to {replica_groups - 1} (--replica-groups)")
        if lighthouse is None:
            raise ValueError(f"--replica-group={replica_group} runs one group of a job on several machines: give the "
                             "job's --lighthouse HOST:PORT too")  # fmt: skip
    if nnodes > 1:
        raise ValueError(f"--nnodes={nnodes} with --replica-groups: a replica group runs on one machine; spread the "
                         "groups over machines with --replica-group I and --lighthouse instead")  # fmt: skip
    if lighthouse is not None:
        host, _, port = lighthouse.removeprefix("http://").rpartition(":")
        if not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"--lighthouse={lighthouse!r}: expected HOST:PORT, such as 10.0.0.1:29510")


def run(
    *,
    replica_groups: int,
    replica_group: int | None,
    lighthouse: str | None,
    nproc_per_node: int,
    max_restarts: int,
    module: bool,
    script: str,
    script_args: list[str],
) -> int:
    """Start the lighthouse (unless ``lighthouse`` names one) and the replica groups; the exit status: the first
    failed group's, or 1 when the lighthouse ended first."""
    from ember.strategies.fault_tolerant import torchft_problem

    problem = torchft_problem()
    if problem is not None:
        raise ValueError(problem)
    # The machine's cores are shared by all the groups' processes (each agent would share them among its own).
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc_per_node * replica_groups)))
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at "info"
    server, port = _start_lighthouse() if lighthouse is None else (None, 0)
    address = f"http://{lighthouse.removeprefix('http://')}" if lighthouse is not None else f"http://127.0.0.1:{port}"
    groups = range(replica_groups) if replica_group is None else [replica_group]
    agents = [_start_group(group, replica_groups, address, nproc_per_node, max_restarts, module, script, script_args)
              for group in groups]  # fmt: skip

    def stop(signal_number: int, frame: FrameType | None) -> None:  # the groups save a checkpoint and stop
        for agent in agents:
            agent.send_signal(signal_number)

    signal.signal(signal.SIGTERM, stop)
    lost: int | None = None  # the lighthouse's exit status, once it ended
    try:
        while any(agent.poll() is None for agent in agents):
            if server is not None and lost is None and server.poll() is not None:
                lost = server.returncode
                stop(signal.SIGTERM, None)  # rather than being restarted by their agents, without a lighthouse
            time.sleep(0.1)
    except KeyboardInterrupt:  # Ctrl-C reached the agents too: they stop their workers
        for agent in agents:
            agent.wait()
    finally:
        if server is not None and server.poll() is None:
            server.terminate()
            server.wait()
    if lost is not None:
        print(f"ember run: the lighthouse at {address} ended (exit status {lost}): the replica groups stopped, and "
              "replica group 0 saved a checkpoint if checkpointing is on; resume with fit(ckpt_path='last')",
              file=sys.stderr)  # fmt: skip
        return 1
    return next((agent.returncode for agent in agents if agent.returncode), 0)


def _start_lighthouse() -> tuple[subprocess.Popen, int]:
    """torchft's lighthouse in a process of its own, listening on 127.0.0.1 only; and its port."""
    with listening_socket("127.0.0.1") as probe:
        port = probe.getsockname()[1]
    script = os.path.join(os.path.dirname(__file__), "lighthouse.py")
    return subprocess.Popen([sys.executable, script, f"127.0.0.1:{port}"], preexec_fn=die_with_parent), port


def _start_group(
    group: int, groups: int, lighthouse: str, processes: int, max_restarts: int, module: bool, script: str,
    script_args: list[str],
) -> subprocess.Popen:  # fmt: skip
    """One replica group: ``ember run`` (torchrun's agent, a rendezvous and store of its own) with its group in the
    environment of its workers."""
    command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", str(processes), "--max-restarts",
               str(max_restarts), "--rdzv-id", f"ember-group-{group}", *(["-m"] if module else []), script,
               *script_args]  # fmt: skip
    environment = {**os.environ, "EMBER_REPLICA_GROUP": str(group), "EMBER_REPLICA_GROUPS": str(groups),
                   "TORCHFT_LIGHTHOUSE": lighthouse}  # fmt: skip
    return subprocess.Popen(command, env=environment, preexec_fn=die_with_parent)  # the group ends with the launcher
