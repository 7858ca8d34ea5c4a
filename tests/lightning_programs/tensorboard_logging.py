"""TensorBoard with the default logger, as most Lightning programs use it: `self.logger.experiment` (the
`SummaryWriter`) for histograms and images, `self.log` with `prog_bar` for scalars, `self.dtype` for tensors
made in a step, and hyperparameters kept out of the logger with `save_hyperparameters(logger=False)`.

Data: scikit-learn's digits as 8x8 images. Nothing is shuffled, so every value is compared.
"""

import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class ConvNet(pl.LightningModule):
    def __init__(self, channels: int = 4, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters(logger=False)
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.head = nn.Linear(channels * 16, 10)

    def forward(self, images):
        features = F.max_pool2d(F.relu(self.conv(images)), 2)
        return self.head(features.flatten(1))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        noise_free = torch.zeros(images.shape[0], 10, dtype=self.dtype, device=self.device)
        loss = F.cross_entropy(self(images) + noise_free, labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        self.log("val_acc", (self(images).argmax(-1) == labels).float().mean(), prog_bar=True)
        if batch_idx == 0:
            self.logger.experiment.add_images("digits", images[:4], self.current_epoch)

    def on_train_epoch_end(self):
        self.logger.experiment.add_histogram("conv.weight", self.conv.weight, self.current_epoch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main(root_dir="."):
    pl.seed_everything(6)
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)
    y = torch.tensor(labels)
    trainer = pl.Trainer(max_epochs=2, default_root_dir=root_dir, log_every_n_steps=10)
    model = ConvNet()
    trainer.fit(model, DataLoader(TensorDataset(x[:1500], y[:1500]), batch_size=50),
                DataLoader(TensorDataset(x[1500:], y[1500:]), batch_size=100))  # fmt: skip
    assert type(trainer.logger).__name__ == "TensorBoardLogger" and model.hparams.channels == 4
    hparams_file = os.path.join(trainer.log_dir, "hparams.yaml")
    if os.path.exists(hparams_file):
        with open(hparams_file) as file:
            assert "channels" not in file.read()
    return {"trainer": trainer}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
