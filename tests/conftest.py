"""Shared fixtures: a tiny regression module, data, and a working directory per test."""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from filelock import FileLock
from torch.utils.data import DataLoader, TensorDataset

import ember


def pytest_configure(config: pytest.Config) -> None:
    """Where Python is told not to write bytecode (PYTHONDONTWRITEBYTECODE), compile the package once, before the
    test workers start: the suite's few hundred processes would otherwise each compile the modules they import
    again, about 0.1 s of CPU apiece. (Python reads bytecode that exists whatever the setting.)"""
    if sys.dont_write_bytecode and not hasattr(config, "workerinput"):  # workerinput: a test worker, started after
        compileall.compile_dir(os.path.dirname(os.path.abspath(ember.__file__)), quiet=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The slow tests first: the workers take tests in this order, so the last ones to run are short and no worker
    # is left alone with a long one at the end (the sort is stable: the same order in every worker).
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test runs in its own directory, so default logs and checkpoints land there."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _warnings_given_again() -> None:
    """Warnings given once per process (rank_zero_warn_once) are given again in each test that expects them."""
    ember.rank_zero._warned.clear()


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[str], None]) -> str:
    """The directory ``name``, filled by ``build`` once in the whole session: the test workers share it (the first
    to ask builds it while the others wait), so a costly reference run is made once however tests are spread."""
    root = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's directory, above each worker's own
    directory = root / name
    with FileLock(str(root / f"{name}.lock")):
        if not (directory / "built").exists():
            shutil.rmtree(directory, ignore_errors=True)  # what a failed attempt left
            directory.mkdir()
            build(str(directory))
            (directory / "built").touch()
    return str(directory)


def make_data(n: int = 64, features: int = 4, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = x @ torch.arange(1.0, features + 1) + 0.1 * torch.randn(n, generator=generator)
    return TensorDataset(x, y.unsqueeze(1))


def make_loader(n: int = 64, batch_size: int = 8, **kwargs: Any) -> DataLoader:
    return DataLoader(make_data(n), batch_size=batch_size, **kwargs)


class Regressor(ember.Module):
    """A linear regression with SGD: small, deterministic, and easy to reason about."""

    def __init__(self, lr: float = 0.05, features: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class DropoutRegressor(Regressor):
    """``Regressor`` with dropout on its inputs: a run that draws random numbers every step, for exact resumes."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.dropout(x))


def quiet_trainer(**flags: Any) -> ember.Trainer:
    """A Trainer without progress output or model summary, for tests that do not look at them."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0
    )
    return ember.Trainer(**{**defaults, **flags})


def parameters_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [parameter.detach().clone() for parameter in module.parameters()]


def descendants(pid: int) -> list[int]:
    """The processes started, directly or not, by process ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    parent = int(file.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def wait_for_workers(launcher: subprocess.Popen, script: str, count: int, settle: float = 4) -> list[int]:
    """The pids of the ``count`` workers running ``script`` under ``launcher``, ``settle`` seconds after they start."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = [pid for pid in descendants(launcher.pid) if script in _command_line(pid)]
        if len(workers) >= count:
            time.sleep(settle)  # let them reach the training loop
            return workers
        time.sleep(0.2)
    pytest.fail(f"the {count} workers running {script} did not start")


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as file:
            return file.read()
    except OSError:
        return ""
