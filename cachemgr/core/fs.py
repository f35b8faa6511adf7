"""The filesystem core: POSIX semantics over the cache index and the cache files.

Two classes, no FUSE dependency (tested in-process as well as through a real mount; names are
`bytes`, as the kernel gives them):

  * `CacheFs`: every operation the FUSE layer forwards, as plain synchronous methods that raise
    `FsError(errno)` on refusal. It is built over a `cachemgr.core.cache.Cache` (the owners of
    the directory's state: index, inodes, cache files, xattrs, backing files, raw tree,
    residency) and the layers above it, given in its constructor (cachemgr.core.hooks: tiering's
    hooks, restore's read-through, the room policy), and composes the
    operations over them:

        Handles     (cachemgr.core.handles)    open handles; the passthrough decision
        Namespace   (cachemgr.core.namespace)  lookup, mkdir, unlink, rename... (no state)
        FileOps     (cachemgr.core.fileops)    open, read, write, truncate, fsync... (I/O counters)
        Xattrs      (cachemgr.core.xattrs)     extended attributes (the cache's owner)

  * `Filesystem`: the same operations as `async` methods, what ckptfs.fuse awaits. It adds the
    decisions that need to wait: read-through (data of an evicted file comes back from the
    store before a read of it, a write-open without O_TRUNC or a truncate), the per-file lock
    against restore fills around content changes (cachemgr.core.filecache), write
    backpressure under --cache-size, the foreground signal (uploads give way to the trainer:
    cachemgr.host.foreground), and the optional worker threads for pread/pwrite (--io-threads).

Built bottom-up by the composition root (ckptfs.daemon): `Cache.open`, then the tiering and
restore services from the cache's owners, then `CacheFs(cache, hooks=, reads=, room=)`, then
`Filesystem(core, foreground)`, then the FUSE adapter; each is whole when its constructor
returns. `CacheFs.load` is a cache with no store (the stand-ins of cachemgr.core.hooks).

Concurrency contract: every method runs on the daemon's trio loop thread (blocking I/O inline:
measured faster than worker threads here, see docs/ARCHITECTURE.md). Two things run elsewhere,
and only through owners that were made for it: restore's fills write cache files from worker
threads through `FileCache.fill` (under the per-file lock that content changes here take), and
with --io-threads the pread/pwrite of a request run in a worker thread on the handle's fd while
the bookkeeping before and after stays on the loop thread. No other thread reads this state.

Memory follows the index: every metadata operation is one index transaction, and its changes
to `Inode` objects and to the cache accounting happen inside `InodeTable.tx`, which undoes them
exactly when the transaction rolls back. So a refused operation (a full cache disk: `IndexFull`,
ENOSPC) leaves memory, index and cache files as they were, and can simply run again: when the
index released its reserve to answer the failure (cachemgr.core.index), `retry_when_full` does that
once. Cache-file changes that cannot be undone (shrinking a file, deleting a purged inode's data)
happen only after the transaction committed (`Index.after_commit`); those that can (creating a
cache file, growing one) happen inside it and are undone on rollback.

Crash contract (kill -9 of the daemon; the OS page cache survives): every metadata operation is
one committed index transaction, so after the crash the tree is exactly as of the last completed
operation; data written before the crash is in the cache files; `recover()` (cachemgr.core.fsck)
repairs the rest at the next mount. Power loss: fsync() syncs the cache file, the data directory
(once per new file) and the index WAL, so every fsync'd file is intact; unsynced data may be
lost, as on any local filesystem.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio

from cachemgr.core.cache import Cache
from cachemgr.core.errors import FsError
from cachemgr.core.filecache import FileCacheStats
from cachemgr.core.fileops import FileOps, IoStats
from cachemgr.core.handles import Handle, Handles, HandleStats, OpenResult
from cachemgr.core.hooks import (
    NO_HOOKS,
    NO_LIMIT,
    NO_STORE,
    FsHooks,
    ReadThrough,
    Room,
)
from cachemgr.core.inodes import Caller, Inode, InodeStats, retrying
from cachemgr.core.namespace import Namespace
from cachemgr.core.passthrough import Backings
from cachemgr.core.rawtree import ResidencyStats
from cachemgr.core.xattrs import XattrStats
from cachemgr.host.foreground import Foreground


@dataclass(frozen=True, slots=True)
class CacheFsStats:
    """`CacheFs.statistics()`: the counters of every owner in the core (`dataclasses.asdict`
    for JSON)."""

    inodes: InodeStats
    handles: HandleStats
    files: FileCacheStats
    xattrs: XattrStats
    io: IoStats
    residency: ResidencyStats


class CacheFs:
    """POSIX filesystem semantics over one cache directory (see the module docstring)."""

    def __init__(self, cache: Cache, *, hooks: FsHooks, reads: ReadThrough, room: Room,
                 direct_io_writes: bool = True) -> None:
        self.cache = cache
        # the owners, read by the operations below and by the async face (Filesystem)
        self.cache_dir, self.index, self.files = cache.cache_dir, cache.index, cache.files
        self.table, self.xattrs, self.backings = cache.table, cache.xattrs, cache.backings
        self.stats = cache.stats
        self.reads = reads    # data from the store before it is read or changed here
        self.room = room      # --cache-size backpressure for writes
        self.handles = Handles(cache.index, cache.table, cache.files, cache.backings, reads, room,
                               direct_io_writes=direct_io_writes)
        self.namespace = Namespace(cache.index, cache.table, cache.files, hooks)
        self.fileops = FileOps(cache.index, cache.table, cache.files, self.handles,
                               self.namespace, hooks, cache.stats, str(cache.cache_dir))

    @classmethod
    def load(cls, cache_dir: Path, *, direct_io_writes: bool = True,
             backings: Backings | None = None) -> CacheFs:
        """A cache with no store (the core's tests, the tools): `Cache.open` with the stand-ins
        of cachemgr.core.hooks for the layers above."""
        return cls(Cache.open(cache_dir, backings=backings), hooks=NO_HOOKS, reads=NO_STORE,
                   room=NO_LIMIT, direct_io_writes=direct_io_writes)

    def close(self) -> None:
        """Persist everything and release the index. Called after the kernel unmounted, so every
        lookup count is implicitly zero and unlinked inodes can go."""
        self.handles.close_all()
        self.fileops.retry_unclosed()  # a close the full disk kept from being recorded
        self.cache.close()

    # -- namespace (cachemgr.core.namespace) ---------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Inode:
        return self.namespace.lookup(parent, name)

    def forget(self, ino: int, nlookup: int) -> None:
        self.namespace.forget(ino, nlookup)

    def getattr(self, ino: int) -> Inode:
        return self.table.get(ino)

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return self.namespace.mkdir(parent, name, mode, uid, gid)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        return self.namespace.symlink(parent, name, target, uid, gid)

    def readlink(self, ino: int) -> bytes:
        return self.namespace.readlink(ino)

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        return self.namespace.mknod(parent, name, mode, rdev, uid, gid)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        return self.namespace.link(ino, new_parent, new_name)

    def unlink(self, parent: int, name: bytes) -> None:
        self.namespace.unlink(parent, name)

    def rmdir(self, parent: int, name: bytes) -> None:
        self.namespace.rmdir(parent, name)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        self.namespace.rename(old_parent, old_name, new_parent, new_name, flags)

    def opendir(self, ino: int) -> int:
        self.namespace.dir(ino)
        return ino

    def readdir(self, ino: int, start_id: int) -> Iterator[tuple[int, bytes, Inode]]:
        return self.namespace.readdir(ino, start_id)

    def ref(self, node: Inode) -> None:
        """readdirplus handed the kernel a reference to `node`."""
        node.lookups += 1

    def fsyncdir(self, ino: int) -> None:
        retrying(self.index.sync)

    # -- files (cachemgr.core.fileops) ---------------------------------------------------------

    def setattr(self, ino: int, **kw: Any) -> Inode:
        return self.fileops.setattr(ino, **kw)

    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
               gid: int, caller: Caller | None = None) -> tuple[OpenResult, Inode]:
        return self.fileops.create(parent, name, mode, flags, uid, gid, caller)

    def open(self, ino: int, flags: int, caller: Caller | None = None) -> OpenResult:
        return self.fileops.open(ino, flags, caller)

    def read(self, fh: int, off: int, size: int) -> bytes:
        return self.fileops.read(fh, off, size)

    def write(self, fh: int, off: int, buf: bytes) -> int:
        return self.fileops.write(fh, off, buf)

    def io_handle(self, fh: int) -> Handle:
        """For callers that do the pread/pwrite themselves: the handle, then `wrote()`."""
        return self.handles.get(fh)

    def before_write(self, h: Handle, n: int) -> None:
        self.fileops.before_write(h, n)

    def wrote(self, h: Handle, off: int, n: int) -> None:
        self.fileops.wrote(h, off, n)

    def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        self.fileops.fallocate(fh, mode, off, length)

    def take_in_writes(self, node: Inode) -> None:
        self.handles.take_in_writes(node)

    def flush(self, fh: int) -> None:
        self.fileops.flush(fh)

    def fsync(self, fh: int, datasync: bool) -> None:
        self.fileops.fsync(fh, datasync)

    def release(self, fh: int) -> None:
        self.fileops.release(fh)

    # -- xattrs (cachemgr.core.xattrs) ---------------------------------------------------------

    def getxattr(self, ino: int, name: bytes) -> bytes:
        return self.xattrs.get(ino, name)

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.xattrs.set(ino, name, value)

    def listxattr(self, ino: int) -> list[bytes]:
        return self.xattrs.list(ino)

    def removexattr(self, ino: int, name: bytes) -> None:
        self.xattrs.remove(ino, name)

    # -- filesystem ----------------------------------------------------------------------------

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.cache_dir)

    def status(self) -> dict[str, object]:
        """A snapshot for `ckptfs status` (a JSON document): what the cache holds and what the
        data path did."""
        totals = self.index.totals()
        # Files being written: their in-memory size is newer than the index's.
        for node in self.table.loaded():
            self.handles.take_in_writes(node)
            if node.dirty and node.nlink > 0:
                row = self.index.get_inode(node.ino)
                if row is not None:
                    totals["bytes"] += node.size - row[4]
        st = os.statvfs(self.cache_dir)
        out: dict[str, object] = {
            "cache": {**totals, "open_handles": len(self.handles),
                      "cached_bytes": self.files.cached_bytes,
                      "evictions": self.stats.evictions,
                      "evicted_bytes": self.stats.evicted_bytes,
                      "disk_free_bytes": st.f_bavail * st.f_frsize,
                      "disk_total_bytes": st.f_blocks * st.f_frsize},
            "io": asdict(self.fileops.statistics()),
            "data_path": asdict(self.backings.statistics()),
            "core": asdict(self.statistics()),
        }
        return out

    def statistics(self) -> CacheFsStats:
        """Counters of every owner in the core (loop thread)."""
        return CacheFsStats(inodes=self.table.statistics(), handles=self.handles.statistics(),
                            files=self.files.statistics(), xattrs=self.xattrs.statistics(),
                            io=self.fileops.statistics(),
                            residency=self.cache.residency.statistics())

    def check_consistency(self) -> list[str]:
        """The problems `fsck.check` finds in index and cache files (empty: consistent)."""
        return self.cache.check_consistency()


_NO_LOCK: contextlib.nullcontext[None] = contextlib.nullcontext()  # usable with `async with`


class Filesystem:
    """The operations the FUSE adapter awaits (see the module docstring). Synchronous ones go
    straight to `CacheFs`; these add the waiting: read-through, fill locks, backpressure."""

    def __init__(self, core: CacheFs, foreground: Foreground, *, io_threads: int = 0) -> None:
        self.core = core
        # noted at every read and write the daemon serves: uploads give way to the trainer
        self.foreground = foreground
        # io_threads > 0 moves the data syscalls (pread/pwrite) to worker threads; bookkeeping
        # stays on the loop thread, so the core still sees one thread. Off by default: measured
        # slower here (docs/ARCHITECTURE.md).
        self._io_limiter = trio.CapacityLimiter(io_threads) if io_threads > 0 else None

    def _changing(self, ino: int, changes_content: bool
                  ) -> contextlib.AbstractAsyncContextManager[None]:
        """Context for an operation that may change a file's content: it waits for a restore
        fill in flight, which then sees the change and writes nothing (cachemgr.core.filecache).
        Other operations take no lock."""
        return self.core.files.exclusive(ino) if changes_content else _NO_LOCK

    async def ensure_cached(self, ino: int) -> None:
        """Data not in the cache comes back from the store before anything changes it."""
        if self.core.cache.residency.needs_fetch(ino):
            await self.core.reads.ensure_all(ino)

    async def setattr(self, ino: int, *, truncating: bool, **kw: Any) -> Inode:
        if truncating:
            await self.ensure_cached(ino)
        # A truncate changes content: not while a restore fill writes the file (FileCache).
        async with self._changing(ino, truncating):
            return self.core.setattr(ino, **kw)

    async def open(self, ino: int, flags: int, caller: Caller | None) -> OpenResult:
        truncating = bool(flags & os.O_TRUNC)  # any access mode (see FileOps._open_data)
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if writing and not truncating:
            await self.ensure_cached(ino)
        async with self._changing(ino, writing or truncating):
            res = self.core.open(ino, flags, caller)
        if writing and res.backing_id:
            self.foreground.note()  # its writes never reach the daemon (host.foreground)
        if not writing:
            # Reads wait only for their own ranges; what the restore policy (--prefetch)
            # fetches ahead of them comes in meanwhile.
            self.core.reads.on_open(ino)
        return res

    async def read(self, fh: int, off: int, size: int) -> bytes:
        core = self.core
        self.foreground.note()  # uploads hold back while the trainer reads
        reads = core.reads
        node = core.io_handle(fh).inode
        if not node.cached:
            try:
                await reads.ensure_range(node.ino, off, size, read=True)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # No room on the cache disk for the chunks: the read is served from the
                # store all the same, without caching (a read never answers ENOSPC).
                return await reads.read_uncached(node.ino, off, size)
        elif node.ino not in reads.clean:
            await reads.verify_cached(node.ino, off, size)
        if self._io_limiter is None:
            return core.read(fh, off, size)
        h = core.io_handle(fh)
        data: bytes = await trio.to_thread.run_sync(os.pread, h.fd, size, off,
                                                    limiter=self._io_limiter)
        core.stats.reads += 1
        core.stats.bytes_read += len(data)
        return data

    async def fsync(self, fh: int, datasync: bool) -> None:
        """fsync with its syscalls in worker threads (cachemgr.core.fileops "fsync"): ranks that
        fsync at once overlap, and the loop answers other requests meanwhile."""
        ops = self.core.fileops
        fd, new_file = ops.fsync_begin(fh)
        await trio.to_thread.run_sync(os.fdatasync if datasync else os.fsync, fd)
        if new_file:
            await trio.to_thread.run_sync(self.core.files.sync_data_dir)
        ops.fsync_end(fh, new_file)
        await trio.to_thread.run_sync(self.core.index.sync_wal)

    async def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """fallocate (FileOps.fallocate) under --cache-size backpressure, like a write: it waits
        for room for what it may add; a reservation larger than the whole limit is refused."""
        core = self.core
        self.foreground.note()
        limit = core.room.limit
        if limit is not None:
            need = core.fileops.fallocate_need(fh, mode, off, length)
            capacity = core.room.capacity
            if capacity is not None and need > capacity:
                raise FsError(errno.ENOSPC, f"fallocate of {need} bytes: more than --cache-size")
            if core.files.cached_bytes + need > limit:
                await core.room.wait_for_room(need)
        ino = core.io_handle(fh).inode.ino
        async with self._changing(ino, True):
            core.fallocate(fh, mode, off, length)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        core = self.core
        self.foreground.note()  # uploads hold back while the trainer writes
        limit = core.room.limit
        if limit is not None and core.files.cached_bytes + len(buf) > limit:
            # Backpressure: wait for uploads to make data evictable, never fail the write.
            await core.room.wait_for_room(len(buf))
        if self._io_limiter is None:
            return core.write(fh, off, buf)
        h = core.io_handle(fh)
        core.before_write(h, len(buf))  # room kept for the index; set-id bits
        if h.append:
            off = h.inode.size
        n: int = await trio.to_thread.run_sync(os.pwrite, h.fd, buf, off,
                                               limiter=self._io_limiter)
        core.wrote(h, off, n)
        return n
