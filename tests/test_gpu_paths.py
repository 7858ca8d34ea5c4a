"""The GPU paths: each mechanism pinned on CPU (the device a loader or strategy chooses, the autocast a
thread enters, where a collective's tensor lives), and the same paths run for real by tests marked cuda."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from ember.data import prepare_loader


class _OnAGPU:
    """Just enough of a strategy for prepare_loader: one process on cuda:0."""

    root_device = torch.device("cuda", 0)
    distributed_sampler_kwargs = None


class _OnCPU(_OnAGPU):
    root_device = torch.device("cpu")


# ---------------------------------------------------------------------------------- pinned memory
def test_only_cpu_tensors_of_batches_bound_for_a_gpu_are_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[str] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args: pinned.append(self.device.type) or self)
    # A dataset that yields tensors already on a device (the meta device stands in for the GPU here).
    samples = [(torch.zeros(2, device="meta"), torch.ones(1))] * 4
    prepared = prepare_loader(DataLoader(samples, batch_size=2), _OnAGPU(), train=False)  # type: ignore[arg-type]
    assert not prepared.pin_memory  # the DataLoader's own pinning would fail on the device tensor
    on_device, on_cpu = next(iter(prepared))
    assert on_device.device.type == "meta" and on_cpu.shape == (2, 1)
    assert pinned == ["cpu"]
    # Worker processes hand over CPU tensors only: the loader pins them in its background thread.
    with_workers = prepare_loader(DataLoader(samples, batch_size=2, num_workers=2), _OnAGPU(), train=False)  # type: ignore[arg-type]
    assert with_workers.pin_memory
    assert not prepare_loader(DataLoader(samples, num_workers=2), _OnCPU(), train=False).pin_memory  # type: ignore[arg-type]
