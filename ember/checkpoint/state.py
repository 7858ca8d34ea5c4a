"""What a training checkpoint holds, built from each part's own ``state_dict()``, and how it is put back.

Parameters, optimizers, schedulers and the loop's progress are the same on every rank; what differs
per rank (random generators, a stateful loader's position, gradients of an unfinished accumulation
window) is gathered from all ranks into ``ranks``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from ember import checkpoint as checkpoint_io
from ember._utils import local_shard
from ember.checkpoint import resume, sharded
from ember.checkpoint.io import CheckpointError
from ember.hparams import checkpoint_entries
from ember.lightning_compat.hook import is_installed as lightning_names_served
from ember.loggers.logger import VersionedLogger, run_versions
from ember.rank_zero import announce, rank_zero_warn
from ember.version import __version__

#: Where a checkpoint is read from: a path, or a file object open for reading (as Lightning's loaders take).
CheckpointSource = str | os.PathLike | BinaryIO

if TYPE_CHECKING:
    from ember.module import DataModule, Module
    from ember.trainer import Trainer

#: In the name of a checkpoint saved after a failure with non-finite weights: "last" never picks it.
FAILURE_MARK = ".nonfinite"


def training_state(trainer: Trainer, *, weights_only: bool, gather: bool = True) -> dict[str, Any]:
    """Everything the next step depends on, as a checkpoint dict (with ``weights_only``: no optimizer, loop or
    callback state). The per-rank part comes from every rank, or from this one only with ``gather=False``."""
    module = _module(trainer)
    strategy, fit_loop = trainer.strategy, trainer.fit_loop
    checkpoint: dict[str, Any] = {
        "ember_version": __version__,
        "torch_version": str(torch.__version__),  # a str subclass that weights_only loading refuses
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "state_dict": strategy.module_state_dict(),
        **checkpoint_entries(module),
    }
    if not weights_only:
        own = resume.rank_state(trainer)
        runner = fit_loop.runner.state_dict() if fit_loop.runner is not None else {}
        checkpoint.update(
            loops={"fit_loop": {**fit_loop.state.state_dict(), **runner}},
            optimizer_states=[strategy.optimizer_state_dict(optimizer) for optimizer in trainer.optimizers],
            lr_schedulers=[config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            precision=strategy.precision.state_dict(),
            # As Lightning's, only the callbacks with a state: an empty one restores nothing.
            callbacks={callback.state_key: state for callback in trainer.callbacks if (state := callback.state_dict())},
            loggers=[{"version": logger.version} for logger in trainer.loggers],
            data=resume.data_layout(trainer, fit_loop.progress.epoch + fit_loop.progress.epoch_finished),
            ranks=dict(enumerate(strategy.all_gather_object(own))) if gather else {trainer.global_rank: own},
        )
    # As in Lightning, a weights-only checkpoint keeps the datamodule's state and hyperparameters, and what the
    # module's on_save_checkpoint adds: only the callbacks, whose state is training state, are not asked.
    datamodule = trainer.datamodule
    if datamodule is not None:
        checkpoint.update(_datamodule_state(datamodule, checkpoint), **checkpoint_entries(datamodule))
    if weights_only:
        trainer.hooks.call_module("on_save_checkpoint", checkpoint)
    else:
        trainer.hooks.call("on_save_checkpoint", checkpoint)
    return checkpoint


def _datamodule_state(datamodule: DataModule, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The datamodule's state_dict under its class's name, as Lightning keys it; nothing when it is empty, as in
    Lightning (``load_datamodule_state`` then has nothing to give back, which loses nothing)."""
    state = datamodule.state_dict()
    if not state:
        return {}
    key = type(datamodule).__qualname__
    if key in checkpoint:
        raise ValueError(
            f"the checkpoint keeps {type(datamodule).__name__}'s state_dict under its class's name, {key!r}, "
            "which is the name of another of its entries: rename the class"
        )
    return {key: state}


def refuse_nonfinite_weights(trainer: Trainer, path: str) -> None:
    """Raise a ``FloatingPointError`` (on every rank) when any rank's weights hold a NaN or an infinity: such a
    checkpoint is never saved at ``path``, and those saved before stay as they are."""
    module = trainer.lightning_module
    nonfinite = nonfinite_parameters(module) if module is not None else []
    if trainer.strategy.reduce(torch.tensor(float(len(nonfinite))), reduce_op="max") > 0:
        shown = f" ({', '.join(nonfinite[:5])}{', ...' if len(nonfinite) > 5 else ''})" if nonfinite else ""
        raise FloatingPointError(
            f"the weights hold NaN or infinite values at global step {trainer.global_step}{shown}: "
            f"{path!r} was not saved, and the checkpoints saved before are kept"
        )


def nonfinite_parameters(module: torch.nn.Module) -> list[str]:
    """The names of the parameters of ``module`` that hold a NaN or an infinity (this rank's shards only)."""
    named = [(name, local_shard(parameter.detach())) for name, parameter in module.named_parameters()]
    named = [(name, tensor) for name, tensor in named if tensor.numel() and tensor.is_floating_point()]
    if not named:
        return []
    # One norm per tensor and one read for all of them: a norm is finite exactly when every element is.
    norms = torch.stack([norm.float() for norm in torch._foreach_norm([tensor for _, tensor in named])])
    finite = torch.isfinite(norms).tolist()
    return [name for (name, _), ok in zip(named, finite) if not ok]


def resolve(trainer: Trainer, ckpt_path: str | None) -> str | None:
    """The checkpoint a stage starts from: an explicit path as it is; "last" and "best" looked up (by rank zero,
    for every rank)."""
    if ckpt_path not in ("last", "best"):
        return ckpt_path
    if ckpt_path == "best":
        _check_best_is_known(trainer)
    found = find_checkpoint(trainer, ckpt_path) if trainer.is_global_zero else None
    found = trainer.strategy.broadcast(found)
    if found is None:
        if ckpt_path == "best":  # Lightning's exception and words, then where Ember looked
            raise ValueError(
                f'`.{trainer.stage}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured to save the best '
                f"model: no best checkpoint is known (none was saved under {trainer.config.root_dir!r})"
            )
        if trainer.stage == "fit" and not lightning_names_served():
            # The first start of a script that continues its run when started again: said, not warned of.
            announce('ckpt_path="last": this run has saved no checkpoint yet, so the fit starts afresh')
            return None
        # Lightning's warning and words (its programs expect it; an evaluation then uses the module's weights as they
        # are). Pointing at the user's call: through _begin_stage, _stage, contextlib, the stage's runner and the
        # strategy's launch (and _evaluate for validate, test and predict).
        rank_zero_warn(
            f'.{trainer.stage}(ckpt_path="last") is set, but there is no last checkpoint available. No checkpoint '
            "will be loaded: this run has saved none yet",
            stacklevel=10 if trainer.stage == "fit" else 11,
        )
    elif trainer.is_global_zero:  # the line is said there alone: the other ranks need not list the directory
        announce(f"resuming from {_with_other_names(found)}")
    return found


def _with_other_names(path: str) -> str:
    """``path``, followed by the other names its file has in its directory (the top-k file that ``last.ckpt`` is a
    hard link to says which step it holds)."""
    if not os.path.isfile(path) or os.stat(path).st_nlink < 2:
        return path
    directory, name = os.path.split(path)
    # Hidden names are work in progress (a save being written, another rank's write check): they come and go
    # while this one lists the directory, as may any file that a save replaces.
    candidates = [other for other in sorted(os.listdir(directory or ".")) if other != name and other[0] != "."]
    others = [other for other in candidates if _same_file(os.path.join(directory, other), path)]
    return f"{path} (also {', '.join(others)})" if others else path


def _same_file(candidate: str, path: str) -> bool:
    try:
        return os.path.samefile(candidate, path)
    except OSError:  # gone since the directory was listed
        return False


def _check_best_is_known(trainer: Trainer) -> None:
    """Refuse "best" where no ``ModelCheckpoint`` can have chosen one, in Lightning's words."""
    stage, callbacks = trainer.stage, trainer.checkpoint_callbacks
    if not callbacks:
        raise ValueError(f'`.{stage}(ckpt_path="best")` is set but `ModelCheckpoint` is not configured.')
    if trainer.config.fast_dev_run and not callbacks[0].best_model_path:
        raise ValueError(f'You cannot execute `.{stage}(ckpt_path="best")` with `fast_dev_run=True`. Please pass an '
                         f"exact checkpoint path to `.{stage}(ckpt_path=...)`")  # fmt: skip
    if len(callbacks) > 1:
        rank_zero_warn(f'`.{stage}(ckpt_path="best")` is called with Trainer configured with multiple '
                       "`ModelCheckpoint` callbacks. It will use the best checkpoint path from first checkpoint "
                       "callback.")  # fmt: skip


def resume_from(trainer: Trainer, path: str, weights_only: bool | None) -> None:
    """Continue from a checkpoint written by ``save_checkpoint``: weights, optimizers, loop position."""
    checkpoint = trainer.strategy.load_checkpoint(path, trust_pickles=weights_only is False)
    restore_training_state(trainer, checkpoint, path)


def load_weights_into(trainer: Trainer, path: str | None, weights_only: bool | None) -> None:
    """The weights of the checkpoint at ``path`` (if any) into the module, after its ``on_load_checkpoint``, and the
    datamodule's state."""
    if path is None:
        return
    checkpoint = trainer.strategy.load_checkpoint(path, trust_pickles=weights_only is False)
    trainer.hooks.call_module("on_load_checkpoint", checkpoint)
    _load_module_weights(trainer, checkpoint, path)
    # The datamodule's state as Lightning restores it; the callbacks' stays: the ModelCheckpoint of the fit just
    # run would forget the files it kept after the loaded one.
    if trainer.datamodule is not None:
        load_datamodule_state(trainer.datamodule, checkpoint)


def restore_training_state(trainer: Trainer, checkpoint: dict[str, Any], path: str) -> None:
    """Put the module, optimizers, schedulers, callbacks, loggers, data and the loop where ``checkpoint``
    says; called once ``fit`` has built the optimizers."""
    _check_not_bare(checkpoint, path)
    if "optimizer_states" not in checkpoint:
        raise ValueError(
            f"ckpt_path={path!r} holds weights only (save_weights_only=True), so training cannot resume "
            "from it; load the weights into the module with Module.load_from_checkpoint instead"
        )
    if "pytorch-lightning_version" in checkpoint:
        raise CheckpointError(
            f"ckpt_path={path!r} was written by Lightning {checkpoint['pytorch-lightning_version']}, whose loop "
            "state Ember cannot continue; Ember reads its weights and hyperparameters: build the module with "
            "Module.load_from_checkpoint(path) and start a new fit from it (validate, test and predict take "
            "the path as it is)"
        )
    if "fit_loop" not in checkpoint.get("loops", {}):
        raise CheckpointError(
            f"ckpt_path={path!r} was written by an older Ember, whose loop state this one cannot read"
        )
    trainer.hooks.call_module("on_load_checkpoint", checkpoint)
    _load_module_weights(trainer, checkpoint, path)
    if trainer.datamodule is not None:  # before the callbacks, as Lightning
        load_datamodule_state(trainer.datamodule, checkpoint)
    trainer.hooks.call_callbacks("on_load_checkpoint", checkpoint)
    _restore_callbacks(trainer, checkpoint.get("callbacks", {}), path)
    # After the callbacks, as Lightning: a callback that replaced a scheduler (StochasticWeightAveraging) takes
    # the module's out of trainer.lr_scheduler_configs first, so that the saved state goes to none but its own.
    _restore_optimization(trainer, checkpoint, path)
    resume.resume(trainer, checkpoint, path)


def _load_module_weights(trainer: Trainer, checkpoint: dict[str, Any], path: str) -> None:
    """The checkpoint's weights into the stage's module, through its strategy, as strictly as the module's
    ``strict_loading`` says."""
    module = _module(trainer)
    load = functools.partial(trainer.strategy.load_module_state_dict, strict=module.strict_loading)
    load_weights(load, module, checkpoint, path)


def load_datamodule_state(datamodule: DataModule, checkpoint: dict[str, Any]) -> None:
    """Give ``datamodule`` the state the checkpoint keeps under its class's name (where Ember 0.1 kept it:
    under ``"datamodule"``), if any."""
    key = type(datamodule).__qualname__
    if key in checkpoint or "datamodule" in checkpoint:
        datamodule.load_state_dict(checkpoint[key if key in checkpoint else "datamodule"])


def _restore_callbacks(trainer: Trainer, saved: dict[str, Any], path: str) -> None:
    """Give each callback its saved state; warn of saved states that no callback takes (an empty one loses
    nothing), as Lightning does, naming the callbacks to add."""
    for callback in trainer.callbacks:
        if callback.state_key in saved:
            callback.load_state_dict(saved[callback.state_key])
    keys = {callback.state_key for callback in trainer.callbacks}
    missing = [key for key, state in saved.items() if state and key not in keys]
    if missing:
        rank_zero_warn(
            f"ckpt_path={path!r} holds the state of callbacks this Trainer does not have, so that state is not "
            f"restored. Please add the following callbacks: {missing}",
            stacklevel=10,  # the caller of fit
        )


def load_weights(
    load: Callable[[dict[str, Any]], None], module: Module, checkpoint: dict[str, Any], path: CheckpointSource
) -> None:
    """``load(checkpoint["state_dict"])``, or an error that says the checkpoint is another model's."""
    _check_not_bare(checkpoint, path)
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path!r} holds no model weights (no 'state_dict' entry): it is not a training checkpoint"
        )
    try:
        load(state)
    except RuntimeError as error:
        if "state_dict" not in str(error):
            raise
        details = " ".join(line.strip() for line in str(error).splitlines()[1:4])
        raise CheckpointError(
            f"{path!r} holds the weights of another model than this {type(module).__name__}: {details}"
        ) from None


def load_module_state(module: torch.nn.Module, state: dict[str, Any], strict: bool) -> None:
    """``module.load_state_dict(state, strict=strict)``; what a lenient load leaves out either side is warned about,
    in Lightning's words, so that a renamed layer is not silently left at its initial weights."""
    keys = module.load_state_dict(state, strict=strict)
    if keys.missing_keys:
        rank_zero_warn(f"Found keys that are in the model state dict but not in the checkpoint: {keys.missing_keys}")
    if keys.unexpected_keys:
        rank_zero_warn(f"Found keys that are not in the model state dict but in the checkpoint: {keys.unexpected_keys}")


def _check_not_bare(checkpoint: dict[str, Any], path: CheckpointSource) -> None:
    """A bare state_dict (what ``torch.save(model.state_dict(), path)`` writes) is no checkpoint: say what to do."""
    if checkpoint and "state_dict" not in checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        raise CheckpointError(
            f"{path!r} holds only a state_dict (parameter names and tensors), not a checkpoint Ember wrote; load it "
            "into the module with module.load_state_dict(torch.load(path))"
        )


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


def find_checkpoint(trainer: Trainer, which: str) -> str | None:
    """The checkpoint "last" or "best" names for this run, or None if there is none.

    "last" is the newest complete, verified checkpoint of this run's lineage: in the ModelCheckpoint
    ``dirpath`` the user gave and, for checkpoints that have none, in the newest version directory under
    ``trainer.runs_dir`` that holds one (in ``<default_root_dir>/checkpoints`` without a logger). Files that
    fail verification (cut short, damaged) are passed over with a warning that names them; failure
    checkpoints (non-finite weights) are never picked.
    """
    if which == "last":
        return _last(trainer)
    callback = trainer.checkpoint_callback
    if callback is not None and callback.best_model_path:
        return callback.best_model_path
    newest = _last(trainer)
    if newest is None:
        return None
    saved = checkpoint_io.load(newest, trust_pickles=False).get("callbacks", {})
    paths = [state.get("best_model_path") for key, state in saved.items() if key.startswith("ModelCheckpoint")]
    return next((path for path in paths if path and os.path.exists(path)), None)


def _last(trainer: Trainer) -> str | None:
    callbacks = trainer.checkpoint_callbacks
    directories = [callback.dirpath for callback in callbacks if callback.dirpath]
    # Checkpoints without a directory of their own (and preemption's, without a ModelCheckpoint) are in the run's
    # version directory, or in <default_root_dir>/checkpoints without a logger that keeps files.
    homeless = not callbacks or len(directories) < len(callbacks)
    versioned = bool(trainer.loggers) and isinstance(trainer.loggers[0], VersionedLogger)
    if homeless and not versioned:
        directories.append(os.path.join(trainer.default_root_dir, "checkpoints"))
    extensions = (".ckpt", *{callback.FILE_EXTENSION for callback in callbacks})  # a callback may name its own
    found = _newest_complete([path for directory in directories for path in _checkpoints_in(directory, extensions)])
    if not homeless or not versioned:
        return found
    # The run's version directory is not settled yet: the newest that holds a complete checkpoint.
    runs_dir = trainer.runs_dir
    for version in reversed(run_versions(runs_dir)):
        in_run = _newest_complete(_checkpoints_in(os.path.join(runs_dir, f"version_{version}"), extensions))
        if in_run is not None:
            return in_run if found is None else max(found, in_run, key=os.path.getmtime)
    return found


def _checkpoints_in(directory: str, extensions: tuple[str, ...]) -> list[str]:
    """The checkpoints (files and sharded directories named ``*<extension>``) under ``directory`` that "last" may
    pick."""
    found = []
    for parent, subdirectories, files in os.walk(directory):
        for name in files + subdirectories:
            # Files being written are hidden temporaries; failure checkpoints are kept for post-mortems only.
            if name.endswith(extensions) and not name.startswith(".") and FAILURE_MARK not in name:
                found.append(os.path.join(parent, name))
    return found


def _newest_complete(candidates: list[str]) -> str | None:
    """The newest of ``candidates`` that is a complete checkpoint; those passed over are named in a warning."""
    # Of a checkpoint kept under several names (a top-k file and its hard link last.ckpt), "last" names the latter.
    for path in sorted(candidates, key=lambda path: (os.path.getmtime(path), _is_last(path)), reverse=True):
        problem = _problem(path)
        if problem is None:
            return path
        # Pointing at the user's fit call: through _last, find_checkpoint, the Trainer's _resolve_checkpoint,
        # _begin_stage, _stage, contextlib, _fit and the strategy's launch, and rank_zero_warn with its wrapper.
        rank_zero_warn(f'ckpt_path="last": passing over {path!r}: {problem}', stacklevel=13)
    return None


def _is_last(path: str) -> bool:
    return os.path.basename(path).startswith("last")


def _problem(path: str) -> str | None:
    """Why ``path`` is not a complete checkpoint Ember wrote, or None if it is one."""
    if os.path.isdir(path):
        if not sharded.is_sharded(path):
            return "a directory that is not a complete sharded checkpoint"
        path = os.path.join(path, sharded.TRAINER_STATE)
    try:
        digest_checked = checkpoint_io.verify(path)
    except (OSError, CheckpointError) as error:
        return str(error)
    return None if digest_checked else "not written by Ember (it carries no digest to verify)"


def _module(trainer: Trainer) -> Module:
    module = trainer.lightning_module
    if module is None:
        raise AttributeError(  # Lightning's exception and words: a save before any stage has no module to save
            "Saving a checkpoint is only possible if a model is attached to the Trainer: call fit, validate, test or "
            "predict first"
        )
    return module
