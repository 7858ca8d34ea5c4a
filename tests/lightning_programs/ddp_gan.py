"""A GAN under DDP on two processes with `strategy="ddp_find_unused_parameters_true"`, as GAN projects
need: in the discriminator's step the generator gets no gradient, which plain DDP refuses. Two optimizers
under manual optimization, losses reduced across processes.

Run it with two processes (`python ddp_gan.py ROOT`; Lightning starts the second). Data: points on a ring.
"""

import math
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from _summary import write_summary
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class RingGAN(pl.LightningModule):
    def __init__(self, latent_dim: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent_dim, 16), nn.ReLU(), nn.Linear(16, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        (real,) = batch
        optimizer_g, optimizer_d = self.optimizers()
        fake = self.generator(torch.randn(real.shape[0], self.hparams.latent_dim))

        d_loss = (F.softplus(-self.discriminator(real)) + F.softplus(self.discriminator(fake.detach()))).mean()
        optimizer_d.zero_grad()
        self.manual_backward(d_loss)
        optimizer_d.step()

        g_loss = F.softplus(-self.discriminator(fake)).mean()
        optimizer_g.zero_grad()
        self.manual_backward(g_loss)
        optimizer_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, sync_dist=True)

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)]  # fmt: skip


def main(root_dir="."):
    pl.seed_everything(5)
    angles = torch.linspace(0, 2 * math.pi, 256)
    points = torch.stack([angles.cos(), angles.sin()], dim=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_find_unused_parameters_true", max_epochs=2,
        default_root_dir=root_dir, enable_progress_bar=False, log_every_n_steps=2,
    )  # fmt: skip
    trainer.fit(RingGAN(), DataLoader(TensorDataset(points), batch_size=32))
    write_summary(trainer, root_dir)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
