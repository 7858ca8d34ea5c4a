"""Strategies on two CPU processes (gloo): manual optimization under DDP, and compile under every strategy.

The cases run in one launch of two processes (see scripts/strategy_cases.py); each test reads its results.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from typing import Any

import pytest
import torch
import warm_processes
from conftest import built_once

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "strategy_cases.py")
sys.path.insert(0, os.path.dirname(SCRIPT))
import strategy_cases  # noqa: E402

CASES = (
    "manual",
    "manual_toggle_model",
    "manual_no_sync",
    "manual_batchnorm",
    "gan",
    "fsdp_compile",
    "pipeline_compile",
    "model_parallel_compile",
    "fsdp_validate",
    "tune",
    "tune_nothing",
    "tune_peak",
)


@pytest.fixture
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    def build(out: str) -> None:
        command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", SCRIPT, "--out", out,
                   "--cases", ",".join(CASES)]  # fmt: skip
        process = warm_processes.Popen(command, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True)  # fmt: skip
        try:
            _, stderr = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail("the two-process cases timed out")
        assert process.returncode == 0, stderr[-4000:]

    out = built_once(tmp_path_factory, "cases", build)
    return {
        case: [torch.load(os.path.join(out, f"{case}-devices2-rank{rank}.pt")) for rank in range(2)] for case in CASES
    }


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["manual", "manual_toggle_model", "manual_no_sync"])
def test_manual_optimization_under_ddp_averages_every_backward(
    two_ranks: dict[str, list[dict[str, Any]]], case: str
) -> None:
    rank0, rank1 = two_ranks[case]
    assert rank0["global_step"] == rank1["global_step"] == 8  # 2 epochs of 4 steps (32 samples a rank, 8 a step)
    # One all-reduce of all gradients per backward that syncs, none in one that accumulates under no_sync.
    assert rank0["all_reduces"] == rank1["all_reduces"] == [8, 0]
    for mine, theirs in zip(rank0["parameters"], rank1["parameters"]):
        assert torch.equal(mine, theirs)
    # Averaged gradients of two ranks with 8 samples each are one process's gradients of 16.
    alone = strategy_cases.run_case(case, devices=1, batch_size=16)
    for ranks, single in zip(rank0["parameters"], alone["parameters"]):
        torch.testing.assert_close(ranks, single, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(200)
def test_manual_optimization_under_ddp_starts_each_step_from_rank_zeros_buffers(
    two_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    """As DDP does before each forward: every training step starts from rank zero's BatchNorm statistics."""
    rank0, rank1 = two_ranks["manual_batchnorm"]
    assert len(rank0["buffers_seen"]) == 8 and len(rank0["buffers_seen"][0]) == 3  # mean, variance, count
    for mine, theirs in zip(rank0["buffers_seen"], rank1["buffers_seen"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    assert not torch.equal(rank0["buffers_seen"][-1][0], rank0["buffers_seen"][0][0])  # the statistics moved


@pytest.mark.timeout(200)
def test_a_two_optimizer_gan_step_keeps_the_ranks_equal(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    rank0, rank1 = two_ranks["gan"]
    assert rank0["global_step"] == 8  # two optimizer steps per batch, 4 batches a rank
    changed = [
        not torch.equal(p, q) for p, q in zip(rank0["parameters"], strategy_cases.TinyGAN().state_dict().values())
    ]
    assert all(changed)
    for mine, theirs in zip(rank0["parameters"], rank1["parameters"]):
        assert torch.equal(mine, theirs)


@pytest.mark.timeout(200)
def test_the_batch_size_finder_agrees_across_ranks_and_fails_on_all_together(
    two_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    assert [rank["found"] for rank in two_ranks["tune"]] == [16, 16]  # rank 1 fits no more than 16
    nothing = two_ranks["tune_nothing"]
    # The rank that found nothing does not leave the other waiting in the collective: both raise at once.
    assert "even batch_size=1 does not fit" in nothing[1]["found"]
    assert "another process found no batch_size that fits" in nothing[0]["found"]
    assert all(rank["seconds"] < 30 for rank in nothing)


@pytest.mark.timeout(200)
def test_the_batch_size_finder_counts_the_memory_of_ddps_gradient_buckets(
    two_ranks: dict[str, list[dict[str, Any]]],
) -> None:
    """A trial runs the module unwrapped, but training under DDP holds a copy of the gradients in its buckets."""
    rank0 = two_ranks["tune_peak"][0]
    trial = re.search(r"Batch size 2 succeeded.* \(trial 1: fits, .*peak ([0-9.]+) MiB\)", rank0["printed"])
    assert trial is not None, rank0["printed"]
    peak = float(trial.group(1)) * 2**20
    # At least the weights kept to be put back and the buckets: twice the parameters' bytes (without the
    # buckets the profiler that measures a CPU trial sees the weights only).
    assert peak > 1.9 * rank0["parameter_bytes"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.timeout(300)
def test_manual_optimization_under_ddp_on_two_gpus(tmp_path: Any) -> None:
    cases = ["manual", "manual_no_sync", "gan"]
    command = [sys.executable, "-m", "ember", "run", "--nproc-per-node", "2", SCRIPT, "--out", str(tmp_path),
               "--cases", ",".join(cases), "--accelerator", "cuda"]  # fmt: skip
    result = warm_processes.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-4000:]
    for case in cases:
        rank0, rank1 = (torch.load(tmp_path / f"{case}-devices2-rank{rank}.pt") for rank in range(2))
        assert rank0["global_step"] == rank1["global_step"] == 8
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(rank0["parameters"], rank1["parameters"]))
        if case != "gan":
            assert rank0["all_reduces"] == [8, 0]


COMPILED = [
    ("fsdp_compile", [[""], [""]]),  # the whole (sharded) module
    ("model_parallel_compile", [[""], [""]]),
    ("pipeline_compile", [["layers.0"], ["layers.1", "layers.2"]]),  # each stage's own layers
]


@pytest.mark.timeout(200)
def test_fsdp_trains_after_validating_under_inference_mode(two_ranks: dict[str, list[dict[str, Any]]]) -> None:
    results = two_ranks["fsdp_validate"]
    assert [result["global_step"] for result in results] == [8, 8]
    assert all(torch.isfinite(torch.tensor(result["last_loss"])) for result in results)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("case", "expected"), COMPILED)
def test_compile_is_applied_under_sharded_strategies(
    two_ranks: dict[str, list[dict[str, Any]]], case: str, expected: list[list[str]]
) -> None:
    results = two_ranks[case]
    assert [result["compiled"] for result in results] == expected
    assert all(
        result["last_loss"] is not None and torch.isfinite(torch.tensor(result["last_loss"])) for result in results
    )
