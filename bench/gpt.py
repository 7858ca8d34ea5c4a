"""GPT-2 small on random tokens: a hand-written training loop against Ember, in three precision modes.

The model has GPT-2 small's shape (12 layers, 12 heads, width 768, vocabulary 50257, context 1024: 124M
parameters, the output layer tied to the token embedding). Each mode -- fp32 (TF32 matmuls on a GPU),
bf16-mixed, and bf16-mixed with torch.compile -- trains the same initial weights with AdamW on the same
batches, first in a hand-written loop, then through ``Trainer.fit``, in one process. Both are timed from
the end of the warm-up steps to the end of the last step, with the device synchronised at both ends only.

Tokens/s and MFU use one FLOP count for both loops: the forward and backward pass of one sequence,
counted once with ``torch.utils.flop_counter`` on the meta device, against the peak FLOP/s that
``ember.callbacks.ThroughputMonitor`` knows for the GPU (or ``--peak-tflops``).

    python bench/gpt.py              # GPT-2 small on the GPU
    python bench/gpt.py --tiny       # a tiny GPT on CPU in a couple of minutes (the default without a GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

import ember
from ember.callbacks import Callback
from ember.callbacks.throughput import peak_flops


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768


GPT2_SMALL = GPTConfig()
TINY = GPTConfig(vocab_size=1024, block_size=128, n_layer=2, n_head=4, n_embd=128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mode:
    name: str
    precision: str  # the Trainer's precision flag
    compile: bool


MODES = [
    Mode(name="fp32", precision="32-true", compile=False),
    Mode(name="bf16-mixed", precision="bf16-mixed", compile=False),
    Mode(name="bf16-mixed + compile", precision="bf16-mixed", compile=True),
]


# ====================================================================================== the model
class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.attn_out = nn.Linear(config.n_embd, config.n_embd)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.mlp_out = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A GPT-2 decoder; ``forward`` returns the next-token cross-entropy, so compiling it covers the loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def make_model(config: GPTConfig) -> GPT:
    torch.manual_seed(0)  # the same initial weights in every run
    return GPT(config)


def make_optimizer(parameters: Iterable[nn.Parameter], device: torch.device) -> torch.optim.Optimizer:
    # fused: one kernel for the whole update on a GPU (foreach, the default, elsewhere)
    return torch.optim.AdamW(parameters, lr=3e-4, weight_decay=0.1, fused=True if device.type == "cuda" else None)


def flops_per_sequence(config: GPTConfig) -> int:
    """FLOPs of the forward and backward pass of one sequence, counted on the meta device (no compute)."""
    with torch.device("meta"):
        model = GPT(config)
        tokens = torch.randint(0, config.vocab_size, (1, config.block_size))
        with FlopCounterMode(display=False) as counter:
            model(tokens, tokens).backward()
    return counter.get_total_flops()


# ============================================================================== the two loops
def handwritten(config: GPTConfig, mode: Mode, loader: DataLoader, device: torch.device, warmup: int) -> float:
    """Seconds the steps after ``warmup`` took in a plain PyTorch loop."""
    model = make_model(config).to(device)
    optimizer = make_optimizer(model.parameters(), device)
    step_fn = torch.compile(model) if mode.compile else model
    bf16 = mode.precision == "bf16-mixed"
    start = 0.0
    for step, (tokens, targets) in enumerate(loader):
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = step_fn(tokens, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == warmup - 1:
            start = _synchronized_time(device)
    return _synchronized_time(device) - start


class EmberGPT(ember.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gpt = make_model(config)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.gpt(tokens, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return self(tokens, targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters(), self.device)


class _Timer(Callback):
    """Times the batches after ``warmup`` the same way as the hand-written loop."""

    def __init__(self, warmup: int, device: torch.device) -> None:
        self.warmup = warmup
        self.device = device
        self.start = self.seconds = 0.0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.warmup - 1:
            self.start = _synchronized_time(self.device)
        elif batch_idx == trainer.num_training_batches - 1:
            self.seconds = _synchronized_time(self.device) - self.start


def with_ember(config: GPTConfig, mode: Mode, loader: DataLoader, device: torch.device, warmup: int) -> float:
    """Seconds the steps after ``warmup`` took in ``Trainer.fit``."""
    timer = _Timer(warmup, device)
    trainer = ember.Trainer(
        accelerator=device.type,
        devices=1,
        precision=mode.precision,
        compile=mode.compile,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(EmberGPT(config), loader)
    return timer.seconds


def _synchronized_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ================================================================================== the run
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT on CPU (the default without a GPU)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (16; 8 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (30; 20 with --tiny)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat each pair, alternating which runs first")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, if not in the table")
    parser.add_argument("--modes", default=",".join(mode.name for mode in MODES), help="comma-separated modes")
    args = parser.parse_args()

    tiny = args.tiny or not torch.cuda.is_available()
    device = torch.device("cpu" if tiny else "cuda")
    config = TINY if tiny else GPT2_SMALL
    batch_size = args.batch_size or (8 if tiny else 16)
    steps = args.steps or (20 if tiny else 30)
    modes = [mode for mode in MODES if mode.name in args.modes.split(",")]
    if tiny:
        torch.set_num_threads(1)  # steadier figures on a shared machine
    # TF32 for the fp32 mode on a GPU; both loops run under the same setting.
    torch.set_float32_matmul_precision("high" if device.type == "cuda" else "highest")

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, ((args.warmup + steps) * batch_size, config.block_size + 1),
                           generator=generator)  # fmt: skip
    loader = DataLoader(
        TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size, pin_memory=device.type == "cuda"
    )
    flops_per_token = flops_per_sequence(config) / config.block_size
    with torch.device("meta"):
        parameters = sum(p.numel() for p in GPT(config).parameters())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (1 thread)"
    print(f"{'tiny GPT' if tiny else 'GPT-2 small'}: {parameters / 1e6:.1f}M parameters, sequence {config.block_size}, "
          f"vocabulary {config.vocab_size}, batch {batch_size}; {where}; torch {torch.__version__}, ember "
          f"{ember.__version__}; {steps} timed steps after {args.warmup}, {args.rounds} round(s)")  # fmt: skip
    print(f"FLOPs per token (forward + backward, torch.utils.flop_counter): {flops_per_token:.4g}")

    tokens_per_run = steps * batch_size * config.block_size
    header = f"{'mode':<22} {'hand-written tok/s':>18} {'MFU':>6} {'Ember tok/s':>12} {'MFU':>6} {'Ember/hand':>10}"
    print(header)
    for mode in modes:
        seconds: dict[str, list[float]] = {"hand": [], "ember": []}
        for round_index in range(args.rounds):
            runs = [("hand", handwritten), ("ember", with_ember)]
            for name, run in runs if round_index % 2 == 0 else runs[::-1]:
                seconds[name].append(run(config, mode, loader, device, args.warmup))
                _release(device)
        if mode.compile:
            torch._dynamo.reset()  # drop compiled graphs before the next mode
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device, mode.precision)
        rates = {name: tokens_per_run / statistics.median(values) for name, values in seconds.items()}

        def mfu(rate: float, peak: float | None = peak) -> str:
            return f"{rate * flops_per_token / peak:.1%}" if peak else "n/a"

        label = "fp32 (TF32 matmuls)" if mode.name == "fp32" and device.type == "cuda" else mode.name
        print(f"{label:<22} {rates['hand']:>18.0f} {mfu(rates['hand']):>6} {rates['ember']:>12.0f} "
              f"{mfu(rates['ember']):>6} {rates['ember'] / rates['hand']:>9.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
