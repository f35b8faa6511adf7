"""The interfaces the filesystem core calls out through, and the one place they are held.

The core (cachemgr.core.fs) knows nothing of tiering, restore or FUSE. What it must tell them, or
ask of them, goes through four small interfaces that the composition root (ckptfs.mount /
ckptfs.daemon) hands it once, with `CacheFs.connect(...)`, before the mount serves requests:

  * `FsHooks`: what happened to the tree (a content version began or closed, a rename, a
    removal, a symlink, a purge, freed cache space), and "announce this directory" after a
    writer's close. `cachemgr.tiering.services.Tiering` implements it today.
  * `ReadThrough`: data of a file not (or not yet verified) in the cache comes from the store
    before the core reads or changes it. `Tiering.restorer` (cachemgr.restore.restorer) implements
    it.
  * `Room`: backpressure under --cache-size: a write waits until there is room for it.
    `Tiering.wait_for_room` implements it; the limit itself is given with it.
  * `KernelNotifier`: tell the kernel to forget a directory entry changed behind its back.
    The FUSE adapter (ckptfs.fuse.KERNEL) implements it.

`Wiring` holds them. It is made empty by `CacheFs.__init__` (a purely local cache: no hooks, no
read-through, no limit, no kernel) and filled once by `connect`; the core's parts read it and
never change it. Connecting after construction is the price of a cycle: Tiering is built from
the core. Nothing here holds state of its own; all of it is used on the trio loop thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from cachemgr.core.inodes import Inode


class FsHooks(Protocol):
    """What the core tells the commit/upload side (cachemgr.tiering.services). The hooks run inside
    the core's index transaction where one is open (on_content_change, on_close, on_rename,
    on_remove, on_symlink): what they write to the index commits or rolls back with the
    operation."""

    def on_content_change(self, ino: int, old_version: int) -> None: ...

    def on_close(self, node: Inode, parent: int, name: bytes) -> None: ...

    def on_rename(self, src: Inode, dst: Inode | None, old_parent: int, old_name: bytes,
                  new_parent: int, new_name: bytes, old_path: str) -> None: ...

    def on_remove(self, node: Inode, path: str) -> None: ...

    def on_symlink(self, node: Inode, parent: int, name: bytes) -> None: ...

    def announce_dir(self, node: Inode) -> None: ...

    def on_space_freed(self) -> None: ...

    def on_purge(self, ino: int) -> None: ...


class ReadThrough(Protocol):
    """Data from the store before the core reads or changes a file (cachemgr.restore.restorer)."""

    clean: Any  # container of inos whose cached data was checked against its CRCs

    async def ensure_all(self, ino: int) -> None: ...

    async def ensure_range(self, ino: int, off: int, size: int, *, read: bool = ...) -> Any: ...

    async def read_uncached(self, ino: int, off: int, size: int) -> bytes: ...

    async def verify_cached(self, ino: int, off: int, size: int) -> Any: ...

    def on_open(self, ino: int) -> Any: ...

    def trusted(self, ino: int) -> bool: ...


class Room(Protocol):
    """Backpressure under --cache-size (cachemgr.tiering.services / space)."""

    async def wait_for_room(self, need: int) -> Any: ...


class KernelNotifier(Protocol):
    def invalidate_entry(self, parent: int, name: bytes) -> None: ...


class _NoKernel:
    def invalidate_entry(self, parent: int, name: bytes) -> None:
        return None


@dataclass(slots=True)
class Wiring:
    """The core's collaborators, set once by `CacheFs.connect` (see the module docstring)."""

    hooks: FsHooks | None = None
    reads: ReadThrough | None = None
    room: Room | None = None
    cache_size: int | None = None          # --cache-size: writes wait for room above it
    kernel: KernelNotifier = field(default_factory=_NoKernel)
    status: Callable[[], dict[str, Any]] | None = None   # the tiering part of `status()`

    def space_freed(self) -> None:
        if self.hooks is not None:
            self.hooks.on_space_freed()

    def purged(self, ino: int) -> None:
        if self.hooks is not None:
            self.hooks.on_purge(ino)
