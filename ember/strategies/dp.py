"""Data parallel in one process: each batch is split across the GPUs of the machine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ember.launch import ClusterEnvironment
from ember.strategies.strategy import Strategy


class DataParallelStrategy(Strategy):
    """One process drives every GPU it was given: each step's batch is split along its first dimension,
    the step runs on a replica of the module per GPU, and the losses are averaged.

    DDP (one process per GPU) is faster; this exists for scripts that use ``torch.nn.DataParallel``.
    Values logged with ``self.log`` come from the first GPU's share of the batch.
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
        )

    def step(self, name: str, *args: Any) -> Any:
        if len(self.parallel_devices) == 1:
            return super().step(name, *args)
        from torch.nn.parallel import gather, parallel_apply, replicate, scatter_kwargs

        device_ids = [device.index for device in self.parallel_devices]
        inputs, _ = scatter_kwargs(args, None, device_ids)
        replicas = replicate(self._module, device_ids[: len(inputs)], not torch.is_grad_enabled())
        for replica in replicas[1:]:
            replica._trainer = None  # only the first share logs, or every value would be recorded N times
        with self.precision.forward_context():
            outputs = parallel_apply([getattr(replica, name) for replica in replicas], inputs)
        if all(output is None for output in outputs):
            return None
        return _average_losses(gather(outputs, self.root_device))


def _average_losses(output: Any) -> Any:
    """The replicas' losses were gathered into a vector; the step's loss is their mean."""
    if isinstance(output, torch.Tensor) and output.dim() == 1:
        return output.mean()
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return {**output, "loss": output["loss"].mean()}
    return output
