"""EmberCLI: a command line for a Module and DataModule, configured by flags and YAML files."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from typing import Any

import pytest
import torch
from conftest import Regressor, make_data
from torch.utils.data import DataLoader

import ember
from ember.exceptions import MisconfigurationException

pytest.importorskip("jsonargparse")
from ember.cli_lightning import EmberArgumentParser, EmberCLI, LRSchedulerCallable, OptimizerCallable, instantiate_class

# The CLI uses jsonargparse's current API: a call its next major version removes warns, and fails here.
pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")


@pytest.fixture(autouse=True)
def bare_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests give ``args``: pytest's own arguments would be a command line given too, which the CLI warns of."""
    monkeypatch.setattr(sys, "argv", ["train.py"])


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
    assert cli.model_class is None and cli.datamodule_class is Data  # as given
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
    with pytest.raises(RuntimeError, match="config.yaml to NOT exist. Aborting to avoid overwriting"):
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


class SavedData(Data):
    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(batch_size)
        self.save_hyperparameters()


def test_a_model_and_data_chosen_by_class_path_log_and_reload_their_hyperparameters(tmp_path: Any) -> None:
    args = ["fit", f"--model={Wider.__module__}.Wider", "--model.scale=3.0", f"--data={SavedData.__module__}.SavedData",
            "--trainer.max_steps=1", "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}",
            *_QUIET]  # fmt: skip
    cli = EmberCLI(args=args)
    # Each records the class it was chosen by: the loggers are given both, not refused a conflict.
    assert cli.model.hparams._class_path != cli.datamodule.hparams._class_path
    with open(os.path.join(cli.trainer.log_dir, "hparams.yaml")) as file:
        logged = file.read()
    assert "batch_size: 8" in logged and "scale: 3.0" in logged
    # The class it was chosen by is rebuilt, as configured, from any class above it.
    loaded = ember.Module.load_from_checkpoint(cli.trainer.checkpoint_callback.best_model_path)
    assert type(loaded) is Wider and loaded.hparams.scale == 3.0


class Wide(ember.Module):
    """A module whose shape is a hyperparameter."""

    def __init__(self, width: int = 2, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_ckpt_path_configures_the_module_from_the_checkpoints_hyperparameters(tmp_path: Any) -> None:
    common = [
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={tmp_path}",
        *_QUIET,
    ]
    fitted = EmberCLI(Wide, Data, args=["fit", "--model.width=6", *common])
    best = fitted.trainer.checkpoint_callback.best_model_path
    # Not told the width, the module is built as the checkpoint's was, and its weights load.
    tested = EmberCLI(Wide, Data, args=["test", f"--ckpt_path={best}", *common], save_config_callback=None)
    assert tested.model.net[0].out_features == 6 and tested.config.test.model.width == 6
    assert "test_loss" in tested.trainer.callback_metrics
    resumed = EmberCLI(Wide, Data, args=["fit", f"--ckpt_path={best}", "--trainer.max_steps=3", *common[1:]],
                       save_config_kwargs={"overwrite": True})  # fmt: skip
    assert resumed.trainer.global_step == 3 and resumed.model.hparams.width == 6


class InjectedSaved(Injected):
    """``Injected`` that saves its hyperparameters, to be rebuilt by ``load_from_checkpoint``."""

    def __init__(
        self,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable = torch.optim.lr_scheduler.ConstantLR,
        width: int = 2,
    ) -> None:
        super().__init__(optimizer, scheduler)
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, width)
        self.head = torch.nn.Linear(width, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.head(self.layer(batch[0])), batch[1])


def test_the_configuration_is_the_hyperparameters_that_load_from_checkpoint_rebuilds(tmp_path: Any) -> None:
    args = ["fit", "--model.optimizer=SGD", "--model.optimizer.lr=0.03", "--model.scheduler=StepLR",
            "--model.scheduler.step_size=2", "--model.width=5", "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}", *_QUIET]  # fmt: skip
    cli = EmberCLI(InjectedSaved, Data, args=args)
    hparams = cli.model.hparams
    assert hparams.optimizer["class_path"] == "torch.optim.SGD" and hparams.optimizer["init_args"]["lr"] == 0.03
    assert hparams.scheduler["init_args"]["step_size"] == 2 and hparams.width == 5
    assert hparams._instantiator == "ember.cli_lightning.instantiate_module"
    with open(os.path.join(cli.trainer.log_dir, "hparams.yaml")) as file:
        assert "class_path: torch.optim.SGD" in file.read()
    loaded = InjectedSaved.load_from_checkpoint(cli.trainer.checkpoint_callback.best_model_path)
    optimizer = loaded.optimizer(loaded.parameters())
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["lr"] == 0.03
    assert loaded.layer.out_features == 5 and torch.equal(loaded.head.weight, cli.model.head.weight)
    # Without the support the module records what its __init__ received, as outside the CLI.
    plain = EmberCLI(InjectedSaved, Data, args=args[1:], run=False, load_from_checkpoint_support=False)
    assert "_instantiator" not in plain.model.hparams and callable(plain.model.hparams.optimizer)


def test_a_checkpoint_cannot_name_the_code_that_rebuilds_its_module(tmp_path: Any) -> None:
    path = tmp_path / "crafted.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"_instantiator": "os.system", "width": 3}}, path)
    with pytest.raises(ValueError, match="'os.system' from the checkpoint is not among those trusted"):
        Wide.load_from_checkpoint(path)


def test_seed_options_from_the_environment_and_the_parser_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_TRAINER__MAX_STEPS", "3")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")

    class Parser(ember.cli_lightning.EmberArgumentParser):
        pass

    cli = EmberCLI(Regressor, Data, args=["--seed_everything=4", *_QUIET], run=False, parser_class=Parser,
                   parser_kwargs={"default_env": True})  # fmt: skip
    assert isinstance(cli.parser, Parser) and cli.trainer.max_steps == 3 and cli.parser_kwargs == {"default_env": True}
    assert os.environ["PL_GLOBAL_SEED"] == "4" and os.environ["PL_SEED_WORKERS"] == "1"  # workers seeded too
    assert EmberCLI(Regressor, Data, args=[], run=False).trainer.max_steps == -1  # the environment unread


def test_args_with_a_command_line_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train.py", "fit"])
    with pytest.warns(UserWarning, match=r"EmberCLI's args parameter is intended to run .*sys.argv\[1:\]=\['fit'\]"):
        EmberCLI(Regressor, Data, args=[], run=False)


def test_a_function_that_builds_the_module_or_trainer() -> None:
    def make_model(features: int = 4, rate: float = 0.1) -> Regressor:
        return Regressor(lr=rate, features=features)

    def make_trainer(max_steps: int = 1) -> ember.Trainer:
        return ember.Trainer(max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False)

    args = ["fit", "--model.rate=0.2", "--trainer.max_steps=2"]
    with pytest.warns(UserWarning, match="does not expose the `callbacks` argument"):
        cli = EmberCLI(make_model, Data, trainer_class=make_trainer, args=args)
    assert isinstance(cli.model, Regressor) and cli.model.hparams.lr == 0.2 and cli.trainer.global_step == 2
    with pytest.raises(ember.exceptions.MisconfigurationException, match="Cannot add arguments from"):
        EmberCLI(dict, Data, args=[], run=False)  # type: ignore[arg-type]


def test_a_subcommand_is_given_no_datamodule_when_none_is_configured() -> None:
    received: dict[str, Any] = {}

    class Recording(EmberCLI):
        def fit(self, **kwargs: Any) -> None:
            received.clear()
            received.update(kwargs)

    Recording(Regressor, args=["fit", "--trainer.logger=false"], save_config_callback=None)
    assert "datamodule" not in received and isinstance(received["model"], Regressor)
    Recording(Regressor, Data, args=["fit", "--trainer.logger=false"], save_config_callback=None)
    assert isinstance(received["datamodule"], Data)


def test_save_to_log_dir_false_needs_a_save_config_of_its_own() -> None:
    with pytest.raises(ValueError, match="only makes sense when subclassing SaveConfigCallback"):
        EmberCLI(Regressor, Data, args=[], run=False, save_config_kwargs={"save_to_log_dir": False})


class StepScheduled(EmberCLI):
    @staticmethod
    def configure_optimizers(lightning_module: ember.Module, optimizer: Any, lr_scheduler: Any = None) -> Any:
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "interval": "step"}}


def test_configure_optimizers_of_the_cli_replaces_the_modules() -> None:
    args = ["--optimizer=Adam", "--lr_scheduler=StepLR", "--lr_scheduler.step_size=1", "--trainer.max_steps=1",
            "--trainer.logger=false", *_QUIET]  # fmt: skip
    with pytest.warns(UserWarning, match="`Regressor.configure_optimizers` will be overridden by `StepScheduled"):
        cli = StepScheduled(Regressor, Data, args=args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.lr_scheduler_configs[0].interval == "step"
    assert isinstance(cli.trainer.optimizers[0], torch.optim.Adam)


def test_reduce_lr_on_plateau_by_its_name() -> None:
    args = ["--optimizer=SGD", "--optimizer.lr=0.01", "--lr_scheduler=ReduceLROnPlateau",
            "--lr_scheduler.monitor=val_loss", "--trainer.max_epochs=1", "--trainer.logger=false", *_QUIET]  # fmt: skip
    cli = EmberCLI(Regressor, Data, args=args, run=False, save_config_callback=None)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.lr_scheduler_configs[0].monitor == "val_loss"


def test_a_run_announces_no_flag_it_was_not_given(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ember"):
        cli = EmberCLI(Regressor, Data, args=["fit", "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"])
    assert "val_check_interval" not in caplog.text
    with open(os.path.join(cli.trainer.log_dir, "config.yaml")) as file:
        saved = file.read()
    assert saved.startswith(f"# ember=={ember.__version__}\n") and "val_check_interval: null" in saved


class Linked(Regressor):
    """A module given its optimizer's and scheduler's class paths and arguments, which it builds itself."""

    def __init__(self, optimizer_init: dict[str, Any], scheduler_init: dict[str, Any], features: int = 4) -> None:
        super().__init__(features=features)
        self.save_hyperparameters()

    def configure_optimizers(self) -> Any:
        optimizer = instantiate_class(self.parameters(), self.hparams.optimizer_init)
        return [optimizer], [instantiate_class(optimizer, self.hparams.scheduler_init)]


class LinkingCLI(EmberCLI):
    def add_arguments_to_parser(self, parser: EmberArgumentParser) -> None:
        parser.add_optimizer_args(torch.optim.Adam, link_to="model.optimizer_init")
        schedulers = (torch.optim.lr_scheduler.StepLR, torch.optim.lr_scheduler.ExponentialLR)
        parser.add_lr_scheduler_args(schedulers, link_to="model.scheduler_init")


def test_optimizer_groups_linked_to_the_modules_arguments() -> None:
    args = ["--optimizer.lr=0.02", "--lr_scheduler=ExponentialLR", "--lr_scheduler.gamma=0.5", "--trainer.max_steps=1",
            "--trainer.logger=false", *_QUIET]  # fmt: skip
    cli = LinkingCLI(Linked, Data, args=args, run=False, save_config_callback=None)
    # A group of one class gives its class path too, as one of several classes does.
    assert cli.model.hparams.optimizer_init["class_path"] == "torch.optim.adam.Adam"
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    optimizer, scheduler = cli.trainer.optimizers[0], cli.trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(optimizer, torch.optim.Adam) and isinstance(scheduler, torch.optim.lr_scheduler.ExponentialLR)
    assert scheduler.base_lrs == [0.02]


class TwoOptimizers(EmberCLI):
    def add_arguments_to_parser(self, parser: EmberArgumentParser) -> None:
        parser.add_optimizer_args(torch.optim.SGD, nested_key="first")
        parser.add_optimizer_args(torch.optim.Adam, nested_key="second")


def test_two_automatic_optimizer_groups_are_refused() -> None:
    with pytest.raises(
        MisconfigurationException, match=r"at most one optimizer .* but found \['first', 'second', 'lr_scheduler'\]"
    ):
        TwoOptimizers(Regressor, Data, args=["--first.lr=0.1"], run=False)
