"""What a stage run by workers that the strategy started from inside the caller (``ddp_spawn``, ...) brings back
to the caller's Trainer and module: rank zero's fitted weights, callback metrics, loop position, checkpoint paths,
run directory and status. The caller's copies never ran the stage; the code after it reads them as if they had."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from ember._utils import apply_to_tensors
from ember.trainer_state import TrainerStatus

if TYPE_CHECKING:
    from ember.callbacks import ModelCheckpoint
    from ember.module import Module
    from ember.trainer import Trainer

#: What a ModelCheckpoint knows of the files it wrote (``best_model_path`` is what ``ckpt_path="best"`` loads).
_CHECKPOINT_FACTS = ("dirpath", "best_model_path", "best_model_score", "best_k_models", "kth_best_model_path",
                     "kth_value", "current_score", "last_model_path")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Collected:
    stage: str
    status: TrainerStatus
    weights: dict[str, torch.Tensor] | None  # after fit only: evaluation changes no weights
    callback_metrics: dict[str, torch.Tensor]
    progress: dict[str, Any]
    checkpoints: list[dict[str, Any]]
    versions: list[int | str]


class StageResults:
    """Collects a stage's results on rank zero's worker and hands them to the caller's Trainer and ``module``."""

    def __init__(self, trainer: Trainer, module: Module, stage: str) -> None:
        self.trainer = trainer
        self.module = module
        self.stage = stage

    def collect(self) -> _Collected:
        trainer = self.trainer
        assert trainer.state.fn is not None  # the stage has run
        fitted = trainer.state.fn == "fit"
        return _Collected(
            stage=trainer.state.fn.value,
            status=trainer.state.status,
            weights=_on_cpu(trainer.strategy.module_state_dict()) if fitted else None,
            callback_metrics=_on_cpu(trainer.callback_metrics),
            progress=trainer.fit_loop.progress.state_dict(),
            checkpoints=[_facts(callback) for callback in trainer.checkpoint_callbacks],
            versions=[logger.version for logger in trainer.loggers],
        )

    def adopt(self, collected: _Collected) -> None:
        trainer = self.trainer
        if collected.weights is not None:
            # As Lightning does: the module's layers may differ in the workers (configure_model builds them there).
            self.module.load_state_dict(collected.weights, strict=False)
        trainer.lightning_module = self.module  # validate/test/predict without a module run the fitted one
        trainer.run_metrics.adopt(collected.callback_metrics)
        trainer.fit_loop.progress.load_state_dict(collected.progress)
        for callback, facts in zip(trainer.checkpoint_callbacks, collected.checkpoints):
            for name, value in facts.items():
                setattr(callback, name, value)
        for logger, version in zip(trainer.loggers, collected.versions):
            logger.use_version(version)  # trainer.log_dir is the workers' run directory, not a new one
        trainer.state.begin(collected.stage)
        trainer.state.end(interrupted=collected.status != TrainerStatus.FINISHED)

    def fail(self) -> None:
        # As Lightning's caller, which ran the stage's entry point too: the stage ended with an exception.
        self.trainer.state.begin(self.stage)
        self.trainer.state.end(interrupted=True)


def _facts(callback: ModelCheckpoint) -> dict[str, Any]:
    # On the CPU, as the rest: a CUDA tensor unpickled in the caller would start CUDA there.
    return apply_to_tensors({name: getattr(callback, name) for name in _CHECKPOINT_FACTS}, _cpu)


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return apply_to_tensors(tensors, _cpu)


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu()
