"""Checkpoints: files written atomically and read without running code (``io``), sharded checkpoints
that every rank writes its part of (``sharded``), and what a training state holds (``state``)."""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from ember.checkpoint import sharded
from ember.checkpoint.io import (
    CheckpointError,
    link,
    load_file,
    plain_values,
    prepare_directory,
    remove,
    replace_directory,
    save,
    staging_path,
    verify,
)

__all__ = [
    "CheckpointError",
    "link",
    "load",
    "load_file",
    "plain_values",
    "prepare_directory",
    "remove",
    "replace_directory",
    "save",
    "staging_path",
    "verify",
]


def load(
    path: str | os.PathLike | BinaryIO, map_location: Any = "cpu", *, trust_pickles: bool = False
) -> dict[str, Any]:
    """Read a checkpoint: a file (a path or a file object, see ``load_file``), or a sharded checkpoint's directory,
    read whole into CPU memory as if it were one file. Nothing in either runs code unless ``trust_pickles``."""
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        return sharded.load_consolidated(os.fspath(path), trust_pickles=trust_pickles)
    return load_file(path, map_location, trust_pickles=trust_pickles)
