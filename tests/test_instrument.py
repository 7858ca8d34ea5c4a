"""``Patches``, the one way the profiler and the doctor instrument a run: undoing puts back exactly what
was there, on classes, instances (nn.Modules included) and modules, in reverse order."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from ember.instrument import Patches


class _Base:
    def inherited(self) -> str:
        return "base"


class _Owner(_Base):
    def own(self) -> str:
        return "own"

    @staticmethod
    def static() -> str:
        return "static"

    @classmethod
    def made(cls) -> str:
        return "made"


def _namespace(owner: Any) -> dict[str, Any]:
    return dict(vars(owner))


def _same(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """The same names, bound to the very same objects."""
    return before.keys() == after.keys() and all(after[name] is value for name, value in before.items())


def test_a_class_gets_back_its_own_attributes_and_loses_the_inherited_ones() -> None:
    before = _namespace(_Owner)
    patches = Patches()
    for name in ("own", "inherited", "static", "made"):
        patches.wrap(_Owner, name, lambda original: lambda *args: ("wrapped", original(*args)))
    patches.replace(_Owner, "added", 1)
    owner = _Owner()
    assert owner.own() == ("wrapped", "own") and owner.inherited() == ("wrapped", "base")
    assert _Owner.added == 1
    patches.undo()
    assert _same(before, _namespace(_Owner))
    assert isinstance(vars(_Owner)["static"], staticmethod) and isinstance(vars(_Owner)["made"], classmethod)
    assert _Owner.static() == "static" and _Owner.made() == "made" and owner.inherited() == "base"
    assert "inherited" not in vars(_Owner) and not hasattr(_Owner, "added")


def test_an_instance_is_patched_in_its_own_dict_only() -> None:
    first, second = _Owner(), _Owner()
    first.value = "mine"  # type: ignore[attr-defined]
    before = _namespace(first)
    patches = Patches()
    seen: list[Any] = []

    def make(original: Any) -> Any:
        seen.append(original)
        return lambda: "patched"

    patches.wrap(first, "own", make)
    patches.replace(first, "value", "patched")
    assert seen[0].__self__ is first  # the original of an instance's method is bound to it
    assert first.own() == "patched" and first.value == "patched"  # type: ignore[attr-defined]
    assert second.own() == "own"  # the class is untouched
    patches.undo()
    assert _same(before, _namespace(first)) and first.own() == "own"


def test_an_nn_module_is_patched_without_its_setattr() -> None:
    module = torch.nn.Linear(2, 1)
    weight, modules = module.weight, dict(module._modules)
    before = _namespace(module)
    patches = Patches()
    # nn.Module.__setattr__ would refuse a plain tensor for a parameter, and register a Module as a submodule.
    patches.replace(module, "weight", torch.full((1, 2), 2.0))
    patches.replace(module, "helper", torch.nn.ReLU())
    patches.wrap(module, "forward", lambda original: lambda x: original(x) + 1)
    assert module._modules == modules
    assert module(torch.ones(1, 2)).item() == pytest.approx(4 + module.bias.item() + 1)
    patches.undo()
    assert _same(before, _namespace(module))
    assert module.weight is weight and not hasattr(module, "helper") and "forward" not in vars(module)


def test_a_module_gets_back_its_functions_and_loses_added_names() -> None:
    fake = types.ModuleType("fake")
    exec("def read(x):\n    return x\n", fake.__dict__)
    read = fake.read  # type: ignore[attr-defined]
    before = _namespace(fake)
    patches = Patches()
    patches.wrap(fake, "read", lambda original: lambda x: original(x) * 2)
    patches.replace(fake, "added", True)
    assert fake.read(3) == 6 and fake.added is True  # type: ignore[attr-defined]
    patches.undo()
    assert _same(before, _namespace(fake)) and fake.read is read  # type: ignore[attr-defined]


def test_nested_patches_and_undo_callbacks_are_undone_latest_first() -> None:
    undone: list[str] = []
    patches = Patches()
    original = _Owner.own
    patches.wrap(_Owner, "own", lambda inner: lambda self: f"outer({inner(self)})")
    patches.on_undo(lambda: undone.append(f"first, own is {_Owner().own()}"))
    patches.wrap(_Owner, "own", lambda inner: lambda self: f"outermost({inner(self)})")
    patches.on_undo(lambda: undone.append(f"second, own is {_Owner().own()}"))
    assert _Owner().own() == "outermost(outer(own))"
    patches.undo()
    assert undone == ["second, own is outermost(outer(own))", "first, own is outer(own)"]
    assert vars(_Owner)["own"] is original
    patches.undo()  # nothing left to undo
    assert undone == ["second, own is outermost(outer(own))", "first, own is outer(own)"]
