"""Callbacks: code that hooks into the Trainer's loop."""

from ember.callbacks.callback import Callback
from ember.callbacks.checkpoint import ModelCheckpoint
from ember.callbacks.device_stats import DeviceStatsMonitor
from ember.callbacks.early_stopping import EarlyStopping
from ember.callbacks.lr_monitor import LearningRateMonitor
from ember.callbacks.model_summary import ModelSummary
from ember.callbacks.on_exception import OnExceptionCheckpoint
from ember.callbacks.progress import ProgressBar
from ember.callbacks.throughput import ThroughputMonitor
from ember.callbacks.timer import Timer

__all__ = [
    "Callback",
    "DeviceStatsMonitor",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "OnExceptionCheckpoint",
    "ProgressBar",
    "ThroughputMonitor",
    "Timer",
]
