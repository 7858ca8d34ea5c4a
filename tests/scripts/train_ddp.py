"""A small training job for the multi-process tests: it writes each rank's final parameters and metrics.

python train_ddp.py --out DIR [--devices N] [--batch-size B] [--accumulate K] [--fail-rank R] ...
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback


def dataset(n: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, (x @ torch.arange(1.0, 5.0)).unsqueeze(1))


class Regressor(ember.Module):
    def __init__(
        self, fail_rank: int = -1, fail_step: int = -1, sleep: float = 0.0, oom_above: int = 0, hang: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.fail_rank, self.fail_step, self.sleep, self.hang = fail_rank, fail_step, sleep, hang
        self.oom_above = oom_above  # on rank 1 only: pretend batches above this size do not fit

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == self.fail_rank and self.global_step == self.fail_step:
            if self.hang:
                while True:  # a deadlock in user code
                    time.sleep(1)
            raise RuntimeError(f"boom on rank {self.global_rank}")
        if self.sleep:
            time.sleep(self.sleep)
        x, y = batch
        if self.oom_above and self.global_rank == 1 and len(x) > self.oom_above:
            raise torch.OutOfMemoryError(f"{len(x)} samples do not fit")
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        # a rank-dependent value: only the cross-rank reduction makes it equal everywhere
        self.log("val_rank", float(self.global_rank), sync_dist=True)
        self.log("val_loss", F.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class CommCounter(Callback):
    """Counts DDP gradient communications through a comm hook."""

    def on_train_start(self, trainer: ember.Trainer, module: ember.Module) -> None:
        self.count = 0
        model = trainer.model

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations other than its own
            self.count += 1
            tensor = bucket.buffer().div_(trainer.world_size)
            return torch.distributed.all_reduce(tensor, async_op=True).get_future().then(lambda f: f.value()[0])

        model.register_comm_hook(None, hook)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accumulate", default="1", help="a count or 'auto'")
    parser.add_argument("--oom-above", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-step", type=int, default=-1)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--hang", action="store_true", help="at --fail-rank/--fail-step, sleep forever")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--count-comms", action="store_true")
    args = parser.parse_args()  # no --local-rank here: Ember strips what the legacy launcher adds

    counter = CommCounter()
    trainer = ember.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, strategy=args.strategy,
        max_epochs=args.epochs, num_sanity_val_steps=0,
        accumulate_grad_batches=args.accumulate if args.accumulate == "auto" else int(args.accumulate),
        enable_progress_bar=False, default_root_dir=args.out, callbacks=[counter] if args.count_comms else None,
        timeout=args.timeout,
    )  # fmt: skip
    model = Regressor(args.fail_rank, args.fail_step, args.sleep, args.oom_above, args.hang)
    loader = DataLoader(dataset(), batch_size=args.batch_size)
    trainer.fit(model, loader, DataLoader(dataset(16), batch_size=4))
    rank = trainer.global_rank
    torch.save([p.detach() for p in model.parameters()], os.path.join(args.out, f"rank{rank}.pt"))
    summary = {
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "metrics": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "comms": counter.count if args.count_comms else None,
        "micro_batches": trainer.fit_loop.runner.micro_batches,
        "log_dir": trainer.log_dir,
        "pid": os.getpid(),
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as file:
        json.dump(summary, file)
    trainer.print("done")


if __name__ == "__main__":
    main()
