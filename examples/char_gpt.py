"""A character-level GPT trained on Python's own standard library sources.

    python examples/char_gpt.py [--max-steps 300] [--layers 2] [--width 96] [--precision bf16-mixed]

The text is the source code of a few standard library modules, read with ``inspect.getsource``, so
nothing is downloaded. The last 10% of it is held out for validation. The script measures the
unigram entropy of the characters (the loss of a model that ignores context), trains a small
decoder-only transformer, and exits with status 1 unless the validation loss (nats per character)
falls below --target, well under that entropy: the model must have learnt to use context.
It ends by sampling a few lines of "Python" from the model.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ember
from ember.callbacks import ModelCheckpoint

MODULES = ("argparse", "textwrap", "string", "shlex", "fnmatch", "glob", "calendar", "difflib")


def stdlib_text() -> str:
    """The sources of ``MODULES`` (a few hundred KB of Python), as one string."""
    import importlib

    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in MODULES)


def unigram_entropy(tokens: torch.Tensor, vocabulary: int) -> float:
    """Nats per character of the best model that ignores context: the entropy of the character frequencies."""
    counts = torch.bincount(tokens, minlength=vocabulary).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


class Windows(Dataset):
    """Windows of ``length`` characters and the same shifted by one (the targets), every ``stride`` characters."""

    def __init__(self, tokens: torch.Tensor, length: int, stride: int) -> None:
        self.tokens, self.length, self.stride = tokens, length, stride

    def __len__(self) -> int:
        return (len(self.tokens) - self.length - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.tokens[start : start + self.length + 1]
        return window[:-1], window[1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.mlp(self.norm2(x)))


class CharGPT(ember.Module):
    def __init__(
        self,
        vocabulary: int,
        context: int = 64,
        layers: int = 2,
        width: int = 96,
        heads: int = 4,
        dropout: float = 0.0,
        lr: float = 6e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.token_embedding = nn.Embedding(vocabulary, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, batch: Any) -> torch.Tensor:
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())  # nats per character

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        # sync_dist: with several processes (see fsdp.py), the loss over every process's share of the data.
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01, betas=(0.9, 0.99))
        steps = int(self.trainer.estimated_stepping_batches)
        warmup = max(1, steps // 20)

        def factor(step: int) -> float:  # linear warm-up, then cosine decay to a tenth
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, steps - warmup)
            return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, count: int, temperature: float = 0.8) -> torch.Tensor:
        tokens = prompt
        for _ in range(count):
            logits = self(tokens[:, -self.hparams.context :])[:, -1] / temperature
            tokens = torch.cat([tokens, torch.multinomial(logits.softmax(dim=-1), 1)], dim=1)
        return tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context", type=int, default=32, help="characters the model sees")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, ...")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--root-dir", default="runs/char_gpt", help="where logs and checkpoints go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=2.2, help="fail if the validation loss (nats/char) is above")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ember.seed_everything(args.seed)
    text = stdlib_text()
    alphabet = sorted(set(text))
    index = {char: i for i, char in enumerate(alphabet)}
    tokens = torch.tensor([index[char] for char in text], dtype=torch.long)
    split = int(0.9 * len(tokens))
    train, val = tokens[:split], tokens[split:]
    entropy = unigram_entropy(train, len(alphabet))
    print(f"{len(text)} characters of {', '.join(MODULES)}; {len(alphabet)} distinct")
    print(f"unigram entropy {entropy:.3f} nats/char; target val_loss < {args.target}")

    train_loader = DataLoader(Windows(train, args.context, stride=1), batch_size=args.batch_size, shuffle=True)
    # Validation reads non-overlapping windows of the held-out text (a fixed sample of it, to stay quick).
    val_loader = DataLoader(Windows(val, args.context, stride=args.context), batch_size=128)
    model = CharGPT(len(alphabet), context=args.context, layers=args.layers, width=args.width, lr=args.lr)
    trainer = ember.Trainer(
        max_steps=args.max_steps,
        val_check_interval=args.max_steps // 3,
        limit_val_batches=4,
        accelerator=args.accelerator,
        precision=args.precision,
        gradient_clip_val=1.0,
        default_root_dir=args.root_dir,
        callbacks=[ModelCheckpoint(monitor="val_loss", save_last=True)],
        log_every_n_steps=25,
    )
    trainer.fit(model, train_loader, val_loader, ckpt_path="last")  # continues when run again
    val_loss = float(trainer.callback_metrics["val_loss"])
    trainer.print(f"val_loss {val_loss:.3f} nats/char ({val_loss / math.log(2):.2f} bits), unigram {entropy:.3f}")

    prompt = torch.tensor([[index[char] for char in "def "]], device=model.device)
    sample = "".join(alphabet[i] for i in model.generate(prompt, 160)[0].tolist())
    trainer.print("sample:\n" + sample)
    if val_loss >= args.target:
        trainer.print(f"FAILED: val_loss {val_loss:.3f} is not below the target {args.target}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
