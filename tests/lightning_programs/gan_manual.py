"""A GAN trained with two optimizers under manual optimization, in the shape of Lightning's basic GAN
tutorial: `automatic_optimization = False`, `self.optimizers()`, `toggle_optimizer`/`untoggle_optimizer`,
`self.manual_backward`, `self.log_dict`, and samples drawn at each epoch's end.

Data: 2-D points on a ring, generated. Noise comes from the seeded generator, in the same order on both
frameworks, and nothing is shuffled, so every value is compared.
"""

import math
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class GAN(pl.LightningModule):
    def __init__(self, latent_dim: int = 4, lr: float = 2e-3, b1: float = 0.5, b2: float = 0.999):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(latent_dim, 32), nn.LeakyReLU(0.2), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        self.samples = []

    def forward(self, z):
        return self.generator(z)

    def training_step(self, batch):
        (real,) = batch
        optimizer_g, optimizer_d = self.optimizers()
        z = torch.randn(real.shape[0], self.hparams.latent_dim).type_as(real)

        self.toggle_optimizer(optimizer_g)
        fake = self(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(real.shape[0], 1))
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        self.toggle_optimizer(optimizer_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), torch.ones(real.shape[0], 1))
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), torch.zeros(real.shape[0], 1))
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self):
        betas = (self.hparams.b1, self.hparams.b2)
        optimizer_g = torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas)
        optimizer_d = torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas)
        return [optimizer_g, optimizer_d], []

    def on_train_epoch_end(self):
        with torch.no_grad():
            self.samples.append(self(torch.randn(8, self.hparams.latent_dim)))


def ring(count):
    angles = torch.linspace(0, 2 * math.pi, count)
    return torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)


def main(root_dir="."):
    pl.seed_everything(1)
    model = GAN()
    trainer = pl.Trainer(max_epochs=3, default_root_dir=root_dir, enable_progress_bar=False, log_every_n_steps=4)
    trainer.fit(model, DataLoader(TensorDataset(ring(256)), batch_size=32))
    return {"trainer": trainer, "samples": torch.stack(model.samples)}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
