"""A full cache disk: the index keeps room for its own writes, and a refused operation changes
nothing (in memory, in the index, in the cache files). Through a real mount, deleting an old
checkpoint on a full disk: tests/mount/test_diskfull_mount.py.

The cache directory lives on a small tmpfs mounted for the test (root only). A disk is made
full by preallocating every free block; before that the index's WAL is truncated, so the next
commit must allocate and fails with SQLITE_FULL, deterministically.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

import pytest

from cachemgr.core.cache import Cache
from cachemgr.core.errors import FsError
from cachemgr.core.fs import CacheFs
from cachemgr.core.hooks import NO_HOOKS, NO_LIMIT, NO_STORE
from cachemgr.core.index import INODE_COLUMNS, RESERVE_BYTES, Index
from cachemgr.core.namespace import RENAME_EXCHANGE
from tests.diskfull_helpers import MiB, disk
from tests.inproc import memory_matches_index

__all__ = ["disk"]  # the fixture, imported for these tests


ROOT = 1
UID, GID = 1234, 5678


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(disk: Path, name: str = "filler") -> Path:
    """Take every free block of `disk` (outside the cache dir)."""
    p = disk / name
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if free_bytes(disk):
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size + free_bytes(disk))
    finally:
        os.close(fd)
    assert free_bytes(disk) == 0
    return p


def wal_empty(fs: CacheFs) -> None:
    """Checkpoint and truncate the WAL: the next commit has to allocate blocks for it."""
    busy, _log, _done = fs.index.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    assert busy == 0


def mkfile(fs: CacheFs, parent: int, name: bytes, data: bytes = b"") -> int:
    res, node = fs.create(parent, name, 0o644, os.O_RDWR | os.O_CREAT, UID, GID)
    if data:
        assert fs.write(res.fh, 0, data) == len(data)
    fs.release(res.fh)
    return node.ino


def snapshot(fs: CacheFs) -> tuple:
    """The index's tree and inode rows, and the cache files' sizes."""
    conn = fs.index.conn
    dentries = sorted((p, bytes(n), i) for p, n, i in
                      conn.execute("SELECT parent, name, ino FROM dentries"))
    inodes = sorted(conn.execute("SELECT * FROM inodes").fetchall())
    xattrs = sorted((i, bytes(n), bytes(v)) for i, n, v in conn.execute("SELECT * FROM xattrs"))
    files = sorted((e.name, e.stat().st_size) for e in os.scandir(fs.cache.data_dir))
    return dentries, inodes, xattrs, files


# ----------------------------------------------------------------------------------------------
# in-process


def test_full_disk_close_and_delete_use_the_reserve_and_it_comes_back(disk, caplog):
    caplog.set_level(logging.INFO, "cachemgr.core.index")
    cache = disk / "cache"
    fs = CacheFs.load(cache)
    assert fs.index.reserve_held
    assert os.stat(cache / "index.reserve").st_blocks * 512 >= RESERVE_BYTES
    old = mkfile(fs, ROOT, b"old.pt", os.urandom(20 * MiB))
    fs.forget(old, fs.cache.table.get(old).lookups)
    # The trainer writes the next checkpoint until the disk is full, and closes it.
    res, node = fs.create(ROOT, b"new.pt", 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
    chunk = os.urandom(MiB)
    with pytest.raises(OSError) as e:
        for i in range(48):
            fs.write(res.fh, i * MiB, chunk)
    assert e.value.errno == errno.ENOSPC
    wal_empty(fs)
    fill(disk)  # whatever the last write left free
    fs.release(res.fh)  # needs the reserve
    assert "released the 8 MiB index reserve" in caplog.text
    assert not fs.index.reserve_held and free_bytes(disk) > RESERVE_BYTES - MiB
    size = fs.cache.table.get(node.ino).size
    assert fs.index.get_inode(node.ino)[INODE_COLUMNS.index("size")] == size
    # What the reserve freed is not for file data.
    res = fs.open(node.ino, os.O_WRONLY | os.O_APPEND)
    with pytest.raises(FsError) as e:
        fs.write(res.fh, 0, chunk)
    assert e.value.errno == errno.ENOSPC
    fs.release(res.fh)
    # The user deletes the old checkpoint to make room: it works.
    fs.unlink(ROOT, b"old.pt")
    assert fs.index.lookup(ROOT, b"old.pt") is None
    assert fs.check_consistency() == []
    assert memory_matches_index(fs) == []
    # Its data went with it (no kernel reference was left), so the reserve is back.
    assert not (cache / "data" / str(old)).exists()
    assert fs.index.reserve_held
    assert "index reserve of 8 MiB made again" in caplog.text
    fs.close()
    fs = CacheFs.load(cache)
    assert [bytes(n) for _, n, _ in fs.index.list_dentries(ROOT, 0, 10)] == [b"new.pt"]
    assert fs.cache.table.get(node.ino).size == size
    assert fs.check_consistency() == []
    fs.close()


def _setup(fs: CacheFs) -> dict[str, int]:
    """A small tree for the operations below."""
    d = fs.mkdir(ROOT, b"d", 0o755, UID, GID).ino
    fs.mkdir(ROOT, b"e", 0o755, UID, GID)
    inos = {"d": d}
    for name, data in ((b"a", b"a" * 5000), (b"b", b"b" * 3000), (b"gone", b"x" * 100)):
        inos[name.decode()] = mkfile(fs, ROOT, name, data)
    inos["in_d"] = mkfile(fs, d, b"f", b"f" * 10)
    fs.setxattr(inos["a"], b"user.k", b"v")
    # "gone" is unlinked and the kernel holds no reference: the next drop purges it.
    fs.forget(inos["gone"], fs.cache.table.get(inos["gone"]).lookups)
    return inos


def _open_dirty(fs: CacheFs, ino: int) -> int:
    fh = fs.open(ino, os.O_RDWR).fh
    fs.write(fh, 0, b"more bytes, more size" * 500)
    return fh


# name -> (prepare(fs, inos) -> ctx, operation(fs, inos, ctx)); each needs an index write.
OPERATIONS = {
    "unlink": (None, lambda fs, i, c: fs.unlink(ROOT, b"a")),
    "unlink+purge": (lambda fs, i: fs.forget(i["b"], fs.cache.table.get(i["b"]).lookups),
                     lambda fs, i, c: fs.unlink(ROOT, b"b")),
    "rmdir": (None, lambda fs, i, c: fs.rmdir(ROOT, b"e")),
    "rename": (None, lambda fs, i, c: fs.rename(ROOT, b"a", i["d"], b"a2")),
    "rename-over": (None, lambda fs, i, c: fs.rename(ROOT, b"a", ROOT, b"b")),
    "rename-dir-over-dir": (None, lambda fs, i, c: fs.rename(ROOT, b"d", ROOT, b"e")),
    "exchange": (None, lambda fs, i, c: fs.rename(ROOT, b"a", ROOT, b"d", RENAME_EXCHANGE)),
    "create": (None, lambda fs, i, c: fs.create(ROOT, b"n", 0o644, os.O_RDWR | os.O_CREAT,
                                                 UID, GID)),
    "mkdir": (None, lambda fs, i, c: fs.mkdir(i["d"], b"sub", 0o755, UID, GID)),
    "mknod": (None, lambda fs, i, c: fs.mknod(ROOT, b"r", stat.S_IFREG | 0o600, 0, UID, GID)),
    "symlink": (None, lambda fs, i, c: fs.symlink(ROOT, b"l", b"a", UID, GID)),
    "chmod+chown+utimens": (None, lambda fs, i, c: fs.setattr(
        i["a"], mode=0o600, uid=7, gid=8, atime_ns=1, mtime_ns=2)),
    "truncate-shrink": (None, lambda fs, i, c: fs.setattr(i["a"], size=10)),
    "truncate-grow": (None, lambda fs, i, c: fs.setattr(i["a"], size=3 * MiB)),
    "ftruncate-open": (lambda fs, i: _open_dirty(fs, i["a"]),
                       lambda fs, i, fh: fs.setattr(i["a"], size=1, fh=fh)),
    "open-write": (None, lambda fs, i, c: fs.open(i["a"], os.O_WRONLY)),
    "open-trunc": (None, lambda fs, i, c: fs.open(i["a"], os.O_WRONLY | os.O_TRUNC)),
    "flush": (lambda fs, i: _open_dirty(fs, i["a"]), lambda fs, i, fh: fs.flush(fh)),
    "fsync": (lambda fs, i: _open_dirty(fs, i["a"]), lambda fs, i, fh: fs.fsync(fh, False)),
    "setxattr": (None, lambda fs, i, c: fs.setxattr(i["b"], b"user.x", b"y")),
    "removexattr": (None, lambda fs, i, c: fs.removexattr(i["a"], b"user.k")),
    "remove_tree": (None, lambda fs, i, c: fs.cache.tree.remove_tree(ROOT, b"d")),
    "raw_move": (None, lambda fs, i, c: fs.cache.tree.raw_move(i["d"], b"f", ROOT, b"moved")),
}


@pytest.mark.parametrize("op", list(OPERATIONS))
def test_operation_refused_on_a_full_disk_changes_nothing(disk, op):
    """Without a reserve left, every operation's index write fails: it answers ENOSPC, and
    memory, index and cache files are exactly as before; with room back, it works."""
    cache = disk / "cache"
    fs = CacheFs(Cache(cache, _open_index(cache, reserve_bytes=0)), hooks=NO_HOOKS,
                 reads=NO_STORE, room=NO_LIMIT)
    fs.cache.recover()
    inos = _setup(fs)
    prepare, run = OPERATIONS[op]
    ctx = prepare(fs, inos) if prepare else None
    before = snapshot(fs)
    mem_before = {n.ino: [getattr(n, c) for c in INODE_COLUMNS] for n in fs.table.loaded()}
    cached_before = fs.files.cached_bytes
    wal_empty(fs)
    filler = fill(disk)
    with pytest.raises(FsError) as e:
        run(fs, inos, ctx)
    assert e.value.errno == errno.ENOSPC
    assert snapshot(fs) == before
    # (An inode the operation looked up may have been loaded; memory_matches_index checks it.)
    assert {n.ino: [getattr(n, c) for c in INODE_COLUMNS] for n in fs.table.loaded()
            if n.ino in mem_before} == mem_before
    assert fs.files.cached_bytes == cached_before
    assert memory_matches_index(fs) == []
    assert fs.check_consistency() == []
    filler.unlink()
    run(fs, inos, ctx)
    assert memory_matches_index(fs) == []
    assert fs.check_consistency() == []
    fs.close()


@pytest.mark.parametrize("op", list(OPERATIONS))
def test_operation_on_a_full_disk_succeeds_with_the_reserve(disk, op):
    cache = disk / "cache"
    fs = CacheFs.load(cache)
    inos = _setup(fs)
    prepare, run = OPERATIONS[op]
    ctx = prepare(fs, inos) if prepare else None
    wal_empty(fs)
    fill(disk)
    run(fs, inos, ctx)
    assert not fs.index.reserve_held
    assert memory_matches_index(fs) == []
    assert fs.check_consistency() == []
    fs.close()


def test_release_and_forget_on_a_full_disk_keep_memory_for_later(disk):
    """The kernel retries neither: a release whose index write fails still drops the handle,
    and the file's size waits in memory; a purge that fails waits for a later drop."""
    cache = disk / "cache"
    fs = CacheFs(Cache(cache, _open_index(cache, reserve_bytes=0)), hooks=NO_HOOKS,
                 reads=NO_STORE, room=NO_LIMIT)
    fs.cache.recover()
    inos = _setup(fs)
    fh = _open_dirty(fs, inos["a"])
    size = fs.cache.table.get(inos["a"]).size
    fs.unlink(ROOT, b"b")
    wal_empty(fs)
    filler = fill(disk)
    with pytest.raises(FsError) as e:
        fs.release(fh)
    assert e.value.errno == errno.ENOSPC
    assert fs.handles.find(fh) is None and fs.cache.table.get(inos["a"]).opens == 0
    assert fs.cache.table.get(inos["a"]).dirty
    # the purge fails: kept, no exception
    fs.forget(inos["b"], fs.cache.table.get(inos["b"]).lookups)
    assert fs.cache.table.if_loaded(inos["b"]) is not None
    assert memory_matches_index(fs) == []
    assert fs.check_consistency() == []
    filler.unlink()
    fs.forget(inos["a"], fs.cache.table.get(inos["a"]).lookups)  # persists "a", then purges "b"
    assert fs.cache.table.if_loaded(inos["b"]) is None and fs.index.get_inode(inos["b"]) is None
    assert fs.index.get_inode(inos["a"])[INODE_COLUMNS.index("size")] == size
    assert fs.check_consistency() == []
    fs.close()


def _open_index(cache: Path, *, reserve_bytes: int) -> Index:
    """What CacheFs.load does, with a chosen reserve."""
    CacheFs.load(cache).close()  # layout, data dir, index
    (cache / "index.reserve").unlink()
    return Index.open(cache / "index.sqlite", uid=0, gid=0, reserve_bytes=reserve_bytes)
