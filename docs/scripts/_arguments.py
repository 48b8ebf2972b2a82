"""Argument types shared by the measurement scripts of this folder (a helper module, not a script).

Each is an ``argparse`` ``type=``: a bad value is a one-line usage error (exit status 2) before the
script does any work, e.g. ``error: argument --repeats: must be a positive integer, got 0``.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def positive_int(text: str) -> int:
    """An integer of at least 1 (a count: repeats, steps, threads, seeds, ranks, a divisor)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (a learning rate: 0 trains nothing, NaN nothing measurable)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive, finite number, got {value}")
    return value


def _file_on_the_way(path: Path) -> Path | None:
    """The nearest of ``path`` and its parents that exists, if it is not a folder (else None)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


def output_dir(text: str) -> Path:
    """A folder to write into: it may not exist yet, but neither it nor a folder above it may be a file."""
    path = Path(text)
    blocked = _file_on_the_way(path)
    if blocked is not None:
        raise argparse.ArgumentTypeError(f"{blocked} is not a directory")
    return path


def output_file(text: str) -> Path:
    """A file to write: it may not exist yet, but it may not be a folder, nor a folder above it a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory, not a file")
    blocked = _file_on_the_way(path.parent)
    if blocked is not None:
        raise argparse.ArgumentTypeError(f"{blocked} is not a directory")
    return path


def options_given(parser: argparse.ArgumentParser, args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    """The options among ``dests`` (argparse destinations) given another value than their default, as
    ``--option``: for a script to refuse the options a mode or section it runs does not use."""
    return [f"--{dest.replace('_', '-')}" for dest in dests if getattr(args, dest) != parser.get_default(dest)]
