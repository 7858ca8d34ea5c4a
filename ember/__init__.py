"""Ember: fast PyTorch training behind a Lightning-compatible Module and Trainer."""

from ember.launch import strip_local_rank_argument
from ember.module import DataModule, Module
from ember.rank_zero import rank_zero_only
from ember.seed import seed_everything
from ember.trainer import Trainer
from ember.version import __version__

# The legacy torch.distributed.launch appends --local-rank=N to the script's arguments.
strip_local_rank_argument()

__all__ = ["DataModule", "Module", "Trainer", "__version__", "rank_zero_only", "seed_everything"]
