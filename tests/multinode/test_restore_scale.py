"""Restore at scale (issue 13): several mounts with empty caches on one store each fetch what
their own readers read, not the whole set (cachemgr.restore.restorer, docs/ARCHITECTURE.md "Restore
policy").

  * A DCP checkpoint saved through node A by 4 gloo ranks, loaded at world size 2 with one rank
    on each of nodes B and C (Shard(0) DTensors, resharded): each node fetches at most 1.2x the
    bytes its rank's load reads (the stored items it overlaps, from the checkpoint's metadata,
    which the *test* reads; the daemon never unpickles it), plus `.metadata`.
  * A subset `dcp.load` of two small keys on a fresh node D fetches at most 1.2x the subset plus
    one chunk per file touched, plus `.metadata`.
  * Per-rank torch.save files: opening one on a node with --prefetch file, reads or auto (other
    nodes mounted) fetches that file and none of its siblings; --prefetch set still fetches
    the whole set.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

import ckptfs
from tests.conftest import start_ranks, wait_for
from tests.dcpranks import load_rank, save_rank

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning"),
]

MiB = 1 << 20
CHUNK = 4 * MiB  # the default chunk_size of objects (docs/FORMAT.md)
SAVE_WORLD = 4
LOAD_WORLD = 2
SMALL = ("small_a", "small_b")


def rstat(m) -> dict:
    return ckptfs.status(m.path)["tiering"]["restore"]


def settled(m) -> dict:
    """The node's restore counters once nothing it started is still fetching."""
    def quiet():
        st = rstat(m)
        busy = st["readahead_running"] or st["in_flight_chunks"] or \
            any(not j["finished"] for j in st["jobs"])
        return None if busy else st
    return wait_for(quiet, timeout=60, what=f"{m.mountpoint.name}'s fetches to end")


def wait_shown(m, rel: str) -> Path:
    p = m.path / rel
    wait_for(lambda: os.path.lexists(p), timeout=30, what=f"{rel} on {m.mountpoint.name}")
    return p


def _state(seed: int) -> dict[str, torch.Tensor]:
    """128 MiB of Shard(0) tensors (rows divisible by 4 and 2: a resharded rank reads whole
    saved shards) and two small replicated ones. DCP puts each replicated item (and `meta`) in
    one rank's file, so a rank also reads the first chunk of files it otherwise skips: 4 MiB
    per such file, which the 1.2x bound absorbs once a rank reads ~40 MiB or more (a real
    checkpoint: ~100 MB per rank and up)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "small_a": torch.randn(100, 100, generator=g),
        "small_b": torch.arange(5000, dtype=torch.int64) * 7,
        "sharded_a": torch.randn(8192, 1024, generator=g),
        "sharded_b": torch.randn(8192, 1024, generator=g),
        "sharded_c": torch.randn(4096, 2048, generator=g).to(torch.bfloat16),
        "sharded_d": torch.randint(-(2**40), 2**40, (4096, 1024), generator=g),
        "sharded_e": torch.randn(2048, 2048, generator=g),
    }


def read_by(md, keys, rank: int = 0, world: int = 1) -> tuple[int, set[str]]:
    """(bytes, files) a DCP load of `keys` by `rank` of `world` reads: every stored item (a
    saved shard, a bytes object) its Shard(0) rows overlap, whole (FileSystemReader reads an
    item whole and narrows it in memory)."""
    total, files = 0, set()
    for fqn, m in md.state_dict_metadata.items():
        if fqn.split(".")[0] not in keys:
            continue
        if isinstance(m, BytesStorageMetadata):
            items = [MetadataIndex(fqn)]
        else:
            rows = m.size[0] if len(m.size) else 0
            per = -(-rows // world) if rows else 0
            lo, hi = rank * per, min(rows, (rank + 1) * per)
            items = [MetadataIndex(fqn, c.offsets) for c in m.chunks
                     if not fqn.startswith("sharded") or
                     (c.offsets[0] < hi and c.offsets[0] + c.sizes[0] > lo)]
        for idx in items:
            info = md.storage_data[idx]
            total += info.length
            files.add(info.relative_path)
    return total, files


def test_dcp_resharded_and_subset_loads_fetch_what_each_node_reads(nodes, tmp_path):
    a = nodes("a")
    a.start()
    ckpt_a = a.path / "run" / "step_5"
    start_ranks(save_rank, (SAVE_WORLD, str(tmp_path / "fs-save"), str(ckpt_a), _state, 5),
                SAVE_WORLD)
    ckptfs.wait_durable(ckpt_a, timeout=180)
    shards = sorted(p.name for p in ckpt_a.iterdir() if p.name.endswith(".distcp"))
    assert len(shards) == SAVE_WORLD, shards
    set_bytes = sum(p.stat().st_size for p in ckpt_a.iterdir())
    meta_size = (ckpt_a / ".metadata").stat().st_size
    md = dcp.FileSystemReader(str(ckpt_a)).read_metadata()  # the test may; the daemon must not

    # World size 2, one rank on each of two fresh nodes (default policy: auto).
    b, c = nodes("b"), nodes("c")
    store = ["--store", f"file://{a.store_dir}"]
    b.start(*store)
    c.start(*store)
    ckpts = [str(wait_shown(m, "run/step_5/.metadata").parent) for m in (b, c)]
    # rank r of the resumed job loads through its own node's mount, ckpts[r]
    start_ranks(load_rank, (LOAD_WORLD, str(tmp_path / "fs-load"), ckpts, _state, 5), LOAD_WORLD)
    keys = set(_state(5)) | {"meta"}
    for rank, m in enumerate((b, c)):
        st = settled(m)
        want, _files = read_by(md, keys, rank, LOAD_WORLD)
        assert st["set_policies"].get("run/step_5") == "split", st
        print(f"node {m.mountpoint.name} (rank {rank} of {LOAD_WORLD}): read {want} B,"
              f" fetched {st['bytes_fetched']} B in {st['gets']} GETs, read-ahead"
              f" {st['readahead_bytes']} B (set {set_bytes} B)")
        assert 0 < st["bytes_fetched"] <= 1.2 * want + meta_size, (rank, want, st)
        assert st["bytes_fetched"] < 0.75 * set_bytes, (rank, set_bytes, st)
        assert st["integrity_errors"] == 0

    # A subset of keys on a fresh node D: the subset, chunk-rounded, and the metadata.
    d = nodes("d")
    d.start(*store)
    ckpt_d = wait_shown(d, "run/step_5/.metadata").parent
    full = _state(5)
    sub = {k: torch.full_like(full[k], 7) for k in SMALL}
    dcp.load(sub, checkpoint_id=str(ckpt_d))
    for k in SMALL:
        assert torch.equal(sub[k], full[k]), k
    want, files = read_by(md, set(SMALL))
    st = settled(d)
    print(f"subset {sorted(SMALL)}: read {want} B in {len(files)} file(s), fetched"
          f" {st['bytes_fetched']} B in {st['gets']} GETs")
    assert 0 < st["bytes_fetched"] <= 1.2 * want + CHUNK * len(files) + meta_size, \
        (want, files, st)
    assert st["integrity_errors"] == 0


def test_per_rank_files_fetch_the_file_opened_and_set_fetches_the_set(nodes):
    a = nodes("a")
    a.start()
    g = torch.Generator().manual_seed(3)
    tmp = a.path / "pr" / "step_1.tmp"
    tmp.mkdir(parents=True)
    states = {f"rank_{r}.pt": {"w": torch.randn(1536, 1024, generator=g), "rank": r}
              for r in range(4)}
    for name, sd in states.items():
        torch.save(sd, tmp / name)
    os.rename(tmp, a.path / "pr" / "step_1")
    ckptfs.wait_durable(a.path / "pr" / "step_1", timeout=120)
    sizes = {n: (a.path / "pr" / "step_1" / n).stat().st_size for n in states}
    store = ["--store", f"file://{a.store_dir}"]
    policy = {"f": "file", "r": "reads", "auto": None, "s": "set"}
    ms = {}
    for name, p in policy.items():
        ms[name] = nodes(name)
        ms[name].start(*store, *(["--prefetch", p] if p else []))
    for name, m in ms.items():
        path = wait_shown(m, "pr/step_1/rank_1.pt")
        got = torch.load(path, weights_only=True)
        assert got["rank"] == 1 and torch.equal(got["w"], states["rank_1.pt"]["w"]), name
        st = settled(m)
        assert st["policy"] == (policy[name] or "auto"), st
        if policy[name] == "set":
            job = next(j for j in st["jobs"] if j["path"] == "pr/step_1")
            assert job["error"] is None and job["bytes_done"] == sum(sizes.values()), job
            assert st["bytes_fetched"] == sum(sizes.values()), st
        else:
            # That file, and none of its siblings.
            assert st["bytes_fetched"] == sizes["rank_1.pt"], (name, st)
            for sib in ("rank_0.pt", "rank_2.pt", "rank_3.pt"):
                ino = (m.path / "pr" / "step_1" / sib).stat().st_ino
                cache = m.cache_dir / "data" / str(ino)
                assert not cache.exists() or cache.stat().st_blocks == 0, (name, sib)
