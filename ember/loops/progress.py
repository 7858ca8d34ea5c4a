"""``Progress``: where the fit loop is, as one record that checkpoints save and restore."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.loops.step import StepResult


@dataclasses.dataclass
class Progress:
    """Everything the fit loop knows about where it is.

    A checkpoint holds this record; a resumed run continues from it. The position inside an epoch is
    kept as samples of the epoch's global order (the order all ranks together read the data in), so
    that a run resumed with another number of processes or another batch size can continue at the
    same sample.
    """

    epoch: int = 0
    """The epoch being trained (``trainer.current_epoch``): the number of epochs finished before it."""

    global_step: int = 0
    """Optimizer steps taken since the run began (``trainer.global_step``)."""

    total_batches: int = 0
    """Training batches (micro-batches) this rank has run since the run began."""

    epoch_batches: int = 0
    """Training batches this rank has run in the current epoch."""

    epoch_steps: int = 0
    """Optimizer steps taken in the current epoch."""

    window_batches: int = 0
    """Micro-batches of the unfinished accumulation window (0 at a step boundary)."""

    epoch_samples: int = 0
    """Samples of the current epoch's global order that all ranks together have consumed."""

    window_samples: int = 0
    """Of those, the samples of the unfinished accumulation window (0 at a step boundary)."""

    epoch_finished: bool = False
    """Whether the current epoch's training and its end-of-epoch work are done (a checkpoint saved at
    the end of an epoch resumes at the start of the next one)."""

    def advance(self, result: StepResult, samples: int) -> None:
        """Count what a training batch did: ``result``, from the step runner, and ``samples``, the samples of the
        epoch's global order that it and the other ranks' batches read. The one place the counters move."""
        batches, steps = result.batches, result.steps
        self.total_batches += batches
        self.epoch_batches += batches
        self.epoch_samples += samples
        if steps:
            self.global_step += steps
            self.epoch_steps += steps
        if not result.closes_window:
            self.window_batches += batches
            self.window_samples += samples
        elif self.window_batches:
            self.window_batches = self.window_samples = 0

    def finish_epoch(self) -> None:
        """The epoch's training and its end-of-epoch work are done: a checkpoint saved from here on resumes at the
        next epoch."""
        self.epoch_finished = True

    def start_next_epoch(self) -> None:
        self.epoch += 1
        self.restart_epoch()

    def restart_epoch(self) -> None:
        """Go back to the start of the current epoch (its optimizer steps stay counted in ``global_step``)."""
        self.epoch_batches = self.epoch_steps = self.epoch_samples = 0
        self.window_batches = self.window_samples = 0
        self.epoch_finished = False

    def drop_unfinished_window(self) -> None:
        """Go back to the start of the unfinished accumulation window (its gradients are not kept)."""
        self.epoch_batches -= self.window_batches
        self.epoch_samples -= self.window_samples
        self.window_batches = self.window_samples = 0

    def renumber_epoch_batches(self, batches: int) -> None:
        """Count the epoch's batches so far as ``batches``: a run resumed with another layout numbers the rest of
        the epoch as the last batches of an epoch of its own layout."""
        self.epoch_batches = batches

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, state[field.name])
        if self.epoch_finished:
            self.start_next_epoch()
