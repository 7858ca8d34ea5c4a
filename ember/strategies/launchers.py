"""Workers started from inside the running process, as Lightning's ``ddp_spawn``, ``ddp_fork`` and ``ddp_notebook``
start them: the caller waits for them, then goes on with rank zero's results.

``strategy="ddp"`` re-runs a script in the workers of ``ember run`` instead (``ember.launch.relaunch``); a process
that no script could re-run (a notebook, ``python -c``, a test session) starts its workers here too. The workers
meet at a store that the caller serves on 127.0.0.1, as torchrun's workers meet at their agent's.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from ember.exceptions import MisconfigurationException
from ember.launch import close_process_group, detect_environment, die_with_parent, listening_socket, threads_per_process
from ember.lightning_compat import install, is_installed
from ember.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from ember.strategies.strategy import Strategy, WorkerResults

#: How long the other workers have to stop by themselves once one has failed. The strategy's watchdog tells
#: them within seconds once their process group is up; before that, they would wait for the missing rank.
GRACE_SECONDS = 10.0

_Report = tuple[Any, ...]  # how a worker ended, its kind first: see _work and _gather


class WorkerTraceback(Exception):
    """Where a worker raised: the cause of the exception the caller raises in its place."""


def start_workers(
    strategy: Strategy, start_method: str, function: Callable[..., Any], args: Sequence[Any],
    results: WorkerResults | None,
) -> Any:  # fmt: skip
    """Run ``function(*args)`` in one new process per device of ``strategy``, wait for them all, and return rank
    zero's value (``results`` adopted here). ``start_method`` is multiprocessing's ("spawn", "fork" or
    "forkserver"), or "popen": spawn where the main module can be imported again, fork where it cannot."""
    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    start_method = _checked(start_method)
    job = (strategy, function, tuple(args), results)
    # Forked workers have the job already. The others start from nothing and get it pickled by value (their
    # tensors are copies: torch's pickler would share them with this process), the Lightning import hook first
    # if this process has it, so that its names unpickle as Ember's.
    sent = job if start_method == "fork" else _pickled(job, start_method)
    if start_method == "fork":
        # DistributedDataParallel's constructor imports torch._dynamo, seconds of work: done once here, every
        # forked worker of this call and of the later ones has it already.
        import torch._dynamo  # noqa: F401
    # A group of this process alone, left open by an earlier stage (a sharded strategy keeps its own): forked
    # workers would inherit it and wait on it forever; the stages after these workers open a new one.
    close_process_group()
    context = mp.get_context(start_method)
    size = len(strategy.parallel_devices)
    server = listening_socket()
    port = server.getsockname()[1]
    processes: list[BaseProcess] = []
    readers: list[Connection] = []
    try:
        for rank in range(size):
            reader, writer = context.Pipe(duplex=False)
            arguments = (rank, size, port, sent, is_installed(), writer)
            # Every start method's context has Process (typeshed's BaseContext does not say so).
            name = f"ember-rank{rank}"
            if is_installed() and start_method != "fork":
                name = _HookName(name)
            process = context.Process(target=_work, args=arguments, name=name)  # type: ignore[attr-defined]
            process.start()
            writer.close()  # the worker holds the other end: the pipe ends with it
            processes.append(process)
            readers.append(reader)
        # Served once the workers are started (a forked worker must not inherit the server's thread); the store
        # owns the socket from then on.
        store = TCPStore("127.0.0.1", port, None, True, wait_for_workers=False, multi_tenant=True,
                         master_listen_fd=server.detach())  # fmt: skip
        reports = _gather(processes, readers)
        del store
    finally:
        _end(processes)
        server.close()  # if the store never took it
    return _outcome(reports, processes, results)


class _HookName(str):
    """A worker's name that installs the Lightning import hook where it is unpickled. A spawned worker reads its
    name, with multiprocessing's other preparation data, before it runs the caller's main script again: a script
    run under the hook (``import ember.lightning`` then ``runpy.run_path``) must import Lightning's names from
    Ember there too, before the job (which installs it too) arrives."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_hook_name, (str(self),))


def _hook_name(name: str) -> str:
    install()
    return name


def _checked(start_method: str) -> str:
    """The start method to use, or an error saying why the workers could not start that way."""
    import torch

    main_importable = _main_importable()
    if start_method == "popen":  # the script-running start, where no script can be re-run
        start_method = "spawn" if main_importable else "fork"
    if start_method != "fork" and not main_importable:
        raise MisconfigurationException(
            f"start_method={start_method!r} starts the workers from nothing, and they import the classes they are "
            "sent; those of this session (a notebook, python -c) cannot be imported: use strategy='ddp_notebook', "
            "which forks the workers, or put the code in a file"
        )
    if start_method == "fork" and torch.cuda.is_initialized():
        raise MisconfigurationException(
            "CUDA is in use in this process already, and forked workers cannot use it: use strategy='ddp_spawn', "
            "or leave CUDA alone before fit (the module is moved to the GPU in the workers)"
        )
    return start_method


def _main_importable() -> bool:
    """Whether a spawned process can import this process's main module (and the classes defined there)."""
    main = sys.modules["__main__"]
    return getattr(main, "__file__", None) is not None or getattr(main, "__spec__", None) is not None


def _pickled(job: tuple[Any, ...], start_method: str) -> bytes:
    try:
        return pickle.dumps(job)
    except (pickle.PicklingError, TypeError, AttributeError) as error:
        raise MisconfigurationException(
            f"the workers of start_method={start_method!r} get the Trainer, the module and the data pickled, but "
            f"{error}: define such objects at the top level of a module, or fork the workers (strategy='ddp_fork')"
        ) from error


def _work(
    rank: int, size: int, port: int, sent: bytes | tuple[Any, ...], lightning: bool, connection: Connection
) -> None:
    """A worker: join the job as rank ``rank`` of ``size``, run the function, and send the caller one report:
    ``("returned", (value, collected) on rank zero, else None)``, ``("raised", pickled exception or None,
    traceback)`` or ``("exited", status)``."""
    die_with_parent()
    # torchrun's variables: the strategy reads its rank from them, and every rank of its process group is a
    # client of the caller's store (TORCHELASTIC_USE_AGENT_STORE), as of the agent's in a torchrun job.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size), LOCAL_WORLD_SIZE=str(size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")  # fmt: skip
    rank_zero_only.rank = rank  # type: ignore[attr-defined]
    report: _Report
    try:
        if "OMP_NUM_THREADS" not in os.environ:  # each of the workers would otherwise start a thread per core
            import torch

            torch.set_num_threads(threads_per_process(size))
        if lightning and isinstance(sent, bytes):
            install()
        strategy, function, args, results = pickle.loads(sent) if isinstance(sent, bytes) else sent
        strategy.environment = detect_environment()
        value = function(*args)
        collected = results.collect() if results is not None else None
        report = ("returned", (value, collected) if rank == 0 else None)
    except BaseException as error:  # an exit too: the caller tells how the job ended
        report = _failure(error)
    close_process_group()
    try:
        data = pickle.dumps(report)
    except Exception as error:  # a value that cannot be pickled
        data = pickle.dumps(_failure(RuntimeError(f"rank {rank}'s results cannot be sent back: {error}")))
    connection.send_bytes(data)
    # The process ends now, and needs no garbage collection: a spawned worker's interpreter would otherwise
    # spend seconds collecting torch's objects at exit while the caller waits.
    gc.freeze()


def _failure(error: BaseException) -> _Report:
    if isinstance(error, (SystemExit, KeyboardInterrupt)):
        status = error.code if isinstance(error, SystemExit) else 128 + signal.SIGINT
        return ("exited", status if isinstance(status, int) else 1)
    text = "".join(traceback.format_exception(error))
    try:
        return ("raised", pickle.dumps(error), text)
    except Exception:  # the exception cannot be pickled: the caller raises its traceback
        return ("raised", None, text)


def _gather(processes: Sequence[BaseProcess], readers: Sequence[Connection]) -> list[tuple[int, _Report]]:
    """The workers' reports, in the order they came; ``("died",)`` for a worker that ended without one, and
    ``("killed",)`` for one killed here. Once one has failed, the others have ``GRACE_SECONDS`` to stop by
    themselves; then they are killed."""
    from multiprocessing.connection import wait

    reports: list[tuple[int, _Report]] = []
    waiting = {reader: rank for rank, reader in enumerate(readers)}
    deadline, silent = math.inf, ("died",)
    while waiting:
        timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
        ready = cast("list[Connection]", wait(list(waiting), timeout))
        if not ready:  # the grace period is over
            for process in processes:
                if process.is_alive():
                    process.kill()
            deadline, silent = math.inf, ("killed",)
        for reader in ready:
            rank = waiting.pop(reader)
            try:
                report = pickle.loads(reader.recv_bytes())
            except EOFError:  # the worker ended without a report
                report = silent
            reports.append((rank, report))
            if report[0] != "returned" and deadline == math.inf and silent[0] == "died":
                deadline = time.monotonic() + GRACE_SECONDS
    return reports


def _end(processes: Sequence[BaseProcess]) -> None:
    """Wait for the workers to exit (after their report, or after Ctrl-C here); kill those that do not."""
    for process in processes:
        process.join(GRACE_SECONDS)
        if process.is_alive():
            process.kill()
            process.join()


#: Which failure the caller tells, first to last: a worker that died (the others' errors are likely to be lost
#: connections to it), an exception, an exit (a rank that stopped because another failed exits with status 1),
#: a worker killed here. Among equals, the first to come.
_FIRST = {"died": 0, "raised": 1, "exited": 2, "killed": 3}


def _outcome(
    reports: list[tuple[int, _Report]], processes: Sequence[BaseProcess], results: WorkerResults | None
) -> Any:
    """Rank zero's value, with ``results`` adopted; or, when a worker failed, its exception, a ``RuntimeError`` for a
    worker that ended without a report, or the ``SystemExit`` a worker exited with (see ``_FIRST``)."""
    failures = [(rank, report) for rank, report in reports if report[0] != "returned"]
    if failures:
        if results is not None:
            results.fail()
        rank, report = min(failures, key=lambda failure: _FIRST[failure[1][0]])
        if report[0] == "exited":
            raise SystemExit(report[1])
        if report[0] == "raised":
            raise _unpickled(*report[1:]) from WorkerTraceback(f"on rank {rank}:\n{report[2]}")
        status = processes[rank].exitcode or 0
        how = f"was killed by {signal.Signals(-status).name}" if status < 0 else f"exited with status {status}"
        raise RuntimeError(f"the worker of rank {rank} {how} without a result; its output above may say why")
    value, collected = dict(reports)[0][1]
    if results is not None:
        results.adopt(collected)
    return value


def _unpickled(pickled: bytes | None, text: str) -> BaseException:
    """The worker's exception, or, where it cannot be rebuilt here, a ``RuntimeError`` with its last line."""
    try:
        return pickle.loads(pickled) if pickled is not None else RuntimeError(text.strip().splitlines()[-1])
    except Exception:  # an exception whose constructor takes other arguments than it keeps
        return RuntimeError(text.strip().splitlines()[-1])
