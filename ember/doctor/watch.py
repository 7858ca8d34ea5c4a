"""The doctor's watcher: instruments torch while a run is watched, filling ``Measurements``.

A few torch entry points are wrapped: optimizer steps (a post-step hook), DataLoader iteration, the
calls that copy a tensor's value to the host, DistributedDataParallel and DistributedSampler. All of
it goes through one ``Patches`` and is undone at the end, so an ordinary run pays nothing for the doctor.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ember.doctor.measurements import Measurements
from ember.doctor.probe import graph_tensors
from ember.instrument import Patches

_TORCH_DIR = os.path.dirname(torch.__file__)
_EMBER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Wrapper = Callable[..., Any]


class Watcher:
    """Instruments torch from ``install`` to ``uninstall``. Optimizer steps ``warmup + 1`` to ``steps`` form
    the measured window; ``on_last_step`` is called after step ``steps``."""

    def __init__(self, steps: int, warmup: int, on_last_step: Callable[[], None]) -> None:
        self.steps = steps
        self.measurements = Measurements(warmup=warmup)
        self.measuring = False
        #: The tensors with an autograd graph alive when the window began (by id).
        self.graph_tensors_at_start: set[int] = set()
        self.ddp_models: weakref.WeakSet[Any] = weakref.WeakSet()
        self._on_last_step = on_last_step
        self._window_start = 0.0
        self._local = threading.local()
        self._patches = Patches()

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        self._patches.on_undo(register_optimizer_step_post_hook(self._after_step).remove)
        self._patches.wrap(_BaseDataLoaderIter, "__next__", self._timed_next)
        for owner, name, waits, label in _SYNC_CALLS:
            self._patches.wrap(owner, name, functools.partial(self._counted, waits=waits, label=label))
        self._watch_distributed()

    def uninstall(self) -> None:
        self._patches.undo()

    def end_window(self) -> None:
        """Stop measuring; fill the figures of the window's end."""
        m = self.measurements
        if self.measuring:
            m.window_seconds = time.perf_counter() - self._window_start
        self.measuring = False
        m.measured_steps = max(0, min(m.steps_seen, self.steps) - m.warmup)
        m.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        m.ddp_models = len(self.ddp_models)
        m.ddp_models_searching_unused = sum(1 for ddp in self.ddp_models if ddp.find_unused_parameters)

    # ---------------------------------------------------------------------------------- steps
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        m = self.measurements
        m.steps_seen += 1
        # From the first step on: a compiled forward recompiles for the mode, which must happen in the warm-up.
        if m.steps_seen == 1 and any(_on_accelerator(p) for group in optimizer.param_groups for p in group["params"]):
            self._watch_masks()
        if m.steps_seen == m.warmup:
            gc.collect()
            self.graph_tensors_at_start = {id(tensor) for tensor in graph_tensors()}
            self._window_start = time.perf_counter()
            self.measuring = True
        elif self.measuring:
            for ddp in self.ddp_models:
                if ddp.find_unused_parameters and any(
                    p.requires_grad and p.grad is None for p in ddp.module.parameters()
                ):
                    m.all_parameters_used = False
        if m.steps_seen == self.steps:
            self._on_last_step()

    # ---------------------------------------------------------------------------------- loaders
    def _timed_next(self, original: Wrapper) -> Wrapper:
        m = self.measurements

        def timed_next(iterator: Any) -> Any:
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                return original(iterator)
            finally:
                if self.measuring:
                    m.data_wait += time.perf_counter() - start
                    m.data_cpu += time.thread_time() - cpu_start
                    persistent = bool(getattr(iterator, "_persistent_workers", False))
                    m.loaders[(iterator._num_workers, iterator._pin_memory, persistent)] += 1

        return timed_next

    # ------------------------------------------------------------------------------- host syncs
    def _counted(
        self, original: Wrapper, waits: Callable[[tuple[Any, ...], dict[str, Any]], bool], label: str
    ) -> Wrapper:
        """``original``, counting the calls from the user's code for which ``waits(args, kwargs)`` says that
        the host waits for the device."""
        m, local = self.measurements, self._local

        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.measuring or getattr(local, "inside", False) or not waits(args, kwargs):
                return original(*args, **kwargs)  # not measuring, nested (print calls tolist), or no wait
            local.inside = True
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                local.inside = False
                where = _user_frame(direct=True)  # torch's own reads inside its functions do not count
                if where is not None:
                    m.syncs[f"{where} ({label})"] += 1
                    m.sync_seconds += time.perf_counter() - start

        return counted

    def _watch_masks(self) -> None:
        """Count ``tensor[mask]`` in the measured window. ``Tensor.__getitem__`` cannot be wrapped (see
        ``_SYNC_CALLS``), but a torch function mode sees it; the mode costs about a microsecond per torch
        call, so it is entered for device runs only, where masks wait for the device."""
        mode = _MaskWatch(self)
        mode.__enter__()
        self._patches.on_undo(lambda: mode.__exit__(None, None, None))

    def count_mask(self, args: tuple[Any, ...], seconds: float) -> None:
        """``Tensor.__getitem__(*args)`` took ``seconds``: a host sync if it indexed a device tensor by a mask."""
        if self.measuring and _masks(args):
            where = _user_frame(direct=True, depth=3)  # above this method and the mode's handler
            if where is not None:
                self.measurements.syncs[f"{where} (boolean mask)"] += 1
                self.measurements.sync_seconds += seconds

    # -------------------------------------------------------------------------------- distributed
    def _watch_distributed(self) -> None:
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DistributedSampler

        self._patches.wrap(DistributedDataParallel, "__init__", self._ddp_init)
        self._patches.wrap(DistributedDataParallel, "forward", self._ddp_forward)
        # Where DDP searches the graph for unused parameters, when this torch has it as a method of its own.
        if "_post_forward" in vars(DistributedDataParallel):
            self._patches.wrap(DistributedDataParallel, "_post_forward", self._ddp_post_forward)
        self._patches.wrap(DistributedSampler, "__iter__", self._sampler_iter)

    def _ddp_init(self, original: Wrapper) -> Wrapper:
        def init(ddp: Any, *args: Any, **kwargs: Any) -> None:
            original(ddp, *args, **kwargs)
            self.ddp_models.add(ddp)
            self._patches.on_undo(ddp.module.register_forward_pre_hook(self._check_bare_forward).remove)

        return init

    def _ddp_forward(self, original: Wrapper) -> Wrapper:
        m, local = self.measurements, self._local

        def forward(ddp: Any, *args: Any, **kwargs: Any) -> Any:
            if self.measuring and torch.is_grad_enabled() and ddp.require_backward_grad_sync:
                m.syncing_forwards += 1
            local.in_ddp = getattr(local, "in_ddp", 0) + 1  # the wrapped module's forward runs inside: not bare
            try:
                return original(ddp, *args, **kwargs)
            finally:
                local.in_ddp -= 1

        return forward

    def _ddp_post_forward(self, original: Wrapper) -> Wrapper:
        m = self.measurements

        def post_forward(ddp: Any, output: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(ddp, output)
            finally:
                if self.measuring and ddp.find_unused_parameters:
                    m.unused_search_seconds += time.perf_counter() - start

        return post_forward

    def _check_bare_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not getattr(self._local, "in_ddp", 0):
            self.measurements.bare_forwards[_user_frame() or type(module).__name__] += 1

    def _sampler_iter(self, original: Wrapper) -> Wrapper:
        m = self.measurements

        def iterate(sampler: Any) -> Any:
            if sampler.shuffle:  # without shuffling, the epoch changes nothing
                m.sampler_epochs.setdefault(id(sampler), []).append(sampler.epoch)
            return original(sampler)

        return iterate


# ------------------------------------------------------------------------------------ host syncs
def _on_accelerator(tensor: Any) -> bool:
    """Whether ``tensor`` lives on a device the host must wait for (a CPU tensor's value is at hand)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cpu", "meta")


def _reads_value(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return _on_accelerator(args[0] if args else kwargs.get("input"))


def _copies_to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``tensor.to(...)`` of a device tensor to the CPU (the target given as a device, or as a tensor)."""
    target = kwargs.get("device", next((arg for arg in args[1:] if isinstance(arg, (str, torch.device))), None))
    if target is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
        target = args[1].device
    return _on_accelerator(args[0]) and target is not None and torch.device(target).type == "cpu"


def _masks(args: tuple[Any, ...]) -> bool:
    """``tensor[mask]`` of a device tensor with a boolean mask: the result's size depends on the mask's values."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return _on_accelerator(args[0]) and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _always(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return True


class _MaskWatch(TorchFunctionMode):
    """Tells the watcher of every ``Tensor.__getitem__`` (other torch calls pass straight through)."""

    def __init__(self, watcher: Watcher) -> None:
        super().__init__()
        self.watcher = watcher

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is not torch.Tensor.__getitem__ or torch.compiler.is_compiling():
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.watcher.count_mask(args, time.perf_counter() - start)


# Calls that make the host wait for the device, when ``waits(args, kwargs)`` says so: (owner, name, waits, label).
# Those that hand a device tensor's value to Python, copy it to the CPU, or give a result whose size depends on
# its values (nonzero); and explicit synchronisation. ``Tensor.__getitem__`` (boolean masks) is watched by a
# torch function mode instead (``_MaskWatch``): setting it on ``torch.Tensor`` gives the class a sequence slot
# that undoing cannot remove, after which ``torch.tensor([a_tensor, ...])`` fails for the rest of the process.
_SYNC_CALLS: list[tuple[Any, str, Callable[[tuple[Any, ...], dict[str, Any]], bool], str]] = [
    *((torch.Tensor, name, _reads_value, name) for name in ("item", "tolist", "cpu", "numpy", "nonzero",
                                                             "__bool__", "__float__", "__int__", "__format__",
                                                             "__repr__")),
    (torch.Tensor, "to", _copies_to_cpu, "to the CPU"),
    (torch, "nonzero", _reads_value, "nonzero"),
    (torch.cuda, "synchronize", _always, "synchronize"),
    (torch.cuda, "empty_cache", _always, "empty_cache"),
]  # fmt: skip


def _user_frame(direct: bool = False, depth: int = 2) -> str | None:
    """``file:line`` of the code that made the call being watched, outside torch and Ember.

    None if Ember made it (its reads happen at log time, by design) or, with ``direct``, if torch's
    own code made it on the user's behalf. Called from a wrapper or a hook: the frame ``depth`` above
    is the one that called it.
    """
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_EMBER_DIR):
            return None
        if not filename.startswith(_TORCH_DIR) and not filename.startswith("<"):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        if direct:
            return None
        frame = frame.f_back
    return None
