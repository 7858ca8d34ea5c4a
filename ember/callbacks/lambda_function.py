"""``LambdaCallback``: a callback made of functions, one per hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.callbacks.callback import Callback


class LambdaCallback(Callback):
    """``LambdaCallback(on_train_epoch_end=fn, ...)``: each keyword names a hook of ``Callback`` and gives the
    function to call for it, with the hook's arguments (the trainer and the module first)."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        for name, function in hooks.items():
            if not name.startswith(("on_", "setup", "teardown")) or not callable(getattr(Callback, name, None)):
                raise ValueError(f"LambdaCallback({name}=...): {name!r} is not a hook of Callback")
            if not callable(function):
                raise TypeError(f"LambdaCallback({name}={function!r}): expected a function")
            setattr(self, name, function)
