"""The exception Ember raises for a configuration it cannot run: a flag, an argument or a call made where it is
not allowed (Lightning's ``MisconfigurationException``, served at its import paths), and the warning it gives for
one that may be a mistake."""


class MisconfigurationException(ValueError):
    """A configuration Ember cannot run. It is a ``ValueError``, so code catching either catches it."""


class PossibleUserWarning(UserWarning):
    """A warning about a setting that may be a mistake, or may be what was meant (Lightning's class of them)."""
