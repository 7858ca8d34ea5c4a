"""Callbacks: code that hooks into the Trainer's loop."""

from ember.callbacks.averaging import EMAWeightAveraging, WeightAveraging
from ember.callbacks.callback import Callback
from ember.callbacks.checkpoint import ModelCheckpoint
from ember.callbacks.device_stats import DeviceStatsMonitor
from ember.callbacks.early_stopping import EarlyStopping, EarlyStoppingReason
from ember.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from ember.callbacks.gradient_accumulation import GradientAccumulationScheduler
from ember.callbacks.lambda_function import LambdaCallback
from ember.callbacks.lr_monitor import LearningRateMonitor
from ember.callbacks.model_summary import ModelSummary
from ember.callbacks.on_exception import OnExceptionCheckpoint
from ember.callbacks.prediction_writer import BasePredictionWriter
from ember.callbacks.progress import ProgressBar
from ember.callbacks.progress_bars import RichProgressBar
from ember.callbacks.progress_base import ProgressBarBase
from ember.callbacks.pruning import ModelPruning
from ember.callbacks.spike import SpikeDetection, TrainingSpikeException
from ember.callbacks.stage_throughput import StageThroughputMonitor
from ember.callbacks.throughput import ThroughputMonitor
from ember.callbacks.timer import Timer
from ember.callbacks.tqdm_progress import TQDMProgressBar
from ember.callbacks.weight_averaging import StochasticWeightAveraging

__all__ = [
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "Callback",
    "DeviceStatsMonitor",
    "EMAWeightAveraging",
    "EarlyStopping",
    "EarlyStoppingReason",
    "GradientAccumulationScheduler",
    "LambdaCallback",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelPruning",
    "ModelSummary",
    "OnExceptionCheckpoint",
    "ProgressBar",
    "ProgressBarBase",
    "RichProgressBar",
    "SpikeDetection",
    "StageThroughputMonitor",
    "StochasticWeightAveraging",
    "TQDMProgressBar",
    "ThroughputMonitor",
    "Timer",
    "TrainingSpikeException",
    "WeightAveraging",
]
