"""Ember's per-epoch overhead against a hand-written PyTorch loop, measured side by side in one process.

A small MLP (32 inputs, 64 hidden, 10 classes) on 32768 random samples, batch 64, SGD, one CPU
thread. Each round alternates epochs of the plain loop and of ``Trainer.fit`` (timed from the
epoch's start to its end) for each Ember configuration, in the order plain, Ember, Ember, plain so
that a drift in machine speed cancels out; the figure is the median over rounds of the ratio.

Configurations: bare (nothing but training), the defaults as a fresh install has them (progress bar,
CSV logger, checkpoint callback, a ``self.log`` per step), bare with the same ``self.log`` (so that what
the bar, logger and checkpoint cost is seen apart from the module's logging) and, where tensorboard is
installed, the defaults with it (Ember then writes TensorBoard's event files too, as Lightning does).

    python bench/overhead.py [--rounds 9] [--profiler]

It also times ``import ember`` on top of ``import torch`` in fresh interpreters. What Ember prints
(model summaries, progress lines, profiles) is discarded, so that only the figures are shown.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ember
from ember.callbacks import Callback
from ember.loggers import CSVLogger

BARE = "bare (no progress bar, logger, checkpoint or self.log)"
DEFAULTS = "defaults (progress bar, CSV logger, checkpoint, self.log per step)"
BARE_LOGGING = "bare + self.log per step (no progress bar, logger or checkpoint)"


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


class MLPModule(ember.Module):
    """The same model and step as the plain loop; it logs its loss per step when ``log`` is set."""

    def __init__(self, log: bool) -> None:
        super().__init__()
        self.net = make_mlp()
        self.log_loss = log

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        if self.log_loss:
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class EpochTimer(Callback):
    """Times the training epoch itself, from its first hook to its last."""

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def plain_epoch(loader: DataLoader) -> float:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.perf_counter()
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def ember_epoch(loader: DataLoader, root: str, log: bool, **flags: Any) -> float:
    timer = EpochTimer()
    if flags.get("logger") == "csv":
        flags["logger"] = CSVLogger(root)
    trainer = ember.Trainer(
        max_epochs=1, accelerator="cpu", default_root_dir=root, callbacks=[timer], num_sanity_val_steps=0, **flags
    )
    with contextlib.redirect_stdout(io.StringIO()):  # the summaries, progress lines and profiles of every run
        trainer.fit(MLPModule(log), loader)
    return timer.seconds


def import_overhead(repeats: int = 7) -> tuple[float, float]:
    """Median wall time of ``import torch`` and of ``import torch, ember`` in fresh interpreters."""

    def timed(statement: str) -> float:
        code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
        return float(subprocess.check_output([sys.executable, "-c", code], text=True))

    torch_alone, with_ember = [], []
    for _ in range(repeats):
        torch_alone.append(timed("import torch"))
        with_ember.append(timed("import torch, ember"))
    return statistics.median(torch_alone), statistics.median(with_ember)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds after one warm-up round")
    parser.add_argument("--profiler", action="store_true", help="also measure Trainer(profiler='simple')")
    args = parser.parse_args()

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32768, 32, generator=generator)
    y = torch.randint(0, 10, (32768,), generator=generator)
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)

    # The bare run does exactly the plain loop's work; the others also log the loss every step.
    bare = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False)
    configurations: dict[str, dict[str, Any]] = {
        BARE: dict(log=False, **bare),
        # The default logger where tensorboard is not installed (as after the README's first command).
        DEFAULTS: dict(log=True, logger="csv"),
        # The same module as the defaults' without what the defaults turn on: the two compared give what the
        # progress bar, the logger and the checkpoint callback cost, apart from the module's own self.log.
        BARE_LOGGING: dict(log=True, **bare),
    }
    if importlib.util.find_spec("tensorboard"):
        configurations["defaults with tensorboard installed (TensorBoard and CSV loggers)"] = dict(log=True)
    if args.profiler:
        configurations["defaults + profiler='simple'"] = dict(log=True, logger="csv", profiler="simple")

    ratios: dict[str, list[float]] = {name: [] for name in configurations}
    with tempfile.TemporaryDirectory() as root:
        for round_index in range(args.rounds + 1):
            for name, flags in configurations.items():
                plain = plain_epoch(loader)
                ours = ember_epoch(loader, root, **flags) + ember_epoch(loader, root, **flags)
                plain += plain_epoch(loader)
                if round_index:  # the first round warms up caches and allocators
                    ratios[name].append(ours / plain)

    print(f"ember {ember.__version__}, torch {torch.__version__}, 1 thread, {args.rounds} rounds")
    print("Ember epoch time / plain loop epoch time (median over rounds):")
    for name, values in ratios.items():
        print(f"  {name}: {statistics.median(values):.3f}x (min {min(values):.3f}, max {max(values):.3f})")
    for label, baseline in (("bare", BARE), ("bare + self.log", BARE_LOGGING)):
        added = [with_defaults / alone for alone, with_defaults in zip(ratios[baseline], ratios[DEFAULTS])]
        print(f"  defaults / {label} (median of the rounds' ratios): {statistics.median(added):.3f}x")
    torch_seconds, ember_seconds = import_overhead()
    print(f"  import torch: {torch_seconds:.2f} s; import torch, ember: {ember_seconds:.2f} s; "
          f"ember adds {ember_seconds - torch_seconds:+.3f} s")  # fmt: skip


if __name__ == "__main__":
    main()
