"""``TQDMProgressBar`` as Lightning's users know it: its tqdm bars, their totals, titles and counts, ``refresh_rate``,
``leave``, printing through the bar, and ``Tqdm`` replaceable where Lightning's tests replace it."""

from __future__ import annotations

import pickle
import sys
from typing import Any
from unittest.mock import Mock

import pytest
import torch
from conftest import Regressor, make_loader

import ember
from ember import lightning_compat
from ember.callbacks import TQDMProgressBar, tqdm_progress
from ember.callbacks.tqdm_progress import Tqdm
from ember.lightning_compat.hook import ROOTS


class Recording(Tqdm):
    """A bar that keeps each count it is drawn at (after 0) and each title, with its total."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts: list[int] = []
        self.titles: list[tuple[str, int | None]] = []

    def refresh(self, *args: Any, **kwargs: Any) -> Any:
        counts = getattr(self, "counts", None)  # tqdm draws while it is made
        if counts is not None and self.n and (not counts or counts[-1] != self.n):
            counts.append(self.n)
        return super().refresh(*args, **kwargs)

    def set_description(self, desc: Any = None, refresh: bool = True) -> None:
        super().set_description(desc, refresh)
        self.titles.append((self.desc, self.total))


class Printing(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.print("train", end="")
        return super().training_step(batch, batch_idx)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.print("test", 1, sep="-")
        super().test_step(batch, batch_idx, dataloader_idx)


def _trainer(bar: TQDMProgressBar, **flags: Any) -> ember.Trainer:
    quiet = dict(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False)
    return ember.Trainer(callbacks=[bar], **{**quiet, **flags})


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tqdm_progress, "Tqdm", Recording)


@pytest.mark.parametrize(
    ("value", "shown"), [(1, "1"), (1.0, "1.000"), (0.25, "0.250"), (1e-5, "1e-5"), ("2.5", "2.500"), ("word", "word")]
)
def test_tqdm_pads_floats_to_three_decimals(value: Any, shown: str) -> None:
    assert Tqdm.format_num(value) == shown


@pytest.mark.usefixtures("recording")
def test_bars_move_every_refresh_rate_batches_and_at_the_last() -> None:
    bar = TQDMProgressBar(refresh_rate=3)
    trainer = _trainer(bar, num_sanity_val_steps=0, limit_val_batches=2)
    trainer.fit(Regressor(), make_loader(40), make_loader(16))  # 5 training batches, 2 of validation
    assert bar.train_progress_bar.titles == [("Epoch 0: ", 5)] and bar.train_progress_bar.counts == [3, 5]
    assert bar.train_progress_bar.leave
    assert bar.val_progress_bar.counts == [2] and not bar.val_progress_bar.leave
    trainer.test(Regressor(), make_loader(24), verbose=False)
    assert bar.test_progress_bar.counts == [3] and bar.test_progress_bar.leave


@pytest.mark.usefixtures("recording")
def test_each_evaluation_loader_gets_its_total_and_title_and_the_sanity_check_its_own() -> None:
    bar = TQDMProgressBar()
    trainer = _trainer(bar, num_sanity_val_steps=1, limit_train_batches=0)
    trainer.fit(Regressor(), make_loader(16), [make_loader(16), make_loader(8)])
    assert bar.val_progress_bar.titles == [("Sanity Checking DataLoader 0: ", 1), ("Sanity Checking DataLoader 1: ", 1)]
    trainer.validate(Regressor(), [make_loader(16), make_loader(8)], verbose=False)
    assert bar.val_progress_bar.titles == [("Validation DataLoader 0: ", 2), ("Validation DataLoader 1: ", 1)]
    assert bar.val_progress_bar.counts == [1, 2, 1]
    assert bar.val_progress_bar.leave  # validate's bar stays; fit's goes


def test_leave_makes_a_bar_per_epoch() -> None:
    for leave, bars in ((True, 3), (False, 1)):
        bar = TQDMProgressBar(leave=leave)
        bar.init_train_tqdm = Mock(wraps=bar.init_train_tqdm)  # type: ignore[method-assign]
        _trainer(bar, max_epochs=2, limit_val_batches=0).fit(Regressor(), make_loader(16))
        assert bar.init_train_tqdm.call_count == bars  # one when training starts, and one per epoch to leave


def test_print_goes_through_the_bar_drawn_or_to_print_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    written, printed = Mock(), Mock()
    monkeypatch.setattr(Tqdm, "write", written)
    monkeypatch.setattr("builtins.print", printed)
    trainer = _trainer(TQDMProgressBar(), max_steps=1, limit_val_batches=0)
    trainer.fit(Printing(), make_loader(16))
    trainer.test(Printing(), make_loader(8), verbose=False)
    assert [call.args for call in written.call_args_list] == [("train",), ("test-1",)]
    assert written.call_args_list[0].kwargs == {"end": ""}
    off = TQDMProgressBar()
    off.disable()
    _trainer(off, max_steps=1, limit_val_batches=0).fit(Printing(), make_loader(16))
    assert printed.call_args_list[-1].args == ("train",) and printed.call_args_list[-1].kwargs == {"end": ""}


def test_a_bar_is_read_after_its_loop_made_it_and_pickles_without_its_bars() -> None:
    bar = TQDMProgressBar()
    with pytest.raises(TypeError, match=r"TQDMProgressBar.train_progress_bar` has not been made yet"):
        _ = bar.train_progress_bar
    _trainer(bar, limit_val_batches=0).fit(Regressor(), make_loader(16))
    assert bar.train_progress_bar.n == 2
    copy = pickle.loads(pickle.dumps(bar))
    with pytest.raises(TypeError):
        _ = copy.train_progress_bar


def test_lightning_s_tqdm_module_is_ember_s_so_replacing_tqdm_there_replaces_the_bars() -> None:
    aside = {name: module for name, module in sys.modules.items() if name.partition(".")[0] in ROOTS}
    for name in aside:
        del sys.modules[name]
    lightning_compat.install()
    try:
        from lightning.pytorch.callbacks.progress import tqdm_progress as served
        from pytorch_lightning.callbacks.progress.tqdm_progress import Tqdm as Served

        assert served is tqdm_progress and Served is Tqdm
    finally:
        lightning_compat.uninstall()
        sys.modules.update(aside)
    assert "lightning.pytorch.callbacks.progress.tqdm_progress" not in sys.modules
