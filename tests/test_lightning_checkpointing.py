"""ModelCheckpoint as Lightning's users know it: its options, names, attributes, callback states and errors."""

from __future__ import annotations

import os
from typing import Any

import pytest
from conftest import Regressor, make_loader, quiet_trainer

from ember.callbacks import ModelCheckpoint
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

