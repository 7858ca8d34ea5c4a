"""Checkpoint files: atomic, durable writes and loading that runs no code from the file."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ember.data import loader_state, restore_loader_state, why_not_resumable
from ember.seed import random_state

if TYPE_CHECKING:
    from ember.trainer import Trainer


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


def load(path: str | os.PathLike, map_location: Any = "cpu", *, trust_pickles: bool = False) -> dict[str, Any]:
    """Read a checkpoint with ``torch.load(weights_only=True)``: tensors and plain Python values only.

    A file carrying other pickled objects is refused before any of them is built, so nothing in
    it runs. ``trust_pickles=True`` lifts that for files from a source you trust. A sharded
    checkpoint (a directory) is read whole, into CPU memory, as if it were one file.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        from ember import sharded_checkpoint

        return sharded_checkpoint.load_consolidated(path, trust_pickles=trust_pickles)
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


# ------------------------------------------------------------------------- the training state
def training_state(trainer: Trainer, *, weights_only: bool, gather: bool = True) -> dict[str, Any]:
    """Everything the next step depends on, as a checkpoint dict (weights and hyperparameters only with
    ``weights_only``).

    Parameters, optimizers, schedulers and loop counters are the same on every rank; what differs
    per rank (random generators, a stateful loader's position, gradients of an unfinished
    accumulation window) is gathered from all ranks, or taken from this rank only with ``gather=False``.
    """
    import ember

    module = trainer._require_module()
    strategy = trainer.strategy
    checkpoint: dict[str, Any] = {
        "ember_version": ember.__version__,
        "torch_version": str(torch.__version__),  # a str subclass that weights_only loading refuses
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "state_dict": strategy.module_state_dict(),
        "hyper_parameters": plain_values(dict(module.hparams), "hyper_parameters"),
    }
    if weights_only:
        return checkpoint
    own = {
        "random_state": random_state(),
        "loader_state": loader_state(trainer.train_dataloader) if trainer.train_dataloader is not None else None,
        "accumulated_gradients": _unfinished_window_gradients(trainer),
    }
    checkpoint.update(
        loops={
            "epoch": trainer._position[0],
            "batches_done": trainer._position[1],
            "total_train_batches": trainer._total_train_batches,
            "micro_batches": trainer._micro_batches,
        },
        optimizer_states=[strategy.optimizer_state_dict(optimizer) for optimizer in trainer.optimizers],
        lr_schedulers=[config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        precision=strategy.precision.state_dict(),
        callbacks={callback.state_key: callback.state_dict() for callback in trainer.callbacks},
        loggers=[{"version": logger.version} for logger in trainer.loggers],
        data={"seed": trainer._data_seed},
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


def _unfinished_window_gradients(trainer: Trainer) -> list[torch.Tensor | None] | None:
    """The gradients accumulated so far in an accumulation window that has not stepped yet.

    After each optimizer step gradients are set to None, so gradients at a batch boundary belong to
    micro-batches whose step is still to come; a resumed run must start from them.
    """
    module = trainer.module
    if module is None or not module.automatic_optimization:
        return None
    # A sharded parameter's gradient is a DTensor: each rank keeps its own shard (rank-local, like the rest).
    gradients = [_local(parameter.grad) for parameter in module.parameters()]
    return gradients if any(gradient is not None for gradient in gradients) else None


def _local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def restore_training_state(trainer: Trainer, checkpoint: dict[str, Any], path: str) -> None:
    """Put the trainer, module, optimizers, callbacks, loggers and data where ``checkpoint`` says."""
    module = trainer._require_module()
    strategy = trainer.strategy
    if "optimizer_states" not in checkpoint:
        raise ValueError(
            f"ckpt_path={path!r} holds weights only (save_weights_only=True), so training cannot resume "
            "from it; load the weights into the module with Module.load_from_checkpoint instead"
        )
    module.on_load_checkpoint(checkpoint)
    strategy.load_module_state_dict(checkpoint["state_dict"])
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
    saved_callbacks = checkpoint.get("callbacks", {})
    for callback in trainer.callbacks:
        callback.on_load_checkpoint(trainer, module, checkpoint)
        if callback.state_key in saved_callbacks:
            callback.load_state_dict(saved_callbacks[callback.state_key])
    for logger, saved in zip(trainer.loggers, checkpoint.get("loggers", [])):
        logger.use_version(saved["version"])  # the resumed run keeps writing to the same run directory
    if trainer.datamodule is not None and "datamodule" in checkpoint:
        trainer.datamodule.load_state_dict(checkpoint["datamodule"])

    loops = checkpoint["loops"]
    trainer.global_step = checkpoint["global_step"]
    trainer.current_epoch = loops["epoch"]
    trainer._position = (loops["epoch"], loops["batches_done"])
    trainer._total_train_batches = loops["total_train_batches"]
    trainer._micro_batches = loops.get("micro_batches", 1)
    trainer._data_seed = checkpoint["data"]["seed"]
    own = checkpoint["ranks"].get(trainer.global_rank)
    if own is None or len(checkpoint["ranks"]) != trainer.world_size:
        warnings.warn(
            f"ckpt_path={path!r} was written by {len(checkpoint['ranks'])} process(es) and is resumed by "
            f"{trainer.world_size}: the weights and loop position carry over, the random state and data "
            "order of each rank start afresh",
            stacklevel=3,
        )
        own = None
    if own is not None:
        trainer._pending_random_state = own["random_state"]  # applied when training resumes
        restore_loader_state(trainer.train_dataloader, own["loader_state"])
        _restore_gradients(module, own["accumulated_gradients"])
    batches_done = trainer._position[1]
    reason = why_not_resumable(trainer.train_dataloader) if batches_done else None
    if reason is not None and own is not None and own["loader_state"] is None:
        warnings.warn(
            f"resuming at the start of epoch {trainer.current_epoch + 1} instead of batch {batches_done} of "
            f"epoch {trainer.current_epoch}: the train dataloader cannot skip to a batch because {reason}",
            stacklevel=3,
        )
        trainer.current_epoch += 1
        trainer._position = (trainer.current_epoch, 0)


def _restore_gradients(module: torch.nn.Module, gradients: list[torch.Tensor | None] | None) -> None:
    if gradients is None:
        return
    for parameter, gradient in zip(module.parameters(), gradients, strict=True):
        if gradient is not None and hasattr(parameter, "device_mesh"):  # a shard of a DTensor gradient
            from torch.distributed.tensor import DTensor

            gradient = DTensor.from_local(gradient.to(parameter.device), parameter.device_mesh, parameter.placements)
        parameter.grad = None if gradient is None else gradient.to(parameter.device)


# ---------------------------------------------------------------------- finding checkpoints
def find_checkpoint(trainer: Trainer, which: str) -> str | None:
    """The newest complete checkpoint ("last") or the best one ("best") of this run's directories."""
    if which == "best":
        callback = trainer.checkpoint_callback
        if callback is not None and callback.best_model_path:
            return callback.best_model_path
        newest = find_checkpoint(trainer, "last")
        if newest is None:
            return None
        saved = load(newest, trust_pickles=False).get("callbacks", {})
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
