"""--cache-size accounting from the user's side: a sparse file counts the blocks it holds, not
its length; a writer waiting for room wakes as soon as room is made (a delete, a truncate);
a file the store can never hold fails its set with the reason instead of leaving it
`uploading` (so `umount` and `ckptfs wait` end)."""

from __future__ import annotations

import errno
import os
import threading

import pytest

import ckptfs
from tests.conftest import wait_for

MiB = 1 << 20
TiB = 1 << 40


def _status(m) -> dict:
    return ckptfs.status(m.path)


def test_sparse_truncate_counts_blocks_and_fails_its_set_with_a_reason(mount_factory):
    m = mount_factory()
    m.start("--cache-size", "64M")
    big = m.path / "huge.bin"
    with open(big, "wb"):
        pass
    os.truncate(big, 10 * TiB)  # a hole: no block is written (ext4's limit is 16 TiB)
    assert os.stat(big).st_size == 10 * TiB
    assert _status(m)["cache"]["cached_bytes"] < 1 * MiB
    # A writer is not held back by the hole.
    data = os.urandom(8 * MiB)
    (m.path / "small.bin").write_bytes(data)
    assert (m.path / "small.bin").read_bytes() == data
    # 10 TiB is more than the store's largest object (S3: 5 TiB): its set fails, said why.
    res = wait_for(lambda: next((s for s in _status(m)["tiering"]["sets"]
                                 if s["path"] == "huge.bin" and s["state"] == "failed"), None),
                   timeout=60, what="the huge file's set to fail")
    assert "cannot be stored" in res["error"], res
    with pytest.raises(ckptfs.NotDurable):
        ckptfs.wait_durable(big, timeout=30)
    ckptfs.wait_durable(m.path / "small.bin", timeout=60)
    os.unlink(big)
    m.stop()  # returns: nothing is left `uploading`
    assert not m.unexpected_errors()


def test_a_writer_waiting_for_room_wakes_when_a_file_is_deleted(mount_factory, tmp_path):
    gate = tmp_path / "uploads-held"
    gate.touch()
    m = mount_factory()
    os.environ["CKPTFS_FAULTS"] = (f"put@data/=hold:{gate},create_multipart@data/=hold:{gate},"
                                   f"upload_part@data/=hold:{gate}")
    try:
        m.start("--cache-size", "64M")
    finally:
        del os.environ["CKPTFS_FAULTS"]
    # 48 MiB not uploaded (held): not evictable.
    (m.path / "a.tmp").write_bytes(os.urandom(48 * MiB))
    done = threading.Event()

    def writer():
        with open(m.path / "b.tmp", "wb") as f:
            f.write(os.urandom(32 * MiB))  # needs room the cache cannot make yet
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    wait_for(lambda: done.is_set() or "writers wait for uploads" in m.log_text(),
             timeout=60, what="the writer to wait for room")
    assert not done.is_set()
    os.unlink(m.path / "a.tmp")  # frees 48 MiB: the waiting writer must wake now
    t.join(60)
    assert done.is_set() and not t.is_alive()
    gate.unlink()
    os.unlink(m.path / "b.tmp")  # in no set: `umount` would exit 12 (docs/SEMANTICS.md)
    m.stop()
    assert not m.unexpected_errors()


def test_fallocate_counts_under_cache_size_and_a_reservation_larger_than_it_is_refused(
        mount_factory):
    """A reservation counts like written data: one that can never fit under --cache-size is
    refused with ENOSPC and changes nothing; one that fits is counted at once."""
    m = mount_factory()
    m.start("--cache-size", "64M")
    p = m.path / "pre.bin"
    base = _status(m)["cache"]["cached_bytes"]
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as e:
            os.posix_fallocate(fd, 0, 128 * MiB)
        assert e.value.errno == errno.ENOSPC
        assert os.fstat(fd).st_size == 0
        assert _status(m)["cache"]["cached_bytes"] == base
        os.posix_fallocate(fd, 0, 16 * MiB)
        assert os.fstat(fd).st_size == 16 * MiB
        assert _status(m)["cache"]["cached_bytes"] == base + 16 * MiB
    finally:
        os.close(fd)
    assert p.read_bytes() == bytes(16 * MiB)
    ckptfs.wait_durable(p, timeout=60)
    m.stop()
    assert not m.unexpected_errors()
