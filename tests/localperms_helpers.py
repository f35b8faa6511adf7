"""A path's permission bits and a umask set for a block (tests/unit/test_localperms.py,
tests/mount/test_localperms_mount.py).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@contextlib.contextmanager
def umask(m: int):
    old = os.umask(m)
    try:
        yield
    finally:
        os.umask(old)
