"""The small disk of the full-cache-disk tests (tests/unit/test_diskfull.py,
tests/mount/test_diskfull_mount.py): `disk`, a 48 MiB tmpfs mounted for the test (root only).
"""

from __future__ import annotations

import subprocess

import pytest

MiB = 1 << 20


@pytest.fixture
def disk(tmp_path):
    """A 48 MiB tmpfs: room for the 8 MiB index reserve and a few checkpoints."""
    d = tmp_path / "disk"
    d.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48M", "tmpfs", str(d)],
                         check=False, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=True)
