"""Write the table of every Trainer flag into docs/trainer-flags.md, from the code.

    python docs/trainer_flags.py            # rewrite the table after changing a flag
    python docs/trainer_flags.py --check    # exit with status 1, writing nothing, if the table is stale

The table sits in the page itself, between two HTML comments (invisible on the site and on the
repository's page), so that it reads the same everywhere. It lists every field of the frozen dataclass
``TrainerConfig`` in ``ember/config.py``: flag, type, default and description, the description being the
field's attribute docstring (the string literal on the line after the field). The source is parsed with
``ast``, not imported, so the script needs neither torch nor an installed Ember. tests/test_docs.py fails
when the page differs from what the script would write.

It fails, loudly, if the file, the class, a field's docstring or the page's markers are missing.
"""

from __future__ import annotations

import argparse
import ast
import copy
import html
import inspect
import os
import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

BEGIN = "<!-- trainer-flags: written by python docs/trainer_flags.py from ember/config.py; edit there -->"
END = "<!-- end of trainer-flags -->"
FLAGS_PAGE = os.path.join("docs", "trainer-flags.md")
CONFIG_FILE = os.path.join("ember", "config.py")
CONFIG_CLASS = "TrainerConfig"


class FlagsError(Exception):
    """The flags table cannot be generated."""


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
    """``text`` for a table cell that reads the same on the site and on GitHub. A ``|`` would end the cell, on
    GitHub even inside a code span, where the site would show an escaping backslash: outside code spans it is
    escaped, and a code span holding one becomes HTML, with the ``|`` as an entity."""
    parts = re.split(r"(`+[^`]*`+)", text)
    return "".join(_code(part) if part.startswith("`") else part.replace("|", "\\|") for part in parts)


def _code(span: str) -> str:
    if "|" not in span:
        return span
    return f"<code>{html.escape(span.strip('`'), quote=False).replace('|', '&#124;')}</code>"


def render_table(flags: list[Flag]) -> str:
    """The flags as a Markdown table."""
    lines = ["| Flag | Type | Default | Description |", "| --- | --- | --- | --- |"]
    for flag in flags:
        default = _cell(f"`{flag.default}`") if flag.default is not None else "required"
        lines.append(f"| `{flag.name}` | {_cell(f'`{flag.type}`')} | {default} | {_cell(flag.doc)} |")
    return "\n".join(lines)


def flags_table(root: str) -> str:
    """The table for the repository at ``root``."""
    return render_table(read_flags(os.path.join(root, CONFIG_FILE), CONFIG_CLASS))


def with_table(page: str, table: str) -> str:
    """The Markdown ``page`` with ``table`` between its markers, in place of what was there."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise FlagsError(f"{FLAGS_PAGE} lost its markers, the lines between which the table goes: {BEGIN} and {END}")
    return f"{page[: start + len(BEGIN)]}\n\n{table}\n\n{page[end:]}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the table of every Trainer flag into " + FLAGS_PAGE)
    parser.add_argument("--check", action="store_true", help="only say whether the table is stale (status 1)")
    parser.add_argument(
        "--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        help="the repository (default: the one holding this script)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    path = os.path.join(args.root, FLAGS_PAGE)
    try:
        with open(path, encoding="utf-8") as file:
            page = file.read()
        fresh = with_table(page, flags_table(args.root))
    except (OSError, FlagsError) as error:
        print(f"trainer_flags: {error}", file=sys.stderr)
        return 2
    if fresh == page:
        return 0
    if args.check:
        print(f"{path} is out of date: run python docs/trainer_flags.py", file=sys.stderr)
        return 1
    with open(path, "w", encoding="utf-8") as file:
        file.write(fresh)
    print(f"wrote the flags table into {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
