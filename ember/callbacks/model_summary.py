"""``ModelSummary``: a table of the model's layers and parameter counts, shown when ``fit`` starts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from ember._utils import is_overridden
from ember.callbacks.callback import Callback
from ember.exceptions import MisconfigurationException
from ember.model_summary import ModelSummary as SummaryObject
from ember.model_summary import parameter_counts, summary_table
from ember.rank_zero import announce

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


class ModelSummary(Callback):
    """Show each layer's name, type, parameter count and trainable count, then the totals and their size.

    ``max_depth`` is how deep to list layers: 1 (the default) lists the module's direct children, -1
    every layer; 0 shows nothing, as Lightning's. Logged to the "ember" logger at INFO on the global-zero process;
    ``Trainer(enable_model_summary=False)`` turns it off. Sharded parameters (DTensors, as FSDP2 makes them)
    count with their full size. A module with an ``example_input_array`` gets Lightning's table instead (modes,
    FLOPs, each layer's input and output sizes), and so does a subclass that overrides ``summarize`` (Lightning's
    hook), given Lightning's columns and totals with the ``summarize_kwargs`` given to ``__init__``.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise MisconfigurationException(
                f"ModelSummary(max_depth={max_depth!r}): expected -1 (every layer), 0 or a positive int"
            )
        self.max_depth = max_depth
        #: What a subclass's ``summarize`` gets besides the summary, as in Lightning.
        self.summarize_kwargs = summarize_kwargs

    def on_fit_start(self, trainer: Trainer, pl_module: Module) -> None:
        if not self.max_depth:  # as Lightning's: depth 0 turns the summary off
            return
        # Ember's shorter table runs nothing; a module with an example_input_array asks for each layer's sizes, and a
        # subclass that overrides summarize for Lightning's columns: both run the example once, as Lightning's does.
        if pl_module.example_input_array is None and not is_overridden("summarize", self, ModelSummary):
            announce(summarize(pl_module, self.max_depth), "callbacks.model_summary")
            return
        summary = SummaryObject(pl_module, self.max_depth)
        if trainer.is_global_zero:
            self.summarize(
                summary.summary_data, summary.total_parameters, summary.trainable_parameters, summary.model_size,
                summary.total_training_modes, total_flops=summary.total_flops, **self.summarize_kwargs,
            )  # fmt: skip

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        """Show a summary in Lightning's table (Lightning's hook, for a subclass to override, or to call): the
        columns as (header, cells) pairs, as ``ember.model_summary.ModelSummary.summary_data`` gives them, and the
        totals. The callback calls it when a subclass overrides it or the module has an ``example_input_array``, and
        otherwise shows Ember's shorter table."""
        table = summary_table(
            summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
        )
        announce(table, "callbacks.model_summary")


def summarize(model: nn.Module, max_depth: int = 1) -> str:
    """The summary table of ``model`` as text (what ``ModelSummary`` prints)."""
    rows = [
        (name, type(layer).__name__, *parameter_counts(layer.parameters()))
        for name, layer in model.named_modules()
        if name and (max_depth == -1 or name.count(".") < max_depth)
    ]
    trainable, total, size = parameter_counts(model.parameters())
    headers = ("Name", "Type", "Params", "Trainable")
    table = [headers] + [(name, kind, _readable(count), _readable(train)) for name, kind, train, count, _ in rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(headers))]
    index_width = len(str(len(rows)))

    def line(index: str, cells: tuple[str, ...]) -> str:
        text = f"{index:<{index_width}} | " + " | ".join(f"{cell:<{width}}" for cell, width in zip(cells, widths))
        return text.rstrip()

    rule = "-" * len(line("", headers))  # "Trainable" is the widest cell of the last column
    lines = [line("", headers), rule, *(line(str(i), cells) for i, cells in enumerate(table[1:])), rule] if rows else []
    lines += [
        f"{_readable(trainable):<10}Trainable params",
        f"{_readable(total - trainable):<10}Non-trainable params",
        f"{_readable(total):<10}Total params",
        f"{size / 1e6:<10.3f}Total estimated model params size (MB)",
    ]
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        lines.append("(lazy layers whose parameters are not initialized yet count as 0)")
    return "\n".join(lines)


def _readable(count: int) -> str:
    """1234 -> "1.2 K", 5600000 -> "5.6 M" (the format Lightning prints)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return str(count)
