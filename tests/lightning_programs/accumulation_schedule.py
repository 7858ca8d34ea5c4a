"""A classifier that steps on large accumulated batches first and on every batch later, as training scripts that
warm up with `GradientAccumulationScheduler(scheduling={...})` do; a checkpoint every epoch, the loss logged per
step and per epoch, and the factor each epoch ran with read from `trainer.accumulate_grad_batches`.

Data: generated blobs, 16 batches an epoch (a multiple of every factor). Nothing is shuffled, so every value is
compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Blobs(pl.LightningModule):
    def __init__(self, lr: float = 0.2):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 3))
        self.factors = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        accuracy = (self.net(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", accuracy)

    def on_train_epoch_start(self):
        self.factors.append(self.trainer.accumulate_grad_batches)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def blobs(count, seed):
    generator = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (count,), generator=generator)
    centres = torch.tensor([[0.0, 2.0], [2.0, -1.0], [-2.0, -1.0]])
    return TensorDataset(centres[y] + 0.7 * torch.randn(count, 2, generator=generator), y)


def main(root_dir="."):
    pl.seed_everything(3)
    model = Blobs()
    trainer = pl.Trainer(
        max_epochs=4,
        callbacks=[GradientAccumulationScheduler(scheduling={0: 4, 2: 2, 3: 1})],
        default_root_dir=root_dir,
        log_every_n_steps=2,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(blobs(256, 0), batch_size=16), DataLoader(blobs(96, 1), batch_size=32))
    assert model.factors == [4, 4, 2, 1] and trainer.global_step == 4 + 4 + 8 + 16
    return {"trainer": trainer, "last_factor": trainer.accumulate_grad_batches}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
