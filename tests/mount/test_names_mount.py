"""File names that are not UTF-8 (Linux names are bytes), through real mounts: sets holding such
names uploaded, published (S3 keys and strict JSON), restored with their exact byte names on a
fresh node and without ckptfs, rotated away, with every directory's link count right. (The
escaped form itself, docs/FORMAT.md "Names": tests/unit/test_names.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

from ckpt_restore import FileStoreView, S3StoreView, manifests, restore_to

import ckptfs
from cachemgr.core.fs import CacheFs
from tests.conftest import REPO, ckptfs_cmd, wait_for
from tests.names_helpers import _strict

# ----------------------------------------------------------------------------------------------
# through real mounts


def fs(p) -> bytes:
    return os.fsencode(p)


def write(path: bytes, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def snapshot(root: bytes) -> dict[bytes, tuple]:
    """{relative path: ("dir",) | ("file", bytes) | ("link", target)} under `root`, as bytes."""
    out: dict[bytes, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    out[rel] = ("file", f.read())
    return out


def check_nlinks(root: bytes) -> None:
    """Every directory's st_nlink is 2 + its subdirectories, as on a local filesystem."""
    for dirpath, dirnames, _ in os.walk(root):
        subdirs = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        assert os.lstat(dirpath).st_nlink == 2 + len(subdirs), (dirpath, sorted(dirnames))


def check_offline(m) -> None:
    """After the unmount: the cache's index passes its invariants (link counts included)."""
    cache = CacheFs.load(m.cache_dir)
    try:
        assert cache.check_consistency() == []
    finally:
        cache.index.close()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """conftest.run_cli, with output decoded as the shell would show it: the CLI prints the
    paths it was given, bytes that are not UTF-8 included."""
    res = subprocess.run(ckptfs_cmd(*args), capture_output=True, timeout=timeout, cwd=REPO,
                         check=False)
    res.stdout = res.stdout.decode("utf-8", "surrogateescape")
    res.stderr = res.stderr.decode("utf-8", "surrogateescape")
    return res


def tiering_status(m) -> dict:
    return ckptfs.status(m.path)["tiering"]


def no_worker_died(m) -> None:
    err = tiering_status(m)["store"]["last_error"] or ""
    assert "internal" not in err, err
    assert not m.unexpected_errors(), m.unexpected_errors()


def durable(m, rel: bytes, timeout: float = 60) -> dict:
    return ckptfs.wait_durable(os.fsdecode(fs(m.path) + b"/" + rel), timeout=timeout)


def test_non_utf8_sets_upload_publish_restore_and_rotate_on_s3(mount_factory, s3_bucket,
                                                                 tmp_path):
    endpoint, bucket = s3_bucket
    args = ["--store", f"s3://{bucket}/p", "--s3-endpoint", endpoint, "--s3-path-style",
            "--refresh-interval", "1", "--attr-timeout", "0"]
    a = mount_factory("a")
    a.start(*args)
    A = fs(a.path)
    os.mkdir(A + b"/ckpts")
    # A DCP-like directory: shards (one with a non-UTF-8 name, one in a non-UTF-8 subdirectory),
    # an empty directory, a symlink, then .metadata.tmp renamed to .metadata (the commit).
    step = A + b"/ckpts/step_\xff"
    os.mkdir(step)
    os.mkdir(step + b"/sub\xe9")
    os.mkdir(step + b"/empty\xfe%")
    for rel in (b"__0_0.distcp", b"shard-\xff.distcp", b"sub\xe9/x\xfe%.bin"):
        write(step + b"/" + rel, os.urandom(70_000))
    os.symlink(b"shard-\xff.distcp", step + b"/link\xff")
    write(step + b"/.metadata.tmp", b"not a pickle: the commit does not need to read it")
    os.rename(step + b"/.metadata.tmp", step + b"/.metadata")
    # A torch.save-like file: written under a temporary name, renamed into place.
    write(A + b"/ckpts/ckpt-\xff.pt.tmp", os.urandom(300_000))
    os.rename(A + b"/ckpts/ckpt-\xff.pt.tmp", A + b"/ckpts/ckpt-\xff.pt")
    # Valid UTF-8 names, with '%' and non-ASCII: committed at close, keys as they always were;
    # and a valid name that looks escaped.
    plain = [b"ckpts/50%.pt", b"ckpts/a%20b.pt", "ckpts/ckpt-é.pt".encode()]
    for rel in plain + [b"ckpts/ckpt-%C3%A9.pt"]:
        write(A + b"/" + rel, os.urandom(10_000))
    got = {r: durable(a, r)["path"] for r in
           [b"ckpts/step_\xff", b"ckpts/ckpt-\xff.pt", b"ckpts/ckpt-%C3%A9.pt"] + plain}
    assert got[b"ckpts/step_\xff"] == "ckpts/step_%FF"
    assert got[b"ckpts/ckpt-\xff.pt"] == "ckpts/ckpt-%FF.pt"

    view = S3StoreView(endpoint, bucket, "p")
    ms = manifests(view)
    assert set(ms) == {"ckpts/step_%FF", "ckpts/ckpt-%FF.pt", "ckpts/ckpt-%25C3%25A9.pt",
                       "ckpts/50%.pt", "ckpts/a%20b.pt", "ckpts/ckpt-é.pt"}
    for key in view.keys(""):
        key.encode("utf-8")
    for p, m in ms.items():
        raw = view.get(f"manifests/{p}.json")
        _strict(raw)
        assert b"\\udc" not in raw
        assert m["version"] == (1 if p.encode() in plain else 2), p
    assert {f["path"] for f in ms["ckpts/step_%FF"]["files"]} == {
        "__0_0.distcp", "shard-%FF.distcp", "sub%E9/x%FE%25.bin", ".metadata"}
    assert ms["ckpts/step_%FF"]["symlinks"] == [{"path": "link%FF", "target": "shard-%FF.distcp"}]
    # Restored without ckptfs, with the exact byte names.
    out = tmp_path / "restored"
    for m in ms.values():
        restore_to(view, m, out)
    want = snapshot(A + b"/ckpts")
    assert snapshot(fs(out) + b"/ckpts") == want
    assert b"step_\xff" in os.listdir(fs(out) + b"/ckpts")

    # A fresh node with an empty cache on the same store shows every set, byte for byte.
    b = mount_factory("b")
    b.start(*args)
    B = fs(b.path)
    wait_for(lambda: all(os.path.lexists(B + b"/" + r) for r in
                         [b"ckpts/step_\xff/link\xff", b"ckpts/ckpt-\xff.pt"] + plain),
             timeout=30, what="the sets on node B")
    assert sorted(os.listdir(B + b"/ckpts")) == sorted(os.listdir(A + b"/ckpts"))
    assert snapshot(B + b"/ckpts") == want
    assert tiering_status(b)["remote"]["not_restored"] == {}
    for root in (A, B):
        check_nlinks(root)

    # Rotation: the sets go from the store and from node B, objects included.
    keys = {f["object"]["key"] for p in ("ckpts/step_%FF", "ckpts/ckpt-%FF.pt")
            for f in ms[p]["files"]}
    shutil.rmtree(step)
    os.unlink(A + b"/ckpts/ckpt-\xff.pt")
    os.unlink(A + b"/" + plain[2])
    wait_for(lambda: set(manifests(view)) == {"ckpts/ckpt-%25C3%25A9.pt", "ckpts/50%.pt",
                                              "ckpts/a%20b.pt"}, timeout=60, what="deletion")
    wait_for(lambda: not keys & set(view.keys("data/")), timeout=60, what="object deletion")
    wait_for(lambda: not os.path.lexists(B + b"/ckpts/step_\xff") and
             not os.path.lexists(B + b"/ckpts/ckpt-\xff.pt"), timeout=30, what="B drops them")
    states = {s["path"]: s["state"] for s in tiering_status(a)["sets"]}
    assert states["ckpts/step_%FF"] == states["ckpts/ckpt-%FF.pt"] == "deleted"
    for m, root in ((a, A), (b, B)):
        check_nlinks(root)
        no_worker_died(m)
        assert not any(s["state"] == "failed" for s in tiering_status(m)["sets"])
    for m in (a, b):
        m.stop()  # umount waits for every set: it returns only if none is stuck
        check_offline(m)


def test_directory_link_counts_when_non_utf8_directories_move_and_go(mount_factory):
    m = mount_factory("n")
    m.start("--attr-timeout", "0")
    M = fs(m.path)
    os.mkdir(M + b"/a")
    os.mkdir(M + b"/b")
    os.mkdir(M + b"/a/step_\xff.tmp")
    write(M + b"/a/step_\xff.tmp/__0_0.distcp", b"x" * 1000)
    # A directory renamed into place in another directory: the commit moves the link too.
    os.rename(M + b"/a/step_\xff.tmp", M + b"/b/step_\xff")
    os.mkdir(M + b"/a/e\xff")
    os.rmdir(M + b"/a/e\xff")
    assert os.stat(M + b"/a").st_nlink == 2
    assert os.stat(M + b"/b").st_nlink == 3
    durable(m, b"b/step_\xff")
    os.rename(M + b"/b/step_\xff", M + b"/a/step_\xff")
    durable(m, b"a/step_\xff")
    check_nlinks(M)
    shutil.rmtree(M + b"/a/step_\xff")
    check_nlinks(M)
    assert os.stat(M + b"/a").st_nlink == 2 and os.listdir(M + b"/a") == []
    wait_for(lambda: manifests(FileStoreView(m.store_dir)) == {}, timeout=60, what="deletion")
    # `ckptfs commit` / `ckptfs wait` take such paths as the shell gives them (argv bytes).
    os.mkdir(M + b"/c\xff")
    write(M + b"/c\xff/r0-\xfe.bin", b"rank 0")
    res = run_cli("commit", os.fsdecode(M + b"/c\xff"))
    assert res.returncode == 0, res.stderr
    res = run_cli("wait", os.fsdecode(M + b"/c\xff/r0-\xfe.bin"), "--timeout", "60")
    assert res.returncode == 0 and "c%FF" in res.stdout, (res.stdout, res.stderr)
    wait_for(lambda: set(manifests(FileStoreView(m.store_dir))) == {"c%FF"}, timeout=60,
             what="the per-file set absorbed by the directory set")
    check_nlinks(M)
    no_worker_died(m)
    m.stop()
    check_offline(m)


def test_names_too_long_for_a_plain_key_publish_under_a_hashed_key(mount_factory):
    """Every valid name maps to a key every store can hold (cachemgr.format.keys): a 255-byte name
    of non-UTF-8 bytes escapes to 765 characters, a 253-byte UTF-8 name makes a 258-byte
    `<name>.json`; neither fits a file:// store's 255-byte file names. Both sets (a file, and a
    directory renamed into place) are published under `manifests/%25/<sha256>.json`, a fresh
    node shows and reads them, and their deletion reaches it (it finds a hashed key's path in
    the document only)."""
    a = mount_factory("a")
    a.start("--refresh-interval", "1", "--attr-timeout", "0")
    A = fs(a.path)
    long_bytes, long_text = b"\xff" * 255, "é" * 126 + "x"  # 253 bytes of UTF-8
    write(A + b"/" + long_bytes, b"data")
    os.mkdir(A + b"/d.tmp")
    write(A + b"/d.tmp/" + long_text.encode(), b"inside")
    os.rename(A + b"/d.tmp", A + b"/" + long_text.encode())
    for rel in (long_bytes, long_text.encode()):
        res = run_cli("wait", os.fsdecode(A + b"/" + rel), "--timeout", "60")
        assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    keys = sorted(k for k in os.listdir(os.path.join(a.store_dir, "objects", "manifests", "%25")))
    assert len(keys) == 2 and all(len(k) == 64 + len(".json") for k in keys), keys
    b = mount_factory("b")
    b.start("--store", f"file://{a.store_dir}", "--refresh-interval", "1", "--attr-timeout", "0")
    B = fs(b.path)
    with open(B + b"/" + long_bytes, "rb") as f:
        assert f.read() == b"data"
    with open(B + b"/" + long_text.encode() + b"/" + long_text.encode(), "rb") as f:
        assert f.read() == b"inside"
    os.unlink(A + b"/" + long_bytes)
    wait_for(lambda: not os.path.lexists(B + b"/" + long_bytes), timeout=60,
             what="the deletion of a set with a hashed key on the other node")
    assert os.path.exists(B + b"/" + long_text.encode())
    for m in (a, b):
        no_worker_died(m)
        assert tiering_status(m)["remote"]["invalid_count"] == 0
        m.stop()
        check_offline(m)


def test_multinode_set_in_a_non_utf8_directory(mount_factory):
    """Node B announces its files of `run/step_\\xff.tmp` in a part record (escaped key and
    names, strict JSON); node A renames the directory into place and publishes both nodes'
    files; B sees the set at its new name with its own file moved there."""
    a = mount_factory("a")
    a.start("--refresh-interval", "1", "--attr-timeout", "0")
    b = mount_factory("b")
    b.start("--store", f"file://{a.store_dir}", "--refresh-interval", "1", "--attr-timeout", "0")
    A, B = fs(a.path), fs(b.path)
    for root in (A, B):
        os.makedirs(root + b"/run/step_\xff.tmp")
    data = {b"__0_0.distcp": os.urandom(50_000), b"__1_0.distcp": os.urandom(50_000),
            b"extra\xfe.bin": os.urandom(20_000)}
    write(A + b"/run/step_\xff.tmp/__0_0.distcp", data[b"__0_0.distcp"])
    write(B + b"/run/step_\xff.tmp/__1_0.distcp", data[b"__1_0.distcp"])
    write(B + b"/run/step_\xff.tmp/extra\xfe.bin", data[b"extra\xfe.bin"])
    # B's record naming its files is written in the background soon after the closes (close()
    # does not wait for the store: docs/SEMANTICS.md "Many nodes").
    view = FileStoreView(a.store_dir)
    node_b = tiering_status(b)["store"]["node"]
    key = f"parts/run/step_%FF.tmp/@{node_b}.json"
    wait_for(lambda: view.get(key) is not None and
             len(json.loads(view.get(key))["files"]) == 2, timeout=30,
             what="B's record naming both of its files")
    rec = _strict(view.get(key))
    assert rec["version"] == 2 and rec["dir"] == "run/step_%FF.tmp"
    assert {f["name"] for f in rec["files"]} == {"__1_0.distcp", "extra%FE.bin"}
    # Wait until B's files are durable (their record names their objects), then commit on A.
    wait_for(lambda: all(f["object"] for f in json.loads(
        view.get(f"parts/run/step_%FF.tmp/@{node_b}.json") or b'{"files": [{}]}')["files"]),
        timeout=60, what="B's files durable")
    os.rename(A + b"/run/step_\xff.tmp", A + b"/run/step_\xff")
    assert durable(a, b"run/step_\xff")["state"] == "durable"
    man = manifests(view)["run/step_%FF"]
    assert man["version"] == 2
    assert {f["path"] for f in man["files"]} == {"__0_0.distcp", "__1_0.distcp", "extra%FE.bin"}
    # B (not the committing node) shows the whole set at its new name, its own files moved
    # there; its step_\xff.tmp is gone, as A's is.
    wait_for(lambda: sorted(os.listdir(B + b"/run")) == [b"step_\xff"] and
             sorted(os.listdir(B + b"/run/step_\xff")) == sorted(data),
             timeout=30, what="the set at its new name on node B")
    for n, d in data.items():
        with open(B + b"/run/step_\xff/" + n, "rb") as f:
            assert f.read() == d
    assert os.listdir(A + b"/run") == [b"step_\xff"]
    assert tiering_status(b)["remote"]["adopted_files"] == 2
    for root in (A, B):
        check_nlinks(root)
    for m in (a, b):
        no_worker_died(m)
        m.stop()
        check_offline(m)
