"""A two-rank job for the observability tests: torchmetrics objects synced across ranks, every logger,
the progress bar and the model summary on rank zero only, and the summary of a sharded model.

python train_observe.py --out DIR   (starts its second process itself)
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ProgressBar
from ember.callbacks.model_summary import summarize
from ember.loggers import CSVLogger, MLflowLogger, TensorBoardLogger


def dataset(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, (x @ torch.arange(1.0, 5.0)).unsqueeze(1))


class Observed(ember.Module):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(4, 1)
        self.rank_sum = torchmetrics.SumMetric()
        self.val_acc = torchmetrics.classification.BinaryAccuracy()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        # Rank r adds r + 1 per batch: the epoch value is the sum over both ranks, the step value this rank's.
        self.rank_sum(torch.tensor(float(self.global_rank + 1)))
        self.log("rank_sum", self.rank_sum, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        target = torch.ones(len(x), dtype=torch.long)
        # Sanity check: all wrong. Epoch 0: rank 0 right, rank 1 wrong (0.5 overall). Epoch 1: all right.
        right = not self.trainer.sanity_checking and (self.global_rank == 0 or self.current_epoch == 1)
        self.val_acc.update(target if right else 1 - target, target)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Recorder(Callback):
    reads_epoch_metrics = True  # runs after the epoch's values are computed

    def __init__(self) -> None:
        self.val_acc: list[float] = []
        self.rank_sum_epoch: list[float] = []
        self.setup_log_dir: str | None = None

    def setup(self, trainer: ember.Trainer, module: ember.Module, stage: str) -> None:
        self.setup_log_dir = trainer.log_dir  # as callbacks that write files beside the logs read it

    def on_validation_end(self, trainer: ember.Trainer, module: ember.Module) -> None:
        if not trainer.sanity_checking:
            self.val_acc.append(float(trainer.callback_metrics["val_acc"]))

    def on_train_epoch_end(self, trainer: ember.Trainer, module: ember.Module) -> None:
        self.rank_sum_epoch.append(float(trainer.callback_metrics["rank_sum_epoch"]))


def sharded_summary() -> str:
    """The summary of a layer whose parameters are split in halves across the two ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = nn.Sequential(nn.Linear(8, 6))
    for name, parameter in list(model[0].named_parameters()):
        setattr(model[0], name, nn.Parameter(distribute_tensor(parameter.detach(), mesh, [Shard(0)])))
    return summarize(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    recorder = Recorder()
    mlruns = os.path.join(args.out, "mlruns")
    loggers = [CSVLogger(args.out), TensorBoardLogger(args.out), MLflowLogger(save_dir=mlruns)]
    trainer = ember.Trainer(
        accelerator="cpu", devices=2, max_epochs=2, log_every_n_steps=2, logger=loggers, enable_checkpointing=False,
        callbacks=[recorder, ProgressBar(interactive=False)],
    )  # fmt: skip
    trainer.fit(Observed(), DataLoader(dataset(64), batch_size=4), DataLoader(dataset(32), batch_size=4))
    summary = {
        "val_acc": recorder.val_acc,
        "rank_sum_epoch": recorder.rank_sum_epoch,
        "rank_sum_step": float(trainer.callback_metrics["rank_sum_step"]),
        "log_dirs": [logger.log_dir for logger in trainer.loggers],
        "setup_log_dir": recorder.setup_log_dir,
        "sharded_summary": sharded_summary(),
    }
    with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as file:
        json.dump(summary, file)


if __name__ == "__main__":
    main()
