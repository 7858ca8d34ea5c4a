"""Helpers for the code of a module or callback: rank-zero output, gradient norms, moving data, pickling."""

from __future__ import annotations

import pickle

import torch
from torch import nn

from ember._utils import AttributeDict, move_to_device
from ember.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_print, rank_zero_warn

move_data_to_device = move_to_device  # Lightning's name

__all__ = [
    "AttributeDict",
    "grad_norm",
    "is_picklable",
    "move_data_to_device",
    "rank_zero_debug",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_print",
    "rank_zero_warn",
]


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """The ``norm_type``-norm of each parameter's gradient, as ``grad_<p>_norm/<name>``, and of all of them
    together, as ``grad_<p>_norm_total`` (``<p>`` is ``norm_type`` as a float: "2.0", "inf"). Ready for
    ``self.log_dict``; the values stay on the device."""
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"grad_norm(norm_type={norm_type!r}): expected a positive number or 'inf'")
    norms = {
        f"grad_{p}_norm{group_separator}{name}": parameter.grad.detach().norm(p)
        for name, parameter in module.named_parameters()
        if parameter.grad is not None
    }
    if norms:
        norms[f"grad_{p}_norm_total"] = torch.stack(list(norms.values())).norm(p)
    return norms


def is_picklable(obj: object) -> bool:
    """Whether ``pickle`` can write ``obj`` (what a checkpoint or a spawned process would need)."""
    try:
        pickle.dumps(obj)
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):
        return False
    return True
