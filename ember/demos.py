"""Small models and random datasets for trying things out and for bug reports: they need no download.

``BoringModel`` learns to map random vectors of 32 to a constant pair; ``Transformer`` is a small
encoder-decoder language model, ``LightningTransformer`` trains it on ``(inputs, target)`` token batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, random_split

from ember.module import DataModule, Module

__all__ = [
    "BoringDataModule",
    "BoringModel",
    "LightningTransformer",
    "RandomDataset",
    "RandomDictDataset",
    "RandomIterableDataset",
    "Transformer",
]


class RandomDataset(Dataset):
    """``length`` random vectors of ``size`` (drawn once, from the global generator)."""

    def __init__(self, size: int, length: int) -> None:
        self.len = length
        self.data = torch.randn(length, size)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class RandomDictDataset(RandomDataset):
    """Samples as ``{"a": x, "b": x + 1}``."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:  # type: ignore[override]
        sample = self.data[index]
        return {"a": sample, "b": sample + 1}


class RandomIterableDataset(IterableDataset):
    """``count`` random vectors of ``size``, drawn as they are read; it has no length."""

    def __init__(self, size: int, count: int) -> None:
        self.size = size
        self.count = count

    def __iter__(self) -> Iterator[torch.Tensor]:
        for _ in range(self.count):
            yield torch.randn(self.size)


class BoringModel(Module):
    """One linear layer (32 to 2) trained with SGD to output ones; every step and loader defined. Subclass it
    and override the part a bug report is about."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def loss(self, predictions: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return F.mse_loss(predictions, torch.ones_like(predictions) if labels is None else labels)

    def step(self, batch: torch.Tensor) -> torch.Tensor:
        return self.loss(self(batch))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"loss": self.step(batch)}

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"x": self.step(batch)}

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"y": self.step(batch)}

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def test_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64))


class ManualOptimBoringModel(BoringModel):
    """``BoringModel`` stepping its optimizer itself (``automatic_optimization = False``)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> dict[str, torch.Tensor]:
        optimizer = self.optimizers()
        loss = self.step(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return {"loss": loss}


class BoringDataModule(DataModule):
    """256 random vectors of 32, split into four parts of 64 for training, validation, test and prediction."""

    def __init__(self) -> None:
        super().__init__()
        self.random_full = RandomDataset(32, 64 * 4)

    def setup(self, stage: str) -> None:
        self.random_train, self.random_val, self.random_test, self.random_predict = random_split(
            self.random_full, [64, 64, 64, 64], generator=torch.Generator().manual_seed(42)
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.random_train)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.random_val)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.random_test)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.random_predict)


class Transformer(nn.Module):
    """An encoder-decoder transformer over a vocabulary: ``forward(inputs, target)`` returns the log-probabilities
    of the next token at each target position, flattened to ``(batch * length, vocab_size)``."""

    def __init__(self, vocab_size: int = 33278, ninp: int = 200, nhead: int = 2, nhid: int = 200,
                 nlayers: int = 2, dropout: float = 0.2) -> None:  # fmt: skip
        super().__init__()
        self.vocab_size = vocab_size
        self.embedding = nn.Embedding(vocab_size, ninp)
        self.transformer = nn.Transformer(
            d_model=ninp, nhead=nhead, num_encoder_layers=nlayers, num_decoder_layers=nlayers,
            dim_feedforward=nhid, dropout=dropout, batch_first=True,
        )  # fmt: skip
        self.decoder = nn.Linear(ninp, vocab_size)
        self.ninp = ninp

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(1)
        frequencies = torch.exp(torch.arange(0, self.ninp, 2, device=tokens.device) * (-math.log(10000.0) / self.ninp))
        encoding = torch.zeros(tokens.shape[1], self.ninp, device=tokens.device)
        encoding[:, 0::2] = torch.sin(positions * frequencies)
        encoding[:, 1::2] = torch.cos(positions * frequencies[: encoding[:, 1::2].shape[1]])
        return self.embedding(tokens) * math.sqrt(self.ninp) + encoding

    def forward(self, inputs: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:  # each target position sees only the positions before it
            mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1], device=target.device)
        output = self.transformer(self._embed(inputs), self._embed(target), tgt_mask=mask)
        return F.log_softmax(self.decoder(output), dim=-1).reshape(-1, self.vocab_size)


class LightningTransformer(Module):
    """Trains ``Transformer`` on batches of ``(inputs, target)`` token tensors with SGD; bring the loaders."""

    def __init__(self, vocab_size: int = 33278) -> None:
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, target)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        return F.nll_loss(self(inputs, target), target.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.1)
