"""The `ckptfs` command line: documented exit codes and one-line messages (README "Exit codes").

Every failure must print exactly one line on stderr, starting with `ckptfs: `, and no traceback.
The tests that need a mount (the `mnt`/`mount_factory` fixtures: real daemons through the real
CLI) are in tests/mount/test_cli_mount.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ckptfs import mount as ckmount
from ckptfs.mount import (
    EXIT_CACHE_DIR,
    EXIT_MOUNTPOINT,
    EXIT_NO_FUSE,
    EXIT_OK,
    EXIT_USAGE,
    MountError,
)
from tests.cli_helpers import _tree, _undo_mount, mount_cli, one_line_error, store_opt
from tests.conftest import REPO, _alive, ckptfs_cmd, is_mounted, require_fuse, run_cli, wait_for

IS_ROOT = os.geteuid() == 0


# ----------------------------------------------------------------------------------------------
# help and usage errors (2)


def test_help() -> None:
    res = run_cli("--help")
    assert res.returncode == 0, res.stderr
    assert "mount" in res.stdout and "umount" in res.stdout
    assert res.stderr == ""
    for sub in ("mount", "umount"):
        res = run_cli(sub, "--help")
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith("usage: ckptfs " + sub), res.stdout
        assert "mountpoint" in res.stdout
        assert res.stderr == ""
    res = run_cli("mount", "--help")
    for opt in ("--cache-dir", "--foreground", "--log-level", "--attr-timeout", "--io-threads"):
        assert opt in res.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--log-level", "nonsense"], "--log-level"),
        (["--attr-timeout", "-1"], "--attr-timeout"),
        (["--attr-timeout", "soon"], "--attr-timeout"),
        (["--attr-timeout", "7200"], "--attr-timeout"),
        (["--io-threads", "999"], "--io-threads"),
        (["--io-threads", "-1"], "--io-threads"),
        (["--read-ahead-kb", "1000000"], "--read-ahead-kb"),
        (["--no-such-option"], "--no-such-option"),
        # a malformed endpoint is a usage error, not "store unusable" (exit 7)
        (["--store", "s3://b/p", "--endpoint-url", "not a url"], "--endpoint-url"),
        (["--store", "s3://b/p", "--endpoint-url", "ftp://127.0.0.1:9"], "--endpoint-url"),
        (["--store", "s3://b/p", "--endpoint-url", "http://"], "--endpoint-url"),
        (["--store", "s3://b/p", "--s3-endpoint", "http://h:99999"], "--endpoint-url"),
    ],
    ids=["log-level", "attr-timeout-neg", "attr-timeout-nan", "attr-timeout-big", "io-threads-big",
         "io-threads-neg", "read-ahead-big", "unknown-option", "endpoint-words",
         "endpoint-scheme", "endpoint-no-host", "endpoint-bad-port"],
)
def test_bad_option_values(tmp_path: Path, args: list[str], needle: str) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    cache = tmp_path / "cache"
    res = mount_cli(mp, cache, *args)
    one_line_error(res, EXIT_USAGE, needle)
    # Refused before anything was touched.
    assert not is_mounted(mp)
    assert not cache.exists()


_SIZE_OPTS = ("--part-size", "--cache-size", "--prefetch-range")
_INT_OPTS = ("--parts-in-flight", "--upload-files", "--keep-local", "--prefetch-concurrency",
             "--io-threads", "--read-ahead-kb")
_SECONDS_OPTS = ("--attr-timeout", "--refresh-interval", "--commit-timeout")
_BAD_NUMBERS = ("nan", "inf", "-1", "1e400", "")


@pytest.mark.parametrize("value", _BAD_NUMBERS, ids=lambda v: v or "empty")
@pytest.mark.parametrize("opt", _SIZE_OPTS + _INT_OPTS + _SECONDS_OPTS)
def test_bad_numbers_exit_2(tmp_path: Path, opt: str, value: str) -> None:
    """Every numeric mount option refuses nan, inf, a negative number, an overflowing one and
    an empty value with exit 2 and one line naming the option (--part-size nan used to end in
    an unexpected ValueError, exit 1; an empty --cache-size used to mean "no limit")."""
    mp = tmp_path / "mp"
    mp.mkdir()
    cache = tmp_path / "cache"
    res = mount_cli(mp, cache, opt, value)
    _undo_mount(res, mp)  # a value taken for valid: do not leave the mount behind
    one_line_error(res, EXIT_USAGE, opt)
    assert not is_mounted(mp)
    assert not cache.exists()


@pytest.mark.parametrize("value", _BAD_NUMBERS, ids=lambda v: v or "empty")
@pytest.mark.parametrize("cmd", ["umount", "wait"])
def test_bad_timeout_exit_2(tmp_path: Path, cmd: str, value: str) -> None:
    one_line_error(run_cli(cmd, str(tmp_path), "--timeout", value), EXIT_USAGE, "--timeout")


def test_parse_size_unit() -> None:
    from ckptfs.config import ConfigError, parse_size

    assert parse_size("64M") == 64 << 20
    assert parse_size("1.5k") == 1536
    assert parse_size("4096") == 4096
    for bad in ("nan", "inf", "-inf", "1e400", "-1", "", " ", "M", "12X"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_usage_errors(tmp_path: Path) -> None:
    one_line_error(run_cli(), EXIT_USAGE)                       # no command
    one_line_error(run_cli("frobnicate"), EXIT_USAGE, "frobnicate")
    one_line_error(run_cli("mount"), EXIT_USAGE, "mountpoint")  # missing argument
    one_line_error(run_cli("umount", str(tmp_path), "--timeout", "x"), EXIT_USAGE, "--timeout")


# ----------------------------------------------------------------------------------------------
# mount point (3)


def test_mountpoint_missing(tmp_path: Path) -> None:
    require_fuse()  # preflight checks FUSE first
    mp = tmp_path / "nope"
    line = one_line_error(mount_cli(mp, tmp_path / "cache"), EXIT_MOUNTPOINT, str(mp))
    assert "does not exist" in line
    assert not mp.exists()


def test_mountpoint_not_a_directory(tmp_path: Path) -> None:
    require_fuse()  # preflight checks FUSE first
    mp = tmp_path / "file"
    mp.write_bytes(b"x")
    line = one_line_error(mount_cli(mp, tmp_path / "cache"), EXIT_MOUNTPOINT, str(mp))
    assert "not a directory" in line
    assert mp.read_bytes() == b"x"


def test_mountpoint_not_empty(tmp_path: Path) -> None:
    require_fuse()  # preflight checks FUSE first
    mp = tmp_path / "mp"
    mp.mkdir()
    (mp / "precious").write_bytes(b"keep me")
    line = one_line_error(mount_cli(mp, tmp_path / "cache"), EXIT_MOUNTPOINT, str(mp))
    assert "not empty" in line
    assert not is_mounted(mp)
    assert (mp / "precious").read_bytes() == b"keep me"


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
def test_mountpoint_already_mounted_other_fs(tmp_path: Path) -> None:
    require_fuse()  # preflight checks FUSE first
    mp = tmp_path / "mp"
    mp.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mp)], check=True)
    try:
        line = one_line_error(mount_cli(mp, tmp_path / "cache"), EXIT_MOUNTPOINT, str(mp))
        assert "already mounted (tmpfs)" in line
    finally:
        subprocess.run(["umount", str(mp)], check=True)


# ----------------------------------------------------------------------------------------------
# cache dir (4)


def test_cache_dir_parent_is_a_file(tmp_path: Path) -> None:
    require_fuse()  # preflight checks FUSE before the cache dir
    mp = tmp_path / "mp"
    mp.mkdir()
    (tmp_path / "plain").write_bytes(b"")
    cache = tmp_path / "plain" / "cache"
    line = one_line_error(mount_cli(mp, cache), EXIT_CACHE_DIR, str(cache))
    assert "cannot create cache dir" in line
    assert not is_mounted(mp)


def test_cache_dir_is_a_file(tmp_path: Path) -> None:
    require_fuse()
    mp = tmp_path / "mp"
    mp.mkdir()
    cache = tmp_path / "cache"
    cache.write_bytes(b"")
    one_line_error(mount_cli(mp, cache), EXIT_CACHE_DIR, str(cache))
    assert not is_mounted(mp)


@pytest.mark.skipif(not IS_ROOT, reason="mounting a read-only tmpfs needs root")
def test_cache_dir_read_only(tmp_path: Path) -> None:
    require_fuse()
    mp = tmp_path / "mp"
    mp.mkdir()
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)], check=True)
    try:
        # The cache dir exists but cannot be written.
        line = one_line_error(mount_cli(mp, ro), EXIT_CACHE_DIR, str(ro))
        assert "not writable" in line
        # The cache dir would have to be created on a read-only filesystem.
        line = one_line_error(mount_cli(mp, ro / "cache"), EXIT_CACHE_DIR, str(ro / "cache"))
        assert "cannot create cache dir" in line
        assert not is_mounted(mp)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_cache_dir_not_a_cache_is_refused_untouched(tmp_path: Path) -> None:
    """A non-empty directory without layout.json is not adopted as a cache: recovery used to
    delete the user's files in its data/ as strays and the lock file was truncated."""
    require_fuse()
    mp = tmp_path / "mp"
    mp.mkdir()
    cache = tmp_path / "home-dir"
    (cache / "data").mkdir(parents=True)
    (cache / "data" / "precious.bin").write_bytes(b"user data")
    (cache / "data" / "7").write_bytes(b"looks like a cache file")
    (cache / "lock").write_bytes(b"my lock file")
    (cache / "notes.txt").write_bytes(b"notes")
    before = _tree(cache)
    res = mount_cli(mp, cache)
    _undo_mount(res, mp)
    line = one_line_error(res, EXIT_CACHE_DIR, str(cache))
    assert "not a ckptfs cache" in line and "not empty" in line
    assert _tree(cache) == before  # nothing created, deleted or changed
    assert not is_mounted(mp)


def test_load_refuses_foreign_dir(tmp_path: Path) -> None:
    """CacheFs.load itself (used by every caller, not only the CLI) never adopts a non-empty
    directory without layout.json, and leaves it as it was."""
    from cachemgr.core.errors import FsError
    from cachemgr.core.fs import CacheFs

    d = tmp_path / "d"
    (d / "data").mkdir(parents=True)
    (d / "data" / "stray").write_bytes(b"x")
    before = _tree(d)
    with pytest.raises(FsError) as ei:
        CacheFs.load(d)
    assert ei.value.errno == errno.ENOTEMPTY and "layout.json" in str(ei.value)
    assert _tree(d) == before
    CacheFs.load(tmp_path / "new").close()  # a new directory is still created as a cache


def test_racing_preflights_claim_a_new_cache_dir(tmp_path: Path) -> None:
    """Several preflights claiming one new cache dir at once: each either passes or finds the
    dir in use; none sees another's half-written layout.json or its temporary file as foreign
    content."""
    import threading

    cache = tmp_path / "cache"
    n = 8
    barrier = threading.Barrier(n)
    errors: list[str] = []

    def claim() -> None:
        barrier.wait()
        try:
            ckmount.check_cache_dir(cache)
        except MountError as e:
            if "in use" not in e.msg:
                errors.append(e.msg)

    threads = [threading.Thread(target=claim) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert json.loads((cache / "layout.json").read_text())["format"] == "ckptfs-cache"
    assert sorted(os.listdir(cache)) == ["layout.json", "lock"]


def test_check_overlap_unit(tmp_path: Path) -> None:
    a = tmp_path / "a"
    for cache, mp in ((a, a), (a / "c", a), (a, a / "m"), (tmp_path / "x" / ".." / "a", a)):
        with pytest.raises(MountError) as ei:
            ckmount.check_overlap(cache, mp)
        assert ei.value.code == EXIT_CACHE_DIR
    ckmount.check_overlap(tmp_path / "ab", a)  # a prefix of the name is no overlap
    ckmount.check_overlap(a, tmp_path / "ab")


# ----------------------------------------------------------------------------------------------
# FUSE missing (5)


@pytest.mark.skipif(not IS_ROOT or shutil.which("unshare") is None,
                    reason="needs root and unshare for a private mount namespace")
def test_dev_fuse_missing(tmp_path: Path) -> None:
    """Run the CLI in a private mount namespace where an empty tmpfs hides /dev."""
    mp = tmp_path / "mp"
    mp.mkdir()
    cache = tmp_path / "cache"
    script = ('mount -t tmpfs tmpfs /dev && test ! -e /dev/fuse && exec "$@"')
    res = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
         *ckptfs_cmd("mount", str(mp), "--cache-dir", str(cache), *store_opt(tmp_path))],
        capture_output=True, text=True, timeout=60, cwd=REPO)
    line = one_line_error(res, EXIT_NO_FUSE, "/dev/fuse")
    assert "missing" in line
    assert not cache.exists()


def test_check_fuse_unit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`check_fuse` directly: /dev/fuse missing, then fusermount3 missing from PATH."""
    real_exists = os.path.exists
    monkeypatch.setattr(ckmount.os.path, "exists",
                        lambda p: False if p == "/dev/fuse" else real_exists(p))
    with pytest.raises(MountError) as ei:
        ckmount.check_fuse()
    assert ei.value.code == EXIT_NO_FUSE and "/dev/fuse" in ei.value.msg
    monkeypatch.undo()
    if not os.path.exists("/dev/fuse"):
        return
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(MountError) as ei:
        ckmount.check_fuse()
    assert ei.value.code == EXIT_NO_FUSE and "fusermount3" in ei.value.msg


# ----------------------------------------------------------------------------------------------
# umount


def test_umount_not_mounted(tmp_path: Path) -> None:
    line = one_line_error(run_cli("umount", str(tmp_path)), EXIT_MOUNTPOINT, str(tmp_path))
    assert "not mounted" in line
    missing = tmp_path / "missing"
    one_line_error(run_cli("umount", str(missing)), EXIT_MOUNTPOINT, str(missing))


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
def test_umount_not_ckptfs(tmp_path: Path) -> None:
    mp = tmp_path / "mp"
    mp.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mp)], check=True)
    try:
        line = one_line_error(run_cli("umount", str(mp)), EXIT_MOUNTPOINT, str(mp))
        assert "not a ckptfs mount" in line
        assert is_mounted(mp)
    finally:
        subprocess.run(["umount", str(mp)], check=True)


# ----------------------------------------------------------------------------------------------
# foreground


def test_foreground_sigterm(tmp_path: Path) -> None:
    require_fuse()
    mp = tmp_path / "mp"
    mp.mkdir()
    cache = tmp_path / "cache"
    err_path = tmp_path / "fg.stderr"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(ckptfs_cmd("mount", "--foreground", str(mp), "--cache-dir",
                                           str(cache), *store_opt(tmp_path)),
                                stdout=subprocess.DEVNULL, stderr=err, cwd=REPO)
    try:
        wait_for(lambda: "ckptfs: mounted" in err_path.read_text(), timeout=60,
                 what="foreground mount to report ready")
        assert proc.poll() is None
        assert is_mounted(mp)
        assert f"pid {proc.pid}" in err_path.read_text()
        (mp / "f").write_bytes(b"hello")
        assert (mp / "f").read_bytes() == b"hello"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == EXIT_OK, err_path.read_text()
        assert not is_mounted(mp)
        assert "Traceback" not in err_path.read_text()
        assert os.listdir(mp) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if is_mounted(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True, check=False)
    # What was written survived the SIGTERM shutdown.
    res = mount_cli(mp, cache)
    assert res.returncode == 0, res.stderr
    try:
        assert (mp / "f").read_bytes() == b"hello"
    finally:
        res = run_cli("umount", str(mp))
        assert res.returncode == 0, res.stderr


# ----------------------------------------------------------------------------------------------
# stale mount of a dead daemon


def test_python_m_entry_point_matches_console_script() -> None:
    """`ckptfs` (console script) and `python -m ckptfs` are the same program."""
    exe = Path(sys.executable).parent / "ckptfs"
    if not exe.exists():
        pytest.skip("console script not installed in this environment")
    res = subprocess.run([str(exe), "umount", "/nonexistent-ckptfs-test"], capture_output=True,
                         text=True, timeout=60, check=False)
    one_line_error(res, EXIT_MOUNTPOINT, "not mounted")


def test_umount_daemon_left_unreaped(tmp_path: Path) -> None:
    """`umount` returns once the daemon has exited even if its parent never reaps it (a
    container init that does not reap): a zombie daemon counts as gone."""
    require_fuse()
    mp = tmp_path / "mp"
    mp.mkdir()
    cache = tmp_path / "cache"
    # A subreaper that adopts the daemon and does not reap it until its stdin closes.
    wrapper = (
        "import ctypes, subprocess, sys\n"
        "assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0\n"
        "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(r.returncode, r.stdout.strip(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", wrapper,
                             *ckptfs_cmd("mount", str(mp), "--cache-dir", str(cache),
                                         *store_opt(tmp_path))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    pid = None
    try:
        first = proc.stdout.readline().split()
        assert first[0] == "0", first
        pid = int(first[-1].rstrip(")"))
        assert is_mounted(mp)
        res = run_cli("umount", str(mp), "--timeout", "30")
        assert res.returncode == EXIT_OK, res.stderr
        assert not is_mounted(mp)
        with open(f"/proc/{pid}/stat") as f:  # still there, unreaped, but finished
            assert f.read().rpartition(")")[2].split()[0] == "Z"
    finally:
        if is_mounted(mp):
            subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True, check=False)
        proc.stdin.close()
        proc.wait(timeout=30)
        if pid is not None:
            wait_for(lambda: not _alive(pid), what="daemon to be reaped")
