"""The Trainer: flags, the fit/validate/test/predict entry points, and the state callbacks read.

The loops themselves are in ``loop.py``; how devices and processes are used is the strategy's.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

import ember
from ember import loop
from ember._utils import is_overridden, parse_max_time
from ember.callbacks import Callback, EarlyStopping, ModelCheckpoint, ProgressBar
from ember.checkpoint import plain_values
from ember.loggers import CSVLogger, Logger
from ember.metrics import MetricStore, Number, to_floats
from ember.module import DataModule, Module
from ember.optim import LRSchedulerConfig
from ember.precision import canonical_precision
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
    ``accumulate_grad_batches``, ``gradient_clip_val``/``gradient_clip_algorithm``.
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        devices: int | str | Sequence[int] = "auto",
        num_nodes: int = 1,
        strategy: str | Strategy = "auto",
        precision: str | int = "32-true",
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
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        log_every_n_steps: int = 50,
        callbacks: Callback | Sequence[Callback] | None = None,
        logger: bool | Logger | Sequence[Logger] = True,
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        default_root_dir: str | os.PathLike | None = None,
        deterministic: bool | Literal["warn"] = False,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        detect_anomaly: bool = False,
        use_distributed_sampler: bool = True,
        sync_batchnorm: bool = False,
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
        _check_count("accumulate_grad_batches", accumulate_grad_batches, minimum=1)
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

        self.strategy: Strategy = select_strategy(
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            strategy=strategy,
            precision=precision,
            sync_batchnorm=sync_batchnorm,
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
        _set_determinism(deterministic, benchmark)

        self.loggers: list[Logger] = _build_loggers(logger, self.default_root_dir)
        self.callbacks: list[Callback] = _build_callbacks(callbacks, enable_progress_bar, enable_checkpointing)

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
        self._stepped = False  # whether the latest training batch ended with an optimizer step
        self._at_epoch_end = False  # whether the running validation is the epoch's last one
        self._position = (0, 0)  # (epoch, batches done in it): where a resumed run continues
        self._deadline = math.inf
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
        per_epoch = math.ceil(self.num_training_batches / self.accumulate_grad_batches)
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
        if ckpt_path is not None:
            ckpt_path = os.fspath(ckpt_path)
            if not os.path.exists(ckpt_path):  # a file, or a sharded checkpoint's directory
                raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no such checkpoint file or directory")
        self.strategy.launch()
        with self._stage("fit", model, datamodule):
            train_loader = self._loaders("train", train_dataloaders, required=True)[0]
            val_loaders = self._loaders("val", val_dataloaders) if hasattr(model, "validation_step") else []
            loop.fit(self, train_loader, val_loaders, ckpt_path, weights_only)

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
        with self._stage("predict", model, datamodule):
            loaders = self._loaders("predict", dataloaders, required=True)
            self._load_weights(ckpt_path, weights_only)
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
        with self._stage(stage, model, datamodule):
            loaders = self._loaders("val" if stage == "validate" else "test", dataloaders, required=True)
            self._load_weights(ckpt_path, weights_only)
            results = loop.evaluate(self, stage, loaders)
            if verbose and self.is_global_zero:
                _print_results(stage, results)
            return results

    # ------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, filepath: str | os.PathLike, weights_only: bool = False) -> None:
        """Write the training state (or only the weights) to ``filepath``; call it on every rank."""
        module = self._require_module()
        checkpoint: dict[str, Any] = {
            "ember_version": ember.__version__,
            "torch_version": str(torch.__version__),  # a str subclass that weights_only loading refuses
            "epoch": self.current_epoch,
            "global_step": self.global_step,
            "state_dict": self.strategy.module_state_dict(),
            "hyper_parameters": plain_values(dict(module.hparams), "hyper_parameters"),
        }
        if not weights_only:
            checkpoint.update(
                position={"epoch": self._position[0], "batches_done": self._position[1]},
                optimizer_states=[self.strategy.optimizer_state_dict(opt) for opt in self.optimizers],
                lr_schedulers=[config.scheduler.state_dict() for config in self.lr_scheduler_configs],
                precision=self.strategy.precision.state_dict(),
                callbacks={callback.state_key: callback.state_dict() for callback in self.callbacks},
            )
            if self.datamodule is not None:
                checkpoint["datamodule"] = self.datamodule.state_dict()
                checkpoint["datamodule_hyper_parameters"] = plain_values(
                    dict(self.datamodule.hparams), "datamodule hyper_parameters"
                )
            module.on_save_checkpoint(checkpoint)
            for callback in self.callbacks:
                callback.on_save_checkpoint(self, module, checkpoint)
        self.strategy.save_checkpoint(checkpoint, os.fspath(filepath))

    def _restore(self, path: str, weights_only: bool) -> None:
        """Continue from a checkpoint written by ``save_checkpoint``: weights, optimizers, loop position."""
        module = self._require_module()
        checkpoint = self.strategy.load_checkpoint(path, trust_pickles=not weights_only)
        if "optimizer_states" not in checkpoint:
            raise ValueError(
                f"ckpt_path={path!r} holds weights only (save_weights_only=True), so training cannot resume "
                "from it; load the weights into the module with Module.load_from_checkpoint instead"
            )
        module.on_load_checkpoint(checkpoint)
        self.strategy.load_module_state_dict(checkpoint["state_dict"])
        saved_optimizers = checkpoint["optimizer_states"]
        if len(saved_optimizers) != len(self.optimizers):
            raise ValueError(
                f"ckpt_path={path!r} holds {len(saved_optimizers)} optimizer states, but "
                f"configure_optimizers() returned {len(self.optimizers)} optimizers"
            )
        for optimizer, state in zip(self.optimizers, saved_optimizers):
            self.strategy.load_optimizer_state_dict(optimizer, state)
        for config, state in zip(self.lr_scheduler_configs, checkpoint["lr_schedulers"]):
            config.scheduler.load_state_dict(state)
        self.strategy.precision.load_state_dict(checkpoint.get("precision", {}))
        saved_callbacks = checkpoint.get("callbacks", {})
        for callback in self.callbacks:
            callback.on_load_checkpoint(self, module, checkpoint)
            if callback.state_key in saved_callbacks:
                callback.load_state_dict(saved_callbacks[callback.state_key])
        if self.datamodule is not None and "datamodule" in checkpoint:
            self.datamodule.load_state_dict(checkpoint["datamodule"])
        self.global_step = checkpoint["global_step"]
        position = checkpoint["position"]
        self._position = (position["epoch"], position["batches_done"])
        self.current_epoch = position["epoch"]

    def _load_weights(self, ckpt_path: str | os.PathLike | None, weights_only: bool) -> None:
        if ckpt_path is None:
            return
        checkpoint = self.strategy.load_checkpoint(os.fspath(ckpt_path), trust_pickles=not weights_only)
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
            if self.world_size > 1:
                for logger in self.loggers:  # rank zero picks the run's version; the others follow it
                    logger.use_version(self.strategy.broadcast(logger.version if self.is_global_zero else None))
        if self.max_time is not None:
            self._deadline = time.monotonic() + self.max_time
        if datamodule is not None:
            if self.local_rank == 0:
                datamodule.prepare_data()
            self.strategy.barrier()
            datamodule.setup(stage)
        module.setup(stage)
        for callback in self.callbacks:
            callback.setup(self, module, stage)
        self.strategy.setup_module(module, training=stage == "fit")
        status = "failed"
        try:
            with torch.autograd.set_detect_anomaly(self.detect_anomaly):
                yield
            status = "success"
        except KeyboardInterrupt as interrupt:
            status = "interrupted"
            self._call_callbacks("on_exception", interrupt)
            raise
        except BaseException as exception:
            self._call_callbacks("on_exception", exception)
            raise
        finally:
            for callback in self.callbacks:
                callback.teardown(self, module, stage)
            module.teardown(stage)
            if datamodule is not None:
                datamodule.teardown(stage)
            if self.is_global_zero:
                for logger in self.loggers:
                    logger.finalize(status)
            self.stage = None

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

        return [prepare_loader(loader, self.strategy, shard=self.use_distributed_sampler) for loader in loaders]

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


def _check_module(model: Any, stage: str) -> None:
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
    callbacks: Callback | Sequence[Callback] | None, progress_bar: bool, checkpointing: bool
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
