"""Jobs for the model-parallel tests, run one after the other in the same processes:

    ember run --nproc-per-node 2 train_sharded.py --out DIR

fsdp: DDP and FSDP (with block wrapping, activation checkpointing, clipping and accumulation) on the
same data; FSDP saves sharded checkpoints. resume: FSDP built on the meta device resumes from the last
one. tensor: 2-way tensor parallel on a small transformer. pipeline: 2 stages, 4 micro-batches. With
--nproc-per-node 4: the 2 x 2 meshes (tensor parallel rows sharded over "data", FSDP-sharded pipelines).
Each rank writes DIR/<job>-rank<R>.pt with its parameters (whole, by name) and what the tests check.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import ModelCheckpoint
from ember.strategies import FSDPStrategy, ModelParallelStrategy, PipelineStrategy, parallelize_transformer


def regression_data(n: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, (x @ torch.arange(1.0, 5.0)).unsqueeze(1).sin())


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Net(ember.Module):
    """An MLP of blocks whose forward skips the submodules a pipeline stage does not hold."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 16)
        self.layers = nn.ModuleList(Block(16) for _ in range(4))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            if layer is not None:
                x = layer(x)
        return self.head(x) if self.head is not None else x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Attention(nn.Module):
    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # the head count comes from the width this rank holds: n_heads / tensor_parallel_size
        q, k, v = (p(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for p in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(width, 2 * width), nn.Linear(width, 2 * width)
        self.w2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention, self.feed_forward = Attention(width, head_dim=4), FeedForward(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(ember.Module):
    """A one-block transformer with the layer names of torchtitan's Llama."""

    def __init__(self, vocabulary: int = 32, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(vocabulary, width)
        self.layers = nn.ModuleList([TransformerBlock(width)])
        self.norm = nn.LayerNorm(width)
        self.output = nn.Linear(width, vocabulary)

    def configure_model(self, device_mesh: Any) -> None:
        parallelize_transformer(self, device_mesh["tensor"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def token_data(n: int = 32, length: int = 8) -> TensorDataset:
    tokens = torch.randint(0, 32, (n, length + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def trainer(out: str, **flags: Any) -> ember.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", enable_progress_bar=False, logger=False, enable_checkpointing=False,
        num_sanity_val_steps=0, default_root_dir=out,
    )  # fmt: skip
    return ember.Trainer(**{**defaults, **flags})


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter whole (gathered from its shards), by name."""
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in module.named_parameters()
    }


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of parameters and optimizer state this rank holds."""
    tensors = list(module.parameters()) + [
        value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)
    ]
    return sum(local.numel() * local.element_size() for local in (getattr(t, "_local_tensor", t) for t in tensors))


def fsdp_jobs(out: str) -> None:
    rank, loader = int(os.environ["RANK"]), DataLoader(regression_data(), batch_size=8)
    flags = dict(max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.3)
    ddp_model = Net()
    ddp = trainer(out, strategy="ddp", **flags)
    ddp.fit(ddp_model, loader)
    fsdp_model = Net()
    strategy = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    checkpoints = ModelCheckpoint(dirpath=os.path.join(out, "fsdp"), save_last=True)
    fsdp = trainer(out, strategy=strategy, callbacks=[checkpoints], enable_checkpointing=True, **flags)
    fsdp.fit(fsdp_model, loader, DataLoader(regression_data(16), batch_size=4))
    torch.save(
        {
            "ddp": full_parameters(ddp_model),
            "fsdp": full_parameters(fsdp_model),
            "ddp_bytes": state_bytes(ddp_model, ddp.optimizers[0]),
            "fsdp_bytes": state_bytes(fsdp_model, fsdp.optimizers[0]),
            "shards_are_dtensors": all(hasattr(p, "full_tensor") for p in fsdp_model.parameters()),
            "last": checkpoints.last_model_path,
            "best": checkpoints.best_model_path,
        },
        os.path.join(out, f"fsdp-rank{rank}.pt"),
    )
    with torch.device("meta"):
        resumed = Net()
    again = trainer(out, strategy=FSDPStrategy(auto_wrap_policy={Block}), **{**flags, "max_epochs": 3})
    again.fit(resumed, loader, ckpt_path=checkpoints.last_model_path)
    # The same, with the checkpoints written in the background.
    written_later = ModelCheckpoint(dirpath=os.path.join(out, "fsdp-async"), save_last=True)
    strategy = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    trainer(out, strategy=strategy, callbacks=[written_later], enable_checkpointing=True, async_checkpoint=True,
            **flags).fit(Net(), loader, DataLoader(regression_data(16), batch_size=4))  # fmt: skip
    with torch.device("meta"):
        resumed_async = Net()
    again_async = trainer(out, strategy=FSDPStrategy(auto_wrap_policy={Block}), async_checkpoint=True,
                          **{**flags, "max_epochs": 3})  # fmt: skip
    again_async.fit(resumed_async, loader, ckpt_path=written_later.last_model_path)
    torch.save(
        {"resumed": full_parameters(resumed), "resumed_async": full_parameters(resumed_async)},
        os.path.join(out, f"resume-rank{rank}.pt"),
    )


def tensor_parallel_job(out: str) -> None:
    rank, model = int(os.environ["RANK"]), TinyLM()
    run = trainer(out, strategy=ModelParallelStrategy(1, 2), max_epochs=2, gradient_clip_val=0.5)
    run.fit(model, DataLoader(token_data(), batch_size=8))
    try:  # a width that two ranks cannot split evenly
        odd = TinyLM(vocabulary=33)
        parallelize_transformer(odd, run.strategy.device_mesh["tensor"])
        error = ""
    except ValueError as caught:
        error = str(caught)
    torch.save(
        {"parameters": full_parameters(model), "dtensors": sum(hasattr(p, "full_tensor") for p in model.parameters()),
         "odd_error": error},
        os.path.join(out, f"tensor-rank{rank}.pt"),
    )  # fmt: skip


def pipeline_job(out: str) -> None:
    rank, model = int(os.environ["RANK"]), Net()
    checkpoints = ModelCheckpoint(dirpath=os.path.join(out, "pipeline"), save_last=True)
    run = trainer(
        out, strategy=PipelineStrategy(4, split_points=["layers.2"]), max_epochs=2, gradient_clip_val=0.3,
        callbacks=[checkpoints], enable_checkpointing=True, num_sanity_val_steps=1,
    )  # fmt: skip
    run.fit(model, DataLoader(regression_data(), batch_size=8), DataLoader(regression_data(16), batch_size=8))
    torch.save(
        {"parameters": full_parameters(model), "val_loss": float(run.callback_metrics["val_loss"]),
         "last_loss": float(run.fit_loop.last_loss), "last": checkpoints.last_model_path},
        os.path.join(out, f"pipeline-rank{rank}.pt"),
    )  # fmt: skip


def two_dimensional_jobs(out: str) -> None:
    """On 4 ranks: 2 data-parallel rows of 2-way tensor parallel, then 2 pipelines of 2 stages."""
    rank, model = int(os.environ["RANK"]), TinyLM()
    run = trainer(out, strategy=ModelParallelStrategy(2, 2), max_epochs=1)
    run.fit(model, DataLoader(token_data(), batch_size=4))
    placements = sorted({str(p.placements) for p in model.parameters()})
    result = {"parameters": full_parameters(model), "placements": placements}
    torch.save(result, os.path.join(out, f"2d-tensor-rank{rank}.pt"))
    model = Net()
    trainer(out, strategy=PipelineStrategy(2, split_points=["layers.2"], data_parallel_size=2), max_epochs=1).fit(
        model, DataLoader(regression_data(), batch_size=8)
    )
    torch.save({"parameters": full_parameters(model)}, os.path.join(out, f"2d-pipeline-rank{rank}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if os.environ["WORLD_SIZE"] == "4":
        two_dimensional_jobs(args.out)
        return
    fsdp_jobs(args.out)
    tensor_parallel_job(args.out)
    pipeline_job(args.out)


if __name__ == "__main__":
    main()
