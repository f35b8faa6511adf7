"""Restore on another node: node A (mount "a") writes checkpoints and waits until they are
durable; node B (mount "b", an EMPTY cache dir on the same store) shows them and reads them back
from the store: bit-exact with torch.load (plain and mmap) and DCP (also with another world
size), served by range, prefetched per set, read concurrently, kept in sync with the store
(sets appearing and disappearing), evicted under a small cache, checked chunk by chunk against
the manifest's CRC32C (a damaged store object answers EIO, a damaged cache file is repaired), and
riding out store errors.

Every test checks at the end that neither daemon logged an unexpected error.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp
from ckpt_restore import FileStoreView, S3StoreView, manifests

import ckptfs
from cachemgr.store.crt import HAVE_CRT
from tests.conftest import run_cli, start_ranks, wait_for
from tests.dcpranks import load_rank, mixed_state, save_rank

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:Detected an existing checkpoint:UserWarning"),
]

MiB = 1 << 20
CHUNK = 4 * MiB  # the default chunk_size of objects (docs/FORMAT.md)


# ----------------------------------------------------------------------------------------------
# helpers


def store_args(a, store) -> list[str]:
    """--store arguments for node B: A's file:// store, or the S3 bucket A uses."""
    if store is None:
        return ["--store", f"file://{a.store_dir}"]
    endpoint, bucket = store
    return ["--store", f"s3://{bucket}/p", "--s3-endpoint", endpoint, "--s3-path-style"]


def start_pair(nodes, s3=None):
    """Node A started on its own file:// store (or the S3 bucket); node B not started yet,
    with an empty cache dir, and the --store arguments that put it on A's store."""
    a = nodes("a")
    if s3 is None:
        a.start()
    else:
        a.start(*store_args(a, s3), "--part-size", "5M")
    b = nodes("b")
    return a, b, store_args(a, s3)


def view_of(a, s3=None):
    if s3 is None:
        return FileStoreView(a.store_dir)
    endpoint, bucket = s3
    return S3StoreView(endpoint, bucket, "p")


def rstat(m) -> dict:
    return ckptfs.status(m.path)["tiering"]["restore"]


def remote_stat(m) -> dict:
    return ckptfs.status(m.path)["tiering"]["remote"]


def wait_shown(b, rel: str, timeout: float = 30.0) -> Path:
    p = b.path / rel
    wait_for(lambda: os.path.lexists(p), timeout=timeout, what=f"{rel} on node B")
    return p


def write_file(path: Path, data: bytes, mode: int | None = None,
               mtime_ns: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(data)
    if mode is not None:
        os.chmod(path, mode)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


def make_set(root: Path, rel: str, files: dict[str, bytes], **kw) -> Path:
    """Write `files` into <rel>.tmp and rename it into place: a directory set (reason rename)."""
    final = root / rel
    tmp = final.with_name(final.name + ".tmp")
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        write_file(tmp / name, data, **kw)
    os.rename(tmp, final)
    return final


def read_range(path: Path, off: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        out = bytearray()
        while len(out) < n:
            b = os.pread(fd, n - len(out), off + len(out))
            if not b:
                break
            out += b
        return bytes(out)
    finally:
        os.close(fd)


def chunks(size: int) -> int:
    return math.ceil(size / CHUNK)


def rand(n: int, seed: int) -> bytes:
    """Incompressible bytes, deterministic (lz4 auto-compression leaves them raw)."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8).numpy().tobytes()


def data_usage(m) -> int:
    """Bytes on disk (allocated blocks) of node m's cache data files."""
    total = 0
    with os.scandir(m.cache_dir / "data") as it:
        for e in it:
            try:
                total += e.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def assert_same(a, b, path: str = "sd") -> None:
    """Recursive bit-exact equality of checkpoint objects (dtype, shape, raw bytes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {b.dtype}{b.shape}"
        if a.numel():
            ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
            bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(ab, bb), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: sequence"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {b!r} != {a!r}"


def blank_like(sd):
    if isinstance(sd, torch.Tensor):
        return torch.full_like(sd, 7) if sd.dtype != torch.bool else torch.ones_like(sd)
    if isinstance(sd, dict):
        return {k: blank_like(v) for k, v in sd.items()}
    return sd


def model_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(1024, 1024, generator=g),                    # 4 MiB fp32
        "w2": torch.randn(777, 1001, generator=g).to(torch.bfloat16),
        "w_t": torch.randn(300, 257, generator=g).t(),                 # non-contiguous
        "ids": torch.randint(-(2**62), 2**62, (65_537,), generator=g, dtype=torch.int64),
        "mask": torch.rand(1000, generator=g) > 0.5,
        "zeros": torch.zeros(1 << 20),                                 # compressible: lz4
        "neg_zero": torch.tensor([-0.0, 0.0, float("inf"), -float("inf")]),
        "empty": torch.empty(0, 3),
        "step": torch.tensor(seed),
    }


def file_meta(root: Path) -> dict[str, tuple]:
    """{relative path: (kind, size, mode, mtime_ns or link target)} of a tree."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode), st.st_mtime_ns)
            else:
                out[rel] = ("file", st.st_size, stat.S_IMODE(st.st_mode), st.st_mtime_ns)
    return out


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while c := f.read(MiB):
            h.update(c)
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# 1. cold restore on node B: torch.load, torch.load(mmap=True), dcp.load; metadata, symlinks


@pytest.fixture(params=["file", "s3"])
def store(request):
    return None if request.param == "file" else request.getfixturevalue("s3_bucket")


def test_cold_restore_bit_exact(nodes, store):
    a, b, bargs = start_pair(nodes, s3=store)
    # torch.save the careful way: tmp + os.replace, then a `latest` symlink replaced atomically.
    run = a.path / "run"
    run.mkdir()
    sd = model_state(1)
    torch.save(sd, run / "model.pt.tmp")
    os.chmod(run / "model.pt.tmp", 0o640)
    os.replace(run / "model.pt.tmp", run / "model.pt")
    os.symlink("model.pt", run / ".latest.tmp")
    os.replace(run / ".latest.tmp", run / "latest")
    # A DCP checkpoint (committed when .metadata lands).
    dsd = {"model": model_state(2), "extra": {"lr": torch.tensor(0.5)}, "step": 2}
    dcp.save(dsd, checkpoint_id=str(run / "step_2"))
    # A directory set with a subdirectory, odd modes, set mtimes and an inner symlink.
    files = {"rank0.bin": rand(5 * MiB + 17, 3), "sub/rank1.bin": rand(MiB, 4),
             "empty.bin": b""}
    tmp = run / "plain.tmp"
    (tmp / "sub").mkdir(parents=True)
    for name, data in files.items():
        write_file(tmp / name, data, mode=0o600, mtime_ns=1_600_000_000_123_456_789)
    os.symlink("rank0.bin", tmp / "first")
    os.chmod(tmp / "sub", 0o750)
    d = run / "plain"
    os.rename(tmp, d)
    for p in (run / "model.pt", run / "latest", run / "step_2", d):
        ckptfs.wait_durable(p, timeout=120)
    man = manifests(view_of(a, store))
    assert {"run/model.pt", "run/latest", "run/step_2", "run/plain"} <= set(man)
    assert man["run/latest"]["kind"] == "symlink"
    expect = file_meta(a.path)

    # On S3, B restores through the CRT both ways (`--s3-transfer crt`), A with the default
    # (uploads by sendfile over http://, restores by boto3): the other restore tests cover the
    # default's GETs.
    b.start(*bargs, *(("--s3-transfer", "crt") if store is not None else ()))
    assert data_usage(b) == 0  # nothing cached yet
    for rel in ("run/model.pt", "run/latest", "run/step_2/.metadata", "run/plain/first"):
        wait_shown(b, rel)
    got = file_meta(b.path)
    # Files: sizes, modes and mtimes (ns) as on A; symlinks with their targets; subdir modes.
    files_a = {k: v for k, v in expect.items() if v[0] in ("file", "link")}
    files_b = {k: v for k, v in got.items() if v[0] in ("file", "link")}
    assert files_b == files_a
    # Directories: the same modes; a set's subdirectory has its mtime from the manifest too.
    assert {k: v[:2] for k, v in got.items() if v[0] == "dir"} == \
        {k: v[:2] for k, v in expect.items() if v[0] == "dir"}
    assert got["run/plain/sub"] == expect["run/plain/sub"]
    assert got["run/plain/sub"][1] == 0o750
    assert os.readlink(b.path / "run" / "latest") == "model.pt"
    # Data: bit-exact through every loader.
    assert_same(sd, torch.load(b.path / "run" / "model.pt", mmap=True, weights_only=True))
    assert_same(sd, torch.load(b.path / "run" / "latest", weights_only=True))
    target = blank_like(dsd)
    dcp.load(target, checkpoint_id=str(b.path / "run" / "step_2"))
    assert_same(dsd, target)
    for name, data in files.items():
        assert (b.path / "run" / "plain" / name).read_bytes() == data
    for rel, v in files_a.items():
        if v[0] == "file":
            assert sha(b.path / rel) == sha(a.path / rel), rel
    st = rstat(b)
    assert st["bytes_fetched"] > 0 and st["integrity_errors"] == 0
    assert remote_stat(b)["restored_sets"] >= 4
    if store is not None:  # S3 over http://: uploads by sendfile, restores boto3 (the default)
        sa = ckptfs.status(a.path)["tiering"]["store"]
        assert sa["data_path"] == "sendfile"
        dc = sa["data_client"]
        assert dc["client"] == "sendfile" and dc["put_bytes"] > 0 and dc["puts"] > 0, dc
        assert ckptfs.status(b.path)["tiering"]["store"]["data_path"] == \
            ("crt" if HAVE_CRT else "boto3")


# ----------------------------------------------------------------------------------------------
# 2. DCP saved by 2 gloo ranks on node A, loaded on node B by 1 process and by 3 gloo ranks


def test_dcp_world_size_change(nodes, tmp_path):
    a, b, bargs = start_pair(nodes)
    ckpt_a = a.path / "dist" / "step_7"
    start_ranks(save_rank, (2, str(tmp_path / "fs-save"), str(ckpt_a), mixed_state, 7), 2)
    ckptfs.wait_durable(ckpt_a, timeout=120)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ckpt_a))

    b.start(*bargs)
    ckpt_b = wait_shown(b, "dist/step_7/.metadata").parent
    assert sorted(os.listdir(ckpt_b)) == sorted(os.listdir(ckpt_a))
    # World size 1: one process loads every tensor in full.
    expected = mixed_state(7)
    target = {k: torch.full_like(v, 7) for k, v in expected.items()}
    target["meta"] = {"step": -1}
    dcp.load(target, checkpoint_id=str(ckpt_b))
    for k, v in expected.items():
        assert_same(v, target[k], k)
    assert target["meta"] == {"step": 7}
    # World size 3 on a fresh node (cold cache again): each rank loads its Shard(0) slices.
    c = nodes("c")
    c.start(*bargs)
    ckpt_c = wait_shown(c, "dist/step_7/.metadata").parent
    # (each rank also loads every tensor in full, as a job that reshards after loading)
    start_ranks(load_rank, (3, str(tmp_path / "fs-load"), str(ckpt_c), mixed_state, 7, True), 3)
    assert rstat(c)["bytes_fetched"] > 0


# ----------------------------------------------------------------------------------------------
# 3. reads served as ranges; prefetch of a whole set on open; `ckptfs prefetch`; mmap


def _restore_set(a, rel: str, files: dict[str, bytes]) -> None:
    make_set(a.path, rel, files)
    ckptfs.wait_durable(a.path / rel, timeout=120)


def test_read_fetches_only_its_chunks_and_mmap_fetches_each_chunk_once(nodes):
    a, b, bargs = start_pair(nodes)
    files = {"big.bin": rand(40 * MiB + 123, 10), "mm.bin": rand(22 * MiB + 5, 11),
             "other.bin": rand(3 * MiB, 12)}
    _restore_set(a, "ck/step_1", files)
    b.start(*bargs, "--no-prefetch")
    big = wait_shown(b, "ck/step_1/big.bin")
    assert big.stat().st_size == len(files["big.bin"])
    assert rstat(b)["chunks_fetched"] == 0
    # 1 MiB in the middle of a 40 MiB file: only the chunk(s) it covers come from the store.
    off = 20 * MiB + 1000
    assert read_range(big, off, MiB) == files["big.bin"][off:off + MiB]
    st = rstat(b)
    assert 1 <= st["chunks_fetched"] <= 2, st
    assert st["bytes_fetched"] <= 2 * CHUNK < len(files["big.bin"]) // 4, st
    assert st["jobs"] == []  # --no-prefetch: nothing fetched in the background
    # The same range again: served from the cache.
    assert read_range(big, off, MiB) == files["big.bin"][off:off + MiB]
    assert rstat(b)["chunks_fetched"] == st["chunks_fetched"]
    # The cache file holds that range (and is not filled elsewhere).
    ino = big.stat().st_ino
    cache_file = b.cache_dir / "data" / str(ino)
    assert read_range(cache_file, off, MiB) == files["big.bin"][off:off + MiB]
    assert cache_file.stat().st_blocks * 512 <= 2 * CHUNK + MiB

    # mmap of a cold file, touching every page: one GET per 4 MiB chunk, not one per page.
    before = rstat(b)["chunks_fetched"]
    mm = b.path / "ck" / "step_1" / "mm.bin"
    with open(mm, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        page = mmap.PAGESIZE
        h = hashlib.sha256()
        for i in range(0, len(m), page):  # page by page, in order
            h.update(m[i:i + page])
        assert h.digest() == hashlib.sha256(files["mm.bin"]).digest()
    st = rstat(b)
    assert st["chunks_fetched"] - before == chunks(len(files["mm.bin"])), st
    assert st["integrity_errors"] == 0


def test_open_prefetches_the_set_and_cli_prefetch(nodes):
    a, b, bargs = start_pair(nodes)
    set1 = {"__0_0.distcp": rand(9 * MiB + 1, 20), "__1_0.distcp": rand(6 * MiB, 21),
            "sub/extra.bin": rand(MiB + 7, 22), ".metadata": b"meta" * 100}
    set2 = {"a.bin": rand(5 * MiB, 23), "b.bin": rand(2 * MiB + 3, 24)}
    _restore_set(a, "ck/step_1", set1)
    _restore_set(a, "ck/step_2", set2)
    b.start(*bargs)
    # Opening one file of a cold set prefetches the whole set in the background.
    meta = wait_shown(b, "ck/step_1/.metadata")
    with open(meta, "rb") as f:
        assert f.read() == set1[".metadata"]
    total = sum(len(v) for v in set1.values())

    def job_done():
        jobs = {j["path"]: j for j in rstat(b)["jobs"]}
        j = jobs.get("ck/step_1")
        return j if j and j["finished"] else None

    job = wait_for(job_done, timeout=60, what="prefetch of ck/step_1")
    # The job counts what it had to fetch when it started: the .metadata the read above asked
    # for may already have been in the cache by then (its read and the job race; either way
    # each chunk is fetched once, as the counts below check).
    meta_first = job["files"] == len(set1) - 1
    want = total - (len(set1[".metadata"]) if meta_first else 0)
    assert job["error"] is None and job["bytes_total"] == want, job
    assert job["bytes_done"] == want and job["files"] in (len(set1), len(set1) - 1), job
    # Every file's data is in B's cache file, bit-exact, before anyone read it.
    for name, data in set1.items():
        ino = (b.path / "ck" / "step_1" / name).stat().st_ino
        assert (b.cache_dir / "data" / str(ino)).read_bytes() == data, name
    st = rstat(b)
    n = sum(chunks(len(v)) for v in set1.values())
    assert st["chunks_fetched"] == n, st
    # The set ck/step_2 was not touched.
    assert "ck/step_2" not in {j["path"] for j in st["jobs"]}
    for name, data in set1.items():
        assert (b.path / "ck" / "step_1" / name).read_bytes() == data
    assert rstat(b)["chunks_fetched"] == n  # reads needed no more fetches

    # `ckptfs prefetch PATH` on a file of the other set: exit 0, the whole set is in afterwards.
    res = run_cli("prefetch", str(b.path / "ck" / "step_2" / "a.bin"))
    assert res.returncode == 0, res.stderr
    assert "prefetched ck/step_2" in res.stdout, res.stdout
    st = rstat(b)
    n2 = sum(chunks(len(v)) for v in set2.values())
    assert st["chunks_fetched"] == n + n2, st
    for name, data in set2.items():
        assert (b.path / "ck" / "step_2" / name).read_bytes() == data
    assert rstat(b)["chunks_fetched"] == n + n2
    # Again: already cached, still exit 0.
    res = run_cli("prefetch", str(b.path / "ck" / "step_2"))
    assert res.returncode == 0 and "already cached" in res.stdout, (res.stdout, res.stderr)


# ----------------------------------------------------------------------------------------------
# 4. concurrent readers of a cold set


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_concurrent_cold_readers_fetch_each_chunk_once(nodes, prefetch):
    a, b, bargs = start_pair(nodes)
    files = {"shared.bin": rand(24 * MiB + 999, 30), "r1.bin": rand(9 * MiB, 31),
             "r2.bin": rand(5 * MiB + 1, 32), "r3.bin": rand(13 * MiB, 33)}
    _restore_set(a, "ck/step_3", files)
    b.start(*bargs, *([] if prefetch else ["--no-prefetch"]))
    d = wait_shown(b, "ck/step_3/r3.bin").parent
    errors: list[BaseException] = []
    go = threading.Barrier(8)

    def reader(name: str, order: str, size: int) -> None:
        try:
            data = files[name]
            offs = list(range(0, len(data), size))
            if order == "reverse":
                offs.reverse()
            elif order == "stride":
                offs = offs[::2] + offs[1::2]
            fd = os.open(d / name, os.O_RDONLY)
            try:
                go.wait(timeout=30)
                for off in offs:
                    got = os.pread(fd, size, off)
                    assert got == data[off:off + size], (name, order, off)
            finally:
                os.close(fd)
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=reader, args=args) for args in (
        ("shared.bin", "forward", 1 * MiB), ("shared.bin", "reverse", 256 * 1024),
        ("shared.bin", "stride", 3 * MiB + 1), ("shared.bin", "forward", 128 * 1024 + 3),
        ("shared.bin", "reverse", 5 * MiB),
        ("r1.bin", "forward", MiB), ("r2.bin", "reverse", 700_000), ("r3.bin", "stride", MiB))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not errors, errors
    for name, data in files.items():
        assert sha(d / name) == hashlib.sha256(data).hexdigest(), name
    total = sum(chunks(len(v)) for v in files.values())
    if prefetch:
        wait_for(lambda: all(j["finished"] for j in rstat(b)["jobs"]), timeout=60,
                 what="prefetch to finish")
    st = rstat(b)
    assert st["chunks_fetched"] == total, st  # each chunk fetched exactly once
    assert st["bytes_fetched"] == sum(len(v) for v in files.values()), st


# ----------------------------------------------------------------------------------------------
# 5. the store's namespace follows node A: new sets appear, deleted sets disappear


def test_sets_committed_later_appear_and_deleted_sets_disappear(nodes):
    a, b, bargs = start_pair(nodes)
    view = view_of(a)
    first = {"w.bin": rand(MiB, 40)}
    _restore_set(a, "run/step_1", first)
    b.start(*bargs, "--refresh-interval", "1")
    assert (wait_shown(b, "run/step_1/w.bin")).read_bytes() == first["w.bin"]
    syncs = remote_stat(b)["syncs"]
    wait_for(lambda: remote_stat(b)["syncs"] >= syncs + 2, timeout=10, what="periodic syncs")

    # Committed on A while B is up: B shows them within the refresh interval (plus a listing).
    sd = model_state(5)
    dcp.save(sd, checkpoint_id=str(a.path / "run" / "step_2"))
    torch.save({"step": 2}, a.path / "run" / "state.pt")
    os.symlink("step_2", a.path / "run" / ".latest.tmp")
    os.replace(a.path / "run" / ".latest.tmp", a.path / "run" / "latest")
    for p in ("step_2", "state.pt", "latest"):
        ckptfs.wait_durable(a.path / "run" / p, timeout=60)
    for rel in ("run/step_2/.metadata", "run/state.pt", "run/latest"):
        wait_shown(b, rel, timeout=15)
    assert os.readlink(b.path / "run" / "latest") == "step_2"
    target = blank_like(sd)
    dcp.load(target, checkpoint_id=str(b.path / "run" / "latest"))
    assert_same(sd, target)
    assert torch.load(b.path / "run" / "state.pt", weights_only=True) == {"step": 2}
    assert sorted(os.listdir(b.path / "run")) == sorted(os.listdir(a.path / "run"))

    # Rotation on A: the set leaves the store, then B drops it after a refresh.
    shutil.rmtree(a.path / "run" / "step_1")
    wait_for(lambda: "run/step_1" not in manifests(view), timeout=60, what="manifest deletion")
    wait_for(lambda: not os.path.lexists(b.path / "run" / "step_1"), timeout=15,
             what="run/step_1 to disappear on B")
    assert "step_1" not in os.listdir(b.path / "run")
    assert remote_stat(b)["removed_sets"] >= 1
    # The other sets stay and still read.
    target = blank_like(sd)
    dcp.load(target, checkpoint_id=str(b.path / "run" / "step_2"))
    assert_same(sd, target)
    # A re-save of a file set on A replaces it on B: readers see the old file or the new one.
    torch.save({"step": 3}, a.path / "run" / "state.pt")
    ckptfs.wait_durable(a.path / "run" / "state.pt", timeout=60)
    wait_for(lambda: torch.load(b.path / "run" / "state.pt", weights_only=True) == {"step": 3},
             timeout=15, what="the re-saved run/state.pt on B")
    # A re-save of a path on A replaces the set on B with the new content.
    first2 = {"w.bin": rand(2 * MiB, 41)}
    shutil.rmtree(a.path / "run" / "step_2")
    wait_for(lambda: "run/step_2" not in manifests(view), timeout=60, what="manifest deletion")
    _restore_set(a, "run/step_2", first2)
    wait_for(lambda: os.path.exists(b.path / "run" / "step_2" / "w.bin"), timeout=15,
             what="the new run/step_2 on B")
    assert (b.path / "run" / "step_2" / "w.bin").read_bytes() == first2["w.bin"]
    assert not os.path.exists(b.path / "run" / "step_2" / ".metadata")


# ----------------------------------------------------------------------------------------------
# 6. eviction under a small cache on node B


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_small_cache_evicts_while_restoring(nodes, prefetch):
    a, b, bargs = start_pair(nodes)
    files = {f"shard_{i}.bin": rand(20 * MiB + i, 50 + i) for i in range(5)}  # ~100 MiB
    _restore_set(a, "ck/big", files)
    limit = 64 * MiB
    b.start(*bargs, "--cache-size", "64M", *([] if prefetch else ["--no-prefetch"]))
    d = wait_shown(b, "ck/big/shard_4.bin").parent
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, data_usage(b))
            stop.wait(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        # Sparse reads first (as a resume with another world size reads its byte ranges):
        # 4 of the 5 chunks of every file, 80 MiB of partly restored files in all.
        for name, data in files.items():
            for i in range(4):
                off = i * CHUNK + 1000 * i
                assert read_range(d / name, off, 64 * 1024) == data[off:off + 64 * 1024]
            peak = max(peak, data_usage(b))
        for _ in range(2):  # twice: the second pass reads back what was evicted
            for name, data in files.items():
                with open(d / name, "rb") as f:
                    h = hashlib.sha256()
                    while c := f.read(MiB):
                        h.update(c)
                assert h.digest() == hashlib.sha256(data).digest(), name
                peak = max(peak, data_usage(b))
        if prefetch:
            wait_for(lambda: all(j["finished"] for j in rstat(b)["jobs"]), timeout=60,
                     what="prefetch jobs to end")
    finally:
        stop.set()
        sampler.join()
    cache = ckptfs.status(b.path)["cache"]
    # Near the limit: the cache's own count stays under it, and so does the disk (room is made
    # before a chunk is fetched); one chunk of slack for the sampler racing a truncate.
    slack = CHUNK
    assert peak <= limit + slack, f"cache data peaked at {peak / MiB:.1f} MiB"
    assert data_usage(b) <= limit + slack
    assert cache["cached_bytes"] <= limit, cache
    st = rstat(b)
    assert st["chunks_fetched"] > sum(chunks(len(v)) for v in files.values())  # re-fetched
    if prefetch:
        # The prefetch of a set larger than the cache stops when the cache is full, instead of
        # evicting what it brought in; reads fetch the rest.
        assert "prefetch ck/big stopped" in b.log_text()
        assert all(j["finished"] for j in st["jobs"]), st["jobs"]
    else:
        # Asked for explicitly, the prefetch of a set larger than the cache says it stopped.
        res = run_cli("prefetch", str(d))
        assert res.returncode == 1 and "the cache is full" in res.stderr, (res.stdout,
                                                                             res.stderr)
        assert data_usage(b) <= limit + slack


# ----------------------------------------------------------------------------------------------
# 7. integrity: a damaged store object answers EIO; a damaged cache file is repaired


def flip_byte(path: Path, off: int) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


def test_damaged_store_object_answers_eio(nodes):
    a, b, bargs = start_pair(nodes)
    files = {"bad.bin": rand(12 * MiB, 60), "good.bin": rand(6 * MiB + 1, 61),
             "zeros.bin": bytes(9 * MiB)}
    _restore_set(a, "ck/step_9", files)
    man = manifests(view_of(a))["ck/step_9"]
    objs = {f["path"]: f["object"] for f in man["files"]}
    bad = objs["bad.bin"]
    assert bad["compression"] == "none" and bad["chunk_size"] == CHUNK, bad
    assert objs["zeros.bin"]["compression"] == "lz4"
    flip_byte(a.store_dir / "objects" / bad["key"], CHUNK + 12345)  # in chunk 1

    b.start(*bargs, "--no-prefetch")
    p = wait_shown(b, "ck/step_9/bad.bin")
    # Chunk 0 and chunk 2 are intact and read fine.
    assert read_range(p, 0, MiB) == files["bad.bin"][:MiB]
    assert read_range(p, 2 * CHUNK + 5, MiB) == files["bad.bin"][2 * CHUNK + 5:2 * CHUNK + 5 + MiB]
    # The damaged range: EIO, not wrong bytes; and again on a retry.
    for _ in range(2):
        with pytest.raises(OSError) as ei:
            read_range(p, CHUNK + 12000, 4096)
        assert ei.value.errno == errno.EIO
    with pytest.raises(OSError) as ei:
        p.read_bytes()
    assert ei.value.errno == errno.EIO
    # The daemon says which object is damaged.
    lines = [ln for ln in b.log_text().splitlines() if bad["key"] in ln and "chunk 1" in ln]
    assert any("ERROR" in ln for ln in lines), b.log_text()[-3000:]
    st = rstat(b)
    assert st["integrity_errors"] >= 1, st
    # The other files of the set still read fine.
    assert (b.path / "ck" / "step_9" / "good.bin").read_bytes() == files["good.bin"]
    assert (b.path / "ck" / "step_9" / "zeros.bin").read_bytes() == files["zeros.bin"]


def _vm_hwm_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def _replace_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".planted")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # a new inode: the store's etag changes, its sidecar CRC no longer counts


def _lz4_frame_of_zeros(n: int) -> bytes:
    """One standard lz4 frame of n zero bytes, built 64 MiB at a time (1 GiB gives ~4 MB)."""
    import lz4.frame

    c = lz4.frame.LZ4FrameCompressor(block_size=lz4.frame.BLOCKSIZE_MAX4MB,
                                      content_checksum=False)
    out, piece = [c.begin()], bytes(64 * MiB)
    for done in range(0, n, len(piece)):
        out.append(c.compress(piece[:min(len(piece), n - done)]))
    out.append(c.flush())
    return b"".join(out)


def test_lz4_bomb_in_store_answers_eio_in_bounded_memory(nodes):
    """A stored frame that expands to 1 GiB where the manifest says 4 MiB: the read gets EIO,
    the daemon lives, and it never holds more than about one frame of output."""
    a, b, bargs = start_pair(nodes)
    a.stop()
    a.start("--compress", "lz4")
    files = {"z.bin": bytes(CHUNK), "ok.bin": bytes(MiB)}
    _restore_set(a, "ck/bomb", files)
    a.stop()
    store = a.store_dir / "objects"
    man_path = store / "manifests" / "ck" / "bomb.json"
    man = json.loads(man_path.read_text())
    obj = next(f["object"] for f in man["files"] if f["path"] == "z.bin")
    assert obj["compression"] == "lz4" and obj["frame_size"] == CHUNK and len(obj["frames"]) == 1
    bomb = _lz4_frame_of_zeros(1 << 30)
    assert len(bomb) < 8 * MiB
    _replace_file(store / obj["key"], bomb)
    # The manifest still passes every check of cachemgr.format.validate: one frame, its length =
    # stored_size, within the compress bound of its frame size (a 4 MiB frame cannot take more
    # than ~4.02 MiB stored, so the frame size says 64 MiB, the largest allowed; the one chunk
    # CRC still covers the whole 4 MiB file). It decompresses to 1 GiB where the reader expects
    # min(frame_size, size) = 4 MiB.
    obj["frames"], obj["stored_size"] = [len(bomb)], len(bomb)
    obj["frame_size"] = obj["chunk_size"] = 64 * MiB
    _replace_file(man_path, json.dumps(man).encode())
    del bomb

    b.start(*bargs)
    p = wait_shown(b, "ck/bomb/z.bin")
    with pytest.raises(OSError) as ei:
        p.read_bytes()
    assert ei.value.errno == errno.EIO
    assert (b.path / "ck" / "bomb" / "ok.bin").read_bytes() == files["ok.bin"]
    assert ckptfs.status(b.path)["tiering"]["restore"]["integrity_errors"] >= 1
    from ckptfs.mount import pid_running

    assert pid_running(b.pid)
    assert _vm_hwm_mib(b.pid) < 400, f"daemon peaked at {_vm_hwm_mib(b.pid):.0f} MiB"
    lines = [ln for ln in b.log_text().splitlines() if obj["key"] in ln]
    assert any("ERROR" in ln and "more than the 4194304 bytes" in ln for ln in lines), \
        b.log_text()[-3000:]


def test_damaged_cache_file_is_fetched_again(nodes):
    a, b, bargs = start_pair(nodes)
    files = {"c.bin": rand(10 * MiB + 3, 70), "d.bin": bytes(5 * MiB) + rand(MiB, 71)}
    _restore_set(a, "ck/step_10", files)
    b.start(*bargs)
    res = run_cli("prefetch", str(wait_shown(b, "ck/step_10/c.bin").parent))
    assert res.returncode == 0, res.stderr
    inos = {n: (b.path / "ck" / "step_10" / n).stat().st_ino for n in files}
    for name, data in files.items():
        assert (b.cache_dir / "data" / str(inos[name])).read_bytes() == data  # fully fetched
    b.stop()
    flip_byte(b.cache_dir / "data" / str(inos["c.bin"]), CHUNK + 777)      # chunk 1
    flip_byte(b.cache_dir / "data" / str(inos["d.bin"]), 5 * MiB + 10)     # chunk 1 (lz4)
    b.start()  # same cache dir, same arguments
    before = rstat(b)
    assert before["chunks_fetched"] == 0 and before["damaged_cache_chunks"] == 0
    for name, data in files.items():
        p = b.path / "ck" / "step_10" / name
        assert p.stat().st_ino == inos[name]
        assert p.read_bytes() == data, name
    st = rstat(b)
    assert st["damaged_cache_chunks"] == 2, st
    assert st["chunks_fetched"] == 2, st  # only the damaged chunks came from the store
    assert "is damaged in chunk 1" in b.log_text()
    # The repair is on disk: read again after another remount, nothing is damaged any more.
    b.stop()
    b.start()
    for name, data in files.items():
        assert (b.path / "ck" / "step_10" / name).read_bytes() == data
        assert (b.cache_dir / "data" / str(inos[name])).read_bytes() == data
    st = rstat(b)
    assert st["damaged_cache_chunks"] == 0 and st["chunks_fetched"] == 0, st


# ----------------------------------------------------------------------------------------------
# 8. store errors during a restore


def test_restore_rides_out_store_errors(nodes, monkeypatch):
    a, b, bargs = start_pair(nodes)
    set1 = {f"__{r}_0.distcp": rand(7 * MiB + r, 80 + r) for r in range(3)}
    set1[".metadata"] = b"m" * 5000
    set1["zeros.bin"] = bytes(10 * MiB)
    set2 = {"w.bin": rand(9 * MiB, 90)}
    _restore_set(a, "ck/step_11", set1)
    _restore_set(a, "ck/step_12", set2)
    monkeypatch.setenv("CKPTFS_FAULTS", "get=every:3")  # the daemon inherits it
    b.start(*bargs)
    monkeypatch.delenv("CKPTFS_FAULTS")
    assert "fault injection active" in b.log_text()
    d = wait_shown(b, "ck/step_11/.metadata").parent
    # Prefetch on open under failing GETs: the whole set comes in, bit-exact.
    assert (d / ".metadata").read_bytes() == set1[".metadata"]
    job = wait_for(lambda: next((j for j in rstat(b)["jobs"]
                                 if j["path"] == "ck/step_11" and j["finished"]), None),
                   timeout=60, what="prefetch of ck/step_11")
    assert job["error"] is None and job["bytes_done"] == job["bytes_total"], job
    for name, data in set1.items():
        assert (d / name).read_bytes() == data, name
    # Reads of a cold file (no prefetch yet) under failing GETs, with the CLI prefetch too.
    w = wait_shown(b, "ck/step_12/w.bin")
    assert read_range(w, 4 * MiB + 3, 3 * MiB) == set2["w.bin"][4 * MiB + 3:7 * MiB + 3]
    res = run_cli("prefetch", str(w))
    assert res.returncode == 0, res.stderr
    assert w.read_bytes() == set2["w.bin"]
    st = ckptfs.status(b.path)["tiering"]
    assert st["store"]["retries"] > 0, st["store"]
    assert st["restore"]["integrity_errors"] == 0
    total = sum(chunks(len(v)) for v in set1.values()) + chunks(len(set2["w.bin"]))
    assert st["restore"]["chunks_fetched"] == total, st["restore"]
