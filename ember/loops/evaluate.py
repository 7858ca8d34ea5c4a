"""The evaluation loops: validation (alone, or inside ``fit``), test, and prediction, on one skeleton.

``EvaluationLoop.run`` is the skeleton, without gradients throughout: the module in evaluation mode, the stage's
start hooks, then each loader's batches through the step and the batch hooks, the epoch's hooks around them, and
what the stage makes of it: metrics for validation and test, the outputs for prediction (``PredictionLoop``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset

from ember._utils import apply_to_tensors, takes_batch_idx, to_floats
from ember.data import count_batches, limited
from ember.data_failures import named_failures
from ember.metrics import Number
from ember.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from ember.loops.hooks import Hooks
    from ember.trainer import Trainer

_HOOK_NAMES = {"validate": "validation", "test": "test", "predict": "predict"}
_LOADER_KINDS = {"validate": "val", "test": "test", "predict": "predict"}


class EvaluationLoop:
    """Runs ``validation_step`` or ``test_step`` over each loader without gradients, then publishes the
    epoch's metrics; returns one dict of metrics per loader."""

    def __init__(self, trainer: Trainer, stage: Literal["validate", "test", "predict"]) -> None:
        self.trainer = trainer
        self.stage = stage
        self._hook = _HOOK_NAMES[stage]  # as in validation_step, on_validation_start, ...
        #: The loaders' kind: as in ``val_dataloader``, ``limit_val_batches``, ...
        self.kind = _LOADER_KINDS[stage]
        #: The number of batches each loader contributes to a run (``math.inf``: unknown); a sanity check runs fewer.
        self.num_batches: list[float] = []
        #: Whether the loop is running (``trainer.validating``, ``trainer.evaluating``).
        self.running = False
        #: Whether the stage's loaders were passed to it (else the module or the datamodule makes them).
        self.loaders_given = False
        self._make_loaders: Callable[[], list[Iterable]] | None = None  # the stage's, to make them again
        self._remake = False

    def count(self, loaders: list[Iterable], limit: int | float | None = None) -> list[float]:
        """The batches each of ``loaders`` contributes under the Trainer's ``limit_*_batches``."""
        flag = f"limit_{self.kind}_batches"
        limit = limit if limit is not None else getattr(self.trainer.config, flag)
        return [count_batches(loader, limit, flag, self.trainer.strategy) for loader in loaders]

    def evaluate(self, make_loaders: Callable[[], list[Iterable]], given: Any, verbose: bool) -> Any:
        """``Trainer.validate`` and ``Trainer.test`` once their stage has begun, on the loaders ``make_loaders``
        makes (``given`` to the stage, or None): the metrics per loader, printed on the global-zero process when
        ``verbose``."""
        loaders = self._make(make_loaders, given)
        counts = self.count(loaders)
        if self._nothing_to_run(counts):
            return []
        results = self.run(loaders, counts)
        if verbose and self.trainer.is_global_zero:
            _print_results(self.stage, results)
        return results

    def _make(self, make_loaders: Callable[[], list[Iterable]], given: Any) -> list[Iterable]:
        self._make_loaders, self.loaders_given, self._remake = make_loaders, given is not None, False
        # As Lightning: a stage its limit turns off (0) never asks for its loaders (costly to load, or absent).
        if getattr(self.trainer.config, f"limit_{self.kind}_batches") == 0:
            return []
        return make_loaders()

    def reload(self) -> None:
        """Make the stage's loaders again once its start hooks (``on_test_start``, ...) have run: what they read has
        changed (the batch size a ``BatchSizeFinder`` found there)."""
        self._remake = True

    def _nothing_to_run(self, counts: list[float]) -> bool:
        """Whether no loader has a batch for this stage (``counts`` become ``num_batches``): as in Lightning, the
        loop is then skipped, its hooks included, and gives no results."""
        self.num_batches = counts
        return not any(counts)

    @property
    def num_sanity_batches(self) -> list[float]:
        """The batches of each loader that the sanity check of ``fit`` runs (``num_sanity_val_steps`` at most)."""
        return sanity_counts(self.num_batches, self.trainer.config.num_sanity_val_steps)

    def run(
        self, loaders: list[Iterable], counts: list[float], *, sanity_check: bool = False, fitting: bool = False
    ) -> Any:
        """Evaluate ``counts[i]`` batches of each loader (the skeleton every evaluation stage runs); a
        ``sanity_check`` runs ``num_sanity_batches`` of them and publishes no metrics. ``fitting``: a validation
        of ``fit``, which runs under ``torch.no_grad`` as Lightning's, never ``inference_mode``: tensors its hooks
        make (a pruning mask of ``ModelPruning``) are trained on afterwards, which inference tensors cannot be."""
        trainer = self.trainer
        hooks, module, hook = trainer.hooks, trainer.lightning_module, self._hook
        assert module is not None
        self.num_batches = counts
        if sanity_check:
            counts = self.num_sanity_batches
        self.running = True
        # As in Lightning, the stage's hooks run without gradients too, from the evaluation mode's to the end's.
        no_grad = _no_grad(not fitting and trainer.config.inference_mode and trainer.strategy.allows_inference_mode)
        try:
            with no_grad:
                self._begin(len(loaders))
                modes = _eval_mode(hooks, trainer.model or module, module, hook)
                hooks.call(f"on_{hook}_start")
                if self._remake and self._make_loaders is not None:
                    loaders = self._make_loaders()
                    counts = self.num_batches = self.count(loaders)
                # Checked once the start hooks have run, so that a BatchSizeFinder refuses several loaders first.
                check_dataloader_idx(module, hook, self.kind, several=len(loaders) > 1)
                arguments = _StepArguments(getattr(module, f"{hook}_step"), several=len(loaders) > 1)
                hooks.call(f"on_{hook}_epoch_start")
                for dataloader_idx, (loader, count) in enumerate(zip(loaders, counts)):
                    with hooks.scope(f"{hook}_step", dataloader_idx if len(loaders) > 1 else None):
                        self._run_loader(loader, count, dataloader_idx, arguments)
                self._end_epoch(len(loaders))
                hooks.call(f"on_{hook}_epoch_end")
                results = self._results(len(loaders), sanity_check)
                hooks.call(f"on_{hook}_end")
                _restore_mode(hooks, module, hook, modes)
            return results
        finally:
            self.running = False
            self._make_loaders, self._remake = None, False  # (fit's validations make theirs beside the loop)

    def _run_loader(self, loader: Iterable, count: float, dataloader_idx: int, arguments: _StepArguments) -> None:
        """The steps over one loader."""
        trainer = self.trainer
        strategy, hooks, hook = trainer.strategy, trainer.hooks, self._hook
        batch_start = hooks.implementations(f"on_{hook}_batch_start")
        batch_end = hooks.implementations(f"on_{hook}_batch_end")
        to_device = hooks.batch_transfer(strategy, dataloader_idx)
        step_name, extra = f"{hook}_step", arguments.hook_extra(dataloader_idx)
        loader = self._prepare(loader, dataloader_idx)
        where = f"{self.kind} dataloader {dataloader_idx}" + (f" in epoch {trainer.current_epoch}"
                                                              if self.stage != "predict" else "")  # fmt: skip
        batches = named_failures(limited(loader, count), where)
        with contextlib.closing(batches):  # closed early (a step raised), it ends the loader's workers
            for batch_idx, batch in enumerate(trainer.profiler.timed_batches(batches, self.kind)):
                self._next_batch(batch_idx)
                if to_device is not None:
                    batch = to_device(batch)
                trainer.run_metrics.eval.batch = batch  # a per-epoch mean of a logged value weighs by its size
                for hook_function in batch_start:
                    hook_function(batch, batch_idx, *extra)
                output = strategy.step(step_name, *arguments.of(batch, batch_idx, dataloader_idx))
                for hook_function in batch_end:
                    hook_function(output, batch, batch_idx, *extra)
                self._batch_done(output, dataloader_idx)

    # ---------------------------------------------------------- what validation and test make of it
    def _begin(self, loaders: int) -> None:
        self.trainer.run_metrics.eval.clear()

    def _prepare(self, loader: Iterable, dataloader_idx: int) -> Iterable:
        return loader

    def _next_batch(self, batch_idx: int) -> None:
        pass

    def _batch_done(self, output: Any, dataloader_idx: int) -> None:
        if not self.trainer.sanity_checking:  # a sanity check's values describe nothing: they are dropped
            self.trainer.run_metrics.evaluation_batch_done(dataloader_idx)

    def _end_epoch(self, loaders: int) -> None:
        # The epoch's end hooks read its values in the callback metrics, as Lightning's do.
        self.trainer.run_metrics.reduce_epoch(self.trainer.run_metrics.eval, final=False)

    def _results(self, loaders: int, sanity_check: bool) -> Any:
        """The epoch's metrics, published (a sanity check's are only read by its hooks: they describe nothing,
        and ``fit`` forgets them once the check ends)."""
        trainer = self.trainer
        metrics = trainer.run_metrics
        if sanity_check:
            metrics.reduce_epoch(metrics.eval)
            metrics.eval.clear()
            return [{} for _ in range(loaders)]
        published = metrics.publish_epoch(metrics.eval, trainer.fit_loop.logging_step, trainer.current_epoch)
        return per_dataloader(published, loaders)


class PredictionLoop(EvaluationLoop):
    """Runs ``predict_step`` over each loader; keeps the outputs (moved to the CPU) when asked, or when a
    callback (a prediction writer) wants them at the end."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__(trainer, "predict")
        #: The outputs kept so far (a list per loader when there are several).
        self.predictions: list[Any] = []
        #: Per loader, the sample indices of each batch so far.
        self.epoch_batch_indices: list[list[list[int]]] = []
        #: The sample indices of the batch being predicted (empty when the loader has no batch sampler).
        self.current_batch_indices: list[int] = []
        self._keeps = False
        self._warned_of_none = False
        self._produced: list[list[int]] | None = None  # the index lists the loader's batch sampler yielded

    def evaluate(self, make_loaders: Callable[[], list[Iterable]], given: Any, return_predictions: bool) -> Any:
        """``Trainer.predict`` once its stage has begun: the outputs, when ``return_predictions``."""
        loaders, trainer = self._make(make_loaders, given), self.trainer
        self._keeps = return_predictions or any(callback.wants_predictions for callback in trainer.callbacks)
        counts = self.count(loaders)
        if self._nothing_to_run(counts):
            return None
        predictions = self.run(loaders, counts)
        return predictions if return_predictions else None

    def _begin(self, loaders: int) -> None:
        self.predictions, self.epoch_batch_indices = [], []
        self._warned_of_none = False

    def _prepare(self, loader: Iterable, dataloader_idx: int) -> Iterable:
        self.predictions.append([])
        self.epoch_batch_indices.append([])
        loader, self._produced = _recording_indices(loader)
        return loader

    def _next_batch(self, batch_idx: int) -> None:
        if self._produced is None:  # as Lightning's: no indices known, so none listed for the loader's batches
            self.current_batch_indices = []
            return
        self.current_batch_indices = self._produced[batch_idx]
        self.epoch_batch_indices[-1].append(self.current_batch_indices)

    def _batch_done(self, output: Any, dataloader_idx: int) -> None:
        if output is None and not self._warned_of_none:  # as Lightning, once a stage (often a missing return)
            self._warned_of_none = True
            rank_zero_warn("predict returned None if it was on purpose, ignore this warning...")
        if self._keeps:
            # Kept on the device, every batch's outputs would pile up in its memory.
            self.predictions[-1].append(apply_to_tensors(output, _to_cpu))

    def _end_epoch(self, loaders: int) -> None:
        if loaders == 1:  # as Lightning gives them to prediction writers (the indices stay per loader)
            self.predictions = self.predictions[0]
        if self._keeps:
            _wait_for_copies(self.trainer.strategy.root_device)  # before the writers at the epoch's end read them

    def _results(self, loaders: int, sanity_check: bool) -> Any:
        return self.predictions


class _StepArguments:
    """What a step and the batch hooks receive: ``batch_idx`` if the step takes it, and with several loaders
    ``dataloader_idx`` (``check_dataloader_idx`` has made sure they take it)."""

    def __init__(self, step: Callable[..., Any], several: bool) -> None:
        self._with_batch_idx = takes_batch_idx(step)
        self._several = several

    def of(self, batch: Any, batch_idx: int, dataloader_idx: int) -> tuple[Any, ...]:
        if self._several:
            return batch, batch_idx, dataloader_idx
        return (batch, batch_idx) if self._with_batch_idx else (batch,)

    def hook_extra(self, dataloader_idx: int) -> tuple[int, ...]:
        return (dataloader_idx,) if self._several else ()


def _eval_mode(hooks: Hooks, model: torch.nn.Module, module: torch.nn.Module,
               hook: str) -> list[tuple[torch.nn.Module, bool]]:  # fmt: skip
    """Put the module in evaluation mode (through its ``on_<hook>_model_eval`` if it overrides it), and the
    strategy's wrappers around it (``model``, ``trainer.model``: a DDP module) too, as Lightning does; returns the
    mode each had, so that frozen parts left in evaluation mode stay there afterwards."""
    modes = [(submodule, submodule.training) for submodule in model.modules()]
    hooks.call_module(f"on_{hook}_model_eval")  # the base class's puts the module in evaluation mode
    inner = {id(submodule) for submodule in module.modules()}  # (by identity: a module may define __eq__)
    for submodule, _ in modes:
        if id(submodule) not in inner:
            submodule.training = False
    return modes


def _restore_mode(hooks: Hooks, module: torch.nn.Module, hook: str,
                  modes: list[tuple[torch.nn.Module, bool]]) -> None:  # fmt: skip
    """Back to the modes of ``_eval_mode``, the module's own through its ``on_<hook>_model_train`` if it overrides
    it (prediction has no such hook)."""
    overridden = hook != "predict" and hooks.module_hook(f"on_{hook}_model_train") is not None
    if overridden:
        hooks.call_module(f"on_{hook}_model_train")
    inner = {id(submodule) for submodule in module.modules()} if overridden else set()
    for submodule, training in modes:
        if id(submodule) not in inner:
            submodule.training = training


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
    """A copy of ``loader`` that records the sample indices of each batch (None: it has none to record)."""
    # An iterable data set's batch sampler yields placeholders, not sample indices: as Lightning, none are listed.
    if (
        not isinstance(loader, DataLoader)
        or isinstance(loader.dataset, IterableDataset)
        or loader.batch_sampler is None
    ):
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


def per_dataloader(metrics: dict[str, tuple[Number, set[int]]], count: int) -> list[dict[str, float]]:
    """The published ``metrics``, as numbers, split by the loaders that logged them (those logged outside the
    loaders' steps, in the epoch's hooks, belong to all)."""
    floats = to_floats({name: value for name, (value, _) in metrics.items()})
    return [
        {name: floats[name] for name, (_, loaders) in metrics.items() if not loaders or index in loaders}
        for index in range(count)
    ]


def check_dataloader_idx(module: torch.nn.Module, hook: str, kind: str, several: bool) -> None:
    """Refuse, as Lightning does before a stage's first batch, a step or a batch hook of the module that cannot
    take the ``dataloader_idx`` that several loaders give it, or that needs one a single loader does not give."""
    for name in (f"{hook}_step", f"on_{hook}_batch_start", f"on_{hook}_batch_end"):
        parameters = inspect.signature(getattr(module, name)).parameters
        index = parameters.get("dataloader_idx")
        takes = any(p.kind == p.VAR_POSITIONAL for p in parameters.values()) or (
            index is not None and index.kind in (index.POSITIONAL_ONLY, index.POSITIONAL_OR_KEYWORD)
        )
        where = f"`{type(module).__name__}.{name}()`"
        if several and not takes:
            raise RuntimeError(
                f"You provided multiple `{kind}_dataloader`, but no `dataloader_idx` argument in {where}. Try "
                "adding `dataloader_idx=0` to its signature."
            )
        if not several and index is not None and index.default is inspect.Parameter.empty:
            raise RuntimeError(
                f"You provided only a single `{kind}_dataloader`, but have included `dataloader_idx` in {where}. "
                "Either remove the argument or give it a default value i.e. `dataloader_idx=0`."
            )


def sanity_counts(counts: list[float], steps: int) -> list[float]:
    """The batches of each loader that a sanity check of ``steps`` batches (-1: all) runs."""
    return counts if steps == -1 else [min(count, steps) for count in counts]


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    """The results as Lightning prints them: a row per metric (named without its ``/dataloader_idx_N``) and a
    column per loader, centred, between rules as wide as the terminal (120 columns where there is none)."""
    per_loader = [{name.split("/dataloader_idx_")[0]: value for name, value in metrics.items()} for metrics in results]
    names = sorted({name for metrics in per_loader for name in metrics})
    if not names:
        return
    columns = shutil.get_terminal_size(fallback=(120, 30)).columns or 120
    headers = [f"DataLoader {index}" for index in range(len(per_loader))]
    width = int(min(max(*(len(text) for text in names + headers), 25), columns / 2))
    rule = ("─" if _can_print("─") else "-") * columns
    half = columns // 2
    per_table = max(int((columns - width) / width), 1)  # loaders beyond it go into further tables
    for start in range(0, len(headers), per_table):
        shown = per_loader[start : start + per_table]
        lines = [rule, _centred([f"{stage} metric".capitalize(), *headers[start : start + per_table]], width), rule]
        for name in names:
            cells = [str(metrics[name]) if name in metrics else " " for metrics in shown]
            last = cells
            while len(name) > half:  # a long name goes on over several lines, its values on each but the last
                lines.append(_centred([name[:half], *cells], width))
                name, last = name[half:], [" "]
            lines.append(_centred([name, *last], width))
        print("\n".join([*lines, rule]))


def _centred(cells: list[str], width: int) -> str:
    return "".join(f"{cell:^{width}}" for cell in cells).rstrip()


def _can_print(text: str) -> bool:
    """Whether stdout's encoding has ``text``'s characters (some terminals' have no box drawing)."""
    try:
        text.encode(sys.stdout.encoding or "utf-8")
    except UnicodeEncodeError:
        return False
    return True
