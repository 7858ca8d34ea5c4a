"""Lightning programs run on Ember unchanged, through the import hook; with Lightning installed, each also runs
on Lightning and the two runs are compared: steps, epochs, logged metric names, checkpoint names and, where
both read the data in the same order, the values.

The programs live in ``tests/lightning_programs``; single-process ones run in this process (Lightning is
imported once), the two-process ones through ``ember run --lightning`` and ``torchrun``.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import dataclasses
import importlib.util
import itertools
import json
import logging
import math
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import warm_processes
from conftest import Regressor, make_data, make_loader, quiet_trainer

import ember
from ember import lightning_compat

PROGRAMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_programs")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_LIGHTNING = (
    importlib.util.find_spec("lightning") is not None and importlib.util.find_spec("pytorch_lightning") is not None
)
_ROOTS = ("lightning", "pytorch_lightning", "lightning_fabric")


# ------------------------------------------------------------------------------ the hook itself
@contextlib.contextmanager
def served_by_ember() -> Iterator[None]:
    """Lightning's names served by Ember; an installed Lightning, if imported, is set aside meanwhile."""
    aside = {name: module for name, module in sys.modules.items() if name.partition(".")[0] in _ROOTS}
    for name in aside:
        del sys.modules[name]
    lightning_compat.install()
    try:
        yield
    finally:
        lightning_compat.uninstall()
        sys.modules.update(aside)


def test_the_tuners_callbacks_are_served() -> None:
    with served_by_ember():
        from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
        from pytorch_lightning.callbacks.batch_size_finder import BatchSizeFinder as FromModule

    assert BatchSizeFinder is FromModule is ember.tuner.BatchSizeFinder
    assert LearningRateFinder is ember.tuner.LearningRateFinder


def test_lightning_names_are_embers_own_objects() -> None:
    with served_by_ember():
        import lightning as L
        import lightning.pytorch as pl
        import pytorch_lightning as ptl
        from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
        from lightning.pytorch.callbacks.weight_averaging import EMAWeightAveraging
        from lightning.pytorch.strategies import DDPStrategy
        from lightning.pytorch.utilities import grad_norm, rank_zero_info
        from lightning.pytorch.utilities.memory import recursive_detach

        assert L.LightningModule is pl.LightningModule is ptl.LightningModule is ember.Module
        assert L.Trainer is ember.Trainer and pl.LightningDataModule is ember.DataModule
        assert ModelCheckpoint is ember.callbacks.ModelCheckpoint and DDPStrategy is ember.strategies.DDPStrategy
        assert BasePredictionWriter is ember.callbacks.BasePredictionWriter and callable(grad_norm)
        assert EMAWeightAveraging is ember.callbacks.EMAWeightAveraging
        assert recursive_detach is ember.utilities.recursive_detach
        assert (
            rank_zero_info is ember.rank_zero.rank_zero_log_info  # Lightning's logs, Ember's own prints
            and pl.callbacks.EarlyStopping is ptl.callbacks.EarlyStopping
        )
        assert "ModelCheckpoint" in dir(pl.callbacks) and L.__version__.startswith("2.")
        assert not hasattr(pl, "__file__")  # dunder lookups stay AttributeErrors for tools that probe them
    # Afterwards, no served module is left behind (an installed Lightning, if imported before, is back).
    assert not lightning_compat.is_installed()
    assert all(hasattr(module, "__file__") for name, module in sys.modules.items() if name.partition(".")[0] in _ROOTS)


@pytest.mark.parametrize(
    ("statement", "name"),
    [
        ("from lightning.pytorch.callbacks.model_summary import ModelSummary", "ember.callbacks.ModelSummary"),
        ("from pytorch_lightning.callbacks.timer import Timer", "ember.callbacks.Timer"),
        ("from lightning.pytorch.callbacks import StochasticWeightAveraging",
         "ember.callbacks.StochasticWeightAveraging"),
        ("from pytorch_lightning.callbacks.stochastic_weight_avg import StochasticWeightAveraging",
         "ember.callbacks.StochasticWeightAveraging"),
        ("from lightning.pytorch.callbacks import ModelPruning", "ember.callbacks.ModelPruning"),
        ("from pytorch_lightning.callbacks.pruning import ModelPruning", "ember.callbacks.ModelPruning"),
        ("from lightning.pytorch.callbacks import GradientAccumulationScheduler",
         "ember.callbacks.GradientAccumulationScheduler"),
        ("from pytorch_lightning.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler",
         "ember.callbacks.GradientAccumulationScheduler"),
        ("from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar",
         "ember.callbacks.ProgressBarBase"),
        ("from lightning.pytorch.strategies.single_device import SingleDeviceStrategy",
         "ember.strategies.SingleDeviceStrategy"),
        ("from lightning.pytorch.strategies.parallel import ParallelStrategy", "ember.strategies.ParallelStrategy"),
        ("from lightning.pytorch.profilers.simple import SimpleProfiler", "ember.profilers.SimpleProfiler"),
        ("from lightning.pytorch.cli import OptimizerCallable", "ember.cli_lightning.OptimizerCallable"),
        ("from lightning.pytorch.cli import LRSchedulerCallable", "ember.cli_lightning.LRSchedulerCallable"),
        ("from lightning.pytorch.cli import ArgsType", "ember.cli_lightning.ArgsType"),
        ("from pytorch_lightning.cli import instantiate_class", "ember.cli_lightning.instantiate_class"),
        ("from lightning.pytorch.cli import LRSchedulerTypeUnion", "ember.cli_lightning.LRSchedulerTypeUnion"),
        ("from lightning.pytorch.trainer.states import TrainerStatus", "ember.trainer_state.TrainerStatus"),
        ("from pytorch_lightning.trainer.states import RunningStage", "ember.trainer_state.RunningStage"),
        ("from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig",
         "ember.lightning_compat.extras.OptimizerLRSchedulerConfig"),
        ("from lightning.pytorch.utilities.model_summary.model_summary import LEFTOVER_PARAMS_NAME",
         "ember.model_summary.LEFTOVER_PARAMS_NAME"),
        ("from lightning.pytorch.callbacks.progress.progress_bar import get_standard_metrics",
         "ember.callbacks.progress_base.standard_metrics"),
    ],
)  # fmt: skip
def test_submodules_and_names_programs_import(statement: str, name: str) -> None:
    pytest.importorskip("jsonargparse")
    module, _, attribute = name.rpartition(".")
    namespace: dict[str, Any] = {}
    with served_by_ember():
        exec(statement, namespace)
    assert namespace[statement.split()[-1]] is getattr(importlib.import_module(module), attribute)


def test_the_cli_records_lightnings_instantiator_and_names_under_the_name_imported(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jsonargparse")
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with served_by_ember():
        from pytorch_lightning.cli import LightningCLI

        args = ["--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}", "--model.features=3",
                "--trainer.enable_progress_bar=false"]  # fmt: skip
        # Messages name the CLI as the program does.
        with pytest.warns(UserWarning, match="`Regressor.configure_optimizers` will be overridden by `LightningCLI"):
            cli = LightningCLI(Regressor, args=[*args, "--optimizer=SGD", "--optimizer.lr=0.1"], run=False)
        cli.trainer.fit(cli.model, torch.utils.data.DataLoader(make_data(8, features=3), batch_size=4))
    # Lightning loads the checkpoint by this name; Ember serves it with its own instantiate_module.
    assert cli.model.hparams._instantiator == "pytorch_lightning.cli.instantiate_module"
    loaded = Regressor.load_from_checkpoint(cli.trainer.checkpoint_callback.best_model_path)
    assert loaded.layer.in_features == 3 and "_instantiator" not in loaded.hparams


def test_spike_detection_is_served_with_its_exception() -> None:
    with served_by_ember():
        from lightning.fabric.utilities.spike import TrainingSpikeException
        from pytorch_lightning.callbacks import SpikeDetection
        from pytorch_lightning.callbacks.spike import SpikeDetection as FromModule

    assert SpikeDetection is FromModule is ember.callbacks.SpikeDetection
    assert TrainingSpikeException is ember.callbacks.TrainingSpikeException


def test_fabrics_seed_rank_zero_and_exception_are_embers() -> None:
    with served_by_ember():
        from lightning.fabric.utilities import rank_zero_only
        from lightning_fabric.utilities.exceptions import MisconfigurationException
        from lightning_fabric.utilities.rank_zero import rank_zero_warn
        from lightning_fabric.utilities.seed import seed_everything

    assert MisconfigurationException is ember.exceptions.MisconfigurationException
    assert seed_everything is ember.seed_everything
    assert rank_zero_only is ember.rank_zero.rank_zero_only and rank_zero_warn is ember.rank_zero.rank_zero_warn


def test_measure_flops_counts_a_meta_model_as_lightnings_does() -> None:
    with served_by_ember():
        from lightning.fabric.utilities.throughput import measure_flops as from_fabric
        from pytorch_lightning.utilities import measure_flops

    assert measure_flops is from_fabric is ember.utilities.measure_flops
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        x = torch.randn(2, 32)
    # Lightning 2.6's counts for this model and input.
    assert measure_flops(model, lambda: model(x)) == 10752
    assert measure_flops(model, lambda: model(x), lambda y: y.sum()) == 24064


def test_the_trainers_accelerator_is_an_instance_of_lightnings_class_for_its_device() -> None:
    with served_by_ember():
        from lightning.pytorch import Trainer
        from lightning.pytorch.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator, MPSAccelerator
        from pytorch_lightning.accelerators.cpu import CPUAccelerator as served_twice

        accelerator = Trainer(accelerator="cpu", logger=False).accelerator
        assert isinstance(accelerator, CPUAccelerator) and isinstance(accelerator, Accelerator)
        assert not isinstance(accelerator, (CUDAAccelerator, MPSAccelerator)) and served_twice is CPUAccelerator
        assert CPUAccelerator.is_available() and CPUAccelerator.auto_device_count() == 1  # asked of the class
        assert CUDAAccelerator.is_available() == torch.cuda.is_available()


@pytest.mark.parametrize(
    ("statement", "message"),
    [
        ("from pytorch_lightning.loggers import CometLogger",
         r"CometLogger is not covered.*subclass ember.loggers.Logger"),
        ("from lightning.pytorch.plugins.environments import SLURMEnvironment",
         r"lightning.pytorch.plugins.environments is a part of Lightning that Ember does not cover: Ember has no "
         r"plugins"),
        ("from lightning.pytorch.plugins import MixedPrecision", r"plugins.MixedPrecision is not covered.*precision="),
        ("from lightning import Fabric", r"lightning.Fabric is not covered by Ember: use ember.Trainer"),
        ("from lightning.fabric import Fabric", r"lightning.fabric.Fabric is not covered by Ember: use ember.Trainer"),
        ("import lightning_fabric.strategies", r"lightning_fabric.strategies is a part of Lightning that Ember does"),
        ("import lightning.pytorch.trainer.connectors", r"Ember covers lightning.pytorch's accelerators, callbacks"),
        ("from lightning.pytorch.accelerators import XLAAccelerator", r"XLAAccelerator is not covered.*not on TPUs"),
        ("from lightning.pytorch.callbacks import Nonexistent", r"callbacks.Nonexistent is not covered.*has Callback"),
        ("from lightning.pytorch.loops import FitLoop", r"loops is a part .*override the module's hooks"),
        ("from lightning.pytorch.strategies.deepspeed import DeepSpeedStrategy",
         r"strategies.deepspeed .*FSDPStrategy"),
    ],
)  # fmt: skip
def test_names_ember_lacks_fail_at_import_with_what_to_use(statement: str, message: str) -> None:
    with served_by_ember(), pytest.raises(ImportError, match=message):
        exec(statement, {})


def test_fabric_s_get_filesystem_is_served(tmp_path: Any) -> None:
    with served_by_ember():
        from lightning.fabric.utilities.cloud_io import get_filesystem

        assert get_filesystem is ember.utilities.get_filesystem
        assert get_filesystem(tmp_path).exists(str(tmp_path)) and "memory" in get_filesystem("memory://a").protocol
        with pytest.raises(ImportError, match=r"cloud_io._load is not covered by Ember: read a checkpoint with"):
            exec("from lightning_fabric.utilities.cloud_io import _load", {})


def test_a_program_using_lightning_s_names_keeps_its_runs_in_lightning_logs(tmp_path: Any) -> None:
    root = str(tmp_path)
    with served_by_ember():
        from lightning.pytorch import Trainer
        from lightning.pytorch.loggers import CSVLogger

        trainer = Trainer(default_root_dir=root, max_steps=1, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Regressor(), make_loader(8))
        assert trainer.log_dir == os.path.join(root, "lightning_logs", "version_0")
        assert CSVLogger(root, name="mine").name == "mine"  # a name of its own stays
        # Without a logger, the runs that preemption saves claim are there too.
        assert Trainer(default_root_dir=root, logger=False).runs_dir == os.path.join(root, "lightning_logs")
    assert ember.loggers.CSVLogger(root).log_dir == os.path.join(root, "ember_logs", "version_0")  # Ember's own
    assert ember.Trainer(default_root_dir=root, logger=False).runs_dir == os.path.join(root, "ember_logs")


def test_a_program_using_lightning_s_names_gets_lightning_s_default_loggers(tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")

    class Images(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            for logger in self.loggers:  # as programs written for Lightning's one default logger do
                logger.experiment.add_image("inputs", torch.rand(3, 4, 4), self.global_step)
            return super().training_step(batch, batch_idx)

    with served_by_ember():
        from lightning.pytorch import Trainer
        from lightning.pytorch.loggers import TensorBoardLogger

        trainer = Trainer(default_root_dir=str(tmp_path), max_steps=2, enable_progress_bar=False)
        trainer.fit(Images(), make_loader())
        assert [type(logger) for logger in trainer.loggers] == [TensorBoardLogger]
    # Ember's own programs keep metrics.csv beside TensorBoard's files.
    loggers = ember.Trainer(default_root_dir=str(tmp_path)).loggers
    assert [type(logger).__name__ for logger in loggers] == ["TensorBoardLogger", "CSVLogger"]


def test_a_program_using_lightning_s_names_gets_lightning_s_progress_bar_class() -> None:
    with served_by_ember():
        from lightning.pytorch import Trainer
        from lightning.pytorch.callbacks import TQDMProgressBar

        bar = Trainer().progress_bar_callback
        assert isinstance(bar, TQDMProgressBar) and bar.refresh_rate == 1
    assert type(ember.Trainer().progress_bar_callback) is ember.callbacks.ProgressBar  # Ember's own


def test_a_program_using_lightning_s_names_gets_lightning_s_precision_advice_at_each_trainer() -> None:
    with served_by_ember():
        from lightning.pytorch import Trainer

        for _ in range(2):  # each Trainer warns, as Lightning's: a program (or a test) building two sees it twice
            with pytest.warns(UserWarning) as caught:
                assert Trainer(accelerator="cpu", precision=16, logger=False).precision == "bf16-mixed"
            messages = [str(warning.message) for warning in caught]
            assert any(message.startswith("`precision=16` is supported for historical reasons") for message in messages)
            assert any("AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'`" in m for m in messages)
        with pytest.warns(UserWarning, match=r"`precision=bf16` is supported for historical reasons.* bf16-mixed"):
            Trainer(precision="bf16", logger=False)


def test_a_bar_of_one_s_own_on_lightning_s_progress_bar_draws_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    with served_by_ember():
        from lightning.pytorch import Trainer
        from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

        class Percent(ProgressBar):
            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
                print(f"{100 * (i + 1) / self.total_train_batches:.0f}%")

        bar = Percent()
        quiet = dict(logger=False, enable_checkpointing=False, enable_model_summary=False)
        trainer = Trainer(max_epochs=1, callbacks=[bar], **quiet)
        trainer.fit(Regressor(), make_loader(16))
        trainer.print("done")
        assert trainer.progress_bar_callback is bar and isinstance(TQDMProgressBar(), ProgressBar)
    printed = capsys.readouterr().out.splitlines()  # Lightning's base draws nothing: the bar's and the Trainer's lines
    assert printed == ["50%", "100%", "`Trainer.fit` stopped: `max_epochs=1` reached.", "done"]


def test_levels_set_on_lightning_s_loggers_apply_to_the_messages_ember_gives_in_lightning_s_words(
    capsys: pytest.CaptureFixture[str],
) -> None:
    quiet = dict(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    rank_zero, package = logging.getLogger("pytorch_lightning.utilities.rank_zero"), logging.getLogger("lightning")
    try:
        with served_by_ember():
            from pytorch_lightning import Trainer
            from pytorch_lightning.callbacks import EarlyStopping

            # The Trainer's messages go; the model summary and EarlyStopping have loggers of their own.
            rank_zero.setLevel(logging.WARNING)
            stopping = EarlyStopping("train_loss", verbose=True, check_on_train_epoch_end=True)
            Trainer(callbacks=[stopping], **quiet).fit(Regressor(), make_loader(16))
            shown = capsys.readouterr().out
            assert "Total params" in shown and "Metric train_loss improved" in shown
            assert "`Trainer.fit` stopped" not in shown
            package.setLevel(logging.ERROR)  # a package above silences all
            Trainer(**quiet).fit(Regressor(), make_loader(16))
            assert capsys.readouterr().out == ""
        ember.Trainer(**quiet).fit(Regressor(), make_loader(16))  # Ember's own programs: Ember's logger decides
        assert "`Trainer.fit` stopped" in capsys.readouterr().out
    finally:
        rank_zero.setLevel(logging.NOTSET)
        package.setLevel(logging.NOTSET)


def test_lightning_s_rank_zero_helpers_log_and_warn_in_lightning_s_categories(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with served_by_ember():
        from lightning.pytorch.utilities import disable_possible_user_warnings
        from lightning.pytorch.utilities.rank_zero import WarningCache, rank_zero_deprecation, rank_zero_info
        from lightning.pytorch.utilities.warnings import PossibleUserWarning

        with pytest.deprecated_call(match="^old$"):
            rank_zero_deprecation("old")
        cache = WarningCache()
        with pytest.warns(UserWarning) as caught:
            for _ in range(2):
                cache.warn("once")
                cache.deprecation("deprecated once")
                cache.info("said once")
        rank_zero_info("%s of %d", "one", 2)  # logging's formatting
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
        try:
            rank_zero_info("silenced")
        finally:
            logging.getLogger("lightning.pytorch").setLevel(logging.NOTSET)
    assert [(warning.category.__name__, str(warning.message)) for warning in caught] == [
        ("UserWarning", "once"),
        ("EmberDeprecationWarning", "deprecated once"),
    ]
    assert capsys.readouterr().out == "said once\none of 2\n"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disable_possible_user_warnings()
        warnings.warn("perhaps a mistake", PossibleUserWarning, stacklevel=1)
        warnings.warn("a mistake", UserWarning, stacklevel=1)
    assert [str(warning.message) for warning in caught] == ["a mistake"]


def test_installing_after_lightning_was_imported_is_refused() -> None:
    code = (
        "import sys, types; sys.modules['pytorch_lightning'] = types.ModuleType('pytorch_lightning'); "
        "import ember.lightning_compat as c; c.install()"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "install() must run before Lightning is imported" in result.stderr


def test_one_line_import_serves_lightning() -> None:
    code = (
        "import ember.lightning\nimport lightning.pytorch as pl\nimport pytorch_lightning\nimport ember\n"
        "assert pl.Trainer is ember.Trainer and pytorch_lightning.LightningModule is ember.Module\nprint('served')"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=environment)
    assert result.returncode == 0 and result.stdout == "served\n", result.stderr


def test_the_readme_table_names_every_lightning_name_the_suite_uses() -> None:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as file:
        readme = file.read()
    section = readme.split("## Moving from Lightning")[1].split("\n## ")[0]
    used = set()
    for name in os.listdir(PROGRAMS):
        if name.endswith(".py"):
            with open(os.path.join(PROGRAMS, name), encoding="utf-8") as file:
                used |= _lightning_names(file.read())
    assert len(used) > 15
    missing = sorted(name for name in used if not re.search(rf"[`.]{name.rpartition('.')[2]}\b", section))
    assert not missing, f"the README's table lacks {missing}"


def _lightning_names(source: str) -> set[str]:
    """The Lightning modules and names a program imports or reaches through a module it imported."""
    tree = ast.parse(source)
    found, aliases = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").partition(".")[0] in _ROOTS:
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.partition(".")[0] in _ROOTS:
                    aliases[alias.asname or alias.name] = alias.name
                    found.add(alias.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # class paths in configurations
            found |= set(re.findall(r"\b(?:lightning|pytorch_lightning)(?:\.\w+)+", node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            found.add(f"{aliases[node.value.id]}.{node.attr}")
    return found


def test_ember_run_lightning_runs_an_unchanged_script(tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\nimport lightning.pytorch as pl\nfrom lightning.pytorch.demos.boring_classes import BoringModel\n"
        "trainer = pl.Trainer(max_steps=3, enable_progress_bar=False, default_root_dir=sys.argv[1])\n"
        "trainer.fit(BoringModel())\nprint('trained on', type(trainer).__module__, trainer.global_step)\n"
    )
    command = [sys.executable, "-m", "ember", "run", "--lightning", str(script), str(tmp_path)]
    result = warm_processes.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained on ember.trainer 3" in result.stdout


# --------------------------------------------------------------------------------- the programs
@dataclasses.dataclass
class Outcome:
    """What a program's run shows, in terms both frameworks share."""

    values: dict[str, float]  # metrics and results, by name
    logged: dict[str, list[int]]  # each logged metric's steps
    checkpoints: list[str]  # checkpoint files, relative to their run directory
    files: list[str]  # other files the program wrote outside the run directories


@contextlib.contextmanager
def framework(name: str) -> Iterator[None]:
    if name == "ember":
        with served_by_ember():
            yield
    else:
        yield


def load_program(name: str) -> Any:
    """A fresh copy of the program's module (its imports of Lightning resolve now)."""
    path = os.path.join(PROGRAMS, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"lightning_program_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_program(name: str, which: str, root: str) -> Outcome:
    with framework(which):
        result = load_program(name).main(root)
    return summarize(result, root)


def summarize(result: dict[str, Any], root: str) -> Outcome:
    values: dict[str, float] = {}
    for key, item in result.items():
        values.update(_values(key, item))
    checkpoints, files = [], []
    logged: dict[str, list[int]] = {}
    for directory, _, names in os.walk(root):
        relative = os.path.relpath(directory, root)
        in_run = relative.split(os.sep)[0] in ("lightning_logs", "ember_logs", "logs")
        for file in names:
            path = os.path.join(directory, file)
            if file.endswith(".ckpt"):
                checkpoints.append(_run_relative(path, root))
            elif file == "metrics.csv":
                for metric, steps in _csv_steps(path).items():
                    logged.setdefault(f"csv:{metric}", []).extend(_once(steps))
            elif file.startswith("events.out.tfevents"):  # each stage (fit, validate, ...) writes a file
                for metric, steps in _event_steps(path).items():
                    logged.setdefault(f"tensorboard:{metric}", []).extend(_once(steps))
            elif not in_run:
                files.append(os.path.relpath(path, root))
    return Outcome(values, logged, sorted(checkpoints), sorted(files))


def _once(steps: list[int]) -> list[int]:
    """``steps`` without repeats of the same step in a row (Lightning's LearningRateMonitor writes the same
    value once per micro-batch of an accumulation window)."""
    return [step for step, _ in itertools.groupby(steps)]


def _values(key: str, item: Any) -> dict[str, float]:
    if hasattr(item, "callback_metrics") and hasattr(item, "global_step"):
        found = {f"{key}.{name}": float(value) for name, value in item.callback_metrics.items()}
        return {**found, f"{key}.global_step": item.global_step, f"{key}.current_epoch": item.current_epoch}
    if isinstance(item, torch.Tensor):
        return {f"{key}.sum": float(item.double().sum()), f"{key}.numel": float(item.numel())}
    if isinstance(item, dict):
        return {name: value for sub, part in item.items() for name, value in _values(f"{key}.{sub}", part).items()}
    if isinstance(item, (list, tuple)):
        return {
            name: value for index, part in enumerate(item) for name, value in _values(f"{key}[{index}]", part).items()
        }
    if isinstance(item, (int, float, bool)):
        return {key: float(item)}
    return {f"{key}:{item}": 0.0}  # anything else is compared by its text


def _run_relative(path: str, root: str) -> str:
    parts = os.path.relpath(path, root).split(os.sep)
    if parts[0] in ("lightning_logs", "ember_logs"):
        parts = parts[1:]  # the default directory's name differs; what is under it must not
    return "/".join(parts)


def _csv_steps(path: str) -> dict[str, list[int]]:
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    steps: dict[str, list[int]] = {}
    for row in rows:
        for name, value in row.items():
            if value not in ("", None) and name not in ("step", "epoch"):
                steps.setdefault(name, []).append(int(row["step"]))
    return steps


def _event_steps(path: str) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(path, size_guidance={"scalars": 0})
    events.Reload()
    # Lightning's TensorBoardLogger adds a placeholder "hp_metric" with the hyperparameters; Ember does not.
    return {
        tag: [event.step for event in events.Scalars(tag)] for tag in events.Tags()["scalars"] if tag != "hp_metric"
    }


#: Programs whose data is read in the same order by both frameworks, so that their values must agree. (A
#: program that draws random numbers in its steps is not among them: Lightning's dataloaders draw a seed
#: from the global generator each epoch, Ember's do not.)
SAME_ORDER = {
    "autoencoder_tutorial", "multi_val_loaders", "bf16_accumulation", "early_stopping", "prediction_writer",
    "finetuning", "warmup_transformer", "custom_batch", "callback_hooks", "cli_program", "tensorboard_logging",
    "hparams_inheritance", "datamodule_from_datasets", "accumulation_schedule",
}  # fmt: skip

SINGLE_PROCESS = sorted(
    name[:-3] for name in os.listdir(PROGRAMS) if name.endswith(".py") and not name.startswith(("_", "ddp_"))
)


@pytest.mark.timeout(300)  # the program runs twice when Lightning is installed
@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_program_runs_on_ember_as_on_lightning(name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ours_root, theirs_root = tmp_path / "ember", tmp_path / "lightning"
    ours_root.mkdir()
    monkeypatch.chdir(ours_root)
    ours = run_program(name, "ember", str(ours_root))
    if not HAS_LIGHTNING:
        assert ours.values, "the program reported nothing"
        return
    theirs_root.mkdir()
    monkeypatch.chdir(theirs_root)
    try:
        theirs = run_program(name, "lightning", str(theirs_root))
    except Exception as error:
        raise AssertionError(f"{name} failed on Lightning itself, so there is nothing to compare with") from error
    compare(name, ours, theirs)


def compare(name: str, ours: Outcome, theirs: Outcome) -> None:
    assert sorted(ours.values) == sorted(theirs.values), "values named differently"
    for key in ("global_step", "current_epoch"):
        for value_name in (n for n in theirs.values if n.endswith(f".{key}")):
            assert ours.values[value_name] == theirs.values[value_name], value_name
    if name in SAME_ORDER:
        for value_name, value in theirs.values.items():
            assert math.isclose(ours.values[value_name], value, rel_tol=1e-4, abs_tol=1e-6), (
                value_name, ours.values[value_name], value,
            )  # fmt: skip
    assert ours.checkpoints == theirs.checkpoints
    assert ours.files == theirs.files
    # Each metric is logged at as many steps by both. Ember labels a value logged during a training step with
    # the global step after it (10 for the tenth), Lightning with the step before (9), so the labels are not
    # compared; nor is "epoch", which each framework writes beside every group of values it writes.
    sources = {key.partition(":")[0] for key in ours.logged} & {key.partition(":")[0] for key in theirs.logged}
    for source in sources:  # CSV files, TensorBoard events, or both
        assert _logged_counts(ours, source) == _logged_counts(theirs, source)


def _logged_counts(outcome: Outcome, source: str) -> dict[str, int]:
    return {k: len(v) for k, v in outcome.logged.items() if k.startswith(source) and not k.endswith(":epoch")}


# ------------------------------------------------------------------------- two-process programs
#: How Ember starts each two-process program: with ember run's two workers, or from one plain process
#: whose Trainer(devices=2) starts them (the hook must reach the workers either way).
TWO_PROCESSES = {
    "ddp_classifier": ["-m", "ember", "run", "--lightning", "--nproc-per-node", "2"],
    "ddp_gan": ["-m", "ember.lightning_compat"],
}


#: Variables that would tell a program it is a worker of a running job (a test may leave one behind).
_JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "EMBER_DOCTOR")  # fmt: skip


def _start(command: list[str], root: str) -> subprocess.Popen:
    """Start ``command`` as a user would from a shell: no variables of a running job."""
    environment = {name: value for name, value in os.environ.items()
                   if name not in _JOB_VARIABLES and not name.startswith("TORCHELASTIC_")}  # fmt: skip
    return warm_processes.Popen(command, cwd=root, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


def _finish(process: subprocess.Popen, root: str) -> Outcome:
    output, _ = process.communicate(timeout=200)
    assert process.returncode == 0, output[-4000:]
    with open(os.path.join(root, "summary.json")) as file:
        values = json.load(file)
    outcome = summarize({}, root)
    return Outcome(values, outcome.logged, outcome.checkpoints, [f for f in outcome.files if f != "summary.json"])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(TWO_PROCESSES))
def test_two_process_program_runs_on_ember_as_on_lightning(name: str, tmp_path: Any) -> None:
    script = os.path.join(PROGRAMS, f"{name}.py")
    ours_root, theirs_root = str(tmp_path / "ember"), str(tmp_path / "lightning")
    os.makedirs(ours_root)
    os.makedirs(theirs_root)
    ours = _start([sys.executable, *TWO_PROCESSES[name], script, ours_root], ours_root)
    # Lightning starts its second process itself, by running the script again.
    theirs = _start([sys.executable, script, theirs_root], theirs_root) if HAS_LIGHTNING else None
    ours_outcome = _finish(ours, ours_root)
    assert ours_outcome.values["trainer.global_step"] > 0
    if theirs is not None:
        compare(name, ours_outcome, _finish(theirs, theirs_root))


def test_a_lightning_program_is_warned_that_last_found_nothing_to_resume(tmp_path: Any) -> None:
    # Ember's own programs are told in an INFO line (test_resume.py); Lightning's programs get Lightning's warning.
    with served_by_ember(), pytest.warns(UserWarning, match=r'ckpt_path="last"\) is set, but .* No checkpoint will'):
        trainer = quiet_trainer(max_epochs=1, default_root_dir=str(tmp_path), log_every_n_steps=1)
        trainer.fit(Regressor(), make_loader(16), ckpt_path="last")
    assert trainer.global_step == 2


def test_a_lightning_program_seeded_without_a_seed_gets_lightnings_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ember's own programs draw a seed and print it (test_lightning_api.py); Lightning's seeds with 0, so that a run
    # of a Lightning program repeats as it does on Lightning.
    for name in ("EMBER_GLOBAL_SEED", "PL_GLOBAL_SEED"):
        monkeypatch.delenv(name, raising=False)
    with served_by_ember(), pytest.warns(UserWarning, match="^No seed found, seed set to 0$"):
        assert ember.seed_everything() == 0
    first = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(first, torch.rand(3)) and os.environ["PL_GLOBAL_SEED"] == "0"
