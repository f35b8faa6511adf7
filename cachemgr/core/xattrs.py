"""Extended attributes of the filesystem core.

`Xattrs` owns the set of inodes that have any xattr (`_inos`, loaded from the index at mount),
a fast path: the kernel asks for security.capability before every write, and almost no file has
xattrs. Invariant: an inode with a row in `xattrs` is in `_inos` (added after the index write
committed or, on rollback, harmlessly left in: a superset only costs one lookup); purged inodes
leave it (`discard`). Values live in the index, changed in the owner inode's `InodeTable.tx`.
Loop thread only.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from cachemgr.core.errors import FsError
from cachemgr.core.index import Index
from cachemgr.core.inodes import InodeTable, now_ns, retry_when_full

XATTR_VALUE_MAX = 64 * 1024


def _check_name(name: bytes) -> None:
    if name.startswith(b"system."):
        # POSIX ACLs and other system.* attributes are not implemented; ENOTSUP tells tools
        # like cp -a to carry on without them.
        raise FsError(errno.ENOTSUP, "system.* xattrs are not supported")
    if not name or len(name) > 255:
        raise FsError(errno.ERANGE if name else errno.EINVAL)


@dataclass(frozen=True, slots=True)
class XattrStats:
    """`Xattrs.statistics()`: extended attributes (`dataclasses.asdict` for JSON)."""

    inodes_with_xattrs: int


class Xattrs:
    """getxattr / setxattr / listxattr / removexattr."""

    def __init__(self, index: Index, table: InodeTable) -> None:
        self.index = index
        self.table = table
        self._inos = index.xattr_inos()

    def discard(self, ino: int) -> None:
        self._inos.discard(ino)

    def get(self, ino: int, name: bytes) -> bytes:
        # Name check first: system.* is ENOTSUP whether or not the inode has other xattrs.
        _check_name(name)
        if ino not in self._inos:
            # Fast path: the kernel asks for security.capability before every write.
            self.table.get(ino)
            raise FsError(errno.ENODATA)
        value = self.index.get_xattr(ino, name)
        if value is None:
            raise FsError(errno.ENODATA)
        return value

    @retry_when_full
    def set(self, ino: int, name: bytes, value: bytes) -> None:
        _check_name(name)
        if len(value) > XATTR_VALUE_MAX:
            raise FsError(errno.E2BIG)
        node = self.table.get(ino)
        with self.table.tx(node):
            node.ctime_ns = now_ns()
            self.index.set_xattr(ino, name, value)
            self.table.save(node, "ctime_ns")
        self._inos.add(ino)

    def list(self, ino: int) -> list[bytes]:
        self.table.get(ino)
        if ino not in self._inos:
            return []
        return self.index.list_xattrs(ino)

    @retry_when_full
    def remove(self, ino: int, name: bytes) -> None:
        _check_name(name)
        node = self.table.get(ino)
        with self.table.tx(node):
            if not self.index.remove_xattr(ino, name):
                raise FsError(errno.ENODATA)
            node.ctime_ns = now_ns()
            self.table.save(node, "ctime_ns")

    def statistics(self) -> XattrStats:
        return XattrStats(inodes_with_xattrs=len(self._inos))
