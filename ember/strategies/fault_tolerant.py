"""Fault tolerance on torchft: data-parallel replica groups that go on training when one of them fails.

``ember run --replica-groups G`` starts torchft's lighthouse and G replica groups, each its own torchrun job
of N processes. Each optimizer step of a group is:

1. a quorum: the lighthouse says which groups are alive; a group that is behind (a restarted one) takes the
   training state of a live peer here, over HTTP, before it runs the step;
2. the forward and backward passes, then one allreduce of the flat gradients: within the group over its own
   process group, then across the live groups over torchft's managed process group. An allreduce that fails
   (a peer died) is reported to torchft's manager, never raised: a healthy group must not die of a peer's
   failure;
3. a vote: the optimizer steps (and the schedulers and the loop's counters move) only when the step commits.

torchft is imported when a fit starts, so that ``import ember`` stays cheap.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import signal
import socket
import sys
import time
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ember.checkpoint.state import restore_training_state, training_state
from ember.exceptions import MisconfigurationException
from ember.seed import set_random_state
from ember.strategies.ddp import DDPStrategy
from ember.strategies.strategy import StepCalls

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

#: The package and version ``pip install 'ember[ft]'`` installs (the Manager API Ember is written against).
TORCHFT_REQUIREMENT = "torchft-nightly==2026.10.26"


@dataclasses.dataclass(frozen=True)
class FaultTolerance:
    """``Trainer(fault_tolerance=FaultTolerance(...))``: how the replica groups that ``ember run --replica-groups``
    starts tolerate failures (without that launcher there are no replica groups, and it is not used)."""

    min_replicas: int = 1
    """Replica groups that must take part in a step for it to commit; with fewer alive, training waits for more
    (up to ``quorum_timeout``)."""

    timeout: float = 60.0
    """Seconds the gradient allreduce, the commit vote or a state transfer to a healing group may take; an
    allreduce that takes longer drops the step."""

    quorum_timeout: float = 60.0
    """Seconds a step may wait for its quorum (the lighthouse's answer, and ``min_replicas`` groups alive)."""

    def __post_init__(self) -> None:
        if isinstance(self.min_replicas, bool) or not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise MisconfigurationException(f"FaultTolerance(min_replicas={self.min_replicas!r}): expected an int >= 1")
        for name in ("timeout", "quorum_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise MisconfigurationException(f"FaultTolerance({name}={value!r}): expected a number of seconds > 0")


class FaultTolerantDDPStrategy(DDPStrategy):
    """``strategy="ddp"`` (or ``"auto"``) in a process that ``ember run --replica-groups`` started: DDP within a
    replica group, torchft's quorum, healing and commit vote across the groups (see the module's docstring).

    The module is not wrapped in ``DistributedDataParallel``: its gradients are averaged after the backward pass
    in one flat allreduce per step, whose buffer layout (the parameters' order) is the same in every group, a
    restarted one included (DDP reorders its buckets after the first step).
    """

    heals_from_peers = True

    def __init__(self, fault_tolerance: FaultTolerance | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.fault_tolerance = fault_tolerance or FaultTolerance()
        self._manager: Any = None  # torchft's Manager, for the fit in progress
        self._replica_groups_pg: Any = None  # the process group torchft reconfigures to each quorum's groups
        self._quorum_held = False  # a quorum was reached for the step under way (its vote has not been taken)
        self._trainer: Trainer | None = None
        self._joined = False  # the first quorum of the fit is done: later heals happen in the middle of a run
        self._lighthouse_lost = False

    # ----------------------------------------------------------------------------- layout
    @property
    def replica_group(self) -> int:
        return self.environment.replica_group if self.environment is not None else 0

    @property
    def num_replica_groups(self) -> int:
        return self.environment.num_replica_groups if self.environment is not None else 1

    @property
    def is_global_zero(self) -> bool:
        # Replica group 0 writes the logs and checkpoints: the groups hold the same state after each commit.
        return self.global_rank == 0 and self.replica_group == 0

    @property
    def training_sampler_kwargs(self) -> dict[str, int]:
        # Each group trains on its own shard; evaluation is sharded within a group only, so each evaluates it all.
        return {"num_replicas": self.world_size * self.num_replica_groups,
                "rank": self.replica_group * self.world_size + self.global_rank}  # fmt: skip

    # -------------------------------------------------------------------------- lifecycle
    def wrap_for_training(self, module: Module) -> nn.Module:
        if not module.automatic_optimization:
            raise MisconfigurationException(
                "ember run --replica-groups steps the optimizer only when the replica groups agree on the step, which "
                "needs automatic optimization; this module sets automatic_optimization = False"
            )
        if self.sync_batchnorm:
            nn.SyncBatchNorm.convert_sync_batchnorm(module)
        if not self._manual_sync:  # the gradients are averaged in backward(), as under manual optimization
            self._broadcast_from_rank_zero(module)
            self._manual_sync = True
        return module

    def join_replica_groups(self, trainer: Trainer) -> None:
        from torchft import Manager

        # It logs each error it recovers from with its traceback; a dropped step is told in one line instead.
        logging.getLogger("torchft.manager").setLevel(logging.CRITICAL)
        # torch warns of the read-only buffer each tensor of a healing state arrives in; it is only read.
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        environment = self.environment
        assert environment is not None and environment.lighthouse is not None  # how this strategy was chosen
        options = self.fault_tolerance
        timeout = timedelta(seconds=options.timeout)
        self._trainer, self._joined, self._quorum_held, self._lighthouse_lost = trainer, False, False, False
        self._replica_groups_pg = self._replica_process_group(timeout)
        self._manager = Manager(
            pg=self._replica_groups_pg,
            load_state_dict=self._load_live_state,
            state_dict=self._live_state,
            min_replica_size=options.min_replicas,
            use_async_quorum=True,  # the quorum is awaited in _await_quorum, which heals before the step
            timeout=timeout,
            quorum_timeout=timedelta(seconds=options.quorum_timeout),
            connect_timeout=timeout,
            rank=self.global_rank,
            world_size=self.world_size,
            lighthouse_addr=environment.lighthouse,
            replica_id=f"ember_group_{self.replica_group}",
            hostname=environment.main_address,
        )
        self._manager.load_state_dict({"step": trainer.global_step, "batches_committed": 0})
        # Before the first batch is drawn, so that a healed group reads the data from its peer's place. A job that
        # starts waits for all its groups (up to quorum_timeout), so that they start together; a restarted group
        # needs a live peer to heal from.
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            self._start_quorum(wanted=self.num_replica_groups, required=options.min_replicas)
        else:
            self._start_quorum(wanted=max(options.min_replicas, min(2, self.num_replica_groups)))
        self._joined = True

    def _replica_process_group(self, timeout: timedelta) -> Any:
        """The process group across the replica groups, that torchft reconfigures at each new quorum: NCCL on GPUs
        unless ``process_group_backend="gloo"`` (NCCL refuses groups that share one GPU), Gloo on CPUs."""
        from torchft import ProcessGroupGloo, ProcessGroupNCCL

        nccl = self.root_device.type == "cuda" and self.process_group_backend in (None, "nccl")
        return ProcessGroupNCCL(timeout) if nccl else ProcessGroupGloo(timeout)

    def teardown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = self._replica_groups_pg = None
        super().teardown()
        if self._lighthouse_lost:
            # The checkpoint is saved; torchft's thread still waits on the lost lighthouse, and the interpreter's
            # exit would wait for it (quorum_timeout): exit now, with the status of a stop on SIGTERM.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)

    # -------------------------------------------------------------------- the live state
    def _live_state(self) -> dict[str, Any]:
        """What a healing group takes from this one: the state a checkpoint holds (model, optimizers, schedulers,
        the loop's position, callbacks), with this rank's random state. torchft calls it while the training
        thread waits for the quorum, at the start of a step."""
        assert self._trainer is not None
        return training_state(self._trainer, weights_only=False, gather=False)

    def _load_live_state(self, state: dict[str, Any]) -> None:
        trainer = self._trainer
        assert trainer is not None
        # torchft pairs each rank of the healing group with the same rank of its source: the state is this rank's.
        own = next(iter(state["ranks"].values()))
        state["ranks"] = dict.fromkeys(range(self.world_size), own)
        restore_training_state(trainer, state, f"a live peer's state (global step {state['global_step']})")
        if self._joined:  # in the middle of a run: the random streams continue from the peer's now
            random_state = trainer.fit_loop.state.take_random_state()
            if random_state is not None:
                set_random_state(random_state)
        if trainer.global_step:  # (at the start, the groups all take group 0's initial state)
            print(f"[replica group {self.replica_group}, rank {self.global_rank}]: healed from a live peer at global "
                  f"step {trainer.global_step}", file=sys.stderr, flush=True)  # fmt: skip

    # ------------------------------------------------------------------------------ steps
    def step(self, name: str, *args: Any) -> Any:
        if name == "training_step" and not self._quorum_held:
            self._start_quorum()
        return super().step(name, *args)

    def _start_quorum(self, wanted: int = 0, required: int = 0) -> None:
        """Join the quorum of this step (healing from a live peer when this group is behind), waiting while fewer
        than ``wanted`` groups (default ``min_replicas``) are alive, then, after ``quorum_timeout``, going on with
        ``required`` (default: as many as wanted) or raising."""
        manager, options = self._manager, self.fault_tolerance
        wanted = wanted or options.min_replicas
        required = required or wanted
        deadline = time.monotonic() + options.quorum_timeout
        while True:
            try:
                manager.start_quorum()
                self._await_quorum()
            except Exception as error:
                self._lose_lighthouse(error)
                break
            alive = self._groups_in_quorum()
            out_of_time = time.monotonic() > deadline
            if alive >= wanted or (out_of_time and alive >= required):
                break
            if out_of_time:
                raise RuntimeError(
                    f"fault tolerance: {alive} replica group(s) alive for {options.quorum_timeout} s, fewer than the "
                    f"{required} needed (FaultTolerance(min_replicas=...), and a live peer for a restarted group)"
                )
            time.sleep(0.1)
        self._quorum_held = True

    def _groups_in_quorum(self) -> int:
        """The groups of the quorum just reached, those healing included (torchft's ``num_participants()`` leaves
        them out). The groups of one quorum must decide alike whether it is enough: a healing group goes on into the
        step's allreduce, where a peer that asked for another quorum instead would leave it waiting until timeout."""
        if self._manager.errored() is not None:  # its process group did not form: the step is dropped anyway
            return int(self._manager.num_participants())
        return int(self._replica_groups_pg.size())

    def _await_quorum(self) -> None:
        """Wait for the quorum torchft forms on its own thread, then heal when this group is behind, as torchft's
        synchronous quorum does (``use_async_quorum=False``). Waited for here, since torchft's wait has no timeout:
        a quorum asked of a lighthouse that is gone fails only after ``quorum_timeout``, too late for a checkpoint
        (a launcher gives its workers 30 s to stop), so the lighthouse is probed while a quorum takes long."""
        manager = self._manager
        quorum = manager._quorum_future
        while not concurrent.futures.wait([quorum], timeout=1.0).done:
            self._probe_lighthouse()
        quorum.result()  # what the quorum raised
        if manager._healing:
            manager._apply_pending_state_dict()
            manager._healing = False  # this step then runs on the peer's state, its gradients left out of the average

    def _probe_lighthouse(self) -> None:
        """Raise ``ConnectionError`` when nothing listens at the lighthouse's address."""
        environment = self.environment
        assert environment is not None and environment.lighthouse is not None
        host, _, port = environment.lighthouse.removeprefix("http://").rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
            pass

    def _lose_lighthouse(self, error: Exception) -> None:
        """No quorum: the lighthouse is gone (or unreachable). Once training runs, this step is dropped and the
        Trainer stops at its end, saving a checkpoint as it does on SIGTERM; before, there is nothing to save."""
        environment = self.environment
        assert environment is not None
        where = f"the lighthouse at {environment.lighthouse}"
        if not self._joined:
            raise RuntimeError(f"fault tolerance: no quorum from {where}: {error}") from error
        print(f"[replica group {self.replica_group}, rank {self.global_rank}]: no quorum from {where} ({error}): "
              "stopping at the end of this step, with a checkpoint", file=sys.stderr, flush=True)  # fmt: skip
        self._lighthouse_lost = True  # the step does not commit
        self._manager.report_error(error)  # (its allreduce is skipped)
        signal.raise_signal(signal.SIGTERM)

    def sync_gradients(self) -> None:
        import torch.distributed as dist

        assert self._module is not None
        gradients = [p.grad for p in self._module.parameters() if p.grad is not None]
        if not gradients:
            return
        flat = torch.cat([gradient.reshape(-1) for gradient in gradients])
        if self.world_size > 1:  # within the group first: a peer's failure cannot break this one
            dist.all_reduce(flat)
            flat /= self.world_size
        try:
            # Averaged over the groups taking part; on an error (a peer died), wait() says False and torchft's
            # manager keeps the error, so that the vote drops the step.
            self._manager.allreduce(flat).wait()
        except Exception as error:  # whatever goes wrong across groups drops the step, never ends this group
            self._manager.report_error(error)
        chunks = flat.split([gradient.numel() for gradient in gradients])
        torch._foreach_copy_(gradients, [chunk.view_as(gradient) for chunk, gradient in zip(chunks, gradients)])

    def step_calls(self) -> StepCalls:
        return dataclasses.replace(super().step_calls(), commit=self._commit)

    def _commit(self) -> bool:
        """The vote on the step under way: whether every rank of this group saw its gradients averaged without
        error, and enough groups took part. The optimizer steps only when it says so."""
        self._quorum_held = False
        if self._lighthouse_lost:  # no quorum, nothing to vote on: the Trainer stops at the end of this step
            return False
        if self._manager.should_commit():
            return True
        error = self._manager.errored()
        why = str(error.original_exception).splitlines()[0] if error is not None else "the group's vote"
        print(f"[replica group {self.replica_group}, rank {self.global_rank}]: step {self._manager.current_step() + 1} "
              f"dropped ({why})", file=sys.stderr, flush=True)  # fmt: skip
        return False


def torchft_problem() -> str | None:
    """Why ``ember run --replica-groups`` cannot run here, in one line (None: it can)."""
    from importlib import metadata

    name, _, wanted = TORCHFT_REQUIREMENT.partition("==")
    try:
        found = metadata.version(name)
    except metadata.PackageNotFoundError:
        found = None
    if found == wanted:
        return None
    return (f"--replica-groups needs {TORCHFT_REQUIREMENT} "
            f"({'found ' + found if found else 'not installed'}): pip install 'ember[ft]'")  # fmt: skip
