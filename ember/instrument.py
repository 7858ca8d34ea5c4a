"""Instrumenting a run: attributes replaced on their owners until everything is put back, in reverse order.

The profiler wraps a Trainer's parts (instances) while it profiles a stage; the doctor wraps torch's
classes and modules while it watches. Both go through ``Patches``, so that undoing leaves each owner
exactly as it was: an attribute the owner had of its own gets that very object back, one it only
inherited is removed again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Patches:
    """Attributes set on owners (instances, classes or modules), and other things to undo, until ``undo``."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.<name>`` to ``value`` until ``undo``."""
        if isinstance(owner, type):
            self._replace_on_class(owner, name, value)
        else:
            self._replace_in_dict(owner, name, value)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.<name>`` (its own or inherited) with ``make(original)`` until ``undo``; ``original``
        is what ``owner.<name>`` gives now (a bound method when ``owner`` is an instance)."""
        self.replace(owner, name, make(getattr(owner, name)))

    def on_undo(self, undo: Callable[[], None]) -> None:
        """Also call ``undo`` (say, a hook handle's ``remove``) when undoing, in its turn."""
        self._undo.append(undo)

    def undo(self) -> None:
        """Put everything back, the latest change first, so that one attribute patched twice ends as it began."""
        while self._undo:
            self._undo.pop()()

    def _replace_on_class(self, owner: type, name: str, value: Any) -> None:
        # A class's namespace is read-only: setattr writes it (and clears the type's method cache). What is
        # put back is the raw entry of the namespace, not what getattr gives: a staticmethod, classmethod or
        # slot wrapper stays one.
        namespace = vars(owner)
        if name in namespace:
            previous = namespace[name]
            self._undo.append(lambda: setattr(owner, name, previous))
        else:
            self._undo.append(lambda: delattr(owner, name))
        setattr(owner, name, value)

    def _replace_in_dict(self, owner: Any, name: str, value: Any) -> None:
        # Straight into the instance's (or module's) __dict__: a class's __setattr__ has no business here
        # (nn.Module's would register a Module value as a submodule, or refuse to replace a parameter).
        own = vars(owner)
        if name in own:
            previous = own[name]
            self._undo.append(lambda: own.__setitem__(name, previous))
        else:
            self._undo.append(lambda: own.pop(name, None))
        own[name] = value
