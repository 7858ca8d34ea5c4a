"""A smoke run on two GPUs, for ``bench/gpu_check.sh``: a small MLP trained for a few dozen steps.

    python bench/gpu_smoke.py ddp|fsdp|dp|manual [--accelerator cuda|cpu] [--backend gloo]
    python -m ember run --nproc-per-node 2 bench/gpu_smoke.py ddp|fsdp|manual --backend gloo   # on one GPU
    python -m ember run --replica-groups 2 bench/gpu_smoke.py ft --backend gloo --out DIR      # needs torchft

ddp, fsdp and dp are the strategies of those names; manual is manual optimization (``self.optimizers()``,
``self.manual_backward``) under DDP; ft is fault tolerance: two replica groups of one process each, that
``ember run --replica-groups 2`` starts (both on the first GPU), averaging gradients over torchft's process
group. ddp, fsdp and manual run in two processes (the script starts them), dp in one that drives both GPUs.
The run passes when the loss falls and stays finite and, with two processes, the ranks end with the same
parameters (the replica groups compare theirs through files in ``--out``). Rank zero prints one line,
``smoke: <run> ok|FAILED: ...``, and the exit status is 1 when it failed. ``--accelerator cpu`` runs the same
(but dp) on CPU processes.

Started by a launcher on a machine with one GPU, the two processes share it; NCCL refuses two ranks on one
device, so ``--backend gloo`` joins them over Gloo instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.strategies import DDPStrategy, FSDPStrategy, Strategy

RUNS = ("ddp", "fsdp", "dp", "manual", "ft")
STEPS, BATCH = 60, 64


class Regression(ember.Module):
    def __init__(self, manual: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
        self.automatic_optimization = not manual
        self.losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)  # through forward: FSDP gathers the parameters in its hooks
        self.losses.append(loss.detach())
        self.log("loss", loss)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        fused = self.device.type == "cuda"  # no per-step host sync under 16-mixed
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=fused or None)


def data(samples: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 32, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True) / 2
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def checksum(module: nn.Module) -> torch.Tensor:
    """One number from all of the parameters, on the CPU. A sharded parameter adds up its ranks' shards (each
    shard is held once, so the ranks agree by construction): gathering them whole would take collectives that
    Gloo lacks for GPU tensors, and crash the process."""
    parameters = list(module.parameters())
    sharded = any(hasattr(p, "to_local") for p in parameters)
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in parameters]
    total = torch.stack([p.detach().double().sum() for p in shards]).sum().cpu()
    if sharded:
        totals: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(totals, total)
        total = torch.stack(totals).sum()
    return total


def group_checksums(trainer: ember.Trainer, own: float, out: str) -> list[float]:
    """Every replica group's checksum: each writes its own to a file in OUT and waits for the others' (the groups
    share no process group of their own outside torchft's)."""
    path = os.path.join(out, f"ft-group{trainer.replica_group}.txt")
    with open(path + ".part", "w") as file:
        file.write(repr(own))
    os.replace(path + ".part", path)  # whole, or not there
    paths = [os.path.join(out, f"ft-group{group}.txt") for group in range(trainer.num_replica_groups)]
    deadline = time.monotonic() + 120
    while not all(os.path.exists(each) for each in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other replica groups wrote no checksum to {out} in 120 s")
        time.sleep(0.2)
    return [float(open(each).read()) for each in paths]


def strategy(run: str, backend: str | None) -> str | Strategy:
    if run == "dp":
        return run
    layout = FSDPStrategy if run == "fsdp" else DDPStrategy  # manual optimization and ft run under DDP
    return layout(process_group_backend=backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", choices=RUNS)
    parser.add_argument("--accelerator", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--backend", help="the process group's backend (default: NCCL on GPUs, Gloo on CPUs)")
    parser.add_argument("--out", help="ft: an empty folder, where the replica groups compare their parameters")
    args = parser.parse_args()
    if args.run == "ft" and not (args.out and os.environ.get("EMBER_REPLICA_GROUPS")):
        parser.error("ft runs under `ember run --replica-groups 2` and needs --out DIR")
    if args.run == "dp" and (args.accelerator != "cuda" or args.backend):
        parser.error("dp drives several GPUs from one process; it needs --accelerator cuda, and no --backend")
    cuda = args.accelerator == "cuda"
    precision = "bf16-mixed" if cuda and torch.cuda.is_bf16_supported(including_emulation=False) else "16-mixed"
    trainer = ember.Trainer(
        accelerator=args.accelerator, devices=1 if args.run == "ft" else 2, strategy=strategy(args.run, args.backend),
        precision=precision if cuda else "32-true", max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Regression(manual=args.run == "manual")
    start = time.perf_counter()
    trainer.fit(model, data(STEPS * BATCH * 2))
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    losses = torch.stack([loss.float().cpu() for loss in model.losses])  # dp's replicas add theirs, on their GPUs
    first, last = losses[:5].mean().item(), losses[-5:].mean().item()
    if args.run == "ft":
        sums = torch.tensor(group_checksums(trainer, checksum(model).item(), args.out), dtype=torch.float64)
        processes = f"{trainer.num_replica_groups} replica groups of {trainer.world_size} process"
    else:
        sums = trainer.strategy.all_gather(checksum(model).to(trainer.strategy.root_device)).cpu()
        processes = f"{trainer.world_size} process(es)"
    ok = bool(losses.isfinite().all()) and last < 0.8 * first and bool((sums == sums[0]).all())
    samples_per_second = trainer.global_step * BATCH * trainer.world_size * trainer.num_replica_groups / seconds
    group = f" over {dist.get_backend()}" if dist.is_initialized() else ""  # dp runs in one process
    trainer.print(
        f"smoke: {args.run} {'ok' if ok else 'FAILED'}: loss {first:.3f} -> {last:.3f}, "
        f"{samples_per_second:.0f} samples/s, {trainer.global_step} steps, "
        f"{processes} on {trainer.strategy.root_device}{group}, "
        f"{precision if cuda else '32-true'}, ranks {'agree' if bool((sums == sums[0]).all()) else 'DISAGREE'}"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
