"""A store that hangs is a store that failed (docs/ARCHITECTURE.md "Store deadlines",
docs/SEMANTICS.md "A store that does not answer"), through a mount (the store layer's side:
tests/unit/test_hang.py):

  * a mount through the proxy: nothing a user or a trainer calls waits on the hung store.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request

from ckptfs.mount import EXIT_OK, EXIT_STORE
from tests.conftest import run_cli, wait_for
from tests.faultproxy import FaultProxy, Rule

# ----------------------------------------------------------------------------------------------
# a mount through a black hole: nothing user-facing waits on the store


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed_call(took: dict[str, float], what: str, fn):
    t0 = time.monotonic()
    out = fn()
    took[what] = round(time.monotonic() - t0, 2)
    return out


def test_nothing_user_facing_waits_on_a_store_that_does_not_answer(mount_factory, s3_bucket):
    """A node mounted through the fault proxy; a set committed and durable; then the store
    becomes a black hole (every request taken, none answered). `ckptfs status`, the metrics
    endpoint, `ls`, a read of the cached file and a new commit (write + close) each answer at
    once (< 5 s asserted; the CLI calls include a Python start); `ckptfs wait --timeout 5` on
    the new set exits 7 in about 5 s; `ckptfs umount --timeout 10` exits 7 (uploads pending)
    within 15 s: the daemon's goodbye to the store (Members.leave) gets what is left of the
    10 s, at least 1 s, not 10 s more. When the store answers again, a remount of the same
    cache dir makes the pending set durable. Measured on the 2-core dev machine, loaded by other
    test runs (printed by the test, -s): commit 0.00 s, status 0.59 s (the CLI's Python start
    included), wait 5.7 s, ls 0.00 s, cached read 0.01 s, metrics 0.00 s, umount 20.8 s
    before the bound (its 10 s for the uploads, then 10 s for the member record it could not
    drop), 12.4 s with it."""
    endpoint, bucket = s3_bucket
    port = _free_port()
    took: dict[str, float] = {}
    with FaultProxy(endpoint) as proxy:
        m = mount_factory()
        m.start("--store", f"s3://{bucket}/p", "--s3-endpoint", proxy.url, "--s3-path-style",
                "--metrics", str(port))
        run = m.path / "run"
        run.mkdir()
        durable = os.urandom(300_000)
        (run / "a.pt").write_bytes(durable)
        assert run_cli("wait", str(run / "a.pt"), "--timeout", "60").returncode == EXIT_OK

        proxy.set_rules([Rule("blackhole")])
        pending = os.urandom(200_000)
        _timed_call(took, "commit", lambda: (run / "b.pt").write_bytes(pending))
        assert proxy.wait_hung(1, timeout=30)  # the store has swallowed a request

        res = _timed_call(took, "status", lambda: run_cli("status", str(m.path), "--json"))
        assert res.returncode == EXIT_OK, res.stderr
        res = _timed_call(took, "wait", lambda: run_cli("wait", str(run / "b.pt"),
                                                        "--timeout", "5"))
        assert res.returncode == EXIT_STORE, (res.returncode, res.stderr)
        names = _timed_call(took, "ls", lambda: sorted(os.listdir(run)))
        assert names == ["a.pt", "b.pt"]
        assert _timed_call(took, "cached read", lambda: (run / "a.pt").read_bytes()) == durable
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = _timed_call(took, "metrics", lambda: r.read().decode())
        assert "ckptfs_store_health" in text
        # the store's health says so once a call has reached its deadline
        health = wait_for(lambda: (m.status()["tiering"]["store"]["health"] != "normal") and
                          m.status()["tiering"]["store"], timeout=90,
                          what="the store to be seen failing")
        assert "no answer within" in (health["last_error"] or ""), health
        for what in ("status", "ls", "cached read", "metrics", "commit"):
            assert took[what] < 5, took
        assert took["wait"] < 5 + 5, took

        res = _timed_call(took, "umount", lambda: run_cli("umount", str(m.path), "--timeout",
                                                          "10", timeout=60))
        print("black hole: user-facing calls (s):", took)
        assert res.returncode == EXIT_STORE, (res.returncode, res.stderr)
        assert took["umount"] < 10 + 5, took
        m.pid = None

        # the store answers again: the remount uploads what was pending
        proxy.clear()
        m.start("--store", f"s3://{bucket}/p", "--s3-endpoint", proxy.url, "--s3-path-style")
        res = run_cli("wait", str(run / "b.pt"), "--timeout", "120")
        assert res.returncode == EXIT_OK, res.stderr
        assert (run / "b.pt").read_bytes() == pending
        m.stop()
        assert not m.unexpected_errors(), m.unexpected_errors()
