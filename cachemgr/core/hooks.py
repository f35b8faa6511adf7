"""The interfaces the filesystem core calls out through, and their stand-ins for a cache alone.

The core knows nothing of tiering, restore or FUSE. What it must tell them, or ask of them, goes
through three small interfaces that `CacheFs` is given in its constructor (the daemon builds the
tiering and restore services first, from the cache's owners, then the core from them), and a
fourth that the tiering services that change the tree behind the kernel's back are given:

  * `FsHooks`: what happened to the tree (a content version began or closed, a rename, a
    removal, a symlink), and "announce this directory" after a writer's close.
    `cachemgr.tiering.commit.Committer` implements it.
  * `ReadThrough`: data of a file not (or not yet verified) in the cache comes from the store
    before the core reads or changes it. `cachemgr.restore.restorer.Restorer` implements it.
  * `Room`: backpressure under --cache-size (`limit`): a write waits until there is room for
    it. `cachemgr.tiering.space.Space` implements it.
  * `KernelNotifier`: tell the kernel to forget a directory entry changed behind its back.
    The FUSE adapter (ckptfs.fuse.KERNEL) implements it; `Engine` hands it to `RemoteSync`.

What the owners below the core tell whoever keeps something per inode or waits for room (an
inode purged, cached bytes freed) is not here: those are events of the owners themselves
(`InodeTable.on_purged`, `FileCache.on_space_freed`), subscribed by the services as they are
built.

A cache with no store (the tests of the core, the tools) is given the stand-ins at the end:
`NO_HOOKS`, `NO_STORE`, `NO_LIMIT`, `NO_KERNEL`. Nothing here holds state; all of it is used on
the trio loop thread.
"""

from __future__ import annotations

import errno
from collections.abc import Container
from typing import TYPE_CHECKING, Protocol

from cachemgr.core.errors import FsError

if TYPE_CHECKING:
    from cachemgr.core.inodes import Inode


class FsHooks(Protocol):
    """What the core tells the commit/upload side (cachemgr.tiering.commit). The hooks run
    inside the core's index transaction where one is open (on_content_change, on_close,
    on_rename, on_remove, on_symlink): what they write to the index commits or rolls back with
    the operation."""

    def on_content_change(self, ino: int, old_version: int) -> None: ...

    def on_close(self, node: Inode, parent: int, name: bytes) -> None: ...

    def on_rename(self, src: Inode, dst: Inode | None, old_parent: int, old_name: bytes,
                  new_parent: int, new_name: bytes, old_path: str) -> None: ...

    def on_remove(self, node: Inode, path: str) -> None: ...

    def on_symlink(self, node: Inode, parent: int, name: bytes) -> None: ...

    def announce_dir(self, node: Inode) -> None: ...


class ReadThrough(Protocol):
    """Data from the store before the core reads or changes a file (cachemgr.restore)."""

    @property
    def clean(self) -> Container[int]:
        """The inos whose cached data was checked against its CRCs (membership only)."""

    async def ensure_all(self, ino: int) -> None: ...

    async def ensure_range(self, ino: int, off: int, size: int, *, read: bool = ...) -> None: ...

    async def read_uncached(self, ino: int, off: int, size: int) -> bytes: ...

    async def verify_cached(self, ino: int, off: int, size: int) -> None: ...

    def on_open(self, ino: int) -> None: ...

    def trusted(self, ino: int) -> bool: ...


class Room(Protocol):
    """Backpressure under --cache-size (cachemgr.tiering.space)."""

    @property
    def limit(self) -> int | None:
        """Bytes of file data the cache holds before writes wait (None: no --cache-size); room
        that can be made (replicas held for other nodes, evictable data) is above it."""

    @property
    def capacity(self) -> int | None:
        """--cache-size itself: what one reservation can never exceed, whatever is dropped for
        it (None: no --cache-size)."""

    async def wait_for_room(self, need: int) -> None: ...


class KernelNotifier(Protocol):
    def invalidate_entry(self, parent: int, name: bytes) -> None: ...


# -- a cache with no store ----------------------------------------------------------------------


class _NoHooks:
    """Nobody to tell: a cache whose sets never leave it."""

    def on_content_change(self, ino: int, old_version: int) -> None:
        return None

    def on_close(self, node: Inode, parent: int, name: bytes) -> None:
        return None

    def on_rename(self, src: Inode, dst: Inode | None, old_parent: int, old_name: bytes,
                  new_parent: int, new_name: bytes, old_path: str) -> None:
        return None

    def on_remove(self, node: Inode, path: str) -> None:
        return None

    def on_symlink(self, node: Inode, parent: int, name: bytes) -> None:
        return None

    def announce_dir(self, node: Inode) -> None:
        return None


class _Everything:
    def __contains__(self, ino: object) -> bool:
        return True


_EVERYTHING = _Everything()


class _NoStore:
    """No store to read from: every cached byte is trusted, and data that is not in the cache
    (an evicted file's) cannot come back (EIO)."""

    @property
    def clean(self) -> _Everything:
        return _EVERYTHING

    async def ensure_all(self, ino: int) -> None:
        raise FsError(errno.EIO, f"inode {ino} was evicted and no store is attached")

    async def ensure_range(self, ino: int, off: int, size: int, *, read: bool = False) -> None:
        raise FsError(errno.EIO, f"inode {ino} was evicted and no store is attached")

    async def read_uncached(self, ino: int, off: int, size: int) -> bytes:
        raise FsError(errno.EIO, f"inode {ino} was evicted and no store is attached")

    async def verify_cached(self, ino: int, off: int, size: int) -> None:
        return None

    def on_open(self, ino: int) -> None:
        return None

    def trusted(self, ino: int) -> bool:
        return True


class _NoLimit:
    """No --cache-size: writes never wait for room."""

    @property
    def limit(self) -> int | None:
        return None

    @property
    def capacity(self) -> int | None:
        return None

    async def wait_for_room(self, need: int) -> None:
        return None


class _NoKernel:
    def invalidate_entry(self, parent: int, name: bytes) -> None:
        return None


NO_HOOKS: FsHooks = _NoHooks()
NO_STORE: ReadThrough = _NoStore()
NO_LIMIT: Room = _NoLimit()
NO_KERNEL: KernelNotifier = _NoKernel()
