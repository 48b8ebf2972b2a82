"""Checks on output paths, made before a long run rather than after it."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional, Union


def cannot_write_in(directory: Union[str, Path]) -> Optional[str]:
    """Why no file can be created in the existing ``directory`` (the system's reason), or ``None`` if one can.

    Tried with a temporary file that is removed at once, not guessed with ``os.access``: that answers for
    the permission bits only (root is let write everywhere, a read-only mount included, by them).
    """
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
