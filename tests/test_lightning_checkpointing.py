"""ModelCheckpoint as Lightning's users know it: its options, names, attributes, callback states and errors."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer

from ember.callbacks import EarlyStopping, ModelCheckpoint
from ember.checkpoint import state as checkpoint_state
from ember.exceptions import MisconfigurationException


def _files(directory: Any) -> set[str]:
    return set(os.listdir(directory))


def test_checkpointing_turned_off_with_a_model_checkpoint_given_is_a_misconfiguration() -> None:
    with pytest.raises(MisconfigurationException, match="`enable_checkpointing=False` but found `ModelCheckpoint`"):
        quiet_trainer(enable_checkpointing=False, callbacks=[ModelCheckpoint()])


def test_a_run_without_a_logger_keeps_its_checkpoints_in_the_root_checkpoints_directory(tmp_path: Any) -> None:
    root = str(tmp_path)
    last_too = ModelCheckpoint(save_last=True)
    trainer = quiet_trainer(max_epochs=1, default_root_dir=root, logger=False, callbacks=[last_too])
    trainer.fit(Regressor(), make_loader(16))
    assert trainer.checkpoint_callback is not None
    assert trainer.checkpoint_callback.dirpath == os.path.join(root, "checkpoints") == trainer.checkpoint_dir
    assert _files(tmp_path) == {"checkpoints"}  # no run directory of its own
    resumed = quiet_trainer(max_epochs=2, default_root_dir=root, logger=False, callbacks=[ModelCheckpoint()])
    assert checkpoint_state.find_checkpoint(resumed, "last") is not None
    resumed.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert resumed.global_step == 4
    assert _files(tmp_path / "checkpoints") == {"epoch=1-step=4.ckpt", "last.ckpt"}


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


def test_early_stoppings_state_takes_lightnings_and_holds_its_keys_and_types() -> None:
    stopper = EarlyStopping(monitor="score")
    stopper.load_state_dict({"wait_count": 1, "stopped_epoch": 0, "best_score": torch.tensor(0.25), "patience": 3})
    state = stopper.state_dict()
    assert stopper.best_score == 0.25 and state["best_score"].dtype == torch.float64  # exact, for resuming
    assert {"wait_count", "stopped_epoch", "best_score", "patience"} <= set(state)
