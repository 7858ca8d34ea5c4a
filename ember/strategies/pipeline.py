"""Pipeline parallel: the model cut into stages, one per rank, fed micro-batches by a schedule."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ember._utils import apply_to_tensors
from ember.strategies.sharded import ShardedStrategy, refuse_wrappers
from ember.strategies.strategy import is_on_meta_device, materialize

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ember.module import Module

#: ``split_fn(module, stage_index, num_stages)``: the names of the submodules that stage keeps.
SplitFn = Callable[[nn.Module, int, int], Sequence[str]]
SCHEDULES = ("1F1B", "GPipe")
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class PipelineStrategy(ShardedStrategy):
    """Each rank runs one stage of the model: a run of its submodules, in the order they were
    registered. A batch is cut into ``n_microbatches`` that flow through the stages as the schedule
    says, the loss is computed on the last stage, and each stage backpropagates its own part. With
    ``data_parallel_size > 1`` the ranks form a 2-D mesh (``"pipeline"``, ``"data"``): several
    pipelines see different data and shard their stages over ``"data"`` (``fully_shard``).

    What it asks of the Module:

    - batches are ``(inputs, target)``, where ``inputs`` is a tensor or a tuple of tensors;
    - ``forward`` skips the submodules that are ``None``: a stage keeps its own submodules and sets
      the others to ``None``, so ``forward`` receives the previous stage's output and runs the rest;
    - ``pipeline_loss(output, target)`` returns the loss of one micro-batch (averaged over its samples);
      it runs on the last stage only, so it must not call ``self.log``.

    ``training_step`` is not called (the schedule runs forward and backward together); the loss shown
    and checked is the mean over micro-batches. In ``validation_step``, ``test_step`` and
    ``predict_step``, ``self(inputs)`` runs the whole pipeline and returns its output on every rank.

    Args:
        n_microbatches: micro-batches per batch; batch sizes must be multiples of it.
        schedule: "1F1B" (one forward, one backward: activations of at most as many micro-batches as
            stages are kept) or "GPipe" (all forwards, then all backwards).
        split_points: names of the submodules that begin the second, third, ... stage, such as
            ``["layers.4"]``. Without them (and without ``split_fn``), the stages get about equal
            numbers of parameters.
        split_fn: ``split_fn(module, stage_index, num_stages)`` returns the names of the submodules
            that stage keeps, for cuts that split points cannot say.
        data_parallel_size: pipelines that see different data; the stages are ``world_size / data``.
        process_group_backend, timeout: as for ``DDPStrategy``.
    """

    name = "pipeline"

    def __init__(
        self,
        n_microbatches: int = 4,
        schedule: str = "1F1B",
        *,
        split_points: Sequence[str] | None = None,
        split_fn: SplitFn | None = None,
        data_parallel_size: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"PipelineStrategy(n_microbatches={n_microbatches!r}): use a positive int")
        if schedule not in SCHEDULES:
            raise ValueError(f"PipelineStrategy(schedule={schedule!r}): choose one of {SCHEDULES}")
        if split_points is not None and split_fn is not None:
            raise ValueError("PipelineStrategy: give split_points or split_fn, not both")
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise ValueError(f"PipelineStrategy(data_parallel_size={data_parallel_size!r}): use a positive int")
        self.n_microbatches = n_microbatches
        self.schedule = schedule
        self.split_points = list(split_points) if split_points is not None else None
        self.split_fn = split_fn
        self.data_parallel_size = data_parallel_size
        self.num_stages, self.stage_index = 1, 0  # decided by configure(), from the number of processes
        self._group: ProcessGroup | None = None  # this rank's pipeline: one rank per stage
        self._last_stage_rank = 0
        self._schedules: dict[tuple[Any, ...], Any] = {}
        self._stage_modules: list[str] = []
        self._anchor: torch.Tensor | None = None
        self._loss_scale: torch.Tensor | None = None
        self._losses: list[torch.Tensor] = []
        self._step_loss: torch.Tensor | None = None

    def configure(self, **flags: Any) -> None:
        super().configure(**flags)
        if self.world_size % self.data_parallel_size:
            raise ValueError(
                f"PipelineStrategy(data_parallel_size={self.data_parallel_size}) does not divide the "
                f"{self.world_size} processes of the run (devices x num_nodes) into pipelines of equal length"
            )
        self.num_stages = self.world_size // self.data_parallel_size
        self.stage_index = self.global_rank // self.data_parallel_size
        if self.split_points is not None and len(self.split_points) != self.num_stages - 1:
            raise ValueError(
                f"PipelineStrategy(split_points={self.split_points}) makes {len(self.split_points) + 1} stages, "
                f"but the run has {self.num_stages} ({self.world_size} processes / data_parallel_size="
                f"{self.data_parallel_size}); give {self.num_stages - 1} split points"
            )
        if self.schedule == "1F1B" and self.n_microbatches < self.num_stages:
            raise ValueError(
                f"PipelineStrategy(n_microbatches={self.n_microbatches}, schedule='1F1B') needs at least one "
                f"micro-batch per stage ({self.num_stages})"
            )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # The stages of a pipeline read the same batches (the first its inputs, the last its targets).
        return {"num_replicas": self.data_parallel_size, "rank": self.global_rank % self.data_parallel_size}

    # ----------------------------------------------------------------------------- set-up
    def lay_out(self, module: Module) -> None:
        """Keep this rank's stage of the module (the other submodules become None) on its device."""
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        refuse_wrappers(module, self.name)
        if not module.automatic_optimization:
            raise ValueError(
                "strategy='pipeline' runs the forward and backward of every micro-batch in its schedule, so "
                "manual optimization (automatic_optimization = False) cannot work with it"
            )
        if not callable(getattr(module, "pipeline_loss", None)):
            raise TypeError(
                f"strategy='pipeline' computes the loss on the last stage with {type(module).__name__}"
                ".pipeline_loss(output, target), which it does not define"
            )
        mesh = self._device_mesh((self.num_stages, self.data_parallel_size), ("pipeline", "data"))
        self._group = mesh["pipeline"].get_group()
        self._last_stage_rank = dist.get_process_group_ranks(self._group)[-1]
        self._stage_modules = self._stage_names(module)
        keep_only(module, self._stage_modules)
        if is_on_meta_device(module):
            materialize(module, self.root_device)
        else:
            module.to(self.root_device)
        if self.data_parallel_size > 1:
            fully_shard(module, mesh=mesh["data"])
        self._anchor = torch.zeros((), device=self.root_device, requires_grad=True)

    def compile_targets(self, module: Module) -> list[nn.Module]:
        # The stage's own submodules: the module's forward runs the schedule's messages between them.
        return [module.get_submodule(name) for name in self._stage_modules]

    def teardown(self) -> None:
        self._schedules.clear()  # each holds its stage's communication buffers
        super().teardown()

    def end_stage(self) -> None:
        super().end_stage()
        # The schedule's last point-to-point messages may still be in flight on Gloo; a process that
        # exits while a peer still sends to it aborts ("terminate called without an active exception").
        self.barrier()

    def _stage_names(self, module: nn.Module) -> list[str]:
        """The names of the submodules this rank's stage keeps."""
        if self.split_fn is not None:
            names = list(self.split_fn(module, self.stage_index, self.num_stages))
            for name in names:
                _require_submodule(module, name, "split_fn returned")
            return names
        if self.split_points is not None:
            points = self.split_points
            for point in points:
                _require_submodule(module, point, "split_points names")
            units = _units(module, lambda name, child: any(point.startswith(name + ".") for point in points))
            cuts = [0, *(units.index(point) for point in self.split_points), len(units)]
            if cuts != sorted(set(cuts)):
                raise ValueError(
                    f"PipelineStrategy(split_points={self.split_points}): give them in the order the submodules "
                    "were registered, each beginning a non-empty stage"
                )
        else:
            units = _units(module, lambda name, child: "." not in name and isinstance(child, _CONTAINERS))
            cuts = _balanced_cuts([_parameter_count(module.get_submodule(unit)) for unit in units], self.num_stages)
        return units[cuts[self.stage_index] : cuts[self.stage_index + 1]]

    # ------------------------------------------------------------------------------ steps
    def step(self, name: str, *args: Any) -> Any:
        if name != "training_step":
            with self.precision.forward_context(), self._forward_runs_pipeline():
                return getattr(self._module, name)(*args)
        inputs, target = _split_batch(args[0])
        run = functools.partial(self._train_micro_batches, inputs, target)
        loss = _ScheduleOnBackward.apply(self._anchor, run)
        self._step_loss = loss.detach()  # filled in once the schedule has run
        return loss

    def _train_micro_batches(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor, scale: torch.Tensor) -> None:
        """Run the schedule's forwards and backwards, each micro-batch's loss scaled by ``scale``."""
        import torch.distributed as dist

        schedule = self._schedule("train", inputs, target)
        # Each micro-batch's loss counts 1/n of the batch's (the schedule's own scaling is off: it would
        # also divide the gradients that earlier batches of an accumulation window left).
        self._loss_scale, self._losses = scale / self.n_microbatches, []
        with torch.enable_grad(), self.precision.forward_context():
            schedule.step(*self._first_stage(inputs), target=target if self._is_last_stage else None)
        if self._is_last_stage:
            # The micro-batches' losses are the last ones: a stage's first step also calls the loss
            # function on placeholder tensors, to learn the shapes of its messages.
            loss = torch.stack(self._losses[-self.n_microbatches :]).float().mean()
        else:
            loss = torch.zeros((), device=self.root_device)
        dist.broadcast(loss, src=self._last_stage_rank, group=self._group)
        assert self._step_loss is not None  # the step made it before its backward ran this
        self._step_loss.copy_(loss)

    def _micro_batch_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.module.pipeline_loss(output, target)
        self._losses.append(loss.detach())
        assert self._loss_scale is not None  # set by _train_micro_batches before the schedule runs
        return loss * self._loss_scale

    @contextlib.contextmanager
    def _forward_runs_pipeline(self) -> Iterator[None]:
        """While active, calling the module runs every stage and returns the last one's output."""
        self.module.forward = self._forward_all_stages
        try:
            yield
        finally:
            del self.module.forward

    def _forward_all_stages(self, *inputs: torch.Tensor) -> Any:
        schedule = self._schedule("evaluate", inputs)
        del self.module.forward  # the stage itself runs the module's own forward
        try:
            output = schedule.step(*self._first_stage(inputs))
        finally:
            self.module.forward = self._forward_all_stages
        # Every stage returns the output, so that the step logs the same values on each rank.
        return self._broadcast_output(output)

    def _broadcast_output(self, output: Any) -> Any:
        """The last stage's ``output`` on every stage: its structure, with the tensors' shapes and dtypes,
        pickled; the tensors themselves broadcast into tensors on this rank's device (a pickled GPU
        tensor would be unpickled on the GPU it came from, the last stage's)."""
        import torch.distributed as dist

        sent: list[torch.Tensor] = []

        def describe(tensor: torch.Tensor) -> torch.Tensor:
            sent.append(tensor)
            return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

        holder = [apply_to_tensors(output, describe) if self._is_last_stage else None]
        dist.broadcast_object_list(holder, src=self._last_stage_rank, group=self._group, device=self.root_device)
        sending = iter(sent)

        def fill(placeholder: torch.Tensor) -> torch.Tensor:
            if self._is_last_stage:
                tensor = next(sending).contiguous()
            else:
                tensor = torch.empty(placeholder.shape, dtype=placeholder.dtype, device=self.root_device)
            dist.broadcast(tensor, src=self._last_stage_rank, group=self._group)
            return tensor

        return apply_to_tensors(holder[0], fill)

    def _schedule(self, kind: str, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None = None) -> Any:
        """The schedule for batches of these shapes: a stage infers its messages' shapes once."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if inputs[0].shape[0] % self.n_microbatches:
            raise ValueError(
                f"a batch of {inputs[0].shape[0]} samples cannot be cut into n_microbatches={self.n_microbatches} "
                "equal micro-batches; use a batch size that is a multiple of it (and drop_last=True)"
            )
        key = (kind, *((tensor.shape, tensor.dtype) for tensor in (*inputs, *([target] if target is not None else []))))
        if key not in self._schedules:
            stage = PipelineStage(self.module, self.stage_index, self.num_stages, self.root_device, group=self._group)
            if kind == "evaluate":
                self._schedules[key] = ScheduleGPipe(stage, self.n_microbatches)  # no loss: forwards only
            else:
                schedule_class = Schedule1F1B if self.schedule == "1F1B" else ScheduleGPipe
                self._schedules[key] = schedule_class(
                    stage, self.n_microbatches, loss_fn=self._micro_batch_loss, scale_grads=False
                )
        return self._schedules[key]

    @property
    def _is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _first_stage(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return inputs if self.stage_index == 0 else ()

    # ------------------------------------------------------------------------ state
    def _split_group(self) -> ProcessGroup | None:
        return self._group

    def _own_entries(self, state: dict[str, Any]) -> dict[str, Any]:
        own = self.module.state_dict().keys()
        return {key: value for key, value in state.items() if key in own}


class _ScheduleOnBackward(torch.autograd.Function):
    """The loss the loop receives from a pipeline's training step.

    Its value is filled in when it is backpropagated: the backward runs the schedule (the forward
    and backward of every micro-batch on every stage), with each micro-batch's loss multiplied by the
    incoming gradient. That gradient carries what the loop applies to the loss (division by the
    accumulation window, the precision's scaling), so those stay exactly as for other strategies.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, run: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.run = run
        return anchor.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        ctx.run(grad)
        return None, None


def _split_batch(batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(
            f"strategy='pipeline' takes batches of (inputs, target); got a {type(batch).__name__}"
            + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
        )
    inputs, target = batch
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), target


def keep_only(module: nn.Module, names: Sequence[str]) -> None:
    """Set every submodule to ``None`` that is not one of ``names``, inside one, or a parent of one.

    Parameters held directly by a parent that stays (the module itself, a container) would be trained
    on every stage, so they are refused; buffers stay everywhere.
    """
    kept = set(names)

    def visit(prefix: str, parent: nn.Module) -> None:
        direct = [name for name, _ in parent.named_parameters(recurse=False)]
        if direct:
            raise ValueError(
                f"strategy='pipeline' gives whole submodules to stages, but {type(parent).__name__} "
                f"{prefix.rstrip('.') or '(the module)'} holds parameters itself ({direct}); move them into a submodule"
            )
        for name, child in list(parent.named_children()):
            full = prefix + name
            if full in kept:
                continue
            if any(other.startswith(full + ".") for other in kept):
                visit(full + ".", child)
            else:
                parent.register_module(name, None)

    visit("", module)


def _units(module: nn.Module, opened: Callable[[str, nn.Module], bool]) -> list[str]:
    """The names of the module's submodules in registration order, those that ``opened(name, submodule)``
    selects replaced by their children, recursively: the pieces stages are made of."""

    def visit(prefix: str, parent: nn.Module) -> list[str]:
        units: list[str] = []
        for name, child in parent.named_children():
            full = prefix + name
            if opened(full, child):
                units += visit(full + ".", child) or [full]
            else:
                units.append(full)
        return units

    return visit("", module)


def _balanced_cuts(sizes: list[int], stages: int) -> list[int]:
    """Indices that cut ``sizes`` into ``stages`` non-empty runs of about equal sums."""
    if len(sizes) < stages:
        raise ValueError(
            f"strategy='pipeline' needs at least {stages} submodules to make {stages} stages, found {len(sizes)}; "
            "give PipelineStrategy(split_points=...) or split_fn"
        )
    total, cuts, running = sum(sizes), [0], 0
    for index, size in enumerate(sizes):
        running += size
        stage = len(cuts)
        remaining_units, remaining_stages = len(sizes) - index - 1, stages - stage
        if stage < stages and (running >= total * stage / stages or remaining_units == remaining_stages):
            cuts.append(index + 1)
    return [*cuts, len(sizes)]


def _parameter_count(module: nn.Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def _require_submodule(module: nn.Module, name: str, what: str) -> None:
    try:
        module.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"PipelineStrategy: {what} {name!r}, which is not a submodule of {type(module).__name__}"
        ) from None
