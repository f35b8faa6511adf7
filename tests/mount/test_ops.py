"""Every filesystem operation through a real mount, with the errno of every refusal.

Each test drives the kernel with ordinary `os` calls on a started mount (`mnt`), so the path is
application -> VFS -> FUSE -> daemon -> cachemgr.core.fs. Where the kernel's VFS answers a refusal
itself before the request reaches the daemon (noted at the assertion), the test asserts what
Linux returns, which is what applications see.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import random
import sqlite3
import stat
import struct
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import _alive, run_cli, wait_for

MiB = 1 << 20
AT_FDCWD = -100
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4

_libc = ctypes.CDLL(None, use_errno=True)


def renameat2(old: Path, new: Path, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(old))


_SYS_GETDENTS64 = {"x86_64": 217, "aarch64": 61}.get(platform.machine())


def list_small_buffer(path: Path, bufsize: int = 1024) -> list[str]:
    """List a directory with getdents64 and a small buffer: the kernel then fetches it from
    the daemon in many READDIR requests (os.scandir's 32 KiB buffer needs only a few), each
    resuming at the offset the previous one ended with."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = ctypes.create_string_buffer(bufsize)
        out = []
        while True:
            n = _libc.syscall(ctypes.c_long(_SYS_GETDENTS64), ctypes.c_int(fd), buf,
                              ctypes.c_uint(bufsize))
            if n < 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(path))
            if n == 0:
                return out
            raw, pos = buf.raw[:n], 0
            while pos < n:
                reclen = struct.unpack_from("<H", raw, pos + 16)[0]  # d_ino, d_off, d_reclen
                name = raw[pos + 19:pos + reclen].split(b"\0", 1)[0]
                if name not in (b".", b".."):
                    out.append(os.fsdecode(name))
                pos += reclen
    finally:
        os.close(fd)


def refused(err: int, fn, *args, **kw) -> None:
    with pytest.raises(OSError) as e:
        fn(*args, **kw)
    assert e.value.errno == err, (
        f"{getattr(fn, '__name__', fn)}: {e.value} (wanted {errno.errorcode[err]})")


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def index_size(mnt, ino: int) -> int:
    """The size the daemon's index holds for `ino` (read-only peek at the live index)."""
    conn = sqlite3.connect(f"file:{mnt.cache_dir / 'index.sqlite'}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT size FROM inodes WHERE ino=?", (ino,)).fetchone()[0]
    finally:
        conn.close()


def cache_file(mnt, p: Path) -> Path:
    return mnt.cache_dir / "data" / str(os.stat(p).st_ino)


# ----------------------------------------------------------------------------------------------
# lookup, getattr, create, open, read, write


def test_create_open_read_write(mnt):
    root = mnt.path
    p = root / "f.bin"
    refused(errno.ENOENT, os.stat, p)
    refused(errno.ENOENT, os.open, p, os.O_RDONLY)

    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o640)
    try:
        st = os.stat(p)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
        assert (st.st_nlink, st.st_size, st.st_uid, st.st_gid) == (1, 0, os.getuid(),
                                                                   os.getgid())
        assert st.st_blksize == MiB  # buffered writers send 1 MiB requests
        assert st.st_ino == os.fstat(fd).st_ino
        refused(errno.EEXIST, os.open, p, os.O_CREAT | os.O_EXCL | os.O_WRONLY)

        # Writes at any offset; past EOF leaves a hole that reads as zeros.
        assert os.write(fd, b"hello") == 5
        assert os.pwrite(fd, b"world", 10) == 5
        assert os.pread(fd, 100, 0) == b"hello" + bytes(5) + b"world"
        assert os.pwrite(fd, b"XY", 3) == 2
        assert os.pread(fd, 100, 0) == b"helXY" + bytes(5) + b"world"
        assert os.pread(fd, 10, 15) == b""
        assert os.pwrite(fd, b"tail", 3 * MiB) == 4  # sparse: 3 MiB hole
        st = os.fstat(fd)
        assert st.st_size == 3 * MiB + 4 and st.st_blocks == (3 * MiB + 4 + 511) // 512
        assert os.pread(fd, MiB, 2 * MiB) == bytes(MiB)
        assert os.pread(fd, 10, 3 * MiB - 2) == b"\0\0tail"
    finally:
        os.close(fd)
    assert os.path.getsize(cache_file(mnt, p)) == 3 * MiB + 4

    # 1 MiB+ writes in one call, at aligned and unaligned offsets.
    big = payload(5 * MiB + 3, seed=1)
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0  # O_TRUNC
        assert os.write(fd, big) == len(big)
        patch = payload(2 * MiB + 1, seed=2)
        assert os.pwrite(fd, patch, 12345) == len(patch)
    finally:
        os.close(fd)
    want = big[:12345] + patch + big[12345 + len(patch):]
    assert p.read_bytes() == want
    with open(p, "rb") as f:  # reads of every size and offset
        f.seek(MiB - 7)
        assert f.read(3 * MiB) == want[MiB - 7:4 * MiB - 7]

    # O_APPEND: each write lands at the current end, even after another fd extended it.
    q = root / "log"
    a = os.open(q, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
    w = os.open(q, os.O_WRONLY)
    try:
        os.write(a, b"one")
        os.pwrite(w, b"-two-", 3)
        os.write(a, b"three")
        os.lseek(w, 0, os.SEEK_SET)
        os.write(w, b"O")
    finally:
        os.close(a)
        os.close(w)
    assert q.read_bytes() == b"One-two-three"

    # mknod of a regular file is a create.
    os.mknod(root / "node", stat.S_IFREG | 0o600)
    st = os.stat(root / "node")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0

    d = root / "dir"
    d.mkdir()
    refused(errno.EISDIR, os.open, d, os.O_WRONLY)    # kernel VFS
    refused(errno.ENOTDIR, os.stat, p / "x")          # kernel VFS (path walk)
    refused(errno.ENOTDIR, os.open, p / "x", os.O_CREAT | os.O_WRONLY)

    # unlink
    os.unlink(q)
    refused(errno.ENOENT, os.stat, q)
    refused(errno.ENOENT, os.unlink, q)
    refused(errno.EISDIR, os.unlink, d)  # kernel VFS (may_delete)
    assert sorted(os.listdir(root)) == ["dir", "f.bin", "node"]


def test_setattr_truncate_chmod_chown_utime(mnt):
    p = mnt.path / "f"
    p.write_bytes(b"0123456789")
    ino = os.stat(p).st_ino

    os.truncate(p, 4)
    assert os.stat(p).st_size == 4 and p.read_bytes() == b"0123"
    os.truncate(p, 8)
    assert os.stat(p).st_size == 8 and p.read_bytes() == b"0123" + bytes(4)
    assert os.path.getsize(mnt.cache_dir / "data" / str(ino)) == 8
    fd = os.open(p, os.O_RDWR)
    try:
        os.ftruncate(fd, 2)
        assert os.fstat(fd).st_size == 2 and os.pread(fd, 10, 0) == b"01"
        os.write(fd, b"abcdef")
        os.ftruncate(fd, 3)  # shrink while being written
        assert os.pread(fd, 10, 0) == b"abc"
        refused(errno.EINVAL, os.ftruncate, fd, -1)  # kernel
    finally:
        os.close(fd)
    assert p.read_bytes() == b"abc"
    with open(p, "wb") as f:  # O_TRUNC through open()
        assert os.fstat(f.fileno()).st_size == 0
    assert os.stat(p).st_size == 0 and p.read_bytes() == b""
    # O_RDONLY|O_TRUNC truncates too, as on Linux's local filesystems.
    p.write_bytes(b"0123456789")
    fd = os.open(p, os.O_RDONLY | os.O_TRUNC)
    try:
        assert os.fstat(fd).st_size == 0 and os.read(fd, 100) == b""
    finally:
        os.close(fd)
    assert os.stat(p).st_size == 0 and p.read_bytes() == b""
    assert os.path.getsize(mnt.cache_dir / "data" / str(ino)) == 0
    refused(errno.EISDIR, os.truncate, mnt.path, 0)  # kernel VFS

    before = os.stat(p)
    os.chmod(p, 0o4751)
    st = os.stat(p)
    assert st.st_mode == stat.S_IFREG | 0o4751
    assert st.st_ctime_ns >= before.st_ctime_ns
    os.chown(p, 1234, 5678)
    st = os.stat(p)
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    # chown clears set-user-ID (the kernel sends the mode change, as on any filesystem).
    assert st.st_mode == stat.S_IFREG | 0o751
    os.chmod(p, 0o4751)
    assert os.stat(p).st_mode == stat.S_IFREG | 0o4751
    os.chmod(mnt.path, 0o711)
    assert os.stat(mnt.path).st_mode == stat.S_IFDIR | 0o711

    os.utime(p, ns=(1_234_567_890_123_456_789, 987_654_321_987_654_321))
    st = os.stat(p)
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_234_567_890_123_456_789,
                                                987_654_321_987_654_321)
    t0 = time.time_ns()
    os.utime(p)  # UTIME_NOW
    st = os.stat(p)
    assert t0 - 10**9 <= st.st_mtime_ns <= time.time_ns() + 10**9
    assert t0 - 10**9 <= st.st_atime_ns <= time.time_ns() + 10**9

    os.utime(p, ns=(5, 6))
    mnt.remount()
    st = os.stat(p)
    assert (st.st_mode, st.st_uid, st.st_gid) == (stat.S_IFREG | 0o4751, 1234, 5678)
    assert (st.st_atime_ns, st.st_mtime_ns, st.st_ino) == (5, 6, ino)
    assert os.stat(mnt.path).st_mode == stat.S_IFDIR | 0o711


def test_flush_fsync_fdatasync_release(mnt):
    p = mnt.path / "f"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    ino = os.fstat(fd).st_ino
    try:
        os.write(fd, b"x" * 1000)
        os.fsync(fd)
        assert index_size(mnt, ino) == 1000  # fsync puts the size in the index
        os.write(fd, b"y" * 1000)
        os.fdatasync(fd)
        assert index_size(mnt, ino) == 2000
        os.write(fd, b"z" * 1000)
        os.close(os.dup(fd))  # closing a duplicate sends FLUSH (no release)
        assert index_size(mnt, ino) == 3000
        os.write(fd, b"w" * 1000)
    finally:
        os.close(fd)  # flush + release
    assert index_size(mnt, ino) == 4000
    assert p.read_bytes() == b"x" * 1000 + b"y" * 1000 + b"z" * 1000 + b"w" * 1000

    # fsync on a read-only fd and on a directory.
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(mnt.path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)

    # Release of the last fd of an unlinked file frees its cache file.
    data = mnt.cache_dir / "data" / str(ino)
    fd = os.open(p, os.O_RDWR)
    os.unlink(p)
    assert data.exists()
    os.close(fd)
    wait_for(lambda: not data.exists(), what="cache file of the unlinked file to go")


def test_unlinked_open_file_and_concurrent_reader(mnt):
    p = mnt.path / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"before")
        os.unlink(p)
        refused(errno.ENOENT, os.stat, p)
        assert os.pwrite(fd, b"-after", 6) == 6
        assert os.pread(fd, 100, 0) == b"before-after"
        assert os.fstat(fd).st_size == 12 and os.fstat(fd).st_nlink == 0
        p.write_bytes(b"new file")  # the name is free for a new inode
        assert os.pread(fd, 100, 0) == b"before-after"
        assert p.read_bytes() == b"new file"
    finally:
        os.close(fd)
    assert p.read_bytes() == b"new file"

    # A file being written reads back its current bytes through a second fd, before close:
    # one opened after the writes and one opened before them.
    q = mnt.path / "growing"
    w = os.open(q, os.O_CREAT | os.O_RDWR, 0o644)
    early = os.open(q, os.O_RDONLY)
    try:
        assert os.read(early, 100) == b""
        os.write(w, b"a" * 5000)
        late = os.open(q, os.O_RDONLY)
        try:
            assert os.read(late, 10_000) == b"a" * 5000
        finally:
            os.close(late)
        assert os.pread(early, 10_000, 0) == b"a" * 5000
        os.pwrite(w, b"b" * 3000, 4000)  # overwrite and extend
        assert os.fstat(early).st_size == 7000
        assert os.pread(early, 10_000, 0) == b"a" * 4000 + b"b" * 3000
        with open(q, "rb") as f:
            assert f.read() == b"a" * 4000 + b"b" * 3000
    finally:
        os.close(early)
        os.close(w)


# ----------------------------------------------------------------------------------------------
# directories


def test_mkdir_rmdir(mnt):
    root = mnt.path
    d = root / "d"
    os.mkdir(d, 0o750)
    st = os.stat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o750
    assert st.st_nlink == 2 and os.stat(root).st_nlink == 3
    refused(errno.EEXIST, os.mkdir, d)  # kernel VFS (the name resolves)
    os.mkdir(d / "sub")
    assert os.stat(d).st_nlink == 3
    (d / "sub" / "f").write_bytes(b"x")
    assert os.stat(d / "sub" / ".." / "sub" / "f").st_size == 1

    refused(errno.ENOTEMPTY, os.rmdir, d)
    refused(errno.ENOTEMPTY, os.rmdir, d / "sub")
    refused(errno.ENOTDIR, os.rmdir, d / "sub" / "f")  # kernel VFS (may_delete)
    refused(errno.ENOENT, os.rmdir, d / "missing")
    refused(errno.ENOTDIR, os.listdir, d / "sub" / "f")
    refused(errno.ENOTDIR, os.mkdir, d / "sub" / "f" / "x")

    os.unlink(d / "sub" / "f")
    os.rmdir(d / "sub")
    assert os.stat(d).st_nlink == 2
    os.rmdir(d)
    refused(errno.ENOENT, os.stat, d)
    assert os.stat(root).st_nlink == 2
    assert os.listdir(root) == []


def test_readdir_under_concurrent_create_unlink(mnt):
    d = mnt.path / "d"
    d.mkdir()
    # Enough entries for many READDIR requests per listing (a few dozen entries fit in one),
    # interleaved with entries that go away meanwhile: `early-*` are unlinked, `tmp-*` are
    # renamed over `final`, which therefore exists the whole time (as does every stable-*).
    stable = {f"stable-{i:04d}" for i in range(240)}
    for i, name in enumerate(sorted(stable)):
        (d / name).touch()
        if i % 3 == 0:
            (d / f"early-{i}").touch()
        elif i % 3 == 1:
            (d / f"tmp-{i}").write_bytes(b"%d" % i)
    (d / "final").write_bytes(b"first")
    stable.add("final")
    stop = threading.Event()
    churned = [0]
    errors: list[OSError] = []

    def churn() -> None:
        try:
            names = os.listdir(d)
            early = sorted(n for n in names if n.startswith("early-"))
            tmps = sorted((n for n in names if n.startswith("tmp-")), key=lambda n: int(n[4:]))
            i = 0
            while not stop.is_set():
                os.close(os.open(d / f"new-{i}", os.O_CREAT | os.O_WRONLY, 0o644))
                if early:
                    os.unlink(d / early.pop())
                if i >= 20:
                    os.unlink(d / f"new-{i - 20}")
                # tmp -> final, from entries listed late to ones listed early and then a new
                # tmp each time (listed last).
                if not tmps:
                    tmps.append("final.tmp")
                    (d / "final.tmp").write_bytes(b"%d" % i)
                os.rename(d / tmps.pop(), d / "final")
                i += 1
                churned[0] = i
        except OSError as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=churn)
    t.start()
    try:
        wait_for(lambda: churned[0] > 0 or errors, what="churn to start")
        listings = 0
        # Until every early and tmp entry went and new ones came, while listing over and over.
        while listings < 10 or churned[0] < 100:
            if listings % 2 or _SYS_GETDENTS64 is None:
                seen = [e.name for e in os.scandir(d)]
            else:
                seen = list_small_buffer(d)
            listings += 1
            counts: dict[str, int] = {}
            for n in seen:
                counts[n] = counts.get(n, 0) + 1
            assert all(counts.get(n) == 1 for n in stable), (
                {n: counts.get(n, 0) for n in stable if counts.get(n) != 1})
            # Only a name removed and made again during the listing may show twice: two
            # entries, the old one and its successor (docs/SEMANTICS.md: entries created or
            # removed during the listing may or may not appear). churn re-creates only
            # final.tmp; every other name is made once and removed at most once.
            twice = {n for n, c in counts.items() if c != 1}
            assert twice <= {"final.tmp"}, {n: counts[n] for n in twice}
            assert not errors, errors
            assert listings < 2000, "churn thread made no progress"
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    final = set(os.listdir(d))
    assert final == stable | {f"new-{i}" for i in range(churned[0] - 20, churned[0])}


# ----------------------------------------------------------------------------------------------
# rename


def test_rename_files_and_directories(mnt):
    root = mnt.path
    a, b = root / "a", root / "b"
    a.write_bytes(b"new")
    b.write_bytes(b"old")
    a_ino = os.stat(a).st_ino
    old_fd = os.open(b, os.O_RDONLY)
    try:
        os.rename(a, b)  # replaces the existing file
        refused(errno.ENOENT, os.stat, a)
        assert os.stat(b).st_ino == a_ino and b.read_bytes() == b"new"
        assert os.read(old_fd, 10) == b"old"  # the replaced file lives on while open
    finally:
        os.close(old_fd)
    os.rename(b, b)  # onto itself: nothing happens
    assert b.read_bytes() == b"new"
    refused(errno.ENOENT, os.rename, root / "missing", root / "x")

    # Whole directories, across directories, with their contents.
    src = root / "p1" / "ckpt"
    src.mkdir(parents=True)
    (root / "p2").mkdir()
    for i in range(50):
        (src / f"shard-{i}").write_bytes(payload(1000, seed=i))
    (src / "nested" / "deeper").mkdir(parents=True)
    (src / "nested" / "deeper" / "f").write_bytes(b"deep")
    assert (os.stat(root / "p1").st_nlink, os.stat(root / "p2").st_nlink) == (3, 2)
    os.rename(src, root / "p2" / "ckpt")
    dst = root / "p2" / "ckpt"
    assert (os.stat(root / "p1").st_nlink, os.stat(root / "p2").st_nlink) == (2, 3)
    assert os.listdir(root / "p1") == []
    assert all((dst / f"shard-{i}").read_bytes() == payload(1000, seed=i) for i in range(50))
    assert (dst / "nested" / "deeper" / "f").read_bytes() == b"deep"

    # Directory over an empty directory replaces it; over a non-empty one: ENOTEMPTY.
    (root / "empty").mkdir()
    (root / "full").mkdir()
    (root / "full" / "x").touch()
    refused(errno.ENOTEMPTY, os.rename, dst, root / "full")
    os.rename(dst, root / "empty")
    assert len(os.listdir(root / "empty")) == 51
    assert os.stat(root / "p2").st_nlink == 2
    assert os.stat(root).st_nlink == 2 + 4  # p1, p2, empty, full

    # File onto directory, directory onto file, directory into its own subtree.
    refused(errno.EISDIR, os.rename, b, root / "full")  # kernel VFS
    refused(errno.ENOTDIR, os.rename, root / "full", b)  # kernel VFS
    refused(errno.EINVAL, os.rename, root / "empty", root / "empty" / "nested" / "x")  # VFS
    refused(errno.EINVAL, os.rename, root / "empty", root / "empty" / "y")  # kernel VFS
    assert b.read_bytes() == b"new" and os.listdir(root / "full") == ["x"]

    # tmp -> final, the checkpoint pattern: the final name is never missing.
    final = root / "model.pt"
    final.write_bytes(b"v0")
    for v in range(1, 20):
        tmp = root / "model.pt.tmp"
        tmp.write_bytes(f"v{v}".encode())
        os.rename(tmp, final)
        assert final.read_bytes() == f"v{v}".encode()
    refused(errno.ENOENT, os.stat, root / "model.pt.tmp")


def test_renameat2_noreplace_exchange_and_flags(mnt):
    root = mnt.path
    f, g = root / "f", root / "g"
    f.write_bytes(b"F")
    g.write_bytes(b"G")
    refused(errno.EEXIST, renameat2, f, g, RENAME_NOREPLACE)  # kernel VFS
    assert (f.read_bytes(), g.read_bytes()) == (b"F", b"G")
    renameat2(f, root / "h", RENAME_NOREPLACE)
    assert (root / "h").read_bytes() == b"F" and not f.exists()

    # RENAME_EXCHANGE of a file and a directory across directories.
    d1, d2 = root / "d1", root / "d2"
    d1.mkdir()
    d2.mkdir()
    (d1 / "x").write_bytes(b"file")
    (d2 / "y").mkdir()
    (d2 / "y" / "child").write_bytes(b"child")
    file_ino, dir_ino = os.stat(d1 / "x").st_ino, os.stat(d2 / "y").st_ino
    renameat2(d1 / "x", d2 / "y", RENAME_EXCHANGE)
    assert os.stat(d1 / "x").st_ino == dir_ino and os.stat(d2 / "y").st_ino == file_ino
    assert (d1 / "x" / "child").read_bytes() == b"child"
    assert (d2 / "y").read_bytes() == b"file"
    assert (os.stat(d1).st_nlink, os.stat(d2).st_nlink) == (3, 2)
    # Two files in one directory.
    renameat2(root / "g", root / "h", RENAME_EXCHANGE)
    assert ((root / "g").read_bytes(), (root / "h").read_bytes()) == (b"F", b"G")

    refused(errno.ENOENT, renameat2, root / "g", root / "missing", RENAME_EXCHANGE)  # VFS
    refused(errno.EINVAL, renameat2, d1 / "x", d1 / "x" / "child", RENAME_EXCHANGE)  # VFS
    refused(errno.EINVAL, renameat2, root / "g", root / "h",
            RENAME_NOREPLACE | RENAME_EXCHANGE)  # kernel
    refused(errno.EINVAL, renameat2, root / "g", root / "new", RENAME_WHITEOUT)
    refused(errno.EINVAL, renameat2, root / "g", root / "new", 1 << 10)  # kernel
    assert sorted(os.listdir(root)) == ["d1", "d2", "g", "h"]
    assert ((root / "g").read_bytes(), (root / "h").read_bytes()) == (b"F", b"G")


# ----------------------------------------------------------------------------------------------
# symlinks, links, special files, names


def test_symlink_readlink_and_atomic_latest(mnt):
    root = mnt.path
    for step in range(3):
        (root / f"step_{step}").mkdir()
        (root / f"step_{step}" / "model.pt").write_bytes(f"weights {step}".encode())
    os.symlink("step_0", root / "latest")
    st = os.lstat(root / "latest")
    assert stat.S_ISLNK(st.st_mode) and st.st_size == len("step_0")
    assert os.readlink(root / "latest") == "step_0"
    assert (root / "latest" / "model.pt").read_bytes() == b"weights 0"
    refused(errno.EEXIST, os.symlink, "x", root / "latest")  # kernel VFS
    refused(errno.EINVAL, os.readlink, root / "step_0")      # kernel VFS
    os.symlink("/abs/" + "t" * 4090, root / "long")          # 4095 bytes: the maximum
    assert os.readlink(root / "long") == "/abs/" + "t" * 4090
    refused(errno.ENAMETOOLONG, os.symlink, "t" * 4096, root / "toolong")  # kernel (PATH_MAX)
    os.symlink("missing/target", root / "dangling")
    assert os.readlink(root / "dangling") == "missing/target"
    refused(errno.ENOENT, os.stat, root / "dangling")

    # `latest` replaced by symlink-to-tmp + rename: a concurrent reader always finds it.
    stop = threading.Event()
    seen: set[str] = set()
    errors: list[OSError] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                seen.add(os.readlink(root / "latest"))
        except OSError as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(150):
            os.symlink(f"step_{i % 3}", root / "latest.tmp")
            os.rename(root / "latest.tmp", root / "latest")
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert seen <= {"step_0", "step_1", "step_2"} and seen
    assert os.readlink(root / "latest") == "step_2"  # 149 % 3
    assert (root / "latest" / "model.pt").read_bytes() == b"weights 2"
    assert "latest.tmp" not in os.listdir(root)


def test_link_and_mknod_refused(mnt):
    root = mnt.path
    f = root / "f"
    f.write_bytes(b"data")
    refused(errno.EPERM, os.link, f, root / "hard")
    refused(errno.ENOENT, os.stat, root / "hard")
    assert os.stat(f).st_nlink == 1
    refused(errno.EPERM, os.mkfifo, root / "fifo")
    refused(errno.EPERM, os.mknod, root / "sock", stat.S_IFSOCK | 0o600)
    refused(errno.EPERM, os.mknod, root / "chr", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    assert sorted(os.listdir(root)) == ["f"]


def fallocate(fd: int, mode: int, off: int, length: int) -> None:
    if _libc.fallocate(fd, mode, ctypes.c_long(off), ctypes.c_long(length)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def test_fallocate_preallocates_reserves_punches_and_zeroes(mnt, mount_factory):
    """fallocate(2) does on the cache file what the cache disk's filesystem does: mode 0
    reserves blocks and grows the file (what fio's layout and posix_fallocate(3) ask), KEEP_SIZE
    reserves past the end, PUNCH_HOLE and ZERO_RANGE zero a range. Sizes other processes see,
    the bytes read back, --cache-size's count, and the content another node restores all follow;
    a read-only descriptor and a mode FUSE does not pass on are refused."""
    FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_COLLAPSE_RANGE = 1, 2, 8
    FALLOC_FL_ZERO_RANGE = 0x10
    p = mnt.path / "f"
    cached = lambda: mnt.status()["cache"]["cached_bytes"]  # noqa: E731
    base = cached()
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fallocate(fd, 0, 0, 8 * MiB)
        assert os.fstat(fd).st_size == os.stat(p).st_size == 8 * MiB
        assert cached() == base + 8 * MiB  # reserved blocks count, not a hole
        data = bytearray(payload(6 * MiB, seed=7)) + bytearray(2 * MiB)
        os.pwrite(fd, bytes(data[: 6 * MiB]), 0)
        fallocate(fd, FALLOC_FL_KEEP_SIZE, 8 * MiB, 4 * MiB)
        assert os.fstat(fd).st_size == os.stat(p).st_size == 8 * MiB
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 1 * MiB, 1 * MiB)
        data[1 * MiB: 2 * MiB] = bytes(MiB)
        fallocate(fd, FALLOC_FL_ZERO_RANGE, 3 * MiB, MiB // 2)
        data[3 * MiB: 3 * MiB + MiB // 2] = bytes(MiB // 2)
        fallocate(fd, 0, 8 * MiB, 2 * MiB)   # past the end: grows it with zeros
        data += bytes(2 * MiB)
        assert os.stat(p).st_size == len(data) == 10 * MiB
        # The kernel refuses what FUSE does not pass on; nothing changed.
        refused(errno.EOPNOTSUPP, fallocate, fd, FALLOC_FL_COLLAPSE_RANGE, 0, MiB)
        assert os.pread(fd, len(data) + 1, 0) == bytes(data)
    finally:
        os.close(fd)
    assert p.read_bytes() == bytes(data)
    ro = os.open(p, os.O_RDONLY)
    try:
        refused(errno.EBADF, fallocate, ro, 0, 0, 16 * MiB)  # the VFS: not open for writing
    finally:
        os.close(ro)
    assert os.stat(p).st_size == 10 * MiB
    # Uploaded as closed, and restored whole on a node with an empty cache.
    res = run_cli("wait", str(p), "--timeout", "60")
    assert res.returncode == 0, res.stderr
    b = mount_factory("b")
    b.start("--store", f"file://{mnt.store_dir}")
    wait_for(lambda: (b.path / "f").exists(), what="f on node B")
    assert (b.path / "f").read_bytes() == bytes(data)


def test_name_length(mnt):
    root = mnt.path
    f = root / "f"
    f.write_bytes(b"data")
    ok, long = "n" * 255, "n" * 256
    (root / ok).write_bytes(b"255")
    assert (root / ok).read_bytes() == b"255"
    os.mkdir(root / ("d" * 255))
    refused(errno.ENAMETOOLONG, os.stat, root / long)
    refused(errno.ENAMETOOLONG, os.open, root / long, os.O_CREAT | os.O_WRONLY)
    refused(errno.ENAMETOOLONG, os.mkdir, root / long)
    refused(errno.ENAMETOOLONG, os.symlink, "t", root / long)
    refused(errno.ENAMETOOLONG, os.rename, f, root / long)
    refused(errno.ENAMETOOLONG, os.unlink, root / long)
    assert sorted(os.listdir(root)) == sorted(["f", ok, "d" * 255])
    # A 255-byte file name makes a 260-byte `<name>.json`, more than a file:// store's file
    # names allow: its manifest goes under a hashed key (docs/FORMAT.md "Layout"), the set is
    # durable like any other, and a draining umount finishes.
    res = run_cli("wait", str(root / ok), "--timeout", "60")
    assert res.returncode == 0, res.stderr
    hashed = mnt.store_dir / "objects" / "manifests" / "%25"
    assert hashed.is_dir() and len(os.listdir(hashed)) == 1
    res = run_cli("umount", str(mnt.path))
    assert res.returncode == 0, res.stderr


# ----------------------------------------------------------------------------------------------
# xattrs, statfs, mmap


def _minimal_acl() -> bytes:
    """A valid POSIX ACL xattr value (u::rw-, g::r--, o::r--), so the kernel forwards it."""
    entries = ((0x01, 6), (0x04, 4), (0x20, 4))
    return (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + (2**32 - 1).to_bytes(4, "little")
        for tag, perm in entries)


def test_xattrs(mnt):
    f = mnt.path / "f"
    f.write_bytes(b"x")
    d = mnt.path / "d"
    d.mkdir()
    assert os.listxattr(f) == []
    refused(errno.ENODATA, os.getxattr, f, "user.missing")
    refused(errno.ENODATA, os.removexattr, f, "user.missing")
    os.setxattr(f, "user.step", b"100")
    os.setxattr(f, "user.bin", bytes(range(256)))
    os.setxattr(f, "trusted.t", b"t")
    os.setxattr(d, "user.dir", b"yes")
    assert os.getxattr(f, "user.step") == b"100"
    assert os.getxattr(f, "user.bin") == bytes(range(256))
    assert sorted(os.listxattr(f)) == ["trusted.t", "user.bin", "user.step"]
    assert os.listxattr(d) == ["user.dir"]
    os.setxattr(f, "user.step", b"200")
    assert os.getxattr(f, "user.step") == b"200"
    os.setxattr(f, "user.big", b"v" * 65536)  # the largest value the kernel passes
    assert os.getxattr(f, "user.big") == b"v" * 65536
    refused(errno.E2BIG, os.setxattr, f, "user.bigger", b"v" * 65537)  # kernel
    refused(errno.ERANGE, os.setxattr, f, "user." + "n" * 251, b"v")   # kernel
    os.removexattr(f, "user.bin")
    refused(errno.ENODATA, os.getxattr, f, "user.bin")
    assert sorted(os.listxattr(f)) == ["trusted.t", "user.big", "user.step"]

    # POSIX ACLs (system.*) are not implemented: ENOTSUP, on inodes with and without xattrs.
    bare = mnt.path / "bare"
    bare.touch()
    for p in (f, bare, d):
        refused(errno.ENOTSUP, os.getxattr, p, "system.posix_acl_access")
        refused(errno.ENOTSUP, os.setxattr, p, "system.posix_acl_access", _minimal_acl())
        refused(errno.ENOTSUP, os.removexattr, p, "system.posix_acl_access")
    refused(errno.ENOTSUP, os.getxattr, d, "system.posix_acl_default")

    mnt.remount()
    assert os.getxattr(f, "user.step") == b"200"
    assert sorted(os.listxattr(f)) == ["trusted.t", "user.big", "user.step"]
    assert os.getxattr(d, "user.dir") == b"yes"


def test_statfs(mnt):
    ours, disk = os.statvfs(mnt.path), os.statvfs(mnt.cache_dir)
    assert ours.f_bsize == disk.f_bsize and ours.f_frsize == disk.f_frsize
    assert ours.f_blocks == disk.f_blocks
    # Free space moves with whatever else runs on this disk: within 1% of its size.
    assert abs(ours.f_bavail - disk.f_bavail) <= disk.f_blocks // 100
    assert abs(ours.f_bfree - disk.f_bfree) <= disk.f_blocks // 100
    assert ours.f_namemax == 255


def test_mmap(mnt):
    p = mnt.path / "weights.bin"
    data = payload(3 * mmap.PAGESIZE + 123, seed=7)
    p.write_bytes(data)

    fd = os.open(p, os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:  # MAP_SHARED, read-only fd
            assert m[:] == data
        with mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) as m:  # MAP_PRIVATE
            assert m[:] == data
            m[0:4] = b"COPY"  # private: never reaches the file
            assert m[0:4] == b"COPY"
    finally:
        os.close(fd)
    assert p.read_bytes() == data

    fd = os.open(p, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) as m:  # MAP_PRIVATE on a write fd
            assert m[:] == data
        if mnt.passthrough:
            # Passthrough: the mapping is the cache file's, shared and writable.
            with mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE) as m:
                m[4:8] = b"MMAP"
        else:
            # MAP_SHARED on a descriptor open for writing: refused (direct I/O writes).
            refused(errno.ENODEV, mmap.mmap, fd, 0, access=mmap.ACCESS_WRITE)
        os.pwrite(fd, b"NEW!", 0)
    finally:
        os.close(fd)
    if mnt.passthrough:
        data = data[:4] + b"MMAP" + data[8:]
    # A new mapping sees data written since the last one (no stale page cache).
    fd = os.open(p, os.O_RDONLY)
    try:
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
            assert m[:] == b"NEW!" + data[4:]
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# persistence, internal errors


def _tree(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                content: object = os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                content = "dir"
            else:
                content = p.read_bytes()
            xattrs = {} if stat.S_ISLNK(st.st_mode) else {
                k: os.getxattr(p, k) for k in os.listxattr(p)}
            out[str(p.relative_to(root))] = (
                st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_size,
                st.st_mtime_ns, content, xattrs)
    return out


def test_state_survives_remount(mnt):
    root = mnt.path
    (root / "run" / "step_1" / "optim").mkdir(parents=True)
    (root / "run" / "step_1" / "model.pt").write_bytes(payload(2 * MiB + 5, seed=3))
    (root / "run" / "step_1" / "optim" / "shard0").write_bytes(payload(4096, seed=4))
    (root / "run" / "empty").touch()
    with open(root / "run" / "sparse", "wb") as f:
        f.seek(10 * MiB)
        f.write(b"end")
    os.symlink("step_1", root / "run" / "latest")
    os.chmod(root / "run" / "step_1" / "model.pt", 0o600)
    os.chown(root / "run" / "empty", 42, 43)
    os.utime(root / "run" / "step_1", ns=(111, 222))
    os.setxattr(root / "run" / "step_1" / "model.pt", "user.sha", b"abc")
    fd = os.open(root / "run" / "unflushed-until-close", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"q" * 777)
    os.close(fd)
    before = _tree(root)
    assert len(before) == 9

    mnt.remount()
    assert _tree(root) == before
    (root / "after").write_bytes(b"more")
    mnt.remount()
    after = _tree(root)
    assert after.pop("after")[7] == b"more"
    assert after == before


def test_internal_error_is_eio_and_mount_survives(mount_factory):
    # Not the `mnt` fixture: this test provokes an "unexpected" error on purpose.
    m = mount_factory("eio")
    m.start()
    p = m.path / "victim"
    p.write_bytes(b"data")
    (m.path / "other").write_bytes(b"fine")
    # Nothing else may be reading the cache file (its upload) when it goes.
    res = run_cli("wait", str(p), "--timeout", "60")
    assert res.returncode == 0, res.stderr
    cache_file(m, p).unlink()  # behind the daemon's back
    refused(errno.EIO, os.open, p, os.O_RDONLY)
    refused(errno.EIO, p.read_bytes)
    log = m.log_text()
    assert "open(" in log and "answering EIO" in log and "Traceback" in log
    assert "FileNotFoundError" in log

    # The mount is alive and every other operation still works.
    assert m.pid is not None and _alive(m.pid)
    assert os.stat(p).st_size == 4  # getattr needs no cache file
    assert (m.path / "other").read_bytes() == b"fine"
    (m.path / "new").write_bytes(b"new")
    assert (m.path / "new").read_bytes() == b"new"
    assert sorted(os.listdir(m.path)) == ["new", "other", "victim"]
    os.unlink(p)
    m.stop()
