"""The Strategy base class: how a module is placed, stepped, synchronised and saved."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from itertools import chain
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import torch
from torch import nn

from ember import checkpoint as checkpoint_io
from ember._utils import move_to_device
from ember.checkpoint.writer import AsyncWriter, Writer
from ember.precision import Precision, build_precision

if TYPE_CHECKING:
    from ember.launch import ClusterEnvironment
    from ember.module import Module
    from ember.trainer import Trainer

ReduceOp = Literal["mean", "avg", "sum", "max", "min"]
T = TypeVar("T")
_NO_CONTEXT = contextlib.nullcontext()  # reusable, so entering it per step allocates nothing


@dataclasses.dataclass(frozen=True)
class StepCalls:
    """What a training step calls, as ``Strategy.step_calls`` binds it."""

    forward: Callable[..., Any]
    """``training_step(*args)``."""
    backward: Callable[[torch.Tensor], None]
    """Backpropagate a loss."""
    unscale: Callable[[torch.optim.Optimizer], None] | None
    """Bring an optimizer's gradients to their true scale (None: they are never scaled)."""
    optimizer_step: Callable[[torch.optim.Optimizer], Any]
    """Step an optimizer."""
    commit: Callable[[], bool] | None = None
    """Whether the step under way may apply its gradients, asked once its backward passes are done: fault
    tolerance's vote across replica groups (None: always)."""


class WorkerResults(Protocol):
    """What comes back to the caller's objects from processes that a strategy started from inside the caller
    (``ddp_spawn``, ...), besides the value of the function they ran: the caller's copies never ran it."""

    def collect(self) -> Any:
        """Called in every worker once the function has returned (a sharded state may need every rank); rank
        zero's value is brought back."""

    def adopt(self, collected: Any) -> None:
        """Called in the caller with rank zero's ``collect()``."""

    def fail(self) -> None:
        """Called in the caller when a worker failed, before its exception is raised there."""


class Strategy:
    """Runs the module on one device. Parallel strategies subclass it and override what differs.

    The Trainer hands the strategy its devices and precision once (``configure``); the loop then
    only calls the methods below and never asks which strategy it has.
    """

    name = "single_device"
    #: Whether a process that its launcher restarted takes its state from a live peer (fault tolerance) rather
    #: than from the last checkpoint.
    heals_from_peers = False
    #: Whether evaluation may run under ``torch.inference_mode`` (``Trainer(inference_mode=True)``); else it
    #: runs under ``torch.no_grad``.
    allows_inference_mode = True
    #: Whether each process holds every parameter whole (a copy of the model can be kept and averaged, as
    #: ``StochasticWeightAveraging`` does); the strategies that shard the model do not.
    holds_whole_model = True

    def __init__(self) -> None:
        self.device_type = "cpu"
        self.parallel_devices: list[torch.device] = [torch.device("cpu")]
        self.num_nodes = 1
        self.sync_batchnorm = False
        self.environment: ClusterEnvironment | None = None
        self.precision: Precision = Precision()
        #: ``torch.compile`` options for the module's forward (None: not compiled).
        self.compile_options: dict[str, Any] | None = None
        self._module: Module | None = None
        # What the steps run through: the module itself, or a wrapper around it (DDP, DataParallel).
        self.model: nn.Module | None = None
        self._batch_device: torch.device | None = None
        # Where batches go when the user placed the module's layers on devices themselves (else None).
        self._input_device: torch.device | None = None
        #: Batches moved to the device so far (by every loop).
        self.batches_moved = 0
        #: How checkpoint files are written: at once, or in the background (``async_checkpoint=True``).
        self.checkpoint_writer: Writer = Writer()

    # ----------------------------------------------------------------------------------- layout
    def configure(
        self,
        *,
        device_type: str,
        parallel_devices: Sequence[torch.device],
        num_nodes: int,
        precision: str | int,
        sync_batchnorm: bool,
        environment: ClusterEnvironment | None,
        compile_options: Mapping[str, Any] | None = None,
        timeout: timedelta | None = None,
        async_checkpoint: bool = False,
    ) -> None:
        """Receive the Trainer's resolved flags and the launcher's description of this process; called once.
        ``timeout`` is how long the processes of a parallel strategy wait for each other (one process has
        none to wait for)."""
        self.device_type = device_type
        self.parallel_devices = list(parallel_devices)
        self.num_nodes = num_nodes
        self.sync_batchnorm = sync_batchnorm
        self.environment = environment
        self.precision = build_precision(precision, self.root_device)
        self.compile_options = dict(compile_options) if compile_options is not None else None
        # A save at once from a GPU copies the state to host memory too: there a background save costs no more.
        at_once_when_busy = device_type == "cpu"
        self.checkpoint_writer = AsyncWriter(at_once_when_busy=at_once_when_busy) if async_checkpoint else Writer()

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[0]

    @property
    def module(self) -> Module:
        """The module ``setup_module`` set up (an error before that)."""
        if self._module is None:
            raise RuntimeError(f"{type(self).__name__}.setup_module() has not been called")
        return self._module

    @property
    def lightning_module(self) -> Module | None:
        """The module the latest stage ran, without the wrapper ``model`` may be (DDP's), or None before one: as
        Lightning's."""
        return self._module

    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def replica_group(self) -> int:
        """This process's replica group under fault tolerance (``ember run --replica-groups``), else 0."""
        return 0

    @property
    def num_replica_groups(self) -> int:
        """The replica groups of a fault-tolerant job, else 1."""
        return 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """``num_replicas`` and ``rank`` when each process must read its own shard of the data."""
        return None

    @property
    def training_sampler_kwargs(self) -> dict[str, int] | None:
        """The same for the training data (fault tolerance also shards it among the replica groups)."""
        return self.distributed_sampler_kwargs

    # ------------------------------------------------------------------------------- lifecycle
    def launch(self, function: Callable[..., T], *args: Any, results: WorkerResults | None = None) -> T:
        """Run ``function(*args)`` in every process of the job, and return its value here.

        One process runs it itself. A parallel strategy that no launcher started first starts the job's processes:
        it re-runs the script in them, this process replaced, or it starts them from inside this one, waits
        for them, and returns rank zero's value, with ``results`` brought back.
        """
        return function(*args)

    def setup_environment(self) -> None:
        """Select this process's device (and, for parallel strategies, join the process group)."""
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)

    def join_replica_groups(self, trainer: Trainer) -> None:
        """Under fault tolerance, join the replica groups before the first training batch, taking a live peer's
        state when this group is behind it (nothing to do otherwise)."""

    def setup_module(self, module: Module, training: bool) -> None:
        """Set ``module`` up for the steps; every strategy follows this template.

        Once per module: the precision's dtype (``"bf16-true"``, ...), then the strategy's own layout
        (``lay_out``: one device, a DDP replica, shards, a pipeline stage, ...), then what every strategy
        shares: where batches go, and ``torch.compile`` when asked. For training, the strategy may then
        wrap the module (``wrap_for_training``: DDP's gradient averaging).
        """
        if module is not self._module:
            self._module = module
            self.precision.convert_module(module)
            self.lay_out(module)
            device = self._input_device or self.root_device
            # CPU batches stay where the loader made them: a copy to the same device would cost per step.
            self._batch_device = device if device.type != "cpu" else None
            if self.compile_options is not None:
                for target in self.compile_targets(module):
                    # In place (nn.Module.compile): the module stays itself, so its state_dict keys carry no
                    # "_orig_mod." prefix and checkpoints load into an uncompiled module.
                    target.compile(**self.compile_options)
            self.model = module
        if training:
            self.model = self.wrap_for_training(module)

    def lay_out(self, module: Module) -> None:
        """Put the module where the strategy runs it: here, on its device.

        A module whose layers the user spread over devices is left where it is, and a module built on
        the meta device is allocated on the device and initialised with ``reset_parameters()``.
        """
        self._input_device = input_device(module)
        if self._input_device is None:
            if is_on_meta_device(module):
                materialize(module, self.root_device)
            else:
                module.to(self.root_device)

    def compile_targets(self, module: Module) -> list[nn.Module]:
        """The modules ``compile=`` compiles: the whole module (its forward is what the steps call)."""
        return [module]

    def wrap_for_training(self, module: Module) -> nn.Module:
        """What training steps run through (the module itself, or a wrapper such as DDP's); called at the
        start of every ``fit``."""
        return module

    @property
    def reuses_outputs(self) -> bool:
        """Whether the forward's outputs are overwritten by the next step (CUDA graphs, which
        ``compile={"mode": "reduce-overhead"}`` uses): then what outlives a step must be copied."""
        options = self.compile_options
        if options is None or self.root_device.type != "cuda":
            return False
        return options.get("mode") in ("reduce-overhead", "max-autotune") or bool(
            (options.get("options") or {}).get("triton.cudagraphs")
        )

    def training_memory(self, module: Module) -> int:
        """Bytes that training holds on the device besides the module's tensors and a step's (DDP's gradient
        buckets): the batch-size finder's trials, which run the module unwrapped, hold as much."""
        return 0

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Adjust optimizers after they were built on the placed module (a no-op on one device)."""

    def teardown(self) -> None:
        """Release what a stage (fit, validate, test, predict) left behind; called after each, on success
        and on error. The module stays set up: a later stage runs it as it is."""
        if self.root_device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------ the steps
    def describe_position(self, position: Callable[[], str]) -> None:
        """Tell the strategy how to say where the run is ("global step 38"), for its messages."""

    def announce_failure(self, error: BaseException) -> str | None:
        """This process failed: a parallel strategy tells the others, so that they end without ado. Returns
        what failed first on another process, when this failure is a consequence of that one."""
        return None

    def on_exception(self, exception: BaseException) -> None:
        """A stage ended with ``exception``, after the callbacks' and the datamodule's ``on_exception`` (Lightning's
        hook, for a strategy of one's own to release what it holds; the Trainer tears the stage down after it)."""

    def batch_transfer(self) -> Callable[[Any], Any] | None:
        """``batch_to_device``, or None where it would leave every batch as it is and count nothing anyone reads
        (batches on the CPU, a precision that converts no input, one process, no profiler timing it): the
        loops then skip a call per batch."""
        moves = self._batch_device is not None or self.precision.converts_input or self.world_size > 1
        return self.batch_to_device if moves or not self._adds_nothing_to("batch_to_device") else None

    def batch_to_device(self, batch: Any) -> Any:
        self.batches_moved += 1  # a sign of life the watchdog of a parallel strategy reads
        if self._batch_device is not None:
            batch = move_to_device(batch, self._batch_device)
        if self.precision.converts_input:
            batch = self.precision.convert_input(batch)
        return batch

    def step(self, name: str, *args: Any) -> Any:
        """Run ``module.<name>(*args)`` (training_step, validation_step, ...) in the precision's context."""
        with self.precision.forward_context():
            return getattr(self._module, name)(*args)

    def step_calls(self) -> StepCalls:
        """How a training step calls ``step``, ``backward``, ``unscale_gradients`` and ``optimizer_step``,
        bound once per run: each is the module's, tensor's or optimizer's own method where neither this
        strategy nor its precision adds anything to it and no profiler wraps it (one device, 32-bit): a
        step then goes through no layer that a hand-written loop does not have."""
        precision, module = self.precision, self._module
        plain_gradients = not precision.scales_gradients
        forward: Callable[..., Any] = functools.partial(self.step, "training_step")
        if module is not None and self._adds_nothing_to("step") and not precision.wraps_forward:
            forward = module.training_step
        return StepCalls(
            forward=forward,
            backward=torch.Tensor.backward if plain_gradients and self._adds_nothing_to("backward") else self.backward,
            unscale=None if plain_gradients and self._adds_nothing_to("unscale_gradients") else self.unscale_gradients,
            optimizer_step=(
                operator.methodcaller("step")  # looked up at each call: an LR scheduler wraps optimizer.step
                if plain_gradients and self._adds_nothing_to("optimizer_step")
                else self.optimizer_step
            ),
        )

    def _adds_nothing_to(self, name: str) -> bool:
        """Whether method ``name`` is the base class's, not replaced by a subclass, on this instance (where a
        profiler wraps what it times) or on this class (where a test's mock counts the calls)."""
        return name not in vars(self) and getattr(type(self), name) is _BASE_METHODS[name]

    def no_sync(self, skip_gradient_sync: bool = True) -> contextlib.AbstractContextManager:
        """While active (with ``skip_gradient_sync``), backward passes accumulate gradients locally without
        communicating: ``with self.trainer.strategy.no_sync():`` around the ``manual_backward`` calls of the
        micro-batches that do not step."""
        return _NO_CONTEXT

    def backward(self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None) -> None:
        """Backpropagate ``loss`` (through ``backward``, the module's own, when given)."""
        self.precision.backward(loss, backward)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self.precision.unscale_gradients(optimizer)

    def clip_gradients(
        self, optimizer: torch.optim.Optimizer, max_value: float, algorithm: Literal["norm", "value"]
    ) -> torch.Tensor | None:
        """Clip the gradients of ``optimizer``'s parameters; return the total norm when clipping by norm."""
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm == "norm":
            return torch.nn.utils.clip_grad_norm_(parameters, max_value)
        torch.nn.utils.clip_grad_value_(parameters, max_value)
        return None

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any
    ) -> Any:
        """Step ``optimizer`` through the precision; ``closure`` and ``kwargs`` go to its ``step``."""
        return self.precision.optimizer_step(optimizer, closure, **kwargs)

    @property
    def averages_split_gradients(self) -> bool:
        """Whether ``sync_gradients`` can average gradients accumulated under ``no_sync`` (for
        ``accumulate_grad_batches="auto"``): on one device there is nothing to average."""
        return self.world_size == 1

    def sync_gradients(self) -> None:
        """Average gradients that were accumulated under ``no_sync`` across ranks (nothing to do on one device)."""

    def release_memory(self) -> None:
        """Return cached device memory after running out of it (never called per step)."""
        gc.collect()
        if self.root_device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------- communication
    def reduce(self, tensor: torch.Tensor, group: Any = None, reduce_op: ReduceOp = "mean") -> torch.Tensor:
        """``tensor`` reduced over the processes of ``group`` (all by default), as Lightning's ``reduce``."""
        return tensor

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        """Stack ``tensor`` from every rank (of ``group``) along a new first dimension (``sync_grads``:
        differentiably)."""
        return tensor.unsqueeze(0)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (any picklable value), in rank order."""
        return [obj]

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank (``name`` only tells the waits apart, as Lightning's)."""

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Whether every rank decided so (``all``), else whether any rank did, as Lightning's."""
        count = self.reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")
        return bool(count == self.world_size) if all else bool(count > 0)

    # ---------------------------------------------------------------------------- checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        assert self._module is not None
        return self._module.state_dict()

    def load_module_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        assert self._module is not None
        self._module.load_state_dict(state, strict=strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str) -> None:
        """Write ``checkpoint`` atomically (in the background with ``async_checkpoint``); only the
        global-zero process writes."""
        if self.is_global_zero:
            self.checkpoint_writer.write(checkpoint, path)

    def link_checkpoint(self, source: str, destination: str) -> None:
        """Make ``destination`` a copy of ``source`` once ``source`` is written (the global-zero process)."""
        if self.is_global_zero:
            self.checkpoint_writer.then(functools.partial(checkpoint_io.link, source, destination))

    def remove_checkpoint(self, path: str) -> None:
        """Remove a checkpoint once the saves before it are written (the global-zero process)."""
        if self.is_global_zero:
            self.checkpoint_writer.then(functools.partial(checkpoint_io.remove, path))

    def wait_for_checkpoints(self) -> None:
        """Return once every checkpoint asked for is written; raise the error of a write that failed."""
        self.checkpoint_writer.wait()

    def end_stage(self) -> None:
        """A stage ended without error: what it left in flight completes before the stage does."""
        self.wait_for_checkpoints()

    def load_checkpoint(self, path: str, *, trust_pickles: bool = False) -> dict[str, Any]:
        # Into CPU memory: each part's load_state_dict puts its tensors on its own device, and some
        # entries (random generator states) must stay on the CPU.
        return checkpoint_io.load(path, map_location="cpu", trust_pickles=trust_pickles)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={[str(d) for d in self.parallel_devices]})"


_BASE_METHODS = {
    name: getattr(Strategy, name)
    for name in ("batch_to_device", "step", "backward", "unscale_gradients", "optimizer_step")
}


def input_device(module: nn.Module) -> torch.device | None:
    """The device of the module's input when the user placed its layers themselves, else None.

    That is ``module.input_device`` if set, or the first parameter's device when the parameters and
    buffers sit on more than one device (``encoder.to("cuda:0"); decoder.to("cuda:1")``).
    """
    chosen = getattr(module, "input_device", None)
    if chosen is not None:
        return torch.device(chosen)
    tensors = list(chain(module.parameters(), module.buffers()))
    if len({tensor.device for tensor in tensors}) > 1:
        return tensors[0].device
    return None


def is_on_meta_device(module: nn.Module) -> bool:
    """Whether the module was built under ``torch.device("meta")``: it has tensors, all without storage."""
    tensors = list(chain(module.parameters(), module.buffers()))
    return bool(tensors) and all(tensor.is_meta for tensor in tensors)


def materialize(module: nn.Module, device: torch.device | str) -> None:
    """Allocate a module built on the meta device on ``device`` and initialise every submodule that owns
    parameters or buffers with its ``reset_parameters()`` (sharded parameters are allocated shard by shard)."""
    owners = [(name, sub) for name, sub in module.named_modules() if next(_own_tensors(sub), None) is not None]
    missing = [name or "(the module)" for name, sub in owners if not callable(getattr(sub, "reset_parameters", None))]
    if missing:
        raise TypeError(
            f"the module was built on the meta device, but {missing} define no reset_parameters(): Ember "
            "allocates the parameters on the device and calls reset_parameters() on each module that owns "
            "parameters or buffers to initialise them; add that method, or build the module on a real device"
        )
    module.to_empty(device=device)
    with torch.no_grad():
        for _, sub in owners:
            sub.reset_parameters()


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    return chain(module.parameters(recurse=False), module.buffers(recurse=False))
