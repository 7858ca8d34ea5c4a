"""A job whose samples say who they are: each rank records the sample indices of every batch it trains on.

    python resume_layout.py --out DIR --devices 2 --batch-size 4 [--accumulate 2] [--kill-after 11]
        [--max-steps N] [--ckpt-path last] [--tag NAME]

It saves a checkpoint every 2 optimizer steps. ``--kill-after S`` sends SIGKILL to this process (rank 0)
once step S is done, mid-epoch; the indices it trained on are in ``<tag>-rank<R>.json``, one entry per
batch: ``[epoch, global_step after it, [indices]]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import ember
from ember.callbacks import Callback, ModelCheckpoint

SAMPLES = 48


class Indexed(Dataset):
    """Sample i is (i, features of i, target of i)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]

    def __len__(self) -> int:
        return SAMPLES


class Net(ember.Module):
    def __init__(self, adam: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.adam = adam

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)  # through the module's own call, which FSDP gathers the parameters for

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.adam:  # a state per parameter, which a sharded strategy reshards
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(Callback):
    def __init__(self, path: str, kill_after: int) -> None:
        self.path, self.kill_after = path, kill_after
        self.rows: list[Any] = []

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.rows.append([trainer.current_epoch, trainer.global_step, batch[0].tolist()])
        with open(self.path, "w") as file:
            json.dump(self.rows, file)
        if trainer.global_step == self.kill_after and trainer.fit_loop.stepped:
            trainer.strategy.barrier()  # both ranks have recorded this batch
            if trainer.global_rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--kill-after", type=int, default=-1)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--strategy", default=None, help="default: ddp with several processes")
    parser.add_argument("--adam", action="store_true", help="Adam instead of SGD")
    args = parser.parse_args()

    ember.seed_everything(7)
    rank = int(os.environ.get("RANK", "0"))
    record = Record(os.path.join(args.out, f"{args.tag}-rank{rank}.json"), args.kill_after)
    trainer = ember.Trainer(
        accelerator="cpu", devices=args.devices, strategy=args.strategy or ("ddp" if args.devices > 1 else "auto"),
        max_epochs=args.epochs, max_steps=args.max_steps, accumulate_grad_batches=args.accumulate,
        default_root_dir=args.out, enable_progress_bar=False, enable_model_summary=False, logger=False,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), every_n_train_steps=2,
                                   save_top_k=-1, save_last=True), record],
    )  # fmt: skip
    model = Net(args.adam)
    trainer.fit(model, DataLoader(Indexed(), batch_size=args.batch_size, shuffle=True), ckpt_path=args.ckpt_path)
    # A sharded parameter is gathered whole on every rank (a collective), then rank 0 saves it.
    final = [getattr(p, "full_tensor", p.detach)().detach() for p in model.parameters()]
    if trainer.global_rank == 0:
        torch.save(final, os.path.join(args.out, f"{args.tag}-final.pt"))


if __name__ == "__main__":
    main()
