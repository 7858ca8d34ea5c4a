"""Profilers: ``Trainer(profiler="simple")`` tables where the time goes, ``"pytorch"`` records a trace."""

from __future__ import annotations

from ember.profilers.profiler import PassThroughProfiler, Profiler
from ember.profilers.pytorch import PyTorchProfiler
from ember.profilers.simple import SimpleProfiler

__all__ = ["PassThroughProfiler", "Profiler", "PyTorchProfiler", "SimpleProfiler", "select_profiler"]

_BY_NAME = {"simple": SimpleProfiler, "pytorch": PyTorchProfiler}


def select_profiler(profiler: str | Profiler | None) -> Profiler:
    """The profiler the Trainer's ``profiler`` flag names (one that does nothing for None)."""
    if profiler is None:
        return PassThroughProfiler()
    if isinstance(profiler, Profiler):
        return profiler
    if isinstance(profiler, str) and profiler in _BY_NAME:
        return _BY_NAME[profiler]()
    raise ValueError(
        f"profiler={profiler!r}: When passing string value for the `profiler` parameter of `Trainer`, it can only be "
        f"one of {list(_BY_NAME)} (else pass None or an instance of ember.profilers.Profiler)"
    )
