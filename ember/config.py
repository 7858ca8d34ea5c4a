"""Every ``Trainer`` flag, checked once into one frozen record.

``TrainerConfig`` holds the flags as the user gave them (None, where Lightning's signature allows it and the
config files its CLI writes spell it, as the default), each checked for its type and range when the record is built;
the values the run derives from them (the epoch limit when none was given, ``max_time`` in seconds, the
``torch.compile`` options) are properties. The flags that stand for others (``fast_dev_run``, ``overfit_batches``,
``barebones``) are applied once, by ``resolved()``, into the record the Trainer keeps, so the loops read only the
usual flags. Each field's docstring is the flag's documentation: the docs site's flag reference is generated from it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast

import torch

from ember._utils import local_path, lowered, parse_max_time
from ember.callbacks import Callback, ModelCheckpoint, ModelSummary, ProgressBarBase
from ember.exceptions import MisconfigurationException, PossibleUserWarning
from ember.loggers import Logger
from ember.loggers.logger import is_logger
from ember.precision import canonical_precision
from ember.profilers import Profiler
from ember.rank_zero import rank_zero_warn, rank_zero_warn_once
from ember.strategies import FaultTolerance, Strategy

Limit = int | float | None
_Init = TypeVar("_Init", bound=Callable[..., None])

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")
_FLOAT32_MATMUL = ("highest", "high", "medium")
_PROFILERS = ("simple", "pytorch")
_COSTLY_CALLBACKS = (ModelCheckpoint, ProgressBarBase, ModelSummary)  # what barebones=True leaves out
_BOOL_FLAGS = (
    "enable_progress_bar", "enable_checkpointing", "enable_model_summary", "inference_mode", "detect_anomaly",
    "use_distributed_sampler", "sync_batchnorm", "slurm_requeue", "restart_on_data_change", "async_checkpoint",
    "enable_autolog_hparams", "barebones",
)  # fmt: skip


class FlagError(MisconfigurationException, TypeError):
    """A Trainer flag with a value it does not take (a ``MisconfigurationException``, so also a ``ValueError``,
    and a ``TypeError``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The Trainer's flags, with Lightning's names and meanings. Building one checks every flag."""

    # ------------------------------------------------------------------------------- layout
    accelerator: str = "auto"
    """The kind of device: "auto" (a GPU if there is one), "cpu", "cuda" (or "gpu"), "mps"."""

    devices: int | str | Sequence[int] = "auto"
    """Devices per node: "auto", a count, -1 for all, a list of indices or a string like "0,2".
    One process drives each device."""

    num_nodes: int = 1
    """Machines in the job; each runs ``devices`` processes."""

    strategy: str | Strategy = "auto"
    """How the work is spread: "auto", "single_device", "ddp", "dp", "fsdp", "model_parallel",
    "pipeline", or a ``Strategy`` instance with its own options."""

    precision: str | int = "32-true"
    """Numerical precision: "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"
    (also 16, 32, 64, "16", "32", "64", "bf16")."""

    float32_matmul_precision: Literal["highest", "high", "medium"] | None = None
    """float32 matrix products: "highest" (full float32), "high" (TF32 tensor cores), "medium"
    (bfloat16 passes); None leaves torch's setting."""

    compile: bool | Mapping[str, Any] = False
    """True, or a dict of ``torch.compile`` options, compiles the module's forward."""

    # ------------------------------------------------------------------------------- length
    max_epochs: int | None = None
    """Epochs to train (-1: no limit). When neither it nor ``max_steps`` nor ``max_time`` is
    given, 1000 (``trainer.max_epochs`` says so once ``fit`` starts)."""

    max_steps: int = -1
    """Optimizer steps to train (-1: no limit)."""

    min_epochs: int | None = None
    """Epochs to train at least: a request to stop earlier (``trainer.should_stop``, set by
    ``EarlyStopping``) waits until they are done."""

    min_steps: int | None = None
    """Optimizer steps to take at least before a request to stop is followed."""

    max_time: str | timedelta | Mapping[str, int] | None = None
    """Wall-clock limit: "DD:HH:MM:SS", a ``datetime.timedelta`` or a dict such as
    ``{"hours": 2}``; a ``Timer`` among the callbacks (its count survives a resume) stops training at the
    first step boundary past it."""

    limit_train_batches: Limit = None
    """Training batches per epoch: an int (or a whole float: ``1e6``) counts batches; a float in [0, 1], a fraction."""

    limit_val_batches: Limit = None
    """Validation batches per run: an int (or a whole float: ``1e6``) counts batches; a float in [0, 1], a fraction."""

    limit_test_batches: Limit = None
    """Test batches: an int (or a whole float: ``1e6``) counts batches; a float in [0, 1], a fraction."""

    limit_predict_batches: Limit = None
    """Prediction batches: an int (or a whole float: ``1e6``) counts batches; a float in [0, 1], a fraction."""

    overfit_batches: int | float = 0.0
    """Train and validate on the same few batches (an int counts them, a float in [0, 1] is a fraction of
    the training data), in order: a model that cannot fit them has a bug. 0 turns it off."""

    fast_dev_run: bool | int = False
    """True (or n) runs 1 (or n) batches of training, validation, test and prediction, with no sanity check,
    logging, checkpointing or early stopping: a quick check that the code runs end to end."""

    reload_dataloaders_every_n_epochs: int = 0
    """Ask the module or datamodule for new training and validation dataloaders every n epochs (0: once)."""

    # ---------------------------------------------------------------------------- validation
    val_check_interval: int | float | str | timedelta | Mapping[str, int] = 1.0
    """How often to validate within an epoch: a float in (0, 1] is a fraction of the epoch, an
    int a number of training batches, a duration ("DD:HH:MM:SS", a ``datetime.timedelta`` or a dict such as
    ``{"minutes": 30}``) the time since training started or last validated, checked after each batch."""

    check_val_every_n_epoch: int | None = 1
    """Validate every N epochs; None counts ``val_check_interval`` (an int or a duration) across epochs."""

    num_sanity_val_steps: int = 2
    """Validation batches run before training, so that a broken ``validation_step`` fails in
    seconds (-1: all, 0: none)."""

    # -------------------------------------------------------------------------- optimization
    accumulate_grad_batches: int | Literal["auto"] = 1
    """Micro-batches per optimizer step; "auto" makes each batch one step, split into as many
    micro-batches as memory needs (found by retrying after running out of memory)."""

    gradient_clip_val: int | float | None = None
    """Clip gradients to this norm (or value, see ``gradient_clip_algorithm``); None: no clipping."""

    gradient_clip_algorithm: Literal["norm", "value"] | None = None
    """"norm" (also when None) scales all gradients to a total 2-norm of at most ``gradient_clip_val``; "value"
    clamps each element."""

    # --------------------------------------------------------------------------- watching
    log_every_n_steps: int = 50
    """Write step values to the loggers every N optimizer steps (0: never; the epochs' values are written)."""

    callbacks: Callback | Sequence[Callback] | None = None
    """Callbacks to run, besides the default ones the ``enable_*`` flags add."""

    logger: bool | Logger | Sequence[Logger] = True
    """True for the default loggers under ``default_root_dir`` (TensorBoard when it is installed, with a CSV file
    beside it; CSV only otherwise), False for none, or loggers."""

    enable_progress_bar: bool = True
    """Show a progress bar (one log line every few seconds when the output is not a terminal)."""

    enable_checkpointing: bool = True
    """Add a ``ModelCheckpoint`` (every epoch, into the run directory) unless one is given."""

    enable_model_summary: bool = True
    """Add a ``ModelSummary`` (the module's layers and parameter counts when ``fit`` starts) unless one is given."""

    profiler: str | Profiler | None = None
    """"simple" (a table of where the time goes), "pytorch" (a trace) or a ``Profiler``."""

    enable_autolog_hparams: bool = True
    """Write the hyperparameters of ``save_hyperparameters()`` to the loggers when ``fit`` starts."""

    barebones: bool = False
    """Turn off everything that costs time besides the steps, to measure the loop's own overhead: loggers,
    ``self.log``, checkpointing, the progress bar, the model summary and the sanity check (asking for any of
    them, or for a profiler, anomaly detection or ``fast_dev_run``, is an error)."""

    default_root_dir: str | os.PathLike[str] | None = None
    """Where logs and checkpoints go when no path is given (default: the working directory; ``~`` is home)."""

    doctor: bool | int = False
    """True (or a number of steps above 5, 30 by default) watches the first steps of ``fit`` and
    prints what slows them down, with the fixes; training then goes on."""

    # ---------------------------------------------------------------------- reproducibility
    deterministic: bool | Literal["warn"] | None = None
    """True: deterministic algorithms only; "warn": a warning when another runs; False: any; None leaves torch's."""

    benchmark: bool | None = None
    """cuDNN benchmark mode: pick the fastest convolution algorithms by trying them; None leaves torch's setting."""

    # -------------------------------------------------------------------------------- misc
    inference_mode: bool = True
    """Evaluate under ``torch.inference_mode`` (True) or ``torch.no_grad`` (False)."""

    detect_anomaly: bool = False
    """Run autograd's anomaly detection: the operation that produced a NaN is named (slow)."""

    use_distributed_sampler: bool = True
    """With several processes, give each its shard of the data through a ``DistributedSampler``."""

    sync_batchnorm: bool = False
    """Compute batch-norm statistics over all processes (``torch.nn.SyncBatchNorm``)."""

    slurm_requeue: bool = False
    """On SLURM's preemption signal, requeue the job after saving the checkpoint."""

    restart_on_data_change: bool = False
    """Resuming with a dataset of another length, or another seed (``seed_everything``), than the
    checkpoint's is refused, since the saved position in the epoch means something else then; True
    accepts the change and starts the interrupted epoch over, with a warning."""

    async_checkpoint: bool = False
    """Write checkpoints in the background: a save blocks training only while the state is copied to host
    memory; the end of ``fit``, a preemption signal and an error wait for the write in flight. On CPU, a
    save while every core is busy (training waited for one) is written at once instead."""

    timeout: int | float | timedelta | None = None
    """How long (seconds, or a ``timedelta``) the processes of a multi-process run wait for each other in
    a collective before the run stops with a message naming the rank that did not arrive and the step it
    was last seen at; None keeps the strategy's own (10 minutes unless it was given one)."""

    fault_tolerance: FaultTolerance | None = None
    """For a script started by ``ember run --replica-groups G``: a ``FaultTolerance`` with the replica groups
    needed for a step to commit and the timeouts (None: its defaults). Without that launcher it is not used."""

    gpus: int | str | Sequence[int] | None = None
    """Lightning 1's spelling of ``accelerator="gpu", devices=...`` (deprecated: it warns, naming the flags to use)."""

    plugins: Any = None
    """Lightning's plugins (precision, cluster environments, checkpoint I/O); Ember has none, so only None is
    taken: ``precision`` picks the precision, the cluster is found by itself, checkpoints are written atomically."""

    model_registry: str | None = None
    """Lightning's upload of checkpoints to its model registry; Ember uploads to none, so only None is taken."""

    def __post_init__(self) -> None:
        for flag in _NONE_IS_DEFAULT:
            if getattr(self, flag) is None:
                object.__setattr__(self, flag, _DEFAULTS[flag])  # the record holds what the loops apply
        if self.accelerator not in ACCELERATORS:
            raise FlagError(f"accelerator={self.accelerator!r} is not supported; choose one of {ACCELERATORS}")
        _check_devices("devices", self.devices, self.accelerator)
        _check_int("num_nodes", self.num_nodes, minimum=1)
        if not isinstance(self.strategy, (str, Strategy)):
            raise FlagError(f"strategy={self.strategy!r}: expected a strategy name or an ember Strategy")
        canonical_precision(self.precision)
        if self.float32_matmul_precision is not None:
            _check_choice("float32_matmul_precision", self.float32_matmul_precision, _FLOAT32_MATMUL)
        _compile_options(self.compile)
        self._check_length()
        self._check_validation()
        self._check_optimization()
        self._check_watching()
        for flag in _BOOL_FLAGS:
            _check_bool(flag, getattr(self, flag))
        if self.deterministic not in ("warn", None):
            _check_bool("deterministic", self.deterministic, also="'warn'")
        if self.benchmark is not None:
            _check_bool("benchmark", self.benchmark, also="None")
        self._check_distributed()
        if self.deterministic and self.benchmark:  # as Lightning: allowed, since the user set both
            rank_zero_warn("You passed `deterministic=True` and `benchmark=True`. Note that PyTorch ignores "
                "torch.backends.cudnn.deterministic=True when torch.backends.cudnn.benchmark=True.")  # fmt: skip
        self._check_gpus()
        self._check_barebones()
        if self.plugins is not None:
            raise FlagError(
                f"plugins={self.plugins!r}: Ember has no plugins; pick the precision with precision=..., the "
                "launcher and cluster are found by themselves (torchelastic, SLURM, MPI), checkpoints are written "
                "atomically by the strategy; leave plugins=None"
            )
        if self.model_registry is not None:
            raise FlagError(
                f"model_registry={self.model_registry!r}: Ember uploads to no model registry; copy the checkpoints "
                "of trainer.checkpoint_callback where they should go, and leave model_registry=None"
            )

    def _check_length(self) -> None:
        if self.max_epochs is not None:
            _check_int("max_epochs", self.max_epochs, minimum=-1)
        _check_int("max_steps", self.max_steps, minimum=-1)
        for flag in ("min_epochs", "min_steps"):
            if getattr(self, flag) is not None:
                _check_int(flag, getattr(self, flag), minimum=0, also="None")
        parse_max_time(self.max_time)
        for flag in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches",
                     "overfit_batches"):  # fmt: skip
            object.__setattr__(self, flag, _checked_limit(flag, getattr(self, flag)))
        runs = self.fast_dev_run
        if not isinstance(runs, bool) and (not isinstance(runs, int) or runs < 0):
            raise FlagError(f"fast_dev_run={runs!r}: should be >= 0 (a number of batches), or True or False")
        _check_int("reload_dataloaders_every_n_epochs", self.reload_dataloaders_every_n_epochs, minimum=0)

    def _check_validation(self) -> None:
        value = self.val_check_interval
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(value, (str, timedelta, Mapping)):
            parse_max_time(value, flag="val_check_interval")
        elif (count := _whole_count(value)) is not None:
            object.__setattr__(self, "val_check_interval", count)
        elif not (is_int and value >= 1) and not (isinstance(value, float) and 0.0 < value <= 1.0):
            raise FlagError(
                f"val_check_interval={value!r}: passed invalid value; expected a fraction of the epoch (a float in "
                "(0, 1]), a number of batches (an int >= 1, or a whole float such as 2.0) or a duration "
                "('DD:HH:MM:SS', a datetime.timedelta or a dict)"
            )
        if self.check_val_every_n_epoch is not None:
            _check_int("check_val_every_n_epoch", self.check_val_every_n_epoch, minimum=1, also="None", noun="integer")
        elif isinstance(value, float) and value != 1.0:  # 1.0 is also the default: the end of each epoch
            raise FlagError(
                f"val_check_interval={value!r} with check_val_every_n_epoch=None: `val_check_interval` should be an "
                "integer or a time-based duration (str 'DD:HH:MM:SS', datetime.timedelta, or dict kwargs for "
                "timedelta) when `check_val_every_n_epoch=None`. Batches are then counted across epochs, where a "
                "fraction of an epoch means nothing"
            )
        _check_int("num_sanity_val_steps", self.num_sanity_val_steps, minimum=-1)

    def _check_optimization(self) -> None:
        if self.accumulate_grad_batches != "auto":
            _check_int("accumulate_grad_batches", self.accumulate_grad_batches, minimum=1, also="'auto'")
        clip = self.gradient_clip_val
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
            raise FlagError(f"gradient_clip_val={clip!r}: `gradient_clip_val` should be an int or a float >= 0")
        object.__setattr__(self, "gradient_clip_algorithm", lowered(self.gradient_clip_algorithm))  # "VALUE", too
        if self.gradient_clip_algorithm is not None:  # None, as Lightning's, says the module may choose
            _check_choice("gradient_clip_algorithm", self.gradient_clip_algorithm, ("norm", "value"))

    def _check_watching(self) -> None:
        _check_int("log_every_n_steps", self.log_every_n_steps, minimum=0)
        _check_items("callbacks", self.callbacks, Callback, "a Callback or a list of them")
        loggers = [] if self.logger is None else self.logger if isinstance(self.logger, Sequence) else [self.logger]
        if not isinstance(self.logger, bool) and not all(is_logger(item) for item in loggers):
            raise FlagError(f"logger={self.logger!r}: expected True, False, a Logger or a list of them")
        object.__setattr__(self, "profiler", profiler := lowered(self.profiler))  # in any case ("Simple"), as Lightning
        if profiler is not None and not isinstance(profiler, Profiler) and profiler not in _PROFILERS:
            raise FlagError(
                f"profiler={profiler!r}: When passing string value for the `profiler` parameter of `Trainer`, it can "
                f"only be one of {list(_PROFILERS)} (else pass None or an instance of ember.profilers.Profiler)"
            )
        root = self.default_root_dir
        if root is not None and not isinstance(root, (str, os.PathLike)):
            raise FlagError(f"default_root_dir={root!r}: expected a path (str or os.PathLike) or None")
        doctor = self.doctor
        if not isinstance(doctor, bool) and (not isinstance(doctor, int) or doctor <= 5):
            raise FlagError(f"doctor={doctor!r}: True (watch 30 steps), False, or a number of steps above 5")

    def _check_distributed(self) -> None:
        timeout = self.timeout
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0):
            raise FlagError(f"timeout={timeout!r}: expected a number of seconds > 0, a datetime.timedelta, or None")
        if self.fault_tolerance is not None and not isinstance(self.fault_tolerance, FaultTolerance):
            raise FlagError(f"fault_tolerance={self.fault_tolerance!r}: expected an ember.strategies.FaultTolerance "
                            "or None")  # fmt: skip

    def _check_gpus(self) -> None:
        if self.gpus is None:
            return
        _check_devices("gpus", self.gpus, "cuda")
        if self.accelerator != "auto" or self.devices != "auto":
            raise FlagError("gpus= is the older spelling of accelerator='cuda', devices=...; pass only one of them")

    def warn_deprecated(self) -> None:
        """Warn about flags that still work but are on their way out, naming what to write instead."""
        if self.gpus is not None:
            accelerator, devices = self.layout
            instead = "accelerator='cpu'" if accelerator == "cpu" else f"accelerator='gpu', devices={devices!r}"
            # Lightning 2 no longer takes gpus=; Ember still does, for now, and says what to write instead.
            rank_zero_warn_once(
                f"gpus={self.gpus!r} is Lightning 1's spelling, which Lightning 2 refuses and Ember will too: "
                f"write {instead}",
                FutureWarning,
                stacklevel=3,
            )

    def _check_barebones(self) -> None:
        """``barebones=True`` turns the costly features off; asking for one of them as well is an error."""
        if not self.barebones:
            return
        costly = any(isinstance(callback, _COSTLY_CALLBACKS) for callback in _as_list(self.callbacks))
        asked = {"logger": self.logger not in (True, False), "profiler": self.profiler is not None}
        asked |= {"fast_dev_run": bool(self.fast_dev_run), "detect_anomaly": self.detect_anomaly, "callbacks": costly}
        for flag, conflicts in asked.items():  # fmt: skip
            if conflicts:
                raise _barebones_conflict(flag, getattr(self, flag))

    @classmethod
    def of_trainer(cls, **flags: Any) -> TrainerConfig:
        """The record of ``Trainer(**flags)``, where None is a flag not given: with ``barebones=True``, a feature it
        turns off that is asked for (``logger=True``, ``enable_checkpointing=True``, ...) is refused, as Lightning
        refuses it."""
        if flags.get("barebones"):
            for flag, off in _BAREBONES_OFF.items():
                if flags.get(flag) not in (None, off):
                    raise _barebones_conflict(flag, flags[flag])
        return cls(**flags)

    def for_fit(self) -> TrainerConfig:
        """The flags as ``fit`` applies them, as Lightning resolves them when ``fit`` starts: ``max_epochs`` is the
        limit it comes to (1000, with a warning, when no limit is given at all; -1 when another one is); ``min_epochs``
        not given is 0, or 1 with ``min_steps`` (an epoch then ends before a stop that was asked for)."""
        if self.max_epochs is None and self.epoch_limit != -1:  # at each such fit, as Lightning (once per line)
            rank_zero_warn(
                "`max_epochs` was not set. Setting it to 1000 epochs. To train without an epoch limit, set "
                "`max_epochs=-1`.",
                PossibleUserWarning,
                stacklevel=5,  # the line calling fit (this function, fit, and rank_zero_warn with its decorator)
            )
        min_epochs = int(self.min_steps is not None) if self.min_epochs is None else self.min_epochs
        return dataclasses.replace(self, max_epochs=self.epoch_limit, min_epochs=min_epochs)

    def resolved(self) -> TrainerConfig:
        """The flags as the loops apply them: ``fast_dev_run``, ``overfit_batches`` and ``barebones`` set the
        limits, the validation schedule and the features they imply (the loops then read only the usual flags)."""
        changes: dict[str, Any] = {}
        if self.barebones:
            changes.update(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                           enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=0)  # fmt: skip
        batches = int(self.fast_dev_run)
        if batches:
            changes.update(
                limit_train_batches=batches, limit_val_batches=batches, limit_test_batches=batches,
                limit_predict_batches=batches, max_steps=batches, max_epochs=1, max_time=None,
                num_sanity_val_steps=0, val_check_interval=1.0, check_val_every_n_epoch=1,
            )  # fmt: skip
        if self.overfit_batches:
            changes.update(limit_train_batches=self.overfit_batches, limit_val_batches=self.overfit_batches)
        return dataclasses.replace(self, **changes) if changes else self

    # ---------------------------------------------------------------------------- derived
    @property
    def layout(self) -> tuple[str, int | str | Sequence[int]]:
        """``(accelerator, devices)`` with the older ``gpus=`` spelling turned into them."""
        if self.gpus is None:
            return self.accelerator, self.devices
        if self.gpus in (0, "0", [], ()):
            return "cpu", "auto"
        return "cuda", self.gpus

    @property
    def epoch_limit(self) -> int:
        """``max_epochs``, or the default: 1000 when no other limit is given, else no limit (-1)."""
        if self.max_epochs is not None:
            return self.max_epochs
        return 1000 if self.max_steps == -1 and self.max_time is None else -1

    @property
    def max_time_seconds(self) -> float | None:
        return parse_max_time(self.max_time)

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """The ``torch.compile`` options (None when the module is not to be compiled)."""
        return _compile_options(self.compile)

    @property
    def doctor_steps(self) -> int:
        """Steps the doctor watches (0: no doctor)."""
        if self.doctor is False:
            return 0
        return 30 if self.doctor is True else int(self.doctor)

    @property
    def timeout_seconds(self) -> float | None:
        timeout = self.timeout
        if timeout is None:
            return None
        return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)

    @property
    def root_dir(self) -> str:
        return local_path(self.default_root_dir) if self.default_root_dir is not None else os.getcwd()


#: What names a Trainer flag's default in the environment: ``PL_TRAINER_MAX_STEPS=7``, as in Lightning.
ENVIRONMENT_PREFIX = "PL_TRAINER_"


def environment_defaults(init: _Init) -> _Init:
    """``Trainer.__init__`` with the flags set in the environment (``PL_TRAINER_<FLAG>``) as defaults: a flag given to
    the Trainer wins. A value is read as a Python literal (``7``, ``False``, ``[0, 1]``), else as a string."""

    @functools.wraps(init)
    def with_environment_defaults(self: Any, **flags: Any) -> None:
        init(self, **{**_environment_flags(), **flags})

    return cast(_Init, with_environment_defaults)


def _environment_flags() -> dict[str, Any]:
    flags = {}
    for flag in _DEFAULTS:
        value = os.environ.get(ENVIRONMENT_PREFIX + flag.upper())
        if value:
            try:
                flags[flag] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                flags[flag] = value
    return flags


#: Flags for which None, as Lightning's signature allows and the config files its CLI writes spell it, means the
#: default.
_NONE_IS_DEFAULT = ("precision", "logger", "val_check_interval", "num_sanity_val_steps", "log_every_n_steps",
                    "enable_checkpointing", "enable_progress_bar", "enable_model_summary")  # fmt: skip
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TrainerConfig)}


#: The features ``barebones=True`` turns off that the Trainer's flags ask for, each with the value that asks for none.
_BAREBONES_OFF = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                  "enable_model_summary": False, "num_sanity_val_steps": 0, "log_every_n_steps": 0}  # fmt: skip


# ------------------------------------------------------------------------------------ checks
def _barebones_conflict(flag: str, value: Any) -> FlagError:
    return FlagError(
        f"`Trainer(barebones=True, {flag}={value!r})` was passed, but barebones=True turns off everything that costs "
        "time besides the steps; drop one of the two"
    )


def _as_list(callbacks: Callback | Sequence[Callback] | None) -> list[Callback]:
    return [] if callbacks is None else [callbacks] if isinstance(callbacks, Callback) else list(callbacks)


def _check_bool(flag: str, value: Any, also: str = "") -> None:
    if not isinstance(value, bool):
        allowed = "True or False" + (f" or {also}" if also else "")
        raise FlagError(f"{flag}={value!r}: expected {allowed}")


def _check_int(flag: str, value: Any, minimum: int, also: str = "", noun: str = "int") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:  # (in Lightning's words for the flag)
        rule = "must be a non-negative integer or -1" if minimum < 0 else f"should be an {noun} >= {minimum}"
        raise FlagError(f"{flag}={value!r}: `{flag}` {rule}" + (f" or {also}" if also else ""))


def _check_choice(flag: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        *others, last = [repr(choice) for choice in choices]  # (Lightning's words, then the choices)
        raise FlagError(f"{flag}={value!r}: `{flag}` {value} is invalid; choose {', '.join(others)} or {last}")


def _checked_limit(flag: str, value: Any) -> Limit:
    """A batch limit as the loops apply it: a whole float above 1 (``1e6``, as a config file may spell a count) is
    that number of batches, as Lightning takes it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FlagError(f"{flag}={value!r}: expected None, a number of batches (int) or a fraction (float)")
    count = _whole_count(value)
    if count is not None:
        return count
    if (isinstance(value, int) and value < 0) or (isinstance(value, float) and not 0.0 <= value <= 1.0):
        raise FlagError(f"{flag}={value!r}: passed invalid value; an int counts batches (>= 0), a float is a fraction "
                        "in [0, 1] or a whole number of batches (2.0)")  # fmt: skip
    return value


def _whole_count(value: Any) -> int | None:
    """``value`` as a number of batches when it is a float above 1 with nothing after the point (else None)."""
    if isinstance(value, float) and value > 1.0 and value.is_integer():
        return int(value)
    return None


def _check_devices(flag: str, value: Any, accelerator: str) -> None:
    if accelerator == "cpu" and value != "auto" and not (isinstance(value, (int, str)) and str(value).isdigit()):
        raise FlagError(f"{flag}={value!r}: `devices` selected with `CPUAccelerator` should be an int > 0 (processes)")
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return
    if isinstance(value, Sequence) and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return
    raise FlagError(f"{flag}={value!r}: use 'auto', a count, -1 for all, a list of indices or a string like '0,1'")


def _check_items(flag: str, value: Any, kind: type, allowed: str) -> None:
    items = [] if value is None else [value] if isinstance(value, kind) else value
    if not isinstance(items, Sequence) or not all(isinstance(item, kind) for item in items):
        raise FlagError(f"{flag}={value!r}: expected {allowed}")


def _compile_options(value: Any) -> dict[str, Any] | None:
    if value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise FlagError(f"compile={value!r}: expected True, False or a dict of torch.compile options")
    accepted = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = sorted(set(value) - set(accepted))
    if unknown:
        raise FlagError(f"compile={dict(value)!r}: {unknown} are not torch.compile options; it takes {accepted}")
    return dict(value)
