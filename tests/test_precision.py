"""Precision modes on CPU: autocast, true half/double precision, and the fp16 loss scaler's logic."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import Regressor, make_loader, quiet_trainer

from ember.precision import MixedPrecision, build_precision, canonical_precision


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


@pytest.mark.parametrize(
    ("flag", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("64-true", torch.float64)]
)
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


class _EvalRecording(_Recording):
    """Records the dtypes its evaluation and prediction steps see."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        self.eval_dtypes = (x.dtype, self(x).dtype)

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


@pytest.mark.parametrize(
    ("flag", "input_dtype", "output_dtype"),
    [("bf16-mixed", torch.float32, torch.bfloat16), ("bf16-true", torch.bfloat16, torch.bfloat16),
     ("64-true", torch.float64, torch.float64)],
)  # fmt: skip
def test_validation_test_and_predict_run_in_the_same_precision(
    flag: str, input_dtype: torch.dtype, output_dtype: torch.dtype
) -> None:
    model = _EvalRecording()
    trainer = quiet_trainer(max_epochs=1, precision=flag, logger=False, enable_checkpointing=False)
    trainer.fit(model, make_loader(16), make_loader(16))
    assert model.eval_dtypes == (input_dtype, output_dtype)
    model.eval_dtypes = ()
    trainer.test(model, make_loader(16), verbose=False)
    assert model.eval_dtypes == (input_dtype, output_dtype)
    predictions = trainer.predict(model, make_loader(16))
    assert {prediction.dtype for prediction in predictions} == {output_dtype}


def _float16_trainer(**flags: Any) -> Any:
    """A Trainer running float16 autocast with a loss scaler on CPU (which "16-mixed" replaces by bf16)."""
    trainer = quiet_trainer(logger=False, enable_checkpointing=False, **flags)
    trainer.strategy.precision = MixedPrecision("16-mixed", torch.float16, "cpu")
    return trainer


def test_the_loss_scale_is_checkpointed_and_restored() -> None:
    trainer = _float16_trainer(max_epochs=1)
    trainer.strategy.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
    trainer.fit(Regressor(), make_loader())
    scale = trainer.strategy.precision.scaler.get_scale()
    assert scale < 2.0**20, "float16 gradients overflow at this scale: skipped steps lower it"
    trainer.save_checkpoint("fp16.ckpt")
    assert torch.load("fp16.ckpt")["precision"]["scaler"]["scale"] == scale

    resumed = _float16_trainer(max_epochs=1)
    resumed.fit(Regressor(), make_loader(), ckpt_path="fp16.ckpt")  # already done: restores, trains nothing
    assert resumed.strategy.precision.scaler.get_scale() == scale


def test_gradients_are_unscaled_before_clipping() -> None:
    class Quadratic(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return (self.layer.weight**2).sum() * 100.0  # gradients of norm ~100: clipping to 1 bites

    reference, scaled = Quadratic(), Quadratic()
    quiet_trainer(max_steps=1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False).fit(
        reference, make_loader()
    )
    _float16_trainer(max_steps=1, gradient_clip_val=1.0).fit(scaled, make_loader())
    moved = (reference.layer.weight - Quadratic().layer.weight).norm()
    assert torch.allclose(moved, torch.tensor(0.05), atol=1e-4), "SGD lr=0.05 times a clipped gradient of norm 1"
    torch.testing.assert_close(scaled.layer.weight, reference.layer.weight, atol=1e-3, rtol=0)


def test_bfloat16_is_refused_on_a_gpu_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    for flag in ("bf16-mixed", "bf16-true", "bf16"):
        with pytest.raises(ValueError, match=rf"precision={flag!r}: Tesla V100-SXM2-16GB has no bfloat16 support"):
            build_precision(flag, torch.device("cuda", 0))


@pytest.mark.cuda
@pytest.mark.parametrize(("flag", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_mixed_precision_on_a_gpu(flag: str, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip("this GPU has no bfloat16")
    model = _Recording()
    initial = model.layer.weight.detach().clone()
    trainer = quiet_trainer(accelerator="cuda", devices=1, max_epochs=2, precision=flag, logger=False)
    trainer.fit(model, make_loader())
    assert model.dtypes == (torch.float32, dtype, torch.float32)
    assert (trainer.strategy.precision.scaler is not None) == (dtype == torch.float16)
    weight = model.layer.weight.detach().cpu()
    assert weight.isfinite().all() and not torch.equal(weight, initial)
