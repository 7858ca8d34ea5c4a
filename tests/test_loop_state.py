"""The fit loop along its state: one writer per fact (the step runner says what a batch did, ``Progress.advance``
counts it, resuming sets the loop's state through its own ``load_state_dict``), the logging scope the hook caller
opens, and the size of the parts that hold them."""

from __future__ import annotations

import ast
import dataclasses
import logging
import os
from typing import Any

import pytest
import torch
from conftest import Regressor, make_loader, quiet_trainer

import ember
from ember.callbacks import Callback, Timer
from ember.checkpoint.resume import LoopState
from ember.exceptions import MisconfigurationException
from ember.loggers import Logger
from ember.loops import Progress, StepResult, StepRunner
from ember.loops.evaluate import EvaluationLoop, PredictionLoop
from ember.loops.step import Window
from ember.strategies.single import SingleDeviceStrategy

PACKAGE = os.path.dirname(ember.__file__)


def _sources() -> dict[str, str]:
    """Every file of the package, by its path relative to the package."""
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path) as file:
                    found[os.path.relpath(path, PACKAGE)] = file.read()
    return found


# ------------------------------------------------------------------------ one writer per fact
def _runner(module: ember.Module, accumulate: int = 1) -> StepRunner:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    strategy = SingleDeviceStrategy()
    strategy.setup_module(module, training=True)
    return StepRunner(strategy, module, [optimizer], accumulate=accumulate)


def test_the_step_runner_says_what_each_batch_did() -> None:
    module = Regressor()
    batch = next(iter(make_loader(8, batch_size=4)))
    result = _runner(module).step(batch, 0)
    assert isinstance(result, StepResult) and result.stepped and result.steps == 1 and result.closes_window
    assert result.loss is not None and not result.loss.requires_grad and result.output.requires_grad

    runner = _runner(module, accumulate=2)
    window = Window(2, 4)
    first, second = (runner.micro_step(batch, index, window, is_last=False) for index in range(2))
    assert (first.stepped, first.closes_window) == (False, False)
    assert (second.stepped, second.closes_window) == (True, True)


def test_a_skipped_batch_takes_no_step() -> None:
    class Skips(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

    result = _runner(Skips()).step(next(iter(make_loader(8, batch_size=4))), 0)
    assert (result.loss, result.stepped) == (None, False)


def test_progress_advance_counts_batches_samples_steps_and_the_window_position() -> None:
    progress = Progress()
    progress.advance(StepResult(None, None, steps=0, closes_window=False), samples=8)
    assert (progress.total_batches, progress.epoch_samples, progress.window_batches, progress.window_samples) == (
        1, 8, 1, 8)  # fmt: skip
    progress.advance(StepResult(None, None, steps=1, closes_window=True), samples=4)
    assert (progress.global_step, progress.epoch_steps, progress.epoch_batches, progress.epoch_samples) == (1, 1, 2, 12)
    assert (progress.window_batches, progress.window_samples) == (0, 0)
    progress.advance(StepResult(None, None, steps=1, batches=0), samples=0)  # a step of gradients already there
    assert (progress.global_step, progress.total_batches) == (2, 2)


_PROGRESS_FIELDS = {field.name for field in dataclasses.fields(Progress)}


def test_no_module_but_progress_assigns_a_field_of_progress() -> None:
    offenders = []
    for name, source in _sources().items():
        if name == os.path.join("loops", "progress.py"):
            continue
        for node in ast.walk(ast.parse(source)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []  # fmt: skip
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr in _PROGRESS_FIELDS \
                        and "progress" in ast.unparse(target.value).lower():  # fmt: skip
                    offenders.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def test_nothing_outside_the_fit_loop_and_the_trainer_writes_the_fit_loops_state() -> None:
    """Callbacks and the tuner read the loop through read-only properties; none sets an attribute of it."""
    offenders = []
    for name, source in _sources().items():
        if name in (os.path.join("loops", "fit.py"), "trainer.py"):
            continue
        for node in ast.walk(ast.parse(source)):
            stored = isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
            if stored and "fit_loop" in ast.unparse(node.value):
                offenders.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


def test_manual_optimization_counts_every_optimizer_step_of_a_batch() -> None:
    class TwoOptimizers(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.steps_seen: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.steps_seen.append(self.global_step)
            x, y = batch
            for optimizer in self.optimizers():
                loss = torch.nn.functional.mse_loss(self(x), y)
                optimizer.zero_grad()
                self.manual_backward(loss)
                optimizer.step()
            return loss

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.SGD(self.parameters(), lr=0.01), torch.optim.SGD(self.parameters(), lr=0.01)]

    module = TwoOptimizers()
    trainer = quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False)
    trainer.fit(module, make_loader(32, batch_size=8))
    assert trainer.global_step == 8 and module.steps_seen == [0, 2, 4, 6]
    assert trainer.fit_loop.progress.total_batches == 4


def test_resuming_sets_the_loop_state_through_its_own_load_state_dict() -> None:
    state = LoopState()
    progress = Progress(epoch=2, global_step=7, epoch_batches=3, epoch_samples=24)
    state.load_state_dict({"progress": progress.state_dict(), "data_seed": 11, "random_state": {"python": 1}})
    assert (state.progress, state.data_seed) == (progress, 11)
    assert state.take_random_state() == {"python": 1} and state.take_random_state() is None
    assert LoopState(**{**vars(state), "pending_random_state": None}).state_dict() == state.state_dict()


_HOOK_NAMES = {name for name in vars(Callback) if name.startswith("on_")} | {
    "setup", "teardown", "prepare_data", "configure_optimizers", "configure_model", "configure_callbacks",
    "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader", "optimizer_step",
    "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping", "on_validation_model_zero_grad",
    "on_validation_model_eval", "on_validation_model_train", "on_test_model_eval", "on_test_model_train",
}  # fmt: skip
# Calls of a module's method outside a run, and a strategy's own call of the module's layout function.
_OUTSIDE_A_RUN = {"module.py": "on_load_checkpoint", os.path.join("strategies", "model_parallel.py"): "configure_model"}


def test_every_hook_call_goes_through_the_hook_caller() -> None:
    """Nothing but ``loops/hooks.py`` calls a hook of the module, the datamodule or a callback directly."""
    offenders = []
    for name, source in _sources().items():
        if name == os.path.join("loops", "hooks.py"):
            continue
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            receiver = ast.unparse(node.func.value).split(".")[-1]
            hook = node.func.attr
            owner = receiver.endswith("module") or receiver in ("callback", "datamodule", "_module")
            if hook in _HOOK_NAMES and owner and _OUTSIDE_A_RUN.get(name) != hook:
                offenders.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)


# ------------------------------------------------------------------------------ the shape
def test_the_fit_loop_and_the_trainer_stay_small() -> None:
    sources = _sources()
    lines = {name: source.count("\n") for name, source in sources.items()}
    assert lines[os.path.join("loops", "fit.py")] <= 400
    assert lines["trainer.py"] <= 600
    assert not {name: count for name, count in lines.items() if count > 600}


def test_the_fit_loop_holds_few_attributes_each_with_its_lifetime() -> None:
    tree = ast.parse(_sources()[os.path.join("loops", "fit.py")])
    fit_loop = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "FitLoop")
    assigned = {
        node.attr
        for node in ast.walk(fit_loop)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self"
    }
    assert len(assigned) <= 15, sorted(assigned)
    init = next(node for node in fit_loop.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    declared = [node.targets[0] if isinstance(node, ast.Assign) else node.target
                for node in init.body if isinstance(node, (ast.Assign, ast.AnnAssign))]  # fmt: skip
    in_init = {ast.unparse(target).removeprefix("self.") for target in declared}
    assert assigned <= in_init  # every one is declared in __init__, under its lifetime's comment


def test_validate_test_and_predict_share_one_skeleton() -> None:
    assert issubclass(PredictionLoop, EvaluationLoop)
    assert "run" not in vars(PredictionLoop) and "_run_loader" not in vars(PredictionLoop)


def test_the_lightning_names_of_settings_read_the_config() -> None:
    trainer = ember.Trainer(max_steps=5, default_root_dir="runs", logger=False)
    # max_epochs is the flag as given until fit resolves it, as Lightning's; the loops read the resolved limit.
    assert (trainer.max_epochs, trainer.config.epoch_limit) == (None, -1)
    assert trainer.default_root_dir == trainer.config.root_dir == "runs"
    assert ember.Trainer(logger=False).config.epoch_limit == 1000
    with pytest.raises(AttributeError, match="read-only"):
        trainer.max_steps = 3  # type: ignore[misc]


def test_max_time_is_a_timer_among_the_callbacks(caplog: pytest.LogCaptureFixture) -> None:
    trainer = quiet_trainer(max_time={"seconds": 30}, logger=False)
    timers = [callback for callback in trainer.callbacks if isinstance(callback, Timer)]
    assert len(timers) == 1 and timers[0].duration == 30
    own = Timer(duration={"minutes": 1})
    with caplog.at_level(logging.INFO, logger="ember"):
        trainer = quiet_trainer(max_time={"seconds": 30}, callbacks=[own], logger=False)
    assert "Ignoring `Trainer(max_time={'seconds': 30})`, callbacks list already contains a Timer" in caplog.text
    assert [callback for callback in trainer.callbacks if isinstance(callback, Timer)] == [own]


def test_a_timer_of_zero_stops_training_after_the_first_step() -> None:
    trainer = quiet_trainer(max_epochs=5, logger=False, enable_checkpointing=False, max_time={"microseconds": 1})
    trainer.fit(Regressor(), make_loader(64))
    assert trainer.global_step == 1


# ----------------------------------------------------------------------------- the logging scope
class _Recorder(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, list[tuple[int, float]]] = {}

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.written.setdefault(name, []).append((step, value))

    def log_hyperparams(self, params: Any) -> None:
        pass


_EPOCH_LOGGING_HOOKS = ["on_train_start", "on_train_epoch_start", "on_validation_start",
                        "on_validation_epoch_start", "on_validation_epoch_end", "on_train_epoch_end"]  # fmt: skip
_STEP_LOGGING_HOOKS = ["on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
                       "on_before_optimizer_step", "on_before_zero_grad"]  # fmt: skip


def _logs_in(hook: str, **options: Any) -> Any:
    def log(self: Any, *args: Any) -> None:
        self.log(hook, 3.0, **options)

    return log


@pytest.mark.parametrize("hook", _EPOCH_LOGGING_HOOKS + _STEP_LOGGING_HOOKS)
@pytest.mark.parametrize("owner", ["module", "callback"])
def test_a_value_logged_in_each_hook_that_may_log_reaches_the_logger_and_the_metrics(hook: str, owner: str) -> None:
    module = type("Logs", (Regressor,), {hook: _logs_in(hook)} if owner == "module" else {})()
    callbacks = [type("Logs", (Callback,), {hook: lambda self, trainer, module, *rest: module.log(hook, 3.0)})()]
    recorder = _Recorder()
    trainer = quiet_trainer(max_epochs=1, logger=recorder, enable_checkpointing=False, log_every_n_steps=1,
                            callbacks=callbacks if owner == "callback" else [])  # fmt: skip
    trainer.fit(module, make_loader(32), make_loader(16))
    assert trainer.callback_metrics[hook] == pytest.approx(3.0)
    assert trainer.logged_metrics[hook] == pytest.approx(3.0)
    steps = [step for step, _ in recorder.written[hook]]
    # per step by default in a step's hooks, else per epoch
    assert len(steps) == (4 if hook in _STEP_LOGGING_HOOKS else 1), steps


def test_a_value_logged_in_the_hooks_that_start_an_evaluation_reaches_its_results() -> None:
    class Logs(Regressor):
        def on_test_start(self) -> None:
            self.log("started", 1.0)

        def on_test_epoch_start(self) -> None:
            self.log("epoch_started", 2.0)

    results = quiet_trainer(logger=False).test(Logs(), make_loader(16), verbose=False)
    assert results[0]["started"] == 1.0 and results[0]["epoch_started"] == 2.0


@pytest.mark.parametrize(
    "hook",
    ["setup", "on_fit_start", "on_train_end", "on_fit_end", "configure_optimizers", "on_save_checkpoint",
     "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"],
)  # fmt: skip
def test_logging_where_nothing_may_be_logged_is_refused_by_name(hook: str) -> None:
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:  # setup(stage=...) by keyword
        with pytest.raises(MisconfigurationException, match=rf"inside `{hook}` \(`self.log\('x'\)`\)"):
            self.log("x", 1.0)
        self.refused.append(hook)
        if hook == "configure_optimizers":
            return Regressor.configure_optimizers(self)
        return args[0] if "batch" in hook else None  # a transfer hook gives the batch back

    module = type("Refuses", (Regressor,), {hook: refused, "refused": []})()
    trainer = quiet_trainer(max_epochs=1, logger=False)
    trainer.fit(module, make_loader(16))
    assert module.refused and set(module.refused) == {hook}


def test_an_epoch_end_refuses_a_value_per_step_and_prediction_refuses_logging() -> None:
    class Logs(Regressor):
        def on_train_epoch_end(self) -> None:
            self.log("per_step", 1.0, on_step=True)

    with pytest.raises(ValueError, match=r"inside `on_train_epoch_end`, must be one of \(False,\)"):
        quiet_trainer(max_epochs=1, logger=False, enable_checkpointing=False).fit(Logs(), make_loader(16))

    class Predicts(Regressor):
        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.log("prediction", 1.0)
            return batch[0]

    with pytest.raises(MisconfigurationException, match="is in `predict_step`, a `predict` hook"):
        quiet_trainer(logger=False).predict(Predicts(), make_loader(16))


def test_the_evaluation_loaders_suffix_is_part_of_the_scope() -> None:
    class TwoLoaders(Regressor):
        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("val_loss", float(dataloader_idx))

        def on_validation_epoch_end(self) -> None:
            self.log("after", 1.0)  # logged once all loaders ran: no loader's suffix

    results = quiet_trainer(logger=False).validate(TwoLoaders(), [make_loader(16), make_loader(8)], verbose=False)
    assert results[1]["val_loss/dataloader_idx_1"] == 1.0 and results[0]["after"] == 1.0
