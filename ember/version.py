"""Ember's version (its own module, so that any part of the package can read it without a cycle)."""

__version__ = "0.1.0"
