"""Resume that survives a changed setup: a run killed mid-epoch continues at the very sample it stopped at,
with another number of processes, batch size or accumulation; a changed dataset or seed is refused."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember import checkpoint as checkpoint_io
from ember.data import EpochOrder

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "resume_layout.py")
SAMPLES = 48


def _launch(out: str, devices: int, *args: str) -> subprocess.CompletedProcess:
    launcher = (
        [sys.executable, "-m", "ember", "run", "--nproc-per-node", str(devices)] if devices > 1 else [sys.executable]
    )
    command = [*launcher, SCRIPT, "--out", out, "--devices", str(devices), *args]
    return subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=150)


def _rows(out: str, tag: str, devices: int) -> list[list[Any]]:
    rows = []
    for rank in range(devices):
        with open(os.path.join(out, f"{tag}-rank{rank}.json")) as file:
            rows.append(json.load(file))
    return rows


# (processes, batch size, accumulation) before and after, and the step to kill the first run after (odd: the
# checkpoint two steps before it is the last one saved).
SCENARIOS = {
    "2->1": ((2, 4, 1), (1, 4, 1), 3),
    "1->2": ((1, 4, 1), (2, 4, 1), 5),
    "2->2, half the batch": ((2, 4, 1), (2, 2, 1), 3),
    "1->1, accumulation 1->2": ((1, 4, 1), (1, 4, 2), 5),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_run_killed_mid_epoch_resumes_at_the_sample_with_another_layout(scenario: str, tmp_path: Any) -> None:
    (devices, batch, accumulate), (new_devices, new_batch, new_accumulate), kill_after = SCENARIOS[scenario]
    out = str(tmp_path)
    killed = _launch(out, devices, "--batch-size", str(batch), "--accumulate", str(accumulate),
                     "--kill-after", str(kill_after), "--tag", "first")  # fmt: skip
    assert killed.returncode != 0  # SIGKILL
    last = checkpoint_io.load(os.path.join(out, "checkpoints", "last.ckpt"))
    progress = last["loops"]["fit_loop"]["progress"]
    assert progress["epoch"] == 0 and 0 < progress["epoch_samples"] < SAMPLES  # mid-epoch
    resumed = _launch(out, new_devices, "--batch-size", str(new_batch), "--accumulate", str(new_accumulate),
                      "--ckpt-path", "last", "--tag", "second")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continues at sample {progress['epoch_samples']}" in resumed.stdout

    # Epoch 0: what the checkpoint holds of the first run, and what the second run read, is every sample once.
    before = [row for rows in _rows(out, "first", devices) for row in rows[: progress["epoch_batches"]]]
    after = [row for rows in _rows(out, "second", new_devices) for row in rows if row[0] == 0]
    used = collections.Counter(index for row in before + after for index in row[2])
    assert used == collections.Counter(range(SAMPLES))

    # Epoch 1 is read as an uninterrupted run with the new layout reads it.
    for rank, rows in enumerate(_rows(out, "second", new_devices)):
        order = EpochOrder(SAMPLES, shuffle=True, num_replicas=new_devices, rank=rank)
        order.seed, order.epoch = last["data"]["seed"], 1
        expected = list(order)
        assert [index for row in rows if row[0] == 1 for index in row[2]] == expected


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_and_resumed_run_equals_one_that_switched_layout_at_the_checkpoint(tmp_path: Any) -> None:
    out, reference = str(tmp_path / "killed"), str(tmp_path / "reference")
    os.makedirs(out)
    os.makedirs(reference)
    assert _launch(out, 2, "--kill-after", "3", "--tag", "first").returncode != 0
    assert _launch(out, 1, "--ckpt-path", "last", "--tag", "second").returncode == 0
    # The same history without a kill: two processes up to the checkpoint's step 2, then one.
    assert _launch(reference, 2, "--max-steps", "2", "--tag", "first").returncode == 0
    assert _launch(reference, 1, "--ckpt-path", "last", "--tag", "second").returncode == 0
    killed = torch.load(os.path.join(out, "second-final.pt"))
    clean = torch.load(os.path.join(reference, "second-final.pt"))
    assert all(torch.equal(a, b) for a, b in zip(killed, clean, strict=True))


# ------------------------------------------------------------------------------ changed data or seed
def _checkpoint_of_a_run(tmp_path: Any, samples: int = 64) -> str:
    ember.seed_everything(3)
    trainer = quiet_trainer(max_steps=3, logger=False, default_root_dir=str(tmp_path))
    trainer.fit(Regressor(), make_loader(samples, batch_size=8, shuffle=True))
    path = str(tmp_path / "mid-epoch.ckpt")
    trainer.save_checkpoint(path)
    return path


def test_a_dataset_of_another_length_is_refused_unless_the_flag_accepts_it(tmp_path: Any) -> None:
    path = _checkpoint_of_a_run(tmp_path)
    with pytest.raises(ValueError, match=r"dataset length 64 -> 80.*Trainer\(restart_on_data_change=True\)"):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), make_loader(80, batch_size=8), ckpt_path=path)
    trainer = quiet_trainer(max_epochs=1, logger=False, restart_on_data_change=True)
    with pytest.warns(UserWarning, match="the data changed .*epoch 0 starts over"):
        trainer.fit(Regressor(), make_loader(80, batch_size=8), ckpt_path=path)
    assert trainer.global_step == 3 + 10  # the whole epoch of 80 samples, after the 3 steps before


def test_another_seed_is_refused_unless_the_flag_accepts_it(tmp_path: Any) -> None:
    path = _checkpoint_of_a_run(tmp_path)
    ember.seed_everything(4)
    with pytest.raises(ValueError, match=r"global seed 3 -> 4"):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), make_loader(64, batch_size=8), ckpt_path=path)
    ember.seed_everything(3)  # the same seed: no objection
    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(Regressor(), make_loader(64, batch_size=8), ckpt_path=path)
    assert trainer.global_step == 8


def test_schedulers_continue_by_step_with_a_warning_when_an_epoch_has_other_steps(tmp_path: Any) -> None:
    class Scheduled(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)]

    ember.seed_everything(3)
    first = quiet_trainer(max_steps=3, logger=False)
    first.fit(Scheduled(), make_loader(64, batch_size=8, shuffle=True))
    path = str(tmp_path / "scheduled.ckpt")
    first.save_checkpoint(path)
    trainer = quiet_trainer(max_epochs=1, logger=False)
    with pytest.warns(UserWarning, match="an epoch is now 4 optimizer steps instead of 8"):
        trainer.fit(Scheduled(), make_loader(64, batch_size=16, shuffle=True), ckpt_path=path)
    assert trainer.global_step == 3 + 3  # samples 24..63 in batches of 16: 3 more steps
