"""The strategy names Lightning registers, as the Ember strategies that do the same work.

Lightning's ``ddp_spawn``, ``ddp_fork`` and ``ddp_notebook`` differ from ``ddp`` only in how the worker
processes are started, so they all name ``DDPStrategy`` with a ``start_method``. Names of integrations Ember
does not have are refused with the closest strategy it has.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ember.strategies.ddp import DDPStrategy
from ember.strategies.fsdp import FSDPStrategy
from ember.strategies.strategy import Strategy

_UNUSED = (("", False), ("_find_unused_parameters_false", False), ("_find_unused_parameters_true", True))
_STARTS = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"), ("_notebook", "fork"))
LIGHTNING_STRATEGIES: dict[str, Callable[[], Strategy]] = {
    f"ddp{start}{unused}": functools.partial(DDPStrategy, find_unused_parameters=find_unused, start_method=method)
    for start, method in _STARTS
    for unused, find_unused in _UNUSED
    if start or unused
}
LIGHTNING_STRATEGIES["fsdp_cpu_offload"] = functools.partial(FSDPStrategy, cpu_offload=True)

#: Prefixes of Lightning's names for integrations Ember lacks, with what to use instead.
MISSING_STRATEGIES = {
    "deepspeed": "Ember has no DeepSpeed integration; strategy='fsdp' shards parameters, gradients and optimizer "
    "state the same way (ZeRO stage 3), with cpu_offload=True for the offload variants",
    "xla": "Ember runs on CUDA, MPS and CPU devices, not on TPUs (XLA)",
    "single_xla": "Ember runs on CUDA, MPS and CPU devices, not on TPUs (XLA)",
    "single_tpu": "Ember runs on CUDA, MPS and CPU devices, not on TPUs (XLA)",
}


def missing_strategy_hint(name: str) -> str:
    """Why ``name`` is not an Ember strategy and what to use instead ("" if it is not a Lightning name)."""
    return next((hint for prefix, hint in MISSING_STRATEGIES.items() if name.startswith(prefix)), "")
