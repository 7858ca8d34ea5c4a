"""The evaluation loops: validation (alone, or inside ``fit``), test, and prediction."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

import torch

from ember._utils import apply_to_tensors
from ember.data import count_batches, named_failures
from ember.metrics import to_floats

if TYPE_CHECKING:
    from ember.trainer import Trainer


class EvaluationLoop:
    """Runs ``validation_step`` or ``test_step`` over each loader without gradients, then publishes the
    epoch's metrics; returns one dict of metrics per loader."""

    def __init__(self, trainer: Trainer, stage: Literal["validate", "test"]) -> None:
        self.trainer = trainer
        self.stage = stage
        self._hook = "validation" if stage == "validate" else "test"
        #: The number of batches each loader contributes to the run in progress (``math.inf``: unknown).
        self.num_batches: list[float] = []

    def count(self, loaders: list[Iterable], limit: int | float | None = None) -> list[float]:
        """The batches each of ``loaders`` contributes under the Trainer's ``limit_*_batches``."""
        config = self.trainer.config
        flag = "limit_val_batches" if self.stage == "validate" else "limit_test_batches"
        limit = limit if limit is not None else getattr(config, flag)
        return [count_batches(loader, limit, flag) for loader in loaders]

    def run(
        self, loaders: list[Iterable], counts: list[float], *, sanity_check: bool = False
    ) -> list[dict[str, float]]:
        """Evaluate ``counts[i]`` batches of each loader; a ``sanity_check`` publishes no metrics."""
        trainer = self.trainer
        module, hooks, metrics = trainer.lightning_module, trainer.hooks, trainer.run_metrics
        assert module is not None
        store = metrics.eval
        store.clear()
        store.default_on_step = False
        previous, metrics.active = metrics.active, store
        self.num_batches = counts
        was_training = module.training
        module.eval()
        if self.stage == "validate":
            hooks.call_callbacks("on_validation_start")
        pass_index = len(loaders) > 1 and takes_dataloader_idx(getattr(module, f"{self._hook}_step"))
        with _no_grad(trainer.config.inference_mode and trainer.strategy.allows_inference_mode):
            hooks.call(f"on_{self._hook}_epoch_start")
            for dataloader_idx, (loader, count) in enumerate(zip(loaders, counts)):
                store.name_suffix = f"/dataloader_idx_{dataloader_idx}" if len(loaders) > 1 else ""
                self._run_loader(loader, count, dataloader_idx, pass_index)
            store.name_suffix = ""
            hooks.call(f"on_{self._hook}_epoch_end")
        if sanity_check:
            store.clear()  # a sanity check's values describe nothing
            published = {}
        else:
            published = metrics.publish_epoch(store, trainer.global_step, trainer.current_epoch)
        if self.stage == "validate":
            hooks.call_callbacks("on_validation_end")
        metrics.active = previous
        module.train(was_training)
        return per_dataloader(to_floats(published), len(loaders))

    def _run_loader(self, loader: Iterable, count: float, dataloader_idx: int, pass_index: bool) -> None:
        """The steps over one loader (given its index when ``pass_index``: there are several)."""
        trainer = self.trainer
        strategy, store, hooks = trainer.strategy, trainer.run_metrics.eval, trainer.hooks
        batch_end = hooks.implementations(f"on_{self._hook}_batch_end", include_module=False)
        step_name = f"{self._hook}_step"
        kind = "val" if self.stage == "validate" else "test"
        named = named_failures(limited(loader, count), f"{kind} dataloader {dataloader_idx}")
        for batch_idx, batch in enumerate(trainer.profiler.timed_batches(named, kind)):
            batch = strategy.batch_to_device(batch)
            store.batch = batch
            args = (batch, batch_idx, dataloader_idx) if pass_index else (batch, batch_idx)
            output = strategy.step(step_name, *args)
            for hook in batch_end:
                hook(output, batch, batch_idx, dataloader_idx)


class PredictionLoop:
    """Runs ``predict_step`` over each loader; keeps the outputs (moved to the CPU) when asked."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        #: The number of batches each loader contributes to the run in progress (``math.inf``: unknown).
        self.num_batches: list[float] = []

    def run(self, loaders: list[Iterable], return_predictions: bool) -> list[Any] | None:
        trainer = self.trainer
        module, strategy, hooks = trainer.lightning_module, trainer.strategy, trainer.hooks
        assert module is not None
        limit = trainer.config.limit_predict_batches
        self.num_batches = [count_batches(loader, limit, "limit_predict_batches") for loader in loaders]
        pass_index = len(loaders) > 1 and takes_dataloader_idx(module.predict_step)
        batch_end = hooks.implementations("on_predict_batch_end", include_module=False)
        predictions: list[list[Any]] = []
        module.eval()
        with _no_grad(trainer.config.inference_mode and trainer.strategy.allows_inference_mode):
            hooks.call("on_predict_epoch_start")
            for dataloader_idx, (loader, count) in enumerate(zip(loaders, self.num_batches)):
                outputs = []
                named = named_failures(limited(loader, count), f"predict dataloader {dataloader_idx}")
                for batch_idx, batch in enumerate(trainer.profiler.timed_batches(named, "predict")):
                    batch = strategy.batch_to_device(batch)
                    args = (batch, batch_idx, dataloader_idx) if pass_index else (batch, batch_idx)
                    output = strategy.step("predict_step", *args)
                    for hook in batch_end:
                        hook(output, batch, batch_idx, dataloader_idx)
                    if return_predictions:
                        # Kept on the device, every batch's outputs would pile up in its memory.
                        outputs.append(apply_to_tensors(output, _to_cpu))
                predictions.append(outputs)
            hooks.call("on_predict_epoch_end")
        if not return_predictions:
            return None
        if strategy.root_device.type == "cuda":
            torch.cuda.synchronize(strategy.root_device)  # the copies to the CPU were not waited for
        return predictions if len(loaders) > 1 else predictions[0]


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", non_blocking=True) if tensor.device.type != "cpu" else tensor


def _no_grad(inference_mode: bool) -> Any:
    return torch.inference_mode() if inference_mode else torch.no_grad()


def per_dataloader(metrics: dict[str, float], count: int) -> list[dict[str, float]]:
    """``metrics`` split by the loader they belong to (names without a loader suffix belong to all)."""
    split: list[dict[str, float]] = [{} for _ in range(count)]
    for name, value in metrics.items():
        _, marker, index = name.partition("/dataloader_idx_")
        for position, loader_metrics in enumerate(split):
            if not marker or int(index) == position:
                loader_metrics[name] = value
    return split


def takes_dataloader_idx(step: Callable[..., Any]) -> bool:
    """Whether a step accepts a third argument: with several loaders it then receives their index."""
    parameters = inspect.signature(step).parameters.values()
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def limited(loader: Iterable, count: float) -> Iterator[Any]:
    return iter(loader) if math.isinf(count) else islice(loader, int(count))
