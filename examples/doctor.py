"""The speed doctor: a training script with planted mistakes, and the doctor naming each one.

    python examples/doctor.py                 # the script watches itself (ember.doctor.Doctor) and checks the report
    ember doctor examples/doctor.py           # or the doctor runs it from outside, unchanged, and reports

The mistakes, each common in real training code:

- input-bound: every sample takes 2 ms to read (as from a slow disk) and the DataLoader has no
  workers, so the model waits for data most of the time;
- graph-kept: every step's loss is appended to a list with its autograd graph, so memory grows;
- cpu-oversubscribed: the process asks for twice as many compute threads as there are cores (on a
  machine so busy that the doctor's timings of the two thread counts overlap, it rightly says nothing);
- host-sync, on a GPU only: ``loss.item()`` every step makes the host wait for the device (a CPU
  tensor's value is at hand, so on a CPU the same line costs no wait and the doctor says nothing).

The doctor watches 20 optimizer steps (the first 5 are warm-up), prints its report with a fix and an
estimated gain for each finding, and removes its instrumentation; training then goes on. The script
exits with status 1 unless the doctor found every mistake it should have.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ember
from ember.doctor import Doctor, active_doctor


class SlowDisk(Dataset):
    """Random regression data whose every sample takes ``delay`` seconds to read."""

    def __init__(self, size: int = 2048, delay: float = 0.002) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 32, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay)
        return self.x[index], self.y[index]


class Regressor(ember.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss)  # mistake: keeps the graph; self.log("train_loss", loss) keeps none
        if loss.item() > 1e6:  # mistake (on a GPU): a host-device sync every step
            print("diverging")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=25)
    parser.add_argument("--accelerator", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--root-dir", default="runs/doctor", help="where logs go")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ember.seed_everything(0)
    torch.set_num_threads(2 * (os.cpu_count() or 1))  # mistake: more compute threads than cores
    loader = DataLoader(SlowDisk(), batch_size=32, shuffle=True, num_workers=0)  # mistake: no workers
    trainer = ember.Trainer(
        accelerator=args.accelerator,
        max_steps=args.max_steps,
        default_root_dir=args.root_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    # Under `ember doctor` a doctor is already watching; otherwise this script starts one itself. (Trainer(doctor=20)
    # would do the same and print the report; holding the Doctor lets the script read the findings afterwards.)
    outside = active_doctor() is not None
    doctor = active_doctor() or Doctor(steps=20).install()
    trainer.fit(Regressor(), loader)  # the report is printed after step 20; training goes on to max_steps
    if outside:
        return 0

    found = {finding.id: finding for finding in doctor.findings()}
    expected = ["input-bound", "graph-kept", "cpu-oversubscribed"]
    threads = doctor.measurements.matmul_seconds
    if "cpu-oversubscribed" not in found and threads is not None and not threads[0].above(threads[1]):
        # Other work on the machine can blur the thread timings; a difference within their noise is no finding.
        print(
            f"(cpu-oversubscribed not shown: with {torch.get_num_threads()} threads a matrix product took "
            f"{threads[0]}, with {doctor.measurements.cores_per_process} {threads[1]}: the machine is busy)"
        )
        expected.remove("cpu-oversubscribed")
    if trainer.strategy.root_device.type == "cuda":
        expected.append("host-sync")
    missed = [name for name in expected if name not in found]
    if "host-sync" in found and not any("doctor.py" in where for where in found["host-sync"].locations):
        missed.append("host-sync's location in doctor.py")
    if missed:
        print(f"FAILED: the doctor did not find {', '.join(missed)}; it found {sorted(found)}")
        return 1
    print(f"\nthe doctor found {', '.join(expected)}; training went on to step {trainer.global_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
