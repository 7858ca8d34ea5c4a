"""Several short multi-process jobs in one launch (process start-up is the slow part on CPU).

ember run --nproc-per-node 2 strategy_cases.py --out DIR --cases manual,gan,fsdp_compile,...

Each case trains a small model and writes ``<case>-rank<R>.pt``: the parameters (and what the case
checks) as this rank sees them. With ``--devices 1`` a case runs in one process, for comparison.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember


def dataset(n: int = 64, features: int = 4) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    return TensorDataset(x, (x @ torch.arange(1.0, features + 1)).unsqueeze(1))


def trainer(devices: int, **flags: Any) -> ember.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=devices, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    return ember.Trainer(**{**defaults, **flags})


class ManualRegressor(ember.Module):
    """Manual optimization, optionally accumulating two micro-batches without syncing the first."""

    def __init__(self, accumulate: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.automatic_optimization = False
        self.accumulate = accumulate

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        if not self.accumulate:
            loss = F.mse_loss(self.layer(x), y)
            self.manual_backward(loss)
        else:  # two halves: the first accumulates locally, the second syncs
            halves = list(zip(x.chunk(2), y.chunk(2)))
            with optimizer.toggle_model(sync_grad=False):
                self.manual_backward(F.mse_loss(self.layer(halves[0][0]), halves[0][1]) / 2)
            loss = F.mse_loss(self.layer(halves[1][0]), halves[1][1]) / 2
            self.manual_backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class TinyGAN(ember.Module):
    """Two optimizers stepped by hand: a discriminator step, then a generator step through it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, _ = batch
        g_opt, d_opt = self.optimizers()
        noise = torch.randn(len(real), 2, generator=torch.Generator().manual_seed(batch_idx + 100 * self.global_rank))
        fake = self.generator(noise)
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        d_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)
        d_opt.zero_grad()
        self.manual_backward(d_loss)
        d_opt.step()
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        g_opt.zero_grad()
        self.manual_backward(g_loss)
        g_opt.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.Adam(self.generator.parameters(), 1e-2),
            torch.optim.Adam(self.discriminator.parameters(), 1e-2),
        ]


class Stages(ember.Module):
    """Three layers in a Sequential: FSDP shards it, a pipeline gives each rank some of its layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if layer is not None:  # a pipeline stage keeps its own layers only
                x = layer(x)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def configure_model(self, device_mesh: Any) -> None:
        """strategy="model_parallel" asks for a layout: here every rank of the row keeps the whole model."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _compiled(module: torch.nn.Module) -> list[str]:
    return [name for name, sub in module.named_modules() if getattr(sub, "_compiled_call_impl", None) is not None]


def run_case(case: str, devices: int, batch_size: int = 8) -> dict[str, Any]:
    loader = DataLoader(dataset(), batch_size=batch_size, shuffle=True)
    if case in ("manual", "manual_accumulate"):
        model: ember.Module = ManualRegressor(accumulate=case == "manual_accumulate")
        run = trainer(devices)
    elif case == "gan":
        model, run = TinyGAN(), trainer(devices, max_epochs=1)
    elif case == "fsdp_validate":  # the sanity check's forward comes first, under inference_mode by default
        model, run = Stages(), trainer(devices, strategy="fsdp", num_sanity_val_steps=2)
        run.fit(model, loader, DataLoader(dataset(16), batch_size=8))
        return {"parameters": None, "global_step": run.global_step, "compiled": [],
                "last_loss": float(run.callback_metrics["val_loss"])}  # fmt: skip
    else:  # "<strategy>_compile"
        model = Stages()
        run = trainer(devices, strategy=case.removesuffix("_compile"), compile={"backend": "eager"})
    run.fit(model, loader)
    sharded = case.endswith("_compile")  # each rank holds other parameters
    return {
        "parameters": None if sharded else [p.detach().clone() for p in model.state_dict().values()],
        "global_step": run.global_step,
        "compiled": _compiled(model),
        "last_loss": None if run.fit_loop.last_loss is None else float(run.fit_loop.last_loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    for case in args.cases.split(","):
        result = run_case(case, args.devices)
        rank = int(os.environ.get("RANK", "0"))
        torch.save(result, os.path.join(args.out, f"{case}-devices{args.devices}-rank{rank}.pt"))


if __name__ == "__main__":
    main()
