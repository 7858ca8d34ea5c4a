"""A training entry point built on LightningCLI, as about a fifth of Lightning projects are: the model and
datamodule configured from a YAML file and from flags, a callback given by class path, `--print_config`,
and `fit` then `test` from the command line.

Data: generated tensors. Nothing is shuffled, so every value is compared.
"""

import contextlib
import io
import os
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset


class LinearModel(pl.LightningModule):
    def __init__(self, in_features: int = 4, hidden: int = 8, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(in_features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", F.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class SyntheticData(pl.LightningDataModule):
    def __init__(self, samples: int = 128, batch_size: int = 16):
        super().__init__()
        self.samples = samples
        self.batch_size = batch_size

    def setup(self, stage):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 4, generator=generator)
        self.dataset = TensorDataset(x, (x**2).sum(dim=1, keepdim=True))

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.dataset, batch_size=64)

    def test_dataloader(self):
        return DataLoader(self.dataset, batch_size=64)


CONFIG = """\
seed_everything: 13
trainer:
  max_epochs: 2
  enable_progress_bar: false
  log_every_n_steps: 4
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        monitor: val_loss
        filename: best-{epoch}
model:
  hidden: 16
data:
  batch_size: 32
"""


def main(root_dir="."):
    config = os.path.join(root_dir, "config_in.yaml")
    with open(config, "w") as file:
        file.write(CONFIG)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
        LightningCLI(LinearModel, SyntheticData, args=["fit", "--config", config, "--print_config"])
    assert "hidden: 16" in printed.getvalue() and "batch_size: 32" in printed.getvalue()
    args = ["--config", config, f"--trainer.default_root_dir={root_dir}", "--model.lr=0.02"]
    cli = LightningCLI(LinearModel, SyntheticData, args=["fit", *args])
    tested = LightningCLI(
        LinearModel, SyntheticData, args=["test", *args, "--ckpt_path", cli.trainer.checkpoint_callback.best_model_path]
    )
    assert cli.model.hparams.hidden == 16 and cli.model.hparams.lr == 0.02
    return {"fit": cli.trainer, "test": tested.trainer}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
