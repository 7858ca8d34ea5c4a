"""Fault tolerance on CPU: the throughput of ``ember run --replica-groups 2`` against plain DDP of 2 processes, and
how long a failure costs.

    python bench/ft.py [--rounds 2] [--steps 300] [--width 256] [--sleep 0.0]

Both jobs run ``tests/scripts/train_ft.py`` (a small MLP, Adam, batches of 4 per process; ``--sleep`` adds that
many seconds of stand-in work to each step, for the figure of a model whose step takes that long), one thread per
process, in the order DDP, fault tolerance, fault tolerance, DDP, ... so that a drift in machine speed cancels out.
A job's step time is the median interval between committed steps after its first fifth. Then one fault-tolerant
job kills replica group 1 twice (SIGKILL between two steps, then, restarted and healed, during the gradient
allreduce) and reports the seconds from each kill to the survivor's next committed step and to the restarted
group's first committed step (its start, the heal included).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "scripts", "train_ft.py")


def run_job(launch: list[str], out: str, *arguments: str) -> list[dict]:
    """Run ``ember run LAUNCH train_ft.py --out OUT ARGUMENTS``; the processes' summaries."""
    command = [sys.executable, "-m", "ember", "run", *launch, SCRIPT, "--out", out, *arguments]
    job = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    if job.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{job.stderr[-5000:]}")
    summaries = []
    for path in sorted(glob.glob(os.path.join(out, "group*.json"))):
        with open(path) as file:
            summaries.append(json.load(file))
    return summaries


def step_seconds(summary: dict) -> float:
    times = [when for when, _ in summary["commits"]]
    times = times[len(times) // 5 :]
    return statistics.median(later - earlier for earlier, later in itertools.pairwise(times))


def throughput(rounds: int, steps: int, width: int, sleep: float) -> dict[str, list[float]]:
    arguments = ["--steps", str(steps), "--width", str(width), "--sleep", str(sleep)]
    seconds: dict[str, list[float]] = {"ddp": [], "ft": []}
    jobs = {"ddp": ["--nproc-per-node", "2"], "ft": ["--replica-groups", "2"]}
    for round_ in range(rounds):
        for name in ("ddp", "ft") if round_ % 2 == 0 else ("ft", "ddp"):
            with tempfile.TemporaryDirectory() as out:
                extra = ["--strategy", "ddp"] if name == "ddp" else []
                summaries = run_job(jobs[name], out, *arguments, *extra)
                seconds[name].append(statistics.mean(step_seconds(summary) for summary in summaries))
    return seconds


def failures(sleep: float) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as out:
        arguments = ["--steps", "100000", "--sleep", str(max(sleep, 0.02)), "--kill-between", "10",
                     "--kill-during", "5"]  # fmt: skip
        summaries = run_job(["--replica-groups", "2", "--max-restarts", "2"], out, *arguments)
        survivor = next(summary for summary in summaries if summary["group"] == 0)
        commits = survivor["commits"]
        figures: dict[str, list[float]] = {"to_survivor_commit": [], "to_restarted_commit": [], "dropped": []}
        for attempt in (0, 1):
            with open(os.path.join(out, f"killed_{attempt}.json")) as file:
                killed = json.load(file)
            # The survivor's first commit of a step the killed group had not committed.
            after = min(when for when, step in commits if step > killed["step"])
            figures["to_survivor_commit"].append(after - killed["time"])
            with open(os.path.join(out, f"first_commit_{attempt + 1}.json")) as file:
                figures["to_restarted_commit"].append(json.load(file)["time"] - killed["time"])
        figures["dropped"].append(survivor["dropped"])
        return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="jobs of each kind")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds of stand-in work per step")
    parser.add_argument("--no-kill", action="store_true", help="measure the throughput only")
    args = parser.parse_args()
    seconds = throughput(args.rounds, args.steps, args.width, args.sleep)
    ddp, ft = statistics.median(seconds["ddp"]), statistics.median(seconds["ft"])
    print(f"step time: DDP {1000 * ddp:.2f} ms, fault tolerance {1000 * ft:.2f} ms: x{ft / ddp:.3f} "
          f"({100 * (ft / ddp - 1):+.1f}%)")  # fmt: skip
    if args.no_kill:
        return
    figures = failures(args.sleep)
    print("kill -> survivor's next committed step: "
          + ", ".join(f"{seconds:.2f} s" for seconds in figures["to_survivor_commit"])
          + " (between steps, during the allreduce); steps the survivor dropped: "
          + str(figures["dropped"][0]))  # fmt: skip
    print(
        "kill -> restarted group's first committed step: "
        + ", ".join(f"{seconds:.2f} s" for seconds in figures["to_restarted_commit"])
    )


if __name__ == "__main__":
    main()
