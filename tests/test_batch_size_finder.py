"""The ``BatchSizeFinder`` callback: the tuner's batch-size search when ``fit`` starts, or where a subclass asks."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_data, make_loader, quiet_trainer
from torch.utils.data import DataLoader

import ember
from ember.exceptions import MisconfigurationException
from ember.tuner import BatchSizeFinder


class _Sized(ember.Module):
    """Makes its loaders at ``batch_size`` (64 samples); counts the batches each step sees, by epoch and size."""

    def __init__(self, batch_size: int | None = 2) -> None:
        super().__init__()
        if batch_size is not None:
            self.batch_size = batch_size
        self.layer = torch.nn.Linear(4, 1)
        self.seen: Counter[tuple[str, int, int]] = Counter()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen["train", self.current_epoch, len(batch[0])] += 1
        return F.mse_loss(self.layer(batch[0]), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["val", self.current_epoch, len(batch[0])] += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(64), batch_size=self.batch_size)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.seen["test", self.current_epoch, len(batch[0])] += 1

    def predict_step(self, batch: Any) -> torch.Tensor:  # (a step may leave out batch_idx)
        self.seen["predict", self.current_epoch, len(batch[0])] += 1
        return self.layer(batch[0])

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(64), batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(make_data(64), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(make_data(64), batch_size=self.batch_size)


def test_the_search_runs_when_fit_starts_and_fit_trains_at_the_size_found() -> None:
    finder = BatchSizeFinder(max_trials=4)
    assert finder.optimal_batch_size == 2  # init_val until a search
    model = _Sized()
    trainer = quiet_trainer(max_epochs=2, logger=False, callbacks=[finder])
    trainer.fit(model)
    assert finder.optimal_batch_size == model.batch_size == 16  # 2, 4, 8, 16: four trials
    assert trainer.global_step == 2 * 64 // 16  # the trials' steps are not training's
    assert trainer.train_dataloader.batch_size == trainer.val_dataloaders.batch_size == 16
    assert model.seen["train", 0, 16] == 3 + 4 and model.seen["train", 1, 16] == 4  # a trial of 3 steps, then 4
    assert model.seen["val", 0, 16] == model.seen["val", 1, 16] == 4 and model.seen["train", 0, 8] == 3


@pytest.mark.parametrize(("stage", "kind"), [("validate", "val"), ("test", "test"), ("predict", "predict")])
def test_an_evaluation_searches_with_its_own_steps_then_runs_at_the_size_found(stage: str, kind: str) -> None:
    finder, model = BatchSizeFinder(max_trials=3, steps_per_trial=2), _Sized()
    trainer = quiet_trainer(logger=False, callbacks=[finder])
    outputs = getattr(trainer, stage)(model)
    assert finder.optimal_batch_size == model.batch_size == 8 and trainer.global_step == 0
    assert model.seen == Counter({(kind, 0, 2): 2, (kind, 0, 4): 2, (kind, 0, 8): 2 + 8})  # trials, then the stage
    assert len(outputs) == (8 if stage == "predict" else 1)
    assert getattr(trainer, f"{kind}_dataloaders").batch_size == 8


def test_a_subclass_searches_again_at_chosen_epochs() -> None:
    class AtEpochs(BatchSizeFinder):
        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            pass

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch in (0, 2):
                pl_module.batch_size = 2 if trainer.current_epoch == 0 else 8  # what the search starts from
                self.init_val = pl_module.batch_size
                self.scale_batch_size(trainer, pl_module)

    model = _Sized()
    trainer = quiet_trainer(max_epochs=3, logger=False, callbacks=[AtEpochs(max_trials=2, steps_per_trial=1)])
    trainer.fit(model)
    assert model.seen["train", 0, 4] == 1 + 16 and model.seen["train", 1, 4] == 16  # 2, 4: trained at 4
    assert model.seen["train", 2, 16] == 1 + 4  # 8, 16: the third epoch trains (and validates) at 16
    assert model.seen["val", 2, 16] == 4 and trainer.global_step == 16 + 16 + 4


def test_a_datamodule_or_hyperparameter_holds_the_size() -> None:
    class Data(ember.DataModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 2

        def train_dataloader(self) -> DataLoader:
            return DataLoader(make_data(64), batch_size=self.batch_size)

    data, finder = Data(), BatchSizeFinder(max_trials=3, steps_per_trial=1)
    quiet_trainer(max_epochs=1, limit_val_batches=0, logger=False, callbacks=[finder]).fit(
        _Sized(None), datamodule=data
    )
    assert finder.optimal_batch_size == data.batch_size == 8

    class Both(_Sized):
        def __init__(self, batch_size: int = 2) -> None:
            super().__init__(batch_size)
            self.save_hyperparameters("batch_size")

    model = Both()
    with pytest.warns(UserWarning, match=r"`model.batch_size` and `model.hparams.batch_size` are mutually exclusive"):
        quiet_trainer(max_epochs=1, logger=False, callbacks=[BatchSizeFinder(max_trials=2)]).fit(model)
    assert model.batch_size == model.hparams.batch_size == 4


def test_what_the_finder_refuses() -> None:
    with pytest.raises(ValueError, match=r"`mode` should be either of \('power', 'binsearch'\)"):
        BatchSizeFinder(mode="linear")
    assert BatchSizeFinder(mode="BinSearch").mode == "binsearch"
    with pytest.raises(MisconfigurationException, match=r"margin=1.5\): choose a fraction in \[0, 1\)"):
        BatchSizeFinder(margin=1.5)
    trainer = quiet_trainer(max_epochs=1, logger=False, callbacks=[BatchSizeFinder()])
    with pytest.raises(MisconfigurationException, match="Field batch_size not found in `model`, `datamodule`"):
        trainer.fit(_Sized(None))
    with pytest.raises(MisconfigurationException, match="cannot be used with dataloaders passed directly to `.fit"):
        trainer.fit(_Sized(), make_loader())
    with pytest.raises(MisconfigurationException, match=r"passed directly to `.test\(\)`"):
        trainer.test(_Sized(), make_loader())

    class TwoLoaders(_Sized):
        def test_dataloader(self) -> list[DataLoader]:
            return [super().test_dataloader(), super().test_dataloader()]

    with pytest.raises(MisconfigurationException, match="cannot be used with multiple test dataloaders"):
        trainer.test(TwoLoaders())
    with pytest.raises(MisconfigurationException, match="Batch size finder is not supported with distributed strat"):
        BatchSizeFinder().setup(ember.Trainer(accelerator="cpu", devices=2, strategy="ddp"), _Sized())
    with pytest.raises(MisconfigurationException, match=r"scale_batch_size\(trainer, pl_module\) sizes the batches"):
        BatchSizeFinder().scale_batch_size(trainer, _Sized())  # no stage is running


def test_fast_dev_run_skips_the_search() -> None:
    finder, model = BatchSizeFinder(), _Sized()
    with pytest.warns(UserWarning, match="Skipping batch size scaler since `fast_dev_run` is enabled"):
        quiet_trainer(fast_dev_run=True, logger=False, callbacks=[finder]).fit(model)
    assert finder.optimal_batch_size is None and model.batch_size == 2


def test_the_trials_are_logged_in_lightnings_words(caplog: pytest.LogCaptureFixture) -> None:
    finder = BatchSizeFinder(init_val=16, steps_per_trial=1)
    with caplog.at_level(logging.INFO):
        quiet_trainer(max_epochs=1, logger=False, callbacks=[finder]).fit(_Sized())
    assert caplog.text.count("trying batch size") == 2  # 16, 32, then 64: the whole data set
    assert caplog.text.count("The batch size 64 is greater or equal than the length of your dataset: 64.") == 1
    assert "Finished batch size finder, will continue with full run using batch size 64" in caplog.text


@pytest.mark.cuda
def test_the_search_runs_on_the_gpu() -> None:
    finder = BatchSizeFinder(max_trials=3)
    model = _Sized()
    trainer = quiet_trainer(accelerator="cuda", devices=1, max_epochs=1, logger=False, callbacks=[finder])
    trainer.fit(model)
    assert finder.optimal_batch_size == model.batch_size == 8  # 2, 4, 8: three trials
    assert trainer.train_dataloader.batch_size == 8 and next(model.parameters()).device.type == "cuda"
