"""What a stage (fit, validate, test, predict) does when it ends with an exception, as Lightning's Trainer does:
the status turns to interrupted, the callbacks', the datamodule's and the strategy's ``on_exception`` run, and a
``KeyboardInterrupt`` ends the process with ``SystemExit(1)`` (a Ctrl-C during ``fit`` is first a preemption
signal, ``loops.stopping``'s: this is the second one, or one a hook raised)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ember import hints
from ember.rank_zero import announce

if TYPE_CHECKING:
    from ember.loops.hooks import Hooks
    from ember.trainer import Trainer


def stage_failed(trainer: Trainer, hooks: Hooks | None, exception: BaseException) -> None:
    """Run what a stage runs when ``exception`` ends it (``hooks``: the stage's, None where it failed before they
    were gathered); raises ``SystemExit(1)`` where the process is to exit instead of raising ``exception`` (the
    caller re-raises it otherwise)."""
    hints.explain(exception)  # a note on what a common mistake (a batch's structure, ...) looks like
    earlier = trainer.strategy.announce_failure(exception) if isinstance(exception, Exception) else None
    call_exception_hooks(trainer, hooks, exception)
    if earlier is not None:  # the traceback to read is that rank's, not this consequence's
        print(f"[rank{trainer.global_rank}]: stopping because {earlier}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    if isinstance(exception, KeyboardInterrupt):
        # As Lightning: the hooks have run and the stage is torn down on the way out; the status says it was cut short.
        announce("Detected KeyboardInterrupt, attempting graceful shutdown ...")  # (Lightning's words)
        raise SystemExit(1) from exception


def call_exception_hooks(trainer: Trainer, hooks: Hooks | None, exception: BaseException) -> None:
    """The ``on_exception`` hooks, in Lightning's order: the callbacks', the datamodule's, then the strategy's."""
    trainer.state.end(interrupted=True)  # as Lightning, before on_exception
    if hooks is not None:
        hooks.call_callbacks("on_exception", exception)
        hooks.call_datamodule("on_exception", exception)
    trainer.strategy.on_exception(exception)
