"""The conventions a new user brings from mount-s3 and the AWS tools, through real mounts (the
rest: tests/unit/test_cli_conventions.py):

- `--read-only` / `-o ro`: a ro kernel mount; every change EROFS; a checkpoint a read-write
  mount wrote to the same moto store loads bit-exact, prefetches, and later checkpoints appear;
  the store is byte-for-byte what it was (no upload, manifest, member record, delete).
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from ckptfs.mount import EXIT_OK
from ckptfs.mounthelper import translate
from tests.cli_helpers import _refused
from tests.conftest import run_cli, wait_for

# ----------------------------------------------------------------------------------------------
# a read-only mount


def _store_objects(endpoint: str, bucket: str) -> dict[str, tuple[str, str]]:
    import boto3

    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            out[o["Key"]] = (o["ETag"], str(o["LastModified"]))
    return out


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _mountinfo_options(mp: Path) -> tuple[set[str], set[str]]:
    """(per-mount options, superblock options) of mount point `mp` in /proc/self/mountinfo."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == os.path.abspath(mp):
                sep = fields.index("-")
                return set(fields[5].split(",")), set(fields[sep + 3].split(","))
    raise AssertionError(f"{mp} not in mountinfo")


def _assert_every_change_refused(mp: Path, existing: Path, d: Path) -> None:
    new = mp / "new"
    checks = {
        "create": lambda: open(new, "wb").close(),
        "open-write": lambda: open(existing, "r+b").close(),
        "open-append": lambda: open(existing, "ab").close(),
        "truncate": lambda: os.truncate(existing, 0),
        "mkdir": lambda: os.mkdir(mp / "newdir"),
        "rmdir": lambda: os.rmdir(d),
        "unlink": lambda: os.unlink(existing),
        "rename": lambda: os.rename(existing, mp / "moved"),
        "chmod": lambda: os.chmod(existing, 0o600),
        "chown": lambda: os.chown(existing, 1, 1),
        "utime": lambda: os.utime(existing, (1, 1)),
        "symlink": lambda: os.symlink("x", mp / "link"),
        "link": lambda: os.link(existing, mp / "hard"),
        "mknod": lambda: os.mknod(mp / "fifo"),
        "setxattr": lambda: os.setxattr(existing, "user.k", b"v"),
        "removexattr": lambda: os.removexattr(existing, "user.k"),
    }
    got = {name: _refused(fn) for name, fn in checks.items()}
    assert got == dict.fromkeys(checks, errno.EROFS)


def test_read_only_mount(s3_bucket, mount_factory):
    import torch

    endpoint, bucket = s3_bucket
    store = ["--store", f"s3://{bucket}/p", "--endpoint-url", endpoint, "--force-path-style"]
    rw = mount_factory("rw")
    rw.start(*store)
    ckpt = rw.path / "ckpt"
    ckpt.mkdir()
    state = {"w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)),
             "step": 7}
    torch.save(state, ckpt / "model.pt")
    (ckpt / "blob").write_bytes(os.urandom(9 << 20))
    assert run_cli("commit", str(ckpt)).returncode == 0
    assert run_cli("wait", str(ckpt)).returncode == 0
    before = _store_objects(endpoint, bucket)

    ro = mount_factory("ro")
    res = ro.start(*store, "--read-only", "--refresh-interval", "1")
    assert "read-only" in res.stdout
    per_mount, sb = _mountinfo_options(ro.path)
    assert "ro" in per_mount and "ro" in sb
    st = ro.status()
    assert st["read_only"] is True
    human = run_cli("status", str(ro.path))
    assert human.returncode == 0 and "read-only" in human.stdout
    # the checkpoint loads bit-exact, and prefetches
    loaded = torch.load(ro.path / "ckpt" / "model.pt")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    assert run_cli("prefetch", str(ro.path / "ckpt")).returncode == EXIT_OK
    assert _sha(ro.path / "ckpt" / "blob") == _sha(ckpt / "blob")
    _assert_every_change_refused(ro.path, ro.path / "ckpt" / "blob", ro.path / "ckpt")
    res = run_cli("commit", str(ro.path / "ckpt"))
    assert res.returncode != 0 and "read-only" in res.stderr
    # the store is exactly what the read-write mount left: no member record, probe, upload
    assert _store_objects(endpoint, bucket) == before
    # a checkpoint committed later by the read-write node appears (the namespace refreshes)
    (rw.path / "later").mkdir()
    (rw.path / "later" / "x").write_bytes(b"later")
    assert run_cli("commit", str(rw.path / "later")).returncode == 0
    assert run_cli("wait", str(rw.path / "later")).returncode == 0
    wait_for(lambda: (ro.path / "later" / "x").exists(), timeout=30, what="the later set")
    assert (ro.path / "later" / "x").read_bytes() == b"later"
    after = _store_objects(endpoint, bucket)
    ro.stop()
    assert _store_objects(endpoint, bucket) == after
    assert "read-only mount: refused" not in ro.log_text()
    assert not ro.unexpected_errors()
    rw.stop()


def test_read_only_through_fstab_helper_spelling(tmp_path, mount_factory):
    """`-o ro` reaches the daemon: the mount helper's translation, mounted for real."""
    m = mount_factory("h")
    argv, _ = translate(f"file://{m.store_dir}", str(m.path), ["ro"])
    assert argv[2:] == ["--store", f"file://{m.store_dir}", "--read-only"]
    m.start(*argv[2:])
    assert "ro" in _mountinfo_options(m.path)[0]
    assert _refused(os.mkdir, m.path / "d") == errno.EROFS
