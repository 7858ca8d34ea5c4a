"""Module basics, batch transfer, the command line and import cost (the examples are in test_examples.py)."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from collections import namedtuple
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember._utils import batch_size_of, move_to_device


def test_save_hyperparameters_records_init_arguments() -> None:
    class Model(ember.Module):
        def __init__(self, width: int, depth: int = 2, *, note: str = "x", **extra: Any) -> None:
            super().__init__()
            self.save_hyperparameters(ignore="note")

    model = Model(8, extra_flag=True)
    assert model.hparams == {"width": 8, "depth": 2, "extra_flag": True}
    assert model.hparams.width == 8

    class Chosen(ember.Module):
        def __init__(self, a: int = 1, b: int = 2) -> None:
            super().__init__()
            self.save_hyperparameters("b")

    assert Chosen().hparams == {"b": 2}
    with pytest.raises(ValueError, match=r"\['c'\] are not arguments of __init__"):

        class Wrong(ember.Module):
            def __init__(self, a: int = 1) -> None:
                super().__init__()
                self.save_hyperparameters("c")

        Wrong()


def test_module_outside_a_trainer() -> None:
    model = Regressor()
    model.log("ignored", 1.0)  # no trainer: logging is a no-op, so steps can be unit-tested
    assert model.current_epoch == 0 and model.global_step == 0 and model.device.type == "cpu"
    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        _ = model.trainer


def test_copies_of_a_module_do_not_carry_the_trainer() -> None:
    model = Regressor()
    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(model, make_loader(16))
    clone = copy.deepcopy(model)
    assert clone._trainer is None and model._trainer is trainer


@dataclasses.dataclass
class _Batch:
    inputs: torch.Tensor
    meta: dict[str, Any]


_Pair = namedtuple("_Pair", ["x", "y"])


def test_batches_of_any_nesting_are_moved() -> None:
    batch = {
        "pair": _Pair(torch.ones(2), [torch.zeros(3), "label"]),
        "record": _Batch(torch.ones(4, 2), {"ids": torch.arange(4)}),
        "count": 3,
    }
    moved = move_to_device(batch, torch.device("meta"))
    assert isinstance(moved["pair"], _Pair) and moved["pair"].x.is_meta and moved["pair"].y[0].is_meta
    assert moved["pair"].y[1] == "label" and moved["count"] == 3
    assert isinstance(moved["record"], _Batch) and moved["record"].meta["ids"].is_meta
    assert batch_size_of(batch) == 2 and batch_size_of(moved["record"]) == 4


def test_the_loop_never_empties_the_cache_or_synchronizes(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the loop must not call this per step")

    monkeypatch.setattr(torch.cuda, "empty_cache", forbidden)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    quiet_trainer(max_epochs=2).fit(Regressor(), make_loader(), make_loader())


def _run(*args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    return warm_processes.run([sys.executable, *args], capture_output=True, text=True, timeout=120, **kwargs)


def test_command_line_help_and_version() -> None:
    result = _run("-m", "ember", "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"ember {ember.__version__}"
    result = _run("-m", "ember", "--help")
    assert result.returncode == 0 and "usage: ember" in result.stdout


def test_import_is_cheap_and_pulls_in_no_optional_packages() -> None:
    code = (
        "import sys, torch; before = set(sys.modules); import ember; "
        "heavy = ('tensorboard', 'matplotlib', 'mlflow', 'sklearn', 'torch.distributed.fsdp', 'torch._dynamo', "
        "'torch.distributed.tensor', 'torch.distributed.checkpoint', 'torch.distributed.pipelining')"
        "; print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in heavy or m in heavy))"
    )
    result = _run("-c", code)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
