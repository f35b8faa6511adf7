"""One cache directory's owners, built first: what every layer above is built from.

`Cache.open` takes a cache directory (creating it if needed), checks its layout, opens the index
and runs crash recovery; the `Cache` it returns holds the owners of the directory's state, each
the only owner of its part:

    Index       (cachemgr.core.index)      every SQL statement on the tree and its metadata
    FileCache   (cachemgr.core.filecache)  cache files: I/O off the loop, cached bytes, holes,
                                           last use, the per-file fill locks
    InodeTable  (cachemgr.core.inodes)     the in-memory inodes; the `tx` undo discipline
    Xattrs      (cachemgr.core.xattrs)     extended attributes (which inodes have any)
    Backings    (cachemgr.core.passthrough) the backing files the kernel does passthrough I/O on
    RawTree     (cachemgr.core.rawtree)    tree changes for restored sets (remote, restore)
    Residency   (cachemgr.core.rawtree)    eviction and refill

and the few questions the services ask of them (`inode`, `data_path`, `transaction`, ...). The
tiering and restore services are built from a `Cache`; then the POSIX operations over it
(cachemgr.core.fs.CacheFs) from the cache and those services; then the FUSE adapter. Nothing
here calls out to a layer above: what the owners have to tell (an inode purged, cached bytes
freed) are their own events, which the services subscribe to as they are built.

On-disk layout of a cache directory (version in `layout.json`):

    layout.json        {"format": "ckptfs-cache", "version": 1}
    index.sqlite       the cache index (schema.sql), WAL mode
    index.reserve      room kept for the index's writes on a full disk (cachemgr.core.index)
    data/<ino>         one cache file per regular file, always exactly the file's logical size

Everything here runs on the daemon's trio loop thread, but restore's fills, which write cache
files from worker threads through `FileCache.fill` (module docstring of cachemgr.core.fs).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cachemgr.core import fsck
from cachemgr.core.errors import FsError
from cachemgr.core.filecache import FileCache
from cachemgr.core.fileops import CoreStats
from cachemgr.core.index import Index
from cachemgr.core.inodes import Inode, InodeTable, retrying
from cachemgr.core.passthrough import Backings
from cachemgr.core.rawtree import RawTree, Residency
from cachemgr.core.xattrs import Xattrs
from cachemgr.host.nodefiles import DIR_MODE, FILE_MODE, make_dirs, open_private, restrict

LAYOUT = {"format": "ckptfs-cache", "version": 1}


class Cache:
    """The owners of one cache directory (see the module docstring)."""

    def __init__(self, cache_dir: Path, index: Index, *, backings: Backings | None = None,
                 before_fill: Callable[[], None] | None = None) -> None:
        self.cache_dir = cache_dir
        self.data_dir = cache_dir / "data"
        self.index = index
        self.stats = CoreStats()
        self.files = FileCache(str(self.data_dir), index.cached_bytes(), before_fill=before_fill)
        self.table = InodeTable(index, self.files)
        self.xattrs = Xattrs(index, self.table)
        self.table.on_purged(self.xattrs.discard)
        # FUSE passthrough: the backing files the kernel does I/O on, and the data-path mode.
        self.backings = backings if backings is not None else Backings(off_reason="not asked")
        self.tree = RawTree(index, self.table, self.files)
        self.residency = Residency(index, self.table, self.files, self.stats)

    @classmethod
    def open(cls, cache_dir: Path, *, backings: Backings | None = None,
             before_fill: Callable[[], None] | None = None) -> Cache:
        """Open (creating if needed) the cache in `cache_dir` and run crash recovery.
        `before_fill`: the tests' seam in restore's fills (cachemgr.core.filecache)."""
        make_dirs(cache_dir)  # 0700 if made here (cachemgr.host.nodefiles)
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
        cache = cls(cache_dir, index, backings=backings, before_fill=before_fill)
        cache.recover()
        return cache

    def recover(self) -> dict[str, int]:
        """Bring index and cache files into agreement after a crash (cachemgr.core.fsck)."""
        return fsck.recover(self.index, self.files)

    def close(self) -> None:
        """Persist the inodes and release the index (after the operations closed their
        handles: CacheFs.close)."""
        retrying(self.table.persist_all)
        self.index.sync()
        self.index.close()

    # -- what the services ask -----------------------------------------------------------------

    @property
    def cached_bytes(self) -> int:
        """Bytes of file data in cache files (FileCache owns it)."""
        return self.files.cached_bytes

    def inode(self, ino: int) -> Inode:
        return self.table.get(ino)

    def inode_if_loaded(self, ino: int) -> Inode | None:
        """The in-memory inode if the table holds it (open, known to the kernel, or loaded
        since), without reading the index: what tiering asks about files being written."""
        return self.table.if_loaded(ino)

    def data_path(self, ino: int) -> str:
        return self.files.path(ino)

    @contextlib.contextmanager
    def transaction(self, *nodes: Inode) -> Iterator[None]:
        """`InodeTable.tx`: for the services that change the tree without the kernel."""
        with self.table.tx(*nodes):
            yield

    # -- restored sets and residency (cachemgr.core.rawtree) -----------------------------------

    def ensure_dirs(self, parts: list[str]) -> int:
        return self.tree.ensure_dirs(parts)

    def raw_create(self, parent: int, name: bytes, mode: int, **kw: Any) -> int:
        return self.tree.raw_create(parent, name, mode, **kw)

    def raw_set_mtime(self, ino: int, mtime_ns: int) -> None:
        self.tree.raw_set_mtime(ino, mtime_ns)

    def raw_move(self, old_parent: int, old_name: bytes, new_parent: int,
                 new_name: bytes) -> None:
        self.tree.raw_move(old_parent, old_name, new_parent, new_name)

    def remove_tree(self, parent: int, name: bytes) -> None:
        self.tree.remove_tree(parent, name)

    def needs_fetch(self, ino: int) -> bool:
        return self.residency.needs_fetch(ino)

    def eviction_candidates(self) -> list[tuple[int, int]]:
        return self.residency.eviction_candidates()

    def evict(self, ino: int, version: int) -> bool:
        return self.residency.evict(ino, version)

    def fetched(self, ino: int, size: int) -> None:
        self.residency.fetched(ino, size)

    def check_consistency(self) -> list[str]:
        """Invariants of index and cache files, for tests and `ckptfs fsck`-style checks."""
        return fsck.check(self.index, self.table, self.files)
