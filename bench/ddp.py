"""Data-parallel throughput on CPU: Ember's DDP against a hand-written DistributedSampler + DDP loop.

    python bench/ddp.py [--rounds 7]

One job of 2 processes (started by torchrun, one thread each) trains an MLP (32 -> 256 -> 256 -> 10)
on 32768 random samples with batch 64 per rank. In every round each process runs epochs of the
hand-written loop and of ``Trainer.fit`` (timed from the epoch's start to its end) in the order
plain, Ember, Ember, plain, so that a drift in machine speed cancels out; the ratio is the median
over rounds after one warm-up round. Each Ember epoch timed is the second of a fit: the hand-written
loop's DDP wrapper is built once and warmed up in the first round, while each fit builds its own, whose
first step sets up its gradient buckets. A job of 1 process measures Ember alone, for the 2-against-1
figure. Both loops share the job's process group, as they would share a machine.
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


class PlainLoop:
    """The loop people write by hand for torchrun: DDP, a DistributedSampler and set_epoch."""

    def __init__(self) -> None:
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DistributedSampler

        self.model = DistributedDataParallel(make_model())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        dataset = make_dataset()
        self.sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        self.loader = DataLoader(dataset, batch_size=BATCH, sampler=self.sampler)
        self.epoch = 0

    def run_epoch(self) -> float:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        start = time.perf_counter()
        for x, y in self.loader:
            self.optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.optimizer.step()
        return time.perf_counter() - start


def ember_epoch() -> float:
    """The second epoch of a ``Trainer.fit`` on the same model and data (the process group is the job's)."""
    from overhead import EpochTimer  # a sibling script of bench/

    import ember

    class Net(ember.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    timer = EpochTimer()
    trainer = ember.Trainer(
        accelerator="cpu", max_epochs=2, callbacks=[timer], enable_progress_bar=False, logger=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(make_dataset(), batch_size=BATCH, shuffle=True))
    return timer.seconds


def worker(rounds: int, result: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plain = PlainLoop() if dist.get_world_size() > 1 else None
    seconds: dict[str, list[float]] = {"plain": [], "ember": []}  # two epochs of each per round
    for _ in range(rounds + 1):
        if plain is not None:
            first = plain.run_epoch()
        seconds["ember"].append(ember_epoch() + ember_epoch())
        if plain is not None:
            seconds["plain"].append(first + plain.run_epoch())
    if dist.get_rank() == 0:
        with open(result, "w") as file:
            json.dump({name: values[1:] for name, values in seconds.items()}, file)  # round one warms up
    from ember.launch import close_process_group

    del plain  # DDP's reducer must go before the process group it uses
    dist.barrier()
    close_process_group()


def run_job(processes: int, rounds: int, out: str) -> dict[str, list[float]]:
    """Seconds of two epochs of each loop per round, from rank zero of a torchrun job."""
    result = os.path.join(out, f"{processes}.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               os.path.abspath(__file__), "--worker", "--rounds", str(rounds), "--result", result]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if job.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{job.stdout[-3000:]}\n{job.stderr[-5000:]}")
    with open(result) as file:
        return json.load(file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds after one warm-up round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.result)
        return

    with tempfile.TemporaryDirectory() as out:
        single = run_job(1, args.rounds, out)
        paired = run_job(2, args.rounds, out)
    one = 2 * SAMPLES / statistics.median(single["ember"])  # every epoch covers SAMPLES, over all ranks
    ours = 2 * SAMPLES / statistics.median(paired["ember"])
    plain = 2 * SAMPLES / statistics.median(paired["plain"])
    ratios = [a / b for a, b in zip(paired["plain"], paired["ember"], strict=True)]
    print(f"torch {torch.__version__}, CPU, gloo, 1 thread per process, {args.rounds} rounds (medians)")
    print(f"  Ember, 1 process:                  {one:9.0f} samples/s")
    print(f"  Ember, 2 processes:                {ours:9.0f} samples/s ({ours / one:.2f}x one process)")
    print(f"  hand-written DDP, 2 processes:     {plain:9.0f} samples/s")
    print(f"  Ember / hand-written, 2 processes: {statistics.median(ratios):.3f}x "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}; throughput ratio, higher is better)")  # fmt: skip


if __name__ == "__main__":
    main()
