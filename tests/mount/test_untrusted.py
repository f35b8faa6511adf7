"""Trust nothing read from the store (cachemgr.format.validate): documents planted in a shared
file:// store by "someone else" (a bug, an older ckptfs, a hostile peer), seen through real
mounts.

  1. Malformed manifests beside a legitimate set: skipped, reported once each, listed as
     invalid in status; the legitimate sets show on a fresh node the moment `mount` returns and
     on a node that was already running.
  2. Another node's part records are validated: a directory commit whose set has an invalid
     record fails naming it, and nothing of the record is published.
  3. A planted manifest "renamed from" this node's durable set neither moves its files nor,
     once deleted, takes that set's (or another node's) objects with it.
  4. `commit.node: "local"` is not a node: the manifest is invalid and pins nothing.
  5. `committed_ns` 2**63 does not make this node's later commits of the path lose.
  6. Permission bits from the store are masked (no setuid, no world-write); a name with a NUL
     is refused; the namespace lists and deletes cleanly.
  7. A manifest over validate.MAX_DOCUMENT_BYTES is never read: a fresh node's daemon stays
     small.

Documents are planted atomically (a `.tmp-` file the store's listing skips, then a rename),
so every listing sees each one whole; their sidecars are absent or stale (no store CRC).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import uuid
from pathlib import Path

import ckptfs
from cachemgr.format import validate
from cachemgr.format.keys import part_key
from cachemgr.store.base import crc32c
from ckptfs.mount import pid_running
from tests.conftest import run_cli, wait_for

ARGS = ("--refresh-interval", "1", "--attr-timeout", "0")
FAKE = "0badc0de"  # a node id no mount has
FAKE2 = "5ca1ab1e"


# ----------------------------------------------------------------------------------------------
# helpers


def start(mount_factory, name: str, store: Path | None = None, *extra: str):
    """A started node; on `store` (another node's store_dir) if given, else its own."""
    m = mount_factory(name)
    where = () if store is None else ("--store", f"file://{store}")
    m.start(*where, *(extra or ARGS))
    return m


def tstatus(m) -> dict:
    return ckptfs.status(m.path)["tiering"]


def node_id(m) -> str:
    return tstatus(m)["store"]["node"]


def rows(m, path: str) -> list[dict]:
    return [s for s in tstatus(m)["sets"] if s["path"] == path]


def cli_status(m) -> dict:
    res = run_cli("status", str(m.path), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["tiering"]


def plant(store: Path, key: str, data: bytes) -> None:
    """Put `data` at `key` of the file:// store at `store`, atomically."""
    dst = store / "objects" / key
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".tmp-{uuid.uuid4().hex}"
    tmp.write_bytes(data)
    os.rename(tmp, dst)


def stored(store: Path, key: str) -> bytes | None:
    try:
        return (store / "objects" / key).read_bytes()
    except FileNotFoundError:
        return None


def manifest_of(store: Path, path: str) -> dict | None:
    data = stored(store, f"manifests/{path}.json")
    return None if data is None else json.loads(data)


def obj(key: str, data: bytes) -> dict:
    """An uncompressed object's description, every field as ckptfs writes it."""
    return {"key": key, "size": len(data), "stored_size": len(data), "crc32c": crc32c(data),
            "compression": "none", "frame_size": 0, "frames": None, "chunk_size": 4 << 20,
            "chunk_crcs": [crc32c(data)] if data else []}


def plant_object(store: Path, node: str, name: str, data: bytes) -> dict:
    """An object of `node` holding `data`; returns its manifest description."""
    key = f"data/{node}/{uuid.uuid4().int % 10**6}/1/{name}"
    plant(store, key, data)
    return obj(key, data)


def manifest(path: str, node: str, files: list[dict], *, kind: str = "dir", nodes=None,
             **commit) -> dict:
    m = {"format": "ckptfs-manifest", "version": 1, "path": path, "kind": kind,
         "commit": {"node": node, "seq": 7, "reason": "rename",
                    "committed_ns": time.time_ns(), **commit},
         "total_bytes": sum(f["size"] for f in files), "files": files}
    if nodes:
        m["commit"]["nodes"] = sorted(nodes)
    if kind == "dir":
        m["mode"] = 0o755
    return m


def file_entry(rel: str, o: dict, mode: int = 0o644) -> dict:
    return {"path": rel, "size": o["size"], "mode": mode, "mtime_ns": time.time_ns(),
            "object": o}


def dir_set(m, rel: str, files: dict[str, bytes]) -> None:
    """Write `files` into `rel`.tmp on node `m`, rename it to `rel` (the commit) and wait until
    the set is durable."""
    tmp = m.path / (rel + ".tmp")
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    os.rename(tmp, m.path / rel)
    ckptfs.wait_durable(m.path / rel, timeout=60)


def warnings_for(m, key: str) -> int:
    return sum(f"skipping manifest {key}:" in ln for ln in m.log_text().splitlines())


def after_listings(m, n: int = 3) -> None:
    """Wait until node `m` listed the store `n` more times."""
    s0 = tstatus(m)["remote"]["syncs"]
    wait_for(lambda: tstatus(m)["remote"]["syncs"] >= s0 + n, timeout=30,
             what=f"{n} more listings on {m.mountpoint.name}")


def healthy(m) -> None:
    """The daemon is alive, answers, and logged no handler failure or traceback."""
    st = cli_status(m)
    assert st["store"]["health"] == "normal", st["store"]
    assert not m.unexpected_errors(), m.unexpected_errors()


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


# ----------------------------------------------------------------------------------------------
# 1. malformed manifests


def test_malformed_manifests_are_skipped_once_and_the_rest_applies(mount_factory):
    a = start(mount_factory, "a")
    store = a.store_dir
    good = {"w0.bin": os.urandom(30_000), "w1.bin": os.urandom(20_000)}
    (a.path / "ckpt").mkdir()
    dir_set(a, "ckpt/good", good)
    real = manifest_of(store, "ckpt/good")
    nodes = sorted({node_id(a), FAKE})

    def copy(path: str, **changes) -> dict:
        m = json.loads(json.dumps(real))
        m["path"] = path
        m["commit"].update(node=FAKE, nodes=nodes)
        m.update(changes)
        return m

    no_commit = copy("bad/no_commit")
    del no_commit["commit"]
    negative = copy("bad/negative")
    negative["files"][0]["size"] = -1
    deep = (b'{"format": "ckptfs-manifest", "version": 1, "path": "bad/deep", "kind": "dir",'
            b' "mode": 493, "commit": ' + json.dumps(copy("x")["commit"]).encode() +
            b', "files": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    bad = {"manifests/bad/no_commit.json": json.dumps(no_commit).encode(),
           "manifests/bad/mode.json": json.dumps(copy("bad/mode", mode="0755")).encode(),
           "manifests/bad/deep.json": deep,
           # a legitimate document at another set's key
           "manifests/bad/other_path.json": json.dumps(copy("ckpt/good")).encode(),
           "manifests/bad/negative.json": json.dumps(negative).encode()}
    for key, data in bad.items():
        plant(store, key, data)

    # A fresh node: every legitimate set the moment mount returns, nothing of the bad ones.
    b = start(mount_factory, "b", store)
    for name, data in good.items():
        assert (b.path / "ckpt" / "good" / name).read_bytes() == data
    assert os.listdir(b.path) == ["ckpt"]
    # A set committed after them reaches both.
    later = {"x.bin": os.urandom(10_000)}
    dir_set(a, "ckpt/later", later)
    wait_for(lambda: (b.path / "ckpt" / "later" / "x.bin").exists(), timeout=30,
             what="ckpt/later on node B")
    assert (b.path / "ckpt" / "later" / "x.bin").read_bytes() == later["x.bin"]

    for m in (a, b):  # the node already running when they were planted, and the fresh one
        after_listings(m, 3)
        st = cli_status(m)
        assert st["store"]["health"] == "normal", st["store"]
        assert st["remote"]["invalid_count"] == len(bad), st["remote"]
        assert sorted(st["remote"]["invalid_manifests"]) == sorted(bad)
        for key in bad:
            assert warnings_for(m, key) == 1, (m.mountpoint.name, key)
        assert st["remote"]["not_restored"] == {}
        assert not m.unexpected_errors(), m.unexpected_errors()
    why = cli_status(b)["remote"]["invalid_manifests"]
    assert "commit" in why["manifests/bad/no_commit.json"]
    assert "mode" in why["manifests/bad/mode.json"]
    assert "JSON" in why["manifests/bad/deep.json"]
    assert "key" in why["manifests/bad/other_path.json"]
    assert "size" in why["manifests/bad/negative.json"]
    assert sorted(os.listdir(a.path / "ckpt")) == sorted(os.listdir(b.path / "ckpt")) == \
        ["good", "later"]
    # A replaced document is read again (and reported again, once).
    plant(store, "manifests/bad/mode.json", json.dumps(copy("bad/mode", mode=[])).encode())
    wait_for(lambda: warnings_for(b, "manifests/bad/mode.json") == 2, timeout=30,
             what="the replaced bad manifest to be reported")
    after_listings(b, 2)
    assert warnings_for(b, "manifests/bad/mode.json") == 2


# ----------------------------------------------------------------------------------------------
# 2. other nodes' part records


def test_invalid_part_record_of_another_node_fails_the_commit(mount_factory):
    a = start(mount_factory, "a")
    b = start(mount_factory, "b", a.store_dir)
    store, nb = a.store_dir, node_id(b)
    pids = {a: a.pid, b: b.pid}
    data: dict[int, dict[str, bytes]] = {}

    def write_ranks(step: int) -> None:
        """Rank 0 on A and rank 1 on B write into run/step_N.tmp; wait until B's file is
        durable (its record names its object)."""
        data[step] = {"rank0.bin": os.urandom(40_000), "rank1.bin": os.urandom(40_000)}
        for m, name in ((a, "rank0.bin"), (b, "rank1.bin")):
            d = m.path / "run" / f"step_{step}.tmp"
            d.mkdir(parents=True)
            (d / name).write_bytes(data[step][name])
        key = f"parts/run/step_{step}.tmp/@{nb}.json"
        wait_for(lambda: (rec := stored(store, key)) and
                 all(f["object"] for f in json.loads(rec)["files"]),
                 timeout=60, what="B's file durable")

    write_ranks(0)
    os.rename(a.path / "run" / "step_0.tmp", a.path / "run" / "step_0")
    ckptfs.wait_durable(a.path / "run" / "step_0", timeout=60)

    evil_obj = plant_object(store, FAKE, "escaped.txt", b"#!/bin/sh\necho owned\n")
    record_files = {
        1: {"name": "../../../escaped.txt", "size": evil_obj["size"], "mode": 0o4755,
            "mtime_ns": 1, "object": evil_obj},
        2: {"name": "rank9.bin", "size": str(evil_obj["size"]), "mode": 0o644, "mtime_ns": 1,
            "object": evil_obj},
        3: {"name": "rank9.bin", "size": evil_obj["size"], "mode": 0o644, "mtime_ns": 1,
            "object": dict(evil_obj, compression="zstd")},
    }
    def failing_commit(step: int, key: str, dir_: str, f: dict) -> None:
        """Plant `f` in a record of FAKE at `key` (for `dir_`), commit run/step_N on A: the set
        fails, naming the record."""
        write_ranks(step)
        plant(store, key, json.dumps({"format": "ckptfs-part", "version": 1, "node": FAKE,
                                      "dir": dir_, "updated_ns": 1, "files": [f]}).encode())
        os.rename(a.path / "run" / f"step_{step}.tmp", a.path / "run" / f"step_{step}")
        row = wait_for(lambda: (r := rows(a, f"run/step_{step}")) and
                       r[-1]["state"] in ("failed", "durable") and r[-1],
                       timeout=60, what=f"run/step_{step} to settle")
        assert row["state"] == "failed", row
        assert key in row["error"] and "invalid" in row["error"], row
        res = run_cli("wait", str(a.path / "run" / f"step_{step}"), "--timeout", "5")
        assert res.returncode != 0 and key in res.stdout + res.stderr, (res.stdout, res.stderr)

    for step, f in record_files.items():
        failing_commit(step, f"parts/run/step_{step}.tmp/@{FAKE}.json", f"run/step_{step}.tmp",
                       f)

    # Another multi-node commit still works, beside the invalid records of other sets: also
    # one under a hashed key (cachemgr.format.keys: a path too long for a plain key), which every
    # committer lists.
    deep = "/".join(["d" * 200] * 5)  # makes a key over 1,024 bytes
    hashed = part_key(f"elsewhere/{deep}", FAKE)
    assert hashed.startswith("parts/%25/")
    plant(store, hashed, json.dumps({"format": "ckptfs-part", "version": 1, "node": FAKE,
                                     "dir": f"elsewhere/{deep}", "updated_ns": 1,
                                     "files": [record_files[2]]}).encode())
    write_ranks(4)
    os.rename(a.path / "run" / "step_4.tmp", a.path / "run" / "step_4")
    ckptfs.wait_durable(a.path / "run" / "step_4", timeout=60)
    # ... and an invalid hashed record of a directory inside the set does fail it.
    failing_commit(5, part_key(f"run/step_5.tmp/{deep}", FAKE), f"run/step_5.tmp/{deep}",
                   record_files[2])

    # Nothing of the records was published, nothing escaped the sets.
    published = sorted(p.relative_to(store / "objects" / "manifests").as_posix()
                       for p in (store / "objects" / "manifests").rglob("*.json"))
    assert published == ["run/step_0.json", "run/step_4.json"], published
    named = {f["object"]["key"] for s in (0, 4)
             for f in manifest_of(store, f"run/step_{s}")["files"]}
    assert evil_obj["key"] not in named
    for root in (a.path, b.path, store):
        assert not [p for p in Path(root).rglob("escaped.txt")
                    if "data" not in p.relative_to(root).parts], root
    assert not (a.path / "run" / "step_1").joinpath("../../../escaped.txt").exists()
    for m, pid in pids.items():  # the daemons that mounted are the ones answering
        assert pid_running(pid) and ckptfs.status(m.path)["pid"] == pid
        healthy(m)

    # A fresh node shows every legitimate set, whole, and none of the failed ones.
    c = start(mount_factory, "c", store)
    assert sorted(os.listdir(c.path / "run")) == ["step_0", "step_4"]
    for s in (0, 4):
        for name, want in data[s].items():
            assert (c.path / "run" / f"step_{s}" / name).read_bytes() == want
    healthy(c)


# ----------------------------------------------------------------------------------------------
# 3. a manifest naming this node's durable set


def test_planted_rename_neither_moves_a_durable_set_nor_deletes_its_objects(mount_factory):
    a = start(mount_factory, "a")
    b = start(mount_factory, "b", a.store_dir)
    store, na, nb = a.store_dir, node_id(a), node_id(b)
    good = {"w0.bin": os.urandom(50_000), "sub/w1.bin": os.urandom(30_000)}
    (a.path / "ckpt" / "good.tmp" / "sub").mkdir(parents=True)
    for rel, d in good.items():
        (a.path / "ckpt" / "good.tmp" / rel).write_bytes(d)
    os.rename(a.path / "ckpt" / "good.tmp", a.path / "ckpt" / "good")
    ckptfs.wait_durable(a.path / "ckpt" / "good", timeout=60)
    other = os.urandom(25_000)
    (b.path / "other.pt").write_bytes(other)
    ckptfs.wait_durable(b.path / "other.pt", timeout=60)
    wait_for(lambda: (a.path / "other.pt").exists(), timeout=30, what="other.pt on node A")
    inodes = {rel: os.stat(a.path / "ckpt" / "good" / rel).st_ino for rel in good}
    real = manifest_of(store, "ckpt/good")
    keys = {f["object"]["key"] for f in real["files"]} | \
        {f["object"]["key"] for f in manifest_of(store, "other.pt")["files"]}

    # "Node B renamed ckpt/good to ckpt/evil", naming A's objects at their rels, and B's.
    files = [dict(f) for f in real["files"]] + \
        [file_entry("z.bin", manifest_of(store, "other.pt")["files"][0]["object"])]
    evil = manifest("ckpt/evil", nb, files, nodes={na, nb}, **{"from": "ckpt/good"})
    evil["dirs"] = [{"path": "sub", "mode": 0o755}]
    plant(store, "manifests/ckpt/evil.json", json.dumps(evil).encode())
    wait_for(lambda: (a.path / "ckpt" / "evil" / "z.bin").exists(), timeout=30,
             what="ckpt/evil on node A")

    # A's set is untouched: same files, same inodes, same bytes, still its local set.
    assert sorted(os.listdir(a.path / "ckpt")) == ["evil", "good"]
    for rel, d in good.items():
        p = a.path / "ckpt" / "good" / rel
        assert os.stat(p).st_ino == inodes[rel], rel
        assert p.read_bytes() == d
    assert [r["state"] for r in rows(a, "ckpt/good")] == ["durable"]
    assert rows(a, "ckpt/good")[0]["origin"] == "local"
    # ckpt/evil is a set restored from the store: its files are fetched.
    (row,) = rows(a, "ckpt/evil")
    assert row["origin"] == nb and row["state"] == "durable", row
    fetched = tstatus(a)["restore"]["bytes_fetched"]
    for rel, d in good.items():
        assert (a.path / "ckpt" / "evil" / rel).read_bytes() == d
    assert (a.path / "ckpt" / "evil" / "z.bin").read_bytes() == other
    assert tstatus(a)["restore"]["bytes_fetched"] >= fetched + sum(map(len, good.values()))
    assert tstatus(a)["remote"]["adopted_files"] == 0

    # Deleting ckpt/evil on A deletes its manifest, and no object another set names.
    shutil.rmtree(a.path / "ckpt" / "evil")
    wait_for(lambda: [r["state"] for r in rows(a, "ckpt/evil")] == ["deleted"], timeout=60,
             what="the deletion of ckpt/evil")
    assert manifest_of(store, "ckpt/evil") is None
    assert all(stored(store, k) is not None for k in keys), \
        [k for k in keys if stored(store, k) is None]
    c = start(mount_factory, "c", store)
    for rel, d in good.items():
        assert (c.path / "ckpt" / "good" / rel).read_bytes() == d
    assert (c.path / "other.pt").read_bytes() == other
    assert os.listdir(c.path / "ckpt") == ["good"]
    for m in (a, b, c):
        healthy(m)


# ----------------------------------------------------------------------------------------------
# 4. the reserved node id


def test_manifest_of_node_local_is_invalid_and_pins_nothing(mount_factory):
    a = start(mount_factory, "a")
    store = a.store_dir
    o = plant_object(store, "local", "pinned.pt", b"planted")
    plant(store, "manifests/ckpt/pinned.pt.json",
          json.dumps(manifest("ckpt/pinned.pt", "local", [file_entry("", o)], kind="file",
                              reason="close")).encode())
    b = start(mount_factory, "b", store)
    assert not (b.path / "ckpt").exists()
    why = cli_status(b)["remote"]["invalid_manifests"]
    assert list(why) == ["manifests/ckpt/pinned.pt.json"] and "node" in why[
        "manifests/ckpt/pinned.pt.json"], why
    assert rows(b, "ckpt/pinned.pt") == []
    # The path is anyone's: A commits it, B shows A's file, and A's deletion reaches B.
    (a.path / "ckpt").mkdir()
    (a.path / "ckpt" / "pinned.pt").write_bytes(b"A's checkpoint")
    ckptfs.wait_durable(a.path / "ckpt" / "pinned.pt", timeout=60)
    assert manifest_of(store, "ckpt/pinned.pt")["commit"]["node"] == node_id(a)
    wait_for(lambda: (b.path / "ckpt" / "pinned.pt").exists(), timeout=30,
             what="A's ckpt/pinned.pt on node B")
    assert (b.path / "ckpt" / "pinned.pt").read_bytes() == b"A's checkpoint"
    assert [r["origin"] for r in rows(b, "ckpt/pinned.pt")] == [node_id(a)]
    os.unlink(a.path / "ckpt" / "pinned.pt")
    wait_for(lambda: not (b.path / "ckpt" / "pinned.pt").exists(), timeout=60,
             what="the deletion to reach node B")
    for m in (a, b):
        assert tstatus(m)["remote"]["invalid_count"] == 0
        healthy(m)


# ----------------------------------------------------------------------------------------------
# 5. a commit time from the far future


def test_far_future_commit_time_does_not_supersede_later_local_commits(mount_factory):
    # A lists the store once, at mount: nothing it applies can stand in for its own commits,
    # only its publish meets the planted manifest.
    a = start(mount_factory, "a", None, "--refresh-interval", "0", "--attr-timeout", "0")
    store, na = a.store_dir, node_id(a)
    o = plant_object(store, FAKE, "p.pt", b"from the future")
    plant(store, "manifests/p.pt.json",
          json.dumps(manifest("p.pt", FAKE, [file_entry("", o)], kind="file", reason="close",
                              committed_ns=2**63)).encode())
    for content in (b"first commit", b"second commit"):
        (a.path / "p.pt").write_bytes(content)
        got = ckptfs.wait_durable(a.path / "p.pt", timeout=60)
        assert got["state"] == "durable"
        m = manifest_of(store, "p.pt")
        assert m["commit"]["node"] == na and m["commit"]["seq"] == got["seq"], m["commit"]
    assert rows(a, "p.pt")[-1]["state"] == "durable"
    assert not any(r["state"] == "superseded" for r in rows(a, "p.pt")), rows(a, "p.pt")
    b = start(mount_factory, "b", store)
    assert (b.path / "p.pt").read_bytes() == b"second commit"
    assert tstatus(b)["remote"]["invalid_count"] == 0
    # Planted again while B runs: B refuses it (and keeps A's file); A's next commit wins.
    plant(store, "manifests/p.pt.json",
          json.dumps(manifest("p.pt", FAKE, [file_entry("", o)], kind="file", reason="close",
                              committed_ns=2**63)).encode())
    wait_for(lambda: tstatus(b)["remote"]["invalid_count"] == 1, timeout=30,
             what="B to refuse the planted manifest")
    assert "committed_ns" in tstatus(b)["remote"]["invalid_manifests"]["manifests/p.pt.json"]
    assert (b.path / "p.pt").read_bytes() == b"second commit"
    (a.path / "p.pt").write_bytes(b"third commit")
    ckptfs.wait_durable(a.path / "p.pt", timeout=60)
    assert manifest_of(store, "p.pt")["commit"]["node"] == na
    wait_for(lambda: (b.path / "p.pt").read_bytes() == b"third commit", timeout=30,
             what="A's third commit on node B")
    for m in (a, b):
        healthy(m)


# ----------------------------------------------------------------------------------------------
# 6. permission bits and names


def test_modes_from_the_store_are_masked_and_nul_names_refused(mount_factory, tmp_path):
    store = tmp_path / "store"
    run = plant_object(store, FAKE, "run.sh", b"#!/bin/sh\nexit 0\n")
    x = plant_object(store, FAKE, "x.bin", os.urandom(5000))
    m = manifest("perm/set", FAKE, [file_entry("run.sh", run, 0o4755),
                                    file_entry("sub/x.bin", x, 0o6777)])
    m["mode"] = 0o777
    m["dirs"] = [{"path": "sub", "mode": 0o1777}]
    plant(store, "manifests/perm/set.json", json.dumps(m).encode())
    nul = manifest("perm/nul", FAKE, [file_entry("a\u0000b", x)])
    plant(store, "manifests/perm/nul.json", json.dumps(nul).encode())
    one = manifest("perm/one.sh", FAKE, [file_entry("", run, 0o2777)], kind="file",
                   reason="close")
    plant(store, "manifests/perm/one.sh.json", json.dumps(one).encode())

    b = start(mount_factory, "b", store)
    P = b.path / "perm"
    modes = {rel: stat.S_IMODE(os.lstat(P / rel).st_mode)
             for rel in ("set", "set/run.sh", "set/sub", "set/sub/x.bin", "one.sh")}
    assert modes == {"set": 0o775, "set/run.sh": 0o755, "set/sub": 0o775,
                     "set/sub/x.bin": 0o775, "one.sh": 0o775}, {k: oct(v) for k, v in
                                                                 modes.items()}
    assert sorted(os.listdir(P)) == ["one.sh", "set"]
    assert validate.MODE_MASK == 0o775
    assert (P / "set" / "run.sh").read_bytes() == b"#!/bin/sh\nexit 0\n"
    why = cli_status(b)["remote"]["invalid_manifests"]
    assert list(why) == ["manifests/perm/nul.json"] and "NUL" in why["manifests/perm/nul.json"]
    # The namespace lists and deletes cleanly.
    res = run_cli("status", str(b.path))
    assert res.returncode == 0
    seen = []
    for dirpath, dirnames, filenames in os.walk(b.path):
        for n in dirnames + filenames:
            os.lstat(os.path.join(dirpath, n))
            seen.append(os.path.relpath(os.path.join(dirpath, n), b.path))
    assert sorted(seen) == ["perm", "perm/one.sh", "perm/set", "perm/set/run.sh",
                            "perm/set/sub", "perm/set/sub/x.bin"]
    shutil.rmtree(P)
    assert os.listdir(b.path) == []
    wait_for(lambda: {r["path"]: r["state"] for r in tstatus(b)["sets"]} ==
             {"perm/set": "deleted", "perm/one.sh": "deleted"}, timeout=60,
             what="the deletions")
    assert manifest_of(store, "perm/set") is None and manifest_of(store, "perm/one.sh") is None
    assert stored(store, "manifests/perm/nul.json") is not None  # never used, never deleted
    healthy(b)


# ----------------------------------------------------------------------------------------------
# 7. a manifest too big to read


def test_manifest_over_the_size_limit_is_never_read(mount_factory, tmp_path):
    store = tmp_path / "store"
    o = plant_object(store, FAKE, "small.pt", b"small")
    plant(store, "manifests/small.pt.json",
          json.dumps(manifest("small.pt", FAKE, [file_entry("", o)], kind="file",
                              reason="close")).encode())
    # A valid-looking manifest of ~70 MB: one file of 35M one-byte chunks, each with its CRC.
    n = 35_000_000
    big = manifest("big/set", FAKE, [file_entry("f.bin", dict(
        obj(f"data/{FAKE}/9/1/f.bin", b""), size=n, stored_size=n, chunk_size=1,
        chunk_crcs="@CRCS@"))])
    head, tail = json.dumps(big).encode().split(b'"@CRCS@"')
    data = head + b"[" + b"0," * (n - 1) + b"0]" + tail
    assert len(data) > validate.MAX_DOCUMENT_BYTES
    plant(store, "manifests/big/set.json", data)
    del data

    b = start(mount_factory, "b", store)
    peak = vm_hwm(b.pid)
    assert peak < 200 << 20, f"daemon peak RSS {peak >> 20} MiB after the mount"
    assert os.listdir(b.path) == ["small.pt"]
    assert (b.path / "small.pt").read_bytes() == b"small"
    after_listings(b, 2)
    why = cli_status(b)["remote"]["invalid_manifests"]
    assert list(why) == ["manifests/big/set.json"] and "bytes" in why[
        "manifests/big/set.json"], why
    assert warnings_for(b, "manifests/big/set.json") == 1
    peak = vm_hwm(b.pid)
    assert peak < 200 << 20, f"daemon peak RSS {peak >> 20} MiB"
    healthy(b)
