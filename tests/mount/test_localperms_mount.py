"""What ckptfs leaves on the node is private, and its log holds no credentials, through real
mounts (the redaction and the modes in process: tests/unit/test_localperms.py).

- Files ckptfs creates on the node are 0600 and its directories 0700 whatever the umask (the
  daemons here start under umask 000): the cache dir it creates, data/ and every cache file,
  the index with its -wal/-shm, layout.json, the lock, the log. A cache made by an older ckptfs
  (0644/0755) is made private at the next mount. The documented exception: a root daemon's
  registration (0644), runtime dir (0755) and control socket (0666), which the non-root users it
  serves must reach (docs/ARCHITECTURE.md "Control socket").
- At --log-level debug against S3 (moto) with a session token, neither the token nor the secret
  key appears in the log: botocore & co. stay at INFO, and a filter masks credential values,
  also in the AWS debug output a user opts into (CKPTFS_LOG_AWS_DEBUG=1).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import ckptfs
from ckptfs.config import runtime_dir
from ckptfs.mount import _reg_key
from tests.conftest import new_bucket, wait_for
from tests.localperms_helpers import mode, umask


def node_files(m) -> dict[str, int]:
    """{path relative to the cache dir (or the log/registration name): mode} of what the
    daemon of mount `m` keeps on the node."""
    c = m.cache_dir
    out = {".": mode(c), "log": mode(m.log_file)}
    for e in os.scandir(c):
        out[e.name] = mode(Path(e.path))
    for e in os.scandir(c / "data"):
        out[f"data/{e.name}"] = mode(Path(e.path))
    return out


def assert_private(m) -> None:
    modes = node_files(m)
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm", "layout.json", "lock"):
        assert name in modes, sorted(modes)
    assert any(n.startswith("data/") for n in modes), sorted(modes)
    bad = {n: oct(v) for n, v in modes.items()
           if v != (0o700 if n in (".", "data") else 0o600)}
    assert not bad, bad


def test_node_files_private_whatever_the_umask(mount_factory):
    a = mount_factory("a")
    with umask(0):
        a.start()
    (a.path / "ck").mkdir()
    (a.path / "ck" / "w.pt").write_bytes(os.urandom(300_000))
    ckptfs.wait_durable(a.path / "ck" / "w.pt", timeout=60)
    assert_private(a)
    # The documented exception: what the non-root users of a root daemon must read or reach.
    reg = runtime_dir() / f"{_reg_key(a.path)}.json"
    if os.getuid() == 0:
        assert (mode(reg.parent), mode(reg)) == (0o755, 0o644)
        assert mode(reg.with_suffix(".sock")) == 0o666
    else:
        assert mode(reg.parent) == 0o700
    # A fresh node restoring from the store: its cache files are private too.
    b = mount_factory("b")
    with umask(0):
        b.start("--store", f"file://{a.store_dir}")
    wait_for(lambda: (b.path / "ck" / "w.pt").exists(), timeout=30, what="set on node B")
    assert (b.path / "ck" / "w.pt").read_bytes() == (a.path / "ck" / "w.pt").read_bytes()
    assert_private(b)
    # A cache made by an older ckptfs (0644 files, 0755 dirs) is private after its next mount.
    a.stop()
    for p in [a.cache_dir / "data", *a.cache_dir.iterdir(), a.log_file]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    a.start()
    assert_private(a)
    for m in (a, b):
        assert not m.unexpected_errors(), m.unexpected_errors()


def test_debug_log_holds_no_credentials(mount_factory, moto_server, monkeypatch):
    # moto, whatever CKPTFS_TEST_S3 says: the secret and the session token are made up here,
    # and a store that checks signatures (RGW) would refuse them.
    endpoint, bucket = moto_server, new_bucket(moto_server)
    token = f"SESSIONTOKEN-{uuid.uuid4().hex}"
    secret = f"SECRETKEY-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SESSION_TOKEN", token)  # the daemons inherit these
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = ["--store", f"s3://{bucket}/p", "--s3-endpoint", endpoint, "--s3-path-style",
             "--log-level", "debug"]
    logs, log_modes = {}, {}
    for name, opt_in in (("plain", None), ("optin", "1")):
        if opt_in:
            monkeypatch.setenv("CKPTFS_LOG_AWS_DEBUG", opt_in)
        m = mount_factory(name)
        m.start(*store)
        (m.path / f"{name}.bin").write_bytes(os.urandom(100_000))
        ckptfs.wait_durable(m.path / f"{name}.bin", timeout=60)
        m.stop()
        logs[name] = m.log_text()
        log_modes[name] = mode(m.log_file)
        assert not m.unexpected_errors(), m.unexpected_errors()
    for name, text in logs.items():
        assert " DEBUG cachemgr." in text or " DEBUG ckptfs." in text, name  # debug was on
        assert token not in text and secret not in text, name
    assert " DEBUG botocore" not in logs["plain"]
    # Opted in, botocore's request dumps are there, with their credentials masked.
    assert " DEBUG botocore" in logs["optin"]
    assert "'X-Amz-Security-Token': b'***'" in logs["optin"]
    assert "'Authorization': b'***'" in logs["optin"]
    assert log_modes == {"plain": 0o600, "optin": 0o600}
