"""Loading failures that say where they happened: a batch that fails to load is raised as a ``DataLoadingError``
naming the loader, the epoch, the batch, and the sample and loader worker when they are known (``ember.data``
serves these names too)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Generator, Iterable
from typing import Any

from torch.utils.data import Dataset


class SampleError(RuntimeError):
    """On Python 3.10, which has no exception notes: a dataset failed to give one sample; the message names
    its index, and the original error is chained to it."""


class DataLoadingError(RuntimeError):
    """A batch could not be loaded: the message says which loader, epoch and batch, and which sample and
    worker when they are known; the original error is chained to it."""


def named_failures(batches: Iterable[Any], where: str, first_index: int = 0) -> Generator[Any, None, None]:
    """``batches``, an error while producing one re-raised as a ``DataLoadingError`` that names ``where``
    (the loader and epoch), the batch index, and the sample index and worker when they are known."""
    iterator = iter(batches)
    index = first_index
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except DataLoadingError:
            raise
        except Exception as error:
            raise DataLoadingError(_loading_failure(where, index, error)) from error
        yield batch
        index += 1


def numbered_batches(
    batches: Iterable[Any], where: str, first: int, last: int
) -> Generator[tuple[int, Any, bool], None, None]:
    """``(index, batch, index == last)`` for indices ``first`` to ``last``, a failure to load a batch raised
    as ``named_failures`` raises it: the training loop's one generator per batch."""
    iterator = iter(batches)
    for index in range(first, last + 1):
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except DataLoadingError:
            raise
        except Exception as error:
            raise DataLoadingError(_loading_failure(where, index, error)) from error
        yield index, batch, index == last


# "sample index 13" (a note), or "sample index 13: ValueError: ..." (a SampleError), on a line of its own
_SAMPLE = re.compile(r"sample index (\S+?)(?:: (.*))?$", re.MULTILINE)
_WORKER = re.compile(r"in DataLoader worker process (\d+)")


def _loading_failure(where: str, batch_index: int, error: Exception) -> str:
    """The message of a failure to load batch ``batch_index``: the sample and worker are read from what the
    failing sample (``_with_sample``) and the DataLoader (the worker that failed) put in the error."""
    text = "\n".join([str(error), *getattr(error, "__notes__", [])])
    worker = _WORKER.search(text)
    samples = _SAMPLE.findall(text)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    causes = [line for line in lines if not _SAMPLE.search(line)]
    if samples and samples[-1][1]:
        cause = samples[-1][1]
    elif worker and causes:  # the worker's own traceback is in the text: its last line is the error
        cause = causes[-1]
    else:
        cause = f"{type(error).__name__}: {lines[0] if lines else ''}"
    details = [f"batch {batch_index}"]
    if samples:
        details.append(f"sample index {samples[-1][0]}")
    if worker:
        details.append(f"worker {worker.group(1)}")
    return f"loading {where} failed at {', '.join(details)}: {cause.strip()}"


class SampleNamed(Dataset):
    """A map-style dataset whose failures name the index of the sample that failed (see ``_with_sample``).

    A loader with a batch size asks for a batch's samples in one ``__getitems__`` call: one ``try`` per
    batch, and the samples read as the loader would read them itself.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        # Looked up once: a dataset without it would otherwise fail the lookup at every batch.
        self._own_getitems: Callable[[list[Any]], list[Any]] | None = getattr(dataset, "__getitems__", None)

    def __getitem__(self, index: Any) -> Any:
        try:
            return self.dataset[index]
        except Exception as error:
            raise _with_sample(error, index)  # noqa: B904 (the original itself, or chained to it on Python 3.10)

    def __getitems__(self, indices: list[Any]) -> list[Any]:
        own = self._own_getitems
        if own is not None:  # the dataset reads batches itself: the failing sample is not known
            return own(indices)
        dataset, index = self.dataset, None
        try:
            return [dataset[(index := each)] for each in indices]  # the loader's own way, noting each index
        except Exception as error:
            raise _with_sample(error, index)  # noqa: B904 (as above)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Code that inspects loader.dataset (its attributes, a Subset's indices) sees the user's dataset.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _with_sample(error: Exception, index: Any) -> Exception:
    """``error`` with a note that names the sample (``sample index 13``), to raise again.

    The original error is kept, not wrapped: a loader worker sends its type and traceback, notes included,
    to the main process, which raises it again as that type, so the error the Trainer chains to its
    ``DataLoadingError`` is the dataset's own in both cases. Python 3.10 has no notes: a ``SampleError``
    chained to ``error`` names the sample there.
    """
    if sys.version_info < (3, 11):
        named = SampleError(f"sample index {index}: {type(error).__name__}: {error}")
        named.__cause__ = error
        return named
    error.add_note(f"sample index {index}")
    return error
