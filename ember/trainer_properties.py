"""What the Trainer tells of its devices and flags under Lightning's public names (``trainer.device_ids``,
``trainer.accelerator``, ``trainer.init_module()``, ...): read from the strategy, the config and the fit loop,
never kept apart from them."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from ember._utils import Reads
from ember.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from ember.config import TrainerConfig
    from ember.loggers import Logger
    from ember.loops.fit import FitLoop
    from ember.optim import LRSchedulerConfig
    from ember.strategies import Strategy


class Accelerator:
    """The kind of device a Trainer runs on (``trainer.accelerator``), with Lightning's methods that apply to it."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def setup_device(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def teardown(self) -> None:
        """Nothing to release: the strategy frees the device's cached memory when a stage ends."""

    def get_device_stats(self, device: torch.device | str) -> dict[str, Any]:
        """The device's figures: ``torch.cuda.memory_stats`` on a GPU; the host's use of CPU, memory and swap (in
        percent, read with ``psutil``) on the CPU."""
        device = torch.device(device)
        if device.type == "cuda":
            return torch.cuda.memory_stats(device)
        try:
            import psutil  # type: ignore[import-untyped, unused-ignore]
        except ImportError as error:
            raise ModuleNotFoundError("the CPU's device stats are read with psutil: pip install psutil") from error
        return {
            "cpu_percent": psutil.cpu_percent(),
            "cpu_vm_percent": psutil.virtual_memory().percent,
            "cpu_swap_percent": psutil.swap_memory().percent,
        }

    def auto_device_count(self) -> int:
        return torch.cuda.device_count() if self.device_type == "cuda" else 1

    def is_available(self) -> bool:
        if self.device_type == "cuda":
            return torch.cuda.is_available()
        return self.device_type != "mps" or torch.backends.mps.is_available()

    def __repr__(self) -> str:
        return f"Accelerator({self.device_type!r})"


# One class per kind of device, as Lightning's, so that ``isinstance(trainer.accelerator, CUDAAccelerator)`` says
# where the run is; its class methods answer for that kind without a Trainer (``CUDAAccelerator.is_available()``).
class CPUAccelerator(Accelerator):
    def __init__(self) -> None:
        super().__init__("cpu")

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def auto_device_count() -> int:
        return 1  # one process: more CPU processes are asked for with devices=N


class CUDAAccelerator(Accelerator):
    def __init__(self) -> None:
        super().__init__("cuda")

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def auto_device_count() -> int:
        return torch.cuda.device_count()


class MPSAccelerator(Accelerator):
    def __init__(self) -> None:
        super().__init__("mps")

    @staticmethod
    def is_available() -> bool:
        return torch.backends.mps.is_available()

    @staticmethod
    def auto_device_count() -> int:
        return 1


_KINDS: dict[str, Callable[[], Accelerator]] = {"cpu": CPUAccelerator, "cuda": CUDAAccelerator, "mps": MPSAccelerator}


def accelerator_of(device_type: str) -> Accelerator:
    """The accelerator of a device of type ``device_type`` (``torch.device.type``)."""
    make = _KINDS.get(device_type)
    return make() if make is not None else Accelerator(device_type)


class LightningProperties:
    """The Trainer's attributes in Lightning's names that only forward what its parts hold (a base of ``Trainer``)."""

    config: TrainerConfig
    strategy: Strategy
    fit_loop: FitLoop
    _loggers: list[Logger]

    _ckpt_path: str | None = None  # the checkpoint the latest stage loaded, or the one the user set
    _ckpt_path_managed = False  # whether the user set it (Lightning's "user managed" checkpoint path)

    reload_dataloaders_every_n_epochs: Reads[int] = Reads("config.reload_dataloaders_every_n_epochs")
    overfit_batches: Reads[int | float] = Reads("config.overfit_batches")
    enable_autolog_hparams: Reads[bool] = Reads("config.enable_autolog_hparams")
    distributed_sampler_kwargs: Reads[dict[str, int] | None] = Reads("strategy.distributed_sampler_kwargs")
    #: The gradient scaler of "16-mixed" (None under another precision).
    scaler: Reads[torch.amp.GradScaler | None] = Reads("strategy.precision", lambda p: getattr(p, "scaler", None))
    accelerator: Reads[Accelerator] = Reads("strategy.root_device.type", accelerator_of)

    @property
    def loggers(self) -> list[Logger]:
        return self._loggers

    @loggers.setter
    def loggers(self, loggers: list[Logger] | None) -> None:
        """Replace the loggers (None: none); the list is refilled, as the parts that write to it hold it."""
        self._loggers[:] = loggers or []

    @property
    def logger(self) -> Logger | None:
        """The first logger (None: there is none); setting it makes it the only one."""
        return self._loggers[0] if self._loggers else None

    @logger.setter
    def logger(self, logger: Logger | None) -> None:
        self.loggers = [] if logger is None else [logger]

    @property
    def ckpt_path(self) -> str | None:
        """The checkpoint the latest ``fit``, ``validate``, ``test`` or ``predict`` loaded (None: none). Set, it
        is the one the next stages load when they are given no ``ckpt_path``, until it is set to None."""
        return self._ckpt_path

    @ckpt_path.setter
    def ckpt_path(self, path: str | os.PathLike | None) -> None:
        self._ckpt_path = None if path is None else os.fspath(path)
        self._ckpt_path_managed = bool(path)

    def _stage_checkpoint(self, ckpt_path: str | os.PathLike | None) -> str | os.PathLike | None:
        """The ``ckpt_path`` a stage takes: the one set on the Trainer unless the stage is given another, which
        then takes its place, with Lightning's warning."""
        if not self._ckpt_path_managed:
            return ckpt_path
        if ckpt_path is None:
            return self._ckpt_path
        rank_zero_warn(
            f"`trainer.ckpt_path = {self._ckpt_path!r}` was called but then you passed "
            f"`trainer.fit(ckpt_path={ckpt_path!r})`. The latter will be loaded.",  # (Lightning's words, any stage)
            stacklevel=4,
        )
        self.ckpt_path = None
        return ckpt_path

    @property
    def device_ids(self) -> list[int]:
        """The index of each device this node's processes use (0 for the CPU)."""
        return [device.index or position for position, device in enumerate(self.strategy.parallel_devices)]

    @property
    def num_devices(self) -> int:
        return len(self.strategy.parallel_devices)

    @property
    def lr_scheduler_configs(self) -> list[LRSchedulerConfig]:
        runner = self.fit_loop.runner
        return runner.scheduler_configs if runner is not None else []

    @property
    def received_sigterm(self) -> bool:
        """Whether the latest ``fit`` received SIGTERM (it then saved ``last.ckpt`` and stopped)."""
        stopping = self.fit_loop.stopping
        return signal.SIGTERM in (stopping.stop_signal, stopping.interruptions.signal_received)

    @property
    def val_check_batch(self) -> int | float | None:
        """Training batches between validations in the latest ``fit`` (None before it, and when
        ``val_check_interval`` is a duration)."""
        data = self.fit_loop.data
        if data is None:
            return None
        if self.config.val_check_interval == 1.0:
            return data.num_batches
        return data.validation.every

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Build a module's tensors on the device it will run on, in the dtype of a "-true" precision; the weights
        are initialised as usual whatever ``empty_init`` says (the strategy loads a checkpoint over them)."""
        precision = self.strategy.precision
        dtype = getattr(precision, "dtype", None) if precision.name.endswith("-true") else None
        previous = torch.get_default_dtype()
        with torch.device(self.strategy.root_device):
            if dtype is not None:
                torch.set_default_dtype(dtype)
            try:
                yield
            finally:
                torch.set_default_dtype(previous)
