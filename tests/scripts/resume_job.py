"""A training job that can be killed and resumed: dropout, SGD with momentum, a per-step scheduler,
shuffled data read by two workers, checkpoints every 5 steps. It writes its final parameters.

    python resume_job.py --out DIR [--steps 70] [--kill-at 37] [--accumulate 2] [--ckpt-path last]
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint
from ember.checkpoint import io as checkpoint_io


class Net(ember.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class KillDuringWrite(Callback):
    """SIGKILL this process while the checkpoint of ``step`` is being written: that write never ends (as a
    large one on a slow disk has not yet), and the kill comes at the next batch, once the write has begun."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.slow = False
        self.writing = threading.Event()
        original = checkpoint_io.save

        def save(checkpoint: Any, path: Any) -> None:
            if self.slow:
                self.writing.set()
                threading.Event().wait()  # until the kill
            original(checkpoint, path)

        checkpoint_io.save = save  # type: ignore[assignment]

    def on_fit_start(self, trainer: ember.Trainer, module: Any) -> None:
        # A write in the background, however busy the machine running the tests keeps its cores, by a writer at
        # the usual priority: one that runs only on idle cores may wait minutes there before it begins.
        trainer.strategy.checkpoint_writer.at_once_when_busy = False  # type: ignore[attr-defined]
        os.sched_setscheduler = lambda *args: None

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.slow = trainer.global_step == self.step and trainer.fit_loop.stepped  # before ModelCheckpoint saves

    def on_train_batch_start(self, trainer: ember.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if self.slow and trainer.global_rank == 0:
            self.writing.wait(timeout=60)  # the write is in flight
            os.kill(os.getpid(), signal.SIGKILL)


class Interrupt(Callback):
    """Kills this process with SIGKILL once the given step is reached (in the first attempt only)."""

    def __init__(self, step: int, pause: float) -> None:
        self.step, self.pause = step, pause

    def on_train_batch_end(self, trainer: ember.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        time.sleep(self.pause)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            first_attempt
            and trainer.global_step == self.step
            and trainer.fit_loop.stepped
            and trainer.global_rank == 1 % trainer.world_size
        ):
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep after each batch")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--async-checkpoint", action="store_true")
    parser.add_argument("--kill-during-write", type=int, default=-1, help="SIGKILL while this step's save is written")
    args = parser.parse_args()

    ember.seed_everything(123)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=generator)
    data = TensorDataset(x, x.mean(dim=1, keepdim=True))
    loader = DataLoader(data, batch_size=4, shuffle=True, num_workers=2)
    callbacks = [ModelCheckpoint(every_n_train_steps=5, save_last=True), Interrupt(args.kill_at, args.pause)]
    if args.kill_during_write >= 0:
        callbacks.append(KillDuringWrite(args.kill_during_write))
    trainer = ember.Trainer(
        accelerator="cpu", max_steps=args.steps, accumulate_grad_batches=args.accumulate, default_root_dir=args.out,
        callbacks=callbacks, enable_progress_bar=False, log_every_n_steps=5, async_checkpoint=args.async_checkpoint,
    )  # fmt: skip
    model = Net()
    trainer.fit(model, loader, ckpt_path=args.ckpt_path)
    torch.save([p.detach() for p in model.parameters()], os.path.join(args.out, f"final-rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main()
