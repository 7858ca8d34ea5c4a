"""Failures that say where they are: data errors name the sample and worker, steps that train nothing are
reported, a loss without a graph says why."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import warm_processes
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
    # The original error is chained (from a worker, as the DataLoader re-raises it: same type, its traceback).
    assert isinstance(raised.value.__cause__, ValueError) and "corrupt record" in str(raised.value.__cause__)


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        for index, sample in enumerate(make_data(32)):
            if index == 9:
                raise OSError("connection to the bucket lost")
            yield sample


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 1])
def test_an_iterable_dataset_that_fails_names_the_epoch_batch_and_worker(workers: int) -> None:
    loader = DataLoader(_Stream(), batch_size=4, num_workers=workers)
    where = ", worker 0" if workers else ""
    with pytest.raises(DataLoadingError, match=rf"epoch 0 failed at batch 2{where}: .*connection to the bucket lost"):
        quiet_trainer(max_epochs=1, logger=False).fit(Regressor(), loader)


class _FailsAtStep2(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("a bug in training_step")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            raise RuntimeError("a bug in validation_step")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("a bug in predict_step")
        return self(batch[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("stage", "step"), [("fit", "training"), ("validate", "validation"), ("predict", "predict")])
def test_a_step_that_raises_ends_the_loader_workers_at_once(stage: str, step: str) -> None:
    loader = DataLoader(make_data(64), batch_size=4, num_workers=2)
    trainer = quiet_trainer(max_epochs=1, logger=False)
    with pytest.raises(RuntimeError, match=f"a bug in {step}_step"):
        getattr(trainer, stage)(_FailsAtStep2(), loader)
    # The traceback held by pytest.raises refers to the loop; the workers must not wait for it to go.
    assert not [child for child in multiprocessing.active_children() if child.is_alive()]


@pytest.mark.timeout(60)
def test_a_script_whose_step_raises_with_workers_exits(tmp_path: Any) -> None:
    """The uncaught error ends the process: the interpreter's exit does not wait for the workers."""
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from torch.utils.data import DataLoader\n"
        "from conftest import make_data, quiet_trainer\n"
        "from test_failures import _FailsAtStep2\n"
        "loader = DataLoader(make_data(64), batch_size=4, num_workers=2)\n"
        "quiet_trainer(max_epochs=1, logger=False).fit(_FailsAtStep2(), loader)\n"
    )
    done = warm_processes.run([sys.executable, str(script)], capture_output=True, text=True, timeout=45, cwd=tmp_path)
    assert done.returncode == 1 and "RuntimeError: a bug in training_step" in done.stderr


def test_a_failing_validation_sample_is_named_too() -> None:
    with pytest.raises(DataLoadingError, match=r"val dataloader 0 in epoch 0 failed at batch 3, sample index 13"):
        quiet_trainer(logger=False).validate(Regressor(), DataLoader(_Broken(), batch_size=4), verbose=False)
    trainer = quiet_trainer(max_epochs=2, check_val_every_n_epoch=2, logger=False)
    with pytest.raises(DataLoadingError, match=r"val dataloader 0 in epoch 1 failed at batch 3, sample index 13"):
        trainer.fit(Regressor(), make_loader(16), DataLoader(_Broken(), batch_size=4))


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
