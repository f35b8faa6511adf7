"""An origin confirms the buddies it counts (--replicas, docs/ARCHITECTURE.md "Replicas",
docs/SEMANTICS.md "Replicated"): every confirm interval (--refresh-interval 1 here: 1 s) it
offers each set not durable yet again to each buddy it counts, and one that does not answer 200
is counted no more. Real mounts on one moto store (tests/replicas_helpers.py's `cluster`), A's
store behind the fault proxy and down, so that A's set stays not durable and only its replica
protects it:

  * the buddy's daemon is killed and its cache dir deleted: A's set reads not replicated (and
    `ckptfs wait --replicated` does not return) until the buddy, started again with a fresh
    cache, has pulled it again;
  * A's daemon restarts (same cache dir, store still down, so no listing of the members): it
    offers to the buddies it kept in its index and reads replicated again at once;
  * a buddy the test controls (an h11 server in a member record) answers 200, then 202, 200
    and 507: A counts it exactly while it answers 200, and confirms it once per interval.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time

import h11
import pytest

torch = pytest.importorskip("torch")
import ckptfs
from tests.conftest import run_cli, wait_for
from tests.fakehttp import FakeHTTPServer, Request, send_response
from tests.replicas_helpers import cluster, knows_buddy, replication, set_row

__all__ = ["cluster"]  # the fixture, imported for these tests

EXIT_STORE = 7   # `ckptfs wait` past its --timeout
CONFIRM = 1.0    # the confirm interval at --refresh-interval 1 (cluster's)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _commit(a, rel: str) -> bytes:
    """A torch.save checkpoint committed at its close at `rel` on `a` (a file set: no other
    node is asked, so the killed buddy, live by its lease, holds up nothing); its bytes."""
    torch.save({"w": torch.randn(1 << 18, generator=torch.Generator().manual_seed(7))},
               a.path / rel)
    return (a.path / rel).read_bytes()


def _replicated(a, rel: str) -> dict:
    res = run_cli("wait", "--replicated", str(a.path / rel), "--timeout", "30")
    assert res.returncode == 0 and "is replicated" in res.stdout, (res.stdout, res.stderr)
    row = set_row(a, rel)
    assert row["replicated"] and row["replicas"] == 1 and row["state"] != "durable", row
    return row


def _restart(m, *more: str) -> None:
    """Start `m` again on its mount point, left dead by kill9 (lazily unmounted first)."""
    subprocess.run(["fusermount3", "-u", "-z", str(m.mountpoint)], check=True,
                   capture_output=True)
    m.start(*m.extra, *more)
    m.node_id = ckptfs.status(m.path)["tiering"]["store"]["node"]


def test_a_buddy_that_lost_its_replica_is_not_counted_until_it_pulls_again(cluster):
    """B's daemon is killed and its cache dir deleted while A's store is down: A stops counting
    B at its next confirmation, `wait --replicated` does not return while nobody holds the set,
    and once B is started again (fresh cache, so a new node id; same peer port, where A's last
    listing of the members says B is) A offers the set again, B pulls it, and A counts it."""
    port = _free_port()
    a = cluster("a", proxied=True)
    b = cluster("b", "--peer-listen", f"127.0.0.1:{port}")
    knows_buddy(a, b)
    cluster.proxy.outage()  # A alone loses the store, until clear()
    rel = "step_1.pt"
    data = _commit(a, rel)
    seq = _replicated(a, rel)["seq"]
    gone = b.node_id

    b.kill9()
    shutil.rmtree(b.cache_dir)  # B holds nothing now; it never tells A
    wait_for(lambda: not set_row(a, rel)["replicated"], timeout=10 * CONFIRM,
             what="the origin to stop counting the buddy that lost its replica")
    row = set_row(a, rel)
    assert row["replicas"] == 0 and row["state"] != "durable", row
    assert f"{gone} no longer holds set {seq}" in a.log_text()
    res = run_cli("wait", "--replicated", str(a.path / rel), "--timeout", "3")
    assert res.returncode == EXIT_STORE, (res.stdout, res.stderr)  # B is down: nobody holds it
    assert not set_row(a, rel)["replicated"]

    _restart(b)
    assert b.node_id != gone  # a fresh cache dir is a new node
    assert replication(b)["held_for_others"] == 0
    _replicated(a, rel)
    held = replication(b)  # A counts B again only once B answered 200: it holds the replica
    assert held["held_for_others"] == 1 and held["replica_bytes"] == len(data), held
    assert (b.cache_dir / "replicas" / a.node_id / str(seq) / "0").read_bytes() == data

    cluster.proxy.clear()  # the store comes back: durable, and B drops its replica
    ckptfs.wait_durable(a.path / rel, timeout=60)
    wait_for(lambda: replication(b)["held_for_others"] == 0, timeout=30,
             what="the buddy to drop the replica of a durable set")


def test_an_origin_restarted_with_the_store_down_counts_its_buddies_again(cluster):
    """A's daemon is killed and started again on the same cache dir while its store is down (no
    listing of the members answers): it offers its set to the buddies it kept in its index,
    which answer 200 at once (they hold it), so it reads replicated again within a few confirm
    intervals of its start, while still not durable."""
    a = cluster("a", proxied=True)
    b = cluster("b")
    knows_buddy(a, b)
    cluster.proxy.outage()
    rel = "step_2.pt"
    data = _commit(a, rel)
    seq = _replicated(a, rel)["seq"]

    a.kill9()
    _restart(a, "--allow-empty-namespace")  # the store cannot be listed at mount
    row = wait_for(lambda: (r := set_row(a, rel))["replicated"] and r, timeout=5 * CONFIRM,
                   what="the restarted origin to count its buddy again")
    assert row["seq"] == seq and row["replicas"] == 1 and row["state"] != "durable", row
    rep = replication(a)
    assert rep["buddies"] == [b.node_id] and rep["replicated_sets"] == 1, rep
    assert replication(b)["held_for_others"] == 1
    res = run_cli("wait", "--replicated", str(a.path / rel), "--timeout", "5")
    assert res.returncode == 0, (res.stdout, res.stderr)

    cluster.proxy.clear()
    ckptfs.wait_durable(a.path / rel, timeout=60)
    assert (a.path / rel).read_bytes() == data


# ----------------------------------------------------------------------------------------------
# any answer but 200 stops the count, and confirmations are bounded: a buddy the test controls


class FakeBuddy(FakeHTTPServer):
    """An h11 server in a member record of the store: it answers every replica offer with
    `status` (the test switches it) and pulls nothing; `offers` counts the offers it got."""

    threaded = False

    def __init__(self) -> None:
        self.status = 200
        self.offers = 0
        self.lock = threading.Lock()  # guards offers and status (test thread vs server thread)
        super().__init__()

    def set_answer(self, status: int) -> int:
        """Answer `status` from now on; the offers counted until now."""
        with self.lock:
            self.status = status
            return self.offers

    def count(self) -> int:
        with self.lock:
            return self.offers

    def register(self, cluster, node: str) -> None:
        import boto3

        doc = {"format": "ckptfs-member", "version": 1, "node": node, "lease_s": 600.0,
               "renewed_ns": time.time_ns(), "pid": 1, "generation": 1,
               "peer": {"host": "127.0.0.1", "port": self.port}}
        boto3.client("s3", endpoint_url=cluster.endpoint, region_name="us-east-1").put_object(
            Bucket=cluster.bucket, Key=f"p/members/@{node}.json", Body=json.dumps(doc).encode())

    def answer(self, s: socket.socket, conn: h11.Connection, req: Request) -> None:
        with self.lock:  # the request was read whole, body included
            status = self.status if req.target == "/v1/replica/offer" else 404
            self.offers += req.target == "/v1/replica/offer"
        send_response(s, conn, status, [("connection", "close")], b"ok")


def test_any_answer_but_200_stops_the_count_and_confirmations_are_bounded(cluster):
    """A's only buddy answers as the test says. 200: A counts it, and confirms it once per
    confirm interval, no more. 202 (a buddy that restarted without the replica and pulls it
    again): A counts it no more and `wait --replicated` does not return; 200 again: counted.
    507 (no room any more): counted no more."""
    fake = FakeBuddy()
    try:
        fake.register(cluster, "fa4eb0dd")
        a = cluster("a", proxied=True)
        wait_for(lambda: replication(a)["buddies"] == ["fa4eb0dd"], timeout=20,
                 what="the origin to list the fake buddy")
        cluster.proxy.outage()
        rel = "solo.pt"
        _commit(a, rel)
        seq = _replicated(a, rel)["seq"]

        start, t0 = fake.count(), time.monotonic()
        wait_for(lambda: fake.count() >= start + 3, timeout=10 * CONFIRM,
                 what="three confirmations of the counted buddy")
        sent, took = fake.count() - start, time.monotonic() - t0
        assert sent <= took / CONFIRM + 1, (sent, took)  # one per set and interval, no more
        assert set_row(a, rel)["replicated"]

        fake.set_answer(202)
        wait_for(lambda: not set_row(a, rel)["replicated"], timeout=10 * CONFIRM,
                 what="the origin to stop counting a buddy that pulls the set again")
        assert f"fa4eb0dd no longer holds set {seq} (it answered 202)" in a.log_text()
        res = run_cli("wait", "--replicated", str(a.path / rel), "--timeout", "2")
        assert res.returncode == EXIT_STORE, (res.stdout, res.stderr)
        fake.set_answer(200)  # pulled: A polls a pulling buddy every 0.5 s
        _replicated(a, rel)

        fake.set_answer(507)
        wait_for(lambda: set_row(a, rel)["replicas"] == 0, timeout=10 * CONFIRM,
                 what="the origin to stop counting a buddy without room")
        assert f"fa4eb0dd no longer holds set {seq} (it answered 507)" in a.log_text()
        assert not set_row(a, rel)["replicated"]
        cluster.proxy.clear()
        ckptfs.wait_durable(a.path / rel, timeout=60)
    finally:
        fake.close()
