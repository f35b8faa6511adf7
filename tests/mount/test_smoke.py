"""The smallest end-to-end check: mount, write, read back, remount, read again."""

import os


def test_write_read_remount(mnt):
    p = mnt.path / "hello.bin"
    data = os.urandom(3 * 1024 * 1024 + 17)
    p.write_bytes(data)
    assert p.read_bytes() == data
    mnt.remount()
    assert p.read_bytes() == data
