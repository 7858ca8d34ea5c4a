"""The ``ember`` command (also ``python -m ember``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import ember


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ember",
        description="Ember: fast PyTorch training with a Lightning-compatible Module and Trainer.",
    )
    parser.add_argument("--version", action="version", version=f"ember {ember.__version__}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
