"""Errors a user can fix (input, config, files, environment), as opposed to bugs.

Raise a `UserError` where the file or key at fault is known. Its message is one line that names
it and says what to do: the command line prints only that line (the traceback goes to the run's
log), and a Prefect task never retries it.
"""
from __future__ import annotations

import errno
import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(Exception):
    """A problem the user can fix; the message is one line naming the file or key and what to do."""


class CacheRootError(UserError):
    """The cache folder (or a folder inside it) cannot be used: not a folder, not writable, full."""


DISK_FULL = ("the disk is full: free space on it (`lorapipe cache gc` removes what no pipeline needs) or use a folder"
             " on another disk")
ADVICE = {  # OSErrors the environment causes, and what to do about them
    errno.ENOSPC: DISK_FULL,
    errno.EDQUOT: DISK_FULL.replace("the disk is full", "the disk quota is used up"),
    errno.EROFS: "the filesystem is read-only: use a folder on a writable one",
    errno.EACCES: "permission denied: fix the permissions or use another folder",
    errno.EPERM: "permission denied: fix the permissions or use another folder",
    errno.ENOTDIR: "is a file where a folder is expected: move it away",
    errno.EEXIST: "is a file where a folder is expected: move it away",
    errno.EISDIR: "is a folder where a file is expected: move it away",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
}
SQLITE_ADVICE = {  # the stat cache's database (cache_dir/stat-cache.sqlite) says no file name either
    sqlite3.SQLITE_FULL: ADVICE[errno.ENOSPC],
    sqlite3.SQLITE_READONLY: ADVICE[errno.EROFS],
    sqlite3.SQLITE_CANTOPEN: "cannot open it: check cache_dir's permissions and free space",
}
MISPLACED = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def describe_os_error(error: OSError) -> str | None:
    """One line for an OSError the environment caused (full disk, read-only filesystem, no
    permission, a file where a folder belongs), naming the path; None for any other OSError."""
    advice = ADVICE.get(error.errno)
    if advice is None:
        return None
    if not error.filename:  # a write names no file
        return None if error.errno in MISPLACED else f"{error.strerror}: {advice}"
    path = Path(os.fsdecode(error.filename))
    if error.errno in MISPLACED:
        blocker = _first_file_on(path) if error.errno != errno.EISDIR else path
        if blocker is None:  # EEXIST for an existing folder is a bug, not a misplaced file
            return None
        return f"{blocker} {advice}"
    return f"{path}: {advice}"


def blame_full_disk_on(error: BaseException, folder: Path) -> None:
    """A write that fails for want of space names no file: name `folder`, where it was writing, so
    that the user's line says which disk is full."""
    if isinstance(error, OSError) and error.filename is None and error.errno in NO_SPACE:
        error.filename = str(folder)


@contextmanager
def naming_a_full_disk(folder: Path) -> Iterator[None]:
    """Around writes into `folder`: a full-disk error raised in the block names it (blame_full_disk_on)."""
    try:
        yield
    except OSError as error:
        blame_full_disk_on(error, folder)
        raise


def unusable_folder(key: str, folder: Path, error: OSError) -> str:
    """One line for a configured folder (cache_dir, output_dir) that `error` showed cannot be used."""
    return f"{key} {folder} cannot be used: {describe_os_error(error) or error}"


def _first_file_on(path: Path) -> Path | None:
    """The file that stands where `path` or one of its parent folders should be."""
    for candidate in reversed([path, *path.parents]):
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return None


def user_message(error: BaseException) -> str | None:
    """The one line to show for an error the user can fix; None for anything else (a bug)."""
    if isinstance(error, UserError):
        return one_line(str(error))
    if isinstance(error, OSError):
        described = describe_os_error(error)
        if described:
            return described
        if isinstance(error, FileNotFoundError) and error.filename:
            return f"{os.fsdecode(error.filename)}: no such file or folder"
    if isinstance(error, sqlite3.Error) and getattr(error, "sqlite_errorcode", None) in SQLITE_ADVICE:
        return f"cache_dir's stat-cache.sqlite: {error}: {SQLITE_ADVICE[error.sqlite_errorcode]}"
    if isinstance(error, (ValueError, FileNotFoundError)):  # how stage code has long reported bad input
        return one_line(str(error))
    return None


def one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())
