"""The doctor's report: text for people, JSON for programs."""

from __future__ import annotations

import dataclasses
import json

from ember.doctor.findings import Finding
from ember.doctor.measurements import Measurements


def text(m: Measurements, findings: list[Finding]) -> str:
    steps = m.measured_steps
    if steps == 0:
        return f"ember doctor: the run made {m.steps_seen} optimizer steps; more than {m.warmup} are needed"
    lines = [
        f"ember doctor: {steps} steps measured (after {m.warmup} of warm-up), {m.step_seconds * 1e3:.1f} ms per step, "
        f"{m.world_size} process(es)"
    ]
    if not findings:
        lines.append("no findings: nothing the doctor checks is slowing this run")
    for finding in findings:
        gain = "" if finding.estimated_gain is None else f"\n  estimated gain: {finding.estimated_gain:.0%}"
        where = "".join(f"\n  at {location}" for location in finding.locations)
        lines.append(
            f"\n[{finding.id}] {finding.title}\n  measured: {finding.measured}\n  why: {finding.why}\n"
            f"  fix: {finding.fix}{gain}{where}"
        )
    return "\n".join(lines)


def as_json(m: Measurements, findings: list[Finding]) -> str:
    steps = m.measured_steps
    return json.dumps(
        {
            "measured_steps": steps,
            "step_ms": m.step_seconds * 1e3 if steps else None,
            "findings": [dataclasses.asdict(finding) for finding in findings],
        },
        indent=2,
    )
