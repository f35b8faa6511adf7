"""Store conformance through a mount (the conformance suite itself, every S3 call and header
ckptfs relies on against every store the suite can start: tests/stores/test_store_conformance.py):
a store that ignores If-None-Match and If-Match is refused by `ckptfs mount` unless the user says
so (--store-ignores-conditions).
"""

from __future__ import annotations

import pytest

import ckptfs
from tests.conftest import new_bucket

pytestmark = pytest.mark.s3


def test_mount_refuses_a_store_that_ignores_conditions_unless_told(mount_factory, moto_server):
    """What a user sees: `ckptfs mount` on such a store exits 7 with one line saying why and
    which option accepts it; with the option it mounts, says so in status, and commits."""
    from ckptfs.cli import EXIT_STORE
    from tests.faultproxy import FaultProxy, Rule

    bucket = new_bucket(moto_server)
    with FaultProxy(moto_server) as proxy:
        proxy.set_rules([Rule("strip_conditions", ops={"put"})])
        store = ["--store", f"s3://{bucket}/p", "--s3-endpoint", proxy.url, "--s3-path-style"]
        m = mount_factory("lax")
        res = m.start(*store, check=False)
        assert res.returncode == EXIT_STORE, (res.returncode, res.stderr)
        err = res.stderr.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "ignores If-None-Match and If-Match" in err and "--store-ignores-conditions" in err
        m.start(*store, "--store-ignores-conditions")
        st = m.status()["tiering"]["store"]["conditional_writes"]
        assert st["honoured"] is False and "NOT honoured" in st["summary"]
        (m.path / "model.pt").write_bytes(b"x" * 1000)
        ckptfs.wait_durable(m.path / "model.pt", timeout=60)
        (m.path / "model.pt").write_bytes(b"y" * 1000)
        ckptfs.wait_durable(m.path / "model.pt", timeout=60)
        text = m.log_text()
        assert "--store-ignores-conditions: the last node to commit a path wins" in text
        m.stop()
        assert not m.unexpected_errors(), m.unexpected_errors()
