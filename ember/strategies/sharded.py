"""What the strategies that spread a model's state over ranks share (FSDP, model parallel, pipeline):
a device mesh, state dicts keyed by parameter name, checkpoints written shard by shard, and gradient
clipping that sees every shard."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ember import checkpoint as checkpoint_io
from ember._utils import local_shard
from ember.checkpoint import sharded as sharded_checkpoint
from ember.strategies.ddp import ParallelStrategy

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


class ShardedStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` whose ranks each hold part of the model.

    Checkpoints are directories written by every rank through ``torch.distributed.checkpoint``
    (see ``ember.checkpoint.sharded``); an ordinary checkpoint file can start a run too.
    """

    #: Whether ``sync_batchnorm=True`` is honoured (the others refuse it rather than ignore it).
    converts_batchnorm = False
    holds_whole_model = False
    # fully_shard keeps the gathered parameters it makes in an evaluation: made under inference_mode, they
    # are inference tensors that the next training step may not update.
    allows_inference_mode = False
    #: Whether ``precision="16-mixed"`` keeps the ranks in step: GradScaler's overflow check all-reduces
    #: its flag over the mesh of the first DTensor gradient, with that gradient's placements, which
    #: reaches every rank only when all gradients are sharded alike over one mesh (FSDP). Replicated
    #: gradients (tensor parallel) and ordinary ones (pipeline stages) would let a rank whose gradients
    #: overflowed skip a step that the others take.
    scales_losses_in_step = False

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._optimizers: list[torch.optim.Optimizer] = []
        self._checkpoint_group: Any = None

    def configure(self, **flags: Any) -> None:
        super().configure(**flags)
        if self.sync_batchnorm and not self.converts_batchnorm:
            raise ValueError(f"sync_batchnorm=True is not supported with strategy={self.name!r}; use strategy='fsdp'")
        if self.precision.name == "16-mixed" and not self.scales_losses_in_step:
            raise ValueError(
                f"precision='16-mixed' skips the steps whose gradients overflowed, which strategy={self.name!r} "
                "cannot decide alike on every rank (a rank would skip a step the others take); use "
                "precision='bf16-mixed'"
            )

    def _device_mesh(self, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, shape, mesh_dim_names=names)

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)

    # ---------------------------------------------------------------------------- gradients
    def clip_gradients(
        self, optimizer: torch.optim.Optimizer, max_value: float, algorithm: Literal["norm", "value"]
    ) -> torch.Tensor | None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # Each rank scales or clamps its own shards; only the norm needs the other ranks.
        local = [local_shard(grad) for grad in grads]
        if algorithm == "value":
            for tensor in local:
                tensor.clamp_(-max_value, max_value)
            return None
        norm = self._total_norm(grads)
        if local:
            scale = torch.clamp(max_value / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(local, scale.to(local[0].device))  # offloaded gradients are on the CPU
        return norm

    def _total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of all of the model's gradients, the same on every rank."""
        from torch.distributed.tensor import DTensor

        layouts: dict[Any, list[torch.Tensor]] = {}
        for grad in grads:  # torch's norm functions take DTensors of one layout at a time
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            layouts.setdefault(key, []).append(grad)
        squares = []
        for group in layouts.values():
            norm = torch.nn.utils.get_total_norm(group)
            if isinstance(norm, DTensor):
                # Reduced over the mesh, whose collectives (NCCL) take tensors on this rank's GPU only; with
                # FSDP's cpu_offload the gradients, and so this rank's part of the norm, are on the CPU.
                local = norm.to_local().to(self.root_device)
                norm = DTensor.from_local(local, norm.device_mesh, norm.placements).full_tensor()
            squares.append(norm.to(self.root_device).float().square())
        total = torch.stack(squares).sum() if squares else torch.zeros((), device=self.root_device)
        stages = self._split_group()
        if stages is not None:
            torch.distributed.all_reduce(total, group=stages)  # the other stages' parameters
        return total.sqrt()

    def _split_group(self) -> ProcessGroup | None:
        """The ranks that hold different parameters without sharding them (pipeline stages), if any."""
        return None

    # ------------------------------------------------------------------------- checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_module_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = not _has_dtensors(state.values())  # from an ordinary file: every rank takes its part
        if full:
            state = self._own_entries(state)
        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=full, strict=strict))

    def _own_entries(self, state: dict[str, Any]) -> dict[str, Any]:
        """The entries of a whole model's state dict that this rank holds."""
        return state

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # Flattened and keyed by parameter name: no two ranks write different values under one key.
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(self.module, optimizer, options=options)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = "param_groups" in state  # Optimizer.state_dict()'s format, from an ordinary file
        if full:
            names = self._parameter_names()[self._optimizers.index(optimizer)]
            kept = {name for name, _ in self.module.named_parameters()}
            state = sharded_checkpoint.name_optimizer_state(state, names, kept)
        # Whole states are given nested: torch reads flattened ones only when they are shards.
        options = StateDictOptions(full_state_dict=full, flatten_optimizer_state_dict=not full)
        set_optimizer_state_dict(self.module, optimizer, state, options=options)

    def _parameter_names(self) -> list[list[list[str]]]:
        """Per optimizer, per param group: the names of its parameters on all ranks, in rank order."""
        import torch.distributed as dist

        names = {parameter: name for name, parameter in self.module.named_parameters()}
        local = [[[names[p] for p in group["params"]] for group in opt.param_groups] for opt in self._optimizers]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, local)
        return [
            [list(dict.fromkeys(itertools.chain.from_iterable(groups))) for groups in zip(*per_rank)]
            for per_rank in zip(*everyone)
        ]

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str) -> None:
        if "optimizer_states" in checkpoint:
            checkpoint = {**checkpoint, sharded_checkpoint.PARAMETER_NAMES: self._parameter_names()}
        sharded_checkpoint.save(
            checkpoint, path, is_global_zero=self.is_global_zero, barrier=self.barrier,
            writer=self.checkpoint_writer, background_group=self._background_group(),
        )  # fmt: skip

    def _background_group(self) -> Any:
        """A gloo group of all ranks for the collectives of saves in the background: on the group training
        uses they would interleave with the training's own. Made at the first such save (by every rank)."""
        import torch.distributed as dist

        if not self.checkpoint_writer.in_background:
            return None
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group

    def load_checkpoint(self, path: str, *, trust_pickles: bool = False) -> dict[str, Any]:
        if not sharded_checkpoint.is_sharded(path):
            return checkpoint_io.load(path, map_location="cpu", trust_pickles=trust_pickles)
        template = {
            "state_dict": self.module_state_dict(),
            "optimizer_states": [self.optimizer_state_dict(optimizer) for optimizer in self._optimizers],
        }
        checkpoint = sharded_checkpoint.load(path, template, trust_pickles=trust_pickles)
        checkpoint.pop(sharded_checkpoint.PARAMETER_NAMES, None)
        return checkpoint


def refuse_wrappers(module: nn.Module, strategy: str) -> None:
    """Refuse a module with data-parallel wrappers inside: a sharded strategy lays out bare modules."""
    wrapped = [
        name or "(the module)"
        for name, sub in module.named_modules()
        if isinstance(sub, (nn.DataParallel, nn.parallel.DistributedDataParallel))
    ]
    if wrapped:
        raise ValueError(
            f"strategy={strategy!r} cannot lay out a module that holds DataParallel or DistributedDataParallel "
            f"wrappers ({wrapped}): pass the bare module; the strategy runs the data parallelism itself"
        )


def _has_dtensors(values: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(value, DTensor) for value in values)
