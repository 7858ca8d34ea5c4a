"""``StochasticWeightAveraging``: Lightning's callback that averages the weights of the last epochs (Izmailov et al.,
"Averaging Weights Leads to Wider Optima and Better Generalization", 2018), on ``torch.optim.swa_utils``.

From the epoch ``swa_epoch_start`` on, the learning rate follows ``SWALR`` (replacing the module's scheduler) and
each epoch starts by adding the weights to the average. When the fit ends at ``max_epochs``, the module gets the
averaged weights and its BatchNorm statistics are recomputed for them with one pass over the training data.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import SWALR

from ember._utils import takes_batch_idx
from ember.callbacks.callback import Callback
from ember.data import limited
from ember.exceptions import MisconfigurationException
from ember.optim import LRSchedulerConfig
from ember.rank_zero import announce, rank_zero_warn

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

AverageFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_CPU = torch.device("cpu")


class StochasticWeightAveraging(Callback):
    """Average the weights of the epochs from ``swa_epoch_start`` to the end of the fit, as Lightning's callback.

    Args:
        swa_lrs: the learning rate the SWA schedule anneals to: one for every parameter group, or a list with one
            per group.
        swa_epoch_start: the epoch (counted from 1) where averaging starts, or a fraction of ``max_epochs``.
        annealing_epochs: over how many epochs the learning rate goes to ``swa_lrs``.
        annealing_strategy: ``"cos"`` or ``"linear"`` annealing.
        avg_fn: ``avg_fn(averaged, current, n_averaged)``, the new average of a parameter (None: equal weights).
        device: where the averaged weights are kept (None: the module's device).
    """

    def __init__(
        self,
        swa_lrs: float | list[float],
        swa_epoch_start: int | float = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: Literal["cos", "linear"] = "cos",
        avg_fn: AverageFn | None = None,
        device: torch.device | str | None = _CPU,
    ) -> None:
        _check_settings(swa_lrs, swa_epoch_start, annealing_epochs, annealing_strategy, avg_fn, device)
        self.swa_lrs = swa_lrs
        self.swa_epoch_start = swa_epoch_start
        self.annealing_epochs = annealing_epochs
        self.annealing_strategy = annealing_strategy
        self.average_fn: AverageFn = avg_fn or self.avg_fn
        self.device = device
        #: How many epochs' weights the average holds (None until averaging starts).
        self.n_averaged: torch.Tensor | None = None
        #: The momentum of each BatchNorm layer, kept while its statistics are recomputed.
        self.momenta: dict[_BatchNorm, float | None] = {}
        self.average_model: nn.Module | None = None
        self.scheduler: SWALR | None = None
        #: The latest epoch whose weights went into the average (-1: none).
        self.latest_update_epoch = -1
        self._first_epoch: int | None = None  # swa_epoch_start as an epoch, once the fit knows max_epochs
        self._max_epochs = -1
        self._batch_norm = False
        # What a checkpoint gave, for the average and the schedule to continue from when averaging starts.
        self._restored_count = 0
        self._restored_schedule: dict[str, Any] | None = None

    # ---------------------------------------------------------------------------- Lightning's API
    @property
    def swa_start(self) -> int:
        """The first epoch of averaging, counted from 0."""
        if self._first_epoch is None:
            raise RuntimeError("StochasticWeightAveraging.swa_start is known once fit has started")
        return max(self._first_epoch - 1, 0)

    @property
    def swa_end(self) -> float:
        """The last epoch of averaging, counted from 0 (infinite with ``max_epochs=-1``)."""
        return float("inf") if self._max_epochs == -1 else self._max_epochs - 1

    @staticmethod
    def pl_module_contains_batch_norm(pl_module: nn.Module) -> bool:
        return any(isinstance(module, _BatchNorm) for module in pl_module.modules())

    @staticmethod
    def avg_fn(averaged: torch.Tensor, current: torch.Tensor, n_averaged: torch.Tensor) -> torch.Tensor:
        """The equally weighted average of ``n_averaged`` values and ``current``."""
        return averaged + (current - averaged) / (n_averaged + 1)

    @staticmethod
    def update_parameters(
        average_model: nn.Module, model: nn.Module, n_averaged: torch.Tensor, avg_fn: AverageFn
    ) -> None:
        """Add ``model``'s parameters to ``average_model``'s, which hold ``n_averaged`` models (then one more)."""
        for average_parameter, parameter in zip(average_model.parameters(), model.parameters()):
            averaged = average_parameter.detach()
            current = parameter.detach().to(averaged.device)
            averaged.copy_(current if n_averaged == 0 else avg_fn(averaged, current, n_averaged.to(averaged.device)))
        n_averaged += 1

    @staticmethod
    def transfer_weights(src_pl_module: nn.Module, dst_pl_module: nn.Module) -> None:
        """Copy the parameters (not the buffers) of ``src_pl_module`` into ``dst_pl_module``."""
        for source, destination in zip(src_pl_module.parameters(), dst_pl_module.parameters()):
            destination.detach().copy_(source.to(destination.device))

    def reset_batch_norm_and_save_state(self, pl_module: nn.Module) -> None:
        """Start the BatchNorm statistics afresh, as a cumulative average (``momentum=None``) over the coming
        batches, keeping each layer's momentum in ``momenta``."""
        self.momenta = {}
        for module in pl_module.modules():
            if isinstance(module, _BatchNorm) and module.track_running_stats:
                module.reset_running_stats()
                self.momenta[module] = module.momentum
                module.momentum = None

    def reset_momenta(self) -> None:
        for module, momentum in self.momenta.items():
            module.momentum = momentum

    # --------------------------------------------------------------------------------- the hooks
    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        if stage != "fit":
            return
        refuse_sharded_models(trainer, "SWA does not currently support")
        # Before the module reaches its device (a copy of a Module leaves its trainer, and the loaders, out).
        self.average_model = copy.deepcopy(pl_module)

    def on_fit_start(self, trainer: Trainer, pl_module: Module) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationException(
                f"SWA currently works with 1 `optimizer`: configure_optimizers() returned {len(trainer.optimizers)}"
            )
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "SWA works with automatic optimization only: its BatchNorm pass runs training_step without "
                "training, which a training_step that steps its optimizers itself (automatic_optimization=False) "
                "would not do"
            )
        if len(trainer.lr_scheduler_configs) > 1:
            raise MisconfigurationException(
                f"SWA currently not supported for more than 1 `lr_scheduler`: configure_optimizers() returned "
                f"{len(trainer.lr_scheduler_configs)}"
            )
        assert trainer.max_epochs is not None  # fit has resolved it: -1 for no limit
        self._max_epochs = max_epochs = trainer.max_epochs
        if isinstance(self.swa_epoch_start, float):
            if max_epochs == -1:
                raise MisconfigurationException(
                    "SWA with `swa_epoch_start` as a float is not supported when `max_epochs=-1`. "
                    "Please provide `swa_epoch_start` as an integer."
                )
            self._first_epoch = int(max_epochs * self.swa_epoch_start)
        else:
            self._first_epoch = self.swa_epoch_start
        self._batch_norm = self.pl_module_contains_batch_norm(pl_module)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("callbacks", {}).get(self.state_key)
        if saved is not None and saved.get("scheduler_state") is not None:
            # The checkpoint's scheduler is the SWA schedule, which on_train_epoch_start builds again: its state
            # must not go into the module's own scheduler, which it replaced.
            trainer.lr_scheduler_configs.clear()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        epoch = trainer.current_epoch
        if not self.swa_start <= epoch <= self.swa_end:
            return
        if self.scheduler is None:
            self._start_averaging(trainer, pl_module)
        assert self.average_model is not None and self.n_averaged is not None
        if epoch > self.latest_update_epoch:  # not twice in an epoch that a resumed fit continues
            self.update_parameters(self.average_model, pl_module, self.n_averaged, self.average_fn)
            self.latest_update_epoch = epoch

    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None:
        # Averaged to the last epoch: the fit ended at max_epochs (not stopped early), or has no epoch limit.
        ended = self._max_epochs == -1 or trainer.current_epoch - 1 == self.swa_end
        if not ended or self.average_model is None or self.n_averaged is None or not self.n_averaged:
            return
        self.transfer_weights(self.average_model, pl_module)
        if self._batch_norm and self._max_epochs != -1:
            self._recompute_batch_norm(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_averaged": 0 if self.n_averaged is None else int(self.n_averaged.item()),
            "latest_update_epoch": self.latest_update_epoch,
            "scheduler_state": None if self.scheduler is None else self.scheduler.state_dict(),
            "average_model_state": None if self.average_model is None else self.average_model.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_count = state_dict["n_averaged"]
        self.latest_update_epoch = state_dict["latest_update_epoch"]
        self._restored_schedule = state_dict["scheduler_state"]
        if self.average_model is not None and state_dict.get("average_model_state") is not None:
            self.average_model.load_state_dict(state_dict["average_model_state"])

    # ------------------------------------------------------------------------------------ helpers
    def _start_averaging(self, trainer: Trainer, pl_module: Module) -> None:
        """Move the average where it is kept and put the SWA schedule in place of the module's scheduler."""
        assert self.average_model is not None
        self.average_model.to(self.device or pl_module.device)
        optimizer = trainer.optimizers[0]
        swa_lrs = self.swa_lrs if isinstance(self.swa_lrs, list) else [self.swa_lrs] * len(optimizer.param_groups)
        for lr, group in zip(swa_lrs, optimizer.param_groups):
            group["initial_lr"] = lr
        self.scheduler = SWALR(
            optimizer,
            swa_lr=swa_lrs,  # type: ignore[arg-type]  # one per parameter group, as SWALR documents it
            anneal_epochs=self.annealing_epochs,
            anneal_strategy=self.annealing_strategy,
            last_epoch=trainer.max_epochs if self.annealing_strategy == "cos" else -1,  # as Lightning's
        )
        if self._restored_schedule is not None:
            self.scheduler.load_state_dict(self._restored_schedule)
        elif trainer.current_epoch != self.swa_start:
            rank_zero_warn(
                f"SWA is initializing after swa_start without any checkpoint data (epoch {trainer.current_epoch}, "
                f"swa_start {self.swa_start}): the average starts with this epoch's weights"
            )
        configs = trainer.lr_scheduler_configs
        swa_config = LRSchedulerConfig(self.scheduler)
        if configs:
            replaced = configs[0]
            if replaced.interval != "epoch" or replaced.frequency != 1:
                rank_zero_warn(f"SWA is currently only supported every epoch. Found {replaced}")
            announce(f"Swapping scheduler `{type(replaced.scheduler).__name__}` for `SWALR`")
            configs[0] = swa_config
        else:
            configs.append(swa_config)
        self.n_averaged = torch.tensor(self._restored_count, dtype=torch.long, device=pl_module.device)

    def _recompute_batch_norm(self, trainer: Trainer, pl_module: Module) -> None:
        """The BatchNorm statistics of the averaged weights: one pass of ``training_step`` over the training
        batches, in training mode, training nothing (no gradient, no step) and keeping nothing it logs."""
        loader = trainer.fit_loop.train_loader  # several training loaders: combined, as training reads them
        if loader is None:
            return
        to_device = trainer.hooks.batch_transfer(trainer.strategy)
        with_index = takes_batch_idx(pl_module.training_step)
        was_training = pl_module.training
        self.reset_batch_norm_and_save_state(pl_module)
        pl_module.train()
        try:
            with (
                contextlib.closing(limited(loader, trainer.num_training_batches)) as batches,
                torch.no_grad(),
                trainer.run_metrics.discarding("training_step"),
            ):
                for batch_idx, batch in enumerate(batches):
                    batch = to_device(batch) if to_device is not None else batch
                    with trainer.strategy.precision.forward_context():
                        pl_module.training_step(*((batch, batch_idx) if with_index else (batch,)))
        finally:
            pl_module.train(was_training)
            self.reset_momenta()


def _check_settings(
    swa_lrs: Any, swa_epoch_start: Any, annealing_epochs: Any, annealing_strategy: Any, avg_fn: Any, device: Any
) -> None:
    """Lightning's checks (and its messages, with the value given), and those of SWALR's arguments."""
    start_ok = isinstance(swa_epoch_start, int) and swa_epoch_start >= 1
    start_ok |= isinstance(swa_epoch_start, float) and 0 <= swa_epoch_start <= 1
    if not start_ok:
        raise MisconfigurationException(
            f"swa_epoch_start should be a >0 integer or a float between 0 and 1. Got {swa_epoch_start!r}"
        )
    lrs = swa_lrs if isinstance(swa_lrs, list) else [swa_lrs]
    if not isinstance(swa_lrs, (float, list)) or not all(isinstance(lr, float) and lr > 0 for lr in lrs):
        raise MisconfigurationException(
            f"The `swa_lrs` should be a positive float, or a list of positive floats (one per parameter group). "
            f"Got {swa_lrs!r}"
        )
    if not isinstance(annealing_epochs, int) or annealing_epochs < 0:
        raise MisconfigurationException(f"annealing_epochs should be an integer >= 0. Got {annealing_epochs!r}")
    if annealing_strategy not in ("cos", "linear"):
        raise MisconfigurationException(f"annealing_strategy should be 'cos' or 'linear'. Got {annealing_strategy!r}")
    if avg_fn is not None and not callable(avg_fn):
        raise MisconfigurationException(f"The `avg_fn` should be callable. Got {avg_fn!r}")
    if device is not None and not isinstance(device, (torch.device, str)):
        raise MisconfigurationException(f"device is expected to be a torch.device or a str. Found {device}")


def refuse_sharded_models(trainer: Trainer, refusal: str) -> None:
    """Refuse a strategy that shards the model, ``refusal`` saying who refuses ("SWA does not support"): averaging
    weights needs every parameter in each process."""
    if not trainer.strategy.holds_whole_model:
        raise MisconfigurationException(
            f"{refusal} sharded models (strategy={trainer.strategy.name!r}): each process must hold every parameter "
            "to average them; use strategy='ddp'"
        )
