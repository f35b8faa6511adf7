"""In-process tests of the services that were reached only through subprocess mounts (issue 11):
publication, gathering another node's files, restore's chunk fill, with real `CacheFs` +
`Engine` nodes on one file:// `LocalStore`, all in one trio loop, no FUSE and no daemon.
(RemoteSync's listing, removals and invalid manifests: tests/unit/test_remote_inproc.py.)

`Node` (tests/inproc.py) opens a cache directory as the daemon does (Cache.open, Engine(cache,
store, cfg), then CacheFs over both); `Recorder` is the LocalStore with a log of its writes (key,
in order) and gates that hold the PUTs of chosen keys, so that a test decides the interleaving:
it never sleeps to wait, it polls a condition (`until`).

  1. publication: a manifest is PUT only after every object it names; sets publish in commit
     order (a later set whose objects are in waits for an earlier one still uploading); a
     superseded set is never published, also when it is superseded while its upload runs;
     a deleted set's manifest goes.
  1b. stuck sets: every set pending longer than a threshold (lowered here) is named by
     status and the metrics' statistics, whatever its position, with what it waits for: a
     held upload, an earlier set in commit order, a failing store, a file still open for
     writing, a lost upload job, another node's file.
  2. gathering: a directory written by two nodes and renamed into place on one of them is
     published with the other node's file, once that node has closed it (not before).
  3. restore: a second node restores a published set; `Restorer.ensure_range` fills only the
     chunks a range needs, and the bytes are the ones written.
  4. remote sync: a listing is applied as one step (no set of it shows while another
     manifest of the same listing is still being read); a set whose manifest left the store
     is removed, on the next listing.
"""

from __future__ import annotations

import errno
import functools
import os
from pathlib import Path

import pytest
import trio

from cachemgr.core.errors import FsError
from cachemgr.core.index import ROOT_INO
from cachemgr.format.keys import is_manifest_key, manifest_key
from cachemgr.store import (
    LocalStore,
    NotFound,
    RetryingStore,
    RetryPolicy,
)
from cachemgr.tiering.progress import FailedSet
from tests.faultstore import FaultyStore
from tests.inproc import CHUNK, Node, Recorder, read_manifest, run_nodes, until


def settle(node: Node) -> None:
    """Run `node`'s tiering service until it is quiet (`Node.quiet`): what it committed is
    published (or failed), nothing queued or running."""
    async def body() -> None:
        await until(node.quiet, "the set to settle")
    run_nodes([node], body)


@pytest.fixture
def store(tmp_path):
    return Recorder(tmp_path / "store")


@pytest.fixture
def node(tmp_path, store):
    n = Node(tmp_path / "a", store)
    yield n
    assert n.core.check_consistency() == []
    n.core.close()


# ----------------------------------------------------------------------------------------------
# 1. publication


def test_manifest_is_put_after_every_object_it_names(node, store):
    node.mkdir("ck")
    for name in ("x", "y", "z"):
        node.write(f"ck/{name}", os.urandom(3 * CHUNK + 7))
    seq = node.t.commit_path("ck")

    settle(node)

    assert node.sets.get(seq).state == "durable"
    m = read_manifest(store, "ck")
    keys = [f["object"]["key"] for f in m["files"]]
    assert sorted(f["path"] for f in m["files"]) == ["x", "y", "z"]
    order = store.puts()
    at = order.index(manifest_key("ck"))
    assert all(order.index(k) < at for k in keys), order
    for f in m["files"]:  # each object is whole in the store, as the manifest says
        assert trio.run(store.head, f["object"]["key"]).size == f["object"]["stored_size"]


class HeadCounter(Recorder):
    """A Recorder that also counts the HEADs of each key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.heads: dict[str, int] = {}

    async def head(self, key):
        self.heads[key] = self.heads.get(key, 0) + 1
        return await super().head(key)


def test_a_set_of_fresh_uploads_is_published_without_a_head_per_object(tmp_path):
    """Issue 35: publication HEADed every object a manifest names (8,192 HEADs for a DCP save
    of 8,192 shards, most of its commit -> durable time) right after the uploader had HEADed
    each one after its PUT. An object this process uploaded and read back is not HEADed again
    by the first publication naming it; an object named again by a later set (an unchanged
    file) is, as is one another node or an earlier process uploaded."""
    store = HeadCounter(tmp_path / "store")
    node = Node(tmp_path / "a", store)
    node.mkdir("ck")
    for name in ("x", "y", "z"):
        node.write(f"ck/{name}", os.urandom(3 * CHUNK + 7))
    first = node.t.commit_path("ck")

    settle(node)
    assert node.sets.get(first).state == "durable"
    old = {f["object"]["key"] for f in read_manifest(store, "ck")["files"]}
    assert node.t.publisher.heads == 0
    # every object was read back once, by its upload (the staged copy's rename on file://:
    # the store's own stat; a HEAD elsewhere), never by the publication
    assert all(store.heads.get(k, 0) <= 1 for k in old), store.heads

    node.write("ck/w", os.urandom(CHUNK))
    second = node.t.commit_path("ck")
    settle(node)
    assert node.sets.get(second).state == "durable"
    files = read_manifest(store, "ck")["files"]
    assert sorted(f["path"] for f in files) == ["w", "x", "y", "z"]
    assert node.t.publisher.heads == 3  # x, y, z again; w is fresh
    assert node.core.check_consistency() == []
    node.core.close()


def test_objects_uploaded_before_a_lease_lapse_are_headed_at_publication(tmp_path):
    """`ckptfs fsck --repair` may delete the unnamed objects of a node whose lease ran out
    (docs/FORMAT.md "Garbage"), so an upload verified under an earlier lease generation
    proves nothing at publication: x and y land, the lease lapses and is taken again (a new
    generation) while z's upload is held, and the publication HEADs x and y, not z."""
    store = HeadCounter(tmp_path / "store")
    node = Node(tmp_path / "a", store)
    node.mkdir("ck")
    for name in ("x", "y", "z"):
        node.write(f"ck/{name}", os.urandom(CHUNK))
    z = node.core.index.resolve("ck/z")
    gate = store.gate(f"data/{node.t.node}/{z}/")

    async def body():
        seq = node.t.commit_path("ck")
        await until(lambda: store.held and len(node.sets.missing_uploads(seq)) == 1,
                    "x and y uploaded, z held")
        node.t.lease.generation += 1  # the lease ran out and was taken again
        gate.set()
        await until(node.quiet, "the set to settle")
    run_nodes([node], body)
    assert node.sets.newest_at("ck").state == "durable"
    assert node.t.publisher.heads == 2
    assert node.core.check_consistency() == []
    node.core.close()


def test_an_object_gone_from_the_store_before_a_later_set_names_it_fails_that_set(node, store):
    """The check before publication still catches an object that is not in the store: x's
    object is removed behind ckptfs's back after the first set; the next commit of the
    directory names it again (x unchanged) and fails, naming it, instead of publishing a
    manifest that points at nothing."""
    node.mkdir("ck")
    node.write("ck/x", os.urandom(CHUNK))
    first = node.t.commit_path("ck")

    settle(node)
    assert node.sets.get(first).state == "durable"
    (gone,) = [f["object"]["key"] for f in read_manifest(store, "ck")["files"]]
    trio.run(LocalStore.delete, store, gone)
    node.write("ck/y", os.urandom(CHUNK))
    second = node.t.commit_path("ck")
    settle(node)
    s = node.sets.get(second)
    assert s.state == "failed" and gone in s.error, s
    assert [f["path"] for f in read_manifest(store, "ck")["files"]] == ["x"]  # the first set


def test_store_health_recovers_with_a_publish_alone(node, store):
    """Manifest PUTs that fail make the store `down`; the first one that succeeds makes it
    `normal` again, with no upload in between (it stayed `down` until an upload succeeded)."""
    node.write("up", b"u" * 5000)

    settle(node)
    assert node.t.store_health.health() == "normal"
    store.flaky[manifest_key("m")] = 6
    node.write("m", b"m" * 5000)   # its object goes in, then its manifest fails 6 times

    async def body():
        await until(lambda: store.flaky[manifest_key("m")] == 0, "6 failed manifest PUTs")
        await until(node.quiet, "the set to settle")
    run_nodes([node], body)
    assert node.sets.newest_at("m").state == "durable"
    assert node.t.store_health.health() == "normal"


def test_a_bug_in_one_publish_fails_that_set_and_the_worker_goes_on(node, store, monkeypatch,
                                                                   caplog):
    """An exception other than a store error while publishing one set (a bug) fails that set
    with the reason, visibly; the namespace worker, its queue and its helper tasks go on: the
    next set is published. (The event was lost with the worker's restart, and the set stayed
    committed for ever.)"""
    real = node.t.publisher._publish

    async def buggy(seq):
        if node.sets.get(seq).path == "bad":
            raise RuntimeError("injected bug")
        await real(seq)
    monkeypatch.setattr(node.t.publisher, "_publish", buggy)
    node.write("bad", b"b" * 5000)
    node.write("good", b"g" * 5000)

    async def body():
        await until(lambda: node.sets.newest_at("good").state == "durable", "good durable")
    run_nodes([node], body)
    bad = node.sets.newest_at("bad")
    assert bad.state == "failed" and "internal error" in bad.error and "injected" in bad.error
    assert "namespace event Publish(seq=" in caplog.text
    assert node.t.store_health.statistics().last_error.endswith("RuntimeError('injected bug')")


def test_sets_are_published_in_commit_order(node, store):
    """`first` commits before `second`; first's object is held in its PUT: second's object goes
    in, but its manifest waits until first is published."""
    node.write("first", b"1" * 5000)
    node.write("second", b"2" * 5000)
    seq1, seq2 = node.sets.newest_at("first").seq, node.sets.newest_at("second").seq
    assert seq1 < seq2
    first_obj = f"data/{node.t.node}/{node.core.index.resolve('first')}/"

    async def body():
        gate = store.gate(first_obj)
        await until(lambda: store.held, "first's object PUT to be held")
        await until(lambda: store.puts(lambda k: k.startswith("data/")),
                    "second's object to be in")
        await until(lambda: node.t.status()["uploads"]["done"] == 1, "second's upload to end")
        assert node.state("second") in ("committed", "uploading")
        assert not store.puts(is_manifest_key), store.log  # nothing published out of order
        gate.set()
        await until(node.quiet, "both sets to settle")
    run_nodes([node], body)

    manifests = store.puts(is_manifest_key)
    assert manifests == [manifest_key("first"), manifest_key("second")], store.log
    assert node.state("first") == node.state("second") == "durable"


def test_a_superseded_set_is_never_published(node, store):
    node.write("model.pt", b"old" * 2000)
    old = node.sets.newest_at("model.pt").seq
    node.write("model.pt", b"new" * 3000)  # a write-open before the upload: old is superseded
    new = node.sets.newest_at("model.pt").seq
    assert node.sets.get(old).state == "superseded"

    settle(node)

    assert store.puts(is_manifest_key) == [manifest_key("model.pt")]
    assert node.sets.get(new).state == "durable"
    m = read_manifest(store, "model.pt")
    assert m["files"][0]["size"] == 9000


def test_a_set_superseded_while_its_upload_runs_is_never_published(node, store):
    node.write("model.pt", b"old" * 2000)
    old = node.sets.newest_at("model.pt").seq
    data = f"data/{node.t.node}/"

    async def body():
        gate = store.gate(data)
        await until(lambda: store.held, "the old content's PUT to be held")
        node.write("model.pt", b"new" * 3000)  # supersedes `old` while its PUT is in flight
        assert node.sets.get(old).state == "superseded"
        gate.set()
        await until(node.quiet, "the new set to settle")
    run_nodes([node], body)

    assert store.puts(is_manifest_key) == [manifest_key("model.pt")]
    assert read_manifest(store, "model.pt")["files"][0]["size"] == 9000
    assert node.state("model.pt") == "durable"


def test_an_object_landing_after_its_file_went_is_collected(node, store):
    """The file is deleted while its object's PUT is in flight: the GC pass the deletion runs
    finds nothing in the store and forgets the object; then the PUT lands. The object must
    still be collected, not left unreferenced for ever (found under load by the crash loop:
    an unreferenced __0_0.distcp 120 s later)."""
    node.write("model.pt", b"old" * 2000)
    data = f"data/{node.t.node}/"
    store.shield = True  # the cancelled upload's PUT still lands, as a boto3 call does

    async def body():
        gate = store.gate(data)
        key = await until(lambda: next(iter(store.held), None), "the object's PUT to be held")
        node.core.unlink(ROOT_INO, b"model.pt")  # its GC pass runs while the PUT is held
        await until(lambda: ("delete", key) in store.log and
                    node.sets.object_content(key) is None, "the GC pass of the deletion")
        gate.set()
        await until(lambda: not store.held and node.quiet(), "the upload to end")
        await until(lambda: not _data_keys(store), "the orphan's GC")
    run_nodes([node], body)

    assert store.puts(lambda k: k.startswith(data)), "the PUT landed (the race was provoked)"
    assert _data_keys(store) == []


def test_an_object_landing_while_its_gc_delete_is_in_flight_is_collected(node, store):
    """The other order of the same race: the deletion's GC pass has sent its DELETE, which
    found nothing, and its reply is still on the way when the PUT lands and the upload ends.
    The pass must not forget the object the upload's end noted again: the next pass deletes
    it (CI found it: the object was left unreferenced for ever)."""
    node.write("model.pt", b"old" * 2000)
    data = f"data/{node.t.node}/"
    store.shield = True
    keys = []

    async def body():
        put_gate = store.gate(data)
        delete_gate = store.delete_gates[data] = trio.Event()
        key = await until(lambda: next(iter(store.held), None), "the object's PUT to be held")
        keys.append(key)
        node.core.unlink(ROOT_INO, b"model.pt")
        await until(lambda: key in store.deletes_held, "the GC pass's DELETE reply to be held")
        put_gate.set()
        await until(lambda: not store.held and node.t.status()["uploads"]["running"] == 0,
                    "the PUT to land and the upload to end")
        assert key in _data_keys(store)
        delete_gate.set()
        await until(lambda: node.quiet() and not store.deletes_held, "the GC pass to end")
        await until(lambda: not _data_keys(store), "the object's collection")
    run_nodes([node], body)

    # the first DELETE found nothing; the second, of the object noted again, took it
    assert [k for op, k in store.log if op == "delete" and k.startswith(data)] == keys * 2


def _data_keys(store: LocalStore) -> list[str]:
    """The data objects in the store (its files under objects/data/, temp files aside)."""
    top = store.root / "objects"
    return sorted(p.relative_to(top).as_posix() for p in (top / "data").rglob("*")
                  if p.is_file() and not p.name.startswith(".tmp-"))


def test_a_deleted_set_is_unpublished(node, store):
    node.write("model.pt", b"x" * 5000)

    async def body():
        await until(node.quiet, "the set to settle")
        assert manifest_key("model.pt") in store.puts()
        node.core.unlink(ROOT_INO, b"model.pt")
        await until(node.quiet, "the deletion to settle")
    run_nodes([node], body)

    assert ("delete", manifest_key("model.pt")) in store.log
    assert node.state("model.pt") == "deleted"
    with pytest.raises(Exception, match=r"model\.pt"):
        read_manifest(store, "model.pt")


def test_a_failed_set_is_at_risk_until_its_path_is_committed_again(node, store):
    """A set whose manifest the store refuses for good is failed and, while nothing replaced
    it, at risk: `Progress.failed_sets` (over every set), status' failed_sets/failed_bytes/
    failed and the metrics' totals count it, and a wait on it or on a directory holding it
    answers failed with the reason. A later commit of its path, or of a directory above it,
    resolves it; so does its removal (nothing is left to lose)."""
    store.refused |= {manifest_key(p) for p in ("model.pt", "run/x/a.pt", "gone.pt")}
    node.mkdir("run")
    node.mkdir("run/x")
    node.write("model.pt", b"m" * 5000)
    node.write("run/x/a.pt", b"a" * 3000)
    node.write("gone.pt", b"g" * 1000)

    def failed() -> dict[str, FailedSet]:
        return {f.path: f for f in node.t.progress.failed_sets()}

    async def body():
        await until(lambda: len(failed()) == 3, "the three sets to fail")
        got = failed()
        assert {p: f.bytes for p, f in got.items()} == {
            "model.pt": 5000, "run/x/a.pt": 3000, "gone.pt": 1000}
        for f in got.values():
            assert f.error.startswith("the store refused its manifest: AccessDenied"), f
            assert node.sets.get(f.seq).state == "failed"
        st = node.t.status()
        assert st["failed_sets"] == 3 and st["failed_bytes"] == 9000
        assert [f["path"] for f in st["failed"]] == ["model.pt", "run/x/a.pt", "gone.pt"]
        assert st["pending_sets"] == 0 and st["pending_bytes"] == 0
        stats = node.t.statistics().sets
        assert stats.failed_sets == 3 and stats.failed_bytes == 9000
        # A wait on the set, and on a directory over it (not itself a set), says failed.
        r = await node.t.wait("model.pt", 5)
        assert r["state"] == "failed" and "refused its manifest" in r["error"], r
        r = await node.t.wait("run", 5)
        assert r["state"] == "failed" and r["path"] == "run/x/a.pt", r
        assert "refused its manifest" in r["error"], r

        # Removed: nothing of it is left to lose.
        node.core.unlink(ROOT_INO, b"gone.pt")
        assert set(failed()) == {"model.pt", "run/x/a.pt"}
        # The store takes manifests again: a commit of the directory above a.pt absorbs it, a
        # new save of model.pt replaces it.
        store.refused.clear()
        node.t.commit_path("run/x")
        node.write("model.pt", b"n" * 7000)
        await until(lambda: node.state("run/x") == node.state("model.pt") == "durable",
                    "the new commits to be durable")
        assert failed() == {}
        st = node.t.status()
        assert (st["failed_sets"], st["failed_bytes"], st["failed"]) == (0, 0, [])
        stats = node.t.statistics().sets
        assert (stats.failed_sets, stats.failed_bytes) == (0, 0)
        assert stats.sets.by_state["failed"] == 3  # the history stays; none is at risk
        assert (await node.t.wait("model.pt", 5))["state"] == "durable"
        r = await node.t.wait("run", 5)
        assert r["state"] == "durable", r
    run_nodes([node], body)


# ----------------------------------------------------------------------------------------------
# 1b. stuck sets: every set pending longer than a threshold is named, with what it waits for


STUCK = 0.2  # the threshold these tests give status/statistics (the mount's is 120 s)


def stuck(node: Node) -> dict[str, dict]:
    """The stuck sets status names, by path; status' count agrees, and the metrics' statistics
    (taken a moment later: a set may have passed the threshold since) name them too."""
    st = node.t.status(stuck_after=STUCK)
    stats = node.t.statistics(stuck_after=STUCK).sets
    assert st["stuck_sets"] == len(st["stuck"]), st["stuck"]
    assert stats.stuck_sets == len(stats.stuck) >= st["stuck_sets"], stats
    shown = {x.seq: x for x in stats.stuck}
    for x in st["stuck"]:
        assert (shown[x["seq"]].path, shown[x["seq"]].committed_ns) == \
            (x["path"], x["committed_ns"]), (x, shown)
        assert shown[x["seq"]].waits_for and shown[x["seq"]].why, shown
    for x in st["stuck"]:
        assert x["state"] in ("committed", "uploading") and x["age_s"] >= STUCK, x
        assert x["why"] and "\n" not in x["why"], x
    return {x["path"]: x for x in st["stuck"]}


def test_a_set_stuck_behind_a_held_upload_is_named_whatever_its_position(node, store):
    """`old.pt`'s upload is held in the store; 55 commits of `churn.pt` come after it, so the
    50 sets status lists are all newer (and superseded, but the last, which commit order holds
    back behind old.pt). Status and the metrics' statistics name both, oldest first: old.pt
    waits for its upload (running, bytes so far), churn.pt for old.pt (commit order, naming
    what old.pt waits for). Under the threshold nothing is stuck; once old.pt is durable
    nothing is."""
    node.write("old.pt", b"o" * 9000)
    old = node.sets.newest_at("old.pt").seq
    gate_key = f"data/{node.t.node}/{node.core.index.resolve('old.pt')}/"

    async def body():
        gate = store.gate(gate_key)
        await until(lambda: store.held, "old.pt's upload to be held")
        for i in range(55):
            node.write("churn.pt", bytes([i]) * 3000)
        churn = node.sets.newest_at("churn.pt").seq
        st = node.t.status()
        assert old not in [r["seq"] for r in st["sets"]]  # not among the recent 50
        assert st["pending_sets"] == 2
        assert node.t.status(stuck_after=3600)["stuck_sets"] == 0  # not yet, at an hour
        assert node.t.status()["stuck"] == [] and st["stuck_after_s"] == 120.0
        got = await until(lambda: (g := stuck(node)) and len(g) == 2 and
                          g["churn.pt"]["waits_for"] == "commit_order" and g,
                          "both sets to be named stuck")
        assert list(got) == ["old.pt", "churn.pt"]  # oldest first
        o, c = got["old.pt"], got["churn.pt"]
        assert o["seq"] == old and o["waits_for"] == "uploads", o
        assert o["why"].startswith("1 of 1 file(s) not in the store yet (0 B of 8.8 KiB"
                                   " uploaded); upload queue: 0 queued, 1 running"), o
        assert c["seq"] == churn and c["after_set"] == old and c["behind_set"] == old, c
        assert c["head_waits_for"] == "uploads", c
        assert c["why"].startswith(f"published after set {old} (old.pt, uploading),"
                                   " committed before it (commit order); the oldest pending"
                                   f" set, {old} (old.pt), waits for: 1 of 1 file(s)"), c
        assert node.t.statistics(stuck_after=STUCK).sets.stuck[0].path == "old.pt"
        gate.set()
        await until(node.quiet, "both sets to settle")
        assert stuck(node) == {}
        assert node.t.status()["oldest_pending_committed_ns"] is None
    run_nodes([node], body)


def test_a_set_whose_manifest_put_hangs_is_named_publishing(node, store):
    """The namespace worker has the set in hand (its manifest PUT hangs): status names it
    `publishing`, not `unknown` (nothing known, a bug)."""
    node.write("m.pt", b"m" * 5000)

    async def body():
        gate = store.gate(manifest_key("m.pt"))
        await until(lambda: store.held, "the manifest PUT to be held")
        got = await until(lambda: (g := stuck(node)) and g, "the set to be named stuck")
        assert got["m.pt"]["waits_for"] == "publishing", got
        assert "publishing it now" in got["m.pt"]["why"]
        gate.set()
        await until(node.quiet, "the set to settle")
        assert stuck(node) == {}
    run_nodes([node], body)


def test_a_path_removed_while_its_superseded_manifest_is_in_flight_leaves_no_manifest(
        node, store):
    """Set 1's manifest PUT is under way (held) when its file is opened for writing (set 1 is
    superseded: it stays durable once its PUT lands, standing in for the older manifest) and
    then removed before that writer's close (so no later set of the path comes). The PUT then
    lands: the path is gone from the tree, so the manifest must go too, or the removed file
    would be listed by every other node for good."""
    node.write("m.pt", b"1" * 5000)
    seq1 = node.sets.newest_at("m.pt").seq

    async def body():
        gate = store.gate(manifest_key("m.pt"))
        await until(lambda: store.held, "set 1's manifest PUT to be held")
        fh = node.open_write("m.pt")          # set 1 superseded (its content changes)
        assert node.sets.get(seq1).state == "superseded"
        parent, name = node.split("m.pt")
        node.core.unlink(parent, name)        # removed before the writer's close
        node.close(fh)
        gate.set()
        await until(lambda: not store.held and node.quiet(), "the PUT to land and settle")
    run_nodes([node], body)
    with pytest.raises(NotFound):
        trio.run(store.head, manifest_key("m.pt"))
    assert node.sets.get(seq1).state in ("deleted", "superseded")


def test_a_set_stuck_on_a_failing_store_says_so(tmp_path, store):
    """Every data PUT fails with a transient 503: the set stays pending (retried), and what it
    waits for is the store, with its last error."""
    faulty = FaultyStore(store)
    n = Node(tmp_path / "a", faulty)
    try:
        faulty.fail_next("put", 10**6)
        faulty.fail_next("create_multipart", 10**6)
        n.write("model.pt", b"m" * 5000)

        async def body():
            got = await until(lambda: (g := stuck(n)) and g["model.pt"]["waits_for"] ==
                              "store" and g, "the set to be named stuck on the store")
            why = got["model.pt"]["why"]
            assert why.startswith("1 of 1 file(s) not in the store yet (0 B of 4.9 KiB"
                                  " uploaded); the store is failing ("), why
            assert "injected 503 SlowDown" in why, why
            faulty._next.clear()  # the store answers again
            await until(lambda: n.state("model.pt") == "durable", "the set to be durable")
            assert stuck(n) == {}
        run_nodes([n], body)
    finally:
        n.core.close()


def test_a_set_committed_while_a_file_is_open_and_a_lost_upload_are_named(node, store):
    """A DCP commit (rename to .metadata) while a storage file is still open for writing here:
    the set waits for that file's last close. A set whose upload job is lost (dropped from the
    queue without superseding the set; nothing else would ever upload it) is named loudly,
    as nothing known will finish it."""
    node.mkdir("ck")

    async def body():
        # (once the services run: recovery at their start treats a file open for writing as
        # one a crash interrupted)
        fh = node.open_write("ck/__0_0.distcp")
        node.core.write(fh, 0, b"s" * 4000)
        node.core.flush(fh)  # not released: still open for writing
        node.write("ck/.metadata.tmp", b"not a pickle")
        node.core.rename(node.split("ck/.metadata.tmp")[0], b".metadata.tmp",
                         node.split("ck/.metadata")[0], b".metadata", 0)
        dcp = node.sets.newest_at("ck")
        assert dcp is not None and dcp.reason == "dcp" and dcp.state == "committed"
        got = await until(lambda: (g := stuck(node)) and "ck" in g and g, "ck to be stuck")
        x = got["ck"]
        assert x["waits_for"] == "open_for_writing", x
        assert "ck/__0_0.distcp still open for writing here" in x["why"], x
        node.close(fh)
        await until(lambda: node.state("ck") == "durable", "ck to be durable once closed")
        # A lost upload: the job of lost.pt's content is dropped, nothing supersedes its set.
        gate = store.gate(f"data/{node.t.node}/")
        node.write("lost.pt", b"l" * 3000)
        ino = node.core.index.resolve("lost.pt")
        await until(lambda: store.held, "lost.pt's upload to be held")
        node.t.uploads.drop(ino, node.core.cache.table.get(ino).version)  # cancels it: lost
        got = await until(lambda: (g := stuck(node)) and "lost.pt" in g and
                          g["lost.pt"]["waits_for"] == "upload_lost" and g,
                          "lost.pt to be named")
        assert got["lost.pt"]["why"].startswith("NOTHING KNOWN: 1 of 1 file(s) not in the"
                                                " store yet"), got
        gate.set()
    run_nodes([node], body)


# ----------------------------------------------------------------------------------------------
# 2. gathering: a set written by two nodes


def test_a_directory_renamed_into_place_gathers_the_other_nodes_file(tmp_path, store):
    a = Node(tmp_path / "a", store)
    b = Node(tmp_path / "b", store)
    x, y = os.urandom(2 * CHUNK + 1), os.urandom(CHUNK + 3)
    for n in (a, b):
        n.mkdir("step.tmp")
    a.write("step.tmp/x", x)

    async def body():
        fh = b.open_write("step.tmp/y")  # B is still writing its file
        b.core.write(fh, 0, y)
        b.core.flush(fh)  # a flush announces it (cachemgr.tiering.parts)
        a.core.rename(ROOT_INO, b"step.tmp", ROOT_INO, b"step", 0)
        row = await until(lambda: next((r for r in a.t.status()["sets"]
                                        if r["path"] == "step" and "waiting_for" in r), None),
                          "A to wait for B's file")
        assert row["state"] in ("committed", "uploading")
        assert not store.puts(lambda k: k == manifest_key("step"))
        b.close(fh)  # B's last close: its upload, then its part record names the object
        await until(lambda: a.state("step") == "durable", "A to publish the set")
    try:
        run_nodes([a, b], body)
        m = read_manifest(store, "step")
        assert sorted(f["path"] for f in m["files"]) == ["x", "y"]
        assert {f["path"]: f["size"] for f in m["files"]} == {"x": len(x), "y": len(y)}
        c = Node(tmp_path / "c", store)
        try:
            trio.run(c.t.remote.sync_once)
            for name, want in (("x", x), ("y", y)):
                ino = c.core.index.resolve(f"step/{name}")
                assert ino is not None
                trio.run(c.t.restorer.ensure_all, ino)
                fh = c.core.open(ino, os.O_RDONLY).fh
                assert c.core.read(fh, 0, len(want) + 1) == want
                c.core.release(fh)
            assert c.core.check_consistency() == []
        finally:
            c.core.close()
    finally:
        for n in (a, b):
            n.core.close()


def test_a_set_stuck_waiting_for_another_nodes_file_is_named(tmp_path, store):
    """A directory renamed into place on A holds a file B still writes (announced by its
    flush): A's set is named stuck, waiting for B's file by name, until B closes it."""
    a = Node(tmp_path / "a", store)
    b = Node(tmp_path / "b", store)
    for n in (a, b):
        n.mkdir("step.tmp")
    a.write("step.tmp/x", b"x" * 5000)

    async def body():
        fh = b.open_write("step.tmp/y")
        b.core.write(fh, 0, b"y" * 3000)
        b.core.flush(fh)  # announces it (cachemgr.tiering.parts)
        a.core.rename(ROOT_INO, b"step.tmp", ROOT_INO, b"step", 0)
        got = await until(lambda: (g := stuck(a)) and "step" in g and
                          g["step"]["waits_for"] == "other_nodes" and g,
                          "A's set to be named stuck on B's file")
        why = got["step"]["why"]
        assert why.startswith("1 file(s) other nodes write, not durable yet: y ("), why
        assert "s commit timeout" in why, why
        assert got["step"]["waiting_for"]["files"] == ["y"]
        b.close(fh)
        await until(lambda: a.state("step") == "durable", "A to publish the set")
        assert stuck(a) == {}
    try:
        run_nodes([a, b], body)
    finally:
        for n in (a, b):
            n.core.close()


# ----------------------------------------------------------------------------------------------
# 3. restore: chunk fill


def test_ensure_range_fills_only_the_chunks_a_range_needs(tmp_path, node, store):
    data = os.urandom(5 * CHUNK + 123)
    node.write("model.pt", data)

    settle(node)

    other = Node(tmp_path / "other", store)
    try:
        trio.run(other.t.remote.sync_once)
        ino = other.core.index.resolve("model.pt")
        assert ino is not None and other.core.cache.residency.needs_fetch(ino)
        r = other.t.restorer
        before = r.statistics().chunks.chunks_fetched
        off, size = 2 * CHUNK + 10, CHUNK  # spans chunks 2 and 3
        trio.run(functools.partial(r.ensure_range, ino, off, size))
        assert r.statistics().chunks.chunks_fetched - before == 2
        fh = other.core.open(ino, os.O_RDONLY).fh
        assert other.core.read(fh, off, size) == data[off:off + size]
        other.core.release(fh)
        assert other.core.cache.residency.needs_fetch(ino)  # the rest is still in the store
        assert other.core.check_consistency() == []
        trio.run(r.ensure_all, ino)
        assert r.statistics().chunks.chunks_fetched - before == 6
        fh = other.core.open(ino, os.O_RDONLY).fh
        assert other.core.read(fh, 0, len(data) + 1) == data
        other.core.release(fh)
        assert other.core.check_consistency() == []
    finally:
        other.core.close()


def test_a_chunk_the_store_keeps_failing_costs_one_retry_budget_then_eio(tmp_path, node, store):
    """Retries are not stacked: a chunk whose GET keeps failing with a transient error is
    tried as often as the store wrapper's policy says (RetryingStore), then the read fails
    with EIO; the restore path adds no loop of its own around it (only a chunk whose bytes
    fail their CRC is read again there)."""
    data = os.urandom(3 * CHUNK)
    node.write("model.pt", data)

    settle(node)

    faulty = FaultyStore(store)
    policy = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.002)
    other = Node(tmp_path / "other", RetryingStore(faulty, policy))
    try:
        trio.run(other.t.remote.sync_once)
        ino = other.core.index.resolve("model.pt")
        assert ino is not None and other.core.cache.residency.needs_fetch(ino)
        faulty.fail_next("get", 1000)
        gets = faulty.calls.get("get", 0)
        with pytest.raises(FsError) as e:
            trio.run(functools.partial(other.t.restorer.ensure_range, ino, CHUNK + 1, 10))
        assert e.value.errno == errno.EIO
        assert faulty.calls["get"] - gets == policy.attempts
    finally:
        other.core.close()


# ----------------------------------------------------------------------------------------------
# 4. remote sync


def test_a_listing_is_applied_as_one_step_and_removals_follow_the_store(tmp_path, node, store):
    node.write("one", b"1" * 5000)
    node.write("two", b"2" * 7000)

    async def published():
        await until(node.quiet, "both sets to settle")
    run_nodes([node], published)

    other = Node(tmp_path / "other", store)
    try:
        async def body():
            gate = store.gate(manifest_key("two"))  # its read is held; one's is not
            async with trio.open_nursery() as n:
                n.start_soon(other.t.remote.sync_once)
                await until(lambda: manifest_key("two") in store.held, "two's read to wait")
                await until(lambda: ("get", manifest_key("one")) in store.log, "one's read")
                # one's manifest is read, two's is not: nothing of the listing shows yet
                assert other.core.index.resolve("one") is None
                assert other.t.remote.statistics().syncs == 0
                gate.set()
            assert other.core.index.resolve("one") is not None
            assert other.core.index.resolve("two") is not None
        trio.run(body)
        assert other.t.remote.statistics().restored_sets == 2

        trio.run(store.delete, manifest_key("one"))  # as another node's unpublish does
        trio.run(other.t.remote.sync_once)
        assert other.core.index.resolve("one") is None
        assert other.core.index.resolve("two") is not None
        assert other.t.remote.statistics().removed_sets == 1
        assert other.core.check_consistency() == []
    finally:
        other.core.close()
