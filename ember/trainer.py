"""The Trainer: the public entry points (fit, validate, test, predict) and the properties callbacks read.

Its flags are checked once into a ``TrainerConfig``; the strategy decides how devices and processes
are used; the loops (``ember.loops``) run the steps and own where the run is. What the Trainer only
forwards from its parts (the strategy, the config, the loops) it reads with ``Reads``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch

from ember._utils import Reads
from ember.callbacks import Callback, EarlyStopping, ModelCheckpoint, ProgressBarBase
from ember.checkpoint import state as checkpoint_state
from ember.config import TrainerConfig, environment_defaults
from ember.data import prepare_loaders, release_workers
from ember.doctor import Doctor, DoctorDone, active_doctor
from ember.hparams import drop_unpicklable
from ember.loggers import Logger
from ember.loops.evaluate import EvaluationLoop, PredictionLoop
from ember.loops.fit import FitLoop
from ember.loops.hooks import Hooks
from ember.metrics import RunMetrics
from ember.module import DataModule, Module, data_source
from ember.profilers import Profiler, select_profiler
from ember.rank_zero import announce, rank_zero_only
from ember.run_directory import RunDirectory
from ember.strategies import FaultTolerance, Strategy, select_strategy
from ember.trainer_failure import call_exception_hooks, stage_failed
from ember.trainer_parts import (
    check_module,
    checked_path,
    default_callbacks,
    default_loggers,
    estimated_stepping_batches,
    evaluated_module,
    known_flags_only,
    log_hyperparameters,
    set_determinism,
    validates_in_fit,
    with_module_callbacks,
)
from ember.trainer_properties import LightningProperties
from ember.trainer_results import StageResults
from ember.trainer_state import TrainerState

_Loaders = Iterable | Sequence[Iterable] | None
_Limit = int | float | None


def _all_if_none(limit: _Limit) -> int | float:
    return 1.0 if limit is None else limit


def _inf_if_all(steps: int) -> int | float:
    return math.inf if steps == -1 else steps


class Trainer(LightningProperties):
    """Runs a ``Module``'s steps: ``fit`` trains (and validates), ``validate``/``test`` evaluate, ``predict`` infers.

    All flags are keyword-only and follow PyTorch Lightning's names and meanings; ``TrainerConfig``
    documents each one, and checks them all when the Trainer is built.

    On SIGTERM (and SIGUSR1 under SLURM) ``fit`` saves ``last.ckpt`` at the next step boundary and exits;
    ``slurm_requeue=True`` also requeues the SLURM job. Resume with ``fit(ckpt_path="last")``.
    """

    @known_flags_only
    @environment_defaults
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
        val_check_interval: int | float | str | timedelta | Mapping[str, int] | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        accumulate_grad_batches: int | Literal["auto"] = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] | None = None,
        log_every_n_steps: int | None = None,
        callbacks: Callback | Sequence[Callback] | None = None,
        logger: bool | Logger | Sequence[Logger] | None = None,
        enable_progress_bar: bool | None = None,
        enable_checkpointing: bool | None = None,
        enable_model_summary: bool | None = None,
        profiler: str | Profiler | None = None,
        enable_autolog_hparams: bool = True,
        barebones: bool = False,
        default_root_dir: str | os.PathLike | None = None,
        deterministic: bool | Literal["warn"] | None = None,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        detect_anomaly: bool = False,
        use_distributed_sampler: bool = True,
        sync_batchnorm: bool = False,
        slurm_requeue: bool = False,
        restart_on_data_change: bool = False,
        async_checkpoint: bool = False,
        timeout: int | float | timedelta | None = None,
        fault_tolerance: FaultTolerance | None = None,
        doctor: bool | int = False,
        gpus: int | str | Sequence[int] | None = None,
        plugins: Any = None,
        model_registry: str | None = None,
    ) -> None:
        flags = {name: value for name, value in locals().items() if name != "self"}
        given = TrainerConfig.of_trainer(**flags)
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
            fault_tolerance=config.fault_tolerance,
        )
        # Under fault tolerance only replica group 0's rank 0 prints.
        rank_zero_only.rank = int(not self.strategy.is_global_zero)  # type: ignore[attr-defined]
        set_determinism(config)
        self._loggers: list[Logger] = default_loggers(config)  # one list: ``loggers = ...`` refills it
        self.callbacks: list[Callback] = default_callbacks(config)
        if config.fast_dev_run:
            announce(f"fast_dev_run: running {int(config.fast_dev_run)} batch(es) of each loop; logging, "
                     "checkpointing and early stopping are off")  # fmt: skip
        self.profiler: Profiler = select_profiler(config.profiler)
        #: What the run has logged with ``self.log`` and what went to the loggers.
        is_global_zero = functools.partial(getattr, self.strategy, "is_global_zero")  # read at each write
        self.run_metrics = RunMetrics(
            self.strategy.reduce, self._loggers, is_global_zero, copy_values=self.strategy.reuses_outputs
        )
        self.fit_loop = FitLoop(self)
        self.validate_loop = EvaluationLoop(self, "validate")
        self.test_loop = EvaluationLoop(self, "test")
        self.predict_loop = PredictionLoop(self)
        #: "fit", "validate", "test" or "predict" while one runs.
        self.stage: str | None = None
        #: The entry point, the loop running in it and the latest status, in Lightning's terms.
        self.state = TrainerState(self)
        #: The module being run (the name Lightning uses).
        self.lightning_module: Module | None = None
        self.datamodule: DataModule | None = None
        self._hooks: Hooks | None = None  # the latest stage's (kept after it: save_checkpoint calls them)
        self._environment_ready = False
        self._stage_loaders: list[Iterable] = []  # the loaders of the stage in progress
        self._latest_loaders: dict[str, Any] = {}  # by kind ("val", ...): the latest stage's, as given
        self._run_directory = RunDirectory(self)
        self._doctor: Doctor | None = None

    # ------------------------------------------------------- what the Trainer reads of its parts
    global_rank: Reads[int] = Reads("strategy.global_rank")
    local_rank: Reads[int] = Reads("strategy.local_rank")
    node_rank: Reads[int] = Reads("strategy.node_rank")
    world_size: Reads[int] = Reads("strategy.world_size")
    num_nodes: Reads[int] = Reads("strategy.num_nodes")
    replica_group: Reads[int] = Reads("strategy.replica_group")  # under fault tolerance (ember run --replica-groups)
    num_replica_groups: Reads[int] = Reads("strategy.num_replica_groups")
    is_global_zero: Reads[bool] = Reads("strategy.is_global_zero")
    precision: Reads[str] = Reads("strategy.precision.name")
    #: What the steps run through: the module, or the strategy's wrapper around it.
    model: Reads[torch.nn.Module | None] = Reads("strategy.model")
    module: Reads[Module | None] = Reads("lightning_module")
    # Lightning's names of the flags (``default_root_dir`` is ``config.root_dir``; ``max_epochs`` the flag as given
    # until ``fit`` resolves it, while the loops read ``config.epoch_limit``).
    max_epochs: Reads[int | None] = Reads("config.max_epochs")
    default_root_dir: Reads[str] = Reads("config.root_dir")
    max_steps: Reads[int] = Reads("config.max_steps")
    min_epochs: Reads[int | None] = Reads("config.min_epochs")
    min_steps: Reads[int | None] = Reads("config.min_steps")
    accumulate_grad_batches: Reads[int | Literal["auto"]] = Reads("fit_loop.accumulate")
    log_every_n_steps: Reads[int] = Reads("config.log_every_n_steps")
    check_val_every_n_epoch: Reads[int | None] = Reads("config.check_val_every_n_epoch")
    val_check_interval: Reads[int | float | str | timedelta | Mapping[str, int]] = Reads("config.val_check_interval")
    gradient_clip_val: Reads[int | float | None] = Reads("config.gradient_clip_val")
    gradient_clip_algorithm: Reads[str | None] = Reads("config.gradient_clip_algorithm")
    barebones: Reads[bool] = Reads("config.barebones")
    # In Lightning's convention, as its Trainer gives them: a batch limit not given is 1.0 (all), a sanity check of
    # every batch (-1) is inf, fast_dev_run=1 is True (the limits then read its count, as the loops apply them).
    num_sanity_val_steps: Reads[int | float] = Reads("config.num_sanity_val_steps", _inf_if_all)
    fast_dev_run: Reads[bool | int] = Reads("config.fast_dev_run", lambda runs: True if runs == 1 else runs)
    limit_train_batches: Reads[int | float] = Reads("config.limit_train_batches", _all_if_none)
    limit_val_batches: Reads[int | float] = Reads("config.limit_val_batches", _all_if_none)
    limit_test_batches: Reads[int | float] = Reads("config.limit_test_batches", _all_if_none)
    limit_predict_batches: Reads[int | float] = Reads("config.limit_predict_batches", _all_if_none)
    global_step: Reads[int] = Reads("fit_loop.progress.global_step")
    current_epoch: Reads[int] = Reads("fit_loop.current_epoch")
    #: True once a preemption signal made ``fit`` save a checkpoint and stop.
    preempted: Reads[bool] = Reads("fit_loop.stopping.preempted")
    sanity_checking: Reads[bool] = Reads("fit_loop.sanity_checking")
    #: Whether the training batch being run is the epoch's last (a manual schedule steps there).
    is_last_batch: Reads[bool] = Reads("fit_loop.is_last_batch")
    validation_enabled: Reads[bool] = Reads("fit_loop.validation_enabled")
    enable_validation: Reads[bool] = Reads("fit_loop.validation_enabled")  # (Lightning's name)
    num_training_batches: Reads[float] = Reads("fit_loop.num_training_batches")
    optimizers: Reads[list[torch.optim.Optimizer]] = Reads("fit_loop.optimizers")
    num_val_batches: Reads[list[float]] = Reads("validate_loop.num_batches")
    num_sanity_val_batches: Reads[list[float]] = Reads("validate_loop.num_sanity_batches")
    num_test_batches: Reads[list[float]] = Reads("test_loop.num_batches")
    num_predict_batches: Reads[list[float]] = Reads("predict_loop.num_batches")
    #: The values last written to the loggers.
    logged_metrics: Reads[dict[str, torch.Tensor]] = Reads("run_metrics.logged")
    # The loop running (``trainer.state.stage``).
    training: Reads[bool] = Reads("state.training")
    validating: Reads[bool] = Reads("state.validating")
    testing: Reads[bool] = Reads("state.testing")
    predicting: Reads[bool] = Reads("state.predicting")
    evaluating: Reads[bool] = Reads("state.evaluating")
    interrupted: Reads[bool] = Reads("state.stopped")  # the latest entry point ended with an exception

    @property
    def hooks(self) -> Hooks:
        """The hooks of the latest stage: the module's, the datamodule's and the callbacks' implementations."""
        if self._hooks is None:
            raise RuntimeError("trainer.hooks exist once fit, validate, test or predict has started")
        return self._hooks

    @property
    def should_stop(self) -> bool:
        return self.fit_loop.stopping.requested

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        """Ask ``fit`` to stop after the current step (or epoch), once ``min_epochs``/``min_steps`` allow it."""
        self.fit_loop.stopping.requested = value

    # The loaders of the latest stage of each kind as they were given (the loops read prepared copies).
    @property
    def train_dataloader(self) -> Any:
        return self._latest_loaders.get("train")

    @property
    def val_dataloaders(self) -> Any:
        """The validation loaders of the latest ``fit`` or ``validate``."""
        return self._latest_loaders.get("val")

    @property
    def test_dataloaders(self) -> Any:
        return self._latest_loaders.get("test")

    @property
    def predict_dataloaders(self) -> Any:
        return self._latest_loaders.get("predict")

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps ``fit`` will take (``math.inf`` if unbounded); usable from ``setup`` on, and
        outside ``fit`` (the tuner's trials) from the training loader the module or datamodule makes."""
        return estimated_stepping_batches(self)

    # ------------------------------------------------------------------------- logging state
    #: The first logger's ``log_dir`` (the same on every rank once a stage has started; None: it keeps no files),
    #: or ``default_root_dir`` without a logger, as in Lightning.
    log_dir: Reads[str | None] = Reads("_run_directory.log_dir")
    #: Where this run's directory and its predecessors' (``version_N``) are.
    runs_dir: Reads[str] = Reads("_run_directory.runs_dir")
    #: Where this run's checkpoints go: the first ModelCheckpoint's directory, else ``<log_dir>/checkpoints``
    #: (``<default_root_dir>/checkpoints`` without a logger).
    checkpoint_dir: Reads[str] = Reads("_run_directory.checkpoint_dir")
    #: The checkpoint a fit resumed with ``ckpt_path="last"`` continues in place, taking over its files (None: the
    #: stage continues no run in place).
    continued_checkpoint: Reads[str | None] = Reads("_run_directory.continuing")

    def preemption_checkpoint_path(self) -> str:
        """Where a preemption signal's checkpoint goes: ``last.ckpt`` in this run's checkpoint directory."""
        return os.path.join(self.checkpoint_dir, "last.ckpt")

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every logged metric, as tensors; of a name logged per step and per epoch, the newer."""
        return self.run_metrics.callback_metrics()

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
    def early_stopping_callbacks(self) -> list[EarlyStopping]:
        return [callback for callback in self.callbacks if isinstance(callback, EarlyStopping)]

    @property
    def early_stopping_callback(self) -> EarlyStopping | None:
        return next(iter(self.early_stopping_callbacks), None)

    @property
    def progress_bar_callback(self) -> ProgressBarBase | None:
        return next((callback for callback in self.callbacks if isinstance(callback, ProgressBarBase)), None)

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
        train_dataloaders, datamodule = data_source("fit", train_dataloaders, datamodule, val_dataloaders)
        check_module(model, "fit", self.config)
        self.config = self.config.for_fit()
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        ckpt_path = self._stage_checkpoint(ckpt_path)
        if ckpt_path is None and restarted and not self.strategy.heals_from_peers:
            ckpt_path = "last"  # restarted by the elastic agent after a failure: continue the run
        ckpt_path = checked_path(ckpt_path)
        args = (model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)
        self.strategy.launch(self._fit, *args, results=StageResults(self, model, "fit"))

    def _fit(self, model: Module, train_dataloaders: _Loaders, val_dataloaders: _Loaders, datamodule: DataModule | None,
             ckpt_path: str | None, weights_only: bool | None) -> None:  # fmt: skip
        given = train_dataloaders is not None
        self.fit_loop.prepare(functools.partial(self._loaders, "train", train_dataloaders, required=True), given)
        with self._stage("fit", model, datamodule, ckpt_path) as path:
            validates = validates_in_fit(model, val_dataloaders is not None or self.hooks.has_loaders("val"))
            restore = functools.partial(checkpoint_state.resume_from, self, path, weights_only) if path else None
            # Partials, not lambdas, as the loop keeps them: a Trainer pickles, as Lightning's does.
            self.fit_loop.run(functools.partial(self._loaders, "val", val_dataloaders) if validates else None, restore)
        if self.preempted:
            self.print(self.fit_loop.stopping.report(self.global_step))  # once the progress bar has ended
            # The usual status of a process ended by that signal (143 for SIGTERM, 130 for Ctrl-C), so that
            # schedulers and launchers see the run was stopped, not finished.
            raise SystemExit(128 + (self.fit_loop.stopping.stop_signal or signal.SIGTERM))

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
        return_predictions: bool | None = True,
        ckpt_path: str | os.PathLike | None = None,
        weights_only: bool | None = True,
    ) -> list[Any] | None:
        """Run ``predict_step``; the outputs (on the CPU) as a list, a list per dataloader when there are several
        (``model`` and ``ckpt_path`` as for ``validate``; ``return_predictions=None`` is the default, True)."""
        return self._evaluate(self.predict_loop, model, dataloaders, ckpt_path, datamodule, return_predictions
                              is not False, weights_only)  # fmt: skip

    def _evaluate(self, loop: EvaluationLoop, model: Module | None, dataloaders: _Loaders | DataModule,
                  ckpt_path: str | os.PathLike | None, datamodule: DataModule | None, option: bool,
                  weights_only: bool | None) -> Any:  # fmt: skip
        """``validate``, ``test`` and ``predict``: ``option`` is their ``verbose`` or ``return_predictions``."""
        dataloaders, datamodule = data_source(loop.stage, dataloaders, datamodule)
        model, ckpt_path = evaluated_module(self, model, loop.stage, self._stage_checkpoint(ckpt_path))
        check_module(model, loop.stage)
        args = (loop, model, dataloaders, checked_path(ckpt_path), datamodule, option, weights_only)
        return self.strategy.launch(self._run_evaluation, *args, results=StageResults(self, model, loop.stage))

    def _run_evaluation(self, loop: EvaluationLoop, model: Module, dataloaders: _Loaders, ckpt_path: str | None,
                        datamodule: DataModule | None, option: bool, weights_only: bool | None) -> Any:  # fmt: skip
        with self._stage(loop.stage, model, datamodule, ckpt_path) as path:
            model.zero_grad()  # as Lightning does: the gradients a fit left are not kept while evaluating
            checkpoint_state.load_weights_into(self, path, weights_only)
            log_hyperparameters(self)  # as fit does: each stage's run directory has them, as in Lightning
            return loop.evaluate(functools.partial(self._loaders, loop.kind, dataloaders, True), dataloaders, option)

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, filepath: str | os.PathLike, weights_only: bool | None = False, storage_options: Any = None
    ) -> None:
        """Write the training state (or only the weights) to ``filepath``; call it on every rank.

        Non-finite weights are never saved: a NaN or infinity raises a ``FloatingPointError`` instead, and
        the checkpoints saved before stay as they are. ``storage_options`` (Lightning's, for its checkpoint
        plugins) must be None: files are written to the local file system.
        """
        if storage_options is not None:
            raise TypeError(f"Trainer.save_checkpoint(storage_options={storage_options!r}): Ember writes checkpoints "
                            "to the local file system and takes no storage options; leave it None")  # fmt: skip
        self.fit_loop.check_losses()  # a NaN loss must never be saved over a good checkpoint
        checkpoint_state.refuse_nonfinite_weights(self, os.fspath(filepath))
        checkpoint = checkpoint_state.training_state(self, weights_only=bool(weights_only))
        self.strategy.save_checkpoint(checkpoint, os.fspath(filepath))

    # ------------------------------------------------------------------------------ stages
    @contextlib.contextmanager
    def _stage(
        self, stage: str, module: Module, datamodule: DataModule | None, ckpt_path: str | None = None
    ) -> Iterator[str | None]:
        """Attach the module and data, set everything up for ``stage``, and tear it down afterwards
        (on success and on error); gives the checkpoint ``ckpt_path`` names ("last" and "best" looked up)."""
        status, raised = "failed", False
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
            raised = True
            if isinstance(exception, KeyboardInterrupt):  # Ctrl-C outside training, or a second one in it
                status = "interrupted"
            stage_failed(self, self._hooks, exception)  # the on_exception hooks; an exit instead, where Lightning exits
            raise
        finally:
            self._end_stage(stage, status, teardown_hooks=not raised)

    def _begin_stage(
        self, stage: str, module: Module, datamodule: DataModule | None, ckpt_path: str | None
    ) -> str | None:
        self.stage = stage
        self.state.begin(stage)
        self._hooks, self._latest_loaders = None, {}  # trainer.val_dataloaders, ...: this stage's only, as Lightning's
        self.run_metrics.reset(fitting=stage == "fit")
        self.lightning_module = module
        module.trainer = self
        drop_unpicklable(module.hparams)
        self.datamodule = datamodule
        # At each stage, as Lightning does. "last" is looked up after, in the dirpath of a ModelCheckpoint the
        # module returns; a fresh one's "best" is read from the checkpoints of the fit before.
        returned = Hooks(self, module, self.callbacks, datamodule).call_module("configure_callbacks")
        self.callbacks = with_module_callbacks(self.callbacks, returned)
        hooks = self._hooks = Hooks(self, module, self.callbacks, datamodule)
        hooks.check()
        if datamodule is not None:
            datamodule.trainer = self
        if not self._environment_ready:
            self.strategy.setup_environment()
            self.strategy.describe_position(self._position)
            self._environment_ready = True
        path = self._ckpt_path = checkpoint_state.resolve(self, ckpt_path)
        # The run's directory is settled before any hook (setup, a profiler) can ask for it. A fit resumed
        # with "last" continues its predecessor's directory in place; any other run has one of its own.
        self._run_directory.settle(continuing=path if stage == "fit" and ckpt_path == "last" else None)
        self.profiler.attach(self, stage)  # from prepare_data to teardown, as Lightning times the hooks
        hooks.prepare_data()  # once per machine, or once in all (prepare_data_per_node=False)
        self.strategy.barrier()
        hooks.setup(stage)
        hooks.configure_model()
        if stage == "fit":
            self._start_doctor()  # before the model is wrapped, so that the wrapper is watched too
        self.strategy.setup_module(module, training=stage == "fit")
        return path

    def _end_stage(self, stage: str, status: str, teardown_hooks: bool) -> None:
        try:
            if status != "success":  # the write in flight still completes (its error, if any, is secondary)
                with contextlib.suppress(Exception):
                    self.strategy.wait_for_checkpoints()
            if self._doctor is not None and status != "interrupted":
                self._doctor.finish()  # fit ended before the doctor saw all its steps: report what it saw
            self._doctor = None
            try:
                if self._hooks is not None and teardown_hooks:  # as Lightning: a stage that raised skips teardown()
                    self._hooks.teardown(stage)
            except BaseException as exception:
                status = "failed"  # as Lightning: a teardown() that raises fails the stage
                call_exception_hooks(self, self._hooks, exception)
                raise
            finally:
                self.profiler.detach(self, stage)  # its wrappers come off whatever teardown() did
                self._finalize_loggers(status)
        finally:
            for loader in self._stage_loaders:
                release_workers(loader)
            self._stage_loaders = []
            self.strategy.teardown()
            self.stage = None
            self.state.end(interrupted=status != "success")

    def _finalize_loggers(self, status: str) -> None:
        if self.is_global_zero:
            for logger in self.loggers:
                # Saved first: a logger of one's own may override finalize without calling save (Lightning's
                # template does), and Lightning has saved each one after every write by then.
                if callable(save := getattr(logger, "save", None)):
                    save()
                logger.finalize(status)

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
            given = self.hooks.data_loaders(kind)
        if given is None:
            if required:  # the default hooks raise the same error
                raise self.hooks.no_loaders(kind)
            return []
        config = self.config
        shown, prepared = prepare_loaders(given, kind, self.strategy, config.overfit_batches,
                                          config.use_distributed_sampler, self.stage)  # fmt: skip
        self._stage_loaders += prepared
        self._latest_loaders[kind] = shown
        return prepared
