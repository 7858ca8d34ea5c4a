"""``WeightAveraging`` and ``EMAWeightAveraging``: Lightning's callbacks that keep an average of the weights
(``torch.optim.swa_utils.AveragedModel``), updated after the optimizer steps or epochs that ``should_update`` picks;
validation runs on the average, and the module ends the fit holding it. A checkpoint keeps the average as the
module's ``state_dict`` (what ``load_from_checkpoint`` gives) and the trained weights beside it, to resume from."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn

from ember.callbacks.callback import Callback
from ember.callbacks.weight_averaging import refuse_sharded_models
from ember.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

_AVERAGING_ARGUMENTS = ("avg_fn", "multi_avg_fn")


class WeightAveraging(Callback):
    """Average the module's weights as training goes, as Lightning's callback (by default, after every optimizer
    step, with equal weights: stochastic weight averaging).

    Args:
        device: where the average is kept (None: the module's device).
        use_buffers: average the buffers too (BatchNorm statistics), as is the default here, unlike
            ``AveragedModel``'s; with False, only the parameters are averaged.
        **kwargs: ``avg_fn`` or ``multi_avg_fn``, the averaging function of ``AveragedModel`` (for an exponential
            moving average: ``torch.optim.swa_utils.get_ema_avg_fn(decay)``, or ``EMAWeightAveraging``).

    Override ``should_update(step_idx=None, epoch_idx=None)`` to choose when the average takes the weights: it is
    asked after each optimizer step (with the step's index, from 0) and at the end of each training epoch (with
    the epoch's); the default takes every step.
    """

    def __init__(self, device: torch.device | str | int | None = None, use_buffers: bool = True, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(_AVERAGING_ARGUMENTS))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword arguments {unknown}: it takes device, use_buffers "
                f"and AveragedModel's {' and '.join(_AVERAGING_ARGUMENTS)}"
            )
        self.device = torch.device(device) if isinstance(device, str) else device
        self.use_buffers = use_buffers
        self.averaging_kwargs = kwargs
        #: The average (its ``module`` holds the averaged weights, ``n_averaged`` how many it took); made when the fit
        #: starts, or when a checkpoint is restored into it.
        self.average_model: AveragedModel | None = None
        #: The global step whose weights the average took last (0: none): a step is averaged once, however many
        #: micro-batches it accumulated.
        self.latest_update_step = 0
        #: The epoch whose end the average took last (-1: none).
        self.latest_update_epoch = -1

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        """Whether the average takes the weights after optimizer step ``step_idx``, or at the end of epoch
        ``epoch_idx`` (one of them is given, counted from 0): every step by default."""
        return step_idx is not None

    # --------------------------------------------------------------------------------- the hooks
    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        if stage != "fit":
            return
        refuse_sharded_models(trainer, f"{type(self).__name__} does not support")
        # Each fit averages its own module, from its first step (a resumed fit's state is loaded after this).
        self.average_model, self.latest_update_step, self.latest_update_epoch = None, 0, -1

    def on_fit_start(self, trainer: Trainer, pl_module: Module) -> None:
        self._average_of(pl_module)  # before the sanity check, which validates on the average as every validation

    def on_train_batch_end(self, trainer: Trainer, pl_module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step > self.latest_update_step and self.should_update(step_idx=step - 1):
            self._average_of(pl_module).update_parameters(pl_module)
            self.latest_update_step = step

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        epoch = trainer.current_epoch
        if epoch > self.latest_update_epoch and self.should_update(epoch_idx=epoch):
            self._average_of(pl_module).update_parameters(pl_module)
            self.latest_update_epoch = epoch

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        self.swap_weights(pl_module)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        self.swap_weights(pl_module)  # the trained weights back, for training to go on from them

    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None:
        for averaged, current in self._pairs(pl_module):
            current.copy_(averaged)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]) -> None:
        if self.average_model is None:
            rank_zero_info(
                f"{type(self).__name__} holds no average outside a fit: the checkpoint keeps the module's weights only"
            )
            return
        averaged = self.average_model.state_dict()
        checkpoint["current_model_state"] = checkpoint["state_dict"]
        checkpoint["state_dict"] = {name[7:]: value for name, value in averaged.items() if name.startswith("module.")}
        checkpoint["averaging_state"] = {
            name: value for name, value in averaged.items() if not name.startswith("module.")
        }

    def on_load_checkpoint(self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]) -> None:
        average = self._average_of(pl_module)
        if "current_model_state" in checkpoint and "averaging_state" in checkpoint:
            rank_zero_info("Found current_model_state in the checkpoint. This will be used to initialize the model.")
            state = {"module." + name: value for name, value in checkpoint["state_dict"].items()}
            average.load_state_dict({**state, **checkpoint["averaging_state"]})
            # The module was given "state_dict", which is the average: the trained weights are these.
            pl_module.load_state_dict(checkpoint["current_model_state"])
        else:
            rank_zero_warn(
                "The checkpoint was not created with WeightAveraging. Both the current and the average model will be "
                "initialized with state_dict."
            )
            average.module.load_state_dict(checkpoint["state_dict"], strict=False)

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self.latest_update_step, "latest_update_epoch": self.latest_update_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.latest_update_step = state_dict["latest_update_step"]
        self.latest_update_epoch = state_dict.get("latest_update_epoch", -1)  # Lightning's state does not keep it

    # ------------------------------------------------------------------------------------ helpers
    def swap_weights(self, pl_module: Module) -> None:
        """Exchange the module's weights (and buffers) with the average's."""
        for averaged, current in self._pairs(pl_module):
            kept = averaged.clone()
            averaged.copy_(current)
            current.copy_(kept)

    def _average_of(self, pl_module: Module) -> AveragedModel:
        # Made once the module has its layers (configure_model) and its device, so that it holds every layer
        # and is kept where the module trains.
        if self.average_model is None:
            device = self.device if self.device is not None else pl_module.device
            self.average_model = AveragedModel(
                pl_module, device=device, use_buffers=self.use_buffers, **self.averaging_kwargs
            )
        return self.average_model

    def _pairs(self, pl_module: Module) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each tensor of the average with the module's (parameters, then buffers); none before the average."""
        if self.average_model is None:
            return
        average = self.average_model.module
        averaged = itertools.chain(average.parameters(), average.buffers())
        current = itertools.chain(pl_module.parameters(), pl_module.buffers())
        for pair in zip(averaged, current):
            yield pair[0].data, pair[1].data


class EMAWeightAveraging(WeightAveraging):
    """An exponential moving average of the weights, as Lightning's callback: ``average = decay * average +
    (1 - decay) * weights`` after every ``update_every_n_steps``-th optimizer step (steps counted from 0) from step
    ``update_starting_at_step`` on (None: from the first), and at the end of every epoch from
    ``update_starting_at_epoch`` on (None: never at epoch ends). ``device``, ``use_buffers`` and ``**kwargs`` as
    ``WeightAveraging``'s."""

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        update_starting_at_epoch: int | None = None,
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMAWeightAveraging(decay={decay!r}): expected a number between 0 and 1")
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=get_ema_avg_fn(decay=decay))
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            if started and self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0:
                return True
        start = self.update_starting_at_epoch
        return epoch_idx is not None and start is not None and epoch_idx >= start
