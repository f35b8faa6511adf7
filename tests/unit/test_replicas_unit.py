"""Replicas in process, no mount (the rest: tests/multinode/test_replicas.py): the choice of a
node's buddies is stable as other nodes come and go, and a replica offer is validated like a store
document.
"""

from __future__ import annotations

import json

import pytest

from tests.replicas_helpers import _offer


def test_buddies_are_stable_as_others_come_and_go():
    from cachemgr.peer.proto import PeerEndpoint
    from cachemgr.tiering.replicaproto import buddies

    peers = [PeerEndpoint(f"n{i:03d}", "127.0.0.1", 1000 + i) for i in range(50)]
    first = [p.node for p in buddies("origin", peers)[:2]]
    assert len(set(first)) == 2 and "origin" not in first
    others = [p for p in peers if p.node not in first]
    for gone in others[:20]:  # a node that is not a buddy leaves: the buddies stay
        assert [p.node for p in buddies("origin", [p for p in peers if p != gone])[:2]] == first
    new = PeerEndpoint("n999", "127.0.0.1", 2000)  # a node joins: at most one buddy changes
    assert len(set(first) & {p.node for p in buddies("origin", [*peers, new])[:2]}) >= 1
    assert [p.node for p in buddies("origin", [*peers, PeerEndpoint("origin", "h", 1)])[:2]] \
        == first  # never itself
    spread = {buddies(f"o{i}", peers)[0].node for i in range(200)}
    assert len(spread) > 25  # each origin has its own buddies: the load spreads


def test_an_offer_is_validated_like_a_store_document():
    from cachemgr.format import validate

    good = json.loads(_offer(1234))
    assert validate.replica_offer(json.dumps(good).encode())["files"][0]["rel"] == "model.pt"
    for bad in ({"kind": "file"},  # a file set's one entry has rel ""
                {"files": [{"rel": "x", "size": -1, "mode": 0o644}]},
                {"endpoint": {"host": "a b", "port": 1}}, {"seq": 0}, {"version": 2},
                {"dirs": [{"path": "../d"}]}, {"symlinks": [{"path": "s", "target": ""}]}):
        with pytest.raises(validate.DocumentError):
            validate.replica_offer(json.dumps({**good, **bad}).encode())
    with pytest.raises(validate.DocumentError):
        validate.replica_offer(b"{" * 100_000)
