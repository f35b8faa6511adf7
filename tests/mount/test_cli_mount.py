"""The `ckptfs` command line through real mounts (the `mnt`/`mount_factory` fixtures: real daemons
through the real CLI): documented exit codes and one-line messages (README "Exit codes") where
the refusal needs a mount, the mount point or cache dir already in use, a busy umount, a stale
mount of a dead daemon. The rest: tests/unit/test_cli.py.

Every failure must print exactly one line on stderr, starting with `ckptfs: `, and no traceback.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from ckptfs.mount import (
    EXIT_CACHE_DIR,
    EXIT_ERROR,
    EXIT_MOUNTPOINT,
    EXIT_OK,
    EXIT_USAGE,
)
from tests.cli_helpers import _tree, _undo_mount, mount_cli, one_line_error
from tests.conftest import _alive, is_mounted, require_fuse, run_cli

# ----------------------------------------------------------------------------------------------
# mount point (3)


def test_mountpoint_already_mounted(mnt, tmp_path: Path) -> None:
    (mnt.path / "f").write_bytes(b"data")
    line = one_line_error(mount_cli(mnt.path, tmp_path / "other-cache"), EXIT_MOUNTPOINT,
                          str(mnt.path))
    assert "already mounted" in line
    # The existing mount is untouched and still answers.
    assert _alive(mnt.pid)
    assert (mnt.path / "f").read_bytes() == b"data"


# ----------------------------------------------------------------------------------------------
# cache dir (4)


def test_cache_dir_in_use(mnt, mount_factory) -> None:
    other = mount_factory("other", cache_dir=mnt.cache_dir)
    res = other.start("--store", f"file://{mnt.store_dir}", check=False)
    line = one_line_error(res, EXIT_CACHE_DIR, str(mnt.cache_dir), f"pid {mnt.pid}")
    assert "in use" in line
    assert not is_mounted(other.path)
    # The first mount is unaffected, and its lock still names it.
    assert _alive(mnt.pid)
    (mnt.path / "still-works").write_bytes(b"ok")
    assert (mnt.path / "still-works").read_bytes() == b"ok"
    assert (mnt.cache_dir / "lock").read_text().strip() == str(mnt.pid)


def test_cache_dir_incompatible_layout(mount_factory) -> None:
    m = mount_factory("old")
    m.cache_dir.mkdir()
    (m.cache_dir / "layout.json").write_text(json.dumps({"format": "ckptfs-cache",
                                                         "version": 99}))
    res = m.start(check=False)
    line = one_line_error(res, EXIT_CACHE_DIR, str(m.cache_dir))
    assert "version" in line
    assert not is_mounted(m.path)


def test_cache_dir_empty_or_fresh_fs_is_claimed(mount_factory) -> None:
    """An empty directory (or one holding only lost+found, the root of a fresh filesystem)
    becomes a cache; once it has layout.json it is remounted as one."""
    m = mount_factory("fresh")
    m.cache_dir.mkdir()
    (m.cache_dir / "lost+found").mkdir()
    m.start()
    assert json.loads((m.cache_dir / "layout.json").read_text())["format"] == "ckptfs-cache"
    (m.path / "f").write_bytes(b"kept")
    m.remount()
    assert (m.path / "f").read_bytes() == b"kept"
    m.stop()


@pytest.mark.parametrize("case", ["same", "cache-inside-new", "cache-inside-symlink",
                                  "mountpoint-inside-cache", "log-inside"])
def test_cache_dir_and_mountpoint_overlap(tmp_path: Path, mount_factory, case: str) -> None:
    """Cache dir at or inside the mount point (the daemon then reaches its cache through its own
    mount: it hung in D state), or the mount point inside the cache dir, compared as resolved
    paths: refused with exit 4 before anything is created; a log file inside the mount point
    (the same hang) with exit 2."""
    require_fuse()
    mp = tmp_path / "mp"
    mp.mkdir()
    extra: list[str] = []
    code = EXIT_CACHE_DIR
    if case == "same":
        cache = mp
    elif case == "cache-inside-new":
        cache = mp / "sub" / "cache"
    elif case == "cache-inside-symlink":
        (tmp_path / "link").symlink_to(mp)
        cache = tmp_path / "link" / "cache"
    elif case == "log-inside":
        cache, code = tmp_path / "cache", EXIT_USAGE
        extra = ["--log-file", str(mp / "ckptfs.log")]
    else:  # the mount point in an existing, valid cache dir
        first = mount_factory("first")
        first.start()
        first.stop()
        cache = first.cache_dir
        mp = cache / "mnt"
        mp.mkdir()
    before = _tree(tmp_path)
    res = mount_cli(mp, cache, *extra)
    _undo_mount(res, mp)
    line = one_line_error(res, code, str(mp))
    assert "inside" in line or "is the mount point" in line
    assert _tree(tmp_path) == before
    assert not is_mounted(mp)


# ----------------------------------------------------------------------------------------------
# umount


def test_umount_busy(mnt) -> None:
    (mnt.path / "d").mkdir()
    sleeper = subprocess.Popen(["sleep", "600"], cwd=mnt.path / "d")
    try:
        line = one_line_error(run_cli("umount", str(mnt.path)), EXIT_ERROR, str(mnt.path))
        assert "busy" in line
        # Still mounted, daemon alive, mount answering.
        assert is_mounted(mnt.path)
        assert _alive(mnt.pid)
        assert os.listdir(mnt.path) == ["d"]
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    res = run_cli("umount", str(mnt.path))
    assert res.returncode == EXIT_OK, res.stderr
    assert res.stdout.startswith("ckptfs: unmounted") and res.stderr == ""
    assert not is_mounted(mnt.path)
    assert not _alive(mnt.pid)
    mnt.pid = None


def test_mount_umount_roundtrip(mount_factory) -> None:
    m = mount_factory("rt")
    res = m.start()
    assert res.stdout.startswith("ckptfs: mounted ") and res.stderr == ""
    assert len(res.stdout.splitlines()) == 1
    assert str(m.path) in res.stdout and f"pid {m.pid}" in res.stdout
    pid = m.pid
    res = run_cli("umount", str(m.path))
    assert res.returncode == EXIT_OK and res.stderr == ""
    assert res.stdout == f"ckptfs: unmounted {m.path}\n"
    # umount returns only once the daemon has exited (and released the cache-dir lock).
    assert not _alive(pid)
    assert not is_mounted(m.path)
    assert (m.cache_dir / "lock").read_text() == ""
    m.pid = None


# ----------------------------------------------------------------------------------------------
# stale mount of a dead daemon


@pytest.mark.parametrize("idle", [False, True], ids=["after-writes", "idle"])
def test_stale_mount_cleaned_up(mnt, idle: bool) -> None:
    """`idle`: the daemon dies right after mounting, while the kernel still caches the mount
    point's attributes (a plain stat of it succeeds); the dead mount must be detected anyway."""
    if not idle:
        (mnt.path / "kept").write_bytes(b"survives")
    old_pid = mnt.pid
    mnt.kill9()
    assert is_mounted(mnt.path)
    with pytest.raises(OSError) as ei:
        os.listdir(mnt.path)
    # ECONNABORTED when the request raced the kernel aborting the dying daemon's connection.
    assert ei.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    res = mnt.start()  # asserts exit 0, mounted, pid
    assert mnt.pid != old_pid
    note = res.stderr.splitlines()
    assert len(note) == 1 and note[0].startswith("ckptfs: ")
    assert "stale mount" in note[0] and str(mnt.path) in note[0]
    assert "Traceback" not in res.stderr
    assert res.stdout.startswith("ckptfs: mounted")
    # Exactly one mount at the mount point (the stale one is gone), and it answers.
    with open("/proc/self/mountinfo") as f:
        assert sum(ln.split()[4] == str(mnt.path) for ln in f) == 1
    assert os.listdir(mnt.path) == ([] if idle else ["kept"])
    if not idle:
        assert (mnt.path / "kept").read_bytes() == b"survives"
    # `kept` is in no set if its close had not reached the daemon when it died (a file open
    # for writing at a crash commits only at its next close: docs/SEMANTICS.md)
    mnt.stop("--allow-unsaved")
    assert not is_mounted(mnt.path)
