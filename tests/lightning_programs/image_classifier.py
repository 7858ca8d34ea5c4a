"""An image classifier in the shape of Lightning's official examples: a LightningDataModule that prepares
and splits the data per stage, torchmetrics accuracy, ReduceLROnPlateau on the validation loss, the best
checkpoint by validation accuracy, then `trainer.test(ckpt_path="best", datamodule=dm)`.

Data: scikit-learn's digits. The training loader shuffles, so only the run's shape is compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split
from torchmetrics.classification import MulticlassAccuracy


class DigitsDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 64):
        super().__init__()
        self.save_hyperparameters()

    def prepare_data(self):
        load_digits()  # where a dataset would be downloaded

    def setup(self, stage):
        images, labels = load_digits(return_X_y=True)
        full = TensorDataset(torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels))
        split = random_split(full, [1297, 250, 250], generator=torch.Generator().manual_seed(42))
        self.train_set, self.val_set, self.test_set = split

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)


class LitClassifier(pl.LightningModule):
    def __init__(self, hidden_dim: int = 64, learning_rate: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 10))
        self.train_acc = MulticlassAccuracy(num_classes=10)
        self.val_acc = MulticlassAccuracy(num_classes=10)
        self.test_acc = MulticlassAccuracy(num_classes=10)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


def main(root_dir="."):
    pl.seed_everything(42)
    datamodule = DigitsDataModule()
    model = LitClassifier()
    checkpoint = ModelCheckpoint(monitor="val_acc", mode="max", filename="digits-{epoch:02d}")
    trainer = pl.Trainer(
        max_epochs=3,
        callbacks=[checkpoint, LearningRateMonitor(logging_interval="epoch")],
        default_root_dir=root_dir,
        log_every_n_steps=5,
    )
    trainer.fit(model, datamodule=datamodule)
    results = trainer.test(ckpt_path="best", datamodule=datamodule)
    assert results[0]["test_acc"] > 0.85, results
    return {"trainer": trainer, "test": results, "best": checkpoint.best_model_path.rsplit("/", 1)[-1]}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
