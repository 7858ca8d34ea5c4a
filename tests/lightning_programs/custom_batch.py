"""A project template's data side: batches of a type of its own moved by `transfer_batch_to_device`,
normalized on the device in `on_after_batch_transfer`, dict samples collated by a custom `collate_fn`, and
steps written without `batch_idx` (Lightning lets a step leave it out).

Data: generated tabular records. Nothing is shuffled, so every value is compared.
"""

import sys
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


@dataclass
class Records:
    features: torch.Tensor
    target: torch.Tensor

    def __len__(self):
        return len(self.target)


class RecordDataset(Dataset):
    def __init__(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        self.features = torch.randn(count, 5, generator=generator) * 3 + 1
        self.target = (self.features[:, 0] - self.features[:, 3] > 0).long()

    def __len__(self):
        return len(self.target)

    def __getitem__(self, index):
        return {"features": self.features[index], "target": self.target[index]}


def collate(samples):
    return Records(torch.stack([s["features"] for s in samples]), torch.stack([s["target"] for s in samples]))


class TabularModel(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.transfers = 0

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        if isinstance(batch, Records):
            self.transfers += 1
            return Records(batch.features.to(device), batch.target.to(device))
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        batch.features = (batch.features - 1) / 3
        return batch

    def training_step(self, batch):
        loss = F.cross_entropy(self.net(batch.features), batch.target)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch):
        self.log("val_acc", (self.net(batch.features).argmax(-1) == batch.target).float().mean())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(root_dir="."):
    pl.seed_everything(4)
    model = TabularModel()
    trainer = pl.Trainer(max_epochs=3, default_root_dir=root_dir, enable_progress_bar=False, log_every_n_steps=5)
    train = DataLoader(RecordDataset(256, 0), batch_size=32, collate_fn=collate)
    val = DataLoader(RecordDataset(64, 1), batch_size=32, collate_fn=collate)
    trainer.fit(model, train, val)
    assert float(trainer.callback_metrics["val_acc"]) > 0.8
    return {"trainer": trainer, "transfers": model.transfers}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
