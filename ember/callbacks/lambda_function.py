"""``LambdaCallback``: a callback made of functions, one per hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ember.callbacks.callback import Callback

# What a checkpoint holds of a callback: not for a function that may return nothing.
_NOT_HOOKS = ("state_dict", "load_state_dict")


class LambdaCallback(Callback):
    """``LambdaCallback(on_train_epoch_end=fn, ...)``: each keyword names a hook of ``Callback`` and gives the
    function to call for it, with the hook's arguments (the trainer and the module first). ``has_work_in=fn``
    is asked, with a hook's name, whether that hook has work; only an answer of False turns the hook off."""

    def __init__(self, **hooks: Callable[..., Any]) -> None:
        for name, function in hooks.items():
            if name.startswith("_") or name in _NOT_HOOKS or not callable(getattr(Callback, name, None)):
                raise TypeError(f"LambdaCallback.__init__() got an unexpected keyword argument {name!r}: it is not a "
                                "hook of Callback")  # fmt: skip
            if not callable(function):
                raise TypeError(f"LambdaCallback({name}={function!r}): expected a function")
        self._has_work_in = hooks.pop("has_work_in", None)
        for name, function in hooks.items():
            setattr(self, name, function)

    def has_work_in(self, hook: str) -> bool:
        # A function given for every hook alike (one that only records calls) answers None: the hook stays on.
        return self._has_work_in is None or self._has_work_in(hook) is not False
