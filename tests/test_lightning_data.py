"""Data loading as Lightning programs expect it: steps and loader hooks switched off with None, several training
loaders, the loaders the Trainer shows, when loaders are asked for, and the datamodule's own behaviour."""

from __future__ import annotations

import pytest
from conftest import Regressor, make_loader, quiet_trainer
from torch.utils.data import DataLoader


# --------------------------------------------------------------------------- switched off with None
def test_validation_step_set_to_none_skips_validation() -> None:
    model = Regressor()
    model.validation_step = None  # type: ignore[assignment,method-assign]
    model.val_dataloader = None  # type: ignore[attr-defined]
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False, num_sanity_val_steps=2)
    trainer.fit(model, make_loader(16), make_loader(16))
    assert trainer.global_step == 2 and not trainer.validation_enabled


def test_a_loader_hook_set_to_none_is_absent() -> None:
    class WithLoaders(Regressor):
        def train_dataloader(self) -> DataLoader:
            return make_loader(16)

        def val_dataloader(self) -> DataLoader:
            raise AssertionError("switched off: never called")

    model = WithLoaders()
    model.val_dataloader = None  # type: ignore[assignment,method-assign]
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(model)
    assert trainer.global_step == 2 and trainer.num_val_batches == []
    model.test_step = None  # type: ignore[assignment,method-assign]
    with pytest.raises(NotImplementedError, match="test_step"):
        trainer.test(model, make_loader(8))
