"""Data-parallel throughput on CPU: Ember's DDP against a hand-written torchrun + DistributedSampler + DDP loop.

    python bench/ddp.py [--rounds 5] [--epochs 3]

Each job trains an MLP (32 -> 256 -> 256 -> 10) on 32768 random samples with batch 64 per rank and
one thread per process, and reports the samples per second of its epochs after the first. Jobs run
in turn, round after round: Ember with 1 process, then 2 processes of the hand-written loop, of
Ember, of Ember again and of the hand-written loop again (so that a drift in machine speed cancels
out). The figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, BATCH = 32768, 64


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 32, generator=generator), torch.randint(0, 10, (SAMPLES,), generator=generator)
    )


def plain_worker(epochs: int) -> list[float]:
    """The loop people write by hand for torchrun."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DistributedSampler

    dist.init_process_group("gloo")
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = make_dataset()
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    seconds = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        start = time.perf_counter()
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
        seconds.append(time.perf_counter() - start)
    del model, optimizer  # DDP's reducer must go before the process group it uses
    dist.barrier()
    dist.destroy_process_group()
    return seconds


def ember_worker(epochs: int) -> list[float]:
    import ember
    from ember.callbacks import Callback

    class Net(ember.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class EpochTimer(Callback):
        seconds: list[float] = []

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            self.seconds.append(time.perf_counter() - self.start)

    timer = EpochTimer()
    trainer = ember.Trainer(
        accelerator="cpu", max_epochs=epochs, callbacks=[timer], enable_progress_bar=False, logger=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(make_dataset(), batch_size=BATCH, shuffle=True))
    return timer.seconds


def run_job(kind: str, processes: int, epochs: int, out: str) -> float:
    """Samples per second of one job (after its first epoch), over all its processes."""
    result = os.path.join(out, f"{kind}-{processes}-{time.monotonic_ns()}.json")
    worker = [os.path.abspath(__file__), "--worker", kind, "--epochs", str(epochs), "--result", result]
    if kind == "ember":
        command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", str(processes), *worker]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                   *worker]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if job.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{job.stdout[-3000:]}\n{job.stderr[-5000:]}")
    with open(result) as file:
        seconds = json.load(file)
    return SAMPLES / statistics.median(seconds[1:])  # every rank reads its shard: the job covers SAMPLES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per job; the first is not timed")
    parser.add_argument("--worker", choices=["plain", "ember"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker is not None:
        torch.set_num_threads(1)
        seconds = plain_worker(args.epochs) if args.worker == "plain" else ember_worker(args.epochs)
        if os.environ.get("RANK", "0") == "0":
            with open(args.result, "w") as file:
                json.dump(seconds, file)
        return

    single, plain, ours = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.rounds):
            single.append(run_job("ember", 1, args.epochs, out))
            hand_written = run_job("plain", 2, args.epochs, out)
            ember_rate = run_job("ember", 2, args.epochs, out) + run_job("ember", 2, args.epochs, out)
            hand_written += run_job("plain", 2, args.epochs, out)
            plain.append(hand_written / 2)
            ours.append(ember_rate / 2)
    ratios = [a / b for a, b in zip(ours, plain, strict=True)]
    print(f"torch {torch.__version__}, CPU, gloo, 1 thread per process, {args.rounds} rounds (medians)")
    print(f"  Ember, 1 process:                 {statistics.median(single):9.0f} samples/s")
    print(f"  Ember, 2 processes:               {statistics.median(ours):9.0f} samples/s "
          f"({statistics.median(ours) / statistics.median(single):.2f}x one process)")  # fmt: skip
    print(f"  hand-written DDP, 2 processes:    {statistics.median(plain):9.0f} samples/s")
    print(f"  Ember / hand-written, 2 processes: {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f})")  # fmt: skip


if __name__ == "__main__":
    main()
