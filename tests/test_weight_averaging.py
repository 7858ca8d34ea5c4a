"""StochasticWeightAveraging: its settings, the average and the schedule it makes, the BatchNorm pass, its
refusals, and a resumed fit that continues the average; WeightAveraging and EMAWeightAveraging."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import Regressor, make_loader, parameters_of, quiet_trainer
from torch import nn
from torch.optim.swa_utils import SWALR

import ember
from ember.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint, StochasticWeightAveraging, WeightAveraging
from ember.exceptions import MisconfigurationException
from ember.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy


class _Normalized(ember.Module):
    """A regression with a BatchNorm layer that records its weights when each epoch starts."""

    def __init__(self, scheduler: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        self.scheduler = scheduler
        self.epoch_starts: list[dict[str, torch.Tensor]] = []
        self.lrs: list[float] = []
        self.backwards = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("epoch_logged", float(self.current_epoch), on_step=True, on_epoch=False)
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backwards += 1
        loss.backward()

    def on_train_epoch_start(self) -> None:
        self.epoch_starts.append({name: p.detach().clone() for name, p in self.named_parameters()})
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)
        if self.scheduler == "lambda":
            return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.9**epoch)]
        if self.scheduler == "step_interval":
            step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": step, "interval": "step"}}
        return optimizer


def _fit(module: ember.Module, swa: StochasticWeightAveraging, **flags: Any) -> ember.Trainer:
    flags = {"max_epochs": 5, **flags}
    trainer = quiet_trainer(logger=False, enable_checkpointing=False, callbacks=[swa], **flags)
    trainer.fit(module, make_loader(40))
    return trainer


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"swa_epoch_start": 0}, r">0 integer or a float between 0 and 1. Got 0"),
        ({"swa_epoch_start": 1.5}, r">0 integer or a float between 0 and 1. Got 1.5"),
        ({"swa_epoch_start": "last"}, r">0 integer or a float between 0 and 1. Got 'last'"),
        ({"swa_lrs": [0.2, 1]}, r"positive float, or a list of positive floats .*Got \[0.2, 1\]"),
        ({"swa_lrs": -0.1}, r"positive float, or a list of positive floats .*Got -0.1"),
        ({"annealing_epochs": -1}, r"annealing_epochs should be an integer >= 0. Got -1"),
        ({"annealing_strategy": "exp"}, r"annealing_strategy should be 'cos' or 'linear'. Got 'exp'"),
        ({"avg_fn": 3}, r"The `avg_fn` should be callable. Got 3"),
        ({"device": 3}, r"device is expected to be a torch.device or a str. Found 3"),
    ],
)
def test_settings_are_checked_when_made(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationException, match=message):
        StochasticWeightAveraging(**{"swa_lrs": 0.1, **settings})


def test_average_of_the_epochs_from_swa_epoch_start_with_batch_norm_recomputed() -> None:
    module, swa = _Normalized(), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=3)
    trainer = _fit(module, swa)
    # Epochs 2, 3 and 4 (from 0) start with the weights averaged: those of epochs 1 to 3 trained.
    assert (swa.swa_start, swa.swa_end, int(swa.n_averaged)) == (2, 4, 3)
    for name, parameter in module.named_parameters():
        expected = sum(start[name] for start in module.epoch_starts[2:]) / 3
        torch.testing.assert_close(parameter.detach(), expected)
    # The statistics are those of one pass of the averaged model over the training data, as a plain mean.
    reference = copy.deepcopy(module.net).train()
    reference[1].reset_running_stats()
    reference[1].momentum = None
    with torch.no_grad():
        for x, _ in make_loader(40):
            reference(x)
    torch.testing.assert_close(module.net[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(module.net[1].running_var, reference[1].running_var)
    assert module.net[1].momentum == 0.1  # given back
    assert int(module.net[1].num_batches_tracked) == 5
    # The pass is no training: no backward, no step, no epoch, nothing logged.
    assert module.backwards == 5 * 5
    assert (trainer.current_epoch, trainer.global_step) == (5, 25)
    assert trainer.callback_metrics["epoch_logged"] == 4.0


def test_the_schedule_anneals_to_swa_lrs_and_replaces_the_module_scheduler(caplog: pytest.LogCaptureFixture) -> None:
    module = _Normalized(scheduler="step_interval")
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=2, annealing_strategy="linear")
    with caplog.at_level(logging.INFO), pytest.warns(UserWarning, match="SWA is currently only supported every epoch"):
        trainer = _fit(module, swa)
    assert "Swapping scheduler `StepLR` for `SWALR`" in caplog.text
    assert isinstance(trainer.lr_scheduler_configs[0].scheduler, SWALR)
    assert trainer.lr_scheduler_configs[0].interval == "epoch"
    # StepLR (gamma 0.1 per step) for the 5 steps of epoch 0, then linear annealing to 0.01 over two epochs.
    first = 0.02 * 0.1**5
    assert module.lrs == pytest.approx([0.02, first, (first + 0.01) / 2, 0.01, 0.01])


def test_the_batch_norm_pass_reads_several_training_loaders_combined() -> None:
    class TwoLoaders(_Normalized):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step([torch.cat(tensors) for tensors in zip(batch["a"], batch["b"])], batch_idx)

    module = TwoLoaders()
    trainer = quiet_trainer(max_epochs=3, logger=False, enable_checkpointing=False,
                            callbacks=[StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)])  # fmt: skip
    trainer.fit(module, {"a": make_loader(40), "b": make_loader(24)})
    assert int(module.net[1].num_batches_tracked) == 5  # the longer loader's, the other one cycled


def test_fit_stopped_early_keeps_the_trained_weights() -> None:
    class Stops(_Normalized):
        def on_train_epoch_end(self) -> None:
            if self.current_epoch == 3:
                self.trainer.should_stop = True

    module, swa = Stops(), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
    _fit(module, swa)
    assert int(swa.n_averaged) == 3
    averaged = dict(swa.average_model.named_parameters())
    assert not all(torch.equal(p.detach(), averaged[name]) for name, p in module.named_parameters())


def test_several_parameter_groups_get_their_own_swa_lr() -> None:
    class TwoGroups(_Normalized):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            first, rest = list(self.net[0].parameters()), [*self.net[1].parameters(), *self.net[3].parameters()]
            return torch.optim.SGD([{"params": first, "lr": 0.01}, {"params": rest, "lr": 0.02}])

    module = TwoGroups()
    trainer = _fit(module, StochasticWeightAveraging(swa_lrs=[0.003, 0.007], swa_epoch_start=1, annealing_epochs=0))
    groups = trainer.optimizers[0].param_groups
    assert [group["swa_lr"] for group in groups] == [group["initial_lr"] for group in groups] == [0.003, 0.007]
    assert [group["lr"] for group in groups] == [0.003, 0.007]


class _Manual(_Normalized):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class _TwoSchedulers(_Normalized):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        schedulers = [
            torch.optim.lr_scheduler.StepLR(optimizer, 1),
            torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9),
        ]
        return [optimizer], schedulers


class _Sharding(SingleDeviceStrategy):
    holds_whole_model = False


@pytest.mark.parametrize(
    ("module", "settings", "flags", "message"),
    [
        (_Manual, {}, {}, "SWA works with automatic optimization only"),
        (_TwoSchedulers, {}, {}, "SWA currently not supported for more than 1 `lr_scheduler`: .* returned 2"),
        (_Normalized, {}, {"max_epochs": -1, "max_steps": 10}, "`swa_epoch_start` as a float is not supported when"),
        (_Normalized, {"swa_epoch_start": 2}, {"strategy": _Sharding()}, "SWA does not currently support sharded"),
    ],
)
def test_what_it_cannot_average_is_refused_when_fit_starts(
    module: type[ember.Module], settings: dict[str, Any], flags: dict[str, Any], message: str
) -> None:
    trainer = quiet_trainer(logger=False, callbacks=[StochasticWeightAveraging(swa_lrs=0.1, **settings)],
                            **{"max_epochs": 2, **flags})  # fmt: skip
    with pytest.raises(MisconfigurationException, match=message):
        trainer.fit(module(), make_loader(40))


def test_the_strategies_that_shard_the_model_say_so() -> None:
    assert SingleDeviceStrategy.holds_whole_model and DDPStrategy.holds_whole_model
    assert not FSDPStrategy.holds_whole_model and not ModelParallelStrategy.holds_whole_model


def test_no_epoch_limit_averages_until_the_fit_ends_without_a_batch_norm_pass() -> None:
    module, swa = _Normalized(), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
    _fit(module, swa, max_epochs=-1, max_steps=17)
    assert int(swa.n_averaged) == 3  # epochs 1, 2 and 3 started
    for name, parameter in module.named_parameters():
        torch.testing.assert_close(parameter.detach(), sum(start[name] for start in module.epoch_starts[1:]) / 3)
    assert int(module.net[1].num_batches_tracked) == 17  # the statistics of training, not reset


@pytest.mark.parametrize("saved_at_step", [7, 13])  # before averaging starts, and inside an averaged epoch
def test_a_resumed_fit_continues_the_average_and_the_schedule_exactly(saved_at_step: int) -> None:
    def run(dirpath: str, ckpt_path: str | None = None, stop_at: int = -1) -> tuple[ember.Module, Any]:
        # The module's LambdaLR is replaced by SWALR: a checkpoint's schedule is SWALR's, which LambdaLR cannot load.
        module, swa = _Normalized(scheduler="lambda"), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=3)
        every = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=saved_at_step, save_top_k=-1)
        trainer = quiet_trainer(max_epochs=5, logger=False, callbacks=[swa, every], max_steps=stop_at)
        trainer.fit(module, make_loader(40), ckpt_path=ckpt_path)
        return module, swa

    whole, whole_swa = run("whole")
    run("stopped", stop_at=saved_at_step)
    epoch = saved_at_step // 5
    resumed, resumed_swa = run("stopped", ckpt_path=f"stopped/epoch={epoch}-step={saved_at_step}.ckpt")
    assert int(resumed_swa.n_averaged) == int(whole_swa.n_averaged) == 3
    for (name, expected), actual in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(expected, actual), name


def test_state_has_lightnings_keys() -> None:
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2)
    assert swa.state_dict() == {"n_averaged": 0, "latest_update_epoch": -1, "scheduler_state": None,
                                "average_model_state": None}  # fmt: skip
    _fit(_Normalized(), swa)
    state = swa.state_dict()
    assert (state["n_averaged"], state["latest_update_epoch"]) == (4, 4)
    assert state["scheduler_state"]["_step_count"] == 5  # once when made, then after each of epochs 1 to 4
    assert set(state["average_model_state"]) == set(_Normalized().state_dict())
    assert not math.isnan(float(state["average_model_state"]["net.0.weight"].sum()))


@pytest.mark.cuda
def test_the_average_and_the_batchnorm_pass_run_on_the_gpu() -> None:
    module, swa = _Normalized(), StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=3)
    _fit(module, swa, accelerator="cuda", devices=1)
    assert int(swa.n_averaged) == 3
    for name, parameter in module.named_parameters():
        assert parameter.device.type == "cuda"
        torch.testing.assert_close(parameter.detach(), sum(start[name] for start in module.epoch_starts[2:]) / 3)
    norm = module.net[1]
    assert norm.running_mean.device.type == "cuda" and int(norm.num_batches_tracked) > 0
    assert bool(norm.running_var.isfinite().all())


class _Recorder(Callback):
    """The module's weights after each training batch, and at each validation (before the averaging callback
    that follows it in the list swaps them: so on_validation_epoch_end, after)."""

    def __init__(self) -> None:
        self.after_steps: list[torch.Tensor] = []
        self.validated: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.after_steps.append(parameters_of(pl_module)[0])

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.validated.append(parameters_of(pl_module)[0])


def _ema(weights: list[torch.Tensor], decay: float) -> torch.Tensor:
    average = weights[0]
    for current in weights[1:]:
        average = decay * average + (1 - decay) * current
    return average


def test_ema_validates_on_the_average_leaves_it_in_the_module_and_checkpoints_both(tmp_path: Any) -> None:
    recorder, ema = _Recorder(), EMAWeightAveraging(decay=0.5, update_every_n_steps=2)
    trainer = quiet_trainer(max_epochs=2, logger=False, enable_checkpointing=False, callbacks=[recorder, ema])
    module = Regressor()
    trainer.fit(module, make_loader(32), make_loader(16))
    steps = recorder.after_steps  # 4 steps an epoch; steps 0, 2, 4 and 6 (counted from 0) are averaged
    assert ema.average_model is not None and int(ema.average_model.n_averaged) == 4
    torch.testing.assert_close(recorder.validated[0], _ema(steps[0:4:2], 0.5))  # epoch 0 validated the average
    torch.testing.assert_close(parameters_of(module)[0], _ema(steps[0::2], 0.5))
    first_average = ema.average_model
    trainer.save_checkpoint(tmp_path / "ema.ckpt")
    checkpoint = torch.load(tmp_path / "ema.ckpt", weights_only=False)
    torch.testing.assert_close(checkpoint["state_dict"]["layer.weight"], _ema(steps[0::2], 0.5))
    # After the fit the module holds the average too (a checkpoint made during the fit keeps the trained weights).
    torch.testing.assert_close(checkpoint["current_model_state"]["layer.weight"], _ema(steps[0::2], 0.5))
    assert int(checkpoint["averaging_state"]["n_averaged"]) == 4
    # Another fit averages its own module from its first step.
    quiet_trainer(max_steps=3, logger=False, enable_checkpointing=False, callbacks=[ema]).fit(
        Regressor(), make_loader(32)
    )
    assert ema.average_model is not first_average and int(ema.average_model.n_averaged) == 2


def test_when_the_ema_takes_the_weights_and_what_it_refuses() -> None:
    ema = EMAWeightAveraging(update_every_n_steps=3, update_starting_at_step=4, update_starting_at_epoch=1)
    assert [step for step in range(12) if ema.should_update(step_idx=step)] == [6, 9]
    assert [ema.should_update(epoch_idx=epoch) for epoch in range(3)] == [False, True, True]
    assert not WeightAveraging().should_update(epoch_idx=0) and WeightAveraging().should_update(step_idx=0)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['decay'\]"):
        WeightAveraging(decay=0.9)
    trainer = quiet_trainer(logger=False, strategy=_Sharding(), callbacks=[EMAWeightAveraging()], max_epochs=1)
    with pytest.raises(MisconfigurationException, match="EMAWeightAveraging does not support sharded models"):
        trainer.fit(Regressor(), make_loader(16))


def test_a_resumed_fit_continues_the_weight_average_exactly() -> None:
    def run(max_steps: int, ckpt_path: str | None = None) -> tuple[ember.Module, WeightAveraging]:
        module, averaging = Regressor(), WeightAveraging()
        every = ModelCheckpoint(dirpath="averaged", every_n_train_steps=3, save_top_k=-1)
        quiet_trainer(max_steps=max_steps, logger=False, callbacks=[averaging, every]).fit(
            module, make_loader(32), ckpt_path=ckpt_path
        )
        return module, averaging

    whole, whole_averaging = run(8)
    resumed, resumed_averaging = run(8, ckpt_path="averaged/epoch=0-step=3.ckpt")
    assert resumed_averaging.average_model is not None and whole_averaging.average_model is not None
    assert int(resumed_averaging.average_model.n_averaged) == 8
    for expected, actual in zip(parameters_of(whole), parameters_of(resumed)):
        assert torch.equal(expected, actual)
