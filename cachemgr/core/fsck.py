"""Agreement of the cache index and the cache files: crash recovery and the consistency check.

`recover()` runs at every mount (cheap when there was no crash: one stat per regular file) and
brings the index and cache files into agreement; `check()` lists what disagrees: the
invariants that recovery and every operation keep, which no mount runs but the tests check after
the operations they drive. Both run before serving or between operations on the loop thread.

Crash states repaired by `recover()` (kill -9 of the daemon; the OS page cache survives):

  * Inodes unlinked while open (nlink = 0) are deleted, with their cache files.
  * A regular file's size is taken from its cache file, which is kept at exactly the logical
    size at all times (the index may hold a stale size for files written since their last
    flush, or a truncate whose cache file was not shrunk yet).
  * Cache files with no inode (a crash between creating the file and committing the inode)
    are deleted; a missing cache file (only possible if the cache dir was tampered with) is
    recreated empty.
  * The holes of files grown by truncate are recomputed from st_blocks (cachemgr.core.filecache).
"""

from __future__ import annotations

import logging
import os
import stat

from cachemgr.core.filecache import FileCache
from cachemgr.core.index import ROOT_INO, Index
from cachemgr.core.inodes import InodeTable

log = logging.getLogger(__name__)


def recover(index: Index, files: FileCache) -> dict[str, int]:
    """Bring index and cache files into agreement after a crash (idempotent)."""
    report = {"orphans": 0, "resized": 0, "stray_files": 0, "missing_files": 0}
    with index.tx():
        for ino in index.orphan_inodes():
            files.unlink(ino)
            index.delete_inode(ino)
            report["orphans"] += 1
        evicted = index.evicted_files()
        for ino, size in index.regular_files():
            if ino in evicted:
                continue  # its data is in the store; the cache file is empty on purpose
            try:
                st = os.stat(files.path(ino))
                actual = st.st_size
                files.note_hole(ino, st)
            except FileNotFoundError:
                # Only possible if the cache dir was tampered with: recreate it empty so the
                # file is readable (its lost bytes cannot be invented).
                log.error("cache file for inode %d is missing; the file is now empty", ino)
                files.create(ino)
                actual = 0
                report["missing_files"] += 1
            if actual != size:
                index.update_inode(ino, size=actual)
                report["resized"] += 1
        # cached_bytes was summed from the index's sizes: the holes do not count.
        files.holes_found()
        known = index.all_inos()
        for entry in os.scandir(files.data_dir):
            name = entry.name
            if not name.isdigit() or int(name) not in known:
                os.unlink(entry.path)
                report["stray_files"] += 1
    if any(report.values()):
        log.info("recovery: %s", report)
    return report


def check(index: Index, table: InodeTable, files: FileCache) -> list[str]:
    """Invariants of index and cache files. Returns a list of problems (empty when
    consistent)."""
    problems: list[str] = []
    rows = index.all_inode_rows()
    counts: dict[int, int] = {}
    subdirs: dict[int, int] = {}
    for parent, ino in index.all_dentries():
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
        mem = table.if_loaded(ino)
        if nlink == 0 and (mem is None or (mem.lookups == 0 and mem.opens == 0)) and \
                not table.purge_pending(ino):
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
                actual = os.stat(files.path(ino)).st_size
            except FileNotFoundError:
                problems.append(f"cache file of inode {ino} missing")
                continue
            if actual != size:
                problems.append(f"inode {ino} size {size} != cache file {actual}")
    return problems
