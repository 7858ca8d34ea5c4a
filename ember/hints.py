"""Hints for the mistakes a newcomer makes most, added to the exception they cause as a note (PEP 678): its
type, message and traceback stay as they are. A step given a batch of another structure than it expects (a dict
unpacked as a tuple, a list where a tensor was expected) fails deep inside torch; the note says what the batch
was. A misspelt argument of ``self.log`` fails with Python's TypeError; the note names the closest arguments.
Nothing here runs unless an exception is on its way out of a stage."""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import torch

from ember.module import Module

_STEPS = ("training_step", "validation_step", "test_step", "predict_step")
_LOG_ARGUMENT = re.compile(r"\blog(?:_dict)?\(\) got an unexpected keyword argument '(\w+)'")
# Messages of failures that a batch's structure causes: a container where a tensor was expected, unpacking, shapes.
_STRUCTURE = re.compile(r"\b(?:str|list|tuple|dict|NoneType|unpack|shape|shapes|size)\b")


def explain(error: BaseException) -> None:
    """Add the hint that fits ``error``, if one does (nothing on Python 3.10, which has no notes)."""
    if not hasattr(error, "add_note"):
        return
    note = _log_argument_hint(error) or _batch_hint(error)
    if note is not None:
        error.add_note(note)


def closest(name: str, valid: Iterable[str], otherwise: str | None = None) -> str:
    """``"did you mean a or b?"`` for the valid names closest to ``name``; else ``otherwise``, or all of them."""
    valid = sorted(valid)
    near = difflib.get_close_matches(name, valid, n=3, cutoff=0.6)
    if near:
        return "did you mean " + " or ".join(near) + "?"
    return otherwise or "valid: " + ", ".join(valid)


def _log_argument_hint(error: BaseException) -> str | None:
    match = _LOG_ARGUMENT.search(str(error)) if isinstance(error, TypeError) else None
    if match is None:
        return None
    valid = [name for name in inspect.signature(Module.log).parameters if name not in ("self", "name", "value")]
    return f"self.log(..., {match.group(1)}=...) takes no such argument; {closest(match.group(1), valid)}"


def _batch_hint(error: BaseException) -> str | None:
    """What the batch of the failing step was, where its structure is the likely cause of ``error``."""
    if not isinstance(error, (TypeError, ValueError, AttributeError, KeyError, IndexError, RuntimeError)):
        return None
    frame = _step_frame(error.__traceback__)
    if frame is None:
        return None
    code = frame.f_code
    arguments = code.co_varnames[: code.co_argcount]
    if len(arguments) < 2:  # (self, batch, ...): a step without its batch
        return None
    batch = frame.f_locals.get(arguments[1])
    if not (isinstance(batch, Mapping) or _STRUCTURE.search(str(error))):
        return None
    hint = f"{code.co_name} was given a batch that is {describe(batch)}"
    if isinstance(batch, Mapping):
        hint += f"; `a, b = batch` unpacks its keys: read its values by key (batch[{next(iter(batch), 'key')!r}])"
    return hint


def _step_frame(traceback: TracebackType | None) -> Any:
    """The innermost frame of a module's step in ``traceback`` (None: the error did not pass through one)."""
    found = None
    while traceback is not None:
        if traceback.tb_frame.f_code.co_name in _STEPS:
            found = traceback.tb_frame
        traceback = traceback.tb_next
    return found


def describe(batch: Any, depth: int = 0) -> str:
    """A batch's structure in words: its type, and the keys, lengths and shapes inside it."""
    if isinstance(batch, torch.Tensor):
        return f"a tensor of shape {tuple(batch.shape)}"
    if depth > 0:
        return type(batch).__name__
    if isinstance(batch, Mapping):
        items = ", ".join(f"{key!r}: {describe(value, depth + 1)}" for key, value in list(batch.items())[:6])
        return f"a {type(batch).__name__} {{{items}{', ...' if len(batch) > 6 else ''}}}"
    if isinstance(batch, (list, tuple)):
        items = ", ".join(describe(item, depth + 1) for item in batch[:6])
        return f"a {type(batch).__name__} of {len(batch)}: [{items}{', ...' if len(batch) > 6 else ''}]"
    return f"a {type(batch).__name__}"
