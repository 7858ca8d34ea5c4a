"""``DummyLogger``: a logger that keeps nothing, standing in for the real ones during ``fast_dev_run``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from ember.loggers.logger import Logger
from ember.rank_zero import rank_zero_only


class _Discard:
    """Takes any method call (``add_image``, ``log_artifact``, ...) and does nothing with it."""

    def __getattr__(self, name: str) -> Any:
        return self._discard

    @staticmethod
    def _discard(*args: Any, **kwargs: Any) -> None:
        return None


class DummyLogger(Logger):
    """Writes nothing. ``Trainer(fast_dev_run=...)`` puts it in place of the configured loggers, so code that
    writes to ``self.logger.experiment`` still runs while nothing is kept."""

    @property
    def experiment(self) -> Any:
        return _Discard()

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        pass


def rank_zero_experiment(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a logger's ``experiment`` getter so that processes other than global zero get an object that
    takes any call and does nothing, instead of opening a run of their own."""

    @functools.wraps(fn)
    def experiment(self: Any) -> Any:
        return fn(self) if rank_zero_only.rank == 0 else _Discard()  # type: ignore[attr-defined]

    return experiment
