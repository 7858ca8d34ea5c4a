"""The loops: ``fit`` (epochs of accumulation windows, with validation), evaluation and prediction, the one
step runner they and the tuner share, and the progress record a checkpoint saves."""

from ember.loops.evaluate import EvaluationLoop, PredictionLoop
from ember.loops.fit import FitLoop
from ember.loops.hooks import Hooks
from ember.loops.progress import Progress
from ember.loops.step import ManualOptimizer, StepRunner, training_loss

__all__ = [
    "EvaluationLoop",
    "FitLoop",
    "Hooks",
    "ManualOptimizer",
    "PredictionLoop",
    "Progress",
    "StepRunner",
    "training_loss",
]
