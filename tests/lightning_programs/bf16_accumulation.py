"""A small transformer trained as in common language-model training scripts: bfloat16 mixed precision,
gradient accumulation, gradient clipping, a one-cycle schedule sized by `trainer.estimated_stepping_batches`,
LearningRateMonitor, and the learning rate read back from `trainer.callback_metrics["lr-AdamW"]`.

Data: generated token sequences (each token predicts the next). Nothing is shuffled, so every value is
compared.
"""

import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import LearningRateMonitor
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TinyLM(pl.LightningModule):
    def __init__(self, vocab: int = 16, width: int = 32, lr: float = 3e-3):
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens), mask=mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def sequences(count, length, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (count, 1), generator=generator)
    step = torch.randint(1, 3, (count, 1), generator=generator)
    return (start + step * torch.arange(length)) % vocab


def main(root_dir="."):
    pl.seed_everything(5)
    model = TinyLM()
    trainer = pl.Trainer(
        max_epochs=2,
        precision="bf16-mixed",
        accumulate_grad_batches=4,
        gradient_clip_val=1.0,
        callbacks=[LearningRateMonitor(logging_interval="step")],
        default_root_dir=root_dir,
        log_every_n_steps=2,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(sequences(320, 12, 16, 0)), batch_size=16))
    assert trainer.global_step == 10 and float(trainer.callback_metrics["lr-AdamW"]) < 1e-3
    return {"trainer": trainer, "lr": float(trainer.callback_metrics["lr-AdamW"])}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
