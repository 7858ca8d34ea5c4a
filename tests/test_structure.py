"""The package's shape: no import cycles, one owner for the Trainer's private state, small functions."""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator

import ember

PACKAGE = os.path.dirname(ember.__file__)


def _modules() -> dict[str, str]:
    """Every module of the package: dotted name -> file."""
    found = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _runtime_imports(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every module imported when the code runs (at module level or inside functions), not under TYPE_CHECKING."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking_block(node):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts if is_package else parts[:-1]
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        with open(path) as file:
            tree = ast.parse(file.read())
        imported = _runtime_imports(tree, name, path.endswith("__init__.py"))
        graph[name] = {target for target in imported if target in modules and target != name}
    return graph


def test_no_module_imports_itself_back_at_run_time() -> None:
    """No import cycle among the package's modules, counting imports inside functions too."""
    graph = _import_graph()
    # A package's __init__ importing its own submodules is not a cycle back into it: drop those edges
    # from a submodule to its parent package (importing `ember.loops.fit` loads `ember.loops` first).
    for name in graph:
        graph[name] = {target for target in graph[name] if not name.startswith(target + ".")}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_nothing_below_the_trainer_imports_it_at_run_time() -> None:
    graph = _import_graph()
    importers = sorted(name for name, targets in graph.items() if "ember.trainer" in targets)
    assert importers == ["ember"], importers


_PRIVATE_TRAINER_ATTRIBUTE = re.compile(r"\btrainer\._[a-z]\w*")


def test_only_the_trainer_touches_its_private_attributes() -> None:
    offenders = []
    for name, path in _modules().items():
        if name == "ember.trainer":
            continue
        with open(path) as file:
            for number, line in enumerate(file, 1):
                if _PRIVATE_TRAINER_ATTRIBUTE.search(line):
                    offenders.append(f"{path}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_code_outside_the_strategies_asks_which_strategy_it_has() -> None:
    """A strategy owns its behaviour: nothing else branches on ``isinstance(..., DDPStrategy)`` and the like."""
    offenders = []
    for name, path in _modules().items():
        if name.startswith("ember.strategies"):
            continue
        with open(path) as file:
            tree = ast.parse(file.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
                classes = re.findall(r"\w+", ast.unparse(node.args[1]))
                if any(cls.endswith("Strategy") and cls != "Strategy" for cls in classes):
                    offenders.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "\n".join(offenders)
