"""Checkpoints: files written atomically and read without running code (``io``), sharded checkpoints
that every rank writes its part of (``sharded``), and what a training state holds (``state``)."""

from __future__ import annotations

import os
import urllib.parse
from typing import Any, BinaryIO

import torch

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
    read whole into CPU memory as if it were one file. Nothing in either runs code unless ``trust_pickles``.
    An ``http(s)://`` URL is downloaded once into torch hub's cache (``$TORCH_HOME/hub/checkpoints``), as Lightning
    does, and read from there."""
    if isinstance(path, str) and path.startswith(("http://", "https://")):
        path = _downloaded(path)
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
        return sharded.load_consolidated(os.fspath(path), trust_pickles=trust_pickles)
    return load_file(path, map_location, trust_pickles=trust_pickles)


def _downloaded(url: str) -> str:
    """The local copy of the file at ``url``, named as the URL names it: ``torch.hub.load_state_dict_from_url``'s
    cache, so that a file it fetched is not fetched again."""
    directory = os.path.join(torch.hub.get_dir(), "checkpoints")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, os.path.basename(urllib.parse.urlparse(url).path))
    if not os.path.exists(path):
        torch.hub.download_url_to_file(url, path, progress=False)
    return path
