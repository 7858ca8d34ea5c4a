"""The doctor's estimated gains against the gains measured after applying its advice; writes bench/doctor.md.

    python bench/doctor.py [--rounds 2] [--output bench/doctor.md]

Each planted mistake of tests/scripts/doctor_cases.py (a hand-written PyTorch loop) is first run
under ``ember doctor --json`` for its finding and estimate; then the script is timed with the
mistake and with the doctor's fix, in turn (mistake, fix, fix, mistake per round), and the measured
gain is one minus the ratio of the median seconds per step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CASES_SCRIPT = os.path.join(os.path.dirname(HERE), "tests", "scripts", "doctor_cases.py")

# (planted mistake, processes, the finding it should produce, what the fix buys when it is not speed). The planted
# "sync" is left out: reading a CPU tensor's value waits for no device, so on a CPU it is no host-device sync.
CASES = [
    ("input", 1, "input-bound", None),
    ("graph", 1, "graph-kept", "memory: the graphs stop piling up"),
    ("bare-forward", 2, "ddp-bare-forward", "correctness: gradients are averaged again"),
    ("find-unused", 2, "ddp-find-unused", None),
    ("set-epoch", 2, "ddp-sampler-epoch", "correctness: each epoch is shuffled differently"),
    ("threads", 2, "cpu-oversubscribed", None),
    ("accumulation", 2, "ddp-sync-every-micro-batch", None),
]


def _command(processes: int, *arguments: str) -> list[str]:
    if processes == 1:
        return [sys.executable, *arguments]
    return [sys.executable, "-m", "ember", "run", "--nproc-per-node", str(processes), *arguments]


def diagnose(mistake: str, processes: int, directory: str) -> dict:
    command = [sys.executable, "-m", "ember", "doctor", "--json", "--nproc-per-node", str(processes), CASES_SCRIPT,
               "--mistakes", mistake]  # fmt: skip
    output = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=directory, check=True).stdout
    return json.loads(output[output.index("{\n") : output.rindex("}") + 1])


def seconds_per_step(mistake: str, processes: int, fixed: bool, extra: list[str], directory: str) -> float:
    arguments = [CASES_SCRIPT, "--mistakes", mistake, "--timing", "--steps", "80", *extra]
    arguments += ["--fixed"] if fixed else []
    job = subprocess.run(_command(processes, *arguments), capture_output=True, text=True, timeout=600, cwd=directory)
    if job.returncode != 0:
        raise RuntimeError(f"{' '.join(arguments)} failed:\n{job.stderr[-3000:]}")
    output = job.stdout
    return float(re.search(r"seconds per step: ([0-9.]+)", output).group(1))  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default=os.path.join(HERE, "doctor.md"))
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for mistake, processes, expected, note in CASES:
            report = diagnose(mistake, processes, directory)
            finding = next((f for f in report["findings"] if f["id"] == expected), None)
            estimate = None if finding is None else finding["estimated_gain"]
            advised = re.search(r"num_workers=(\d+)", finding["fix"]) if finding else None
            extra = ["--workers", advised.group(1)] if advised else []
            planted, fixed = [], []
            for _ in range(args.rounds):
                planted.append(seconds_per_step(mistake, processes, False, extra, directory))
                fixed.append(seconds_per_step(mistake, processes, True, extra, directory))
                fixed.append(seconds_per_step(mistake, processes, True, extra, directory))
                planted.append(seconds_per_step(mistake, processes, False, extra, directory))
            measured = 1 - statistics.median(fixed) / statistics.median(planted)
            rows.append((expected if finding else f"{expected} (NOT FOUND)", mistake, processes, estimate, measured,
                         statistics.median(planted), statistics.median(fixed), note))  # fmt: skip
            print(rows[-1], flush=True)

    lines = [
        "# The doctor's estimates against measured gains",
        "",
        f"Measured with `python bench/doctor.py --rounds {args.rounds}` (torch {torch.__version__}, CPU, "
        f"{os.cpu_count()} cores, Gloo for two processes). Each planted mistake of "
        "`tests/scripts/doctor_cases.py` (a hand-written PyTorch loop) was run under `ember doctor`, then timed "
        "with the mistake and with the doctor's fix applied (medians of per-step times, mistake and fix "
        "alternated). A gain is the share of step time saved. The findings about GPUs (`host-sync`, `precision`, "
        "`small-batch`) need a GPU and are not measured here.",
        "",
        "| Finding | Planted mistake | Processes | Doctor's estimate | Measured after the fix | ms per step "
        "(mistake → fix) | What the fix buys besides speed |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for finding, mistake, processes, estimate, measured, planted_s, fixed_s, note in rows:
        shown = "—" if estimate is None else f"{estimate:.0%}"
        lines.append(
            f"| `{finding}` | {mistake} | {processes} | {shown} | {round(measured, 2) + 0.0:.0%} | "  # no "-0%"
            f"{planted_s * 1e3:.1f} → {fixed_s * 1e3:.1f} | {note or ''} |"
        )
    with open(args.output, "w") as file:
        file.write("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
