"""Failures that say where they are: data errors name the sample and worker, steps that train nothing are
reported, a loss without a graph says why."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Regressor, make_data, make_loader, quiet_trainer
from torch.utils.data import DataLoader, Dataset, IterableDataset

import ember
from ember.data import DataLoadingError


class _Broken(Dataset):
    """Sample 13 cannot be read."""

    def __init__(self) -> None:
        self.data = make_data(32)

    def __getitem__(self, index: int) -> Any:
        if index == 13:
            raise ValueError("corrupt record")
        return self.data[index]

    def __len__(self) -> int:
        return 32


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_fails_to_load_is_named_with_its_batch_epoch_and_worker(workers: int) -> None:
    loader = DataLoader(_Broken(), batch_size=4, num_workers=workers)  # sample 13 is in batch 3
    with pytest.raises(DataLoadingError) as raised:
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), loader)
    message = str(raised.value)
    assert "the train dataloader in epoch 0 failed at batch 3, sample index 13" in message
    assert "ValueError: corrupt record" in message
    assert ("worker " in message) == (workers > 0)
    original = raised.value.__cause__
    while original is not None and original.__cause__ is not None:
        original = original.__cause__
    assert original is not None  # the original error is chained


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        for index, sample in enumerate(make_data(32)):
            if index == 9:
                raise OSError("connection to the bucket lost")
            yield sample


@pytest.mark.timeout(60)
def test_an_iterable_dataset_that_fails_names_the_batch_and_the_worker() -> None:
    loader = DataLoader(_Stream(), batch_size=4, num_workers=1)
    with pytest.raises(DataLoadingError, match=r"failed at batch 2, worker 0: .*connection to the bucket lost"):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), loader)


def test_a_failing_validation_sample_is_named_too() -> None:
    with pytest.raises(DataLoadingError, match=r"val dataloader 0 failed at batch 3, sample index 13"):
        quiet_trainer(logger=False).validate(Regressor(), DataLoader(_Broken(), batch_size=4), verbose=False)


def test_an_epoch_in_which_every_step_skipped_its_batch_is_reported_once() -> None:
    class Skipping(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

    trainer = quiet_trainer(max_epochs=3, logger=False)
    with pytest.warns(
        UserWarning, match="epoch 0 ended without an optimizer step: training_step returned None"
    ) as caught:
        trainer.fit(Skipping(), make_loader(16))
    assert len([w for w in caught if "without an optimizer step" in str(w.message)]) == 1
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    ("compute", "cause"),
    [
        (lambda module, x, y: torch.nn.functional.mse_loss(module(x), y).detach(), r"\.detach\(\)"),
        (lambda module, x, y: torch.tensor(torch.nn.functional.mse_loss(module(x), y).item()), r"torch\.tensor"),
        (lambda module, x, y: _frozen(module, x, y), "every parameter of the module is frozen"),
    ],
)
def test_a_loss_without_a_graph_says_why(compute: Any, cause: str) -> None:
    class NoGraph(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return compute(self, x, y)

    with pytest.raises(ValueError, match=f"loss that does not require grad: .*{cause}"):
        quiet_trainer(max_epochs=1, logger=False).fit(NoGraph(), make_loader(16))


def _frozen(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    module.requires_grad_(False)
    return torch.nn.functional.mse_loss(module(x), y)


@pytest.mark.parametrize("value", [0, -3, True, "10 minutes"])
def test_the_timeout_flag_takes_a_positive_duration(value: Any) -> None:
    with pytest.raises(ValueError, match=f"timeout={value!r}: expected a number of seconds > 0"):
        ember.Trainer(timeout=value)
