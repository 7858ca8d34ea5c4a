"""Fine-tuning in the shape of the Hugging Face-style Lightning scripts: a learning-rate warm-up done by
overriding `optimizer_step` (the warm-up must take effect, or the model would not train), a linear decay
scheduler stepped per step, and gradient norms logged with `grad_norm` in `on_before_optimizer_step`.

Data: a generated sequence-classification task (is the sum of the tokens even?). Nothing is shuffled, so
every value is compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SequenceClassifier(pl.LightningModule):
    def __init__(self, vocab=10, width=24, learning_rate=5e-3, warmup_steps=6):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = nn.GRU(width, width, batch_first=True)
        self.classifier = nn.Linear(width, 2)

    def forward(self, tokens):
        _, hidden = self.encoder(self.embed(tokens))
        return self.classifier(hidden[-1])

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = F.cross_entropy(self(tokens), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, labels = batch
        self.log("val_acc", (self(tokens).argmax(dim=-1) == labels).float().mean(), prog_bar=True)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if self.trainer.global_step < self.hparams.warmup_steps:
            scale = min(1.0, float(self.trainer.global_step + 1) / self.hparams.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = scale * self.hparams.learning_rate
        optimizer.step(closure=optimizer_closure)

    def on_before_optimizer_step(self, optimizer):
        norms = grad_norm(self.encoder, norm_type=2)
        self.log("grad_2.0_norm_total", norms["grad_2.0_norm_total"])

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.learning_rate)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.1, 1 - step / total))
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def task(count, seed):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 10, (count, 8), generator=generator)
    return TensorDataset(tokens, tokens.sum(dim=1) % 2)


def main(root_dir="."):
    pl.seed_everything(21)
    model = SequenceClassifier()
    trainer = pl.Trainer(max_epochs=3, default_root_dir=root_dir, log_every_n_steps=5, enable_progress_bar=False)
    trainer.fit(model, DataLoader(task(480, 0), batch_size=32), DataLoader(task(96, 1), batch_size=96))
    return {"trainer": trainer, "lr": trainer.optimizers[0].param_groups[0]["lr"]}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
