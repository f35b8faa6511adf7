"""Errors of the cache manager. Each carries the errno the FUSE layer replies with.

The mapping to errno happens here, once: callers raise `FsError(errno.X, "why")` and the FUSE
adapter turns it into `pyfuse3.FUSEError(err.errno)` without interpreting it again.
"""

from __future__ import annotations

import errno as _errno
import os


class FsError(Exception):
    """A refused filesystem operation. `errno` is what the caller of the syscall sees."""

    def __init__(self, errno: int, msg: str = "") -> None:
        super().__init__(errno, msg or os.strerror(errno))
        self.errno = errno
        self.msg = msg or os.strerror(errno)

    def __str__(self) -> str:
        return f"[{_errno.errorcode.get(self.errno, self.errno)}] {self.msg}"


class IndexError_(FsError):
    """The cache index is unusable (wrong layout version, corrupt). Surfaces as EIO."""

    def __init__(self, msg: str) -> None:
        super().__init__(_errno.EIO, msg)


class IndexFull(FsError):
    """SQLite could not write the cache index because the cache disk is full (SQLITE_FULL).
    Surfaces as ENOSPC. The transaction was rolled back. `released` is True when the index
    released its reserve (`cachemgr.core.index`) to answer it: the same operation, run again, has
    room for its index writes."""

    def __init__(self, msg: str, *, released: bool) -> None:
        super().__init__(_errno.ENOSPC, msg)
        self.released = released
