"""Tiering through a real mount: commit rules, atomic publication, bit-exact contents in the
store (read back without ckptfs, as docs/FORMAT.md says), re-commit, deletion, compression,
status/wait. Key cases run against both the file:// store and S3 over HTTP (moto_server)."""

import json
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_restore import FileStoreView, S3StoreView, manifests, restore, restore_to

import ckptfs
from tests.conftest import run_cli, wait_for


@pytest.fixture(params=["file", "s3"])
def tiered(request, mount_factory):
    """(mount, store view) for a file:// store or a moto S3 bucket."""
    m = mount_factory("t")
    if request.param == "file":
        m.start()
        view = FileStoreView(m.store_dir)
    else:
        endpoint, bucket = request.getfixturevalue("s3_bucket")
        m.start("--store", f"s3://{bucket}/ckpts", "--s3-endpoint", endpoint, "--s3-path-style",
                "--part-size", "5M")
        view = S3StoreView(endpoint, bucket, "ckpts")
    yield m, view
    assert not m.unexpected_errors(), m.unexpected_errors()


def state_dict(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 1024, generator=g),            # 2 MiB, incompressible
            "b": torch.randn(1024, generator=g).to(torch.bfloat16),
            "zeros": torch.zeros(1 << 20),                          # compressible
            "step": torch.tensor(seed)}


def assert_equal_sd(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_dcp_set_published_bit_exact(tiered, tmp_path):
    m, view = tiered
    sd = state_dict(1)
    ckpt = m.path / "run" / "step_100"
    dcp.save(sd, checkpoint_id=str(ckpt))
    r = ckptfs.wait_durable(ckpt / ".metadata", timeout=120)
    assert r["path"] == "run/step_100"
    published = manifests(view)
    assert "run/step_100" in published
    man = published["run/step_100"]
    assert man["kind"] == "dir" and man["commit"]["reason"] == "dcp"
    names = {f["path"] for f in man["files"]}
    assert ".metadata" in names and any(n.endswith(".distcp") for n in names)
    # Restore with plain tools into a plain directory and load it with DCP, no ckptfs.
    out = restore_to(view, man, tmp_path / "restored")
    back = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(back, checkpoint_id=str(out))
    assert_equal_sd(sd, back)


def test_torch_save_tmp_rename_publishes_final_name_only(tiered, tmp_path):
    m, view = tiered
    sd = state_dict(2)
    (m.path / "ck").mkdir()
    tmp, final = m.path / "ck" / "model.pt.tmp", m.path / "ck" / "model.pt"
    torch.save(sd, tmp)
    os.replace(tmp, final)
    os.symlink("model.pt", m.path / "ck" / "latest.tmp")
    os.replace(m.path / "ck" / "latest.tmp", m.path / "ck" / "latest")
    ckptfs.wait_durable(final, timeout=120)
    ckptfs.wait_durable(m.path / "ck" / "latest", timeout=120)
    published = manifests(view)
    assert set(published) == {"ck/model.pt", "ck/latest"}
    assert published["ck/latest"]["kind"] == "symlink"
    assert published["ck/latest"]["target"] == "model.pt"
    out = restore_to(view, published["ck/model.pt"], tmp_path / "r")
    assert_equal_sd(sd, torch.load(out, weights_only=True))


def test_set_invisible_until_commit(mnt):
    view = FileStoreView(mnt.store_dir)
    d = mnt.path / "step_5"
    d.mkdir()
    shards = {f"__{r}_0.distcp": os.urandom(300_000) for r in range(3)}
    for name, data in shards.items():
        with open(d / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    with open(d / ".metadata.tmp", "wb") as f:
        f.write(b"metadata")
    # Uploads start at close, before the commit: wait until they are all done...
    def uploads_idle():
        t = ckptfs.status(mnt.path)["tiering"]["uploads"]
        return t["done"] >= 4 and t["queued"] == 0 and t["running"] == 0
    wait_for(uploads_idle, timeout=60, what="pre-commit uploads")
    assert len(view.keys("data/")) == 4
    # ...and still nothing is published: no .metadata, no set.
    assert manifests(view) == {}
    res = run_cli("wait", str(d / "__0_0.distcp"), "--timeout", "1")
    assert res.returncode == 8, res.stderr  # in no committed set
    os.rename(d / ".metadata.tmp", d / ".metadata")
    ckptfs.wait_durable(d, timeout=60)
    got = restore(view, manifests(view)["step_5"])
    assert got == {**shards, ".metadata": b"metadata"}


def test_directory_rename_commits_and_tmp_dir_is_not_a_set(mnt):
    view = FileStoreView(mnt.store_dir)
    tmp = mnt.path / "ckpt" / "step_7.tmp"
    tmp.mkdir(parents=True)
    files = {f"rank{r}.pt": os.urandom(100_000 + r) for r in range(4)}
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "extra.bin").write_bytes(b"x" * 10)
    def idle():
        return ckptfs.status(mnt.path)["tiering"]["uploads"]["queued"] == 0
    wait_for(idle, timeout=60, what="uploads")
    assert manifests(view) == {}  # files inside a *.tmp directory are not sets of their own
    os.rename(tmp, mnt.path / "ckpt" / "step_7")
    ckptfs.wait_durable(mnt.path / "ckpt" / "step_7", timeout=60)
    man = manifests(view)
    assert set(man) == {"ckpt/step_7"}
    assert restore(view, man["ckpt/step_7"]) == {**files, "sub/extra.bin": b"x" * 10}
    assert [d["path"] for d in man["ckpt/step_7"]["dirs"]] == ["sub"]


def test_resave_replaces_set_atomically_and_gc_removes_old_objects(tiered):
    m, view = tiered
    ckpt = m.path / "step_1"
    dcp.save(state_dict(10), checkpoint_id=str(ckpt))
    first = ckptfs.wait_durable(ckpt, timeout=120)
    old_keys = {f["object"]["key"] for f in manifests(view)["step_1"]["files"]}
    sd2 = state_dict(11)
    dcp.save(sd2, checkpoint_id=str(ckpt))  # shards overwritten in place, .metadata replaced
    second = ckptfs.wait_durable(ckpt, timeout=120)
    assert second["seq"] > first["seq"]
    man = manifests(view)["step_1"]
    assert man["commit"]["seq"] == second["seq"]
    new_keys = {f["object"]["key"] for f in man["files"]}
    assert not (old_keys & new_keys)
    # The store holds the new set whole; the old objects are collected.
    wait_for(lambda: not (set(view.keys("data/")) & old_keys), timeout=60, what="gc")
    restored = restore(view, man)
    assert len(restored) == len(man["files"])
    back = {k: torch.empty_like(v) for k, v in sd2.items()}
    dcp.load(back, checkpoint_id=str(ckpt))
    assert_equal_sd(sd2, back)


def test_deleting_a_set_deletes_it_in_the_store(mnt):
    view = FileStoreView(mnt.store_dir)
    for step in (1, 2, 3):
        dcp.save(state_dict(step), checkpoint_id=str(mnt.path / f"step_{step}"))
        ckptfs.wait_durable(mnt.path / f"step_{step}", timeout=60)
    keys_1 = {f["object"]["key"] for f in manifests(view)["step_1"]["files"]}
    shutil.rmtree(mnt.path / "step_1")          # rotation in training code
    (mnt.path / "step_2" / ".metadata").unlink()  # not the set root: the set stays published
    wait_for(lambda: "step_1" not in manifests(view), timeout=60, what="manifest deletion")
    wait_for(lambda: not (set(view.keys("data/")) & keys_1), timeout=60, what="object deletion")
    assert set(manifests(view)) == {"step_2", "step_3"}
    st = ckptfs.status(mnt.path)["tiering"]
    states = {s["path"]: s["state"] for s in st["sets"]}
    assert states["step_1"] == "deleted" and states["step_3"] == "durable"


def test_compression_auto_on_real_tensors_and_zeros(mnt):
    view = FileStoreView(mnt.store_dir)
    weights = torch.randn(1 << 20)  # 4 MiB of fp32 "trained weights": incompressible
    torch.save({"w": weights}, mnt.path / "weights.pt")
    (mnt.path / "zeros.bin").write_bytes(bytes(8 << 20))
    ckptfs.wait_durable(mnt.path / "weights.pt", timeout=60)
    ckptfs.wait_durable(mnt.path / "zeros.bin", timeout=60)
    man = manifests(view)
    w = man["weights.pt"]["files"][0]["object"]
    z = man["zeros.bin"]["files"][0]["object"]
    assert w["compression"] == "none" and w["stored_size"] == w["size"]
    assert z["compression"] == "lz4" and z["stored_size"] < z["size"] // 100
    assert restore(view, man["zeros.bin"])[""] == bytes(8 << 20)
    assert torch.equal(torch.load(mnt.path / "weights.pt", weights_only=True)["w"], weights)


def test_commit_and_wait_cli(mnt):
    d = mnt.path / "plain"
    d.mkdir()
    for r in range(2):
        (d / f"rank{r}.bin").write_bytes(os.urandom(50_000))
    res = run_cli("commit", str(d))
    assert res.returncode == 0, res.stderr
    res = run_cli("wait", str(d / "rank0.bin"), "--timeout", "60")
    assert res.returncode == 0, res.stderr
    assert "durable" in res.stdout
    view = FileStoreView(mnt.store_dir)
    assert "plain" in manifests(view)
    # The per-rank files were committed singly at close, then absorbed by the directory set.
    wait_for(lambda: set(manifests(view)) == {"plain"}, timeout=60, what="absorbed sets")
    res = run_cli("commit", str(mnt.path / "missing"))
    assert res.returncode == 2 and res.stderr.startswith("ckptfs: ")
    res = run_cli("wait", "/tmp", "--timeout", "1")
    assert res.returncode == 3
    st = json.loads(run_cli("status", str(mnt.path), "--json").stdout)
    assert st["tiering"]["store"]["health"] == "normal"


def test_umount_drains_uploads_and_remount_keeps_sets(mount_factory):
    m = mount_factory("d")
    m.start("--part-size", "5M")
    data = os.urandom(24 << 20)
    (m.path / "big.bin").write_bytes(data)
    res = run_cli("umount", str(m.path))  # waits until big.bin is durable
    assert res.returncode == 0, res.stderr
    m.pid = None
    view = FileStoreView(m.store_dir)
    assert restore(view, manifests(view)["big.bin"])[""] == data
    m.start()
    assert (m.path / "big.bin").read_bytes() == data
    st = ckptfs.status(m.path)["tiering"]
    assert [s["state"] for s in st["sets"] if s["path"] == "big.bin"] == ["durable"]


DEEP = 1500  # levels: past Python's recursion limit (1000), under PATH_MAX with 1-byte names


def _make_deep_tree(top, depth: int, data: bytes) -> None:
    """top/d/d/.../d/f (`depth` directories below `top`), built with directory fds."""
    os.mkdir(top)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        wfd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(wfd, data)
        os.close(wfd)
    finally:
        os.close(fd)


def _read_deep(top, depth: int) -> bytes:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        rfd = os.open("f", os.O_RDONLY, dir_fd=fd)
        try:
            return os.read(rfd, 1 << 20)
        finally:
            os.close(rfd)
    finally:
        os.close(fd)


def test_deep_tree_commits_restores_prefetches_and_deletes(mount_factory, s3_bucket):
    """A 1,500-level directory set: committed by a rename, durable, shown and read on a fresh
    node, prefetched by path on both, deleted with rm -rf; no walk in the daemon recurses.
    On S3 (moto): the file:// store's own mkdir of the bottom directory's part-record key
    recurses (pathlib), which is the store's business, not the namespace walks'."""
    endpoint, bucket = s3_bucket
    store = ["--store", f"s3://{bucket}/deep", "--s3-endpoint", endpoint, "--s3-path-style"]
    a = mount_factory("deep")
    a.start(*store)
    data = b"bottom of a deep tree\n"
    _make_deep_tree(a.path / "deep.tmp", DEEP, data)
    os.rename(a.path / "deep.tmp", a.path / "deep")
    assert ckptfs.wait_durable(a.path / "deep", timeout=60)["state"] == "durable"
    view = S3StoreView(endpoint, bucket, "deep")
    man = manifests(view)["deep"]
    assert [f["path"] for f in man["files"]] == ["d/" * DEEP + "f"]
    assert len(man["dirs"]) == DEEP
    res = run_cli("prefetch", str(a.path))  # walks the whole namespace from the root
    assert res.returncode == 0, res.stderr
    # A fresh node shows the set from its manifest and reads the file from the store.
    b = mount_factory("deepb")
    b.start(*store, "--no-prefetch")
    wait_for(lambda: (b.path / "deep").is_dir(), timeout=30, what="deep set on node B")
    res = run_cli("prefetch", str(b.path))
    assert res.returncode == 0, res.stderr
    assert _read_deep(b.path / "deep", DEEP) == data
    b.stop()
    res = subprocess.run(["rm", "-rf", str(a.path / "deep")], capture_output=True, text=True,
                         check=False)
    assert res.returncode == 0, res.stderr
    wait_for(lambda: "deep" not in manifests(view), timeout=60, what="manifest deletion")
    # The manifest goes first, the objects after it: until they are gone too the set is
    # `deleting` (docs/SEMANTICS.md), then `deleted`.
    wait_for(lambda: {s["path"]: s["state"]
                      for s in ckptfs.status(a.path)["tiering"]["sets"]}["deep"] == "deleted",
             timeout=60, what="the deep set deleted (its objects too)")
    assert os.listdir(a.path) == []
    for m in (a, b):
        assert not m.unexpected_errors(), m.unexpected_errors()
