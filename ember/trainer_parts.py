"""What a Trainer is built of besides its strategy: the loggers and callbacks its flags ask for (Lightning's
defaults), the module's own callbacks, and the determinism settings; and the checks of what its entry points
are given."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec

import torch

from ember import checkpoint as checkpoint_io
from ember._utils import is_overridden, replaces
from ember.callbacks import (
    Callback,
    ModelCheckpoint,
    ModelSummary,
    ProgressBar,
    ProgressBarBase,
    Timer,
    TQDMProgressBar,
)
from ember.config import FlagError, TrainerConfig
from ember.data import count_batches
from ember.exceptions import MisconfigurationException, PossibleUserWarning
from ember.hints import closest
from ember.hparams import CLASS_PATH_KEY
from ember.lightning_compat.hook import is_installed as lightning_names_served
from ember.loggers import CSVLogger, DummyLogger, Logger, TensorBoardLogger
from ember.loops.hooks import Hooks
from ember.module import Module
from ember.optim import check_manual_optimization_flags
from ember.rank_zero import announce, rank_zero_warn

if TYPE_CHECKING:
    from ember.trainer import Trainer

P = ParamSpec("P")


def set_determinism(config: TrainerConfig) -> None:
    if config.deterministic is not None:  # as Lightning: False turns torch's setting off, None leaves it
        torch.use_deterministic_algorithms(bool(config.deterministic), warn_only=config.deterministic == "warn")
    if config.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before the first matmul.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = bool(config.benchmark)  # benchmark=True too only where asked for, warned
    elif config.benchmark is not None:
        torch.backends.cudnn.benchmark = config.benchmark


def known_flags_only(init: Callable[P, None]) -> Callable[P, None]:
    """``Trainer.__init__``, refusing a flag it does not take with one line that names the closest ones (Python's
    own TypeError names none); once made, the Trainer says what the limits given as 1 or 1.0 mean (only the flags
    as given tell an explicit 1.0 from the default)."""
    flags = [name for name in inspect.signature(init).parameters if name != "self"]

    @functools.wraps(init)
    def checked(*args: P.args, **given: P.kwargs) -> None:
        for name in given:
            if name not in flags:
                unexpected = f"Trainer.__init__() got an unexpected keyword argument {name!r}"  # (Python's words)
                raise FlagError(f"{unexpected}: Trainer({name}=...) is not a flag; {closest(name, flags, _EVERY_FLAG)}")
        init(*args, **given)
        announce_whole_limits(given)

    return checked


#: What a limit of one batch, or of the whole, given explicitly means (Lightning says so at INFO too).
_WHOLE_LIMITS = {
    "limit_train_batches": ("1 batch per epoch will be used", "100% of the batches per epoch will be used"),
    "val_check_interval": (
        "validation will run after every batch",
        "validation will run at the end of the training epoch",
    ),
    **{
        name: ("1 batch will be used", "100% of the batches will be used")
        for name in ("limit_val_batches", "limit_test_batches", "limit_predict_batches", "overfit_batches")
    },
}


def announce_whole_limits(given: dict[str, Any]) -> None:
    """Say what a batch limit of exactly 1 or 1.0 given to the Trainer means (one batch, or all of them), which
    is easy to mix up; and that barebones mode is on."""
    for name, (one, whole) in _WHOLE_LIMITS.items():
        value = given.get(name)
        if type(value) in (int, float) and value == 1:
            announce(f"`Trainer({name}={value!r})` was configured so {one if isinstance(value, int) else whole}.")
    if given.get("barebones") is True:
        announce("running in `Trainer(barebones=True)` mode: logging, checkpointing, the progress bar, the model "
                 "summary and the other features that cost time besides the steps are off")  # fmt: skip


_EVERY_FLAG = "docs/trainer-flags.md lists every flag"


def default_loggers(config: TrainerConfig) -> list[Logger]:
    logger = config.logger
    if logger is False:
        return []
    if config.fast_dev_run:
        return [DummyLogger()]  # nothing is kept, but code that writes to trainer.logger still runs
    if logger is True:
        # As Lightning's default, TensorBoard when it is installed (trainer.logger.experiment is its writer). Ember's
        # own programs get metrics.csv beside it, for `ember plot` and for reading without TensorBoard; programs
        # written for Lightning get its one logger, as they may use every logger as TensorBoard's.
        tensorboard = importlib.util.find_spec("tensorboard") is not None
        if tensorboard and lightning_names_served():
            return [TensorBoardLogger(config.root_dir)]
        csv = CSVLogger(config.root_dir)
        return [TensorBoardLogger(config.root_dir), csv] if tensorboard else [csv]
    return list(logger) if isinstance(logger, Sequence) else [logger]  # a Logger, or an object that logs like one


def default_callbacks(config: TrainerConfig) -> list[Callback]:
    """The callbacks given, then the defaults the flags add, in Lightning's order: the ``Timer`` of ``max_time``, the
    progress bar, the model summary and the ``ModelCheckpoint`` (which goes last, with the given ones). A flag turns
    a default off; a progress bar or checkpoint given against it is refused, a ``ModelSummary`` is kept."""
    callbacks = config.callbacks
    given = [callbacks] if isinstance(callbacks, Callback) else list(callbacks or [])
    bars = [callback for callback in given if isinstance(callback, ProgressBarBase)]
    if len(bars) > 1:  # Lightning's words
        raise MisconfigurationException(
            "You added multiple progress bar callbacks to the Trainer, but currently only one progress bar is "
            f"supported: {[type(bar).__name__ for bar in bars]}; keep one"
        )
    bar = bars[0] if bars else None
    if not config.enable_progress_bar and bar is not None:
        raise MisconfigurationException(
            f"Trainer was configured with `enable_progress_bar=False` but found `{type(bar).__name__}` in callbacks "
            "list: remove one of them"
        )
    checkpointing = any(isinstance(callback, ModelCheckpoint) for callback in given)
    if not config.enable_checkpointing and checkpointing:
        raise MisconfigurationException(
            "Trainer was configured with `enable_checkpointing=False` but found `ModelCheckpoint` in callbacks list: "
            "remove one of them"
        )
    _add_timer(given, config.max_time)
    if config.enable_progress_bar and bar is None:
        # A program that uses Lightning's names gets Lightning's class (the same bar, with refresh_rate 1).
        given.append(TQDMProgressBar() if lightning_names_served() else ProgressBar())
    if config.enable_model_summary and not any(isinstance(callback, ModelSummary) for callback in given):
        given.append(ModelSummary())
    if config.enable_checkpointing and not checkpointing:
        given.append(ModelCheckpoint())
    return in_lightning_order(given)


def in_lightning_order(callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` in Lightning's order, each group in the given order: those that tune the run (``BatchSizeFinder``,
    ``LearningRateFinder``) first, so that the run they tune is the one the other callbacks see, and the
    ``ModelCheckpoint``s last, so that a checkpoint saved in a hook holds what the other callbacks (early stopping)
    did in that hook. Two callbacks with a state that share a ``state_key`` are refused, as in Lightning: a
    checkpoint would keep only one's."""
    stateful = [callback for callback in callbacks if is_overridden("state_dict", callback, Callback)]
    keys = [callback.state_key for callback in stateful]
    shared = next((callback for callback, key in zip(stateful, keys) if keys.count(key) > 1), None)
    if shared is not None:
        raise RuntimeError(
            f"Found more than one stateful callback of type `{type(shared).__name__}`. In the current "
            "configuration, this callback does not support being saved alongside other instances of the same "
            f"type: both would be saved as {shared.state_key!r}. HINT: The `callback.state_key` must be unique "
            "among all callbacks in the Trainer (a ModelCheckpoint's differs by its monitor, mode and schedule)."
        )
    # (`is True`: a Mock standing in for a callback has every attribute)
    return sorted(callbacks, key=lambda each: isinstance(each, ModelCheckpoint) - (each.tunes_the_run is True))


def _add_timer(callbacks: list[Callback], max_time: Any) -> None:
    """``max_time`` is a ``Timer`` that stops training after the step during which the time ran out (as Lightning's;
    it counts the time a resumed run trained before, which checkpoints save)."""
    if max_time is None:
        return
    if any(isinstance(callback, Timer) for callback in callbacks):  # said at INFO, as Lightning says it
        announce(f"Ignoring `Trainer(max_time={max_time!r})`, callbacks list already contains a Timer: its duration "
                 "applies")  # fmt: skip
        return
    callbacks.append(Timer(duration=max_time, interval="step"))


def estimated_stepping_batches(trainer: Trainer) -> float:
    """Optimizer steps ``fit`` will take (``math.inf`` if unbounded): from the fit's training data during ``fit``,
    and outside it (the tuner's trials) from the training loader the datamodule or the module makes."""
    config, data = trainer.config, trainer.fit_loop.data
    if trainer.stage == "fit" and data is not None and data.loader is None:
        announce("Loading `train_dataloader` to estimate number of stepping batches.")  # (Lightning's words)
        data.load()  # asked for in setup or configure_optimizers: the training loader is needed now
    batches = trainer.num_training_batches
    if trainer.stage != "fit" and trainer.lightning_module is not None:
        loader = Hooks(trainer, trainer.lightning_module, [], trainer.datamodule).data_loaders("train")
        if loader is not None:
            batches = count_batches(loader, config.limit_train_batches, "limit_train_batches")
    accumulate = trainer.accumulate_grad_batches  # the current epoch's, as Lightning's (under a schedule)
    per_epoch = batches if math.isinf(batches) else math.ceil(batches / (1 if accumulate == "auto" else accumulate))
    total = per_epoch * config.epoch_limit if config.epoch_limit != -1 else math.inf
    return min(total, config.max_steps) if config.max_steps != -1 else total


def log_hyperparameters(trainer: Trainer) -> None:
    """Hand the module's and the datamodule's initial hyperparameters to the loggers (on rank zero), unless
    ``enable_autolog_hparams=False``, then the module for its graph; a name both give different values is
    refused, as Lightning refuses it."""
    module, datamodule = trainer.lightning_module, trainer.datamodule
    if module is None or not trainer.loggers:
        return
    hyperparameters = {}
    if trainer.config.enable_autolog_hparams:
        own, data = module.hparams_for_logger, datamodule.hparams_for_logger if datamodule else {}
        # Sorted as text: names may be of several types ({1: ..., "lr": ...}).
        # The command line's record of each one's class differs by nature, and Lightning skips it too.
        shared = own.keys() & data.keys() - {CLASS_PATH_KEY}
        differing = sorted((name for name in shared if not _same(own[name], data[name])), key=str)
        if differing:
            raise RuntimeError(
                f"Error while merging hparams: the keys {differing} are present in both the LightningModule's and "
                "LightningDataModule's hparams but have different values; rename one of them, or give them the same "
                "value"
            )
        hyperparameters = {**own, **data}
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if hyperparameters:
            logger.log_hyperparams(hyperparameters)
        if callable(getattr(logger, "log_graph", None)):  # an object that logs may not record graphs
            logger.log_graph(module)


def with_module_callbacks(callbacks: list[Callback], returned: Callback | Sequence[Callback] | None) -> list[Callback]:
    """The Trainer's callbacks with those the module's ``configure_callbacks()`` ``returned`` (None: none), as
    Lightning merges them: one returned replaces the Trainer's of its class and of the classes it extends (not a
    bare ``Callback``), which is announced."""
    added = [returned] if isinstance(returned, Callback) else list(returned or [])
    if not added:
        return callbacks
    present = {type(callback) for callback in callbacks} - {Callback}
    replaced = {kind for kind in present if any(isinstance(callback, kind) for callback in added)}
    if replaced:
        announce("The following callbacks returned in `LightningModule.configure_callbacks` will override existing "
                 f"callbacks passed to Trainer: {', '.join(sorted(kind.__name__ for kind in replaced))}")  # fmt: skip
    kept = [callback for callback in callbacks if type(callback) not in replaced]
    return in_lightning_order(kept + added)


def checked_path(ckpt_path: str | os.PathLike | None) -> str | None:
    """``ckpt_path`` as a string, failing now (before any process starts) if an explicit path is missing."""
    if ckpt_path is None:
        return None
    ckpt_path = os.fspath(ckpt_path)
    if ckpt_path in ("last", "best") or os.path.exists(ckpt_path):
        return ckpt_path
    if os.path.islink(ckpt_path):
        checkpoint_io.verify(ckpt_path)  # says where the dangling link points
    raise FileNotFoundError(f"Checkpoint file not found: {ckpt_path} (ckpt_path takes a path, 'last' or 'best')")


def check_module(model: Any, stage: str, config: TrainerConfig | None = None) -> None:
    """Refuse a model ``stage`` cannot run, before anything is set up (with ``config``, a fit's: flags the module's
    optimization cannot honour, as Lightning checks them before any file is written)."""
    if isinstance(getattr(model, "_orig_mod", None), Module):
        raise TypeError(
            f"Trainer.{stage}() got a torch.compile()d module; pass the Module itself and "
            "Trainer(compile=True) (or a dict of torch.compile options) to compile it"
        )
    if not isinstance(model, Module):
        raise TypeError(f"`model` must be a `LightningModule`, got `{type(model).__name__}`: Trainer.{stage}() needs "
                        "an ember.Module")  # (Lightning's words first)  # fmt: skip
    required = {"fit": ("training_step", "configure_optimizers"), "validate": ("validation_step",),
                "test": ("test_step",), "predict": ()}[stage]  # fmt: skip
    missing = [name for name in required if not replaces(name, model, Module)]
    if missing:
        needs = f"Trainer.{stage}() needs {type(model).__name__} to define {', '.join(missing)}"
        raise MisconfigurationException(f"No `{missing[0]}()` method defined to run `Trainer.{stage}`: {needs}")
    if config is not None:
        check_manual_optimization_flags(model, config.accumulate_grad_batches, config.gradient_clip_val)
    if stage == "predict":
        _check_predicts(model)


def _check_predicts(model: Module) -> None:
    """Refuse a module that cannot predict (Lightning's messages): its ``predict_step`` switched off, or the
    default one, which calls ``forward``, without a ``forward``."""
    if model.predict_step is None:
        raise MisconfigurationException("`predict_step` cannot be None to run `Trainer.predict`")
    if not replaces("predict_step", model, Module) and not replaces("forward", model, Module):
        raise MisconfigurationException(
            f"`Trainer.predict` requires `forward` method to run: {type(model).__name__} defines neither forward nor "
            "predict_step"
        )


def validates_in_fit(model: Module, has_loaders: bool) -> bool:
    """Whether ``fit`` validates: the module defines ``validation_step`` and there are validation loaders. Either
    one without the other is likely a slip (a hook misnamed, a loader forgotten): warned, in Lightning's words."""
    has_step = replaces("validation_step", model, Module)
    if has_loaders and not has_step:
        rank_zero_warn("You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop.",
                       stacklevel=7)  # (the caller of fit)  # fmt: skip
    if has_step and not has_loaders:
        rank_zero_warn("You defined a `validation_step` but have no `val_dataloader`. Skipping val loop.",
                       PossibleUserWarning, stacklevel=7)  # fmt: skip
    return has_step and has_loaders


def _same(first: Any, second: Any) -> bool:
    """Whether two hyperparameters hold the same value (a tensor only as the same object)."""
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return first is second
    return type(first) is type(second) and bool(first == second)


def evaluated_module(
    trainer: Trainer, model: Module | None, stage: str, ckpt_path: str | os.PathLike | None
) -> tuple[Module, str | os.PathLike | None]:
    """The module to evaluate and the checkpoint to load into it: without a module, the fitted one, with
    its best checkpoint unless ``ckpt_path`` names another."""
    if model is not None:
        return model, ckpt_path
    if trainer.lightning_module is None:
        raise TypeError(f"`Trainer.{stage}()` requires a `LightningModule` when it hasn't been passed in a previous "
                        "run: pass one, or call fit() first to use the fitted one")  # (Lightning's words)  # fmt: skip
    if ckpt_path is None:
        # As Lightning: the fitted module is evaluated with its best weights (refused when the stage starts if no
        # ModelCheckpoint saved one), never silently with the last ones.
        ckpt_path = "best"
        rank_zero_warn(  # Lightning's words, at each such call
            f"`.{stage}(ckpt_path=None)` was called without a model. The best model of the previous `fit` call will "
            f"be used. You can pass `.{stage}(ckpt_path='best')` to use the best model or `.{stage}(ckpt_path='last')` "
            "to use the last model. If you pass a value, this warning will be silenced.",
            stacklevel=6,
        )
    return trainer.lightning_module, ckpt_path
