"""Paths given on the command line: one true line for each way one can be wrong.

Every output file of the entry points (`predict --out`, `export --out`, `evaluate --out`,
`tune --out`) goes through `write_atomically`: written to a temporary file beside the target,
flushed, then renamed over it, so a failed or interrupted write leaves the previous file as it
was. `check_output` finds a bad target before any work (a folder, a path under a regular file,
a FIFO or device, a folder this process cannot write), so an hour of evaluation is not lost
to a typo. A bad path is `PathError` (exit 2); a disk that refuses the bytes (full, read-only,
over quota) is `WriteError` (exit 74). `file_problem` and `folder_problem` say what is wrong
with a file or folder to be read: missing, of the other kind, a FIFO or device, unreadable.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

# Errors that say the path is wrong (exit 2); any other OSError is the disk's (exit 74).
PATH_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOENT}
    | {errno.ENAMETOOLONG, errno.ELOOP}
)


class PathError(RuntimeError):
    """A path given by the user cannot be used as asked (exit 2)."""


class WriteError(OSError):
    """An output could not be written: the disk refused (exit 74). The previous file stays."""


def kind(mode: int) -> str:
    """What a `st_mode` is, in words ("a folder", "a FIFO", ...)."""
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _reason(error: OSError) -> str:
    return error.strerror or type(error).__name__


def _stat_problem(path: Path, what: str) -> int | str:
    """The mode of `path`, or what keeps it from being stat-ed (`what`: "a file", "a folder")."""
    if str(path) == "":
        return f"is empty; name {what}"
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as error:
        return f"cannot be read ({_reason(error)})"


def file_problem(path: Path) -> str | None:
    """What keeps `path` from being read as a regular file, or None when it can be."""
    mode = _stat_problem(path, "a file")
    if isinstance(mode, str):
        return mode
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    if not stat.S_ISREG(mode):
        return f"is {kind(mode)}, not a regular file"
    if not os.access(path, os.R_OK):
        return f"cannot be read ({os.strerror(errno.EACCES)})"
    return None


def folder_problem(path: Path) -> str | None:
    """What keeps `path` from being listed as a folder, or None when it can be."""
    mode = _stat_problem(path, "a folder")
    if isinstance(mode, str):
        return mode
    if not stat.S_ISDIR(mode):
        return f"is {kind(mode)}, not a folder"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"cannot be read ({os.strerror(errno.EACCES)})"
    return None


def check_output(path: Path, flag: str) -> None:
    """Refuse, before any work, an output path that cannot become a file (`PathError`)."""
    if str(path) in ("", "."):
        raise PathError(f"{flag} is empty; name a file to write")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as error:  # ENOTDIR: under a regular file; EACCES: a folder on the way
        raise PathError(f"{flag} {path} cannot be written: {_blocker(path, error)}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise PathError(f"{flag} {path} is a folder; name a file to write")
    if mode is not None and not stat.S_ISREG(mode):
        raise PathError(f"{flag} {path} is {kind(mode)}, not a regular file; name a file")
    existing = next(parent for parent in path.absolute().parents if parent.exists())
    if not existing.is_dir():
        raise PathError(f"{flag} {path} cannot be written: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PathError(f"{flag} {path} cannot be written: {existing} is not writable")


def _blocker(path: Path, error: OSError) -> str:
    """The ancestor of `path` that is a regular file, else the error's words."""
    for parent in reversed(path.absolute().parents):
        if parent.is_file():
            return f"{parent} is a file, not a folder"
    return _reason(error)


def write_atomically(path: Path, data: bytes | str, flag: str) -> None:
    """Write `data` to `path` whole, or leave `path` as it was and raise one line.

    The temporary file is made beside `path` (a rename across file systems is not atomic),
    flushed to disk, then renamed over `path`; the folder is flushed too.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(handle, "wb") as file:
            file.write(payload)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_folder(path.parent)
    except OSError as error:
        raise failure(error, path, flag) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def failure(error: OSError, path: Path, flag: str) -> PathError | WriteError:
    """`error` from writing `path`, as one line: a bad path (exit 2) or a refusing disk (74)."""
    kept = f"{path} is as it was" if path.is_file() else "nothing was written"
    if error.errno in PATH_ERRNOS:
        return PathError(f"{flag} {path} cannot be written: {_blocker(path, error)}; {kept}")
    return WriteError(f"{flag} {path} could not be written: {_reason(error)}; {kept}")


def _fsync_folder(folder: Path) -> None:
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder
        return
    try:
        os.fsync(handle)
    except OSError:  # some network file systems cannot flush a folder
        pass
    finally:
        os.close(handle)
