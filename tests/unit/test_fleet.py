"""A fleet on one bucket, in process (issue 35; tests/fleet.py): what one node asks the store
must not grow with the number of nodes. Real CacheFs + Engine nodes on one counted in-memory
store, at two fleet sizes; the committer's own requests (one GET per other node's record, one
HEAD per object) are O(N) by design and are left out. scripts/sim_fleet.py runs the same
scenario at 10 to 1,000 nodes and reports it."""

from __future__ import annotations

import statistics

import trio

from cachemgr.tiering import lease
from tests.fleet import FleetNode, MemStore, NodeView, RequestLog, run_fleet, sim_config

# The requests every node makes every pass whatever happens (LIST manifests/, LIST intents/,
# the member record's renewal): their number depends on how long a phase lasts, not on N.
PERIODIC = {("list", "manifests"), ("list", "intents"), ("put", "members")}


def _per_node(r, phase: str, who: list[str]) -> list[int]:
    per = r.log.per_node(phase, who, exclude=PERIODIC)
    return sorted(sum(ops.values()) for ops in per.values())


def _fleet(tmp_path, n: int):
    return trio.run(lambda: run_fleet(tmp_path / f"n{n}", MemStore(), n, 3, interval=0.1,
                                      lease=600.0, idle=1.0, timeout=120.0))


def test_requests_per_node_do_not_grow_with_the_fleet(tmp_path):
    """A DCP commit by node 0 of one shard per node, then three fresh nodes restoring it, at 4
    and at 24 nodes: each writer other than the committer makes the same requests (its
    object, its part records, the manifest's GET, a HEAD), each restoring node too, and an idle
    pass costs each node the same LISTs. An O(N) request per node (a listing of every member,
    a GET per other node's record) would multiply by 6 here."""
    small, big = _fleet(tmp_path, 4), _fleet(tmp_path, 24)
    for r in (small, big):
        assert len(r.log.per_node("commit", r.nodes)) == len(r.nodes)
    commit = [_per_node(r, "commit", r.nodes[1:]) for r in (small, big)]
    restore = [_per_node(r, "restore", r.readers) for r in (small, big)]
    assert max(commit[1]) <= max(commit[0]) + 1, commit
    assert statistics.median(commit[1]) <= statistics.median(commit[0]) + 1, commit
    assert max(restore[1]) <= max(restore[0]) + 1, restore
    for r in (small, big):
        # nothing but the periodic listings while idle
        assert _per_node(r, "idle", r.nodes)[-1] == 0, r.log.per_node("idle", r.nodes)
        passes = r.idle_s / 0.1
        lists = [ops.get("list", 0) for ops in r.log.per_node("idle", r.nodes).values()]
        assert max(lists) <= 2 * passes + 4, (lists, passes)  # manifests/ + intents/
    # the committer's own requests are O(N) (a GET per record, a HEAD per object), no more;
    # its LISTs of the records are one per poll, and how many polls the gathering takes
    # depends on how fast the other nodes' uploads land (the machine's load), not on N. Per
    # other node: a GET of each version of its record it sees (a writer PUTs it at most twice:
    # after the close, and with the object) and a HEAD of its object; the committer's own
    # requests (its record's PUTs, its object's) vary by a few with the same timing
    c_small, c_big = (sum(n for op, n in r.log.per_node("commit", r.nodes[:1], exclude=PERIODIC)
                          [r.nodes[0]].items() if op != "list") for r in (small, big))
    assert c_big <= c_small + 3 * (24 - 4) + 4, (c_small, c_big)


def _dead_members(store: MemStore, k: int) -> None:
    async def put() -> None:
        for i in range(k):
            key = lease.member_key(f"dead{i:04x}")
            await store.put(key, lease.encode_doc("member", node=f"dead{i:04x}", lease_s=30.0,
                                              renewed_ns=1, pid=1, generation=1))
            store.backdate(key, 3600)  # silent for an hour: gone
    trio.run(put)


def test_listing_live_members_reads_each_dead_record_once(tmp_path):
    """`Members.live()` (the restore policy's choice, a directory commit, peers) lists
    members/ and reads a record past its lease to learn that node's own lease: once per
    record version, not at every call. Before, every call cost a GET per dead node's record
    (they stay in the store until fsck)."""
    gets = []
    for k in (5, 50):
        store, log = MemStore(), RequestLog()
        _dead_members(store, k)
        node = FleetNode(tmp_path / f"a{k}", store, log, sim_config(1.0, 30.0))
        try:
            async def calls(node: FleetNode = node) -> list[dict[str, float]]:
                return [await node.t.members.live() for _ in range(3)]
            lives = trio.run(calls)
            assert lives == [{}, {}, {}]
            gets.append(log.per_node("start", [node.id])[node.id].get("get", 0))
        finally:
            node.close()
    # each dead record read once in three calls
    assert gets == [5, 50], gets


def test_a_dead_members_record_is_read_again_when_it_changes(tmp_path):
    """A node that comes back writes its record again (a new etag): it is read again, and
    counted live by its own lease."""
    store, log = MemStore(), RequestLog()
    _dead_members(store, 1)
    node = FleetNode(tmp_path / "a", store, log, sim_config(1.0, 30.0))
    view = NodeView(store, log, "other")

    async def main() -> None:
        assert await node.t.members.live() == {}
        await view.put(lease.member_key("dead0000"), lease.encode_doc(
            "member", node="dead0000", lease_s=30.0, renewed_ns=2, pid=1, generation=2))
        assert set(await node.t.members.live()) == {"dead0000"}
    try:
        trio.run(main)
    finally:
        node.close()
