"""``LRFinder``: the loss curve of a learning-rate sweep and the learning rate it suggests."""

from __future__ import annotations

import math
import os
from typing import Any

from ember._utils import Reads


class LRFinder:
    """What ``Tuner.lr_find`` measured: ``results["lr"]`` and ``results["loss"]`` (smoothed), and a suggestion."""

    #: Weight of the past in the loss's exponential moving average (single steps are noisy).
    SMOOTHING = 0.98
    # Lightning's names of the sweep's bounds.
    lr_min: Reads[float] = Reads("min_lr")
    lr_max: Reads[float] = Reads("max_lr")

    def __init__(self, mode: str, min_lr: float, max_lr: float, num_training: int) -> None:
        self.mode, self.min_lr, self.max_lr, self.num_training = mode, min_lr, max_lr, num_training
        self.results: dict[str, list[float]] = {"lr": [], "loss": []}
        self.suggested_lr: float | None = None
        self._average = 0.0
        self._best = math.inf

    def add(self, lr: float, loss: float | None) -> None:
        """Record a step's loss; None (the step was skipped) is recorded as NaN, outside the average."""
        count = len(self.results["lr"]) + 1
        self.results["lr"].append(lr)
        if loss is None:
            self.results["loss"].append(math.nan)
            return
        self._average = self.SMOOTHING * self._average + (1 - self.SMOOTHING) * loss
        smoothed = self._average / (1 - self.SMOOTHING**count)  # the average without its zero start's bias
        self.results["loss"].append(smoothed)
        self._best = min(self._best, smoothed)

    def diverged(self, threshold: float) -> bool:
        """Whether the loss has climbed past ``threshold`` times its best (or is no longer finite)."""
        last = self.results["loss"][-1]
        return not math.isfinite(last) or last > threshold * self._best

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The learning rate where the smoothed loss falls fastest (None if the sweep has too few finite losses)."""
        end = len(self.results["lr"]) - skip_end
        points = zip(self.results["lr"][skip_begin:end], self.results["loss"][skip_begin:end])
        finite = [(lr, loss) for lr, loss in points if math.isfinite(loss)]  # skipped steps' losses are NaN
        if len(finite) < 3:
            return None
        lrs, losses = [lr for lr, _ in finite], [loss for _, loss in finite]
        scale = (lambda lr: math.log10(lr)) if self.mode == "exponential" else (lambda lr: lr)
        slopes = [
            (losses[i + 1] - losses[i - 1]) / (scale(lrs[i + 1]) - scale(lrs[i - 1])) for i in range(1, len(losses) - 1)
        ]
        steepest = min(range(len(slopes)), key=lambda i: slopes[i] if math.isfinite(slopes[i]) else math.inf)
        return lrs[steepest + 1]

    def plot(self, path: str | os.PathLike | None = None, suggest: bool = True) -> Any:
        """Draw the loss against the learning rate (log scale for an exponential sweep); save it to ``path``."""
        try:
            import matplotlib

            if path is not None:
                matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise ImportError("LRFinder.plot needs matplotlib: pip install 'ember[plot]'") from err
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.plot(self.results["lr"], self.results["loss"], label="loss (smoothed)")
        if self.mode == "exponential":
            axes.set_xscale("log")
        if suggest and self.suggested_lr is not None:
            axes.axvline(self.suggested_lr, color="tab:red", linestyle="--", label=f"suggested {self.suggested_lr:.2e}")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("loss")
        axes.legend()
        figure.tight_layout()
        if path is not None:
            figure.savefig(os.fspath(path), dpi=120)
        return figure
