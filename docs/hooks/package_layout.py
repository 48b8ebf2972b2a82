"""A mkdocs hook: the installed package's layout, for mkdocstrings.

The adapters live in ``backends/`` and are installed as ``fismo_core.backends``
(``package-dir`` in ``pyproject.toml``). mkdocstrings reads source files
without importing them and finds no ``fismo_core/backends``; this hook lays the
installed package out in ``build/api-layout/`` (links to the sources) before
the pages are rendered, and ``mkdocs.yml`` points mkdocstrings there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "build" / "api-layout"


@event_priority(100)  # before mkdocstrings' on_config, which drops search paths that do not exist yet
def on_config(config, **kwargs):
    package = LAYOUT / "fismo_core"
    shutil.rmtree(LAYOUT, ignore_errors=True)
    package.mkdir(parents=True)
    for entry in (ROOT / "fismo_core").iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, package / entry.name)
    os.symlink(ROOT / "backends", package / "backends")
    return config
