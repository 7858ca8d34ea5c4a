"""The doctor finds each planted mistake, with its location where it has one, and nothing in clean runs."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections import Counter
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, make_loader, quiet_trainer
from torch.overrides import _get_current_function_mode_stack

from ember.doctor import Doctor, Measurements, diagnose, findings, probe, report
from ember.doctor.measurements import Timings

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = os.path.join(HERE, "scripts", "doctor_cases.py")
DIGITS = os.path.join(os.path.dirname(HERE), "examples", "digits.py")


def _doctor(*arguments: str, processes: int = 1, cwd: str, steps: int = 30) -> dict[str, Any]:
    command = [sys.executable, "-m", "ember", "doctor", "--json", "--nproc-per-node", str(processes)]
    command += ["--steps", str(steps), *arguments]
    result = warm_processes.run(command, capture_output=True, text=True, timeout=180, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    return json.loads(text[text.index("{\n") : text.rindex("}") + 1])


def _ids(report: dict[str, Any]) -> list[str]:
    return [finding["id"] for finding in report["findings"]]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("mistake", "finding"), [("input", "input-bound"), ("graph", "graph-kept"), ("sync", None)])
def test_a_planted_mistake_is_found(mistake: str, finding: str | None, tmp_path: Any) -> None:
    # Steps of about a millisecond: 200 of them make a window that a busy machine's hiccups do not sway.
    steps = 30 if mistake == "input" else 200
    report = _doctor(CASES, "--mistakes", mistake, "--steps", str(steps), cwd=str(tmp_path), steps=steps)
    if finding is None:  # a per-step .item() of a CPU tensor: there is no device to wait for
        assert _ids(report) == []
        return
    # On a busy machine a short run may also wait for data; what matters here is that the mistake is found.
    assert finding in _ids(report)
    found = next(each for each in report["findings"] if each["id"] == finding)
    assert found["measured"] and found["why"] and found["fix"]
    if mistake == "input":
        assert 0.2 < found["estimated_gain"] <= 1.0 and "num_workers=" in found["fix"]
    if mistake == "graph":
        assert "list 'kept', a global of" in found["locations"][0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_distributed_mistakes_are_found(tmp_path: Any) -> None:
    planted = _doctor(CASES, "--mistakes", "bare-forward,find-unused,set-epoch,threads", processes=2, cwd=str(tmp_path))
    assert _ids(planted)[:3] == ["ddp-bare-forward", "ddp-find-unused", "ddp-sampler-epoch"]
    assert "doctor_cases.py" in planted["findings"][0]["locations"][0]
    # Measured by the processes contending for cores: on a machine busy with other work, the thread timings may
    # overlap, and the doctor then rightly says nothing; when it speaks, its numbers back its advice.
    assert _ids(planted)[3:] in ([], ["cpu-oversubscribed"])
    for threads in planted["findings"][3:]:
        slower, faster = (
            float(ms) for ms in re.findall(r"takes ([\d.]+) ms .* and ([\d.]+) ms", threads["measured"])[0]
        )
        assert slower > faster and threads["estimated_gain"] >= 0.005 and threads["fix"].startswith("torch.set_num")
    accumulation = _doctor(CASES, "--mistakes", "accumulation", processes=2, cwd=str(tmp_path))
    assert _ids(accumulation) == ["ddp-sync-every-micro-batch"]
    assert "4.0 per optimizer step" in accumulation["findings"][0]["title"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("processes", [1, 2])
def test_clean_runs_raise_no_alarm(processes: int, tmp_path: Any) -> None:
    assert _ids(_doctor(CASES, "--steps", "200", processes=processes, cwd=str(tmp_path), steps=200)) == []
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
    assert torch.nonzero is nonzero and _get_current_function_mode_stack() == []
    # The classes are as they were: torch.tensor of a list of tensors still reads each as a number.
    assert torch.tensor([torch.tensor(1.0), torch.tensor(2.0)]).tolist() == [1.0, 2.0]


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
    result = warm_processes.run(help_text, capture_output=True, text=True, timeout=60)
    for flag in ("--steps", "--json", "--nproc-per-node", "--module"):
        assert flag in result.stdout
    command = [sys.executable, "-m", "ember", "doctor", "--steps", "3", CASES]
    bad = warm_processes.run(command, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--steps=3" in bad.stderr


def test_installing_and_removing_the_doctor_leaves_torch_as_it_was() -> None:
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import _global_optimizer_post_hooks
    from torch.utils.data import DistributedSampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    owners = [torch, torch.cuda, torch.Tensor, _BaseDataLoaderIter, DistributedDataParallel, DistributedSampler]
    before = [dict(vars(owner)) for owner in owners]
    hooks = dict(_global_optimizer_post_hooks)
    doctor = Doctor(steps=10).install()
    assert torch.Tensor.item.__qualname__ != "TensorBase.item" and "__next__" in vars(_BaseDataLoaderIter)
    doctor.uninstall()
    for owner, namespace in zip(owners, before):
        after = vars(owner)
        assert after.keys() == namespace.keys() and all(after[name] is namespace[name] for name in namespace), owner
    assert dict(_global_optimizer_post_hooks) == hooks


# ------------------------------------------------------------------------ each finding, on figures made by hand
def _measured(**figures: Any) -> Measurements:
    """A clean run (25 steps of 10 ms, one process, two cores, no DDP), changed by ``figures``."""
    clean = Measurements(
        steps_seen=30, measured_steps=25, window_seconds=0.25, data_wait=0.01, data_cpu=0.01,
        loaders=Counter({(0, False, False): 25}), threads=2, cores_per_process=2,
    )  # fmt: skip
    return dataclasses.replace(clean, **figures)


def _timings(*milliseconds: float) -> Timings:
    return Timings(tuple(ms / 1e3 for ms in milliseconds))


# A setting 4 times slower than another, each timed 9 times with one burst of other work in each: one of FAST's
# timings is slower than most of SLOW's, and the difference is still beyond the noise.
SLOW = _timings(4.0, 4.2, 3.9, 4.1, 4.0, 4.3, 3.8, 4.0, 9.0)
FAST = _timings(1.0, 1.1, 0.9, 1.0, 1.0, 1.2, 1.0, 0.9, 4.5)


def _ddp(**figures: Any) -> Measurements:
    """A clean run with one DDP model that syncs once per step, changed by ``figures``."""
    return _measured(**{"ddp_models": 1, "syncing_forwards": 25, "all_reduce_seconds": 0.001, **figures})


def test_a_clean_run_has_no_findings_and_every_finding_shows_in_report_order() -> None:
    assert diagnose(_measured()) == [] and diagnose(_ddp()) == []
    everything = _ddp(
        data_wait=0.15, graph_tensors=30, syncs=Counter({"a.py:1 in f (item)": 50}), precision_seconds=(SLOW, FAST),
        peak_memory=2**30, total_memory=80 * 2**30, batch_size=32, bare_forwards=Counter({"a.py:2 in f": 25}),
        ddp_models_searching_unused=1, sampler_epochs={1: [0, 0]}, threads=8, matmul_seconds=(SLOW, FAST),
        syncing_forwards=100,
    )  # fmt: skip
    assert [finding.id for finding in diagnose(everything)] == [
        "input-bound", "graph-kept", "host-sync", "precision", "small-batch", "ddp-bare-forward", "ddp-find-unused",
        "ddp-sampler-epoch", "cpu-oversubscribed", "ddp-sync-every-micro-batch",
    ]  # fmt: skip
    assert diagnose(dataclasses.replace(everything, measured_steps=0)) == []  # nothing measured, nothing found


def test_input_bound() -> None:
    assert findings.input_bound(_measured(data_wait=0.04)) is None  # 16% of the time
    reading = findings.input_bound(_measured(data_wait=0.15))  # 6 ms of each 10 ms step, mostly sleeping on I/O
    assert reading is not None and reading.title == "Training waits for data 60% of the time"
    assert reading.fix.startswith("DataLoader(..., num_workers=2);") and reading.estimated_gain == pytest.approx(0.6)
    computing = findings.input_bound(_measured(data_wait=0.15, data_cpu=0.15, cores_per_process=2))
    assert computing is not None and computing.fix.startswith("DataLoader(..., num_workers=1);")  # a core for training
    workers = findings.input_bound(
        _measured(data_wait=0.15, loaders=Counter({(2, False, False): 25}), cuda_available=True)
    )
    assert workers is not None and "num_workers=3, persistent_workers=True, pin_memory=True" in workers.fix


def test_graphs_kept() -> None:
    assert findings.graphs_kept(_measured(graph_tensors=3)) is None
    kept = findings.graphs_kept(_measured(graph_tensors=25, graph_bytes=2**20, graph_holders=["list 'kept'"]))
    assert kept is not None and kept.locations == ["list 'kept'"]
    assert "25 more tensors with a grad_fn alive after 25 steps (about 1.0 per step)" in kept.measured
    assert "1.00 MB" in kept.measured


KEPT_LOSSES: list[torch.Tensor] = []


class _Recorder:
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []


def test_kept_graphs_are_traced_to_the_global_or_the_attribute_holding_them() -> None:
    module, recorder, weight = Regressor(), _Recorder(), torch.ones(2, requires_grad=True)
    module.outputs = []  # as a LightningModule collecting its step outputs
    for _ in range(3):
        KEPT_LOSSES.append(weight * 2)
        recorder.losses.append(weight * 3)  # an object whose attributes Python keeps in the object itself
        module.outputs.append(weight * 4)
    try:
        places = probe._holders(KEPT_LOSSES + recorder.losses + module.outputs)
    finally:
        KEPT_LOSSES.clear()
    assert sorted(places) == [
        f"list 'KEPT_LOSSES', a global of {__file__} (3 of the tensors sampled)",
        "list in attribute 'losses' of a _Recorder (3 of the tensors sampled)",
        "list in attribute 'outputs' of a Regressor (3 of the tensors sampled)",
    ]


def test_host_syncs() -> None:
    assert findings.host_syncs(_measured(syncs=Counter({"a.py:1 in f (item)": 24}))) is None
    syncs = findings.host_syncs(_measured(syncs=Counter({"a.py:1 in f (item)": 50}), sync_seconds=0.05))
    assert syncs is not None and syncs.title.startswith("2.0 host-device synchronisations per step")
    assert syncs.locations == ["a.py:1 in f (item): 50 calls"] and syncs.estimated_gain == pytest.approx(0.2)


def test_precision() -> None:
    assert findings.precision(_measured()) is None  # not measured: no GPU, or not float32
    assert findings.precision(_measured(precision_seconds=(_timings(10, 10.2, 9.9), _timings(9.5, 9.6, 9.4)))) is None
    faster = findings.precision(_measured(precision_seconds=(SLOW, FAST), gpu_name="a GPU"))
    assert faster is not None and "4.0x faster" in faster.title and faster.measured.endswith("on a GPU")
    assert "4 ms (3.8-9 ms over 9 runs) in float32 and 1 ms (0.9-4.5 ms over 9 runs)" in faster.measured
    assert faster.estimated_gain == pytest.approx(0.75)
    # bf16 faster by the medians, but two of its timings are as slow as float32's two fastest: within the noise
    noisy = (_timings(10, 10.5, 9.5, 8.0, 10, 9.8, 10.2, 7.5, 10), _timings(5, 5.5, 4.5, 8.5, 5, 5.2, 8.2, 4.8, 5.1))
    assert findings.precision(_measured(precision_seconds=noisy)) is None


def test_batch_headroom() -> None:
    assert findings.batch_headroom(_measured()) is None  # not measured: no GPU
    assert findings.batch_headroom(_measured(peak_memory=40 * 2**30, total_memory=80 * 2**30, batch_size=32)) is None
    small = findings.batch_headroom(_measured(peak_memory=2**30, total_memory=80 * 2**30, batch_size=32))
    assert small is not None and small.title == "The batch uses 1% of the GPU's memory"
    assert "batches of about 2048" in small.fix and "x64 linear, or x8.0 square-root" in small.fix


def test_bare_forward() -> None:
    assert findings.bare_forward(_ddp()) is None
    bare = findings.bare_forward(_ddp(bare_forwards=Counter({"a.py:2 in f": 25})))
    assert bare is not None and bare.locations == ["a.py:2 in f: 25 calls"] and bare.measured.startswith("25 forward")


def test_unneeded_unused_search() -> None:
    assert findings.unneeded_unused_search(_ddp(unused_search_seconds=0.025)) is None  # not searching
    needed = _ddp(ddp_models_searching_unused=1, unused_search_seconds=0.025, all_parameters_used=False)
    assert findings.unneeded_unused_search(needed) is None
    unneeded = findings.unneeded_unused_search(dataclasses.replace(needed, all_parameters_used=True))
    assert unneeded is not None and "1.00 ms per step" in unneeded.measured
    assert unneeded.estimated_gain == pytest.approx(0.1)


def test_sampler_epochs() -> None:
    assert findings.sampler_epochs(_ddp(sampler_epochs={1: [0, 1, 2], 2: [0]})) is None
    stuck = findings.sampler_epochs(_ddp(sampler_epochs={1: [0, 1], 2: [0, 0, 0]}))
    assert stuck is not None and stuck.measured == "iterated 3 times with epoch=0 each time"


def test_oversubscribed() -> None:
    assert findings.oversubscribed(_measured(matmul_seconds=(SLOW, FAST))) is None  # 2 threads on 2 cores
    crowded = findings.oversubscribed(_measured(threads=16, local_processes=2, matmul_seconds=(SLOW, FAST)))
    assert crowded is not None and crowded.title == "16 CPU threads x 2 process(es) on 4 cores"
    assert crowded.fix.startswith("torch.set_num_threads(2)") and crowded.estimated_gain == pytest.approx(0.75)
    assert crowded.measured.startswith(
        "a matrix product takes 4 ms (3.8-9 ms over 9 runs) with 16 threads and 1 ms (0.9-4.5 ms over 9 runs) with 2"
    )
    # Fewer threads measured slower: the fix would slow the run down, so there is nothing to report.
    assert findings.oversubscribed(_measured(threads=4, matmul_seconds=(FAST, SLOW))) is None
    # Faster by the medians, within the noise: the timings overlap.
    noisy = (
        _timings(1.4, 1.5, 1.3, 1.2, 16.0, 1.3, 1.4, 1.2, 1.5),
        _timings(1.1, 1.2, 1.0, 1.3, 1.1, 1.25, 1.35, 1.0, 1.2),
    )
    assert findings.oversubscribed(_measured(threads=4, matmul_seconds=noisy)) is None
    # Faster beyond the noise, but by less than the 0.5% the report would show as an estimated gain of 0%.
    steady = (_timings(1.004, 1.005, 1.004), _timings(1.0, 1.001, 1.0))
    assert findings.oversubscribed(_measured(threads=4, matmul_seconds=steady)) is None


def test_the_thread_timings_are_repeated_and_interleaved() -> None:
    before = torch.get_num_threads()
    measured = Measurements()
    try:
        torch.set_num_threads(probe.cores_per_process() + 1)
        probe._threads(measured)
    finally:
        torch.set_num_threads(before)
    assert measured.matmul_seconds is not None
    assert [len(timings.samples) for timings in measured.matmul_seconds] == [9, 9]


def test_sync_every_micro_batch() -> None:
    assert findings.sync_every_micro_batch(_ddp(syncing_forwards=30)) is None
    assert findings.sync_every_micro_batch(_measured(syncing_forwards=100)) is None  # no DDP model
    every = findings.sync_every_micro_batch(_ddp(syncing_forwards=100, all_reduce_seconds=0.001))
    assert every is not None and "(4.0 per optimizer step)" in every.title
    assert every.estimated_gain == pytest.approx(75 * 0.001 / 0.25)


def test_the_report_as_text_and_json() -> None:
    measured = _measured(data_wait=0.15)
    found = diagnose(measured)
    text = report.text(measured, found)
    assert text.startswith("ember doctor: 25 steps measured (after 5 of warm-up), 10.0 ms per step, 1 process(es)")
    assert "\n[input-bound] Training waits for data 60% of the time\n  measured: " in text
    assert "estimated gain: 60%" in text
    assert report.text(_measured(), []).endswith("no findings: nothing the doctor checks is slowing this run")
    short = _measured(steps_seen=3, measured_steps=0)
    assert report.text(short, []) == "ember doctor: the run made 3 optimizer steps; more than 5 are needed"
    as_json = json.loads(report.as_json(measured, found))
    assert as_json["measured_steps"] == 25 and as_json["step_ms"] == pytest.approx(10.0)
    assert as_json["findings"][0]["id"] == "input-bound" and as_json["findings"][0]["estimated_gain"] == 0.6
