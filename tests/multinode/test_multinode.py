"""Many nodes, one store: 2-4 "nodes" (separate mounts, separate cache dirs, one moto_server)
write one checkpoint together, and it appears in the store and on every node exactly when all
of it is durable.

  * DCP with gloo ranks, each rank writing through its own node's mount; rank 0's `.metadata`
    rename on node A publishes the set only once node B's shards are durable (B's uploads are
    held back on purpose: until then no node lists it); loads on fresh nodes with another world
    size; B completes the set in place around its own shards without fetching them again.
  * A rank killed mid-save: the set never appears, the previous one is intact.
  * A node's daemon killed after its local writes, before its uploads: the set appears only
    after that node's mount comes back and finishes; or, if it never does, the commit fails at
    --commit-timeout naming the missing files, and the previous checkpoint stays.
  * Per-rank torch.save into a temporary directory on 3 nodes, renamed into place on one node
    (the rename happens on every node), and `ckptfs commit` from another node.
  * Two nodes committing one path at once: the later commit wins, everywhere, never a mix.
  * Nothing on the write path waits for the store: a DCP save whose store PUTs are held
    finishes at once and becomes durable when they go through; a directory renamed into place
    while the other node's part records cannot reach the store waits for that node's
    acknowledgement (cachemgr.tiering.members) and is never published without its file.

Every test checks at the end that no daemon logged an unexpected error.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp
from ckpt_restore import manifests, restore

import ckptfs
from tests.conftest import (
    hold_uploads,
    run_cli,
    wait_for,
)
from tests.multinode_helpers import (
    cluster,
    multinode_state,
    node_id,
    run_ranks,
    set_row,
    start_node,
    status,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning"),
]

__all__ = ["cluster"]  # the fixture (tests/multinode_helpers.py), imported for these tests

MiB = 1 << 20


# ----------------------------------------------------------------------------------------------
# helpers (the cluster and its ranks: tests/multinode_helpers.py)


def settled(*ms) -> bool:
    """No uploads queued or running and no set pending on any of the nodes."""
    for m in ms:
        t = status(m)
        if t["uploads"]["queued"] or t["uploads"]["running"] or t["pending_sets"]:
            return False
    return True


def manifest(view, path: str) -> dict | None:
    return manifests(view).get(path)


def previous_intact_on_a_fresh_node(cluster, seed: int) -> None:
    """A fresh node shows ckpt/step_1 and not ckpt/step_2, and step_1 loads bit-exactly."""
    c = cluster("c")
    wait_for(lambda: (c.path / "ckpt" / "step_1" / ".metadata").exists(), timeout=30,
             what="step_1 on a fresh node")
    assert not (c.path / "ckpt" / "step_2").exists()
    assert run_ranks(cluster.tmp, [str(c.path / "ckpt" / "step_1")], seed=seed,
                     mode="load") == [0]


# ----------------------------------------------------------------------------------------------
# 1. DCP across nodes


def test_dcp_on_two_nodes_publishes_only_when_every_shard_is_durable(cluster):
    gate = cluster.tmp / "b-uploads-held"
    a = cluster("a")
    b = cluster("b", env=hold_uploads(gate))
    ckpts = [str(a.path / "ckpt" / "step_1")] * 2 + [str(b.path / "ckpt" / "step_1")] * 2
    (a.path / "ckpt").mkdir()
    (b.path / "ckpt").mkdir()

    assert run_ranks(cluster.tmp, ckpts, seed=1) == [0, 0, 0, 0]
    # Ranks 0 and 1 wrote through A (rank 0 also .metadata), 2 and 3 through B.
    assert sorted(os.listdir(a.path / "ckpt" / "step_1")) == [".metadata", "__0_0.distcp",
                                                              "__1_0.distcp"]
    assert sorted(os.listdir(b.path / "ckpt" / "step_1")) == ["__2_0.distcp", "__3_0.distcp"]

    # B's shards are not durable yet: A's commit waits for exactly them, and says so.
    row = wait_for(lambda: (r := set_row(a, "ckpt/step_1")) and r.get("waiting_for") and r,
                   timeout=30, what="A's commit to wait for B's shards")
    assert row["state"] in ("committed", "uploading")
    assert row["waiting_for"]["files"] == ["__2_0.distcp", "__3_0.distcp"]
    out = run_cli("status", str(a.path)).stdout
    assert "waiting" in out and "__2_0.distcp" in out, out
    with pytest.raises(ckptfs.NotDurable):
        ckptfs.wait_durable(a.path / "ckpt" / "step_1", timeout=2)
    # No node lists it: not in the store, not on a fresh node.
    assert "ckpt/step_1" not in manifests(cluster.view)
    c = cluster("c")
    assert not (c.path / "ckpt" / "step_1").exists()
    # Each node announced its files in a part record (written in the background after the
    # closes); B's shards are there, pending. A DCP commit needs no acknowledgements.
    want = sorted(f"parts/ckpt/step_1/@{node_id(n)}.json" for n in (a, b))
    wait_for(lambda: sorted(cluster.view.keys("parts/ckpt/step_1/")) == want, timeout=30,
             what="both nodes' part records")
    assert not cluster.view.keys("intents/")
    rec = json.loads(cluster.view.get(f"parts/ckpt/step_1/@{node_id(b)}.json"))
    assert [(f["name"], f["object"]) for f in rec["files"]] == [("__2_0.distcp", None),
                                                                ("__3_0.distcp", None)]

    gate.unlink()  # B's uploads go through
    ckptfs.wait_durable(a.path / "ckpt" / "step_1", timeout=120)
    m = manifest(cluster.view, "ckpt/step_1")
    assert m is not None
    assert sorted(f["path"] for f in m["files"]) == [".metadata", "__0_0.distcp",
                                                     "__1_0.distcp", "__2_0.distcp",
                                                     "__3_0.distcp"]
    assert m["commit"]["nodes"] == sorted([node_id(a), node_id(b)])
    by_node = {f["path"]: f["object"]["key"].split("/")[1] for f in m["files"]}
    assert by_node["__2_0.distcp"] == by_node["__3_0.distcp"] == node_id(b)
    assert by_node["__0_0.distcp"] == by_node[".metadata"] == node_id(a)
    # Every byte in the store equals what the ranks wrote on their nodes.
    data = restore(cluster.view, m)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        assert data[name] == (a.path / "ckpt" / "step_1" / name).read_bytes()
    for name in ("__2_0.distcp", "__3_0.distcp"):
        assert data[name] == (b.path / "ckpt" / "step_1" / name).read_bytes()

    # B completes the set in place around its own shards (no GET of them).
    wait_for(lambda: (b.path / "ckpt" / "step_1" / ".metadata").exists(), timeout=30,
             what="the committed set on B")
    assert sorted(os.listdir(b.path / "ckpt" / "step_1")) == sorted(f["path"] for f in
                                                                     m["files"])
    assert status(b)["remote"]["adopted_files"] == 2
    # On B the set is now one it restored: durable (a rank there can wait on it too).
    assert ckptfs.wait_durable(b.path / "ckpt" / "step_1", timeout=10)["state"] == "durable"
    # Loads on two fresh nodes with world size 2 (saved with 4), and on B with world size 1.
    d = cluster("d")
    for n in (c, d):
        wait_for(lambda n=n: (n.path / "ckpt" / "step_1" / ".metadata").exists(), timeout=30,
                 what=f"the set on {n.mountpoint.name}")
    assert run_ranks(cluster.tmp, [str(c.path / "ckpt" / "step_1"),
                                   str(d.path / "ckpt" / "step_1")], seed=1,
                     mode="load") == [0, 0]
    full = multinode_state(1)
    target = {k: torch.zeros_like(v) for k, v in full.items()} | {"meta": {"step": -1}}
    dcp.load(target, checkpoint_id=str(b.path / "ckpt" / "step_1"))
    for k, v in full.items():
        assert torch.equal(target[k], v), k
    assert target["meta"] == {"step": 1}
    # B fetched only A's files (its own shards were adopted, never downloaded).
    a_bytes = sum(f["size"] for f in m["files"] if by_node[f["path"]] == node_id(a))
    fetched_b = status(b)["restore"]["bytes_fetched"]
    assert 0 < fetched_b <= a_bytes


def test_rank_killed_mid_save_never_appears_and_the_previous_checkpoint_stays(cluster):
    a = cluster("a")
    b = cluster("b")
    (a.path / "ckpt").mkdir()
    (b.path / "ckpt").mkdir()
    first = [str(a.path / "ckpt" / "step_1"), str(b.path / "ckpt" / "step_1")]
    assert run_ranks(cluster.tmp, first, seed=1) == [0, 0]
    ckptfs.wait_durable(a.path / "ckpt" / "step_1", timeout=120)
    before = manifest(cluster.view, "ckpt/step_1")

    second = [str(a.path / "ckpt" / "step_2"), str(b.path / "ckpt" / "step_2")]
    codes = run_ranks(cluster.tmp, second, seed=2, kill_rank=1, big=True, timeout=120)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0, codes
    assert not (a.path / "ckpt" / "step_2" / ".metadata").exists()
    # Everything either node had to upload is uploaded; still no step_2 anywhere.
    wait_for(lambda: settled(a, b), timeout=60, what="both nodes to settle")
    assert "ckpt/step_2" not in manifests(cluster.view)
    assert manifest(cluster.view, "ckpt/step_1") == before
    assert all(s["path"] != "ckpt/step_2" for s in status(a)["sets"])
    previous_intact_on_a_fresh_node(cluster, seed=1)


# ----------------------------------------------------------------------------------------------
# 2. a node's daemon dies between its local writes and its uploads


def test_node_daemon_killed_before_upload_set_appears_after_it_returns(cluster):
    gate = cluster.tmp / "b-uploads-held"
    a = cluster("a")
    b = cluster("b", env=hold_uploads(gate))
    (a.path / "ckpt").mkdir()
    (b.path / "ckpt").mkdir()
    ckpts = [str(a.path / "ckpt" / "step_1"), str(b.path / "ckpt" / "step_1")]
    assert run_ranks(cluster.tmp, ckpts, seed=3) == [0, 0]
    wait_for(lambda: (r := set_row(a, "ckpt/step_1")) and r.get("waiting_for"), timeout=30,
             what="A waiting for B's shard")
    b.kill9()  # its shard is in B's cache only
    # The committing node restarts too while it waits: the wait is resumed from the index.
    a.kill9()
    start_node(a)
    # A keeps waiting across several listings of the store (its own count), nothing published
    wait_for(lambda: status(a)["remote"]["syncs"] >= 3 and (r := set_row(a, "ckpt/step_1"))
             and r.get("waiting_for") and r["waiting_for"]["waited_s"] >= 3, timeout=60,
             what="A, restarted, to list the store three times while it waits")
    assert "ckpt/step_1" not in manifests(cluster.view)
    row = wait_for(lambda: (r := set_row(a, "ckpt/step_1")) and r.get("waiting_for") and r,
                   timeout=30, what="A, restarted, to wait again")
    assert row["state"] in ("committed", "uploading")
    assert row["waiting_for"]["files"] == ["__1_0.distcp"]
    assert row["waiting_for"]["waited_s"] >= 3

    gate.unlink()
    start_node(b)  # the same cache dir, no faults: B recovers and uploads its closed shard
    ckptfs.wait_durable(a.path / "ckpt" / "step_1", timeout=120)
    m = manifest(cluster.view, "ckpt/step_1")
    assert sorted(f["path"] for f in m["files"]) == [".metadata", "__0_0.distcp",
                                                     "__1_0.distcp"]
    c = cluster("c")
    wait_for(lambda: (c.path / "ckpt" / "step_1" / ".metadata").exists(), timeout=30,
             what="the set on a fresh node")
    assert run_ranks(cluster.tmp, [str(c.path / "ckpt" / "step_1")], seed=3,
                     mode="load") == [0]


def test_commit_fails_at_the_timeout_when_a_node_never_returns(cluster):
    a = cluster("a", "--commit-timeout", "6")
    gate = cluster.tmp / "b-uploads-held"
    b = cluster("b", env=hold_uploads(gate))
    (a.path / "ckpt").mkdir()
    (b.path / "ckpt").mkdir()
    # A previous checkpoint, written by A alone.
    assert run_ranks(cluster.tmp, [str(a.path / "ckpt" / "step_1")], seed=4) == [0]
    ckptfs.wait_durable(a.path / "ckpt" / "step_1", timeout=60)
    ckpts = [str(a.path / "ckpt" / "step_2"), str(b.path / "ckpt" / "step_2")]
    assert run_ranks(cluster.tmp, ckpts, seed=5) == [0, 0]
    b.kill9()
    wait_for(lambda: set_row(a, "ckpt/step_2")["state"] == "failed", timeout=30,
             what="the commit to time out")
    row = set_row(a, "ckpt/step_2")
    assert "timed out" in row["error"] and "__1_0.distcp" in row["error"], row
    out = run_cli("wait", str(a.path / "ckpt" / "step_2"), "--timeout", "5")
    assert out.returncode != 0 and "timed out" in (out.stderr + out.stdout)
    assert "ckpt/step_2" not in manifests(cluster.view)
    previous_intact_on_a_fresh_node(cluster, seed=4)
    gate.unlink()


# ----------------------------------------------------------------------------------------------
# 3. torch.save per rank on 3 nodes


def rank_file(m, rel: str, rank: int) -> bytes:
    obj = {"rank": rank, "w": torch.randn(256, 1024, generator=torch.Generator().manual_seed(rank))}
    p = m.path / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, p)
    return p.read_bytes()


def test_torch_save_per_rank_on_three_nodes_renamed_into_place_on_one(cluster):
    a, b, c = cluster("a"), cluster("b"), cluster("c")
    written = {}
    for r, m in enumerate((a, a, b, c)):
        written[f"rank{r}.pt"] = rank_file(m, f"run/step_5.tmp/rank{r}.pt", r)
    # (a barrier, then) rank 0 renames its node's directory into place.
    os.rename(a.path / "run" / "step_5.tmp", a.path / "run" / "step_5")
    ckptfs.wait_durable(a.path / "run" / "step_5", timeout=120)
    m = manifest(cluster.view, "run/step_5")
    assert sorted(f["path"] for f in m["files"]) == sorted(written)
    assert restore(cluster.view, m) == written
    assert m["commit"]["nodes"] == sorted(node_id(x) for x in (a, b, c))
    # On B and C the rename happens too: their rank files move into run/step_5, their
    # step_5.tmp goes, and they read every rank's file.
    for n in (b, c):
        wait_for(lambda n=n: sorted(os.listdir(n.path / "run")) == ["step_5"], timeout=30,
                 what=f"run/step_5 alone on {n.mountpoint.name}")
        for name, data in written.items():
            assert (n.path / "run" / "step_5" / name).read_bytes() == data
        assert status(n)["remote"]["adopted_files"] == 1

    # Rotation on A: the set leaves the store and every node; B and C drop their records and
    # their objects (nothing of it is left in the store).
    keys = {f["object"]["key"] for f in m["files"]}
    shutil.rmtree(a.path / "run" / "step_5")
    for n in (b, c):
        wait_for(lambda n=n: not (n.path / "run" / "step_5").exists(), timeout=60,
                 what=f"run/step_5 to go from {n.mountpoint.name}")
    wait_for(lambda: not keys & set(cluster.view.keys("data/")), timeout=60,
             what="every node's objects of run/step_5 to be collected")
    wait_for(lambda: not cluster.view.keys("parts/run/step_5"), timeout=60,
             what="the part records of run/step_5 to go")
    assert "run/step_5" not in manifests(cluster.view)

    # `ckptfs commit` from another node (B) of a directory all three wrote into.
    more = {}
    for r, m_ in enumerate((a, b, c)):
        more[f"rank{r}.pt"] = rank_file(m_, f"run/step_6.tmp/rank{r}.pt", 10 + r)
    res = run_cli("commit", str(b.path / "run" / "step_6.tmp"))
    assert res.returncode == 0, res.stderr
    ckptfs.wait_durable(b.path / "run" / "step_6.tmp", timeout=120)
    m6 = manifest(cluster.view, "run/step_6.tmp")
    assert restore(cluster.view, m6) == more


# ----------------------------------------------------------------------------------------------
# 4. two nodes commit the same path


def test_concurrent_commits_of_one_path_the_later_one_wins_everywhere(cluster):
    gate_a = cluster.tmp / "a-held"
    gate_b = cluster.tmp / "b-held"
    a = cluster("a", env=hold_uploads(gate_a))
    b = cluster("b", env=hold_uploads(gate_b))
    mine = {}
    for m, seed in ((a, 1), (b, 2)):
        d = m.path / "run" / "shared.tmp"
        d.mkdir(parents=True)
        mine[m.mountpoint.name] = rank_file(m, "run/shared.tmp/model.pt", seed)
    os.rename(a.path / "run" / "shared.tmp", a.path / "run" / "shared")
    a_ns = set_row(a, "run/shared")["committed_ns"]  # B's commit comes after it on the clock
    wait_for(lambda: time.time_ns() > a_ns, timeout=5, what="the clock to pass A's commit")
    os.rename(b.path / "run" / "shared.tmp", b.path / "run" / "shared")
    ra, rb = set_row(a, "run/shared"), set_row(b, "run/shared")
    assert ra["committed_ns"] < rb["committed_ns"]
    # B's commit is the later one. Let B publish first, then A: A's conditional PUT finds
    # B's manifest, which is later, and A's commit loses; the store keeps B's.
    gate_b.unlink()
    ckptfs.wait_durable(b.path / "run" / "shared", timeout=120)
    gate_a.unlink()
    # A's own commit (by its seq: once it lost, A's next listing adds B's set at the path as
    # a newer row, which may come before this poll).
    def a_commit() -> dict:
        return next(s for s in status(a)["sets"] if s["seq"] == ra["seq"])
    wait_for(lambda: a_commit()["state"] == "superseded", timeout=60,
             what="A's earlier commit to lose")
    assert "later" in a_commit()["error"]
    m = manifest(cluster.view, "run/shared")
    assert m["commit"]["node"] == node_id(b)
    assert restore(cluster.view, m) == {"model.pt": mine["b-mnt"]}
    # A shows the winner after its next listing: never a mix of both.
    wait_for(lambda: (a.path / "run" / "shared" / "model.pt").read_bytes() == mine["b-mnt"],
             timeout=30, what="B's version on A")
    assert sorted(os.listdir(a.path / "run" / "shared")) == ["model.pt"]


# ----------------------------------------------------------------------------------------------
# 5. nothing on the write path waits for the store


def hold_puts(gate: Path, *prefixes: str) -> dict:
    """Daemon environment in which PUTs (and multipart uploads) of keys under `prefixes` wait
    while `gate` exists."""
    gate.touch()
    items = []
    for p in prefixes:
        items.append(f"put@{p}=hold:{gate}")
        if p == "data/":
            items += [f"create_multipart@{p}=hold:{gate}", f"upload_part@{p}=hold:{gate}"]
    return {"CKPTFS_FAULTS": ",".join(items)}


def test_dcp_save_on_one_node_never_waits_for_the_store(cluster):
    gate = cluster.tmp / "puts-held"
    a = cluster("a", env=hold_puts(gate, "parts/", "data/"))
    d = a.path / "ckpt" / "step_1"
    d.mkdir(parents=True)
    # A close in a DCP directory (an open set) whose part record cannot reach the store: it
    # returned before (close used to wait up to 10 s for the record, each close).
    (d / "__9_0.distcp").write_bytes(b"x")  # makes step_1 a DCP directory
    f = open(d / "extra.bin", "wb")  # noqa: SIM115
    f.write(os.urandom(MiB))
    t0 = time.monotonic()
    f.close()
    close_s = time.monotonic() - t0
    os.unlink(d / "__9_0.distcp")
    sd = {"w": torch.randn(512, 512, generator=torch.Generator().manual_seed(7)),
          "extra": {"step": 1}}
    t0 = time.monotonic()
    dcp.save(sd, checkpoint_id=str(d))
    save_s = time.monotonic() - t0
    # The save is done while every record and data PUT is still held, and took nowhere near
    # one close's old wait.
    assert gate.exists()
    assert close_s < 5 and save_s < 10, (close_s, save_s)
    parts = status(a)["parts"]
    assert parts["puts"] == 0 and parts["dirty"] >= 1, parts
    row = set_row(a, "ckpt/step_1")
    assert row["state"] in ("committed", "uploading")
    assert "ckpt/step_1" not in manifests(cluster.view)

    gate.unlink()  # the store answers again: the set becomes durable, its records follow
    assert ckptfs.wait_durable(d, timeout=120)["state"] == "durable"
    m = manifest(cluster.view, "ckpt/step_1")
    assert sorted(f["path"] for f in m["files"]) == sorted(os.listdir(d))
    assert restore(cluster.view, m) == {n: (d / n).read_bytes() for n in os.listdir(d)}
    wait_for(lambda: cluster.view.keys("parts/ckpt/step_1/"), timeout=30,
             what="the record once the store answers")
    # One node alone: no intent, no acknowledgement.
    assert status(a)["members"]["intents_written"] == 0
    assert not cluster.view.keys("intents/") and not cluster.view.keys("acks/")


def test_directory_commit_waits_for_files_another_node_closed_before_it(cluster):
    gate = cluster.tmp / "b-records-held"
    a = cluster("a")
    b = cluster("b", env=hold_puts(gate, "parts/"))
    written = {}
    for r, m in enumerate((a, b)):
        written[f"rank{r}.pt"] = rank_file(m, f"run/step_7.tmp/rank{r}.pt", r)
    # B's close returned though its part record cannot reach the store.
    assert status(b)["parts"]["puts"] == 0
    # (a barrier, then) rank 0 renames its node's directory into place.
    os.rename(a.path / "run" / "step_7.tmp", a.path / "run" / "step_7")
    def not_torn() -> bool:
        m = manifest(cluster.view, "run/step_7")
        assert m is None or sorted(f["path"] for f in m["files"]) == sorted(written), \
            f"TORN: published without B's file: {m['files']}"
        return True

    # A knows nothing of B's file from the store; it asks B, and waits for B's answer, which
    # B can give only once its record is in the store.
    row = wait_for(lambda: not_torn() and (r := set_row(a, "run/step_7")) and
                   (r.get("waiting_for") or {}).get("acks_from") and r,
                   timeout=30, what="A's commit to wait for B's acknowledgement")
    assert row["waiting_for"]["acks_from"] == [node_id(b)]
    assert row["state"] in ("committed", "uploading")
    out = run_cli("status", str(a.path)).stdout
    assert f"acks from nodes {node_id(b)}" in out, out
    # The intent is in the store; A's own file is durable; B's record is still held (B's
    # acknowledgement waits for it), and nothing is published.
    wait_for(lambda: not_torn() and cluster.view.keys("intents/") and
             status(a)["uploads"]["done"] >= 1, timeout=30, what="A's upload and its intent")
    assert "run/step_7" not in manifests(cluster.view)
    assert not [k for k in cluster.view.keys("parts/run/") if node_id(b) in k]
    assert not cluster.view.keys("acks/")

    gate.unlink()
    ckptfs.wait_durable(a.path / "run" / "step_7", timeout=120)
    m = manifest(cluster.view, "run/step_7")
    assert sorted(f["path"] for f in m["files"]) == sorted(written)
    assert restore(cluster.view, m) == written
    assert m["commit"]["nodes"] == sorted(node_id(x) for x in (a, b))
    assert status(b)["members"]["acks_sent"] == 1
    # The intent and its acknowledgement are gone with the wait.
    wait_for(lambda: not cluster.view.keys("intents/") and not cluster.view.keys("acks/"),
             timeout=30, what="the intent and the acks to go")


def test_a_node_cut_off_past_its_lease_acts_again_only_under_a_new_generation(cluster):
    """The fence (cachemgr.tiering.lease.Lease). In the middle of a multi-node commit, node B's
    acknowledgement is on its way when B is cut off from the store past its lease. When B gets
    through again it registers under a new generation before anything else; its old
    acknowledgement, landing after that, is ignored by the committer; B acknowledges again under
    the new generation, and only then is the set published, whole. Gates order every step."""
    gates = {k: cluster.tmp / f"b-{k}-held" for k in ("acks", "renewals", "intents")}
    a = cluster("a", "--lease", "4")
    b = cluster("b", "--lease", "4", env={"CKPTFS_FAULTS": ",".join((
        f"put@acks/=hold:{gates['acks']}", f"put@members/=hold:{gates['renewals']}",
        f"list@intents/=hold:{gates['intents']}"))})
    b_id = node_id(b)
    written = {}
    for r, m in enumerate((a, b)):
        written[f"rank{r}.pt"] = rank_file(m, f"run/step_9.tmp/rank{r}.pt", r)
    wait_for(lambda: any(f"@{b_id}" in k for k in cluster.view.keys("parts/run/step_9.tmp/")),
             timeout=30, what="B's part record")
    gen1 = status(b)["members"]["generation"]
    assert gen1 > 0 and status(b)["members"]["lease_held"]

    # 1. A commits while B's lease runs: A asks B; B's acknowledgement is held on its way.
    gates["acks"].touch()
    os.rename(a.path / "run" / "step_9.tmp", a.path / "run" / "step_9")
    wait_for(lambda: "holding put acks/" in b.log_text(), timeout=30,
             what="B's acknowledgement to be on its way")
    # 2. B is cut off (its renewals held) until its own clock says its lease ran out.
    gates["renewals"].touch()
    wait_for(lambda: not status(b)["members"]["lease_held"], timeout=30,
             what="B's lease to run out")
    out = run_cli("status", str(b.path)).stdout
    assert "lease of 4s ran out" in out, out
    # 3. B gets through: the renewal that was held answers after the lease ran out, so B
    #    registers again under a new generation, before it acknowledges anything.
    gates["intents"].touch()  # (B's next look at the intents waits: step 5 decides when)
    gates["renewals"].unlink()
    wait_for(lambda: status(b)["members"]["lease_lapses"] == 1, timeout=30,
             what="B to register under a new generation")
    mem = status(b)["members"]
    assert mem["generation"] > gen1 and mem["lease_held"] and mem["acks_sent"] == 0
    member = json.loads(cluster.view.get(f"members/@{b_id}.json"))
    assert member["generation"] == mem["generation"]
    # 4. B's old acknowledgement lands now: A ignores it and goes on waiting for B.
    gates["acks"].unlink()
    wait_for(lambda: status(a)["members"]["acks_ignored"] == 1, timeout=60,
             what="A to ignore B's acknowledgement from the old generation")
    row = set_row(a, "run/step_9")
    assert row["waiting_for"]["acks_from"] == [b_id], row
    assert "run/step_9" not in manifests(cluster.view)
    # 5. B looks at the intents again and acknowledges under its new generation: the set is
    #    published, whole, with B's record written again under the new generation.
    gates["intents"].unlink()
    ckptfs.wait_durable(a.path / "run" / "step_9", timeout=120)
    m = manifest(cluster.view, "run/step_9")
    assert sorted(f["path"] for f in m["files"]) == sorted(written)
    assert restore(cluster.view, m) == written
    assert status(b)["members"]["acks_sent"] == 1
    assert status(a)["members"]["acks_ignored"] == 1
    assert "registered again as generation" in b.log_text()
    for key in cluster.view.keys("parts/"):
        # (a record is deleted once B has no file left in its directory: gone since the
        # listing, it holds no generation at all)
        if f"@{b_id}" in key and (raw := cluster.view.get(key)) is not None:
            assert json.loads(raw)["generation"] == mem["generation"], key


def test_directory_commit_waits_for_a_node_that_died_before_its_record(cluster):
    gate = cluster.tmp / "b-records-held"
    a = cluster("a")
    b = cluster("b", env=hold_puts(gate, "parts/"))
    written = {}
    for r, m in enumerate((a, b)):
        written[f"rank{r}.pt"] = rank_file(m, f"run/step_8.tmp/rank{r}.pt", r)
    b_id = node_id(b)
    b.kill9()  # between its close and that close's record: the record never got out
    gate.unlink()
    os.rename(a.path / "run" / "step_8.tmp", a.path / "run" / "step_8")
    # B's lease still runs: A asks it, and waits for it (B may hold files A cannot know of).
    row = wait_for(lambda: (r := set_row(a, "run/step_8")) and
                   (r.get("waiting_for") or {}).get("acks_from") and r,
                   timeout=30, what="A's commit to wait for the dead node's acknowledgement")
    assert row["waiting_for"]["acks_from"] == [b_id]
    wait_for(lambda: status(a)["uploads"]["done"] >= 1, timeout=30, what="A's own upload")
    assert "run/step_8" not in manifests(cluster.view)
    # B comes back on the same cache dir: it registers again, answers from its index (its
    # record is written then) and uploads its file; the set is published whole.
    start_node(b)
    ckptfs.wait_durable(a.path / "run" / "step_8", timeout=120)
    m = manifest(cluster.view, "run/step_8")
    assert restore(cluster.view, m) == written
    assert m["commit"]["nodes"] == sorted([node_id(a), b_id])
