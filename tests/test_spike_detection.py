"""SpikeDetection: a training loss that spikes ends the fit with TrainingSpikeException and writes the batches to
skip, as Lightning's callback does."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from conftest import make_loader, quiet_trainer

import ember
from ember.callbacks import SpikeDetection, TrainingSpikeException


class _Scripted(ember.Module):
    """Its training loss at step i is ``losses[i]``, whatever the batch."""

    def __init__(self, losses: list[float]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.losses = losses

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.weight.sum() * 0 + self.losses[self.global_step]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path: Any, losses: list[float], callback: SpikeDetection) -> ember.Trainer:
    trainer = quiet_trainer(
        max_epochs=1, logger=False, enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[callback]
    )
    trainer.fit(_Scripted(losses), make_loader(16, batch_size=2))
    return trainer


def test_a_spike_ends_the_fit_and_writes_the_batches_to_skip(tmp_path: Any) -> None:
    callback = SpikeDetection()
    with pytest.raises(TrainingSpikeException, match="^Training spike detected in batch 4$"):
        _fit(tmp_path, [1.0, 1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0], callback)
    # The spiking batch and the one before it, which may have damaged the weights.
    assert callback.bad_batches == [3, 4]
    assert json.loads((tmp_path / "skip_batches.json").read_text()) == [3, 4]
    assert callback.state_dict()["bad_batches_path"] == str(tmp_path / "skip_batches.json")


@pytest.mark.parametrize(
    ("losses", "settings"),
    [
        ([1.0, 1.0, 2.5, 1.0, 1.0, 1.0, 1.0, 1.0], {}),  # within rtol=2 of the mean
        ([1.0, 1.0, 0.1, 1.0, 1.0, 1.0, 1.0, 1.0], {}),  # an improvement
        ([1.0, 9.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0], {"warmup": 3}),
        ([1.0, 1.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0], {"atol": 5.0}),  # both tolerances must be exceeded
        ([1.0, 1.0, 5.0, 0.1, 1.0, 1.0, 1.0, 1.0], {"mode": "max"}),
    ],
)
def test_what_is_no_spike(tmp_path: Any, losses: list[float], settings: dict[str, Any]) -> None:
    callback = SpikeDetection(**settings)
    assert _fit(tmp_path, losses, callback).global_step == 8
    assert callback.bad_batches == [] and not (tmp_path / "skip_batches.json").exists()


@pytest.mark.parametrize(
    ("losses", "settings", "batch"),
    [
        ([1.0, 1.0, 7.0, 1.0], {"atol": 5.0, "rtol": None}, 2),
        ([1.0, 1.0, float("inf"), 1.0], {}, 2),  # finite_only: a loss that is not finite is a spike
        ([1.0, 1.0, float("inf"), 1.0], {"finite_only": False}, 2),  # above any mean
        ([1.0, 1.0, 1.0, 10.0], {"window": 2, "rtol": 1.0}, 3),
    ],
)
def test_what_is_a_spike(tmp_path: Any, losses: list[float], settings: dict[str, Any], batch: int) -> None:
    path = tmp_path / "runs" / "skip.json"
    with pytest.raises(TrainingSpikeException, match=f"batch {batch}$"):
        _fit(tmp_path, losses, SpikeDetection(exclude_batches_path=path, **settings))
    assert json.loads(path.read_text()) == [batch - 1, batch]


def test_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(ValueError, match=r"Has to be min or max, found up: SpikeDetection\(mode='up'\)"):
        SpikeDetection(mode="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"SpikeDetection\(window=0\): expected a positive number"):
        SpikeDetection(window=0)
