"""mkdocs hooks (registered in mkdocs.yml): the Trainer flags table, generated from the code.

The marker ``<!-- trainer-flags -->`` in a page becomes a table of every field of the frozen dataclass
``TrainerConfig`` in ``ember/config.py``: flag, type, default and description, the description being the
field's attribute docstring (the string literal on the line after the field). The source is parsed with
``ast``, not imported, so the docs build needs neither torch nor an installed Ember.

The build fails, loudly, if the file, the class, a field's docstring or the marker is missing: a page
that silently lost its table would drift from the code without anyone noticing.
"""

from __future__ import annotations

import ast
import copy
import inspect
import os
import re
from typing import Any, NamedTuple

from mkdocs.exceptions import PluginError

MARKER = "<!-- trainer-flags -->"
FLAGS_PAGE = "trainer-flags.md"
CONFIG_FILE = os.path.join("ember", "config.py")
CONFIG_CLASS = "TrainerConfig"


class FlagsError(PluginError):
    """The flags table cannot be generated; mkdocs stops the build with this message."""


class Flag(NamedTuple):
    name: str
    type: str
    default: str | None  # None: the flag has no default
    doc: str


def read_flags(path: str, class_name: str = CONFIG_CLASS) -> list[Flag]:
    """The fields of dataclass ``class_name`` in the Python file ``path``, in order, with their docstrings."""
    if not os.path.isfile(path):
        raise FlagsError(f"{path}: no such file; the Trainer flags page is generated from its {class_name}")
    with open(path, encoding="utf-8") as file:
        tree = ast.parse(file.read(), filename=path)
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    if not classes:
        raise FlagsError(f"{path} defines no class {class_name}; the Trainer flags page is generated from it")
    aliases = _type_aliases(tree)
    body = classes[0].body
    flags = []
    for index, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        annotation = _source(_AliasExpander(aliases).visit(copy.deepcopy(node.annotation)))
        if node.target.id.startswith("_") or annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue  # not a flag: private, or not a field at all
        following = body[index + 1] if index + 1 < len(body) else None
        if not (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            raise FlagsError(
                f"{path}:{node.lineno}: {class_name}.{node.target.id} has no docstring (a string literal on the "
                "line after the field); the Trainer flags page needs one for every flag"
            )
        flags.append(Flag(node.target.id, annotation, _default(node.value), _one_paragraph(following.value.value)))
    if not flags:
        raise FlagsError(f"{path}: {class_name} has no fields")
    return flags


def _type_aliases(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level type aliases such as ``Limit = int | float | None``, by name."""
    aliases: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            name, value = node.target.id, node.value
        else:
            continue
        is_union = isinstance(value, ast.BinOp) and isinstance(value.op, ast.BitOr)
        if is_union or isinstance(value, ast.Subscript):
            aliases[name] = value
    return aliases


class _AliasExpander(ast.NodeTransformer):
    """Replaces the names of module-level type aliases in an annotation by what they stand for."""

    def __init__(self, aliases: dict[str, ast.expr]) -> None:
        self.aliases = aliases

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return copy.deepcopy(self.aliases[node.id]) if node.id in self.aliases else node


def _default(value: ast.expr | None) -> str | None:
    """The default of a field as source text: ``x = 1``, ``field(default=1)`` or ``field(default_factory=list)``."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("field", "dataclasses.field"):
        for keyword in value.keywords:
            if keyword.arg == "default":
                return _source(keyword.value)
            if keyword.arg == "default_factory":
                return f"{_source(keyword.value)}()"
        return None
    return _source(value)


def _source(node: ast.expr) -> str:
    """``node`` as source text, its strings in double quotes as the docs write them."""
    text = ast.unparse(node)
    # ast.unparse quotes strings with ' unless they contain one; with no " in the text, every ' is a quote.
    return text.replace("'", '"') if '"' not in text else text


def _one_paragraph(docstring: str) -> str:
    """A docstring as one line for a table cell: paragraphs are kept apart by a line break."""
    paragraphs = re.split(r"\n\s*\n", inspect.cleandoc(docstring))
    return "<br>".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def _cell(text: str) -> str:
    """``text`` for a table cell: a ``|`` outside code spans would end the cell (inside them it is literal)."""
    parts = re.split(r"(`+[^`]*`+)", text)
    return "".join(part if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def render_table(flags: list[Flag]) -> str:
    """The flags as a Markdown table."""
    lines = ["| Flag | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for flag in flags:
        default = f"`{flag.default}`" if flag.default is not None else "required"
        lines.append(f"| `{flag.name}` | `{flag.type}` | {default} | {_cell(flag.doc)} |")
    return "\n".join(lines)


def flags_table(root: str) -> str:
    """The table for the repository at ``root``."""
    return render_table(read_flags(os.path.join(root, CONFIG_FILE), CONFIG_CLASS))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        if page.file.src_uri == FLAGS_PAGE:
            raise FlagsError(f"docs/{FLAGS_PAGE} lost its {MARKER} marker, where the flags table goes")
        return markdown
    root = os.path.dirname(os.path.abspath(config.config_file_path))
    return markdown.replace(MARKER, flags_table(root))
