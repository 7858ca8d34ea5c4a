"""Fault tolerance (``ember run --replica-groups``, torchft): a step that does not commit counts no step, the flags
and their errors, and, with torchft installed, replica groups that survive a peer's death, heal it, and stop with
a checkpoint when the lighthouse dies."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, descendants, make_loader, quiet_trainer

import ember
from ember import checkpoint, cli
from ember.exceptions import MisconfigurationException
from ember.strategies import (
    DDPStrategy,
    FaultTolerance,
    FaultTolerantDDPStrategy,
    SingleDeviceStrategy,
    select_strategy,
)
from ember.strategies.strategy import StepCalls

SCRIPT = str(Path(__file__).parent / "scripts" / "train_ft.py")


class _Outvoted(SingleDeviceStrategy):
    """One device, whose vote drops every other step (as fault tolerance does when a peer fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.votes = 0

    def step_calls(self) -> StepCalls:
        return dataclasses.replace(super().step_calls(), commit=self._commit)

    def _commit(self) -> bool:
        self.votes += 1
        return self.votes % 2 == 0


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_step_that_does_not_commit_moves_neither_optimizer_nor_schedulers_nor_step_count(accumulate: int) -> None:
    class Scheduled(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module, strategy = Scheduled(), _Outvoted()
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, logger=False, accumulate_grad_batches=accumulate)
    trainer.fit(module, make_loader(64, batch_size=8))  # 8 batches: 8 // accumulate votes, half of them lost
    votes = 8 // accumulate
    assert strategy.votes == votes
    assert trainer.global_step == votes // 2 and trainer.fit_loop.runner.dropped_steps == votes // 2
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** (votes // 2))
    assert trainer.optimizers[0].state == {}  # SGD keeps no state; each committed step updated the weights once
    assert all(parameter.grad is None for parameter in module.parameters())  # a dropped step's gradients go too


def test_the_fault_tolerance_flag_and_config_are_checked() -> None:
    with pytest.raises(MisconfigurationException, match="fault_tolerance='yes': expected an ember.strategies.Fault"):
        ember.Trainer(fault_tolerance="yes")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationException, match=r"FaultTolerance\(min_replicas=0\): expected an int >= 1"):
        FaultTolerance(min_replicas=0)
    with pytest.raises(MisconfigurationException, match=r"FaultTolerance\(timeout=-1\): expected a number of seconds"):
        FaultTolerance(timeout=-1)
    assert ember.Trainer(logger=False).num_replica_groups == 1 and ember.Trainer(logger=False).replica_group == 0


def test_a_process_of_a_replica_group_gets_fault_tolerant_ddp_and_its_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    environment = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
                   "EMBER_REPLICA_GROUP": "1", "EMBER_REPLICA_GROUPS": "3",
                   "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:29510"}  # fmt: skip
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    options = dict(accelerator="cpu", devices="auto", num_nodes=1, precision="32-true", sync_batchnorm=False)
    chosen = select_strategy(strategy="ddp", fault_tolerance=FaultTolerance(min_replicas=2), **options)
    assert isinstance(chosen, FaultTolerantDDPStrategy) and chosen.fault_tolerance.min_replicas == 2
    assert (chosen.replica_group, chosen.num_replica_groups, chosen.is_global_zero) == (1, 3, False)
    assert chosen.training_sampler_kwargs == {"num_replicas": 3, "rank": 1}
    assert chosen.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}  # each group evaluates all the data
    with pytest.raises(MisconfigurationException, match="strategy='fsdp': ember run --replica-groups trains"):
        select_strategy(strategy="fsdp", **options)
    # A DDPStrategy of the user's keeps its process-group settings: Gloo across groups that share one GPU.
    given = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=30))
    chosen = select_strategy(strategy=given, **options)
    assert isinstance(chosen, FaultTolerantDDPStrategy) and chosen.replica_group == 1
    assert (chosen.process_group_backend, chosen.timeout) == ("gloo", timedelta(seconds=30))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--replica-groups", "0"], "--replica-groups=0: give 1 or more replica groups"),
        (["--replica-groups", "2", "--replica-group", "2", "--lighthouse", "h:1"], "--replica-group=2: give 0 to 1"),
        (["--replica-groups", "2", "--replica-group", "1"], "--replica-group=1 runs one group of a job on several"),
        (["--replica-groups", "2", "--lighthouse", "nohost"], "--lighthouse='nohost': expected HOST:PORT"),
        (["--lighthouse", "h:1"], "--lighthouse goes with --replica-groups G"),
    ],
)
def test_replica_group_flags_that_cannot_work_are_one_line(arguments: list[str], message: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert cli.main(["run", *arguments, SCRIPT]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"ember run: {message}") and error.count("\n") == 1


def test_without_torchft_replica_groups_fail_with_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import metadata

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert cli.main(["run", "--replica-groups", "2", SCRIPT]) == 2
    error = capsys.readouterr().err
    needs = "--replica-groups needs torchft-nightly==2026.10.26 (not installed)"
    assert error == f"ember run: {needs}: pip install 'ember[ft]'\n"


# ------------------------------------------------------------------------------------------ with torchft
def _needs_torchft() -> None:
    pytest.importorskip("torchft", reason="needs torchft (pip install 'ember[ft]')")


def _launch(out: Path, *arguments: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "ember", "run", "--replica-groups", "2", *arguments[:2], SCRIPT, "--out", str(out),
               *arguments[2:]]  # fmt: skip
    return warm_processes.Popen(command, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _summaries(out: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Each process's summary, by (replica group, restart)."""
    found = [json.loads(path.read_text()) for path in out.glob("group*_rank0_restart*.json")]
    return {(summary["group"], summary["restart"]): summary for summary in found}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_replica_group_costs_its_peer_at_most_a_step_and_heals_from_it(tmp_path: Path) -> None:
    """Group 1 is SIGKILLed after a committed step, then (restarted, healed) in the backward pass while group 0
    waits in the gradient allreduce. Group 0 is never restarted and drops the one step that failed; group 1 heals
    from group 0's live state both times, without reading a checkpoint; both end with the same parameters."""
    _needs_torchft()
    launcher = _launch(tmp_path, "--max-restarts", "2", "--steps", "5000", "--sleep", "0.02", "--kill-between", "10",
                       "--kill-during", "5")  # fmt: skip
    _, stderr = launcher.communicate(timeout=220)
    assert launcher.returncode == 0, stderr[-3000:]
    summaries = _summaries(tmp_path)
    assert set(summaries) == {(0, 0), (1, 2)}  # the survivor's only attempt, and the killed group's last
    survivor, healed = summaries[0, 0], summaries[1, 2]
    assert survivor["dropped"] == 1 and healed["dropped"] == 0  # the kill during the allreduce dropped a step
    assert survivor["global_step"] == healed["global_step"] and healed["started_at"] > 10
    assert stderr.count("healed from a live peer") == 2 and survivor["ckpt_path"] is None is healed["ckpt_path"]
    assert healed["parameters"] == survivor["parameters"] and healed["lr"] == survivor["lr"]
    commits = [when for when, _ in survivor["commits"]]
    for attempt in (0, 1):  # the survivor commits again within a few seconds of each kill
        killed = json.loads((tmp_path / f"killed_{attempt}.json").read_text())["time"]
        assert min(when for when in commits if when > killed) - killed < 10


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_dead_lighthouse_ends_the_job_with_a_checkpoint_that_a_new_job_resumes(tmp_path: Path) -> None:
    _needs_torchft()
    launcher = _launch(tmp_path, "--max-restarts", "1", "--steps", "5000", "--sleep", "0.02", "--checkpoint")
    deadline = time.monotonic() + 150
    while not list(tmp_path.glob("checkpoints/*step=*.ckpt")):  # training is under way
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()[1][-3000:]
        time.sleep(0.5)
    lighthouse = next(pid for pid in descendants(launcher.pid) if "lighthouse.py" in _command_line(pid))
    os.kill(lighthouse, signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 1
    assert stderr.strip().splitlines()[-1].startswith("ember run: the lighthouse at http://127.0.0.1:")
    last = tmp_path / "checkpoints" / "last.ckpt"  # logger=False: under default_root_dir, as in Lightning
    saved = checkpoint.load(str(last))["global_step"]
    # A full stop resumes from the last checkpoint, as without fault tolerance: group 0 reads it, group 1 heals.
    resumed = _launch(tmp_path, "--max-restarts", "0", "--steps", str(saved + 5), "--checkpoint")
    _, stderr = resumed.communicate(timeout=150)
    assert resumed.returncode == 0, stderr[-3000:]
    summaries = _summaries(tmp_path)
    first, second = summaries[0, 0], summaries[1, 0]
    assert first["started_at"] == second["started_at"] == saved and first["global_step"] == saved + 5
    assert first["ckpt_path"] == str(last) and second["ckpt_path"] is None
    # Group 1 heals in the job's first quorum; group 0 must count it among the groups alive and go on with it, not
    # ask for another quorum while group 1 waits for it in the step's allreduce (a step dropped after a 20 s wait).
    assert first["dropped"] == second["dropped"] == 0
    assert first["parameters"] == second["parameters"]


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""
