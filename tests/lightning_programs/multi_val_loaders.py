"""Validation on several loaders at once, in the shape of common multi-domain evaluation code: the
`dataloader_idx` argument, metrics named per loader by Lightning (`/dataloader_idx_N`), and
`trainer.validate` returning one dict per loader.

Data: a regression on generated tensors, with an in-domain and a shifted validation set. Nothing is
shuffled, so every value is compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def make_set(count, shift, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 6, generator=generator) + shift
    y = (x * torch.linspace(-1, 1, 6)).sum(dim=1, keepdim=True)
    return TensorDataset(x, y)


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.model(x), y))
        self.log("val_mae", (self.model(x) - y).abs().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(make_set(192, 0.0, 0), batch_size=16)

    def val_dataloader(self):
        return [DataLoader(make_set(64, 0.0, 1), batch_size=32), DataLoader(make_set(48, 1.5, 2), batch_size=32)]


def main(root_dir="."):
    pl.seed_everything(3)
    model = Regressor()
    trainer = pl.Trainer(max_epochs=2, default_root_dir=root_dir, log_every_n_steps=4, enable_progress_bar=False)
    trainer.fit(model)
    results = trainer.validate(model)
    assert len(results) == 2 and "val_loss/dataloader_idx_1" in results[1]
    return {"trainer": trainer, "validate": results}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
