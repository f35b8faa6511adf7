"""A full cache disk through a real mount: deleting an old checkpoint on a full disk works and
nothing is logged as a bug (in process, the index's reserve and refused operations that change
nothing: tests/unit/test_diskfull.py).

The cache directory lives on a small tmpfs mounted for the test (root only).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from cachemgr.core.fs import CacheFs
from tests.conftest import wait_for
from tests.diskfull_helpers import MiB, disk

__all__ = ["disk"]  # the fixture, imported for these tests


# ----------------------------------------------------------------------------------------------
# through a real mount


def test_delete_old_checkpoint_on_a_full_disk_through_the_mount(disk, mount_factory):
    m = mount_factory("full", cache_dir=disk / "cache")
    m.start()
    old = m.path / "step_100"
    old.mkdir()
    for r in range(2):
        (old / f"rank{r}.pt").write_bytes(os.urandom(6 * MiB))
    (m.path / "latest").symlink_to("step_100")
    # The next checkpoint fills the disk; its close then needs the index reserve, and what
    # the reserve freed is not for file data.
    new = m.path / "step_200"
    new.mkdir()
    for name in ("rank0.pt", "rank1.pt"):
        with pytest.raises(OSError) as e, open(new / name, "wb") as f:
            for _ in range(48):
                f.write(os.urandom(MiB))
                f.flush()
        assert e.value.errno == errno.ENOSPC
    os.unlink(new / "rank1.pt")
    # The user makes room: delete the old checkpoint, repoint `latest`.
    for p in sorted(old.iterdir()):
        p.unlink()
    old.rmdir()
    os.symlink("step_200", m.path / "latest.tmp")
    os.rename(m.path / "latest.tmp", m.path / "latest")
    want = {"latest": "step_200", "step_200": ["rank0.pt"]}
    size = (new / "rank0.pt").stat().st_size
    assert _tree(m.path) == want
    # The deleted files' data leaves the cache once the kernel forgets them; then the disk
    # has room for the index reserve again.
    wait_for(lambda: len(os.listdir(m.cache_dir / "data")) == 1 and
             (m.cache_dir / "index.reserve").exists(), what="the old checkpoint's space back")
    assert m.unexpected_errors() == []
    m.stop()
    fs = CacheFs.load(m.cache_dir)
    try:
        assert fs.check_consistency() == []
    finally:
        fs.close()
    m.start()
    assert _tree(m.path) == want
    assert (new / "rank0.pt").stat().st_size == size
    assert m.unexpected_errors() == []


def _tree(root: Path) -> dict:
    out: dict = {}
    for p in sorted(root.iterdir()):
        if p.is_symlink():
            out[p.name] = os.readlink(p)
        elif p.is_dir():
            out[p.name] = sorted(os.listdir(p))
    return out
