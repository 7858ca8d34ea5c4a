"""The Trainer's public behaviour as Lightning's: its loop's state, its interrupts and what it says it runs on."""

from __future__ import annotations

import pytest
from conftest import Regressor, make_loader, quiet_trainer


@pytest.mark.parametrize(
    ("max_epochs", "max_steps", "done"),
    [(-1, -1, False), (3, -1, False), (-1, 5, False), (0, -1, True), (-1, 0, True), (None, 0, True)],
)
def test_fit_loop_done_says_whether_a_limit_leaves_nothing_to_train(
    max_epochs: int | None, max_steps: int, done: bool
) -> None:
    trainer = quiet_trainer(max_epochs=max_epochs, max_steps=max_steps, logger=False)
    assert trainer.fit_loop.done is done


def test_fit_loop_done_once_the_fit_reached_its_limit() -> None:
    trainer = quiet_trainer(max_steps=2, logger=False, enable_checkpointing=False)
    trainer.fit(Regressor(), make_loader(8), make_loader(8))
    assert trainer.global_step == 2 and trainer.fit_loop.done is True
