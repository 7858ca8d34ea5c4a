"""Seeding of every random generator a training run touches."""

from __future__ import annotations

import os
import random

import torch

from ember.rank_zero import rank_zero_print

_MAX_SEED = 2**32 - 1


def seed_everything(seed: int | None = None, workers: bool = False) -> int:
    """Seed Python's ``random``, NumPy (when installed) and torch on every device; return the seed.

    Without ``seed`` one is read from ``EMBER_GLOBAL_SEED`` or drawn at random (and printed, so the
    run can be repeated). ``workers=True`` makes the Trainer give each DataLoader worker a seed
    derived from this one, its rank and its worker id.
    """
    if seed is None:
        env_seed = os.environ.get("EMBER_GLOBAL_SEED")
        seed = int(env_seed) if env_seed is not None else random.randint(0, _MAX_SEED)
        if env_seed is None:
            rank_zero_print(f"seed_everything: no seed given, using {seed}")
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed_everything(seed={seed}): the seed must be between 0 and {_MAX_SEED}")
    os.environ["EMBER_GLOBAL_SEED"] = str(seed)
    os.environ["EMBER_SEED_WORKERS"] = "1" if workers else "0"
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA generators as well
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    return seed
