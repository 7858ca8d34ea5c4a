"""The documentation: its runnable code blocks run, and the Trainer flags table is generated from the code.

A code block is runnable when the line just before its opening fence is the HTML comment
``<!-- runnable -->`` (invisible on GitHub and on the site). Every such block in ``docs/**/*.md`` and
``README.md`` runs here, in-process (``exec``, in a fresh namespace whose ``__name__`` is ``"__main__"``),
in the test's own temporary working directory, so whatever it writes is thrown away. Blocks must stay
small (a few epochs on tiny data) and run on a CPU in one process: blocks that need GPUs or several
processes are left unmarked.

The site is built in strict mode here and by ``.ci/run`` (``python -m mkdocs build --strict``).
"""

from __future__ import annotations

import glob
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- runnable -->"
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "trainer_config.py")


def _documents() -> list[str]:
    pages = sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [*pages, os.path.join(ROOT, "README.md")]


def _runnable_blocks() -> list[tuple[str, int, str]]:
    """``(file, line, code)`` of every runnable block; a marker not followed by a Python block is an error."""
    blocks = []
    for path in _documents():
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
        name = os.path.relpath(path, ROOT)
        for index, line in enumerate(lines):
            if line.strip() != MARKER:
                continue
            fence = lines[index + 1] if index + 1 < len(lines) else ""
            if not re.fullmatch(r"```(python|py)\s*", fence):
                raise ValueError(f"{name}:{index + 1}: {MARKER} must be followed by a ```python block")
            end = next((i for i in range(index + 2, len(lines)) if lines[i].strip() == "```"), None)
            if end is None:
                raise ValueError(f"{name}:{index + 2}: the runnable block is never closed")
            blocks.append((name, index + 3, "\n".join(lines[index + 2 : end]) + "\n"))
    return blocks


BLOCKS = _runnable_blocks()


def test_the_docs_have_runnable_blocks() -> None:
    files = {name for name, _, _ in BLOCKS}
    assert "README.md" in files and len(BLOCKS) >= 10, sorted(files)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "line", "code"), BLOCKS, ids=[f"{name}:{line}" for name, line, _ in BLOCKS])
def test_runnable_block(name: str, line: int, code: str) -> None:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    # The file name and line make a traceback point into the Markdown file.
    exec(compile("\n" * (line - 1) + code, os.path.join(ROOT, name), "exec"), namespace)


def test_the_site_builds_in_strict_mode(tmp_path: Any) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")  # the theme
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # Strict: a warning (a broken link or anchor, a page missing from the nav) fails the build.
    assert result.returncode == 0, result.stderr[-3000:]
    assert os.path.exists(os.path.join(tmp_path, "trainer-flags", "index.html"))


# ------------------------------------------------------------------------------ the flags table
def _flags_script() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("trainer_flags", os.path.join(ROOT, "docs", "trainer_flags.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_flags_table_renders_fields_in_order_with_types_defaults_and_docstrings() -> None:
    flags_script = _flags_script()
    flags = flags_script.read_flags(FIXTURE, "TrainerConfig")
    names = ["accelerator", "devices", "gradient_clip_algorithm", "callbacks", "limit_val_batches", "max_epochs"]
    assert [flag.name for flag in flags] == names  # ClassVars, private fields and methods are not flags
    by_name = {flag.name: flag for flag in flags}
    assert by_name["devices"].type == "int | str | Sequence[int]"
    assert by_name["gradient_clip_algorithm"].type == 'Literal["norm", "value"]'
    assert by_name["accelerator"].default == '"auto"'
    assert by_name["callbacks"].default == "tuple()" and by_name["max_epochs"].default == "None"
    assert by_name["limit_val_batches"].type == "int | float | None"  # a module-level alias, spelt out
    paragraphs = ["How many devices of this machine to use (one process each), or which.", "``-1`` means all of them."]
    assert by_name["devices"].doc == "<br>".join(paragraphs)
    table = flags_script.render_table(flags)
    assert table.splitlines()[0] == "| Flag | Type | Default | Description |"
    # A | ends a cell on GitHub even in a code span: escaped outside code spans, an entity in HTML inside them.
    assert '| `devices` | <code>int &#124; str &#124; Sequence[int]</code> | `"auto"` |' in table
    assert "Epochs to train (<code>int &#124; None</code>): a count \\| -1 for no limit. |" in table
    assert '| `gradient_clip_algorithm` | `Literal["norm", "value"]` |' in table
    assert len(table.splitlines()) == 2 + len(flags)


def test_the_flags_table_fails_loudly_without_its_source(tmp_path: Any) -> None:
    flags_script = _flags_script()
    with pytest.raises(flags_script.FlagsError, match="no such file"):
        flags_script.read_flags(str(tmp_path / "config.py"))
    with pytest.raises(flags_script.FlagsError, match="defines no class Missing"):
        flags_script.read_flags(FIXTURE, "Missing")
    with pytest.raises(flags_script.FlagsError, match="Undocumented.precision has no docstring"):
        flags_script.read_flags(FIXTURE, "Undocumented")
    with pytest.raises(flags_script.FlagsError, match="no such file"):
        flags_script.flags_table(str(tmp_path))  # a repository without ember/config.py


def test_the_flags_page_holds_the_table_of_the_code() -> None:
    """The table is in the file itself (read on the repository's page too), as the script writes it from the code."""
    flags_script = _flags_script()
    with open(os.path.join(ROOT, "docs", "trainer-flags.md"), encoding="utf-8") as file:
        page = file.read()
    fresh = flags_script.with_table(page, flags_script.flags_table(ROOT))
    assert page == fresh, "docs/trainer-flags.md is out of date: run python docs/trainer_flags.py"
    assert "| `max_epochs` | " in page


def test_the_flags_script_writes_between_its_markers_and_checks(tmp_path: Any) -> None:
    flags_script = _flags_script()
    begin, end = flags_script.BEGIN, flags_script.END
    page = f"# Flags\n\n{begin}\n\n| old | table |\n\n{end}\n\nMore.\n"
    assert flags_script.with_table(page, "| new |") == f"# Flags\n\n{begin}\n\n| new |\n\n{end}\n\nMore.\n"
    with pytest.raises(flags_script.FlagsError, match="lost its markers"):
        flags_script.with_table("# Flags\n", "| new |")
    (tmp_path / "ember").mkdir()
    (tmp_path / "docs").mkdir()
    with open(FIXTURE, encoding="utf-8") as fixture:
        (tmp_path / "ember" / "config.py").write_text(fixture.read())
    (tmp_path / "docs" / "trainer-flags.md").write_text(page)
    assert flags_script.main(["--check", "--root", str(tmp_path)]) == 1  # stale: nothing written
    assert (tmp_path / "docs" / "trainer-flags.md").read_text() == page
    assert flags_script.main(["--root", str(tmp_path)]) == 0
    assert "| `devices` |" in (tmp_path / "docs" / "trainer-flags.md").read_text()
    assert flags_script.main(["--check", "--root", str(tmp_path)]) == 0


def test_the_flags_table_covers_every_trainer_flag() -> None:
    if not os.path.exists(os.path.join(ROOT, "ember", "config.py")):
        pytest.skip("ember/config.py (TrainerConfig) is not in this tree yet")
    import ember

    flags_script = _flags_script()
    documented = [flag.name for flag in flags_script.read_flags(os.path.join(ROOT, "ember", "config.py"))]
    parameters = inspect.signature(ember.Trainer.__init__).parameters
    flags = [name for name, parameter in parameters.items() if parameter.kind is inspect.Parameter.KEYWORD_ONLY]
    assert sorted(documented) == sorted(flags)
