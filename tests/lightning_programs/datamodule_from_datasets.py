"""Data set up the quick way common in notebooks and small projects: `LightningDataModule.from_datasets`,
a curriculum that grows the training set through `train_dataloader()` with
`reload_dataloaders_every_n_epochs=1`, `min_epochs` holding EarlyStopping off, and `Trainer.validate` /
`Trainer.test` on the fitted model without passing it again.

Data: generated tensors. Nothing is shuffled, so every value is compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class CurriculumModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        generator = torch.Generator().manual_seed(2)
        x = torch.rand(256, 2, generator=generator)
        self.pool = TensorDataset(x, x[:, :1] * 3 - x[:, 1:])

    def train_dataloader(self):
        size = 64 * (self.current_epoch + 1)  # easy first: more data each epoch
        return DataLoader(torch.utils.data.Subset(self.pool, range(min(size, 256))), batch_size=32)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self.layer(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def main(root_dir="."):
    pl.seed_everything(12)
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(64, 2, generator=generator)
    held_out = TensorDataset(x, x[:, :1] * 3 - x[:, 1:])
    data = pl.LightningDataModule.from_datasets(val_dataset=held_out, test_dataset=held_out, batch_size=32)
    stopping = EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)  # would stop at once
    trainer = pl.Trainer(
        max_epochs=6, min_epochs=3, reload_dataloaders_every_n_epochs=1, default_root_dir=root_dir,
        callbacks=[stopping, ModelCheckpoint(monitor="val_loss")], enable_progress_bar=False,
    )  # fmt: skip
    model = CurriculumModel()
    trainer.fit(model, val_dataloaders=data.val_dataloader())
    validated = trainer.validate(datamodule=data, ckpt_path="last")
    tested = trainer.test(datamodule=data)
    assert trainer.current_epoch == 3, trainer.current_epoch
    return {"trainer": trainer, "validate": validated, "test": tested}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
