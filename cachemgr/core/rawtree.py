"""Changes to the tree and to file residency that do not come from the kernel.

Two narrow interfaces of the filesystem core, each owning no state of its own:

  * `RawTree`: what remote sets (cachemgr.tiering.remote) and restore use to build and replace trees
    that other nodes committed: `ensure_dirs`, `raw_create`, `raw_set_mtime`, `raw_move`,
    `remove_tree`. No `FsHooks` are called (these changes are not this node's to commit);
    the caller tells the kernel through `KernelNotifier`. Each step is one `InodeTable.tx`,
    so it can be part of the caller's larger transaction (a whole set applied at once).
  * `Residency`: whether a file's data is in its cache file: eviction (driven by the
    --cache-size policy in cachemgr.engine) and refill (cachemgr.restore.restorer).

Crash states: an eviction marks the inode evicted (`cached = 0`) in a committed transaction
before it empties the cache file, so a crash in between leaves a full cache file of an
evicted inode: harmless (it is fetched again, over it). A refill writes the data first and
marks the inode cached after; a crash in between fetches again.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass

from cachemgr.core.errors import FsError
from cachemgr.core.filecache import FileCache
from cachemgr.core.fileops import CoreStats
from cachemgr.core.index import ROOT_INO, Index
from cachemgr.core.inodes import InodeTable, now_ns, retry_when_full
from cachemgr.core.namespace import check_name

log = logging.getLogger(__name__)


class RawTree:
    """Tree changes made by the node itself (restored sets), without hooks."""

    def __init__(self, index: Index, table: InodeTable, files: FileCache) -> None:
        self.index = index
        self.table = table
        self.files = files

    def ensure_dirs(self, parts: list[str]) -> int:
        """The directory at `parts` below the root, creating missing ones (mode 0755, like
        mkdir -p) without tiering hooks. ENOTDIR if a component is not a directory."""
        ino = ROOT_INO
        for part in parts:
            name = part.encode("utf-8", "surrogateescape")
            child = self.index.lookup(ino, name)
            if child is None:
                child = self.raw_create(ino, name, stat.S_IFDIR | 0o755)
            elif not self.table.get(child).is_dir:
                raise FsError(errno.ENOTDIR, f"{'/'.join(parts)}: {part} is not a directory")
            ino = child
        return ino

    def raw_create(self, parent: int, name: bytes, mode: int, *, size: int = 0,
                   mtime_ns: int | None = None, target: bytes | None = None,
                   obj: str | None = None) -> int:
        """Create an entry the kernel has not seen, without tiering hooks: restored sets.
        A regular file is created evicted (`cached = 0`) with its object `obj`: its data
        comes from the store on first read."""
        check_name(name)
        if self.index.lookup(parent, name) is not None:
            raise FsError(errno.EEXIST)
        d = self.table.get(parent)
        now = now_ns()
        is_dir = stat.S_ISDIR(mode)
        with self.table.tx(d):  # d's link count and times come back if the apply rolls back
            ino = self.index.insert_inode(
                mode=mode, uid=os.getuid(), gid=os.getgid(), now=now,
                nlink=2 if is_dir else 1, size=len(target) if target is not None else size,
                target=target)
            if mtime_ns is not None:
                self.index.update_inode(ino, mtime_ns=mtime_ns)
            if stat.S_ISREG(mode):
                self.files.create(ino)
                self.index.on_rollback(lambda: self.files.unlink(ino))  # as Namespace.new_inode
                self.index.set_restored_object(ino, obj)
            self.index.add_dentry(parent, name, ino)
            if is_dir:
                d.nlink += 1
            self.table.touch_dir(d, now)
            # Whatever loads the new inode later in the same transaction (a restored set's
            # files created in this new directory) loads an uncommitted row: gone again if
            # the transaction rolls back, as in Namespace.new_inode.
            self.table.unload_on_rollback(ino)
        return ino

    def raw_create_files(self, parent: int, rows: list[tuple[bytes, int, int, int | None, str]]
                         ) -> list[int]:
        """`raw_create` of many regular files in one directory: rows (name, mode, size,
        mtime_ns or None for now, obj), names distinct and free in `parent` (the caller
        knows: a directory it has just created). Their inode numbers, in order. One step for
        all of them: two statements and one touch of the directory, where `raw_create` is ~7
        statements a file (a fresh node's first listing of 100,000 files, docs/ARCHITECTURE.md
        "Scale")."""
        for name, *_ in rows:
            check_name(name)
        d = self.table.get(parent)
        now = now_ns()
        with self.table.tx(d):
            inos = self.index.insert_restored_files(
                parent, [(n, stat.S_IFREG | stat.S_IMODE(m), size, now if mt is None else mt, o)
                         for n, m, size, mt, o in rows],
                uid=os.getuid(), gid=os.getgid(), now=now)
            created: list[int] = []

            def unlink_created() -> None:  # as Namespace.new_inode
                for i in created:
                    self.files.unlink(i)

            self.index.on_rollback(unlink_created)
            for ino in inos:
                self.files.create(ino)
                created.append(ino)
                self.table.unload_on_rollback(ino)
            self.table.touch_dir(d, now)
        return inos

    def raw_set_mtime(self, ino: int, mtime_ns: int) -> None:
        """Set an inode's mtime without tiering hooks (a restored set's directories)."""
        node = self.table.get(ino)
        with self.table.tx(node):
            node.mtime_ns = mtime_ns
            self.table.save(node, "mtime_ns")

    @retry_when_full
    def raw_move(self, old_parent: int, old_name: bytes, new_parent: int,
                 new_name: bytes) -> None:
        """Move a regular file's entry without tiering hooks (a file this node wrote, adopted
        into a set another node committed). The target name must be free."""
        ino = self.index.lookup(old_parent, old_name)
        if ino is None:
            raise FsError(errno.ENOENT)
        if self.index.lookup(new_parent, new_name) is not None:
            raise FsError(errno.EEXIST)
        check_name(new_name)
        now = now_ns()
        od, nd = self.table.get(old_parent), self.table.get(new_parent)
        with self.table.tx(od, nd):
            self.index.move_dentry(old_parent, old_name, new_parent, new_name)
            self.table.touch_dir(od, now)
            if nd is not od:
                self.table.touch_dir(nd, now)

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
            if not expanded and self.table.get(i).is_dir:
                stack.append((p, n, i, True))
                stack.extend((i, cn, c, False) for cn, c in self.index.children(i))
                continue
            self._remove_entry(p, n, i)

    @retry_when_full
    def _remove_entry(self, parent: int, name: bytes, ino: int) -> None:
        """One step of `remove_tree`: the entry `name` of `parent` (a file, a link or an
        emptied directory) and, when nothing else holds it, its inode."""
        node = self.table.get(ino)
        d = self.table.get(parent)
        with self.table.tx(node, d):
            self.index.remove_dentry(parent, name)
            if node.is_dir:
                node.nlink = 0
                d.nlink -= 1
            else:
                node.nlink -= 1
            self.table.save(node, "nlink")
            self.table.touch_dir(d, now_ns())
        self.table.maybe_drop(node)


@dataclass(frozen=True, slots=True)
class ResidencyStats:
    """`Residency.statistics()`: eviction (`dataclasses.asdict` for JSON)."""

    evictions: int
    evicted_bytes: int


class Residency:
    """Eviction and refill of cache files (the data stays in the store)."""

    def __init__(self, index: Index, table: InodeTable, files: FileCache,
                 stats: CoreStats) -> None:
        self.index = index
        self.table = table
        self.files = files
        self.stats = stats  # evictions and evicted_bytes are counted here

    def needs_fetch(self, ino: int) -> bool:
        return not self.table.get(ino).cached

    def eviction_candidates(self) -> list[tuple[int, int]]:
        """(ino, version) of cached files whose current content is in the store and that nobody
        has open, least recently used first."""
        out = []
        for ino, version, mtime_ns in self.index.evictable_files():
            node = self.table.if_loaded(ino)
            if node is not None and (node.opens or node.version != version):
                continue
            out.append((self.files.last_used(ino, mtime_ns / 1e9 - 1e12), ino, version))
        out.sort()
        return [(ino, version) for _, ino, version in out]

    def evict(self, ino: int, version: int) -> bool:
        """Drop the cached data of (ino, version) if it is safely in the store and unused."""
        node = self.table.get(ino)
        if not node.is_reg or not node.cached or node.opens or node.version != version:
            return False
        if self.files.busy(ino):
            return False  # a fill (a damaged chunk being repaired) is writing it
        if self.index.uploaded_version(ino) != version:
            return False  # never evict data that is not uploaded
        with self.index.tx():  # memory follows the index only once the index has changed
            self.index.set_cached(ino, 0)
        node.cached = 0
        freed = self.files.evicted(ino, node.size)
        self.stats.evictions += 1
        self.stats.evicted_bytes += freed
        log.debug("evicted inode %d (%d bytes)", ino, node.size)
        return True

    def statistics(self) -> ResidencyStats:
        return ResidencyStats(evictions=self.stats.evictions,
                              evicted_bytes=self.stats.evicted_bytes)

    def fetched(self, ino: int, size: int) -> None:
        """The cache file of an evicted inode was refilled from the store."""
        node = self.table.get(ino)
        with self.index.tx():  # memory follows the index only once the index has changed
            self.index.set_cached(ino, 1)
        node.cached = 1
        self.files.refilled(ino, node.size)
        node.gen += 1
