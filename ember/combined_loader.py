"""``CombinedLoader``: several loaders read together, with Lightning's modes and results.

Its ``iterables`` are a loader, or a dict, list or tuple of loaders (nested as deep as needed); a combined batch
has their structure, with each loader's batch in its place. ``fit`` reads several training loaders this way
("max_size_cycle" unless a ``CombinedLoader`` says otherwise), as one iterable, so that the training loop
reads one loader whatever their number.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from itertools import chain
from typing import Any, Literal

from ember._utils import sized_len

Mode = Literal["min_size", "max_size_cycle", "max_size", "sequential"]
MODES: tuple[Mode, ...] = ("min_size", "max_size_cycle", "max_size", "sequential")
_END = object()  # what next() gives for an exhausted iterator


class CombinedLoader:
    """Reads ``iterables`` together, in one of these modes:

    - ``"min_size"``: until the shortest loader ends;
    - ``"max_size_cycle"``: until the longest ends, the others starting over when they end;
    - ``"max_size"``: until the longest ends, with None in the place of those that ended;
    - ``"sequential"``: one loader after the other, each batch alone.

    Iterating it yields ``(batch, batch_idx, dataloader_idx)``, as Lightning's does (``dataloader_idx`` is 0 but
    in the sequential mode); ``len()`` is the number of batches the mode yields.
    """

    def __init__(self, iterables: Any, mode: Mode = "min_size") -> None:
        if mode not in MODES:
            # (Lightning's words first)
            raise ValueError(f"Unsupported mode {mode!r} for CombinedLoader: the modes are {', '.join(MODES)}")
        self.iterables = iterables
        self.mode = mode

    @property
    def flattened(self) -> list[Iterable]:
        """The loaders, in the order a combined batch lists them (depth first). Setting it replaces them, in
        ``iterables`` too (its structure kept), as in Lightning: a list of as many loaders."""
        return _leaves(self.iterables)

    @flattened.setter
    def flattened(self, loaders: list[Iterable]) -> None:
        count = len(self.flattened)
        if len(loaders) != count:  # (Lightning's words first)
            raise ValueError(f"Mismatch in flattened length ({len(loaders)}) and existing length ({count}): give "
                             "one loader for each of this CombinedLoader's")  # fmt: skip
        self.iterables = _rebuilt(self.iterables, iter(loaders))

    def __iter__(self) -> Iterator[tuple[Any, int, int]]:
        """As Lightning's, ``iter()`` starts the loaders' iterators (and their workers) at once: all of them, or in
        the sequential mode the first, the others when their turn comes."""
        loaders = self.flattened
        if self.mode != "sequential":
            started = [iter(loader) for loader in loaders]
            return ((batch, batch_idx, 0) for batch_idx, batch in enumerate(self._combined(iter, started)))
        first = [iter(loader) for loader in loaders[:1]]
        return _in_turn(chain(first, (iter(loader) for loader in loaders[1:])))

    def __len__(self) -> int:
        lengths = [sized_len(iterable) for iterable in self.flattened]
        known = [length for length in lengths if length is not None]
        if self.mode == "min_size" and known:
            return min(known)
        if len(known) < len(lengths):
            raise TypeError(f"this CombinedLoader (mode {self.mode!r}) reads a loader without a length: it has none")
        return sum(known) if self.mode == "sequential" else max(known, default=0)

    def batches(self, open_loader: Callable[[Iterable], Iterator[Any]] = iter) -> Iterator[Any]:
        """The batches alone: one after the other in the sequential mode, else combined in the structure of
        ``iterables``. ``open_loader`` starts a loader's iterator (``iter`` unless the caller needs more)."""
        if self.mode == "sequential":
            return chain.from_iterable(open_loader(iterable) for iterable in self.flattened)
        return self._combined(open_loader)

    def _combined(self, open_loader: Callable[[Iterable], Iterator[Any]],
                  started: list[Iterator[Any]] | None = None) -> Iterator[Any]:  # fmt: skip
        """The combined batches, from the loaders' iterators (``started``, else started at the first batch)."""
        iterators = started if started is not None else [open_loader(iterable) for iterable in self.flattened]
        ended = [False] * len(iterators)
        try:
            while iterators:
                batches = [self._next(iterators, index, ended, open_loader) for index in range(len(iterators))]
                if all(ended) or (self.mode == "min_size" and any(ended)):
                    return
                yield _rebuilt(self.iterables, iter(batches))
        finally:
            for iterator in iterators:
                close = getattr(iterator, "close", None)
                if close is not None:  # a generator that ends its loader's workers
                    close()

    def _next(self, iterators: list[Iterator[Any]], index: int, ended: list[bool],
              open_loader: Callable[[Iterable], Iterator[Any]]) -> Any:  # fmt: skip
        """Loader ``index``'s next batch; when it has ended, marked in ``ended``, the mode says what stands for it:
        None, or in the cycling mode its first batch again."""
        batch = next(iterators[index], _END)
        if batch is not _END:
            return batch
        ended[index] = True
        if self.mode != "max_size_cycle":
            return None
        iterators[index] = open_loader(self.flattened[index])
        batch = next(iterators[index], _END)
        if batch is _END:  # it yields nothing at all: nothing to cycle through
            ended[:] = [True] * len(ended)
        return batch

    @property
    def sampler(self) -> Any:
        """Each loader's ``sampler`` (None for one without), in the structure of ``iterables``, as Lightning's."""
        return _rebuilt(self.iterables, (getattr(loader, "sampler", None) for loader in self.flattened))

    @property
    def batch_sampler(self) -> Any:
        """Each loader's ``batch_sampler`` (None for one without), in the structure of ``iterables``."""
        return _rebuilt(self.iterables, (getattr(loader, "batch_sampler", None) for loader in self.flattened))

    def replaced(self, loaders: list[Iterable]) -> CombinedLoader:
        """A ``CombinedLoader`` of the same structure and mode over ``loaders`` (in the order of ``flattened``)."""
        return CombinedLoader(_rebuilt(self.iterables, iter(loaders)), self.mode)


def _in_turn(iterators: Iterable[Iterator[Any]]) -> Iterator[tuple[Any, int, int]]:
    """The sequential mode's ``(batch, batch_idx, dataloader_idx)``: each loader's batches after the other's."""
    for dataloader_idx, iterator in enumerate(iterators):
        for batch_idx, batch in enumerate(iterator):
            yield batch, batch_idx, dataloader_idx


def _holds_loaders(tree: Any) -> bool:
    """Whether ``tree`` is a dict, list or tuple of loaders. As in Lightning, one of numbers or strings alone (or an
    empty one) is itself a loader: ``[0, 1, 2]`` is read as the iterable it is."""
    items = tree.values() if isinstance(tree, Mapping) else tree if isinstance(tree, (list, tuple)) else None
    return items is not None and not all(isinstance(item, (int, float, str)) for item in items)


def _leaves(tree: Any) -> list[Any]:
    if not _holds_loaders(tree):
        return [tree]
    items = tree.values() if isinstance(tree, Mapping) else tree
    return [leaf for item in items for leaf in _leaves(item)]


def _rebuilt(tree: Any, leaves: Iterator[Any]) -> Any:
    """``tree`` with its leaves replaced, in order, by the items of ``leaves``."""
    if not _holds_loaders(tree):
        return next(leaves)
    if isinstance(tree, Mapping):
        return {key: _rebuilt(value, leaves) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_rebuilt(item, leaves) for item in tree]
    if isinstance(tree, tuple):
        items = [_rebuilt(item, leaves) for item in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)  # a named tuple takes its fields
    return next(leaves)
