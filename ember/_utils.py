"""Small helpers shared across the package."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import operator
import os
import re
from collections.abc import Callable, Hashable, Iterator, Mapping
from datetime import timedelta
from typing import Any, Generic, TypeVar, overload

import torch

from ember.exceptions import MisconfigurationException


class AttributeDict(dict):
    """A ``dict`` whose keys are also attributes: ``hparams.lr`` reads ``hparams["lr"]``."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as err:  # Python's own words, as Lightning's AttributeDict gives them
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}") from err

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError as err:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}") from err

    def __repr__(self) -> str:
        """One ``"name": value`` line per key, sorted and aligned (empty when there are none), as Lightning prints
        ``hparams``."""
        width = max((len(str(key)) for key in self), default=0) + 3
        names = {key: f'"{key}":' for key in self}
        return "\n".join(f"{names[key]:<{width}} {self[key]}" for key in sorted(self, key=str))


T = TypeVar("T")
Key = TypeVar("Key", bound=Hashable)

#: How many graph traces are under way (``tracing_graph``).
graph_traces = 0


@contextlib.contextmanager
def tracing_graph() -> Iterator[None]:
    """While a logger traces a module's graph: ``torch.jit.trace`` reads every attribute of the modules it traces,
    and an ``ember.Module`` that no Trainer holds then reads its ``trainer`` as None instead of refusing."""
    global graph_traces
    graph_traces += 1
    try:
        yield
    finally:
        graph_traces -= 1


class Reads(Generic[T]):
    """A read-only attribute that reads ``path`` (dotted attributes) of its instance: a class that forwards what its
    parts own writes ``world_size: Reads[int] = Reads("strategy.world_size")`` instead of a property each.
    ``shown`` turns the value read into the one the attribute gives (the same value in another convention)."""

    def __init__(self, path: str, shown: Callable[[Any], T] | None = None) -> None:
        self.path = path
        read = operator.attrgetter(path)
        self._read = read if shown is None else lambda instance: shown(read(instance))
        self._name = path
        self.__doc__ = f"``{path}``"

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = f"{owner.__name__}.{name}"

    @overload
    def __get__(self, instance: None, owner: type) -> Reads[T]: ...
    @overload
    def __get__(self, instance: object, owner: type) -> T: ...
    def __get__(self, instance: object | None, owner: type) -> Reads[T] | T:
        return self if instance is None else self._read(instance)

    def __set__(self, instance: object, value: Any) -> None:
        raise AttributeError(f"{self._name} is read-only (it reads {self.path})")


def apply_to_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply ``fn`` to every tensor in nested lists, tuples, named tuples, dicts and dataclasses."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        items = [apply_to_tensors(item, fn) for item in data]
        if hasattr(data, "_fields"):  # named tuple
            return type(data)(*items)
        return type(data)(items)
    if isinstance(data, Mapping):
        return type(data)({key: apply_to_tensors(value, fn) for key, value in data.items()})  # type: ignore[call-arg]
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        changes = {
            field.name: apply_to_tensors(getattr(data, field.name), fn)
            for field in dataclasses.fields(data)
            if field.init
        }
        return dataclasses.replace(data, **changes)
    return data


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move a batch to ``device`` without blocking the host (pinned source memory makes it asynchronous).

    Objects that are not containers but have a ``to(device)`` method (for example a tokenizer's
    ``BatchEncoding``) are moved with it.
    """
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):  # the common case, kept free of the generic walk
        if type(batch) in (list, tuple):
            return type(batch)(move_to_device(item, device) for item in batch)
        return apply_to_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True))
    if isinstance(batch, Mapping) or dataclasses.is_dataclass(batch):
        return apply_to_tensors(batch, lambda tensor: tensor.to(device, non_blocking=True))
    to = getattr(batch, "to", None)
    if callable(to):
        return to(device)
    return batch


def split_batch(batch: Any, pieces: int) -> list[Any]:
    """``batch`` cut into at most ``pieces`` parts along the first dimension of every tensor in it."""
    size = batch_size_of(batch)
    pieces = max(1, min(pieces, size))
    return [apply_to_tensors(batch, functools.partial(_piece, pieces=pieces, index=i)) for i in range(pieces)]


def _piece(tensor: torch.Tensor, pieces: int, index: int) -> torch.Tensor:
    return torch.tensor_split(tensor, pieces)[index]


def batch_size_of(batch: Any) -> int:
    """The size of the first dimension of the first tensor found in ``batch`` (1 if there is none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, (list, tuple)):  # the common case, tested before the slower Mapping test
        items: Any = batch
    elif isinstance(batch, Mapping):
        items = list(batch.values())
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        items = [getattr(batch, field.name) for field in dataclasses.fields(batch)]
    else:
        return 1
    for item in items:
        size = batch_size_of(item)
        if size != 1 or isinstance(item, torch.Tensor):
            return size
    return 1


TensorOrNone = TypeVar("TensorOrNone", torch.Tensor, torch.Tensor | None)


def local_shard(tensor: TensorOrNone) -> TensorOrNone:
    """This rank's shard of a DTensor (a sharded parameter or gradient), or ``tensor`` itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def sized_len(iterable: object) -> int | None:
    """``len(iterable)``, or None when it has no length: no ``__len__``, or one that raises ``TypeError`` or
    ``NotImplementedError`` (as a DataLoader of an ``IterableDataset`` without a length does)."""
    try:
        return len(iterable)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def is_overridden(name: str, instance: object, base: type) -> bool:
    """Whether ``instance`` (its class, or the instance itself) defines ``name`` differently from ``base``."""
    if name in getattr(instance, "__dict__", {}):
        return True
    # Read through the instance, so that an object that stands in for a subclass (a mock with spec=Callback,
    # whose attributes are its own) counts as overriding what it has.
    own = getattr(instance, name, None)
    return own is not None and getattr(own, "__func__", own) is not getattr(base, name, None)


def replaces(name: str, instance: object, base: type) -> bool:
    """Whether ``instance``'s ``name`` does other than ``base``'s, looking through wrappers of the base's own
    method (``functools.partial``, ``functools.wraps``), which still run what the base does.

    Whether a stage runs a step or reads a loader, and which owner's transfer hooks move the batches (the
    datamodule's over the module's), is decided by this, as Lightning does: a recording or timing wrapper does
    not make its owner the one in charge, and None (``model.validation_step = None``) switches the hook off.
    ``is_overridden``, which only spares calling what does nothing, counts a wrapper as work."""
    own = getattr(instance, name, None)
    while own is not None:
        # ``__wrapped__`` first: a partial of a recording function, made to look like the method it wraps
        # (``update_wrapper``), stands for that method.
        if (inner := getattr(own, "__wrapped__", None)) is not None:
            own = inner
        elif isinstance(own, functools.partial):
            own = own.func
        else:
            break
    return own is not None and getattr(own, "__func__", own) is not getattr(base, name, None)


def lowered(value: Any) -> Any:
    """``value`` in lower case when it is a string (a flag's name Lightning reads in any case), else as given."""
    return value.lower() if isinstance(value, str) else value


def local_path(path: str | os.PathLike[str]) -> str:
    """``path`` with ``~`` expanded and normalised, as Lightning reads ``default_root_dir``; a URL (``s3://...``)
    is left as given, since it names no local file."""
    path = os.fspath(path)
    return path if "://" in path else os.path.normpath(os.path.expanduser(path))


_TIME_PATTERN = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def parse_max_time(value: str | timedelta | Mapping[str, int] | None, flag: str = "max_time") -> float | None:
    """``max_time`` (or the duration named ``flag``) as seconds: "DD:HH:MM:SS", a ``timedelta`` or a dict
    of ``timedelta`` arguments."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, Mapping):
        try:
            seconds = timedelta(**value).total_seconds()
        except TypeError as err:
            raise MisconfigurationException(
                f"{flag}={dict(value)!r}: a dict takes timedelta's keys (days, hours, minutes, seconds)"
            ) from err
    elif isinstance(value, str) and (match := _TIME_PATTERN.match(value.strip())):
        days, hours, minutes, secs = (int(part) for part in match.groups())
        seconds = timedelta(days=days, hours=hours, minutes=minutes, seconds=secs).total_seconds()
    else:
        raise MisconfigurationException(
            f"{flag}={value!r}: expected 'DD:HH:MM:SS', a datetime.timedelta or a dict such as {{'hours': 2}} (a "
            "string has the format DD:HH:MM:SS, days included: '00:06:00:00' is six hours)"
        )
    if seconds < 0:
        raise MisconfigurationException(f"{flag}={value!r}: the time limit must not be negative")
    return seconds  # 0: training stops before its first step, as Lightning's does


def require(package: str, extra: str, needed_by: str) -> None:
    """Import ``package``, or raise an error that says how to install it (``pip install 'ember[extra]'``)."""
    try:
        importlib.import_module(package)
    except ImportError:
        raise ModuleNotFoundError(
            f"{needed_by} needs the {package} package: pip install 'ember[{extra}]' (or pip install {package})"
        ) from None


def takes_batch_idx(step: Callable[..., Any]) -> bool:
    """Whether a step accepts ``batch_idx`` after the batch (Lightning lets a step leave it out)."""
    parameters = inspect.signature(step).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL or p.name == "batch_idx" for p in parameters)


def to_floats(values: Mapping[Key, torch.Tensor | float]) -> dict[Key, float]:
    """Python floats for ``values``, with one host-device transfer per device instead of one per value."""
    floats = {name: float(value) for name, value in values.items() if not isinstance(value, torch.Tensor)}
    tensors = {name: value for name, value in values.items() if isinstance(value, torch.Tensor)}
    by_device: dict[torch.device, list[Key]] = {}
    for name, tensor in tensors.items():
        by_device.setdefault(tensor.device, []).append(name)
    for names in by_device.values():
        if len(names) == 1:  # the usual case (the loss alone): read as it is, without stacking
            floats[names[0]] = float(tensors[names[0]].item())
            continue
        stacked = torch.stack([tensors[name].detach().float().reshape(()) for name in names])
        floats.update(zip(names, stacked.tolist()))
    return {name: floats[name] for name in values}


# What an allocator says when it raises a plain RuntimeError rather than torch.OutOfMemoryError (the CPU's does), and
# cuDNN's failure to find a workspace, which Lightning's batch-size search also counts as running out of memory.
_OUT_OF_MEMORY_TEXTS = ("DefaultCPUAllocator: can't allocate memory", "CUDA out of memory",
                        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED")  # fmt: skip


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is memory running out: ``torch.OutOfMemoryError``, or an allocator's ``RuntimeError``."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OUT_OF_MEMORY_TEXTS)
