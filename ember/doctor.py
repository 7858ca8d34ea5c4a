"""The speed doctor: watch a few training steps, then say what slows them down and how to fix it.

``ember doctor script.py`` runs a script (an Ember one or a hand-written PyTorch loop) for a bounded
number of optimizer steps; ``Trainer(doctor=True)`` watches the first steps of a run and goes on.
While it watches, a few torch entry points are wrapped (optimizer steps, DataLoader iteration, the
calls that copy a tensor's value to Python, DistributedDataParallel); the wrappers are removed
afterwards, so an ordinary run pays nothing for the doctor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from ember.loops.step import StepRunner

if TYPE_CHECKING:
    from ember.trainer import Trainer

_TORCH_DIR = os.path.dirname(torch.__file__)
_EMBER_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclasses.dataclass
class Finding:
    """One thing that slows training (or makes it wrong), with the numbers behind it and the fix."""

    id: str
    title: str
    measured: str
    why: str
    fix: str
    #: The share of step time the fix should save (None when the finding is about correctness or memory).
    estimated_gain: float | None = None
    locations: list[str] = dataclasses.field(default_factory=list)


class DoctorDone(BaseException):
    """The doctor has watched enough steps: ends the script ``ember doctor`` runs (not an error)."""


_active: Doctor | None = None


def active_doctor() -> Doctor | None:
    return _active


class Doctor:
    """Instruments torch for ``steps`` optimizer steps (the first ``warmup`` are not measured).

    With ``stop=True`` it raises ``DoctorDone`` after the report (for ``ember doctor``); otherwise it
    just removes its instrumentation and training goes on.
    """

    def __init__(self, steps: int = 30, warmup: int = 5, stop: bool = False, as_json: bool = False) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= warmup:
            raise ValueError(f"the doctor needs more than {warmup} steps to measure; got steps={steps!r}")
        self.steps, self.warmup, self.stop, self.as_json = steps, warmup, stop, as_json
        self.trainer: Trainer | None = None
        self.step_count = 0
        self.measuring = False
        self.window_start = self.window_seconds = 0.0
        self.data_wait = 0.0
        self.data_cpu = 0.0  # of which this thread computed (the rest it slept or waited for I/O)
        self.loaders: Counter[tuple[int, bool, bool]] = Counter()  # (num_workers, pin_memory, persistent)
        self.syncs: Counter[str] = Counter()
        self.sync_seconds = 0.0
        self.graph_tensors_at_start: set[int] = set()
        self.ddp_models: weakref.WeakSet = weakref.WeakSet()
        self.bare_forwards: Counter[str] = Counter()
        self.syncing_forwards = 0
        self.unused_search_seconds = 0.0
        self.all_parameters_used = True
        self.sampler_epochs: dict[int, list[int]] = {}
        self.report_text = ""
        self._local = threading.local()
        self._restore: list[Callable[[], None]] = []
        self._findings: list[Finding] | None = None

    # --------------------------------------------------------------------------- instrumenting
    def install(self) -> Doctor:
        global _active
        if _active is not None:
            raise RuntimeError("a doctor is already watching this process")
        _active = self
        from torch.optim.optimizer import register_optimizer_step_post_hook

        handle = register_optimizer_step_post_hook(self._after_step)
        self._restore.append(handle.remove)
        self._wrap_loaders()
        self._wrap_syncs()
        self._wrap_distributed()
        return self

    def uninstall(self) -> None:
        global _active
        while self._restore:
            self._restore.pop()()
        if _active is self:
            _active = None

    def attach(self, trainer: Trainer) -> None:
        """An Ember run: the doctor can also measure the module's step in other precisions."""
        self.trainer = trainer

    def _patch(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace ``owner.name`` (its own or inherited) with ``make(original)`` until ``uninstall``."""
        own = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        self._restore.append(lambda: setattr(owner, name, original) if own else delattr(owner, name))

    def _wrap_loaders(self) -> None:
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        doctor = self

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def timed_next(iterator: Any) -> Any:
                start, cpu_start = time.perf_counter(), time.thread_time()
                try:
                    return original(iterator)
                finally:
                    if doctor.measuring:
                        doctor.data_wait += time.perf_counter() - start
                        doctor.data_cpu += time.thread_time() - cpu_start
                        persistent = bool(getattr(iterator, "_persistent_workers", False))
                        doctor.loaders[(iterator._num_workers, iterator._pin_memory, persistent)] += 1

            return timed_next

        self._patch(_BaseDataLoaderIter, "__next__", make)

    def _wrap_syncs(self) -> None:
        for owner, name, waits, label in _SYNC_CALLS:
            self._patch(owner, name, functools.partial(self._counted, waits=waits, label=label))

    def _counted(
        self, original: Callable[..., Any], waits: Callable[[tuple[Any, ...], dict[str, Any]], bool], label: str
    ) -> Callable[..., Any]:
        """``original``, counting the calls from the user's code for which ``waits(args, kwargs)`` says that
        the host waits for the device."""
        doctor = self

        def counted(*args: Any, **kwargs: Any) -> Any:
            local = doctor._local
            if not doctor.measuring or getattr(local, "inside", False) or not waits(args, kwargs):
                return original(*args, **kwargs)  # not measuring, nested (print calls tolist), or no wait
            local.inside = True
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                local.inside = False
                where = _user_frame(direct=True)  # torch's own reads inside its functions do not count
                if where is not None:
                    doctor.syncs[f"{where} ({label})"] += 1
                    doctor.sync_seconds += time.perf_counter() - start

        return counted

    def _wrap_distributed(self) -> None:
        from torch.nn.parallel import DistributedDataParallel
        from torch.utils.data import DistributedSampler

        doctor = self

        def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
            def init(ddp: Any, *args: Any, **kwargs: Any) -> None:
                original(ddp, *args, **kwargs)
                doctor.ddp_models.add(ddp)
                handle = ddp.module.register_forward_pre_hook(doctor._check_bare_forward)
                doctor._restore.append(handle.remove)

            return init

        def make_forward(original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(ddp: Any, *args: Any, **kwargs: Any) -> Any:
                if doctor.measuring and torch.is_grad_enabled() and ddp.require_backward_grad_sync:
                    doctor.syncing_forwards += 1
                doctor._local.in_ddp = getattr(doctor._local, "in_ddp", 0) + 1
                try:
                    return original(ddp, *args, **kwargs)
                finally:
                    doctor._local.in_ddp -= 1

            return forward

        def make_post_forward(original: Callable[..., Any]) -> Callable[..., Any]:
            def post_forward(ddp: Any, output: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(ddp, output)
                finally:
                    if doctor.measuring and ddp.find_unused_parameters:
                        doctor.unused_search_seconds += time.perf_counter() - start

            return post_forward

        def make_iter(original: Callable[..., Any]) -> Callable[..., Any]:
            def iterate(sampler: Any) -> Any:
                if sampler.shuffle:  # without shuffling, the epoch changes nothing
                    doctor.sampler_epochs.setdefault(id(sampler), []).append(sampler.epoch)
                return original(sampler)

            return iterate

        self._patch(DistributedDataParallel, "__init__", make_init)
        self._patch(DistributedDataParallel, "forward", make_forward)
        if "_post_forward" in DistributedDataParallel.__dict__:
            self._patch(DistributedDataParallel, "_post_forward", make_post_forward)
        self._patch(DistributedSampler, "__iter__", make_iter)

    def _check_bare_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not getattr(self._local, "in_ddp", 0):
            self.bare_forwards[_user_frame() or type(module).__name__] += 1

    # ------------------------------------------------------------------------------ measuring
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step_count += 1
        if self.step_count == self.warmup:
            gc.collect()
            self.graph_tensors_at_start = {id(tensor) for tensor in _graph_tensors()}
            self.window_start = time.perf_counter()
            self.measuring = True
        elif self.measuring:
            for ddp in self.ddp_models:
                if ddp.find_unused_parameters and any(
                    p.requires_grad and p.grad is None for p in ddp.module.parameters()
                ):
                    self.all_parameters_used = False
        if self.step_count == self.steps:
            self.finish()

    def finish(self) -> None:
        """Stop measuring, work out the findings, show the report on rank zero, remove the instrumentation."""
        if self._findings is not None:
            return
        if self.measuring:
            self.window_seconds = time.perf_counter() - self.window_start
        self.measuring = False
        self._findings = self._diagnose()
        self.report_text = self.as_json_text() if self.as_json else self.report()
        if _rank() == 0:
            print(self.report_text, flush=True)
        self.uninstall()
        if self.stop:
            raise DoctorDone

    @property
    def measured_steps(self) -> int:
        return max(0, min(self.step_count, self.steps) - self.warmup)

    def findings(self) -> list[Finding]:
        if self._findings is None:
            self.finish()
        assert self._findings is not None
        return self._findings

    def _diagnose(self) -> list[Finding]:
        steps = self.measured_steps
        if steps == 0:
            return []
        step = self.window_seconds / steps
        checks = [
            self._input_bound(step),
            self._graphs_kept(steps),
            self._host_syncs(steps, step),
            self._precision(step),
            self._batch_headroom(),
            self._bare_forward(),
            self._unneeded_unused_search(step),
            self._sampler_epochs(),
            self._oversubscribed(),
            self._sync_every_micro_batch(steps, step),
        ]
        return [finding for finding in checks if finding is not None]

    # ------------------------------------------------------------------------------ the checks
    def _input_bound(self, step: float) -> Finding | None:
        share = self.data_wait / self.window_seconds if self.window_seconds else 0.0
        if share < 0.2 or not self.loaders:
            return None
        workers, pinned, persistent = self.loaders.most_common(1)[0][0]
        from ember.data import cores_per_process

        wait = self.data_wait / self.measured_steps
        compute = max(step - wait, 1e-6)
        reading = wait * max(workers, 1)  # one batch's reading time, if a single process did it
        # Enough workers to read a batch per step of compute; reading that mostly waits on I/O can use
        # more workers than cores, reading that computes should leave the training process a core.
        waits_on_io = workers == 0 and self.data_cpu < 0.5 * self.data_wait
        cap = 8 if waits_on_io else max(1, cores_per_process() - 1)
        suggested = max(workers + 1, min(cap, math.ceil(reading / compute)))
        # With W workers reading in parallel, a step takes the longer of the compute and a W-th of the reading.
        estimated = 1 - max(compute, reading / suggested) / step
        fixes = [f"num_workers={suggested}"]
        if workers and not persistent:
            fixes.append("persistent_workers=True")
        if torch.cuda.is_available() and not pinned:
            fixes.append("pin_memory=True")
        return Finding(
            id="input-bound",
            title=f"Training waits for data {share:.0%} of the time",
            measured=f"{wait * 1e3:.1f} ms of each {step * 1e3:.1f} ms step waiting for the next batch "
            f"(num_workers={workers}, pin_memory={pinned}, persistent_workers={persistent})",
            why="while a batch is read and collated in the training process, the model does not run; worker "
            "processes prepare the next batches during the step",
            fix=f"DataLoader(..., {', '.join(fixes)}); ember.data.suggest_num_workers(loader) measures the best count",
            estimated_gain=max(0.0, estimated),
        )

    def _graphs_kept(self, steps: int) -> Finding | None:
        gc.collect()
        new = [tensor for tensor in _graph_tensors() if id(tensor) not in self.graph_tensors_at_start]
        if len(new) < 0.8 * steps:
            return None
        held = sum(tensor.untyped_storage().nbytes() for tensor in new)
        return Finding(
            id="graph-kept",
            title="Tensors that keep their autograd graph pile up from step to step",
            measured=f"{len(new)} more tensors with a grad_fn alive after {steps} steps "
            f"(about {len(new) / steps:.1f} per step), holding at least {held / 2**20:.2f} MB plus their graphs",
            why="a tensor with a grad_fn keeps the whole graph of its step (activations included) in memory: "
            "memory grows until the run slows down or runs out",
            fix="store loss.detach() or loss.item() at logging time, or use self.log(...), which keeps no graph",
            locations=_holders(new[:20]),
        )

    def _host_syncs(self, steps: int, step: float) -> Finding | None:
        total = sum(self.syncs.values())
        if total < steps:
            return None
        return Finding(
            id="host-sync",
            title=f"{total / steps:.1f} host-device synchronisations per step in your code",
            measured=f"{total} calls over {steps} steps that wait for a GPU tensor's value (.item(), .cpu(), "
            f".tolist(), print(tensor), boolean-mask indexing, nonzero, ...), "
            f"{self.sync_seconds / steps * 1e3:.2f} ms per step",
            why="each waits until the device has finished all queued work, so the host cannot queue the next "
            "kernels ahead and the GPU idles",
            fix="log tensors with self.log(...) (read only at log time), keep values on the device (torch.where "
            "or a multiplication by the mask instead of x[mask]), and remove torch.cuda.synchronize()/empty_cache() "
            "calls from the loop",
            estimated_gain=min(1.0, self.sync_seconds / self.window_seconds) if self.window_seconds else None,
            locations=[f"{where}: {count} calls" for where, count in self.syncs.most_common(5)],
        )

    def _precision(self, step: float) -> Finding | None:
        trainer = self.trainer
        if trainer is None or trainer.strategy.root_device.type != "cuda" or trainer.precision != "32-true":
            return None
        if not torch.cuda.is_bf16_supported():
            return None
        batch = trainer.run_metrics.train.batch
        if batch is None:
            return None
        fp32 = _time_step(trainer, batch, None)
        bf16 = _time_step(trainer, batch, torch.bfloat16)
        if bf16 >= 0.9 * fp32:
            return None
        return Finding(
            id="precision",
            title=f"float32 on a GPU with bfloat16 tensor cores: bf16-mixed runs the step {fp32 / bf16:.1f}x faster",
            measured=f"forward and backward take {fp32 * 1e3:.1f} ms in float32 and {bf16 * 1e3:.1f} ms under "
            f"bfloat16 autocast on {torch.cuda.get_device_name()}",
            why="tensor cores run 16-bit matrix products many times faster than float32 ones",
            fix="Trainer(precision='bf16-mixed')",
            estimated_gain=1 - bf16 / fp32,
        )

    def _batch_headroom(self) -> Finding | None:
        trainer = self.trainer
        if trainer is None or trainer.strategy.root_device.type != "cuda":
            return None
        device = trainer.strategy.root_device
        peak = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        if not peak or peak > 0.25 * total:
            return None
        from ember._utils import batch_size_of

        size = batch_size_of(trainer.run_metrics.train.batch)
        factor = 2 ** int(torch.log2(torch.tensor(0.8 * total / peak)).floor())
        return Finding(
            id="small-batch",
            title=f"The batch uses {peak / total:.0%} of the GPU's memory",
            measured=f"peak {peak / 2**30:.2f} GiB of {total / 2**30:.1f} GiB with batches of {size}",
            why="small batches leave the GPU underused: each step pays fixed costs (kernel launches, optimizer "
            "step, synchronisation) for little work",
            fix=f"try batches of about {size * factor} (Tuner(trainer).scale_batch_size finds the largest that fits); "
            f"scale the learning rate with it (x{factor} linear, or x{factor**0.5:.1f} square-root rule)",
        )

    def _bare_forward(self) -> Finding | None:
        if not self.bare_forwards:
            return None
        return Finding(
            id="ddp-bare-forward",
            title="The forward pass bypasses the DistributedDataParallel wrapper",
            measured=f"{sum(self.bare_forwards.values())} forward calls on the wrapped module itself",
            why="DDP averages gradients through hooks its own forward sets up: a forward on the bare module "
            "trains each rank on its own gradients, and the replicas drift apart",
            fix="call the DDP wrapper (ddp_model(x)), not ddp_model.module(x) or the module you wrapped",
            locations=[f"{where}: {count} calls" for where, count in self.bare_forwards.most_common(5)],
        )

    def _unneeded_unused_search(self, step: float) -> Finding | None:
        searching = [ddp for ddp in self.ddp_models if ddp.find_unused_parameters]
        if not searching or not self.all_parameters_used:
            return None
        per_step = self.unused_search_seconds / max(1, self.measured_steps)
        return Finding(
            id="ddp-find-unused",
            title="find_unused_parameters=True, but every parameter gets a gradient",
            measured=f"all parameters received gradients in each of {self.measured_steps} steps; the search for "
            f"unused ones took {per_step * 1e3:.2f} ms per step",
            why="with the option, DDP walks the autograd graph after every forward and cannot start the "
            "gradient all-reduce until the whole backward is done",
            fix="DistributedDataParallel(..., find_unused_parameters=False), or in Ember "
            "DDPStrategy(find_unused_parameters=False)",
            estimated_gain=per_step / step if step else None,
        )

    def _sampler_epochs(self) -> Finding | None:
        stuck = [epochs for epochs in self.sampler_epochs.values() if len(epochs) > 1 and len(set(epochs)) == 1]
        if not stuck:
            return None
        return Finding(
            id="ddp-sampler-epoch",
            title="A DistributedSampler repeats the same order every epoch",
            measured=f"iterated {len(stuck[0])} times with epoch={stuck[0][0]} each time",
            why="DistributedSampler shuffles with seed + epoch: without set_epoch() every epoch sees the data "
            "in the same order, which hurts convergence",
            fix="call sampler.set_epoch(epoch) at the start of each epoch (the Ember Trainer does it for you)",
        )

    def _oversubscribed(self) -> Finding | None:
        from ember.data import cores_per_process

        threads = torch.get_num_threads()
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        fair = cores_per_process()
        if threads <= fair:
            return None
        # Interleaved and the best of three, since other processes on the machine add noise to each run.
        timings = [(_matmul_seconds(threads), _matmul_seconds(fair)) for _ in range(3)]
        now, fixed = min(t for t, _ in timings), min(f for _, f in timings)
        return Finding(
            id="cpu-oversubscribed",
            title=f"{threads} CPU threads x {processes} process(es) on {fair * processes} cores",
            measured=f"a matrix product takes {now * 1e3:.1f} ms with {threads} threads and {fixed * 1e3:.1f} ms "
            f"with {fair} (all processes measuring at once)",
            why="more compute threads than cores make them take turns: caches are thrashed and threads wait",
            fix=f"torch.set_num_threads({fair}) in each process (or OMP_NUM_THREADS={fair})",
            estimated_gain=max(0.0, 1 - fixed / now) if now else None,
        )

    def _sync_every_micro_batch(self, steps: int, step: float) -> Finding | None:
        if not self.ddp_models or self.syncing_forwards < 1.5 * steps:
            return None
        per_step = self.syncing_forwards / steps
        reduce_seconds = _all_reduce_seconds(next(iter(self.ddp_models)))
        wasted = (self.syncing_forwards - steps) * reduce_seconds
        return Finding(
            id="ddp-sync-every-micro-batch",
            title=f"Gradients are all-reduced on every micro-batch ({per_step:.1f} per optimizer step)",
            measured=f"{self.syncing_forwards} synchronising forward passes for {steps} optimizer steps; one "
            f"all-reduce of the gradients takes {reduce_seconds * 1e3:.2f} ms",
            why="while accumulating, only the micro-batch before the optimizer step needs averaged gradients; "
            "the others can accumulate locally",
            fix="wrap the non-stepping micro-batches in `with model.no_sync():` (Trainer(accumulate_grad_batches=k) "
            "does it for you)",
            estimated_gain=min(1.0, wasted / self.window_seconds) if self.window_seconds else None,
        )

    # -------------------------------------------------------------------------------- the report
    def report(self) -> str:
        steps = self.measured_steps
        findings = self._findings or []
        lines = []
        if steps == 0:
            return f"ember doctor: the run made {self.step_count} optimizer steps; more than {self.warmup} are needed"
        step_ms = self.window_seconds / steps * 1e3
        lines.append(
            f"ember doctor: {steps} steps measured (after {self.warmup} of warm-up), {step_ms:.1f} ms per step, "
            f"{int(os.environ.get('WORLD_SIZE', '1'))} process(es)"
        )
        if not findings:
            lines.append("no findings: nothing the doctor checks is slowing this run")
        for finding in findings:
            gain = "" if finding.estimated_gain is None else f"\n  estimated gain: {finding.estimated_gain:.0%}"
            where = "".join(f"\n  at {location}" for location in finding.locations)
            lines.append(
                f"\n[{finding.id}] {finding.title}\n  measured: {finding.measured}\n  why: {finding.why}\n"
                f"  fix: {finding.fix}{gain}{where}"
            )
        return "\n".join(lines)

    def as_json_text(self) -> str:
        steps = self.measured_steps
        return json.dumps(
            {
                "measured_steps": steps,
                "step_ms": self.window_seconds / steps * 1e3 if steps else None,
                "findings": [dataclasses.asdict(finding) for finding in self._findings or []],
            },
            indent=2,
        )


# ------------------------------------------------------------------------------------ helpers
def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


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


def _masks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``tensor[mask]`` of a device tensor with a boolean mask: the result's size depends on the mask's values."""
    index = args[1]
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return _on_accelerator(args[0]) and any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _always(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return True


# Calls that make the host wait for the device, when ``waits(args, kwargs)`` says so: (owner, name, waits, label).
# Those that hand a device tensor's value to Python, copy it to the CPU, or give a result whose size depends on
# its values (boolean masks, nonzero); and explicit synchronisation.
_SYNC_CALLS: list[tuple[Any, str, Callable[[tuple[Any, ...], dict[str, Any]], bool], str]] = [
    *((torch.Tensor, name, _reads_value, name) for name in ("item", "tolist", "cpu", "numpy", "nonzero",
                                                             "__bool__", "__float__", "__int__", "__format__",
                                                             "__repr__")),
    (torch.Tensor, "to", _copies_to_cpu, "to the CPU"),
    (torch.Tensor, "__getitem__", _masks, "boolean mask"),
    (torch, "nonzero", _reads_value, "nonzero"),
    (torch.cuda, "synchronize", _always, "synchronize"),
    (torch.cuda, "empty_cache", _always, "empty_cache"),
]  # fmt: skip


def _user_frame(direct: bool = False) -> str | None:
    """``file:line`` of the code that made the call being watched, outside torch and Ember.

    None if Ember made it (its reads happen at log time, by design) or, with ``direct``, if torch's
    own code made it on the user's behalf.
    """
    frame: FrameType | None = sys._getframe(2)
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


def _graph_tensors() -> list[torch.Tensor]:
    import warnings

    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor) and obj.grad_fn is not None]


def _holders(tensors: list[torch.Tensor]) -> list[str]:
    """Where tensors are kept: a global variable or an object's attribute holding the containers they are in."""
    places: Counter[str] = Counter()
    for tensor in tensors:
        for container in gc.get_referrers(tensor):
            if not isinstance(container, (list, dict, tuple, set)):
                continue
            for owner in gc.get_referrers(container):
                if not isinstance(owner, dict):
                    continue
                name = next((key for key, value in owner.items() if value is container), None)
                if name is None:
                    continue
                if "__name__" in owner and "__file__" in owner:
                    places[f"{type(container).__name__} {name!r}, a global of {owner['__file__']}"] += 1
                else:
                    holder = next((o for o in gc.get_referrers(owner) if getattr(o, "__dict__", None) is owner), None)
                    kind = f" of a {type(holder).__name__}" if holder is not None else ""
                    places[f"{type(container).__name__} in attribute {name!r}{kind}"] += 1
    return [f"{place} ({count} of the tensors sampled)" for place, count in places.most_common(3)]


def _time_step(trainer: Trainer, batch: Any, dtype: torch.dtype | None, repeats: int = 3) -> float:
    """Seconds for the module's training step and its backward on ``batch`` (gradients discarded), run by
    fit's own step runner, in autocast to ``dtype`` when given."""
    module = trainer.lightning_module
    assert module is not None
    runner = StepRunner(trainer.strategy, module, [])
    seconds = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            runner.forward_backward(batch, 0, window_size=1, sync=False)  # no gradient all-reduce
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        module.zero_grad(set_to_none=True)
    return min(seconds[1:])


def _matmul_seconds(threads: int, size: int = 384, repeats: int = 8) -> float:
    """A matrix-product benchmark with ``threads`` threads, all ranks at the same time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    _barrier()
    torch.mm(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    elapsed = (time.perf_counter() - start) / repeats
    torch.set_num_threads(previous)
    _barrier()
    return elapsed


def _all_reduce_seconds(ddp: Any, repeats: int = 5) -> float:
    """Time of one all-reduce of as many numbers as the model has parameters (all ranks together)."""
    import torch.distributed as dist

    parameter = next(ddp.module.parameters())
    numbers = sum(p.numel() for p in ddp.module.parameters() if p.requires_grad)
    buffer = torch.zeros(numbers, device=parameter.device)
    dist.all_reduce(buffer)
    _barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buffer)
    if buffer.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


# ------------------------------------------------------------------------------- ember doctor
def run_script(script: str, arguments: list[str], *, steps: int, as_json: bool, module: bool = False) -> int:
    """Run a training script (as ``python script.py`` would) under the doctor; return its exit status."""
    import runpy

    from ember.launch import close_process_group

    os.environ["EMBER_DOCTOR"] = json.dumps({"steps": steps, "json": as_json})  # for a relaunch into workers
    doctor = Doctor(steps=steps, stop=True, as_json=as_json).install()
    sys.argv = [script, *arguments]
    status = 0
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    except DoctorDone:
        pass
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    with contextlib.suppress(DoctorDone):
        doctor.finish()  # the script ended before the doctor had seen all its steps
    close_process_group()  # a plain script may leave its group open; its threads must end before exit
    return status
