"""``Hooks``: calling a hook on the module and on each callback, paying nothing for those nobody overrides."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ember._utils import is_overridden
from ember.callbacks import Callback
from ember.module import Module

if TYPE_CHECKING:
    from ember.trainer import Trainer


class Hooks:
    """The implementations of each hook for one stage: the module's and each callback's, where they
    override it. Built when the stage starts (after a profiler has wrapped what it times), so the
    loops call exactly what is there, and nothing for a hook nobody overrides."""

    def __init__(self, trainer: Trainer, module: Module, callbacks: Sequence[Callback]) -> None:
        self._trainer = trainer
        self._module = module
        self._callbacks = list(callbacks)
        self._cache: dict[tuple[str, bool], list[Callable[..., Any]]] = {}

    def implementations(self, name: str, include_module: bool = True) -> list[Callable[..., Any]]:
        """What to call for hook ``name``: the module's (if ``include_module``), then each callback's."""
        key = (name, include_module)
        hooks = self._cache.get(key)
        if hooks is None:
            module = self._module
            hooks = [getattr(module, name)] if include_module and is_overridden(name, module, Module) else []
            hooks += [
                functools.partial(getattr(callback, name), self._trainer, module)
                for callback in self._callbacks
                if is_overridden(name, callback, Callback)
            ]
            self._cache[key] = hooks
        return hooks

    def module_hook(self, name: str) -> Callable[..., Any] | None:
        """The module's own ``name``, if it overrides it."""
        return getattr(self._module, name) if is_overridden(name, self._module, Module) else None

    def call(self, name: str, *args: Any) -> None:
        """Call ``name`` on the module, then on every callback."""
        for hook in self.implementations(name):
            hook(*args)

    def call_callbacks(self, name: str, *args: Any) -> None:
        for hook in self.implementations(name, include_module=False):
            hook(*args)
