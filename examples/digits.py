"""Train a small CNN on scikit-learn's handwritten digits (8x8 images, shipped with the package).

    python examples/digits.py [--max-epochs 15] [--batch-size 64] [--precision bf16-mixed] ...
    python examples/digits.py --devices 2 --strategy ddp       # two processes, started by the Trainer
    ember run --nproc-per-node 2 examples/digits.py            # the same, started by the launcher

It prints progress, writes metrics (CSV) and checkpoints under --root-dir, and exits with status 1
if the best validation accuracy is below --target: the example doubles as a convergence test.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

import ember
from ember.callbacks import ModelCheckpoint


class DigitsData(ember.DataModule):
    """The 1797 digits of ``sklearn.datasets.load_digits``, split 80/20 with a fixed seed."""

    def __init__(self, batch_size: int = 64, num_workers: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
        labels = torch.tensor(digits.target, dtype=torch.long)
        dataset = TensorDataset(images, labels)
        val_size = len(dataset) // 5
        split = torch.Generator().manual_seed(0)
        self.train_set, self.val_set = random_split(dataset, [len(dataset) - val_size, val_size], generator=split)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            shuffle=True,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, num_workers=self.hparams.num_workers)


class DigitsCNN(ember.Module):
    def __init__(self, lr: float = 3e-3, dropout: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        # sync_dist: with several processes, the accuracy is over all ranks' shards of the data.
        self.log("val_loss", F.cross_entropy(logits, labels), sync_dist=True)
        self.log("val_acc", (logits.argmax(dim=1) == labels).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        steps = int(self.trainer.estimated_stepping_batches)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _short(path: str) -> str:
    """``path`` relative to the working directory when that is shorter."""
    relative = os.path.relpath(path) if path else path
    return relative if len(relative) < len(path) else path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    parser.add_argument("--accelerator", default="auto", help="auto, cpu, cuda or mps")
    parser.add_argument("--devices", default="auto", help="devices (one process each); 'auto' follows the launcher")
    parser.add_argument("--strategy", default="auto", help="auto, ddp, dp, ...")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, ...")
    parser.add_argument("--root-dir", default="runs/digits", help="where logs and checkpoints go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.95, help="fail if best val_acc is below this")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ember.seed_everything(args.seed)
    checkpoint = ModelCheckpoint(monitor="val_acc", mode="max", save_last=True)
    trainer = ember.Trainer(
        max_epochs=args.max_epochs,
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        precision=args.precision,
        default_root_dir=args.root_dir,
        callbacks=[checkpoint],
        log_every_n_steps=10,
    )
    model = DigitsCNN(lr=args.lr)
    # "last": run again after an interruption (Ctrl-C, a preemption), it continues where it stopped.
    trainer.fit(model, datamodule=DigitsData(args.batch_size, args.num_workers), ckpt_path="last")
    best = float(checkpoint.best_model_score or 0.0)  # None: never validated
    trainer.print(f"best val_acc {best:.4f} (target {args.target})")
    trainer.print(f"checkpoint: {_short(checkpoint.best_model_path)}")  # each on a line of its own, to fit 80 columns
    trainer.print(f"metrics: {_short(os.path.join(trainer.log_dir or '', 'metrics.csv'))}")
    if best < args.target:
        trainer.print(f"FAILED: val_acc {best:.4f} is below the target {args.target}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
