"""What a Module offers besides training: its device type, freezing, TorchScript export, the example input."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember.callbacks import ModelSummary
from ember.exceptions import MisconfigurationException


def test_freeze_and_unfreeze_give_the_module_back_in_its_new_mode() -> None:
    model = Regressor()
    assert model.freeze() is model and not model.training
    assert not any(parameter.requires_grad for parameter in model.parameters())
    assert model.unfreeze() is model and model.training
    assert all(parameter.requires_grad for parameter in model.parameters())


def test_a_module_without_a_trainer_runs_on_no_gpu_and_no_fabric() -> None:
    model = Regressor()
    assert model.example_input_array is None and model.on_gpu is False and model.fabric is None


@pytest.mark.parametrize("method", ["script", "trace"])
def test_to_torchscript_exports_in_evaluation_mode_and_keeps_the_module_s(method: str, tmp_path: Any) -> None:
    model = Regressor()
    model.example_input_array = torch.randn(3, 4)
    path = tmp_path / f"{method}.pt"
    exported = model.to_torchscript(file_path=path, method=method)
    assert isinstance(exported, torch.jit.ScriptModule) and not exported.training and model.training
    x = torch.randn(5, 4)
    assert torch.allclose(torch.jit.load(str(path))(x), model(x))


def test_to_torchscript_traces_the_inputs_given_and_refuses_what_it_cannot_do(tmp_path: Any) -> None:
    model = Regressor()
    traced = model.to_torchscript(method="trace", example_inputs=torch.zeros(1, 4))
    assert traced(torch.ones(2, 4)).shape == (2, 1)
    with pytest.raises(ValueError, match="requires either `example_inputs` or `model.example_input_array`"):
        model.to_torchscript(method="trace")
    with pytest.raises(ValueError, match="only supports 'script' or 'trace', but value given was: onnx"):
        model.to_torchscript(method="onnx")
    with pytest.raises(FileNotFoundError):  # as writing any file there would
        model.to_torchscript(file_path=tmp_path / "missing" / "model.pt")


def test_the_summary_shows_each_layer_s_sizes_when_the_module_has_an_example_input(capsys: Any) -> None:
    model = Regressor()
    model.example_input_array = torch.zeros(6, 4)
    trainer = ember.Trainer(accelerator="cpu", max_steps=1, logger=False, callbacks=[ModelSummary()])
    trainer.fit(model, make_loader(16))
    header, _, row = capsys.readouterr().out.splitlines()[:3]
    assert [cell.strip() for cell in header.split("|")][-2:] == ["In sizes", "Out sizes"]
    assert [cell.strip() for cell in row.split("|")][-2:] == ["[6, 4]", "[6, 1]"]


class _ManualBackwardInAutomatic(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        return loss


def test_manual_backward_under_automatic_optimization_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match="to use manual_backward, please disable automatic opt"):
        quiet_trainer(max_steps=1, logger=False).fit(_ManualBackwardInAutomatic(), make_loader(16))


def test_to_onnx_needs_onnx_and_an_input_then_exports_the_example(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Regressor()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ModuleNotFoundError, match=r"`Regressor.to_onnx\(\)` requires `onnx` to be installed."):
        model.to_onnx("model.onnx")
    monkeypatch.undo()
    exports: list[tuple[Any, ...]] = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: object())  # as if onnx were installed
    monkeypatch.setattr(torch.onnx, "export", lambda *args, **kwargs: exports.append((*args, kwargs)) or "program")
    with pytest.raises(ValueError, match="neither `input_sample` nor `model.example_input_array` attribute is set"):
        model.to_onnx("model.onnx")
    model.example_input_array = torch.zeros(2, 4)
    assert model.to_onnx("model.onnx", opset_version=17) == "program" and model.training
    ((module, sample, path, kwargs),) = exports
    assert (
        module is model
        and torch.equal(sample, torch.zeros(2, 4))
        and (path, kwargs) == ("model.onnx", {"opset_version": 17})
    )
