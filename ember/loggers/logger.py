"""The ``Logger`` base class, and the versioned run directories shared by the file-based loggers.

A file-based logger's ``save_dir`` may be a local path or, as in Lightning, the URL of another file system
(``s3://bucket/runs``, ``gs://...``, ``memory://...``), reached through fsspec (``url_filesystem``).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import posixpath
import re
from argparse import Namespace
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ember.lightning_compat.hook import is_installed as lightning_names_served
from ember.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    import torch
    from fsspec import AbstractFileSystem

#: The name a logger's runs' directory has by default (``<save_dir>/ember_logs/version_N``).
DEFAULT_NAME = "ember_logs"


def default_name() -> str:
    """What ``DEFAULT_NAME`` stands for: itself, or Lightning's ``"lightning_logs"`` while Lightning's names are
    served (``ember.lightning``, ``ember run --lightning``), so that a Lightning program run unchanged writes its
    runs where it would on Lightning."""
    return "lightning_logs" if lightning_names_served() else DEFAULT_NAME


class Logger:
    """Where metrics and hyperparameters go. The Trainer calls loggers on the global-zero process only."""

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> int | str:
        return 0

    @property
    def save_dir(self) -> str | None:
        """The directory runs of this logger live under, or None if it keeps nothing on disk."""
        return None

    @property
    def log_dir(self) -> str | None:
        """This run's directory (checkpoints go under it by default)."""
        return None

    @property
    def root_dir(self) -> str | None:
        """The directory of every version of this logger's runs (None: it keeps nothing on disk)."""
        return None

    @property
    def group_separator(self) -> str:
        """What separates a group of values from their names (Lightning's ``"/"``)."""
        return "/"

    def use_version(self, version: int | str) -> None:
        """Adopt ``version`` (rank zero's choice), so that every rank names the same run directory."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Write ``metrics`` labelled ``step`` (the Trainer passes both by keyword, as Lightning does)."""
        raise NotImplementedError

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        pass

    def log_graph(self, model: torch.nn.Module, input_array: torch.Tensor | None = None) -> None:
        """Record the model's graph (``TensorBoardLogger(log_graph=True)`` does); called when ``fit`` starts."""

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Called after ``checkpoint_callback`` (a ``ModelCheckpoint``) saved a checkpoint file, for a logger that
        keeps checkpoints of its own (uploads them as artifacts)."""

    def save(self) -> None:
        """Flush what is buffered."""

    def finalize(self, status: str) -> None:
        """Called once at the end of a stage with "success", "failed" or "interrupted"."""
        self.save()


_LOGGER_METHODS = ("log_metrics", "log_hyperparams", "finalize")  # the ones the Trainer calls


def is_logger(value: Any) -> bool:
    """Whether ``value`` logs: a ``Logger``, or an object with the methods the Trainer calls on one (Lightning takes
    any such object: a stand-in such as a mock, or a logger of another library)."""
    return isinstance(value, Logger) or all(callable(getattr(value, name, None)) for name in _LOGGER_METHODS)


def run_directory_of(logger: Any, root: str | None = None) -> str | None:
    """The run directory of ``logger``, where Lightning puts its checkpoints: a file-keeping logger's
    ``version_dir``; for another logger, ``<save_dir>/<name>/<version>``, under ``root`` (the Trainer's
    ``default_root_dir``) when it has no ``save_dir`` (None: it has none, and no ``root`` is given)."""
    if isinstance(logger, VersionedLogger):
        return logger.version_dir  # without a TensorBoardLogger's sub_dir, as Lightning places checkpoints
    save_dir = getattr(logger, "save_dir", None)
    save_dir = root if save_dir is None else save_dir
    if save_dir is None:
        return None
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(os.fspath(save_dir), str(logger.name), version)


class VersionedLogger(Logger):
    """A logger that writes into ``<save_dir>/<name>/version_<N>``, N one more than the last run's.

    The version is claimed when first asked for (by the Trainer, on rank zero, before anything is
    written): its directory is created then, atomically, so two runs started together in one folder
    never share one. Loggers sharing ``save_dir`` and ``name`` write into the same run directory; without a
    name (None or ""), the versions are in ``save_dir`` itself.
    """

    #: What joins ``prefix`` and a metric's name (Lightning's class attribute: a subclass may change it).
    LOGGER_JOIN_CHAR = "-"

    def __init__(self, save_dir: str | os.PathLike, name: str | None, version: int | str | None) -> None:
        self._save_dir = os.fspath(save_dir)
        self._name = (default_name() if name == DEFAULT_NAME else name) or ""
        self._version = version
        #: Whether this run continues the one whose directory it writes into (a resumed fit), set by the Trainer.
        self.continues = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = claim_version(self.runs_dir)
        return self._version

    @property
    def runs_dir(self) -> str:
        """The directory this logger's runs (``version_<N>``) live in: ``<save_dir>/<name>``, of a subclass's
        ``save_dir`` and ``name`` too, as in Lightning."""
        return os.path.join(self.save_dir, self.name)

    @property
    def root_dir(self) -> str:
        """``runs_dir``, by Lightning's name."""
        return self.runs_dir

    def use_version(self, version: int | str) -> None:
        self._version = version

    @property
    def has_version(self) -> bool:
        """Whether the version was given or claimed already (else the next ``version`` claims one)."""
        return self._version is not None

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def version_dir(self) -> str:
        """This run's ``<save_dir>/<name>/version_<N>`` (its checkpoints go under it by default)."""
        version = self.version
        return os.path.join(self.runs_dir, version if isinstance(version, str) else f"version_{version}")

    @property
    def log_dir(self) -> str:
        return self.version_dir


def url_filesystem(path: str) -> AbstractFileSystem | None:
    """The fsspec file system of ``path`` when it is a URL (``s3://...``); None for a plain local path, which Ember
    writes with its own atomic and append-only file operations. fsspec comes with torch; the file system's own
    package (s3fs, gcsfs, ...) is needed for the URL's."""
    if "://" not in path:
        return None
    import fsspec

    return fsspec.core.url_to_fs(path)[0]


def save_hparams_to_yaml(
    config_yaml: str | os.PathLike, hparams: Mapping[str, Any] | Namespace, use_omegaconf: bool = True
) -> None:
    """Write ``hparams`` (a dict or an ``argparse.Namespace``) to the YAML file ``config_yaml`` (a path or a URL), the
    values YAML cannot hold as their repr (Lightning's ``core.saving`` function; Ember writes plain YAML whatever
    ``use_omegaconf`` says)."""
    import yaml

    path = os.fspath(config_yaml)
    # keys in order, as Lightning's yaml.dump writes them
    text = yaml.safe_dump(_yaml_ready(params_dict(hparams)), sort_keys=True, allow_unicode=True)
    filesystem = url_filesystem(path)
    if filesystem is not None:
        filesystem.pipe_file(path, text.encode())
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as file:
        file.write(text)


def load_hparams_from_yaml(config_yaml: str | os.PathLike, use_omegaconf: bool = True) -> dict[str, Any]:
    """The hyperparameters in the YAML file ``config_yaml`` (a path or a URL): a dict, whatever ``use_omegaconf``
    says; with a ``RuntimeWarning``, none when there is no such file (Lightning's ``core.saving`` function)."""
    import yaml

    path = os.fspath(config_yaml)
    filesystem = url_filesystem(path)
    if not (filesystem.isfile(path) if filesystem is not None else os.path.isfile(path)):
        rank_zero_warn(f"load_hparams_from_yaml: there is no file {path!r}; no hyperparameters", RuntimeWarning)
        return {}
    if filesystem is not None:
        text = filesystem.cat_file(path).decode()
    else:
        with open(path) as file:
            text = file.read()
    return yaml.safe_load(text) or {}


def params_dict(params: Mapping[str, Any] | Namespace | None) -> dict[str, Any]:
    """Hyperparameters as a dict: a loggers' ``log_hyperparams`` takes a dict, an ``argparse.Namespace`` or None."""
    if params is None:
        return {}
    return dict(vars(params) if isinstance(params, Namespace) else params)


def prefixed(metrics: Mapping[str, Any], prefix: str, separator: str = "-") -> Mapping[str, Any]:
    """``metrics`` with each name after ``prefix`` and ``separator`` (as they are without a prefix)."""
    return {f"{prefix}{separator}{name}": value for name, value in metrics.items()} if prefix else metrics


_PLAIN = (bool, int, float, str)


def _yaml_ready(value: Any) -> Any:
    """``value`` as plain YAML holds it: ``None``, booleans, numbers (NumPy's as Python's), strings, and
    lists and dicts of them; anything else as its repr."""
    if value is None or type(value) in _PLAIN:
        return value
    if isinstance(value, Mapping):
        return {key if type(key) in _PLAIN else repr(key): _yaml_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_yaml_ready(item) for item in value]
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return repr(value)


_VERSION_DIR = re.compile(r"^version_(\d+)$")


def next_version(root: str) -> int:
    """One more than the highest ``version_N`` directory under ``root`` (0 if there is none)."""
    versions = run_versions(root)
    return versions[-1] + 1 if versions else 0


def run_versions(root: str) -> list[int]:
    """The ``N`` of every ``version_N`` directory under ``root``, in increasing order (a file of such a name is
    no run, as in Lightning)."""
    filesystem = url_filesystem(root)
    if filesystem is not None:
        found = filesystem.ls(root, detail=True) if filesystem.isdir(root) else []
        entries = [posixpath.basename(entry["name"].rstrip("/")) for entry in found if entry["type"] == "directory"]
    else:
        found_here = os.listdir(root) if os.path.isdir(root) else []
        entries = [entry for entry in found_here if os.path.isdir(os.path.join(root, entry))]
    return sorted(int(m.group(1)) for entry in entries if (m := _VERSION_DIR.match(entry)))


def settle_versions(loggers: Sequence[Logger], continuing: str | None) -> list[int | str]:
    """Give each logger its run directory and return their versions (rank zero decides; the others adopt).

    A run that continues the checkpoint ``continuing`` in place keeps writing into the version directory
    that holds it (and its loggers are told so: they append to what is there); otherwise each runs directory
    gets a version claimed anew, shared by the loggers that write under it. A version the user gave is kept
    as it is.
    """
    claimed: dict[str, int | str] = {}
    for logger in loggers:
        if not isinstance(logger, VersionedLogger):
            continue
        if not logger.has_version:
            version = lineage_version(logger.runs_dir, continuing)
            shared = claimed.get(logger.runs_dir) if version is None else version
            if shared is not None:
                logger.use_version(shared)
        claimed.setdefault(logger.runs_dir, logger.version)
        logger.continues = continuing is not None and _inside(continuing, logger.log_dir)
    return [logger.version for logger in loggers]


def _inside(path: str, directory: str) -> bool:
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(directory))
    return relative != ".." and not relative.startswith(".." + os.sep)


def lineage_version(runs_dir: str, path: str | None) -> int | None:
    """N when ``path`` lies inside ``runs_dir/version_N`` (a checkpoint of that run), else None."""
    if path is None:
        return None
    relative = os.path.relpath(os.path.abspath(path), os.path.abspath(runs_dir))
    match = _VERSION_DIR.match(relative.split(os.sep)[0])
    return int(match.group(1)) if match and not relative.startswith("..") else None


def claim_version(root: str) -> int:
    """Create ``root/version_N`` for the next free N and return N.

    ``os.mkdir`` either creates the directory or finds it there: two runs that pick the same N (two
    jobs of an array, or nodes sharing a file system) cannot both create it, and the loser takes the
    next number. Under a URL (an object store, which has no directories to create atomically) N is the next
    free number.
    """
    filesystem = url_filesystem(root)
    if filesystem is not None:
        version = next_version(root)
        filesystem.makedirs(posixpath.join(root, f"version_{version}"), exist_ok=True)
        return version
    try:
        os.makedirs(root, exist_ok=True)
        version = next_version(root)
        while True:
            try:
                os.mkdir(os.path.join(root, f"version_{version}"))
                return version
            except FileExistsError:
                version += 1
    except OSError as error:
        raise type(error)(  # a PermissionError stays one
            f"cannot create a run directory under {root!r}: {error.strerror or error}; pass a "
            "default_root_dir (or a logger save_dir) you can write to"
        ) from error


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level, their keys joined with "/": {"opt": {"lr": 1}} becomes {"opt/lr": 1}. As in
    Lightning, a ``Namespace`` or dataclass value is a dict of its fields, and a list of dicts has its items'
    indices as keys: {"layers": [{"n": 2}]} becomes {"layers/0/n": 2}."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        value = _fields(value)
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}/"))
        elif isinstance(value, list) and value and all(isinstance(item, Mapping) for item in value):
            flat.update(flatten({str(index): item for index, item in enumerate(value)}, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _fields(value: Any) -> Any:
    """A ``Namespace`` or a dataclass instance as the dict of its fields; any other value as it is."""
    if isinstance(value, Namespace):
        return vars(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
