"""Files written into a directory after it was committed (issue 39; docs/SEMANTICS.md "Files
written into a committed directory"), in process: real `CacheFs` + `Engine` on a file://
store (tests/inproc.py's `Node`), no FUSE.

Megatron-core's `dist_checkpointing` commits `iter_N/` with DCP's `.metadata` rename and only
then writes `metadata.json` (and `integrity.json`) into it; its trainer then rewrites
`latest_checkpointed_iteration.txt`. Each late file amends the directory's set: the directory
is committed again, whole, its unchanged files keeping their objects, and published in commit
order, so the tracker file never appears in the store before the files it points to. A DCP
save into a committed directory is not amended file by file (that would publish a mix of two
saves): its `.metadata` rename commits it. A closed file in no set is counted and named.
"""

from __future__ import annotations

import json
import os

import pytest
import trio

from cachemgr.core.index import ROOT_INO
from cachemgr.format.keys import is_manifest_key, manifest_key
from tests.inproc import CHUNK, Node, Recorder, read_manifest, run_nodes, until


@pytest.fixture
def store(tmp_path):
    return Recorder(tmp_path / "store")


def dcp_save(node: Node, d: str, shards: dict[str, bytes]) -> None:
    """What DCP's FileSystemWriter does in `d`: the shards, `.metadata.tmp`, the rename."""
    for name, data in shards.items():
        node.write(f"{d}/{name}", data)
    node.write(f"{d}/.metadata.tmp", b"metadata of " + ",".join(shards).encode())
    parent = node.core.index.resolve(d)
    node.core.rename(parent, b".metadata.tmp", parent, b".metadata", 0)


def rel_paths(m: dict) -> list[str]:
    return sorted(f["path"] for f in m["files"])


def test_megatron_s_late_files_amend_the_dcp_set_and_publish_before_the_tracker(tmp_path,
                                                                                 store):
    node = Node(tmp_path / "a", store)
    node.mkdir("ck")
    node.mkdir("ck/iter_0000006")
    shard = os.urandom(3 * CHUNK + 5)
    dcp_save(node, "ck/iter_0000006", {"__0_0.distcp": shard})
    dcp = node.sets.newest_at("ck/iter_0000006")
    assert dcp.reason == "dcp"
    node.write("ck/iter_0000006/metadata.json", b'{"sharded_backend": "torch_dist"}')
    node.write("ck/iter_0000006/integrity.json", b'{"sha": "..."}')
    node.write("ck/latest_checkpointed_iteration.txt", b"6")
    amended = node.sets.newest_at("ck/iter_0000006")
    assert amended.reason == "amend" and amended.seq > dcp.seq
    tracker = node.sets.newest_at("ck/latest_checkpointed_iteration.txt")
    assert tracker.seq > amended.seq
    assert node.sets.unsaved(10).files == 0

    async def body():
        await until(node.quiet, "the sets to settle")
    run_nodes([node], body)

    assert node.sets.get(amended.seq).state == "durable"
    assert node.sets.get(dcp.seq).state in ("superseded", "replaced")
    m = read_manifest(store, "ck/iter_0000006")
    assert rel_paths(m) == [".metadata", "__0_0.distcp", "integrity.json", "metadata.json"]
    assert m["commit"]["reason"] == "amend"
    order = store.puts(is_manifest_key)
    # the tracker's manifest comes after the last manifest of the directory it names
    last_dir = max(i for i, k in enumerate(order) if k == manifest_key("ck/iter_0000006"))
    assert order.index(manifest_key("ck/latest_checkpointed_iteration.txt")) > last_dir, order
    # the shard was uploaded once: the amends reuse its object
    shard_key = next(f["object"]["key"] for f in m["files"] if f["path"] == "__0_0.distcp")
    assert store.puts(lambda k: k == shard_key) == [shard_key]
    st = node.t.status()
    assert st["unsaved_files"] == 0 and st["pending_sets"] == 0
    assert node.core.check_consistency() == []
    node.core.close()


def test_a_late_file_after_the_set_is_durable_replaces_its_manifest(tmp_path, store):
    node = Node(tmp_path / "a", store)
    node.mkdir("step")
    dcp_save(node, "step", {"__0_0.distcp": os.urandom(CHUNK), "__1_0.distcp": b"x" * 100})

    async def settle():
        await until(node.quiet, "the set to settle")
    run_nodes([node], settle)
    first = node.sets.newest_at("step")
    assert first.state == "durable" and first.reason == "dcp"
    assert rel_paths(read_manifest(store, "step")) == [".metadata", "__0_0.distcp",
                                                       "__1_0.distcp"]
    # a late file closed, a torch.save `tmp -> final` rename, and a symlink: each amends
    node.write("step/metadata.json", b"{}")
    node.write("step/common.pt.tmp", b"common state")
    parent = node.core.index.resolve("step")
    node.core.rename(parent, b"common.pt.tmp", parent, b"common.pt", 0)
    node.core.symlink(parent, b"model", b"__0_0.distcp", 0, 0)
    run_nodes([node], settle)

    newest = node.sets.newest_at("step")
    assert newest.reason == "amend" and newest.state == "durable"
    assert node.sets.get(first.seq).state == "replaced"
    m = read_manifest(store, "step")
    assert rel_paths(m) == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt",
                            "metadata.json"]
    assert [s["path"] for s in m["symlinks"]] == ["model"]
    # the objects the first manifest named are still there: the new one names them too
    for f in m["files"]:
        assert trio.run(store.head, f["object"]["key"]).size == f["object"]["stored_size"]
    node.core.close()


def test_a_dcp_save_into_a_committed_directory_commits_at_its_metadata_rename(tmp_path,
                                                                              store):
    """Saving again into a committed DCP directory rewrites its shards one by one: a file
    closed there meanwhile must not publish a mix of the two saves; the `.metadata` rename
    commits the new save, with that file."""
    node = Node(tmp_path / "a", store)
    node.mkdir("ck")
    dcp_save(node, "ck", {"__0_0.distcp": b"old0" * 1000, "__1_0.distcp": b"old1" * 1000})

    async def settle():
        await until(node.quiet, "the set to settle")
    run_nodes([node], settle)
    first = node.sets.newest_at("ck")
    node.write("ck/__0_0.distcp", b"new0" * 1000)      # the new save has begun
    node.write("ck/extra.json", b"{}")                  # a late-looking file meanwhile
    assert node.sets.newest_at("ck").seq == first.seq  # no amend: a save is under way
    assert node.sets.unsaved(10).paths == ["ck/__0_0.distcp", "ck/extra.json"]
    node.write("ck/__1_0.distcp", b"new1" * 1000)
    node.write("ck/.metadata.tmp", b"new metadata")
    parent = node.core.index.resolve("ck")
    node.core.rename(parent, b".metadata.tmp", parent, b".metadata", 0)
    second = node.sets.newest_at("ck")
    assert second.reason == "dcp"
    run_nodes([node], settle)

    assert store.puts(lambda k: k == manifest_key("ck")) == [manifest_key("ck")] * 2
    m = read_manifest(store, "ck")
    assert rel_paths(m) == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra.json"]
    assert node.sets.get(second.seq).state == "durable"
    assert node.sets.unsaved(10).files == 0
    node.core.close()


def test_closed_files_in_no_set_are_counted_and_named(tmp_path, store):
    """A temporary file never renamed and the shards of a DCP directory whose `.metadata`
    never came are in no set: status and the metrics' statistics count them, their bytes and
    their paths; a file still open for writing is not counted (its close decides)."""
    node = Node(tmp_path / "a", store)
    node.mkdir("d")
    node.write("d/__0_0.distcp", b"s" * 300)
    node.write("model.pt.tmp", b"m" * 200)
    fh = node.open_write("open.pt.tmp")
    node.core.write(fh, 0, b"o" * 50)
    node.write("done.pt", b"d" * 10)  # commits itself

    st = node.t.status()
    assert (st["unsaved_files"], st["unsaved_bytes"]) == (2, 500)
    assert sorted(st["unsaved"]) == ["d/__0_0.distcp", "model.pt.tmp"]
    unsaved = node.t.statistics().sets.unsaved
    assert (unsaved.files, unsaved.bytes) == (2, 500)
    node.close(fh)
    assert node.t.status()["unsaved_files"] == 3
    # committing the directory and renaming the temporary file into place saves them
    node.t.commit_path("d")
    node.core.rename(ROOT_INO, b"model.pt.tmp", ROOT_INO, b"model.pt", 0)
    node.core.unlink(ROOT_INO, b"open.pt.tmp")
    assert node.t.status()["unsaved_files"] == 0
    node.core.close()


def test_an_amend_of_a_set_other_nodes_wrote_into_keeps_their_files(tmp_path, store):
    """A directory renamed into place on A holds B's file; A's late files amend it, before its
    first manifest is in (the amend gathers B's file again) and after (B's file is in A's tree
    by then): every manifest the store ever holds for it has B's file, and the last has the
    late files too."""
    a = Node(tmp_path / "a", store)
    b = Node(tmp_path / "b", store)
    x, y = os.urandom(2 * CHUNK + 1), os.urandom(CHUNK + 3)
    for n in (a, b):
        n.mkdir("step.tmp")
    a.write("step.tmp/x", x)
    b.write("step.tmp/y", y)
    seen: list[list[str]] = []  # every manifest of `step` PUT, as it was PUT
    real_put = store.put

    async def put(key, data, **kw):
        if key == manifest_key("step"):
            seen.append(rel_paths(json.loads(bytes(data))))
        return await real_put(key, data, **kw)
    store.put = put

    async def body():
        a.core.rename(ROOT_INO, b"step.tmp", ROOT_INO, b"step", 0)
        a.write("step/metadata.json", b"{}")     # at once: the rename's set is not durable yet
        amend = a.sets.newest_at("step")
        assert amend.reason == "amend"
        await until(lambda: a.sets.get(amend.seq).state == "durable", "the amend to publish")
        a.write("step/integrity.json", b"{}")    # after: B's file is in A's tree now
        await until(lambda: a.state("step") == "durable" and
                    a.sets.newest_at("step").seq > amend.seq, "the second amend to publish")
    try:
        run_nodes([a, b], body)
        assert seen and all("y" in m for m in seen), seen
        assert seen[-1] == ["integrity.json", "metadata.json", "x", "y"], seen
        m = read_manifest(store, "step")
        assert {f["path"]: f["size"] for f in m["files"]}["y"] == len(y)
        assert sorted(m["commit"].get("nodes", [])) == sorted([a.t.node, b.t.node])
    finally:
        for n in (a, b):
            n.core.close()
