"""The module hierarchy of a project template: a base LightningModule that saves the shared
hyperparameters, task modules that add their own with `save_hyperparameters("lr")`, `self.hparams` read in
`configure_optimizers`, and a model rebuilt with `load_from_checkpoint` from what was saved.

Data: generated tensors. Nothing is shuffled, so every value is compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class BaseTask(pl.LightningModule):
    def __init__(self, in_features: int = 6, hidden: int = 12, dropout: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = torch.nn.Sequential(
            torch.nn.Linear(in_features, hidden), torch.nn.ReLU(), torch.nn.Dropout(dropout)
        )


class RegressionTask(BaseTask):
    def __init__(self, lr: float = 0.05, weight_decay: float = 0.0, hidden: int = 12):
        super().__init__(hidden=hidden)
        self.save_hyperparameters("lr", "weight_decay")
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def main(root_dir="."):
    pl.seed_everything(9)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(96, 6, generator=generator)
    data = TensorDataset(x, x[:, :3].sum(dim=1, keepdim=True))
    model = RegressionTask(lr=0.01, hidden=10)
    trainer = pl.Trainer(max_epochs=2, default_root_dir=root_dir, enable_progress_bar=False, log_every_n_steps=3)
    trainer.fit(model, DataLoader(data, batch_size=16), DataLoader(data, batch_size=32))
    restored = RegressionTask.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    expected = {"in_features": 6, "hidden": 10, "dropout": 0.0, "lr": 0.01, "weight_decay": 0.0}
    assert dict(model.hparams) == expected and dict(restored.hparams) == expected, dict(model.hparams)
    return {"trainer": trainer, "restored": restored.head.weight.detach(), "hparams": dict(restored.hparams)}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
