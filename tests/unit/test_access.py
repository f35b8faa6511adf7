"""A root mount's control API used by other users, and registrations no one else can forge.

The usual deployment: the daemon runs as root (allow_other), the trainer as a normal user. Here
the trainer is uid 65534 (nobody): `ckptfs status|wait|commit|prefetch` and
`ckptfs.wait_durable()` work for it on what it may read (or write, for commit), and are refused
with exit code 9 on the rest. A registration directory another uid planted (or one with a bad
mode, or a symlink) is never believed, by clients and by daemons alike.

Needs root (to switch users) and a python the other uid can run: the test venv's interpreter
may live under a root-only directory, so the system python with the venv's site-packages on
PYTHONPATH is tried too.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from ckptfs import control
from ckptfs import mount as ckmount
from ckptfs.mount import EXIT_ACCESS, EXIT_CACHE_DIR, EXIT_NO_SET, EXIT_OK
from tests.cli_helpers import one_line_error
from tests.conftest import REPO, Mount, is_mounted, require_fuse, run_cli, wait_for

NOBODY = 65534
FORGER = 4321      # another unprivileged uid, the one planting registrations
EXTRA_GID = 4242   # a supplementary group of the trainer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


def _user_env(world) -> dict[str, str]:
    return {"HOME": str(world.home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "XDG_RUNTIME_DIR": str(world.xdg), "LANG": "C.UTF-8",
            "PYTHONPATH": sysconfig.get_paths()["purelib"]}


def _run_as(world, argv: list[str], *, uid: int = NOBODY, groups: tuple[int, ...] = (),
            timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=_user_env(world), user=uid, group=NOBODY,
                          extra_groups=list(groups), check=False)


@functools.cache
def _user_python() -> str | None:
    """An interpreter uid 65534 can run that imports ckptfs from the repo."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": sysconfig.get_paths()["purelib"],
           "HOME": "/"}
    for py in (sys.executable, os.path.realpath(sys.executable), "/usr/bin/python3"):
        try:
            probe = "import sys, ckptfs, trio; print(sys.version_info[:2])"
            res = subprocess.run([py, "-c", probe],
                                 capture_output=True, text=True, timeout=60, cwd=REPO, env=env,
                                 user=NOBODY, group=NOBODY, extra_groups=[], check=False)
        except OSError:
            continue
        if res.returncode == 0 and res.stdout.strip() == str(tuple(sys.version_info[:2])):
            return py
    return None


def ckptfs_as(world, *args: str, **kw) -> subprocess.CompletedProcess:
    py = _user_python()
    if py is None:
        pytest.skip(f"no python that uid {NOBODY} can run imports ckptfs here")
    return _run_as(world, [py, "-m", "ckptfs", *args], **kw)


@pytest.fixture
def world():
    """A directory tree every user can traverse (pytest's tmp_path is root-only): the trainer's
    HOME, and a sticky world-writable dir as its XDG_RUNTIME_DIR (like /tmp, where a
    non-root daemon's registration dir /tmp/ckptfs-<uid> lives without XDG_RUNTIME_DIR)."""
    base = Path(tempfile.mkdtemp(prefix="ckptfs-access-", dir="/tmp"))
    os.chmod(base, 0o755)
    home = base / "home"
    home.mkdir(mode=0o700)
    os.chown(home, NOBODY, NOBODY)
    xdg = base / "xdg"
    xdg.mkdir()
    os.chmod(xdg, 0o1777)
    yield SimpleNamespace(base=base, home=home, xdg=xdg)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def root_mount(world):
    m = Mount(world.base, "root")
    m.start()
    yield m
    m.cleanup()
    errors = m.unexpected_errors()
    assert not errors, "daemon logged unexpected errors:\n" + "\n".join(errors)


def _write(p: Path, data: bytes, mode: int = 0o644) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    os.chmod(p, mode)


def _commit_durable(m: Mount, rel: str) -> None:
    res = run_cli("commit", str(m.path / rel))
    assert res.returncode == 0, res.stderr
    res = run_cli("wait", str(m.path / rel), "--timeout", "60")
    assert res.returncode == 0, res.stderr


def test_non_root_trainer_uses_root_mount(world, root_mount) -> None:
    m = root_mount
    mp = m.path
    # As root, through the mount: what the trainer may and may not see or change.
    _write(mp / "pub" / "step1" / "a.pt", b"a" * 1000)
    _commit_durable(m, "pub/step1")
    _write(mp / "pub" / "step2.tmp" / "d.pt", b"d" * 10)
    (mp / "priv").mkdir(mode=0o700)
    _write(mp / "priv" / "s" / "b.pt", b"b" * 100, 0o600)
    _commit_durable(m, "priv/s")
    (mp / "grp").mkdir()
    os.chown(mp / "grp", 0, EXTRA_GID)
    os.chmod(mp / "grp", 0o750)
    _write(mp / "grp" / "g" / "g.pt", b"g" * 10)
    _commit_durable(m, "grp/g")
    (mp / "nob").mkdir()
    os.chown(mp / "nob", NOBODY, NOBODY)
    _write(mp / "nob" / "c.pt", b"c" * 10)

    # status: the mount root is readable by everyone.
    res = ckptfs_as(world, "status", str(mp))
    assert res.returncode == EXIT_OK, res.stderr
    assert f"pid {m.pid}" in res.stdout

    # wait: a readable durable file; an unreadable one is refused, not reported.
    res = ckptfs_as(world, "wait", str(mp / "pub" / "step1" / "a.pt"), "--timeout", "60")
    assert res.returncode == EXIT_OK, res.stderr
    assert "is durable" in res.stdout
    line = one_line_error(ckptfs_as(world, "wait", str(mp / "priv" / "s" / "b.pt")),
                          EXIT_ACCESS, "permission denied")
    assert "/priv" in line
    # Readable through a supplementary group only (SO_PEERGROUPS), and not without it.
    res = ckptfs_as(world, "wait", str(mp / "grp" / "g" / "g.pt"), groups=(EXTRA_GID,))
    assert res.returncode == EXIT_OK, res.stderr
    one_line_error(ckptfs_as(world, "wait", str(mp / "grp" / "g" / "g.pt")), EXIT_ACCESS,
                   "permission denied")
    # A readable path in no committed set still gets its real answer.
    one_line_error(ckptfs_as(world, "wait", str(mp / "pub" / "step2.tmp" / "d.pt")), EXIT_NO_SET)

    # commit: a directory the trainer may write; not one it may only read.
    res = ckptfs_as(world, "commit", str(mp / "nob"))
    assert res.returncode == EXIT_OK, res.stderr
    res = ckptfs_as(world, "wait", str(mp / "nob" / "c.pt"), "--timeout", "60")
    assert res.returncode == EXIT_OK, res.stderr
    one_line_error(ckptfs_as(world, "commit", str(mp / "pub" / "step2.tmp")), EXIT_ACCESS,
                   "permission denied", "write")

    # prefetch: readable yes, unreadable no.
    res = ckptfs_as(world, "prefetch", str(mp / "pub" / "step1"), "--no-wait")
    assert res.returncode == EXIT_OK, res.stderr
    one_line_error(ckptfs_as(world, "prefetch", str(mp / "priv" / "s")), EXIT_ACCESS,
                   "permission denied")

    # The Python API, from the trainer's process.
    py = _user_python()
    script = ("import sys, ckptfs\n"
              "print(ckptfs.wait_durable(sys.argv[1], timeout=60)['state'])\n"
              "try:\n"
              "    ckptfs.wait_durable(sys.argv[2], timeout=5)\n"
              "except ckptfs.CkptfsError as e:\n"
              "    print('refused', e.code, e)\n")
    res = _run_as(world, [py, "-c", script, str(mp / "pub" / "step1" / "a.pt"),
                          str(mp / "priv" / "s" / "b.pt")])
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.splitlines()
    assert first == "durable"
    assert second.startswith(f"refused {EXIT_ACCESS} permission denied"), second

    # A mount root the trainer may not read: status is refused too.
    os.chmod(mp, 0o700)
    try:
        one_line_error(ckptfs_as(world, "status", str(mp)), EXIT_ACCESS, "permission denied")
    finally:
        os.chmod(mp, 0o755)
    # Nothing above was denied by the kernel: these refusals came from the daemon.
    assert (mp / "nob" / "c.pt").read_bytes() == b"c" * 10


class _ForgedDaemon:
    """A control socket answering every request with a lie ("durable", a fake pid)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.listen(8)
        self.asked = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    if not conn.recv(65536):
                        continue  # the client hung up without asking
                    self.asked += 1
                    conn.sendall(json.dumps({"state": "durable", "seq": 999, "path": "FORGED",
                                             "pid": 4242, "mountpoint": "FORGED"}).encode()
                                 + b"\n")
                except OSError:
                    continue

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("how", ["other-owner", "symlink", "not-private"])
def test_forged_registration_is_ignored(world, root_mount, how: str) -> None:
    """Another uid plants the trainer's registration dir (a dir it owns, a symlink to one, or
    a dir of the trainer's with a bad mode it could write into) with a registration of the
    root mount pointing at its own socket: the trainer's client ignores it, finds the root
    daemon in /run/ckptfs and gets the real answers."""
    m = root_mount
    mp = m.path
    _write(mp / "loose.tmp" / "x.pt", b"x")  # readable, in no committed set
    own = world.xdg / "ckptfs"     # the trainer's registration dir (XDG_RUNTIME_DIR/ckptfs)
    if how == "other-owner":
        forged = own
        forged.mkdir()
        os.chown(forged, FORGER, FORGER)
        os.chmod(forged, 0o755)
    elif how == "symlink":
        forged = world.base / "forger"
        forged.mkdir()
        os.chown(forged, FORGER, FORGER)
        own.symlink_to(forged)
        os.lchown(own, FORGER, FORGER)
    else:
        forged = own
        forged.mkdir()
        os.chown(forged, NOBODY, NOBODY)
        os.chmod(forged, 0o777)
    key = ckmount._reg_key(mp)
    sock = forged / f"{key}.sock"
    fake = _ForgedDaemon(sock)
    reg = forged / f"{key}.json"
    reg.write_text(json.dumps({"pid": 4242, "uid": NOBODY, "mountpoint": str(mp),
                               "cache_dir": "/nonexistent", "control": str(sock)}))
    os.chown(reg, FORGER, FORGER)
    try:
        res = ckptfs_as(world, "wait", str(mp / "loose.tmp" / "x.pt"), "--timeout", "5")
        one_line_error(res, EXIT_NO_SET, "not in any committed set")
        res = ckptfs_as(world, "status", str(mp))
        assert res.returncode == EXIT_OK, res.stderr
        assert f"pid {m.pid}" in res.stdout and "FORGED" not in res.stdout
        assert fake.asked == 0
    finally:
        fake.close()


@pytest.mark.parametrize("how", ["other-owner", "symlink", "not-private"])
def test_daemon_refuses_planted_runtime_dir(world, how: str) -> None:
    """A non-root `ckptfs mount` whose registration dir was planted (or is not private)
    refuses with one line and exit 4 before creating anything, instead of registering where
    another user could replace its registration."""
    require_fuse()
    work = world.home / "work"
    (work / "mp").mkdir(parents=True)
    for p in (work, work / "mp"):
        os.chown(p, NOBODY, NOBODY)
    own = world.xdg / "ckptfs"
    if how == "other-owner":
        own.mkdir(mode=0o700)
        os.chown(own, FORGER, FORGER)
    elif how == "symlink":
        (world.base / "forger").mkdir(mode=0o700)
        os.chown(world.base / "forger", NOBODY, NOBODY)
        own.symlink_to(world.base / "forger")
    else:
        own.mkdir()
        os.chown(own, NOBODY, NOBODY)
        os.chmod(own, 0o755)
    res = ckptfs_as(world, "mount", str(work / "mp"), "--cache-dir", str(work / "cache"),
                    "--store", f"file://{work / 'store'}")
    try:
        one_line_error(res, EXIT_CACHE_DIR, "runtime dir", str(own))
        assert not (work / "cache").exists()
    finally:
        if is_mounted(work / "mp"):  # only if the refusal is missing
            ckptfs_as(world, "umount", str(work / "mp"))


def test_client_checks_the_servers_uid(tmp_path: Path) -> None:
    """control.request with expect_uid: a socket served by another uid gets no request."""
    fake = _ForgedDaemon(tmp_path / "s.sock")
    try:
        with pytest.raises(control.UntrustedServer, match="served by uid 0"):
            control.request(tmp_path / "s.sock", {"op": "status"}, expect_uid=NOBODY)
        assert fake.asked == 0
        assert control.request(tmp_path / "s.sock", {"op": "status"}, expect_uid=0)["seq"] == 999
        wait_for(lambda: fake.asked == 1, what="the request to be counted")
    finally:
        fake.close()


def test_may_mode_bits() -> None:
    """The daemon's mode-bit check: owner, then group (primary or supplementary), then other;
    the owner class decides even when it grants less than other; root passes."""
    p = control.Peer(pid=1, uid=1000, gid=100, groups=frozenset({200}))
    assert control.may(0o400, 1000, 0, p, 4)
    assert not control.may(0o047, 1000, 100, p, 4)    # owner class: no read
    assert control.may(0o040, 0, 100, p, 4)            # primary group
    assert control.may(0o040, 0, 200, p, 4)            # supplementary group
    assert not control.may(0o404, 0, 200, p, 4)        # group class: no read
    assert control.may(0o004, 0, 300, p, 4)            # other
    assert not control.may(0o005, 0, 300, p, 2)
    root = control.Peer(pid=1, uid=0, gid=0, groups=frozenset())
    assert control.may(0o000, 1000, 100, root, 2)
