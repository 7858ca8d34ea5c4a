"""``DummyLogger``: a logger that keeps nothing, standing in for the real ones during ``fast_dev_run``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ember.loggers.logger import Logger
from ember.rank_zero import rank_zero_only


class DummyExperiment:
    """Takes any method call (``add_image``, ``log_artifact``, ...) and does nothing with it: the ``experiment`` of a
    ``DummyLogger``, and of a logger on the processes other than global zero (``rank_zero_experiment``)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy and pickle look for optional dunders: those stay missing
            raise AttributeError(name)
        return self._discard

    def __getitem__(self, key: Any) -> Any:
        return self

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    @staticmethod
    def _discard(*args: Any, **kwargs: Any) -> None:
        return None


class DummyLogger(Logger):
    """Writes nothing. ``Trainer(fast_dev_run=...)`` puts it in place of the configured loggers, so code that
    writes to ``self.logger.experiment`` still runs while nothing is kept."""

    @property
    def experiment(self) -> Any:
        return DummyExperiment()

    @property
    def version(self) -> str:
        return ""

    def log_metrics(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getitem__(self, index: int) -> DummyLogger:
        """Itself, so that code that indexes the loggers it was given (``self.logger[0]``) still runs."""
        return self

    def __getattr__(self, name: str) -> Any:
        """A method that does nothing for any other name (another logger's ``log_text``, ``log_image``, ...)."""
        return getattr(DummyExperiment(), name)


def rank_zero_experiment(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a logger's ``experiment`` getter so that processes other than global zero get an object that
    takes any call and does nothing, instead of opening a run of their own."""

    @functools.wraps(fn)
    def experiment(self: Any) -> Any:
        return fn(self) if rank_zero_only.rank == 0 else DummyExperiment()  # type: ignore[attr-defined]

    return experiment
