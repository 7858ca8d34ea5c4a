"""ModelCheckpoint as Lightning's users know it: its options, names, attributes, callback states and errors."""

from __future__ import annotations

import pytest
from conftest import quiet_trainer

from ember.callbacks import ModelCheckpoint
from ember.exceptions import MisconfigurationException


def test_checkpointing_turned_off_with_a_model_checkpoint_given_is_a_misconfiguration() -> None:
    with pytest.raises(MisconfigurationException, match="`enable_checkpointing=False` but found `ModelCheckpoint`"):
        quiet_trainer(enable_checkpointing=False, callbacks=[ModelCheckpoint()])
