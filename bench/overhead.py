"""Ember's per-epoch overhead against a hand-written PyTorch loop, measured side by side in one process.

A small MLP (32 inputs, 64 hidden, 10 classes) on 32768 random samples, batch 64, SGD, one CPU
thread. Each round alternates epochs of the plain loop and of ``Trainer.fit`` (timed from the
epoch's start to its end) for each Ember configuration, in the order plain, Ember, Ember, plain so
that a drift in machine speed cancels out; the figure is the median over rounds of the ratio.

Configurations: bare (nothing but training), the defaults as a fresh install has them (progress bar,
CSV logger, checkpoint callback, a ``self.log`` per step), bare with the same ``self.log`` (so that what
the bar, logger and checkpoint cost is seen apart from the module's logging) and, where tensorboard is
installed, the defaults with it (Ember then writes TensorBoard's event files too, as Lightning does).

    python bench/overhead.py [--rounds 9] [--profiler] [--breakdown 9]

It also times ``import ember`` on top of ``import torch`` in fresh interpreters. ``--breakdown N`` then runs
N more alternated rounds with timers around the parts of a step that the plain loop and Ember both run
(loading the batch, the model's forward, the loss, backward, the optimizer step, the gradient reset) and
prints the microseconds per step of each; what is left of a step is the loop's own code (Ember's: its
bookkeeping, the ``training_step`` call, ``self.log``, the callbacks' hooks). What Ember prints (model
summaries, progress lines, profiles) is discarded, so that only the figures are shown.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.dataloader import _BaseDataLoaderIter

import ember
import ember.loops.step
from ember.callbacks import Callback
from ember.instrument import Patches
from ember.loggers import CSVLogger

BARE = "bare (no progress bar, logger, checkpoint or self.log)"
DEFAULTS = "defaults (progress bar, CSV logger, checkpoint, self.log per step)"
BARE_LOGGING = "bare + self.log per step (no progress bar, logger or checkpoint)"
TENSORBOARD = "defaults with tensorboard installed (TensorBoard and CSV loggers)"
PROFILER = "defaults + profiler='simple'"
#: Each configuration's column heading in the step breakdown.
SHORT_NAMES = {BARE: "bare", DEFAULTS: "defaults", BARE_LOGGING: "bare+self.log", TENSORBOARD: "tensorboard",
               PROFILER: "profiler"}  # fmt: skip


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


# The parts of a step that both loops run, and where each is looked up when it is called.
STEP_PARTS: dict[str, tuple[Any, str]] = {
    "loading the batch": (_BaseDataLoaderIter, "__next__"),
    "model forward": (nn.Sequential, "forward"),
    "loss": (F, "cross_entropy"),
    "backward": (torch.Tensor, "backward"),
    "optimizer step": (torch.optim.SGD, "step"),
    "gradient reset": (torch.optim.Optimizer, "zero_grad"),
}
# Ember resets the gradients in ``clear_gradients``, which calls an optimizer's zero_grad only where it is not
# torch's own: wrapping torch's in a timer would make Ember call it, so Ember's reset is timed where it is made.
EMBER_STEP_PARTS = {**STEP_PARTS, "gradient reset": (ember.loops.step, "clear_gradients")}


@contextlib.contextmanager
def timed_parts(seconds: dict[str, float], parts: dict[str, tuple[Any, str]]) -> Iterator[None]:
    """While active, each of ``parts`` adds the time it takes to ``seconds[part]``. Installed before the
    Trainer is built, so that what it binds once (``Tensor.backward``) is the timed one too."""

    def timed(part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - start

        return run

    patches = Patches()
    for part, (owner, name) in parts.items():
        patches.wrap(owner, name, functools.partial(timed, part))
    try:
        yield
    finally:
        patches.undo()


def step_breakdown(loader: DataLoader, root: str, configurations: dict[str, dict[str, Any]], rounds: int) -> None:
    """Print the microseconds per step of each part of ``STEP_PARTS`` and of the rest, for the plain loop and
    each configuration: the median over ``rounds`` alternated rounds (after one warm-up round)."""
    steps = len(loader)
    columns = {"plain": None, **configurations}
    figures: dict[str, dict[str, list[float]]] = {column: {} for column in columns}
    for round_index in range(rounds + 1):
        for column, flags in columns.items():
            seconds = dict.fromkeys(STEP_PARTS, 0.0)
            with timed_parts(seconds, STEP_PARTS if flags is None else EMBER_STEP_PARTS):
                total = plain_epoch(loader) if flags is None else ember_epoch(loader, root, **flags)
            if round_index:
                seconds["the loop's own code"] = total - sum(seconds.values())
                seconds["the whole step"] = total
                for part, value in seconds.items():
                    figures[column].setdefault(part, []).append(value / steps * 1e6)
    print(f"Microseconds per step, median of {rounds} rounds (the timers add a little to each timed part):")
    print("\n".join(breakdown_table(figures)))


def breakdown_table(figures: dict[str, dict[str, list[float]]]) -> list[str]:
    """The lines of the step breakdown: a column per loop (``figures``' keys), a row per part, each figure the
    median of its measurements."""
    names = [SHORT_NAMES.get(column, column) for column in figures]
    width = max(len(name) for name in names) + 1
    lines = [f"  {'':22s}" + "".join(f" {name:>{width}s}" for name in names)]
    for part in figures["plain"]:
        # A space before each figure: on a busy machine one may be wider than its column.
        row = "".join(f" {statistics.median(values[part]):{width}.1f}" for values in figures.values())
        lines.append(f"  {part:22s}{row}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds after one warm-up round")
    parser.add_argument("--profiler", action="store_true", help="also measure Trainer(profiler='simple')")
    parser.add_argument(
        "--breakdown", type=int, default=0, metavar="ROUNDS",
        help="then time the parts of a step in this many more rounds (0: not at all)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    if args.breakdown < 0:
        parser.error(f"--breakdown {args.breakdown}: give 0 (no breakdown) or more rounds")

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
        configurations[TENSORBOARD] = dict(log=True)
    if args.profiler:
        configurations[PROFILER] = dict(log=True, logger="csv", profiler="simple")

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
    if args.breakdown:
        with tempfile.TemporaryDirectory() as root:
            step_breakdown(loader, root, configurations, args.breakdown)


if __name__ == "__main__":
    main()
