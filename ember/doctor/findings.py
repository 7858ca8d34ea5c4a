"""The findings: one small, pure function each, from ``Measurements`` to a ``Finding`` or None.

Nothing here touches torch, the run or the outside world, so each finding can be checked on
measurements made by hand. ``FINDINGS`` lists them in the order the report shows them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from ember.doctor.measurements import Measurements

#: Share of the window spent waiting for data above which the run counts as input-bound.
INPUT_BOUND_SHARE = 0.2
#: Tensors with a graph left alive per measured step from which the graphs count as piling up.
KEPT_GRAPHS_PER_STEP = 0.8
#: DDP forward passes that all-reduce per optimizer step from which accumulation is taken to sync every time.
SYNCING_FORWARDS_PER_STEP = 1.5
#: The share of GPU memory the peak may reach for the batch to count as small.
SMALL_BATCH_MEMORY = 0.25
#: The gain a measured fix must bring to be a finding: below it, the report would round it to 0%.
MINIMUM_GAIN = 0.005


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


def input_bound(m: Measurements) -> Finding | None:
    share = m.data_wait / m.window_seconds if m.window_seconds else 0.0
    if share < INPUT_BOUND_SHARE or not m.loaders:
        return None
    workers, pinned, persistent = m.loaders.most_common(1)[0][0]
    step = m.step_seconds
    wait = m.data_wait / m.measured_steps
    compute = max(step - wait, 1e-6)
    reading = wait * max(workers, 1)  # one batch's reading time, if a single process did it
    # Enough workers to read a batch per step of compute; reading that mostly waits on I/O can use
    # more workers than cores, reading that computes should leave the training process a core.
    waits_on_io = workers == 0 and m.data_cpu < 0.5 * m.data_wait
    cap = 8 if waits_on_io else max(1, m.cores_per_process - 1)
    suggested = max(workers + 1, min(cap, math.ceil(reading / compute)))
    # With W workers reading in parallel, a step takes the longer of the compute and a W-th of the reading.
    estimated = 1 - max(compute, reading / suggested) / step
    fixes = [f"num_workers={suggested}"]
    if workers and not persistent:
        fixes.append("persistent_workers=True")
    if m.cuda_available and not pinned:
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


def graphs_kept(m: Measurements) -> Finding | None:
    steps = m.measured_steps
    if m.graph_tensors < KEPT_GRAPHS_PER_STEP * steps:
        return None
    return Finding(
        id="graph-kept",
        title="Tensors that keep their autograd graph pile up from step to step",
        measured=f"{m.graph_tensors} more tensors with a grad_fn alive after {steps} steps "
        f"(about {m.graph_tensors / steps:.1f} per step), holding at least {m.graph_bytes / 2**20:.2f} MB plus "
        "their graphs",
        why="a tensor with a grad_fn keeps the whole graph of its step (activations included) in memory: "
        "memory grows until the run slows down or runs out",
        fix="store loss.detach() or loss.item() at logging time, or use self.log(...), which keeps no graph",
        locations=list(m.graph_holders),
    )


def host_syncs(m: Measurements) -> Finding | None:
    steps = m.measured_steps
    total = sum(m.syncs.values())
    if total < steps:
        return None
    return Finding(
        id="host-sync",
        title=f"{total / steps:.1f} host-device synchronisations per step in your code",
        measured=f"{total} calls over {steps} steps that wait for a GPU tensor's value (.item(), .cpu(), "
        f".tolist(), print(tensor), boolean-mask indexing, nonzero, ...), "
        f"{m.sync_seconds / steps * 1e3:.2f} ms per step",
        why="each waits until the device has finished all queued work, so the host cannot queue the next "
        "kernels ahead and the GPU idles",
        fix="log tensors with self.log(...) (read only at log time), keep values on the device (torch.where "
        "or a multiplication by the mask instead of x[mask]), and remove torch.cuda.synchronize()/empty_cache() "
        "calls from the loop",
        estimated_gain=min(1.0, m.sync_seconds / m.window_seconds) if m.window_seconds else None,
        locations=[f"{where}: {count} calls" for where, count in m.syncs.most_common(5)],
    )


def precision(m: Measurements) -> Finding | None:
    if m.precision_seconds is None:
        return None
    fp32, bf16 = m.precision_seconds
    if not fp32.above(bf16) or bf16.median >= 0.9 * fp32.median:
        return None
    return Finding(
        id="precision",
        title="float32 on a GPU with bfloat16 tensor cores: bf16-mixed runs the step "
        f"{fp32.median / bf16.median:.1f}x faster",
        measured=f"forward and backward take {fp32} in float32 and {bf16} under bfloat16 autocast on {m.gpu_name}",
        why="tensor cores run 16-bit matrix products many times faster than float32 ones",
        fix="Trainer(precision='bf16-mixed')",
        estimated_gain=1 - bf16.median / fp32.median,
    )


def batch_headroom(m: Measurements) -> Finding | None:
    peak, total, size = m.peak_memory, m.total_memory, m.batch_size
    if not peak or total is None or size is None or peak > SMALL_BATCH_MEMORY * total:
        return None
    factor = 2 ** math.floor(math.log2(0.8 * total / peak))  # the largest power of two that leaves a fifth free
    return Finding(
        id="small-batch",
        title=f"The batch uses {peak / total:.0%} of the GPU's memory",
        measured=f"peak {peak / 2**30:.2f} GiB of {total / 2**30:.1f} GiB with batches of {size}",
        why="small batches leave the GPU underused: each step pays fixed costs (kernel launches, optimizer "
        "step, synchronisation) for little work",
        fix=f"try batches of about {size * factor} (Tuner(trainer).scale_batch_size finds the largest that fits); "
        f"scale the learning rate with it (x{factor} linear, or x{factor**0.5:.1f} square-root rule)",
    )


def bare_forward(m: Measurements) -> Finding | None:
    if not m.bare_forwards:
        return None
    return Finding(
        id="ddp-bare-forward",
        title="The forward pass bypasses the DistributedDataParallel wrapper",
        measured=f"{sum(m.bare_forwards.values())} forward calls on the wrapped module itself",
        why="DDP averages gradients through hooks its own forward sets up: a forward on the bare module "
        "trains each rank on its own gradients, and the replicas drift apart",
        fix="call the DDP wrapper (ddp_model(x)), not ddp_model.module(x) or the module you wrapped",
        locations=[f"{where}: {count} calls" for where, count in m.bare_forwards.most_common(5)],
    )


def unneeded_unused_search(m: Measurements) -> Finding | None:
    if not m.ddp_models_searching_unused or not m.all_parameters_used:
        return None
    steps, step = m.measured_steps, m.step_seconds
    per_step = m.unused_search_seconds / max(1, steps)
    return Finding(
        id="ddp-find-unused",
        title="find_unused_parameters=True, but every parameter gets a gradient",
        measured=f"all parameters received gradients in each of {steps} steps; the search for "
        f"unused ones took {per_step * 1e3:.2f} ms per step",
        why="with the option, DDP walks the autograd graph after every forward and cannot start the "
        "gradient all-reduce until the whole backward is done",
        fix="DistributedDataParallel(..., find_unused_parameters=False), or in Ember "
        "DDPStrategy(find_unused_parameters=False)",
        estimated_gain=per_step / step if step else None,
    )


def sampler_epochs(m: Measurements) -> Finding | None:
    stuck = [epochs for epochs in m.sampler_epochs.values() if len(epochs) > 1 and len(set(epochs)) == 1]
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


def oversubscribed(m: Measurements) -> Finding | None:
    threads, fair = m.threads, m.cores_per_process
    if threads <= fair or m.matmul_seconds is None:
        return None
    now, fixed = m.matmul_seconds
    gain = 1 - fixed.median / now.median
    if not now.above(fixed) or gain < MINIMUM_GAIN:  # fewer threads are not faster beyond the noise
        return None
    return Finding(
        id="cpu-oversubscribed",
        title=f"{threads} CPU threads x {m.local_processes} process(es) on {fair * m.local_processes} cores",
        measured=f"a matrix product takes {now} with {threads} threads and {fixed} with {fair} (interleaved, "
        "all processes measuring at once)",
        why="more compute threads than cores make them take turns: caches are thrashed and threads wait",
        fix=f"torch.set_num_threads({fair}) in each process (or OMP_NUM_THREADS={fair})",
        estimated_gain=gain,
    )


def sync_every_micro_batch(m: Measurements) -> Finding | None:
    steps = m.measured_steps
    if not m.ddp_models or m.syncing_forwards < SYNCING_FORWARDS_PER_STEP * steps or m.all_reduce_seconds is None:
        return None
    reduce_seconds = m.all_reduce_seconds
    wasted = (m.syncing_forwards - steps) * reduce_seconds
    return Finding(
        id="ddp-sync-every-micro-batch",
        title=f"Gradients are all-reduced on every micro-batch ({m.syncing_forwards / steps:.1f} per optimizer step)",
        measured=f"{m.syncing_forwards} synchronising forward passes for {steps} optimizer steps; one "
        f"all-reduce of the gradients takes {reduce_seconds * 1e3:.2f} ms",
        why="while accumulating, only the micro-batch before the optimizer step needs averaged gradients; "
        "the others can accumulate locally",
        fix="wrap the non-stepping micro-batches in `with model.no_sync():` (Trainer(accumulate_grad_batches=k) "
        "does it for you)",
        estimated_gain=min(1.0, wasted / m.window_seconds) if m.window_seconds else None,
    )


#: Every finding, in the order of the report.
FINDINGS: tuple[Callable[[Measurements], Finding | None], ...] = (
    input_bound,
    graphs_kept,
    host_syncs,
    precision,
    batch_headroom,
    bare_forward,
    unneeded_unused_search,
    sampler_epochs,
    oversubscribed,
    sync_every_micro_batch,
)


def diagnose(m: Measurements) -> list[Finding]:
    """Every finding the measurements show; none before a step was measured (the findings divide by steps)."""
    if not m.measured_steps:
        return []
    return [finding for check in FINDINGS if (finding := check(m)) is not None]
