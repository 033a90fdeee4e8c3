"""Atomic, non-overwriting publication of files and directories.

Outputs are written under a temporary name in the destination folder and published in one step. A file is published
with `os.link`, which fails if the destination exists, so a concurrent writer cannot be overwritten either; a
directory is published with `os.rename` after checking the destination is absent. On any failure the temporary is
removed, so an interrupted write never leaves something at the final path.

Every temporary Vflash creates (`temporary`: the atomic writers', the MP4 encoder's frames, the demo family's build
folder) is named for its writer (`.NAME.HOST+PID+random.partial[SUFFIX]`): a process killed mid-write (SIGKILL, power
loss) cannot remove its own, so the next temporary made in the same folder removes those whose writer ran on this
host and no longer exists. Temporaries of live processes, of other hosts sharing the folder, or without a writer are
kept.

Writes are plain I/O, never into a memory map (writing a mapped page past a full disk is SIGBUS, not an error): an OS
error while a temporary is written, a full disk above all, is one line naming the destination and the free space
left there (`WriteFailedError`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import RunFailedError, VflashError, describe_value

__all__ = [
    "GIB", "MIB", "MissingInputError", "OutputExistsError", "WriteFailedError", "atomic_directory", "atomic_file",
    "check_file_name", "check_folder", "check_input_file", "check_new_directory", "check_writable_destination",
    "nearest_existing", "path_argument", "read_json", "read_text_file", "remove_folder", "remove_if_owner_ended",
    "resolve_inside", "size_text", "temporary", "write_errors",
]

logger = logging.getLogger(__name__)


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


class MissingInputError(VflashError):
    """A file named inside an input folder is not there (`resolve_inside`)."""


class WriteFailedError(RunFailedError):
    """Writing an output failed in the OS (a full disk, a quota, a read-only filesystem); nothing was published."""


def _file_type(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_input_file(path: str | os.PathLike[str], what: str, error: type[VflashError] = VflashError) -> Path:
    """`path` as a regular, readable file; otherwise `error` saying exactly what it is instead (missing, a broken
    link, a symbolic-link loop, a folder, a FIFO, unreadable). The path is never opened, so a FIFO cannot block."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise error(f"{what} {path} is a broken symbolic link (to {os.readlink(path)})") from None
        raise error(f"{what} {path} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise error(f"{what} {path} is a symbolic link loop") from None
        if exc.errno == errno.ENOTDIR:
            raise error(f"{what} {path} does not exist (a part of its folder path is a file)") from None
        raise error(f"{what} {path} cannot be read: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = _file_type(mode)
        raise error(f"{what} {path} is {kind}, not a file" if kind.startswith("a ") else f"{what} {path} is {kind}")
    if not os.access(path, os.R_OK):
        raise error(f"{what} {path} is not readable (permission denied)")
    return path


def check_folder(path: str | Path, what: str = "", error: type[VflashError] = VflashError, hint: str = "") -> Path:
    """`path` as an existing folder; otherwise `error` saying whether it is missing or something else (then `hint`)."""
    path = Path(path)
    if not path.is_dir():
        state = "is not a folder" if os.path.lexists(path) else "does not exist"
        raise error(" ".join(filter(None, (what, str(path), state))) + (f"; {hint}" if hint else ""))
    return path


def read_text_file(path: str | Path, what: str, max_bytes: int, error: type[VflashError] = VflashError) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`, checked before it is read."""
    path = check_input_file(path, what, error)
    size = path.stat().st_size
    if size > max_bytes:
        raise error(f"{what} {path} is {size:,} bytes; at most {max_bytes:,} are accepted")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"{what} {path} cannot be read: {exc.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text (byte {exc.start} is 0x{data[exc.start]:02x})") from None


def path_argument(value: object, what: str) -> Path:
    """A non-empty file path given as str or `os.PathLike` (never bytes, a number or None), as a Path: the check of
    every path a Python caller hands over, before it reaches `open` or `os.stat` (which raise TypeError)."""
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, str) and text:
            if "\x00" in text:
                raise VflashError(f"{what} must not contain a NUL character")
            return Path(text)
    raise VflashError(f"{what} must be a file path (str or Path), got {describe_value(value)}")


def resolve_inside(folder: str | Path, name: str, what: str) -> Path:
    """The file `name` (relative to `folder`, or an absolute path into it) names, links resolved, which must lie inside
    `folder`: an input folder is a boundary, so `..`, an absolute path elsewhere or a symbolic link out of it is refused
    with `VflashError`, as is a name that is not a regular file there. The messages quote `name` as given, never the
    resolved target outside."""
    if not isinstance(name, str) or not name:
        raise VflashError(f"{what} must be a non-empty file name, got {name!r}")
    if "\x00" in name:
        raise VflashError(f"{what} {name!r} must not contain a NUL character")
    root = Path(folder).resolve()
    try:
        path = (root / name).resolve()
    except (RuntimeError, OSError):  # a symbolic-link loop (RuntimeError before Python 3.13)
        raise VflashError(f"{what} {name!r} is a symbolic link loop") from None
    if not path.is_relative_to(root):
        raise VflashError(f"{what} {name!r} is outside the input folder {folder}")
    if not os.path.lexists(path):
        raise MissingInputError(f"{what} {name!r} does not exist in the input folder {folder}")
    if not path.is_file():
        raise VflashError(f"{what} {name!r} is not a file in the input folder {folder}")
    return path


def check_writable_destination(path: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Validate an output file path before any heavy work: parent folder exists and is writable, the destination
    is free (or, with `overwrite`, a regular file or a link that may be replaced; never a folder)."""
    text = os.fspath(path)
    path = Path(path)
    if "\x00" in text:
        raise VflashError("the output path must not contain a NUL character")
    if text.endswith(("/", os.sep)) or path.name in ("", ".", ".."):
        raise VflashError(f"output {text} names a folder; give a file name inside it")
    parent = path.parent if str(path.parent) else Path(".")
    check_folder(parent, "output folder")
    if not os.access(parent, os.W_OK):
        raise VflashError(f"output folder {parent} is not writable")
    check_file_name(parent, path.name, "output file name")
    if os.path.lexists(path):
        if path.is_dir():
            raise VflashError(f"output {path} is a folder; give a file name inside it")
        if not overwrite:
            raise OutputExistsError(f"{path} already exists; refusing to overwrite it")
        if path.exists() and not path.is_file():
            raise VflashError(f"output {path} is {_file_type(path.stat().st_mode)}; refusing to replace it")
    return path


def read_json(path: str | Path, error: type[VflashError], missing: str, corrupt: str) -> object:
    """The JSON value in `path`; `error(missing)` when there is no such file (or a part of its folder path is a file),
    `error(corrupt)` when it is not UTF-8 JSON or nests too deeply to parse."""
    if os.path.lexists(path):
        check_input_file(path, "JSON file", error)  # a FIFO would block the read
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        raise error(missing) from None
    except (ValueError, RecursionError):  # not JSON, not UTF-8 (UnicodeDecodeError is a ValueError), too deep
        raise error(corrupt) from None
    except OSError as exc:  # an I/O error (a folder or an unreadable file is named by check_input_file)
        raise error(f"{path} cannot be read: {exc.strerror or exc}") from None


def check_file_name(folder: Path, name: str, what: str) -> None:
    """A name of a file or folder to be written in `folder` (or, while it does not exist yet, the folder it will be
    created in): it leaves room for its temporary's (`atomic_file`, `atomic_directory`) in the folder's name limit."""
    longest = _name_max(nearest_existing(folder)) - _TEMPORARY_OVERHEAD
    if len(os.fsencode(name)) > longest:
        raise VflashError(
            f"{what} {name[:40]}... is {len(os.fsencode(name))} bytes long; "
            f"this folder takes names of at most {longest} bytes"
        )


def nearest_existing(path: Path) -> Path:
    """`path` if it exists (a dangling link counts), else its nearest existing ancestor: where a folder would be
    created."""
    while not os.path.lexists(path):
        path = path.parent
    return path


def check_new_directory(path: str | Path) -> Path:
    """Validate an output folder before any heavy work: absent, a name that fits, and creatable (the nearest
    existing folder above it is a writable folder, not a file)."""
    path = Path(path)
    if os.path.lexists(path):
        raise OutputExistsError(f"{path} already exists; refusing to overwrite it")
    existing = nearest_existing(path.absolute().parent)
    if not existing.is_dir():
        raise VflashError(f"output folder {path} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK):
        raise VflashError(f"output folder {path} cannot be created: {existing} is not writable")
    check_file_name(existing, path.name, "output folder name")
    return path


# What a temporary's name adds to its destination's: ".", the writer, mkstemp's 8 random characters, ".partial" and a
# suffix of up to 16 characters (host names are at most 64 bytes, process ids at most 7 digits).
_TEMPORARY_OVERHEAD = 1 + 64 + 1 + 7 + 1 + 8 + len(".partial") + 16


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def process_exists(pid: int) -> bool:
    """Whether a process id is in use on this host (POSIX; signal 0 probes without side effects)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_if_owner_ended(owned: Iterable[tuple[Path, str, str]], what: str) -> list[Path]:
    """Remove each (path, owner host, owner pid) whose owner ran on this host and no longer exists; keep those of live
    processes, of other hosts sharing the folder, or with a malformed pid. POSIX only: elsewhere there is no
    side-effect-free liveness probe for a process id. Returns what was removed."""
    if os.name != "posix":
        return []
    host = socket.gethostname()
    removed = []
    for path, owner_host, pid in owned:
        if owner_host != host or not pid.isdigit() or process_exists(int(pid)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        logger.info("removed %s, left by %s %s that no longer runs", path, what, pid)
        removed.append(path)
    return removed


# `temporary`'s names: the destination's name, then the writer "HOST+PID+" and mkstemp's random part, ".partial".
_TEMPORARY_NAME = re.compile(r"\.(?P<name_and_host>.+)\+(?P<pid>[0-9]+)\+[^+/]*\.partial.*")


def remove_abandoned_temporaries(folder: Path) -> list[Path]:
    """Remove the temporaries in `folder` left by writers on this host that no longer run (see the module doc)."""
    host = socket.gethostname()
    owned = []
    for candidate in folder.glob(".*.partial*"):
        match = _TEMPORARY_NAME.fullmatch(candidate.name)
        if match is not None:  # host names hold dots, destination names may too: the name ends in this host's or not
            owner = host if match["name_and_host"].endswith(f".{host}") else "another host"
            owned.append((candidate, owner, match["pid"]))
    return remove_if_owner_ended(owned, "process")


def temporary(destination: Path, suffix: str = "", directory: bool = False) -> Path:
    """A new temporary file (or folder) named for `destination` and this writer, beside it (see the module doc), after
    removing what writers that ended left in that folder."""
    folder = destination.parent if str(destination.parent) else Path(".")
    remove_abandoned_temporaries(folder)
    prefix, end = f".{destination.name}.{socket.gethostname()}+{os.getpid()}+", f".partial{suffix}"
    if directory:
        return Path(tempfile.mkdtemp(prefix=prefix, suffix=end, dir=folder))
    fd, name = tempfile.mkstemp(prefix=prefix, suffix=end, dir=folder)
    os.close(fd)
    return Path(name)


def remove_folder(path: Path) -> None:
    """Remove a folder Vflash wrote (a stale compile): first renamed to a temporary of this writer, so it leaves its
    name at once and, should this process be killed while deleting it, the next temporary made beside it finishes."""
    doomed = temporary(path, directory=True)
    os.rename(path, doomed)  # onto the new empty folder: POSIX replaces it
    shutil.rmtree(doomed, ignore_errors=True)


MIB = 1 << 20
GIB = 1 << 30


def size_text(n: int) -> str:
    """Bytes for a person: GiB from 1 GiB on, MiB below ("12.3 GiB", "512.0 MiB")."""
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


@contextlib.contextmanager
def write_errors(destination: Path) -> Iterator[None]:
    """An OS error inside the block (a full disk, a quota, a read-only or failing filesystem) as one line naming
    `destination`, the file the OS named when it is not one of the destination's own temporaries, and the space left
    in the destination's folder at that moment (so the block must not have removed its temporaries yet)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as exc:
        failed = _os_error(exc)
        if failed is None:
            raise
        folder = nearest_existing(destination.absolute().parent)
        try:
            free = f"{size_text(shutil.disk_usage(folder).free)} free in {folder}"
        except OSError:
            free = f"{folder} cannot be examined"
        named = Path(os.fsdecode(failed.filename)) if failed.filename else destination
        own = named == destination or (
            named.name.startswith(f".{destination.name}.") and named.parent == destination.parent
        )
        raise WriteFailedError(
            f"writing {destination} failed{'' if own else f' at {named}'}: {failed.strerror} ({free})"
        ) from None


def _os_error(exc: BaseException) -> OSError | None:
    """The OS error behind `exc`: itself, or the one safetensors' writer reports as text ("... (os error 28)");
    None when there is none (then it is not a fault of the filesystem)."""
    if isinstance(exc, OSError) and not isinstance(exc, VflashError) and exc.errno is not None:
        return exc if exc.strerror else OSError(exc.errno, os.strerror(exc.errno), exc.filename)
    found = re.search(r"\(os error (\d+)\)", str(exc)) if not isinstance(exc, OSError) else None
    return None if found is None else OSError(int(found[1]), os.strerror(int(found[1])))


@contextlib.contextmanager
def atomic_file(path: str | Path, overwrite: bool = False, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path next to `path`; publish it at `path` when the block succeeds."""
    path = check_writable_destination(path, overwrite)
    with write_errors(path):
        tmp = temporary(path, suffix)
    try:
        with write_errors(path):
            yield tmp
            # mkstemp creates 0600; a published file gets the permissions a plain open() would give it.
            os.chmod(tmp, 0o666 & ~_umask())
            if overwrite:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise OutputExistsError(
                        f"{path} appeared while it was being written; refusing to overwrite it"
                    ) from None
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory next to `path`; rename it to `path` when the block succeeds."""
    path = Path(path)
    if path.exists():
        raise OutputExistsError(f"{path} already exists; refusing to overwrite it")
    parent = path.parent if str(path.parent) else Path(".")
    with write_errors(path):
        parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary(path, directory=True)
    try:
        with write_errors(path):
            yield tmp
            if path.exists():
                raise OutputExistsError(f"{path} appeared while it was being written; refusing to overwrite it")
            os.rename(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
