"""A model's summary as an object (Lightning's ``utilities.model_summary``): its layers, their parameter counts and
modes and, when the model has an ``example_input_array``, their input and output sizes and FLOPs; ``str()`` gives
Lightning's table. The ``ModelSummary`` callback prints Ember's shorter table when ``fit`` starts."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ember._utils import move_to_device
from ember.rank_zero import rank_zero_warn_once

#: A size that no forward pass measured (the layer did not run, or the model has no example input).
UNKNOWN_SIZE = "?"
NOT_APPLICABLE = "n/a"
LEFTOVER_PARAMS_NAME = "other params"  # the row of the parameters that belong to no submodule
_UNITS = (" ", "K", "M", "B", "T")
# Bits per parameter of the Trainer's precision; another precision counts as 32 bits, as in Lightning.
_PRECISION_BITS = {"64": 64, "64-true": 64, "32": 32, "32-true": 32, "16": 16, "16-true": 16, "bf16": 16,
                   "bf16-true": 16}  # fmt: skip


def readable_count(number: float) -> str:
    """``number`` with its thousands as K, M, B or T (Lightning's ``get_human_readable_count``): 123 -> "123  ",
    1234 -> "1.2 K", 4e14 -> "400 T"."""
    digits = int(math.floor(math.log10(number)) + 1) if number > 0 else 1
    group = min(math.ceil(digits / 3), len(_UNITS)) - 1
    scaled = number / 1000**group
    if group == 0 or scaled >= 100:
        return f"{int(scaled):,d} {_UNITS[group]}"
    return f"{scaled:,.1f} {_UNITS[group]}"


def batch_shape(value: Any) -> list[Any] | str:
    """The shape of a tensor as a list, of a list or tuple of them as a list of those ("?" for anything else)."""
    if hasattr(value, "shape"):
        return list(value.shape)
    if isinstance(value, (list, tuple)):
        return [batch_shape(item) for item in value]
    return UNKNOWN_SIZE


def parameter_counts(parameters: Iterable[nn.Parameter]) -> tuple[int, int, int]:
    """(trainable, total, bytes) of ``parameters``; a lazy layer's, whose shape is not known yet, count as 0, and a
    DTensor's numel() is that of the whole, unsharded tensor."""
    trainable = total = size = 0
    for parameter in parameters:
        if isinstance(parameter, nn.parameter.UninitializedParameter):
            continue
        count = parameter.numel()
        total += count
        size += count * parameter.element_size()
        if parameter.requires_grad:
            trainable += count
    return trainable, total, size


class LayerSummary:
    """One layer of a ``ModelSummary``: its type, parameter count and mode, and the sizes of the first input and
    output a forward pass gave it (``in_size``/``out_size``, "?" until then)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._in_size: list[Any] | str = UNKNOWN_SIZE
        self._out_size: list[Any] | str = UNKNOWN_SIZE
        self._handle: Any = None
        if not isinstance(module, torch.jit.ScriptModule):  # scripted modules take no hooks
            self._handle = module.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        inputs = (*args, *kwargs.values())
        self._in_size = batch_shape(inputs[0] if len(inputs) == 1 else inputs)
        self._out_size = batch_shape(output)
        self.detach_hook()  # the first call only: a layer used twice keeps its first sizes

    def detach_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # An empty size (no input, a 0-dimensional tensor) says nothing: "?", as in Lightning.
    @property
    def in_size(self) -> list[Any] | str:
        return self._in_size or UNKNOWN_SIZE

    @property
    def out_size(self) -> list[Any] | str:
        return self._out_size or UNKNOWN_SIZE

    @property
    def layer_type(self) -> str:
        return type(self._module).__name__

    @property
    def num_parameters(self) -> int:
        return parameter_counts(self._module.parameters())[1]

    @property
    def training(self) -> bool:
        return self._module.training


class ModelSummary:
    """The layers of ``model`` down to ``max_depth`` (1: its children, -1: every layer, 0: none), measured when it is
    made: with an ``example_input_array``, the model runs it once (in eval mode, without gradients) to record each
    layer's sizes and FLOPs."""

    def __init__(self, model: nn.Module, max_depth: int = 1) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"`max_depth` can be -1, 0 or > 0, got {max_depth}.")
        self._model = model
        self._max_depth = max_depth
        self._flops: dict[str, dict[Any, int]] = {}
        self._total_flops = 0
        self._layers = self._measure()
        trainer = getattr(model, "_trainer", None)
        bits = _PRECISION_BITS.get(str(trainer.precision), 32) if trainer is not None else 32
        self._megabytes_per_parameter = bits / 8 * 1e-6

    @property
    def max_depth(self) -> int:
        return self._max_depth

    @property
    def named_modules(self) -> list[tuple[str, nn.Module]]:
        """The layers listed: none at depth 0, the children at 1, every module below the root deeper."""
        if self._max_depth == 0:
            return []
        if self._max_depth == 1:
            return list(self._model.named_children())
        return list(self._model.named_modules())[1:]

    def _measure(self) -> dict[str, LayerSummary]:
        layers = {name: LayerSummary(module) for name, module in self.named_modules}
        if getattr(self._model, "example_input_array", None) is not None:
            self._run_example()
        for layer in layers.values():
            layer.detach_hook()
        deep = self._max_depth  # named_modules lists every depth past 1: cut at max_depth
        return {name: layer for name, layer in layers.items() if deep < 1 or name.count(".") < deep}

    def _run_example(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        model = self._model
        device = next(model.parameters(), torch.empty(0)).device
        example = move_to_device(model.example_input_array, device)
        modes = {module: module.training for module in model.modules()}
        counter = FlopCounterMode(display=False)
        model.eval()
        try:
            with torch.no_grad(), counter:
                if isinstance(example, (list, tuple)):
                    model(*example)
                elif isinstance(example, dict):
                    model(**example)
                else:
                    model(example)
        finally:
            for module, training in modes.items():
                module.training = training
        root = f"{type(model).__name__}."  # the counter names each module after the root's class
        self._flops = {name.removeprefix(root): dict(counts) for name, counts in counter.get_flop_counts().items()}
        self._total_flops = counter.get_total_flops()

    @property
    def layer_names(self) -> list[str]:
        return list(self._layers)

    @property
    def layer_types(self) -> list[str]:
        return [layer.layer_type for layer in self._layers.values()]

    @property
    def in_sizes(self) -> list[Any]:
        return [layer.in_size for layer in self._layers.values()]

    @property
    def out_sizes(self) -> list[Any]:
        return [layer.out_size for layer in self._layers.values()]

    @property
    def param_nums(self) -> list[int]:
        return [layer.num_parameters for layer in self._layers.values()]

    @property
    def training_modes(self) -> list[bool]:
        return [layer.training for layer in self._layers.values()]

    @property
    def total_training_modes(self) -> dict[str, int]:
        """How many modules below the root are in train and in eval mode."""
        modes = [module.training for module in self._model.modules()][1:]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_parameters(self) -> int:
        return self._counts()[1]

    @property
    def trainable_parameters(self) -> int:
        return self._counts()[0]

    def summarize(self) -> dict[str, LayerSummary]:
        """Each layer listed, by name (measured when the summary was made)."""
        return dict(self._layers)

    def _counts(self) -> tuple[int, int, int]:
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in self._model.parameters()):
            rank_zero_warn_once(  # Lightning's words
                "The total number of parameters detected may be inaccurate because the model contains an instance of "
                "`UninitializedParameter`. To get an accurate number, set `self.example_input_array` in your "
                "LightningModule."
            )
        return parameter_counts(self._model.parameters())

    @property
    def total_layer_params(self) -> int:
        return sum(self.param_nums)

    @property
    def model_size(self) -> float:
        """The parameters' size in MB at the Trainer's precision (32 bits without a Trainer)."""
        return self.total_parameters * self._megabytes_per_parameter

    @property
    def total_flops(self) -> int:
        return self._total_flops

    @property
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        """The FLOPs of each layer listed in the example's forward pass, by operator (none for a layer it did not
        run)."""
        return {name: self._flops.get(name, {}) for name in self._layers}

    @property
    def summary_data(self) -> list[tuple[str, list[str]]]:
        """The table's columns, as (header, cells) pairs: what ``str()`` shows, and what a ``ModelSummary``
        callback's ``summarize`` gets."""
        columns = [
            (" ", [str(index) for index in range(len(self._layers))]),
            ("Name", self.layer_names),
            ("Type", self.layer_types),
            ("Params", [readable_count(count) for count in self.param_nums]),
            ("Mode", ["train" if training else "eval" for training in self.training_modes]),
            ("FLOPs", [readable_count(sum(counts.values())) for counts in self.flop_counts.values()]),
        ]
        if getattr(self._model, "example_input_array", None) is not None:
            columns += [("In sizes", [str(size) for size in self.in_sizes]),
                        ("Out sizes", [str(size) for size in self.out_sizes])]  # fmt: skip
        leftover = self.total_parameters - self.total_layer_params
        if leftover > 0:  # parameters of the root itself, or of the layers below max_depth's
            row = {" ": " ", "Name": LEFTOVER_PARAMS_NAME, "Params": readable_count(leftover)}
            for header, cells in columns:
                cells.append(row.get(header, NOT_APPLICABLE))
        return columns

    def __str__(self) -> str:
        return summary_table(
            self.summary_data, self.total_parameters, self.trainable_parameters, self.model_size,
            self.total_training_modes, self.total_flops,
        )  # fmt: skip

    def __repr__(self) -> str:
        return str(self)


def summary_table(
    summary_data: list[tuple[str, list[str]]],
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    total_flops: int,
) -> str:
    """Lightning's summary table: the columns (header, cells), then the totals."""
    widths = [max([len(header), *(len(cell) for cell in cells)]) for header, cells in summary_data]
    rule = "-" * (sum(widths) + 3 * (len(summary_data) + 1))
    rows = [[header for header, _ in summary_data], *zip(*(cells for _, cells in summary_data))]
    lines = [" | ".join(f"{cell:<{width}}" for cell, width in zip(row, widths)) for row in rows]
    totals = [
        (readable_count(trainable_parameters), "Trainable params"),
        (readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
        (readable_count(total_parameters), "Total params"),
        (f"{model_size:,.3f}", "Total estimated model params size (MB)"),
        (str(total_training_modes["train"]), "Modules in train mode"),
        (str(total_training_modes["eval"]), "Modules in eval mode"),
        (readable_count(total_flops), "Total Flops"),
    ]
    return "\n".join([lines[0], rule, *lines[1:], rule, *(f"{value:<10}{label}" for value, label in totals)])


def summarize(model: nn.Module, max_depth: int = 1) -> ModelSummary:
    """The ``ModelSummary`` of ``model`` (Lightning's ``summarize``)."""
    return ModelSummary(model, max_depth=max_depth)
