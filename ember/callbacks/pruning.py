"""``ModelPruning``: prune weights with ``torch.nn.utils.prune`` at the end of training (or validation) epochs."""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.utils import prune

from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException
from ember.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer

log = logging.getLogger(__name__)

_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "ln_structured": prune.ln_structured,
    "l1_unstructured": prune.l1_unstructured,
    "random_structured": prune.random_structured,
    "random_unstructured": prune.random_unstructured,
}
# The same methods as classes, which prune.global_unstructured takes.
_METHODS: dict[str, type[prune.BasePruningMethod]] = {
    "ln_structured": prune.LnStructured,
    "l1_unstructured": prune.L1Unstructured,
    "random_structured": prune.RandomStructured,
    "random_unstructured": prune.RandomUnstructured,
}
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

Amount = int | float
EpochFlag = bool | Callable[[int], bool]
ParameterList = Sequence[tuple[nn.Module, str]]


class ModelPruning(Callback):
    """Prune parameters with ``torch.nn.utils.prune`` as training goes, as Lightning's ``ModelPruning``.

    ``pruning_fn`` is "l1_unstructured", "random_unstructured", "ln_structured" (with ``pruning_dim`` and
    ``pruning_norm``), "random_structured" (with ``pruning_dim``), or a ``prune.BasePruningMethod`` subclass (with
    ``use_global_unstructured=True``). ``parameters_to_prune`` is a list of ``(module, name)`` pairs; left empty,
    it is every ``parameter_names`` ("weight" and "bias") parameter of the model's layers (containers aside).
    ``amount`` (a fraction, a count, or a function of the epoch) is pruned at the end of each training epoch
    (of each validation with ``prune_on_train_epoch_end=False``) where ``apply_pruning`` (a bool or a function of
    the epoch) says so; ``use_lottery_ticket_hypothesis`` then resets the unpruned weights to their values when
    training began (to fresh ones with ``resample_parameters``). With ``make_pruning_permanent`` checkpoints hold
    the pruned weights under their own names, and the masks are folded in when training ends. ``verbose=1`` logs
    the overall sparsity after each pruning, ``2`` each parameter's too.
    """

    PARAMETER_NAMES = ("weight", "bias")

    def __init__(
        self,
        pruning_fn: Callable[..., Any] | str,
        parameters_to_prune: ParameterList | None = (),
        parameter_names: list[str] | None = None,
        use_global_unstructured: bool = True,
        amount: Amount | Callable[[int], Amount] = 0.5,
        apply_pruning: EpochFlag = True,
        make_pruning_permanent: bool = True,
        use_lottery_ticket_hypothesis: EpochFlag = True,
        resample_parameters: bool = False,
        pruning_dim: int | None = None,
        pruning_norm: int | None = None,
        verbose: int = 0,
        prune_on_train_epoch_end: bool = True,
    ) -> None:
        self._parameter_names = parameter_names or self.PARAMETER_NAMES
        for name in self._parameter_names:
            if name not in self.PARAMETER_NAMES:
                raise MisconfigurationException(
                    f"The provided `parameter_names` name: {name} isn't in {self.PARAMETER_NAMES}"
                )
        self._use_global_unstructured = use_global_unstructured
        self._global_kwargs: dict[str, Any] = {}
        self._method_name: str | None = None
        self.pruning_fn = self._resolve(pruning_fn, pruning_dim, pruning_norm)
        if use_global_unstructured and getattr(self.pruning_fn, "PRUNING_TYPE", None) != "unstructured":
            raise MisconfigurationException(
                'Only the "unstructured" PRUNING_TYPE is supported with `use_global_unstructured=True`.'
                f" Found method {self.pruning_fn} of type {getattr(self.pruning_fn, 'PRUNING_TYPE', None)}. "
            )
        if not (isinstance(amount, int | float) or callable(amount)):
            raise MisconfigurationException(
                "`amount` should be provided and be either an int, a float or Callable function."
            )
        if verbose not in (0, 1, 2):
            raise MisconfigurationException("`verbose` must be any of (0, 1, 2)")
        self.amount = amount
        self._parameters_to_prune: ParameterList = parameters_to_prune or ()
        self._apply_pruning = apply_pruning
        self._make_pruning_permanent = make_pruning_permanent
        self._use_lottery_ticket_hypothesis = use_lottery_ticket_hypothesis
        self._resample_parameters = resample_parameters
        self._verbose = verbose
        self._prune_on_train_epoch_end = prune_on_train_epoch_end
        # id of a pruned layer -> a copy of it as training began, and which of its parameters are pruned
        self._original_layers: dict[int, tuple[nn.Module, list[tuple[int, str]]]] = {}

    def _resolve(self, pruning_fn: Callable[..., Any] | str, dim: int | None, norm: int | None) -> Any:
        """The function (or, for global pruning, the method class) that ``pruning_fn`` names."""
        if inspect.isclass(pruning_fn) and issubclass(pruning_fn, prune.BasePruningMethod):
            if not self._use_global_unstructured:
                raise MisconfigurationException(
                    "PyTorch `BasePruningMethod` is currently only supported with `use_global_unstructured=True`."
                )
            return pruning_fn
        if not isinstance(pruning_fn, str):
            raise MisconfigurationException(
                f"`pruning_fn` is expected to be a str in {list(_FUNCTIONS)} or a PyTorch `BasePruningMethod`. "
                f"Found: {pruning_fn}. HINT: if passing a `BasePruningMethod`, pass the class, not an instance"
            )
        name = pruning_fn.lower()
        if name not in _FUNCTIONS:
            raise MisconfigurationException(
                f"The provided `pruning_fn` {name} isn't available in PyTorch's built-in functions: {list(_FUNCTIONS)} "
            )
        kwargs: dict[str, int] = {}
        if name.endswith("_structured"):
            if dim is None:
                raise MisconfigurationException(
                    "When requesting `structured` pruning, the `pruning_dim` should be provided."
                )
            if name == "ln_structured":
                if norm is None:
                    raise MisconfigurationException(
                        "When requesting `ln_structured` pruning, the `pruning_norm` should be provided."
                    )
                kwargs["n"] = norm
            kwargs["dim"] = dim
        if self._use_global_unstructured:
            self._method_name = _METHODS[name].__name__
            self._global_kwargs = kwargs
            return _METHODS[name]
        self._method_name = _FUNCTIONS[name].__name__
        return partial(_FUNCTIONS[name], **kwargs)

    def filter_parameters_to_prune(self, parameters_to_prune: ParameterList = ()) -> ParameterList:
        """Override to choose, from the ``(module, name)`` pairs found, those to prune."""
        return parameters_to_prune

    @staticmethod
    def sanitize_parameters_to_prune(
        pl_module: nn.Module, parameters_to_prune: ParameterList = (), parameter_names: Sequence[str] = ()
    ) -> ParameterList:
        """``parameters_to_prune`` checked against ``pl_module``; when empty, every ``parameter_names`` parameter of
        its layers."""
        names = parameter_names or ModelPruning.PARAMETER_NAMES
        layers = [module for module in pl_module.modules() if not _is_container(module, pl_module)]
        if not parameters_to_prune:
            return [
                (module, name)
                for name in names
                for module in layers
                if isinstance(getattr(module, name, None), nn.Parameter)
            ]
        if not _are_pairs(parameters_to_prune):
            raise MisconfigurationException(
                "The provided `parameters_to_prune` should either be list of tuple"
                " with 2 elements: (nn.Module, parameter_name_to_prune) or None"
            )
        missing_modules = [module for module, _ in parameters_to_prune if module not in layers]
        missing_parameters = [
            name for module, name in parameters_to_prune if module in layers and not hasattr(module, name)
        ]
        if missing_modules or missing_parameters:
            raise MisconfigurationException(
                "Some provided `parameters_to_prune` don't exist in the model."
                f" Found missing modules: {missing_modules} and missing parameters: {missing_parameters}"
            )
        return parameters_to_prune

    def setup(self, trainer: Trainer, pl_module: Module, stage: str) -> None:
        found = self.sanitize_parameters_to_prune(pl_module, self._parameters_to_prune, self._parameter_names)
        self._parameters_to_prune = self.filter_parameters_to_prune(found)
        self._original_layers = {}
        if self._use_lottery_ticket_hypothesis:
            for index, (module, name) in enumerate(self._parameters_to_prune):
                entry = self._original_layers.setdefault(id(module), (copy.deepcopy(module), []))
                entry[1].append((index, name))

    def make_pruning_permanent(self, module: nn.Module) -> None:
        """Fold the masks into the parameters of every pruned layer of ``module`` and drop the pruning hooks."""
        for layer in module.modules():
            for key, hook in list(layer._forward_pre_hooks.items()):
                if isinstance(hook, prune.BasePruningMethod):
                    hook.remove(layer)
                    del layer._forward_pre_hooks[key]

    def apply_lottery_ticket_hypothesis(self) -> None:
        """Reset the unpruned weights to their values when training began (fresh values with
        ``resample_parameters``), keeping the masks: the "winning ticket" of the lottery ticket hypothesis."""
        for original, names in self._original_layers.values():
            source = original
            if self._resample_parameters and callable(getattr(original, "reset_parameters", None)):
                source = copy.deepcopy(original)  # the original values stay for the next reset
                cast(Callable[[], None], source.reset_parameters)()
            for index, name in names:
                layer = self._parameters_to_prune[index][0]
                _copy_parameter(layer, source, name)

    def apply_pruning(self, amount: Amount) -> None:
        """Prune ``amount`` of ``parameters_to_prune`` (together, or each by itself)."""
        before = self._sparsity() if self._verbose else []
        if self._use_global_unstructured:
            kwargs = {**self._global_kwargs, "amount": amount}
            accepted = set(inspect.signature(self.pruning_fn).parameters) - {"self"}
            kwargs = {key: value for key, value in kwargs.items() if key in accepted}
            prune.global_unstructured(self._parameters_to_prune, pruning_method=self.pruning_fn, **kwargs)
        else:
            for module, name in self._parameters_to_prune:
                self.pruning_fn(module, name=name, amount=amount)
        if self._verbose:
            self._log_sparsity(before, self._sparsity(), amount)

    def _sparsity(self) -> list[tuple[int, int]]:
        """(pruned, total) of each parameter's mask; (0, 1) for one not pruned yet."""
        counts = []
        for module, name in self._parameters_to_prune:
            mask = getattr(module, f"{name}_mask", None)
            counts.append((int((mask == 0).sum().item()), mask.numel()) if mask is not None else (0, 1))
        return counts

    @rank_zero_only
    def _log_sparsity(self, before: list[tuple[int, int]], after: list[tuple[int, int]], amount: Amount) -> None:
        total = sum(size for _, size in after)
        was, now = sum(zeros for zeros, _ in before), sum(zeros for zeros, _ in after)
        log.info(
            f"Applied `{self._method_name}`. Pruned: {was}/{total} ({was / total:.2%})"
            f" -> {now}/{total} ({now / total:.2%})"
        )
        if self._verbose != 2:
            return
        for (module, name), (was, was_size), (now, size) in zip(self._parameters_to_prune, before, after, strict=True):
            log.info(
                f"Applied `{self._method_name}` to `{module!r}.{name}` with amount={amount}. Pruned:"
                f" {was} ({was / was_size:.2%}) -> {now} ({now / size:.2%})"
            )

    def _run_pruning(self, epoch: int) -> None:
        enabled = self._apply_pruning(epoch) if callable(self._apply_pruning) else self._apply_pruning
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        if not enabled or not amount:
            return
        self.apply_pruning(amount)
        lottery = self._use_lottery_ticket_hypothesis
        if lottery(epoch) if callable(lottery) else lottery:
            self.apply_lottery_ticket_hypothesis()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self._prune_on_train_epoch_end:
            self._run_pruning(pl_module.current_epoch)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: Module) -> None:
        if not self._prune_on_train_epoch_end and not trainer.sanity_checking:
            self._run_pruning(pl_module.current_epoch)

    def on_train_end(self, trainer: Trainer, pl_module: Module) -> None:
        if self._make_pruning_permanent:
            self.make_pruning_permanent(pl_module)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: Module, checkpoint: dict[str, Any]) -> None:
        # The checkpoint holds the pruned weights under their own names, while training goes on with its masks.
        if self._make_pruning_permanent:
            checkpoint["state_dict"] = _fold_masks(checkpoint["state_dict"])


def _is_container(module: nn.Module, root: nn.Module) -> bool:
    """Whether ``module`` only holds other layers: a container, the model itself or a model nested in it (which has
    a ``training_step``: ``ember.module`` cannot be imported here without a cycle)."""
    return module is root or isinstance(module, _CONTAINERS) or callable(getattr(module, "training_step", None))


def _are_pairs(parameters: Any) -> bool:
    return isinstance(parameters, list | tuple) and all(
        isinstance(pair, list | tuple)
        and len(pair) == 2
        and isinstance(pair[0], nn.Module)
        and isinstance(pair[1], str)
        for pair in parameters
    )


def _copy_parameter(layer: nn.Module, source: nn.Module, name: str) -> None:
    """Give ``layer``'s parameter ``name`` (its unpruned values, once pruned) ``source``'s values."""
    target = getattr(layer, f"{name}_orig", None)
    if target is None:
        target = getattr(layer, name, None)
    values = getattr(source, name, None)
    if isinstance(target, torch.Tensor) and isinstance(values, torch.Tensor):
        target.data = values.data.to(target.device)


def _fold_masks(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a state_dict, as the strategy gathered it) with each pruned tensor as its mask times its original
    values, under its own name."""
    state = dict(state)
    for key in [key.removesuffix("_mask") for key in state if key.endswith("_mask")]:
        original, mask = state.pop(f"{key}_orig"), state.pop(f"{key}_mask")
        state[key] = mask.to(original.dtype) * original
    return state
