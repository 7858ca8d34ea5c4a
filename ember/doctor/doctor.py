"""``Doctor``: watches a run for a number of optimizer steps, then reports what slows it down."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ember.doctor import probe, report
from ember.doctor.findings import Finding, diagnose
from ember.doctor.measurements import Measurements
from ember.doctor.watch import Watcher

if TYPE_CHECKING:
    from ember.trainer import Trainer


class DoctorDone(BaseException):
    """The doctor has watched enough steps: ends the script ``ember doctor`` runs (not an error)."""


_active: Doctor | None = None


def active_doctor() -> Doctor | None:
    """The doctor installed in this process, if one is (``ember doctor`` installs one before the script runs)."""
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
        self.report_text = ""
        self.watcher = Watcher(steps, warmup, on_last_step=self.finish)
        self._findings: list[Finding] | None = None

    @property
    def measurements(self) -> Measurements:
        return self.watcher.measurements

    def install(self) -> Doctor:
        global _active
        if _active is not None:
            raise RuntimeError("a doctor is already watching this process")
        _active = self
        self.watcher.install()
        return self

    def uninstall(self) -> None:
        global _active
        self.watcher.uninstall()
        if _active is self:
            _active = None

    def attach(self, trainer: Trainer) -> None:
        """An Ember run: the doctor can also measure the module's step in other precisions."""
        self.trainer = trainer

    def finish(self) -> None:
        """Stop measuring and remove the instrumentation, work out the findings, show the report on rank zero."""
        if self._findings is not None:
            return
        self.watcher.end_window()
        self.uninstall()
        measurements = self.measurements
        if measurements.measured_steps:  # every rank takes part: some figures are measured together
            probe.measure(measurements, self.watcher.graph_tensors_at_start, self.watcher.ddp_models, self.trainer)
        self._findings = diagnose(measurements)
        self.report_text = self.as_json_text() if self.as_json else self.report()
        if int(os.environ.get("RANK", "0")) == 0:
            print(self.report_text, flush=True)
        if self.stop:
            raise DoctorDone

    def findings(self) -> list[Finding]:
        if self._findings is None:
            self.finish()
        assert self._findings is not None
        return self._findings

    def report(self) -> str:
        return report.text(self.measurements, self._findings or [])

    def as_json_text(self) -> str:
        return report.as_json(self.measurements, self._findings or [])
