"""Find a batch size that fits and a learning rate that learns, before training."""

from ember.tuner.callback import BatchSizeFinder, LearningRateFinder
from ember.tuner.lr_finder import LRFinder
from ember.tuner.tuner import Tuner

__all__ = ["BatchSizeFinder", "LRFinder", "LearningRateFinder", "Tuner"]
