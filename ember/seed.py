"""Seeding of every random generator a training run touches."""

from __future__ import annotations

import operator
import os
import random
import sys
from typing import Any

import torch

from ember.lightning_compat.hook import is_installed as lightning_names_served
from ember.rank_zero import log_info, rank_zero_print, rank_zero_warn

_MAX_SEED = 2**32 - 1


def seed_everything(seed: int | str | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's ``random``, NumPy (when installed) and torch on every device; return the seed.

    Without ``seed`` one is read from ``EMBER_GLOBAL_SEED`` (or Lightning's ``PL_GLOBAL_SEED``) or drawn
    at random (and printed, so the run can be repeated); in a program that uses Lightning's names it is then 0,
    with Lightning's warning, as in Lightning. A seed given as a string of digits is its number.
    The Trainer derives its data order and DataLoader workers' seeds from the seed as well, so ``workers``
    changes nothing: workers are always seeded. As Lightning's, it sets ``PL_GLOBAL_SEED`` and
    ``PL_SEED_WORKERS`` (``"1"`` with ``workers=True``), which Lightning programs read.
    Each process logs ``Seed set to N`` (with its rank where a launcher set one), as Lightning does;
    ``verbose=False`` keeps that and a drawn seed unprinted.
    """
    if seed is None:
        seed = _seed_from_environment(verbose)
    seed = _as_number(seed)
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed_everything(seed={seed}): the seed must be between 0 and {_MAX_SEED}")
    os.environ["EMBER_GLOBAL_SEED"] = os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA generators as well
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    if verbose:
        log_info(_rank_prefixed(f"Seed set to {seed}"), lightning_module="utilities.seed")
    return seed


def _rank_prefixed(message: str) -> str:
    """``message`` led by this process's rank where a launcher set one: every process seeds, and logs it."""
    rank = next((os.environ[name] for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID") if name in os.environ), None)
    return message if rank is None else f"[rank: {rank}] {message}"


def _seed_from_environment(verbose: bool) -> int:
    """The seed of ``seed_everything()`` called without one."""
    name = "EMBER_GLOBAL_SEED" if "EMBER_GLOBAL_SEED" in os.environ else "PL_GLOBAL_SEED"
    env_seed = os.environ.get(name)
    if env_seed is not None:
        try:
            return int(env_seed)
        except ValueError:  # Lightning's words first
            raise ValueError(f"Invalid seed specified via {name}: {env_seed!r} (expected an integer)") from None
    if lightning_names_served():  # Lightning's programs get Lightning's seed, so that their runs repeat as there
        if verbose:
            rank_zero_warn("No seed found, seed set to 0")
        return 0
    seed = random.randint(0, _MAX_SEED)
    if verbose:
        rank_zero_print(f"seed_everything: no seed given, using {seed}")
    return seed


def _as_number(seed: int | str) -> int:
    try:  # operator.index takes NumPy's integers too, and refuses floats that would lose a part
        return int(seed) if isinstance(seed, str) else operator.index(seed)
    except (TypeError, ValueError):
        raise TypeError(f"seed_everything(seed={seed!r}): expected an int (or a string of digits)") from None


def random_state() -> dict[str, Any]:
    """This process's random generators (Python, NumPy if imported, torch CPU and CUDA), as plain values."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kind, keys, position, has_gauss, cached = numpy.random.get_state()
        # A NumPy array is not among what weights_only loading accepts; a tensor is.
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), position, has_gauss, cached)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state: dict[str, Any]) -> None:
    """Restore what ``random_state`` captured."""
    random.setstate(_as_python_state(state["python"]))
    torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        import numpy

        kind, keys, position, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), position, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([generator.cpu() for generator in state["cuda"]])


def _as_python_state(state: Any) -> tuple:
    # random.setstate wants tuples; a state that went through a checkpoint may hold lists.
    version, internal, gauss = state
    return version, tuple(internal), gauss
