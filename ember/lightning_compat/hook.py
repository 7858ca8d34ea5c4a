"""The import hook: a ``sys.meta_path`` finder that serves Lightning's package names from Ember.

Each served module is built from a table of ``names``: its attributes are Ember's own objects, imported
when first used, so ``lightning.pytorch.LightningModule is ember.Module``. A module or name Ember does not
cover raises ``ImportError`` at import, naming it and what to use instead, never later.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

from ember.lightning_compat.names import FABRIC, LIGHTNING, MISSING_MODULES, PYTORCH, Missing, Names

#: The packages served; Lightning's own, when installed, stays hidden while the hook is installed.
ROOTS = ("lightning", "pytorch_lightning", "lightning_fabric")
#: The Lightning version whose API Ember follows, as ``lightning.__version__`` reports it.
LIGHTNING_VERSION = "2.6.0"


class LightningNameError(ImportError):
    """A Lightning module or name that Ember does not cover."""


def table_of(fullname: str) -> Names:
    """The names of served module ``fullname``, or a ``LightningNameError`` saying what to use instead."""
    root, _, rest = fullname.partition(".")
    if root == "lightning" and not rest:
        return LIGHTNING
    fabric_key = rest if root == "lightning_fabric" else _fabric_key(root, rest)
    if fabric_key in FABRIC:
        return FABRIC[fabric_key]
    key = rest.removeprefix("pytorch").removeprefix(".") if root == "lightning" else rest
    covered = root == "pytorch_lightning" or (root == "lightning" and rest.split(".")[0] == "pytorch")
    if covered and key in PYTORCH:
        return PYTORCH[key]
    hint = next((hint for prefix, hint in MISSING_MODULES.items() if (key or root).startswith(prefix)), None)
    covered_parts = ", ".join(key for key, names in sorted(PYTORCH.items()) if key and names and "." not in key)
    raise LightningNameError(
        f"{fullname} is a part of Lightning that Ember does not cover: "
        + (hint or f"Ember covers lightning.pytorch's {covered_parts}"),
        name=fullname,
    )


def _fabric_key(root: str, rest: str) -> str | None:
    """The part of ``lightning.fabric`` that ``lightning.<rest>`` names (None: another part of ``lightning``)."""
    if root != "lightning" or rest.partition(".")[0] != "fabric":
        return None
    return rest.removeprefix("fabric").removeprefix(".")


class _ServedModule(types.ModuleType):
    """A Lightning module whose attributes are Ember's objects (see ``table_of``)."""

    def __init__(self, name: str, names: Names) -> None:
        super().__init__(name, f"{name}, served by Ember (see ember.lightning_compat)")
        self.__names = names
        self.__all__ = [key for key, value in names.items() if isinstance(value, str)]
        self.__path__: list[str] = []  # a package: its submodules come through the finder too
        if name in ("lightning", "pytorch_lightning", "lightning.pytorch"):
            self.__version__ = LIGHTNING_VERSION

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        target = self.__names.get(name)
        if isinstance(target, str):
            module, _, attribute = target.partition(":")
            value = getattr(importlib.import_module(module), attribute)
            setattr(self, name, value)
            return value
        submodule = f"{self.__name__}.{name}"
        if self._has_submodule(name):
            return importlib.import_module(submodule)
        instead = target.instead if isinstance(target, Missing) else _module_hint(self.__name__)
        raise LightningNameError(
            f"{self.__name__}.{name} is not covered by Ember"
            + (f": {instead}" if instead else "")
            + (f" ({self.__name__} has {', '.join(self.__all__)})" if self.__all__ else ""),
            name=self.__name__,
        )

    def _has_submodule(self, name: str) -> bool:
        try:
            table_of(f"{self.__name__}.{name}")
        except LightningNameError:
            return False
        return True

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.__all__})


def _module_hint(fullname: str) -> str:
    key = fullname.partition(".")[2].removeprefix("pytorch.")
    return MISSING_MODULES.get(key, "")


class LightningFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the served packages (``ROOTS``) before any installed copy of Lightning."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] not in ROOTS:
            return None
        table_of(fullname)  # an uncovered module fails here, at its import
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _ServedModule(spec.name, table_of(spec.name))

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the attributes come from the table when first used."""


_finder = LightningFinder()


def install() -> None:
    """Serve ``lightning``, ``lightning.pytorch`` and ``pytorch_lightning`` from Ember from now on.

    Call it before the program imports them; if a real Lightning is imported already, this raises instead of
    mixing the two. Calling it again does nothing.
    """
    if is_installed():
        return
    imported = sorted(name for name in sys.modules if name.partition(".")[0] in ROOTS)
    if imported:
        raise RuntimeError(
            f"install() must run before Lightning is imported, but {', '.join(imported[:3])} "
            f"{'is' if len(imported) == 1 else 'are'} imported already: call it first (ember run --lightning "
            "does that for a script)"
        )
    sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Stop serving Lightning's names, and forget the modules served so far."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [name for name, module in sys.modules.items() if isinstance(module, _ServedModule)]:
        del sys.modules[name]


def is_installed() -> bool:
    return _finder in sys.meta_path
