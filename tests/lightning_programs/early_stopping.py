"""A run that EarlyStopping ends, as in most training scripts: EarlyStopping on the validation loss with
patience and min_delta, ModelCheckpoint keeping the two best epochs and the last, then loading the best
checkpoint with `load_from_checkpoint`.

Data: a noisy regression on generated tensors that stops improving after a few epochs. Nothing is
shuffled, so every value (and so the epoch where the run stops) is compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class NoisyRegression(pl.LightningModule):
    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def data(count, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 3, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.5 * torch.randn(count, 1, generator=generator))


def main(root_dir="."):
    pl.seed_everything(11)
    stopping = EarlyStopping(monitor="val_loss", patience=2, min_delta=1e-3, mode="min")
    checkpoint = ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True, filename="{epoch}-{step}")
    trainer = pl.Trainer(max_epochs=50, callbacks=[stopping, checkpoint], default_root_dir=root_dir)
    trainer.fit(NoisyRegression(), DataLoader(data(128, 0), batch_size=16), DataLoader(data(64, 1), batch_size=64))
    assert 0 < stopping.stopped_epoch < 49, stopping.stopped_epoch
    best = NoisyRegression.load_from_checkpoint(checkpoint.best_model_path)
    return {"trainer": trainer, "stopped_epoch": stopping.stopped_epoch, "best_weight": best.layer.weight.detach()}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
