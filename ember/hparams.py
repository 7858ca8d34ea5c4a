"""``save_hyperparameters()`` and ``hparams`` (``HyperparametersMixin``, which ``Module`` and ``DataModule`` share), and
the way a checkpoint keeps them and rebuilds an object from them."""

from __future__ import annotations

import ast
import contextlib
import csv
import functools
import importlib
import inspect
import os
from argparse import Namespace
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from contextvars import ContextVar
from types import FrameType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from torch import nn

from ember._utils import AttributeDict
from ember.checkpoint.io import plain_values
from ember.loggers.logger import load_hparams_from_yaml, params_dict
from ember.rank_zero import rank_zero_warn
from ember.utilities import is_picklable

_PRIMITIVES = (bool, int, float, str)
_T = TypeVar("_T")

#: The hyperparameter that names the function rebuilding its object from the others (see ``given_hyperparameters``).
INSTANTIATOR_KEY = "_instantiator"
#: The hyperparameter in which the command line records the class it chose by class path (``--model=...``).
CLASS_PATH_KEY = "_class_path"
#: The functions a checkpoint may name there, and what runs for each: Ember's command line records its own, and a
#: checkpoint of Lightning's CLI names Lightning's, whose work Ember's does. No other name is imported: a checkpoint
#: must not choose the code that loading it runs.
_TRUSTED_INSTANTIATORS = dict.fromkeys(
    ("ember.cli_lightning.instantiate_module", "lightning.pytorch.cli.instantiate_module",
     "pytorch_lightning.cli.instantiate_module"),
    "ember.cli_lightning.instantiate_module",
)  # fmt: skip
#: The class being built under ``given_hyperparameters``, and the hyperparameters it records.
_GIVEN: ContextVar[tuple[type, dict[str, Any]] | None] = ContextVar("given_hyperparameters", default=None)


class HyperparametersMixin:
    """``save_hyperparameters()`` and ``hparams`` for any class (Lightning's ``core.mixins.HyperparametersMixin``)."""

    #: Where a checkpoint keeps the hyperparameters, and the ``__init__`` argument that took them as one config.
    CHECKPOINT_HYPER_PARAMS_KEY: ClassVar[str] = "hyper_parameters"
    CHECKPOINT_HYPER_PARAMS_NAME: ClassVar[str] = "hparams_name"

    _hparams: AttributeDict
    _log_hparams = True
    _config_argument: str | None = None  # the __init__ argument given whole to save_hyperparameters, if any

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: Sequence[str] | str | None = None,
        frame: FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """Record the arguments of ``__init__`` (or the names given, or one dict or Namespace) in ``self.hparams``.

        They are written to the checkpoint, and to the logger unless ``logger=False``; ``load_from_checkpoint``
        rebuilds the object from them. The arguments of each ``__init__`` that called this one are recorded too (a
        subclass's, or those of an object built by another's ``__init__``), the innermost's value losing where names
        meet. Each call adds to what earlier calls saved, and ``ignore`` removes names.
        """
        ignored = {ignore} if isinstance(ignore, str) else set(ignore or ())
        given = _GIVEN.get()
        if given is not None and type(self) is given[0]:
            init_args = dict(given[1])
        else:
            init_args = _init_arguments(frame or _caller_frame(), self)
        configs = [arg for arg in args if not isinstance(arg, str)]
        if configs:  # Lightning takes the first that is not a name, and ignores the names then
            chosen = _config_values(configs[0])
            self._config_argument = next((name for name, value in init_args.items() if value is configs[0]), None)
        else:
            missing = [name for name in args if name not in init_args]
            if missing:
                raise ValueError(
                    f"save_hyperparameters{tuple(args)}: {missing} are not arguments of __init__ "
                    f"(it has {sorted(init_args)})"
                )
            chosen = {name: init_args[name] for name in args} if args else init_args
        self.hparams.update({k: v for k, v in chosen.items() if k not in ignored})
        for name in ignored:
            self.hparams.pop(name, None)
        for name, value in self.hparams.items():
            if isinstance(value, nn.Module):
                rank_zero_warn(
                    f"save_hyperparameters(): {name!r} is an instance of `nn.Module` and is already saved during "
                    "checkpointing (its weights), while checkpoints leave it out of the hyperparameters: pass "
                    f"save_hyperparameters(ignore=[{name!r}])",
                    stacklevel=4,  # the __init__ that called save_hyperparameters
                )
        self._hparams_initial = AttributeDict(self.hparams)
        self._log_hparams = logger

    @property
    def hparams(self) -> AttributeDict:
        if not hasattr(self, "_hparams"):
            self._hparams = AttributeDict()
        return self._hparams

    @property
    def hparams_initial(self) -> AttributeDict:
        """``hparams`` as ``save_hyperparameters`` left them (later changes to ``hparams`` are not seen here)."""
        return AttributeDict(getattr(self, "_hparams_initial", {}))

    @property
    def hparams_for_logger(self) -> dict[str, Any]:
        """The hyperparameters to send to the loggers: ``hparams_initial`` (none after
        ``save_hyperparameters(logger=False)``)."""
        return dict(self.hparams_initial) if self._log_hparams else {}


@contextlib.contextmanager
def given_hyperparameters(cls: type, hparams: Mapping[str, Any], instantiator: str) -> Iterator[None]:
    """While a ``cls`` is built, its ``save_hyperparameters()`` records ``hparams`` instead of the arguments its
    ``__init__`` received, with ``instantiator``: the function that ``load_from_checkpoint`` rebuilds it by. A command
    line records so the configuration it built the object from (an optimizer given by class path, say), which plain
    values hold where the arguments received (the optimizer's class, bound to its options) would not."""
    token = _GIVEN.set((cls, {**hparams, INSTANTIATOR_KEY: instantiator}))
    try:
        yield
    finally:
        _GIVEN.reset(token)


def build(cls: type[_T], arguments: dict[str, Any]) -> _T:
    """``cls(**arguments)``; or, where the saved hyperparameters name the function that rebuilds their object (see
    ``given_hyperparameters``), what that function builds of ``cls`` from them."""
    path = arguments.pop(INSTANTIATOR_KEY, None)
    if path is None:
        return cls(**arguments)
    target = _TRUSTED_INSTANTIATORS.get(path) if isinstance(path, str) else None
    if target is None:
        raise ValueError(
            f"The instantiator {path!r} from the checkpoint is not among those trusted to rebuild a {cls.__name__} "
            f"({sorted(_TRUSTED_INSTANTIATORS)}): it was not run, as it could be any code"
        )
    module, _, name = target.rpartition(".")
    instantiate: Callable[[type[_T], dict[str, Any]], _T] = getattr(importlib.import_module(module), name)
    return instantiate(cls, arguments)


def _config_values(config: Any) -> dict[str, Any]:
    """What a config given whole to ``save_hyperparameters`` holds: a mapping's items (a dict, an OmegaConf
    ``DictConfig``), a ``Namespace``'s attributes. Other objects are refused, as Lightning refuses them."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, Namespace):
        return dict(vars(config))
    primitive = isinstance(config, _PRIMITIVES)
    reason = f"Primitives {_PRIMITIVES} are not allowed" if primitive else f"Unsupported config type of {type(config)}"
    raise ValueError(
        f"save_hyperparameters({config!r}): {reason}. Pass the names of __init__'s arguments (as strings), or one "
        "dict or Namespace"
    )


def _caller_frame() -> FrameType:
    """The frame that called the function calling this one."""
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    if caller is None:
        raise RuntimeError("save_hyperparameters() needs the calling frame, which this Python does not give")
    return caller


def _init_arguments(frame: FrameType, obj: object) -> dict[str, Any]:
    """The arguments of the function running in ``frame`` (an ``__init__`` of ``obj``) and of each ``__init__`` of
    an object with hyperparameters that called it, out to the first frame that is none: a subclass's ``__init__``
    calling its parent's, or one that builds ``obj`` (as Lightning collects them). Where they share a name, the outer
    frame's value wins."""
    levels = [_frame_arguments(frame, obj)]
    current = frame.f_back
    while current is not None and (constructed := _constructed(current)) is not None:
        levels.append(_frame_arguments(current, constructed))
        current = current.f_back
    arguments: dict[str, Any] = {}
    for level in levels:
        arguments.update(level)
    return arguments


def _constructed(frame: FrameType) -> HyperparametersMixin | None:
    """The object with hyperparameters whose ``__init__`` runs in ``frame`` (None: none does)."""
    code = frame.f_code
    if code.co_name != "__init__" or code.co_argcount == 0:
        return None
    self = frame.f_locals.get(code.co_varnames[0])
    return self if isinstance(self, HyperparametersMixin) else None


def _frame_arguments(frame: FrameType, owner: object) -> dict[str, Any]:
    """The arguments a method of ``owner`` received (``self`` and ``*args`` excluded, ``**kwargs`` flattened)."""
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    local = frame.f_locals
    arguments = {name: local[name] for name in names if name in local and local[name] is not owner}
    has_varargs = bool(code.co_flags & inspect.CO_VARARGS)
    if code.co_flags & inspect.CO_VARKEYWORDS:
        kwargs_name = code.co_varnames[len(names) + has_varargs]
        arguments.update(frame.f_locals.get(kwargs_name, {}))
    return arguments


# ------------------------------------------------------------------------------- checkpoints
def checkpoint_entries(owner: HyperparametersMixin) -> dict[str, Any]:
    """What a checkpoint keeps of ``owner``'s hyperparameters (under its class's ``CHECKPOINT_HYPER_PARAMS_*`` keys):
    nothing when it has none, as in Lightning, whose programs test for the key to know whether there are any."""
    if not owner.hparams:
        return {}
    key = owner.CHECKPOINT_HYPER_PARAMS_KEY
    entries = {key: plain_values(dict(owner.hparams), key)}
    if owner._config_argument is not None:
        entries[owner.CHECKPOINT_HYPER_PARAMS_NAME] = owner._config_argument
    return entries


class _ClassOnly(classmethod):
    """A classmethod that refuses to be called on an instance, as Lightning's ``load_from_checkpoint``:
    ``model.load_from_checkpoint(path)`` would build a new module and leave ``model`` as it was."""

    def __get__(self, instance: object, owner: type | None = None) -> Callable[..., Any]:
        bound = super().__get__(instance, owner)
        if instance is None:
            return bound

        @functools.wraps(bound)
        def refused(*args: Any, **kwargs: Any) -> Any:  # read from an instance, it can still be inspected
            raise TypeError(
                f"The classmethod `{type(instance).__name__}.{bound.__name__}` cannot be called on an instance. "
                "Please call it on the class type and make sure the return value is used."
            )

        return refused


if TYPE_CHECKING:  # the type checker reads it as the classmethod it is
    class_only_method = classmethod
else:
    class_only_method = _ClassOnly


def init_arguments(
    cls: type[HyperparametersMixin],
    checkpoint: Mapping[str, Any],
    overrides: Mapping[str, Any],
    *past_keys: str,
    hparams_file: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """The arguments that rebuild a ``cls`` from the hyperparameters ``checkpoint`` saved (or, without them, from
    those under ``past_keys``, where older releases saved them), or, as in Lightning, from the YAML file
    ``hparams_file`` in their place, with ``overrides`` taking precedence; an argument that ``cls.__init__`` does not
    take is left out, unless it takes ``**kwargs``."""
    found = next((key for key in (cls.CHECKPOINT_HYPER_PARAMS_KEY, *past_keys) if key in checkpoint), None)
    saved = dict(checkpoint[found]) if found is not None else {}
    if hparams_file is not None:
        if os.path.splitext(os.fspath(hparams_file))[1].lower() not in (".yml", ".yaml"):
            raise ValueError(f"load_from_checkpoint(hparams_file={hparams_file!r}): a .yml or .yaml file is required")
        saved = dict(load_hparams_from_yaml(hparams_file))
    parameters = inspect.signature(cls.__init__).parameters
    config_argument = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
    if config_argument in parameters:  # they were given whole, as one config: give them back as one
        saved = {config_argument: AttributeDict(saved)}
    arguments = {**saved, **overrides}
    if not any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters.values()):
        # A parent's saved hyperparameters that this class's __init__ does not take are left out.
        arguments = {name: value for name, value in arguments.items() if name in parameters or name == INSTANTIATOR_KEY}
    return arguments


def drop_unpicklable(hparams: dict[str, Any]) -> None:
    """Remove, with a warning each, the hyperparameters that cannot be pickled (a lambda, ...): nothing could save
    them (Lightning's ``clean_namespace``)."""
    for name in [name for name, value in hparams.items() if not is_picklable(value)]:
        rank_zero_warn(
            f"Attribute {name!r} removed from hparams because it cannot be pickled; leave it out with "
            f"save_hyperparameters(ignore=[{name!r}])"
        )
        del hparams[name]


def init_arguments_by_frame(
    frame: FrameType, path_args: list[dict[str, Any]], inside: bool = False, classes: tuple[type, ...] = ()
) -> list[dict[str, Any]]:
    """The arguments of each method of a class (of one of ``classes``, when given) running in ``frame`` and the
    frames that called it, appended to ``path_args``, innermost first: from the first such frame out to the next
    that is none (``inside``: ``frame`` is already within them), as Lightning's ``collect_init_args``. A method is
    known by its ``__class__`` cell, which a method that calls ``super()`` has."""
    current: FrameType | None = frame
    while current is not None and current.f_back is not None:  # the outermost frame (the script's) is no method
        owner_class = current.f_locals.get("__class__")
        if isinstance(owner_class, type) and (not classes or issubclass(owner_class, classes)):
            code = current.f_code
            owner = current.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            path_args.append(_frame_arguments(current, owner))
            inside = True
        elif inside:
            break
        current = current.f_back
    return path_args


def init_keys(cls: type) -> tuple[str, str | None, str | None]:
    """The names ``cls.__init__`` gives ``self``, ``*args`` and ``**kwargs`` (None where it takes none), as
    Lightning's ``parse_class_init_keys``."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())  # type: ignore[misc]

    def first(kind: inspect._ParameterKind) -> str | None:
        return next((parameter.name for parameter in parameters if parameter.kind == kind), None)

    return parameters[0].name, first(inspect.Parameter.VAR_POSITIONAL), first(inspect.Parameter.VAR_KEYWORD)


# ------------------------------------------------------------------------------- fields
def _field_holders(module: Any, name: str) -> list[Any]:
    """Where ``name`` is kept, in Lightning's order: the module's attribute, its ``hparams``, then the attached
    datamodule's attribute and its ``hparams``. The last one is what is read; a write changes them all."""
    trainer = getattr(module, "_trainer", None)  # the `trainer` property raises when none is attached
    datamodule = getattr(trainer, "datamodule", None)
    holders = []
    for owner in (module, datamodule):
        if owner is None:
            continue
        if hasattr(owner, name):
            holders.append(owner)
        hparams = getattr(owner, "hparams", None)
        # Any container counts, as in Lightning: a dict, or a namespace answering `in` (argparse.Namespace).
        if isinstance(hparams, Container) and name in hparams:
            holders.append(hparams)
    return holders


def _missing_field(name: str) -> AttributeError:
    return AttributeError(
        f"{name} is neither stored in the model namespace nor the `hparams` namespace/dict, nor the datamodule."
    )


def has_field(module: Any, name: str) -> bool:
    """Whether the module, its hyperparameters or its trainer's datamodule has ``name`` (Lightning's
    ``lightning_hasattr``)."""
    return bool(_field_holders(module, name))


def get_field(module: Any, name: str) -> Any:
    """``name`` from the datamodule (its attribute, else its hyperparameter), else from the module's
    hyperparameters, else from the module's attribute (Lightning's ``lightning_getattr``)."""
    holders = _field_holders(module, name)
    if not holders:
        raise _missing_field(name)
    holder = holders[-1]
    return holder[name] if isinstance(holder, Mapping) else getattr(holder, name)


def set_field(module: Any, name: str, value: Any) -> None:
    """Set ``name`` everywhere ``get_field`` finds it, so that the module and its datamodule agree (Lightning's
    ``lightning_setattr``); raise ``AttributeError`` where it is nowhere."""
    holders = _field_holders(module, name)
    if not holders:
        raise _missing_field(name)
    for holder in holders:
        if isinstance(holder, Mapping):
            holder[name] = value  # type: ignore[index]  # hparams are a dict
        else:
            setattr(holder, name, value)


def save_hparams_to_tags_csv(tags_csv: str | os.PathLike, hparams: Mapping[str, Any] | Namespace) -> None:
    """Write ``hparams`` to a CSV file of ``key,value`` rows after that header (Lightning 1's ``meta_tags.csv``,
    which ``load_hparams_from_tags_csv`` reads back); its folder must exist, as Lightning's requires."""
    path = os.fspath(tags_csv)
    folder = os.path.dirname(path)
    if folder and not os.path.isdir(folder):
        raise RuntimeError(f"save_hparams_to_tags_csv: there is no folder {folder!r} to write {path!r} in")
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["key", "value"])
        writer.writerows(params_dict(hparams).items())


def load_hparams_from_tags_csv(tags_csv: str | os.PathLike) -> dict[str, Any]:
    """The hyperparameters of a CSV file that ``save_hparams_to_tags_csv`` wrote: each value a Python literal where
    its text is one (``1``, ``2.0``, ``True``), else the text; with a ``RuntimeWarning``, none when there is no such
    file (Lightning's ``core.saving`` function)."""
    path = os.fspath(tags_csv)
    if not os.path.isfile(path):
        rank_zero_warn(f"load_hparams_from_tags_csv: there is no file {path!r}; no hyperparameters", RuntimeWarning)
        return {}
    with open(path, newline="") as file:
        rows = list(csv.reader(file))[1:]  # after the header
    return {key: _literal(value) for key, value in rows}


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):  # a word, not a literal: the text itself
        return text
