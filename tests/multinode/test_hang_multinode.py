"""A store that hangs is a store that failed (docs/ARCHITECTURE.md "Store deadlines",
docs/SEMANTICS.md "A store that does not answer"), with several nodes (the store layer's side:
tests/unit/test_hang.py):

  * a fresh node during a black-hole outage mounts and reads a lost node's sets from its buddy.
"""

from __future__ import annotations

import time

from tests.conftest import run_cli
from tests.faultproxy import Rule
from tests.replicas_helpers import cluster  # noqa: F401 - the fixture

# ----------------------------------------------------------------------------------------------
# a fresh node during a black-hole outage reads a lost node's sets from its buddy


def test_a_fresh_node_mounts_and_reads_from_the_buddy_while_the_store_is_a_black_hole(
        cluster):  # noqa: F811 - the fixture of tests/replicas_helpers.py, imported above
    """test_replicas' refusal version with a store that takes every request and answers none:
    A commits a torch.save checkpoint, replicated on B; A's daemon is killed and its cache dir
    deleted. A fresh node C (--peers --peer-seeds B --allow-empty-namespace) mounts within
    60 s (its probe LIST gives up at 15 s, its first listing fails at its deadlines while it
    registers) and loads the checkpoint bit-exact from B's replica, the store untouched.
    Measured on the loaded 2-core dev machine (printed, -s): mount of C 46-47 s (probe 15 s,
    then the first listing's 30 s beside the 20 s registration), the read 0.0-0.1 s (10 s
    before the peer client used the peers the namespace answers named at once while the
    store's listings fail)."""
    import shutil

    import torch

    import ckptfs
    from tests.replicas_helpers import knows_buddy, peer_endpoint

    a = cluster("a", "--lease", "4", proxied=True)
    b = cluster("b", "--lease", "4", proxied=True)
    knows_buddy(a, b)
    cluster.proxy.set_rules([Rule("blackhole")])  # until clear(): the store answers nothing
    g = torch.Generator().manual_seed(7)
    model = {"w": torch.randn(1_500_000, generator=g)}  # > one 4 MiB chunk: two chunks
    torch.save(model, a.path / "ckpt.pt")
    wrote = (a.path / "ckpt.pt").read_bytes()
    res = run_cli("wait", "--replicated", str(a.path / "ckpt.pt"), "--timeout", "60")
    assert res.returncode == 0, res.stderr
    assert cluster.proxy.hung() >= 1
    a.kill9()
    shutil.rmtree(a.cache_dir)

    t0 = time.monotonic()
    c = cluster("c", "--peer-seeds", peer_endpoint(b), "--allow-empty-namespace",
                proxied=True)
    took = time.monotonic() - t0
    print(f"black hole: a fresh node mounted in {took:.1f} s")
    assert took < 60, took
    rows = {s["path"]: s for s in ckptfs.status(c.path)["tiering"]["sets"]}
    assert rows["ckpt.pt"]["state"] == "replicated", rows
    t0 = time.monotonic()
    assert (c.path / "ckpt.pt").read_bytes() == wrote
    print(f"black hole: read from the buddy in {time.monotonic() - t0:.1f} s")
    assert torch.equal(torch.load(c.path / "ckpt.pt")["w"], model["w"])
    peers = ckptfs.status(c.path)["tiering"]["peers"]
    assert peers["restored_from_peers"]["bytes"] >= len(wrote), peers
    assert peers["restored_from_store"]["bytes"] == 0, peers
    cluster.proxy.clear()
