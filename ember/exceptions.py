"""The exception Ember raises for a configuration it cannot run: a flag, an argument or a call made where it is
not allowed (Lightning's ``MisconfigurationException``, served at its import paths)."""


class MisconfigurationException(ValueError):
    """A configuration Ember cannot run. It is a ``ValueError``, so code catching either catches it."""
