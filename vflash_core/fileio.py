"""Atomic, non-overwriting publication of files and directories.

Outputs are written under a temporary name in the destination folder and published in one step. A file is published
with `os.link`, which fails if the destination exists, so a concurrent writer cannot be overwritten either; a
directory is published with `os.rename` after checking the destination is absent. On any failure the temporary is
removed, so an interrupted write never leaves something at the final path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import VflashError


def _umask() -> int:
    """The process umask, read without changing it (os.umask would briefly change it for every thread)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class OutputExistsError(VflashError):
    """The destination exists and overwriting was not requested."""


def check_writable_destination(path: str | Path, overwrite: bool = False) -> Path:
    """Validate an output path before any heavy work: parent exists and is writable, destination free."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise VflashError(f"output folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise VflashError(f"output folder {parent} is not writable")
    if path.exists() and not overwrite:
        raise OutputExistsError(f"{path} already exists; refusing to overwrite it")
    return path


@contextlib.contextmanager
def atomic_file(path: str | Path, overwrite: bool = False, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to `path`; publish it at `path` when the block succeeds."""
    path = check_writable_destination(path, overwrite)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".partial{suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp creates 0600; a published file gets the permissions a plain open() would give it.
        os.chmod(tmp, 0o666 & ~_umask())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise OutputExistsError(f"{path} appeared while it was being written; refusing to overwrite it")
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `path`; rename it to `path` when the block succeeds."""
    path = Path(path)
    if path.exists():
        raise OutputExistsError(f"{path} already exists; refusing to overwrite it")
    parent = path.parent if str(path.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=parent))
    try:
        yield tmp
        if path.exists():
            raise OutputExistsError(f"{path} appeared while it was being written; refusing to overwrite it")
        os.rename(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
