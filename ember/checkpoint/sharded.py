"""Sharded checkpoints: a directory that every rank writes its own shard to, through
``torch.distributed.checkpoint`` (DCP), so that no rank ever holds the whole model.

::

    epoch=3-step=400.ckpt/
        .metadata, __0_0.distcp, __1_0.distcp, ...   the module's and optimizers' tensors (DCP)
        trainer_state.pt                              every other entry, written by rank zero

Reading runs no code from the files, as for ordinary checkpoints: DCP's metadata is unpickled with
an allow-list of its own classes, and its non-tensor values with ``torch.load(weights_only=True)``.
Optimizer states are stored flattened and keyed by parameter name (``"state.layer.weight.exp_avg"``),
which lets them be loaded onto any number of ranks and turned back into an ordinary
``Optimizer.state_dict()`` by ``load_consolidated``.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import torch

from ember.checkpoint import io as checkpoint_io
from ember.checkpoint.writer import Writer

SHARDED_ENTRIES = ("state_dict", "optimizer_states")
#: Per optimizer, per parameter group: the names of its parameters, in order.
PARAMETER_NAMES = "optimizer_parameter_names"
TRAINER_STATE = "trainer_state.pt"


def is_sharded(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata"))


def save(
    checkpoint: dict[str, Any],
    path: str,
    *,
    is_global_zero: bool,
    barrier: Callable[[], None],
    writer: Writer,
    background_group: Any = None,
) -> None:
    """Write ``checkpoint`` to the directory ``path``; every rank calls it with its own shards.

    The shards go to a staging directory that replaces ``path`` only once it is complete, so a run
    killed while saving leaves the previous checkpoint intact. With a writer that works in the background,
    ``torch.distributed.checkpoint.async_save`` copies this rank's shards to host memory and writes them
    in a thread of its own, meeting the other ranks through ``background_group`` (not the group training
    uses); rank zero then finishes the directory in the writer's thread.
    """
    import torch.distributed.checkpoint as dcp

    writer.wait()  # one save in flight at most
    staging = checkpoint_io.staging_path(path, "partial")
    if is_global_zero:
        checkpoint_io.remove(staging)
    barrier()
    rest = {key: value for key, value in checkpoint.items() if key not in SHARDED_ENTRIES}
    storage = dcp.FileSystemWriter(staging)
    if not writer.in_background:
        dcp.save(_sharded_part(checkpoint), storage_writer=storage)  # returns once .metadata exists
        if is_global_zero:
            _finish(rest, staging, path)
        barrier()
        return
    started = dcp.async_save(_sharded_part(checkpoint), storage_writer=storage, process_group=background_group)
    written = cast("Future[Any]", started)
    snapshot = writer.snapshot(rest) if is_global_zero else None

    def complete() -> None:
        written.result()  # on rank zero: done once every rank's shards and .metadata are written
        if snapshot is not None:
            _finish(snapshot, staging, path)

    writer.submit(complete)


def _finish(rest: dict[str, Any], staging: str, path: str) -> None:
    checkpoint_io.save(rest, os.path.join(staging, TRAINER_STATE))
    checkpoint_io.replace_directory(staging, path)


def load(path: str, template: dict[str, Any], *, trust_pickles: bool = False) -> dict[str, Any]:
    """Read a sharded checkpoint into ``template``, this rank's ``state_dict`` (and ``optimizer_states``)
    laid out as the run needs them: DCP reshards from however many ranks wrote the files."""
    import torch.distributed.checkpoint as dcp

    checkpoint = _trainer_state(path, trust_pickles)
    reader = _safe_reader(path)
    saved_optimizers = _count_optimizers(reader.read_metadata())
    optimizers = template["optimizer_states"]
    loads_optimizers = bool(optimizers) and saved_optimizers == len(optimizers)
    dcp.load(
        _sharded_part(template if loads_optimizers else {"state_dict": template["state_dict"]}),
        storage_reader=reader,
        planner=_safe_planner(trust_pickles),
    )  # fills the template's tensors and dicts in place
    checkpoint["state_dict"] = template["state_dict"]
    if saved_optimizers:  # a different count is left for the Trainer to report, with the numbers
        checkpoint["optimizer_states"] = optimizers if loads_optimizers else [{}] * saved_optimizers
    return checkpoint


def load_consolidated(path: str, *, trust_pickles: bool = False) -> dict[str, Any]:
    """Read a whole sharded checkpoint into one process as an ordinary checkpoint (full tensors on the
    CPU, optimizer states as ``Optimizer.state_dict()`` writes them). Needs no process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    checkpoint = _trainer_state(path, trust_pickles)
    reader = _safe_reader(path)
    metadata = reader.read_metadata()
    empty: dict[str, Any] = {
        key: torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        for key, item in metadata.state_dict_metadata.items()
    }
    planner = _safe_planner(trust_pickles, flatten_state_dict=False)
    with warnings.catch_warnings():  # DCP warns that it reads in one process, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(empty, storage_reader=reader, planner=planner, no_dist=True)
    nested: dict[str, Any] = {}
    for key, value in planner.state_dict.items():  # the tensors filled in, and the other values read
        *parents, leaf = metadata.planner_data[key]
        target = nested
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    checkpoint["state_dict"] = nested["state_dict"]
    names = checkpoint.pop(PARAMETER_NAMES, [])
    saved = nested.get("optimizer_states", {})
    if saved:
        checkpoint["optimizer_states"] = [
            unflatten_optimizer_state(saved[str(index)], names[index]) for index in range(len(saved))
        ]
    return checkpoint


def unflatten_optimizer_state(flat: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """A flattened optimizer state keyed by parameter name, as ``Optimizer.state_dict()`` has it:
    parameters numbered in the order of ``groups`` (the names of each param group's parameters)."""
    index_of = {name: index for index, name in enumerate(name for group in groups for name in group)}
    state: dict[int, dict[str, Any]] = {}
    settings: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        name, _, entry = rest.rpartition(".")
        if kind == "state":
            state.setdefault(index_of[name], {})[entry] = value
        else:
            settings.setdefault(name, {})[entry] = value
    param_groups = [
        {**(settings.get(group[0], {}) if group else {}), "params": [index_of[name] for name in group]}
        for group in groups
    ]
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def name_optimizer_state(state: dict[str, Any], groups: list[list[str]], kept: set[str]) -> dict[str, Any]:
    """An ``Optimizer.state_dict()`` keyed by parameter name, for the parameters in ``kept``: the saved
    group ``i``'s ``j``-th parameter is ``groups[i][j]`` (the run's parameter names, group by group)."""
    saved_groups = state["param_groups"]
    if [len(group["params"]) for group in saved_groups] != [len(group) for group in groups]:
        raise ValueError(
            f"the checkpoint's optimizer has param groups of {[len(g['params']) for g in saved_groups]} "
            f"parameters, but configure_optimizers() built groups of {[len(group) for group in groups]}"
        )
    by_name: dict[str, Any] = {}
    param_groups = []
    for saved, names in zip(saved_groups, groups):
        pairs = [(index, name) for index, name in zip(saved["params"], names) if name in kept]
        by_name.update({name: state["state"][index] for index, name in pairs if index in state["state"]})
        param_groups.append({**saved, "params": [name for _, name in pairs]})
    return {"state": by_name, "param_groups": param_groups}


def _sharded_part(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The entries DCP writes; the list of optimizer states as ``{"0": ...}``, since DCP's keys are strings."""
    part = {"state_dict": checkpoint["state_dict"]}
    if "optimizer_states" in checkpoint:
        part["optimizer_states"] = {str(index): state for index, state in enumerate(checkpoint["optimizer_states"])}
    return part


def _count_optimizers(metadata: Any) -> int:
    return len({path[1] for path in metadata.planner_data.values() if path[0] == "optimizer_states"})


def _trainer_state(path: str, trust_pickles: bool) -> dict[str, Any]:
    state_file = os.path.join(path, TRAINER_STATE)
    if not is_sharded(path) or not os.path.isfile(state_file):
        raise checkpoint_io.CheckpointError(
            f"{path!r} is a directory but not a complete sharded checkpoint (it needs .metadata and {TRAINER_STATE})"
        )
    return checkpoint_io.load_file(state_file, trust_pickles=trust_pickles)


# ------------------------------------------------------------------------------ safe reading
@functools.cache
def _reader_classes() -> tuple[type, type]:
    """DCP's reader and planner, made safe; defined on first use, since DCP is imported only then."""
    import torch.distributed.checkpoint as dcp

    class SafeReader(dcp.FileSystemReader):
        """Unpickles ``.metadata`` with an allow-list instead of ``pickle.load``."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            with open(os.path.join(self.path, ".metadata"), "rb") as file:
                metadata = _MetadataUnpickler(file).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(dcp.DefaultLoadPlanner):
        """Reads non-tensor values with ``torch.load(weights_only=True)`` unless pickles are trusted."""

        def __init__(self, trust_pickles: bool, **options: Any) -> None:
            super().__init__(**options)
            self.trust_pickles = trust_pickles

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            # DCP's own load_bytes unpickles without restrictions: it only sees the value once it has
            # been read safely and written again.
            buffer = io.BytesIO()
            torch.save(_load_value(value, self.trust_pickles), buffer)
            buffer.seek(0)
            super().load_bytes(read_item, buffer)

    return SafeReader, SafeLoadPlanner


def _safe_reader(path: str) -> Any:
    return _reader_classes()[0](path)


def _safe_planner(trust_pickles: bool, **options: Any) -> Any:
    return _reader_classes()[1](trust_pickles, **options)


def _load_value(value: io.BytesIO, trust_pickles: bool) -> Any:
    try:
        return torch.load(value, weights_only=not trust_pickles)
    except pickle.UnpicklingError as err:
        raise checkpoint_io.CheckpointError(
            "a sharded checkpoint holds pickled objects other than tensors and plain Python values, so it was "
            "not loaded and nothing in it ran. If you trust where it comes from, load it with weights_only=False."
        ) from err


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch sizes, dtypes and layouts, and paths; refuses everything else."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
    }

    _METADATA = "torch.distributed.checkpoint.metadata"

    def find_class(self, module: str, name: str) -> Any:
        # Only names from these modules are looked up at all: a lookup imports the module.
        if "." not in name and ((module, name) in self._ALLOWED or module in ("torch", self._METADATA)):
            found = super().find_class(module, name)
            if (
                (module, name) in self._ALLOWED
                or (module == "torch" and isinstance(found, torch.dtype))
                or (module == self._METADATA and isinstance(found, type) and found.__module__ == module)
            ):
                return found
        raise pickle.UnpicklingError(f"a sharded checkpoint's .metadata references {module}.{name}, which is refused")
