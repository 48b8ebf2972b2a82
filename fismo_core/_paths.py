"""Output paths: checked before a long run rather than after it, and written all or nothing."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
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


class StagedFiles:
    """Files written as ``.NAME.part`` beside their names and renamed over them once every one is written
    (`staged_files`): a write that fails (a full disk, Ctrl-C, a folder in a file's place) leaves the
    directory as it was, not a truncated file (``fismo verify --save`` truncated the reference it replaced)
    nor half of a set (``fismo demo``'s report; users' hunts, 2026-12-03).

    A name that is a symbolic link is written through it: the file it points to is replaced, the link
    stays. A name that exists and is not a regular file (a device such as ``/dev/null``, a pipe) is a
    `NotARegularFileError` before anything is written: the rename replaced the link, or the device node,
    with a file (a user's hunt, 2026-12-04)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.parts: dict[Path, Path] = {}

    def __call__(self, name: str) -> Path:
        """Where to write file ``name`` for now."""
        target = writable_target(self.directory / name)
        part = target.parent / f".{target.name}.part"
        self.parts[target] = part
        return part


class NotARegularFileError(OSError):
    """An output name that exists as something else than a regular file (a device, a pipe, a directory), or a
    symbolic link into a folder that does not exist."""


def writable_target(path: Path) -> Path:
    """The file a write to ``path`` replaces (through symbolic links), or a `NotARegularFileError` if it cannot
    be a regular file there: checked before a long run as well as at the write (`StagedFiles`)."""
    target = path.resolve()
    if target.exists() and not target.is_file():
        raise NotARegularFileError(f"cannot write {path}: it exists and is not a regular file")
    if path.is_symlink() and not target.parent.is_dir():  # (a missing folder of path's own is made by the writer)
        raise NotARegularFileError(f"cannot write {path}: it is a symbolic link into {target.parent}, which is not "
                                   "a folder")
    return target


@contextlib.contextmanager
def staged_files(directory: Union[str, Path]) -> Iterator[StagedFiles]:
    """A `StagedFiles` in ``directory``: on leaving, each part is renamed over its name; on an exception, the
    parts are removed and the files that were there stay."""
    staged = StagedFiles(Path(directory))
    try:
        yield staged
        for target, part in staged.parts.items():
            os.replace(part, target)
    except BaseException:
        for part in staged.parts.values():
            part.unlink(missing_ok=True)
        raise
