"""Strategies: how a run is laid out over devices and processes, chosen from the Trainer's flags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch

from ember.exceptions import MisconfigurationException
from ember.launch import ClusterEnvironment, detect_environment
from ember.strategies.ddp import DDPStrategy, ParallelStrategy
from ember.strategies.dp import DataParallelStrategy
from ember.strategies.fault_tolerant import FaultTolerance, FaultTolerantDDPStrategy
from ember.strategies.fsdp import FSDPStrategy
from ember.strategies.model_parallel import ModelParallelStrategy, parallelize_transformer
from ember.strategies.names import LIGHTNING_STRATEGIES, missing_strategy_hint
from ember.strategies.pipeline import PipelineStrategy
from ember.strategies.sharded import ShardedStrategy
from ember.strategies.single import SingleDeviceStrategy
from ember.strategies.strategy import Strategy

__all__ = [
    "DDPStrategy",
    "DataParallelStrategy",
    "FSDPStrategy",
    "FaultTolerance",
    "FaultTolerantDDPStrategy",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "PipelineStrategy",
    "ShardedStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "parallelize_transformer",
    "select_strategy",
]

_ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")


def _device_type(accelerator: str) -> str:
    if accelerator not in _ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not supported; choose one of {_ACCELERATORS}")
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    if accelerator == "auto":
        return "cuda" if cuda else "mps" if mps else "cpu"
    if not {"cpu": True, "cuda": cuda, "mps": mps, "gpu": cuda or mps}[accelerator]:
        missing = {"gpu": "no GPU (CUDA or Apple MPS)", "cuda": "no CUDA device", "mps": "no Apple MPS device"}
        lightnings = "No supported gpu backend found!" if accelerator == "gpu" else (
            f"`{accelerator.upper()}Accelerator` can not run on your system since the accelerator is not available. "
            "The following accelerator(s) is available and can be passed into `accelerator` argument of `Trainer`: "
            "['cpu']."
        )  # fmt: skip
        raise MisconfigurationException(
            f"accelerator={accelerator!r}: {missing[accelerator]} is available on this machine; pass "
            f"accelerator='cpu', or 'auto' to use whatever device it has ({lightnings})"
        )
    if accelerator == "gpu":  # as in Lightning: whichever kind of GPU the machine has
        return "cuda" if cuda else "mps"
    return accelerator


def _parse_devices(devices: int | str | Sequence[int], device_type: str, launched: bool = False) -> list[torch.device]:
    """The devices of this node's processes: "auto", a count, -1 (all), a list of indices or "0,2".

    With ``launched`` (a launcher started this node's processes), a count is the launcher's business
    wherever each process has a device of its own and sees no other: CPU processes, and GPU processes
    that see one GPU each (``srun --gpus-per-task=1``, ``CUDA_VISIBLE_DEVICES`` set per process).
    Every entry is then that one device, as each process sees it.
    """
    import os

    available = {
        "cuda": torch.cuda.device_count() if device_type == "cuda" else 0,
        "mps": 1,
        "cpu": os.cpu_count() or 1,
    }[device_type]
    what = {"cuda": "CUDA devices", "mps": "MPS device", "cpu": "CPU cores"}[device_type]
    own_device = launched and (device_type == "cpu" or (device_type == "cuda" and available == 1))
    devices = _count_or_indices(devices, device_type)
    if isinstance(devices, int):
        if devices == -1:
            devices = available if device_type != "cpu" else 1
        if devices < 1:
            raise MisconfigurationException(f"devices={devices}: at least one device is needed (-1 means all)")
        if devices > available and not own_device:
            raise MisconfigurationException(
                f"devices={devices}, but this machine has {available} {what}; pass devices={available} or fewer"
            )
        indices = list(range(devices))
    else:
        indices = list(devices)
        if not indices or len(set(indices)) != len(indices):
            raise ValueError(f"devices={devices!r}: give a non-empty list of distinct indices")
        bad = [index for index in indices if not isinstance(index, int) or not 0 <= index < available]
        if bad:
            raise MisconfigurationException(
                f"devices={devices!r}: {bad} out of range; this machine has {available} {what}"
            )
    if device_type == "cpu":
        return [torch.device("cpu")] * len(indices)
    if own_device:
        return [torch.device(device_type, 0)] * len(indices)
    return [torch.device(device_type, index) for index in indices]


def _count_or_indices(devices: int | str | Sequence[int], device_type: str) -> int | Sequence[int]:
    """``devices`` as a count (-1: all) or a sequence of indices, from any of its spellings."""
    if devices == "auto":
        return -1 if device_type == "cuda" else 1
    if isinstance(devices, str):
        text = devices.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        try:
            return [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"devices={devices!r}: use 'auto', a count, -1 for all, or indices like '0,1'") from None
    if isinstance(devices, bool) or not isinstance(devices, (int, Sequence)):
        raise ValueError(f"devices={devices!r}: use 'auto', a count, -1 for all, or a list of indices")
    return devices  # type: ignore[return-value]  # mypy: isinstance(_, Sequence) lets str back in


def select_strategy(
    *,
    accelerator: str,
    devices: int | str | Sequence[int],
    num_nodes: int,
    strategy: str | Strategy,
    precision: str | int,
    sync_batchnorm: bool,
    compile_options: Mapping[str, Any] | None = None,
    timeout: timedelta | None = None,
    async_checkpoint: bool = False,
    fault_tolerance: FaultTolerance | None = None,
) -> Strategy:
    """Turn the Trainer's layout flags into one configured ``Strategy`` (the only place they are decided)."""
    environment = detect_environment()
    device_type = _device_type(accelerator)
    if environment is not None and devices == "auto":
        devices = environment.local_world_size  # one device per process the launcher started here
    parallel_devices = _parse_devices(devices, device_type, launched=environment is not None)
    if environment is not None:
        _check_against_launcher(environment, len(parallel_devices), num_nodes)
    processes = len(parallel_devices) * num_nodes
    if environment is not None and environment.lighthouse is not None:
        chosen = _fault_tolerant(strategy, fault_tolerance)
    elif isinstance(strategy, Strategy):
        chosen = strategy
    elif strategy == "auto":
        chosen = DDPStrategy() if processes > 1 else SingleDeviceStrategy()
    elif strategy in _STRATEGIES or strategy in LIGHTNING_STRATEGIES:
        chosen = _STRATEGIES[strategy]() if strategy in _STRATEGIES else LIGHTNING_STRATEGIES[strategy]()
    else:
        hint = missing_strategy_hint(strategy)
        raise ValueError(
            f"strategy={strategy!r} is not supported"
            + (f": {hint}" if hint else "")
            + f"; choose one of {['auto', *_STRATEGIES]} (or the 'ddp_*' names Lightning registers)"
        )
    if isinstance(chosen, SingleDeviceStrategy) and processes > 1:
        raise ValueError(f"strategy='single_device' runs one process, but devices x num_nodes = {processes}; use 'ddp'")
    chosen.configure(
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
    return chosen


_STRATEGIES: dict[str, type[Strategy]] = {
    "single_device": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "dp": DataParallelStrategy,
    "fsdp": FSDPStrategy,
    "model_parallel": ModelParallelStrategy,
    "pipeline": PipelineStrategy,
}


def _fault_tolerant(strategy: str | Strategy, fault_tolerance: FaultTolerance | None) -> Strategy:
    """The strategy of a process that ``ember run --replica-groups`` started: DDP within its group, torchft across."""
    if isinstance(strategy, FaultTolerantDDPStrategy):
        return strategy
    if type(strategy) is DDPStrategy:  # its process-group settings carry over; the module is not wrapped in DDP
        return FaultTolerantDDPStrategy(
            fault_tolerance, process_group_backend=strategy.process_group_backend, timeout=strategy.timeout
        )
    if strategy not in ("auto", "ddp"):
        raise MisconfigurationException(
            f"strategy={strategy!r}: ember run --replica-groups trains data-parallel replica groups, with "
            "strategy='ddp' (or 'auto', or a DDPStrategy); run other strategies without --replica-groups"
        )
    return FaultTolerantDDPStrategy(fault_tolerance)


def _check_against_launcher(environment: ClusterEnvironment, devices: int, num_nodes: int) -> None:
    if environment.num_nodes != num_nodes:
        raise ValueError(
            f"num_nodes={num_nodes}, but {environment.launcher} started this job on {environment.num_nodes} "
            f"node(s) ({environment.world_size} processes, {environment.local_world_size} per node); "
            f"pass num_nodes={environment.num_nodes}"
        )
    if environment.local_world_size != devices:
        raise ValueError(
            f"devices={devices}, but {environment.launcher} started {environment.local_world_size} processes "
            "on this node; one process drives one device, so pass devices='auto' or the same count"
        )
