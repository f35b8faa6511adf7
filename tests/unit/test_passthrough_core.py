"""In-process tests of the passthrough rules of `CacheFs` (cachemgr/core/handles.py
`passthrough_open`, `take_in_writes`) and of `cachemgr.core.passthrough.Backings`, with a fake
kernel: which opens get a backing id, that an inode keeps one backing file while it has passthrough
opens, what a refused registration does, and that the daemon takes in the size and mtime "the
kernel" wrote (here: the test writing the cache file directly, as the kernel does).

The real kernel is in tests/mount/test_passthrough.py.
"""

from __future__ import annotations

import errno
import os

import pytest

from cachemgr.core.fs import CacheFs
from cachemgr.core.passthrough import Backings

ROOT = 1
UID, GID = 0, 0


class FakeKernel:
    """Backing ids as FUSE_DEV_IOC_BACKING_OPEN/CLOSE hand them out."""

    def __init__(self) -> None:
        self.next_id = 1
        self.open: dict[int, int] = {}  # backing id -> fd it was given
        self.refuse: int | None = None  # errno to refuse the next registration with

    def register(self, fd: int) -> int:
        if self.refuse is not None:
            err, self.refuse = self.refuse, None
            raise OSError(err, os.strerror(err))
        os.fstat(fd)  # a valid fd
        bid = self.next_id
        self.next_id += 1
        self.open[bid] = fd
        return bid

    def unregister(self, bid: int) -> None:
        del self.open[bid]


@pytest.fixture
def kernel():
    return FakeKernel()


@pytest.fixture
def fs(tmp_path, kernel):
    fs = CacheFs.load(tmp_path / "cache",
                      backings=Backings(kernel.register, kernel.unregister))
    yield fs
    fs.close()
    assert kernel.open == {}, "a backing id outlived its last handle"


def create(fs, name: bytes, flags: int = os.O_RDWR):
    res, node = fs.create(ROOT, name, 0o644, flags | os.O_CREAT, UID, GID)
    return res, node


def test_new_file_is_passthrough_and_one_backing_per_inode(fs, kernel):
    res, node = create(fs, b"f")
    assert res.backing_id == 1 and not res.keep_cache and not res.direct_io
    second = fs.open(node.ino, os.O_RDONLY)
    assert second.backing_id == res.backing_id  # the same backing file for the inode
    assert len(kernel.open) == 1
    fs.release(res.fh)
    assert kernel.open  # still one passthrough handle
    fs.release(second.fh)
    assert kernel.open == {}
    assert fs.backings.statistics().passthrough_opens == 2


def test_open_in_page_cache_mode_keeps_the_next_open_in_user_space(fs, kernel):
    res, node = create(fs, b"f")
    fs.release(res.fh)
    fs.backings.turn_off("test")  # an open served by the daemon (page-cache read)...
    r1 = fs.open(node.ino, os.O_RDONLY)
    assert r1.backing_id == 0
    fs.backings.off_reason = None  # ...and passthrough back on while it is open
    r2 = fs.open(node.ino, os.O_RDONLY)
    assert r2.backing_id == 0, "the kernel refuses passthrough on an inode open in page-cache mode"
    assert fs.backings.fallbacks == 1
    fs.release(r1.fh)
    fs.release(r2.fh)
    r3 = fs.open(node.ino, os.O_RDONLY)  # nobody has it open: passthrough
    assert r3.backing_id > 0
    fs.release(r3.fh)


def test_refused_registration(fs, kernel):
    kernel.refuse = errno.EMFILE  # this open only
    res, node = create(fs, b"a")
    assert res.backing_id == 0 and fs.backings.on
    fs.release(res.fh)
    kernel.refuse = errno.EPERM  # cannot work on this mount: off for good, said why
    r = fs.open(node.ino, os.O_RDONLY)
    assert r.backing_id == 0
    assert not fs.backings.on and "Operation not permitted" in fs.backings.off_reason
    fs.release(r.fh)
    r = fs.open(node.ino, os.O_RDONLY)
    assert r.backing_id == 0 and kernel.open == {}
    fs.release(r.fh)


def test_takes_in_what_the_kernel_wrote(fs, kernel):
    res, node = create(fs, b"f")
    path = fs.cache.files.path(node.ino)
    before = fs.files.cached_bytes
    with open(path, "r+b") as f:  # the kernel writing the backing file
        f.write(b"x" * 5000)
    assert fs.getattr(node.ino).size == 0  # nothing told the daemon yet
    fs.take_in_writes(node)
    assert node.size == 5000 and fs.files.cached_bytes == before + 5000
    st = os.stat(path)
    assert node.mtime_ns == st.st_mtime_ns
    gen = node.gen
    fs.take_in_writes(node)  # unchanged: nothing to take in
    assert node.gen == gen
    with open(path, "r+b") as f:
        f.seek(10000)
        f.write(b"y")
    fs.flush(res.fh)  # flush takes it in and persists it
    assert fs.index.get_inode(node.ino)[4] == 10001
    fs.release(res.fh)
    assert not fs.backings.writing(node.ino)
    assert fs.check_consistency() == []


def test_set_id_writer_is_served_by_the_daemon(fs, kernel):
    from cachemgr.core.inodes import Caller

    res, node = create(fs, b"s")
    fs.release(res.fh)
    fs.setattr(node.ino, mode=0o4755)
    user = Caller(1000, 1000, 1)
    r = fs.open(node.ino, os.O_WRONLY, user)
    assert r.backing_id == 0  # its writes must drop S_ISUID (CacheFs.before_write)
    fs.write(r.fh, 0, b"z")
    assert not node.mode & 0o4000
    fs.release(r.fh)


def test_no_passthrough_writes_while_the_index_reserve_is_released(fs, kernel):
    res, node = create(fs, b"f")
    fs.release(res.fh)
    if not fs.index.reserve_bytes:
        pytest.skip("no index reserve configured")
    fs.index._release_reserve()
    fs.index._make_reserve = lambda **kw: None  # the disk stays full (no room to take it back)
    w = fs.open(node.ino, os.O_WRONLY)
    assert w.backing_id == 0
    r = fs.open(node.ino, os.O_RDONLY)
    assert r.backing_id == 0  # open in user space already: stays so
    fs.release(w.fh)
    fs.release(r.fh)
    r = fs.open(node.ino, os.O_RDONLY)  # reads need no room
    assert r.backing_id > 0
    fs.release(r.fh)


def test_backings_off_without_a_binding():
    b = Backings(off_reason="--no-passthrough")
    assert not b.on and b.mode == "fuse" and b.off_reason == "--no-passthrough"
    assert Backings().off_reason == "no passthrough binding"


def test_a_passthrough_reader_that_reads_holds_uploads_back_for_a_while(fs, kernel):
    """The daemon sees no passthrough reads; `busy_since_probe` (the upload scheduler's
    foreground probe) finds them in the opener's read counter, for READ_HOLD_S after its open,
    and forgets the process at its last release. Writers' handles are not readers."""
    from cachemgr.core.inodes import Caller
    from cachemgr.core.passthrough import READ_HOLD_S

    b = fs.backings
    t = [1000.0]
    counters = {4242: 0, 4343: 0}
    b.clock = lambda: t[0]
    b.read_counter = counters.get
    res, node = create(fs, b"f")
    fs.release(res.fh)
    reader = Caller(1000, 1000, 4242)
    r1 = fs.open(node.ino, os.O_RDONLY, reader)
    r2 = fs.open(node.ino, os.O_RDONLY, reader)
    w = fs.open(node.ino, os.O_WRONLY, Caller(1000, 1000, 4343))
    assert r1.backing_id and r2.backing_id and w.backing_id
    b.busy_since_probe()  # the first probe takes the baselines (the reader's counter)
    assert not b.busy_since_probe()  # nothing read or written since
    counters[4343] += 10  # the writer's process reads something: not a reader of ours
    assert not b.busy_since_probe()
    counters[4242] += 1 << 20
    assert b.busy_since_probe()
    assert not b.busy_since_probe()
    fs.release(r1.fh)  # one of its two handles: still a reader
    counters[4242] += 1
    assert b.busy_since_probe()
    t[0] += READ_HOLD_S + 1  # long after its open: reading elsewhere holds nothing back
    counters[4242] += 1
    assert not b.busy_since_probe()
    r3 = fs.open(node.ino, os.O_RDONLY, reader)  # a new open starts the window again
    counters[4242] += 1
    assert b.busy_since_probe()
    del counters[4242]  # the process is gone (or not ours to read): nothing to say
    assert not b.busy_since_probe()
    for h in (r2, r3, w):
        fs.release(h.fh)
    assert b._readers == {}


def test_read_counter_of_a_real_process():
    """/proc/PID/io's rchar moves when the process reads, and a gone process reads as None."""
    import subprocess
    import sys

    from cachemgr.core.passthrough import read_counter

    child = subprocess.Popen(
        [sys.executable, "-c",
         ("import sys\nfor line in sys.stdin:\n    open('/proc/self/stat','rb').read()\n"
          "    print('ok', flush=True)\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ok\n"  # started and idle, waiting on stdin
        before = read_counter(child.pid)
        assert before is not None and before > 0
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "ok\n"
        assert read_counter(child.pid) > before
    finally:
        child.stdin.close()
        child.wait()
    assert read_counter(child.pid) is None
