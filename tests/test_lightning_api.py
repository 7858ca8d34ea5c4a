"""Lightning's meanings of the Trainer's and the Module's API: what Lightning programs rely on."""

from __future__ import annotations

import collections
import csv
import functools
import io
import logging
import os
import pickle
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import Regressor, make_data, make_loader, quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import ember
from ember.callbacks import BasePredictionWriter, Callback, LearningRateMonitor, ModelCheckpoint
from ember.exceptions import MisconfigurationException
from ember.loggers import CSVLogger
from ember.loops import evaluate as evaluation_loop
from ember.optim import LightningOptimizer


# ------------------------------------------------------------------------- metrics per stage
def test_each_stage_starts_with_no_metrics() -> None:
    trainer = quiet_trainer(max_epochs=1, log_every_n_steps=1)
    model = Regressor()
    trainer.fit(model, make_loader(), make_loader(16))
    assert {"train_loss", "val_loss"} <= set(trainer.callback_metrics)
    results = trainer.test(model, make_loader(16), verbose=False)
    assert set(trainer.callback_metrics) == {"test_loss"}
    assert set(trainer.logged_metrics) == {"test_loss"}
    assert [set(result) for result in results] == [{"test_loss"}]
    trainer.predict(model, DataLoader(make_data(16).tensors[0], batch_size=8))
    assert trainer.callback_metrics == {} and trainer.progress_bar_metrics == {}


def test_learning_rates_reach_the_callback_metrics() -> None:
    class AdamW(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}

    trainer = quiet_trainer(max_epochs=2, callbacks=[LearningRateMonitor()])
    trainer.fit(AdamW(), make_loader())
    assert float(trainer.callback_metrics["lr-AdamW"]) == pytest.approx(0.005)


# ------------------------------------------------------------------- evaluating the fitted module
class _Tracked(Regressor):
    """Logs val_loss so that a ModelCheckpoint can rank epochs; counts how often weights were loaded."""

    def __init__(self, lr: float = 0.05, features: int = 4) -> None:
        super().__init__(lr, features)
        self.loaded_from: list[int] = []

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_from.append(checkpoint["global_step"])

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch[0])


def _fitted(**flags: Any) -> tuple[ember.Trainer, _Tracked]:
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True, save_top_k=1)
    trainer = quiet_trainer(max_epochs=3, callbacks=[checkpoint], **flags)
    model = _Tracked()
    trainer.fit(model, make_loader(), make_loader(16))
    return trainer, model


def test_evaluating_after_fit_uses_the_fitted_module_and_its_best_checkpoint() -> None:
    trainer, model = _fitted()
    best = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)  # type: ignore[union-attr]
    with pytest.warns(UserWarning, match=r"^`\.test\(ckpt_path=None\)` was called without a model\. The best model"):
        results = trainer.test(dataloaders=make_loader(16), verbose=False)
    assert model.loaded_from == [best["global_step"]] and set(results[0]) == {"test_loss"}
    trainer.test(ckpt_path="best", dataloaders=make_loader(16), verbose=False, weights_only=None)
    assert trainer.ckpt_path == trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    trainer.validate(ckpt_path="last", dataloaders=make_loader(16), verbose=False)
    assert model.loaded_from == [best["global_step"]] * 2 + [trainer.global_step]
    assert trainer.ckpt_path == trainer.checkpoint_callback.last_model_path  # type: ignore[union-attr]
    assert torch.load(trainer.ckpt_path, weights_only=True)["global_step"] == trainer.global_step
    trainer.test(model, make_loader(16), verbose=False)
    assert trainer.ckpt_path is None  # nothing loaded: the module as it is
    predictions = trainer.predict(dataloaders=make_loader(16), ckpt_path="best")
    assert predictions is not None and len(predictions) == 2 and predictions[0].shape == (8, 1)


def test_a_lightning_checkpoint_gives_its_weights_but_no_training_to_continue() -> None:
    from ember.checkpoint.io import CheckpointError

    model = Regressor(lr=0.2)
    written_by_lightning = {
        "epoch": 1, "global_step": 4, "pytorch-lightning_version": "2.6.6", "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"state_dict": {}}}, "callbacks": {}, "optimizer_states": [{}], "lr_schedulers": [],
        "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.2, "features": 4},
    }  # fmt: skip
    torch.save(written_by_lightning, "lightning.ckpt")
    loaded = Regressor.load_from_checkpoint("lightning.ckpt")
    assert loaded.hparams.lr == 0.2 and torch.equal(loaded.layer.weight, model.layer.weight)
    assert quiet_trainer(logger=False).test(Regressor(), make_loader(16), ckpt_path="lightning.ckpt", verbose=False)
    with pytest.raises(CheckpointError, match=r"written by Lightning 2.6.6.*Module.load_from_checkpoint"):
        quiet_trainer(max_epochs=3, logger=False).fit(Regressor(), make_loader(), ckpt_path="lightning.ckpt")


def test_the_datamodule_alone_is_enough_after_fit() -> None:
    class Data(ember.DataModule):
        def train_dataloader(self) -> DataLoader:
            return make_loader()

        def val_dataloader(self) -> DataLoader:
            return make_loader(16)

        def test_dataloader(self) -> DataLoader:
            return make_loader(24)

    trainer = quiet_trainer(max_epochs=1, callbacks=[ModelCheckpoint(monitor="val_loss")])
    model = _Tracked()
    trainer.fit(model, datamodule=Data())
    with pytest.warns(UserWarning, match="The best model of the previous `fit` call will be used"):
        trainer.test(datamodule=Data(), verbose=False)
    assert trainer.num_test_batches == [3] and len(model.loaded_from) == 1


def test_evaluating_without_a_module_before_fit_is_a_clear_error() -> None:
    trainer = quiet_trainer()
    with pytest.raises(TypeError, match=r"`Trainer.test\(\)` requires a `LightningModule` when it hasn't been passed"):
        trainer.test(dataloaders=make_loader())
    fitted = quiet_trainer(max_epochs=1, enable_checkpointing=False)
    fitted.fit(Regressor(), make_loader())
    # as Lightning: "best" without a ModelCheckpoint is refused, even where an earlier run left checkpoints
    quiet_trainer(max_epochs=1, default_root_dir=fitted.default_root_dir).fit(Regressor(), make_loader())
    with pytest.raises(ValueError, match=r'test\(ckpt_path="best"\)` is set but `ModelCheckpoint` is not configured.$'):
        fitted.test(dataloaders=make_loader(), ckpt_path="best")
    # without a module, the best weights are meant, and there are none
    with pytest.warns(UserWarning, match="best model of the previous `fit`"), pytest.raises(ValueError, match="not co"):
        fitted.test(dataloaders=make_loader())
    fitted.test(fitted.lightning_module, dataloaders=make_loader(), verbose=False)  # the current weights


def test_best_is_refused_where_no_model_checkpoint_chose_one_and_taken_from_the_first() -> None:
    fast = quiet_trainer(fast_dev_run=True)
    fast.fit(Regressor(), make_loader())
    with pytest.raises(ValueError, match=r'execute `.validate\(ckpt_path="best"\)` with `fast_dev_run=True`'):
        fast.validate(dataloaders=make_loader(), ckpt_path="best")
    first, second = ModelCheckpoint(monitor="val_loss", dirpath="first"), ModelCheckpoint(dirpath="second")
    trainer = quiet_trainer(max_epochs=1, callbacks=[first, second])
    trainer.fit(Regressor(), make_loader(), make_loader())
    with pytest.warns(UserWarning, match="multiple `ModelCheckpoint` callbacks. It will use the best checkpoint path"):
        trainer.test(dataloaders=make_loader(), ckpt_path="best", verbose=False)
    assert trainer.ckpt_path == first.best_model_path


def test_what_the_trainer_is_doing() -> None:
    seen: list[tuple[str, tuple[bool, ...]]] = []

    class Watching(Regressor):
        def _note(self, where: str) -> None:
            t = self.trainer
            seen.append((where, (t.training, t.validating, t.testing, t.predicting, t.sanity_checking, t.evaluating)))

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._note("train")

        def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self._note("validate")

        def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self._note("test")

        def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self._note("predict")

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            return self(batch[0])

    trainer = quiet_trainer(max_steps=1, limit_val_batches=1, num_sanity_val_steps=1, logger=False)
    model = Watching()
    trainer.fit(model, make_loader(8), make_loader(8))
    trainer.test(model, make_loader(8), verbose=False)
    trainer.predict(model, make_loader(8))
    assert seen == [
        ("validate", (False, False, False, False, True, True)),  # the sanity check
        ("train", (True, False, False, False, False, False)),
        ("validate", (False, True, False, False, False, True)),
        ("test", (False, False, True, False, False, True)),
        ("predict", (False, False, False, True, False, False)),
    ]
    assert not (trainer.training or trainer.validating or trainer.testing or trainer.predicting)


def test_the_loaders_of_each_kind() -> None:
    seen: list[int] = []

    class Drawing(Callback):
        def on_validation_epoch_end(self, trainer: Any, module: Any) -> None:
            seen.append(len(next(iter(trainer.val_dataloaders))[0]))  # a batch to draw, as callbacks do

    trainer = quiet_trainer(max_epochs=1, logger=False, callbacks=[Drawing()])
    model = Regressor()
    assert trainer.val_dataloaders is None
    trainer.fit(model, make_loader(16), make_loader(16, batch_size=4))
    assert seen == [4] and trainer.train_dataloader is not None
    trainer.test(model, [make_loader(8), make_loader(8)], verbose=False)
    assert isinstance(trainer.test_dataloaders, list) and len(trainer.test_dataloaders) == 2
    assert trainer.train_dataloader is None and trainer.val_dataloaders is None  # only the latest stage's
    trainer.predict(model, DataLoader(make_data(8).tensors[0], batch_size=2))
    assert next(iter(trainer.predict_dataloaders)).shape == (2, 4)  # type: ignore[arg-type]
    assert trainer.test_dataloaders is None


# ---------------------------------------------------------------------------- the module's API
def test_steps_without_batch_idx() -> None:
    seen: list[str] = []

    class Short(Regressor):
        def training_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
            seen.append("train")
            return F.mse_loss(self(batch[0]), batch[1])

        def validation_step(self, batch: Any) -> None:  # type: ignore[override]
            seen.append("val")

        def test_step(self, batch: Any) -> None:  # type: ignore[override]
            seen.append("test")

        def predict_step(self, batch: Any) -> torch.Tensor:  # type: ignore[override]
            seen.append("predict")
            return self(batch[0])

    model = Short()
    trainer = quiet_trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=1)
    trainer.fit(model, make_loader(), make_loader())
    trainer.test(model, make_loader(8), verbose=False)
    trainer.predict(model, make_loader(8))
    assert seen == ["train", "train", "val", "test", "predict"]


def test_all_gather_on_one_process_returns_the_data_as_tensors() -> None:
    gathered: list[Any] = []

    class Gather(Regressor):
        def on_validation_epoch_end(self) -> None:
            gathered.append(self.all_gather({"n": 3, "t": torch.ones(2)}))

    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(Gather(), make_loader(), make_loader(16))
    assert torch.equal(gathered[0]["n"], torch.tensor(3)) and torch.equal(gathered[0]["t"], torch.ones(2))


def test_all_gather_keeps_a_namedtuple_s_type() -> None:
    Pair = collections.namedtuple("Pair", "loss count")
    gathered: list[Any] = []

    class Gather(Regressor):
        def on_train_start(self) -> None:
            gathered.append(self.all_gather(Pair(torch.ones(2), 3)))

    quiet_trainer(max_steps=1, logger=False).fit(Gather(), make_loader())
    assert type(gathered[0]) is Pair and torch.equal(gathered[0].count, torch.tensor(3))


def test_dtype_follows_the_parameters() -> None:
    dtypes: list[torch.dtype] = []

    class Typed(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            dtypes.append(self.dtype)
            return super().training_step(batch, batch_idx)

    assert Regressor().dtype == torch.float32 and Regressor().double().dtype == torch.float64
    quiet_trainer(max_steps=1, precision="64-true", logger=False).fit(Typed(), make_loader())
    assert dtypes == [torch.float64]


def test_toggle_optimizer_freezes_the_other_optimizers_parameters() -> None:
    states: list[tuple[bool, bool]] = []

    class Two(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.other = nn.Linear(4, 1)
            self.other.bias.requires_grad_(False)  # frozen by the user: must stay frozen after untoggle
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            first, second = self.optimizers()
            self.toggle_optimizer(first)
            states.append((self.layer.weight.requires_grad, self.other.weight.requires_grad))
            self.untoggle_optimizer(first)
            with self.toggled_optimizer(second):
                states.append((self.layer.weight.requires_grad, self.other.weight.requires_grad))
            states.append((self.layer.weight.requires_grad, self.other.bias.requires_grad))

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]

    quiet_trainer(max_steps=1, limit_train_batches=1, max_epochs=1, logger=False).fit(Two(), make_loader())
    assert states == [(True, False), (False, True), (True, False)]


def test_untoggle_optimizer_leaves_the_toggled_optimizer_s_parameters_as_the_block_set_them() -> None:
    states: list[tuple[bool, bool]] = []

    class Two(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.other = nn.Linear(4, 1)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            first, _ = self.optimizers()
            with self.toggled_optimizer(first):
                self.layer.bias.requires_grad_(False)  # the user freezes part of the toggled optimizer's model
            states.append((self.layer.bias.requires_grad, self.other.weight.requires_grad))

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]

    quiet_trainer(max_steps=1, limit_train_batches=1, max_epochs=1, logger=False).fit(Two(), make_loader())
    assert states == [(False, True)]  # as in Lightning: only the other optimizers' parameters are given back


def test_grad_norm_names_each_gradient_s_norm_and_refuses_a_norm_type_not_positive() -> None:
    model = Regressor()
    model(torch.ones(2, 4)).sum().backward()
    norms = ember.utilities.grad_norm(model, norm_type="inf")
    assert sorted(norms) == ["grad_inf_norm/layer.bias", "grad_inf_norm/layer.weight", "grad_inf_norm_total"]
    assert float(norms["grad_inf_norm/layer.bias"]) == 2.0 and float(norms["grad_inf_norm_total"]) == 2.0
    with pytest.raises(ValueError, match=r"`norm_type` must be a positive number or 'inf' \(infinity norm\). Got -1.0"):
        ember.utilities.grad_norm(model, norm_type=-1)


def test_recursive_detach_detaches_every_tensor_and_copies_it_to_the_cpu_when_asked() -> None:
    weight = torch.ones(2, requires_grad=True)
    detached = ember.utilities.recursive_detach({"a": weight * 2, "b": [weight, 3]}, to_cpu=True)
    assert not detached["a"].requires_grad and not detached["b"][0].requires_grad and detached["b"][1] == 3
    assert detached["a"].device.type == "cpu" and weight.requires_grad
    torch.testing.assert_close(detached["a"], torch.full((2,), 2.0))


def test_logger_and_loggers_of_the_module() -> None:
    model = Regressor()
    assert model.logger is None and model.loggers == []
    logger = CSVLogger(".")
    quiet_trainer(max_steps=1, logger=logger).fit(model, make_loader())
    assert model.logger is logger and model.loggers == [logger]


def test_hyperparameters_kept_out_of_the_logger() -> None:
    class Quiet(Regressor):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__(lr)
            self.save_hyperparameters(logger=False)

    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(Quiet(), make_loader())
    assert _logged_hyperparameters(trainer) == {}
    checkpoint = torch.load(trainer.checkpoint_callback.best_model_path, weights_only=True)  # type: ignore[union-attr]
    assert checkpoint["hyper_parameters"] == {"lr": 0.05, "features": 4}  # the parent's and the subclass's


def test_hyperparameters_of_parent_and_child_are_both_kept() -> None:
    class Base(ember.Module):
        def __init__(self, width: int = 8, depth: int = 2) -> None:
            super().__init__()
            self.save_hyperparameters()

    class Child(Base):
        def __init__(self, lr: float = 0.1, width: int = 16) -> None:
            super().__init__(width=width)
            self.save_hyperparameters("lr")

    class Everything(Base):
        def __init__(self, dropout: float = 0.5, **kwargs: Any) -> None:
            super().__init__(**kwargs)

    assert Child().hparams == {"width": 16, "depth": 2, "lr": 0.1}
    # Called in the parent's __init__, it sees the arguments of every __init__ up the chain.
    assert Everything(dropout=0.2, depth=3).hparams == {"width": 8, "depth": 3, "dropout": 0.2}


def test_hparams_initial_keeps_what_was_saved() -> None:
    model = Regressor(lr=0.5)
    model.hparams.lr = 0.1
    assert model.hparams_initial == {"lr": 0.5, "features": 4} and model.hparams.lr == 0.1
    assert ember.Module().hparams_initial == {}


def test_freeze_and_unfreeze() -> None:
    model = Regressor()
    model.freeze()
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    model.unfreeze()
    assert model.training and all(p.requires_grad for p in model.parameters())


def test_datamodule_from_datasets() -> None:
    data = ember.DataModule.from_datasets(
        train_dataset=make_data(32), val_dataset=[make_data(16), make_data(8)], batch_size=8, num_workers=0
    )
    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(Regressor(), datamodule=data)
    assert trainer.num_training_batches == 4 and trainer.num_val_batches == [2, 1]
    for missing in ("test_dataloader", "predict_dataloader"):  # no dataset given: the default, which says so
        with pytest.raises(MisconfigurationException, match=f"`{missing}` must be implemented"):
            getattr(data, missing)()
    train = data.train_dataloader()
    assert isinstance(train, DataLoader) and train.batch_size == 8
    assert isinstance(train.sampler, torch.utils.data.RandomSampler)


def test_from_datasets_takes_a_dict_of_datasets_as_lightning_does() -> None:
    data = ember.DataModule.from_datasets(
        train_dataset={"a": make_data(16), "b": make_data(32)}, val_dataset={"x": make_data(8)}, batch_size=8
    )
    train = data.train_dataloader()
    assert isinstance(train, dict) and {key: len(loader) for key, loader in train.items()} == {"a": 2, "b": 4}

    class OnA(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch["a"], batch_idx)

    trainer = quiet_trainer(max_epochs=1)
    trainer.fit(OnA(), datamodule=data)
    assert trainer.num_training_batches == 4 and trainer.num_val_batches == [1]  # "max_size_cycle"


def test_from_datasets_gives_the_loading_settings_to_an_init_that_takes_them() -> None:
    class Named(ember.DataModule):
        def __init__(self, other: int, batch_size: int = 1) -> None:
            super().__init__()
            self.other, self.batch_size = other, batch_size

    class Open(ember.DataModule):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__()
            self.given = kwargs

    named = Named.from_datasets(make_data(8), batch_size=4, num_workers=2, other=5)
    assert (named.other, named.batch_size) == (5, 4) and named.train_dataloader().batch_size == 4
    assert Open.from_datasets(make_data(8), batch_size=4, num_workers=2).given == {"batch_size": 4, "num_workers": 2}
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'other'"):
        Named.from_datasets(make_data(8), batch_size=4)


def test_callback_hooks_lightning_adds() -> None:
    calls: list[str] = []

    class Recorder(Callback):
        def on_sanity_check_start(self, trainer: Any, module: Any) -> None:
            calls.append("sanity_start")

        def on_sanity_check_end(self, trainer: Any, module: Any) -> None:
            calls.append("sanity_end")

        def on_validation_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            calls.append(f"val_batch_start{batch_idx}")

        def on_test_start(self, trainer: Any, module: Any) -> None:
            calls.append("test_start")

        def on_test_end(self, trainer: Any, module: Any) -> None:
            calls.append("test_end")

    trainer = quiet_trainer(max_epochs=1, num_sanity_val_steps=1, limit_val_batches=2, callbacks=[Recorder()])
    model = Regressor()
    trainer.fit(model, make_loader(), make_loader())
    trainer.test(model, make_loader(8), verbose=False)
    assert calls == ["sanity_start", "val_batch_start0", "sanity_end", "val_batch_start0", "val_batch_start1",
                     "test_start", "test_end"]  # fmt: skip


# ------------------------------------------------------------------------------------- hooks
class _Recorded(Regressor):
    """Records every hook of an optimizer step, in the order they run."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.calls.append(f"training_step{batch_idx}")
        return super().training_step(batch, batch_idx)

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.calls.append("on_before_zero_grad")

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        self.calls.append("optimizer_zero_grad")
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.calls.append("on_before_backward")

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.calls.append("backward")
        super().backward(loss, *args, **kwargs)

    def on_after_backward(self) -> None:
        self.calls.append("on_after_backward")

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.calls.append(f"optimizer_step{batch_idx}")
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.calls.append("on_before_optimizer_step")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, algorithm: Any = None) -> None:
        self.calls.append(f"configure_gradient_clipping({gradient_clip_val}, {algorithm})")
        super().configure_gradient_clipping(optimizer, gradient_clip_val, algorithm)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        self.calls.append("lr_scheduler_step")
        super().lr_scheduler_step(scheduler, metric)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_every_hook_of_a_step_runs_in_lightnings_order() -> None:
    model = _Recorded()
    trainer = quiet_trainer(max_steps=1, accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False)
    trainer.fit(model, make_loader())
    backward = ["on_before_backward", "backward", "on_after_backward"]
    assert model.calls == [
        "training_step0", "on_before_zero_grad", "optimizer_zero_grad", *backward,
        "optimizer_step1", "training_step1", *backward, "on_before_optimizer_step",
        "configure_gradient_clipping(1.0, None)", "lr_scheduler_step",
    ]  # fmt: skip
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.025)


def test_the_same_steps_with_and_without_hooks() -> None:
    class Hooked(_Recorded):
        configure_optimizers = Regressor.configure_optimizers  # type: ignore[assignment]

    plain, hooked = Regressor(), Hooked()
    for model in (plain, hooked):
        quiet_trainer(max_epochs=2, accumulate_grad_batches=3, gradient_clip_val=0.5, logger=False).fit(
            model, make_loader(56)
        )
    for a, b in zip(plain.parameters(), hooked.parameters()):
        assert torch.equal(a, b)


def test_a_warm_up_in_optimizer_step_sets_the_learning_rate() -> None:
    rates: list[float] = []

    class WarmUp(Regressor):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            for group in optimizer.param_groups:
                group["lr"] = min(1.0, (self.trainer.global_step + 1) / 4) * self.hparams.lr
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step(closure=optimizer_closure)

    model = WarmUp()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(max_steps=6, logger=False)
    trainer.fit(model, make_loader())
    assert rates == pytest.approx([0.0125, 0.025, 0.0375, 0.05, 0.05, 0.05]) and trainer.global_step == 6
    assert not torch.equal(before[0], model.layer.weight)


def test_an_optimizer_step_that_never_runs_the_closure_is_an_error() -> None:
    class Forgetful(Regressor):
        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            optimizer.step()

    refused = r"The closure hasn't been executed.*Forgetful.optimizer_step\(\) did not call the optimizer_closure"
    with pytest.raises(MisconfigurationException, match=refused):
        quiet_trainer(max_steps=1, logger=False).fit(Forgetful(), make_loader())


def test_batch_transfer_hooks_of_module_and_datamodule() -> None:
    calls: list[tuple[str, str, int]] = []

    class Moving(Regressor):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            calls.append(("module", "before", dataloader_idx))
            return batch

        def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
            calls.append(("module", "transfer", dataloader_idx))
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            calls.append(("module", "after", dataloader_idx))
            x, y = batch
            return x * 0, y  # the step sees what this returns

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            assert torch.count_nonzero(batch[0]) == 0

    class Data(ember.DataModule):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            calls.append(("datamodule", "before", dataloader_idx))
            return batch

        def train_dataloader(self) -> DataLoader:
            return make_loader(8)

        def val_dataloader(self) -> list[DataLoader]:
            return [make_loader(8), make_loader(8)]

    quiet_trainer(max_epochs=1, logger=False).fit(Moving(), datamodule=Data())
    steps = [("datamodule", "before"), ("module", "transfer"), ("module", "after")]
    assert calls == [(*s, 0) for s in steps] + [(*s, 0) for s in steps] + [(*s, 1) for s in steps]


def test_a_wrapper_of_the_datamodules_own_transfer_hook_leaves_the_modules_in_charge() -> None:
    """A recording wrapper around the datamodule's inherited hook (``update_wrapper`` of a partial) does not
    override it: the module's hook moves the batches, and the wrapper is never called."""
    recorded: list[str] = []
    moved: list[int] = []

    class Moving(Regressor):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            moved.append(dataloader_idx)
            return batch

    class Data(ember.DataModule):
        def __init__(self) -> None:
            super().__init__()

            def record(name: str, method: Any, *args: Any) -> Any:
                recorded.append(name)
                return method(*args)

            inherited = self.on_before_batch_transfer
            self.on_before_batch_transfer = functools.update_wrapper(  # type: ignore[method-assign]
                functools.partial(record, "on_before_batch_transfer", inherited), inherited
            )

        def train_dataloader(self) -> DataLoader:
            return make_loader(8)

    quiet_trainer(max_steps=2, logger=False).fit(Moving(), datamodule=Data())
    assert recorded == [] and moved == [0, 0]


def test_the_steps_and_loaders_have_lightnings_defaults_and_a_stage_runs_only_what_is_overridden() -> None:
    assert ember.Module.validation_step(Regressor(), None, 0) is None
    for kind in ("train", "val", "test", "predict"):
        with pytest.raises(MisconfigurationException, match=f"`{kind}_dataloader` must be implemented"):
            getattr(ember.DataModule(), f"{kind}_dataloader")()

    class NoValidation(Regressor):
        validation_step = ember.Module.validation_step  # the default: nothing to validate with

    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(NoValidation(), make_loader(8), make_loader(8))
    assert trainer.num_val_batches == [] and trainer.global_step > 0

    class Untrainable(ember.Module):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)

    with pytest.raises(MisconfigurationException, match="to define training_step"):
        quiet_trainer(max_epochs=1, logger=False).fit(Untrainable(), make_loader(8))


def test_evaluation_stages_start_without_the_gradients_a_fit_left() -> None:
    seen: list[bool] = []

    class Looking(Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            seen.append(all(p.grad is None for p in self.parameters()))

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
            seen.append(all(p.grad is None for p in self.parameters()))

    model = Looking()
    trainer = quiet_trainer(max_steps=1, logger=False)
    trainer.fit(model, make_loader(8))
    for evaluate in (functools.partial(trainer.validate, verbose=False), trainer.predict):
        model.layer.weight.grad = torch.ones_like(model.layer.weight)  # as a fit stopped mid-window leaves them
        evaluate(model, make_loader(8))
    assert len(seen) == 2 and all(seen)


def test_loader_hooks_wrapped_to_record_them_are_read_once_each_in_lightnings_order() -> None:
    called: list[str] = []

    class Data(ember.DataModule):
        def __init__(self) -> None:
            super().__init__()
            for name in ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"):
                method = getattr(self, name)
                recorder = functools.partial(lambda name, method: (called.append(name), method())[1], name, method)
                setattr(self, name, functools.update_wrapper(recorder, method))

        def train_dataloader(self) -> DataLoader:
            return make_loader(8)

        def val_dataloader(self) -> DataLoader:
            return make_loader(8)

    # With a sanity check the validation loader is read first, for it; then the training loader.
    quiet_trainer(max_epochs=1, logger=False, num_sanity_val_steps=2).fit(Regressor(), datamodule=Data())
    assert called == ["val_dataloader", "train_dataloader"]


def test_eval_batch_hooks_get_the_loader_index_only_with_several_loaders() -> None:
    seen: list[tuple[int, ...]] = []

    class Hooked(Regressor):
        def on_validation_batch_start(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            seen.append((batch_idx,))

        def on_test_batch_end(self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            seen.append((batch_idx, dataloader_idx))

    model = Hooked()
    trainer = quiet_trainer(max_epochs=1, logger=False, limit_val_batches=1)
    trainer.fit(model, make_loader(8), make_loader(8))
    trainer.test(model, [make_loader(8), make_loader(8)], verbose=False)
    assert seen == [(0,), (0, 0), (0, 1)]


def test_a_step_or_batch_hook_that_does_not_fit_the_loaders_dataloader_idx_is_refused() -> None:
    class NoIndex(Regressor):
        def validation_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            pass

    class NeedsIndex(Regressor):
        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int) -> None:  # type: ignore[override]
            pass

    class HookWithoutIndex(Regressor):
        def on_predict_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
            pass

    trainer = quiet_trainer(logger=False)
    with pytest.raises(RuntimeError, match=r"multiple `val_dataloader`, but no `dataloader_idx` .* `NoIndex\.valid"):
        trainer.validate(NoIndex(), [make_loader(8), make_loader(8)])
    with pytest.raises(RuntimeError, match=r"only a single `test_dataloader`, but .* `NeedsIndex\.test_step\(\)`"):
        trainer.test(NeedsIndex(), make_loader(8))
    inputs = DataLoader(torch.randn(4, 4), batch_size=2)
    with pytest.raises(RuntimeError, match=r"multiple `predict_dataloader`, .* `HookWithoutIndex\.on_predict_batch"):
        trainer.predict(HookWithoutIndex(), [inputs, inputs])
    assert trainer.predict(HookWithoutIndex(), inputs) is not None  # one loader: no index, none expected


def test_a_loader_hook_that_returns_none_is_refused_with_lightnings_type_error() -> None:
    class NoData(Regressor):
        def val_dataloader(self) -> None:  # type: ignore[override]
            return None

    with pytest.raises(TypeError, match=r"returned from `NoData\.val_dataloader\(\)`\. Found None"):
        quiet_trainer(logger=False).fit(NoData(), make_loader(8))


def test_a_writer_is_given_the_batch_indices_of_loaders_that_sample_indices_only() -> None:
    given: list[Any] = []

    class Writer(BasePredictionWriter):
        def write_on_epoch_end(self, trainer: Any, module: Any, predictions: Any, batch_indices: Any) -> None:
            given.append(batch_indices)

    class Stream(IterableDataset):
        def __iter__(self) -> Iterator[torch.Tensor]:
            return iter(torch.randn(3, 4))

    unbatched = DataLoader(torch.randn(2, 3, 4), batch_size=None)  # two batches, no batch sampler
    streamed = DataLoader(Stream(), batch_size=2)  # a batch sampler of placeholders, no sample indices
    loaders = [DataLoader(torch.randn(3, 4), batch_size=2), unbatched, streamed]
    trainer = quiet_trainer(logger=False, callbacks=[Writer(write_interval="epoch")])
    trainer.predict(Regressor(), loaders, return_predictions=False)
    assert given == [[[[0, 1], [2]], [], []]]


def test_configure_model_and_configure_callbacks() -> None:
    calls: list[str] = []

    class Marker(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            calls.append(self.name)

    class Late(ember.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer: nn.Module | None = None

        def configure_model(self) -> None:  # type: ignore[override]
            super().configure_model()  # Lightning's default takes no argument: neither does Ember's
            if self.layer is None:
                self.layer = nn.Linear(4, 1)

        def configure_callbacks(self) -> Callback:
            return Marker("from the module")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            assert self.layer is not None
            return F.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = quiet_trainer(max_steps=2, logger=False, callbacks=[Marker("given"), LearningRateMonitor()])
    model = Late()
    with pytest.raises(ValueError, match="LearningRateMonitor needs a logger"):
        trainer.fit(model, make_loader())  # the given callbacks still run
    assert calls == ["from the module"] and model.layer is not None


def test_hooks_that_lightning_removed_are_refused() -> None:
    class OldStyle(Regressor):
        def training_epoch_end(self, outputs: Any) -> None:
            pass

    with pytest.raises(NotImplementedError, match=r"OldStyle.training_epoch_end\(\) is a hook that Ember never calls"):
        quiet_trainer(max_steps=1).fit(OldStyle(), make_loader())

    class OldCallback(Callback):
        def on_epoch_end(self, trainer: Any, module: Any) -> None:
            pass

    with pytest.raises(NotImplementedError, match="OldCallback.on_epoch_end.*on_train_epoch_end"):
        quiet_trainer(max_steps=1, callbacks=[OldCallback()]).fit(Regressor(), make_loader())

    class OldData(ember.DataModule):
        def train_dataloader(self) -> DataLoader:
            return make_loader()

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["position"] = 3

    with pytest.raises(NotImplementedError, match=r"OldData.on_save_checkpoint\(\).*from state_dict\(\)"):
        quiet_trainer(max_steps=1).fit(Regressor(), datamodule=OldData())

    class Iterating(Regressor):
        def training_step(self, dataloader_iter: Any) -> torch.Tensor:  # type: ignore[override]
            return super().training_step(*next(dataloader_iter))

    with pytest.raises(NotImplementedError, match=r"training_step\(dataloader_iter\)"):
        quiet_trainer(max_steps=1).fit(Iterating(), make_loader())


def test_a_manual_schedule_steps_at_the_last_batch_of_each_epoch() -> None:
    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.last: list[bool] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer, scheduler = self.optimizers(), self.lr_schedulers()
            optimizer.zero_grad()
            self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
            optimizer.step()
            self.last.append(self.trainer.is_last_batch)
            if self.trainer.is_last_batch:  # as Lightning's documentation of manual optimization does
                scheduler.step()

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]

    model = Manual()
    quiet_trainer(max_epochs=2, logger=False).fit(model, make_loader(24))
    assert model.last == [False, False, True] * 2
    assert model.lr_schedulers().get_last_lr() == [pytest.approx(0.025)]


def test_manual_optimization_hooks_and_flags(tmp_path: Path) -> None:
    calls: list[str] = []

    class Manual(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
            optimizer.step()

        def on_before_backward(self, loss: torch.Tensor) -> None:
            calls.append("on_before_backward")

        def on_after_backward(self) -> None:
            calls.append("on_after_backward")

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            calls.append("on_before_optimizer_step")

    quiet_trainer(max_steps=1, logger=False).fit(Manual(), make_loader())
    assert calls == ["on_before_backward", "on_after_backward", "on_before_optimizer_step"]
    # Refused before the fit writes anything (its run directory, checkpoint directory), as in Lightning.
    with pytest.raises(MisconfigurationException, match="gradient accumulation is not supported for manual optimi"):
        quiet_trainer(default_root_dir=tmp_path / "refused", accumulate_grad_batches=2).fit(Manual(), make_loader())
    with pytest.raises(MisconfigurationException, match="gradient clipping is not supported for manual optimization"):
        quiet_trainer(default_root_dir=tmp_path / "refused", gradient_clip_val=1.0).fit(Manual(), make_loader())
    assert not (tmp_path / "refused").exists()


def test_a_fit_without_an_optimizer_warns_and_runs_its_steps() -> None:
    class NoOptimizer(Regressor):
        def configure_optimizers(self) -> None:
            return None

    model = NoOptimizer()
    before = [parameter.detach().clone() for parameter in model.parameters()]
    trainer = quiet_trainer(max_epochs=1, logger=False)
    with pytest.warns(UserWarning, match="returned `None`, this fit will run with no optimizer"):
        trainer.fit(model, make_loader(24))
    assert trainer.global_step == 3
    assert all(torch.equal(old, new) for old, new in zip(before, model.parameters()))


class _ManualWithScheduler(Regressor):
    def __init__(self, scheduler: Any) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.scheduler = scheduler

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(F.mse_loss(self(batch[0]), batch[1]))
        optimizer.step()

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [self.scheduler(optimizer)]


def test_manual_optimization_ignores_the_keys_that_would_step_its_schedulers() -> None:
    # The module steps its schedulers itself: a plateau scheduler needs no monitor, and the keys that only the
    # Trainer's stepping reads are warned about and left out.
    plateau = _ManualWithScheduler(torch.optim.lr_scheduler.ReduceLROnPlateau)
    trainer = quiet_trainer(max_steps=1, logger=False)
    trainer.fit(plateau, make_loader())
    assert trainer.lr_scheduler_configs[0].monitor is None

    in_dict = _ManualWithScheduler(
        lambda optimizer: {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), "monitor": "loss",
                           "strict": False, "interval": "step"}
    )  # fmt: skip
    trainer = quiet_trainer(max_steps=1, logger=False)
    with pytest.warns(RuntimeWarning, match=r"contains the key\(s\) \['monitor', 'strict'\], but the keys will be ig"):
        trainer.fit(in_dict, make_loader())
    config = trainer.lr_scheduler_configs[0]
    assert (config.interval, config.monitor, config.strict, config.reduce_on_plateau) == ("step", None, True, False)


class _OwnStepScheduler:
    """A scheduler whose ``step`` takes what PyTorch's does not: the module steps it in ``lr_scheduler_step``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.steps: list[int] = []

    def step(self, epoch: int) -> None:
        self.steps.append(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]


def test_a_scheduler_of_another_api_is_stepped_by_the_modules_lr_scheduler_step() -> None:
    class OwnStep(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            self.scheduler = _OwnStepScheduler(optimizer)
            return [optimizer], [self.scheduler]

        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            scheduler.step(epoch=self.current_epoch)

    model = OwnStep()
    quiet_trainer(max_epochs=2, logger=False).fit(model, make_loader(16))
    assert model.scheduler.steps == [0, 1]
    manual = _ManualWithScheduler(_OwnStepScheduler)  # stepped by training_step: nothing to check
    quiet_trainer(max_steps=1, logger=False).fit(manual, make_loader())


def test_lr_scheduler_step_is_given_the_monitored_metric_as_it_was_logged() -> None:
    metrics: list[Any] = []

    class Plateau(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}

        def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
            metrics.append(metric)
            scheduler.step(metric.item())

    trainer = quiet_trainer(max_epochs=2, logger=False)
    trainer.fit(Plateau(), make_loader(16), make_loader(16))
    assert len(metrics) == 2 and all(torch.is_tensor(metric) for metric in metrics)
    assert metrics[-1] == trainer.callback_metrics["val_loss"]


def test_a_one_cycle_schedule_per_epoch_is_warned_about() -> None:
    class OneCycle(Regressor):
        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return [optimizer], [torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=10)]

    with pytest.warns(RuntimeWarning, match="A `OneCycleLR` scheduler is using 'interval': 'epoch'"):
        quiet_trainer(max_steps=1, logger=False).fit(OneCycle(), make_loader())


def test_the_optimizers_a_module_is_given_are_instances_of_their_own_class() -> None:
    seen: list[Any] = []

    class Checked(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            optimizer = self.optimizers()
            seen.append((type(optimizer).__name__, isinstance(optimizer, torch.optim.SGD), str(optimizer)[:13]))
            seen.append(optimizer.optimizer is self.trainer.optimizers[0] is self.optimizers(use_pl_optimizer=False))
            return super().training_step(batch, batch_idx)

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            seen.append(isinstance(optimizer, LightningOptimizer) and isinstance(optimizer, torch.optim.SGD))
            seen.append(torch.is_tensor(optimizer.step(closure=optimizer_closure)))  # what the closure returned

    quiet_trainer(max_steps=1, logger=False).fit(Checked(), make_loader())
    # optimizer_step runs first: training_step runs inside the closure it hands to optimizer.step.
    assert seen == [True, ("LightningSGD", True, "LightningSGD "), True, True]


def test_a_module_that_was_not_fitted_has_no_optimizers_in_other_stages() -> None:
    seen: list[Any] = []

    class Asks(Regressor):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            seen.append((self.optimizers(), self.optimizers(use_pl_optimizer=False), self.lr_schedulers()))

    trainer = quiet_trainer(logger=False)
    trainer.test(Asks(), make_loader(8))
    assert seen == [([], [], None)] and trainer.optimizers == []


def test_a_lightning_optimizer_made_by_hand_shares_its_optimizers_state() -> None:
    layer = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.1)
    wrapped = LightningOptimizer(optimizer)
    assert isinstance(wrapped, torch.optim.Adam) and type(wrapped).__name__ == "LightningAdam"
    assert wrapped.state is optimizer.state and wrapped.param_groups is optimizer.param_groups
    assert str(wrapped) == "Lightning" + str(optimizer)
    saved = wrapped.state_dict()
    saved["param_groups"][0]["lr"] = 0.5
    wrapped.load_state_dict(saved)  # loads into the optimizer itself
    assert optimizer.param_groups[0]["lr"] == 0.5
    layer(torch.ones(1, 3)).sum().backward()
    assert wrapped.step() is None  # outside a fit, the optimizer's own step
    wrapped.zero_grad()
    assert all(parameter.grad is None for parameter in layer.parameters())


class _CountingSGD(torch.optim.SGD):
    """An SGD that counts the calls of its ``zero_grad`` and records the extra arguments of its ``step``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zero_grads = 0
        self.step_arguments: list[dict[str, Any]] = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grads += 1
        super().zero_grad(set_to_none)

    def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        self.step_arguments.append(kwargs)
        return super().step(closure)


def test_a_manual_step_gives_the_optimizer_its_closure_and_arguments() -> None:
    calls: list[str] = []

    class ClosureSteps(Regressor):
        def __init__(self, optimizer: type[torch.optim.Optimizer], **options: Any) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.make = functools.partial(optimizer, **options)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            optimizer = self.optimizers()

            def closure() -> torch.Tensor:
                calls.append("closure")
                optimizer.zero_grad()
                loss = F.mse_loss(self(batch[0]), batch[1])
                self.manual_backward(loss)
                return loss

            return optimizer.step(closure=closure, **({"mode": "x"} if isinstance(optimizer, _CountingSGD) else {}))

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            calls.append("on_before_optimizer_step")

        def configure_optimizers(self) -> Any:
            return self.make(self.parameters())

    # LBFGS evaluates the closure several times in one step: each run is then shown to the hooks.
    trainer = quiet_trainer(max_steps=1, logger=False)
    trainer.fit(ClosureSteps(torch.optim.LBFGS, max_iter=3), make_loader())
    assert calls == ["closure", "on_before_optimizer_step"] * 3 and trainer.global_step == 1
    model = ClosureSteps(_CountingSGD, lr=0.1)
    quiet_trainer(max_steps=2, logger=False).fit(model, make_loader())
    assert model.optimizers(use_pl_optimizer=False).step_arguments == [{"mode": "x"}] * 2


class _Quasi(Regressor):
    """A regression fitted by LBFGS, whose ``step`` evaluates the closure it is given several times."""

    def __init__(self, override_step: bool = False) -> None:
        super().__init__()
        self.evaluations = self.shown = 0
        if override_step:
            self.optimizer_step = self._step_with_the_closure  # type: ignore[method-assign]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.evaluations += 1
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.shown += 1

    def _step_with_the_closure(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any) -> None:
        optimizer.step(closure=optimizer_closure)

    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), max_iter=3)


@pytest.mark.parametrize("override_step", [False, True])
def test_an_optimizer_that_runs_the_closure_itself_steps_under_automatic_optimization(override_step: bool) -> None:
    model, reference = _Quasi(override_step), _Quasi()
    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(model, make_loader(16))
    assert trainer.global_step == 2 and model.evaluations == model.shown == 2 * 3
    optimizer = torch.optim.LBFGS(reference.parameters(), max_iter=3)
    for x, y in make_loader(16):  # the same steps by hand: each evaluation starts from no gradients

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad()
            loss = F.mse_loss(reference(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
    for trained, by_hand in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(trained, by_hand)


@pytest.mark.parametrize("automatic", [True, False])
def test_a_mock_of_the_strategys_backward_counts_every_backward(automatic: bool) -> None:
    class Steps(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = automatic

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            if not automatic:
                self.manual_backward(loss)
                self.optimizers().step()
            return loss

    trainer = quiet_trainer(max_epochs=1, logger=False)
    with mock.patch.object(ember.strategies.Strategy, "backward", wraps=trainer.strategy.backward) as backward:
        trainer.fit(Steps(), make_loader(24))
    assert backward.call_count == trainer.global_step == 3


def test_a_step_with_a_closure_that_cannot_be_called_is_refused() -> None:
    class NotCallable(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.optimizers().step(closure=1.0)

    with pytest.raises(MisconfigurationException, match="the closure should be callable: got float 1.0"):
        quiet_trainer(max_steps=1, logger=False).fit(NotCallable(), make_loader())


def test_manual_backward_gives_backward_its_arguments() -> None:
    class Twice(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            loss = F.mse_loss(self(batch[0]), batch[1])
            self.manual_backward(loss, retain_graph=True)
            once = self.layer.weight.grad.clone()
            self.manual_backward(loss)  # the graph was kept for a second backward
            torch.testing.assert_close(self.layer.weight.grad, 2 * once)
            optimizer.step()
            optimizer.zero_grad()

    trainer = quiet_trainer(max_steps=2, logger=False)
    trainer.fit(Twice(), make_loader())
    assert trainer.global_step == 2


def test_the_optimizers_zero_grad_is_called_only_where_the_hooks_call_it() -> None:
    class EveryOther(Regressor):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            if batch_idx % 2 == 0:
                optimizer.zero_grad()

        def configure_optimizers(self) -> Any:
            return _CountingSGD(self.parameters(), lr=0.1)

    model = EveryOther()
    quiet_trainer(max_epochs=1, logger=False).fit(model, make_loader(64))
    assert model.optimizers(use_pl_optimizer=False).zero_grads == 4  # of 8 batches: none before training


def test_toggle_model_freezes_the_other_optimizers_parameters_as_lightning_does() -> None:
    seen: list[tuple[bool, bool]] = []

    class TwoParts(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.other = nn.Linear(4, 1)
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            mine, _ = self.optimizers()
            with mine.toggle_model(sync_grad=False):  # sync_grad: whether manual_backward averages across ranks
                seen.append((self.layer.weight.requires_grad, self.other.weight.requires_grad))
                self.manual_backward(F.mse_loss(self(batch[0]) + self.other(batch[0]), batch[1]))
            mine.step()
            seen.append((self.layer.weight.requires_grad, self.other.weight.requires_grad))

        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.layer.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]

    model = TwoParts()
    quiet_trainer(max_steps=1, logger=False).fit(model, make_loader())
    assert seen == [(True, False), (True, True)]
    assert model.layer.weight.grad is not None and model.other.weight.grad is None


def test_validation_leaves_frozen_parts_in_evaluation_mode() -> None:
    modes: list[bool] = []

    class Frozen(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(self.backbone(x))

        def on_fit_start(self) -> None:
            self.backbone.eval()  # a frozen backbone keeps its batch-norm statistics

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            modes.append(self.backbone.training)

    trainer = quiet_trainer(max_epochs=2, logger=False, num_sanity_val_steps=1)
    trainer.fit(Frozen(), make_loader(16), make_loader(16))
    assert modes == [False] * 4


def test_evaluation_puts_the_strategys_wrapper_of_the_module_in_evaluation_mode_too() -> None:
    """As Lightning's ``trainer.model.eval()``: a wrapper around the module (DDP's) is in evaluation mode while a
    stage evaluates, then back in its mode. Checked on the loop's helpers: a DDP run needs a process group."""
    module = Regressor()
    trainer = quiet_trainer(logger=False)
    trainer.validate(module, make_loader(8), verbose=False)
    wrapper = nn.Sequential(module)
    modes = evaluation_loop._eval_mode(trainer.hooks, wrapper, module, "validation")
    assert (wrapper.training, module.training) == (False, False)
    evaluation_loop._restore_mode(trainer.hooks, module, "validation", modes)
    assert (wrapper.training, module.training) == (True, True)


def test_gradients_are_cleared_before_a_validation_between_optimizer_steps() -> None:
    """As Lightning: on_validation_model_zero_grad (by default zero_grad) runs before each validation of fit that
    comes after an optimizer step, not in the sanity check, nor in the middle of an accumulation window."""
    seen: list[tuple[int, bool]] = []

    class Watching(Regressor):
        def on_after_backward(self) -> None:
            pass  # with a hook of the step, the gradients stay until the next window starts, as in Lightning

        def on_validation_start(self) -> None:
            seen.append((self.trainer.fit_loop.progress.total_batches, self.layer.weight.grad is None))

    # 8 batches per epoch, 2 per step; validation after batches 3 (mid-window) and 6 (after a step).
    flags = dict(max_epochs=1, logger=False, accumulate_grad_batches=2, val_check_interval=3, num_sanity_val_steps=1)
    quiet_trainer(**flags).fit(Watching(), make_loader(), make_loader(16))
    assert seen == [(0, True), (3, False), (6, True)]

    calls: list[tuple[int, int]] = []

    class Overriding(Watching):
        def on_validation_model_zero_grad(self) -> None:
            calls.append((self.global_step, self.trainer.fit_loop.progress.total_batches))  # keeps the gradients

    seen.clear()
    quiet_trainer(**flags).fit(Overriding(), make_loader(), make_loader(16))
    assert calls == [(3, 6)] and seen == [(0, True), (3, False), (6, False)]


def test_prepare_data_of_the_module_runs_once_per_stage() -> None:
    calls: list[str] = []

    class Preparing(Regressor):
        def prepare_data(self) -> None:
            calls.append("prepare")

    model = Preparing()
    trainer = quiet_trainer(max_steps=1, logger=False)
    trainer.fit(model, make_loader())
    trainer.validate(model, make_loader(), verbose=False)
    assert calls == ["prepare", "prepare"]


# ------------------------------------------------------------------------------------ flags
class _StopAtOnce(Callback):
    """Asks to stop after every batch, as an early-stopping callback might."""

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer.should_stop = True


def test_min_epochs_and_min_steps_hold_off_stopping(capsys: pytest.CaptureFixture[str]) -> None:
    trainer = quiet_trainer(max_epochs=10, callbacks=[_StopAtOnce()], logger=False)
    trainer.fit(Regressor(), make_loader())  # 8 batches per epoch
    assert trainer.global_step == 1
    trainer = quiet_trainer(max_epochs=10, min_epochs=2, callbacks=[_StopAtOnce()], logger=False)
    trainer.fit(Regressor(), make_loader())
    assert trainer.global_step == 16 and trainer.current_epoch == 2
    said = "Trainer was signaled to stop but the required `min_epochs=2` or `min_steps=None` has not been met. Training"
    assert capsys.readouterr().out.count(said) == 1  # once, in Lightning's words
    trainer = quiet_trainer(max_epochs=10, min_steps=11, callbacks=[_StopAtOnce()], logger=False)
    trainer.fit(Regressor(), make_loader())
    assert trainer.global_step == 11


def test_min_epochs_not_given_reads_as_lightning_resolves_it() -> None:
    trainer = quiet_trainer(max_epochs=10, callbacks=[_StopAtOnce()], logger=False)
    assert trainer.min_epochs is None  # until fit starts
    trainer.fit(Regressor(), make_loader())
    assert trainer.min_epochs == 0
    # With min_steps alone, min_epochs is 1, as in Lightning: a stop asked for after min_steps waits for the epoch.
    trainer = quiet_trainer(max_epochs=10, min_steps=3, callbacks=[_StopAtOnce()], logger=False)
    trainer.fit(Regressor(), make_loader())  # 8 batches per epoch
    assert (trainer.min_epochs, trainer.global_step, trainer.current_epoch) == (1, 8, 1)


def test_fast_dev_run_runs_a_few_batches_of_each_loop_and_keeps_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    model = _Tracked()
    trainer = quiet_trainer(fast_dev_run=True, max_epochs=5, callbacks=[ModelCheckpoint(monitor="val_loss")])
    trainer.fit(model, make_loader(), make_loader())
    assert trainer.global_step == 1 and trainer.current_epoch == 1 and trainer.num_val_batches == [1]
    assert not os.path.exists("ember_logs") and trainer.checkpoint_callback.best_model_path == ""  # type: ignore[union-attr]
    assert "fast_dev_run" in capsys.readouterr().out
    trainer.test(model, make_loader(), verbose=False)
    assert trainer.num_test_batches == [1]
    trainer = quiet_trainer(fast_dev_run=3)
    trainer.fit(Regressor(), make_loader(), make_loader())
    assert trainer.global_step == 3 and trainer.num_val_batches == [3]
    assert trainer.logger is not None and trainer.logger.experiment.add_image("x", torch.zeros(3, 2, 2)) is None


def test_overfit_batches_uses_the_same_few_batches_unshuffled() -> None:
    seen: list[list[float]] = []

    class Watching(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append(batch[1].flatten().tolist())
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(max_epochs=2, overfit_batches=2, logger=False)
    with pytest.warns(UserWarning, match="You requested to overfit but enabled train dataloader shuffling"):
        trainer.fit(Watching(), make_loader(shuffle=True), make_loader())
    targets = make_data().tensors[1].flatten().tolist()
    assert seen == [targets[:8], targets[8:16]] * 2 and trainer.num_val_batches == [2]


def test_dataloaders_are_reloaded_every_n_epochs() -> None:
    requests: list[int] = []

    class Reloading(Regressor):
        def train_dataloader(self) -> DataLoader:
            requests.append(self.current_epoch)
            return make_loader(8 * (len(requests)))  # one more batch each time

    trainer = quiet_trainer(max_epochs=4, reload_dataloaders_every_n_epochs=2, logger=False)
    trainer.fit(Reloading())
    assert requests == [0, 2] and trainer.global_step == 1 + 1 + 2 + 2


def test_barebones_turns_off_everything_that_costs_time() -> None:
    trainer = ember.Trainer(accelerator="cpu", barebones=True, max_epochs=1)
    assert trainer.loggers == [] and trainer.callbacks == [] and trainer.config.num_sanity_val_steps == 0
    with pytest.warns(UserWarning, match=r"self.log\('train_loss', ...\) does nothing: `Trainer\(barebones=True\)` is"):
        trainer.fit(Regressor(), make_loader())
    with pytest.warns(UserWarning, match=r"self.log_dict\(\['a', 'b'\], ...\) does nothing: `Trainer\(barebones=True"):
        trainer.lightning_module.log_dict({"a": 1.0, "b": 2.0})  # one warning for the call
    assert trainer.callback_metrics == {} and not os.path.exists("ember_logs")
    for flags, name in (({"logger": CSVLogger(".")}, "logger"), ({"profiler": "simple"}, "profiler"),
                        ({"fast_dev_run": True}, "fast_dev_run"), ({"detect_anomaly": True}, "detect_anomaly"),
                        ({"callbacks": [ModelCheckpoint()]}, "callbacks")):  # fmt: skip
        with pytest.raises(ember.config.FlagError, match=f"barebones=True.*{name}="):
            ember.Trainer(barebones=True, **flags)


@pytest.mark.parametrize(
    ("flags", "save_on_train_epoch_end", "epochs_saved"),
    [({"check_val_every_n_epoch": 2}, None, [1, 3]), ({"check_val_every_n_epoch": 2}, True, [0, 1, 2, 3]),
     ({}, False, [0, 1, 2, 3]), ({"limit_val_batches": 0}, False, []),
     ({"val_check_interval": 0.5}, None, [0, 0, 1, 1, 2, 2, 3, 3])],
)  # fmt: skip
def test_when_checkpoints_are_saved_as_lightning_chooses(
    flags: dict[str, Any], save_on_train_epoch_end: bool | None, epochs_saved: list[int]
) -> None:
    checkpoint = ModelCheckpoint(dirpath="saved", save_top_k=-1, save_on_train_epoch_end=save_on_train_epoch_end)
    trainer = quiet_trainer(max_epochs=4, logger=False, callbacks=[checkpoint], **flags)
    trainer.fit(Regressor(), make_loader(32), make_loader(16))
    names = sorted(os.listdir("saved"), key=lambda name: int(name.split("step=")[1].split(".")[0]))
    assert [int(name.split("-")[0].removeprefix("epoch=")) for name in names] == epochs_saved


def test_hyperparameters_are_not_logged_when_asked_not_to() -> None:
    trainer = quiet_trainer(max_steps=1, enable_autolog_hparams=False)
    trainer.fit(Regressor(), make_loader())
    assert _logged_hyperparameters(trainer) == {}


@pytest.mark.parametrize(
    ("name", "find_unused"),
    [("ddp_find_unused_parameters_true", True), ("ddp_spawn", False), ("ddp_fork", False),
     ("ddp_notebook_find_unused_parameters_true", True)],
)  # fmt: skip
def test_lightnings_strategy_names(name: str, find_unused: bool) -> None:
    strategy = ember.Trainer(accelerator="cpu", devices=1, strategy=name).strategy
    assert isinstance(strategy, ember.strategies.DDPStrategy) and strategy.find_unused_parameters is find_unused


def test_lightnings_options_of_ddp_and_fsdp() -> None:
    from torch.distributed.fsdp import ShardingStrategy

    from ember.strategies import DDPStrategy, FSDPStrategy

    assert DDPStrategy(start_method="spawn").start_method == "spawn"
    assert ember.Trainer(accelerator="cpu", devices=1, strategy="ddp_fork").strategy.start_method == "fork"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"start_method='thread'\): choose one of \('popen', 'spawn'"):
        DDPStrategy(start_method="thread")
    assert FSDPStrategy(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward is False
    assert FSDPStrategy(sharding_strategy=ShardingStrategy.FULL_SHARD, state_dict_type="sharded").reshard_after_forward
    with pytest.raises(ValueError, match=r"sharding_strategy='NO_SHARD'\).*strategy='ddp'"):
        FSDPStrategy(sharding_strategy="NO_SHARD")
    with pytest.raises(ValueError, match=r"state_dict_type='full'\).*ember checkpoint consolidate"):
        FSDPStrategy(state_dict_type="full")
    with pytest.raises(ValueError, match=r"mixed_precision=...\): pass Trainer\(precision='bf16-mixed'\)"):
        FSDPStrategy(mixed_precision=object())


def test_strategy_names_ember_lacks_say_what_to_use() -> None:
    with pytest.raises(ValueError, match=r"strategy='deepspeed_stage_2'.*DeepSpeed.*'fsdp'"):
        ember.Trainer(accelerator="cpu", strategy="deepspeed_stage_2")
    with pytest.raises(ValueError, match=r"FSDPStrategy\(cpu_offload=True\).*on accelerator='cpu'"):
        ember.Trainer(accelerator="cpu", strategy="fsdp_cpu_offload")  # the name is known; CPUs need no offload


#: The Trainer flags as a config file that Lightning's CLI writes (``--print_config``, the run's config.yaml)
#: spells them: None for "the default".
LIGHTNING_CONFIG_DEFAULTS = dict(
    accelerator="auto", strategy="auto", devices="auto", num_nodes=1, precision=None, logger=None, callbacks=None,
    fast_dev_run=False, max_epochs=None, min_epochs=None, max_steps=-1, min_steps=None, max_time=None,
    limit_train_batches=None, limit_val_batches=None, limit_test_batches=None, limit_predict_batches=None,
    overfit_batches=0.0, val_check_interval=None, check_val_every_n_epoch=1, num_sanity_val_steps=None,
    log_every_n_steps=None, enable_checkpointing=None, enable_progress_bar=None, enable_model_summary=None,
    accumulate_grad_batches=1, gradient_clip_val=None, gradient_clip_algorithm=None, deterministic=None,
    benchmark=None, inference_mode=True, use_distributed_sampler=True, profiler=None, detect_anomaly=False,
    barebones=False, plugins=None, sync_batchnorm=False, reload_dataloaders_every_n_epochs=0, default_root_dir=None,
    enable_autolog_hparams=True, model_registry=None,
)  # fmt: skip


def test_none_means_the_default_as_in_lightnings_config_files() -> None:
    trainer = ember.Trainer(**LIGHTNING_CONFIG_DEFAULTS)  # type: ignore[arg-type]
    assert trainer.config == ember.Trainer().config
    assert trainer.config.precision == "32-true" and trainer.config.log_every_n_steps == 50
    assert trainer.config.num_sanity_val_steps == 2 and trainer.config.val_check_interval == 1.0
    assert trainer.config.gradient_clip_algorithm is None and trainer.config.deterministic is None
    assert trainer.logger is not None and trainer.checkpoint_callback is not None


def test_plugins_and_model_registry_are_refused_unless_none() -> None:
    with pytest.raises(ember.config.FlagError, match=r"plugins=\['bf16'\]: Ember has no plugins.*precision="):
        ember.Trainer(plugins=["bf16"])
    with pytest.raises(ember.config.FlagError, match=r"model_registry='my-model': Ember uploads to no model registry"):
        ember.Trainer(model_registry="my-model")


def test_the_older_gpus_flag_warns_with_the_flags_to_use() -> None:
    with pytest.warns(FutureWarning, match=r"gpus=0 is Lightning 1's spelling.*accelerator='cpu'"):
        assert ember.Trainer(gpus=0).strategy.root_device.type == "cpu"


def test_the_default_logger_is_tensorboard_with_a_csv_file_beside_it() -> None:
    pytest.importorskip("tensorboard")
    from ember.loggers import TensorBoardLogger

    class Images(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.logger.experiment.add_image("input", batch[0][:1].reshape(1, 2, 2), self.global_step)
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(max_steps=2, log_every_n_steps=1)
    trainer.fit(Images(), make_loader())
    assert isinstance(trainer.logger, TensorBoardLogger) and isinstance(trainer.loggers[1], CSVLogger)
    files = os.listdir(trainer.log_dir)
    assert "metrics.csv" in files and any(name.startswith("events.out.tfevents") for name in files)


def test_the_default_logger_is_csv_without_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    hidden = lambda name, *rest: None if name == "tensorboard" else find_spec(name, *rest)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hidden)
    trainer = quiet_trainer(max_steps=1)
    assert [type(logger) for logger in trainer.loggers] == [CSVLogger]


@pytest.mark.parametrize("inference_mode", [True, False])
def test_inference_mode_and_anomaly_detection(inference_mode: bool) -> None:
    seen: dict[str, tuple[bool, bool, bool]] = {}

    class Watching(Regressor):
        def _note(self, stage: str) -> None:
            seen[stage] = (torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.is_anomaly_enabled())

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self._note("train")
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self._note("validate")

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self._note("test")

    trainer = quiet_trainer(max_steps=1, logger=False, inference_mode=inference_mode, detect_anomaly=True)
    model = Watching()
    trainer.fit(model, make_loader(8), make_loader(8))
    trainer.test(model, make_loader(8), verbose=False)
    # As Lightning's, fit's validations run under no_grad whatever the flag: what their hooks make trains on.
    assert seen == {"train": (False, True, True), "validate": (False, False, True),
                    "test": (inference_mode, False, True)}  # fmt: skip
    trainer.validate(model, make_loader(8), verbose=False)
    assert seen["validate"] == (inference_mode, False, True)
    assert not torch.is_anomaly_enabled()


def test_learning_rate_monitor_logs_the_rate_each_logging_step_uses() -> None:
    rates: list[float] = []

    class Halving(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            rates.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self) -> Any:
            first = torch.optim.Adam(self.layer.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(first, step_size=1, gamma=0.5)
            return {"optimizer": first, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    trainer = quiet_trainer(max_steps=4, log_every_n_steps=2, callbacks=[LearningRateMonitor()])
    trainer.fit(Halving(), make_loader())
    with open(os.path.join(trainer.log_dir, "metrics.csv"), newline="") as file:
        logged = [(int(row["step"]), float(row["lr-Adam"])) for row in csv.DictReader(file) if row.get("lr-Adam")]
    # labelled as the step's other values: with the step's index (the second step is 1)
    assert logged == [(1, rates[1]), (3, rates[3])] and rates == [0.1, 0.05, 0.025, 0.0125]
    monitor = LearningRateMonitor()

    class Two(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.other = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            return [torch.optim.Adam(self.layer.parameters()), torch.optim.Adam(self.other.parameters())]

    trainer = quiet_trainer(max_steps=1, limit_train_batches=1, max_epochs=1, callbacks=[monitor])
    trainer.fit(Two(), make_loader())
    assert set(trainer.callback_metrics) == {"lr-Adam", "lr-Adam-1"}  # the second of a kind gets "-1"


def test_the_options_of_self_log_that_lightning_has() -> None:
    class Options(Regressor):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            x, y = batch
            self.log(f"loss_{dataloader_idx}", F.mse_loss(self(x), y), add_dataloader_idx=False)
            self.log("plain", 1.0, rank_zero_only=True, metric_attribute="unused")

    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(Options(), make_loader(), [make_loader(16), make_loader(16)])
    assert {"loss_0", "loss_1", "plain/dataloader_idx_0"} <= set(trainer.callback_metrics)
    for options, message in (({"enable_graph": True}, "never keep the autograd graph"),
                             ({"sync_dist_group": object()}, "leave the group out"),
                             ({"rank_zero_only": True, "sync_dist": True}, "cannot be synced")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            Regressor().log("x", 1.0, **options)


def test_the_datamodule_hears_of_a_failed_stage() -> None:
    seen: list[str] = []

    class Data(ember.DataModule):
        def train_dataloader(self) -> DataLoader:
            return make_loader()

        def on_exception(self, exception: BaseException) -> None:
            seen.append(str(exception))

    class Failing(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            raise RuntimeError("broken step")

    with pytest.raises(RuntimeError, match="broken step"):
        quiet_trainer(max_steps=1, logger=False).fit(Failing(), datamodule=Data())
    assert seen == ["broken step"]


def test_the_tuner_runs_the_modules_step_hooks() -> None:
    from ember.tuner import Tuner

    calls: list[int] = []

    class Hooked(Regressor):
        def train_dataloader(self) -> DataLoader:
            return make_loader(64, batch_size=8)

        def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
            calls.append(batch_idx)
            optimizer.step(closure=optimizer_closure)

    Tuner(quiet_trainer(logger=False)).lr_find(Hooked(), num_training=5, early_stop_threshold=None)
    assert calls == [0, 1, 2, 3, 4]


def test_a_trainer_pickles_after_fit() -> None:
    trainer = quiet_trainer(max_steps=2, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader(32), make_loader(16))
    copy = pickle.loads(pickle.dumps(trainer))
    assert copy.global_step == 2 and isinstance(copy.optimizers[0], torch.optim.SGD)
    assert pickle.loads(pickle.dumps(trainer.lightning_module.optimizers())).param_groups[0]["lr"] == 0.05
    torch.save(trainer, io.BytesIO())  # as Lightning users save one


def test_seed_everything_quiet(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EMBER_GLOBAL_SEED", "PL_GLOBAL_SEED"):
        monkeypatch.delenv(name, raising=False)
    ember.seed_everything(verbose=False)
    assert capsys.readouterr().out == ""
    monkeypatch.delenv("EMBER_GLOBAL_SEED")
    monkeypatch.delenv("PL_GLOBAL_SEED")
    ember.seed_everything()
    assert "no seed given" in capsys.readouterr().out


def test_seed_everything_logs_its_seed(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    with caplog.at_level(logging.INFO, logger="ember"):
        ember.seed_everything(3)
        monkeypatch.setenv("RANK", "1")  # every process seeds, and says which it is
        ember.seed_everything(4)
        ember.seed_everything(5, verbose=False)
    assert [record.getMessage() for record in caplog.records] == ["Seed set to 3", "[rank: 1] Seed set to 4"]


def test_seed_everything_sets_and_reads_lightnings_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("EMBER_GLOBAL_SEED", "PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(name, raising=False)
    assert ember.seed_everything("7", workers=True) == 7  # a seed read from the command line as text
    assert (os.environ["PL_GLOBAL_SEED"], os.environ["PL_SEED_WORKERS"]) == ("7", "1")
    ember.seed_everything(8)
    assert (os.environ["PL_GLOBAL_SEED"], os.environ["PL_SEED_WORKERS"]) == ("8", "0")
    monkeypatch.delenv("EMBER_GLOBAL_SEED")
    monkeypatch.setenv("PL_GLOBAL_SEED", "11")  # set by a Lightning launcher or script
    assert ember.seed_everything() == 11
    with pytest.raises(TypeError, match=r"seed_everything\(seed='x'\): expected an int"):
        ember.seed_everything("x")
    monkeypatch.delenv("EMBER_GLOBAL_SEED")
    monkeypatch.setenv("PL_GLOBAL_SEED", "eleven")
    with pytest.raises(ValueError, match=r"Invalid seed specified via PL_GLOBAL_SEED: 'eleven' \(expected an integer"):
        ember.seed_everything()


def test_trainer_state_says_which_entry_point_and_loop_run_and_how_it_ended() -> None:
    from ember.trainer_state import RunningStage, TrainerFn, TrainerStatus

    seen: list[tuple[str | None, str | None]] = []

    class Watch(ember.callbacks.Callback):
        def on_sanity_check_start(self, trainer: ember.Trainer, module: Any) -> None:
            seen.append((trainer.state.fn, trainer.state.stage))

        def on_train_batch_start(self, trainer: ember.Trainer, module: Any, *args: Any) -> None:
            seen.append((trainer.state.fn, trainer.state.stage))

        def on_validation_batch_start(self, trainer: ember.Trainer, module: Any, *args: Any) -> None:
            seen.append((trainer.state.fn, trainer.state.stage))

    flags: dict[str, Any] = dict(max_epochs=1, limit_val_batches=1, num_sanity_val_steps=1, logger=False)
    trainer = quiet_trainer(callbacks=[Watch()], **flags)
    assert trainer.state.status == TrainerStatus.INITIALIZING and trainer.state.stage is None
    trainer.fit(Regressor(), make_loader(16), make_loader(16))
    assert seen[0] == ("fit", "sanity_check") and {("fit", "train"), ("fit", "validate")} <= set(seen)
    assert (trainer.state.fn, trainer.state.stage, trainer.state.finished) == (TrainerFn.FITTING, None, True)
    trainer.test(Regressor(), make_loader(16), verbose=False)
    assert trainer.state.fn == "test" and trainer.state.status == "finished" and not trainer.interrupted
    assert not trainer.training and RunningStage.VALIDATING == "validate"
    prefixes = [stage.dataloader_prefix for stage in RunningStage]  # as in limit_<prefix>_batches
    assert prefixes == ["train", "val", "val", "test", "predict"]
    assert [stage for stage in RunningStage if stage.evaluating] == ["sanity_check", "validate", "test"]

    class Fails(Regressor):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            raise RuntimeError("the step fails")

    class Status(ember.callbacks.Callback):
        def on_exception(self, trainer: ember.Trainer, module: Any, exception: BaseException) -> None:
            seen.append((trainer.state.status, str(exception)))

    seen.clear()
    trainer = quiet_trainer(callbacks=[Status()], **flags)
    with pytest.raises(RuntimeError, match="the step fails"):
        trainer.test(Fails(), make_loader(16), verbose=False)
    assert trainer.interrupted and trainer.state.status == TrainerStatus.INTERRUPTED
    assert seen == [(TrainerStatus.INTERRUPTED, "the step fails")]  # already so in on_exception, as in Lightning


def test_the_trainers_devices_and_flags_under_lightnings_names() -> None:
    trainer = quiet_trainer(max_epochs=1, val_check_interval=0.5, reload_dataloaders_every_n_epochs=2, logger=False)
    assert (trainer.device_ids, trainer.num_devices, trainer.distributed_sampler_kwargs, trainer.scaler) == (
        [0],
        1,
        None,
        None,
    )
    assert (trainer.reload_dataloaders_every_n_epochs, trainer.overfit_batches, trainer.enable_autolog_hparams) == (
        2,
        0.0,
        True,
    )
    accelerator = trainer.accelerator
    assert accelerator.device_type == "cpu" and accelerator.is_available() and accelerator.auto_device_count() == 1
    assert not trainer.received_sigterm and trainer.val_check_batch is None  # before fit
    trainer.fit(Regressor(), make_loader(), make_loader(16))  # 8 batches, validated every 4
    assert trainer.val_check_batch == 4 and not trainer.received_sigterm
    trainer = quiet_trainer(max_epochs=1, overfit_batches=3, logger=False)
    trainer.fit(Regressor(), make_loader())
    assert trainer.overfit_batches == 3 and trainer.val_check_batch == 3  # once an epoch: all its batches


def test_init_module_builds_on_the_device_in_a_true_precisions_dtype() -> None:
    with quiet_trainer(precision="64-true").init_module():
        layer = nn.Linear(2, 2)
    assert layer.weight.dtype == torch.float64 and torch.get_default_dtype() == torch.float32
    with quiet_trainer(precision="bf16-mixed").init_module(empty_init=True):
        layer = nn.Linear(2, 2)
    assert layer.weight.dtype == torch.float32 and layer.weight.device == torch.device("cpu")


def test_received_sigterm_after_a_fit_that_sigterm_stopped(tmp_path: Any) -> None:
    class Terminate(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer: ember.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = quiet_trainer(max_epochs=1, callbacks=[Terminate()], default_root_dir=str(tmp_path), logger=False)
    with pytest.raises(SystemExit):
        trainer.fit(Regressor(), make_loader())
    assert trainer.received_sigterm and trainer.global_step < 8


def test_save_checkpoint_takes_lightnings_arguments(tmp_path: Any) -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False)
    with pytest.raises(AttributeError, match="only possible if a model is attached to the Trainer"):  # as Lightning
        trainer.save_checkpoint(tmp_path / "before.ckpt")
    trainer.fit(Regressor(), make_loader())
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=None)  # None: the whole state, as False
    assert "optimizer_states" in torch.load(tmp_path / "weights.ckpt", weights_only=True)
    with pytest.raises(TypeError, match="storage_options=.*leave it None"):
        trainer.save_checkpoint(tmp_path / "other.ckpt", storage_options={"anon": True})


def test_log_dir_without_a_logger_is_the_root_directory(tmp_path: Any) -> None:
    trainer = quiet_trainer(logger=False, default_root_dir=str(tmp_path))
    assert trainer.log_dir == str(tmp_path)  # as Lightning's: programs join their own files to it
    trainer.fit(Regressor(), make_loader(16))
    assert trainer.log_dir == str(tmp_path)
    assert quiet_trainer(default_root_dir=str(tmp_path)).log_dir != str(tmp_path)  # a logger's run directory


def _logged_hyperparameters(trainer: ember.Trainer) -> Any:
    """What the loggers wrote to hparams.yaml (TensorBoard's writes `{}` when nothing was logged, as Lightning's)."""
    path = os.path.join(trainer.log_dir or "", "hparams.yaml")
    if not os.path.exists(path):
        return {}
    with open(path) as file:
        return yaml.safe_load(file)


def test_the_strategy_gives_the_module_unwrapped_as_lightnings() -> None:
    trainer = quiet_trainer(max_steps=1, logger=False, enable_checkpointing=False)
    assert trainer.strategy.lightning_module is None and trainer.model is None
    model = Regressor()
    trainer.fit(model, make_loader())
    assert trainer.strategy.lightning_module is model is trainer.lightning_module is trainer.model
    other = Regressor()
    trainer.validate(other, make_loader(), verbose=False)
    assert trainer.strategy.lightning_module is other
