"""The file data operations of the filesystem core: open, read, write, truncate, flush, fsync,
release, and the content versions they begin and close.

`FileOps` owns no state of its own beyond the I/O counters (`CoreStats`) and `_unclosed`
(the contents whose last close could not be recorded on a full disk, closed again later):
handles belong to `Handles`, inodes to `InodeTable`, cache-file accounting to `FileCache`.
All of it runs on the trio loop thread (blocking I/O inline: measured faster than worker
threads here, see docs/ARCHITECTURE.md).

Invariants, and what guards them:

  * A cache file is always exactly its file's logical size: writes extend it, `_truncate`
    resizes it (growing inside the transaction, undone on rollback; shrinking only after
    commit, since lost bytes cannot come back).
  * The hot path (`write`) changes only memory: size/mtime reach the index at flush, fsync or
    release (`Inode.dirty`).
  * (ino, version) names one closed content: the first writer's open and every truncate
    without writers begin a new version (`_new_version`, `FsHooks.on_content_change`); the last
    writer's release, or such a truncate, closes it (`_closed`, `FsHooks.on_close`).

Crash states: a truncate whose transaction committed but whose cache file was not shrunk yet
keeps the old bytes (recover() takes the size from the cache file); sizes written since the
last flush are in the cache files, which recover() trusts. fsync() syncs the cache file, the data
directory (once per new file) and the index WAL, so every fsync'd file survives power loss.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from dataclasses import dataclass, field

from cachemgr.core.errors import FsError, IndexFull
from cachemgr.core.filecache import (
    FALLOC_FL_KEEP_SIZE,
    FALLOC_FL_PUNCH_HOLE,
    FALLOC_MODES,
    FileCache,
    fallocate,
)
from cachemgr.core.handles import Handle, Handles, OpenResult
from cachemgr.core.hooks import FsHooks
from cachemgr.core.index import Index
from cachemgr.core.inodes import (
    SETID,
    Caller,
    Inode,
    InodeTable,
    kill_setid,
    kill_setid_on_chown,
    now_ns,
    retry_when_full,
    retrying,
)
from cachemgr.core.namespace import Namespace

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CoreStats:
    """The data path's counters: I/O (FileOps) and evictions (rawtree.Residency); loop thread
    only, read by metrics and status."""

    writes: int = 0
    bytes_written: int = 0
    reads: int = 0
    bytes_read: int = 0
    fsyncs: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    evictions: int = 0        # cached files whose data was dropped (it is in the store)
    evicted_bytes: int = 0    # their cache bytes freed


@dataclass(frozen=True, slots=True)
class IoStats:
    """`FileOps.statistics()`: the daemon's own reads and writes (`dataclasses.asdict` for JSON)."""

    write_requests: int
    bytes_written: int
    read_requests: int
    bytes_read: int
    fsyncs: int


class FileOps:
    """POSIX operations on file data."""

    def __init__(self, index: Index, table: InodeTable, files: FileCache, handles: Handles,
                 namespace: Namespace, hooks: FsHooks, stats: CoreStats, cache_dir: str) -> None:
        self.index = index
        self.table = table
        self.files = files
        self.handles = handles
        self.namespace = namespace
        self.hooks = hooks
        self.stats = stats
        self.cache_dir = cache_dir
        # ino -> (version, passthrough): a content whose last writer's release could not be
        # recorded (IndexFull even after the reserve). The kernel does not retry a release, so
        # it is closed again (`retry_unclosed`) at the next release and at unmount; else its
        # set would never be committed. Loop thread only.
        self._unclosed: dict[int, tuple[int, bool]] = {}

    # -- attributes --------------------------------------------------------------------------

    @retry_when_full
    def setattr(self, ino: int, *, size: int | None = None, mode: int | None = None,
                uid: int | None = None, gid: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None, fh: int | None = None,
                caller: Caller | None = None) -> Inode:
        node = self.table.get(ino)
        self.handles.take_in_writes(node)
        if size is not None:
            _check_truncate(node, size)
        now = now_ns()
        changed: list[str] = ["ctime_ns"]
        with self.table.tx(node):
            if size is not None:
                self._truncate(node, size, fh)
                node.mtime_ns = now
                changed += ["size", "mtime_ns"]
            if mode is not None:
                node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
                changed.append("mode")
            if size is not None and kill_setid(node, caller):
                changed.append("mode")  # after an explicit mode: the kernel's own kill is in it
            # A chown. With a mode in the same SETATTR, that mode is the kernel's, set-id bits
            # already cleared (no FUSE_HANDLE_KILLPRIV_V2); without one, the daemon clears them.
            if (uid is not None or gid is not None) and mode is None and \
                    not stat.S_ISDIR(node.mode) and kill_setid_on_chown(node):
                changed.append("mode")
            for name, value in (("uid", uid), ("gid", gid), ("atime_ns", atime_ns),
                                ("mtime_ns", mtime_ns)):
                if value is not None:
                    setattr(node, name, value)
                    changed.append(name)
            node.ctime_ns = now
            self.table.save(node, *changed)
            if node.dirty:
                self.table.persist(node)
        return node

    def _truncate(self, node: Inode, size: int, fh: int | None) -> None:
        """Resize a regular file, inside the caller's `tx(node)`."""
        h = self.handles.find(fh) if fh is not None else None
        target: int | str = h.fd if h is not None else self.files.path(node.ino)
        old = node.size
        self.files.resized(node.ino, old, size)
        node.size = size
        node.gen += 1
        if not node.writers:
            self._new_version(node)
        if size > old:
            # Growing adds a hole, so it is undone exactly: now, inside the transaction (an
            # EFBIG from the cache disk refuses the whole operation).
            os.truncate(target, size)
            self.index.on_rollback(lambda: os.truncate(target, old))
        elif size < old:
            # Shrinking loses bytes: only once the transaction committed.
            self.index.after_commit(lambda: os.truncate(target, size))

    # -- opening -------------------------------------------------------------------------------

    @retry_when_full
    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
               gid: int, caller: Caller | None = None) -> tuple[OpenResult, Inode]:
        d = self.namespace.dir(parent)
        fd = None
        try:
            with self.table.tx():  # the new inode and its open: one transaction
                node = self.namespace.new_inode(d, name, stat.S_IFREG | stat.S_IMODE(mode),
                                                uid, gid)
                fd = self._open_data(node, flags, caller)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return self.handles.add(node, fd, flags, caller), node

    @retry_when_full
    def open(self, ino: int, flags: int, caller: Caller | None = None) -> OpenResult:
        """Open a regular file. `caller` (None: privileged) decides which set-id bits its
        writes and a truncating open remove (`kill_setid`)."""
        node = self.table.get(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if not node.is_reg:
            raise FsError(errno.EINVAL, "not a regular file")
        fd = self._open_data(node, flags, caller)
        return self.handles.add(node, fd, flags, caller)

    def _open_data(self, node: Inode, flags: int, caller: Caller | None) -> int:
        """The index side of an open, in one transaction: O_TRUNC, the set-id bits a truncating
        open removes, a new content version for the first writer. Returns an fd on the cache
        file."""
        accmode = flags & os.O_ACCMODE
        writable = accmode in (os.O_WRONLY, os.O_RDWR)
        # O_TRUNC truncates whatever the access mode, as on Linux's local filesystems
        # (O_RDONLY|O_TRUNC needs write permission, which the kernel checked). With
        # atomic_o_trunc the kernel leaves the truncation to us and sets its size to 0.
        trunc = bool(flags & os.O_TRUNC)
        if not node.cached and writable and not trunc:
            # The read-through (CacheFs.open_async) fetches the data before a write open;
            # reaching here is a bug. (Read-only opens are fine: each read waits for its own
            # range, see cachemgr.restore.restorer.)
            raise FsError(errno.EIO, f"inode {node.ino} is not in the cache (fetch it first)")
        fd = os.open(self.files.path(node.ino), os.O_RDWR)
        if not trunc and not (writable and not node.writers):
            return fd  # nothing for the index (a read-only open, or another writer's)
        try:
            with self.table.tx(node):
                # An unprivileged O_TRUNC removes set-id bits even on an empty file, as
                # do_truncate does (the kernel leaves that to us with atomic_o_trunc).
                if trunc and kill_setid(node, caller):
                    self.table.save(node, "mode", "ctime_ns")
                if trunc and (node.size or not node.cached):
                    self._truncate_at_open(node, fd, writable)
                if writable and not node.writers:
                    # The first writer starts a new content version: the unit of upload and
                    # commit.
                    node.writing = 1
                    self._new_version(node)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _truncate_at_open(self, node: Inode, fd: int, writable: bool) -> None:
        now = now_ns()
        if node.cached:
            self.files.dropped(node.ino, node.size)
        node.size = 0
        node.cached = 1
        node.gen += 1
        node.mtime_ns = node.ctime_ns = now
        self.table.save(node, "size", "mtime_ns", "ctime_ns", "cached")
        # Shrinking loses bytes: only once the transaction committed.
        self.index.after_commit(lambda: os.ftruncate(fd, 0))
        if not writable and not node.writers:
            self._new_version(node)  # as a truncate without writers (_truncate)

    # -- reading and writing -------------------------------------------------------------------

    def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.handles.hot(fh)
        data = os.pread(h.fd, size, off)
        st = self.stats
        st.reads += 1
        st.bytes_read += len(data)
        return data

    def write(self, fh: int, off: int, buf: bytes) -> int:
        # Hot path: one pwrite, then in-memory size/mtime; the index is updated at flush/release.
        h = self.handles.hot(fh)
        if (h.opener is not None and h.inode.mode & SETID) or not self.index.reserve_held:
            self.before_write(h, len(buf))
        if h.append:
            off = h.inode.size
        n = os.pwrite(h.fd, buf, off)
        self.wrote(h, off, n)
        return n

    def before_write(self, h: Handle, n: int) -> None:
        """Before `n` bytes are written through `h`:

        * While the index reserve is released (the cache disk was full, cachemgr.core.index), file
          data does not take the room that freed: it is for the index writes of the deletes
          that make room. ENOSPC unless the disk has the reserve's size free besides `n`.
        * An unprivileged opener's write removes set-id bits (file_remove_privs). With direct
          I/O the kernel leaves that to the filesystem (FUSE_WRITE_KILL_SUIDGID, which pyfuse3
          does not pass on), so it is decided here from the opener's credentials; through the
          page cache the kernel already did it.
        """
        if not self.index.data_may_take(self.cache_dir, n):
            raise FsError(errno.ENOSPC, "cache disk full (what is left is kept for the"
                          " index: delete files to make room)")
        if h.opener is not None and h.inode.mode & SETID:
            retrying(self.table.kill_setid_now, h.inode, h.opener)

    def wrote(self, h: Handle, off: int, n: int) -> None:
        node = h.inode
        end = off + n
        if off < node.size and self.files.has_hole(node.ino):
            self.files.filled(node.ino, min(end, node.size) - off)
        if end > node.size:
            self.files.grew(end - node.size)
            node.size = end
        node.mtime_ns = node.ctime_ns = time.time_ns()
        node.dirty = True
        node.gen += 1
        st = self.stats
        st.writes += 1
        st.bytes_written += n

    def fallocate_need(self, fh: int, mode: int, off: int, length: int) -> int:
        """At most how many bytes `fallocate` adds to `cached_bytes` (for --cache-size
        backpressure): the growth past the end and the hole it may fill, never more than
        `length`; nothing for a punch."""
        node = self.handles.get(fh).inode
        if mode & FALLOC_FL_PUNCH_HOLE:
            return 0
        grow = 0 if mode & FALLOC_FL_KEEP_SIZE else max(0, off + length - node.size)
        return min(length, grow + self.files.hole(node.ino))

    def fallocate(self, fh: int, mode: int, off: int, length: int) -> None:
        """fallocate(2) on the cache file through the handle's fd (docs/SEMANTICS.md
        "fallocate"): mode 0 and FALLOC_FL_KEEP_SIZE reserve blocks (mode 0 grows the file to
        `off + length`), FALLOC_FL_PUNCH_HOLE and FALLOC_FL_ZERO_RANGE zero a range, as the cache
        disk's filesystem does them (its EOPNOTSUPP, ENOSPC... are answered as they are). Like
        a write: a writable handle, room kept for the index, set-id bits of an unprivileged
        opener removed, mtime and ctime set. Inline on the loop thread: allocating marks extents
        and writes no data. The kernel holds the inode lock for the whole request, so no write
        or truncate of this file runs meanwhile; the size is taken from the cache file after
        the call, so a partial allocation on a full disk is counted as it is."""
        h = self.handles.get(fh)
        node = h.inode
        if mode & ~FALLOC_MODES:
            raise FsError(errno.EOPNOTSUPP, f"fallocate mode {mode:#x}")
        if not h.writable:
            raise FsError(errno.EBADF)
        if off < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        if h.passthrough:
            self.handles.take_in_writes(node)  # what the kernel wrote through it, first
        if mode & FALLOC_FL_PUNCH_HOLE:  # frees blocks: no room to keep, set-id bits only
            if h.opener is not None and node.mode & SETID:
                retrying(self.table.kill_setid_now, node, h.opener)
        else:
            self.before_write(h, length)  # room kept for the index; set-id bits
        try:
            fallocate(h.fd, mode, off, length)
        except OSError as e:
            failed: OSError | None = e
        else:
            failed = None
        size = os.fstat(h.fd).st_size
        resized = size != node.size
        if resized:
            self.files.resized(node.ino, node.size, size)  # grown over: a hole, recounted next
            node.size = size
        if failed is None or resized:
            # Blocks were allocated or punched: the hole is taken from st_blocks again.
            self.files.hole_settled(node.ino, node.size)
            node.mtime_ns = node.ctime_ns = time.time_ns()
            node.dirty = True
            node.gen += 1
            if h.passthrough:
                self.handles.backings.refresh(node.ino)  # the daemon's own change, taken in
        if failed is not None:
            raise FsError(failed.errno or errno.EIO, f"fallocate: {failed.strerror}")

    # -- closing -------------------------------------------------------------------------------

    def flush(self, fh: int) -> None:
        """close() of a handle. The last writer of a file in an open set has its directory's
        part record updated in the background (cachemgr.tiering.parts); close() never waits for the
        store."""
        h = self.handles.get(fh)
        if h.passthrough:
            self.handles.take_in_writes(h.inode)
        if h.inode.dirty:
            retrying(self.table.persist_now, h.inode)
        if h.writable:
            self.hooks.announce_dir(h.inode)

    @retry_when_full
    # fsync (docs/SEMANTICS.md "fsync"): the file's data, the name of its cache file and its
    # metadata in the index, durable on the cache disk, in that order. `Filesystem.fsync` runs
    # the three syncs in worker threads (so the fsyncs of several ranks overlap and the loop
    # answers other requests meanwhile) around the two steps below, which stay on the loop
    # thread; `fsync` here does it all on the calling thread (in-process callers). The handle's
    # fd stays open throughout: the kernel sends no RELEASE while an fsync of it is in flight.

    def fsync(self, fh: int, datasync: bool) -> None:
        fd, new_file = self.fsync_begin(fh)
        if datasync:
            os.fdatasync(fd)
        else:
            os.fsync(fd)
        if new_file:
            self.files.sync_data_dir()
        self.fsync_end(fh, new_file)
        self.index.sync_wal()

    def fsync_begin(self, fh: int) -> tuple[int, bool]:
        """What the kernel wrote through a passthrough handle taken in; (the fd to sync,
        whether the cache file's name must be synced too: created since its last fsync)."""
        h = self.handles.get(fh)
        self.handles.take_in_writes(h.inode)
        return h.fd, h.inode.new_file

    def fsync_end(self, fh: int, synced_name: bool) -> None:
        """The file's metadata committed to the index (the caller then syncs the WAL)."""
        node = self.handles.get(fh).inode
        if synced_name:
            node.new_file = False
        with self.table.tx(node):
            self.table.persist(node)
        self.stats.fsyncs += 1

    def release(self, fh: int) -> None:
        """The last close of a handle. The handle goes whatever happens (the kernel does not
        retry a release); if its index transaction fails (a full cache disk even after the
        reserve), the file's size stays dirty in memory and its content is not closed: it is
        uploaded after its next write-open and close."""
        h = self.handles.pop(fh)
        if h is None:
            return
        node = h.inode
        if h.passthrough:
            try:
                self.handles.take_in_writes(node)  # what the kernel wrote through this handle
            finally:
                self.handles.backings.release(node.ino, h.writable, h.pid)
        os.close(h.fd)
        node.opens -= 1
        if h.writable:
            node.writers -= 1
        try:
            retrying(self._released, node, h.writable, h.passthrough)
        except IndexFull:
            if h.writable and not node.writers and node.nlink > 0:
                self._unclosed[node.ino] = (node.version, h.passthrough)
                log.warning("cache disk full: the close of inode %d is not recorded yet; it is "
                            "retried at the next close and at unmount", node.ino)
            raise
        finally:
            self.table.maybe_drop(node)
        if self._unclosed:
            self.retry_unclosed()

    def retry_unclosed(self) -> None:
        """Close again every content whose last close could not be recorded (`_unclosed`):
        unless a new writer opened it since (its close will), or it is gone. Stops at the
        first that still fails (the disk is still full)."""
        for ino, (version, passthrough) in list(self._unclosed.items()):
            try:
                node = self.table.get(ino)
            except FsError:
                del self._unclosed[ino]  # deleted meanwhile
                continue
            try:
                if node.version != version or node.writers or not node.writing \
                        or node.nlink == 0:
                    del self._unclosed[ino]
                    continue
                try:
                    retrying(self._released, node, True, passthrough)
                except IndexFull:
                    return
                del self._unclosed[ino]
                log.info("the close of inode %d is recorded now", ino)
            finally:
                self.table.maybe_drop(node)

    def _released(self, node: Inode, writable: bool, passthrough: bool = False) -> None:
        with self.table.tx(node):
            if writable and not node.writers and (self.files.has_hole(node.ino) or passthrough):
                # (A passthrough writer may have written sparsely: the daemon saw no offsets.)
                self.files.hole_settled(node.ino, node.size)
            if node.dirty:
                self.table.persist(node)
            if writable and not node.writers:
                node.writing = 0
                self.table.save(node, "writing")
                self._closed(node)

    def _new_version(self, node: Inode) -> None:
        """The file's content is about to change: (ino, version) names one closed content, so a
        new one begins. Sets holding the old content can no longer be published as committed."""
        with self.table.tx(node):
            old = node.version
            node.version += 1
            self.hooks.on_content_change(node.ino, old)
            self.table.save(node, "version", "writing")
            if not node.writing:
                self._closed(node)

    def _closed(self, node: Inode) -> None:
        """A content version is complete (last writer closed, or a truncate without writers)."""
        if node.nlink == 0:
            return
        entry = self.index.dentry_of(node.ino)
        if entry is not None:
            with self.index.tx():
                self.hooks.on_close(node, entry[0], entry[1])

    def statistics(self) -> IoStats:
        s = self.stats
        return IoStats(write_requests=s.writes, bytes_written=s.bytes_written,
                       read_requests=s.reads, bytes_read=s.bytes_read, fsyncs=s.fsyncs)


def _check_truncate(node: Inode, size: int) -> None:
    if node.is_dir:
        raise FsError(errno.EISDIR)
    if not node.is_reg:
        raise FsError(errno.EINVAL, "truncate of a special file")
    if size < 0:
        raise FsError(errno.EINVAL)
    if not node.cached:
        raise FsError(errno.EIO, f"inode {node.ino} is not in the cache (fetch it first)")
