"""Run Lightning programs on Ember, unchanged.

``install()`` puts an import hook in place that serves ``lightning``, ``lightning.pytorch`` and
``pytorch_lightning`` (and the parts of them Ember covers: callbacks, loggers, strategies, utilities, cli,
demos, ...) from Ember, whether or not Lightning is installed::

    import ember.lightning_compat
    ember.lightning_compat.install()  # first thing in a notebook, before Lightning is imported (or, in one
                                      # line: import ember.lightning)
    import lightning.pytorch as pl    # pl.Trainer is ember.Trainer, pl.LightningModule is ember.Module

``ember run --lightning train.py ARGS`` does the same for a script, in every process it starts. A Lightning
name that Ember does not cover raises ``ImportError`` when it is imported, naming the closest Ember
equivalent. ``docs/lightning.md`` lists what maps to what.
"""

from ember.lightning_compat.hook import LightningNameError, install, is_installed, uninstall

__all__ = ["LightningNameError", "install", "is_installed", "uninstall"]
