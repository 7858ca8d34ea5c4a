"""Loggers: where metrics and hyperparameters are written. ``CSVLogger`` is the default."""

from ember.loggers.csv_logger import CSVLogger
from ember.loggers.logger import Logger

__all__ = ["CSVLogger", "Logger"]
