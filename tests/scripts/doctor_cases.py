"""A hand-written PyTorch training loop with planted performance mistakes (or none), for the doctor.

    python doctor_cases.py --mistakes input,graph,sync [--fixed] [--steps N]
    torchrun --nproc-per-node 2 doctor_cases.py --mistakes bare-forward,find-unused,set-epoch,threads,accumulation

Mistakes: input (a slow dataset read in the training process), graph (every step's loss kept with
its graph), sync (a per-step .item()), bare-forward (the forward bypasses DDP), find-unused
(find_unused_parameters=True with every parameter used), set-epoch (a DistributedSampler without
set_epoch), threads (every process uses all cores), accumulation (all-reducing every micro-batch).
``--fixed`` applies the doctor's advice instead, so that the gain can be measured.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

kept: list[torch.Tensor] = []  # where the "graph" mistake keeps every step's loss


class SlowDisk(Dataset):
    """Each sample takes 2 ms to read, as from a slow disk."""

    def __init__(self, size: int = 2048) -> None:
        self.data = torch.randn(size, 32)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.002)
        return self.data[index], self.data[index].sum().reshape(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistakes", default="")
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2, help="loader workers when the input mistake is fixed")
    parser.add_argument("--timing", action="store_true", help="print the median seconds per step (after 5)")
    args = parser.parse_args()
    planted = {name for name in args.mistakes.split(",") if name and not args.fixed}
    fixed = {name for name in args.mistakes.split(",") if name and args.fixed}
    distributed = "WORLD_SIZE" in os.environ
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores if "threads" in planted else max(1, cores // processes))
    torch.manual_seed(0)

    # Enough compute per step that reading in-memory data is not the bottleneck (unless it is planted): about
    # 4% of a step at this width. At 512 it was 13%, near enough to the doctor's 20% that a busy machine's
    # scheduling hiccup during one read of the short measured window made a clean run look input-bound.
    width = 1024
    model: nn.Module = nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)
    )
    if "input" in planted | fixed:
        dataset: Dataset = SlowDisk()
    else:
        x = torch.randn(512 if "set-epoch" in planted | fixed else 4096, 32)
        dataset = TensorDataset(x, x.sum(dim=1, keepdim=True))
    sampler = None
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        sampler = DistributedSampler(dataset, shuffle=True)
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters="find-unused" in planted)
    workers = args.workers if "input" in fixed else 0
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, shuffle=sampler is None, num_workers=workers,
                        persistent_workers=workers > 0)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    accumulate = 4 if "accumulation" in planted | fixed else 1

    step = micro = epoch = 0
    stamps: list[float] = []
    while step < args.steps:
        if sampler is not None and "set-epoch" not in planted:
            sampler.set_epoch(epoch)
        for x, y in loader:
            stepping = (micro + 1) % accumulate == 0
            if distributed:
                forward = ddp.module if "bare-forward" in planted else ddp
                local = "accumulation" in fixed and not stepping  # accumulate without communicating
                with ddp.no_sync() if local else contextlib.nullcontext():
                    loss = F.mse_loss(forward(x), y) / accumulate
                    loss.backward()
            else:
                loss = F.mse_loss(model(x), y)
                loss.backward()
            micro += 1
            if "graph" in planted | fixed:
                kept.append(loss if "graph" in planted else loss.detach())
            if "sync" in planted and loss.item() > 1e9:  # a per-step read of the loss
                print(f"diverging: {loss:.3f}")
            if not stepping:
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            stamps.append(time.perf_counter())
            if step == args.steps:
                break
        epoch += 1
    if args.timing and int(os.environ.get("RANK", "0")) == 0:
        durations = sorted(b - a for a, b in itertools.pairwise(stamps[5:]))
        print(f"seconds per step: {durations[len(durations) // 2]:.6f}")
    if distributed:
        del ddp  # DDP's reducer must go before the process group it uses
        dist.barrier()
        time.sleep(0.05)  # a gloo thread that frees its last work during interpreter shutdown aborts the process
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
