"""The evaluation loops: validation (alone, or inside ``fit``), test, and prediction."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import DataLoader

from ember._utils import apply_to_tensors
from ember.data import count_batches, loader_batches, named_failures
from ember.loops.step import takes_batch_idx
from ember.metrics import to_floats

if TYPE_CHECKING:
    from ember.loops.hooks import Hooks
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
        #: Whether the loop is running (``trainer.validating``, ``trainer.evaluating``).
        self.running = False

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
        self.running = True
        try:
            return self._run(loaders, counts, sanity_check)
        finally:
            self.running = False

    def _run(self, loaders: list[Iterable], counts: list[float], sanity_check: bool) -> list[dict[str, float]]:
        trainer = self.trainer
        module, hooks, metrics = trainer.lightning_module, trainer.hooks, trainer.run_metrics
        assert module is not None
        store = metrics.eval
        store.clear()
        store.default_on_step = False
        previous, metrics.active = metrics.active, store
        self.num_batches = counts
        modes = _eval_mode(hooks, module, self._hook)
        hooks.call(f"on_{self._hook}_start")
        step = getattr(module, f"{self._hook}_step")
        arguments = _StepArguments(step, several=len(loaders) > 1)
        with _no_grad(trainer.config.inference_mode and trainer.strategy.allows_inference_mode):
            hooks.call(f"on_{self._hook}_epoch_start")
            for dataloader_idx, (loader, count) in enumerate(zip(loaders, counts)):
                store.name_suffix = f"/dataloader_idx_{dataloader_idx}" if len(loaders) > 1 else ""
                self._run_loader(loader, count, dataloader_idx, arguments)
            store.name_suffix = ""
            hooks.call(f"on_{self._hook}_epoch_end")
        if sanity_check:
            store.clear()  # a sanity check's values describe nothing
            published = {}
        else:
            published = metrics.publish_epoch(store, trainer.fit_loop.logging_step, trainer.current_epoch)
        hooks.call(f"on_{self._hook}_end")
        metrics.active = previous
        _restore_mode(hooks, module, self._hook, modes)
        return per_dataloader(to_floats(published), len(loaders))

    def _run_loader(self, loader: Iterable, count: float, dataloader_idx: int, arguments: _StepArguments) -> None:
        """The steps over one loader."""
        trainer = self.trainer
        strategy, store, hooks = trainer.strategy, trainer.run_metrics.eval, trainer.hooks
        batch_start = hooks.implementations(f"on_{self._hook}_batch_start")
        batch_end = hooks.implementations(f"on_{self._hook}_batch_end")
        to_device = hooks.batch_transfer(strategy, dataloader_idx)
        step_name = f"{self._hook}_step"
        kind = "val" if self.stage == "validate" else "test"
        extra = arguments.hook_extra(dataloader_idx)
        where = f"{kind} dataloader {dataloader_idx} in epoch {trainer.current_epoch}"
        batches = named_failures(limited(loader, count), where)
        with contextlib.closing(batches):  # closed early (a step raised), it ends the loader's workers
            for batch_idx, batch in enumerate(trainer.profiler.timed_batches(batches, kind)):
                if to_device is not None:
                    batch = to_device(batch)
                store.batch = batch
                for hook in batch_start:
                    hook(batch, batch_idx, *extra)
                output = strategy.step(step_name, *arguments.of(batch, batch_idx, dataloader_idx))
                for hook in batch_end:
                    hook(output, batch, batch_idx, *extra)


class _StepArguments:
    """What a step and the batch hooks receive: ``batch_idx`` if the step takes it, and with several loaders
    ``dataloader_idx`` if the step takes a third argument (the hooks then always get it)."""

    def __init__(self, step: Callable[..., Any], several: bool) -> None:
        self._with_index = several and takes_dataloader_idx(step)
        self._with_batch_idx = takes_batch_idx(step)
        self._several = several

    def of(self, batch: Any, batch_idx: int, dataloader_idx: int) -> tuple[Any, ...]:
        if self._with_index:
            return batch, batch_idx, dataloader_idx
        return (batch, batch_idx) if self._with_batch_idx else (batch,)

    def hook_extra(self, dataloader_idx: int) -> tuple[int, ...]:
        return (dataloader_idx,) if self._several else ()


def _eval_mode(hooks: Hooks, module: torch.nn.Module, hook: str) -> list[tuple[torch.nn.Module, bool]]:
    """Put the module in evaluation mode (through its ``on_<hook>_model_eval`` if it overrides it); returns
    the mode each submodule had, so that frozen parts left in evaluation mode stay there afterwards."""
    modes = [(submodule, submodule.training) for submodule in module.modules()]
    own = hooks.module_hook(f"on_{hook}_model_eval")
    if own is not None:
        own()
    else:
        module.eval()
    return modes


def _restore_mode(hooks: Hooks, module: torch.nn.Module, hook: str | None,
                  modes: list[tuple[torch.nn.Module, bool]]) -> None:  # fmt: skip
    """Back to the modes of ``_eval_mode`` (or what the module's ``on_<hook>_model_train`` does)."""
    own = hooks.module_hook(f"on_{hook}_model_train") if hook is not None else None
    if own is not None:
        own()
        return
    for submodule, training in modes:
        submodule.training = training


class PredictionLoop:
    """Runs ``predict_step`` over each loader; keeps the outputs (moved to the CPU) when asked, or when a
    callback (a prediction writer) wants them at the end."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        #: The number of batches each loader contributes to the run in progress (``math.inf``: unknown).
        self.num_batches: list[float] = []
        #: The outputs kept so far (a list per loader when there are several).
        self.predictions: list[Any] = []
        #: Per loader, the sample indices of each batch so far.
        self.epoch_batch_indices: list[list[list[int]]] = []
        #: The sample indices of the batch being predicted (empty when the loader has no batch sampler).
        self.current_batch_indices: list[int] = []

    def run(self, loaders: list[Iterable], return_predictions: bool) -> list[Any] | None:
        trainer = self.trainer
        module, hooks = trainer.lightning_module, trainer.hooks
        assert module is not None
        limit = trainer.config.limit_predict_batches
        self.num_batches = [count_batches(loader, limit, "limit_predict_batches") for loader in loaders]
        arguments = _StepArguments(module.predict_step, several=len(loaders) > 1)
        keep = return_predictions or any(callback.wants_predictions for callback in trainer.callbacks)
        self.predictions, self.epoch_batch_indices = [], []
        modes = _eval_mode(hooks, module, "predict")
        hooks.call("on_predict_start")
        with _no_grad(trainer.config.inference_mode and trainer.strategy.allows_inference_mode):
            hooks.call("on_predict_epoch_start")
            for dataloader_idx, (loader, count) in enumerate(zip(loaders, self.num_batches)):
                outputs: list[Any] = []
                indices: list[list[int]] = []
                self.predictions.append(outputs)
                self.epoch_batch_indices.append(indices)
                self._run_loader(loader, count, dataloader_idx, arguments, outputs if keep else None, indices)
            if len(loaders) == 1:  # as Lightning gives them to prediction writers (the indices stay per loader)
                self.predictions = self.predictions[0]
            if keep:
                _wait_for_copies(trainer.strategy.root_device)  # before the writers at the epoch's end read them
            hooks.call("on_predict_epoch_end")
        hooks.call("on_predict_end")
        _restore_mode(hooks, module, None, modes)  # prediction has no hook of its own for this
        return self.predictions if return_predictions else None

    def _run_loader(self, loader: Iterable, count: float, dataloader_idx: int, arguments: _StepArguments,
                    outputs: list[Any] | None, indices: list[list[int]]) -> None:  # fmt: skip
        trainer = self.trainer
        strategy, hooks = trainer.strategy, trainer.hooks
        batch_start = hooks.implementations("on_predict_batch_start")
        batch_end = hooks.implementations("on_predict_batch_end")
        to_device = hooks.batch_transfer(strategy, dataloader_idx)
        extra = arguments.hook_extra(dataloader_idx)
        loader, produced = _recording_indices(loader)
        batches = named_failures(limited(loader, count), f"predict dataloader {dataloader_idx}")
        with contextlib.closing(batches):  # closed early (a step raised), it ends the loader's workers
            for batch_idx, batch in enumerate(trainer.profiler.timed_batches(batches, "predict")):
                self.current_batch_indices = produced[batch_idx] if produced is not None else []
                indices.append(self.current_batch_indices)
                if to_device is not None:
                    batch = to_device(batch)
                for hook in batch_start:
                    hook(batch, batch_idx, *extra)
                output = strategy.step("predict_step", *arguments.of(batch, batch_idx, dataloader_idx))
                for hook in batch_end:
                    hook(output, batch, batch_idx, *extra)
                if outputs is not None:
                    # Kept on the device, every batch's outputs would pile up in its memory.
                    outputs.append(apply_to_tensors(output, _to_cpu))


class _RecordingBatchSampler:
    """Yields the wrapped batch sampler's index lists and keeps them, in order, for prediction writers."""

    def __init__(self, inner: Iterable[list[int]]) -> None:
        self.inner = inner
        self.produced: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.produced.clear()
        for indices in self.inner:
            self.produced.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


def _recording_indices(loader: Iterable) -> tuple[Iterable, list[list[int]] | None]:
    """A copy of ``loader`` that records the sample indices of each batch (None: it has no batch sampler)."""
    if not isinstance(loader, DataLoader) or loader.batch_sampler is None:
        return loader, None
    recorder = _RecordingBatchSampler(loader.batch_sampler)
    recording = copy.copy(loader)
    # DataLoader forbids assigning a batch sampler after construction; the copy is not shared with anyone.
    object.__setattr__(recording, "batch_sampler", recorder)
    object.__setattr__(recording, "_iterator", None)
    return recording, recorder.produced


def _to_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("cpu", non_blocking=True) if tensor.device.type != "cpu" else tensor


def _wait_for_copies(device: torch.device) -> None:
    """Wait for the copies ``_to_cpu`` started: until then the predictions' values are not there."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    batches = loader_batches(loader)
    return batches if math.isinf(count) else islice(batches, int(count))
