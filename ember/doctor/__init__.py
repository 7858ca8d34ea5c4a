"""The speed doctor: watch a few training steps, then say what slows them down and how to fix it.

``ember doctor script.py`` runs a script (an Ember one or a hand-written PyTorch loop) for a bounded
number of optimizer steps; ``Trainer(doctor=True)`` watches the first steps of a run and goes on.

    watch.py         Watcher: instruments torch while it watches (through ember.instrument), filling
    measurements.py  Measurements, the plain figures of the run; then
    probe.py         measures, once at the end, the figures that cost time, where a finding can use them;
    findings.py      one pure function per finding, Measurements -> Finding | None;
    report.py        the report, as text or JSON;
    doctor.py        Doctor, which runs these in turn; run.py: run_script, for ``ember doctor``.
"""

from __future__ import annotations

from ember.doctor.doctor import Doctor, DoctorDone, active_doctor
from ember.doctor.findings import FINDINGS, Finding, diagnose
from ember.doctor.measurements import Measurements
from ember.doctor.run import run_script

__all__ = ["FINDINGS", "Doctor", "DoctorDone", "Finding", "Measurements", "active_doctor", "diagnose", "run_script"]
