"""Bad input gets a clear error that names the flag or value and what is allowed."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer
from torch.utils.data import DataLoader

import ember
from ember.exceptions import MisconfigurationException
from ember.optim import LightningOptimizer


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"precision": "17"}, r"precision='17': Precision '17' is invalid. Allowed precision values: .*'bf16-mixed'"),
        ({"accelerator": "tpu"}, r"accelerator='tpu' is not supported; choose one of"),
        ({"max_epochs": -5}, r"max_epochs=-5: `max_epochs` must be a non-negative integer or -1"),
        ({"max_steps": -3}, r"max_steps=-3"),
        ({"accumulate_grad_batches": 0}, r"=0: `accumulate_grad_batches` should be an int >= 1 or 'auto'"),
        (
            {"devices": (os.cpu_count() or 1) + 1, "accelerator": "cpu"},
            r"devices=\d+, but this machine has \d+ CPU cores",
        ),
        ({"devices": 0}, r"devices=0: at least one device"),
        ({"devices": "two"}, r"devices='two'"),
        ({"limit_train_batches": 1.5}, r"limit_train_batches=1.5: passed invalid value; an int counts batches"),
        ({"limit_val_batches": -1}, r"limit_val_batches=-1"),
        ({"val_check_interval": 0.0}, r"val_check_interval=0.0"),
        (
            {"gradient_clip_algorithm": "l3"},
            r"gradient_clip_algorithm='l3': `gradient_clip_algorithm` l3 is invalid; choose 'norm' or 'value'",
        ),
        ({"gradient_clip_val": -1.0}, r"gradient_clip_val=-1.0"),
        ({"log_every_n_steps": -1}, r"log_every_n_steps=-1"),
        ({"deterministic": "yes"}, r"deterministic='yes'"),
        ({"gpus": 1, "devices": 2}, r"gpus= is the older spelling"),
        ({"max_time": "1 hour"}, r"max_time='1 hour': expected 'DD:HH:MM:SS'"),
        ({"strategy": "horovod"}, r"strategy='horovod' is not supported"),
        ({"profiler": "advanced"}, r"profiler='advanced': When passing string value .* one of \['simple', 'pytorch'\]"),
        ({"float32_matmul_precision": "tf32"}, r"float32_matmul_precision='tf32': .* is invalid; choose 'highest'"),
        ({"compile": "max-autotune"}, r"compile='max-autotune': expected True, False or a dict"),
        ({"compile": {"modes": "max-autotune"}}, r"\['modes'\] are not torch.compile options; it takes \['fullgraph'"),
    ],
)
def test_bad_flags_name_the_flag(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ember.Trainer(**flags)


@pytest.mark.parametrize("devices", [0, "0", (os.cpu_count() or 1) + 1])
def test_a_device_count_the_machine_cannot_give_is_a_misconfiguration(devices: int | str) -> None:
    with pytest.raises(MisconfigurationException, match=f"devices={devices}"):  # as Lightning's
        ember.Trainer(accelerator="cpu", devices=devices)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="accelerator='cuda': no CUDA device"):
        ember.Trainer(accelerator="cuda")
    with pytest.raises(ValueError, match="no CUDA device"):
        ember.Trainer(gpus=1)


@pytest.mark.parametrize(
    ("accelerator", "missing"),
    [("gpu", "no GPU (CUDA or Apple MPS)"), ("cuda", "no CUDA device"), ("mps", "no Apple MPS device")],
)
def test_an_accelerator_the_machine_lacks_says_what_to_pass_instead(
    accelerator: str, missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    expected = rf"accelerator='{accelerator}': {re.escape(missing)} is available on this machine; pass "
    expected += "accelerator='cpu'"
    for devices in ("auto", 1):
        with pytest.raises(MisconfigurationException, match=expected) as error:  # Lightning's type for it
            ember.Trainer(accelerator=accelerator, devices=devices)
        assert "'auto'" in str(error.value) and "devices=0" not in str(error.value)
        lightnings = "No supported gpu backend found!" if accelerator == "gpu" else "can not run on your system"
        assert lightnings in str(error.value)  # Lightning's words too


def test_gpu_means_apple_mps_on_a_mac_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.strategies import _device_type

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert _device_type("gpu") == "mps"


def test_older_gpus_flag_zero_means_cpu() -> None:
    assert ember.Trainer(gpus=0).strategy.root_device.type == "cpu"


class _Returns(Regressor):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.value(self, batch) if callable(self.value) else self.value


@pytest.mark.parametrize(
    ("returned", "error", "message"),
    [
        ("a string", MisconfigurationException, r"must return a Tensor, a dict, or None .*: it returned str"),
        (
            {"loss": 0.5},
            MisconfigurationException,
            r"must return a Tensor, a dict, or None .*: it returned a dict whose 'loss' is a float",
        ),
        (
            {"logits": torch.ones(1)},
            MisconfigurationException,
            r"returns a dict, the 'loss' key needs to be present \(its keys: \['logits'\]\)",
        ),
        (lambda self, batch: self(batch[0]).sum(dim=1), ValueError, r"returned a loss of shape \(8,\); reduce it"),
        (torch.tensor(1.0), ValueError, "does not require grad"),
    ],
)
def test_unusable_training_step_results(returned: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        quiet_trainer(max_steps=1, logger=False).fit(_Returns(returned), make_loader())


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the backward of a custom function failed")


def test_a_backward_that_fails_for_its_own_reason_is_not_blamed_on_the_loss() -> None:
    # A sound loss whose backward fails: the step's own error comes through, not an explanation of the loss.
    returned = _Returns(lambda self, batch: _FailingBackward.apply(self(batch[0]).mean()))
    with pytest.raises(RuntimeError, match="the backward of a custom function failed"):
        quiet_trainer(max_steps=1, logger=False).fit(returned, make_loader())


class _StepOnly:
    """A scheduler that cannot be saved: it has no ``state_dict``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        pass


class _OwnScheduler(_StepOnly):
    """A scheduler that can be saved but whose ``step`` is not PyTorch's: the module must step it itself."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _Optimizers(Regressor):
    def __init__(self, make: Any) -> None:
        super().__init__()
        self.make = make

    def configure_optimizers(self) -> Any:
        return self.make(self)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda self: "adam", MisconfigurationException, r"Unknown configuration for model optimizers: "
                              r"configure_optimizers\(\) returned str 'adam'; it must return an optimizer"),
        (lambda self: {"lr_scheduler": None}, TypeError, r'no "optimizer" key'),
        (lambda self: [torch.optim.SGD(self.parameters(), lr=0.1)] * 2, RuntimeError,
         "Training with multiple optimizers is only supported with manual optimization: configure_optimizers"
         r"\(\) returned 2"),
        (
            lambda self: {"optimizer": (o := torch.optim.SGD(self.parameters(), lr=0.1)),
                          "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(o, 1), "interval": "batch"}},
            MisconfigurationException, '"interval" key in lr scheduler dict must be "step" or "epoch" but is "batch"',
        ),
        (
            lambda self: {"optimizer": (o := torch.optim.SGD(self.parameters(), lr=0.1)),
                          "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(o)},
            MisconfigurationException, "must include a monitor when a `ReduceLROnPlateau` scheduler is used",
        ),
        (
            lambda self: {"optimizer": torch.optim.SGD(self.parameters(), lr=0.1),
                          "lr_scheduler": {"interval": "step"}},
            MisconfigurationException, 'The lr scheduler dict must have the key "scheduler"',
        ),
        (
            lambda self: {"optimizer": (o := torch.optim.SGD(self.parameters(), lr=0.1)),
                          "lr_scheduler": _StepOnly(o)},
            TypeError, "The provided lr scheduler `_StepOnly` is invalid. It should have `state_dict`",
        ),
        (
            lambda self: {"optimizer": (o := torch.optim.SGD(self.parameters(), lr=0.1)),
                          "lr_scheduler": _OwnScheduler(o)},
            MisconfigurationException, "`_OwnScheduler` doesn't follow PyTorch's LRScheduler API. You should override",
        ),
        (
            lambda self: ([torch.optim.SGD(self.parameters(), lr=0.1)],
                          [torch.optim.lr_scheduler.StepLR(torch.optim.SGD(self.parameters(), lr=0.1), 1)]),
            MisconfigurationException, "attached with an optimizer that wasn't returned from `configure_optimizers`",
        ),
        (
            lambda self: [LightningOptimizer(torch.optim.SGD(self.parameters(), lr=0.1))],
            TypeError, "configure_optimizers returned a LightningOptimizer: return the torch.optim.Optimizer it wraps",
        ),
    ],
)  # fmt: skip
def test_unusable_configure_optimizers(make: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        quiet_trainer(max_steps=1, logger=False).fit(_Optimizers(make), make_loader())


def test_missing_training_step_and_missing_data() -> None:
    class NoStep(ember.Module):
        def configure_optimizers(self) -> Any:
            return None

    with pytest.raises(MisconfigurationException, match="needs NoStep to define training_step"):
        quiet_trainer().fit(NoStep(), make_loader())
    for stage, step in (("validate", "validation_step"), ("test", "test_step")):  # Lightning's words first
        with pytest.raises(
            MisconfigurationException, match=rf"^No `{step}\(\)` method defined to run `Trainer.{stage}`"
        ):
            getattr(quiet_trainer(), stage)(NoStep(), make_loader())
    # Predicting needs a predict_step, or the default one's forward.
    with pytest.raises(MisconfigurationException, match=r"^`Trainer.predict` requires `forward` method to run: NoStep"):
        quiet_trainer().predict(NoStep(), make_loader())
    switched_off = Regressor()
    switched_off.predict_step = None  # type: ignore[assignment]
    with pytest.raises(MisconfigurationException, match="^`predict_step` cannot be None to run `Trainer.predict`"):
        quiet_trainer().predict(switched_off, make_loader())
    with pytest.raises(MisconfigurationException, match="`train_dataloader` must be implemented.*no train data"):
        quiet_trainer().fit(Regressor())
    with pytest.raises(TypeError, match=r"^`model` must be a `LightningModule`, got `Linear`: Trainer.fit"):
        quiet_trainer().fit(torch.nn.Linear(2, 2), make_loader())  # type: ignore[arg-type]


def test_checkpoint_path_that_does_not_exist_loses_nothing(tmp_path: Any) -> None:
    model = Regressor()
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(
        FileNotFoundError, match=r"Checkpoint file not found: missing.ckpt \(ckpt_path takes a path, 'last' or 'best'\)"
    ):
        quiet_trainer(max_steps=1, logger=False).fit(model, make_loader(), ckpt_path="missing.ckpt")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not os.listdir(tmp_path)  # nothing was written


def test_fraction_of_a_loader_without_length() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return iter(make_loader(16).dataset)

    # MisconfigurationException, as Lightning raises for both
    fraction = r"^When using an `IterableDataset`, `Trainer\(limit_train_batches\)` must be `1.0` or an int: "
    with pytest.raises(MisconfigurationException, match=fraction + "limit_train_batches=0.5 is a fraction, but the"):
        quiet_trainer(max_epochs=1, limit_train_batches=0.5).fit(Regressor(), DataLoader(Stream(), batch_size=4))
    interval = r"^When using an IterableDataset for `train_dataloader`, `Trainer\(val_check_interval\)` must be time"
    with pytest.raises(MisconfigurationException, match=interval + ".*val_check_interval=0.5 is a fraction of an"):
        quiet_trainer(max_epochs=1, val_check_interval=0.5).fit(Regressor(), DataLoader(Stream(), batch_size=4))


@pytest.mark.parametrize(("stage", "flag"), [("fit", "limit_train_batches"), ("test", "limit_test_batches")])
def test_a_fraction_of_a_loader_that_takes_no_batch(stage: str, flag: str) -> None:
    kind = flag.split("_")[1]
    with pytest.raises(MisconfigurationException, match=rf"0.1 of the `{kind}_dataloader` but 0.1 \* 8 < 1: {flag}=0.1 "
                       rf"takes no batch. Please increase it, to at least {flag}=0.125"):  # fmt: skip
        getattr(quiet_trainer(max_epochs=1, logger=False, **{flag: 0.1}), stage)(Regressor(), make_loader(64))
    trainer = quiet_trainer(max_epochs=1, logger=False, **{flag: 0.125})
    getattr(trainer, stage)(Regressor(), make_loader(64))
    assert getattr(trainer, "num_training_batches" if stage == "fit" else "num_test_batches") in (1, [1])


def test_val_check_interval_longer_than_an_epoch() -> None:
    message = r"val_check_interval=20 must be less than or equal to the number of the training batches of an epoch \(8"
    with pytest.raises(ValueError, match=message):
        quiet_trainer(max_epochs=1, val_check_interval=20).fit(Regressor(), make_loader(), make_loader())


def test_a_torch_compiled_module_is_refused_with_the_flag_to_use() -> None:
    with pytest.raises(TypeError, match=r"torch.compile\(\)d module; pass the Module itself and Trainer\(compile"):
        quiet_trainer(max_epochs=1).fit(torch.compile(Regressor()), make_loader())


def test_compile_is_refused_with_data_parallel_over_several_gpus() -> None:
    from ember.strategies import DataParallelStrategy

    with pytest.raises(ValueError, match="compile= does not work with strategy='dp'; use strategy='ddp'"):
        DataParallelStrategy().configure(
            device_type="cuda",
            parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)],
            num_nodes=1,
            precision="32-true",
            sync_batchnorm=False,
            environment=None,
            compile_options={},
        )


def test_a_lightning_1_training_step_taking_optimizer_idx_is_refused_before_training() -> None:
    class OldStyle(Regressor):
        def training_step(self, batch: Any, batch_idx: int, optimizer_idx: int = 0) -> torch.Tensor:
            return super().training_step(batch, batch_idx)

    model = OldStyle()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    message = r"OldStyle.training_step\(..., optimizer_idx\) is .* Remove the `optimizer_idx` argument from"
    with pytest.raises(RuntimeError, match=message):
        quiet_trainer(max_epochs=1, logger=False).fit(model, make_loader(16))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
