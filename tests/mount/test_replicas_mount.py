"""Replicas on one mount (the rest: tests/multinode/test_replicas.py): --replicas needs --peers,
and a mount without peers has no replication (status, `ckptfs wait --replicated`, no replica
directory).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import ckptfs
from tests.conftest import run_cli
from tests.replicas_helpers import EXIT_USAGE


def test_replicas_need_peers(mount_factory, tmp_path):
    m = mount_factory("solo")
    res = m.start("--replicas", "1", check=False)
    assert res.returncode == EXIT_USAGE, (res.stdout, res.stderr)
    assert "--replicas needs --peers" in res.stderr
    plain = mount_factory("plain")
    plain.start()
    t = ckptfs.status(plain.path)["tiering"]
    assert t["peers"] is None
    torch.save({"w": torch.ones(4)}, plain.path / "x.pt")
    ckptfs.wait_durable(plain.path / "x.pt", timeout=60)
    rows = ckptfs.status(plain.path)["tiering"]["sets"]
    assert rows and all("replicas" not in r and "replicated" not in r for r in rows), rows
    res = run_cli("wait", "--replicated", str(plain.path / "x.pt"), "--timeout", "5")
    assert res.returncode == 1 and "replication is off" in res.stderr, res.stderr
    assert not (plain.cache_dir / "replicas").exists()
