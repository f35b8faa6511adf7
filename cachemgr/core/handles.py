"""Open file handles and the data-path choice for each: served by the daemon or by the kernel
(FUSE passthrough on the cache file).

`Handles` is the one owner of the open handles (`_handles`: fh -> `Handle`, each with its own fd
on the cache file) and of the passthrough policy (`passthrough_open`); `cachemgr.core.passthrough.
Backings` owns the kernel's backing-file registrations it asks for.

Invariants, and what guards them:

  * Every handle counts once in its inode's `opens` (and `writers` when writable) from `add()`
    to `pop()`; its fd is closed exactly once, by whoever pops it (release, or `close_all` at
    unmount). Only the loop thread touches them.
  * A passthrough handle's writes reach the cache file without the daemon: `take_in_writes`
    brings the inode's size and mtime (and the cache accounting) up to date from the file
    before anything answers with or acts on them.

No durable state: handles die with the daemon (the kernel's opens die with the mount).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from cachemgr.core.errors import FsError
from cachemgr.core.filecache import FileCache
from cachemgr.core.hooks import ReadThrough, Room
from cachemgr.core.index import Index
from cachemgr.core.inodes import SETID, Caller, Inode, InodeTable, retrying
from cachemgr.core.passthrough import Backings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Handle:
    fh: int
    inode: Inode
    fd: int
    writable: bool
    append: bool
    opener: Caller | None = None  # None: privileged (set-id bits stay on writes)
    passthrough: bool = False     # the kernel does this handle's I/O on the cache file
    pid: int = 0                  # the opener's pid (0: in-process), for Backings' readers


@dataclass(frozen=True, slots=True)
class OpenResult:
    fh: int
    direct_io: bool
    keep_cache: bool
    backing_id: int = 0  # > 0: open in passthrough on this backing id (cachemgr.core.passthrough)


# Errnos of a passthrough registration that say it cannot work on this mount at all (no
# CAP_SYS_ADMIN, not granted, a stacked cache filesystem...): passthrough goes off for the
# mount. Any other (EMFILE...) refuses this open only.
_PASSTHROUGH_FATAL = frozenset({errno.EPERM, errno.EINVAL, errno.ELOOP, errno.EOPNOTSUPP,
                                errno.ENOTTY, errno.ENOSYS, errno.EACCES})


@dataclass(frozen=True, slots=True)
class HandleStats:
    """`Handles.statistics()`: open handles (`dataclasses.asdict` for JSON)."""

    open_handles: int
    passthrough_handles: int


class Handles:
    """Owner of the open handles and of the passthrough decision for each open."""

    def __init__(self, index: Index, table: InodeTable, files: FileCache, backings: Backings,
                 reads: ReadThrough, room: Room, *, direct_io_writes: bool) -> None:
        self.index = index
        self.table = table
        self.files = files
        self.backings = backings
        self.reads = reads  # a file not yet checked against its CRCs stays with the daemon
        self.room = room    # under --cache-size every write waits for room: the daemon's
        self.direct_io_writes = direct_io_writes
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1

    def __len__(self) -> int:
        return len(self._handles)

    def get(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def find(self, fh: int) -> Handle | None:
        return self._handles.get(fh)

    def hot(self, fh: int) -> Handle:
        """The handle on the read/write path (the kernel only sends handles it was given)."""
        return self._handles[fh]

    def pop(self, fh: int) -> Handle | None:
        return self._handles.pop(fh, None)

    def close_all(self) -> None:
        for h in list(self._handles.values()):
            os.close(h.fd)
        self._handles.clear()
        self.backings.close_all()

    def add(self, node: Inode, fd: int, flags: int, caller: Caller | None) -> OpenResult:
        """The in-memory side of an open (cannot fail: a refused passthrough open is served by
        the daemon)."""
        writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        self.files.used(node.ino)
        fh = self._next_fh
        self._next_fh += 1
        opener = caller if caller is not None and caller.uid != 0 else None
        pid = caller.pid if caller is not None else 0
        h = self._handles[fh] = Handle(fh, node, fd, writable, bool(flags & os.O_APPEND), opener,
                                       pid=pid)
        backing_id = self.passthrough_open(node, writable, opener, pid) if node.is_reg else 0
        node.opens += 1
        if writable:
            node.writers += 1
        if backing_id:
            h.passthrough = True
            # The kernel does this handle's reads, writes and mmap on the cache file; page
            # cache and direct I/O flags do not go with passthrough (fs/fuse/iomode.c).
            return OpenResult(fh, direct_io=False, keep_cache=False, backing_id=backing_id)
        if writable:
            # direct_io on write opens: writes arrive as the caller's buffers (up to 1 MiB per
            # request) and skip the kernel page cache; measured 2-3x faster here than cached
            # writes (docs/ARCHITECTURE.md). The price: shared writable mmap is refused.
            return OpenResult(fh, direct_io=self.direct_io_writes, keep_cache=False)
        # Read-only open: let the kernel keep its page cache only if the data has not changed
        # since the last open that allowed it (gen unchanged and nobody writing); otherwise the
        # kernel drops its cached pages for this file at open.
        keep = node.writers == 0 and node.gen == node.cached_gen
        if node.writers == 0:
            node.cached_gen = node.gen
        return OpenResult(fh, direct_io=False, keep_cache=keep)

    def _daemon_keeps(self, node: Inode, writable: bool, opener: Caller | None) -> bool:
        """Whether an open that could start passthrough must be served by the daemon."""
        if node.opens or not node.cached:
            return True
        if not self.reads.trusted(node.ino):
            return True
        if not writable:
            return False
        return bool((opener is not None and node.mode & SETID)
                    or self.room.limit is not None
                    or (not self.index.reserve_held and self.index.reserve_bytes))

    def passthrough_open(self, node: Inode, writable: bool, opener: Caller | None,
                         pid: int = 0) -> int:
        """The backing id for a passthrough open of `node`, or 0 to serve it in user space.

        Passthrough when the file's data is whole in the cache and nobody has it open (an open
        in page-cache mode would make the kernel refuse it), and from then on for every open
        while a passthrough one is open (the kernel refuses any other). The daemon's own path
        keeps what passthrough cannot do: a file still being restored or not yet checked against
        its CRCs (cachemgr.restore.restorer), writes under --cache-size (every write waits for
        room), writes while the index reserve is released (a full cache disk: the room it freed is
        for the index, `FileOps.before_write`), and writes that must remove set-id bits (the
        kernel would remove them from the cache file, not from the file)."""
        b = self.backings
        ino = node.ino
        if not b.active(ino):
            if not b.on:
                return 0
            if self._daemon_keeps(node, writable, opener):
                b.fallbacks += 1
                return 0
        elif writable and opener is not None and node.mode & SETID:
            # Passthrough is forced (other opens are); the writer's first write would remove
            # the set-id bits, so this open does.
            retrying(self.table.kill_setid_now, node, opener)
        try:
            return b.acquire(ino, self.files.path(ino), writable, pid)
        except OSError as e:
            if e.errno in _PASSTHROUGH_FATAL:
                hint = (" (the cache dir is on a filesystem stacked too deep for passthrough)"
                        if e.errno == errno.ELOOP else "")
                b.turn_off(f"registering a backing file failed: {os.strerror(e.errno)}{hint}")
            else:
                log.warning("passthrough open of inode %d refused (%s); served by the daemon",
                            ino, e)
            return 0  # (never for an inode already active: acquire registers nothing then)

    def take_in_writes(self, node: Inode) -> None:
        """Size and mtime of a file a passthrough writer changed, from its cache file: the
        kernel wrote without telling the daemon. Called before the daemon answers with or acts
        on the file's attributes (getattr, lookup, setattr, flush, fsync, release, status)."""
        st = self.backings.refresh(node.ino)
        if st is None:
            return
        if st.st_size != node.size:
            # Holes are recomputed when the last writer closes (`FileOps.release`).
            self.files.grew(st.st_size - node.size)
            node.size = st.st_size
        # The backing file changed: a write, which sets mtime (the daemon's own changes, a
        # truncate or utimens, take their node fields after taking this in: setattr).
        node.mtime_ns = node.ctime_ns = st.st_mtime_ns
        node.dirty = True
        node.gen += 1

    def statistics(self) -> HandleStats:
        passthrough = sum(1 for h in self._handles.values() if h.passthrough)
        return HandleStats(open_handles=len(self._handles), passthrough_handles=passthrough)
