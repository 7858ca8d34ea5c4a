"""Training curves from ``metrics.csv`` files: what ``ember plot`` draws, one panel per metric."""

from __future__ import annotations

import csv
import glob
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

from ember._utils import require

# "train_loss_step", "val_loss" and "loss" share the panel "loss".
_STAGE_PREFIX = re.compile(r"^(train|val|valid|validation|test)[_/]")
_STAGE_SUFFIX = re.compile(r"_(step|epoch)(?=/|$)")
_LINE_STYLES = ("-", "--", ":", "-.")

Series = dict[str, list[tuple[float, float]]]  # metric name -> [(x, value), ...]


def metrics_files(path: str) -> list[str]:
    """The metrics.csv files ``path`` names: the file itself, the one in a run directory, or all below it."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such file or directory")
    if os.path.isfile(os.path.join(path, "metrics.csv")):
        return [os.path.join(path, "metrics.csv")]
    found = sorted(glob.glob(os.path.join(path, "**", "metrics.csv"), recursive=True))
    if not found:
        raise FileNotFoundError(f"{path}: no metrics.csv in this directory or below it")
    return found


def read_series(path: str, x: Literal["step", "epoch"]) -> Series:
    """Each metric's points from one metrics.csv; with ``x="epoch"``, one point per epoch (the mean)."""
    points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        if x not in (reader.fieldnames or []):
            raise ValueError(f"{path}: not a metrics file with a {x!r} column (columns: {reader.fieldnames})")
        for row in reader:
            position = float(row[x])
            for name, value in row.items():
                if name not in ("step", "epoch") and value not in ("", None):
                    points[name][position].append(float(value))
    return {name: [(at, sum(values) / len(values)) for at, values in sorted(by_x.items())]
            for name, by_x in points.items()}  # fmt: skip


def panel_of(metric: str) -> str:
    """The panel a metric is drawn in: its name without the stage prefix and the _step/_epoch suffix."""
    return _STAGE_SUFFIX.sub("", _STAGE_PREFIX.sub("", metric))


def plot(
    paths: Sequence[str],
    output: str = "curves.png",
    metrics: Sequence[str] | None = None,
    x: Literal["step", "epoch"] = "step",
) -> str:
    """Draw the curves of the runs in ``paths`` into the image ``output`` (its extension picks the format;
    without one, PNG, and ``.png`` is added); return its path.

    ``metrics`` keeps only the named metrics or panels ("loss" keeps train_loss and val_loss).
    """
    require("matplotlib", "plot", "ember plot")
    from matplotlib.figure import Figure

    files = [file for path in paths for file in metrics_files(path)]
    runs = dict(zip(_run_labels(files), (read_series(file, x) for file in files)))
    available = sorted({name for series in runs.values() for name in series})
    if metrics:
        unknown = [name for name in metrics if name not in available and name not in map(panel_of, available)]
        if unknown:
            raise ValueError(f"--metrics {','.join(unknown)}: not logged; the runs have {', '.join(available)}")
        available = [name for name in available if name in metrics or panel_of(name) in metrics]
    if not available:
        raise ValueError(f"nothing to plot: the metrics files of {', '.join(paths)} hold no values")
    panels: dict[str, list[str]] = defaultdict(list)
    for name in sorted(available, key=lambda name: "loss" not in name):  # losses first
        panels[panel_of(name)].append(name)

    columns = 1 if len(panels) == 1 else 2 if len(panels) in (2, 4) else 3
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(5.5 * columns, 3.8 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    colors = [f"C{index}" for index in range(10)]
    for ax, (panel, names) in zip(axes, panels.items()):
        lowest, highest = math.inf, -math.inf
        for run_index, (run, series) in enumerate(runs.items()):
            for name_index, name in enumerate(names):
                if name not in series:
                    continue
                xs, ys = zip(*series[name])
                lowest, highest = min(lowest, *ys), max(highest, *ys)
                several = len(runs) > 1  # several runs: a color per run, a line style per metric
                ax.plot(
                    xs, ys, label=f"{run}: {name}" if several else name,
                    color=colors[(run_index if several else name_index) % len(colors)],
                    linestyle=_LINE_STYLES[name_index % len(_LINE_STYLES)] if several else "-",
                    marker="o" if len(xs) <= 30 else None, markersize=3, linewidth=1.5,
                )  # fmt: skip
        if lowest > 0 and highest / lowest > 100:  # losses falling over decades read better on a log scale
            ax.set_yscale("log")
        ax.set_title(panel)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    if not os.path.splitext(output)[1]:
        output += ".png"  # what matplotlib would write: the name returned is the file's
    figure.savefig(output, dpi=120)
    return output


def _run_labels(files: list[str]) -> list[str]:
    """Short names for runs: their directories, less the part all of them share ("version_0", ...)."""
    directories = [os.path.dirname(os.path.abspath(file)) for file in files]
    if len(directories) == 1:
        return [os.path.basename(directories[0]) or directories[0]]
    common = os.path.commonpath(directories)
    return [os.path.relpath(directory, common) if directory != common else file for directory, file in
            zip(directories, files)]  # fmt: skip
