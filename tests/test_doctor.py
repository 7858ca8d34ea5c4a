"""The doctor finds each planted mistake, with its location where it has one, and nothing in clean runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer

from ember.doctor import Doctor

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "scripts", "doctor_cases.py")
DIGITS = os.path.join(os.path.dirname(HERE), "examples", "digits.py")


def _doctor(*arguments: str, processes: int = 1, cwd: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "ember", "doctor", "--json", "--nproc-per-node", str(processes), *arguments]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    return json.loads(text[text.index("{\n") : text.rindex("}") + 1])


def _ids(report: dict[str, Any]) -> list[str]:
    return [finding["id"] for finding in report["findings"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mistake", "finding"), [("input", "input-bound"), ("graph", "graph-kept"), ("sync", None)])
def test_a_planted_mistake_is_found(mistake: str, finding: str | None, tmp_path: Any) -> None:
    report = _doctor(CASES, "--mistakes", mistake, cwd=str(tmp_path))
    if finding is None:  # a per-step .item() of a CPU tensor: there is no device to wait for
        assert _ids(report) == []
        return
    assert _ids(report) == [finding]
    found = report["findings"][0]
    assert found["measured"] and found["why"] and found["fix"]
    if mistake == "input":
        assert 0.2 < found["estimated_gain"] <= 1.0 and "num_workers=" in found["fix"]
    if mistake == "graph":
        assert "list 'kept', a global of" in found["locations"][0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_mistakes_are_found(tmp_path: Any) -> None:
    planted = _doctor(CASES, "--mistakes", "bare-forward,find-unused,set-epoch,threads", processes=2, cwd=str(tmp_path))
    assert _ids(planted) == ["ddp-bare-forward", "ddp-find-unused", "ddp-sampler-epoch", "cpu-oversubscribed"]
    assert "doctor_cases.py" in planted["findings"][0]["locations"][0]
    assert planted["findings"][3]["estimated_gain"] >= 0.0  # measured by the processes contending for cores
    accumulation = _doctor(CASES, "--mistakes", "accumulation", processes=2, cwd=str(tmp_path))
    assert _ids(accumulation) == ["ddp-sync-every-micro-batch"]
    assert "4.0 per optimizer step" in accumulation["findings"][0]["title"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [1, 2])
def test_clean_runs_raise_no_alarm(processes: int, tmp_path: Any) -> None:
    assert _ids(_doctor(CASES, processes=processes, cwd=str(tmp_path))) == []
    pytest.importorskip("sklearn")
    digits = _doctor(DIGITS, "--max-epochs", "3", "--root-dir", str(tmp_path), processes=processes, cwd=str(tmp_path))
    assert _ids(digits) == [] and digits["measured_steps"] == 25


class _Reading(Regressor):
    """Reads the values of its tensors every step, in each of the ways that wait for a device, and in
    ways that do not (a dtype conversion, integer and slice indexing)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        x, _ = batch
        if loss.item() > 1e9:  # the planted per-step reads
            print("diverging")
        positive = x[x > 0]
        where = torch.nonzero(x)
        on_host = x.to("cpu")
        unaffected = x.to(torch.float64)[0, 1:]
        assert positive.dim() == 1 and where.dim() == 2 and on_host.shape == x.shape and unaffected.numel() == 3
        return loss


def test_trainer_doctor_counts_what_waits_for_the_device_and_training_goes_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ember.doctor.watch

    # The CPU stands in for a GPU: every tensor counts as on a device.
    monkeypatch.setattr(ember.doctor.watch, "_on_accelerator", lambda tensor: isinstance(tensor, torch.Tensor))
    nonzero = torch.nonzero
    trainer = quiet_trainer(max_epochs=3, doctor=10, logger=False)
    trainer.fit(_Reading(), make_loader(64, batch_size=4))
    output = capsys.readouterr().out
    assert "[host-sync] 4.0 host-device synchronisations per step" in output
    for read in ("(item)", "(boolean mask)", "(nonzero)", "(to the CPU)"):
        assert f"{read}: 5 calls" in output
    assert "test_doctor.py" in output and "estimated gain" in output
    assert trainer.global_step == 48  # the run went on after the report
    assert torch.Tensor.item.__qualname__ == "TensorBase.item"  # the instrumentation is gone
    assert torch.Tensor.__getitem__.__qualname__ == "TensorBase.__getitem__" and torch.nonzero is nonzero


def test_reads_of_cpu_tensors_are_no_host_syncs(capsys: pytest.CaptureFixture[str]) -> None:
    quiet_trainer(max_epochs=1, doctor=10, logger=False).fit(_Reading(), make_loader(64, batch_size=4))
    output = capsys.readouterr().out
    assert "ember doctor:" in output and "host-sync" not in output


def test_doctor_options_are_checked(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="doctor=3: True"):
        quiet_trainer(doctor=3)
    with pytest.raises(ValueError, match="more than 5 steps"):
        Doctor(steps=5)
    help_text = [sys.executable, "-m", "ember", "doctor", "--help"]
    result = subprocess.run(help_text, capture_output=True, text=True, timeout=60)
    for flag in ("--steps", "--json", "--nproc-per-node", "--module"):
        assert flag in result.stdout
    command = [sys.executable, "-m", "ember", "doctor", "--steps", "3", CASES]
    bad = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--steps=3" in bad.stderr
