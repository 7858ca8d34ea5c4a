"""Helpers for the code of a module or callback: rank-zero output, gradient norms, FLOPs, moving and detaching
data, pickling."""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ember._utils import AttributeDict, apply_to_tensors, batch_size_of, move_to_device
from ember.exceptions import MisconfigurationException
from ember.rank_zero import (
    rank_zero_debug,
    rank_zero_info,
    rank_zero_only,
    rank_zero_print,
    rank_zero_warn,
    rank_zero_warn_once,
)

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

move_data_to_device = move_to_device  # Lightning's name


def get_filesystem(path: str | os.PathLike, **kwargs: Any) -> AbstractFileSystem:
    """The fsspec file system that holds ``path`` (a URL's, ``s3://...``, or the local one for a plain path);
    ``kwargs`` go to it (credentials, ...). Lightning's ``lightning_fabric.utilities.cloud_io.get_filesystem``."""
    import fsspec  # (comes with torch; imported here, as few programs need it)

    return fsspec.core.url_to_fs(os.fspath(path), **kwargs)[0]


__all__ = [
    "AttributeDict",
    "GradClipAlgorithmType",
    "extract_batch_size",
    "get_filesystem",
    "grad_norm",
    "is_picklable",
    "measure_flops",
    "move_data_to_device",
    "rank_zero_debug",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_print",
    "rank_zero_warn",
    "recursive_detach",
]


class GradClipAlgorithmType(str, Enum):
    """The values of ``gradient_clip_algorithm``, as Lightning names them; each is equal to its string."""

    VALUE = "value"
    NORM = "norm"


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """The ``norm_type``-norm of each parameter's gradient, as ``grad_<p>_norm/<name>``, and of all of them
    together, as ``grad_<p>_norm_total`` (``<p>`` is ``norm_type`` as a float: "2.0", "inf"). Ready for
    ``self.log_dict``; the values stay on the device."""
    p = float(norm_type)
    if p <= 0:
        raise ValueError(
            f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {p} "
            f"(grad_norm(norm_type={norm_type!r}))"
        )
    norms = {
        f"grad_{p}_norm{group_separator}{name}": parameter.grad.detach().norm(p)
        for name, parameter in module.named_parameters()
        if parameter.grad is not None
    }
    if norms:
        norms[f"grad_{p}_norm_total"] = torch.stack(list(norms.values())).norm(p)
    return norms


def measure_flops(
    model: nn.Module,
    forward_fn: Callable[[], torch.Tensor],
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """The FLOPs ``forward_fn()`` takes (a forward of ``model``), and with ``loss_fn`` those of the loss of its
    output and its backward too, as ``torch.utils.flop_counter`` counts them.

    Build the model and its input on the meta device, so that nothing is computed or allocated::

        with torch.device("meta"):
            model = MyModel()
            x = torch.randn(2, 32)
        forward_flops = measure_flops(model, lambda: model(x))
        training_flops = measure_flops(model, lambda: model(x), lambda y: y.sum())

    ``model`` is not used to count: it names what is measured, as in Lightning's signature.
    """
    # Imported here: the flop counter pulls in much of torch's tracing machinery, which `import ember` must not pay.
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        if loss_fn is None:
            forward_fn()
        else:
            loss_fn(forward_fn()).backward()
    return int(counter.get_total_flops())


def is_picklable(obj: object) -> bool:
    """Whether ``pickle`` can write ``obj`` (what a checkpoint or a spawned process would need)."""
    try:
        pickle.dumps(obj)
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):
        return False
    return True


def recursive_detach(in_dict: Any, to_cpu: bool = False) -> Any:
    """``in_dict`` with every tensor in it (through nested dicts, lists, tuples and dataclasses) detached from its
    graph, and copied to the CPU with ``to_cpu``; what is not a tensor is kept as it is."""
    return apply_to_tensors(in_dict, lambda tensor: tensor.detach().cpu() if to_cpu else tensor.detach())


def extract_batch_size(batch: Any) -> int:
    """The batch size Lightning's ``extract_batch_size`` infers: the first dimension of the first tensor in
    ``batch`` (1 for a scalar tensor), looking through mappings, iterables and dataclasses in order. Tensors that
    disagree are warned about (once); a batch with no tensor, or too deep to look through, is refused."""
    found = checked_batch_size(batch)
    if found is None:
        raise MisconfigurationException(
            "We could not infer the batch_size from the batch. Either simplify its structure or provide the "
            "batch_size as `self.log(..., batch_size=batch_size)`."
        )
    return found


def logged_batch_size(batch: Any, compare: bool) -> int:
    """The size ``self.log`` weighs a per-epoch mean by: the first tensor's, its disagreement with the others warned
    about (once) as ``extract_batch_size`` does when ``compare`` (each epoch's first batch: a batch's structure seldom
    changes, and comparing every batch would cost each step); 1 for a batch without tensors."""
    return (checked_batch_size(batch) if compare else batch_size_of(batch)) or 1


def checked_batch_size(batch: Any) -> int | None:
    """``extract_batch_size``'s size, warning (once) when ``batch``'s tensors disagree; None when it holds no tensor
    or is too deep to look through."""
    found = None
    try:
        for size in _batch_sizes(batch):
            if found is None:
                found = size
            elif size != found:
                rank_zero_warn_once(  # Lightning's words
                    f"Trying to infer the `batch_size` from an ambiguous collection. The batch size we found is "
                    f"{found}. To avoid any miscalculations, use `self.log(..., batch_size=batch_size)`."
                )
                break
    except RecursionError:
        return None
    return found


def _batch_sizes(batch: Any) -> Iterator[int | None]:
    """The size of each tensor in ``batch``, in order, and None for each value that is neither a tensor nor holds
    any (a string, a number)."""
    if isinstance(batch, torch.Tensor):
        yield batch.size(0) if batch.ndim else 1
    elif isinstance(batch, (Iterable, Mapping)) and not isinstance(batch, str):
        for item in batch.values() if isinstance(batch, Mapping) else batch:
            yield from _batch_sizes(item)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from _batch_sizes(getattr(batch, field.name))
    else:
        yield None
