"""Lightning's ``RichProgressBar``, as Ember's ``ProgressBar`` with its arguments (``TQDMProgressBar`` is Lightning's
own, in ``tqdm_progress``).

It draws Ember's bar: tqdm on a terminal, a compact line every few seconds elsewhere. It is redrawn by time, not
every ``refresh_rate`` batches; ``refresh_rate=0`` turns it off, as in Lightning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ember.callbacks.progress import ProgressBar
from ember.exceptions import MisconfigurationException


class _SwitchableBar(ProgressBar):
    """Ember's bar, off when ``refresh_rate`` (Lightning's count of batches, read back as given) is 0."""

    def __init__(self, refresh_rate: int) -> None:
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise MisconfigurationException(
                f"{type(self).__name__}(refresh_rate={refresh_rate!r}): expected a number of batches >= 0"
            )
        super().__init__()
        self.refresh_rate = refresh_rate

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0


@dataclasses.dataclass
class RichProgressBarTheme:
    """Lightning's styles of a ``RichProgressBar``'s parts (rich's style strings), kept as given: Ember's bar, which
    does not draw with rich, shows them in no colour."""

    description: Any = ""
    progress_bar: Any = "#6206E0"
    progress_bar_finished: Any = "#6206E0"
    progress_bar_pulse: Any = "#6206E0"
    batch_progress: Any = ""
    time: Any = "dim"
    processing_speed: Any = "dim underline"
    metrics: Any = "italic"
    metrics_text_delimiter: str = " "
    metrics_format: str = ".3f"


class RichProgressBar(_SwitchableBar):
    """Lightning's ``RichProgressBar(refresh_rate, leave, theme, console_kwargs)``: Ember's bar (see the module),
    which does not draw with rich (``theme`` is kept, in ``theme``, and not drawn)."""

    def __init__(
        self,
        refresh_rate: int = 100,
        leave: bool = False,
        theme: RichProgressBarTheme | None = None,
        console_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(refresh_rate)
        self.leave = leave
        self.theme = theme if theme is not None else RichProgressBarTheme()
        self.console_kwargs = dict(console_kwargs or {})
