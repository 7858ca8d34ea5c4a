"""EmberCLI: a command line for a Module and DataModule, configured by flags and YAML files."""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import pytest
import torch
from conftest import Regressor, make_data
from torch.utils.data import DataLoader

import ember

pytest.importorskip("jsonargparse")
from ember.cli_lightning import EmberCLI, LRSchedulerCallable, OptimizerCallable

# The CLI uses jsonargparse's current API: a call its next major version removes warns, and fails here.
pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")


class Data(ember.DataModule):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(32), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(16), batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(make_data(16), batch_size=self.batch_size)


class Wider(Regressor):
    """A second model, chosen by class path."""

    def __init__(self, lr: float = 0.05, features: int = 4, scale: float = 2.0) -> None:
        super().__init__(lr, features)
        self.save_hyperparameters("scale")


_QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def test_fit_with_a_config_file_and_flags_then_test(tmp_path: Any) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  max_epochs: 2\nmodel:\n  lr: 0.01\ndata:\n  batch_size: 16\n")
    cli = EmberCLI(Regressor, Data, args=["fit", "--config", str(config), "--model.features=4", *_QUIET])
    assert cli.trainer.global_step == 4 and cli.model.hparams.lr == 0.01 and cli.datamodule.batch_size == 16
    saved = os.path.join(cli.trainer.log_dir, "config.yaml")
    with open(saved) as file:
        assert "lr: 0.01" in file.read()
    best = cli.trainer.checkpoint_callback.best_model_path
    tested = EmberCLI(Regressor, Data, args=["test", "--ckpt_path", best, *_QUIET])
    assert "test_loss" in tested.trainer.callback_metrics


def test_print_config_shows_every_option() -> None:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        EmberCLI(Regressor, Data, args=["fit", "--print_config"])
    text = printed.getvalue()
    assert "seed_everything:" in text and "max_epochs: null" in text and "lr: 0.05" in text


def test_class_paths_for_the_model_callbacks_optimizer_and_scheduler() -> None:
    args = [
        f"--model={Wider.__module__}.Wider",
        "--model.scale=3.0", "--trainer.max_steps=2", "--trainer.logger=false", "--trainer.callbacks+=EarlyStopping",
        "--trainer.callbacks.monitor=train_loss", "--optimizer=Adam", "--optimizer.lr=0.003",
        "--lr_scheduler=StepLR", "--lr_scheduler.step_size=1", *_QUIET,
    ]  # fmt: skip
    cli = EmberCLI(datamodule_class=Data, args=args, run=False, save_config_callback=None)
    assert isinstance(cli.model, Wider) and cli.model.hparams.scale == 3.0
    assert any(isinstance(callback, ember.callbacks.EarlyStopping) for callback in cli.trainer.callbacks)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.param_groups[0]["lr"] == pytest.approx(0.003)
    assert isinstance(cli.trainer.lr_scheduler_configs[0].scheduler, torch.optim.lr_scheduler.StepLR)


def test_the_saved_config_is_not_overwritten(tmp_path: Any) -> None:
    # Without a logger or checkpoints the run has no directory of its own: the config goes to default_root_dir.
    args = ["fit", "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
            "--trainer.enable_checkpointing=false", *_QUIET]  # fmt: skip
    EmberCLI(Regressor, Data, args=args)
    with pytest.raises(RuntimeError, match="config.yaml exists already"):
        EmberCLI(Regressor, Data, args=args)
    EmberCLI(Regressor, Data, args=args, save_config_kwargs={"overwrite": True})


#: A configuration as Lightning's CLI writes it (``fit --print_config``, or the config.yaml of each run): every
#: Trainer flag, None where Lightning's default is None, and the options Ember has no use for.
LIGHTNING_CONFIG = """\
# lightning.pytorch==2.6.6
seed_everything: 3
trainer:
  accelerator: auto
  strategy: auto
  devices: auto
  num_nodes: 1
  precision: null
  logger: null
  callbacks: null
  fast_dev_run: false
  max_epochs: 2
  min_epochs: null
  max_steps: -1
  min_steps: null
  max_time: null
  limit_train_batches: null
  limit_val_batches: null
  limit_test_batches: null
  limit_predict_batches: null
  overfit_batches: 0.0
  val_check_interval: null
  check_val_every_n_epoch: 1
  num_sanity_val_steps: null
  log_every_n_steps: null
  enable_checkpointing: null
  enable_progress_bar: false
  enable_model_summary: null
  accumulate_grad_batches: 1
  gradient_clip_val: null
  gradient_clip_algorithm: null
  deterministic: null
  benchmark: null
  inference_mode: true
  use_distributed_sampler: true
  profiler: null
  detect_anomaly: false
  barebones: false
  plugins: null
  sync_batchnorm: false
  reload_dataloaders_every_n_epochs: 0
  default_root_dir: null
  enable_autolog_hparams: true
  model_registry: null
model:
  lr: 0.01
  features: 4
data:
  batch_size: 16
optimizer: null
lr_scheduler: null
ckpt_path: null
weights_only: null
"""


def test_a_config_file_written_by_lightnings_cli_runs_unchanged(tmp_path: Any) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(LIGHTNING_CONFIG)
    cli = EmberCLI(Regressor, Data, args=["fit", "--config", str(config)])
    assert cli.trainer.global_step == 4 and cli.model.hparams.lr == 0.01
    assert cli.trainer.config.precision == "32-true" and cli.trainer.config.log_every_n_steps == 50
    assert cli.trainer.checkpoint_callback is not None and cli.trainer.logger is not None


class Injected(ember.Module):
    """A module that takes how to build its optimizer and scheduler, as Lightning's CLI documentation shows."""

    def __init__(
        self,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable = torch.optim.lr_scheduler.ConstantLR,
    ) -> None:
        super().__init__()
        self.optimizer, self.scheduler = optimizer, scheduler
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler(optimizer)}


def test_optimizer_and_scheduler_given_to_the_module_by_class_path() -> None:
    args = ["--model.optimizer=SGD", "--model.optimizer.lr=0.05", "--model.scheduler=StepLR",
            "--model.scheduler.step_size=2", "--trainer.max_steps=1", "--trainer.logger=false", *_QUIET]  # fmt: skip
    cli = EmberCLI(Injected, Data, args=args, run=False, save_config_callback=None)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    optimizer = cli.trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert isinstance(cli.trainer.lr_scheduler_configs[0].scheduler, torch.optim.lr_scheduler.StepLR)


class Predicting(Regressor):
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


class PredictData(Data):
    def predict_dataloader(self) -> DataLoader:
        return DataLoader(make_data(16), batch_size=self.batch_size)


def test_validate_and_predict_with_the_datamodule_chosen_by_class_path(capsys: pytest.CaptureFixture[str]) -> None:
    data = f"--data={PredictData.__module__}.PredictData"
    common = [data, "--data.batch_size=4", "--trainer.logger=false", *_QUIET]
    validated = EmberCLI(Predicting, args=["validate", *common], save_config_callback=None)
    assert isinstance(validated.datamodule, PredictData) and validated.trainer.num_val_batches == [4]
    assert "val_loss" in validated.trainer.callback_metrics
    predicted = EmberCLI(Predicting, args=["predict", *common, "--return_predictions=true"], save_config_callback=None)
    assert predicted.trainer.num_predict_batches == [4]
