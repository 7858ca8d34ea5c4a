"""Callbacks: code that hooks into the Trainer's loop."""

from ember.callbacks.callback import Callback
from ember.callbacks.checkpoint import ModelCheckpoint
from ember.callbacks.early_stopping import EarlyStopping
from ember.callbacks.lr_monitor import LearningRateMonitor
from ember.callbacks.progress import ProgressBar
from ember.callbacks.throughput import ThroughputMonitor

__all__ = ["Callback", "EarlyStopping", "LearningRateMonitor", "ModelCheckpoint", "ProgressBar", "ThroughputMonitor"]
