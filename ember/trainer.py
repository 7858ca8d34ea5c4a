"""The Trainer: flags, the fit/validate/test/predict entry points, and the state callbacks read.

The loops themselves are in ``loop.py``; how devices and processes are used is the strategy's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from ember import checkpoint as checkpoint_io
from ember import loop
from ember._utils import is_overridden, parse_max_time
from ember.callbacks import Callback, EarlyStopping, ModelCheckpoint, ModelSummary, ProgressBar
from ember.doctor import Doctor, DoctorDone, active_doctor
from ember.loggers import CSVLogger, Logger
from ember.metrics import MetricStore, Number, to_floats
from ember.module import DataModule, Module
from ember.optim import LRSchedulerConfig
from ember.precision import canonical_precision
from ember.profilers import Profiler, select_profiler
from ember.rank_zero import rank_zero_only
from ember.strategies import Strategy, select_strategy

_Loaders = Iterable | Sequence[Iterable] | None
_Limit = int | float | None


class Trainer:
    """Runs a ``Module``'s steps: ``fit`` trains (and validates), ``validate``/``test`` evaluate, ``predict`` infers.

    All flags are keyword-only and follow PyTorch Lightning's names and meanings. Layout: ``accelerator``
    ("auto", "cpu", "cuda"/"gpu", "mps"), ``devices``, ``num_nodes``, ``strategy``; ``precision``.
    Length: ``max_epochs`` (-1 for no limit; 1000 when neither it nor ``max_steps`` is given),
    ``max_steps`` (optimizer steps), ``max_time``, ``limit_*_batches`` (an int counts batches, a float
    is a fraction of the loader). Validation: ``val_check_interval`` (fraction of an epoch or every N
    batches), ``check_val_every_n_epoch``, ``num_sanity_val_steps``. Optimization:
    ``accumulate_grad_batches`` (a count, or "auto": each batch is one step, split into as many
    micro-batches as memory needs, found by retrying after running out of memory),
    ``gradient_clip_val``/``gradient_clip_algorithm``. Watching the run: ``logger`` (True for a
    ``CSVLogger``, a ``Logger`` or a list of them), ``log_every_n_steps``, ``enable_progress_bar``,
    ``enable_model_summary``, ``profiler`` ("simple", "pytorch" or a ``Profiler``). Speed:
    ``float32_matmul_precision`` ("highest", or "high"/"medium" for TF32 tensor cores; None leaves torch's
    setting), ``compile`` (True, or a dict of ``torch.compile`` options, compiles the module's forward).

    ``doctor=True`` (or a number of steps) watches the first steps of ``fit`` and prints what slows them
    down, with the fixes (see ``ember doctor``); training then goes on without instrumentation.

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
        precision: str | int = "32-true",
        float32_matmul_precision: Literal["highest", "high", "medium"] | None = None,
        compile: bool | Mapping[str, Any] = False,
        max_epochs: int | None = None,
        max_steps: int = -1,
        max_time: str | timedelta | Mapping[str, int] | None = None,
        limit_train_batches: _Limit = None,
        limit_val_batches: _Limit = None,
        limit_test_batches: _Limit = None,
        limit_predict_batches: _Limit = None,
        val_check_interval: int | float = 1.0,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int = 2,
        accumulate_grad_batches: int | Literal["auto"] = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        log_every_n_steps: int = 50,
        callbacks: Callback | Sequence[Callback] | None = None,
        logger: bool | Logger | Sequence[Logger] = True,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        enable_model_summary: bool = True,
        profiler: str | Profiler | None = None,
        default_root_dir: str | os.PathLike | None = None,
        deterministic: bool | Literal["warn"] = False,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        detect_anomaly: bool = False,
        use_distributed_sampler: bool = True,
        sync_batchnorm: bool = False,
        slurm_requeue: bool = False,
        doctor: bool | int = False,
        gpus: int | str | Sequence[int] | None = None,
    ) -> None:
        if gpus is not None:
            if accelerator != "auto" or devices != "auto":
                raise ValueError(
                    "gpus= is the older spelling of accelerator='cuda', devices=...; pass only one of them"
                )
            if gpus in (0, "0", [], ()):
                accelerator, devices = "cpu", "auto"
            else:
                accelerator, devices = "cuda", gpus
        _check_count("num_nodes", num_nodes, minimum=1)
        _check_count("max_steps", max_steps, minimum=-1)
        if accumulate_grad_batches != "auto" and (
            isinstance(accumulate_grad_batches, bool)
            or not isinstance(accumulate_grad_batches, int)
            or accumulate_grad_batches < 1
        ):
            raise ValueError(f"accumulate_grad_batches={accumulate_grad_batches!r}: expected an int >= 1 or 'auto'")
        _check_count("log_every_n_steps", log_every_n_steps, minimum=1)
        _check_count("num_sanity_val_steps", num_sanity_val_steps, minimum=-1)
        if max_epochs is not None:
            _check_count("max_epochs", max_epochs, minimum=-1)
        if check_val_every_n_epoch is not None:
            _check_count("check_val_every_n_epoch", check_val_every_n_epoch, minimum=1)
        for flag, value in (
            ("limit_train_batches", limit_train_batches),
            ("limit_val_batches", limit_val_batches),
            ("limit_test_batches", limit_test_batches),
            ("limit_predict_batches", limit_predict_batches),
        ):
            _check_limit(flag, value)
        _check_val_check_interval(val_check_interval)
        if gradient_clip_val is not None and (not isinstance(gradient_clip_val, (int, float)) or gradient_clip_val < 0):
            raise ValueError(f"gradient_clip_val={gradient_clip_val!r} must be a non-negative number or None")
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}: choose 'norm' or 'value'")
        if deterministic not in (True, False, "warn"):
            raise ValueError(f"deterministic={deterministic!r}: choose True, False or 'warn'")
        canonical_precision(precision)  # fail on a bad value before any device is touched
        compile_options = _compile_options(compile)
        if float32_matmul_precision is not None:
            if float32_matmul_precision not in ("highest", "high", "medium"):
                raise ValueError(
                    f"float32_matmul_precision={float32_matmul_precision!r}: choose 'highest' (full float32), "
                    "'high' (TF32 tensor cores), 'medium' (bfloat16 passes) or None (leave torch's setting)"
                )
            torch.set_float32_matmul_precision(float32_matmul_precision)

        self.strategy: Strategy = select_strategy(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            strategy=strategy,
            precision=precision,
            sync_batchnorm=sync_batchnorm,
            compile_options=compile_options,
        )
        rank_zero_only.rank = self.strategy.global_rank  # type: ignore[attr-defined]

        if max_epochs is None:
            max_epochs = 1000 if max_steps == -1 and max_time is None else -1
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.max_time = parse_max_time(max_time)
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.limit_test_batches = limit_test_batches
        self.limit_predict_batches = limit_predict_batches
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.num_sanity_val_steps = num_sanity_val_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = os.fspath(default_root_dir) if default_root_dir is not None else os.getcwd()
        self.inference_mode = inference_mode
        self.detect_anomaly = detect_anomaly
        self.use_distributed_sampler = use_distributed_sampler
        self.slurm_requeue = slurm_requeue
        if doctor is not False and (doctor is not True and (not isinstance(doctor, int) or doctor <= 5)):
            raise ValueError(f"doctor={doctor!r}: True (watch 30 steps) or a number of steps above 5")
        self.doctor_steps = 30 if doctor is True else int(doctor)
        self._doctor: Doctor | None = None
        _set_determinism(deterministic, benchmark)

        self.loggers: list[Logger] = _build_loggers(logger, self.default_root_dir)
        self.callbacks: list[Callback] = _build_callbacks(
            callbacks, enable_progress_bar, enable_checkpointing, enable_model_summary
        )
        self.profiler: Profiler = select_profiler(profiler)

        # ----- state read by callbacks, modules and the loop
        self.stage: str | None = None
        self.sanity_checking = False
        self.should_stop = False
        self.global_step = 0
        self.current_epoch = 0
        self.module: Module | None = None
        self.datamodule: DataModule | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[LRSchedulerConfig] = []
        self.num_training_batches: float = 0
        self.validation_enabled = False
        self.logged_metrics: dict[str, torch.Tensor] = {}
        self._manual_optimizers: list[_ManualOptimizer] = []
        self._train_results = MetricStore(self.strategy.reduce)
        self._eval_results = MetricStore(self.strategy.reduce)
        self._results = self._train_results
        self._epoch_metrics: dict[str, Number] = {}  # finished epochs' values, read by callbacks
        self._prog_bar_epoch_metrics: dict[str, Number] = {}
        self._eval_batch_counts: list[float] = []
        self._last_loss: torch.Tensor | None = None
        # (loss, epoch, batch_idx, global_step) since the last finiteness check, kept on the device
        self._recent_losses: list[tuple[torch.Tensor, int, int, int]] = []
        self._next_log_step = log_every_n_steps
        self._total_train_batches = 0
        self._micro_batches = 1  # with accumulate_grad_batches="auto": pieces per batch that fit in memory
        self._stepped = False  # whether the latest training batch ended with an optimizer step
        self._at_epoch_end = False  # whether the running validation is the epoch's last one
        self._position = (0, 0)  # (epoch, batches done in it): where a resumed run continues
        self._deadline = math.inf
        self._data_seed = 0  # the order of training data; set at fit start, saved in checkpoints
        self._pending_random_state: dict[str, Any] | None = None  # restored when a resumed run starts
        self._signal_received: int | None = None
        self._stop_agreement = loop.StopAgreement()  # when the ranks next agree on stopping
        #: True once a preemption signal made ``fit`` save a checkpoint and stop.
        self.preempted = False
        self.train_dataloader: Iterable | None = None
        self._environment_ready = False
        self._hook_cache: dict[tuple[str, bool], list[Callable[..., Any]]] = {}

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
    def lightning_module(self) -> Module | None:
        """The module being run (the name Lightning uses)."""
        return self.module

    # ------------------------------------------------------------------------- logging state
    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str | None:
        """The first logger's run directory (the same on every rank once a stage has started)."""
        return self.loggers[0].log_dir if self.loggers else None

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        """The latest value of every logged metric (the epoch value where there is one), as tensors."""
        metrics = {**self._epoch_metrics, **self._train_results.step_values(fresh_only=False)}
        return {name: _as_tensor(value) for name, value in metrics.items()}

    @property
    def progress_bar_metrics(self) -> dict[str, float]:
        """Values logged with ``prog_bar=True``, as floats (reading them synchronises with the device)."""
        return to_floats({**self._prog_bar_epoch_metrics, **self._train_results.prog_bar_step_values()})

    @property
    def estimated_stepping_batches(self) -> float:
        """Optimizer steps ``fit`` will take (``math.inf`` if unbounded); usable in ``configure_optimizers``."""
        accumulate = 1 if self.accumulate_grad_batches == "auto" else self.accumulate_grad_batches
        per_epoch = math.ceil(self.num_training_batches / accumulate)
        total = per_epoch * self.max_epochs if self.max_epochs != -1 else math.inf
        return min(total, self.max_steps) if self.max_steps != -1 else total

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
        """``print`` on the global-zero process only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    # --------------------------------------------------------------------------- entry points
    def fit(
        self,
        model: Module,
        train_dataloaders: Iterable | DataModule | None = None,
        val_dataloaders: _Loaders = None,
        datamodule: DataModule | None = None,
        ckpt_path: str | os.PathLike | None = None,
        weights_only: bool = True,
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
        with self._stage("fit", model, datamodule):
            self.train_dataloader = self._loaders("train", train_dataloaders, required=True)[0]
            val_loaders = self._loaders("val", val_dataloaders) if hasattr(model, "validation_step") else []
            loop.fit(self, self.train_dataloader, val_loaders, self._resolve_checkpoint(ckpt_path), weights_only)
        if self.preempted:
            self.print("stopped by a preemption signal after saving a checkpoint; exiting")
            raise SystemExit(0)

    def validate(
        self,
        model: Module,
        dataloaders: _Loaders | DataModule = None,
        ckpt_path: str | os.PathLike | None = None,
        datamodule: DataModule | None = None,
        verbose: bool = True,
        weights_only: bool = True,
    ) -> list[dict[str, float]]:
        """Run ``validation_step`` over the validation data; one dict of metrics per dataloader."""
        return self._evaluate("validate", model, dataloaders, ckpt_path, datamodule, verbose, weights_only)

    def test(
        self,
        model: Module,
        dataloaders: _Loaders | DataModule = None,
        ckpt_path: str | os.PathLike | None = None,
        datamodule: DataModule | None = None,
        verbose: bool = True,
        weights_only: bool = True,
    ) -> list[dict[str, float]]:
        """Run ``test_step`` over the test data; one dict of metrics per dataloader."""
        return self._evaluate("test", model, dataloaders, ckpt_path, datamodule, verbose, weights_only)

    def predict(
        self,
        model: Module,
        dataloaders: _Loaders | DataModule = None,
        datamodule: DataModule | None = None,
        return_predictions: bool = True,
        ckpt_path: str | os.PathLike | None = None,
        weights_only: bool = True,
    ) -> list[Any] | None:
        """Run ``predict_step``; the outputs as a list (a list per dataloader when there are several)."""
        if isinstance(dataloaders, DataModule):
            datamodule, dataloaders = dataloaders, None
        _check_module(model, "predict")
        self.strategy.launch()
        ckpt_path = _checked_path(ckpt_path)
        with self._stage("predict", model, datamodule):
            loaders = self._loaders("predict", dataloaders, required=True)
            self._load_weights(self._resolve_checkpoint(ckpt_path), weights_only)
            return loop.predict(self, loaders, return_predictions)

    def _evaluate(
        self,
        stage: Literal["validate", "test"],
        model: Module,
        dataloaders: _Loaders | DataModule,
        ckpt_path: str | os.PathLike | None,
        datamodule: DataModule | None,
        verbose: bool,
        weights_only: bool,
    ) -> list[dict[str, float]]:
        if isinstance(dataloaders, DataModule):
            datamodule, dataloaders = dataloaders, None
        _check_module(model, stage)
        self.strategy.launch()
        ckpt_path = _checked_path(ckpt_path)
        with self._stage(stage, model, datamodule):
            loaders = self._loaders("val" if stage == "validate" else "test", dataloaders, required=True)
            self._load_weights(self._resolve_checkpoint(ckpt_path), weights_only)
            results = loop.evaluate(self, stage, loaders)
            if verbose and self.is_global_zero:
                _print_results(stage, results)
            return results

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool = False) -> None:
        """Write the training state (or only the weights) to ``filepath``; call it on every rank."""
        loop.check_losses(self)  # a NaN loss must never be saved over a good checkpoint
        checkpoint = checkpoint_io.training_state(self, weights_only=weights_only)
        self.strategy.save_checkpoint(checkpoint, os.fspath(filepath))

    def _restore(self, path: str, weights_only: bool) -> None:
        """Continue from a checkpoint written by ``save_checkpoint``: weights, optimizers, loop position."""
        checkpoint = self.strategy.load_checkpoint(path, trust_pickles=not weights_only)
        checkpoint_io.restore_training_state(self, checkpoint, path)

    def _resolve_checkpoint(self, ckpt_path: str | None) -> str | None:
        """An explicit path as it is; "last" and "best" looked up (by rank zero, for every rank)."""
        if ckpt_path not in ("last", "best"):
            return ckpt_path
        found = self.strategy.broadcast(checkpoint_io.find_checkpoint(self, ckpt_path) if self.is_global_zero else None)
        if found is None:
            if ckpt_path == "best":
                raise FileNotFoundError(
                    "ckpt_path='best': no best checkpoint is known (none was saved with a monitor under "
                    f"{self.default_root_dir!r})"
                )
            self.print(f"ckpt_path='last': no checkpoint under {self.default_root_dir!r} yet; starting from scratch")
        else:
            self.print(f"resuming from {found}")
        return found

    def _load_weights(self, ckpt_path: str | None, weights_only: bool) -> None:
        if ckpt_path is None:
            return
        checkpoint = self.strategy.load_checkpoint(ckpt_path, trust_pickles=not weights_only)
        module = self._require_module()
        module.on_load_checkpoint(checkpoint)
        self.strategy.load_module_state_dict(checkpoint["state_dict"])

    # ------------------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _stage(self, stage: str, module: Module, datamodule: DataModule | None) -> Iterator[None]:
        """Attach the module and data, set everything up for ``stage``, and tear it down afterwards."""
        self.stage = stage
        self.module = module
        module._trainer = self
        self._hook_cache.clear()
        self.datamodule = datamodule
        if datamodule is not None:
            datamodule.trainer = self
        if not self._environment_ready:
            self.strategy.setup_environment()
            self._environment_ready = True
            # Rank zero picks each run's version before anything is written, so that loggers sharing a
            # directory write into the same run; the other ranks follow it.
            for logger in self.loggers:
                logger.use_version(self.strategy.broadcast(logger.version if self.is_global_zero else None))
        self._deadline = time.monotonic() + self.max_time if self.max_time is not None else math.inf
        if datamodule is not None:
            if self.local_rank == 0:
                datamodule.prepare_data()
            self.strategy.barrier()
            datamodule.setup(stage)
        module.setup(stage)
        for callback in self.callbacks:
            callback.setup(self, module, stage)
        if stage == "fit":
            self._start_doctor()  # before the model is wrapped, so that the wrapper is watched too
        self.strategy.setup_module(module, training=stage == "fit")
        self.profiler.setup(self, stage)
        status = "failed"
        try:
            with torch.autograd.set_detect_anomaly(self.detect_anomaly):
                yield
            status = "success"
        except DoctorDone:
            status = "interrupted"  # `ember doctor` has seen enough steps
            raise
        except KeyboardInterrupt as interrupt:
            status = "interrupted"
            self._call_callbacks("on_exception", interrupt)
            raise
        except BaseException as exception:
            self._call_callbacks("on_exception", exception)
            raise
        finally:
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
            self.stage = None

    def _start_doctor(self) -> None:
        doctor = active_doctor()  # `ember doctor` runs this script
        if doctor is None and self.doctor_steps:
            doctor = self._doctor = Doctor(steps=self.doctor_steps).install()
        if doctor is not None:
            doctor.attach(self)

    def _loaders(self, kind: str, given: _Loaders, required: bool = False) -> list[Iterable]:
        """The loaders of one kind: passed in, else from the datamodule, else from the module."""
        if given is None:
            hook = f"{kind}_dataloader"
            for source in (self.datamodule, self.module):
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
        from ember.data import prepare_loader

        train = kind == "train"
        return [
            prepare_loader(loader, self.strategy, train=train, shard=self.use_distributed_sampler) for loader in loaders
        ]

    def _require_module(self) -> Module:
        if self.module is None:
            raise RuntimeError("no module is attached; call fit, validate, test or predict first")
        return self.module

    def _hooks(self, name: str, include_module: bool = True) -> list[Callable[..., Any]]:
        """The implementations of hook ``name`` to call: the module's and each callback's, if they define it.

        Hooks nobody overrides are left out, so the loop pays nothing for them. Cached per stage.
        """
        key = (name, include_module)
        hooks = self._hook_cache.get(key)
        if hooks is None:
            module = self.module
            hooks = [getattr(module, name)] if include_module and is_overridden(name, module, Module) else []
            hooks += [
                functools.partial(getattr(callback, name), self, module)
                for callback in self.callbacks
                if is_overridden(name, callback, Callback)
            ]
            self._hook_cache[key] = hooks
        return hooks

    def _call_hook(self, name: str, *args: Any) -> None:
        """Call ``name`` on the module, then on every callback."""
        for hook in self._hooks(name):
            hook(*args)

    def _call_callbacks(self, name: str, *args: Any) -> None:
        for hook in self._hooks(name, include_module=False):
            hook(*args)

    def _log_to_loggers(self, metrics: Mapping[str, Number], step: int) -> None:
        """Turn values into numbers (one device sync) and hand them to the loggers on rank zero."""
        if not metrics:
            return
        floats = to_floats(metrics)
        self.logged_metrics.update({name: torch.tensor(value) for name, value in floats.items()})
        if self.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics({**floats, "epoch": self.current_epoch}, step)


class _ManualOptimizer:
    """What ``Module.optimizers()`` returns: ``step()`` goes through the strategy (loss scaling) and
    counts ``trainer.global_step``; everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: Trainer) -> None:
        self.optimizer = optimizer
        self._trainer = trainer

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            closure()
        self._trainer.strategy.optimizer_step(self.optimizer)
        self._trainer.global_step += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)


# -------------------------------------------------------------------------- flag checking
def _checked_path(ckpt_path: str | os.PathLike | None) -> str | None:
    """``ckpt_path`` as a string, failing now (before any process starts) if an explicit path is missing."""
    if ckpt_path is None:
        return None
    ckpt_path = os.fspath(ckpt_path)
    if ckpt_path not in ("last", "best") and not os.path.exists(ckpt_path):
        raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no such checkpoint (pass a path, 'last' or 'best')")
    return ckpt_path


def _check_count(flag: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "-1 (no limit) or a non-negative int" if minimum == -1 else f"an int >= {minimum}"
        raise ValueError(f"{flag}={value!r}: expected {allowed}")


def _check_limit(flag: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{flag}={value!r}: expected None, a number of batches (int) or a fraction (float)")
    if (isinstance(value, int) and value < 0) or (isinstance(value, float) and not 0.0 <= value <= 1.0):
        raise ValueError(f"{flag}={value!r}: an int counts batches (>= 0), a float is a fraction in [0, 1]")


def _check_val_check_interval(value: Any) -> None:
    valid = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
        isinstance(value, float) and 0.0 < value <= 1.0
    )
    if not valid:
        raise ValueError(
            f"val_check_interval={value!r}: a float is a fraction of the epoch in (0, 1], an int a number of batches"
        )


def _compile_options(value: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` options of ``compile=`` (None when the model is not to be compiled)."""
    if value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"compile={value!r}: expected True, False or a dict of torch.compile options")
    accepted = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = sorted(set(value) - set(accepted))
    if unknown:
        raise ValueError(f"compile={dict(value)!r}: {unknown} are not torch.compile options; it takes {accepted}")
    return dict(value)


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


def _set_determinism(deterministic: bool | Literal["warn"], benchmark: bool | None) -> None:
    if deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
        torch.backends.cudnn.deterministic = True
        if benchmark:
            raise ValueError("benchmark=True picks kernels by speed, which deterministic=True forbids")
        torch.backends.cudnn.benchmark = False
    elif benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark


def _build_loggers(logger: bool | Logger | Sequence[Logger], root_dir: str) -> list[Logger]:
    if logger is True:
        return [CSVLogger(root_dir)]
    if logger is False or logger is None:
        return []
    loggers = [logger] if isinstance(logger, Logger) else list(logger)
    for item in loggers:
        if not isinstance(item, Logger):
            raise TypeError(f"logger={item!r}: expected True, False, an ember Logger or a list of them")
    return loggers


def _build_callbacks(
    callbacks: Callback | Sequence[Callback] | None, progress_bar: bool, checkpointing: bool, model_summary: bool
) -> list[Callback]:
    given = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    for callback in given:
        if not isinstance(callback, Callback):
            raise TypeError(f"callbacks: {callback!r} is not an ember Callback")
    if progress_bar and not any(isinstance(callback, ProgressBar) for callback in given):
        given.append(ProgressBar())
    if not progress_bar:
        given = [callback for callback in given if not isinstance(callback, ProgressBar)]
    if checkpointing and not any(isinstance(callback, ModelCheckpoint) for callback in given):
        given.append(ModelCheckpoint())
    if not checkpointing and any(isinstance(callback, ModelCheckpoint) for callback in given):
        raise ValueError("enable_checkpointing=False, but a ModelCheckpoint was passed in callbacks")
    if model_summary and not any(isinstance(callback, ModelSummary) for callback in given):
        given.insert(0, ModelSummary())
    if not model_summary and any(isinstance(callback, ModelSummary) for callback in given):
        raise ValueError("enable_model_summary=False, but a ModelSummary was passed in callbacks")
    # Callbacks that read epoch metrics (checkpointing, early stopping) run last, in the given order.
    return sorted(given, key=lambda callback: callback.reads_epoch_metrics)


def _as_tensor(value: Number) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    for index, metrics in enumerate(results):
        title = f"{stage} results" + (f" (dataloader {index})" if len(results) > 1 else "")
        width = max([len(name) for name in metrics] + [len(title)])
        print(title)
        for name, value in metrics.items():
            print(f"  {name:<{width}}  {value:.6g}")
