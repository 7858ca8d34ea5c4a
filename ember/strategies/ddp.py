"""Distributed data parallel: one process per device, gradients averaged by ``DistributedDataParallel``."""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable
from datetime import timedelta
from itertools import chain
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ember.launch import (
    ClusterEnvironment,
    close_process_group,
    ctrl_c_ends_at_once,
    die_with_parent,
    listening_socket,
    loopback_interface,
    relaunch,
    script_target,
)
from ember.strategies.launchers import start_workers
from ember.strategies.strategy import _NO_CONTEXT, ReduceOp, Strategy, T, WorkerResults
from ember.strategies.watchdog import Watchdog

#: How long a rank waits for the others in a collective when no timeout is given.
DEFAULT_TIMEOUT = timedelta(minutes=10)
_BACKSTOP = timedelta(seconds=30)

if TYPE_CHECKING:
    from ember.module import Module


class _StepForward(nn.Module):
    """Makes a wrapper's ``forward`` run one of the module's steps.

    DDP averages gradients through hooks it arms in its own ``forward``; a training step called on
    the bare module would silently train each rank on its own gradients.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, step_name: str, *args: Any) -> Any:
        return getattr(self.module, step_name)(*args)


class ParallelStrategy(Strategy):
    """One process per device on one or more machines, joined in a process group: the layout, launching
    and communication that every multi-process strategy shares. Subclasses decide how the module is
    wrapped or split.

    Args:
        process_group_backend: "nccl", "gloo", ... (default: NCCL on CUDA, Gloo on CPU).
        timeout: how long a rank may wait for the others in a collective (default 10 minutes, or the
            Trainer's ``timeout``); then the run ends, naming the rank that did not arrive.
    """

    #: How the workers start without a launcher: "popen" re-runs the script in them (in ``ember run``), "spawn",
    #: "fork" and "forkserver" start them from inside this process (see ``launch``).
    start_method = "popen"

    def __init__(self, *, process_group_backend: str | None = None, timeout: timedelta | None = None) -> None:
        super().__init__()
        self.process_group_backend = process_group_backend
        self.timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
        self._watchdog: Watchdog | None = None

    def configure(self, **flags: Any) -> None:
        timeout = flags.get("timeout")
        super().configure(**flags)
        if timeout is not None:  # the Trainer's, which takes precedence
            self.timeout = timeout

    # ----------------------------------------------------------------------------- layout
    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """The processes on each machine, one per device (Lightning's name)."""
        return len(self.parallel_devices)

    @property
    def world_size(self) -> int:
        if self.environment is not None:
            return self.environment.world_size
        return self.num_nodes * len(self.parallel_devices)

    @property
    def global_rank(self) -> int:
        return self.environment.global_rank if self.environment is not None else 0

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank if self.environment is not None else 0

    @property
    def node_rank(self) -> int:
        return self.environment.node_rank if self.environment is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -------------------------------------------------------------------------- lifecycle
    def launch(self, function: Callable[..., T], *args: Any, results: WorkerResults | None = None) -> T:
        """Run ``function(*args)`` here if a launcher started this process. Otherwise start the job's processes: a
        script run with ``start_method="popen"`` (``strategy="ddp"``) is re-run in them under ``ember run``, this
        process replaced; any other start (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``, or a process that no
        script could re-run: a notebook, ``python -c``, a test session) starts them from inside this process,
        which waits for them and returns rank zero's value, with ``results`` brought back."""
        if self.environment is not None or self.world_size == 1:
            return function(*args)
        if self.num_nodes > 1:
            raise RuntimeError(
                f"num_nodes={self.num_nodes}: start a multi-node job with a launcher on every node "
                "(ember run --nnodes N --node-rank R --rdzv-endpoint HOST:PORT script.py, or srun)"
            )
        target = script_target()
        if self.start_method == "popen" and target is not None:
            relaunch(len(self.parallel_devices), target)
        return start_workers(self, self.start_method, function, args, results)

    def setup_environment(self) -> None:
        import torch.distributed as dist

        environment = self.environment
        if environment is None and self.world_size > 1:
            raise RuntimeError(f"strategy={self.name!r} runs in processes started by a launcher; call launch() first")
        if environment is not None and environment.launcher == "torchelastic":
            die_with_parent()
        super().setup_environment()
        if dist.is_initialized():
            return
        backend = self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        self.process_group_backend = backend  # what the run uses, as Lightning's reads once set up
        # The backend's own timeout is a backstop: the watchdog names the missing rank and ends the run first.
        options: dict[str, Any] = {"backend": backend, "timeout": self.timeout + _BACKSTOP}
        if backend == "nccl":
            options["device_id"] = self.root_device
        if environment is None:
            # A group of one process, so that the strategy's collectives and device meshes work without a launcher.
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **options)
        else:
            with ctrl_c_ends_at_once():
                _meet_the_other_ranks(environment, options, self.timeout)
        atexit.register(close_process_group)
        if self.world_size > 1:
            default_store: Any = dist.distributed_c10d._get_default_store()
            store = default_store.clone()  # the watchdog's own connection: the main thread may be using its
            self._watchdog = Watchdog(store, self.global_rank, self.world_size, self.timeout.total_seconds(),
                                      progress=lambda: self.batches_moved)  # fmt: skip
            self._watchdog.start()

    def describe_position(self, position: Callable[[], str]) -> None:
        if self._watchdog is not None:
            self._watchdog.position = position

    def announce_failure(self, error: BaseException) -> str | None:
        if self._watchdog is None:
            return None
        try:
            return self._watchdog.announce_failure(error)
        except Exception:  # the failure itself matters more than telling of it
            return None

    # ---------------------------------------------------------------------- communication
    def reduce(self, tensor: torch.Tensor, group: Any = None, reduce_op: ReduceOp = "mean") -> torch.Tensor:
        import torch.distributed as dist

        ops = {"mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}  # fmt: skip
        op = str(getattr(reduce_op, "name", reduce_op)).lower()  # torch's ReduceOp.SUM too, as Lightning takes it
        if op not in ops:
            raise ValueError(f"reduce_op={reduce_op!r} is not a reduction: use one of {', '.join(map(repr, ops))}")
        reduced = torch.as_tensor(tensor, device=self.root_device).detach().clone()
        dist.all_reduce(reduced, op=ops[op], group=group)
        return reduced / dist.get_world_size(group) if op in ("mean", "avg") else reduced

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        import torch.distributed as dist

        group = dist.group.WORLD if group is None else group
        tensor = torch.as_tensor(tensor, device=self.root_device).contiguous()
        if sync_grads:  # gradients flow back to each rank's own tensor
            from torch.distributed.nn.functional import all_gather

            return torch.stack(all_gather(tensor, group=group))
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        import torch.distributed as dist

        holder = [obj]
        dist.broadcast_object_list(holder, src=src, device=self.root_device)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def barrier(self, name: str | None = None) -> None:
        import torch.distributed as dist

        if self.root_device.type == "cuda":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()


_START_METHODS = ("popen", "spawn", "fork", "forkserver")


class DDPStrategy(ParallelStrategy):
    """One process per device on one or more machines; NCCL between GPUs, Gloo between CPU processes.

    Args:
        find_unused_parameters: let DDP cope with parameters that get no gradient in some steps (slower).
        static_graph: promise that the set of used parameters never changes (enables optimizations).
        gradient_as_bucket_view: gradients share memory with the communication buckets (saves memory).
        bucket_cap_mb: size of the gradient buckets that are all-reduced together.
        process_group_backend: "nccl", "gloo", ... (default: NCCL on CUDA, Gloo on CPU).
        timeout: how long a rank may wait for the others (see ``ParallelStrategy``).
        start_method: how the workers start without a launcher: "popen" (``strategy="ddp"``) re-runs the script in
            them; "spawn" (``"ddp_spawn"``), "fork" (``"ddp_fork"``, ``"ddp_notebook"``) and "forkserver" start
            them from inside the caller, which gets rank zero's results back (see ``ParallelStrategy.launch``).
    """

    name = "ddp"

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        bucket_cap_mb: float | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: str = "popen",
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if start_method not in _START_METHODS:
            raise ValueError(f"DDPStrategy(start_method={start_method!r}): choose one of {_START_METHODS}")
        self.start_method = start_method
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_mb = bucket_cap_mb
        # Under manual optimization gradients are averaged in backward(), unless the user is accumulating.
        self._manual_sync = False
        self._manual_sync_off = _Switch()

    # -------------------------------------------------------------------------- lifecycle
    def wrap_for_training(self, module: Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        if self.sync_batchnorm:
            nn.SyncBatchNorm.convert_sync_batchnorm(module)
        if not module.automatic_optimization:
            # The module steps its optimizers inside training_step, so its backward passes would run inside
            # DDP's forward, before DDP is ready to average them: they are averaged in backward() instead.
            if not self._manual_sync:
                self._broadcast_from_rank_zero(module)
                self._manual_sync = True
            return module
        self._manual_sync = False
        if isinstance(self.model, DistributedDataParallel):
            return self.model
        options: dict[str, Any] = {}
        if self.bucket_cap_mb is not None:
            options["bucket_cap_mb"] = self.bucket_cap_mb
        # A module that the user spread over several GPUs stays there, and DDP then takes no device_ids.
        one_gpu = self.root_device.type == "cuda" and self._input_device is None
        return DistributedDataParallel(
            _StepForward(module),
            device_ids=[self.root_device.index] if one_gpu else None,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            **options,
        )

    def training_memory(self, module: Module) -> int:
        if self.gradient_as_bucket_view or not module.automatic_optimization:
            return 0  # the gradients are views of the buckets, or there is no DDP wrapper
        return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)

    def _broadcast_from_rank_zero(self, module: nn.Module) -> None:
        """Start every rank from rank zero's parameters and buffers (what DDP's constructor does)."""
        import torch.distributed as dist

        for tensor in chain(module.parameters(), module.buffers()):
            dist.broadcast(tensor.data, src=0)

    # ------------------------------------------------------------------------------ steps
    def step(self, name: str, *args: Any) -> Any:
        with self.precision.forward_context():
            if isinstance(self.model, nn.parallel.DistributedDataParallel):
                return self.model(name, *args)  # through DDP, which arms the gradient all-reduce
            if self._manual_sync and name == "training_step":
                self._broadcast_buffers()  # what DDP's forward does first: BatchNorm statistics are rank zero's
            return getattr(self._module, name)(*args)

    def _broadcast_buffers(self) -> None:
        """Rank zero's buffers on every rank: one broadcast per device and dtype."""
        import torch.distributed as dist

        assert self._module is not None
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for buffer in self._module.buffers():
            groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        for buffers in groups.values():
            flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
            dist.broadcast(flat, src=0)
            chunks = flat.split([buffer.numel() for buffer in buffers])
            torch._foreach_copy_(buffers, [chunk.view_as(buffer) for chunk, buffer in zip(chunks, buffers)])

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None) -> None:
        super().backward(loss, backward)
        if self._manual_sync and not self._manual_sync_off.active:
            self.sync_gradients()

    def no_sync(self, skip_gradient_sync: bool = True) -> contextlib.AbstractContextManager:
        if not skip_gradient_sync:
            return _NO_CONTEXT
        if self._manual_sync:
            return self._manual_sync_off
        if isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return _NO_CONTEXT

    @property
    def averages_split_gradients(self) -> bool:
        return True

    def sync_gradients(self) -> None:
        import torch.distributed as dist

        assert self._module is not None
        gradients = [p.grad for p in self._module.parameters() if p.grad is not None]
        if not gradients:
            return
        flat = torch.cat([gradient.reshape(-1) for gradient in gradients])  # one collective, not one per tensor
        dist.all_reduce(flat)
        flat /= self.world_size
        chunks = flat.split([gradient.numel() for gradient in gradients])
        torch._foreach_copy_(gradients, [chunk.view_as(gradient) for chunk, gradient in zip(chunks, gradients)])


class _Switch(contextlib.AbstractContextManager):
    """A reusable context manager that says whether it is entered (nesting counts)."""

    def __init__(self) -> None:
        self._depth = 0

    @property
    def active(self) -> bool:
        return self._depth > 0

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1


def _listen_on_loopback(environment: ClusterEnvironment) -> None:
    """On one machine, the process group's own sockets listen on 127.0.0.1 too, where the rendezvous is:
    the store Ember serves for SLURM and mpirun jobs, or a launcher's store at a loopback address."""
    ember_store = environment.launcher != "torchelastic"
    if environment.single_machine and (ember_store or environment.main_address in ("127.0.0.1", "localhost")):
        interface = loopback_interface()
        if interface is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def _meet_the_other_ranks(environment: ClusterEnvironment, options: dict[str, Any], timeout: timedelta) -> None:
    import torch.distributed as dist

    _listen_on_loopback(environment)
    if environment.launcher == "torchelastic":
        dist.init_process_group(**options)  # rendezvous through the agent's store (env://)
    else:
        store = _make_store(environment, timeout)
        dist.init_process_group(store=store, rank=environment.global_rank, world_size=environment.world_size, **options)


def _make_store(environment: ClusterEnvironment, timeout: timedelta) -> Any:
    """The rendezvous store of a job started by SLURM or mpirun: rank zero serves it, the others connect.

    On one machine it listens on 127.0.0.1 only (nothing outside the machine can reach it) and every rank
    dials that address, not the node's name: that may resolve to a LAN address where nothing listens.
    """
    from torch.distributed import TCPStore

    is_server = environment.global_rank == 0
    host = "127.0.0.1" if environment.single_machine else environment.main_address
    options: dict[str, Any] = {}
    if is_server and environment.single_machine:
        server = listening_socket(host, environment.main_port)
        options["master_listen_fd"] = server.fileno()
        _keep_alive.append(server)
    return TCPStore(host, environment.main_port, environment.world_size, is_server, timeout, **options)


_keep_alive: list[Any] = []
