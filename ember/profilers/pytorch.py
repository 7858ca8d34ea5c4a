"""``PyTorchProfiler``: a ``torch.profiler`` trace of a few steps, for TensorBoard or Perfetto."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ember.exceptions import MisconfigurationException
from ember.profilers.profiler import Profiler, latest_start, run_directory
from ember.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from ember.trainer import Trainer

# The loader whose batches are the steps of each stage.
_STEP_LOADER = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}


class PyTorchProfiler(Profiler):
    """Records operator-level traces with ``torch.profiler``, the Trainer's actions marked in them.

    Steps are the batches of the stage's loader (training batches for fit). By default it skips one
    step, warms up for one and records three (``schedule`` takes a ``torch.profiler.schedule``). Each
    recorded window is written as ``<dirpath>/<stage>-rank<N>.<time>.pt.trace.json``, a Chrome trace
    that Perfetto (ui.perfetto.dev) and TensorBoard's profiler plugin open; the summary is the table of
    the operators that took the most time. ``activities`` defaults to the CPU, plus CUDA when the run
    uses a GPU; ``record_shapes``, ``profile_memory``, ``with_stack`` and the other ``profiler_kwargs``
    (``on_trace_ready``, ``with_flops``, ...) are ``torch.profiler.profile``'s. As in Lightning,
    ``export_to_chrome=False`` writes no trace, ``record_module_names`` marks each submodule's forward in the
    trace, ``sort_by_key`` orders the summary (by default the operators' own time) and ``table_kwargs`` are
    further arguments of its table; ``group_by_input_shapes`` (with ``record_shapes=True``) keeps the calls of
    each input shape apart. Used without a Trainer (``with profiler.profile("name"):``), it records everything from
    the first action to ``describe``, which writes ``<dirpath>/<filename>.pt.trace.json`` too. ``function_events``
    holds the events of the latest recording once its summary is made, as in Lightning.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = "profile",
        schedule: Callable[[int], Any] | None = None,
        activities: Iterable[torch.profiler.ProfilerActivity] | None = None,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        row_limit: int = 20,
        group_by_input_shapes: bool = False,
        export_to_chrome: bool = True,
        sort_by_key: str | None = None,
        record_module_names: bool = True,
        table_kwargs: dict[str, Any] | None = None,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath, filename)
        self.schedule = schedule
        self.activities = list(activities) if activities is not None else None
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.row_limit = row_limit
        self.group_by_input_shapes = group_by_input_shapes and record_shapes
        self.export_to_chrome = export_to_chrome
        self.sort_by_key = sort_by_key
        self.record_module_names = record_module_names
        self.table_kwargs = _checked("table_kwargs", table_kwargs or {}, torch.autograd.profiler_util.EventList.table)
        self.profiler_kwargs = _checked("profiler_kwargs", profiler_kwargs, torch.profiler.profile.__init__)
        self._module_ranges: list[torch.utils.hooks.RemovableHandle] = []
        self._profiler: torch.profiler.profile | None = None
        self._ranges: list[tuple[str, torch.profiler.record_function]] = []
        self._step_kind = "train"
        self._steps_begun = 0
        self._traces_written = 0
        self._on_its_own = False  # recording without a Trainer, from the first `start` on
        #: The events of the latest recording (Lightning's attribute), once its summary is made.
        self.function_events: torch.autograd.profiler_util.EventList | None = None

    def attach(self, trainer: Trainer, stage: str) -> None:
        if self._on_its_own and self._profiler is not None:
            # A hook the Trainer runs before the stage (configure_callbacks) started one: the stage's takes over.
            self._profiler.stop()
            self._on_its_own = False
        self._step_kind = _STEP_LOADER[stage]
        self.function_events = None
        self._steps_begun = self._traces_written = 0
        directory = run_directory(self.dirpath, trainer)
        write_trace = torch.profiler.tensorboard_trace_handler(
            directory, worker_name=f"{stage}-rank{trainer.global_rank}"
        )

        if not self.export_to_chrome:
            write_trace = None
        write_trace = self.profiler_kwargs.get("on_trace_ready", write_trace)

        def trace_ready(profiler: torch.profiler.profile) -> None:
            self._traces_written += 1
            if write_trace is not None:
                write_trace(profiler)

        activities = self.activities
        if activities is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.strategy.root_device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = self.schedule or torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1)
        self._profiler = self._new_profiler(activities, schedule, trace_ready)
        if self.record_module_names and trainer.lightning_module is not None:
            self._mark_modules(trainer.lightning_module)
        super().attach(trainer, stage)
        self._profiler.start()

    def detach(self, trainer: Trainer, stage: str) -> None:
        if self._profiler is not None:
            self._profiler.stop()
        for handle in self._module_ranges:
            handle.remove()
        self._module_ranges = []
        super().detach(trainer, stage)
        if not self._traces_written:
            rank_zero_warn(
                f"PyTorchProfiler recorded no trace of {stage}: it ran fewer steps than the schedule waits for "
                "and records; run more batches or pass a shorter torch.profiler.schedule"
            )
        self._profiler = None

    def _new_profiler(
        self, activities: list[torch.profiler.ProfilerActivity], schedule: Any, on_trace_ready: Any
    ) -> torch.profiler.profile:
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            **{name: value for name, value in self.profiler_kwargs.items() if name != "on_trace_ready"},
        )

    def start(self, action: str) -> None:
        if self._profiler is None:  # used without a Trainer, as Lightning's: it records everything until `describe`
            self._profiler = self._new_profiler(self.activities or [torch.profiler.ProfilerActivity.CPU], None, None)
            self._profiler.start()
            self._on_its_own = True
        marker = torch.profiler.record_function(action)
        marker.__enter__()
        self._ranges.append((action, marker))

    def stop(self, action: str) -> None:
        self._ranges.pop(latest_start(self._ranges, action))[1].__exit__(None, None, None)

    def _stop_on_its_own(self) -> None:
        for _, marker in reversed(self._ranges):
            marker.__exit__(None, None, None)
        self._ranges = []
        assert self._profiler is not None
        self._profiler.stop()
        if self.export_to_chrome and self.dirpath is not None:
            os.makedirs(self.dirpath, exist_ok=True)
            self._profiler.export_chrome_trace(
                os.path.join(self.dirpath, f"{self.filename or 'profile'}.pt.trace.json")
            )
        self._on_its_own = False
        self._profiler = None  # a later action starts a new recording

    def _mark_modules(self, module: torch.nn.Module) -> None:
        """Each submodule's forward as a range of its own, named as Lightning names it."""
        for name, submodule in module.named_modules():
            if name:
                label = f"[pl][module]{type(submodule).__module__}.{type(submodule).__name__}: {name}"
                self._module_ranges += [
                    submodule.register_forward_pre_hook(functools.partial(self._enter_module, label=label)),
                    submodule.register_forward_hook(functools.partial(self._exit_module, label=label)),
                ]

    def _enter_module(self, module: torch.nn.Module, inputs: Any, label: str) -> None:
        self.start(label)

    def _exit_module(self, module: torch.nn.Module, inputs: Any, output: Any, label: str) -> None:
        self.stop(label)

    def next_batch(self, kind: str) -> None:
        super().next_batch(kind)
        if kind == self._step_kind and self._profiler is not None:
            if self._steps_begun:  # the first step began when the profiler started
                self._profiler.step()
            self._steps_begun += 1

    def summary(self) -> str:
        if self._profiler is not None and self._profiler.profiler is not None:
            profiler = self._profiler
            if self._on_its_own:  # its report ends a recording made without a Trainer, the open actions with it
                self._stop_on_its_own()
            self.function_events = profiler.events()
        if not self.function_events:
            return ""
        events = self.function_events.key_averages(group_by_input_shapes=self.group_by_input_shapes)
        if not events:
            return ""
        sort_by = self.sort_by_key
        if sort_by is None:
            on_device = any(event.self_device_time_total for event in events)
            sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
        return events.table(sort_by=sort_by, row_limit=self.row_limit, **self.table_kwargs)


def _checked(argument: str, given: dict[str, Any], function: Callable[..., Any]) -> dict[str, Any]:
    """``given``, or an error naming the keys that ``function`` does not take (the profiler's own arguments)."""
    taken = set(inspect.signature(function).parameters) - {"self", "sort_by", "row_limit", "schedule", "activities"}
    unknown = sorted(set(given) - taken)
    if unknown:
        raise MisconfigurationException(
            f"PyTorchProfiler({argument}) does not take {unknown}: choose among {sorted(taken)} (sort_by, row_limit, "
            "schedule and activities are PyTorchProfiler's own arguments)"
        )
    return given
