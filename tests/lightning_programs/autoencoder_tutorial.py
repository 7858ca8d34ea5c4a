"""The autoencoder of Lightning's 15-minute introduction: `import lightning as L`, one module with its steps,
`L.Trainer(limit_train_batches=..., max_epochs=...)`, then `trainer.test` with a dataloader.

Data: scikit-learn's digits (8x8 images), flattened. No shuffling, so every value can be compared.
"""

import sys

import lightning as L
import torch
from sklearn.datasets import load_digits
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset


class LitAutoEncoder(L.LightningModule):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def training_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        z = self.encoder(x)
        x_hat = self.decoder(z)
        loss = nn.functional.mse_loss(x_hat, x)
        self.log("train_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        x, _ = batch
        x = x.view(x.size(0), -1)
        x_hat = self.decoder(self.encoder(x))
        self.log("test_loss", nn.functional.mse_loss(x_hat, x))

    def configure_optimizers(self):
        return optim.Adam(self.parameters(), lr=1e-3)


def main(root_dir="."):
    L.seed_everything(0)
    images, labels = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels))
    train, test = torch.utils.data.random_split(data, [1500, 297], generator=torch.Generator().manual_seed(0))

    encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 3))
    decoder = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 64))
    autoencoder = LitAutoEncoder(encoder, decoder)

    trainer = L.Trainer(limit_train_batches=20, max_epochs=2, default_root_dir=root_dir, log_every_n_steps=10)
    trainer.fit(model=autoencoder, train_dataloaders=DataLoader(train, batch_size=32))
    results = trainer.test(autoencoder, dataloaders=DataLoader(test, batch_size=64))
    return {"trainer": trainer, "test": results}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
