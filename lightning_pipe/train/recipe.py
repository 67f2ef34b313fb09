"""What the recipe scripts under ``recipes/`` share: a ``--size`` (the recipe's sizes: ``smoke``,
``reduced``, ``full``, ...) and an ``--output`` directory, by default ``<recipe>/results/<size>``."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

__all__ = ["output_directory", "sized_parser"]


def sized_parser(doc: str, sizes: Iterable[str]) -> argparse.ArgumentParser:
    """A parser described by ``doc``'s first paragraph, with ``--size`` (default ``reduced``) and
    ``--output``; a recipe adds its own arguments to it."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(sizes), default="reduced")
    parser.add_argument("--output", type=Path, help="where the results go (default: <recipe>/results/<size>)")
    return parser


def output_directory(args: argparse.Namespace, script: str) -> Path:
    """``--output``, or ``results/<size>`` beside ``script`` (the recipe's ``__file__``), created."""
    output = args.output or Path(script).parent / "results" / args.size
    output.mkdir(parents=True, exist_ok=True)
    return output
