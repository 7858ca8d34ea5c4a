"""What a training checkpoint holds, built from each part's own ``state_dict()``, and how it is put back.

Parameters, optimizers, schedulers and the loop's progress are the same on every rank; what differs
per rank (random generators, a stateful loader's position, gradients of an unfinished accumulation
window) is gathered from all ranks into ``ranks``.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ember import checkpoint as checkpoint_io
from ember.checkpoint.io import CheckpointError, plain_values
from ember.data import why_not_resumable
from ember.version import __version__

if TYPE_CHECKING:
    from ember.module import Module
    from ember.trainer import Trainer


def training_state(trainer: Trainer, *, weights_only: bool, gather: bool = True) -> dict[str, Any]:
    """Everything the next step depends on, as a checkpoint dict (weights and hyperparameters only with
    ``weights_only``). The per-rank part comes from every rank, or from this one only with ``gather=False``."""
    module = _module(trainer)
    strategy, fit_loop = trainer.strategy, trainer.fit_loop
    checkpoint: dict[str, Any] = {
        "ember_version": __version__,
        "torch_version": str(torch.__version__),  # a str subclass that weights_only loading refuses
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "state_dict": strategy.module_state_dict(),
        "hyper_parameters": plain_values(dict(module.hparams), "hyper_parameters"),
    }
    if weights_only:
        return checkpoint
    own = fit_loop.rank_state()
    checkpoint.update(
        loops={"fit_loop": fit_loop.state_dict()},
        optimizer_states=[strategy.optimizer_state_dict(optimizer) for optimizer in trainer.optimizers],
        lr_schedulers=[config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        precision=strategy.precision.state_dict(),
        callbacks={callback.state_key: callback.state_dict() for callback in trainer.callbacks},
        loggers=[{"version": logger.version} for logger in trainer.loggers],
        data={"seed": fit_loop.data_seed},
        ranks=dict(enumerate(strategy.all_gather_object(own))) if gather else {trainer.global_rank: own},
    )
    if trainer.datamodule is not None:
        checkpoint["datamodule"] = trainer.datamodule.state_dict()
        checkpoint["datamodule_hyper_parameters"] = plain_values(
            dict(trainer.datamodule.hparams), "datamodule hyper_parameters"
        )
    module.on_save_checkpoint(checkpoint)
    for callback in trainer.callbacks:
        callback.on_save_checkpoint(trainer, module, checkpoint)
    return checkpoint


def restore_training_state(trainer: Trainer, checkpoint: dict[str, Any], path: str) -> None:
    """Put the module, optimizers, schedulers, callbacks, loggers, data and the loop where ``checkpoint``
    says; called once ``fit`` has built the optimizers."""
    if "optimizer_states" not in checkpoint:
        raise ValueError(
            f"ckpt_path={path!r} holds weights only (save_weights_only=True), so training cannot resume "
            "from it; load the weights into the module with Module.load_from_checkpoint instead"
        )
    if "fit_loop" not in checkpoint.get("loops", {}):
        raise CheckpointError(
            f"ckpt_path={path!r} was written by an older Ember, whose loop state this one cannot read"
        )
    module = _module(trainer)
    module.on_load_checkpoint(checkpoint)
    trainer.strategy.load_module_state_dict(checkpoint["state_dict"])
    _restore_optimization(trainer, checkpoint, path)
    saved_callbacks = checkpoint.get("callbacks", {})
    for callback in trainer.callbacks:
        callback.on_load_checkpoint(trainer, module, checkpoint)
        if callback.state_key in saved_callbacks:
            callback.load_state_dict(saved_callbacks[callback.state_key])
    for logger, saved in zip(trainer.loggers, checkpoint.get("loggers", [])):
        logger.use_version(saved["version"])  # the resumed run keeps writing to the same run directory
    if trainer.datamodule is not None and "datamodule" in checkpoint:
        trainer.datamodule.load_state_dict(checkpoint["datamodule"])
    _restore_position(trainer, checkpoint, path)


def _restore_optimization(trainer: Trainer, checkpoint: dict[str, Any], path: str) -> None:
    strategy = trainer.strategy
    saved_optimizers = checkpoint["optimizer_states"]
    if len(saved_optimizers) != len(trainer.optimizers):
        raise ValueError(
            f"ckpt_path={path!r} holds {len(saved_optimizers)} optimizer states, but "
            f"configure_optimizers() returned {len(trainer.optimizers)} optimizers"
        )
    for optimizer, state in zip(trainer.optimizers, saved_optimizers):
        strategy.load_optimizer_state_dict(optimizer, state)
    for config, state in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"]):
        config.scheduler.load_state_dict(state)
    strategy.precision.load_state_dict(checkpoint.get("precision", {}))


def _restore_position(trainer: Trainer, checkpoint: dict[str, Any], path: str) -> None:
    fit_loop = trainer.fit_loop
    fit_loop.load_state_dict(checkpoint["loops"]["fit_loop"])
    fit_loop.data_seed = checkpoint["data"]["seed"]
    ranks = checkpoint["ranks"]
    own = ranks.get(trainer.global_rank)
    if own is None or len(ranks) != trainer.world_size:
        warnings.warn(
            f"ckpt_path={path!r} was written by {len(ranks)} process(es) and is resumed by "
            f"{trainer.world_size}: the weights and loop position carry over, the random state and data "
            "order of each rank start afresh",
            stacklevel=4,
        )
        own = None
    else:
        fit_loop.load_rank_state(own)
    progress = fit_loop.progress
    loader = fit_loop.train_loader
    reason = why_not_resumable(loader) if progress.epoch_batches and loader is not None else None
    if reason is not None and (own is None or own["loader_state"] is None):
        warnings.warn(
            f"resuming at the start of epoch {progress.epoch + 1} instead of batch {progress.epoch_batches} of "
            f"epoch {progress.epoch}: the train dataloader cannot skip to a batch because {reason}",
            stacklevel=4,
        )
        progress.start_next_epoch()


def find_checkpoint(trainer: Trainer, which: str) -> str | None:
    """The newest complete checkpoint ("last") or the best one ("best") of this run's directories."""
    if which == "best":
        callback = trainer.checkpoint_callback
        if callback is not None and callback.best_model_path:
            return callback.best_model_path
        newest = find_checkpoint(trainer, "last")
        if newest is None:
            return None
        saved = checkpoint_io.load(newest, trust_pickles=False).get("callbacks", {})
        paths = [state.get("best_model_path") for key, state in saved.items() if key.startswith("ModelCheckpoint")]
        return next((path for path in paths if path and os.path.exists(path)), None)
    roots = [trainer.default_root_dir] + [c.dirpath for c in trainer.checkpoint_callbacks if c.dirpath]
    candidates = []
    for root in roots:
        for directory, subdirectories, files in os.walk(root):
            for name in files + subdirectories:
                # Files being written are hidden temporaries; only complete checkpoints carry the name.
                if name.endswith(".ckpt") and not name.startswith("."):
                    candidates.append(os.path.join(directory, name))
    return max(candidates, key=os.path.getmtime, default=None)


def _module(trainer: Trainer) -> Module:
    module = trainer.lightning_module
    if module is None:
        raise RuntimeError("no module is attached; call fit, validate, test or predict first")
    return module
