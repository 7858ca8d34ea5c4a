"""Transfer learning in the shape of fine-tuning scripts: a pretrained backbone frozen at first, a custom
`BaseFinetuning` callback that unfreezes it at a chosen epoch into its own parameter group with a lower
learning rate, and `BackboneFinetuning` for the same on a second run.

Data: scikit-learn's digits. The "pretrained" backbone is an autoencoder's encoder trained first on the same
images. Nothing is shuffled, so every value is compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class UnfreezeAt(BaseFinetuning):
    def __init__(self, unfreeze_at_epoch=1):
        super().__init__()
        self._unfreeze_at_epoch = unfreeze_at_epoch

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == self._unfreeze_at_epoch:
            self.unfreeze_and_add_param_group(modules=pl_module.backbone, optimizer=optimizer, train_bn=True)


class TransferModel(pl.LightningModule):
    def __init__(self, backbone, lr=0.05):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        self.backbone = backbone
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.backbone(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(dim=-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=self.hparams.lr)


def pretrained_backbone(images):
    encoder = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU())
    decoder = nn.Linear(16, 64)
    optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=1e-2)
    for _ in range(50):
        optimizer.zero_grad()
        F.mse_loss(decoder(encoder(images)), images).backward()
        optimizer.step()
    return encoder


def main(root_dir="."):
    images, labels = load_digits(return_X_y=True)
    x, y = torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels)
    train = DataLoader(TensorDataset(x[:1400], y[:1400]), batch_size=100)
    val = DataLoader(TensorDataset(x[1400:], y[1400:]), batch_size=200)
    outcome = {}
    for name, callback in (("custom", UnfreezeAt(1)), ("backbone", BackboneFinetuning(unfreeze_backbone_at_epoch=1))):
        pl.seed_everything(8)
        model = TransferModel(pretrained_backbone(x[:1400]))
        trainer = pl.Trainer(max_epochs=3, callbacks=[callback], default_root_dir=root_dir, enable_progress_bar=False)
        trainer.fit(model, train, val)
        groups = trainer.optimizers[0].param_groups
        assert len(groups) == 2 and all(p.requires_grad for p in model.backbone.parameters())
        outcome[name] = {"trainer": trainer, "lrs": [group["lr"] for group in groups]}
    return outcome


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
