"""The one manifest writer and its one rule (cachemgr/tiering/manifests.py, docs/SEMANTICS.md
"Conflicts"): of two commits of a path the store keeps the later (`mf.Commit.later_than`: one
node's commits by seq, two nodes' by commit time, a tie going to the larger node id), whoever
writes it: the committing node's namespace worker, or a buddy taking the set over for it
(cachemgr.tiering.takeover, which compares its origin's commit). On the file:// LocalStore (the
in-process `Recorder` of tests/inproc.py, which logs every request) and on moto:

  1. the rule: ties on the commit time, a node's own commits by seq (its clock stepped back),
     the same commit;
  2. the writer: a later commit replaces, an earlier one and the same one write nothing (the
     same commit twice: one PUT); what a caller believes is there saves the look only when it
     is nothing or an earlier commit; racing writers end with the latest commit whatever the
     order; a store ignoring conditions still gets the rule (a look before the plain PUT);
  3. a takeover loses to a later set at the path (and deletes its uploads), replaces an earlier
     one, wins a tie its origin would win, never brings back its origin's superseded commit,
     and finds the origin's own manifest of the same commit done;
  4. the namespace worker (an in-process node) whose PUT meets another node's commit landed
     first: a later one stays and its set is superseded, an earlier one is replaced.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import crc32c
import pytest
import trio

from cachemgr.format import manifest as mf
from cachemgr.format.keys import manifest_key
from cachemgr.format.objects import StoredObject
from cachemgr.store import LocalStore, PreconditionFailed, StoreError
from cachemgr.tiering.manifests import NOTHING, ManifestWriter, Seen
from cachemgr.tiering.takeover import Takeover, TakeoverRecords
from tests.inproc import Recorder

PATH = "ckpt/latest.pt"


def manifest(node: str, seq: int, ns: int, path: str = PATH) -> dict:
    """The manifest of an empty directory set committed by `node` as its set `seq` at `ns`."""
    return mf.build(path=path, kind="dir", seq=seq, node=node, reason="close", committed_ns=ns,
                    layout={"mode": 0o755}, files=[])


async def no_fence() -> None:
    pass


def commit_there(store: LocalStore, path: str = PATH) -> tuple[str, int, int]:
    """(node, seq, committed_ns) of the manifest the store holds at `path`."""
    c = mf.loads(trio.run(store.get, manifest_key(path)))["commit"]
    return c["node"], c["seq"], c["committed_ns"]


def plant(store: LocalStore, m: dict) -> str:
    """Put manifest `m` at its key as a writer before this test did; its etag."""
    return trio.run(lambda: store.put(manifest_key(m["path"]), mf.dumps(m))).etag


def write(store: LocalStore, m: dict, seen: Seen | None = None):
    return trio.run(ManifestWriter(store, no_fence).write, m, mf.dumps(m), seen)


@pytest.fixture
def store(tmp_path):
    return Recorder(tmp_path / "store")


# ----------------------------------------------------------------------------------------------
# 1. the rule


def test_a_tie_on_the_commit_time_goes_to_the_larger_node_id():
    a, b = mf.Commit(100, "aaaa0000", 1), mf.Commit(100, "bbbb0000", 1)
    assert b.later_than(a) and not a.later_than(b)
    # the commit time first: a node id decides ties only
    assert mf.Commit(101, "aaaa0000", 1).later_than(b)


def test_one_node_s_commits_are_ordered_by_seq_whatever_its_clock_says():
    # its clock stepped back between its sets 5 and 6: 6 is still its later commit
    assert mf.Commit(90, "aaaa0000", 6).later_than(mf.Commit(100, "aaaa0000", 5))
    assert not mf.Commit(100, "aaaa0000", 5).later_than(mf.Commit(90, "aaaa0000", 6))


def test_the_same_node_and_seq_are_the_same_commit():
    m = manifest("aaaa0000", 3, 100)
    taken = {**m, "commit": {**m["commit"], "nodes": ["aaaa0000", "cccc0000"],
                             "taken_over_by": "cccc0000"}}
    one, other = mf.commit_of(m), mf.commit_of(taken)
    assert one == other and not one.later_than(other) and not other.later_than(one)


# ----------------------------------------------------------------------------------------------
# 2. the writer


def test_a_later_commit_replaces_an_earlier_one_and_never_the_reverse(store):
    assert write(store, manifest("aaaa0000", 1, 100)).outcome == "written"
    done = write(store, manifest("bbbb0000", 1, 200))
    assert done.outcome == "written" and commit_there(store) == ("bbbb0000", 1, 200)
    puts = len(store.puts())
    lost = write(store, manifest("cccc0000", 9, 150))
    assert lost.outcome == "later" and lost.there["commit"]["node"] == "bbbb0000"
    assert lost.etag == done.etag and len(store.puts()) == puts  # nothing written
    assert commit_there(store) == ("bbbb0000", 1, 200)


def test_ties_on_the_commit_time_end_with_the_larger_node_id(store):
    plant(store, manifest("bbbb0000", 1, 100))
    assert write(store, manifest("aaaa0000", 7, 100)).outcome == "later"
    assert commit_there(store) == ("bbbb0000", 1, 100)
    assert write(store, manifest("cccc0000", 1, 100)).outcome == "written"
    assert commit_there(store) == ("cccc0000", 1, 100)


def test_the_same_commit_twice_is_one_put(store):
    m = manifest("aaaa0000", 4, 100)
    first = write(store, m)
    again = write(store, m)  # a PUT whose reply was lost, tried again
    assert (first.outcome, again.outcome) == ("written", "same")
    assert again.etag == first.etag and again.there["commit"]["seq"] == 4
    assert store.puts() == [manifest_key(PATH)]


def test_a_node_s_own_later_set_replaces_its_earlier_one_after_its_clock_stepped_back(store):
    etag = write(store, manifest("aaaa0000", 5, 100)).etag
    seen = Seen(etag, mf.Commit(100, "aaaa0000", 5))
    assert write(store, manifest("aaaa0000", 6, 90), seen).outcome == "written"
    assert commit_there(store) == ("aaaa0000", 6, 90)


def test_what_a_caller_believes_is_there_saves_the_look_only_for_an_earlier_commit(store):
    etag = plant(store, manifest("bbbb0000", 1, 100))
    store.log.clear()
    # the index knows an earlier commit there: one PUT, If-Match on it, no look
    done = write(store, manifest("aaaa0000", 2, 200), Seen(etag, mf.Commit(100, "bbbb0000", 0)))
    assert done.outcome == "written" and store.log == [("put", manifest_key(PATH))]
    # it knows a later commit there: looked at, and it wins (no PUT)
    store.log.clear()
    seen = Seen(done.etag, mf.Commit(200, "aaaa0000", 2))
    assert write(store, manifest("cccc0000", 1, 150), seen).outcome == "later"
    assert store.log == [("get", manifest_key(PATH))]
    # a belief that is wrong costs a refused PUT and a look, never the rule
    store.log.clear()
    assert write(store, manifest("dddd0000", 1, 120), NOTHING).outcome == "later"
    assert store.log == [("get", manifest_key(PATH))]
    assert commit_there(store) == ("aaaa0000", 2, 200)


def test_an_unreadable_manifest_at_the_path_is_replaced(store):
    trio.run(lambda: store.put(manifest_key(PATH), b"{not json"))
    assert write(store, manifest("aaaa0000", 1, 100)).outcome == "written"
    assert commit_there(store) == ("aaaa0000", 1, 100)


def test_racing_writers_end_with_the_latest_commit_whatever_their_order(tmp_path):
    commits = [("aaaa0000", 1, 100), ("bbbb0000", 1, 100), ("cccc0000", 3, 99),
               ("aaaa0000", 2, 100), ("dddd0000", 1, 50), ("bbbb0000", 2, 100)]
    latest = ("bbbb0000", 2, 100)  # the tie at 100 goes to bbbb; its later seq
    for round_ in range(4):
        store = LocalStore(tmp_path / f"store{round_}")
        order = random.Random(round_).sample(commits, len(commits))
        got = trio.run(race, store, [manifest(*c) for c in order])
        assert commit_there(store) == latest, (order, got)
        assert got.count("written") >= 1 and "same" not in got, got


async def race(store: LocalStore, ms: list[dict]) -> list[str]:
    """Write every manifest of `ms` at once, each by its own writer; their outcomes."""
    out: list[str] = []

    async def one(m: dict) -> None:
        out.append((await ManifestWriter(store, no_fence).write(m, mf.dumps(m))).outcome)

    async with trio.open_nursery() as n:
        for m in ms:
            n.start_soon(one, m)
    return out


class Unconditional(Recorder):
    """A store found to ignore conditional PUTs, mounted with --store-ignores-conditions."""

    @property
    def supports_conditional_put(self) -> bool:
        return False

    async def put(self, key, data, **kw):
        return await super().put(key, data)


def test_a_store_ignoring_conditions_still_gets_the_rule_by_a_look(tmp_path):
    store = Unconditional(tmp_path / "store")
    plant(store, manifest("bbbb0000", 1, 200))
    assert write(store, manifest("aaaa0000", 1, 100), NOTHING).outcome == "later"
    assert commit_there(store) == ("bbbb0000", 1, 200)
    assert write(store, manifest("aaaa0000", 2, 300), NOTHING).outcome == "written"
    assert commit_there(store) == ("aaaa0000", 2, 300)


class RefusesIfMatch(Recorder):
    """A store that takes If-Match in another ETag form than its probe found."""

    async def put(self, key, data, **kw):
        if kw.get("if_match") is not None:
            raise PreconditionFailed(f"{key} changed", key=key)
        return await super().put(key, data, **kw)


def test_if_match_refused_with_the_current_etag_is_said_so(tmp_path):
    store = RefusesIfMatch(tmp_path / "store")
    plant(store, manifest("bbbb0000", 1, 100))
    with pytest.raises(StoreError, match="refused If-Match with the current ETag"):
        write(store, manifest("aaaa0000", 1, 200))


def test_on_s3_racing_writers_and_a_vanished_manifest(moto_server):
    """moto: conditional PUTs race as on S3; If-Match on a key whose manifest was deleted
    meanwhile answers 404, and the writer creates it (If-None-Match)."""
    from cachemgr.store import open_store
    from tests.conftest import new_bucket

    bucket = new_bucket(moto_server)

    async def main() -> None:
        st = open_store(f"s3://{bucket}/p", endpoint_url=moto_server, path_style=True)
        await race(st, [manifest(f"{i:x}" * 8, 1, 100 + i % 3) for i in range(6)])
        there = mf.loads(await st.get(manifest_key(PATH)))
        assert mf.commit_of(there) == mf.Commit(102, "55555555", 1)  # 102: 2 and 5; 5 > 2
        gone = await st.head(manifest_key(PATH))
        await st.delete(manifest_key(PATH))
        m = manifest("66666666", 1, 50)
        # the writer believes an earlier commit is there (a stale index): If-Match answers 404
        seen = Seen(gone.etag, mf.Commit(1, "00000000", 0))
        done = await ManifestWriter(st, no_fence).write(m, mf.dumps(m), seen)
        assert done.outcome == "written"
        assert mf.commit_of(mf.loads(await st.get(manifest_key(PATH)))) == mf.commit_of(m)
        await st.aclose()

    trio.run(main)


# ----------------------------------------------------------------------------------------------
# 3. takeover: a buddy publishes its origin's commit, by the same rule

ORIGIN, BUDDY = "aaaa0000", "eeee0000"


class HeldLease:
    """The buddy's lease, held (Takeover awaits `ensure` as its fence)."""

    async def ensure(self) -> None:
        pass


def takeover(store: LocalStore, tmp_path: Path) -> Takeover:
    async def upload(local: str, key: str, size: int) -> StoredObject:
        data = Path(local).read_bytes()
        assert len(data) == size
        await store.put(key, data)
        return StoredObject(key=key, size=size, stored_size=size, crc32c=crc32c.crc32c(data))

    async def live() -> dict[str, float]:
        return {BUDDY: 0.0}

    return Takeover(store=store, node=BUDDY, lease=HeldLease(), live=live, upload=upload,
                    records=TakeoverRecords(tmp_path / "replicas"))


def replica(tmp_path: Path, seq: int, ns: int, origin: str = ORIGIN) -> tuple[dict, Path]:
    """A held replica of `origin`'s file set `seq` at PATH, committed at `ns`; (descriptor,
    its directory)."""
    where = tmp_path / "replicas" / origin / str(seq)
    where.mkdir(parents=True)
    (where / "0").write_bytes(b"w" * 100 + bytes([seq]))
    desc = {"origin": origin, "seq": seq, "path": PATH, "kind": "file", "reason": "close",
            "committed_ns": ns, "files": [{"rel": "", "size": 101, "mode": 0o644,
                                           "mtime_ns": ns}],
            "dirs": [], "symlinks": []}
    return desc, where


def takeover_keys(store: LocalStore) -> list[str]:
    return sorted(i.key for i in trio.run(store.list, f"data/{BUDDY}/takeover/"))


def test_a_takeover_loses_to_a_later_set_at_the_path(store, tmp_path):
    plant(store, manifest("bbbb0000", 1, 200))
    t = takeover(store, tmp_path)
    assert trio.run(t.publish, *replica(tmp_path, 5, 100))
    assert commit_there(store) == ("bbbb0000", 1, 200) and t.taken_over == 0
    assert takeover_keys(store) == []  # its uploads deleted: nothing names them


def test_a_takeover_replaces_an_earlier_set_at_the_path(store, tmp_path):
    plant(store, manifest("bbbb0000", 1, 50))
    t = takeover(store, tmp_path)
    assert trio.run(t.publish, *replica(tmp_path, 5, 100))
    m = json.loads(trio.run(store.get, manifest_key(PATH)))  # as written (readers drop some)
    assert commit_there(store) == (ORIGIN, 5, 100) and t.taken_over == 1
    assert m["commit"]["taken_over_by"] == BUDDY
    assert [f["object"]["key"] for f in m["files"]] == takeover_keys(store)


def test_a_takeover_wins_a_tie_its_origin_would_win_and_loses_one_it_would_lose(store,
                                                                                tmp_path):
    # Before one rule, a takeover lost every tie on the commit time (>=), its origin's own
    # PUT won those against a smaller node id: who published decided what the store kept.
    plant(store, manifest("0000aaaa", 1, 100))
    t = takeover(store, tmp_path)
    assert trio.run(t.publish, *replica(tmp_path, 5, 100))
    assert commit_there(store) == (ORIGIN, 5, 100) and t.taken_over == 1
    plant(store, manifest("ffff0000", 1, 100))
    assert trio.run(t.publish, *replica(tmp_path, 6, 100))
    assert commit_there(store) == ("ffff0000", 1, 100) and t.taken_over == 1


def test_a_takeover_never_brings_back_its_origin_s_superseded_commit(store, tmp_path):
    # the origin published its set 7 with its clock stepped back: its set 5, held by the
    # buddy with a later commit time, is still the earlier commit
    plant(store, manifest(ORIGIN, 7, 90))
    t = takeover(store, tmp_path)
    assert trio.run(t.publish, *replica(tmp_path, 5, 100))
    assert commit_there(store) == (ORIGIN, 7, 90) and t.taken_over == 0


def test_a_takeover_finds_its_origin_s_own_manifest_of_the_commit_done(store, tmp_path):
    plant(store, manifest(ORIGIN, 5, 100))  # the origin came back and published it first
    etag = trio.run(store.head, manifest_key(PATH)).etag
    t = takeover(store, tmp_path)
    assert trio.run(t.publish, *replica(tmp_path, 5, 100))
    assert trio.run(store.head, manifest_key(PATH)).etag == etag and t.taken_over == 0
    assert takeover_keys(store) == []


# ----------------------------------------------------------------------------------------------
# 4. the namespace worker through the writer (an in-process node, tests/inproc.py)


@pytest.mark.parametrize("theirs", ["later", "earlier"])
def test_a_publication_meets_another_node_s_commit_that_landed_first(tmp_path, theirs):
    """Node A's manifest PUT of model.pt is held while another node's commit of the path lands
    (If-None-Match is then refused): a later commit stays and A's set is superseded, saying
    why; an earlier one is replaced by A's."""
    from tests.inproc import Node, run_nodes, until

    store = Recorder(tmp_path / "store")
    node = Node(tmp_path / "a", store)
    key = manifest_key("model.pt")
    other = "ffff0000"

    async def body() -> None:
        gate = store.gate(key)
        node.write("model.pt", b"m" * 5000)
        await until(lambda: key in store.held, "A's manifest PUT to be held")
        data = b"o" * 100
        obj = StoredObject(key=f"data/{other}/1/1/model.pt", size=100, stored_size=100,
                           crc32c=crc32c.crc32c(data))
        await LocalStore.put(store, obj.key, data)
        mine = node.sets.newest_at("model.pt")
        ns = mine.committed_ns + (10**9 if theirs == "later" else -(10**9))
        m = mf.build(path="model.pt", kind="file", seq=1, node=other, reason="close",
                     committed_ns=ns, layout={}, files=[{"path": "", "size": 100,
                                                         "mode": 0o644, "mtime_ns": ns,
                                                         "object": obj.to_json()}])
        await LocalStore.put(store, key, mf.dumps(m))
        gate.set()
        await until(lambda: node.sets.get(mine.seq).state not in ("committed", "uploading"),
                    "A's publication to end")
        s = node.sets.get(mine.seq)
        there = mf.loads(await LocalStore.get(store, key))["commit"]
        if theirs == "later":
            assert s.state == "superseded" and there["node"] == other, (s, there)
            assert "later than this one" in s.error, s
        else:
            assert s.state == "durable" and there["node"] == node.t.node, (s, there)
        await until(node.quiet, "the node to settle")

    try:
        run_nodes([node], body)
        assert node.core.check_consistency() == []
    finally:
        node.core.close()
