"""``python -m ember.lightning_compat [-m] SCRIPT ARGS...``: run a Lightning script (or module) on Ember.

This is what each process of ``ember run --lightning`` runs: the import hook first, then the script as
``python SCRIPT ARGS`` would run it.
"""

from __future__ import annotations

import os
import runpy
import sys

from ember.lightning_compat import install


def main(argv: list[str]) -> int:
    module = argv[:1] == ["-m"]
    argv = argv[1:] if module else argv
    if not argv:
        print("usage: python -m ember.lightning_compat [-m] SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    target, arguments = argv[0], argv[1:]
    install()
    sys.argv = [target, *arguments]
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python SCRIPT` puts its directory first
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
