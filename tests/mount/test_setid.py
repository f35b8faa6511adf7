"""Set-id bits on unprivileged data changes, through a real mount (pjdfstest chmod/12).

A write, a truncate, a truncating open or a fallocate by a caller without CAP_FSETID removes
S_ISUID, and S_ISGID when group-execute is set or the caller is not in the file's group, as
Linux does for its local filesystems. With direct I/O (the default mount) the kernel leaves
this to the daemon; with `--no-direct-io` the kernel does part of it. The expected modes are
what the machine's own local filesystem (the one holding the test's temporary directory) does
with the same operations, so the test checks ckptfs against the running kernel, not a copy of
its rules.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

NOBODY = 65534


def as_nobody(d: Path, fn) -> None:
    """Run `fn` in a child process as uid/gid 65534 with no supplementary groups, in directory
    `d` (entered as root: the test's temporary directories are not searchable by others)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(d)
            os.setgid(NOBODY)
            os.setgroups([])
            os.setuid(NOBODY)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the unprivileged operation failed"


def _write(p: Path) -> None:
    fd = os.open(p, os.O_WRONLY)
    try:
        os.write(fd, b"x")
    finally:
        os.close(fd)


def _open_trunc(p: Path) -> None:
    os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))


def _ftruncate(p: Path) -> None:
    fd = os.open(p, os.O_WRONLY)
    try:
        os.ftruncate(fd, 7)
    finally:
        os.close(fd)


def _fallocate(p: Path) -> None:
    fd = os.open(p, os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, 64)  # fallocate(2) mode 0: it grows the file
    finally:
        os.close(fd)


OPS = {"write": _write, "open-trunc": _open_trunc, "ftruncate": _ftruncate,
       "truncate": lambda p: os.truncate(p, 1), "fallocate": _fallocate}
# (mode, group of the file): 0 = root's group, which nobody is not in.
CASES = [(0o4777, 0), (0o2777, 0), (0o6777, 0), (0o2767, 0), (0o2767, NOBODY), (0o6767, NOBODY),
         (0o4766, 0)]


def _run(d: Path, unprivileged: bool = True) -> dict:
    """{(op, mode, gid): mode after the operation} for every case in directory `d`."""
    out = {}
    for op, fn in OPS.items():
        for mode, gid in CASES:
            p = d / f"{op}-{mode:o}-{gid}"
            p.write_bytes(b"0123456789")
            os.chown(p, 0, gid)
            os.chmod(p, mode)
            if unprivileged:
                as_nobody(d, lambda p=p, fn=fn: fn(Path(p.name)))
            else:
                fn(p)
            out[op, mode, gid] = stat.S_IMODE(os.stat(p).st_mode)
    return out


@pytest.fixture
def reference(tmp_path) -> dict:
    local = tmp_path / "local"
    local.mkdir(mode=0o777)
    os.chmod(local, 0o777)
    ref = _run(local)
    # What the rules above say, on this kernel: pjdfstest chmod/12 expects 0777 after a write.
    assert ref["write", 0o4777, 0] == ref["write", 0o6777, 0] == 0o777
    return ref


@pytest.mark.parametrize("mode_args", [[], ["--no-direct-io"]], ids=["direct-io", "page-cache"])
def test_unprivileged_write_and_truncate_remove_setid_bits(mount_factory, reference, mode_args):
    m = mount_factory()
    m.start(*mode_args)
    d = m.path / "d"
    d.mkdir()
    os.chmod(d, 0o777)
    got = _run(d)
    assert {k: oct(v) for k, v in got.items()} == {k: oct(v) for k, v in reference.items()}
    # Persisted, not just in the kernel's cache.
    m.remount()
    assert {k: stat.S_IMODE(os.stat(d / f"{k[0]}-{k[1]:o}-{k[2]}").st_mode) for k in got} == got
    assert m.unexpected_errors() == []


def test_privileged_write_keeps_setid_bits(mnt):
    """Root (CAP_FSETID) keeps them, as on a local filesystem."""
    d = mnt.path
    got = _run(d, unprivileged=False)
    assert all(v == mode for (_op, mode, _gid), v in got.items()), got


def test_setid_removal_changes_ctime(mnt):
    p = mnt.path / "f"
    p.write_bytes(b"abc")
    os.chmod(p, 0o4777)
    before = os.stat(p).st_ctime_ns
    as_nobody(mnt.path, lambda: _write(Path("f")))
    st = os.stat(p)
    assert stat.S_IMODE(st.st_mode) == 0o777
    assert st.st_ctime_ns > before
