"""Continuing a run: the loop's state a checkpoint holds (``LoopState``), and putting it back with this run's data
and layout, exactly where the data and the layout are the checkpoint's own, else at the same sample of the epoch.

The per-rank part (random generators, a stateful loader's position, the gradients of an unfinished accumulation
window) applies only when the run has as many ranks as the one that saved it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from ember._utils import local_shard
from ember.data import (
    batches_from,
    data_replicas,
    dataset_length,
    loader_batch_size,
    loader_state,
    restore_loader_state,
    why_not_resumable,
)
from ember.exceptions import MisconfigurationException
from ember.loops.progress import Progress
from ember.rank_zero import announce, rank_zero_warn_once
from ember.seed import random_state

if TYPE_CHECKING:
    from ember.trainer import Trainer


@dataclasses.dataclass
class LoopState:
    """Where a fit is: what a checkpoint saves of the loop and a resumed run continues from.

    One per Trainer (``trainer.fit_loop.state``), outliving each fit. ``Progress.advance`` and the loop's epoch
    ends move the progress; each fit draws the data seed; ``resume`` alone sets all of it from a checkpoint.
    """

    progress: Progress = dataclasses.field(default_factory=Progress)
    """Where the loop is: epoch, steps, batches and samples."""

    data_seed: int = 0
    """The order of the training data follows from it (the same on every rank) and the epoch."""

    pending_random_state: dict[str, Any] | None = None
    """This rank's random generators as a checkpoint saved them: put back when the resumed run draws its
    first batch, so that dropout and the like continue exactly."""

    def start(self, data_seed: int) -> None:
        """A fit starts: its data order follows ``data_seed`` unless a checkpoint it resumes says otherwise."""
        self.data_seed = data_seed
        self.pending_random_state = None

    def take_random_state(self) -> dict[str, Any] | None:
        """The random state to put back now (once), or None."""
        state, self.pending_random_state = self.pending_random_state, None
        return state

    def state_dict(self) -> dict[str, Any]:
        return {"progress": self.progress.state_dict(), "data_seed": self.data_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.progress.load_state_dict(state["progress"])
        self.data_seed = state.get("data_seed", self.data_seed)
        self.pending_random_state = state.get("random_state")


def data_layout(trainer: Trainer, epoch: int) -> dict[str, Any]:
    """What a checkpoint's position in the epoch is relative to: the data seed and the data's layout, with the
    accumulation of ``epoch``, the epoch the position resumes in (under a schedule, the next one at an epoch's end)."""
    fit_loop = trainer.fit_loop
    if fit_loop.data is not None:
        # Saved or resumed before the loop asks for the training loader (after the sanity check): ask now.
        fit_loop.data.load()
    loader = fit_loop.train_loader
    accumulate = fit_loop.accumulation_of(epoch)
    accumulate = accumulate if isinstance(accumulate, int) else 1
    batches = fit_loop.num_training_batches  # limit_train_batches and drop_last counted
    return {
        "seed": fit_loop.state.data_seed,
        "global_seed": os.environ.get("EMBER_GLOBAL_SEED"),  # set by seed_everything
        "dataset_length": dataset_length(loader) if loader is not None else None,
        "batch_size": loader_batch_size(loader) if loader is not None else None,
        "replicas": data_replicas(loader) if loader is not None else 1,
        "accumulate": accumulate,
        "steps_per_epoch": None if math.isinf(batches) else math.ceil(batches / accumulate),
    }


def rank_state(trainer: Trainer) -> dict[str, Any]:
    """What differs per rank: the random generators, a stateful loader's position, and the gradients of an
    unfinished accumulation window."""
    loader = trainer.fit_loop.train_loader
    return {
        "random_state": random_state(),
        "loader_state": loader_state(loader) if loader is not None else None,
        "accumulated_gradients": _unfinished_window_gradients(trainer.lightning_module),
    }


def resume(trainer: Trainer, checkpoint: dict[str, Any], path: str) -> None:
    """Put the loop where ``checkpoint`` says, with this run's data and layout: the same batch where both are the
    checkpoint's, the same sample of the epoch where the batch size, the ranks or the accumulation changed, the
    epoch's start where the data changed (with ``restart_on_data_change``) or the loader cannot skip."""
    fit_loop = trainer.fit_loop
    saved_loop = checkpoint["loops"]["fit_loop"]
    if fit_loop.runner is not None:
        fit_loop.runner.load_state_dict(saved_loop)
    position = Progress()
    position.load_state_dict(saved_loop["progress"])
    limit = trainer.config.epoch_limit
    if limit != -1 and position.epoch > limit:  # (having reached it exactly, the run has nothing left to train)
        raise MisconfigurationException(
            f"You restored a checkpoint with current_epoch={position.epoch}, but you have set "
            f"Trainer(max_epochs={limit}): ckpt_path={path!r} has trained past that limit; raise max_epochs to "
            "continue its run, or start a new run from its weights (Module.load_from_checkpoint)"
        )
    saved, now = checkpoint["data"], data_layout(trainer, position.epoch)
    new_seed = _changes(saved, now, ("global_seed",))
    same_setup = _place(trainer, position, saved, now, new_seed, path)
    own = _own_rank_state(trainer, checkpoint["ranks"], path)
    if own is not None and same_setup:
        _restore_rank(trainer, own)
    loader = fit_loop.train_loader
    reason = why_not_resumable(loader) if position.epoch_batches and loader is not None else None
    if reason is not None and (own is None or own["loader_state"] is None):
        rank_zero_warn_once(
            f"resuming at the start of epoch {position.epoch + 1} instead of batch {position.epoch_batches} of "
            f"epoch {position.epoch}: the train dataloader cannot skip to a batch because {reason}",
            stacklevel=5,
        )
        position.start_next_epoch()
    fit_loop.state.load_state_dict({
        "progress": position.state_dict(),
        # A new global seed (seed_everything with another value) orders the data from now on.
        "data_seed": fit_loop.state.data_seed if new_seed else saved["seed"],
        "random_state": own["random_state"] if own is not None else None,
    })  # fmt: skip


def _place(trainer: Trainer, position: Progress, saved: dict[str, Any], now: dict[str, Any], new_seed: list[str],
           path: str) -> bool:  # fmt: skip
    """Move ``position`` to where this run's data and layout continue the checkpoint's epoch; returns whether they
    are the checkpoint's own (a stateful loader's position and an unfinished window's gradients then apply)."""
    changed = _changes(saved, now, ("dataset_length",)) + new_seed
    if changed:
        _accept_data_change(trainer, position, changed, path)
        return False
    layout = _changes(saved, now, ("batch_size", "replicas", "accumulate"))
    if not layout:
        return True
    _continue_with_new_layout(trainer, position, layout)
    before, after = saved.get("steps_per_epoch"), now["steps_per_epoch"]
    schedulers = trainer.fit_loop.runner is not None and trainer.fit_loop.runner.scheduler_configs
    if schedulers and None not in (before, after) and before != after:
        rank_zero_warn_once(
            f"an epoch is now {after} optimizer steps instead of {before}: learning-rate schedulers continue by "
            f"optimizer step (from global step {position.global_step}), so a schedule planned in epochs no "
            "longer ends with an epoch",
            stacklevel=6,
        )
    return False


def _accept_data_change(trainer: Trainer, position: Progress, changed: list[str], path: str) -> None:
    what = ", ".join(changed)
    if not trainer.config.restart_on_data_change:
        raise ValueError(
            f"ckpt_path={path!r} was saved with other data than this run's ({what}), so its position in "
            f"epoch {position.epoch} would mean something else now; pass "
            "Trainer(restart_on_data_change=True) to resume anyway, starting that epoch over"
        )
    if position.epoch_batches and not position.epoch_finished:
        rank_zero_warn_once(f"the data changed ({what}): epoch {position.epoch} starts over", stacklevel=6)
    position.restart_epoch()


def _continue_with_new_layout(trainer: Trainer, position: Progress, layout: list[str]) -> None:
    loader = trainer.fit_loop.train_loader
    assert loader is not None
    if position.window_batches:  # its gradients were summed for another window: that window runs again
        position.drop_unfinished_window()
    left = batches_from(loader, position.epoch_samples)
    if left is not None:
        # The rest is numbered as the epoch's last batches in the new layout: the resumed epoch ends (and
        # validates) where an epoch of the new layout ends, whatever batch the position falls in.
        position.renumber_epoch_batches((batches_from(loader, 0) or 0) - left)
        announce(
            f"resuming with {', '.join(layout)}: epoch {position.epoch} continues at sample "
            f"{position.epoch_samples} of its order"
        )
    elif position.epoch_batches:
        rank_zero_warn_once(
            f"resuming with {', '.join(layout)}: the train dataloader cannot continue at a sample (it does not "
            f"read a map-style dataset in order or shuffled), so epoch {position.epoch} starts over",
            stacklevel=6,
        )
        position.restart_epoch()


def _own_rank_state(trainer: Trainer, ranks: dict[int, Any], path: str) -> dict[str, Any] | None:
    """This rank's part of the checkpoint, or None (with a warning) when another number of ranks saved it."""
    own = ranks.get(trainer.global_rank)
    if own is not None and len(ranks) == trainer.world_size:
        return own
    rank_zero_warn_once(
        f"ckpt_path={path!r} was written by {len(ranks)} process(es) and is resumed by "
        f"{trainer.world_size}: the weights, optimizers and position in the data carry over; the random "
        "state of each rank starts afresh",
        stacklevel=5,
    )
    return None


def _restore_rank(trainer: Trainer, own: dict[str, Any]) -> None:
    """A stateful loader's position and the unfinished window's gradients, as this rank saved them."""
    loader = trainer.fit_loop.train_loader
    if loader is not None:
        restore_loader_state(loader, own["loader_state"])
    _restore_gradients(trainer.lightning_module, own["accumulated_gradients"])


def _changes(saved: dict[str, Any], now: dict[str, Any], names: tuple[str, ...]) -> list[str]:
    """``"name old -> new"`` for each of ``names`` that both know and that differ."""
    return [
        f"{name.replace('_', ' ')} {saved[name]} -> {now[name]}"
        for name in names
        if saved.get(name) is not None and now.get(name) is not None and saved[name] != now[name]
    ]


def _unfinished_window_gradients(module: torch.nn.Module | None) -> list[torch.Tensor | None] | None:
    """The gradients accumulated so far in an accumulation window that has not stepped yet.

    After each optimizer step gradients are set to None, so gradients at a batch boundary belong to
    micro-batches whose step is still to come; a resumed run must start from them.
    """
    if module is None or not getattr(module, "automatic_optimization", True):
        return None
    # A sharded parameter's gradient is a DTensor: each rank keeps its own shard (rank-local, like the rest).
    gradients = [local_shard(parameter.grad) for parameter in module.parameters()]
    return gradients if any(gradient is not None for gradient in gradients) else None


def _restore_gradients(module: torch.nn.Module | None, gradients: list[torch.Tensor | None] | None) -> None:
    if gradients is None or module is None:
        return
    for parameter, gradient in zip(module.parameters(), gradients, strict=True):
        if gradient is not None and hasattr(parameter, "device_mesh"):  # a shard of a DTensor gradient
            from torch.distributed.tensor import DTensor

            mesh, placements = parameter.device_mesh, getattr(parameter, "placements")  # noqa: B009 (a DTensor's)
            gradient = DTensor.from_local(gradient.to(parameter.device), mesh, placements)
        parameter.grad = None if gradient is None else gradient.to(parameter.device)
