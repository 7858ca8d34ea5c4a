"""Does float16 loss scaling keep ranks in step when gradients are DTensors? Run in two processes:

    ember run --nproc-per-node 2 scaler_dtensor.py --out DIR

GradScaler's overflow check (``_amp_foreach_non_finite_check_and_unscale_``) has a DTensor handler that
all-reduces the overflow flag over the mesh, with the placements of the first gradient it is given. In
each case rank 1 plants an inf in its part of one gradient, and every rank records whether it stepped.

fsdp: a module sharded by ``fully_shard`` (every gradient sharded alike over one mesh, as FSDPStrategy
makes them). replicated-first: a replicated DTensor gradient, then a sharded one (tensor parallel keeps
some parameters replicated). plain-and-sharded: an ordinary gradient next to a sharded one (tensor
parallel leaves the layers without a plan as they are).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ember.launch import close_process_group


def fsdp(mesh: DeviceMesh) -> list[nn.Parameter]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    fully_shard(model, mesh=mesh)
    model(torch.randn(3, 4)).sum().backward()
    return list(model.parameters())


def replicated_first(mesh: DeviceMesh) -> list[nn.Parameter]:
    return _parameters(mesh, [Replicate()], [Shard(0)])


def plain_and_sharded(mesh: DeviceMesh) -> list[nn.Parameter]:
    return _parameters(mesh, None, [Shard(0)])


def _parameters(mesh: DeviceMesh, *placements: Any) -> list[nn.Parameter]:
    parameters = []
    for placement in placements:
        value = torch.ones(4, 2)
        if placement is None:
            parameter = nn.Parameter(value)
            parameter.grad = torch.ones(4, 2)
        else:
            parameter = nn.Parameter(distribute_tensor(value, mesh, placement))
            parameter.grad = distribute_tensor(torch.ones(4, 2), mesh, placement)
        parameters.append(parameter)
    return parameters


def run(case: str, mesh: DeviceMesh) -> dict[str, Any]:
    parameters = {"fsdp": fsdp, "replicated-first": replicated_first, "plain-and-sharded": plain_and_sharded}[case](
        mesh
    )
    last = parameters[-1].grad
    if dist.get_rank() == 1:  # an overflow in this rank's part of the last gradient only
        (last.to_local() if isinstance(last, DTensor) else last).view(-1)[0] = float("inf")
    before = [_local(parameter).clone() for parameter in parameters]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # the scale is made at the first scaling, as by scaler.scale(loss).backward()
    optimizer = torch.optim.SGD(parameters, lr=0.1)
    try:
        scaler.step(optimizer)
    except RuntimeError as error:  # recorded: the test reads what each rank saw
        return {"error": f"{type(error).__name__}: {error}"}
    scaler.update()
    stepped = any(not torch.equal(_local(p), b) for p, b in zip(parameters, before))
    return {"stepped": stepped, "scale": scaler.get_scale()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {case: run(case, mesh) for case in ("fsdp", "replicated-first", "plain-and-sharded")}
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as file:
        json.dump(results, file)
    dist.barrier()
    close_process_group()  # lets gloo's threads let go of the tensors first: an abort at exit otherwise


if __name__ == "__main__":
    main()
