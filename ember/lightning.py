"""``import ember.lightning``: serve Lightning's names from Ember from here on, in one line.

For a notebook's first cell, or the top of a script, before Lightning is imported::

    import ember.lightning
    import lightning.pytorch as pl  # pl.Trainer is ember.Trainer

It calls ``ember.lightning_compat.install()``; ``ember.lightning_compat.uninstall()`` undoes it.
"""

from ember.lightning_compat import install

install()
