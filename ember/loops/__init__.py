"""The loops: ``fit`` (``loops.fit``: epochs of accumulation windows, with validation), evaluation and prediction
(``loops.evaluate``), the hook caller (``loops.hooks``), stopping (``loops.stopping``), and the parts anything that
runs training steps shares, exported here: the progress record a checkpoint saves and the one step runner."""

from ember.loops.progress import Progress
from ember.loops.step import StepResult, StepRunner, training_loss

__all__ = ["Progress", "StepResult", "StepRunner", "training_loss"]
