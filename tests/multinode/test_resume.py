"""What a resuming job sees (docs/SEMANTICS.md "What a resuming job sees"), tested from the
reader's side, at the moment it looks:

  * a fresh mount shows every set the store lists the instant `ckptfs mount` returns (the
    first listing is applied before the mount reports ready), and a store that cannot be
    listed fails the mount with exit 7 unless --allow-empty-namespace;
  * later listings never show a `latest` link before the checkpoint it names;
  * the store never shows a set before one committed earlier on the same node (a `latest`
    published before its checkpoint would dangle if the node died);
  * the node that committed a multi-node checkpoint shows and loads every node's files;
  * a restore fill in flight never overwrites what a truncating open wrote, nor does the
    repair of a damaged cache chunk (gated worker threads, no sleeps);
  * a restore on a cache disk smaller than the checkpoint never kills the daemon: the
    prefetch stops with its reason in status, reads are served from the store.

Store-side gates: CKPTFS_FAULTS `get@<prefix>=hold:<gate>` holds the daemon's GETs of those keys
while the gate file exists; CKPTFS_TEST_HOLD_FILL=<gate> holds restore's cache-file writes
(cachemgr.core.filecache). Every test checks that no daemon logged an unexpected error.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp

import ckptfs
from tests.conftest import ckptfs_cmd, is_mounted, run_cli, wait_for
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

__all__ = ["cluster"]  # the fixture, imported for these tests

MiB = 1 << 20


def _env(**kw: str) -> dict:
    env = dict(os.environ)
    env.update(kw)
    return env


def _save_steps(root: Path, steps: range) -> dict[str, bytes]:
    """torch.save checkpoints the careful way (tmp + rename) and a `latest` symlink replaced
    atomically; returns {name: bytes}."""
    out = {}
    for step in steps:
        name = f"step_{step}.pt"
        torch.save({"step": step, "w": torch.full((256,), float(step))}, root / (name + ".tmp"))
        os.rename(root / (name + ".tmp"), root / name)
        tmp = root / "latest.tmp"
        os.symlink(name, tmp)
        os.rename(tmp, root / "latest")
        out[name] = (root / name).read_bytes()
    return out


def _pid(out: str) -> int:
    m = re.search(r"pid (\d+)", out)
    assert m, out
    return int(m.group(1))


def _check_log(m) -> None:
    errors = m.unexpected_errors()
    assert not errors, f"daemon {m.mountpoint.name} logged unexpected errors:\n" + \
        "\n".join(errors)


# ----------------------------------------------------------------------------------------------
# 1. the namespace the moment mount returns


def test_fresh_mount_shows_every_set_the_moment_mount_returns(cluster):
    a = cluster("a")
    saved = _save_steps(a.path, range(1, 7))
    a.stop()  # waits until every set is durable
    want = sorted([*saved, "latest"])

    for i in range(3):
        gate = cluster.tmp / f"manifest-gets-held-{i}"
        gate.touch()
        b = cluster(f"b{i}", start=False)
        proc = subprocess.Popen(
            ckptfs_cmd("mount", str(b.mountpoint), "--cache-dir", str(b.cache_dir),
                       "--log-file", str(b.log_file), *b.args),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_env(CKPTFS_FAULTS=f"get@manifests/=hold:{gate}"))
        try:
            # The daemon's first listing is held at its manifest GETs (or mount returned).
            wait_for(lambda b=b, proc=proc: proc.poll() is not None or
                     "holding get manifests/" in b.log_text(),
                     timeout=60, what="the first listing to reach the held GETs")
            if proc.poll() is None:
                gate.unlink()  # the mount is still waiting for its first listing: let it go
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            # The instant mount returned: every set, and `latest` resolves.
            names = sorted(os.listdir(b.mountpoint))
            assert names == want, f"mount {i} returned showing {names}"
            assert os.readlink(b.mountpoint / "latest") == "step_6.pt"
            assert (b.mountpoint / "latest").read_bytes() == saved["step_6.pt"]
        finally:
            gate.unlink(missing_ok=True)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        b.pid = _pid(out)
        b.stop()
        _check_log(b)


def test_every_save_of_one_path_is_durable_and_a_fresh_node_shows_the_newest(cluster):
    """On a real S3 server (RGW 16.2, which refuses If-Match with the quoted ETag) every second
    save of a path failed to publish while status said nothing was at risk (docs/STORES.md).
    Three saves of model.pt (tmp + rename) with `latest` moved each time: each is durable, no
    set fails, and a node mounted afterwards shows the newest, bit-exact."""
    a = cluster("a")
    for step in (1, 2, 3):
        torch.save({"step": step, "w": torch.full((4096,), float(step))},
                   a.path / "model.pt.tmp")
        os.rename(a.path / "model.pt.tmp", a.path / "model.pt")
        tmp = a.path / "latest.tmp"
        os.symlink(f"step_{step}", tmp)
        os.rename(tmp, a.path / "latest")
        for p in ("model.pt", "latest"):
            assert ckptfs.wait_durable(a.path / p, timeout=120)["state"] == "durable"
        t = status(a)
        assert t["failed_sets"] == 0, t["failed"]
        assert t["store"]["conditional_writes"]["honoured"], t["store"]
        assert set_row(a, "model.pt")["state"] == "durable"
    want = (a.path / "model.pt").read_bytes()
    b = cluster("b")
    assert sorted(os.listdir(b.path)) == ["latest", "model.pt"]
    assert os.readlink(b.path / "latest") == "step_3"
    assert (b.path / "model.pt").read_bytes() == want
    assert torch.load(b.path / "model.pt")["step"] == 3
    b.stop()
    a.stop()


def test_store_that_cannot_be_listed_fails_the_mount_unless_allowed(cluster):
    a = cluster("a")
    _save_steps(a.path, range(1, 3))
    a.stop()
    b = cluster("b", start=False)
    args = ["mount", str(b.mountpoint), "--cache-dir", str(b.cache_dir), "--log-file",
            str(b.log_file), *b.args]
    faults = _env(CKPTFS_FAULTS="list=next:1000")  # every LIST fails (after retries)
    res = subprocess.run(ckptfs_cmd(*args), capture_output=True, text=True, env=faults,
                         timeout=120, check=False)
    assert res.returncode == 7, res
    assert res.stderr.startswith("ckptfs: cannot list the sets in store"), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    wait_for(lambda: not is_mounted(b.mountpoint), timeout=30, what="the failed mount to go")
    # Opted in: mounted, showing only this (empty) cache; the sets come with a later listing.
    res = subprocess.run(ckptfs_cmd(*args, "--allow-empty-namespace"), capture_output=True,
                         text=True, env=_env(CKPTFS_FAULTS="list=next:16"), timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr
    b.pid = _pid(res.stdout)
    wait_for(lambda: (b.mountpoint / "latest").exists(), timeout=60,
             what="the sets after a later listing")
    assert sorted(os.listdir(b.mountpoint)) == ["latest", "step_1.pt", "step_2.pt"]
    b.stop()
    assert "--allow-empty-namespace" in b.log_text()


def test_a_listing_never_shows_latest_before_its_target(cluster):
    a = cluster("a")
    saved = _save_steps(a.path, range(1, 3))
    ckptfs.wait_durable(a.path / "latest", timeout=120)
    gate = cluster.tmp / "step3-get-held"
    gate.touch()
    b = cluster("b", "--attr-timeout", "0",
                env={"CKPTFS_FAULTS": f"get@manifests/step_3=hold:{gate}"})
    assert os.readlink(b.path / "latest") == "step_2.pt"
    saved |= _save_steps(a.path, range(3, 4))
    ckptfs.wait_durable(a.path / "latest", timeout=120)
    ckptfs.wait_durable(a.path / "step_3.pt", timeout=120)
    # B's listing now holds the new `latest` and step_3.pt; step_3's GET is held.
    wait_for(lambda: "holding get manifests/step_3" in b.log_text(), timeout=60,
             what="B's listing to reach step_3.pt")
    target = os.readlink(b.path / "latest")
    assert (b.path / target).exists(), f"latest -> {target}, which B does not show"
    assert target == "step_2.pt"
    gate.unlink()
    wait_for(lambda: os.readlink(b.path / "latest") == "step_3.pt", timeout=60,
             what="the new latest on B")
    assert (b.path / "latest").read_bytes() == saved["step_3.pt"]
    for m in (a, b):
        _check_log(m)


# ----------------------------------------------------------------------------------------------
# 2. publication order in the store


def test_latest_is_published_only_after_the_checkpoint_it_names(cluster):
    gate = cluster.tmp / "a-uploads-held"
    gate.touch()
    a = cluster("a", env={"CKPTFS_FAULTS": f"put@data/=hold:{gate},"
                                           f"create_multipart@data/=hold:{gate},"
                                           f"upload_part@data/=hold:{gate}"})
    _save_steps(a.path, range(1, 2))
    # step_1.pt waits for its upload; `latest` (nothing to upload) waits for step_1.pt.
    row = wait_for(lambda: (r := set_row(a, "latest")) and r.get("after_set") and r,
                   timeout=30, what="latest to be held behind step_1.pt")
    assert row["state"] == "committed"
    assert set_row(a, "step_1.pt")["seq"] <= row["after_set"]
    assert cluster.view.keys("manifests/") == []
    gate.unlink()
    ckptfs.wait_durable(a.path / "latest", timeout=120)
    assert sorted(cluster.view.keys("manifests/")) == ["manifests/latest.json",
                                                       "manifests/step_1.pt.json"]
    s = {r["path"]: r for r in status(a)["sets"]}
    assert s["step_1.pt"]["durable_ns"] <= s["latest"]["durable_ns"]
    _check_log(a)


# ----------------------------------------------------------------------------------------------
# 3. the node that committed a multi-node set


def test_committing_node_shows_and_loads_every_nodes_files(cluster):
    a = cluster("a")
    b = cluster("b")
    (a.path / "ckpt").mkdir()
    (b.path / "ckpt").mkdir()
    ckpts = [str(a.path / "ckpt" / "step_1")] * 2 + [str(b.path / "ckpt" / "step_1")] * 2
    assert run_ranks(cluster.tmp, ckpts, seed=5) == [0, 0, 0, 0]
    ckptfs.wait_durable(a.path / "ckpt" / "step_1", timeout=120)
    want = [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    assert sorted(os.listdir(a.path / "ckpt" / "step_1")) == want
    # Every rank reads other ranks' files (replicated items live in one rank's file): load
    # through the committing node only, at world size 2 and 1.
    assert run_ranks(cluster.tmp, [str(a.path / "ckpt" / "step_1")] * 2, seed=5,
                     mode="load") == [0, 0]
    full = multinode_state(5)
    target = {k: torch.zeros_like(v) for k, v in full.items()} | {"meta": {"step": -1}}
    dcp.load(target, checkpoint_id=str(a.path / "ckpt" / "step_1"))
    for k, v in full.items():
        assert torch.equal(target[k], v), k
    # B's shards came from the store on A; A's own were never fetched.
    assert status(a)["restore"]["bytes_fetched"] > 0
    # Also after a remount of the committing node.
    a.stop()
    start_node(a)
    assert sorted(os.listdir(a.path / "ckpt" / "step_1")) == want
    assert a.path.joinpath("ckpt", "step_1", "__3_0.distcp").read_bytes() == \
        b.path.joinpath("ckpt", "step_1", "__3_0.distcp").read_bytes()
    assert node_id(a) != node_id(b)
    for m in (a, b):
        _check_log(m)


def test_committing_node_shows_other_nodes_torch_save_files_after_a_rename(cluster):
    a = cluster("a")
    b = cluster("b")
    for m in (a, b):
        (m.path / "step_1.tmp").mkdir()
    torch.save({"rank": 0}, a.path / "step_1.tmp" / "rank_0.pt")
    torch.save({"rank": 1}, b.path / "step_1.tmp" / "rank_1.pt")
    os.rename(a.path / "step_1.tmp", a.path / "step_1")
    ckptfs.wait_durable(a.path / "step_1", timeout=120)
    assert sorted(os.listdir(a.path / "step_1")) == ["rank_0.pt", "rank_1.pt"]
    assert torch.load(a.path / "step_1" / "rank_1.pt") == {"rank": 1}
    for m in (a, b):
        _check_log(m)


# ----------------------------------------------------------------------------------------------
# 4. restore fills vs. the trainer's writes (gated worker threads)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _rewrite_while_fill_is_held(b, gate: Path, rel: str, new: bytes) -> None:
    """With a fill of `rel` held in its worker thread (gate), open(O_TRUNC) + write + close the
    file through the mount, then release the fill; the new bytes must win."""
    held = Path(str(gate) + ".held")
    wait_for(held.exists, timeout=60, what="a restore fill to be held")
    done = threading.Event()
    err: list[BaseException] = []

    def writer():
        try:
            with open(b.path / rel, "wb") as f:  # O_WRONLY|O_CREAT|O_TRUNC
                f.write(new)
        except BaseException as e:  # noqa: BLE001  (handed to the test thread, which fails)
            err.append(e)
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    # The writer either finished (it did not wait for the fill: the old bug) or waits for the
    # file's lock while the fill is in flight.
    wait_for(lambda: done.is_set() or
             ckptfs.status(b.path)["tiering"]["filecache"]["waiting"] > 0,
             timeout=30, what="the truncating open to finish or to wait for the fill")
    gate.unlink()
    t.join(60)
    assert not t.is_alive() and not err, err
    ckptfs.wait_durable(b.path / rel, timeout=120)
    assert (b.path / rel).read_bytes() == new, "old bytes came back after the rewrite"


def test_restore_fill_never_overwrites_a_truncating_rewrite(cluster):
    a = cluster("a")
    old = os.urandom(6 * MiB)
    (a.path / "w.bin").write_bytes(old)
    ckptfs.wait_durable(a.path / "w.bin", timeout=120)
    gate = cluster.tmp / "fill-held"
    gate.touch()
    b = cluster("b", "--no-prefetch", env={"CKPTFS_TEST_HOLD_FILL": str(gate)})
    reader = threading.Thread(target=lambda: _try_read(b.path / "w.bin"))
    reader.start()  # its read fetches chunk 0 and is held writing it
    new = os.urandom(1 * MiB)
    _rewrite_while_fill_is_held(b, gate, "w.bin", new)
    reader.join(60)
    assert status(b)["filecache"]["fills_skipped"] + status(b)["filecache"]["fills"] >= 1
    b.stop()
    start_node(b)
    assert (b.path / "w.bin").read_bytes() == new
    for m in (a, b):
        _check_log(m)


def _try_read(p: Path) -> None:
    try:
        with open(p, "rb") as f:
            f.read(4096)
    except OSError:
        pass  # the file may be rewritten under the reader: what it reads is not the point


def test_repair_of_a_damaged_chunk_never_overwrites_a_rewrite(cluster):
    a = cluster("a")
    old = os.urandom(6 * MiB)
    (a.path / "w.bin").write_bytes(old)
    ckptfs.wait_durable(a.path / "w.bin", timeout=120)
    a.stop()
    # Damage chunk 0 of the cache file at rest, then restart with fills held.
    ino = _cache_ino(a, "w.bin")
    with open(a.cache_dir / "data" / str(ino), "r+b") as f:
        f.write(b"\0" * 4096)
    gate = cluster.tmp / "repair-held"
    gate.touch()
    start_node(a, env={"CKPTFS_TEST_HOLD_FILL": str(gate)})
    reader = threading.Thread(target=lambda: _try_read(a.path / "w.bin"))
    reader.start()  # first read checks chunk 0, finds it damaged, fetches it, held writing
    new = os.urandom(2 * MiB)
    _rewrite_while_fill_is_held(a, gate, "w.bin", new)
    reader.join(60)
    assert status(a)["restore"]["damaged_cache_chunks"] == 1
    a.stop()
    start_node(a)
    assert (a.path / "w.bin").read_bytes() == new
    _check_log(a)


def _cache_ino(m, name: str) -> int:
    import sqlite3

    conn = sqlite3.connect(m.cache_dir / "index.sqlite")
    try:
        (ino,) = conn.execute("SELECT ino FROM dentries WHERE parent=1 AND name=?",
                              (name.encode(),)).fetchone()
    finally:
        conn.close()
    return ino


# ----------------------------------------------------------------------------------------------
# 5. a restore on a cache disk smaller than the checkpoint


@pytest.fixture
def small_disk(tmp_path):
    d = tmp_path / "small-disk"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_restore_on_a_small_cache_disk_keeps_the_daemon_and_serves_reads(cluster, small_disk):
    a = cluster("a")
    (a.path / "big.tmp").mkdir()
    files = {f"shard_{i}.bin": os.urandom(24 * MiB) for i in range(4)}  # 96 MiB > 48 MiB disk
    for name, data in files.items():
        (a.path / "big.tmp" / name).write_bytes(data)
    os.rename(a.path / "big.tmp", a.path / "big")
    ckptfs.wait_durable(a.path / "big", timeout=180)
    b = cluster("b", start=False)
    b.cache_dir = small_disk / "cache"
    start_node(b)
    with open(b.path / "big" / "shard_0.bin", "rb") as f:  # starts the set's prefetch
        head = f.read(MiB)
    assert head == files["shard_0.bin"][:MiB]
    job = wait_for(lambda: next((j for j in status(b)["restore"]["jobs"]
                                 if j["path"] == "big" and j["finished"]), None),
                   timeout=120, what="the prefetch to end")
    assert job["error"] and "full" in job["error"], job
    # The daemon is alive and every byte reads back right (what did not fit comes by range).
    for name, data in files.items():
        assert hashlib.sha256((b.path / "big" / name).read_bytes()).hexdigest() == \
            hashlib.sha256(data).hexdigest(), name
    out = run_cli("status", str(b.path))
    assert out.returncode == 0 and "full" in out.stdout, out.stdout
    b.stop()
    for m in (a, b):
        _check_log(m)


def test_recommit_after_its_manifest_vanished_is_published(cluster):
    """If-Match on a manifest that is no longer in the store (S3 answers 404 NoSuchKey, not
    412): the re-commit publishes with If-None-Match instead of failing for good (found by the
    fault suite, scripts/fault_loop.py)."""
    a = cluster("a")
    _save_steps(a.path, range(1, 2))
    ckptfs.wait_durable(a.path / "latest", timeout=120)
    view = cluster.view
    view.s3.delete_object(Bucket=view.bucket, Key=view.prefix + "manifests/latest.json")
    _save_steps(a.path, range(2, 3))
    assert ckptfs.wait_durable(a.path / "latest", timeout=120)["state"] == "durable"
    assert "manifests/latest.json" in cluster.view.keys("manifests/")
    _check_log(a)


def test_rotation_deletes_the_old_checkpoint_only_after_the_new_latest_is_published(cluster):
    gate = cluster.tmp / "a-uploads-held"  # absent: uploads go through until it is created
    a = cluster("a", env={"CKPTFS_FAULTS": f"put@data/=hold:{gate},"
                                           f"create_multipart@data/=hold:{gate},"
                                           f"upload_part@data/=hold:{gate}"})
    _save_steps(a.path, range(1, 2))
    ckptfs.wait_durable(a.path / "latest", timeout=120)
    gate.touch()
    _save_steps(a.path, range(2, 3))  # step_2.pt's upload is held; latest -> step_2 waits
    os.unlink(a.path / "step_1.pt")   # rotation
    wait_for(lambda: status(a)["deletes_waiting"] == 1, timeout=30,
             what="the deletion to wait for the sets committed before it")
    keys = cluster.view.keys("manifests/")
    assert "manifests/step_1.pt.json" in keys, keys  # what the store's latest still names
    gate.unlink()
    ckptfs.wait_durable(a.path / "latest", timeout=120)
    wait_for(lambda: "manifests/step_1.pt.json" not in cluster.view.keys("manifests/"),
             timeout=60, what="step_1.pt to leave the store")
    assert sorted(cluster.view.keys("manifests/")) == ["manifests/latest.json",
                                                       "manifests/step_2.pt.json"]
    _check_log(a)
