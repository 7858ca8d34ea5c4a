"""What checkpointing costs a run, written at once and in the background, measured side by side in one run.

A ~50M-parameter MLP with AdamW (about 600 MB of state) trains on random data, saving a checkpoint every
``--every`` optimizer steps (``ModelCheckpoint(every_n_train_steps=...)``, the two newest kept). Each round
runs the same steps three times, none / at once / in the background, in the reverse order every other
round, so that a drift in machine speed touches all three alike. It reports:

- the time training is blocked per save: the whole write (``async_checkpoint=False``) against the copy
  to host memory (``async_checkpoint=True``), and how many saves went to the background;
- the throughput (steps per second, after a warm-up) with checkpointing every ``--every`` steps, against
  none;
- the seconds that saving adds to the fit (each round's fit against the same round's fit without saves),
  at once and in the background, and their ratio: medians and ranges over the rounds;
- the time to resume: from ``fit(ckpt_path="last")`` to the first training step (reading and verifying
  the file, restoring model, optimizer and position).

    python bench/checkpoint.py [--rounds 2] [--steps 150] [--every 50] [--width 4096] [--batch-size 48] [--threads N]
    python bench/checkpoint.py --accelerator cuda --width 8192 --batch-size 2048   # larger, on a GPU
    python bench/checkpoint.py --busy-workers 2 --width 2048 --layers 5 --steps 60 --every 5 --rounds 5

On a GPU the data stays in GPU memory, and the copy that blocks a background save goes to pinned host memory.
With ``--busy-workers N`` the batches come from N DataLoader workers that each spend ``--burn-ms`` of CPU
time per sample, as a loader that decodes and augments does: with as many workers as cores, no core is left
idle for a background write.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ember
from ember.callbacks import Callback, ModelCheckpoint

WARMUP_STEPS = 5


class Wide(ember.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks: list[torch.nn.Module] = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.net = torch.nn.Sequential(*blocks[:-1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class BusySamples(Dataset):
    """The rows of ``x`` over and over, each costing its worker ``burn_ms`` of CPU time: an epoch as long as
    the fits here, so that the workers start once."""

    def __init__(self, x: torch.Tensor, burn_ms: float) -> None:
        self.x, self.y, self.burn = x, torch.tanh(x), burn_ms / 1000

    def __len__(self) -> int:
        return 1 << 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = time.thread_time() + self.burn  # CPU time: a worker that waits for a core burns no less
        while time.thread_time() < end:
            pass
        return self.x[index % len(self.x)], self.y[index % len(self.x)]


class StepClock(Callback):
    """When each training step began, and when the first one of a run did (for the time to resume)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: ember.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def steps_per_second(self) -> float:
        timed = self.starts[WARMUP_STEPS:]
        return (len(timed) - 1) / (timed[-1] - timed[0])


def run(args: argparse.Namespace, root: str, mode: str, ckpt_path: str | None = None) -> dict[str, Any]:
    """Train ``args.steps`` steps with checkpoints written ``mode`` ("none", "sync" or "async")."""
    clock = StepClock()
    callbacks: list[Callback] = [clock]
    if mode != "none":
        callbacks.append(
            ModelCheckpoint(every_n_train_steps=args.every, save_top_k=2, monitor="step", mode="max", save_last=True)
        )
    trainer = ember.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, default_root_dir=root, callbacks=callbacks,
        enable_checkpointing=mode != "none", async_checkpoint=mode == "async", logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    blocked: list[float] = []
    save = trainer.save_checkpoint

    def timed_save(*save_args: Any, **save_kwargs: Any) -> None:
        started = time.perf_counter()
        save(*save_args, **save_kwargs)
        blocked.append(time.perf_counter() - started)

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    writer, in_background = trainer.strategy.checkpoint_writer, [0]
    snapshot = writer.snapshot

    def counted_snapshot(checkpoint: Any) -> dict[str, Any]:  # a background write starts with a snapshot
        in_background[0] += 1
        return snapshot(checkpoint)

    writer.snapshot = counted_snapshot  # type: ignore[method-assign]
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.fit(Wide(args.width, args.layers), loader(args), ckpt_path=ckpt_path)
    return {
        "blocked": blocked,
        "in_background": in_background[0] if mode == "async" else 0,
        "steps_per_second": clock.steps_per_second() if ckpt_path is None else None,
        "fit_seconds": time.perf_counter() - started,
        "to_first_step": clock.starts[0] - started,
        "last": trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else None,
    }


def loader(args: argparse.Namespace) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size * 8, args.width, generator=generator)
    if args.busy_workers:
        samples = BusySamples(x, args.burn_ms)
        return DataLoader(samples, batch_size=args.batch_size, num_workers=args.busy_workers)
    x = x.to(args.accelerator)
    # Whole batches, in a shuffled order: one slice each, not a stack of single samples (slow on a GPU).
    batches = TensorDataset(x.view(8, args.batch_size, -1), torch.tanh(x).view(8, args.batch_size, -1))
    return DataLoader(batches, batch_size=None, shuffle=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--every", type=int, default=50, help="optimizer steps between checkpoints")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU threads for training (default: torch's choice, every core); fewer leave the background writer a core",
    )  # fmt: skip
    parser.add_argument("--busy-workers", type=int, default=0, help="DataLoader workers that burn CPU per sample")
    parser.add_argument("--burn-ms", type=float, default=2.0, help="CPU milliseconds a busy worker spends per sample")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    if not 1 <= args.every <= args.steps - WARMUP_STEPS:
        parser.error(f"--every {args.every}: give 1 to --steps - {WARMUP_STEPS} ({args.steps - WARMUP_STEPS})")
    if args.busy_workers < 0:
        parser.error(f"--busy-workers {args.busy_workers}: give 0 (the data in memory) or more workers")
    if args.burn_ms <= 0:
        parser.error(f"--burn-ms {args.burn_ms}: give a positive number of milliseconds")
    if args.busy_workers and args.accelerator != "cpu":
        parser.error("--busy-workers: measured on CPU only (on a GPU the data stays in GPU memory)")
    return args


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    parameters = sum(p.numel() for p in Wide(args.width, args.layers).parameters())
    results: dict[str, list[dict[str, Any]]] = {"none": [], "sync": [], "async": []}
    with tempfile.TemporaryDirectory() as root:
        for round_ in range(args.rounds):
            for mode in list(results)[:: 1 if round_ % 2 == 0 else -1]:
                results[mode].append(run(args, f"{root}/{mode}", mode))
        last = results["sync"][-1]["last"]
        args_resume = argparse.Namespace(**{**vars(args), "steps": args.steps + 2})
        resumed = run(args_resume, f"{root}/resume", "none", ckpt_path=last)
        fresh = run(args_resume, f"{root}/fresh", "none")

    def median(mode: str, key: str) -> float:
        return statistics.median(value for result in results[mode] for value in _values(result[key]))

    none, sync, asynchronous = (median(mode, "steps_per_second") for mode in ("none", "sync", "async"))
    blocked_sync, blocked_async = median("sync", "blocked"), median("async", "blocked")
    saves = sum(len(result["blocked"]) for result in results["async"])
    in_background = sum(result["in_background"] for result in results["async"])
    extra_sync, extra_async, ratios = extra_seconds(results)
    where = torch.cuda.get_device_name(0) if args.accelerator == "cuda" else f"{torch.get_num_threads()} CPU threads"
    workers = f"{args.busy_workers} loader worker{'s' * (args.busy_workers > 1)}"
    busy = f", {workers} burning {args.burn_ms:g} ms of CPU a sample" * bool(args.busy_workers)
    print(f"ember {ember.__version__}, torch {torch.__version__}, {where}; "
          f"{parameters / 1e6:.0f}M parameters with AdamW, a checkpoint every {args.every} steps{busy}, "
          f"{args.rounds} rounds")  # fmt: skip
    print(f"  training blocked per save: {blocked_sync:.3f} s written at once, {blocked_async:.3f} s in the "
          f"background ({blocked_async / blocked_sync:.0%} of it; {in_background} of {saves} saves went to the "
          "background, the others were written at once)")  # fmt: skip
    print(f"  steps/s: {none:.3f} without checkpoints, {sync:.3f} written at once ({1 - sync / none:+.1%} cost), "
          f"{asynchronous:.3f} in the background ({1 - asynchronous / none:+.1%} cost)")  # fmt: skip
    print(f"  seconds the saves add to the fit: {_spread(extra_sync, '.2f')} written at once, "
          f"{_spread(extra_async, '.2f')} in the background; their ratio {_spread(ratios, '.2f')}")  # fmt: skip
    print(f"  to the first training step: {resumed['to_first_step']:.2f} s resuming from a checkpoint, "
          f"{fresh['to_first_step']:.2f} s starting fresh")  # fmt: skip


def extra_seconds(results: dict[str, list[dict[str, Any]]]) -> tuple[list[float], list[float], list[float]]:
    """Per round: the seconds saving at once and in the background added to the fit, and their ratio."""
    rounds = zip(results["none"], results["sync"], results["async"], strict=True)
    extra = [(sync["fit_seconds"] - none["fit_seconds"], late["fit_seconds"] - none["fit_seconds"])
             for none, sync, late in rounds]  # fmt: skip
    return [at_once for at_once, _ in extra], [late for _, late in extra], [late / at_once for at_once, late in extra]


def _spread(values: list[float], spec: str) -> str:
    """The median of ``values``, and their range when there are several."""
    middle = format(statistics.median(values), spec)
    return middle if len(values) == 1 else f"{middle} ({format(min(values), spec)} to {format(max(values), spec)})"


def _values(value: Any) -> list[float]:
    return value if isinstance(value, list) else [value]


if __name__ == "__main__":
    main()
