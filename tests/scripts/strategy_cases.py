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


ACCELERATOR = "cpu"  # --accelerator cuda runs the cases on GPUs


def trainer(devices: int, **flags: Any) -> ember.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator=ACCELERATOR, devices=devices, max_epochs=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    return ember.Trainer(**{**defaults, **flags})


class ManualRegressor(ember.Module):
    """Manual optimization, optionally accumulating two micro-batches without syncing the first (under
    ``optimizer.toggle_model(sync_grad=False)`` or the strategy's ``no_sync()``)."""

    def __init__(self, accumulate: str = "", batchnorm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)) if batchnorm else (
            torch.nn.Linear(4, 1))  # fmt: skip
        self.automatic_optimization = False
        self.accumulate = accumulate
        #: The all-reduces that the backward passes ran: [synced, unsynced] (both counted on two processes).
        self.all_reduces = [0, 0]
        #: The buffers (a BatchNorm's statistics) as each training step found them.
        self.buffers_seen: list[list[torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        x, y = batch
        self.buffers_seen.append([buffer.cpu().clone() for buffer in self.buffers()])
        if not self.accumulate:
            loss = F.mse_loss(self.layer(x), y)
            self._backward(loss, synced=True)
        else:  # two halves: the first accumulates locally, the second syncs
            halves = list(zip(x.chunk(2), y.chunk(2)))
            unsynced = optimizer.toggle_model(sync_grad=False) if self.accumulate == "toggle_model" else None
            with unsynced or self.trainer.strategy.no_sync():
                self._backward(F.mse_loss(self.layer(halves[0][0]), halves[0][1]) / 2, synced=False)
            loss = F.mse_loss(self.layer(halves[1][0]), halves[1][1]) / 2
            self._backward(loss, synced=True)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    def _backward(self, loss: torch.Tensor, synced: bool) -> None:
        import torch.distributed as dist

        all_reduce, counter = dist.all_reduce, self.all_reduces

        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[0 if synced else 1] += 1
            return all_reduce(*args, **kwargs)

        dist.all_reduce = counted
        try:
            self.manual_backward(loss)
        finally:
            dist.all_reduce = all_reduce

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
        generator = torch.Generator().manual_seed(batch_idx + 100 * self.global_rank)
        fake = self.generator(torch.randn(len(real), 2, generator=generator).to(self.device))
        ones, zeros = torch.ones(len(real), 1, device=self.device), torch.zeros(len(real), 1, device=self.device)
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


class Sized(ember.Module):
    """For the batch-size finder: batches above ``limit`` samples do not fit on this rank; the parameters
    (1 MiB) outweigh a trial's activations, so that a trial's peak memory shows what it holds for them."""

    def __init__(self, limit: int, batch_size: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 512), torch.nn.Linear(512, 508), torch.nn.Linear(508, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if len(x) > self.hparams.limit:
            raise torch.OutOfMemoryError(f"{len(x)} samples do not fit")
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(), batch_size=self.hparams.batch_size)


def tune_case(case: str, rank: int) -> dict[str, Any]:
    """The batch-size finder on every rank: "tune" with a limit that differs by rank, "tune_nothing" with
    nothing fitting on rank 1, "tune_peak" measuring a trial's memory (printed by rank zero)."""
    import contextlib
    import io
    import time

    from ember.tuner import Tuner

    limit = {"tune": [40, 16], "tune_nothing": [40, 0], "tune_peak": [2, 2]}[case][rank]
    run = trainer(2)
    printed = io.StringIO()
    started = time.monotonic()
    try:
        with contextlib.redirect_stdout(printed):
            found: Any = Tuner(run).scale_batch_size(Sized(limit), init_val=2, steps_per_trial=1,
                                                     max_memory=2**40 if case == "tune_peak" else None)  # fmt: skip
    except torch.OutOfMemoryError as error:
        found = str(error)
    parameter_bytes = sum(p.numel() * p.element_size() for p in Sized(limit).parameters())
    return {"found": found, "seconds": time.monotonic() - started, "printed": printed.getvalue(),
            "parameter_bytes": parameter_bytes}  # fmt: skip


def _compiled(module: torch.nn.Module) -> list[str]:
    return [name for name, sub in module.named_modules() if getattr(sub, "_compiled_call_impl", None) is not None]


def run_case(case: str, devices: int, batch_size: int = 8) -> dict[str, Any]:
    loader = DataLoader(dataset(), batch_size=batch_size, shuffle=True)
    if case in ("manual", "manual_toggle_model", "manual_no_sync", "manual_batchnorm"):
        variant = case.removeprefix("manual").lstrip("_")
        model: ember.Module = ManualRegressor(accumulate=variant if variant != "batchnorm" else "",
                                              batchnorm=variant == "batchnorm")  # fmt: skip
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
        "parameters": None if sharded else [p.detach().cpu().clone() for p in model.state_dict().values()],
        "global_step": run.global_step,
        "compiled": _compiled(model),
        "last_loss": None if run.fit_loop.last_loss is None else float(run.fit_loop.last_loss),
        "all_reduces": getattr(model, "all_reduces", None),
        "buffers_seen": getattr(model, "buffers_seen", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    global ACCELERATOR
    ACCELERATOR = args.accelerator
    for case in args.cases.split(","):
        rank = int(os.environ.get("RANK", "0"))
        result = tune_case(case, rank) if case.startswith("tune") else run_case(case, args.devices)
        torch.save(result, os.path.join(args.out, f"{case}-devices{args.devices}-rank{rank}.pt"))


if __name__ == "__main__":
    main()
