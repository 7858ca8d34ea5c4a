"""The Trainer: the public entry points (fit, validate, test, predict) and the properties callbacks read.

Its flags are checked once into a ``TrainerConfig``; the strategy decides how devices and processes
are used; the loops (``ember.loops``) run the steps and own where the run is.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
import os
import signal
import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from ember import checkpoint as checkpoint_io
from ember.callbacks import Callback, EarlyStopping, ModelCheckpoint, ModelSummary, ProgressBar
from ember.checkpoint import state as checkpoint_state
from ember.config import TrainerConfig
from ember.data import in_order, prepare_loader, release_workers
from ember.doctor import Doctor, DoctorDone, active_doctor
from ember.loggers import CSVLogger, DummyLogger, Logger, TensorBoardLogger
from ember.loggers.logger import VersionedLogger, claim_version, lineage_version, settle_versions
from ember.loops import EvaluationLoop, FitLoop, Hooks, PredictionLoop
from ember.metrics import RunMetrics
from ember.module import DataModule, Module
from ember.optim import LRSchedulerConfig
from ember.profilers import Profiler, select_profiler
from ember.rank_zero import rank_zero_only, rank_zero_warn_once
from ember.strategies import Strategy, select_strategy

_Loaders = Iterable | Sequence[Iterable] | None
_Limit = int | float | None


class Trainer:
    """Runs a ``Module``'s steps: ``fit`` trains (and validates), ``validate``/``test`` evaluate, ``predict`` infers.

    All flags are keyword-only and follow PyTorch Lightning's names and meanings; ``TrainerConfig``
    documents each one, and checks them all when the Trainer is built.

    On SIGTERM (and SIGUSR1 under SLURM) ``fit`` saves ``last.ckpt`` at the next step boundary and exits;
    ``slurm_requeue=True`` also requeues the SLURM job. Resume with ``fit(ckpt_path="last")``.
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        devices: int | str | Sequence[int] = "auto",
        num_nodes: int = 1,
        strategy: str | Strategy = "auto",
        precision: str | int | None = "32-true",
        float32_matmul_precision: Literal["highest", "high", "medium"] | None = None,
        compile: bool | Mapping[str, Any] = False,
        max_epochs: int | None = None,
        max_steps: int = -1,
        min_epochs: int | None = None,
        min_steps: int | None = None,
        max_time: str | timedelta | Mapping[str, int] | None = None,
        limit_train_batches: _Limit = None,
        limit_val_batches: _Limit = None,
        limit_test_batches: _Limit = None,
        limit_predict_batches: _Limit = None,
        overfit_batches: int | float = 0.0,
        fast_dev_run: bool | int = False,
        reload_dataloaders_every_n_epochs: int = 0,
        val_check_interval: int | float | None = 1.0,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = 2,
        accumulate_grad_batches: int | Literal["auto"] = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] | None = "norm",
        log_every_n_steps: int | None = 50,
        callbacks: Callback | Sequence[Callback] | None = None,
        logger: bool | Logger | Sequence[Logger] | None = True,
        enable_progress_bar: bool | None = True,
        enable_checkpointing: bool | None = True,
        enable_model_summary: bool | None = True,
        profiler: str | Profiler | None = None,
        enable_autolog_hparams: bool = True,
        barebones: bool = False,
        default_root_dir: str | os.PathLike | None = None,
        deterministic: bool | Literal["warn"] | None = False,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        detect_anomaly: bool = False,
        use_distributed_sampler: bool = True,
        sync_batchnorm: bool = False,
        slurm_requeue: bool = False,
        restart_on_data_change: bool = False,
        async_checkpoint: bool = False,
        timeout: int | float | timedelta | None = None,
        doctor: bool | int = False,
        gpus: int | str | Sequence[int] | None = None,
        plugins: Any = None,
        model_registry: str | None = None,
    ) -> None:
        flags = {name: value for name, value in locals().items() if name != "self"}
        given = TrainerConfig(**flags)
        given.warn_deprecated()
        #: The flags, checked, as the loops apply them (see ``TrainerConfig.resolved``).
        self.config = config = given.resolved()
        if config.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(config.float32_matmul_precision)
        accelerator, devices = config.layout
        self.strategy: Strategy = select_strategy(
            accelerator=accelerator,
            devices=devices,
            num_nodes=config.num_nodes,
            strategy=config.strategy,
            precision=config.precision,
            sync_batchnorm=config.sync_batchnorm,
            compile_options=config.compile_options,
            timeout=timedelta(seconds=config.timeout_seconds) if config.timeout_seconds is not None else None,
            async_checkpoint=config.async_checkpoint,
        )
        rank_zero_only.rank = self.strategy.global_rank  # type: ignore[attr-defined]
        _set_determinism(config)
        self.loggers: list[Logger] = _build_loggers(config)
        self.callbacks: list[Callback] = _build_callbacks(config)
        if config.fast_dev_run:
            self.print(f"fast_dev_run: running {int(config.fast_dev_run)} batch(es) of each loop; logging, "
                       "checkpointing and early stopping are off")  # fmt: skip
        self.profiler: Profiler = select_profiler(config.profiler)
        #: What the run has logged with ``self.log`` and what went to the loggers.
        self.run_metrics = RunMetrics(
            self.strategy.reduce, self.loggers, self.strategy.is_global_zero, copy_values=self.strategy.reuses_outputs
        )
        self.fit_loop = FitLoop(self)
        self.validate_loop = EvaluationLoop(self, "validate")
        self.test_loop = EvaluationLoop(self, "test")
        self.predict_loop = PredictionLoop(self)
        self._hooks: Hooks | None = None
        #: "fit", "validate", "test" or "predict" while one runs.
        self.stage: str | None = None
        #: The module being run (the name Lightning uses).
        self.lightning_module: Module | None = None
        self.datamodule: DataModule | None = None
        self._environment_ready = False
        self._stage_loaders: list[Iterable] = []  # the loaders of the stage in progress
        self._run_settled = False
        self._run_version: int | None = None  # the run directory's version when no logger keeps one
        self._doctor: Doctor | None = None
        self._callbacks_added_by: Module | None = None  # the module whose configure_callbacks() joined
        #: The checkpoint the last ``fit``, ``validate``, ``test`` or ``predict`` loaded (None: none).
        self.ckpt_path: str | None = None
        self._latest_loaders: dict[str, list[Iterable]] = {}  # by kind ("val", ...): the latest stage's

    # ----------------------------------------------------------------------- process layout
    @property
    def global_rank(self) -> int:
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self.strategy.node_rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def num_nodes(self) -> int:
        return self.strategy.num_nodes

    @property
    def num_devices(self) -> int:
        return len(self.strategy.parallel_devices)

    @property
    def is_global_zero(self) -> bool:
        return self.strategy.is_global_zero

    @property
    def precision(self) -> str:
        return self.strategy.precision.name

    @property
    def model(self) -> torch.nn.Module | None:
        """What the steps run through: the module, or the strategy's wrapper around it."""
        return self.strategy.model

    @property
    def module(self) -> Module | None:
        return self.lightning_module

    @property
    def hooks(self) -> Hooks:
        """The hooks of the stage in progress: the module's and the callbacks' implementations of each."""
        if self._hooks is None:
            raise RuntimeError("trainer.hooks exist while fit, validate, test or predict runs")
        return self._hooks

    # ---------------------------------------------------------------------------- the flags
    @property
    def max_epochs(self) -> int:
        return self.config.epoch_limit

    @property
    def max_steps(self) -> int:
        return self.config.max_steps

    @property
    def accumulate_grad_batches(self) -> int | Literal["auto"]:
        return self.config.accumulate_grad_batches

    @property
    def log_every_n_steps(self) -> int:
        return self.config.log_every_n_steps

    @property
    def check_val_every_n_epoch(self) -> int | None:
        return self.config.check_val_every_n_epoch

    @property
    def val_check_interval(self) -> int | float:
        return self.config.val_check_interval

    @property
    def num_sanity_val_steps(self) -> int:
        return self.config.num_sanity_val_steps

    @property
    def gradient_clip_val(self) -> int | float | None:
        return self.config.gradient_clip_val

    @property
    def gradient_clip_algorithm(self) -> str:
        return self.config.gradient_clip_algorithm

    @property
    def default_root_dir(self) -> str:
        return self.config.root_dir

    @property
    def fast_dev_run(self) -> bool | int:
        return self.config.fast_dev_run

    # ---------------------------------------------------------------------- the loop's state
    @property
    def global_step(self) -> int:
        """Optimizer steps taken since the run began."""
        return self.fit_loop.progress.global_step

    @property
    def current_epoch(self) -> int:
        return self.fit_loop.progress.epoch

    @property
    def should_stop(self) -> bool:
        return self.fit_loop.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self.fit_loop.should_stop = value

    @property
    def preempted(self) -> bool:
        """True once a preemption signal made ``fit`` save a checkpoint and stop."""
        return self.fit_loop.preempted

    @property
    def sanity_checking(self) -> bool:
        return self.fit_loop.sanity_checking

    @property
    def is_last_batch(self) -> bool:
        """Whether the training batch being run is the epoch's last (a manual schedule steps there)."""
        return self.fit_loop.is_last_batch

    @property
    def training(self) -> bool:
        """Whether ``fit`` is training (not validating, nor in its sanity check)."""
        return self.stage == "fit" and not self.validate_loop.running

    @property
    def validating(self) -> bool:
        """Whether a validation runs (in ``validate``, or in ``fit`` outside the sanity check)."""
        return self.validate_loop.running and not self.sanity_checking

    @property
    def testing(self) -> bool:
        return self.stage == "test"

    @property
    def predicting(self) -> bool:
        return self.stage == "predict"

    @property
    def evaluating(self) -> bool:
        """Whether a validation (sanity check included) or a test runs."""
        return self.validate_loop.running or self.testing

    @property
    def validation_enabled(self) -> bool:
        return self.fit_loop.validation_enabled

    @property
    def num_training_batches(self) -> float:
        return self.fit_loop.num_training_batches

    @property
    def num_val_batches(self) -> list[float]:
        return self.validate_loop.num_batches

    @property
    def num_test_batches(self) -> list[float]:
        return self.test_loop.num_batches

    @property
    def num_predict_batches(self) -> list[float]:
        return self.predict_loop.num_batches

    @property
    def train_dataloader(self) -> Iterable | None:
        return self.fit_loop.train_loader

    @property
    def val_dataloaders(self) -> Iterable | list[Iterable] | None:
        """The validation loader of the latest ``fit`` or ``validate`` (a list when there are several)."""
        return _one_or_list(self._latest_loaders.get("val"))

    @property
    def test_dataloaders(self) -> Iterable | list[Iterable] | None:
        return _one_or_list(self._latest_loaders.get("test"))

    @property
    def predict_dataloaders(self) -> Iterable | list[Iterable] | None:
        return _one_or_list(self._latest_loaders.get("predict"))

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self.fit_loop.optimizers

    @property
    def lr_scheduler_configs(self) -> list[LRSchedulerConfig]:
        runner = self.fit_loop.runner
        return runner.scheduler_configs if runner is not None else []

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps ``fit`` will take (``math.inf`` if unbounded); usable in ``configure_optimizers``."""
        accumulate = self.accumulate_grad_batches
        batches = self.num_training_batches
        per_epoch = batches if math.isinf(batches) else math.ceil(batches / (1 if accumulate == "auto" else accumulate))
        total = per_epoch * self.max_epochs if self.max_epochs != -1 else math.inf
        return min(total, self.max_steps) if self.max_steps != -1 else total

    # ------------------------------------------------------------------------- logging state
    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str | None:
        """This run's directory: the first logger's (the same on every rank once a stage has started), or,
        when no logger keeps files, one claimed under ``runs_dir`` for the run's checkpoints."""
        log_dir = self.loggers[0].log_dir if self.loggers else None
        if log_dir is None and self._run_version is not None:
            return os.path.join(self.runs_dir, f"version_{self._run_version}")
        return log_dir

    @property
    def checkpoint_dir(self) -> str:
        """Where this run's checkpoints go: the first ModelCheckpoint's directory, else ``<log_dir>/checkpoints``."""
        callback = self.checkpoint_callback
        if callback is not None and callback.dirpath:
            return callback.dirpath
        return os.path.join(self.log_dir or self.default_root_dir, "checkpoints")

    def preemption_checkpoint_path(self) -> str:
        """Where a preemption signal's checkpoint goes: ``last.ckpt`` in this run's checkpoint directory. Call
        it on every rank: a run that keeps no files otherwise (no logger, no ModelCheckpoint) claims its
        ``version_N`` now, rank zero's for every rank, so that ``ckpt_path="last"`` finds the file."""
        if self.log_dir is None and self.checkpoint_callback is None:
            claimed = claim_version(self.runs_dir) if self.is_global_zero else None
            self._run_version = self.strategy.broadcast(claimed)
        return os.path.join(self.checkpoint_dir, "last.ckpt")

    @property
    def runs_dir(self) -> str:
        """Where this run's directory and its predecessors' (``version_N``) are: the first file-keeping
        logger's ``<save_dir>/<name>``, else ``<default_root_dir>/ember_logs``."""
        for logger in self.loggers:
            if isinstance(logger, VersionedLogger):
                return logger.runs_dir
        return os.path.join(self.default_root_dir, "ember_logs")

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every logged metric (the epoch value where there is one), as tensors."""
        return self.run_metrics.callback_metrics()

    @property
    def logged_metrics(self) -> dict[str, torch.Tensor]:
        """The values last written to the loggers."""
        return self.run_metrics.logged

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """Values logged with ``prog_bar=True``, as floats (reading them synchronises with the device)."""
        return self.run_metrics.progress_bar_metrics()

    # ----------------------------------------------------------------------------- callbacks
    @property
    def checkpoint_callbacks(self) -> list[ModelCheckpoint]:
        return [callback for callback in self.callbacks if isinstance(callback, ModelCheckpoint)]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        callbacks = self.checkpoint_callbacks
        return callbacks[0] if callbacks else None

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        return next((callback for callback in self.callbacks if isinstance(callback, EarlyStopping)), None)

    @property
    def progress_bar_callback(self) -> ProgressBar | None:
        return next((callback for callback in self.callbacks if isinstance(callback, ProgressBar)), None)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the global-zero process only (above the progress bar, when one is drawn)."""
        if self.is_global_zero:
            bar = self.progress_bar_callback
            (bar.print if bar is not None else print)(*args, **kwargs)

    # --------------------------------------------------------------------------- entry points
    def fit(
        self,
        model: Module,
        train_dataloaders: Iterable | DataModule | None = None,
        val_dataloaders: _Loaders = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike | None = None,
        weights_only: bool | None = True,
    ) -> None:
        """Train ``model``, validating as the flags say; ``ckpt_path`` resumes from a checkpoint.

        ``weights_only=False`` allows checkpoints that carry arbitrary pickled objects: only for
        files from a source you trust, since loading them can run code.
        """
        if isinstance(train_dataloaders, DataModule):
            datamodule, train_dataloaders = train_dataloaders, None
        _check_module(model, "fit")
        if ckpt_path is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            ckpt_path = "last"  # restarted by the elastic agent after a failure: continue the run
        ckpt_path = _checked_path(ckpt_path)
        self.strategy.launch()
        def loaders() -> tuple[Iterable, list[Iterable]]:
            train_loader = self._loaders("train", train_dataloaders, required=True)[0]
            return train_loader, self._loaders("val", val_dataloaders) if hasattr(model, "validation_step") else []

        with self._stage("fit", model, datamodule, ckpt_path) as path:
            train_loader, val_loaders = loaders()
            restore = functools.partial(self._restore, path, weights_only) if path is not None else None
            self.fit_loop.run(train_loader, val_loaders, restore, reload=loaders)
        if self.preempted:
            # The usual status of a process ended by that signal (143 for SIGTERM, 130 for Ctrl-C), so that
            # schedulers and launchers see the run was stopped, not finished.
            raise SystemExit(128 + (self.fit_loop.stop_signal or signal.SIGTERM))

    def validate(
        self,
        model: Module | None = None,
        dataloaders: _Loaders | DataModule = None,
        ckpt_path: str | os.PathLike | None = None,
        datamodule: DataModule | None = None,
        verbose: bool = True,
        weights_only: bool | None = True,
    ) -> list[dict[str, float]]:
        """Run ``validation_step`` over the validation data; one dict of metrics per dataloader.

        Without ``model``, the module of the last ``fit`` is used, with the weights of ``ckpt_path``: "best"
        (the default then), "last" or a path.
        """
        return self._evaluate(self.validate_loop, model, dataloaders, ckpt_path, datamodule, verbose, weights_only)

    def test(
        self,
        model: Module | None = None,
        dataloaders: _Loaders | DataModule = None,
        ckpt_path: str | os.PathLike | None = None,
        datamodule: DataModule | None = None,
        verbose: bool = True,
        weights_only: bool | None = True,
    ) -> list[dict[str, float]]:
        """Run ``test_step`` over the test data; one dict of metrics per dataloader (``model`` and ``ckpt_path``
        as for ``validate``)."""
        return self._evaluate(self.test_loop, model, dataloaders, ckpt_path, datamodule, verbose, weights_only)

    def predict(
        self,
        model: Module | None = None,
        dataloaders: _Loaders | DataModule = None,
        datamodule: DataModule | None = None,
        return_predictions: bool = True,
        ckpt_path: str | os.PathLike | None = None,
        weights_only: bool | None = True,
    ) -> list[Any] | None:
        """Run ``predict_step``; the outputs (on the CPU) as a list, a list per dataloader when there are several
        (``model`` and ``ckpt_path`` as for ``validate``)."""
        if isinstance(dataloaders, DataModule):
            datamodule, dataloaders = dataloaders, None
        model, ckpt_path = self._evaluated_module(model, "predict", ckpt_path)
        _check_module(model, "predict")
        self.strategy.launch()
        ckpt_path = _checked_path(ckpt_path)
        with self._stage("predict", model, datamodule, ckpt_path) as path:
            loaders = self._loaders("predict", dataloaders, required=True)
            self._load_weights(path, weights_only)
            return self.predict_loop.run(loaders, return_predictions)

    def _evaluate(
        self,
        loop: EvaluationLoop,
        model: Module | None,
        dataloaders: _Loaders | DataModule,
        ckpt_path: str | os.PathLike | None,
        datamodule: DataModule | None,
        verbose: bool,
        weights_only: bool | None,
    ) -> list[dict[str, float]]:
        if isinstance(dataloaders, DataModule):
            datamodule, dataloaders = dataloaders, None
        model, ckpt_path = self._evaluated_module(model, loop.stage, ckpt_path)
        _check_module(model, loop.stage)
        self.strategy.launch()
        ckpt_path = _checked_path(ckpt_path)
        with self._stage(loop.stage, model, datamodule, ckpt_path) as path:
            loaders = self._loaders("val" if loop.stage == "validate" else "test", dataloaders, required=True)
            self._load_weights(path, weights_only)
            results = loop.run(loaders, loop.count(loaders))
            if verbose and self.is_global_zero:
                _print_results(loop.stage, results)
            return results

    def _evaluated_module(
        self, model: Module | None, stage: str, ckpt_path: str | os.PathLike | None
    ) -> tuple[Module, str | os.PathLike | None]:
        """The module to evaluate and the checkpoint to load into it: without a module, the fitted one, with
        its best checkpoint unless ``ckpt_path`` names another."""
        if model is not None:
            return model, ckpt_path
        if self.lightning_module is None:
            raise ValueError(f"Trainer.{stage}() needs a module: pass one, or call fit() first to use the fitted one")
        if ckpt_path is None and self.checkpoint_callback is not None and not self.fast_dev_run:
            ckpt_path = "best"
            rank_zero_warn_once(
                f".{stage}(ckpt_path=None) without a model: the best checkpoint of the last fit is loaded; pass "
                f"ckpt_path='best', 'last' or a path to choose (and silence this warning)",
                stacklevel=3,
            )
        return self.lightning_module, ckpt_path

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool = False) -> None:
        """Write the training state (or only the weights) to ``filepath``; call it on every rank.

        Non-finite weights are never saved: a NaN or infinity raises a ``FloatingPointError`` instead, and
        the checkpoints saved before stay as they are.
        """
        self.fit_loop.check_losses()  # a NaN loss must never be saved over a good checkpoint
        module = self.lightning_module
        nonfinite = checkpoint_state.nonfinite_parameters(module) if module is not None else []
        if self.strategy.reduce(torch.tensor(float(len(nonfinite))), "max") > 0:
            shown = f" ({', '.join(nonfinite[:5])}{', ...' if len(nonfinite) > 5 else ''})" if nonfinite else ""
            raise FloatingPointError(
                f"the weights hold NaN or infinite values at global step {self.global_step}{shown}: "
                f"{os.fspath(filepath)!r} was not saved, and the checkpoints saved before are kept"
            )
        checkpoint = checkpoint_state.training_state(self, weights_only=weights_only)
        self.strategy.save_checkpoint(checkpoint, os.fspath(filepath))

    def _restore(self, path: str, weights_only: bool | None) -> None:
        """Continue from a checkpoint written by ``save_checkpoint``: weights, optimizers, loop position."""
        checkpoint = self.strategy.load_checkpoint(path, trust_pickles=weights_only is False)
        checkpoint_state.restore_training_state(self, checkpoint, path)

    def _resolve_checkpoint(self, ckpt_path: str | None) -> str | None:
        """An explicit path as it is; "last" and "best" looked up (by rank zero, for every rank)."""
        if ckpt_path not in ("last", "best"):
            return ckpt_path
        found = checkpoint_state.find_checkpoint(self, ckpt_path) if self.is_global_zero else None
        found = self.strategy.broadcast(found)
        if found is None:
            if ckpt_path == "best":
                why = "no ModelCheckpoint saved one" if self.checkpoint_callback is None else "none was saved"
                raise FileNotFoundError(
                    f"ckpt_path='best': no best checkpoint is known ({why} under {self.default_root_dir!r})"
                )
            if self.is_global_zero:
                warnings.warn(
                    f"ckpt_path='last': no complete checkpoint of this run under {self.runs_dir!r} yet; "
                    "training starts from scratch",
                    stacklevel=6,  # the user's fit: through _begin_stage, _stage and contextlib
                )
        else:
            self.print(f"resuming from {found}")
        return found

    def _load_weights(self, ckpt_path: str | None, weights_only: bool | None) -> None:
        if ckpt_path is None:
            return
        checkpoint = self.strategy.load_checkpoint(ckpt_path, trust_pickles=weights_only is False)
        module = self.lightning_module
        assert module is not None
        module.on_load_checkpoint(checkpoint)
        checkpoint_state.load_weights(self.strategy.load_module_state_dict, module, checkpoint, ckpt_path)

    # ------------------------------------------------------------------------------ stages
    @contextlib.contextmanager
    def _stage(
        self, stage: str, module: Module, datamodule: DataModule | None, ckpt_path: str | None = None
    ) -> Iterator[str | None]:
        """Attach the module and data, set everything up for ``stage``, and tear it down afterwards
        (on success and on error); gives the checkpoint ``ckpt_path`` names ("last" and "best" looked up)."""
        status = "failed"
        try:
            path = self._begin_stage(stage, module, datamodule, ckpt_path)
            with torch.autograd.set_detect_anomaly(self.config.detect_anomaly):
                yield path
            self.strategy.end_stage()  # a save in flight completes before the stage does
            status = "success"
        except DoctorDone:
            status = "interrupted"  # `ember doctor` has seen enough steps
            raise
        except BaseException as exception:
            if isinstance(exception, KeyboardInterrupt):  # Ctrl-C outside training, or a second one in it
                status = "interrupted"
            earlier = self.strategy.announce_failure(exception) if isinstance(exception, Exception) else None
            if self._hooks is not None:
                self._hooks.call_callbacks("on_exception", exception)
            if datamodule is not None:
                datamodule.on_exception(exception)
            if earlier is not None:  # the traceback to read is that rank's, not this consequence's
                print(f"[rank{self.global_rank}]: stopping because {earlier}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            raise
        finally:
            self._end_stage(stage, module, datamodule, status)

    def _begin_stage(
        self, stage: str, module: Module, datamodule: DataModule | None, ckpt_path: str | None
    ) -> str | None:
        self.stage = stage
        self.run_metrics.reset()
        self.lightning_module = module
        module.trainer = self
        self.datamodule = datamodule
        if module is not self._callbacks_added_by:  # the module's own callbacks join once
            self.callbacks = _with_module_callbacks(self.callbacks, module)
            self._callbacks_added_by = module
        # Hook lists are found lazily, at the first call: after the profiler below wrapped what it times.
        self._hooks = hooks = Hooks(self, module, self.callbacks, datamodule)
        hooks.check()
        if datamodule is not None:
            datamodule.trainer = self
        if not self._environment_ready:
            self.strategy.setup_environment()
            self.strategy.describe_position(self._position)
            self._environment_ready = True
        # The run's directory is settled before any hook (setup, a profiler) can ask for it. A fit resumed
        # with "last" continues its predecessor's directory in place; any other run has one of its own.
        path = self.ckpt_path = self._resolve_checkpoint(ckpt_path)
        self._settle_run_directory(continuing=path if stage == "fit" and ckpt_path == "last" else None)
        self._prepare_data(stage, module, datamodule)
        module.setup(stage)
        for callback in self.callbacks:
            callback.setup(self, module, stage)
        configure_model = hooks.module_hook("configure_model")
        if configure_model is not None and _callable_without_arguments(configure_model):
            configure_model()  # Lightning's form; the form that takes a device mesh is the strategy's to call
        if stage == "fit":
            self._start_doctor()  # before the model is wrapped, so that the wrapper is watched too
        self.strategy.setup_module(module, training=stage == "fit")
        self.profiler.setup(self, stage)
        return path

    def _prepare_data(self, stage: str, module: Module, datamodule: DataModule | None) -> None:
        """``prepare_data`` once per machine (the module's and the datamodule's), then the datamodule's ``setup``."""
        if self.local_rank == 0:
            if self.hooks.module_hook("prepare_data") is not None:
                module.prepare_data()
            if datamodule is not None:
                datamodule.prepare_data()
        self.strategy.barrier()
        if datamodule is not None:
            datamodule.setup(stage)

    def _end_stage(self, stage: str, module: Module, datamodule: DataModule | None, status: str) -> None:
        try:
            if status != "success":  # the write in flight still completes (its error, if any, is secondary)
                with contextlib.suppress(Exception):
                    self.strategy.wait_for_checkpoints()
            self.profiler.teardown(self, stage)
            if self._doctor is not None and status != "interrupted":
                self._doctor.finish()  # fit ended before the doctor saw all its steps: report what it saw
            self._doctor = None
            for callback in self.callbacks:
                callback.teardown(self, module, stage)
            module.teardown(stage)
            if datamodule is not None:
                datamodule.teardown(stage)
            if self.is_global_zero:
                for logger in self.loggers:
                    logger.finalize(status)
        finally:
            for loader in self._stage_loaders:
                release_workers(loader)
            self._stage_loaders = []
            self.strategy.teardown()
            self.stage = None
            self._hooks = None

    def _settle_run_directory(self, continuing: str | None = None) -> None:
        """Rank zero claims this run's directory (or, continuing a checkpoint in place, takes the one that
        holds it) and checks that it can write there, before any work; every rank then uses the same one."""
        if self._run_settled:
            return
        outcome = self._claim_run_directory(continuing) if self.is_global_zero else None
        versions, run_version, problem = self.strategy.broadcast(outcome)
        if problem is not None:
            raise problem  # rank zero's, of its own type (PermissionError, ...), on every rank
        for logger, version in zip(self.loggers, versions):
            logger.use_version(version)
        self._run_version = run_version
        self._run_settled = True

    def _claim_run_directory(self, continuing: str | None) -> tuple[list[int | str], int | None, OSError | None]:
        try:
            versions = settle_versions(self.loggers, continuing)
            run_version = None
            # Without a logger that keeps files, checkpoints that have no directory of their own still get one
            # that belongs to this run alone.
            homeless = any(callback.dirpath is None for callback in self.checkpoint_callbacks)
            keeps_checkpoints = self.stage == "fit" and not self.fast_dev_run
            if keeps_checkpoints and homeless and not any(logger.log_dir for logger in self.loggers):
                run_version = lineage_version(self.runs_dir, continuing)
                run_version = claim_version(self.runs_dir) if run_version is None else run_version
            self._run_version = run_version
            for directory in self._directories_written():
                checkpoint_io.prepare_directory(directory)
        except OSError as error:
            return [], None, error
        return versions, run_version, None

    def _directories_written(self) -> list[str]:
        """The directories this run writes into: its run directory and its checkpoints' directories."""
        log_dir = self.log_dir
        directories = [log_dir] if log_dir is not None else []
        default = os.path.join(log_dir or self.default_root_dir, "checkpoints")
        if self.stage == "fit" and not self.fast_dev_run:
            directories += [callback.dirpath or default for callback in self.checkpoint_callbacks]
        return directories

    def _position(self) -> str:
        """Where the run is, in words (for the messages of a parallel strategy's watchdog)."""
        if self.stage is None or self.stage == "fit":
            return f"global step {self.global_step} (epoch {self.current_epoch})"
        return f"{self.stage} batch {self.strategy.batches_moved}"

    def _start_doctor(self) -> None:
        doctor = active_doctor()  # `ember doctor` runs this script
        if doctor is None and self.config.doctor_steps:
            doctor = self._doctor = Doctor(steps=self.config.doctor_steps).install()
        if doctor is not None:
            doctor.attach(self)

    def _loaders(self, kind: str, given: _Loaders, required: bool = False) -> list[Iterable]:
        """The loaders of one kind: passed in, else from the datamodule, else from the module."""
        if given is None:
            hook = f"{kind}_dataloader"
            for source in (self.datamodule, self.lightning_module):
                if source is not None and hasattr(source, hook):
                    given = getattr(source, hook)()
                    break
        if given is None:
            if required:
                raise ValueError(
                    f"no {kind} data: pass dataloaders to the Trainer's method, or define "
                    f"{kind}_dataloader() on the Module or a DataModule"
                )
            return []
        # A list of DataLoaders is several loaders; any other iterable (even a list of batches) is one.
        several = isinstance(given, (list, tuple)) and given and all(isinstance(item, DataLoader) for item in given)
        loaders = list(given) if several else [given]
        if kind == "train" and len(loaders) != 1:
            raise ValueError(f"fit() trains on one dataloader; got {len(loaders)}")
        if self.config.overfit_batches and kind in ("train", "val"):
            loaders = [in_order(loader, "overfit_batches") for loader in loaders]  # the same batches every epoch
        shard = self.config.use_distributed_sampler
        prepared = [prepare_loader(loader, self.strategy, train=kind == "train", shard=shard) for loader in loaders]
        self._stage_loaders += prepared
        self._latest_loaders[kind] = prepared
        return prepared


def _one_or_list(loaders: list[Iterable] | None) -> Iterable | list[Iterable] | None:
    if not loaders:
        return None
    return loaders[0] if len(loaders) == 1 else loaders


# -------------------------------------------------------------------------- flag checking
def _checked_path(ckpt_path: str | os.PathLike | None) -> str | None:
    """``ckpt_path`` as a string, failing now (before any process starts) if an explicit path is missing."""
    if ckpt_path is None:
        return None
    ckpt_path = os.fspath(ckpt_path)
    if ckpt_path in ("last", "best") or os.path.exists(ckpt_path):
        return ckpt_path
    if os.path.islink(ckpt_path):
        checkpoint_io.verify(ckpt_path)  # says where the dangling link points
    raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no such checkpoint (pass a path, 'last' or 'best')")


def _check_module(model: Any, stage: str) -> None:
    if isinstance(getattr(model, "_orig_mod", None), Module):
        raise TypeError(
            f"Trainer.{stage}() got a torch.compile()d module; pass the Module itself and "
            "Trainer(compile=True) (or a dict of torch.compile options) to compile it"
        )
    if not isinstance(model, Module):
        raise TypeError(f"Trainer.{stage}() needs an ember.Module; got {type(model).__name__}")
    required = {"fit": ("training_step", "configure_optimizers"), "validate": ("validation_step",),
                "test": ("test_step",), "predict": ()}[stage]  # fmt: skip
    missing = [name for name in required if not hasattr(model, name)]
    if missing:
        raise NotImplementedError(f"Trainer.{stage}() needs {type(model).__name__} to define {', '.join(missing)}")


def _set_determinism(config: TrainerConfig) -> None:
    if config.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=config.deterministic == "warn")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    elif config.benchmark is not None:
        torch.backends.cudnn.benchmark = config.benchmark


def _build_loggers(config: TrainerConfig) -> list[Logger]:
    logger = config.logger
    if logger is False:
        return []
    if config.fast_dev_run:
        return [DummyLogger()]  # nothing is kept, but code that writes to trainer.logger still runs
    if logger is True:
        # As Lightning's default, TensorBoard when it is installed (trainer.logger.experiment is its writer);
        # metrics.csv is written beside it, for `ember plot` and for reading without TensorBoard.
        csv = CSVLogger(config.root_dir)
        return [TensorBoardLogger(config.root_dir), csv] if importlib.util.find_spec("tensorboard") else [csv]
    return [logger] if isinstance(logger, Logger) else list(logger)


def _build_callbacks(config: TrainerConfig) -> list[Callback]:
    callbacks = config.callbacks
    given = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    if config.enable_progress_bar and not any(isinstance(callback, ProgressBar) for callback in given):
        given.append(ProgressBar())
    if not config.enable_progress_bar:
        given = [callback for callback in given if not isinstance(callback, ProgressBar)]
    checkpointing = any(isinstance(callback, ModelCheckpoint) for callback in given)
    if config.enable_checkpointing and not checkpointing:
        given.append(ModelCheckpoint())
    if not config.enable_checkpointing and checkpointing:
        raise ValueError("enable_checkpointing=False, but a ModelCheckpoint was passed in callbacks")
    summary = any(isinstance(callback, ModelSummary) for callback in given)
    if config.enable_model_summary and not summary:
        given.insert(0, ModelSummary())
    if not config.enable_model_summary and summary:
        raise ValueError("enable_model_summary=False, but a ModelSummary was passed in callbacks")
    # Callbacks that read epoch metrics (checkpointing, early stopping) run last, in the given order.
    return sorted(given, key=lambda callback: callback.reads_epoch_metrics)


def _callable_without_arguments(function: Any) -> bool:
    return all(
        parameter.default is not parameter.empty or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
        for parameter in inspect.signature(function).parameters.values()
    )


def _with_module_callbacks(callbacks: list[Callback], module: Module) -> list[Callback]:
    """The Trainer's callbacks with those of ``module.configure_callbacks()``, which replace any of the same type."""
    returned = module.configure_callbacks()
    added = [returned] if isinstance(returned, Callback) else list(returned)
    if not added:
        return callbacks
    replaced = {type(callback) for callback in added}
    kept = [callback for callback in callbacks if type(callback) not in replaced]
    # Callbacks that read epoch metrics (checkpointing, early stopping) run last, as in _build_callbacks.
    return sorted(kept + added, key=lambda callback: callback.reads_epoch_metrics)


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    for index, metrics in enumerate(results):
        title = f"{stage} results" + (f" (dataloader {index})" if len(results) > 1 else "")
        width = max([len(name) for name in metrics] + [len(title)])
        print(title)
        for name, value in metrics.items():
            print(f"  {name:<{width}}  {value:.6g}")
