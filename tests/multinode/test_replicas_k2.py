"""Takeover with K = 2 (--replicas 2, docs/ARCHITECTURE.md "Replicas"): real mounts on
127.0.0.1 on one moto S3 store, node A's store behind the fault proxy. A's sets are held by two
buddies, B and C; A dies before the store has them; both buddies see its lease expire and race
to publish the same replicas with conditional manifest PUTs. The store must end with exactly
the sets A committed, each published once, with no object left behind by the buddy that lost.
Which buddy wins a set is up to the race: the test asserts what holds either way.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
from tests.conftest import run_cli, wait_for
from tests.faultproxy import Rule
from tests.replicas_helpers import (
    _store_get,
    cluster,
    replica_files,
    replication,
    set_row,
    unnamed_objects,
)

__all__ = ["cluster"]  # the fixture, imported for this test

SETS = ("run/step_1", "run/dcp_2")


def _manifest_keys(cluster) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=cluster.endpoint, region_name="us-east-1")
    return sorted(o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=cluster.bucket, Prefix="p/manifests/") for o in page.get("Contents", []))


def _commit_sets(a) -> tuple[dict[str, bytes], dict, dict]:
    """A commits a torch.save directory and a DCP directory (the store is down for A): the
    bytes of every file it wrote, what it torch.saved and the DCP state."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(11)
    tmp = a.path / "run" / "step_1.tmp"
    tmp.mkdir(parents=True)
    model = {"w": torch.randn(1 << 20, generator=g)}
    torch.save(model, tmp / "model.pt")
    os.rename(tmp, a.path / "run" / "step_1")
    state = {"w": torch.randn(300_000, generator=g), "b": torch.arange(1000)}
    dcp.save(state, checkpoint_id=str(a.path / "run" / "dcp_2"))
    wrote = {p.relative_to(a.path).as_posix(): p.read_bytes()
             for p in (a.path / "run").rglob("*") if p.is_file()}
    assert set(wrote) == {"run/step_1/model.pt", "run/dcp_2/.metadata",
                          "run/dcp_2/__0_0.distcp"}, sorted(wrote)
    return wrote, model, state


def test_two_buddies_race_to_take_over_and_each_set_is_published_once(cluster):
    """A (--replicas 2) has both B and C as buddies; in a store outage it commits two sets,
    both held by both buddies; A is killed and its cache dir deleted; both buddies race to take
    over (both upload the first set's files before either PUTs its manifest): the store holds
    one manifest per set, A's commit, published by one of them; every data object there is
    named by a manifest (the loser deleted its uploads); each set is counted taken over once;
    both buddies drop their replicas; a fresh node D loads both sets bit-exact."""
    import torch.distributed.checkpoint as dcp

    race = cluster.new_proxy()  # the buddies' store: it holds their takeover uploads
    a = cluster("a", "--replicas", "2", "--lease", "4", proxied=True)  # cluster.proxy: goes down
    b = cluster("b", "--lease", "4", proxied=race)
    c = cluster("c", "--lease", "4", proxied=race)
    buddies = {b.node_id, c.node_id}
    wait_for(lambda: set(replication(a)["buddies"]) == buddies, timeout=20,
             what="A to list both B and C as its buddies")
    cluster.proxy.outage()  # until clear(): A never reaches the store again
    wrote, model, state = _commit_sets(a)
    for rel in SETS:
        res = run_cli("wait", "--replicated", str(a.path / rel), "--timeout", "30")
        assert res.returncode == 0, res.stderr
    rows = {rel: set_row(a, rel) for rel in SETS}
    assert all(r["replicas"] == 2 and r["replicated"] and r["state"] != "durable"
               for r in rows.values()), rows
    for m in (b, c):
        held = replication(m)
        assert held["held_for_others"] == 2, (m.node_id, held)
        assert held["replica_bytes"] == sum(map(len, wrote.values())), (m.node_id, held)
        assert {p.name for p in (m.cache_dir / "replicas" / a.node_id).iterdir()} == \
            {str(r["seq"]) for r in rows.values()}, replica_files(m)
    # The race, provoked: each buddy's first takeover upload waits at the proxy until the
    # other's is there too, so both are past their check of the store for the same set and
    # both will PUT its manifest; one finds the other's there.
    race.set_rules([Rule("hold", ops={"put", "create_multipart"}, key="/takeover/", delay=120)])
    a.kill9()
    shutil.rmtree(a.cache_dir)
    assert race.wait_held(2, timeout=60), race.snapshot()
    first_rel, first = min(((rel, r["seq"]) for rel, r in rows.items()), key=lambda x: x[1])
    held = sorted(k for _op, k, mode in race.log if mode == "hold")
    assert held == sorted(f"p/data/{n}/takeover/{a.node_id}/{first}/0" for n in buddies), held
    race.set_rules([])
    assert race.release() == 2

    # Both buddies settled: each dropped both replicas (published, or found published).
    wait_for(lambda: all(replication(m)["held_for_others"] == 0 for m in (b, c)), timeout=60,
             what="both buddies to take over or drop A's replicas")
    assert _manifest_keys(cluster) == sorted(f"p/manifests/{rel}.json" for rel in SETS)
    winners = {}
    for rel, row in rows.items():
        commit = json.loads(_store_get(cluster, f"p/manifests/{rel}.json"))["commit"]
        assert (commit["node"], commit["seq"], commit["committed_ns"]) == \
            (a.node_id, row["seq"], row["committed_ns"]), (rel, commit, row)
        assert commit["taken_over_by"] in buddies, commit
        assert sorted(commit["nodes"]) == sorted({a.node_id, commit["taken_over_by"]}), commit
        winners[rel] = commit["taken_over_by"]
    # the loser's uploads of a set it found published are gone, not left unnamed
    assert unnamed_objects(cluster) == []
    (lost,) = [m for m in (b, c) if m.node_id != winners[first_rel]]  # both uploaded it
    gone = [ln for ln in lost.log_text().splitlines()
            if f"set {first} of node {a.node_id} ({first_rel}) was published by "
               f"{winners[first_rel]} first: deleted the 1 objects" in ln]
    assert len(gone) == 1, lost.log_text()[-3000:]
    counted = {m.node_id: replication(m)["taken_over"] for m in (b, c)}
    assert sum(counted.values()) == 2, counted  # one per set, whichever buddy won it
    for m in (b, c):
        assert counted[m.node_id] == sum(w == m.node_id for w in winners.values()), \
            (counted, winners)
        took = [ln for ln in m.log_text().splitlines() if "took over set" in ln]
        assert len(took) == counted[m.node_id] and all(a.node_id in ln for ln in took), took
        # the takeover records go once the buddy's namespace owns the objects (next sweep)
        wait_for(lambda m=m: replica_files(m) == [a.node_id], timeout=20,
                 what=f"{m.node_id} to hold nothing but the origin's empty directory")

    d = cluster("d")
    for rel, data in wrote.items():
        wait_for(lambda rel=rel: (d.path / rel).exists(), timeout=20, what=f"{rel} on d")
        assert (d.path / rel).read_bytes() == data, rel
    assert torch.equal(torch.load(d.path / "run" / "step_1" / "model.pt")["w"], model["w"])
    back = {"w": torch.zeros(300_000), "b": torch.zeros(1000, dtype=torch.int64)}
    dcp.load(back, checkpoint_id=str(d.path / "run" / "dcp_2"))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
