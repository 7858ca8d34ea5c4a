"""Rank-zero helpers: print, warn, log and run functions on the global-zero process only."""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from ember.exceptions import PossibleUserWarning
from ember.lightning_compat.hook import is_installed as lightning_names_served

_T = TypeVar("_T")

# Launchers that set a global rank, in the order they are trusted.
_RANK_VARIABLES = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _rank_from_environment() -> int:
    for name in _RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def rank_zero_only(fn: Callable[..., _T]) -> Callable[..., _T | None]:
    """Decorate ``fn`` so that it runs on the global-zero process and returns ``None`` elsewhere.

    The rank is the Trainer's once one exists; before that it is read from the launcher's variables.
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> _T | None:
        if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
            return fn(*args, **kwargs)
        return None

    return wrapped


rank_zero_only.rank = _rank_from_environment()  # type: ignore[attr-defined]


@rank_zero_only
def rank_zero_print(*args: Any, **kwargs: Any) -> None:
    print(*args, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str, category: type[Warning] = UserWarning, stacklevel: int = 3) -> None:
    warnings.warn(message, category, stacklevel=stacklevel)


@rank_zero_only
def rank_zero_info(*args: Any, **kwargs: Any) -> None:
    """Print an informational message (as ``print`` takes it) on the global-zero process."""
    print(*args, **kwargs)


def disable_possible_user_warnings(module: str = "") -> None:
    """Ignore the ``PossibleUserWarning``s (about settings that may be mistakes) from here on: all of them, or those
    of the modules whose name matches ``module`` (a regular expression, as ``warnings.filterwarnings`` takes)."""
    warnings.filterwarnings("ignore", category=PossibleUserWarning, module=module)


class EmberDeprecationWarning(DeprecationWarning):
    """What ``rank_zero_deprecation`` warns with (Lightning's ``LightningDeprecationWarning``): a
    ``DeprecationWarning``, which ``pytest.deprecated_call`` and the warning filters take as one."""


@rank_zero_only
def rank_zero_deprecation(message: str, stacklevel: int = 3) -> None:
    """Warn, on the global-zero process, that what ``message`` names is deprecated."""
    warnings.warn(message, EmberDeprecationWarning, stacklevel=stacklevel)


class WarningCache(set[str]):
    """Gives each message once (on the global-zero process): as a warning, a deprecation or an informational
    message (Lightning's class of that name)."""

    def warn(self, message: str, category: type[Warning] = UserWarning) -> None:
        if message not in self:
            self.add(message)
            rank_zero_warn(message, category, stacklevel=4)  # the caller of warn

    def deprecation(self, message: str) -> None:
        if message not in self:
            self.add(message)
            rank_zero_deprecation(message, stacklevel=4)

    def info(self, message: str) -> None:
        if message not in self:
            self.add(message)
            rank_zero_log_info(message)


class _Console(logging.Handler):
    """Writes the "ember" logger's messages to ``sys.stdout`` as it is at each message (so that redirecting or
    capturing stdout takes them, as it took their ``print``), above the progress bars while they are drawn;
    unless the root logger already writes to the console, where they would then be shown twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if _root_shows_on_console():
            return
        try:
            text = self.format(record)
            tqdm = sys.modules.get("tqdm")  # drawing bars imported it; importing it here would cost every message
            if tqdm is not None:
                tqdm.tqdm.write(text, file=sys.stdout)  # the bars are cleared, the text written, the bars redrawn
            else:
                print(text, file=sys.stdout, flush=True)
        except Exception:
            self.handleError(record)


def _root_shows_on_console() -> bool:
    """Whether the root logger has a handler writing to stdout or stderr (``logging.basicConfig()``'s)."""
    consoles = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    return any(getattr(handler, "stream", None) in consoles for handler in logging.getLogger().handlers)


class _LightningLevels(logging.Filter):
    """In a program that uses Lightning's names, drops the messages that the levels it set on Lightning's loggers
    would have hidden on Lightning: a level set on the logger of the Lightning module that gives the message
    (``utilities.rank_zero`` unless ``announce`` was told another) or on a package above it, as
    ``logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)``, which Lightning's docs advise."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not lightning_names_served():
            return True
        module = getattr(record, "lightning_module", "utilities.rank_zero")
        packages = ("lightning.pytorch", "pytorch_lightning")  # whichever the program imported
        return all(record.levelno >= _lightning_level(f"{package}.{module}") for package in packages)


def _lightning_level(name: str) -> int:
    """The level set on logger ``name`` or on the nearest package above it (the root excluded), else INFO, the
    level Lightning gives its own. Read without creating the loggers that the program never named."""
    while name:
        logger = logging.Logger.manager.loggerDict.get(name)
        if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET:
            return logger.level
        name = name.rpartition(".")[0]
    return logging.INFO


# As Lightning's logger: informational messages are shown at INFO by default, by a handler of their own, and
# logging.getLogger("ember").setLevel(logging.WARNING) silences them. They also reach the root logger's
# handlers (a log file, pytest's caplog), as any library's records do.
_logger = logging.getLogger("ember")
_logger.setLevel(logging.INFO)
_logger.addHandler(_Console())
_logger.addFilter(_LightningLevels())


def log_info(message: str, lightning_module: str = "utilities.rank_zero") -> None:
    """Log an informational message to the "ember" logger at INFO, on this process. ``lightning_module`` is where
    Lightning logs it, under ``lightning.pytorch``: the levels a Lightning program sets there apply to it."""
    _logger.info(message, extra={"lightning_module": lightning_module})


@rank_zero_only
def announce(message: str, lightning_module: str = "utilities.rank_zero") -> None:
    """Log an informational message of the Trainer (a model summary, where a run resumes), as ``log_info``, on the
    global-zero process."""
    log_info(message, lightning_module)


@rank_zero_only
def rank_zero_log_info(message: Any, *args: Any, **kwargs: Any) -> None:
    """Lightning's ``rank_zero_info``: ``logging``'s ``info(message, *args)`` (``%``-formatted) on the "ember" logger,
    on the global-zero process. It is shown as the Trainer's messages are, and the levels a Lightning program sets
    on Lightning's loggers silence it, as there."""
    _logger.info(message, *args, **kwargs)


@rank_zero_only
def rank_zero_debug(message: str, *args: Any) -> None:
    """Log a debugging message to the "ember" logger (``logging``), on the global-zero process."""
    _logger.debug(message, *args)


# The warnings rank_zero_warn_once has given in this process.
_warned: set[tuple[str, type[Warning]]] = set()


def rank_zero_warn_once(message: str, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn`` on the global-zero process, the first time this process gives ``message``.

    For warnings that would otherwise come from every process, or again at every step, epoch or save.
    ``stacklevel`` counts from the caller, as ``warnings.warn``'s does.
    """
    if rank_zero_only.rank != 0 or (message, category) in _warned:  # type: ignore[attr-defined]
        return
    _warned.add((message, category))
    warnings.warn(message, category, stacklevel=stacklevel + 1)
