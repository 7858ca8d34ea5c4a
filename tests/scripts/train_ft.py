"""A training job for the fault-tolerance tests and bench/ft.py, run by ``ember run --replica-groups``: each process
writes what it did to ``--out`` (one JSON file per process and attempt) when its fit ends.

python train_ft.py --out DIR [--steps N] [--sleep S] [--kill-between K] [--kill-during K] [--checkpoint]

``--kill-between K``: replica group 1 SIGKILLs itself after committing global step K (its first attempt);
``--kill-during K``: K steps after it healed (its second attempt), it SIGKILLs itself in the backward pass, while
its peer waits in the gradient allreduce.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback


class Regressor(ember.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.layer = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.9)]


class Record(Callback):
    """When each step committed, the failures this process was told to stage, and what it ends with."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.commits: list[tuple[float, int]] = []  # (time, global step) of each committed step
        self.started_at = -1  # the global step the first batch was trained at (after healing)
        self.sleep = args.sleep
        self.stop_at: int | None = None

    def on_train_batch_start(self, trainer: ember.Trainer, module: ember.Module, batch: Any, batch_idx: int) -> None:
        if self.started_at < 0:
            self.started_at = trainer.global_step
        if self.sleep:
            time.sleep(self.sleep)  # the work of a bigger model

    def on_before_backward(self, trainer: ember.Trainer, module: ember.Module, loss: torch.Tensor) -> None:
        if self._told("kill_during", 1) and trainer.global_step == self.started_at + self.args.kill_during:
            time.sleep(0.3)  # the peer is waiting in the allreduce by now
            self._die(trainer.global_step)

    def on_train_batch_end(self, trainer: ember.Trainer, module: ember.Module, *args: Any) -> None:
        if trainer.fit_loop.stepped:
            self.commits.append((time.time(), trainer.global_step))
            if len(self.commits) == 1 and self.restart:  # for bench/ft.py: when a restarted group trained again
                with open(os.path.join(self.args.out, f"first_commit_{self.restart}.json"), "w") as file:
                    json.dump({"time": self.commits[0][0]}, file)
        if self._told("kill_between", 0) and trainer.global_step == self.args.kill_between:
            self._die(trainer.global_step)
        self._stop_once_rejoined(trainer)

    def _stop_once_rejoined(self, trainer: ember.Trainer) -> None:
        """With --kill-during: every group stops at the same step, 10 steps after the second restart healed."""
        stop_file = os.path.join(self.args.out, "stop_at")
        if self._told("kill_during", 2) and trainer.global_step == self.started_at + 10:
            with open(stop_file + ".tmp", "w") as file:
                file.write(str(trainer.global_step + 10))
            os.replace(stop_file + ".tmp", stop_file)
        if self.stop_at is None and self.args.kill_during >= 0 and os.path.exists(stop_file):
            with open(stop_file) as file:
                self.stop_at = int(file.read())
        if self.stop_at is not None and trainer.global_step >= self.stop_at:
            trainer.should_stop = True

    def _told(self, name: str, restart: int) -> bool:
        return getattr(self.args, name) >= 0 and ember_group() == 1 and self.restart == restart

    def _die(self, step: int) -> None:
        """SIGKILL this process; ``step``: the global step it committed last."""
        with open(os.path.join(self.args.out, f"killed_{self.restart}.json"), "w") as file:
            json.dump({"time": time.time(), "step": step}, file)
        os.kill(os.getpid(), signal.SIGKILL)


def ember_group() -> int:
    return int(os.environ.get("EMBER_REPLICA_GROUP", "0"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--kill-between", type=int, default=-1)
    parser.add_argument("--kill-during", type=int, default=-1)
    parser.add_argument("--checkpoint", action="store_true", help="checkpoint every 5 steps; resume from 'last'")
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    ember.seed_everything(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, 4, generator=generator)
    loader = DataLoader(TensorDataset(x, (x @ torch.arange(1.0, 5.0)).unsqueeze(1)), batch_size=4, shuffle=True)
    record = Record(args)
    callbacks: list[Callback] = [record]
    if args.checkpoint:
        callbacks.append(ember.callbacks.ModelCheckpoint(every_n_train_steps=5))
    trainer = ember.Trainer(
        accelerator="cpu", strategy=args.strategy, max_steps=args.steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=args.checkpoint, callbacks=callbacks,
        fault_tolerance=ember.strategies.FaultTolerance(timeout=20, quorum_timeout=30),
    )  # fmt: skip
    module = Regressor(args.width)
    started = time.time()
    trainer.fit(module, loader, ckpt_path="last" if args.checkpoint else None)
    runner = trainer.fit_loop.runner
    summary = {
        "group": trainer.replica_group,
        "groups": trainer.num_replica_groups,
        "rank": trainer.global_rank,
        "restart": record.restart,
        "global_step": trainer.global_step,
        "started_at": record.started_at,
        "dropped": runner.dropped_steps if runner is not None else 0,
        "commits": record.commits,
        "seconds": time.time() - started,
        "ckpt_path": trainer.ckpt_path,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "parameters": [p.detach().flatten().tolist() for p in module.parameters()],
    }
    name = f"group{trainer.replica_group}_rank{trainer.global_rank}_restart{record.restart}.json"
    with open(os.path.join(args.out, name), "w") as file:
        json.dump(summary, file)


if __name__ == "__main__":
    main()
