"""Tensor parallel within groups of ranks and data parallel across them, on a 2-D device mesh."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ember._utils import is_overridden
from ember.module import Module
from ember.strategies.sharded import ShardedStrategy, refuse_wrappers
from ember.strategies.strategy import is_on_meta_device, materialize

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Size = int | Literal["auto"]


class ModelParallelStrategy(ShardedStrategy):
    """Ranks arranged in a 2-D ``DeviceMesh`` with dimensions ``"data"`` and ``"tensor"``: the ranks of
    a row split each layer between them (tensor parallel), the rows see different data.

    The module lays itself out in ``configure_model(self, device_mesh)``: tensor parallel plans with
    ``device_mesh["tensor"]`` (``parallelize_transformer`` applies the usual one) and, optionally,
    ``fully_shard`` over ``device_mesh["data"]``. If it does not shard the whole module over
    ``"data"`` and there are several rows, Ember does (``fully_shard`` of the root), so that gradients
    are averaged across them.

    Args:
        data_parallel_size: rows of the mesh ("auto": the number of nodes, or what the tensor size leaves).
        tensor_parallel_size: ranks per row ("auto": the devices per node, or what the data size leaves).
        process_group_backend, timeout: as for ``DDPStrategy``.
    """

    name = "model_parallel"

    def __init__(
        self,
        data_parallel_size: Size = "auto",
        tensor_parallel_size: Size = "auto",
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        for flag, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelParallelStrategy({flag}={value!r}): use 'auto' or a positive int")
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.device_mesh: DeviceMesh | None = None
        self._data_size, self._tensor_size = 1, 1  # decided by configure(), from the number of processes

    def configure(self, **flags: Any) -> None:
        super().configure(**flags)
        self._data_size, self._tensor_size = mesh_shape(
            self.world_size, self.num_nodes, self.data_parallel_size, self.tensor_parallel_size
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        # The ranks of a row split the model, so they read the same batches.
        return {"num_replicas": self._data_size, "rank": self.global_rank // self._tensor_size}

    def lay_out(self, module: Module) -> None:
        """Lay the module out over the mesh with its own ``configure_model``; shard it over "data"."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        refuse_wrappers(module, self.name)
        if not is_overridden("configure_model", module, Module):
            raise TypeError(
                f"strategy='model_parallel' lays the model out in {type(module).__name__}.configure_model("
                "device_mesh), which it does not define: apply tensor parallel plans there "
                "(ember.strategies.parallelize_transformer)"
            )
        if not is_on_meta_device(module):
            module.to(self.root_device)
        self.device_mesh = self._device_mesh((self._data_size, self._tensor_size), ("data", "tensor"))
        module.configure_model(self.device_mesh)
        if self._data_size > 1 and not isinstance(module, FSDPModule):
            fully_shard(module, mesh=self.device_mesh["data"])
        if any(parameter.is_meta for parameter in module.parameters()):
            materialize(module, self.root_device)


def mesh_shape(world_size: int, num_nodes: int, data: Size, tensor: Size) -> tuple[int, int]:
    """The (data, tensor) sizes of a mesh over ``world_size`` ranks; "auto" fills in what the other leaves."""
    if data == "auto" and tensor == "auto":
        data, tensor = num_nodes, world_size // num_nodes
    elif data == "auto":
        data = max(1, world_size // tensor)  # type: ignore[operator]
    elif tensor == "auto":
        tensor = max(1, world_size // data)
    if data * tensor != world_size:  # type: ignore[operator]
        raise ValueError(
            f"ModelParallelStrategy(data_parallel_size={data}, tensor_parallel_size={tensor}) needs "
            f"{data} x {tensor} = {data * tensor} processes, but the run has {world_size} "  # type: ignore[operator]
            "(devices x num_nodes); choose sizes whose product is that"
        )
    return data, tensor  # type: ignore[return-value]


def parallelize_transformer(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    blocks: str = "layers",
    column: Sequence[str] = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"),
    row: Sequence[str] = ("attention.wo", "feed_forward.w2"),
    embedding: str | None = "tok_embeddings",
    output: str | None = "output",
) -> None:
    """Apply the usual (Megatron) tensor parallel plan to a transformer, over the 1-D ``tp_mesh``.

    In each block of ``model.<blocks>`` (a ``ModuleList`` or ``ModuleDict``), the ``column`` linears
    (query, key, value, MLP input) are split by output features and the ``row`` linears (attention
    output, MLP output) by input features, so a block communicates once after attention and once
    after the MLP. The ``embedding`` is split by vocabulary rows and the ``output`` projection by
    columns, its logits gathered so that the loss sees all of them. The defaults are the names of
    torchtitan's Llama; ``None`` leaves the embedding or output as it is.

    Each rank then holds ``n_heads / tp`` attention heads: the attention must take its head count from
    the width it gets, as in ``q.view(batch, seq, -1, head_dim)``.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    size = tp_mesh.size()
    for index, block in enumerate(_submodule(model, blocks, "blocks").children()):
        plan: dict[str, Any] = {}
        for names, style, dim in ((column, ColwiseParallel, 0), (row, RowwiseParallel, 1)):
            for name in names:
                _check_divides(_submodule(block, name, f"{blocks}.{index}"), f"{blocks}.{index}.{name}", dim, size)
                plan[name] = style()
        parallelize_module(block, tp_mesh, plan)
    plan = {}
    if embedding is not None:
        _check_divides(_submodule(model, embedding, "embedding"), embedding, 0, size)
        plan[embedding] = RowwiseParallel(input_layouts=Replicate())
    if output is not None:
        _check_divides(_submodule(model, output, "output"), output, 0, size)
        plan[output] = ColwiseParallel(output_layouts=Replicate())
    if plan:
        parallelize_module(model, tp_mesh, plan)


def _submodule(module: nn.Module, name: str, flag: str) -> nn.Module:
    try:
        return module.get_submodule(name)
    except AttributeError:
        raise ValueError(
            f"parallelize_transformer({flag}=...): {type(module).__name__} has no submodule {name!r}"
        ) from None


def _check_divides(layer: nn.Module, name: str, dim: int, size: int) -> None:
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"parallelize_transformer: {name} is a {type(layer).__name__}, not a Linear or Embedding")
    if weight.shape[dim] % size:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the {weight.shape[dim]} {('rows', 'columns')[dim]} of "
            f"{name}.weight, which it splits; choose a size that divides every split dimension"
        )
