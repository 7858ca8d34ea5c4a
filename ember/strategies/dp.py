"""Data parallel in one process: each batch is split across the GPUs of the machine."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from ember.launch import ClusterEnvironment
from ember.precision import Precision
from ember.strategies.strategy import Strategy


class DataParallelStrategy(Strategy):
    """One process drives every GPU it was given: each step's batch is split along its first dimension,
    the step runs on a replica of the module per GPU, and the losses are averaged.

    DDP (one process per GPU) is faster; this exists for scripts that use ``torch.nn.DataParallel``.
    Values logged with ``self.log`` come from the first GPU's share of the batch. The training step's
    loss is the mean of the shares' losses; the other steps' outputs are gathered: tensors concatenated
    along the batch dimension, Python numbers and 0-dim tensors into a vector of one value per GPU.
    """

    name = "dp"

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
        if device_type != "cuda":
            raise ValueError(
                "strategy='dp' splits each batch across GPUs in one process and needs CUDA; "
                "on CPU use strategy='ddp' (one process per device)"
            )
        if num_nodes != 1 or (environment is not None and environment.world_size > 1):
            raise ValueError("strategy='dp' runs in a single process on one machine; use strategy='ddp' instead")
        if compile_options is not None and len(parallel_devices) > 1:
            # The replicas made per step share the compiled forward of the original module, bound to it.
            raise ValueError("compile= does not work with strategy='dp'; use strategy='ddp' to compile the model")
        super().configure(
            device_type=device_type,
            parallel_devices=parallel_devices,
            num_nodes=num_nodes,
            precision=precision,
            sync_batchnorm=sync_batchnorm,
            environment=environment,
            compile_options=compile_options,
            timeout=timeout,
            async_checkpoint=async_checkpoint,
        )

    def step(self, name: str, *args: Any) -> Any:
        if len(self.parallel_devices) == 1:
            return super().step(name, *args)
        from torch.nn.parallel import parallel_apply, replicate
        from torch.nn.parallel.scatter_gather import scatter_kwargs

        device_ids = [device.index for device in self.parallel_devices]
        inputs, _ = scatter_kwargs(args, None, device_ids)
        device_ids = device_ids[: len(inputs)]  # a batch smaller than the number of GPUs uses fewer
        assert self._module is not None
        replicas = replicate(self._module, device_ids, not torch.is_grad_enabled())
        for replica in replicas[1:]:
            # Only the first share logs, or every value would be recorded once per GPU. The replicas keep
            # the trainer (self.trainer, self.optimizers()), which they share with the module.
            vars(replica)["log"] = _log_nothing
        steps = [_in_context(self.precision, getattr(replica, name)) for replica in replicas]
        with self.precision.forward_context():
            outputs = parallel_apply(steps, inputs, None, device_ids)  # type: ignore[arg-type]  # any callables
        if all(output is None for output in outputs):
            return None
        output = _gather(outputs, self.root_device)
        return _average_loss(output) if name == "training_step" else output


def _in_context(precision: Precision, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run in the precision's context in the thread that calls it.

    Autocast's state is per thread: ``parallel_apply`` runs each replica in a thread of its own, which
    re-enters autocast with the device's default dtype (float16 on CUDA), not the precision's.
    """

    def run(*args: Any) -> Any:
        with precision.forward_context():
            return function(*args)

    return run


def _log_nothing(*args: Any, **kwargs: Any) -> None:
    """``self.log`` on the replicas after the first."""


def _gather(outputs: list[Any], device: torch.device) -> Any:
    """The replicas' outputs as one, as ``DataParallel`` gathers them: tensors concatenated along the batch
    dimension on ``device`` (0-dim ones, and Python numbers, into a vector of one value per replica),
    containers item by item; other values are the first replica's."""
    first = outputs[0]
    rebuild: Any = type(first)
    if isinstance(first, torch.Tensor):
        tensors = [output.to(device) for output in outputs]
        return torch.stack(tensors) if first.dim() == 0 else torch.cat(tensors)
    if isinstance(first, (int, float)):
        return torch.tensor(outputs, device=device)
    if isinstance(first, Mapping):
        return rebuild({key: _gather([output[key] for output in outputs], device) for key in first})
    if isinstance(first, (list, tuple)):
        items = [_gather(list(parts), device) for parts in zip(*outputs)]
        return rebuild(*items) if hasattr(first, "_fields") else rebuild(items)
    return first


def _average_loss(output: Any) -> Any:
    """The training step's loss is the mean of the replicas' losses, gathered into a vector."""
    if isinstance(output, torch.Tensor):
        return output.mean()
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": output["loss"].mean()}
    return output
