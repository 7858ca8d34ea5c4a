"""Fully sharded data parallel: each rank keeps a shard of every parameter, gradient and optimizer state."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ember.strategies.sharded import ShardedStrategy, refuse_wrappers
from ember.strategies.strategy import _NO_CONTEXT, is_on_meta_device, materialize

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from ember.module import Module

#: Which submodules get a treatment: a set of module classes, or a function of the module.
ModulePolicy = set[type[nn.Module]] | Callable[[nn.Module], bool]


class FSDPStrategy(ShardedStrategy):
    """Data parallel in which every rank holds 1/N of the parameters, gradients and optimizer state,
    through PyTorch's ``fully_shard`` (FSDP2). Parameters are gathered for each block's forward and
    backward, and gradients are reduce-scattered.

    Args:
        auto_wrap_policy: the blocks that are sharded (and gathered) as one unit, besides the whole
            model: a set of module classes (e.g. ``{TransformerBlock}``) or a function of the module.
            Without one, the whole model is one unit, gathered whole for the forward.
        activation_checkpointing_policy: blocks (classes or a function) whose activations are recomputed
            in the backward instead of kept: less memory for some more compute.
        reshard_after_forward: free gathered parameters after each block's forward (True, least memory),
            keep them until the backward (False, less communication), or an int: reshard to groups
            of that many ranks.
        cpu_offload: keep parameters, gradients and optimizer state in CPU memory; the optimizer steps on
            the CPU.
        accumulate_full_gradients: with ``accumulate_grad_batches``, keep each micro-batch's full (unsharded)
            gradients and reduce them once per step: less communication, but the memory of DDP's
            gradients. By default every micro-batch's gradients are reduce-scattered into the shards.
        process_group_backend, timeout: as for ``DDPStrategy``.
        sharding_strategy, state_dict_type, mixed_precision: Lightning's options, as far as they mean something
            here: ``sharding_strategy="FULL_SHARD"`` is ``reshard_after_forward=True``, ``"SHARD_GRAD_OP"`` is
            ``False``; ``state_dict_type="sharded"`` is what Ember writes; mixed precision is the Trainer's
            ``precision``. Other values are refused, naming what to use.

    ``precision="bf16-mixed"`` (or ``"16-mixed"``) computes with 16-bit copies of the parameters and
    reduces gradients in float32; a module built under ``torch.device("meta")`` is allocated shard by
    shard.
    """

    name = "fsdp"
    converts_batchnorm = True
    scales_losses_in_step = True  # every gradient is sharded alike over the one "data" mesh

    def __init__(
        self,
        *,
        auto_wrap_policy: ModulePolicy | None = None,
        activation_checkpointing_policy: ModulePolicy | None = None,
        reshard_after_forward: bool | int = True,
        cpu_offload: bool = False,
        accumulate_full_gradients: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        sharding_strategy: Any = None,
        state_dict_type: str | None = None,
        mixed_precision: Any = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        _check_lightning_options(state_dict_type, mixed_precision)
        if sharding_strategy is not None:
            reshard_after_forward = _reshards_after_forward(sharding_strategy)
        self.auto_wrap_policy = _check_policy("auto_wrap_policy", auto_wrap_policy)
        self.activation_checkpointing_policy = _check_policy(
            "activation_checkpointing_policy", activation_checkpointing_policy
        )
        if not isinstance(reshard_after_forward, int) or (
            not isinstance(reshard_after_forward, bool) and reshard_after_forward < 1
        ):
            raise ValueError(
                f"FSDPStrategy(reshard_after_forward={reshard_after_forward!r}): use True, False or a group size >= 1"
            )
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.accumulate_full_gradients = accumulate_full_gradients
        self._sync_off: contextlib.AbstractContextManager = _NO_CONTEXT

    def configure(self, **flags: Any) -> None:
        super().configure(**flags)
        if self.cpu_offload and self.device_type == "cpu":
            raise ValueError(
                "FSDPStrategy(cpu_offload=True) keeps the model's state in CPU memory between GPU computations; "
                "on accelerator='cpu' it is there already, so leave cpu_offload off"
            )
        if self.cpu_offload and self.precision.name == "16-mixed":
            # The overflow flag of gradients offloaded to the CPU would be all-reduced over NCCL, which takes
            # GPU tensors only.
            raise ValueError(
                "FSDPStrategy(cpu_offload=True) with precision='16-mixed': the loss scaler checks the gradients "
                "where they are offloaded, on the CPU, and cannot agree on the result across GPUs; use "
                "precision='bf16-mixed'"
            )

    def lay_out(self, module: Module) -> None:
        """Shard the module: each ``auto_wrap_policy`` block, then the whole (in the precision's dtype)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        refuse_wrappers(module, self.name)
        if self.sync_batchnorm:
            nn.SyncBatchNorm.convert_sync_batchnorm(module)
        for block in _matching(module, self.activation_checkpointing_policy):
            _checkpoint_activations(block)
        options: dict[str, Any] = {
            "mesh": self._device_mesh((self.world_size,), ("data",)),
            "reshard_after_forward": self.reshard_after_forward,
        }
        compute_dtype = getattr(self.precision, "dtype", None)
        if self.precision.name.endswith("-mixed") and compute_dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if self.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        # Blocks first, the whole model last: fully_shard leaves out what a wrapped block already holds.
        for block in reversed(list(_matching(module, self.auto_wrap_policy))):
            fully_shard(block, **options)
        fully_shard(module, **options)
        if is_on_meta_device(module):
            materialize(module, "cpu" if self.cpu_offload else self.root_device)
        self._sync_off = _GradientSyncOff(cast("FSDPModule", module))  # fully_shard made it one

    def teardown(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        # A stage that failed between a block's forward and backward leaves its parameters gathered.
        if self._module is not None:
            for block in self._module.modules():
                if isinstance(block, FSDPModule):
                    block.reshard()
        super().teardown()

    def no_sync(self, skip_gradient_sync: bool = True) -> contextlib.AbstractContextManager:
        if skip_gradient_sync and self.accumulate_full_gradients:
            return self._sync_off
        return _NO_CONTEXT


class _GradientSyncOff(contextlib.AbstractContextManager):
    """Reusable: turns FSDP's gradient reduction off while entered (gradients then accumulate unsharded)."""

    def __init__(self, module: FSDPModule) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc_info: object) -> None:
        self.module.set_requires_gradient_sync(True)


#: Lightning's (FSDP1's) sharding strategies that FSDP2 does with one mesh: whether parameters are resharded after
#: the forward.
_SHARDING_STRATEGIES = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}


def _reshards_after_forward(sharding_strategy: Any) -> bool:
    """``reshard_after_forward`` for Lightning's ``sharding_strategy`` (a name, or torch's ``ShardingStrategy``)."""
    name = getattr(sharding_strategy, "name", sharding_strategy)
    if name not in _SHARDING_STRATEGIES:
        instead = (
            "strategy='ddp' keeps whole copies" if name == "NO_SHARD"
            else "FSDPStrategy shards over every process; ModelParallelStrategy arranges them in a 2-D mesh"
        )  # fmt: skip
        raise ValueError(
            f"FSDPStrategy(sharding_strategy={sharding_strategy!r}): Ember's FSDP takes {sorted(_SHARDING_STRATEGIES)} "
            f"(reshard_after_forward=True or False); {instead}"
        )
    return _SHARDING_STRATEGIES[name]


def _check_lightning_options(state_dict_type: str | None, mixed_precision: Any) -> None:
    if state_dict_type not in (None, "sharded"):
        raise ValueError(
            f"FSDPStrategy(state_dict_type={state_dict_type!r}): Ember's FSDP checkpoints are sharded (a directory "
            "each process writes its shard to); `ember checkpoint consolidate PATH` makes one file of one. Leave "
            "state_dict_type out, or pass 'sharded'"
        )
    if mixed_precision is not None:
        raise ValueError(
            "FSDPStrategy(mixed_precision=...): pass Trainer(precision='bf16-mixed') (or '16-mixed'), which FSDP "
            "applies with 16-bit copies of the parameters and float32 gradient reduction"
        )


def _check_policy(flag: str, policy: Any) -> ModulePolicy | None:
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return policy
    if isinstance(policy, (set, frozenset, list, tuple)) and all(
        isinstance(cls, type) and issubclass(cls, nn.Module) for cls in policy
    ):
        return set(policy)
    raise TypeError(f"FSDPStrategy({flag}={policy!r}): give a set of nn.Module classes or a function of a module")


def _matching(module: nn.Module, policy: ModulePolicy | None) -> Iterator[nn.Module]:
    """The submodules (not the module itself) that ``policy`` selects, parents before children."""
    if policy is None:
        return
    for sub in module.modules():
        if sub is not module and (isinstance(sub, tuple(policy)) if isinstance(policy, set) else policy(sub)):
            yield sub


def _checkpoint_activations(block: nn.Module) -> None:
    """Recompute the block's activations in the backward instead of keeping them.

    The block's own ``forward`` runs under ``torch.utils.checkpoint``; its hooks (FSDP's gathering)
    stay outside, so the recomputation finds the parameters gathered by the backward's hooks.
    """
    from torch.utils.checkpoint import checkpoint

    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
