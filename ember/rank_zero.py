"""Rank-zero helpers: print, warn, log and run functions on the global-zero process only."""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")

# Launchers that set a global rank, in the order they are trusted.
_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _rank_from_environment() -> int:
    for name in _RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def rank_zero_only(fn: Callable[..., _T]) -> Callable[..., _T | None]:
    """Decorate ``fn`` so that it runs on the global-zero process and returns ``None`` elsewhere.

    The rank is the Trainer's once one exists; before that it is read from the launcher's variables.
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> _T | None:
        if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
            return fn(*args, **kwargs)
        return None

    return wrapped


rank_zero_only.rank = _rank_from_environment()  # type: ignore[attr-defined]


@rank_zero_only
def rank_zero_print(*args: Any, **kwargs: Any) -> None:
    print(*args, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> None:
    warnings.warn(message, category, stacklevel=stacklevel)


@rank_zero_only
def rank_zero_info(*args: Any, **kwargs: Any) -> None:
    """Print an informational message (as ``print`` takes it) on the global-zero process."""
    print(*args, **kwargs)


@rank_zero_only
def rank_zero_debug(message: str, *args: Any) -> None:
    """Log a debugging message to the "ember" logger (``logging``), on the global-zero process."""
    logging.getLogger("ember").debug(message, *args)


# The warnings rank_zero_warn_once has given in this process.
_warned: set[tuple[str, type[Warning]]] = set()


def rank_zero_warn_once(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` on the global-zero process, the first time this process gives ``message``.

    For warnings that would otherwise come from every process, or again at every step, epoch or save.
    ``stacklevel`` counts from the caller, as ``warnings.warn``'s does.
    """
    if rank_zero_only.rank != 0 or (message, category) in _warned:  # type: ignore[attr-defined]
        return
    _warned.add((message, category))
    warnings.warn(message, category, stacklevel=stacklevel + 1)
