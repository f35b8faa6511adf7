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

`Cache` itself answers nothing about files: it is the owners, `open` (with crash recovery,
`recover`), `check_consistency` (cachemgr.core.fsck) and `close`. The tiering and restore
services are built from the owners each of them uses (cachemgr.engine.Engine hands
them out: a service asks `InodeTable.get`, `FileCache.path`, `RawTree.raw_create`,
`Residency.evict` ... itself); then the POSIX operations over the cache
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

import errno
import json
import os
from pathlib import Path

from cachemgr.core import fsck
from cachemgr.core.errors import FsError
from cachemgr.core.filecache import FileCache
from cachemgr.core.fileops import CoreStats
from cachemgr.core.index import Index
from cachemgr.core.inodes import InodeTable, retrying
from cachemgr.core.passthrough import Backings
from cachemgr.core.rawtree import RawTree, Residency
from cachemgr.core.xattrs import Xattrs
from cachemgr.host.nodefiles import DIR_MODE, FILE_MODE, make_dirs, open_private, restrict

LAYOUT = {"format": "ckptfs-cache", "version": 1}


class Cache:
    """The owners of one cache directory (see the module docstring)."""

    def __init__(self, cache_dir: Path, index: Index, *,
                 backings: Backings | None = None) -> None:
        self.cache_dir = cache_dir
        self.data_dir = cache_dir / "data"
        self.index = index
        self.stats = CoreStats()
        self.files = FileCache(str(self.data_dir), index.cached_bytes())
        self.table = InodeTable(index, self.files)
        self.xattrs = Xattrs(index, self.table)
        self.table.on_purged(self.xattrs.discard)
        # FUSE passthrough: the backing files the kernel does I/O on, and the data-path mode.
        self.backings = backings if backings is not None else Backings(off_reason="not asked")
        self.tree = RawTree(index, self.table, self.files)
        self.residency = Residency(index, self.table, self.files, self.stats)

    @classmethod
    def open(cls, cache_dir: Path, *, backings: Backings | None = None) -> Cache:
        """Open (creating if needed) the cache in `cache_dir` and run crash recovery."""
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
        cache = cls(cache_dir, index, backings=backings)
        cache.recover()
        return cache

    def recover(self) -> dict[str, int]:
        """Bring index and cache files into agreement after a crash (cachemgr.core.fsck)."""
        return fsck.recover(self.index, self.files)

    def check_consistency(self) -> list[str]:
        """The problems `fsck.check` finds in index and cache files (empty: consistent)."""
        return fsck.check(self.index, self.table, self.files)

    def close(self) -> None:
        """Persist the inodes and release the index (after the operations closed their
        handles: CacheFs.close)."""
        retrying(self.table.persist_all)
        self.index.sync()
        self.index.close()
