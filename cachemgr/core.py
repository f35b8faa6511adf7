"""The filesystem core: POSIX semantics over the cache index and the cache files.

`CacheFs` implements every operation the FUSE layer forwards, as plain synchronous methods that
raise `FsError(errno)` on refusal. It has no FUSE dependency, so it is tested in-process as well as
through a real mount. Names are `bytes`, as the kernel gives them.

On-disk layout of a cache directory (version in `layout.json`):

    layout.json        {"format": "ckptfs-cache", "version": 1}
    index.sqlite       the cache index (schema.sql), WAL mode
    index.reserve      room kept for the index's writes on a full disk (cachemgr.index)
    data/<ino>         one cache file per regular file, always exactly the file's logical size

Concurrency contract: all methods run on the single trio thread of the FUSE loop (blocking I/O
inline: measured faster than worker threads here, see docs/ARCHITECTURE.md). The only other
writers of cache files are restore's worker threads, and they write only through
`cachemgr.filecache.FileCache` (`self.files`), under a per-file lock that the FUSE layer takes
before it changes a file's content (a write or truncating open, a truncate); eviction skips a
file whose lock is held. State kept in memory:

  * `_inodes`: `Inode` objects for every inode the kernel knows (lookup count > 0), every open
    inode, and whatever was loaded since. `size`/`mtime_ns` of an inode being written are
    updated here on every write and written to the index at flush/fsync/release (`dirty`).
  * `_handles`: open file handles (fh -> `Handle`), each with its own fd on the cache file.

Memory follows the index: every metadata operation is one index transaction, and its changes
to `Inode` objects, `cached_bytes` and the inode table are made inside `_tx()`, which undoes them
exactly when the transaction rolls back. So a refused operation (a full cache disk: `IndexFull`,
ENOSPC) leaves memory, index and cache files as they were, and can simply run again: when the
index released its reserve to answer the failure (cachemgr.index), `_retry_when_full` does that
once. Cache-file changes that cannot be undone (shrinking a file, deleting a purged inode's data)
happen only after the transaction committed (`Index.after_commit`); those that can (creating a
cache file, growing one) happen inside it and are undone on rollback.

Crash contract (kill -9 of the daemon; the OS page cache survives):

  * Every metadata operation is one committed index transaction: after the crash the tree is
    exactly as of the last completed operation (a truncate whose transaction committed but
    whose cache file was not shrunk yet keeps the old bytes: recover() takes the size from
    the cache file).
  * Data written before the crash is in the cache files (page cache). The index may hold a stale
    size for files written since their last flush; `recover()` sets every regular file's size
    from its cache file, which is kept at exactly the logical size at all times.
  * Inodes unlinked while open (nlink = 0) are deleted by `recover()`, with their cache files.
  * Cache files with no inode (a crash between creating the file and committing the inode) are
    deleted by `recover()`.

Power loss: fsync() syncs the cache file, the data directory (once per new file) and the index
WAL, so every fsync'd file is intact; unsynced data may be lost, as on any local filesystem.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import FsError, IndexFull
from .filecache import FileCache
from .index import INODE_COLUMNS, ROOT_INO, Index
from .nodefiles import DIR_MODE, FILE_MODE, make_dirs, open_private, restrict
from .passthrough import Backings

log = logging.getLogger(__name__)

LAYOUT = {"format": "ckptfs-cache", "version": 1}
NAME_MAX = 255
SYMLINK_MAX = 4095
XATTR_VALUE_MAX = 64 * 1024
RENAME_NOREPLACE = 1  # linux/fs.h
RENAME_EXCHANGE = 2
READDIR_BATCH = 256  # entries fetched from the index per readdir round trip

_MUTABLE = ("mode", "uid", "gid", "size", "atime_ns", "mtime_ns", "ctime_ns", "nlink")


@dataclass(slots=True)
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    nlink: int
    rdev: int
    target: bytes | None
    version: int = 0          # content version: bumped by every write-open and truncate
    writing: int = 0          # persisted "open for writing" flag (see schema.sql)
    cached: int = 1           # 1: data in the cache file; 0: evicted, lives in the store
    lookups: int = 0          # kernel lookup count (lookup/create/mkdir/... minus forget)
    opens: int = 0            # open handles
    writers: int = 0          # open handles with write access
    dirty: bool = False       # size/mtime changed in memory, not yet in the index
    gen: int = 0              # bumped on every data change; decides keep_cache
    cached_gen: int = -1      # gen when the kernel was last allowed to keep its page cache
    new_file: bool = False    # cache file created since the data dir was last fsync'd

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


# Every field of an Inode: what `CacheFs._tx` saves and restores.
_INODE_FIELDS = Inode.__slots__
_SETID = stat.S_ISUID | stat.S_ISGID


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks for an operation (the FUSE request's context): decides which set-id bits a
    change of a file's data removes."""
    uid: int
    gid: int
    pid: int = 0


@dataclass(slots=True)
class Handle:
    fh: int
    inode: Inode
    fd: int
    writable: bool
    append: bool
    opener: Caller | None = None  # None: privileged (set-id bits stay on writes)
    passthrough: bool = False     # the kernel does this handle's I/O on the cache file


@dataclass(frozen=True, slots=True)
class OpenResult:
    fh: int
    direct_io: bool
    keep_cache: bool
    backing_id: int = 0  # > 0: open in passthrough on this backing id (cachemgr.passthrough)


@dataclass(slots=True)
class CoreStats:
    writes: int = 0
    bytes_written: int = 0
    reads: int = 0
    bytes_read: int = 0
    fsyncs: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    evictions: int = 0        # cached files whose data was dropped (it is in the store)
    evicted_bytes: int = 0    # their cache bytes freed


def _now() -> int:
    return time.time_ns()


def _retry_when_full(method):
    """Run an operation once more when its index transaction failed on a full cache disk and
    the index released its reserve to make room (`IndexFull.released`, cachemgr.index). The
    failed run changed nothing (its transaction rolled back and `CacheFs._tx` undid its
    in-memory changes), and the second one has the reserve's room for its index writes."""

    @functools.wraps(method)
    def wrapper(self, *args, **kw):
        try:
            return method(self, *args, **kw)
        except IndexFull as e:
            if not e.released:
                raise
        return method(self, *args, **kw)

    return wrapper


def _in_group(caller: Caller, gid: int) -> bool:
    """Whether `caller` is in group `gid` (its fsgid or a supplementary group), as the kernel's
    in_group_p. The supplementary groups come from /proc; an exited caller counts as not in it
    (which removes the bit: the safe side)."""
    if caller.gid == gid:
        return True
    try:
        with open(f"/proc/{caller.pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return str(gid) in line.split()[1:]
    except OSError:
        pass
    return False


class CacheFs:
    """POSIX filesystem semantics over one cache directory."""

    def __init__(self, cache_dir: Path, index: Index, *, direct_io_writes: bool = True,
                 backings: Backings | None = None) -> None:
        self.cache_dir = cache_dir
        self.data_dir = cache_dir / "data"
        self.index = index
        self.direct_io_writes = direct_io_writes
        self._inodes: dict[int, Inode] = {}
        self._handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._xattr_inos = index.xattr_inos()
        self.stats = CoreStats()
        # The owner of cache-file writes made off the event loop (restore) and of the
        # per-file locks the FUSE layer takes before changing content (cachemgr.filecache).
        self.files = FileCache(str(self.data_dir))
        # FUSE passthrough: the backing files the kernel does I/O on, and the data-path mode.
        self.backings = backings if backings is not None else Backings(off_reason="not asked")
        # Tiering hooks (cachemgr.tiering.Tiering) or None for a purely local cache.
        self.tiering = None
        # Bytes of file data held in cache files (evicted files excluded): what --cache-size
        # limits. Kept up to date by every size change.
        self.cached_bytes = index.cached_bytes()
        # Bytes of a cached file's length that are a hole the file was grown over (truncate
        # up), by ino: --cache-size counts the blocks a file holds, not its length, so
        # `truncate -s 100T` costs nothing. cached_bytes = sum over cached files of
        # (size - hole). Recomputed from st_blocks at recovery and whenever the last writer of
        # a file with a hole closes it; changed with cached_bytes inside `_tx`.
        self._holes: dict[int, int] = {}
        self._last_used: dict[int, float] = {}
        # Unlinked, unused inodes whose purge failed on a full cache disk: purged at a later
        # drop, at close() or by recover() at the next mount.
        self._purge_pending: set[int] = set()
        # Set by the FUSE layer: tell the kernel to forget a directory entry changed behind its
        # back (sets restored from the store).
        self.invalidate_entry = lambda parent, name: None

    # ------------------------------------------------------------------------------------------
    # lifecycle

    @classmethod
    def load(cls, cache_dir: Path, *, direct_io_writes: bool = True,
             backings: Backings | None = None) -> CacheFs:
        """Open (creating if needed) the cache in `cache_dir` and run crash recovery."""
        make_dirs(cache_dir)  # 0700 if made here (cachemgr.nodefiles)
        layout_path = cache_dir / "layout.json"
        if layout_path.exists():
            try:
                layout = json.loads(layout_path.read_text())
            except ValueError as e:
                raise FsError(errno.EIO, f"{layout_path} is not valid JSON: {e}") from None
            if layout != LAYOUT:
                raise FsError(
                    errno.EIO,
                    f"{cache_dir} holds cache layout {layout}, this ckptfs uses {LAYOUT}",
                )
        else:
            # Files but no layout.json: not a cache. Adopting it would let recover() delete
            # every file in its data/ as stray (`ckptfs mount` refuses such a directory first,
            # with a message; this guards every other caller). lost+found: a fresh filesystem.
            if any(e.name != "lost+found" for e in os.scandir(cache_dir)):
                raise FsError(errno.ENOTEMPTY, f"{cache_dir} is not empty and is not a ckptfs "
                              "cache (no layout.json)")
            tmp = layout_path.with_suffix(".tmp")
            fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(LAYOUT) + "\n")
            os.replace(tmp, layout_path)
        # Private whatever made them (an older ckptfs made 0644/0755): data/ at 0700 keeps
        # every cache file in it out of other users' reach, however old the file.
        restrict(layout_path, FILE_MODE)
        make_dirs(cache_dir / "data")
        restrict(cache_dir / "data", DIR_MODE)
        index = Index.open(cache_dir / "index.sqlite", uid=os.getuid(), gid=os.getgid())
        fs = cls(cache_dir, index, direct_io_writes=direct_io_writes, backings=backings)
        fs.recover()
        return fs

    def recover(self) -> dict[str, int]:
        """Bring index and cache files into agreement after a crash (idempotent; cheap when
        there was no crash: one stat per regular file)."""
        report = {"orphans": 0, "resized": 0, "stray_files": 0, "missing_files": 0}
        with self.index.tx():
            for ino in self.index.orphan_inodes():
                self._unlink_data(ino)
                self.index.delete_inode(ino)
                report["orphans"] += 1
            evicted = self.index.evicted_files()
            for ino, size in self.index.regular_files():
                if ino in evicted:
                    continue  # its data is in the store; the cache file is empty on purpose
                try:
                    st = os.stat(self._data_path(ino))
                    actual = st.st_size
                    self._note_hole(ino, st)
                except FileNotFoundError:
                    # Only possible if the cache dir was tampered with: recreate it empty so the
                    # file is readable (its lost bytes cannot be invented).
                    log.error("cache file for inode %d is missing; the file is now empty", ino)
                    self._make_data_file(ino)
                    actual = 0
                    report["missing_files"] += 1
                if actual != size:
                    self.index.update_inode(ino, size=actual)
                    report["resized"] += 1
            # cached_bytes was summed from the index's sizes: the holes do not count.
            self.cached_bytes -= sum(self._holes.values())
            known = self.index.all_inos()
            for entry in os.scandir(self.data_dir):
                name = entry.name
                if not name.isdigit() or int(name) not in known:
                    os.unlink(entry.path)
                    report["stray_files"] += 1
        if any(report.values()):
            log.info("recovery: %s", report)
        return report

    def close(self) -> None:
        """Persist everything and release the index. Called after the kernel unmounted, so every
        lookup count is implicitly zero and unlinked inodes can go."""
        for h in list(self._handles.values()):
            os.close(h.fd)
        self._handles.clear()
        self.backings.close_all()
        self._retrying(self._persist_all)
        self.index.sync()
        self.index.close()

    def _persist_all(self) -> None:
        with self._tx():
            for node in list(self._inodes.values()):
                self._persist(node)
                if node.nlink == 0:
                    self._purge(node)

    # ------------------------------------------------------------------------------------------
    # helpers

    @contextlib.contextmanager
    def _tx(self, *nodes: Inode) -> Iterator[None]:
        """An index transaction (or a part of the enclosing one) tied to memory: every field of
        `nodes` and `cached_bytes`, as they are now, come back exactly when the transaction
        rolls back. Every in-memory change an operation makes happens inside one, on nodes it
        names: memory never shows a change the index does not have."""
        with self.index.tx():
            saved = [(n, [getattr(n, f) for f in _INODE_FIELDS]) for n in nodes]
            cached = self.cached_bytes
            holes = [(n.ino, self._holes.get(n.ino)) for n in nodes]

            def undo() -> None:
                for n, values in saved:
                    for f, v in zip(_INODE_FIELDS, values):
                        setattr(n, f, v)
                self.cached_bytes = cached
                for ino, h in holes:
                    if h is None:
                        self._holes.pop(ino, None)
                    else:
                        self._holes[ino] = h

            self.index.on_rollback(undo)
            yield

    transaction = _tx  # for the services that change the tree without the kernel (remote)

    @staticmethod
    def _retrying(fn, *args):
        """`fn(*args)`, once more if it failed on a full disk and the reserve made room (see
        `_retry_when_full`)."""
        try:
            return fn(*args)
        except IndexFull as e:
            if not e.released:
                raise
        return fn(*args)

    def _data_path(self, ino: int) -> str:
        return f"{self.data_dir}/{ino}"

    data_path = _data_path

    def _make_data_file(self, ino: int) -> None:
        os.close(open_private(self._data_path(ino), os.O_WRONLY | os.O_TRUNC))

    def _unlink_data(self, ino: int) -> None:
        try:
            os.unlink(self._data_path(ino))
        except FileNotFoundError:
            pass

    def inode_if_loaded(self, ino: int) -> Inode | None:
        """The in-memory inode if the table holds it (open, known to the kernel, or loaded
        since), without reading the index: what tiering asks about files being written."""
        return self._inodes.get(ino)

    def inode(self, ino: int) -> Inode:
        node = self._inodes.get(ino)
        if node is not None:
            return node
        row = self.index.get_inode(ino)
        if row is None:
            raise FsError(errno.ENOENT, f"no inode {ino}")
        node = Inode(*row)
        if node.target is not None:
            node.target = bytes(node.target)
        self._inodes[ino] = node
        return node

    def _dir(self, ino: int) -> Inode:
        node = self.inode(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def _child(self, parent: int, name: bytes) -> Inode:
        ino = self.index.lookup(parent, name)
        if ino is None:
            raise FsError(errno.ENOENT)
        return self.inode(ino)

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
        if not name or b"/" in name or name in (b".", b".."):
            raise FsError(errno.EINVAL, f"invalid name {name!r}")

    def _save(self, node: Inode, *names: str) -> None:
        self.index.update_inode(node.ino, **{n: getattr(node, n) for n in names})

    def _persist(self, node: Inode) -> None:
        if node.dirty:
            self._save(node, "size", "mtime_ns", "ctime_ns")
            node.dirty = False

    # A file counts as having a hole only when its blocks cover less than its length by more
    # than this: block rounding and filesystem preallocation stay out of the accounting.
    _HOLE_MIN = 1 << 20

    def _note_hole(self, ino: int, st: os.stat_result, size: int | None = None) -> None:
        """Record the hole of cache file `ino` from its stat (the caller adjusts
        cached_bytes)."""
        length = st.st_size if size is None else size
        hole = length - st.st_blocks * 512
        if hole > self._HOLE_MIN:
            self._holes[ino] = hole
        else:
            self._holes.pop(ino, None)

    def _freed(self) -> None:
        """Cached bytes went down: writers waiting for room under --cache-size look again
        (every decrease calls this, so no wakeup is lost)."""
        if self.tiering is not None:
            self.tiering.on_space_freed()

    def _touch_dir(self, d: Inode, now: int) -> None:
        d.mtime_ns = d.ctime_ns = now
        self._save(d, "mtime_ns", "ctime_ns", "nlink")

    def _maybe_drop(self, node: Inode) -> None:
        """Forget the in-memory inode, or delete it for good if it is unlinked and unused.
        Never raises IndexFull: the operation that got here is complete, and what is left to
        write waits in memory (a dirty size until the next persist, an unlinked inode until a
        later drop, close() or the next mount's recover())."""
        if node.lookups > 0 or node.opens > 0:
            return
        if not self._drop(node):
            return
        for ino in list(self._purge_pending):
            pending = self._inodes.get(ino)
            if pending is None or pending.lookups or pending.opens:
                self._purge_pending.discard(ino)  # purged, or dropped at its own last use
            elif not self._drop(pending):
                break

    def _drop(self, node: Inode) -> bool:
        try:
            if node.nlink == 0:
                self._retrying(self._purge_now, node)
            elif node.dirty:
                self._retrying(self._persist_now, node)
        except IndexFull as e:
            if node.nlink == 0:
                self._purge_pending.add(node.ino)
            log.warning("inode %d stays in memory: %s", node.ino, e)
            return False
        self._inodes.pop(node.ino, None)
        return True

    def _purge_now(self, node: Inode) -> None:
        with self._tx(node):
            self._purge(node)

    def _persist_now(self, node: Inode) -> None:
        with self._tx(node):
            self._persist(node)

    def _purge(self, node: Inode) -> None:
        """Delete an unlinked, unused inode (inside a transaction): its row now, its cache file
        once the transaction committed (deleted data cannot be undone; a crash in between leaves
        a cache file without inode, which recover() deletes). Tiering hears of the purge only
        then too: what it forgets (a partly restored file's chunks and their count in
        cached_bytes) is not brought back if the transaction rolls back (a restored set
        replaced from the store, whose apply failed half-way: cachemgr.remote)."""
        if node.is_reg and node.cached:
            self.cached_bytes -= node.size - self._holes.pop(node.ino, 0)
            self._freed()
        self.index.delete_inode(node.ino)
        ino, is_reg = node.ino, node.is_reg

        def gone() -> None:
            if self.tiering is not None:
                self.tiering.on_purge(ino)
            if is_reg:
                self._unlink_data(ino)
                self._last_used.pop(ino, None)
            self._xattr_inos.discard(ino)
            self._inodes.pop(ino, None)
            self._purge_pending.discard(ino)

        self.index.after_commit(gone)

    def _new_inode(self, parent: Inode, name: bytes, mode: int, uid: int, gid: int, *,
                   target: bytes | None = None) -> Inode:
        self._check_name(name)
        if self.index.lookup(parent.ino, name) is not None:
            raise FsError(errno.EEXIST)
        now = _now()
        is_dir = stat.S_ISDIR(mode)
        with self._tx(parent):
            ino = self.index.insert_inode(
                mode=mode, uid=uid, gid=gid, now=now, nlink=2 if is_dir else 1,
                size=len(target) if target is not None else 0, target=target,
            )
            if stat.S_ISREG(mode):
                # Create the cache file inside the transaction: a crash before COMMIT leaves a
                # stray file (deleted by recover()), never an inode without its cache file.
                self._make_data_file(ino)
                self.index.on_rollback(lambda: self._unlink_data(ino))
            self.index.add_dentry(parent.ino, name, ino)
            if is_dir:
                parent.nlink += 1
            self._touch_dir(parent, now)
            node = self.inode(ino)
            # Loaded from the uncommitted row: gone again if the transaction rolls back.
            self.index.on_rollback(lambda: self._inodes.pop(ino, None))
            node.new_file = stat.S_ISREG(mode)
            node.lookups += 1
        return node

    def _is_ancestor(self, maybe_ancestor: int, ino: int) -> bool:
        """True if directory `maybe_ancestor` is `ino` or contains it."""
        cur: int | None = ino
        while cur is not None and cur != ROOT_INO:
            if cur == maybe_ancestor:
                return True
            cur = self.index.parent_of(cur)
        return maybe_ancestor == ROOT_INO

    # ------------------------------------------------------------------------------------------
    # namespace

    def lookup(self, parent: int, name: bytes) -> Inode:
        """Resolve `name` in `parent` and take one kernel reference on the result."""
        d = self._dir(parent)
        if name == b".":
            node = d
        elif name == b"..":
            node = self.inode(self.index.parent_of(parent) or ROOT_INO)
        else:
            if len(name) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG)
            node = self._child(parent, name)
        node.lookups += 1
        return node

    def forget(self, ino: int, nlookup: int) -> None:
        node = self._inodes.get(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - nlookup)
        self._maybe_drop(node)

    def getattr(self, ino: int) -> Inode:
        return self.inode(ino)

    @_retry_when_full
    def setattr(self, ino: int, *, size: int | None = None, mode: int | None = None,
                uid: int | None = None, gid: int | None = None, atime_ns: int | None = None,
                mtime_ns: int | None = None, fh: int | None = None,
                caller: Caller | None = None) -> Inode:
        node = self.inode(ino)
        self.take_in_writes(node)
        if size is not None:
            if node.is_dir:
                raise FsError(errno.EISDIR)
            if not node.is_reg:
                raise FsError(errno.EINVAL, "truncate of a special file")
            if size < 0:
                raise FsError(errno.EINVAL)
            if not node.cached:
                raise FsError(errno.EIO, f"inode {node.ino} is not in the cache (fetch it first)")
        now = _now()
        changed: list[str] = ["ctime_ns"]
        with self._tx(node):
            if size is not None:
                self._truncate(node, size, fh)
                node.mtime_ns = now
                changed += ["size", "mtime_ns"]
            if mode is not None:
                node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(mode)
                changed.append("mode")
            if size is not None and self._kill_setid(node, caller):
                changed.append("mode")  # after an explicit mode: the kernel's own kill is in it
            if uid is not None:
                node.uid = uid
                changed.append("uid")
            if gid is not None:
                node.gid = gid
                changed.append("gid")
            if atime_ns is not None:
                node.atime_ns = atime_ns
                changed.append("atime_ns")
            if mtime_ns is not None:
                node.mtime_ns = mtime_ns
                changed.append("mtime_ns")
            node.ctime_ns = now
            self._save(node, *changed)
            if node.dirty:
                self._persist(node)
        return node

    def _truncate(self, node: Inode, size: int, fh: int | None) -> None:
        """Resize a regular file, inside the caller's `_tx(node)`."""
        h = self._handles.get(fh) if fh is not None else None
        target: int | str = h.fd if h is not None else self._data_path(node.ino)
        old = node.size
        hole = self._holes.get(node.ino, 0)
        if size > old:
            new_hole = hole + size - old  # a hole: no block is written
        else:
            new_hole = max(0, min(hole - (old - size), size))  # the hole goes first (at the end)
        self.cached_bytes += (size - new_hole) - (old - hole)
        if new_hole:
            self._holes[node.ino] = new_hole
        else:
            self._holes.pop(node.ino, None)
        if size < old:
            self._freed()
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

    def _kill_setid(self, node: Inode, caller: Caller | None) -> bool:
        """A change of `node`'s data by `caller` (a write, a truncate, a truncating open):
        remove the set-id bits Linux removes on its local filesystems (fs/attr.c
        setattr_should_drop_suidgid, via file_remove_privs on write and do_truncate): S_ISUID;
        S_ISGID if group-execute is set or the caller is not in the file's group (a setgid file
        without group-execute is otherwise left alone). Not for a caller with CAP_FSETID,
        taken to be uid 0. Inside the caller's `_tx(node)`; True if the mode changed (the
        caller saves it)."""
        mode = node.mode
        if caller is None or caller.uid == 0 or not mode & _SETID or not stat.S_ISREG(mode):
            return False
        kill = mode & stat.S_ISUID
        if mode & stat.S_ISGID and (mode & stat.S_IXGRP or not _in_group(caller, node.gid)):
            kill |= stat.S_ISGID
        if not kill:
            return False
        node.mode = mode & ~kill
        node.ctime_ns = _now()
        return True

    @_retry_when_full
    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        d = self._dir(parent)
        return self._new_inode(d, name, stat.S_IFDIR | stat.S_IMODE(mode), uid, gid)

    @_retry_when_full
    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        d = self._dir(parent)
        if len(target) > SYMLINK_MAX:
            raise FsError(errno.ENAMETOOLONG, f"symlink target longer than {SYMLINK_MAX} bytes")
        with self._tx():  # the symlink and the commit it may trigger: one transaction
            node = self._new_inode(d, name, stat.S_IFLNK | 0o777, uid, gid, target=target)
            if self.tiering is not None:
                self.tiering.on_symlink(node, parent, name)
        return node

    def readlink(self, ino: int) -> bytes:
        node = self.inode(ino)
        if not stat.S_ISLNK(node.mode):
            raise FsError(errno.EINVAL, "not a symlink")
        assert node.target is not None
        return node.target

    @_retry_when_full
    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        if not stat.S_ISREG(mode):
            # Checkpoint directories hold regular files, directories and symlinks only.
            raise FsError(errno.EPERM, "only regular files, directories and symlinks")
        d = self._dir(parent)
        return self._new_inode(d, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        # EPERM is what link(2) returns when "the filesystem does not support the creation of
        # hard links". Hard links would make a file belong to two shard sets at once.
        raise FsError(errno.EPERM, "hard links are not supported")

    @_retry_when_full
    def unlink(self, parent: int, name: bytes) -> None:
        d = self._dir(parent)
        node = self._child(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        now = _now()
        path = self.index.path_of(node.ino) if self.tiering is not None else None
        with self._tx(node, d):
            self.index.remove_dentry(parent, name)
            node.nlink -= 1
            node.ctime_ns = now
            self._save(node, "nlink", "ctime_ns")
            self._touch_dir(d, now)
            if path is not None:
                self.tiering.on_remove(node, path)
        self._maybe_drop(node)

    @_retry_when_full
    def rmdir(self, parent: int, name: bytes) -> None:
        d = self._dir(parent)
        node = self._child(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if self.index.has_children(node.ino):
            raise FsError(errno.ENOTEMPTY)
        now = _now()
        path = self.index.path_of(node.ino) if self.tiering is not None else None
        with self._tx(node, d):
            self.index.remove_dentry(parent, name)
            node.nlink = 0
            self._save(node, "nlink")
            d.nlink -= 1
            self._touch_dir(d, now)
            if path is not None:
                self.tiering.on_remove(node, path)
        self._maybe_drop(node)

    @_retry_when_full
    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (
            RENAME_NOREPLACE | RENAME_EXCHANGE
        ):
            raise FsError(errno.EINVAL, f"unsupported rename flags {flags:#x}")
        od = self._dir(old_parent)
        nd = self._dir(new_parent)
        self._check_name(new_name)
        src = self._child(old_parent, old_name)
        dst_ino = self.index.lookup(new_parent, new_name)
        dst = self.inode(dst_ino) if dst_ino is not None else None
        if flags & RENAME_EXCHANGE:
            if dst is None:
                raise FsError(errno.ENOENT)
            return self._exchange(od, old_name, src, nd, new_name, dst)
        if dst is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if dst.ino == src.ino:
                return  # POSIX: same file, do nothing
        if src.is_dir and new_parent != old_parent and self._is_ancestor(src.ino, new_parent):
            raise FsError(errno.EINVAL, "cannot move a directory into itself")
        if dst is not None:
            if src.is_dir and not dst.is_dir:
                raise FsError(errno.ENOTDIR)
            if not src.is_dir and dst.is_dir:
                raise FsError(errno.EISDIR)
            if dst.is_dir and self.index.has_children(dst.ino):
                raise FsError(errno.ENOTEMPTY)
        now = _now()
        old_path = self.index.path_of(src.ino) if self.tiering is not None else None
        with self._tx(src, od, nd, *([dst] if dst is not None else [])):
            if dst is not None:
                # The target entry keeps its row (its id = readdir position) and now names
                # src: a listing under way sees the replaced name exactly once.
                self.index.set_dentry_ino(new_parent, new_name, src.ino)
                self.index.remove_dentry(old_parent, old_name)
                if dst.is_dir:
                    dst.nlink = 0
                    nd.nlink -= 1
                else:
                    dst.nlink -= 1
                dst.ctime_ns = now
                self._save(dst, "nlink", "ctime_ns")
            else:
                self.index.move_dentry(old_parent, old_name, new_parent, new_name)
            if src.is_dir and old_parent != new_parent:
                od.nlink -= 1
                nd.nlink += 1
            src.ctime_ns = now
            self._save(src, "ctime_ns")
            self._touch_dir(od, now)
            if nd is not od:
                self._touch_dir(nd, now)
            if old_path is not None:
                # Inside the rename's transaction: the commit it triggers (if any) is durable
                # exactly when the rename is.
                self.tiering.on_rename(src, dst, old_parent, old_name, new_parent, new_name,
                                       old_path)
        if dst is not None:
            self._maybe_drop(dst)

    def _exchange(self, od: Inode, old_name: bytes, a: Inode, nd: Inode, new_name: bytes,
                  b: Inode) -> None:
        if od is not nd:
            for moving, into in ((a, nd), (b, od)):
                if moving.is_dir and self._is_ancestor(moving.ino, into.ino):
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
        now = _now()
        with self._tx(a, b, od, nd):
            self.index.set_dentry_ino(od.ino, old_name, b.ino)
            self.index.set_dentry_ino(nd.ino, new_name, a.ino)
            if od is not nd and a.is_dir != b.is_dir:
                delta = 1 if a.is_dir else -1  # a moves into nd, b into od
                nd.nlink += delta
                od.nlink -= delta
            for n in (a, b):
                n.ctime_ns = now
                self._save(n, "ctime_ns")
            self._touch_dir(od, now)
            if nd is not od:
                self._touch_dir(nd, now)

    # ------------------------------------------------------------------------------------------
    # directories

    def opendir(self, ino: int) -> int:
        self._dir(ino)
        return ino

    def readdir(self, ino: int, start_id: int):
        """Yield (next_id, name, inode) for entries after `start_id`, in `id` order. The caller
        takes a lookup reference (`ref()`) for each entry it actually hands to the kernel."""
        after = start_id
        while True:
            rows = self.index.list_dentries(ino, after, READDIR_BATCH)
            if not rows:
                return
            for dent_id, name, child in rows:
                yield dent_id, bytes(name), self.inode(child)
                after = dent_id

    def ref(self, node: Inode) -> None:
        node.lookups += 1

    @_retry_when_full
    def fsyncdir(self, ino: int) -> None:
        self.index.sync()

    # ------------------------------------------------------------------------------------------
    # files

    @_retry_when_full
    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
               gid: int, caller: Caller | None = None) -> tuple[OpenResult, Inode]:
        d = self._dir(parent)
        fd = None
        try:
            with self._tx():  # the new inode and its open: one transaction
                node = self._new_inode(d, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid)
                fd = self._open_data(node, flags, caller)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return self._add_handle(node, fd, flags, caller), node

    @_retry_when_full
    def open(self, ino: int, flags: int, caller: Caller | None = None) -> OpenResult:
        """Open a regular file. `caller` (None: privileged) decides which set-id bits its
        writes and a truncating open remove (`_kill_setid`)."""
        node = self.inode(ino)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        if not node.is_reg:
            raise FsError(errno.EINVAL, "not a regular file")
        fd = self._open_data(node, flags, caller)
        return self._add_handle(node, fd, flags, caller)

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
            # The FUSE layer fetches the data before a write open; reaching here is a bug.
            # (Read-only opens are fine: each read waits for its own range, see
            # cachemgr.restore.)
            raise FsError(errno.EIO, f"inode {node.ino} is not in the cache (fetch it first)")
        fd = os.open(self._data_path(node.ino), os.O_RDWR)
        if not trunc and not (writable and not node.writers):
            return fd  # nothing for the index (a read-only open, or another writer's)
        try:
            with self._tx(node):
                # An unprivileged O_TRUNC removes set-id bits even on an empty file, as
                # do_truncate does (the kernel leaves that to us with atomic_o_trunc).
                if trunc and self._kill_setid(node, caller):
                    self._save(node, "mode", "ctime_ns")
                if trunc and (node.size or not node.cached):
                    now = _now()
                    if node.cached:
                        self.cached_bytes -= node.size - self._holes.pop(node.ino, 0)
                        self._freed()
                    node.size = 0
                    node.cached = 1
                    node.gen += 1
                    node.mtime_ns = node.ctime_ns = now
                    self._save(node, "size", "mtime_ns", "ctime_ns", "cached")
                    # Shrinking loses bytes: only once the transaction committed.
                    self.index.after_commit(lambda: os.ftruncate(fd, 0))
                    if not writable and not node.writers:
                        self._new_version(node)  # as a truncate without writers (_truncate)
                if writable and not node.writers:
                    # The first writer starts a new content version: the unit of upload and
                    # commit.
                    node.writing = 1
                    self._new_version(node)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _add_handle(self, node: Inode, fd: int, flags: int, caller: Caller | None) -> OpenResult:
        """The in-memory side of an open (cannot fail: a refused passthrough open is served by
        the daemon)."""
        writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        self._last_used[node.ino] = time.monotonic()
        fh = self._next_fh
        self._next_fh += 1
        opener = caller if caller is not None and caller.uid != 0 else None
        h = self._handles[fh] = Handle(fh, node, fd, writable, bool(flags & os.O_APPEND), opener)
        backing_id = self._passthrough_open(node, writable, opener) if node.is_reg else 0
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

    # Errnos of a passthrough registration that say it cannot work on this mount at all (no
    # CAP_SYS_ADMIN, not granted, a stacked cache filesystem...): passthrough goes off for the
    # mount. Any other (EMFILE...) refuses this open only.
    _PASSTHROUGH_FATAL = frozenset({errno.EPERM, errno.EINVAL, errno.ELOOP, errno.EOPNOTSUPP,
                                    errno.ENOTTY, errno.ENOSYS, errno.EACCES})

    def _passthrough_open(self, node: Inode, writable: bool, opener: Caller | None) -> int:
        """The backing id for a passthrough open of `node`, or 0 to serve it in user space.

        Passthrough when the file's data is whole in the cache and nobody has it open (an open
        in page-cache mode would make the kernel refuse it), and from then on for every open
        while a passthrough one is open (the kernel refuses any other). The daemon's own path
        keeps what passthrough cannot do: a file still being restored or not yet checked against
        its CRCs (cachemgr.restore), writes under --cache-size (every write waits for room),
        writes while the index reserve is released (a full cache disk: the room it freed is
        for the index, `before_write`), and writes that must remove set-id bits (the kernel
        would remove them from the cache file, not from the file)."""
        b = self.backings
        ino = node.ino
        if not b.active(ino):
            if not b.on:
                return 0
            t = self.tiering
            if (node.opens or not node.cached
                    or t is not None and not t.restorer.trusted(ino)
                    or writable and (opener is not None and node.mode & _SETID
                                     or t is not None and t.cfg.cache_size is not None
                                     or not self.index.reserve_held
                                     and self.index.reserve_bytes)):
                b.fallbacks += 1
                return 0
        elif writable and opener is not None and node.mode & _SETID:
            # Passthrough is forced (other opens are); the writer's first write would remove
            # the set-id bits, so this open does.
            self._retrying(self._kill_setid_now, node, opener)
        try:
            return b.acquire(ino, self._data_path(ino), writable)
        except OSError as e:
            if e.errno in self._PASSTHROUGH_FATAL:
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
            # Holes are recomputed when the last writer closes (`_released`).
            self.cached_bytes += st.st_size - node.size
            if st.st_size < node.size:
                self._freed()
            node.size = st.st_size
        # The backing file changed: a write, which sets mtime (the daemon's own changes, a
        # truncate or utimens, take their node fields after taking this in: setattr).
        node.mtime_ns = node.ctime_ns = st.st_mtime_ns
        node.dirty = True
        node.gen += 1

    def _handle(self, fh: int) -> Handle:
        h = self._handles.get(fh)
        if h is None:
            raise FsError(errno.EBADF)
        return h

    def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handles[fh]
        data = os.pread(h.fd, size, off)
        st = self.stats
        st.reads += 1
        st.bytes_read += len(data)
        return data

    def write(self, fh: int, off: int, buf: bytes) -> int:
        # Hot path: one pwrite, then in-memory size/mtime; the index is updated at flush/release.
        h = self._handles[fh]
        if (h.opener is not None and h.inode.mode & _SETID) or not self.index.reserve_held:
            self.before_write(h, len(buf))
        if h.append:
            off = h.inode.size
        n = os.pwrite(h.fd, buf, off)
        self.wrote(h, off, n)
        return n

    def io_handle(self, fh: int) -> Handle:
        """For callers that do the pread/pwrite themselves (in a worker thread): the handle,
        then `wrote()` back on the loop thread."""
        return self._handle(fh)

    def before_write(self, h: Handle, n: int) -> None:
        """Before `n` bytes are written through `h`:

        * While the index reserve is released (the cache disk was full, cachemgr.index), file
          data does not take the room that freed: it is for the index writes of the deletes
          that make room. ENOSPC unless the disk has the reserve's size free besides `n`.
        * An unprivileged opener's write removes set-id bits (file_remove_privs). With direct
          I/O the kernel leaves that to the filesystem (FUSE_WRITE_KILL_SUIDGID, which pyfuse3
          does not pass on), so it is decided here from the opener's credentials; through the
          page cache the kernel already did it.
        """
        index = self.index
        if not index.reserve_held and index.reserve_bytes:
            st = os.statvfs(self.cache_dir)
            if st.f_bavail * st.f_frsize < index.reserve_bytes + n:
                raise FsError(errno.ENOSPC, "cache disk full (what is left is kept for the"
                              " index: delete files to make room)")
        if h.opener is not None and h.inode.mode & _SETID:
            self._retrying(self._kill_setid_now, h.inode, h.opener)

    def _kill_setid_now(self, node: Inode, caller: Caller) -> None:
        with self._tx(node):
            if self._kill_setid(node, caller):
                self._save(node, "mode", "ctime_ns")

    def wrote(self, h: Handle, off: int, n: int) -> None:
        node = h.inode
        end = off + n
        if end > node.size:
            self.cached_bytes += end - node.size
            node.size = end
        node.mtime_ns = node.ctime_ns = time.time_ns()
        node.dirty = True
        node.gen += 1
        st = self.stats
        st.writes += 1
        st.bytes_written += n

    def flush(self, fh: int) -> None:
        """close() of a handle. The last writer of a file in an open set has its directory's
        part record updated in the background (cachemgr.parts); close() never waits for the
        store."""
        h = self._handle(fh)
        if h.passthrough:
            self.take_in_writes(h.inode)
        if h.inode.dirty:
            self._retrying(self._persist_now, h.inode)
        if self.tiering is not None and h.writable:
            self.tiering.announce_dir(h.inode)

    @_retry_when_full
    def fsync(self, fh: int, datasync: bool) -> None:
        h = self._handle(fh)
        node = h.inode
        self.take_in_writes(node)
        if datasync:
            os.fdatasync(h.fd)
        else:
            os.fsync(h.fd)
        if node.new_file:
            dfd = os.open(self.data_dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            node.new_file = False
        with self._tx(node):
            self._persist(node)
        self.index.sync()
        self.stats.fsyncs += 1

    def release(self, fh: int) -> None:
        """The last close of a handle. The handle goes whatever happens (the kernel does not
        retry a release); if its index transaction fails (a full cache disk even after the
        reserve), the file's size stays dirty in memory and its content is not closed: it is
        uploaded after its next write-open and close."""
        h = self._handles.pop(fh, None)
        if h is None:
            return
        node = h.inode
        if h.passthrough:
            try:
                self.take_in_writes(node)  # what the kernel wrote through this handle
            finally:
                self.backings.release(node.ino, h.writable)
        os.close(h.fd)
        node.opens -= 1
        if h.writable:
            node.writers -= 1
        try:
            self._retrying(self._released, node, h.writable, h.passthrough)
        finally:
            self._maybe_drop(node)

    def _released(self, node: Inode, writable: bool, passthrough: bool = False) -> None:
        with self._tx(node):
            if writable and not node.writers and (node.ino in self._holes or passthrough):
                # (A passthrough writer may have written sparsely: the daemon saw no offsets.)
                # Bytes written into the hole count from now on: take it from the blocks.
                old_hole = self._holes.pop(node.ino, 0)
                try:
                    self._note_hole(node.ino, os.stat(self._data_path(node.ino)),
                                    size=node.size)
                except OSError:
                    self._holes[node.ino] = old_hole
                self.cached_bytes += old_hole - self._holes.get(node.ino, 0)
            if node.dirty:
                self._persist(node)
            if writable and not node.writers:
                node.writing = 0
                self._save(node, "writing")
                self._closed(node)

    def _new_version(self, node: Inode) -> None:
        """The file's content is about to change: (ino, version) names one closed content, so a
        new one begins. Sets holding the old content can no longer be published as committed."""
        with self._tx(node):
            old = node.version
            node.version += 1
            if self.tiering is not None:
                self.tiering.on_content_change(node.ino, old)
            self._save(node, "version", "writing")
            if not node.writing:
                self._closed(node)

    def _closed(self, node: Inode) -> None:
        """A content version is complete (last writer closed, or a truncate without writers)."""
        if self.tiering is None or node.nlink == 0:
            return
        row = self.index.conn.execute(
            "SELECT parent, name FROM dentries WHERE ino=? LIMIT 1", (node.ino,)).fetchone()
        if row is not None:
            with self.index.tx():
                self.tiering.on_close(node, row[0], bytes(row[1]))

    # -- eviction and refill (driven by cachemgr.tiering) ---------------------------------------

    def needs_fetch(self, ino: int) -> bool:
        return not self.inode(ino).cached

    def eviction_candidates(self) -> list[tuple[int, int]]:
        """(ino, version) of cached files whose current content is in the store and that nobody
        has open, least recently used first."""
        rows = self.index.conn.execute(
            "SELECT ino, version, mtime_ns FROM inodes WHERE (mode & 61440) = 32768 AND"
            " cached = 1 AND writing = 0 AND nlink > 0 AND obj_version = version AND size > 0"
        ).fetchall()
        out = []
        for ino, version, mtime_ns in rows:
            node = self._inodes.get(ino)
            if node is not None and (node.opens or node.version != version):
                continue
            out.append((self._last_used.get(ino, mtime_ns / 1e9 - 1e12), ino, version))
        out.sort()
        return [(ino, version) for _, ino, version in out]

    def evict(self, ino: int, version: int) -> bool:
        """Drop the cached data of (ino, version) if it is safely in the store and unused."""
        node = self.inode(ino)
        if not node.is_reg or not node.cached or node.opens or node.version != version:
            return False
        if self.files.busy(ino):
            return False  # a fill (a damaged chunk being repaired) is writing it
        row = self.index.conn.execute(
            "SELECT obj_version FROM inodes WHERE ino=?", (ino,)).fetchone()
        if row is None or row[0] != version:
            return False  # never evict data that is not uploaded
        with self.index.tx():
            node.cached = 0
            self._save(node, "cached")
            self.index.conn.execute("UPDATE inodes SET present=NULL WHERE ino=?", (ino,))
        os.truncate(self._data_path(ino), 0)
        freed = node.size - self._holes.pop(ino, 0)
        self.cached_bytes -= freed
        self.stats.evictions += 1
        self.stats.evicted_bytes += freed
        self._freed()
        log.debug("evicted inode %d (%d bytes)", ino, node.size)
        return True

    # -- sets restored from the store (driven by cachemgr.restore) -----------------------------

    def ensure_dirs(self, parts: list[str]) -> int:
        """The directory at `parts` below the root, creating missing ones (mode 0755, like
        mkdir -p) without tiering hooks. ENOTDIR if a component is not a directory."""
        ino = ROOT_INO
        for part in parts:
            name = part.encode("utf-8", "surrogateescape")
            child = self.index.lookup(ino, name)
            if child is None:
                child = self.raw_create(ino, name, stat.S_IFDIR | 0o755)
            elif not self.inode(child).is_dir:
                raise FsError(errno.ENOTDIR, f"{'/'.join(parts)}: {part} is not a directory")
            ino = child
        return ino

    def raw_create(self, parent: int, name: bytes, mode: int, *, size: int = 0,
                   mtime_ns: int | None = None, target: bytes | None = None,
                   obj: str | None = None) -> int:
        """Create an entry the kernel has not seen, without tiering hooks: restored sets.
        A regular file is created evicted (`cached = 0`) with its object `obj`: its data
        comes from the store on first read."""
        self._check_name(name)
        if self.index.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        d = self.inode(parent)
        now = _now()
        is_dir = stat.S_ISDIR(mode)
        with self._tx(d):  # d's link count and times come back if the apply rolls back
            ino = self.index.insert_inode(
                mode=mode, uid=os.getuid(), gid=os.getgid(), now=now,
                nlink=2 if is_dir else 1, size=len(target) if target is not None else size,
                target=target)
            if mtime_ns is not None:
                self.index.update_inode(ino, mtime_ns=mtime_ns)
            if stat.S_ISREG(mode):
                self._make_data_file(ino)
                self.index.update_inode(ino, cached=0)
                self.index.conn.execute(
                    "UPDATE inodes SET obj=?, obj_version=0 WHERE ino=?", (obj, ino))
            self.index.add_dentry(parent, name, ino)
            if is_dir:
                d.nlink += 1
            self._touch_dir(d, now)
            # Whatever loads the new inode later in the same transaction (a restored set's
            # files created in this new directory) loads an uncommitted row: gone again if
            # the transaction rolls back, as in _new_inode.
            self.index.on_rollback(lambda: self._inodes.pop(ino, None))
        return ino

    def raw_set_mtime(self, ino: int, mtime_ns: int) -> None:
        """Set an inode's mtime without tiering hooks (a restored set's directories)."""
        node = self.inode(ino)
        with self._tx(node):
            node.mtime_ns = mtime_ns
            self._save(node, "mtime_ns")

    @_retry_when_full
    def raw_move(self, old_parent: int, old_name: bytes, new_parent: int,
                 new_name: bytes) -> None:
        """Move a regular file's entry without tiering hooks (a file this node wrote, adopted
        into a set another node committed). The target name must be free."""
        ino = self.index.lookup(old_parent, old_name)
        if ino is None:
            raise FsError(errno.ENOENT)
        if self.index.lookup(new_parent, new_name) is not None:
            raise FsError(errno.EEXIST)
        self._check_name(new_name)
        now = _now()
        od, nd = self.inode(old_parent), self.inode(new_parent)
        with self._tx(od, nd):
            self.index.move_dentry(old_parent, old_name, new_parent, new_name)
            self._touch_dir(od, now)
            if nd is not od:
                self._touch_dir(nd, now)

    def remove_tree(self, parent: int, name: bytes) -> None:
        """rm -rf of one entry without tiering hooks (a restored set replaced from the store).
        Files still open stay readable through their descriptors until closed. Iterative
        (explicit stack, children before their directory): a tree of any depth is fine."""
        ino = self.index.lookup(parent, name)
        if ino is None:
            return
        stack = [(parent, name, ino, False)]  # (parent, name, ino, children already pushed)
        while stack:
            p, n, i, expanded = stack.pop()
            if self.index.lookup(p, n) != i:
                continue  # gone already
            if not expanded and self.inode(i).is_dir:
                stack.append((p, n, i, True))
                stack.extend((i, bytes(cn), c, False)
                             for _id, cn, c in self.index.list_dentries(i, 0, 1 << 30))
                continue
            self._remove_entry(p, n, i)

    @_retry_when_full
    def _remove_entry(self, parent: int, name: bytes, ino: int) -> None:
        """One step of `remove_tree`: the entry `name` of `parent` (a file, a link or an
        emptied directory) and, when nothing else holds it, its inode."""
        node = self.inode(ino)
        d = self.inode(parent)
        with self._tx(node, d):
            self.index.remove_dentry(parent, name)
            if node.is_dir:
                node.nlink = 0
                d.nlink -= 1
            else:
                node.nlink -= 1
            self._save(node, "nlink")
            self._touch_dir(d, _now())
        self._maybe_drop(node)

    def fetched(self, ino: int, size: int) -> None:
        """The cache file of an evicted inode was refilled from the store."""
        node = self.inode(ino)
        with self.index.tx():
            node.cached = 1
            self._save(node, "cached")
            self.index.conn.execute("UPDATE inodes SET present=NULL WHERE ino=?", (ino,))
        self._holes.pop(ino, None)  # restored: every chunk written
        self.cached_bytes += node.size
        node.gen += 1

    # ------------------------------------------------------------------------------------------
    # xattrs

    @staticmethod
    def _check_xattr_name(name: bytes) -> None:
        if name.startswith(b"system."):
            # POSIX ACLs and other system.* attributes are not implemented; ENOTSUP tells tools
            # like cp -a to carry on without them.
            raise FsError(errno.ENOTSUP, "system.* xattrs are not supported")
        if not name or len(name) > 255:
            raise FsError(errno.ERANGE if name else errno.EINVAL)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        # Name check first: system.* is ENOTSUP whether or not the inode has other xattrs.
        self._check_xattr_name(name)
        if ino not in self._xattr_inos:
            # Fast path: the kernel asks for security.capability before every write.
            self.inode(ino)
            raise FsError(errno.ENODATA)
        value = self.index.get_xattr(ino, name)
        if value is None:
            raise FsError(errno.ENODATA)
        return value

    @_retry_when_full
    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        self._check_xattr_name(name)
        if len(value) > XATTR_VALUE_MAX:
            raise FsError(errno.E2BIG)
        node = self.inode(ino)
        with self._tx(node):
            node.ctime_ns = _now()
            self.index.set_xattr(ino, name, value)
            self._save(node, "ctime_ns")
        self._xattr_inos.add(ino)

    def listxattr(self, ino: int) -> list[bytes]:
        self.inode(ino)
        if ino not in self._xattr_inos:
            return []
        return self.index.list_xattrs(ino)

    @_retry_when_full
    def removexattr(self, ino: int, name: bytes) -> None:
        self._check_xattr_name(name)
        node = self.inode(ino)
        with self._tx(node):
            if not self.index.remove_xattr(ino, name):
                raise FsError(errno.ENODATA)
            node.ctime_ns = _now()
            self._save(node, "ctime_ns")

    # ------------------------------------------------------------------------------------------
    # filesystem

    def statfs(self) -> os.statvfs_result:
        return os.statvfs(self.cache_dir)

    def status(self) -> dict:
        """A snapshot for `ckptfs status`: what the cache holds and what the data path did."""
        totals = self.index.totals()
        # Files being written: their in-memory size is newer than the index's.
        for node in self._inodes.values():
            self.take_in_writes(node)
            if node.dirty and node.nlink > 0:
                row = self.index.get_inode(node.ino)
                if row is not None:
                    totals["bytes"] += node.size - row[4]
        st = os.statvfs(self.cache_dir)
        s = self.stats
        out = {
            "cache": {**totals, "open_handles": len(self._handles),
                      "cached_bytes": self.cached_bytes,
                      "evictions": s.evictions, "evicted_bytes": s.evicted_bytes,
                      "disk_free_bytes": st.f_bavail * st.f_frsize,
                      "disk_total_bytes": st.f_blocks * st.f_frsize},
            "io": {"write_requests": s.writes, "bytes_written": s.bytes_written,
                   "read_requests": s.reads, "bytes_read": s.bytes_read, "fsyncs": s.fsyncs},
            "data_path": self.backings.statistics(),
        }
        if self.tiering is not None:
            out["tiering"] = self.tiering.status()
        return out

    def check_consistency(self) -> list[str]:
        """Invariants of index and cache files, for tests and `ckptfs fsck`-style checks.
        Returns a list of problems (empty when consistent)."""
        problems: list[str] = []
        conn = self.index.conn
        rows = {r[0]: r for r in conn.execute("SELECT " + ", ".join(INODE_COLUMNS) +
                                                " FROM inodes")}
        counts: dict[int, int] = {}
        subdirs: dict[int, int] = {}
        for parent, ino in conn.execute("SELECT parent, ino FROM dentries"):
            if parent not in rows or not stat.S_ISDIR(rows[parent][1]):
                problems.append(f"dentry in non-directory {parent}")
            if ino not in rows:
                problems.append(f"dentry to missing inode {ino}")
                continue
            counts[ino] = counts.get(ino, 0) + 1
            if stat.S_ISDIR(rows[ino][1]):
                subdirs[parent] = subdirs.get(parent, 0) + 1
        for ino, row in rows.items():
            mode, nlink = row[1], row[8]
            mem = self._inodes.get(ino)
            if nlink == 0 and (mem is None or (mem.lookups == 0 and mem.opens == 0)) and \
                    ino not in self._purge_pending:
                problems.append(f"unreferenced orphan inode {ino}")
            if stat.S_ISDIR(mode):
                want = 2 + subdirs.get(ino, 0) if (ino == ROOT_INO or counts.get(ino)) else 0
                if nlink != want:
                    problems.append(f"directory {ino} nlink {nlink} != {want}")
            elif nlink != counts.get(ino, 0):
                problems.append(f"inode {ino} nlink {nlink} != {counts.get(ino, 0)} entries")
            if stat.S_ISREG(mode) and row[13]:  # cached (evicted files have empty cache files)
                size = mem.size if mem is not None else row[4]
                try:
                    actual = os.stat(self._data_path(ino)).st_size
                except FileNotFoundError:
                    problems.append(f"cache file of inode {ino} missing")
                    continue
                if actual != size:
                    problems.append(f"inode {ino} size {size} != cache file {actual}")
        return problems
