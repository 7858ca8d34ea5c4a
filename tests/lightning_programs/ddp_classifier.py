"""A classifier trained with DDP on two processes, in the shape of multi-GPU training scripts (here on CPU
with gloo): `strategy="ddp"`, metrics reduced across processes with `sync_dist=True`, `self.all_gather` of
per-process predictions in `on_validation_epoch_end`, `isinstance(trainer.strategy, DDPStrategy)`, and
messages printed once with `rank_zero_info`.

Run it with two processes (`python ddp_classifier.py ROOT`; Lightning starts the second). Data: the digits.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _summary import write_summary
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DistributedClassifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.correct = []
        self.gathered_sizes = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.correct.append((logits.argmax(dim=-1) == y).float())
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)

    def on_validation_epoch_end(self):
        correct = self.all_gather(torch.cat(self.correct))  # (processes, samples of each)
        self.gathered_sizes.append(tuple(correct.shape))
        self.log("val_acc", correct.float().mean(), rank_zero_only=False)
        self.correct.clear()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(root_dir="."):
    pl.seed_everything(7)
    images, labels = load_digits(return_X_y=True)
    x, y = torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels)
    model = DistributedClassifier()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, default_root_dir=root_dir,
        enable_progress_bar=False, num_sanity_val_steps=0, log_every_n_steps=5,
    )  # fmt: skip
    assert isinstance(trainer.strategy, DDPStrategy) and trainer.world_size == 2
    trainer.fit(model, DataLoader(TensorDataset(x[:1600], y[:1600]), batch_size=50),
                DataLoader(TensorDataset(x[1600:], y[1600:]), batch_size=50))  # fmt: skip
    rank_zero_info(f"validation accuracy {float(trainer.callback_metrics['val_acc']):.3f}")
    assert model.gathered_sizes[-1][0] == 2 and float(trainer.callback_metrics["val_acc"]) > 0.8
    write_summary(trainer, root_dir, gathered_rows=model.gathered_sizes[-1][0])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
