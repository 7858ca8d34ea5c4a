"""Loggers: where metrics and hyperparameters are written. ``CSVLogger`` is the default.

``TensorBoardLogger``, ``MLflowLogger`` and ``WandbLogger`` import their packages only when constructed.
"""

from ember.loggers.csv_logger import CSVLogger
from ember.loggers.dummy import DummyLogger
from ember.loggers.logger import Logger
from ember.loggers.mlflow import MLflowLogger
from ember.loggers.tensorboard import TensorBoardLogger
from ember.loggers.wandb import WandbLogger

MLFlowLogger = MLflowLogger  # Lightning's spelling

__all__ = ["CSVLogger", "DummyLogger", "Logger", "MLFlowLogger", "MLflowLogger", "TensorBoardLogger", "WandbLogger"]
