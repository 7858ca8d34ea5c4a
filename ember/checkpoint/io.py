"""Checkpoint files: atomic, durable writes and loading that runs no code from the file.

This module knows files only; what a checkpoint holds is ``ember.checkpoint.state``'s business.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint file could not be used."""


def save(checkpoint: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write ``checkpoint`` to ``path`` so that ``path`` is always either the old file or the new one.

    The bytes go to a temporary file in the same directory, are flushed to disk, and the file is
    renamed over ``path``: a process killed mid-write leaves the previous checkpoint intact.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(dict(checkpoint), file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(directory)


def link(source: str | os.PathLike, destination: str | os.PathLike) -> None:
    """Make ``destination`` an atomic copy of the complete file ``source`` (a hard link when possible).

    A sharded checkpoint (a directory) is copied with its files hard-linked, and replaces
    ``destination`` only once complete.
    """
    source, destination = os.fspath(source), os.fspath(destination)
    if os.path.isdir(source):
        staging = staging_path(destination, "partial")
        remove(staging)
        shutil.copytree(source, staging, copy_function=_link_or_copy)
        replace_directory(staging, destination)
        return
    directory = os.path.dirname(os.path.abspath(destination))
    temporary = os.path.join(directory, f".{os.path.basename(destination)}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        os.unlink(temporary)
    try:
        os.link(source, temporary)
    except OSError:  # file systems without hard links
        shutil.copyfile(source, temporary)
    os.replace(temporary, destination)
    _fsync_directory(directory)


def load_file(path: str | os.PathLike, map_location: Any = "cpu", *, trust_pickles: bool = False) -> dict[str, Any]:
    """Read a checkpoint file with ``torch.load(weights_only=True)``: tensors and plain Python values only.

    A file carrying other pickled objects is refused before any of them is built, so nothing in
    it runs. ``trust_pickles=True`` lifts that for files from a source you trust.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"ckpt_path={path!r}: no such checkpoint file")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=not trust_pickles)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        culprit = f"it references {found.group(1)}" if found else str(err).splitlines()[0]
        raise CheckpointError(
            f"{path!r} holds pickled objects other than tensors and plain Python values ({culprit}), so it "
            "was not loaded and nothing in it ran. If you trust where the file comes from, load it with "
            "weights_only=False."
        ) from None
    except (RuntimeError, EOFError) as err:
        raise CheckpointError(f"{path!r} is not a readable checkpoint: {err}") from err
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path!r} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    return checkpoint


def remove(path: str | os.PathLike) -> None:
    """Remove a checkpoint, a file or a directory, if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def replace_directory(source: str, destination: str) -> None:
    """Move the complete directory ``source`` to ``destination``, replacing what was there."""
    old = staging_path(destination, "old")
    remove(old)
    if os.path.lexists(destination):
        os.replace(destination, old)  # a directory cannot be renamed over another one
    os.replace(source, destination)
    remove(old)
    _fsync_directory(os.path.dirname(os.path.abspath(destination)))


def staging_path(path: str | os.PathLike, what: str) -> str:
    """A hidden sibling of ``path`` for work in progress, the same on every rank."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{what}")


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # file systems without hard links
        shutil.copy2(source, destination)


def plain_values(value: Any, where: str = "value") -> Any:
    """``value`` reduced to what ``weights_only`` loading accepts; other objects are left out, with a warning."""
    kept = _plain_or_dropped(value, where)
    return None if kept is _DROPPED else kept


_DROPPED = object()
_PLAIN_TYPES = (bool, int, float, str, torch.Tensor, torch.dtype, torch.device)


def _plain_or_dropped(value: Any, where: str) -> Any:
    if value is None or isinstance(value, _PLAIN_TYPES):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        items = ((key, _plain_or_dropped(item, f"{where}[{key!r}]")) for key, item in value.items())
        return {key: item for key, item in items if item is not _DROPPED}
    if isinstance(value, (list, tuple)):
        items = (_plain_or_dropped(item, f"{where}[{index}]") for index, item in enumerate(value))
        kept = [item for item in items if item is not _DROPPED]
        return tuple(kept) if isinstance(value, tuple) else kept
    warnings.warn(
        f"{where} is a {type(value).__name__}, which checkpoints do not store (they hold tensors and "
        "plain Python values only, so that loading runs no code); it is left out",
        stacklevel=3,
    )
    return _DROPPED


def _fsync_directory(directory: str) -> None:
    """Make a rename durable: the directory entry itself must reach the disk."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
