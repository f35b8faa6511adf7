"""In-process unit tests of `cachemgr.core.fs.CacheFs`: POSIX semantics without FUSE.

Names are bytes, the root is inode 1. Inodes created here carry one kernel lookup reference
(as after a real create/mkdir), so an unlinked inode stays until `forget`, as in the kernel.
Every test ends by checking the index/cache-file invariants (`check_consistency`).
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from cachemgr.core.cache import LAYOUT, Cache
from cachemgr.core.errors import FsError
from cachemgr.core.fs import CacheFs
from cachemgr.core.hooks import NO_HOOKS, NO_LIMIT, NO_STORE
from cachemgr.core.index import Index
from cachemgr.core.namespace import RENAME_EXCHANGE, RENAME_NOREPLACE
from cachemgr.host.foreground import Foreground

ROOT = 1
UID, GID = 1234, 5678
RW = os.O_RDWR
RENAME_WHITEOUT = 4  # linux/fs.h


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def fs(cache):
    fs = CacheFs.load(cache)
    yield fs
    _close_quietly(fs)


def _close_quietly(fs: CacheFs) -> None:
    try:
        fs.index.conn.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return  # closed (or abandoned by crash())
    fs.close()


def crash(fs: CacheFs) -> None:
    """Abandon `fs` like a killed daemon: nothing in memory is persisted (no flush, release,
    forget or close). Only committed index transactions and the cache files remain; the fds are
    closed so nothing leaks (the kernel would close them too)."""
    fs.handles.close_all()
    fs.index.conn.close()


def local(cache: Cache, **kw) -> CacheFs:
    """The core over `cache` with no store (CacheFs.load's stand-ins), or the given ones."""
    parts = {"hooks": NO_HOOKS, "reads": NO_STORE, "room": NO_LIMIT, **kw}
    return CacheFs(cache, **parts)


def reopen(cache: Path) -> tuple[CacheFs, dict[str, int]]:
    """What `CacheFs.load` does after a crash, keeping the recovery report."""
    fs = local(Cache(cache, Index.open(cache / "index.sqlite", uid=0, gid=0)))
    return fs, fs.cache.recover()


def refused(err: int, fn, *args, **kw) -> None:
    with pytest.raises(FsError) as e:
        fn(*args, **kw)
    assert e.value.errno == err, f"{fn.__name__}{args}: {e.value} (wanted {errno.errorcode[err]})"


def mkfile(fs: CacheFs, parent: int, name: bytes, data: bytes = b"") -> int:
    res, node = fs.create(parent, name, 0o644, RW | os.O_CREAT, UID, GID)
    if data:
        assert fs.write(res.fh, 0, data) == len(data)
    fs.release(res.fh)
    return node.ino


def mkdir(fs: CacheFs, parent: int, name: bytes) -> int:
    return fs.mkdir(parent, name, 0o755, UID, GID).ino


def read_all(fs: CacheFs, ino: int) -> bytes:
    fh = fs.open(ino, os.O_RDONLY).fh
    try:
        return fs.read(fh, 0, fs.getattr(ino).size + 100)
    finally:
        fs.release(fh)


def forget(fs: CacheFs, ino: int) -> None:
    """The kernel drops every reference it holds on `ino`."""
    fs.forget(ino, fs.cache.table.get(ino).lookups)


def names(fs: CacheFs, d: int) -> list[bytes]:
    return [name for _, name, _ in fs.readdir(d, 0)]


def ino_of(fs: CacheFs, parent: int, name: bytes) -> int:
    ino = fs.index.lookup(parent, name)
    assert ino is not None, name
    return ino


def index_row(fs: CacheFs, ino: int) -> dict | None:
    cur = fs.index.conn.execute("SELECT * FROM inodes WHERE ino=?", (ino,))
    row = cur.fetchone()
    return None if row is None else dict(zip([c[0] for c in cur.description], row))


def data_path(cache: Path, ino: int) -> Path:
    return cache / "data" / str(ino)


# ----------------------------------------------------------------------------------------------
# files


def test_create_write_read_truncate_unlink(fs, cache):
    res, node = fs.create(ROOT, b"f", 0o640, RW | os.O_CREAT, UID, GID)
    assert stat.S_ISREG(node.mode) and stat.S_IMODE(node.mode) == 0o640
    assert (node.nlink, node.size, node.uid, node.gid) == (1, 0, UID, GID)
    assert res.direct_io and not res.keep_cache
    assert fs.lookup(ROOT, b"f").ino == node.ino
    assert names(fs, ROOT) == [b"f"]
    refused(errno.EEXIST, fs.create, ROOT, b"f", 0o644, RW, UID, GID)

    fh = res.fh
    assert fs.write(fh, 0, b"hello") == 5
    assert fs.write(fh, 10, b"world") == 5  # past EOF: a hole of zeros
    assert fs.getattr(node.ino).size == 15
    assert fs.read(fh, 0, 100) == b"hello" + bytes(5) + b"world"
    assert fs.read(fh, 12, 2) == b"rl"
    assert fs.read(fh, 15, 10) == b""
    assert os.path.getsize(data_path(cache, node.ino)) == 15
    # Writes update the size in memory only; flush puts it in the index.
    assert index_row(fs, node.ino)["size"] == 0
    fs.flush(fh)
    assert index_row(fs, node.ino)["size"] == 15

    fs.setattr(node.ino, size=3)
    assert fs.read(fh, 0, 100) == b"hel"
    fs.setattr(node.ino, size=8, fh=fh)
    assert fs.read(fh, 0, 100) == b"hel" + bytes(5)
    assert fs.getattr(node.ino).size == 8 == index_row(fs, node.ino)["size"]
    assert os.path.getsize(data_path(cache, node.ino)) == 8
    refused(errno.EINVAL, fs.setattr, node.ino, size=-1)
    fs.release(fh)
    assert fs.check_consistency() == []

    # Read-only opens may keep the kernel's page cache only while the data is unchanged.
    ro = fs.open(node.ino, os.O_RDONLY)
    assert not ro.direct_io and not ro.keep_cache
    fs.release(ro.fh)
    ro = fs.open(node.ino, os.O_RDONLY)
    assert ro.keep_cache
    fs.release(ro.fh)
    w = fs.open(node.ino, os.O_WRONLY)
    fs.write(w.fh, 0, b"H")
    ro = fs.open(node.ino, os.O_RDONLY)
    assert not ro.keep_cache  # changed, and still being written
    assert fs.read(ro.fh, 0, 1) == b"H"
    fs.release(ro.fh)
    fs.release(w.fh)

    # O_TRUNC empties the file, with the open, whatever the access mode: Linux truncates on
    # O_RDONLY|O_TRUNC too (and with atomic_o_trunc the kernel leaves it to us).
    t = fs.open(node.ino, os.O_WRONLY | os.O_TRUNC)
    assert fs.getattr(node.ino).size == 0 == index_row(fs, node.ino)["size"]
    fs.write(t.fh, 0, b"12345")
    fs.release(t.fh)
    assert read_all(fs, node.ino) == b"12345"
    ro = fs.open(node.ino, os.O_RDONLY | os.O_TRUNC)
    assert fs.getattr(node.ino).size == 0 == index_row(fs, node.ino)["size"]
    assert os.path.getsize(data_path(cache, node.ino)) == 0
    assert not ro.keep_cache  # the data changed
    fs.release(ro.fh)
    assert read_all(fs, node.ino) == b""

    # O_APPEND: every write lands at the current end, whatever offset it names.
    a = fs.open(node.ino, os.O_WRONLY | os.O_APPEND)
    w = fs.open(node.ino, os.O_WRONLY)
    fs.write(a.fh, 0, b"one")
    fs.write(w.fh, 3, b"-two-")
    fs.write(a.fh, 0, b"three")
    fs.release(a.fh)
    fs.release(w.fh)
    assert read_all(fs, node.ino) == b"one-two-three"

    refused(errno.EBADF, fs.flush, 9999)
    refused(errno.ENOENT, fs.getattr, 9999)

    fs.unlink(ROOT, b"f")
    refused(errno.ENOENT, fs.lookup, ROOT, b"f")
    refused(errno.ENOENT, fs.unlink, ROOT, b"f")
    assert names(fs, ROOT) == []
    assert fs.getattr(node.ino).nlink == 0  # the kernel still holds its references
    assert data_path(cache, node.ino).exists()
    assert fs.check_consistency() == []
    fs.forget(node.ino, node.lookups)
    refused(errno.ENOENT, fs.getattr, node.ino)
    assert index_row(fs, node.ino) is None
    assert not data_path(cache, node.ino).exists()
    assert fs.check_consistency() == []


def test_setattr_fields_and_persistence(fs, cache):
    ino = mkfile(fs, ROOT, b"f", b"x" * 10)
    before = fs.getattr(ino).ctime_ns
    fs.setattr(ino, mode=0o4711, uid=42, gid=43, atime_ns=1_000_000_001,
               mtime_ns=2_000_000_002)
    node = fs.getattr(ino)
    assert node.mode == stat.S_IFREG | 0o4711  # the file type bits are kept
    assert (node.uid, node.gid, node.atime_ns, node.mtime_ns) == (42, 43, 1_000_000_001,
                                                                  2_000_000_002)
    assert node.ctime_ns >= before
    d = mkdir(fs, ROOT, b"d")
    refused(errno.EISDIR, fs.setattr, d, size=0)
    link = fs.symlink(ROOT, b"l", b"f", UID, GID).ino
    refused(errno.EINVAL, fs.setattr, link, size=0)
    assert fs.check_consistency() == []
    fs.close()

    fs2 = CacheFs.load(cache)
    node = fs2.getattr(ino)
    assert node.mode == stat.S_IFREG | 0o4711
    assert (node.uid, node.gid, node.atime_ns, node.mtime_ns, node.size) == (
        42, 43, 1_000_000_001, 2_000_000_002, 10)
    assert fs2.check_consistency() == []
    fs2.close()


def test_open_and_mknod_refusals(fs):
    d = mkdir(fs, ROOT, b"d")
    refused(errno.EISDIR, fs.open, d, os.O_RDONLY)
    link = fs.symlink(ROOT, b"l", b"d", UID, GID).ino
    refused(errno.EINVAL, fs.open, link, os.O_RDONLY)
    # mknod makes regular files only; FIFOs, sockets and devices are refused.
    node = fs.mknod(ROOT, b"reg", stat.S_IFREG | 0o600, 0, UID, GID)
    assert node.mode == stat.S_IFREG | 0o600 and node.size == 0
    assert read_all(fs, node.ino) == b""
    for kind in (stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK):
        refused(errno.EPERM, fs.mknod, ROOT, b"special", kind | 0o600, 0, UID, GID)
    refused(errno.ENOENT, fs.lookup, ROOT, b"special")
    refused(errno.ENOTDIR, fs.create, node.ino, b"x", 0o644, RW, UID, GID)
    refused(errno.ENOTDIR, fs.lookup, node.ino, b"x")
    assert fs.check_consistency() == []


def test_hard_link_refused(fs):
    ino = mkfile(fs, ROOT, b"f", b"data")
    refused(errno.EPERM, fs.link, ino, ROOT, b"g")
    refused(errno.ENOENT, fs.lookup, ROOT, b"g")
    assert fs.getattr(ino).nlink == 1
    assert fs.check_consistency() == []


# ----------------------------------------------------------------------------------------------
# directories


def test_mkdir_rmdir(fs):
    a = mkdir(fs, ROOT, b"a")
    assert fs.getattr(ROOT).nlink == 3
    node = fs.getattr(a)
    assert stat.S_ISDIR(node.mode) and node.nlink == 2 and node.uid == UID
    refused(errno.EEXIST, fs.mkdir, ROOT, b"a", 0o755, UID, GID)
    b = mkdir(fs, a, b"b")
    assert fs.getattr(a).nlink == 3
    mkfile(fs, b, b"f")
    assert fs.lookup(b, b"..").ino == a
    assert fs.lookup(b, b".").ino == b
    assert fs.lookup(ROOT, b"..").ino == ROOT

    refused(errno.ENOTEMPTY, fs.rmdir, ROOT, b"a")
    refused(errno.ENOTEMPTY, fs.rmdir, a, b"b")
    refused(errno.ENOTDIR, fs.rmdir, b, b"f")
    refused(errno.ENOENT, fs.rmdir, ROOT, b"missing")
    refused(errno.EISDIR, fs.unlink, ROOT, b"a")
    refused(errno.ENOTDIR, fs.opendir, ino_of(fs, b, b"f"))
    assert fs.check_consistency() == []

    fs.unlink(b, b"f")
    fs.rmdir(a, b"b")
    assert fs.getattr(a).nlink == 2
    assert fs.getattr(b).nlink == 0  # still referenced by the kernel
    refused(errno.ENOENT, fs.lookup, a, b"b")
    assert fs.check_consistency() == []
    fs.rmdir(ROOT, b"a")
    assert fs.getattr(ROOT).nlink == 2
    assert names(fs, ROOT) == []
    forget(fs, b)
    forget(fs, a)
    assert index_row(fs, a) is None and index_row(fs, b) is None
    assert fs.check_consistency() == []


def test_remove_tree_of_a_deep_tree(fs):
    """remove_tree walks with an explicit stack: 1,500 levels (past Python's recursion limit)
    go, files and directories alike, and an open file stays readable until released."""
    top = d = mkdir(fs, ROOT, b"top")
    chain = [top]
    for i in range(1500):
        if i == 700:
            mkfile(fs, d, b"side", b"side")
        d = mkdir(fs, d, b"d")
        chain.append(d)
    bottom = mkfile(fs, d, b"f", b"bottom")
    fh = fs.open(bottom, os.O_RDONLY).fh
    fs.cache.tree.remove_tree(ROOT, b"top")
    assert fs.index.lookup(ROOT, b"top") is None and names(fs, ROOT) == []
    assert fs.getattr(ROOT).nlink == 2
    assert fs.read(fh, 0, 100) == b"bottom"  # still readable through its descriptor
    fs.release(fh)
    for ino in chain + [bottom]:
        forget(fs, ino)
    assert all(index_row(fs, ino) is None for ino in chain + [bottom])
    assert fs.check_consistency() == []


# ----------------------------------------------------------------------------------------------
# rename


def test_rename_file_over_file(fs, cache):
    a = mkfile(fs, ROOT, b"a", b"new")
    b = mkfile(fs, ROOT, b"b", b"old")
    old = fs.open(b, os.O_RDONLY)
    fs.rename(ROOT, b"a", ROOT, b"b")
    assert ino_of(fs, ROOT, b"b") == a
    assert names(fs, ROOT) == [b"b"]
    assert read_all(fs, a) == b"new"
    # The replaced file lives on while open (and known to the kernel).
    assert fs.getattr(b).nlink == 0
    assert fs.read(old.fh, 0, 10) == b"old"
    assert fs.check_consistency() == []
    fs.release(old.fh)
    fs.forget(b, 1)
    assert index_row(fs, b) is None and not data_path(cache, b).exists()

    # Renaming a name onto itself (same inode) does nothing.
    fs.rename(ROOT, b"b", ROOT, b"b")
    assert ino_of(fs, ROOT, b"b") == a
    refused(errno.ENOENT, fs.rename, ROOT, b"missing", ROOT, b"x")
    refused(errno.ENAMETOOLONG, fs.rename, ROOT, b"b", ROOT, b"n" * 256)
    assert ino_of(fs, ROOT, b"b") == a
    assert fs.check_consistency() == []


def test_rename_directory_over_empty_directory(fs):
    src_parent = mkdir(fs, ROOT, b"p1")
    dst_parent = mkdir(fs, ROOT, b"p2")
    src = mkdir(fs, src_parent, b"d")
    mkfile(fs, src, b"inside", b"payload")
    victim = mkdir(fs, dst_parent, b"target")
    assert (fs.getattr(src_parent).nlink, fs.getattr(dst_parent).nlink) == (3, 3)

    fs.rename(src_parent, b"d", dst_parent, b"target")
    assert ino_of(fs, dst_parent, b"target") == src
    assert names(fs, src_parent) == []
    assert read_all(fs, ino_of(fs, src, b"inside")) == b"payload"
    assert fs.getattr(victim).nlink == 0
    assert (fs.getattr(src_parent).nlink, fs.getattr(dst_parent).nlink) == (2, 3)
    assert fs.lookup(src, b"..").ino == dst_parent
    assert fs.check_consistency() == []
    fs.forget(victim, 1)
    assert index_row(fs, victim) is None

    # Same-directory rename of a directory over an empty one.
    empty = mkdir(fs, dst_parent, b"empty")
    fs.rename(dst_parent, b"target", dst_parent, b"empty")
    assert names(fs, dst_parent) == [b"empty"]
    assert ino_of(fs, dst_parent, b"empty") == src
    assert fs.getattr(dst_parent).nlink == 3 and fs.getattr(empty).nlink == 0
    assert fs.check_consistency() == []


def test_rename_refusals(fs):
    d = mkdir(fs, ROOT, b"d")
    full = mkdir(fs, ROOT, b"full")
    mkfile(fs, full, b"x")
    f = mkfile(fs, ROOT, b"f")
    sub = mkdir(fs, d, b"sub")
    deep = mkdir(fs, sub, b"deep")

    refused(errno.ENOTEMPTY, fs.rename, ROOT, b"d", ROOT, b"full")
    refused(errno.EISDIR, fs.rename, ROOT, b"f", ROOT, b"d")
    refused(errno.ENOTDIR, fs.rename, ROOT, b"d", ROOT, b"f")
    refused(errno.EINVAL, fs.rename, ROOT, b"d", d, b"inside")
    refused(errno.EINVAL, fs.rename, ROOT, b"d", deep, b"inside")
    refused(errno.EINVAL, fs.rename, d, b"sub", deep, b"x")
    refused(errno.EEXIST, fs.rename, ROOT, b"f", ROOT, b"d", RENAME_NOREPLACE)
    refused(errno.EEXIST, fs.rename, ROOT, b"d", ROOT, b"full", RENAME_NOREPLACE)
    for flags in (RENAME_WHITEOUT, RENAME_NOREPLACE | RENAME_EXCHANGE, 8, 1 << 31):
        refused(errno.EINVAL, fs.rename, ROOT, b"f", ROOT, b"g", flags)
    refused(errno.ENOENT, fs.rename, ROOT, b"f", ROOT, b"missing", RENAME_EXCHANGE)
    refused(errno.ENOTDIR, fs.rename, f, b"x", ROOT, b"y")
    # Nothing moved.
    assert names(fs, ROOT) == [b"d", b"full", b"f"]
    assert (ino_of(fs, ROOT, b"d"), ino_of(fs, d, b"sub"), ino_of(fs, sub, b"deep")) == (
        d, sub, deep)
    assert fs.getattr(ROOT).nlink == 4 and fs.getattr(full).nlink == 2

    # Moving a directory sideways or up (not into itself) is fine.
    fs.rename(sub, b"deep", ROOT, b"deep")
    fs.rename(ROOT, b"f", ROOT, b"g", RENAME_NOREPLACE)
    assert ino_of(fs, ROOT, b"g") == f
    assert fs.getattr(ROOT).nlink == 5 and fs.getattr(sub).nlink == 2
    assert fs.check_consistency() == []


def test_rename_exchange(fs):
    d1 = mkdir(fs, ROOT, b"d1")
    d2 = mkdir(fs, ROOT, b"d2")
    f = mkfile(fs, d1, b"f", b"file data")
    sub = mkdir(fs, d2, b"sub")
    mkfile(fs, sub, b"child", b"child data")
    assert (fs.getattr(d1).nlink, fs.getattr(d2).nlink) == (2, 3)

    fs.rename(d1, b"f", d2, b"sub", RENAME_EXCHANGE)
    assert ino_of(fs, d1, b"f") == sub
    assert ino_of(fs, d2, b"sub") == f
    assert (fs.getattr(d1).nlink, fs.getattr(d2).nlink) == (3, 2)
    assert (fs.getattr(f).nlink, fs.getattr(sub).nlink) == (1, 2)
    assert read_all(fs, ino_of(fs, sub, b"child")) == b"child data"
    assert read_all(fs, f) == b"file data"
    assert fs.lookup(sub, b"..").ino == d1
    assert fs.check_consistency() == []

    # ... and back, the other way round.
    fs.rename(d2, b"sub", d1, b"f", RENAME_EXCHANGE)
    assert (ino_of(fs, d1, b"f"), ino_of(fs, d2, b"sub")) == (f, sub)
    assert (fs.getattr(d1).nlink, fs.getattr(d2).nlink) == (2, 3)

    # Two files in one directory; two directories across directories.
    g = mkfile(fs, d1, b"g", b"g data")
    fs.rename(d1, b"f", d1, b"g", RENAME_EXCHANGE)
    assert (ino_of(fs, d1, b"f"), ino_of(fs, d1, b"g")) == (g, f)
    other = mkdir(fs, d1, b"other")
    fs.rename(d1, b"other", d2, b"sub", RENAME_EXCHANGE)
    assert (ino_of(fs, d1, b"other"), ino_of(fs, d2, b"sub")) == (sub, other)
    assert (fs.getattr(d1).nlink, fs.getattr(d2).nlink) == (3, 3)

    # A directory cannot be exchanged with something inside itself.
    refused(errno.EINVAL, fs.rename, d1, b"other", sub, b"child", RENAME_EXCHANGE)
    refused(errno.EINVAL, fs.rename, sub, b"child", d1, b"other", RENAME_EXCHANGE)
    assert ino_of(fs, d1, b"other") == sub
    assert fs.check_consistency() == []


# ----------------------------------------------------------------------------------------------
# unlink while open, crash recovery


def test_unlink_open_file_keeps_data_until_release(fs, cache):
    res, node = fs.create(ROOT, b"f", 0o644, RW, UID, GID)
    fs.write(res.fh, 0, b"abc")
    fs.unlink(ROOT, b"f")
    refused(errno.ENOENT, fs.lookup, ROOT, b"f")
    fs.forget(node.ino, node.lookups)  # the kernel forgets the name; the fd keeps the inode
    assert fs.getattr(node.ino).nlink == 0
    assert fs.write(res.fh, 3, b"def") == 3
    assert fs.read(res.fh, 0, 10) == b"abcdef"
    assert data_path(cache, node.ino).exists()
    assert fs.check_consistency() == []
    # A new file of the same name is a different inode.
    other = mkfile(fs, ROOT, b"f", b"other")
    assert other != node.ino
    assert fs.read(res.fh, 0, 10) == b"abcdef"
    fs.release(res.fh)
    assert not data_path(cache, node.ino).exists()
    assert index_row(fs, node.ino) is None
    refused(errno.ENOENT, fs.getattr, node.ino)
    assert read_all(fs, other) == b"other"
    assert fs.check_consistency() == []


def test_recover_removes_orphans_after_crash(fs, cache):
    keep = mkfile(fs, ROOT, b"keep", b"kept")
    res, node = fs.create(ROOT, b"open-unlinked", 0o644, RW, UID, GID)
    fs.write(res.fh, 0, b"x" * 4096)
    fs.unlink(ROOT, b"open-unlinked")
    d = mkdir(fs, ROOT, b"d")
    fs.rmdir(ROOT, b"d")  # the kernel still holds a reference: the row stays
    assert index_row(fs, node.ino)["nlink"] == 0 and index_row(fs, d)["nlink"] == 0
    assert fs.check_consistency() == []
    crash(fs)

    fs2, report = reopen(cache)
    assert report == {"orphans": 2, "resized": 0, "stray_files": 0, "missing_files": 0}
    assert index_row(fs2, node.ino) is None and index_row(fs2, d) is None
    assert not data_path(cache, node.ino).exists()
    assert names(fs2, ROOT) == [b"keep"]
    assert read_all(fs2, keep) == b"kept"
    assert fs2.cache.recover() == dict.fromkeys(report, 0)  # idempotent
    assert fs2.check_consistency() == []
    fs2.close()


def test_recover_sizes_from_cache_files_after_crash(fs, cache):
    grown = mkfile(fs, ROOT, b"grown", b"a" * 100)
    res, node = fs.create(ROOT, b"unflushed", 0o644, RW, UID, GID)
    data = os.urandom(300_000)
    fs.write(res.fh, 0, data)
    g = fs.open(grown, RW)
    fs.write(g.fh, 100, b"b" * 50)  # never flushed either
    assert index_row(fs, node.ino)["size"] == 0
    assert index_row(fs, grown)["size"] == 100
    assert fs.check_consistency() == []
    crash(fs)
    # Debris a crash can leave: a cache file whose inode never committed.
    stray = data_path(cache, 987654)
    stray.write_bytes(b"junk")

    fs2, report = reopen(cache)
    assert report == {"orphans": 0, "resized": 2, "stray_files": 1, "missing_files": 0}
    assert not stray.exists()
    assert fs2.getattr(node.ino).size == len(data) == index_row(fs2, node.ino)["size"]
    assert read_all(fs2, node.ino) == data
    assert read_all(fs2, grown) == b"a" * 100 + b"b" * 50
    assert fs2.cache.recover() == dict.fromkeys(report, 0)
    assert fs2.check_consistency() == []
    fs2.close()

    # CacheFs.load runs the same recovery.
    fs3 = CacheFs.load(cache)
    assert read_all(fs3, node.ino) == data
    assert fs3.check_consistency() == []
    fs3.close()


def test_recover_recreates_missing_cache_file(fs, cache):
    ino = mkfile(fs, ROOT, b"f", b"data")
    fs.close()
    data_path(cache, ino).unlink()
    fs2, report = reopen(cache)
    assert report == {"orphans": 0, "resized": 1, "stray_files": 0, "missing_files": 1}
    assert fs2.getattr(ino).size == 0 and read_all(fs2, ino) == b""
    assert fs2.check_consistency() == []
    fs2.close()


def test_close_persists_dirty_sizes_and_purges_orphans(fs, cache):
    res, node = fs.create(ROOT, b"f", 0o644, RW, UID, GID)
    fs.write(res.fh, 0, b"z" * 1000)
    _open_fh, gone = fs.create(ROOT, b"g", 0o644, RW, UID, GID)
    fs.unlink(ROOT, b"g")
    assert fs.check_consistency() == []
    fs.close()  # the kernel unmounted: handles and references are gone
    assert not data_path(cache, gone.ino).exists()
    fs2, report = reopen(cache)
    assert report == dict.fromkeys(report, 0)
    assert fs2.getattr(node.ino).size == 1000
    assert index_row(fs2, gone.ino) is None
    assert fs2.check_consistency() == []
    fs2.close()


def test_check_consistency_detects_damage(fs, cache):
    ino = mkfile(fs, ROOT, b"f", b"data")
    assert fs.check_consistency() == []
    data_path(cache, ino).write_bytes(b"longer data")
    assert fs.check_consistency() == [f"inode {ino} size 4 != cache file 11"]
    data_path(cache, ino).unlink()
    assert fs.check_consistency() == [f"cache file of inode {ino} missing"]
    data_path(cache, ino).write_bytes(b"data")
    assert fs.check_consistency() == []


# ----------------------------------------------------------------------------------------------
# readdir


def test_readdir_offsets_stable_under_concurrent_changes(fs):
    d = mkdir(fs, ROOT, b"d")
    stable, churn = [], []
    for i in range(600):  # more than one index batch (READDIR_BATCH)
        name = f"s{i:04d}".encode()
        mkfile(fs, d, name)
        stable.append(name)
        if i % 3 == 0:
            mkfile(fs, d, f"c{i:04d}".encode())
            churn.append(f"c{i:04d}".encode())
    assert sorted(names(fs, d)) == sorted(stable + churn)

    # List like the kernel does: a few entries per request, resuming at the last offset, with
    # creates and unlinks in between (before and after the current position).
    for chunk in (1, 7, 100):
        seen: list[bytes] = []
        offset, created = 0, 0
        while True:
            batch = []
            for next_id, name, _node in fs.readdir(d, offset):
                batch.append(name)
                offset = next_id
                if len(batch) == chunk:
                    break
            if not batch:
                break
            seen += batch
            if churn:
                fs.unlink(d, churn.pop(0))           # maybe already listed, maybe not
            if churn:
                fs.unlink(d, churn.pop())            # most likely not listed yet
            if created < 50:  # bounded, or a one-entry-per-step listing would never end
                new = f"n{chunk}-{created}".encode()
                mkfile(fs, d, new)
                churn.append(new)
                created += 1
        for name in stable:
            assert seen.count(name) == 1, name
        assert len(seen) == len(set(seen))
        assert fs.check_consistency() == []
    assert sorted(names(fs, d)) == sorted(stable + churn)
    refused(errno.ENOTDIR, fs.opendir, ino_of(fs, d, b"s0000"))
    assert fs.check_consistency() == []


def test_readdir_sees_a_replaced_name_exactly_once(fs):
    """A name replaced by rename (tmp -> final, `latest`) exists for the whole listing: a
    listing that is under way when the rename happens reports it exactly once, whichever of
    the two entries it had passed."""
    for replacement_first in (True, False):
        for stop_after in range(1, 5):  # the listing has passed 1, 2, 3 or 4 entries
            d = mkdir(fs, ROOT, f"d-{replacement_first}-{stop_after}".encode())
            # Directory order: [a, tmp, final, z] or [a, final, tmp, z].
            first, second = (b"tmp", b"final") if replacement_first else (b"final", b"tmp")
            for name in (b"a", first, second, b"z"):
                mkfile(fs, d, name, name)
            seen, offset = [], 0
            for next_id, name, _node in fs.readdir(d, 0):
                seen.append(name)
                offset = next_id
                if len(seen) == stop_after:
                    break
            fs.rename(d, b"tmp", d, b"final")
            seen += [name for _, name, _ in fs.readdir(d, offset)]
            case = (replacement_first, stop_after, seen)
            assert seen.count(b"final") == 1, case
            assert seen.count(b"a") == 1 and seen.count(b"z") == 1, case
            assert read_all(fs, ino_of(fs, d, b"final")) == b"tmp"
            assert names(fs, d) == [b"a", b"final", b"z"]
    assert fs.check_consistency() == []


# ----------------------------------------------------------------------------------------------
# xattrs


def test_xattrs(fs, cache):
    ino = mkfile(fs, ROOT, b"f")
    bare = mkfile(fs, ROOT, b"bare")
    assert fs.listxattr(ino) == []
    refused(errno.ENODATA, fs.getxattr, ino, b"user.a")
    fs.setxattr(ino, b"user.b", b"2")
    fs.setxattr(ino, b"user.a", b"1")
    fs.setxattr(ino, b"trusted.bin", bytes(range(256)))
    assert fs.getxattr(ino, b"user.a") == b"1"
    assert fs.getxattr(ino, b"trusted.bin") == bytes(range(256))
    assert sorted(fs.listxattr(ino)) == [b"trusted.bin", b"user.a", b"user.b"]
    fs.setxattr(ino, b"user.a", b"one")  # replace
    assert fs.getxattr(ino, b"user.a") == b"one"
    fs.setxattr(ino, b"user.empty", b"")
    assert fs.getxattr(ino, b"user.empty") == b""
    fs.removexattr(ino, b"user.b")
    refused(errno.ENODATA, fs.getxattr, ino, b"user.b")
    refused(errno.ENODATA, fs.removexattr, ino, b"user.b")
    assert sorted(fs.listxattr(ino)) == [b"trusted.bin", b"user.a", b"user.empty"]

    # system.* (POSIX ACLs) are not implemented: ENOTSUP, whether or not the inode has
    # other xattrs.
    for node in (ino, bare):
        for op, args in ((fs.getxattr, ()), (fs.setxattr, (b"\x02\0\0\0",)),
                         (fs.removexattr, ())):
            refused(errno.ENOTSUP, op, node, b"system.posix_acl_access", *args)
    refused(errno.E2BIG, fs.setxattr, ino, b"user.big", b"v" * (64 * 1024 + 1))
    fs.setxattr(ino, b"user.max", b"v" * (64 * 1024))
    refused(errno.ERANGE, fs.setxattr, ino, b"user." + b"n" * 251, b"v")
    refused(errno.EINVAL, fs.setxattr, ino, b"", b"v")
    refused(errno.ENOENT, fs.setxattr, 9999, b"user.a", b"v")
    refused(errno.ENOENT, fs.getxattr, 9999, b"user.a")
    refused(errno.ENOENT, fs.listxattr, 9999)
    assert fs.listxattr(bare) == []
    assert fs.check_consistency() == []
    fs.close()

    fs2 = CacheFs.load(cache)
    assert fs2.getxattr(ino, b"user.a") == b"one"
    assert len(fs2.getxattr(ino, b"user.max")) == 64 * 1024
    # Deleting the inode deletes its xattrs.
    fs2.lookup(ROOT, b"f")
    fs2.unlink(ROOT, b"f")
    fs2.forget(ino, 1)
    count = fs2.index.conn.execute("SELECT COUNT(*) FROM xattrs WHERE ino=?", (ino,))
    assert count.fetchone()[0] == 0
    assert fs2.check_consistency() == []
    fs2.close()


# ----------------------------------------------------------------------------------------------
# names, symlinks


def test_names_longer_than_255_bytes(fs):
    long, ok = b"n" * 256, b"n" * 255
    refused(errno.ENAMETOOLONG, fs.create, ROOT, long, 0o644, RW, UID, GID)
    refused(errno.ENAMETOOLONG, fs.mkdir, ROOT, long, 0o755, UID, GID)
    refused(errno.ENAMETOOLONG, fs.symlink, ROOT, long, b"t", UID, GID)
    refused(errno.ENAMETOOLONG, fs.mknod, ROOT, long, stat.S_IFREG | 0o644, 0, UID, GID)
    refused(errno.ENAMETOOLONG, fs.lookup, ROOT, long)
    mkfile(fs, ROOT, ok, b"x")
    refused(errno.ENAMETOOLONG, fs.rename, ROOT, ok, ROOT, long)
    assert names(fs, ROOT) == [ok]
    assert fs.lookup(ROOT, ok).size == 1
    # Multi-byte UTF-8 counts bytes, not characters.
    refused(errno.ENAMETOOLONG, fs.mkdir, ROOT, "é".encode() * 128, 0o755, UID, GID)
    mkdir(fs, ROOT, "é".encode() * 127)
    assert fs.check_consistency() == []


def test_symlink_readlink(fs, cache):
    node = fs.symlink(ROOT, b"latest", b"step_100", UID, GID)
    assert node.mode == stat.S_IFLNK | 0o777 and node.size == len(b"step_100")
    assert fs.readlink(node.ino) == b"step_100"
    assert fs.lookup(ROOT, b"latest").ino == node.ino
    refused(errno.EEXIST, fs.symlink, ROOT, b"latest", b"x", UID, GID)
    f = mkfile(fs, ROOT, b"f")
    refused(errno.EINVAL, fs.readlink, f)
    refused(errno.EINVAL, fs.readlink, ROOT)
    refused(errno.ENAMETOOLONG, fs.symlink, ROOT, b"long", b"t" * 4096, UID, GID)
    odd = fs.symlink(ROOT, b"odd", b"/abs/../\xff\x00x" + b"t" * 4000, UID, GID)
    # Atomic replacement of `latest`: a tmp symlink renamed over it.
    tmp = fs.symlink(ROOT, b"latest.tmp", b"step_200", UID, GID)
    fs.rename(ROOT, b"latest.tmp", ROOT, b"latest")
    assert fs.readlink(fs.lookup(ROOT, b"latest").ino) == b"step_200"
    assert fs.lookup(ROOT, b"latest").ino == tmp.ino
    assert fs.getattr(node.ino).nlink == 0
    forget(fs, node.ino)
    assert index_row(fs, node.ino) is None
    assert fs.check_consistency() == []
    fs.close()

    fs2 = CacheFs.load(cache)
    assert fs2.readlink(tmp.ino) == b"step_200"
    assert fs2.readlink(odd.ino) == b"/abs/../\xff\x00x" + b"t" * 4000
    assert isinstance(fs2.readlink(odd.ino), bytes)
    assert fs2.check_consistency() == []
    fs2.close()


# ----------------------------------------------------------------------------------------------
# layout


def test_layout_version_mismatch_refused(fs, cache):
    mkfile(fs, ROOT, b"f", b"data")
    assert fs.check_consistency() == []
    fs.close()
    layout = cache / "layout.json"
    assert json.loads(layout.read_text()) == LAYOUT

    layout.write_text(json.dumps({**LAYOUT, "version": LAYOUT["version"] + 1}))
    with pytest.raises(FsError) as e:
        CacheFs.load(cache)
    assert e.value.errno == errno.EIO and "layout" in str(e.value)
    layout.write_text("{not json")
    with pytest.raises(FsError) as e:
        CacheFs.load(cache)
    assert e.value.errno == errno.EIO

    layout.write_text(json.dumps(LAYOUT))
    conn = sqlite3.connect(cache / "index.sqlite")
    conn.execute("PRAGMA user_version=2")
    conn.close()
    with pytest.raises(FsError) as e:
        CacheFs.load(cache)
    assert e.value.errno == errno.EIO and "layout version 2" in str(e.value)

    # The refusals changed nothing: back at the right version, everything is there.
    conn = sqlite3.connect(cache / "index.sqlite")
    conn.execute("PRAGMA user_version=1")
    conn.close()
    fs2 = CacheFs.load(cache)
    assert read_all(fs2, fs2.lookup(ROOT, b"f").ino) == b"data"
    assert fs2.check_consistency() == []
    fs2.close()


# -- the index's tree queries and the async layer (cachemgr.core.fs.Filesystem) ----------------


def test_index_tree_queries(fs):
    a = fs.mkdir(ROOT, b"a", 0o755, UID, GID)
    b = fs.mkdir(a.ino, b"b c", 0o755, UID, GID)
    _res, f = fs.create(b.ino, b"f", 0o644, RW, UID, GID)
    fs.release(_res.fh)
    idx = fs.index
    assert idx.dentry_of(f.ino) == (b.ino, b"f")
    assert idx.dentry_of(ROOT) is None
    assert idx.is_ancestor(a.ino, f.ino) and idx.is_ancestor(ROOT, b.ino)
    assert not idx.is_ancestor(b.ino, a.ino)
    walked = [(p, n, i, rel) for p, n, i, rel in idx.walk(ROOT)]
    assert walked == [(ROOT, b"a", a.ino, "a"), (a.ino, b"b c", b.ino, "a/b c"),
                      (b.ino, b"f", f.ino, "a/b c/f")]
    assert idx.children(a.ino) == [(b"b c", b.ino)]
    (row,) = idx.children_with_inodes(b.ino)
    assert row[:3] == (b"f", f.ino, f.mode)
    with idx.tx():
        idx.set_meta("part:7", "x")
        idx.set_meta("part_%", "y")
        idx.set_meta("partial", "z")
    assert idx.meta_with_prefix("part:") == [("part:7", "x")]
    assert idx.meta_with_prefix("part_%") == [("part_%", "y")]
    with idx.tx():
        idx.delete_meta("part:7")
    assert idx.meta("part:7") is None and idx.meta("partial") == "z"
    assert fs.check_consistency() == []


class _Reads:
    """A stand-in for cachemgr.restore.restorer.Restorer: fills a file from `data` when asked."""

    def __init__(self, fs: CacheFs, data: bytes) -> None:
        self.fs, self.data = fs, data
        self.clean: set[int] = set()
        self.calls: list[tuple] = []

    def _fill(self, ino: int) -> None:
        with open(self.fs.cache.files.path(ino), "r+b") as f:
            f.write(self.data)
        self.fs.cache.residency.fetched(ino, len(self.data))
        self.clean.add(ino)

    async def ensure_all(self, ino: int) -> None:
        self.calls.append(("all", ino))
        self._fill(ino)

    async def ensure_range(self, ino: int, off: int, size: int, *, read: bool = False) -> None:
        self.calls.append(("range", ino, off, size))
        self._fill(ino)

    async def read_uncached(self, ino: int, off: int, size: int) -> bytes:
        raise AssertionError("not reached")

    async def verify_cached(self, ino: int, off: int, size: int) -> None:
        self.calls.append(("verify", ino))
        self.clean.add(ino)

    def on_open(self, ino: int) -> None:
        self.calls.append(("open", ino))

    def trusted(self, ino: int) -> bool:
        return ino in self.clean


class _Room:
    def __init__(self, limit: int) -> None:
        self.asked: list[int] = []
        self.limit = limit
        self.capacity = limit

    async def wait_for_room(self, need: int) -> None:
        self.asked.append(need)


def test_filesystem_read_through_and_backpressure(fs):
    import trio

    from cachemgr.core.fs import Filesystem

    data = b"restored bytes"
    ino = fs.cache.tree.raw_create(ROOT, b"r", stat.S_IFREG | 0o644, size=len(data), obj="{}")
    w = fs.cache.tree.raw_create(ROOT, b"w", stat.S_IFREG | 0o644, size=len(data), obj="{}")
    fsys = Filesystem(fs, Foreground())
    # No store: an evicted file cannot be opened for writing (nothing to fetch it from).
    with pytest.raises(FsError) as e:
        trio.run(fsys.open, w, os.O_WRONLY, None)
    assert e.value.errno == errno.EIO
    reads, room = _Reads(fs, data), _Room(len(data) + 4)
    fs = local(fs.cache, reads=reads, room=room)
    fsys = Filesystem(fs, Foreground())
    res = trio.run(fsys.open, ino, os.O_RDONLY, None)
    assert reads.calls == [("open", ino)]
    assert trio.run(fsys.read, res.fh, 0, 100) == data
    assert reads.calls[1] == ("range", ino, 0, 100)
    fs.release(res.fh)
    # A write-open without O_TRUNC fetches the whole file first.
    res = trio.run(fsys.open, w, os.O_WRONLY, None)
    assert ("all", w) in reads.calls and fs.cache.table.get(w).cached == 1
    # Under --cache-size a write past the limit waits for room first, then writes.
    assert trio.run(fsys.write, res.fh, len(data), b"x" * 10) == 10
    assert room.asked == [10]
    assert trio.run(fsys.write, res.fh, 0, b"y") == 1 and room.asked == [10, 1]
    fs.release(res.fh)
    assert fs.files.cached_bytes == 2 * len(data) + 10
    assert fs.statistics().files.cached_bytes == fs.files.cached_bytes
    assert fs.check_consistency() == []


def test_fallocate_within_cache_size_waits_while_room_is_made_over_it_is_refused(fs):
    """Room below --cache-size that can be made (replicas held for other nodes, evictable data)
    is not a reason to refuse: a fallocate larger than the room's current limit but within
    --cache-size waits for room; one larger than --cache-size itself is ENOSPC."""
    import trio

    from cachemgr.core.fs import Filesystem

    MiB = 1 << 20
    room = _Room(4 * MiB)
    room.capacity = 16 * MiB        # 12 MiB of it held by what can be dropped
    fsys = Filesystem(local(fs.cache, room=room), Foreground())
    res, node = fsys.core.create(ROOT, b"big", 0o644, os.O_RDWR | os.O_CREAT, UID, GID)
    trio.run(fsys.fallocate, res.fh, 0, 0, 8 * MiB)
    assert room.asked == [8 * MiB] and node.size == 8 * MiB
    with pytest.raises(FsError) as e:
        trio.run(fsys.fallocate, res.fh, 0, 0, 26 * MiB)   # 18 MiB more than it holds
    assert e.value.errno == errno.ENOSPC and node.size == 8 * MiB
    assert room.asked == [8 * MiB]
    fsys.core.release(res.fh)
    assert fs.check_consistency() == []


def test_residency_and_restored_entries_change_memory_only_with_the_index(fs, monkeypatch):
    """evict, fetched and raw_create change the inode table and the cache files only when their
    index transaction commits: a full index leaves memory, index and cache files agreeing."""
    from cachemgr.core.index import IndexFull

    ino = mkfile(fs, ROOT, b"f", b"data" * 100)
    node = fs.cache.table.get(ino)
    fs.index.set_uploaded(ino, node.version, "{}")   # its content is in the store
    real = fs.index.set_cached

    def full(*a):
        raise IndexFull("injected: cache disk full", released=False)
    monkeypatch.setattr(fs.index, "set_cached", full)
    with pytest.raises(IndexFull):
        fs.cache.residency.evict(ino, node.version)
    assert node.cached == 1 and os.path.getsize(fs.files.path(ino)) == 400
    assert fs.check_consistency() == []
    monkeypatch.setattr(fs.index, "set_cached", real)
    assert fs.cache.residency.evict(ino, node.version) and node.cached == 0
    monkeypatch.setattr(fs.index, "set_cached", full)
    with pytest.raises(IndexFull):
        fs.cache.residency.fetched(ino, 400)
    assert node.cached == 0
    assert fs.check_consistency() == []
    monkeypatch.setattr(fs.index, "set_cached", real)

    # a restored file whose entry cannot be recorded leaves no cache file behind
    monkeypatch.setattr(fs.index, "add_dentry", full)
    before = set(os.listdir(fs.files.path(ino).rsplit("/", 1)[0]))
    with pytest.raises(IndexFull):
        fs.cache.tree.raw_create(ROOT, b"r", stat.S_IFREG | 0o644, size=10, obj="{}")
    assert set(os.listdir(fs.files.path(ino).rsplit("/", 1)[0])) == before
    assert fs.index.lookup(ROOT, b"r") is None
    assert fs.check_consistency() == []


def test_bytes_written_into_a_hole_count_as_they_are_written(fs):
    """A file truncated up (a hole: no block) and then written below its end: the written
    bytes count in cached_bytes at each write (--cache-size backpressure sees them), not only
    at the close, which then recounts from the blocks exactly."""
    MiB = 1 << 20
    res, node = fs.create(ROOT, b"sparse", 0o644, os.O_RDWR | os.O_CREAT, UID, GID)
    fs.setattr(node.ino, size=16 * MiB)
    base = fs.files.cached_bytes
    assert fs.files.hole(node.ino) == 16 * MiB
    fs.write(res.fh, 0, b"a" * (4 * MiB))
    assert fs.files.cached_bytes == base + 4 * MiB
    fs.write(res.fh, 0, b"b" * (4 * MiB))   # the same range again: counted at most the hole
    assert base + 4 * MiB <= fs.files.cached_bytes <= base + 8 * MiB
    fs.write(res.fh, 14 * MiB, b"c" * (4 * MiB))   # half in the hole, half past the end
    fs.flush(res.fh)
    fs.release(res.fh)
    blocks = os.stat(fs.files.path(node.ino)).st_blocks * 512
    assert fs.files.cached_bytes == base + blocks        # the close's recount: exactly the blocks
    assert fs.check_consistency() == []


def test_fallocate_grows_reserves_and_punches_and_counts_the_blocks(fs):
    """fallocate on a writable handle does on the cache file what the cache disk does (mode 0
    grows the file, KEEP_SIZE reserves past the end, PUNCH_HOLE zeroes), and cached_bytes
    follows the blocks (--cache-size counts what the disk holds); a read-only handle or a mode
    FUSE does not pass on is refused and changes nothing."""
    from cachemgr.core.filecache import FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE

    MiB = 1 << 20
    res, node = fs.create(ROOT, b"pre", 0o644, os.O_RDWR | os.O_CREAT, UID, GID)
    path = fs.files.path(node.ino)
    base = fs.files.cached_bytes
    gen, mtime = node.gen, node.mtime_ns
    fs.fallocate(res.fh, 0, 0, 8 * MiB)
    assert node.size == os.path.getsize(path) == 8 * MiB and node.dirty
    assert node.gen > gen and node.mtime_ns >= mtime
    assert fs.files.cached_bytes == base + 8 * MiB
    assert os.stat(path).st_blocks * 512 >= 8 * MiB     # reserved, not a hole
    fs.write(res.fh, 0, b"a" * (6 * MiB))
    assert fs.files.cached_bytes == base + 8 * MiB            # written into reserved blocks
    fs.fallocate(res.fh, FALLOC_FL_KEEP_SIZE, 8 * MiB, 4 * MiB)
    assert node.size == os.path.getsize(path) == 8 * MiB
    fs.fallocate(res.fh, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4 * MiB)
    assert node.size == 8 * MiB
    assert fs.read(res.fh, 0, 6 * MiB) == b"\0" * (4 * MiB) + b"a" * (2 * MiB)
    blocks = os.stat(path).st_blocks * 512
    assert fs.files.cached_bytes == base + min(8 * MiB, blocks)
    refused(errno.EOPNOTSUPP, fs.fallocate, res.fh, 0x08, 0, MiB)    # COLLAPSE_RANGE
    refused(errno.EINVAL, fs.fallocate, res.fh, 0, 0, 0)
    fs.flush(res.fh)
    fs.release(res.fh)
    ro = fs.open(node.ino, os.O_RDONLY)
    refused(errno.EBADF, fs.fallocate, ro.fh, 0, 0, 16 * MiB)
    assert node.size == 8 * MiB
    fs.release(ro.fh)
    assert fs.check_consistency() == []
