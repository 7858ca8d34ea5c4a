"""The overhead benchmark's step breakdown, the checkpoint benchmark's scenarios, and their flags (the figures
themselves are measured, not tested)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import warm_processes
from torch.utils.data import DataLoader, TensorDataset

BENCH = Path(__file__).resolve().parents[1] / "bench"
# bench/ is not a package: its script is loaded from its file, leaving sys.path as it is.
_spec = importlib.util.spec_from_file_location("bench_overhead", BENCH / "overhead.py")
assert _spec is not None and _spec.loader is not None
overhead = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overhead)


def test_step_breakdown_times_every_part_and_puts_the_timed_functions_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timed = [*overhead.STEP_PARTS.values(), *overhead.EMBER_STEP_PARTS.values()]
    originals = [getattr(owner, name) for owner, name in timed]
    x, y = torch.randn(256, 32), torch.randint(0, 10, (256,))
    loader = DataLoader(TensorDataset(x, y), batch_size=64)
    bare = dict(log=False, enable_progress_bar=False, logger=False, enable_checkpointing=False)
    overhead.step_breakdown(loader, str(tmp_path), {overhead.BARE: bare}, rounds=1)

    rows = {line[:24].strip(): line[24:].split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert list(rows) == [*overhead.STEP_PARTS, "the loop's own code", "the whole step"]
    for part, (plain, ember) in rows.items():
        assert float(plain) > 0 and float(ember) > 0, part  # each part ran in both loops and was timed
    assert [getattr(owner, name) for owner, name in timed] == originals


def test_breakdown_figures_wider_than_their_column_stay_apart() -> None:
    # On a busy machine a step can take more microseconds than a column's heading has letters.
    figures = {"plain": {"backward": [123456.7]}, overhead.BARE: {"backward": [7654321.0, 7654323.0]}}
    heading, row = overhead.breakdown_table(figures)
    assert heading.split() == ["plain", "bare"]
    assert row.split() == ["backward", "123456.7", "7654322.0"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rounds", "0"], "--rounds 0: give 1 or more"),
        (["--breakdown", "-1"], "--breakdown -1: give 0 (no breakdown) or more rounds"),
    ],
)
def test_bad_overhead_flags_are_refused(flags: list[str], message: str) -> None:
    result = warm_processes.run(
        [sys.executable, str(BENCH / "overhead.py"), *flags], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert message in result.stderr


# bench/checkpoint.py: its flags, and the figures of the fit's extra seconds from saves.
_checkpoint_spec = importlib.util.spec_from_file_location("bench_checkpoint", BENCH / "checkpoint.py")
assert _checkpoint_spec is not None and _checkpoint_spec.loader is not None
checkpoint_bench = importlib.util.module_from_spec(_checkpoint_spec)
_checkpoint_spec.loader.exec_module(checkpoint_bench)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rounds", "0"], "--rounds 0: give 1 or more"),
        (["--every", "0"], "--every 0: give 1 to --steps - 5 (145)"),
        (["--steps", "20", "--every", "16"], "--every 16: give 1 to --steps - 5 (15)"),
        (["--busy-workers", "-1"], "--busy-workers -1: give 0 (the data in memory) or more workers"),
        (["--busy-workers", "2", "--burn-ms", "0"], "--burn-ms 0.0: give a positive number of milliseconds"),
        (["--busy-workers", "2", "--accelerator", "cuda"], "--busy-workers: measured on CPU only"),
    ],
)
def test_bad_checkpoint_bench_flags_are_refused(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        checkpoint_bench.parse_args(flags)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_the_busy_workers_scenario_and_the_extra_seconds_of_each_round() -> None:
    args = checkpoint_bench.parse_args(["--busy-workers", "2", "--burn-ms", "3", "--steps", "60", "--every", "5"])
    assert (args.busy_workers, args.burn_ms, args.steps, args.every) == (2, 3.0, 60, 5)
    assert checkpoint_bench.parse_args([]).busy_workers == 0  # the data in memory, as before
    fits = {"none": [10.0, 12.0], "sync": [12.0, 13.0], "async": [11.0, 14.0]}
    results = {mode: [{"fit_seconds": seconds} for seconds in fits[mode]] for mode in fits}
    assert checkpoint_bench.extra_seconds(results) == ([2.0, 1.0], [1.0, 2.0], [0.5, 2.0])
    assert checkpoint_bench._spread([2.0, 1.0, 4.0], ".2f") == "2.00 (1.00 to 4.00)"
    assert checkpoint_bench._spread([0.5], ".2f") == "0.50"


@pytest.mark.slow
def test_the_checkpoint_bench_runs_with_busy_workers() -> None:
    tiny = ["--rounds", "1", "--steps", "8", "--every", "3", "--width", "16", "--layers", "1", "--batch-size", "2"]
    result = warm_processes.run(
        [sys.executable, str(BENCH / "checkpoint.py"), *tiny, "--busy-workers", "1", "--burn-ms", "0.1"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 loader worker burning 0.1 ms of CPU a sample" in result.stdout
    assert "of 2 saves went to the background" in result.stdout
    assert "seconds the saves add to the fit: " in result.stdout
