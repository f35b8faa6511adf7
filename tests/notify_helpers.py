"""The notify and log rotation tests' shared pieces (tests/unit/test_notify.py,
tests/mount/test_notify_mount.py): the shipped logrotate config, and `short_dir`, a directory
whose path is short enough for an AF_UNIX socket.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO

LOGROTATE_CONF = REPO / "deploy" / "logrotate" / "ckptfs"


@pytest.fixture
def short_dir():
    """A directory with a short path: AF_UNIX socket paths are limited to 107 bytes, and
    pytest's tmp_path can be longer."""
    d = tempfile.mkdtemp(prefix="sd-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)
