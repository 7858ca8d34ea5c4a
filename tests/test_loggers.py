"""TensorBoard, MLflow and W&B (offline) loggers read back with their own readers, several loggers at once,
torchmetrics objects (also across two gloo ranks), and rank-zero-only output."""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import warnings
from typing import Any

import numpy
import pytest
import torch
import warm_processes
import yaml
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember.loggers import CSVLogger, MLflowLogger, TensorBoardLogger, WandbLogger

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(log_dir)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_event_files_read_back_with_scalars_and_hyperparameters(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    logger = TensorBoardLogger(str(tmp_path))
    trainer = quiet_trainer(max_epochs=2, logger=logger, log_every_n_steps=2)
    trainer.fit(Regressor(lr=0.03), make_loader(32), make_loader(16))
    assert logger.log_dir == os.path.join(str(tmp_path), "ember_logs", "version_0") == trainer.log_dir
    scalars = _scalars(logger.log_dir)
    assert [step for step, _ in scalars["train_loss"]] == [1, 3, 5, 7]  # each step's index, as Lightning labels
    assert [step for step, _ in scalars["val_loss"]] == [3, 7]
    assert scalars["train_loss"][-1][1] == pytest.approx(float(trainer.logged_metrics["train_loss"]))

    events = EventAccumulator(logger.log_dir)
    events.Reload()
    records = events.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(records["_hparams_/session_start_info"]).session_start_info
    assert session.hparams["lr"].number_value == pytest.approx(0.03)
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as file:
        assert yaml.safe_load(file) == {"lr": 0.03, "features": 4}

    experiment = plugin_data_pb2.HParamsPluginData.FromString(records["_hparams_/experiment"]).experiment
    assert [info.name.tag for info in experiment.metric_infos] == ["hp_metric"]  # the HPARAMS tab's metric

    # as Lightning's: a Namespace, a dataclass or a list of dicts among the hyperparameters is flattened; the
    # metrics given are the HPARAMS tab's, and without any the hyperparameters go to hparams.yaml only
    params = {"args": argparse.Namespace(depth=2), "layers": [{"width": 8}], "sizes": [1, 2], "p": numpy.float32(0.5)}
    named, unnamed = (TensorBoardLogger(str(tmp_path), name=name, default_hp_metric=False) for name in "ab")
    named.log_hyperparams(params, {"hp/acc": 0.0})
    unnamed.log_hyperparams(params)
    for logger in named, unnamed:
        logger.finalize("success")
    events = EventAccumulator(named.log_dir)
    events.Reload()
    records = events.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(records["_hparams_/session_start_info"]).session_start_info
    assert set(session.hparams) == {"args/depth", "layers/0/width", "sizes", "p"}
    assert session.hparams["p"].number_value == 0.5  # a NumPy number is a number
    experiment = plugin_data_pb2.HParamsPluginData.FromString(records["_hparams_/experiment"]).experiment
    assert [info.name.tag for info in experiment.metric_infos] == ["hp/acc"]
    events = EventAccumulator(unnamed.log_dir)
    events.Reload()
    assert not [tag for tag in events.summary_metadata if tag.startswith("_hparams_")]
    assert os.path.isfile(os.path.join(unnamed.log_dir, "hparams.yaml"))


def test_mlflow_runs_read_back_from_the_local_store(tmp_path: Any) -> None:
    pytest.importorskip("mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    store = str(tmp_path / "mlruns")
    logger = MLflowLogger(experiment_name="regression", save_dir=store, tags={"team": "core"})
    trainer = quiet_trainer(max_epochs=2, logger=logger, log_every_n_steps=2)
    trainer.fit(Regressor(lr=0.03), make_loader(32), make_loader(16))

    client = MlflowClient(tracking_uri="file:" + store)
    (run,) = client.search_runs([logger.name])
    assert run.info.run_id == logger.version and run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.03", "features": "4"} and run.data.tags["team"] == "core"
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [metric.step for metric in history] == [1, 3, 5, 7]
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "val_loss")] == [3, 7]
    runs = mlflow.search_runs(experiment_names=["regression"], output_format="list")
    assert [found.info.run_id for found in runs] == [logger.version]
    # checkpoints go into the run's directory of the store
    assert trainer.checkpoint_callback is not None
    assert trainer.checkpoint_callback.dirpath == os.path.join(store, logger.name, logger.version, "checkpoints")
    assert logger.log_dir is None and trainer.log_dir == store  # the run's files are MLflow's, as in Lightning


def test_mlflow_marks_a_failed_run_and_prefixes_and_cleans_metric_names(tmp_path: Any) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    class Failing(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("top@1 acc", 1.0)
            if batch_idx == 3:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    store = str(tmp_path / "mlruns")
    logger = MLflowLogger(save_dir=store, prefix="train")
    with pytest.raises(RuntimeError, match="boom"):
        quiet_trainer(max_epochs=1, logger=logger, log_every_n_steps=1).fit(Failing(), make_loader(64))
    run = MlflowClient(tracking_uri="file:" + store).get_run(logger.version)
    assert run.info.status == "FAILED" and "train-top_1 acc" in run.data.metrics  # prefix-name, as in Lightning


def test_wandb_offline_run_holds_the_metrics_and_hyperparameters(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="regression", save_dir=tmp_path)
    trainer = quiet_trainer(max_epochs=2, logger=logger, log_every_n_steps=2)
    trainer.fit(Regressor(lr=0.03), make_loader(32), make_loader(16))
    run = logger.experiment
    assert logger.version == run.id and logger.name == "regression"
    assert run.config["lr"] == 0.03 and run.config["features"] == 4
    assert {"train_loss", "val_loss", "trainer/global_step"} <= set(run.summary.keys())
    assert run.summary["trainer/global_step"] == 7  # the last logging step's index, as in Lightning
    # as Lightning's: nested dicts stay groups of the config, a class is its name, other objects their text
    logger.log_hyperparams(
        {"optim": {"name": "sgd", "betas": [0.9]}, "act": torch.nn.ReLU, "args": argparse.Namespace(a=1)}
    )
    assert run.config["optim"] == {"name": "sgd", "betas": [0.9]} and "optim/name" not in run.config
    assert (run.config["act"], run.config["args"]) == ("ReLU", "Namespace(a=1)")
    assert logger.log_dir is None and trainer.log_dir == str(tmp_path)  # a W&B run's files are wandb's
    assert trainer.checkpoint_callback is not None
    assert trainer.checkpoint_callback.dirpath == os.path.join(str(tmp_path), "regression", run.id, "checkpoints")
    run.finish()
    (offline,) = [name for name in os.listdir(tmp_path / "wandb") if name.startswith("offline-run-")]
    assert offline.endswith(run.id) and os.path.isfile(tmp_path / "wandb" / offline / f"run-{run.id}.wandb")
    with pytest.raises(ValueError, match="does not upload checkpoints"):
        WandbLogger(log_model=True)


def test_several_loggers_share_one_versioned_run_directory(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    root = str(tmp_path)
    for version in ("version_0", "version_1"):
        loggers = [CSVLogger(root), TensorBoardLogger(root)]
        trainer = quiet_trainer(max_epochs=1, logger=loggers, log_every_n_steps=2)
        trainer.fit(Regressor(), make_loader(32))
        assert trainer.loggers == loggers
        assert {logger.log_dir for logger in loggers} == {os.path.join(root, "ember_logs", version)}
    files = sorted(os.listdir(os.path.join(root, "ember_logs", "version_1")))
    assert files[:1] == ["checkpoints"] and "metrics.csv" in files and "hparams.yaml" in files
    assert any(name.startswith("events.out.tfevents") for name in files)


def test_missing_packages_give_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'ember\[tensorboard\]'"):
        TensorBoardLogger()
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'ember\[mlflow\]'"):
        MLflowLogger()


def test_csv_writes_a_row_per_call_under_alphabetical_columns(tmp_path: Any) -> None:
    logger = CSVLogger(str(tmp_path))
    logger.log_metrics({"loss_epoch": 1.0, "epoch": 0}, step=8)
    logger.log_metrics({"lr": 0.1, "epoch": 1}, step=8)  # the next epoch starts at the same step
    logger.log_metrics({"loss": 2.0, "epoch": 1}, step=8)
    logger.save()
    logger.log_metrics({"acc": 0.5}, step=9)  # a new column: the file gets a new header, still in order
    logger.save()
    with open(logger.metrics_file, newline="") as file:
        lines = list(csv.reader(file))
    assert lines == [
        ["acc", "epoch", "loss", "loss_epoch", "lr", "step"],
        ["", "0", "", "1.0", "", "8"],
        ["", "1", "", "", "0.1", "8"],
        ["", "1", "2.0", "", "", "8"],
        ["0.5", "", "", "", "", "9"],
    ]


def test_loggers_take_a_namespace_and_write_hparams_yaml_in_key_order(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    for logger in (CSVLogger(str(tmp_path), name="csv"), TensorBoardLogger(str(tmp_path), name="tb")):
        logger.log_hyperparams({"lr": 0.1, "batch": {"size": 8, "drop": True}})
        logger.log_hyperparams(argparse.Namespace(depth=3))  # added to what was logged before
        logger.save()
        with open(os.path.join(logger.log_dir, "hparams.yaml")) as file:
            assert file.read() == "batch:\n  drop: true\n  size: 8\ndepth: 3\nlr: 0.1\n"
    assert logger.hparams == {"lr": 0.1, "batch": {"size": 8, "drop": True}, "depth": 3}


def test_tensorboard_run_directory_holds_an_hparams_yaml_even_without_hyperparameters(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(str(tmp_path))
    logger.save()  # no run directory yet: nothing is written, and no version is claimed
    assert not os.path.exists(os.path.join(str(tmp_path), "ember_logs"))
    logger.log_metrics({"a": 1.0}, step=0)
    logger.save()
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as file:
        assert file.read() == "{}\n"


def test_tensorboard_sub_dir_holds_the_events_and_the_version_directory_the_checkpoints(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(str(tmp_path), name="runs", sub_dir="train")
    trainer = quiet_trainer(max_epochs=1, logger=logger)
    trainer.fit(Regressor(), make_loader(16))
    version_dir = os.path.join(str(tmp_path), "runs", "version_0")
    assert logger.sub_dir == "train" and logger.log_dir == trainer.log_dir == os.path.join(version_dir, "train")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logger.log_dir))
    assert os.listdir(os.path.join(version_dir, "checkpoints")) == ["epoch=0-step=2.ckpt"]
    assert quiet_trainer(logger=False, default_root_dir=str(tmp_path)).log_dir == str(tmp_path)


def test_tensorboard_log_graph_records_the_model_traced_with_its_example_input(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    graphs = []
    for log_graph, example in ((True, torch.zeros(2, 4)), (False, torch.zeros(2, 4)), (True, None)):
        model = Regressor()
        model.example_input_array = example
        logger = TensorBoardLogger(str(tmp_path), version=len(graphs), log_graph=log_graph)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_trainer(max_steps=1, logger=logger).fit(model, make_loader(16))
        events = EventAccumulator(logger.log_dir)
        events.Reload()
        graphs.append((events.Tags()["graph"], any("example_input_array" in str(w.message) for w in caught)))
    assert graphs == [(True, False), (False, False), (False, True)]


# ---------------------------------------------------------------------------------- torchmetrics
def test_torchmetrics_objects_are_computed_per_epoch_and_reset() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")

    class WithMetrics(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.batch_mean = torchmetrics.MeanMetric()
            self.step_only = torchmetrics.SumMetric()
            self.val_count = torchmetrics.SumMetric()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.batch_mean(torch.tensor(float(batch_idx)))
            self.log("batch_mean", self.batch_mean, on_step=True, on_epoch=True)
            self.step_only(torch.tensor(1.0))
            self.log("step_only", self.step_only)  # per step only, yet reset at the epoch's end
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.val_count.update(torch.tensor(1.0))
            self.log("val_count", self.val_count)

    seen: list[tuple[float, float, float]] = []

    class Watch(ember.callbacks.Callback):
        reads_epoch_metrics = True

        def on_train_epoch_end(self, trainer: ember.Trainer, module: Any) -> None:
            metrics = trainer.callback_metrics
            reset = float(module.step_only.metric_state["sum_value"])
            seen.append((float(metrics["batch_mean_epoch"]), float(metrics["val_count"]), reset))

    model = WithMetrics()
    trainer = ember.Trainer(accelerator="cpu", max_epochs=2, enable_progress_bar=False, logger=False,
                            enable_checkpointing=False, num_sanity_val_steps=2, callbacks=[Watch()])  # fmt: skip
    trainer.fit(model, make_loader(32), make_loader(24))
    # 4 batches (mean index 1.5) and 3 validation batches per epoch: the 2 sanity batches and the first
    # epoch's updates are not counted again
    assert [(mean, count) for mean, count, _ in seen] == [(1.5, 3.0), (1.5, 3.0)]
    assert float(trainer.callback_metrics["batch_mean_step"]) == 3.0
    assert [reset for *_, reset in seen] == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_gloo_ranks_sync_metrics_and_only_rank_zero_writes(tmp_path: Any) -> None:
    pytest.importorskip("torchmetrics")
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    out = str(tmp_path)
    result = warm_processes.run(
        [sys.executable, os.path.join(SCRIPTS, "train_observe.py"), "--out", out], cwd=out,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = []
    for rank in range(2):
        with open(os.path.join(out, f"rank{rank}.json")) as file:
            ranks.append(json.load(file))
    # the metric objects' own sync gives the global values, the same on both ranks, per epoch
    assert [r["val_acc"] for r in ranks] == [[0.5, 1.0], [0.5, 1.0]]
    assert [r["rank_sum_epoch"] for r in ranks] == [[24.0, 24.0], [24.0, 24.0]]  # 8 batches x (1 + 2)
    assert [r["rank_sum_step"] for r in ranks] == [1.0, 2.0]  # step values are each rank's own
    # one run, written once
    assert ranks[0]["log_dirs"] == ranks[1]["log_dirs"]
    assert ranks[0]["setup_log_dir"] == ranks[1]["setup_log_dir"] == ranks[0]["log_dirs"][0]  # settled before setup
    run_dir = os.path.join(out, "ember_logs", "version_0")
    assert sorted(os.listdir(os.path.join(out, "ember_logs"))) == ["version_0"]
    assert len([name for name in os.listdir(run_dir) if name.startswith("events.out")]) == 1
    assert [step for step, _ in _scalars(run_dir)["train_loss"]] == [1, 3, 5, 7, 9, 11, 13, 15]
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as file:
        assert [row["step"] for row in csv.DictReader(file) if row["train_loss"]] == [str(n) for n in range(1, 16, 2)]
    experiments = [name for name in os.listdir(os.path.join(out, "mlruns")) if name not in ("0", ".trash")]
    assert len(experiments) == 1
    runs = [name for name in os.listdir(os.path.join(out, "mlruns", experiments[0])) if name != "meta.yaml"]
    assert len(runs) == 1
    # the summary and the progress lines are printed by rank zero alone
    assert result.stdout.count("Total params") == 1 and result.stdout.count("Epoch 0/1 8/8") == 1
    # a parameter sharded over the two ranks counts with its full size (6 x 8 + 6), not its half
    assert "54        Total params" in ranks[0]["sharded_summary"]


def test_tensorboard_scalars_reach_the_file_at_each_flush_and_at_the_end(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(str(tmp_path), flush_logs_every_n_steps=10)
    logger.log_metrics({"loss": 1.0}, 5)
    assert _scalars(logger.log_dir) == {}  # buffered: the writer's thread is not woken per step
    logger.log_metrics({"loss": 0.5}, 10)
    assert _scalars(logger.log_dir) == {"loss": [(5, 1.0), (10, 0.5)]}
    logger.log_metrics({"loss": 0.25}, 12)
    logger.finalize("success")
    assert _scalars(logger.log_dir)["loss"][-1] == (12, 0.25)


def test_metrics_csv_stays_open_during_a_stage_and_is_closed_at_its_end(tmp_path: Any) -> None:
    def open_files() -> set[str]:
        return {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd here")
    logger = CSVLogger(str(tmp_path), flush_logs_every_n_steps=2)
    seen: list[bool] = []

    class Probe(ember.callbacks.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen.append(os.path.realpath(logger.metrics_file) in open_files())

    quiet_trainer(max_epochs=2, log_every_n_steps=1, logger=logger, callbacks=[Probe()]).fit(Regressor(), make_loader())
    assert seen[-1] and os.path.realpath(logger.metrics_file) not in open_files()  # appended to in place, then closed
    with open(logger.metrics_file, newline="") as file:
        assert [int(row["step"]) for row in csv.DictReader(file) if row["train_loss"]] == list(range(16))


def test_csv_logger_writes_to_a_file_system_url() -> None:
    import fsspec

    from ember.loggers.logger import load_hparams_from_yaml

    filesystem = fsspec.filesystem("memory")
    first = CSVLogger("memory://runs", name="exp")
    writer = first.experiment
    writer.log_metrics({"loss": 0.5}, step=0)
    writer.save()
    writer.log_metrics({"loss": 0.25, "acc": 1.0}, step=1)  # a new column: the file is written with it
    writer.save()
    first.log_hyperparams({"lr": 0.1, "layers": [2, 3]})
    assert first.log_dir == "memory://runs/exp/version_0" and not os.path.exists("memory:")
    text = filesystem.cat_file(writer.metrics_file_path).decode()
    assert list(csv.reader(text.splitlines())) == [["acc", "loss", "step"], ["", "0.5", "0"], ["1.0", "0.25", "1"]]
    assert load_hparams_from_yaml(f"{first.log_dir}/{writer.NAME_HPARAMS_FILE}") == {"lr": 0.1, "layers": [2, 3]}
    assert CSVLogger("memory://runs", name="exp").version == 1  # the next free number
    filesystem.rm("/runs", recursive=True)


def test_hparams_yaml_saved_and_loaded_as_lightning_names_them(tmp_path: Any) -> None:
    from argparse import Namespace

    from ember.loggers.logger import load_hparams_from_yaml, save_hparams_to_yaml

    path = tmp_path / "nested" / "hparams.yaml"
    save_hparams_to_yaml(path, Namespace(lr=0.1, name="net", dtype=torch.float32))
    assert load_hparams_from_yaml(path) == {"lr": 0.1, "name": "net", "dtype": "torch.float32"}  # its repr
    with pytest.warns(RuntimeWarning, match="there is no file"):
        assert load_hparams_from_yaml(tmp_path / "missing.yaml") == {}
