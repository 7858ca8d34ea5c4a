"""Preemption and exact resume: a run that is stopped and resumed ends with the same parameters, bit for bit,
as a run that never stopped.

    python examples/resume.py [--stop-at-step 17] [--root-dir runs/resume]

Three runs of the same training (the digits CNN of ``digits.py``: shuffled data read by two worker
processes, dropout, AdamW, a one-cycle schedule stepped every step, gradient accumulation):

1. a reference run, never interrupted (in this process);
2. the same run in a child process, which receives SIGTERM in the middle of an epoch, as a cluster
   scheduler sends before preempting a job: the Trainer finishes the step, saves ``last.ckpt`` and the
   process exits with status 143 (128 + SIGTERM), as a process ended by SIGTERM does;
3. a fresh Trainer and a freshly initialised model in this process, calling ``fit(ckpt_path="last")``:
   it continues from the child's checkpoint (weights, optimizer, schedule, random generators, data
   order and position in the epoch) to the end.

The script exits with status 1 unless the resumed run's parameters equal the reference run's exactly.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import Any

import torch
from digits import DigitsCNN, DigitsData
from torch.utils.data import DataLoader

import ember
from ember.callbacks import Callback, ModelCheckpoint


class SigtermAtStep(Callback):
    """Sends SIGTERM to this process once training reaches optimizer step ``step`` (a stand-in for a scheduler)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.sent = False

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            print(f"sending SIGTERM to myself at step {trainer.global_step}, batch {batch_idx} of epoch "
                  f"{trainer.current_epoch}", flush=True)  # fmt: skip
            os.kill(os.getpid(), signal.SIGTERM)


class ShuffledByWorkers(DigitsData):
    """The digits, read by two worker processes that live through the epochs (a SIGTERM to the whole job
    reaches them too: the save must not need them)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.hparams.batch_size, shuffle=True, num_workers=2, persistent_workers=True
        )


def train(root_dir: str, ckpt_path: str | None = None, stop_at_step: int | None = None) -> DigitsCNN:
    # The same seed in every run: a checkpoint refuses to resume a run seeded otherwise (its data order
    # would be another), unless Trainer(restart_on_data_change=True).
    ember.seed_everything(0)
    callbacks: list[Callback] = [ModelCheckpoint(save_last=True)]
    if stop_at_step is not None:
        callbacks.append(SigtermAtStep(stop_at_step))
    trainer = ember.Trainer(
        accelerator="cpu",
        max_epochs=2,
        accumulate_grad_batches=2,
        default_root_dir=root_dir,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = DigitsCNN(lr=3e-3, dropout=0.2)
    trainer.fit(model, datamodule=ShuffledByWorkers(batch_size=64, num_workers=2), ckpt_path=ckpt_path)
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stop-at-step", type=int, default=17, help="the optimizer step at which SIGTERM arrives")
    parser.add_argument("--root-dir", default="runs/resume", help="where the runs write logs and checkpoints")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # run 2, started by this script
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    interrupted_dir = os.path.join(args.root_dir, "interrupted")
    if args.child:
        train(interrupted_dir, stop_at_step=args.stop_at_step)
        print("FAILED: the run was not stopped")  # fit raises SystemExit(143) after saving: this is not reached
        return 1

    # Run 2 starts first, in its own process, while this process does run 1.
    child = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", "--root-dir", args.root_dir,
         "--stop-at-step", str(args.stop_at_step)],
    )  # fmt: skip
    reference = train(os.path.join(args.root_dir, "reference"))
    if child.wait(timeout=300) != 128 + signal.SIGTERM:
        print(f"FAILED: the preempted run exited with status {child.returncode}, not 128 + SIGTERM")
        return 1

    print("resuming from the preempted run's last checkpoint")
    resumed = train(interrupted_dir, ckpt_path="last")

    pairs = list(zip(reference.state_dict().items(), resumed.state_dict().items()))
    different = [name for (name, a), (_, b) in pairs if not torch.equal(a, b)]
    if different:
        print(f"FAILED: {len(different)} of {len(pairs)} tensors differ after resuming, such as {different[0]}")
        return 1
    print(f"all {len(pairs)} parameter tensors of the resumed run equal the uninterrupted run's, bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
