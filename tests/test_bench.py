"""The overhead benchmark's step breakdown and its flags (the figures themselves are measured, not tested)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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
    result = subprocess.run(
        [sys.executable, str(BENCH / "overhead.py"), *flags], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert message in result.stderr
