"""Workers started from inside the caller: ``ddp_spawn``, ``ddp_fork`` and ``ddp_notebook`` (and ``ddp`` where no
script could be re-run: here, under pytest, where re-running the process would run the tests again) train in new
processes and return to the caller with rank zero's results, as Lightning's do.

CPU processes with Gloo on 127.0.0.1; every test that starts processes has a timeout, so that a hang fails fast.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import time
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import warm_processes
from conftest import Regressor, make_loader, parameters_of, quiet_trainer
from torch.utils.data import DataLoader

import ember
from ember.callbacks import LambdaCallback, ModelCheckpoint
from ember.exceptions import MisconfigurationException
from ember.launch import script_target
from ember.strategies import DDPStrategy
from ember.strategies.launchers import GRACE_SECONDS, WorkerTraceback, _checked
from ember.tuner import Tuner


def _fit(
    strategy: str, model: Regressor | None = None, ckpt_path: str | None = None, **flags: Any
) -> tuple[ember.Trainer, Regressor]:
    """``model`` (a new Regressor) fitted on 2 CPU processes: 32 samples in batches of 4 per process."""
    model = model or Regressor()
    trainer = quiet_trainer(devices=2, strategy=strategy, **{"max_epochs": 2, **flags})
    trainer.fit(model, make_loader(32, batch_size=4), make_loader(16, batch_size=4), ckpt_path=ckpt_path)
    return trainer, model


def _fitted_in_one_process(batch_size: int = 8, max_epochs: int = 2) -> list[torch.Tensor]:
    model = Regressor()
    quiet_trainer(max_epochs=max_epochs, logger=False, enable_checkpointing=False).fit(
        model, make_loader(32, batch_size=batch_size)
    )
    return parameters_of(model)


def _assert_close(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, b in zip(got, expected, strict=True):
        assert (a - b).abs().max() < 1e-5


class _Failing(Regressor):
    """Fails on rank 1 at its third step: raises ``ValueError``, or exits at once (``exit_status``)."""

    def __init__(self, exit_status: int | None = None) -> None:
        super().__init__()
        self.exit_status = exit_status

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_rank == 1 and self.global_step == 2:
            if self.exit_status is not None:
                os._exit(self.exit_status)  # a worker that dies without a word
            raise ValueError("no value fits on rank 1")
        return super().training_step(batch, batch_idx)


class _WithData(Regressor):
    def train_dataloader(self) -> Any:
        return make_loader(32, batch_size=4)


def _log_reduced_ranks(trainer: ember.Trainer, module: ember.Module) -> None:
    rank = torch.tensor(float(trainer.global_rank + 1))
    module.log("ranks_summed", trainer.strategy.reduce(rank, reduce_op="sum"))
    module.log("ranks_averaged", trainer.strategy.reduce(rank, group=None, reduce_op="AVG"))
    trainer.strategy.barrier("reduced")
    module.log("ranks_gathered", trainer.strategy.all_gather(rank, group=None).sum())
    zero = trainer.global_rank == 0
    decisions = [trainer.strategy.reduce_boolean_decision(zero, all=every) for every in (True, False)]
    module.log("all_ranks_zero", float(decisions[0]))
    module.log("any_rank_zero", float(decisions[1]))
    layout = (trainer.strategy.num_processes, trainer.strategy.process_group_backend)
    module.log("gloo_processes", float(layout[0]) if layout[1] == "gloo" else -1.0)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_forked_workers_return_fit_validate_test_and_predict_results_to_the_caller() -> None:
    checkpoint = ModelCheckpoint(monitor="val_loss", save_last=True)
    # A group of this process alone, as an earlier stage of a sharded strategy leaves it: the forked workers must
    # not inherit it (they would wait on it forever). A test run before in this process may have left one.
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    reducing = LambdaCallback(on_validation_epoch_end=_log_reduced_ranks)  # Lightning's keywords of the collectives
    trainer, model = _fit("ddp_notebook", callbacks=[checkpoint, reducing])  # ddp_fork's workers start as these do
    # Two processes with batches of 4 step as one with batches of 8.
    _assert_close(parameters_of(model), _fitted_in_one_process(batch_size=8))
    assert (trainer.global_step, trainer.current_epoch) == (8, 2)
    assert trainer.state.finished and trainer.lightning_module is model
    assert {"train_loss", "val_loss"} <= set(trainer.callback_metrics)
    # Rank zero wrote the checkpoints, in the run directory the caller's Trainer and loggers now name.
    assert checkpoint.best_model_path.startswith(os.path.join(trainer.log_dir, "checkpoints"))
    assert os.path.isfile(checkpoint.best_model_path) and os.path.isfile(checkpoint.last_model_path)
    assert checkpoint.best_model_score is not None and os.listdir(trainer.runs_dir) == ["version_0"]
    (results,) = trainer.validate(model, make_loader(16, batch_size=4))
    assert trainer.callback_metrics["val_loss"] == results["val_loss"]
    reduced = {"ranks_summed": 3.0, "ranks_averaged": 1.5, "ranks_gathered": 3.0, "all_ranks_zero": 0.0,
               "any_rank_zero": 1.0, "gloo_processes": 2.0}  # fmt: skip
    assert results == {"val_loss": results["val_loss"], **reduced}
    # Without a module, test runs the fitted one with the best checkpoint's weights, in new workers.
    (results,) = trainer.test(dataloaders=make_loader(16, batch_size=4), ckpt_path="best")
    assert set(results) == {"test_loss"} and trainer.state.fn == "test"
    predictions = trainer.predict(model, DataLoader(torch.randn(16, 4), batch_size=4))
    assert predictions is not None and sum(len(batch) for batch in predictions) == 8  # rank zero's half


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_where_no_script_can_be_re_run_starts_workers_and_resumes_as_an_uninterrupted_run(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    uninterrupted, _ = _fit("ddp_fork", max_epochs=2, default_root_dir=tmp_path / "a")
    first, _ = _fit("ddp_fork", max_epochs=1, default_root_dir=tmp_path / "b")
    assert first.checkpoint_callback is not None and os.path.isfile(first.checkpoint_callback.best_model_path)
    # strategy="ddp" in a notebook's session, whose main module no worker could import: forked workers. (Under
    # pytest, whose main module can be imported, they would be spawned: see _checked's test.)
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    resumed, model = _fit("ddp", max_epochs=2, default_root_dir=tmp_path / "b", ckpt_path="last")
    assert resumed.global_step == uninterrupted.global_step == 8
    assert uninterrupted.lightning_module is not None
    for got, expected in zip(parameters_of(model), parameters_of(uninterrupted.lightning_module), strict=True):
        assert torch.equal(got, expected)
    assert resumed.log_dir == first.log_dir  # continued in place, where rank zero wrote its checkpoints


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_s_exception_is_raised_in_the_caller_with_its_rank_and_traceback() -> None:
    started = time.monotonic()
    trainer = quiet_trainer(devices=2, strategy="ddp_fork", max_epochs=2, logger=False)
    with pytest.raises(ValueError, match="no value fits on rank 1") as raised:
        trainer.fit(_Failing(), make_loader(32, batch_size=4))
    assert time.monotonic() - started < 30
    assert trainer.interrupted and trainer.state.fn == "fit"  # the caller's Trainer says how its stage ended
    cause = raised.value.__cause__
    assert isinstance(cause, WorkerTraceback)
    assert str(cause).startswith("on rank 1:") and "in training_step" in str(cause)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_that_dies_without_a_word_ends_the_job_naming_its_rank() -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the worker of rank 1 exited with status 3 without a result"):
        _fit("ddp_fork", model=_Failing(exit_status=3), logger=False)
    # Rank zero, left waiting in a collective, is killed once the grace period is over.
    assert time.monotonic() - started < GRACE_SECONDS + 30


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_learning_rate_finder_runs_in_the_workers_and_sets_the_caller_s_module() -> None:
    model = _WithData(lr=0.05)
    trainer = quiet_trainer(devices=2, strategy="ddp_fork", logger=False)
    finder = Tuner(trainer).lr_find(model, num_training=20)
    assert finder.suggested_lr is not None and len(finder.results["lr"]) > 1
    assert model.hparams.lr == finder.suggested_lr != 0.05


def _script_main() -> types.ModuleType:
    """A main module that spawned workers can import: a script's (pytest's own depends on how it was started)."""
    main = types.ModuleType("__main__")
    main.__file__ = __file__
    return main


def test_ddp_without_a_script_spawns_where_the_main_module_can_be_imported_else_forks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "__main__", _script_main())
    assert _checked("popen") == "spawn"
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a notebook's
    assert _checked("popen") == "fork"


def test_reduce_refuses_an_operation_it_does_not_know_naming_it() -> None:
    with pytest.raises(ValueError, match=r"reduce_op='median' is not a reduction: use one of 'mean', 'avg', 'sum'"):
        DDPStrategy().reduce(torch.tensor(1.0), reduce_op="median")  # type: ignore[arg-type]


def test_spawn_needs_a_main_module_it_can_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # a notebook's
    with pytest.raises(MisconfigurationException, match="use strategy='ddp_notebook'"):
        _fit("ddp_spawn")


def test_spawn_refuses_what_cannot_be_pickled_before_starting_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "__main__", _script_main())  # however pytest itself was started
    callback = LambdaCallback(on_fit_start=lambda trainer, module: None)
    with pytest.raises(MisconfigurationException, match=r"start_method='spawn' get the Trainer.*strategy='ddp_fork'"):
        _fit("ddp_spawn", callbacks=[callback])


def test_fork_refuses_a_process_that_uses_cuda_already(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(MisconfigurationException, match="forked workers cannot use it: use strategy='ddp_spawn'"):
        _fit("ddp_fork")


def test_only_a_script_or_module_run_is_re_run_in_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    assert script_target() is None  # a test session: re-running it would run every test again
    monkeypatch.delitem(sys.modules, "_pytest")
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["-c"])
    assert script_target() is None  # python -c, or a notebook: no file to re-run
    main.__file__ = "train.py"
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.1"])
    assert script_target() == [os.path.abspath("train.py")]
    main.__spec__ = importlib.machinery.ModuleSpec("package.train", None)
    assert script_target() == ["-m", "package.train"]


LIGHTNING_SCRIPT = """
import os

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset


class Net(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    x = torch.randn(32, 4)
    model = Net()
    before = model.layer.weight.clone()
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, enable_progress_bar=False,
                      enable_model_summary=False)  # the default logger and checkpoints: pickled for the workers
    trainer.fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    best = trainer.checkpoint_callback.best_model_path
    print("after fit:", trainer.global_step, not torch.equal(before, model.layer.weight), trainer.state.finished,
          list(trainer.callback_metrics), best.startswith(trainer.log_dir) and os.path.isfile(best))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_lightning_script_run_under_the_hook_spawns_workers_that_import_it_with_the_hook(tmp_path: Any) -> None:
    # The script imports Lightning at its top and is run by a launcher that installed the hook first: each
    # spawned worker runs the script again, before it gets its job, and must have the hook by then.
    (tmp_path / "train.py").write_text(LIGHTNING_SCRIPT)
    launcher = "import ember.lightning, runpy; runpy.run_path('train.py', run_name='__main__')"
    command = [sys.executable, "-c", launcher]
    result = warm_processes.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("after fit:") == 1 and "after fit: 4 True True ['train_loss'] True" in result.stdout
