"""``SimpleProfiler``: where the time of each step goes, as a table."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import torch

from ember.profilers.profiler import Profiler, latest_start

if TYPE_CHECKING:
    from ember.trainer import Trainer


class Record:
    """What one action took: each call's time (seconds, its own time only), how often it ran, in total and at the
    longest."""

    __slots__ = ("durations",)

    def __init__(self) -> None:
        self.durations: list[float] = []

    @property
    def calls(self) -> int:
        return len(self.durations)

    @property
    def total(self) -> float:
        return sum(self.durations)

    @property
    def longest(self) -> float:
        return max(self.durations, default=0.0)


class SimpleProfiler(Profiler):
    """Reports, per action, the calls, mean and longest time, total time and share of the stage.

    Each action counts its own time only: time spent in an action started inside it (``backward``
    inside a manual ``training_step``, logging inside a hook) counts for the inner one, so the rows
    add up to the stage's time; "other" is the time no action covered (the loop itself, setup).
    ``records`` holds the figures after the stage, and ``recorded_durations`` (Lightning's name) each call's
    time, by action. On a CUDA device it waits for the device when
    actions start and stop, so that GPU work counts for the action that queued it; this removes the
    overlap of host and device, so a profiled run is slower than an unprofiled one. ``extended=False`` leaves the
    calls, the longest call and the share out of the table, as Lightning's leaves out the calls and the share.
    """

    def __init__(
        self, dirpath: str | os.PathLike | None = None, filename: str | None = "profile", extended: bool = True
    ) -> None:
        super().__init__(dirpath, filename)
        self.extended = extended
        self.records: dict[str, Record] = {}
        self._stack: list[list] = []  # [action, start time, time spent in actions started inside it]
        self._started = time.perf_counter()  # used on its own, it reports the time since it was made
        self._elapsed = 0.0
        self._device: torch.device | None = None

    def attach(self, trainer: Trainer, stage: str) -> None:
        self.records = {}
        self._stack = []
        device = trainer.strategy.root_device
        self._device = device if device.type == "cuda" else None
        super().attach(trainer, stage)
        self._started = time.perf_counter()

    def detach(self, trainer: Trainer, stage: str) -> None:
        self._elapsed = time.perf_counter() - self._started
        super().detach(trainer, stage)

    def start(self, action: str) -> None:
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        self._stack.append([action, time.perf_counter(), 0.0])

    def stop(self, action: str) -> None:
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        now = time.perf_counter()
        _, started, inner = self._stack.pop(latest_start(self._stack, action))
        elapsed = now - started
        if self._stack:
            self._stack[-1][2] += elapsed
        record = self.records.get(action)
        if record is None:
            record = self.records[action] = Record()
        record.durations.append(elapsed - inner)

    @property
    def recorded_durations(self) -> dict[str, list[float]]:
        """Each action's calls, their own time in seconds, as ``records`` has them (Lightning's attribute)."""
        return {action: record.durations for action, record in self.records.items()}

    def summary(self) -> str:
        if not self.records:
            return ""
        total = max(self._elapsed or time.perf_counter() - self._started, 1e-9)
        rows = sorted(self.records.items(), key=lambda item: item[1].total, reverse=True)
        other = max(total - sum(record.total for record in self.records.values()), 0.0)
        width = max(len(action) for action in [*self.records, _OTHER])

        def line(action: str, calls: str, mean: str, longest: str, spent: str, share: str) -> str:
            cells = (calls, mean, longest, spent, share) if self.extended else (mean, spent)
            return f"{action:<{width}}" + "".join(f"  {cell:>10}" for cell in cells)

        def seconds(value: float) -> tuple[str, str]:
            return f"{value:.3f}", f"{100 * value / total:.1f}"

        header = line("Action", "Calls", "Mean (ms)", "Max (ms)", "Total (s)", "%")
        rule = "-" * len(header)
        lines = [f"Profile of {self._stage or 'the actions'}: {total:.3f} s", header, rule]
        for action, record in rows:
            mean, longest = f"{1e3 * record.total / record.calls:.3f}", f"{1e3 * record.longest:.3f}"
            lines.append(line(action, str(record.calls), mean, longest, *seconds(record.total)))
        lines += [line(_OTHER, "", "", "", *seconds(other)), rule, line("total", "", "", "", *seconds(total))]
        return "\n".join(lines)


_OTHER = "other (the loop itself, setup)"
