"""The tuner: find the largest batch size that fits a memory budget, then a learning rate, then train with both.

    python examples/tuning.py [--max-memory-mib 1.5] [--max-epochs 6]

``Tuner(trainer).scale_batch_size`` runs a few training steps at growing batch sizes (read from and
written to the datamodule's ``batch_size`` hyperparameter). On a GPU a size fails when it runs out of
memory; on a CPU, where memory does not run out but swaps, ``max_memory`` is the budget that a trial's
peak tensor memory must stay under. ``Tuner(trainer).lr_find`` then trains with a learning rate that
rises exponentially, records the loss, and sets the module's ``lr`` to where the loss falls fastest.
Both put the model's weights back after their trials. The script trains a small CNN on the digits
with what they found (plain SGD with momentum, which needs a well-chosen learning rate) and exits
with status 1 if the validation accuracy is below --target.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F
from digits import DigitsData
from torch import nn

import ember
from ember.tuner import Tuner


class SmallCNN(ember.Module):
    def __init__(self, lr: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()  # lr becomes a hyperparameter, which lr_find updates
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Flatten(), nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = F.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        self.log("val_acc", (self.net(images).argmax(dim=1) == labels).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-memory-mib", type=float, default=1.5, help="the batch-size finder's memory budget")
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--root-dir", default="runs/tuning", help="where logs and checkpoints go")
    parser.add_argument("--target", type=float, default=0.93, help="fail if the final val_acc is below this")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ember.seed_everything(0)
    model, data = SmallCNN(), DigitsData(batch_size=8)
    trainer = ember.Trainer(accelerator="cpu", max_epochs=args.max_epochs, default_root_dir=args.root_dir)
    tuner = Tuner(trainer)

    budget = int(args.max_memory_mib * 2**20)
    batch_size = tuner.scale_batch_size(model, datamodule=data, mode="power", init_val=8, max_memory=budget)
    print(f"batch size: {batch_size} (the largest whose training steps peak under {args.max_memory_mib} MiB)")

    # With momentum 0.9 this model diverges above a rate of about 0.3: the sweep stays below, so that the
    # steepest fall of its loss is one that training can use.
    finder = tuner.lr_find(model, datamodule=data, min_lr=1e-4, max_lr=0.3, num_training=100)
    print(f"learning rate: {finder.suggested_lr:.3g} (where the smoothed loss fell fastest in a sweep of "
          f"{len(finder.results['lr'])} steps); now model.hparams.lr = {model.hparams.lr:.3g}")  # fmt: skip

    trainer.fit(model, datamodule=data, ckpt_path="last")  # continues when run again
    accuracy = float(trainer.callback_metrics["val_acc"])
    trainer.print(f"val_acc {accuracy:.4f} after {args.max_epochs} epochs (target {args.target})")
    if accuracy < args.target:
        trainer.print(f"FAILED: val_acc {accuracy:.4f} is below the target {args.target}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
