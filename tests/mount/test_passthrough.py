"""FUSE passthrough (docs/ARCHITECTURE.md "Data path"), from the user's side: a file the cache
holds whole is read and written by the kernel on the cache file, and everything ckptfs promises
stays: sizes and mtimes other processes see, O_APPEND / O_TRUNC / sparse writes, commit at close
and upload of exactly the closed content, shared writable mmap, restore on another node, the
switch to passthrough once a restored file is whole, eviction never touching an open file, and
the fallback (--no-passthrough, status says why).

On a machine where passthrough cannot work these tests skip, except with CI=true: CI runs on a
kernel and as a user with which it works, so there it must be active.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import threading

import pytest

import ckptfs
from tests.conftest import IN_CI, USER_SPACE_DATA_PATH, run_cli, wait_for

MiB = 1 << 20


def rand(n: int, seed: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def status(m) -> dict:
    return ckptfs.status(m.path)


def dp(m) -> dict:
    return status(m)["data_path"]


def io(m) -> dict:
    return status(m)["io"]


@pytest.fixture
def pt(mount_factory):
    """A mount whose data path is passthrough (skipped where it cannot be, never in CI)."""
    if USER_SPACE_DATA_PATH:
        pytest.skip("CKPTFS_TEST_DATA_PATH=fuse: these tests are about passthrough")
    m = mount_factory("pt")
    m.start()
    mode = dp(m)
    if mode["mode"] != "passthrough":
        if IN_CI:
            pytest.fail(f"passthrough is off in CI: {mode['off_reason']}")
        pytest.skip(f"passthrough unavailable here: {mode['off_reason']}")
    yield m
    errors = m.unexpected_errors()
    assert not errors, "daemon logged unexpected errors:\n" + "\n".join(errors)


def wait_durable(m, rel: str) -> None:
    res = run_cli("wait", str(m.path / rel), "--timeout", "60")
    assert res.returncode == 0, res.stdout + res.stderr


def second_node(mount_factory, a, name: str = "b", *extra: str):
    b = mount_factory(name)
    b.start("--store", f"file://{a.store_dir}", *extra)
    return b


def test_status_says_passthrough(pt):
    d = dp(pt)
    assert d["mode"] == "passthrough" and d["off_reason"] is None
    text = run_cli("status", str(pt.path)).stdout
    assert "data path  passthrough" in text
    # The daemon runs the libfuse it was built against, and says so once.
    lines = [ln for ln in pt.log_text().splitlines() if "data path:" in ln]
    assert len(lines) == 1 and "passthrough" in lines[0], lines
    # (ckptfs/native/build.sh's prefix, in the machine's build cache: not the system's)
    assert "/libfuse/lib/libfuse3.so" in lines[0], lines[0]


def test_writes_bypass_the_daemon_and_are_committed(pt, mount_factory):
    before = io(pt)
    data = rand(24 * MiB + 123, 1)
    p = pt.path / "ckpt.pt"
    with open(p, "wb", buffering=0) as f:
        f.write(data[: 8 * MiB])
        # Another process sees what the kernel wrote, though the daemon did not write it.
        assert os.stat(p).st_size == 8 * MiB
        f.write(data[8 * MiB:])
        assert os.stat(p).st_size == len(data)
        assert dp(pt)["open_backings"] == 1
    after = io(pt)
    assert after["write_requests"] == before["write_requests"]  # not one write went through it
    assert dp(pt)["open_backings"] == 0
    assert p.read_bytes() == data
    assert io(pt)["read_requests"] == before["read_requests"]
    st = os.stat(p)
    assert st.st_size == len(data) and st.st_mtime_ns > 0
    # Committed at close, uploaded, and whole on a node with an empty cache.
    wait_durable(pt, "ckpt.pt")
    b = second_node(mount_factory, pt)
    wait_for(lambda: (b.path / "ckpt.pt").exists(), what="ckpt.pt on node B")
    assert (b.path / "ckpt.pt").read_bytes() == data
    assert os.stat(b.path / "ckpt.pt").st_mtime_ns == st.st_mtime_ns


def test_append_trunc_and_sparse_writes(pt, mount_factory):
    p = pt.path / "log.bin"
    with open(p, "wb") as f:
        f.write(b"a" * 1000)
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        os.pwrite(fd, b"b" * 10, 0)  # O_APPEND: at the end whatever the offset (Linux)
        os.write(fd, b"c" * 5)
    finally:
        os.close(fd)
    assert p.read_bytes() == b"a" * 1000 + b"b" * 10 + b"c" * 5

    with open(p, "r+b") as f:  # no O_TRUNC: the content stays
        f.write(b"Z")
    assert p.read_bytes()[:2] == b"Za"
    with open(p, "wb") as f:  # O_TRUNC
        assert os.fstat(f.fileno()).st_size == 0
        f.write(b"new")
    assert p.read_bytes() == b"new"

    # Sparse: a write far beyond the end leaves a hole that costs no cache bytes.
    s = pt.path / "sparse.bin"
    hole = 512 * MiB
    with open(s, "wb") as f:
        f.write(b"head")
        f.seek(hole)
        f.write(b"tail")
    assert os.stat(s).st_size == hole + 4
    with open(s, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(hole - 4)
        assert f.read(8) == b"\0" * 4 + b"tail"
    cache = status(pt)["cache"]
    assert cache["cached_bytes"] < 16 * MiB, cache  # the hole is not counted
    wait_durable(pt, "sparse.bin")
    wait_durable(pt, "log.bin")
    b = second_node(mount_factory, pt)
    wait_for(lambda: (b.path / "sparse.bin").exists(), what="sparse.bin on node B")
    assert (b.path / "log.bin").read_bytes() == b"new"
    with open(b.path / "sparse.bin", "rb") as f:
        f.seek(hole)
        assert f.read() == b"tail"


def test_shared_writable_mmap_is_committed(pt, mount_factory):
    p = pt.path / "mm.bin"
    data = rand(3 * mmap.PAGESIZE + 17, 2)
    p.write_bytes(data)
    with open(p, "r+b") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE) as m:
        m[100:104] = b"MMAP"
        m.flush()
    want = data[:100] + b"MMAP" + data[104:]
    assert p.read_bytes() == want
    wait_durable(pt, "mm.bin")
    b = second_node(mount_factory, pt)
    wait_for(lambda: (b.path / "mm.bin").exists(), what="mm.bin on node B")
    assert (b.path / "mm.bin").read_bytes() == want


def test_a_writer_open_in_passthrough_is_never_uploaded(pt, mount_factory):
    """Reopened for writing after its commit, a file keeps its last closed content in the store
    (what another node restores) while a passthrough writer has it open; once the writer
    closes, exactly the new closed content is published."""
    p = pt.path / "model.pt"
    v1, v2 = rand(8 * MiB, 3), rand(8 * MiB, 4)
    p.write_bytes(v1)
    wait_durable(pt, "model.pt")
    f = open(p, "r+b", buffering=0)  # noqa: SIM115
    try:
        f.write(v2[: 4 * MiB])  # half of v2 over v1: not a content anyone closed
        assert dp(pt)["open_backings"] == 1
        b = second_node(mount_factory, pt)
        assert (b.path / "model.pt").read_bytes() == v1
        b.stop()
        f.write(v2[4 * MiB:])
    finally:
        f.close()
    wait_durable(pt, "model.pt")
    c = second_node(mount_factory, pt, "c")
    wait_for(lambda: hashlib.sha256((c.path / "model.pt").read_bytes()).digest()
             == hashlib.sha256(v2).digest(), what="v2 on node C")


def test_restored_file_switches_to_passthrough_once_whole(pt, mount_factory):
    data = rand(12 * MiB, 5)
    (pt.path / "r.bin").write_bytes(data)
    wait_durable(pt, "r.bin")
    b = second_node(mount_factory, pt, "b", "--no-prefetch")
    rb = b.path / "r.bin"
    wait_for(lambda: rb.exists(), what="r.bin on node B")
    # Not in the cache yet: the daemon serves it (and restores it).
    first = open(rb, "rb")  # noqa: SIM115
    try:
        assert dp(b)["passthrough_opens"] == 0
        assert first.read() == data
        assert io(b)["read_requests"] > 0
        # Whole now, but open in page-cache mode: a second open stays with the daemon (the
        # kernel refuses passthrough on an inode open in page-cache mode).
        with open(rb, "rb") as second:
            assert second.read() == data
        assert dp(b)["passthrough_opens"] == 0
    finally:
        first.close()
    reads = io(b)["read_requests"]
    with open(rb, "rb") as third:  # nobody has it open: passthrough
        assert third.read() == data
        assert dp(b)["open_backings"] == 1
        with open(rb, "rb") as fourth:  # and every open while one is
            assert fourth.read(10) == data[:10]
    assert dp(b)["passthrough_opens"] == 2
    assert io(b)["read_requests"] == reads
    errors = b.unexpected_errors()
    assert not errors, errors


def test_eviction_skips_a_file_open_in_passthrough(mount_factory):
    if USER_SPACE_DATA_PATH:
        pytest.skip("CKPTFS_TEST_DATA_PATH=fuse")
    m = mount_factory("ev")
    m.start("--cache-size", "64M")
    if dp(m)["mode"] != "passthrough":
        if IN_CI:
            pytest.fail(dp(m)["off_reason"])
        pytest.skip(dp(m)["off_reason"])
    a, c = rand(24 * MiB, 6), rand(24 * MiB, 7)
    (m.path / "a.bin").write_bytes(a)  # under --cache-size writes go through the daemon
    (m.path / "c.bin").write_bytes(c)
    wait_durable(m, "a.bin")
    wait_durable(m, "c.bin")
    with open(m.path / "a.bin", "rb") as held:  # reads may go passthrough
        assert dp(m)["open_backings"] == 1
        # 40 MiB more under a 64 MiB cache: room must be made, from c.bin only.
        (m.path / "d.bin").write_bytes(rand(40 * MiB, 8))
        assert held.read() == a
    assert status(m)["cache"]["cached_bytes"] <= 64 * MiB + 8 * MiB
    assert (m.path / "c.bin").read_bytes() == c  # evicted, and back from the store
    errors = m.unexpected_errors()
    assert not errors, errors


def test_no_passthrough_serves_every_byte_in_the_daemon(mount_factory):
    m = mount_factory("np")
    m.start("--no-passthrough")
    d = dp(m)
    assert d["mode"] == "fuse" and d["off_reason"] == "--no-passthrough"
    assert "the daemon serves file data (--no-passthrough)" in run_cli("status", str(m.path)).stdout
    before = io(m)
    (m.path / "x").write_bytes(b"x" * MiB)
    assert (m.path / "x").read_bytes() == b"x" * MiB
    after = io(m)
    assert after["bytes_written"] - before["bytes_written"] == MiB
    assert dp(m)["passthrough_opens"] == 0
    lines = [ln for ln in m.log_text().splitlines() if "data path:" in ln]
    assert len(lines) == 1 and "--no-passthrough" in lines[0], lines


def test_concurrent_writers_and_readers(pt):
    """Several threads write their own files and read each other's, all in passthrough."""
    files = {f"rank{i}.pt": rand(6 * MiB + i, 10 + i) for i in range(4)}

    def write(name: str) -> None:
        (pt.path / name).write_bytes(files[name])

    threads = [threading.Thread(target=write, args=(n,)) for n in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, data in files.items():
        assert (pt.path / name).read_bytes() == data
        assert os.stat(pt.path / name).st_size == len(data)
    assert io(pt)["write_requests"] == 0
    for name in files:
        wait_durable(pt, name)


def test_daemon_killed_under_a_passthrough_writer(pt):
    """kill -9 of the daemon: an open passthrough descriptor still writes the cache file, its
    close reports ENOTCONN (or ECONNABORTED: a FLUSH queued before the kernel saw the daemon's
    /dev/fuse close is ended with that one), and the remount shows every byte it wrote (not
    committed: it was never closed while the daemon ran)."""
    a, b = rand(2 * MiB, 20), rand(2 * MiB, 21)
    f = open(pt.path / "w.bin", "wb", buffering=0)  # noqa: SIM115
    f.write(a)
    pt.kill9()
    assert f.write(b) == len(b)  # the kernel writes the cache file, no daemon involved
    with pytest.raises(OSError) as e:
        f.close()
    assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED), e.value
    pt.start()
    assert (pt.path / "w.bin").read_bytes() == a + b
    res = run_cli("wait", str(pt.path / "w.bin"), "--timeout", "5")
    assert res.returncode == 8, res.stdout + res.stderr  # in no committed set


def test_cache_dir_stacked_too_deep_falls_back(pt, mount_factory):
    """A cache dir inside another passthrough mount is a stack deeper than the kernel allows:
    the first registration fails, passthrough goes off with one line saying why, and the mount
    serves every byte itself, correctly."""
    (pt.path / "inner-cache").mkdir()
    inner = mount_factory("inner", cache_dir=pt.path / "inner-cache")
    inner.start()
    data = rand(3 * MiB, 30)
    (inner.path / "f.bin").write_bytes(data)
    assert (inner.path / "f.bin").read_bytes() == data
    d = dp(inner)
    assert d["mode"] == "fuse" and "stacked too deep" in d["off_reason"], d
    lines = [ln for ln in inner.log_text().splitlines() if "passthrough off" in ln]
    assert len(lines) == 1, lines
    assert io(inner)["bytes_written"] == len(data)
    inner.stop()
