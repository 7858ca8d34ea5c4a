"""ModelCheckpoint as Lightning's users know it: its options, names, attributes, callback states and errors."""

from __future__ import annotations

import functools
import http.server
import inspect
import io
import logging
import os
import threading
from datetime import timedelta
from typing import Any, Literal

import pytest
import torch
import yaml
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember import checkpoint as checkpoint_io
from ember.callbacks import Callback, EarlyStopping, ModelCheckpoint
from ember.callbacks.callback import settings_key
from ember.checkpoint import state as checkpoint_state
from ember.exceptions import MisconfigurationException


class _Scored(Regressor):
    """Logs ``scores[epoch]`` as "score" in validation, so the ranking of checkpoints is known in advance."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = scores

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", self.scores[self.current_epoch])


class _FailsAt(Callback):
    """Raises once training reaches global step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("trouble")


def _files(directory: Any) -> set[str]:
    return set(os.listdir(directory))


# ------------------------------------------------------------------------------------ options
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mode": "avg"}, r"`mode` can be min, max but got avg"),
        ({"save_top_k": -3}, r"save_top_k=-3\. Must be >= -1"),
        ({"save_top_k": 3}, r"ModelCheckpoint\(save_top_k=3, monitor=None\) is not a valid configuration"),
        ({"every_n_epochs": -1}, r"every_n_epochs=-1\. Must be >= 0"),
        ({"every_n_train_steps": -1}, r"every_n_train_steps=-1\. Must be >= 0"),
        ({"every_n_train_steps": 1, "every_n_epochs": 2}, "Combination of parameters every_n_train_steps"),
        ({"train_time_interval": timedelta(minutes=1), "every_n_epochs": 2}, "should be mutually exclusive"),
    ],
)
def test_a_configuration_that_cannot_run_is_a_misconfiguration(options: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationException, match=message):
        ModelCheckpoint(**options)


def test_zero_turns_a_trigger_off_and_the_newest_k_are_kept_by_monitoring_the_step(tmp_path: Any) -> None:
    ModelCheckpoint(every_n_train_steps=0, every_n_epochs=0, train_time_interval=timedelta(minutes=1))
    every_three = ModelCheckpoint(
        dirpath=tmp_path, filename="{step}", every_n_train_steps=3, every_n_epochs=0, monitor="step", mode="max",
        save_top_k=2,
    )  # fmt: skip
    trainer = quiet_trainer(max_epochs=2, callbacks=[every_three], logger=False)
    trainer.fit(Regressor(), make_loader(64))  # 16 steps
    assert _files(tmp_path) == {"step=12.ckpt", "step=15.ckpt"}
    assert every_three.best_model_path == str(tmp_path / "step=15.ckpt") and every_three.best_model_score == 15
    assert every_three.kth_best_model_path == str(tmp_path / "step=12.ckpt") and every_three.kth_value == 12


def test_the_dirpath_expands_the_home_directory_and_is_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", "/home/someone")
    assert ModelCheckpoint(dirpath="~/checkpoints").dirpath == "/home/someone/checkpoints"
    assert ModelCheckpoint(dirpath="./~/checkpoints").dirpath == os.path.join(os.getcwd(), "~", "checkpoints")


def test_the_signature_holds_types_an_argument_parser_can_use() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--save_last", type=inspect.signature(ModelCheckpoint).parameters["save_last"].annotation)
    assert [parser.parse_args(["--save_last", value]).save_last for value in ("true", "no", "link")] == [
        True, False, "link"
    ]  # fmt: skip


def test_checkpointing_turned_off_with_a_model_checkpoint_given_is_a_misconfiguration() -> None:
    with pytest.raises(MisconfigurationException, match="`enable_checkpointing=False` but found `ModelCheckpoint`"):
        quiet_trainer(enable_checkpointing=False, callbacks=[ModelCheckpoint()])


# ------------------------------------------------------------------------------ what is kept
def test_the_epoch_and_the_step_can_be_monitored(tmp_path: Any) -> None:
    latest = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="epoch", mode="max", save_top_k=-1)
    trainer = quiet_trainer(max_epochs=3, callbacks=[latest], logger=False)
    trainer.fit(Regressor(), make_loader(16), make_loader(8))
    assert _files(tmp_path) == {"epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"}
    assert latest.best_model_path == str(tmp_path / "epoch=2.ckpt") and latest.best_model_score == 2
    assert latest.kth_best_model_path == str(tmp_path / "epoch=0.ckpt")  # the worst kept
    assert latest.current_score == 2


def test_the_kept_files_their_worst_and_the_latest_score_are_in_the_callback_state(tmp_path: Any) -> None:
    best_two = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="score", save_top_k=2)
    trainer = quiet_trainer(max_epochs=3, callbacks=[best_two], logger=False)
    trainer.fit(_Scored([0.5, 0.2, 0.3]), make_loader(16), make_loader(8))
    assert best_two.kth_best_model_path == str(tmp_path / "epoch=2.ckpt")
    assert best_two.kth_value == pytest.approx(0.3) and best_two.current_score == pytest.approx(0.3)
    state = checkpoint_io.load(str(tmp_path / "epoch=2.ckpt"))["callbacks"][best_two.state_key]
    assert state["kth_best_model_path"] == str(tmp_path / "epoch=2.ckpt")
    assert state["current_score"] == pytest.approx(0.3) and state["kth_value"] == pytest.approx(0.3)
    assert set(state["best_k_models"]) == {str(tmp_path / "epoch=1.ckpt"), str(tmp_path / "epoch=2.ckpt")}


@pytest.mark.parametrize(("mode", "kept_as"), [("min", float("inf")), ("max", float("-inf"))])
def test_a_nan_score_is_kept_as_the_worst_value(mode: Literal["min", "max"], kept_as: float, tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="score", mode=mode)
    trainer = quiet_trainer(max_epochs=2, callbacks=[checkpoint], logger=False)
    nan_then_good = [float("nan"), 0.5]
    trainer.fit(_Scored(nan_then_good), make_loader(16), make_loader(8))
    assert checkpoint.best_model_score == 0.5  # the NaN was kept (first), then replaced
    only_nan = ModelCheckpoint(dirpath=tmp_path / "nan", monitor="score", mode=mode)
    quiet_trainer(max_epochs=1, callbacks=[only_nan], logger=False).fit(
        _Scored([float("nan")]), make_loader(16), make_loader(8)
    )
    assert only_nan.best_model_score == kept_as and only_nan.current_score == kept_as


def test_a_metric_the_file_name_uses_before_it_is_logged_counts_as_zero(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}-{val_loss:.2f}", every_n_train_steps=2)
    quiet_trainer(max_epochs=1, callbacks=[checkpoint], logger=False).fit(Regressor(), make_loader(16))
    assert _files(tmp_path) == {"epoch=0-val_loss=0.00.ckpt"}


def test_to_yaml_writes_the_kept_files_and_their_scores(tmp_path: Any) -> None:
    best_two = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", monitor="score", save_top_k=2)
    quiet_trainer(max_epochs=3, callbacks=[best_two], logger=False).fit(
        _Scored([0.5, 0.25, 0.75]), make_loader(16), make_loader(8)
    )
    best_two.to_yaml()
    with open(tmp_path / "best_k_models.yaml") as file:
        assert yaml.safe_load(file) == {str(tmp_path / "epoch=0.ckpt"): 0.5, str(tmp_path / "epoch=1.ckpt"): 0.25}


# -------------------------------------------------------------------------------------- last
def test_last_is_named_by_checkpoint_name_last_which_may_hold_metrics(tmp_path: Any) -> None:
    class NamedLast(ModelCheckpoint):
        CHECKPOINT_NAME_LAST = "last-{epoch}"

    checkpoint = NamedLast(dirpath=tmp_path, save_last=True, save_top_k=0)
    quiet_trainer(max_epochs=2, callbacks=[checkpoint], logger=False).fit(Regressor(), make_loader(16))
    assert _files(tmp_path) == {"last-epoch=1.ckpt"}  # the previous one is replaced
    assert checkpoint.last_model_path == str(tmp_path / "last-epoch=1.ckpt")


def test_the_naming_characters_and_extension_are_class_attributes_that_last_finds_files_by(tmp_path: Any) -> None:
    assert (ModelCheckpoint.CHECKPOINT_JOIN_CHAR, ModelCheckpoint.CHECKPOINT_EQUALS_CHAR) == ("-", "=")
    assert (ModelCheckpoint.CHECKPOINT_NAME_LAST, ModelCheckpoint.FILE_EXTENSION) == ("last", ".ckpt")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    checkpoint.CHECKPOINT_JOIN_CHAR, checkpoint.CHECKPOINT_EQUALS_CHAR = "_", ":"
    checkpoint.CHECKPOINT_NAME_LAST, checkpoint.FILE_EXTENSION = "{epoch}-latest", ".pt"
    quiet_trainer(max_epochs=1, callbacks=[checkpoint], logger=False).fit(Regressor(), make_loader(16))
    assert _files(tmp_path) == {"epoch:0_step:2.pt", "epoch:0-latest.pt"}
    again = ModelCheckpoint(dirpath=tmp_path)
    again.FILE_EXTENSION = ".pt"
    resumed = quiet_trainer(max_epochs=2, callbacks=[again], logger=False)
    resumed.fit(Regressor(), make_loader(16), ckpt_path="last")  # found by its extension
    assert resumed.ckpt_path in {str(tmp_path / name) for name in ("epoch:0_step:2.pt", "epoch:0-latest.pt")}
    assert resumed.global_step == 4


@pytest.mark.parametrize(
    "schedule", [{"every_n_epochs": 0}, {"every_n_epochs": 5}, {"save_on_train_epoch_end": False}]
)  # the last: after validations, and there are none
def test_last_is_saved_when_training_ends_if_the_schedule_was_never_due(
    schedule: dict[str, Any], tmp_path: Any
) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True, **schedule)
    quiet_trainer(max_epochs=2, callbacks=[checkpoint], logger=False).fit(Regressor(), make_loader(16))
    assert _files(tmp_path) == {"last.ckpt"} and checkpoint.last_model_path == str(tmp_path / "last.ckpt")
    assert checkpoint_io.load(str(tmp_path / "last.ckpt"))["global_step"] == 4


def test_a_second_run_into_the_same_directory_versions_its_files(tmp_path: Any) -> None:
    for _ in range(2):
        checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_last=True)
        quiet_trainer(max_epochs=1, callbacks=[checkpoint], logger=False).fit(Regressor(), make_loader(16))
    assert _files(tmp_path) == {"epoch=0.ckpt", "last.ckpt", "epoch=0-v1.ckpt", "last-v1.ckpt"}
    assert checkpoint.best_model_path == str(tmp_path / "epoch=0-v1.ckpt")
    assert checkpoint.last_model_path == str(tmp_path / "last-v1.ckpt")


def test_without_the_version_counter_a_second_run_overwrites_the_files(tmp_path: Any) -> None:
    for _ in range(2):
        checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_last=True, enable_version_counter=False)
        quiet_trainer(max_epochs=1, callbacks=[checkpoint], logger=False).fit(Regressor(), make_loader(16))
    assert _files(tmp_path) == {"epoch=0.ckpt", "last.ckpt"}


def test_a_run_without_a_logger_keeps_its_checkpoints_in_the_root_checkpoints_directory(tmp_path: Any) -> None:
    root = str(tmp_path)
    last_too = ModelCheckpoint(save_last=True)
    trainer = quiet_trainer(max_epochs=1, default_root_dir=root, logger=False, callbacks=[last_too])
    trainer.fit(Regressor(), make_loader(16))
    assert trainer.checkpoint_callback is not None
    assert trainer.checkpoint_callback.dirpath == os.path.join(root, "checkpoints") == trainer.checkpoint_dir
    assert _files(tmp_path) == {"checkpoints"}  # no run directory of its own
    again = ModelCheckpoint(save_last=True)
    resumed = quiet_trainer(max_epochs=2, default_root_dir=root, logger=False, callbacks=[again])
    assert checkpoint_state.find_checkpoint(resumed, "last") is not None
    resumed.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert resumed.global_step == 4
    # The run continued in place replaces its "last", which its first save made a link to the top-k file.
    assert _files(tmp_path / "checkpoints") == {"epoch=1-step=4.ckpt", "last.ckpt"}
    assert again.last_model_path == os.path.join(root, "checkpoints", "last.ckpt")


# ---------------------------------------------------------------------------------- resuming
def test_the_checkpoint_a_fit_started_from_is_never_rotated_away(tmp_path: Any) -> None:
    def newest_two() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path, monitor="step", mode="max", save_top_k=2, every_n_train_steps=2)

    quiet_trainer(max_steps=4, callbacks=[newest_two()], logger=False).fit(Regressor(), make_loader(64))
    assert _files(tmp_path) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"}
    started_from = str(tmp_path / "epoch=0-step=4.ckpt")
    quiet_trainer(max_steps=8, callbacks=[newest_two()], logger=False).fit(
        Regressor(), make_loader(64), ckpt_path=started_from
    )
    assert _files(tmp_path) == {"epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"}


def test_another_directorys_state_gives_only_its_best_model_path(tmp_path: Any) -> None:
    written = ModelCheckpoint(dirpath=tmp_path / "first", monitor="score")
    written.best_model_path, written.best_model_score = "first/best.ckpt", torch.tensor(0.1)
    written.best_k_models = {"first/best.ckpt": torch.tensor(0.1)}
    restored = ModelCheckpoint(dirpath=tmp_path / "second", monitor="score")
    with pytest.warns(UserWarning, match="The dirpath has changed from"):
        restored.load_state_dict(written.state_dict())
    assert restored.best_model_path == "first/best.ckpt"
    assert restored.best_model_score is None and restored.best_k_models == {}


# ------------------------------------------------------------------------------- exceptions
def test_save_on_exception_keeps_the_work_since_the_last_checkpoint(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, save_last=True)
    trainer = quiet_trainer(max_epochs=3, callbacks=[checkpoint, _FailsAt(step=3)], logger=False)
    with pytest.raises(RuntimeError, match="trouble"):
        trainer.fit(Regressor(), make_loader(16))  # 2 steps an epoch: fails in the second
    assert _files(tmp_path) == {"epoch=0-step=2.ckpt", "epoch=1-step=3.ckpt", "last.ckpt"}
    assert checkpoint_io.load(str(tmp_path / "epoch=1-step=3.ckpt"))["global_step"] == 3
    assert checkpoint_io.load(str(tmp_path / "last.ckpt"))["global_step"] == 3
    resumed = quiet_trainer(max_epochs=3, callbacks=[ModelCheckpoint(dirpath=tmp_path)], logger=False)
    resumed.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert resumed.global_step == 6


def test_a_run_resumed_from_the_last_its_failure_saved_replaces_it(tmp_path: Any) -> None:
    def run(*callbacks: Callback) -> ember.Trainer:
        checkpoint = ModelCheckpoint(dirpath=tmp_path, save_on_exception=True, save_last=True)
        return quiet_trainer(max_epochs=1, callbacks=[checkpoint, *callbacks], logger=False)

    with pytest.raises(RuntimeError, match="trouble"):
        run(_FailsAt(step=1)).fit(Regressor(), make_loader(16))  # before any other save
    run().fit(Regressor(), make_loader(16), ckpt_path="last")
    assert _files(tmp_path) == {"epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"}


def test_save_on_exception_saves_nothing_when_the_step_was_just_saved(tmp_path: Any) -> None:
    every_step = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_on_exception=True)
    trainer = quiet_trainer(max_epochs=1, callbacks=[every_step, _FailsAt(step=1)], logger=False)
    with pytest.raises(RuntimeError, match="trouble"):
        trainer.fit(Regressor(), make_loader(16))
    assert _files(tmp_path) == {"step=1.ckpt"}


# ---------------------------------------------------------------------------- callback states
def test_callback_states_are_keyed_as_lightning_keys_them() -> None:
    checkpoint = ModelCheckpoint(monitor="val_loss")
    assert checkpoint.state_key == (
        "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, 'every_n_epochs': 1, "
        "'train_time_interval': None}"
    )
    assert EarlyStopping(monitor="val_loss").state_key == "EarlyStopping{'monitor': 'val_loss', 'mode': 'min'}"

    class Subclass(ModelCheckpoint):
        pass

    assert Subclass(monitor="val_loss").state_key.startswith(Subclass.__qualname__ + "{'monitor': 'val_loss'")


def test_a_checkpoint_holds_the_states_of_the_callbacks_that_have_one(tmp_path: Any) -> None:
    class Counting(Callback):
        def __init__(self, name: str) -> None:
            self.name = name

        @property
        def state_key(self) -> str:
            return settings_key(self, name=self.name)

        def state_dict(self) -> dict[str, Any]:
            return {"name": self.name}

    saving = ModelCheckpoint(dirpath=tmp_path, filename="all")
    callbacks = [Counting("one"), saving, ember.callbacks.LambdaCallback(), Counting("two")]
    quiet_trainer(max_steps=1, logger=False, callbacks=callbacks).fit(Regressor(), make_loader(8))
    saved = checkpoint_io.load(str(tmp_path / "all.ckpt"))["callbacks"]
    one, two = callbacks[0].state_key, callbacks[3].state_key
    assert sorted(saved) == sorted([saving.state_key, one, two]) and two.endswith("Counting{'name': 'two'}")
    assert saved[two] == {"name": "two"}


def test_model_checkpoints_state_takes_lightnings_and_holds_its_keys_and_types(tmp_path: Any) -> None:
    lightning_checkpoint_state = {
        "monitor": "score", "best_model_score": torch.tensor(0.25), "best_model_path": str(tmp_path / "a.ckpt"),
        "current_score": torch.tensor(0.5), "dirpath": str(tmp_path),
        "best_k_models": {str(tmp_path / "a.ckpt"): torch.tensor(0.25), str(tmp_path / "b.ckpt"): torch.tensor(0.5)},
        "kth_best_model_path": str(tmp_path / "b.ckpt"), "kth_value": torch.tensor(0.5), "last_model_path": "",
    }  # fmt: skip
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="score", save_top_k=2)
    checkpoint.load_state_dict(lightning_checkpoint_state)
    assert checkpoint.kth_best_model_path == str(tmp_path / "b.ckpt") and checkpoint.best_model_score == 0.25
    state = checkpoint.state_dict()
    assert set(state) == set(lightning_checkpoint_state)
    assert isinstance(state["best_model_score"], torch.Tensor) and isinstance(state["kth_value"], torch.Tensor)


def test_early_stoppings_state_takes_lightnings_and_holds_its_keys_and_types() -> None:
    stopper = EarlyStopping(monitor="score")
    stopper.load_state_dict({"wait_count": 1, "stopped_epoch": 0, "best_score": torch.tensor(0.25), "patience": 3})
    state = stopper.state_dict()
    assert stopper.best_score == 0.25 and state["best_score"].dtype == torch.float64  # exact, for resuming
    assert {"wait_count", "stopped_epoch", "best_score", "patience"} <= set(state)


# ------------------------------------------------------------------------------------ names, contents, order
def test_a_slash_in_the_file_name_or_a_metric_name_makes_a_subdirectory(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, filename="{val/acc:.2f}")
    assert checkpoint.format_checkpoint_name({"val/acc": 0.5}) == str(tmp_path / "val" / "acc=0.50.ckpt")
    named = checkpoint.format_checkpoint_name({"val/acc": 0.5}, prefix="run", ver=2)  # Lightning's arguments
    assert named == str(tmp_path / "run-val" / "acc=0.50-v2.ckpt")
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="score", filename="runs/{epoch}")
    quiet_trainer(max_epochs=3, limit_train_batches=1, callbacks=[checkpoint], logger=False).fit(
        _Scored([2.0, 1.0, 3.0]), make_loader(), make_loader(8)
    )
    # the best is kept in the subdirectory, and the file it replaced there is removed
    assert checkpoint.best_model_path == str(tmp_path / "runs" / "epoch=1.ckpt")
    assert _files(tmp_path / "runs") == {"epoch=1.ckpt"}


class _Keeping(ember.DataModule):
    def __init__(self, size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.calls: list[str] = []

    def train_dataloader(self) -> Any:
        return make_loader(self.hparams.size)

    def state_dict(self) -> dict[str, Any]:
        return {"kept": 1}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append("datamodule.load_state_dict")


class _Noting(Callback):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.calls.append("callback.on_save_checkpoint")

    def on_load_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.calls.append("callback.on_load_checkpoint")


class _Adding(Regressor):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["added"] = True


def test_a_weights_only_checkpoint_keeps_the_datamodule_and_what_the_module_adds(tmp_path: Any) -> None:
    datamodule = _Keeping(size=8)
    calls = datamodule.calls
    trainer = quiet_trainer(max_epochs=1, callbacks=[_Noting(calls)], logger=False, default_root_dir=tmp_path)
    trainer.fit(_Adding(), datamodule=datamodule)
    datamodule.calls.clear()
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    saved = checkpoint_io.load(tmp_path / "weights.ckpt")
    assert saved["_Keeping"] == {"kept": 1} and saved["datamodule_hyper_parameters"] == {"size": 8}
    assert saved["added"] and "callbacks" not in saved and "optimizer_states" not in saved
    assert datamodule.calls == []  # the callbacks' on_save_checkpoint is for full checkpoints only
    assert _Keeping.load_from_checkpoint(tmp_path / "weights.ckpt").hparams.size == 8


class _Unconfigured(Regressor):
    """A Regressor whose __init__ saves no hyperparameters."""

    def __init__(self) -> None:
        ember.Module.__init__(self)
        self.layer = torch.nn.Linear(4, 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _Stateless(ember.DataModule):
    def train_dataloader(self) -> Any:
        return make_loader(16)


def test_a_checkpoint_has_no_hyperparameter_or_datamodule_entries_where_they_are_empty(tmp_path: Any) -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, default_root_dir=tmp_path)
    trainer.fit(_Unconfigured(), datamodule=_Stateless())
    path = trainer.checkpoint_callback.best_model_path
    saved = checkpoint_io.load(path)
    # As in Lightning, whose programs test for these keys to know whether there is anything under them.
    assert "hyper_parameters" not in saved and "datamodule_hyper_parameters" not in saved
    assert "_Stateless" not in saved
    assert not _Unconfigured.load_from_checkpoint(path).hparams
    assert not _Stateless.load_from_checkpoint(path).hparams
    trainer = quiet_trainer(max_epochs=2, logger=False, default_root_dir=tmp_path)
    trainer.fit(_Unconfigured(), datamodule=_Stateless(), ckpt_path=path)
    assert trainer.current_epoch == 2


def test_a_resumed_fit_gives_the_datamodule_its_state_before_the_callbacks_get_theirs(tmp_path: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    quiet_trainer(max_epochs=1, callbacks=[checkpoint], logger=False).fit(Regressor(), datamodule=_Keeping())
    datamodule = _Keeping()
    trainer = quiet_trainer(max_epochs=2, callbacks=[_Noting(datamodule.calls)], logger=False)
    trainer.fit(Regressor(), datamodule=datamodule, ckpt_path=checkpoint.best_model_path)
    assert datamodule.calls[:2] == ["datamodule.load_state_dict", "callback.on_load_checkpoint"]


def test_model_checkpoints_run_after_the_other_callbacks_and_save_what_early_stopping_decided(tmp_path: Any) -> None:
    checkpoint, stopping = ModelCheckpoint(dirpath=tmp_path, save_last=True), EarlyStopping("score", patience=1)
    trainer = quiet_trainer(max_epochs=5, limit_train_batches=1, callbacks=[checkpoint, stopping], logger=False)
    assert trainer.callbacks[-2:] == [stopping, checkpoint]
    trainer.fit(_Scored([2.0, 3.0, 3.0]), make_loader(), make_loader(8))
    saved = checkpoint_io.load(checkpoint.last_model_path)["callbacks"][stopping.state_key]
    assert stopping.stopped_epoch == 1 and saved["wait_count"] == 1 and saved["stopped_epoch"] == 1


def test_load_from_checkpoint_takes_hyperparameters_from_a_yaml_file_under_the_keyword_arguments(tmp_path: Any) -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, default_root_dir=tmp_path)
    trainer.fit(Regressor(lr=0.2), make_loader())
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    (tmp_path / "hparams.yaml").write_text("lr: 0.3\n")
    assert Regressor.load_from_checkpoint(tmp_path / "model.ckpt", hparams_file=None).hparams.lr == 0.2
    loaded = Regressor.load_from_checkpoint(tmp_path / "model.ckpt", hparams_file=tmp_path / "hparams.yaml")
    assert dict(loaded.hparams) == {"lr": 0.3, "features": 4}
    given = Regressor.load_from_checkpoint(tmp_path / "model.ckpt", hparams_file=tmp_path / "hparams.yaml", lr=0.4)
    assert given.hparams.lr == 0.4
    with pytest.raises(ValueError, match=r"hparams_file=.*\.yml or \.yaml"):
        Regressor.load_from_checkpoint(tmp_path / "model.ckpt", hparams_file=tmp_path / "hparams.txt")


def test_a_yaml_hparams_file_takes_the_place_of_the_checkpoints_hyperparameters(tmp_path: Any) -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, default_root_dir=tmp_path)
    trainer.fit(Regressor(lr=0.2), make_loader())
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    (tmp_path / "hparams.yaml").write_text("features: 4\n")
    # As in Lightning: what the file leaves out comes from __init__'s defaults, not from the checkpoint.
    loaded = Regressor.load_from_checkpoint(tmp_path / "model.ckpt", hparams_file=tmp_path / "hparams.yaml")
    assert dict(loaded.hparams) == {"lr": 0.05, "features": 4}


def test_load_from_checkpoint_called_on_an_instance_is_refused_as_it_would_change_nothing(tmp_path: Any) -> None:
    module = Regressor()
    assert callable(module.load_from_checkpoint)  # it can be read, as inspecting a module does
    with pytest.raises(TypeError, match=r"`Regressor.load_from_checkpoint` cannot be called on an instance"):
        module.load_from_checkpoint(tmp_path / "model.ckpt")
    with pytest.raises(TypeError, match="cannot be called on an instance"):
        _Keeping().load_from_checkpoint(tmp_path / "model.ckpt")


def test_validating_from_a_checkpoint_gives_the_datamodule_its_state_but_leaves_the_callbacks_as_they_are(
    tmp_path: Any,
) -> None:
    class Validated(_Keeping):
        def val_dataloader(self) -> Any:
            return make_loader(self.hparams.size)

    checkpoint = ModelCheckpoint(dirpath=tmp_path)
    quiet_trainer(max_epochs=1, callbacks=[checkpoint], logger=False).fit(Regressor(), datamodule=Validated())
    datamodule = Validated()
    trainer = quiet_trainer(callbacks=[_Noting(datamodule.calls)], logger=False)
    trainer.validate(Regressor(), datamodule=datamodule, ckpt_path=checkpoint.best_model_path, verbose=False)
    # A fit's ModelCheckpoint given its state back would forget the files it kept after the loaded one.
    assert datamodule.calls == ["datamodule.load_state_dict"]


def test_verbose_checkpointing_says_what_ranks_in_lightnings_words(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="score", verbose=True)
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=1, callbacks=[checkpoint], logger=False)
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer.fit(_Scored([2.0, 3.0]), make_loader(), make_loader(8))
    said = [record.getMessage() for record in caplog.records if record.getMessage().startswith("Epoch")]
    path = str(tmp_path / "epoch=0-step=1.ckpt")
    assert said == [
        f"Epoch 0, global step 1: 'score' reached 2.00000 (best 2.00000), saving model to {path!r} as top 1",
        "Epoch 1, global step 2: 'score' was not in top 1",
    ]


def test_load_from_checkpoint_reads_an_open_file_bytes_in_memory_or_a_url(tmp_path: Any, monkeypatch: Any) -> None:
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    model = Regressor()
    trainer.fit(model, make_loader())
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    with open(path, "rb") as file:  # as Lightning's, which reads a path or a file-like object
        loaded = Regressor.load_from_checkpoint(file)
    assert torch.equal(loaded.layer.weight, model.layer.weight)
    loaded = Regressor.load_from_checkpoint(io.BytesIO(path.read_bytes()))
    assert torch.equal(loaded.layer.weight, model.layer.weight)
    # A URL: downloaded into torch hub's cache under $TORCH_HOME, as Lightning does.
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub-home"))
    serve = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), serve) as server:
        threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True).start()  # polls: a quick stop
        loaded = Regressor.load_from_checkpoint(f"http://127.0.0.1:{server.server_address[1]}/model.ckpt")
        server.shutdown()
    assert torch.equal(loaded.layer.weight, model.layer.weight)
    assert os.path.isfile(tmp_path / "hub-home" / "hub" / "checkpoints" / "model.ckpt")
    with pytest.raises(checkpoint_io.CheckpointError, match="'not-a-checkpoint' is not a readable checkpoint"):
        named = io.BytesIO(b"PK\x03\x04 cut short")
        named.name = "not-a-checkpoint"  # type: ignore[misc]
        Regressor.load_from_checkpoint(named)


def test_a_lenient_load_from_checkpoint_warns_of_the_weights_either_side_lacks(tmp_path: Any) -> None:
    class Wider(Regressor):
        def __init__(self, lr: float = 0.05, features: int = 4) -> None:
            super().__init__(lr, features)
            self.head = torch.nn.Linear(1, 1)

    trainer = quiet_trainer(max_epochs=1, logger=False, default_root_dir=tmp_path)
    trainer.fit(Regressor(), make_loader())
    trainer.save_checkpoint(tmp_path / "narrow.ckpt")
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head.weight", "head.bias"'):
        Wider.load_from_checkpoint(tmp_path / "narrow.ckpt")
    with pytest.warns(UserWarning, match=r"in the model state dict but not in the checkpoint: \['head.weight', 'h"):
        Wider.load_from_checkpoint(tmp_path / "narrow.ckpt", strict=False)
    torch.save({**torch.load(tmp_path / "narrow.ckpt"), "state_dict": Wider().state_dict()}, tmp_path / "wide.ckpt")
    with pytest.warns(UserWarning, match=r"not in the model state dict but in the checkpoint: \['head.weight', 'h"):
        Regressor.load_from_checkpoint(tmp_path / "wide.ckpt", strict=False)


def test_strict_loading_false_lets_a_stage_and_load_from_checkpoint_leave_weights_out(tmp_path: Any) -> None:
    class Headed(Regressor):
        def __init__(self, lr: float = 0.05, features: int = 4, lenient: bool = False) -> None:
            super().__init__(lr, features)
            self.head = torch.nn.Linear(1, 1)  # not in the checkpoint: loaded from elsewhere
            if lenient:
                self.strict_loading = False

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", torch.nn.functional.mse_loss(self.head(self(batch[0])), batch[1]))

    trainer = quiet_trainer(max_epochs=1, logger=False, default_root_dir=tmp_path)
    trainer.fit(Regressor(), make_loader())
    trainer.save_checkpoint(tmp_path / "body.ckpt")
    assert Regressor().strict_loading
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head.weight"'):
        quiet_trainer(logger=False).test(Headed(), make_loader(), ckpt_path=tmp_path / "body.ckpt", verbose=False)
    tested = quiet_trainer(logger=False).test(Headed(lenient=True), make_loader(), ckpt_path=tmp_path / "body.ckpt")
    assert set(tested[0]) == {"test_loss"}
    assert not Headed.load_from_checkpoint(tmp_path / "body.ckpt", lenient=True).strict_loading
    with pytest.raises(ValueError, match=r"strict=True\)` which is in conflict with `Headed.strict_loading=False"):
        Headed.load_from_checkpoint(tmp_path / "body.ckpt", strict=True, lenient=True)


def test_a_checkpoint_path_set_on_the_trainer_is_loaded_by_the_next_stages_until_one_is_given_another(
    tmp_path: Any,
) -> None:
    every_epoch = ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1)
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=1, logger=False, callbacks=[every_epoch])
    model = Regressor()
    trainer.fit(model, make_loader(8))
    first, last = str(tmp_path / "epoch=0.ckpt"), str(tmp_path / "epoch=1.ckpt")
    assert trainer.ckpt_path is None  # the fit loaded none
    trainer.ckpt_path = first
    loaded: list[str | None] = []
    for _ in range(2):
        trainer.test(model, make_loader(8), verbose=False)
        loaded.append(trainer.ckpt_path)
    with pytest.warns(UserWarning, match="`trainer.ckpt_path = .*` was called but then you passed"):
        trainer.test(model, make_loader(8), ckpt_path=last, verbose=False)
    loaded.append(trainer.ckpt_path)
    trainer.test(model, make_loader(8), verbose=False)  # the path given took the place of the one set
    assert [*loaded, trainer.ckpt_path] == [first, first, last, None]
