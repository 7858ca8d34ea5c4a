"""Memory per rank: DDP against FSDP on a model of a few hundred MB, two processes.

    python bench/memory.py [--blocks 16] [--width 2048] [--accelerator cpu|cuda]

The model is a stack of ``--blocks`` blocks (Linear(width, width) + ReLU; 16 x 2048 is 67M parameters,
256 MiB in float32) trained with AdamW for 4 optimizer steps of 2 micro-batches (batch 8 per rank).
Each job runs in fresh processes (``ember run --nproc-per-node 2``). Per rank it reports the bytes of
parameters and optimizer state it holds after training, and its peak memory: on CPU the growth of
the process's peak resident set over what it used before building the model; on a GPU
``torch.cuda.max_memory_allocated``. FSDP builds the model on the meta device, so no rank ever holds
all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

JOBS = {
    "ddp": "DDP",
    "fsdp": "FSDP (a unit per block)",
    "fsdp-full-grads": "FSDP, accumulate_full_gradients=True",
}


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def worker(job: str, blocks: int, width: int, accelerator: str, result: str) -> None:
    import torch.nn.functional as F

    import ember
    from ember.strategies import FSDPStrategy

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    class Net(ember.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Block() for _ in range(blocks)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.blocks(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    if job == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = FSDPStrategy(auto_wrap_policy={Block}, accumulate_full_gradients=job == "fsdp-full-grads")
    trainer = ember.Trainer(
        accelerator=accelerator, strategy=strategy, max_steps=4, accumulate_grad_batches=2,
        enable_progress_bar=False, logger=False, enable_checkpointing=False,
    )  # fmt: skip
    baseline = peak_resident_bytes()
    with torch.device("meta" if job != "ddp" else "cpu"):
        model = Net()
    data = TensorDataset(torch.randn(64, width), torch.randn(64, width))
    trainer.fit(model, DataLoader(data, batch_size=8))
    tensors = [*model.parameters()] + [
        value for state in trainer.optimizers[0].state.values() for value in state.values() if torch.is_tensor(value)
    ]
    held = sum(local.numel() * local.element_size() for local in (getattr(t, "_local_tensor", t) for t in tensors))
    peak = torch.cuda.max_memory_allocated() if accelerator == "cuda" else peak_resident_bytes() - baseline
    with open(f"{result}.{trainer.global_rank}", "w") as file:
        json.dump({"held": held, "peak": peak}, file)


def run_job(job: str, args: argparse.Namespace, out: str) -> list[dict[str, int]]:
    result = os.path.join(out, job)
    command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", os.path.abspath(__file__),
               "--worker", job, "--result", result, "--blocks", str(args.blocks), "--width", str(args.width),
               "--accelerator", args.accelerator]  # fmt: skip
    # glibc keeps freed blocks of up to 32 MiB for reuse, which would count buffers long gone in the RSS;
    # a fixed threshold makes large blocks go back to the system when freed.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{job} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    ranks = []
    for rank in (0, 1):
        with open(f"{result}.{rank}") as file:
            ranks.append(json.load(file))
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--worker", choices=list(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.blocks, args.width, args.accelerator, args.result)
        return

    parameters = args.blocks * (args.width + 1) * args.width
    size = f"{parameters / 1e6:.1f}M parameters, {parameters * 4 / 2**20:.0f} MiB in float32"
    print(f"torch {torch.__version__}, {args.accelerator}, 2 processes; {args.blocks} blocks of "
          f"Linear({args.width}, {args.width}): {size}; AdamW")  # fmt: skip
    peak_name = "peak allocated" if args.accelerator == "cuda" else "peak RSS growth"
    print(f"| Strategy | parameters + optimizer state per rank | {peak_name} per rank |")
    print("| --- | --- | --- |")
    with tempfile.TemporaryDirectory() as out:
        for job, title in JOBS.items():
            ranks = run_job(job, args, out)
            held = max(rank["held"] for rank in ranks) / 2**20
            peak = max(rank["peak"] for rank in ranks) / 2**20
            print(f"| {title} | {held:.0f} MiB | {peak:.0f} MiB |", flush=True)


if __name__ == "__main__":
    main()
