"""The inode table: the in-memory `Inode` of every inode in use, tied to the index.

`InodeTable` is the one owner of `Inode` objects (`_inodes`) and of the inodes whose purge waits
for room (`_purge_pending`). Everything else reaches an inode through `get()` (loads it from the
index) or `if_loaded()` (only what is in memory).

Invariants, and what guards them:

  * Memory follows the index. Every metadata change is made inside `tx(*nodes)`: one index
    transaction (or part of the enclosing one) whose rollback restores every field of `nodes`
    and the cache accounting of their files (`FileCache.savepoint`) exactly as they were. So
    memory never shows a change the index does not have, and a refused operation (a full cache
    disk: `IndexFull`, ENOSPC) can simply run again: `retry_when_full` / `retrying` do that
    once when the index released its reserve to answer the failure (cachemgr.core.index).
  * The table holds every inode the kernel knows (lookup count > 0), every open inode, and
    whatever was loaded since. `size`/`mtime_ns` of an inode being written are newer in memory
    than in the index (`dirty`) until the next `persist`.
  * An inode is dropped from memory only when unused (no lookups, no opens), after its dirty
    fields were written; an unlinked unused inode is purged (row, cache file) at that point.
    A purge refused by a full disk leaves the inode in `_purge_pending`: purged at a later drop,
    at `persist_all` (unmount) or by `CacheFs.recover()` at the next mount.

Only the trio loop thread uses this module (no locking).

Crash states: an inode loaded from an uncommitted row is removed from the table on rollback
(callers register that with `Index.on_rollback`); a purge deletes the row in its transaction and
the cache file only after commit (a crash in between leaves a stray cache file: recover()).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from cachemgr.core.errors import FsError, IndexFull
from cachemgr.core.filecache import FileCache
from cachemgr.core.index import Index

log = logging.getLogger(__name__)

SETID = stat.S_ISUID | stat.S_ISGID

P = ParamSpec("P")
R = TypeVar("R")


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


# Every field of an Inode: what `InodeTable.tx` saves and restores.
INODE_FIELDS: tuple[str, ...] = tuple(Inode.__slots__)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks for an operation (the FUSE request's context): decides which set-id bits a
    change of a file's data removes."""
    uid: int
    gid: int
    pid: int = 0


def now_ns() -> int:
    return time.time_ns()


def retrying(fn: Callable[P, R], *args: P.args, **kw: P.kwargs) -> R:
    """`fn(*args)`, once more if it failed on a full disk and the index released its reserve
    to make room (see `retry_when_full`)."""
    try:
        return fn(*args, **kw)
    except IndexFull as e:
        if not e.released:
            raise
    return fn(*args, **kw)


def retry_when_full(method: Callable[P, R]) -> Callable[P, R]:
    """Run an operation once more when its index transaction failed on a full cache disk and
    the index released its reserve to make room (`IndexFull.released`, cachemgr.core.index). The
    failed run changed nothing (its transaction rolled back and `InodeTable.tx` undid its
    in-memory changes), and the second one has the reserve's room for its index writes."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kw: P.kwargs) -> R:
        return retrying(method, *args, **kw)

    return wrapper


def in_group(caller: Caller, gid: int) -> bool:
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


def kill_setid_on_chown(node: Inode) -> bool:
    """A chown of a file that is not a directory: S_ISUID goes, and S_ISGID if group-execute
    is set (chown(2); the VFS's chown_common). Under FUSE_HANDLE_KILLPRIV_V2 the kernel leaves
    this to the server (its FATTR_KILL_SUIDGID; ckptfs.fuse `enable_killpriv_v2`); without it
    the kernel's own mode arrives in the same SETATTR and this finds nothing left to clear.
    True if the mode changed."""
    kill = node.mode & stat.S_ISUID
    if node.mode & stat.S_ISGID and node.mode & stat.S_IXGRP:
        kill |= stat.S_ISGID
    if not kill:
        return False
    node.mode &= ~kill
    return True


def kill_setid(node: Inode, caller: Caller | None) -> bool:
    """A change of `node`'s data by `caller` (a write, a truncate, a truncating open): remove
    the set-id bits Linux removes on its local filesystems (fs/attr.c
    setattr_should_drop_suidgid, via file_remove_privs on write and do_truncate): S_ISUID;
    S_ISGID if group-execute is set or the caller is not in the file's group (a setgid file
    without group-execute is otherwise left alone). Not for a caller with CAP_FSETID, taken to
    be uid 0. Inside the caller's `tx(node)`; True if the mode changed (the caller saves it)."""
    mode = node.mode
    if caller is None or caller.uid == 0 or not mode & SETID or not stat.S_ISREG(mode):
        return False
    kill = mode & stat.S_ISUID
    if mode & stat.S_ISGID and (mode & stat.S_IXGRP or not in_group(caller, node.gid)):
        kill |= stat.S_ISGID
    if not kill:
        return False
    node.mode = mode & ~kill
    node.ctime_ns = now_ns()
    return True


@dataclass(frozen=True, slots=True)
class InodeStats:
    """`InodeTable.statistics()`: the in-memory inodes (`dataclasses.asdict` for JSON)."""

    loaded: int
    purge_pending: int
    dirty: int


class InodeTable:
    """Owner of the in-memory inodes and of the transaction discipline that ties them to the
    index (`tx`)."""

    def __init__(self, index: Index, files: FileCache) -> None:
        self.index = index
        self.files = files
        # told (after commit) that an inode is gone for good: the owners and services above
        # that keep something per inode subscribe as they are built (`on_purged`)
        self._purged: list[Callable[[int], None]] = []
        self._inodes: dict[int, Inode] = {}
        # Unlinked, unused inodes whose purge failed on a full cache disk: purged at a later
        # drop, at persist_all() or by recover() at the next mount.
        self._purge_pending: set[int] = set()

    def on_purged(self, listener: Callable[[int], None]) -> None:
        """`listener(ino)` runs after the commit that purged an inode (row and cache file)."""
        self._purged.append(listener)

    def touch_dir(self, d: Inode, now: int) -> None:
        """A directory's entries changed: its mtime and ctime (and nlink) to the index."""
        d.mtime_ns = d.ctime_ns = now
        self.save(d, "mtime_ns", "ctime_ns", "nlink")

    # -- lookup ------------------------------------------------------------------------------

    def get(self, ino: int) -> Inode:
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

    def if_loaded(self, ino: int) -> Inode | None:
        """The in-memory inode if the table holds it (open, known to the kernel, or loaded
        since), without reading the index: what tiering asks about files being written."""
        return self._inodes.get(ino)

    def loaded(self) -> list[Inode]:
        return list(self._inodes.values())

    def purge_pending(self, ino: int) -> bool:
        return ino in self._purge_pending

    def unload_on_rollback(self, ino: int) -> None:
        """`ino` was loaded from an uncommitted row: gone again if the transaction rolls back."""
        def unload() -> None:
            self._inodes.pop(ino, None)

        self.index.on_rollback(unload)

    # -- transactions ------------------------------------------------------------------------

    @contextlib.contextmanager
    def tx(self, *nodes: Inode) -> Iterator[None]:
        """An index transaction (or a part of the enclosing one) tied to memory: every field of
        `nodes` and the cache accounting of their files, as they are now, come back exactly
        when the transaction rolls back. Every in-memory change an operation makes happens
        inside one, on nodes it names: memory never shows a change the index does not have."""
        with self.index.tx():
            saved = [(n, [getattr(n, f) for f in INODE_FIELDS]) for n in nodes]
            undo_files = self.files.savepoint([n.ino for n in nodes])

            def undo() -> None:
                for n, values in saved:
                    for f, v in zip(INODE_FIELDS, values, strict=True):
                        setattr(n, f, v)
                undo_files()

            self.index.on_rollback(undo)
            yield

    def save(self, node: Inode, *names: str) -> None:
        self.index.update_inode(node.ino, **{n: getattr(node, n) for n in names})

    def persist(self, node: Inode) -> None:
        if node.dirty:
            self.save(node, "size", "mtime_ns", "ctime_ns")
            node.dirty = False

    def persist_now(self, node: Inode) -> None:
        with self.tx(node):
            self.persist(node)

    def kill_setid_now(self, node: Inode, caller: Caller) -> None:
        with self.tx(node):
            if kill_setid(node, caller):
                self.save(node, "mode", "ctime_ns")

    # -- dropping and purging ------------------------------------------------------------------

    def maybe_drop(self, node: Inode) -> None:
        """Forget the in-memory inode, or delete it for good if it is unlinked and unused.
        Never raises IndexFull: the operation that got here is complete, and what is left to
        write waits in memory (a dirty size until the next persist, an unlinked inode until a
        later drop, persist_all() or the next mount's recover())."""
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
                retrying(self._purge_now, node)
            elif node.dirty:
                retrying(self.persist_now, node)
        except IndexFull as e:
            if node.nlink == 0:
                self._purge_pending.add(node.ino)
            log.warning("inode %d stays in memory: %s", node.ino, e)
            return False
        self._inodes.pop(node.ino, None)
        return True

    def _purge_now(self, node: Inode) -> None:
        with self.tx(node):
            self.purge(node)

    def purge(self, node: Inode) -> None:
        """Delete an unlinked, unused inode (inside a transaction): its row now, its cache file
        once the transaction committed (deleted data cannot be undone; a crash in between leaves
        a cache file without inode, which recover() deletes). The `purged` listener hears of it
        only then too: what it forgets (a partly restored file's chunks and their count in
        cached_bytes) is not brought back if the transaction rolls back (a restored set
        replaced from the store, whose apply failed half-way: cachemgr.tiering.remote)."""
        if node.is_reg and node.cached:
            self.files.dropped(node.ino, node.size)
        self.index.delete_inode(node.ino)
        ino, is_reg = node.ino, node.is_reg

        def gone() -> None:
            for listener in self._purged:
                listener(ino)
            if is_reg:
                self.files.remove(ino)
            self._inodes.pop(ino, None)
            self._purge_pending.discard(ino)

        self.index.after_commit(gone)

    def persist_all(self) -> None:
        """Write every dirty inode and purge every unlinked one (unmount: the kernel holds no
        reference any more)."""
        with self.tx():
            for node in list(self._inodes.values()):
                self.persist(node)
                if node.nlink == 0:
                    self.purge(node)

    def statistics(self) -> InodeStats:
        return InodeStats(loaded=len(self._inodes), purge_pending=len(self._purge_pending),
                          dirty=sum(1 for n in self._inodes.values() if n.dirty))
