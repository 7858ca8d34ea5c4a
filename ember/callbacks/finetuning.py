"""``BaseFinetuning`` and ``BackboneFinetuning``: train a model's head first, then unfreeze more of it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ember.callbacks.callback import Callback
from ember.rank_zero import rank_zero_print, rank_zero_warn

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

Modules = nn.Module | Iterable[Any]  # a module, or (nested) iterables of modules


class BaseFinetuning(Callback):
    """Freeze parts of the module before training and unfreeze them on a schedule of your own.

    Subclass it and define ``freeze_before_training(pl_module)`` (called when a stage is set up, before the
    optimizers are built: build them from ``filter(lambda p: p.requires_grad, self.parameters())``) and
    ``finetune_function(pl_module, epoch, optimizer)`` (called with each optimizer when each training epoch
    starts; ``unfreeze_and_add_param_group`` gives an unfrozen part its own parameter group). Its state, saved in
    checkpoints, is each optimizer's parameter groups with their parameters' names (``internal_optimizer_metadata``,
    as in Lightning): a resumed fit puts the groups the schedule had added back into the optimizers, their
    parameters trainable again, before the optimizers' states are loaded.
    """

    def __init__(self) -> None:
        self._groups: dict[int, list[dict[str, Any]]] = {}  # by optimizer: its groups, parameters by name

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        self.freeze_before_training(pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: Module) -> None:
        names = {parameter: name for name, parameter in pl_module.named_parameters()}
        for index, optimizer in enumerate(trainer.optimizers):
            self.finetune_function(pl_module, trainer.current_epoch, optimizer)
            known = self._groups.setdefault(index, [])  # groups as they were added, as Lightning keeps them
            known += [
                {**group, "params": [names[parameter] for parameter in group["params"]]}
                for group in optimizer.param_groups[len(known) :]
            ]

    def on_load_checkpoint(self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]) -> None:
        # Called once the optimizers exist, before their saved states are loaded: those states hold the groups
        # the schedule added, which configure_optimizers (built from the parameters that train) leaves out.
        saved = checkpoint.get("callbacks", {}).get(self.state_key, {}).get("internal_optimizer_metadata", {})
        parameters = dict(pl_module.named_parameters())
        for index, optimizer in enumerate(trainer.optimizers):
            for group in saved.get(index, [])[len(optimizer.param_groups) :]:
                added = [parameters[name].requires_grad_(True) for name in group["params"]]
                optimizer.add_param_group({**group, "params": added})

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._groups = state_dict.get("internal_optimizer_metadata", {})

    def freeze_before_training(self, pl_module: Module) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define freeze_before_training(pl_module)")

    def finetune_function(self, pl_module: Module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define finetune_function(pl_module, epoch, optimizer)")

    # ---------------------------------------------------------------------------- helpers
    @staticmethod
    def flatten_modules(modules: Modules) -> list[nn.Module]:
        """The submodules that own parameters themselves (the leaves, and parents with parameters of their own)."""
        if isinstance(modules, nn.Module):
            return [m for m in modules.modules() if not list(m.children()) or list(m.parameters(recurse=False))]
        return [m for item in modules for m in BaseFinetuning.flatten_modules(item)]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Iterator[nn.Parameter]:
        """The parameters of ``modules`` whose ``requires_grad`` is ``requires_grad`` (batch norms' only if
        ``train_bn``)."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            yield from (p for p in module.parameters(recurse=False) if p.requires_grad == requires_grad)

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Gradients for every parameter of ``modules``; batch norms update their running statistics again."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for parameter in module.parameters(recurse=False):
                parameter.requires_grad_(True)

    @staticmethod
    def freeze_module(module: nn.Module) -> None:
        """No gradients for the module's own parameters; a batch norm also stops updating its statistics."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for parameter in module.parameters(recurse=False):
            parameter.requires_grad_(False)

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``, except their batch norms when ``train_bn``."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters of ``params`` that ``optimizer`` does not hold yet (with a warning if it holds some)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        new = [p for p in params if id(p) not in held]
        if len(new) < len(params):
            rank_zero_warn(
                f"The provided params to be frozen already belong to a group of this {type(optimizer).__name__}: "
                f"{len(params) - len(new)} of them are skipped. Did you init your optimizer in configure_optimizers() "
                "with every parameter? Build it from filter(lambda p: p.requires_grad, self.parameters()), so that "
                "the frozen ones join it when they are unfrozen."
            )
        return new

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: torch.optim.Optimizer,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze ``modules`` and give their parameters a new group of ``optimizer`` with learning rate ``lr``
        (by default the first group's divided by ``initial_denom_lr``)."""
        BaseFinetuning.make_trainable(modules)
        group_lr = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
        params = BaseFinetuning.filter_on_optimizer(optimizer, BaseFinetuning.filter_params(modules, train_bn))
        if params:
            optimizer.add_param_group({"params": params, "lr": group_lr})


def multiplicative(epoch: int) -> float:
    """``BackboneFinetuning``'s default schedule: the backbone's learning rate doubles every epoch."""
    return 2.0


class BackboneFinetuning(BaseFinetuning):
    """Train with ``module.backbone`` frozen until epoch ``unfreeze_backbone_at_epoch``; then train it too, in a
    parameter group of its own whose learning rate starts at ``backbone_initial_lr`` (or the first group's
    times ``backbone_initial_ratio_lr``) and is multiplied by ``lambda_func(epoch + 1)`` at each later epoch,
    never going above the first group's when ``should_align``."""

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), nn.Module):
            raise AttributeError(f"BackboneFinetuning needs {type(pl_module).__name__}.backbone, an nn.Module")
        super().setup(trainer, pl_module, stage)

    def freeze_before_training(self, pl_module: Module) -> None:
        self.freeze(pl_module.backbone)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.previous_backbone_lr = state_dict.get("previous_backbone_lr")

    def finetune_function(self, pl_module: Module, epoch: int, optimizer: torch.optim.Optimizer) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            lr = self.backbone_initial_lr
            self.previous_backbone_lr = current_lr * self.backbone_initial_ratio_lr if lr is None else lr
            self.unfreeze_and_add_param_group(
                pl_module.backbone, optimizer, self.previous_backbone_lr,
                initial_denom_lr=self.initial_denom_lr, train_bn=self.train_bn,
            )  # fmt: skip
        elif epoch > self.unfreeze_backbone_at_epoch and self.previous_backbone_lr is not None:
            next_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            next_lr = current_lr if self.should_align and next_lr > current_lr else next_lr
            optimizer.param_groups[-1]["lr"] = next_lr
            self.previous_backbone_lr = next_lr
        else:
            return
        if self.verbose:
            rank_zero_print(
                f"BackboneFinetuning: lr {round(current_lr, self.rounding)}, backbone lr "
                f"{round(self.previous_backbone_lr, self.rounding)}"
            )
