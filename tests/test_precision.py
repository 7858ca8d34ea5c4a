"""Precision modes on CPU: autocast, true half/double precision, and the fp16 loss scaler's logic."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import Regressor, make_loader, quiet_trainer

from ember.precision import MixedPrecision, canonical_precision


@pytest.mark.parametrize(
    ("flag", "name"),
    [(32, "32-true"), ("32", "32-true"), (16, "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed"),
     (64, "64-true"), ("16-true", "16-true"), ("bf16-true", "bf16-true")],
)  # fmt: skip
def test_spellings(flag: Any, name: str) -> None:
    assert canonical_precision(flag) == name


class _Recording(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        output = self(x)
        self.dtypes = (x.dtype, output.dtype, self.layer.weight.dtype)
        return F.mse_loss(output.float(), y.float())


def test_bf16_mixed_runs_the_forward_in_bfloat16_and_keeps_float32_weights() -> None:
    model = _Recording()
    trainer = quiet_trainer(max_epochs=1, precision="bf16-mixed", logger=False)
    trainer.fit(model, make_loader())
    assert model.dtypes == (torch.float32, torch.bfloat16, torch.float32)
    assert trainer.precision == "bf16-mixed"


@pytest.mark.parametrize(("flag", "dtype"), [("bf16-true", torch.bfloat16), ("64-true", torch.float64)])
def test_true_precision_casts_parameters_and_inputs(flag: str, dtype: torch.dtype) -> None:
    model = _Recording()
    quiet_trainer(max_epochs=1, precision=flag, logger=False).fit(model, make_loader())
    assert model.dtypes == (dtype, dtype, dtype)


def test_16_mixed_on_cpu_uses_bfloat16_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="on CPU Ember uses precision='bf16-mixed'"):
        trainer = quiet_trainer(precision="16-mixed")
    assert trainer.precision == "bf16-mixed"


def test_scaler_skips_steps_with_infinite_gradients_and_lowers_its_scale() -> None:
    precision = MixedPrecision("16-mixed", torch.float16, "cpu")
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scale = precision.scaler.get_scale()

    precision.backward((weight * torch.tensor([float("inf"), 1.0])).sum())
    precision.unscale_gradients(optimizer)
    precision.optimizer_step(optimizer)
    assert torch.equal(weight.detach(), torch.ones(2)), "a step with inf gradients must be skipped"
    assert precision.scaler.get_scale() == scale * 0.5

    optimizer.zero_grad()
    precision.backward((weight * 3.0).sum())
    precision.unscale_gradients(optimizer)  # before clipping, gradients must be at their true scale
    assert torch.equal(weight.grad, torch.full((2,), 3.0))
    precision.optimizer_step(optimizer)
    assert torch.equal(weight.detach(), torch.full((2,), -2.0))
    assert precision.state_dict()["scaler"]["scale"] == scale * 0.5
