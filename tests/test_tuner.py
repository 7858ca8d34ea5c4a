"""The batch-size and learning-rate finders, the loader-worker suggestion."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import make_data, make_loader, parameters_of, quiet_trainer
from torch.utils.data import DataLoader

import ember
from ember.exceptions import MisconfigurationException
from ember.tuner import Tuner


class _Sized(ember.Module):
    """Builds its loader at ``hparams.batch_size``; batches above ``limit`` samples do not fit in memory."""

    def __init__(self, batch_size: int = 8, lr: float = 0.01, limit: int = 10**9, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if len(x) > self.hparams.limit:
            raise torch.OutOfMemoryError(f"{len(x)} samples do not fit")
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(256), batch_size=self.hparams.batch_size, shuffle=True)


@pytest.mark.parametrize(
    ("mode", "init_val", "found"),
    # From a size that does not fit, power mode halves it until one fits, then keeps it when its double does not
    # fit (Lightning's: init_val times a power of two); binsearch bisects.
    [("power", 2, 32), ("binsearch", 2, 40), ("power", 100, 25), ("binsearch", 100, 40)],
)
def test_the_largest_batch_that_fits_is_found_and_set(mode: str, init_val: int, found: int) -> None:
    model = _Sized(limit=40)
    before = parameters_of(model)
    size = Tuner(quiet_trainer()).scale_batch_size(model, mode=mode, init_val=init_val, steps_per_trial=2, margin=0.0)
    assert size == found and model.hparams.batch_size == found
    assert all(torch.equal(a, b) for a, b in zip(parameters_of(model), before, strict=True))  # weights put back


class _CpuBound(_Sized):
    """Above ``limit`` samples, asks the CPU's allocator for a petabyte (the plain RuntimeError it raises), or, when
    ``broken``, feeds its layer the wrong number of features (a RuntimeError that is no lack of memory)."""

    def __init__(self, limit: int, broken: bool = False) -> None:
        super().__init__(limit=limit)
        self.broken = broken

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if len(x) > self.hparams.limit:
            x = x[:, :3] if self.broken else torch.empty(2**50, dtype=torch.uint8)
        return F.mse_loss(self.layers(x), y)


def test_the_cpu_allocators_error_is_running_out_of_memory_and_other_errors_are_raised() -> None:
    assert Tuner(quiet_trainer()).scale_batch_size(_CpuBound(limit=40), init_val=2, steps_per_trial=1) == 32
    auto = quiet_trainer(max_epochs=1, accumulate_grad_batches="auto", logger=False)
    auto.fit(_CpuBound(limit=8), make_loader(32, batch_size=32))
    assert auto.fit_loop.runner.micro_batches == 4
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        Tuner(quiet_trainer()).scale_batch_size(_CpuBound(limit=40, broken=True), init_val=2, steps_per_trial=1)


def test_a_binary_search_keeps_a_margin_and_no_size_passes_max_val() -> None:
    # As Lightning's defaults: 5% below the largest size that fit (40), and sizes up to 8192.
    assert Tuner(quiet_trainer()).scale_batch_size(_Sized(limit=40), mode="binsearch", steps_per_trial=1) == 38
    assert Tuner(quiet_trainer()).scale_batch_size(_Sized(limit=40), mode="power", max_val=24) == 24
    with pytest.raises(MisconfigurationException, match=r"margin=1.0\): choose a fraction in \[0, 1\)"):
        Tuner(quiet_trainer()).scale_batch_size(_Sized(), mode="binsearch", margin=1.0)


def test_no_trial_keeps_init_val() -> None:
    model = _Sized()
    assert Tuner(quiet_trainer()).scale_batch_size(model, init_val=6, max_trials=0) == 6
    assert model.hparams.batch_size == 6


def test_batch_size_lr_scaling_and_the_data_set_bound() -> None:
    linear = _Sized(batch_size=8, lr=0.01, limit=32)
    Tuner(quiet_trainer()).scale_batch_size(linear, init_val=8, lr_scaling="linear")
    assert linear.hparams.batch_size == 32 and linear.hparams.lr == pytest.approx(0.04)
    root = _Sized(batch_size=8, lr=0.01, limit=32)
    Tuner(quiet_trainer()).scale_batch_size(root, init_val=8, lr_scaling="sqrt")
    assert root.hparams.lr == pytest.approx(0.02)
    everything = _Sized()
    assert Tuner(quiet_trainer()).scale_batch_size(everything, init_val=64) == 256  # the whole data set


def test_a_cpu_memory_budget_bounds_the_batch_size() -> None:
    small = Tuner(quiet_trainer()).scale_batch_size(_Sized(width=4096), init_val=4, max_memory=2 * 2**20)
    large = Tuner(quiet_trainer()).scale_batch_size(_Sized(width=4096), init_val=4, max_memory=8 * 2**20)
    assert 4 <= small < large < 256


CPU_PEAK = """
import torch
from ember.tuner.memory import peak_memory
with peak_memory(torch.device("cpu"), measure=True) as peak:
    a = torch.empty(2**20, dtype=torch.uint8)
    b = torch.ones(2**19, dtype=torch.uint8)
    view = a[10:]  # no new memory: a view
    a.add_(1)  # nor in place
    del a, view
    c = torch.zeros(2**20, dtype=torch.uint8)  # where a was: 1.5 MiB alive at most
    del b, c
print(peak())
"""


@pytest.mark.timeout(60)
def test_the_cpu_peak_memory_is_measured_without_a_word_on_stderr() -> None:
    result = subprocess.run([sys.executable, "-c", CPU_PEAK], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert int(result.stdout) == 2**20 + 2**19


def test_lr_find_suggests_a_rate_on_the_falling_part_of_the_curve(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    model = _Sized(batch_size=16)
    before = parameters_of(model)
    finder = Tuner(quiet_trainer()).lr_find(model, min_lr=1e-5, max_lr=10.0, num_training=60)
    lrs, losses = finder.results["lr"], finder.results["loss"]
    assert len(lrs) == len(losses) and 20 < len(lrs) <= 60 and lrs == sorted(lrs)
    suggestion = finder.suggested_lr
    assert suggestion is not None and 1e-4 < suggestion < 1.0
    assert model.hparams.lr == suggestion  # update_attr
    assert all(torch.equal(a, b) for a, b in zip(parameters_of(model), before, strict=True))
    finder.plot(tmp_path / "lr.png")
    assert os.path.getsize(tmp_path / "lr.png") > 10_000


class _Unsized(_Sized):
    """No loader of its own: the data comes with the call."""

    train_dataloader = ember.Module.train_dataloader


def test_lr_find_takes_lightnings_arguments_and_loaders_given_to_it() -> None:
    model, loader = _Unsized(), DataLoader(make_data(256), batch_size=16)
    finder = Tuner(quiet_trainer()).lr_find(model, loader, val_dataloaders=loader, method="fit", num_training=12)
    assert finder is not None and len(finder.results["lr"]) == 12
    assert (finder.lr_min, finder.lr_max, finder.num_training, finder.mode) == (1e-8, 1.0, 12, "exponential")
    finder = Tuner(quiet_trainer()).lr_find(model, train_dataloaders=loader, num_training=12)
    assert finder is not None and len(finder.results["lr"]) == 12

    class Data(ember.DataModule):
        batch_size = 16

        def train_dataloader(self) -> DataLoader:
            return DataLoader(make_data(256), batch_size=self.batch_size)

    assert Tuner(quiet_trainer()).lr_find(_Unsized(), Data(), num_training=12) is not None  # as fit takes one
    with pytest.raises(MisconfigurationException, match="`train_dataloader` must be implemented to be used with"):
        Tuner(quiet_trainer()).lr_find(_Unsized())
    with pytest.raises(MisconfigurationException, match="method='fit' is the only valid configuration to run lr"):
        Tuner(quiet_trainer()).lr_find(model, loader, method="test")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationException, match="please consider setting `train_dataloaders` and `val_data"):
        Tuner(quiet_trainer()).lr_find(model, dataloaders=loader)
    with pytest.raises(MisconfigurationException, match="cannot be used with dataloaders passed directly"):
        Tuner(quiet_trainer()).scale_batch_size(_Sized(), train_dataloaders=loader)
    assert Tuner(quiet_trainer()).scale_batch_size(_Unsized(), Data(), init_val=2, max_trials=2, steps_per_trial=1) == 4


def test_tuner_errors_name_what_is_missing() -> None:
    class NoSize(_Sized):
        def __init__(self) -> None:
            super().__init__()
            del self.hparams["batch_size"]

    with pytest.raises(MisconfigurationException, match="Field batch_size not found in `model`, `datamodule`, nor"):
        Tuner(quiet_trainer()).scale_batch_size(NoSize())
    with pytest.raises(ValueError, match=r"`mode` should be either of .*mode='triple'"):
        Tuner(quiet_trainer()).scale_batch_size(_Sized(), mode="triple")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"method 'prediction' is invalid. Should be one of \('fit', 'validate'"):
        Tuner(quiet_trainer()).scale_batch_size(_Sized(), method="prediction")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_trials=-1\) must be an int >= 0"):
        Tuner(quiet_trainer()).scale_batch_size(_Sized(), max_trials=-1)
    with pytest.raises(ValueError, match=r"min_lr=0.0, max_lr=0.1\): both must be positive"):
        Tuner(quiet_trainer()).lr_find(_Sized(), min_lr=0.0, max_lr=0.1)
    with pytest.raises(torch.OutOfMemoryError, match="even batch_size=1 does not fit"):
        Tuner(quiet_trainer()).scale_batch_size(_Sized(limit=0))


class _Evaluated(_Sized):
    """Its evaluation loaders too are made at ``hparams.batch_size``; its steps count the batches by size."""

    def __init__(self) -> None:
        super().__init__(batch_size=2)
        self.sizes: dict[int, int] = {}

    def _count(self, batch: Any) -> None:
        self.sizes[len(batch[0])] = self.sizes.get(len(batch[0]), 0) + 1

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._count(batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._count(batch)

    def predict_step(self, batch: Any, batch_idx: int) -> None:
        self._count(batch)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_data(64), batch_size=self.hparams.batch_size)

    test_dataloader = predict_dataloader = val_dataloader


@pytest.mark.parametrize("method", ["validate", "test", "predict"])
def test_scale_batch_size_sizes_an_evaluation_with_its_steps(method: str) -> None:
    model = _Evaluated()
    size = Tuner(quiet_trainer()).scale_batch_size(model, method=method, max_trials=3, steps_per_trial=2)  # type: ignore[arg-type]
    assert size == model.hparams.batch_size == 8 and model.sizes == {2: 2, 4: 2, 8: 2}  # no training step ran
    loader = model.val_dataloader()
    with pytest.raises(MisconfigurationException, match="cannot be used with dataloaders passed directly"):
        Tuner(quiet_trainer()).scale_batch_size(model, dataloaders=loader, method=method)  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationException, match=r"`train_dataloaders` and `val_dataloaders` arguments should"):
        Tuner(quiet_trainer()).scale_batch_size(model, val_dataloaders=loader, method=method)  # type: ignore[arg-type]


def test_scale_batch_size_sizes_one_evaluation_loader() -> None:
    class Two(_Evaluated):
        def test_dataloader(self) -> list[DataLoader]:
            return [self.val_dataloader(), self.val_dataloader()]

    with pytest.raises(MisconfigurationException, match="cannot be used with multiple test dataloaders"):
        Tuner(quiet_trainer()).scale_batch_size(Two(), method="test")

    class One(_Evaluated):
        def test_dataloader(self) -> list[DataLoader]:
            return [self.val_dataloader()]

    assert Tuner(quiet_trainer()).scale_batch_size(One(), method="test", max_trials=2, steps_per_trial=1) == 4


def test_a_search_mode_is_read_in_any_case_as_in_lightning() -> None:
    from ember.tuner import BatchSizeFinder, LearningRateFinder

    assert LearningRateFinder(mode="Linear").mode == "linear" and BatchSizeFinder(mode="POWER").mode == "power"
    finder = Tuner(quiet_trainer()).lr_find(_Sized(), mode="LINEAR", num_training=4)  # type: ignore[arg-type]
    assert finder is not None and finder.mode == "linear"
    size = Tuner(quiet_trainer()).scale_batch_size(_Sized(limit=40), mode="BinSearch", steps_per_trial=1)  # type: ignore[arg-type]
    assert size == 38
    with pytest.raises(ValueError, match=r"`mode` should be either of \('linear', 'exponential'\)"):
        LearningRateFinder(mode="cosine")  # type: ignore[arg-type]


class _SlowItems(torch.utils.data.Dataset):
    """Each item takes 5 ms to read, as if it came from a slow disk."""

    def __len__(self) -> int:
        return 400

    def __getitem__(self, index: int) -> torch.Tensor:
        import time

        time.sleep(0.005)
        return torch.full((4,), float(index))


def test_suggest_num_workers_measures_each_count() -> None:
    from ember.data import suggest_num_workers

    suggestion = suggest_num_workers(DataLoader(_SlowItems(), batch_size=4), max_workers=2, batches=16)
    assert set(suggestion.batches_per_second) == {0, 1, 2}
    assert suggestion.num_workers >= 1  # reading overlaps across workers
    assert suggestion.batches_per_second[2] > 1.5 * suggestion.batches_per_second[0]
    with pytest.raises(TypeError, match="needs a torch DataLoader"):
        suggest_num_workers([1, 2, 3])  # type: ignore[arg-type]
