"""Replicated before durable (--replicas, docs/ARCHITECTURE.md "Peers", docs/SEMANTICS.md
"Replicated"): real mounts on 127.0.0.1 on one moto S3 store, node A's store behind the fault
proxy (tests/faultproxy.py) so that A alone can lose it. A set A commits while the store is
down is copied to A's buddy (B), fsynced there, and `ckptfs wait --replicated` returns; once the
store is back the set becomes durable and the buddy drops its replica. An offer that escapes the
set, lies about its size, or comes with bytes failing their CRC32C changes nothing on the buddy
but a log line naming the peer.
"""

from __future__ import annotations

import json
import os
import socket

import h11
import pytest

torch = pytest.importorskip("torch")
import ckptfs
from tests.conftest import run_cli, wait_for
from tests.fakehttp import FakeHTTPServer, Request, request, send_response
from tests.replicas_helpers import (
    EXIT_STORE,
    EXIT_USAGE,
    SECRET,
    _offer,
    _store_get,
    cluster,
    knows_buddy,
    peer_endpoint,
    replica_files,
    replication,
    set_row,
    unnamed_objects,
)

__all__ = ["cluster"]  # the fixture, imported for these tests


def outside_replicas(m) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file in the cache dir but the replicas, the index and logs."""
    out = {}
    for p in m.cache_dir.rglob("*"):
        rel = p.relative_to(m.cache_dir).as_posix()
        if p.is_file() and not rel.startswith("replicas/") and "index" not in rel:
            st = p.stat()
            out[rel] = (st.st_size, st.st_mtime_ns)
    return out


def test_replicated_before_durable_then_durable_and_dropped(cluster):
    a = cluster("a", proxied=True)
    b = cluster("b")
    knows_buddy(a, b)
    cluster.proxy.outage()  # the store is down for A only, until clear()
    g = torch.Generator().manual_seed(3)
    tmp = a.path / "run" / "step_1.tmp"
    tmp.mkdir(parents=True)
    torch.save({"w": torch.randn(1 << 20, generator=g)}, tmp / "model.pt")
    os.rename(tmp, a.path / "run" / "step_1")
    data = (a.path / "run" / "step_1" / "model.pt").read_bytes()

    res = run_cli("wait", "--replicated", str(a.path / "run" / "step_1"), "--timeout", "20")
    assert res.returncode == 0, res.stderr
    assert "is replicated" in res.stdout, res.stdout
    row = set_row(a, "run/step_1")
    assert row["state"] != "durable" and row["replicated"] and row["replicas"] == 1, row
    res = run_cli("wait", str(a.path / "run" / "step_1"), "--timeout", "1")
    assert res.returncode == EXIT_STORE, (res.stdout, res.stderr)  # replicated, not durable
    shown = run_cli("status", str(a.path))
    assert shown.returncode == 0 and "replicated/" in shown.stdout and \
        "held by 1 buddy" in shown.stdout.replace("\n", " "), shown.stdout

    held = replication(b)
    assert held["held_for_others"] == 1 and held["replica_bytes"] == len(data), held
    (seq_dir,) = (b.cache_dir / "replicas" / a.node_id).iterdir()
    assert seq_dir.name == str(row["seq"])
    assert (seq_dir / "0").read_bytes() == data
    desc = json.loads((seq_dir / "descriptor.json").read_bytes())
    assert desc["path"] == "run/step_1" and desc["origin"] == a.node_id
    assert [f["rel"] for f in desc["files"]] == ["model.pt"]

    cluster.proxy.clear()  # the store comes back: A uploads, B drops its replica
    ckptfs.wait_durable(a.path / "run" / "step_1", timeout=60)
    wait_for(lambda: replication(b)["held_for_others"] == 0, timeout=30,
             what="the buddy to drop the replica of a durable set")
    # The count drops when the replica is forgotten (served no more); its files go right
    # after, in a worker thread: the origin's (empty) directory is all that stays.
    wait_for(lambda: replica_files(b) == [a.node_id], timeout=30,
             what="the dropped replica's files to be removed")


# ----------------------------------------------------------------------------------------------
# a peer that lies changes nothing on the buddy


def _request(port: int, method: str, target: str, body: bytes = b"",
             secret: bytes = SECRET) -> int:
    """The status of one request signed with `secret` (fakehttp.request)."""
    from cachemgr.peer.proto import sign

    return request(port, method, target, sign(secret, method, target), body)


class FakeOrigin(FakeHTTPServer):
    """An h11 server that answers every replica range with bytes whose CRC32C header lies."""

    threaded = False

    def __init__(self) -> None:
        self.requests = 0
        super().__init__()

    def answer(self, s: socket.socket, conn: h11.Connection, req: Request) -> None:
        self.requests += 1
        n = int(req.query["len"][0])
        send_response(s, conn, 200, [("x-ckptfs-crc32c", "12345")], b"\xee" * n)


def test_a_lying_peer_changes_nothing_on_the_buddy(cluster):
    b = cluster("b")
    port = int(ckptfs.status(b.path)["tiering"]["peers"]["server"]["endpoint"]
               .rsplit(":", 1)[1])
    before = outside_replicas(b)
    fake = FakeOrigin()
    try:
        for bad in ({"path": "../etc"}, {"path": "/abs"},
                    {"files": [{"rel": "../../x", "size": 1, "mode": 0o644}]},
                    {"files": [{"rel": "a/../../x", "size": 1, "mode": 0o644}]},
                    {"files": [{"rel": "big", "size": 1 << 60, "mode": 0o644}]},
                    {"origin": "../up"}):
            assert _request(port, "POST", "/v1/replica/offer",
                            _offer(fake.port, **bad)) == 400, bad
        assert _request(port, "POST", "/v1/replica/offer", _offer(fake.port),
                        secret=b"wrong") == 401
        # the offer is sound, the bytes are not: pulled, refused, nothing kept
        assert _request(port, "POST", "/v1/replica/offer", _offer(fake.port)) == 202
        wait_for(lambda: replication(b)["pulls_failed"] == 1, timeout=20,
                 what="the pull of lying bytes to fail")
        assert fake.requests >= 1
        assert _request(port, "POST", "/v1/replica/offer", _offer(fake.port)) == 409
        log = b.log_text()
        assert log.count("refused an offer from peer 127.0.0.1:") == 6, log[-3000:]
        named = [ln for ln in log.splitlines()
                 if f"peer evil at 127.0.0.1:{fake.port} sent bytes of file 0" in ln]
        assert len(named) == 1 and "fail their CRC32C" in named[0], log[-3000:]
        st = replication(b)
        assert st["held_for_others"] == 0 and st["replica_bytes"] == 0, st
        assert replica_files(b) in ([], ["evil"]), replica_files(b)
        assert outside_replicas(b) == before
    finally:
        fake.close()


# ----------------------------------------------------------------------------------------------
# takeover: the "done means"


def test_a_lost_node_s_sets_are_taken_over_by_its_buddy(cluster):
    """The store unreachable from A; A commits a torch.save checkpoint and a DCP set; both are
    replicated; A's daemon is killed and its cache dir deleted; its lease expires; the buddy
    publishes both sets, and a fresh node loads them bit-exact."""
    import shutil

    import torch.distributed.checkpoint as dcp

    a = cluster("a", "--lease", "4", proxied=True)
    b = cluster("b", "--lease", "4")
    knows_buddy(a, b)
    cluster.proxy.outage()  # until clear(): A never reaches the store again
    g = torch.Generator().manual_seed(5)
    tmp = a.path / "run" / "step_1.tmp"
    tmp.mkdir(parents=True)
    torch.save({"w": torch.randn(1 << 20, generator=g)}, tmp / "model.pt")
    os.rename(tmp, a.path / "run" / "step_1")
    state = {"w": torch.randn(300_000, generator=g), "b": torch.arange(1000)}
    dcp.save(state, checkpoint_id=str(a.path / "run" / "dcp_2"))
    for rel in ("run/step_1", "run/dcp_2"):
        res = run_cli("wait", "--replicated", str(a.path / rel), "--timeout", "20")
        assert res.returncode == 0, res.stderr
    wrote = {p.relative_to(a.path).as_posix(): p.read_bytes()
             for p in (a.path / "run").rglob("*") if p.is_file()}
    assert set(wrote) == {"run/step_1/model.pt", "run/dcp_2/.metadata",
                          "run/dcp_2/__0_0.distcp"}, sorted(wrote)
    a.kill9()
    shutil.rmtree(a.cache_dir)

    wait_for(lambda: replication(b)["taken_over"] == 2, timeout=40,
             what="the buddy to take over both sets of the lost node")
    lines = [ln for ln in b.log_text().splitlines() if "took over set" in ln]
    assert len(lines) == 2 and all(a.node_id in ln for ln in lines), lines
    wait_for(lambda: replication(b)["held_for_others"] == 0, timeout=10,
             what="the buddy to drop the replicas it published")

    c = cluster("c")
    for rel, data in wrote.items():
        wait_for(lambda rel=rel: (c.path / rel).exists(), timeout=20, what=f"{rel} on c")
        assert (c.path / rel).read_bytes() == data, rel
    back = {"w": torch.zeros(300_000), "b": torch.zeros(1000, dtype=torch.int64)}
    dcp.load(back, checkpoint_id=str(c.path / "run" / "dcp_2"))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    m = json.loads(_store_get(cluster, "p/manifests/run/step_1.json"))
    assert m["commit"]["node"] == a.node_id and m["commit"]["taken_over_by"] == b.node_id, m


def test_a_fresh_node_reads_a_lost_node_s_sets_from_its_buddy_while_the_store_is_down(cluster):
    """The store down for every node (A, its buddy B and a fresh node C all behind the fault
    proxy): A commits a torch.save checkpoint and a DCP set, both replicated on B; A's daemon
    is killed and its cache dir deleted. C mounts with --peer-seeds naming B: it shows both
    sets ("replicated", not durable) and loads them bit-exact from B's replica, the store
    untouched. Once the store is back, B takes them over, C's sets become the store's
    (durable) and still read the same, and a fresh node D loads them from the store."""
    import shutil

    import torch.distributed.checkpoint as dcp

    a = cluster("a", "--lease", "4", proxied=True)
    b = cluster("b", "--lease", "4", proxied=True)
    knows_buddy(a, b)
    cluster.proxy.outage()  # until clear(): no node behind the proxy reaches the store
    g = torch.Generator().manual_seed(7)
    model = {"w": torch.randn(1_500_000, generator=g)}  # > one 4 MiB chunk: two chunks
    torch.save(model, a.path / "ckpt.pt")
    state = {"w": torch.randn(300_000, generator=g), "b": torch.arange(1000)}
    dcp.save(state, checkpoint_id=str(a.path / "run" / "dcp_3"))
    for rel in ("ckpt.pt", "run/dcp_3"):
        res = run_cli("wait", "--replicated", str(a.path / rel), "--timeout", "20")
        assert res.returncode == 0, res.stderr
    wrote = {p.relative_to(a.path).as_posix(): p.read_bytes()
             for p in a.path.rglob("*") if p.is_file()}
    assert set(wrote) == {"ckpt.pt", "run/dcp_3/.metadata", "run/dcp_3/__0_0.distcp"}
    a.kill9()
    shutil.rmtree(a.cache_dir)
    # the buddy's own mount shows what it holds once its listings keep failing
    for rel in ("ckpt.pt", "run/dcp_3"):
        wait_for(lambda rel=rel: (b.path / rel).exists(), timeout=90,
                 what=f"{rel} on the buddy, from its own replica")
        assert set_row(b, rel)["state"] == "replicated"
    assert {rel: (b.path / rel).read_bytes() for rel in wrote} == wrote

    c = cluster("c", "--peer-seeds", peer_endpoint(b), "--allow-empty-namespace",
                proxied=True)
    rows = {s["path"]: s for s in ckptfs.status(c.path)["tiering"]["sets"]}
    # the namespace holds both sets the moment mount returns
    assert rows["ckpt.pt"]["state"] == "replicated", rows
    assert rows["run/dcp_3"]["state"] == "replicated", rows
    assert torch.equal(torch.load(c.path / "ckpt.pt")["w"], model["w"])
    back = {"w": torch.zeros(300_000), "b": torch.zeros(1000, dtype=torch.int64)}
    dcp.load(back, checkpoint_id=str(c.path / "run" / "dcp_3"))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    for rel, data in wrote.items():
        assert (c.path / rel).read_bytes() == data, rel
    peers = ckptfs.status(c.path)["tiering"]["peers"]
    assert peers["restored_from_peers"]["bytes"] >= sum(map(len, wrote.values())), peers
    assert peers["restored_from_store"]["bytes"] == 0, peers
    assert ckptfs.status(b.path)["tiering"]["peers"]["server"]["served_chunks"] >= 4
    res = run_cli("wait", str(c.path / "ckpt.pt"), "--timeout", "0.5")
    assert res.returncode != 0, "a set only peers hold was reported durable"
    res = run_cli("wait", "--replicated", str(c.path / "ckpt.pt"), "--timeout", "5")
    assert res.returncode == 0 and "replicated" in res.stdout, (res.stdout, res.stderr)
    res = run_cli("status", str(c.path))
    assert res.returncode == 0 and "read from the replicas peers hold" in res.stdout, res.stdout

    cluster.proxy.clear()  # the store is back: B takes both sets over
    wait_for(lambda: replication(b)["taken_over"] == 2, timeout=60,
             what="the buddy to take over both sets once the store is back")
    for rel in ("ckpt.pt", "run/dcp_3"):
        wait_for(lambda rel=rel: set_row(c, rel)["state"] == "durable", timeout=30,
                 what=f"{rel} on c to become the store's set")
    for rel, data in wrote.items():
        assert (c.path / rel).read_bytes() == data, rel
    d = cluster("d")
    for rel, data in wrote.items():
        assert (d.path / rel).read_bytes() == data, rel


def test_a_fresh_node_refuses_an_unlisted_store_unless_told(cluster, mount_factory, tmp_path):
    """The store down for a fresh node whose seed answers: without --allow-empty-namespace the
    mount still fails with exit 7 (an incomplete view is never shown unasked), its message
    naming the flag; a seed that is not HOST:PORT is a usage error."""
    b = cluster("b")
    cluster.proxy.outage()
    sf = tmp_path / "c.secret"
    sf.write_bytes(SECRET)
    sf.chmod(0o600)
    c = mount_factory("c")
    args = ("--store", f"s3://{cluster.bucket}/p", "--s3-endpoint", cluster.proxy.url,
            "--s3-path-style", "--peers", "--peer-address", "127.0.0.1",
            "--peer-secret-file", str(sf))
    res = c.start(*args, "--peer-seeds", peer_endpoint(b), check=False)
    assert res.returncode == EXIT_STORE, (res.returncode, res.stderr)
    assert "--allow-empty-namespace" in res.stderr and "peers hold replicas" in res.stderr, \
        res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = c.start(*args, "--peer-seeds", "no-port-here", check=False)
    assert res.returncode == EXIT_USAGE and "--peer-seeds" in res.stderr, res.stderr


def test_a_buddy_collects_its_takeover_objects_once_the_path_moves_on(cluster):
    """After a takeover, the buddy re-commits one taken-over path and deletes another: once its
    GC ran, every data object in the store is named by a manifest there (the takeover objects
    of both paths are gone with their contents)."""
    a = cluster("a", "--lease", "4", proxied=True)
    b = cluster("b", "--lease", "4")
    knows_buddy(a, b)
    cluster.proxy.outage()
    for name in ("x.pt", "y.pt"):
        torch.save({"w": torch.randn(100_000)}, a.path / name)
        res = run_cli("wait", "--replicated", str(a.path / name), "--timeout", "20")
        assert res.returncode == 0, res.stderr
    a.kill9()
    wait_for(lambda: replication(b)["taken_over"] == 2, timeout=40, what="the takeovers")
    taken = [f["object"]["key"] for n in ("x", "y")
             for f in json.loads(_store_get(cluster, f"p/manifests/{n}.pt.json"))["files"]]
    assert all(k.startswith(f"data/{b.node_id}/takeover/") for k in taken), taken
    for name in ("x.pt", "y.pt"):
        wait_for(lambda name=name: (b.path / name).exists(), timeout=20, what=f"{name} on b")
    assert unnamed_objects(cluster) == []
    torch.save({"w": torch.randn(100_000)}, b.path / "x.pt")
    ckptfs.wait_durable(b.path / "x.pt", timeout=20)
    os.unlink(b.path / "y.pt")
    wait_for(lambda: set_row(b, "y.pt")["state"] == "deleted", timeout=20,
             what="y.pt's manifest to go")
    wait_for(lambda: unnamed_objects(cluster) == [], timeout=20,
             what="the buddy's GC to delete its takeover objects")


def test_a_takeover_whose_path_moves_on_before_its_buddy_applied_it_leaves_nothing(cluster):
    """The buddy's listings of the store's sets fail (its own proxy), so it never applies the
    manifest it published taking over A's set; another node re-commits that path meanwhile.
    The buddy's takeover record still owns the objects it uploaded: its sweep deletes them, and
    every data object in the store is named by a manifest there."""
    from tests.faultproxy import Rule

    side = cluster.new_proxy()
    a = cluster("a", "--lease", "4", proxied=True)
    b = cluster("b", "--lease", "4", proxied=side)
    knows_buddy(a, b)
    cluster.proxy.outage()
    torch.save({"w": torch.randn(200_000)}, a.path / "x.pt")
    res = run_cli("wait", "--replicated", str(a.path / "x.pt"), "--timeout", "20")
    assert res.returncode == 0, res.stderr
    side.set_rules([Rule("error503", ops={"list"}, key="manifests/$")])
    a.kill9()
    wait_for(lambda: replication(b)["taken_over"] == 1, timeout=40, what="the takeover")
    taken = [f["object"]["key"]
             for f in json.loads(_store_get(cluster, "p/manifests/x.pt.json"))["files"]]
    assert all(k.startswith(f"data/{b.node_id}/takeover/") for k in taken), taken
    c = cluster("c")  # only now: A's one buddy was B
    data = torch.randn(50_000)
    torch.save({"w": data}, c.path / "x.pt")
    ckptfs.wait_durable(c.path / "x.pt", timeout=30)
    m = json.loads(_store_get(cluster, "p/manifests/x.pt.json"))
    assert m["commit"]["node"] == c.node_id, m
    wait_for(lambda: unnamed_objects(cluster) == [], timeout=20,
             what="the buddy's sweep to delete the objects of the takeover that moved on")
    assert "moved on before this node applied it" in b.log_text()
    assert not (b.cache_dir / "replicas" / ".takeovers").exists()
    side.clear()
    wait_for(lambda: (b.path / "x.pt").exists() and
             set_row(b, "x.pt")["state"] == "durable", timeout=20,
             what="the buddy to apply the newer manifest once it lists again")
    assert torch.equal(torch.load(b.path / "x.pt")["w"], data)


def test_an_origin_back_after_its_takeover_leaves_one_whole_set(cluster):
    """A's set is taken over by its buddy while A is dead; A comes back (same cache dir, store
    reachable) and publishes it too: the store holds one manifest of that commit, whole."""
    import subprocess

    a = cluster("a", "--lease", "4", proxied=True)
    b = cluster("b", "--lease", "4")
    knows_buddy(a, b)
    cluster.proxy.outage()
    torch.save({"w": torch.randn(300_000)}, a.path / "solo.pt")
    res = run_cli("wait", "--replicated", str(a.path / "solo.pt"), "--timeout", "20")
    assert res.returncode == 0, res.stderr
    data = (a.path / "solo.pt").read_bytes()
    a.kill9()
    wait_for(lambda: replication(b)["taken_over"] == 1, timeout=40, what="the takeover")
    taken = json.loads(_store_get(cluster, "p/manifests/solo.pt.json"))

    cluster.proxy.clear()
    subprocess.run(["fusermount3", "-u", "-z", str(a.mountpoint)], check=True,
                   capture_output=True)
    a.start(*a.extra, "--keep-local", "0")  # its file is evicted once durable
    ckptfs.wait_durable(a.path / "solo.pt", timeout=60)
    after = json.loads(_store_get(cluster, "p/manifests/solo.pt.json"))
    assert after["commit"] == taken["commit"] and after["files"] == taken["files"], after
    c = cluster("c")
    wait_for(lambda: (c.path / "solo.pt").exists(), timeout=20, what="solo.pt on c")
    assert (c.path / "solo.pt").read_bytes() == data
    # A's own uploads of that set are named by no manifest: A points its file at the buddy's
    # objects and deletes its own; once A re-commits the path, the buddy collects its own.
    wait_for(lambda: unnamed_objects(cluster) == [], timeout=20,
             what="the origin to delete its own copies of the taken-over set")
    wait_for(lambda: ckptfs.status(a.path)["cache"]["evictions"] >= 1, timeout=20,
             what="the origin to evict its durable file")
    assert (a.path / "solo.pt").read_bytes() == data  # read back from the buddy's object
    torch.save({"w": torch.randn(300_000)}, a.path / "solo.pt")
    ckptfs.wait_durable(a.path / "solo.pt", timeout=20)
    wait_for(lambda: unnamed_objects(cluster) == [], timeout=20,
             what="the buddy to delete its takeover objects once the path moved on")


def test_a_buddy_needing_room_drops_its_replica_first_and_its_origin_offers_again(cluster):
    """B (a small --cache-size) holds A's replica; B's own writer needs that room: the replica
    is dropped before anything of B's, the writer never waits, and A learns it: its set shows
    no buddy, is not replicated, and is offered again (B, still without room, refuses it)."""
    a = cluster("a", proxied=True)
    b = cluster("b", "--cache-size", "64M")
    knows_buddy(a, b)
    cluster.proxy.outage()  # A's set stays not durable: only the replica protects it
    tmp = a.path / "run" / "step_1.tmp"
    tmp.mkdir(parents=True)
    (tmp / "model.bin").write_bytes(os.urandom(36 << 20))
    os.rename(tmp, a.path / "run" / "step_1")
    res = run_cli("wait", "--replicated", str(a.path / "run" / "step_1"), "--timeout", "20")
    assert res.returncode == 0, res.stderr
    held = replication(b)
    assert held["held_for_others"] == 1 and held["replica_bytes"] == 36 << 20, held
    space = ckptfs.status(b.path)["tiering"]["services"]["space"]
    assert space["cached_bytes"] == 0, space

    refused = held["offers_refused"]  # before the drop: A's offers after it count, however soon
    own = os.urandom(36 << 20)  # 36 MiB of B's own + the 36 MiB replica > 64 MiB
    (b.path / "own.bin").write_bytes(own)
    assert (b.path / "own.bin").read_bytes() == own
    after = replication(b)
    assert after["held_for_others"] == 0 and after["replica_bytes"] == 0, after
    assert after["dropped"] == 1, after
    space = ckptfs.status(b.path)["tiering"]["services"]["space"]
    assert space["waits"] == 0 and space["evicted"] == 0, space  # nothing of B's went
    assert replica_files(b) == [a.node_id], replica_files(b)
    assert "this node needs the room" in b.log_text()

    wait_for(lambda: set_row(a, "run/step_1")["replicas"] == 0, timeout=10,
             what="the origin to learn its buddy dropped the replica")
    row = set_row(a, "run/step_1")
    assert not row["replicated"] and row["state"] != "durable", row
    wait_for(lambda: replication(b)["offers_refused"] > refused, timeout=30,
             what="the origin to offer the set again (refused: no room on B)")
    assert replication(b)["held_for_others"] == 0
    assert "dropped its replica of set" in a.log_text()
    cluster.proxy.clear()
    ckptfs.wait_durable(a.path / "run" / "step_1", timeout=60)
