"""Tiering under crashes, throttling, a small cache and retention, judged from the store side.

The store is read without ckptfs (`read_store`: list `manifests/`, fetch every object a manifest
names, undo the lz4 framing frame by frame, check sizes and CRC32C of the raw content), so what
is asserted is what a restore with plain tools would see (docs/FORMAT.md):

  * kill -9 of the daemon at random moments while a writer saves DCP-like directories,
    torch.save-like `x.tmp` -> `x` files and `step_<k>.tmp` -> `step_<k>` directories, and
    rotates old ones away: after every crash every set in the store is whole and bit-exact
    against the version that was committed, or absent; never torn. After the last crash and a
    clean unmount, every set whose commit completed is in the store, bit-exact.
  * a store that fails every 3rd PUT, every 2nd part upload and every 4th HEAD (S3 over HTTP):
    nothing is lost, retries are counted in `ckptfs status`.
  * --cache-size 64M with 200 MB of writes: writers are slowed, never failed; the cache stays
    near its limit; evicted files read back from the store.
  * --keep-local 1: older sets are evicted and read back; deleting a durable set removes its
    manifest and then its objects.
  * races that would leave a manifest naming a missing or overwritten object: a delete right
    after a crash between a manifest PUT and its index record; a delete and re-save of one path
    while the store is slow; a reused inode number (object keys are per inode and version).

Writers write deterministic content with a self-describing header (`content()`), so the
verifier can tell which version of a set a manifest holds, and that all its files belong to
that one version.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import crc32c as _crc32c
import lz4.frame
import pytest
from ckpt_restore import FileStoreView, S3StoreView
from procwait import Events

import ckptfs
from tests.conftest import REPO, run_cli, wait_for

MiB = 1 << 20

# ----------------------------------------------------------------------------------------------
# deterministic, self-describing content

HEADER_LEN = 192


def content(k: int, set_path: str, rel: str, size: int, compressible: bool) -> bytes:
    """The bytes of file `rel` of version `k` of set `set_path`: a header naming all of that,
    then bytes derived from it (random, or a repeated random block that lz4 squeezes)."""
    head = f"CKPT k={k} set={set_path} file={rel} size={size} c={int(compressible)}\n".encode()
    assert len(head) <= HEADER_LEN <= size, (head, size)
    head = head.ljust(HEADER_LEN, b"#")
    rng = random.Random(head)
    n = size - HEADER_LEN
    if compressible:
        block = rng.randbytes(8192)
        body = (block * (n // len(block) + 1))[:n]
    else:
        body = rng.randbytes(n)
    return head + body


def parse_header(data: bytes) -> dict | None:
    if len(data) < HEADER_LEN or not data.startswith(b"CKPT "):
        return None
    line = data[:HEADER_LEN].split(b"\n", 1)[0].decode()
    f = dict(item.split("=", 1) for item in line.split()[1:])
    return {"k": int(f["k"]), "set": f["set"], "file": f["file"], "size": int(f["size"]),
            "c": f["c"] == "1"}


def file_spec(k: int, rel: str, small: bool = False) -> tuple[int, bool]:
    """(size, compressible) of one file of version k: 1-7 MiB (multipart at --part-size 5M for
    the larger ones), some compressible."""
    rng = random.Random(f"{k}/{rel}")
    if small:
        return 4096 + rng.randrange(8192), rng.random() < 0.5
    return rng.randint(1, 7) * MiB + rng.randrange(4096), rng.random() < 0.4


# The three checkpoint shapes, by set name.
DCP_FILES = ("__0_0.distcp", "__1_0.distcp", ".metadata")
STEP_FILES = ("extra/rng.bin", "model.bin", "optim.bin")
_SET_RE = re.compile(r"^(dcp|step|model)_(\d+)(\.pt)?$")


def expected_files(set_path: str) -> tuple[str, ...]:
    name = set_path.rsplit("/", 1)[-1]
    if name.startswith("dcp_"):
        return DCP_FILES
    if name.startswith("step_"):
        return STEP_FILES
    assert name == "latest.pt" or (name.startswith("model_") and name.endswith(".pt")), name
    return ("",)


def check_set(set_path: str, files: dict[str, bytes]) -> int:
    """Assert that `files` is exactly one whole version of the set at `set_path` (right file
    list, every file's header naming this set and one same version, every byte as written);
    returns that version."""
    assert sorted(files) == sorted(expected_files(set_path)), (set_path, sorted(files))
    versions = set()
    for rel, data in files.items():
        h = parse_header(data)
        assert h is not None, f"{set_path}/{rel}: no header (foreign or torn content)"
        assert h["set"] == set_path and h["file"] == rel, (set_path, rel, h)
        assert h["size"] == len(data), (set_path, rel, h, len(data))
        want = content(h["k"], set_path, rel, h["size"], h["c"])
        assert data == want, f"{set_path}/{rel} (version {h['k']}): content differs"
        versions.add(h["k"])
    assert len(versions) == 1, f"{set_path}: files of different versions {sorted(versions)}"
    return versions.pop()


# ----------------------------------------------------------------------------------------------
# store-side verifier


class S3Reader(S3StoreView):
    """An S3 store read with plain boto3, and the etag of an object (multipart or not)."""

    def etag(self, key: str) -> str:
        return self.s3.head_object(Bucket=self.bucket, Key=self.prefix + key)["ETag"]


class TornSet(AssertionError):
    pass


def _decode(obj: dict, blob: bytes) -> bytes:
    if obj["compression"] == "none":
        assert obj["frames"] is None
        return blob
    assert obj["compression"] == "lz4", obj
    fs, size, frames = obj["frame_size"], obj["size"], obj["frames"]
    assert len(frames) == -(-size // fs), obj
    assert sum(frames) == len(blob), (obj["key"], sum(frames), len(blob))
    out, off = [], 0
    for i, n in enumerate(frames):
        raw = lz4.frame.decompress(blob[off:off + n])  # each frame stands alone
        assert len(raw) == min(fs, size - i * fs), (obj["key"], i, len(raw))
        out.append(raw)
        off += n
    return b"".join(out)


def read_store(reader, manifests: dict | None = None) -> dict[str, dict[str, bytes]]:
    """{set path: {file path: raw bytes}} of every manifest in the store. Raises TornSet
    (listing every problem) if a manifest names an object that is missing, of the wrong size,
    undecodable or whose CRC32C does not match. Only call it while nothing writes the store."""
    out: dict[str, dict[str, bytes]] = {}
    torn: list[str] = []
    for key in reader.keys("manifests/"):
        assert key.endswith(".json"), key
        set_path = key[len("manifests/"):-len(".json")]
        raw = reader.get(key)
        assert raw is not None, f"manifest {key} listed but gone: the store is not quiescent"
        m = json.loads(raw)
        assert m["format"] == "ckptfs-manifest" and m["version"] == 1, key
        assert m["path"] == set_path, (key, m["path"])
        if manifests is not None:
            manifests[set_path] = m
        files: dict[str, bytes] = {}
        for f in m["files"]:
            obj = f["object"]
            blob = reader.get(obj["key"])
            where = f"set {set_path}: file {f['path']!r}, object {obj['key']}"
            if blob is None:
                torn.append(f"{where} is missing")
                continue
            if len(blob) != obj["stored_size"]:
                torn.append(f"{where} has {len(blob)} bytes, manifest says {obj['stored_size']}")
                continue
            try:
                data = _decode(obj, blob)
            except (RuntimeError, AssertionError) as e:
                torn.append(f"{where} does not decode: {e!r}")
                continue
            if len(data) != f["size"] or obj["size"] != f["size"]:
                torn.append(f"{where}: raw size {len(data)}, manifest says {f['size']}")
            elif _crc32c.crc32c(data) != obj["crc32c"]:
                torn.append(f"{where}: CRC32C {_crc32c.crc32c(data):08x} != {obj['crc32c']:08x}")
            files[f["path"]] = data
        out[set_path] = files
    if torn:
        raise TornSet("TORN sets in the store:\n  " + "\n  ".join(torn))
    return out


def unreferenced_objects(reader) -> set[str]:
    """Data objects no manifest refers to (garbage the writing node must collect)."""
    referenced = set()
    for key in reader.keys("manifests/"):
        raw = reader.get(key)
        if raw is not None:
            referenced |= {f["object"]["key"] for f in json.loads(raw)["files"]}
    return set(reader.keys("data/")) - referenced


def _store_vs_mount(reader, in_mount: dict[str, dict[str, bytes]]) -> str:
    """What still differs between the store and the mount: the message of a failed wait."""
    try:
        store = read_store(reader)
    except (TornSet, AssertionError) as e:
        return f"the store does not read whole: {e}"
    only_mount = sorted(set(in_mount) - set(store))
    only_store = sorted(set(store) - set(in_mount))
    differ = sorted(p for p in set(store) & set(in_mount) if store[p] != in_mount[p])
    return (f"sets only in the mount {only_mount}, only in the store {only_store}, with other "
            f"content {differ}; unreferenced objects {sorted(unreferenced_objects(reader))[:10]}")


# ----------------------------------------------------------------------------------------------
# helpers


def wait_durable(path: Path, timeout: float = 120.0) -> dict:
    """ckptfs.wait_durable, tolerating the moment between close() returning and the daemon
    handling the (asynchronous) FUSE RELEASE that commits a file: until then the path is "in no
    committed set"."""
    def attempt():
        try:
            return ckptfs.wait_durable(path, timeout=timeout)
        except ckptfs.NotDurable as e:
            if e.state == "none":
                return None
            raise
    return wait_for(attempt, timeout=10, what=f"{path} to be committed")


def status_json(m) -> dict:
    res = run_cli("status", "--json", str(m.path))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def write_chunks(path: Path, data: bytes, *, fsync: bool, chunk: int = MiB, on_chunk=None):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(data), chunk):
            piece = data[off:off + chunk]
            assert os.write(fd, piece) == len(piece)
            if on_chunk is not None:
                on_chunk()
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------
# the checkpoint writer (a subprocess, so that it can be killed along with the daemon)
#
# Events on stdout, one per line, flushed: "P" progress; "B <set> <k>" a save of version k of a
# set begins; "D <set> <k>" its commit returned (rename / replace done); "X <path>" a deletion
# begins; "Y <path>" it returned; "END".


def writer_main(mnt: str, rnd: int, n_ckpts: int | None) -> None:
    root = Path(mnt) / "ckpt"
    out = sys.stdout

    def ev(*a) -> None:
        out.write(" ".join(str(x) for x in a) + "\n")
        out.flush()

    def progress() -> None:
        ev("P")

    rng = random.Random(f"writer/{rnd}")
    root.mkdir(exist_ok=True)

    def rotate(keep: int = 2) -> None:
        kinds: dict[str, list[tuple[int, str]]] = {"dcp": [], "step": [], "model": []}
        junk = []
        for name in sorted(os.listdir(root)):
            m = _SET_RE.match(name)
            if name == "latest.pt":
                continue
            if m and (m.group(1) != "dcp" or (root / name / ".metadata").exists()) and \
                    (m.group(1) == "model") == bool(m.group(3)):
                kinds[m.group(1)].append((int(m.group(2)), name))
            else:
                junk.append(name)  # leftovers of saves a crash interrupted
        old = [n for v in kinds.values() for _, n in sorted(v)[:-keep]]
        for name in old + junk:
            p = root / name
            ev("X", f"ckpt/{name}")
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
            ev("Y", f"ckpt/{name}")

    def save_files(d: Path, set_path: str, k: int, rels, fsync: bool) -> None:
        for rel in rels:
            size, comp = file_spec(k, rel, small=rel == ".metadata")
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            write_chunks(d / rel, content(k, set_path, rel, size, comp), fsync=fsync,
                         on_chunk=progress)
            progress()

    def save_dcp(k: int) -> None:
        set_path = f"ckpt/dcp_{k}"
        ev("B", set_path, k)
        d = root / f"dcp_{k}"
        d.mkdir()
        save_files(d, set_path, k, DCP_FILES[:2], fsync=True)
        size, comp = file_spec(k, ".metadata", small=True)
        write_chunks(d / ".metadata.tmp", content(k, set_path, ".metadata", size, comp),
                     fsync=True)
        progress()
        os.rename(d / ".metadata.tmp", d / ".metadata")
        ev("D", set_path, k)

    def save_torch(name: str, k: int) -> None:
        set_path = f"ckpt/{name}"
        ev("B", set_path, k)
        size, comp = file_spec(k, name, small=False)
        write_chunks(root / f"{name}.tmp", content(k, set_path, "", size, comp),
                     fsync=rng.random() < 0.5, on_chunk=progress)
        progress()
        os.replace(root / f"{name}.tmp", root / name)
        ev("D", set_path, k)

    def save_step(k: int) -> None:
        set_path = f"ckpt/step_{k}"
        ev("B", set_path, k)
        tmp = root / f"step_{k}.tmp"
        tmp.mkdir()
        save_files(tmp, set_path, k, STEP_FILES, fsync=rng.random() < 0.5)
        os.rename(tmp, root / f"step_{k}")
        ev("D", set_path, k)

    rotate()
    i = 0
    while n_ckpts is None or i < n_ckpts:
        k = rnd * 100 + i
        kind = (rnd + i) % 3
        if kind == 0:
            save_dcp(k)
        elif kind == 1:
            save_torch(f"model_{k}.pt", k)
            save_torch("latest.pt", k)
        else:
            save_step(k)
        rotate()
        i += 1
    ev("END")


def start_writer(m, rnd: int, n_ckpts: int | None, log: Path) -> subprocess.Popen:
    code = ("import sys; from tests.faults.test_tiering_crash import writer_main; "
            "writer_main(sys.argv[1], int(sys.argv[2]), "
            "None if sys.argv[3] == '-' else int(sys.argv[3]))")
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-c", code, str(m.path), str(rnd),
             "-" if n_ckpts is None else str(n_ckpts)],
            cwd=REPO, env=_child_env(), stdout=subprocess.PIPE, stderr=err)


def _child_env() -> dict:
    """Environment of a writer process that imports this module (it needs scripts/ on the path
    for ckpt_restore, as conftest gives the test process)."""
    return {**os.environ, "PYTHONPATH": str(REPO / "scripts")}


def stop_writer(w: subprocess.Popen, m) -> None:
    """Kill a writer. One blocked in a FUSE request the daemon has taken cannot die before the
    daemon answers (the kernel waits uninterruptibly): if it does not, kill the daemon too
    (aborting the connection), so that a failing test never hangs."""
    if w.poll() is None:
        w.kill()
        try:
            w.wait(timeout=10)
        except subprocess.TimeoutExpired:
            if m.pid is not None:
                m.kill9()
            w.wait(timeout=30)


class History:
    """What the writer reported, in order, per set path."""

    def __init__(self) -> None:
        self.n = 0
        self.by_path: dict[str, list[tuple[int, str, int | None]]] = {}

    def record(self, line: str) -> None:
        parts = line.split()
        if not parts or parts[0] in ("P", "END"):
            return
        self.n += 1
        kind, path = parts[0], parts[1]
        assert kind in "BDXY", line
        self.by_path.setdefault(path, []).append(
            (self.n, kind, int(parts[2]) if len(parts) > 2 else None))

    def begun(self, path: str) -> set[int]:
        return {k for _, kind, k in self.by_path.get(path, []) if kind == "B"}

    def allowed_final(self, path: str) -> tuple[set[int], bool]:
        """(versions the store may hold for `path` once everything settled, may it be absent)
        Settled means: the last writer finished cleanly and the mount drained."""
        evs = self.by_path.get(path, [])
        if evs and evs[-1][1] == "Y":
            return set(), True  # its deletion returned last: gone for sure
        last_d = max((i for i, (_, kind, _) in enumerate(evs) if kind == "D"), default=None)
        later = evs[last_d + 1:] if last_d is not None else evs
        versions = {k for _, kind, k in later if kind == "B"}
        if last_d is not None:
            versions.add(evs[last_d][2])
        # Absent is fine unless a commit completed and nothing since tried to delete it.
        may_be_absent = last_d is None or any(kind in "XY" for _, kind, _ in later)
        return versions, may_be_absent

    def delete_begun(self, path: str) -> bool:
        return any(kind == "X" for _, kind, _ in self.by_path.get(path, []))


def committed_in_mount(root: Path) -> dict[str, dict[str, bytes]]:
    """The committed sets under the mount's ckpt/ (by the writer's naming), with contents."""
    out: dict[str, dict[str, bytes]] = {}
    for name in sorted(os.listdir(root)):
        p = root / name
        m = _SET_RE.match(name)
        if name == "latest.pt" or (m and m.group(1) == "model" and m.group(3)):
            out[f"ckpt/{name}"] = {"": p.read_bytes()}
        elif m and m.group(1) in ("dcp", "step") and not m.group(3) and \
                (m.group(1) == "step" or (p / ".metadata").exists()):
            files = {}
            for dirpath, _dirs, names in os.walk(p):
                for n in names:
                    fp = Path(dirpath) / n
                    files[str(fp.relative_to(p))] = fp.read_bytes()
            out[f"ckpt/{name}"] = files
    return out


# ----------------------------------------------------------------------------------------------
# 1. the verifier catches what it must


def test_verifier_detects_torn_sets(mount_factory):
    m = mount_factory("ver")
    m.start("--compress", "lz4")
    d = m.path / "ckpt" / "dcp_7"
    d.mkdir(parents=True)
    files = {}
    for rel in DCP_FILES:
        size, comp = (6 * MiB + 1, True) if rel != ".metadata" else (5000, False)
        files[rel] = content(7, "ckpt/dcp_7", rel, size, comp)
        write_chunks(d / (rel + ".tmp" if rel == ".metadata" else rel), files[rel], fsync=True)
    os.rename(d / ".metadata.tmp", d / ".metadata")
    assert ckptfs.wait_durable(d, timeout=60)["state"] == "durable"
    m.stop()
    reader = FileStoreView(m.store_dir)
    manifests: dict = {}
    assert read_store(reader, manifests) == {"ckpt/dcp_7": files}
    assert check_set("ckpt/dcp_7", files) == 7
    objs = {f["path"]: f["object"] for f in manifests["ckpt/dcp_7"]["files"]}
    big = objs["__0_0.distcp"]
    assert big["compression"] == "lz4" and len(big["frames"]) == 2
    path = reader.root / big["key"]
    blob = path.read_bytes()
    # A flipped byte inside the second frame's compressed data.
    at = big["frames"][0] + big["frames"][1] // 2
    path.write_bytes(blob[:at] + bytes([blob[at] ^ 0x55]) + blob[at + 1:])
    with pytest.raises(TornSet, match=r"__0_0\.distcp"):
        read_store(reader)
    path.unlink()
    with pytest.raises(TornSet, match="missing"):
        read_store(reader)
    path.write_bytes(blob)
    assert read_store(reader) == {"ckpt/dcp_7": files}
    # Files of two versions in one set, or a wrong byte, are caught by check_set.
    mixed = dict(files, **{"__1_0.distcp": content(8, "ckpt/dcp_7", "__1_0.distcp",
                                                   len(files["__1_0.distcp"]), True)})
    with pytest.raises(AssertionError, match="different versions"):
        check_set("ckpt/dcp_7", mixed)
    bad = dict(files, **{"__1_0.distcp": files["__1_0.distcp"][:-1] + b"?"})
    with pytest.raises(AssertionError, match="content differs"):
        check_set("ckpt/dcp_7", bad)


# ----------------------------------------------------------------------------------------------
# 2. crash loop

ROUNDS = 36


@pytest.mark.slow  # tens of seconds: not in scripts/test.sh --quick
def test_crash_loop_store_never_torn(mount_factory, tmp_path):
    t0 = time.monotonic()
    seed = int(os.environ.get("CKPTFS_CRASH_SEED", "20261122"))  # fixed; override to explore
    rng = random.Random(seed)
    m = mount_factory("crash")
    reader = FileStoreView(m.store_dir)
    hist = History()
    wlog = tmp_path / "writer.log"
    seen: dict[str, int] = {}        # newest version of each set seen in the store so far
    ever_in_store: set[str] = set()
    prev_store: set[str] = set()
    m.start("--part-size", "5M")
    for rnd in range(ROUNDS):
        if rnd:
            m.start()  # same cache dir and store; cleans up the dead mount point
        w = start_writer(m, rnd, None, wlog)
        events = Events(w)
        try:
            n_kill = rng.randint(1, 90)
            for _ in range(n_kill):
                line = events.next(timeout=60)
                assert line is not None, (f"round {rnd}: writer died early (rc {w.wait()}); "
                                          f"see {wlog}:\n{wlog.read_text()[-3000:]}")
                hist.record(line)
            # Land the crash anywhere: mid-write, mid-upload, mid-publish, mid-delete.
            time.sleep(rng.uniform(0, 0.4))  # what is tested: a crash at a random moment
            m.kill9()
        finally:
            stop_writer(w, m)
        for line in events.rest():
            hist.record(line)
        w.stdout.close()
        # The daemon is dead: the store is quiescent. Every set in it must be whole, and one
        # version the writer really began, never older than one already seen.
        store = read_store(reader)
        for path, files in store.items():
            k = check_set(path, files)
            assert k in hist.begun(path), (rnd, path, k, hist.begun(path))
            assert k >= seen.get(path, -1), f"{path}: store went back from {seen[path]} to {k}"
            seen[path] = k
        # A published set leaves the store only by being deleted.
        vanished = [p for p in prev_store if p not in store and not hist.delete_begun(p)]
        assert not vanished, f"round {rnd}: published sets vanished: {vanished}"
        prev_store = set(store)
        ever_in_store |= set(store)

    # Last round: the writer finishes; the mount drains; nothing is lost.
    m.start()
    w = start_writer(m, ROUNDS, 4, wlog)
    events = Events(w)
    try:
        while (line := events.next(timeout=120)) is not None:
            hist.record(line)
        assert w.wait(timeout=60) == 0, wlog.read_text()[-3000:]
    finally:
        stop_writer(w, m)
    w.stdout.close()
    in_mount = committed_in_mount(m.path / "ckpt")
    assert in_mount, "the final round committed nothing"

    def settled():
        try:
            store = read_store(reader)
        except (TornSet, AssertionError):
            return False  # racing the daemon's deletes; judged strictly below
        return store == in_mount and not unreferenced_objects(reader)
    try:
        wait_for(settled, timeout=120, what="the store to match the mount (deletes and GC done)")
    except AssertionError as e:
        raise AssertionError(f"{e}: {_store_vs_mount(reader, in_mount)}") from None
    st = status_json(m)["tiering"]
    failed = [s for s in st["sets"] if s["state"] == "failed"]
    assert not failed, failed
    m.stop()  # drains uploads

    store = read_store(reader)
    assert store == in_mount
    assert not unreferenced_objects(reader)
    for path in hist.by_path:
        if path.endswith(".tmp") or ".tmp" in path.rsplit("/", 1)[-1]:
            continue
        versions, may_be_absent = hist.allowed_final(path)
        if path in store:
            k = check_set(path, store[path])
            assert k in versions, (path, k, versions, hist.by_path[path])
        else:
            assert may_be_absent, (f"{path}: committed ({hist.by_path[path]}) and never "
                                   "deleted, but not in the store after a clean unmount")
    completed = [p for p in hist.by_path
                 if any(kind == "D" for _, kind, _ in hist.by_path[p])]
    assert len(completed) >= 2 * ROUNDS // 3, f"too few commits completed: {len(completed)}"
    assert len(ever_in_store) >= 10, ever_in_store
    errors = m.unexpected_errors()
    assert not errors, "\n".join(errors)
    print(f"crash loop (seed {seed}): {ROUNDS} crashes, {len(completed)} commits completed, "
          f"{len(ever_in_store)} sets seen in the store, {time.monotonic() - t0:.0f}s")


# ----------------------------------------------------------------------------------------------
# 3. throttling and 5xx from S3


def test_throttled_s3_loses_nothing(mount_factory, s3_bucket, monkeypatch):
    endpoint, bucket = s3_bucket
    m = mount_factory("s3")
    monkeypatch.setenv("CKPTFS_FAULTS", "put=every:3,upload_part=every:2,head=every:4")
    m.start("--store", f"s3://{bucket}/pfx", "--s3-endpoint", endpoint, "--s3-path-style",
            "--part-size", "5M")
    monkeypatch.delenv("CKPTFS_FAULTS")
    assert "fault injection active" in m.log_text()
    root = m.path / "ckpt"
    root.mkdir()
    d = root / "dcp_1"
    d.mkdir()
    expect: dict[str, dict[str, bytes]] = {"ckpt/dcp_1": {}, "ckpt/model.pt": {}}
    for rel, size, comp in (("__0_0.distcp", 20 * MiB + 123, False),
                            ("__1_0.distcp", 21 * MiB + 7, True)):
        data = content(1, "ckpt/dcp_1", rel, size, comp)
        write_chunks(d / rel, data, fsync=True)
        expect["ckpt/dcp_1"][rel] = data
    meta = content(1, "ckpt/dcp_1", ".metadata", 9000, True)
    write_chunks(d / ".metadata.tmp", meta, fsync=True)
    os.rename(d / ".metadata.tmp", d / ".metadata")
    expect["ckpt/dcp_1"][".metadata"] = meta
    model = content(2, "ckpt/model.pt", "", 22 * MiB + 5, False)
    write_chunks(root / "model.pt.tmp", model, fsync=False)
    os.replace(root / "model.pt.tmp", root / "model.pt")
    expect["ckpt/model.pt"][""] = model

    assert ckptfs.wait_durable(d, timeout=180)["state"] == "durable"
    assert wait_durable(root / "model.pt", timeout=180)["state"] == "durable"

    reader = S3Reader(endpoint, bucket, "pfx")
    manifests: dict = {}
    store = read_store(reader, manifests)
    assert store == expect
    objs = [f["object"] for man in manifests.values() for f in man["files"]]
    assert any(o["compression"] == "lz4" for o in objs)
    # 20+ MiB of incompressible bytes at 5 MiB parts: multipart (S3 ETags of those end "-<n>").
    multipart = [o["key"] for o in objs if re.search(r"-\d+\"?$", reader.etag(o["key"]))]
    assert len(multipart) >= 2, multipart
    st = status_json(m)["tiering"]
    assert st["store"]["health"] == "normal", st["store"]
    assert st["store"]["retries"] > 0, st["store"]   # RetryingStore rode out the faults
    assert st["pending_sets"] == 0
    m.stop()
    assert not m.unexpected_errors(), m.unexpected_errors()


# ----------------------------------------------------------------------------------------------
# 4. backpressure with a small cache

BP_SIZES = [30, 20, 40, 25, 45, 20, 20]   # MiB: 200 MiB through a 64 MiB cache


def bp_data(i: int) -> bytes:
    return random.Random(f"bp/{i}").randbytes(BP_SIZES[i] * MiB + i)


def bp_writer_main(mnt: str) -> None:
    for i in range(len(BP_SIZES)):
        write_chunks(Path(mnt) / "ckpt" / f"f_{i}.bin", bp_data(i), fsync=False,
                     on_chunk=lambda: (sys.stdout.write("P\n"), sys.stdout.flush()))
        sys.stdout.write(f"C {i}\n")
        sys.stdout.flush()
    sys.stdout.write("END\n")
    sys.stdout.flush()


def data_dir_bytes(cache_dir: Path) -> int:
    total = 0
    with os.scandir(cache_dir / "data") as it:
        for e in it:
            try:
                total += e.stat().st_size
            except FileNotFoundError:
                pass
    return total


def test_backpressure_small_cache(mount_factory, tmp_path):
    limit = 64 * MiB
    m = mount_factory("bp")
    m.start("--cache-size", "64M")
    (m.path / "ckpt").mkdir()
    code = ("import sys; from tests.faults.test_tiering_crash import bp_writer_main; "
            "bp_writer_main(sys.argv[1])")
    with open(tmp_path / "bp-writer.log", "wb") as err:
        w = subprocess.Popen([sys.executable, "-c", code, str(m.path)], cwd=REPO,
                             env=_child_env(), stdout=subprocess.PIPE, stderr=err)
    events = Events(w)
    peak = 0
    closed = 0
    try:
        while (line := events.next(timeout=90)) is not None:  # slowed, never stuck
            peak = max(peak, data_dir_bytes(m.cache_dir))
            if line.startswith("C "):
                closed += 1
        rc = w.wait(timeout=30)
    finally:
        stop_writer(w, m)
    assert rc == 0, (tmp_path / "bp-writer.log").read_text()[-3000:]  # no ENOSPC, no EIO
    assert closed == len(BP_SIZES)
    for i in range(len(BP_SIZES)):
        assert wait_durable(m.path / "ckpt" / f"f_{i}.bin", timeout=120)["state"] == "durable"
    peak = max(peak, data_dir_bytes(m.cache_dir))
    assert peak <= limit + max(BP_SIZES) * MiB, f"cache grew to {peak / MiB:.1f} MiB"
    store = read_store(FileStoreView(m.store_dir))
    assert sorted(store) == sorted(f"ckpt/f_{i}.bin" for i in range(len(BP_SIZES)))
    for i in range(len(BP_SIZES)):
        want = bp_data(i)
        assert store[f"ckpt/f_{i}.bin"][""] == want, i
        # Through the mount: evicted files come back from the store, within the limit again.
        assert (m.path / "ckpt" / f"f_{i}.bin").read_bytes() == want, i
        assert data_dir_bytes(m.cache_dir) <= limit + max(BP_SIZES) * MiB
    st = status_json(m)
    assert st["cache"]["cached_bytes"] <= limit + max(BP_SIZES) * MiB
    m.stop()
    assert not m.unexpected_errors(), m.unexpected_errors()
    print(f"backpressure: peak cache data {peak / MiB:.1f} MiB for a {limit / MiB:.0f} MiB limit")


# ----------------------------------------------------------------------------------------------
# 5. retention and deletion


def test_keep_local_evicts_older_sets_and_delete_removes_objects(mount_factory):
    m = mount_factory("keep")
    m.start("--keep-local", "1")
    root = m.path / "ckpt"
    root.mkdir()
    datas, inos = [], []
    for i in range(3):
        data = content(i, f"ckpt/model_{i}.pt", "", 3 * MiB + i, False)
        write_chunks(root / f"model_{i}.pt.tmp", data, fsync=True)
        os.replace(root / f"model_{i}.pt.tmp", root / f"model_{i}.pt")
        assert wait_durable(root / f"model_{i}.pt")["state"] == "durable"
        datas.append(data)
        inos.append(os.stat(root / f"model_{i}.pt").st_ino)

    def cached_size(i: int) -> int:
        return os.stat(m.cache_dir / "data" / str(inos[i])).st_size

    wait_for(lambda: cached_size(0) == 0 and cached_size(1) == 0, timeout=30,
             what="the two older sets to be evicted")
    assert cached_size(2) == len(datas[2]), "the newest set must stay in the cache"
    for i in range(3):  # evicted ones are fetched back from the store
        assert (root / f"model_{i}.pt").read_bytes() == datas[i], i
        assert os.stat(root / f"model_{i}.pt").st_size == len(datas[i])
    assert cached_size(0) == len(datas[0])

    reader = FileStoreView(m.store_dir)
    manifests: dict = {}
    store = read_store(reader, manifests)
    assert store == {f"ckpt/model_{i}.pt": {"": datas[i]} for i in range(3)}
    key0 = manifests["ckpt/model_0.pt"]["files"][0]["object"]["key"]
    assert reader.get(key0) is not None

    os.unlink(root / "model_0.pt")
    wait_for(lambda: reader.get("manifests/ckpt/model_0.pt.json") is None, timeout=30,
             what="the deleted set's manifest to go")
    wait_for(lambda: reader.get(key0) is None, timeout=30, what="its object to go")
    store = read_store(reader)
    assert store == {f"ckpt/model_{i}.pt": {"": datas[i]} for i in (1, 2)}
    assert not unreferenced_objects(reader)
    m.stop()
    assert not m.unexpected_errors(), m.unexpected_errors()


# ----------------------------------------------------------------------------------------------
# deletion races: a manifest must go before the objects it names


def _set_row(cache_dir: Path, path: str) -> tuple:
    import sqlite3

    con = sqlite3.connect(cache_dir / "index.sqlite")
    try:
        return con.execute("SELECT seq, state FROM sets WHERE path=? ORDER BY seq DESC LIMIT 1",
                           (path,)).fetchone()
    finally:
        con.close()


def test_delete_after_crash_between_manifest_put_and_index(mount_factory, monkeypatch):
    """kill -9 after the manifest PUT but before the index recorded the set durable (made
    exact by rolling the index back to that state while the daemon is dead): at the next mount
    the set is live again, with its manifest in the store. Deleting it then, while the store is
    too flaky for the re-publication to have happened yet, must still take the manifest out
    before GC deletes its object: never a manifest naming a missing object."""
    import sqlite3

    m = mount_factory("amb")
    m.start()
    root = m.path / "ckpt"
    root.mkdir()
    data = content(1, "ckpt/model.pt", "", 3 * MiB, False)
    write_chunks(root / "model.pt.tmp", data, fsync=True)
    os.replace(root / "model.pt.tmp", root / "model.pt")
    assert wait_durable(root / "model.pt")["state"] == "durable"
    reader = FileStoreView(m.store_dir)
    manifests: dict = {}
    assert read_store(reader, manifests) == {"ckpt/model.pt": {"": data}}
    key = manifests["ckpt/model.pt"]["files"][0]["object"]["key"]
    m.kill9()
    con = sqlite3.connect(m.cache_dir / "index.sqlite")
    with con:
        n = con.execute("UPDATE sets SET state='uploading', durable_ns=NULL WHERE"
                        " path='ckpt/model.pt' AND state='durable'").rowcount
    con.close()
    assert n == 1
    # Two whole HEAD calls fail (8 attempts each, then a 1 s pause): the re-publication waits
    # >= 2 s, a window the unlink below lands in.
    monkeypatch.setenv("CKPTFS_FAULTS", "head=next:16")
    m.start()
    monkeypatch.delenv("CKPTFS_FAULTS")
    assert _set_row(m.cache_dir, "ckpt/model.pt")[1] == "uploading"  # still ambiguous
    os.unlink(root / "model.pt")
    wait_for(lambda: reader.get(key) is None, timeout=60, what="the object to be collected")
    # The object is gone; the manifest must have gone before it.
    assert reader.get("manifests/ckpt/model.pt.json") is None, \
        "TORN: the deleted set's manifest outlived its object"
    assert read_store(reader) == {}
    m.stop()
    assert not m.unexpected_errors(), m.unexpected_errors()


def test_delete_then_recommit_same_path_with_slow_store(mount_factory, monkeypatch):
    """rmtree a durable set and save a new one at the same path while the store is slow: the
    old manifest must not stay behind (pointing at collected objects) while the new set waits
    for its uploads."""
    m = mount_factory("redo")
    m.start()
    root = m.path / "ckpt"
    root.mkdir()
    (m.path / "scratch.tmp").mkdir()

    def save_step(k: int) -> dict[str, bytes]:
        tmp = root / "step_1.tmp"
        (tmp / "extra").mkdir(parents=True)
        files = {}
        for rel in STEP_FILES:
            size, comp = file_spec(k, rel)
            files[rel] = content(k, "ckpt/step_1", rel, size, comp)
            write_chunks(tmp / rel, files[rel], fsync=False)
        os.rename(tmp, root / "step_1")
        return files

    old = save_step(1)
    # Garbage-to-be: an uploaded file outside any set.
    write_chunks(m.path / "scratch.tmp" / "g.bin", os.urandom(MiB), fsync=False)
    assert wait_durable(root / "step_1")["state"] == "durable"
    reader = FileStoreView(m.store_dir)
    wait_for(lambda: any(k.endswith("/g.bin") for k in reader.keys("data/")), timeout=30,
             what="the scratch file's upload")
    manifests: dict = {}
    assert read_store(reader, manifests) == {"ckpt/step_1": old}
    old_keys = {f["object"]["key"] for f in manifests["ckpt/step_1"]["files"]}
    m.stop("--allow-unsaved")  # scratch.tmp/g.bin is in no set, on purpose

    # The namespace worker is kept busy >= 1 s by a failing DELETE (collecting g.bin) while
    # the set is deleted and saved again; PUTs always fail, so the new set stays pending.
    monkeypatch.setenv("CKPTFS_FAULTS", "delete=next:8,put=every:1")
    m.start()
    monkeypatch.delenv("CKPTFS_FAULTS")
    try:
        os.unlink(m.path / "scratch.tmp" / "g.bin")
        shutil.rmtree(root / "step_1")
        new = save_step(2)
        wait_for(lambda: not (set(reader.keys("data/")) & old_keys), timeout=60,
                 what="the old set's objects to be collected")
        raw = reader.get("manifests/ckpt/step_1.json")
        assert raw is None or not ({f["object"]["key"] for f in json.loads(raw)["files"]}
                                   & old_keys), "TORN: the old manifest outlived its objects"
    finally:
        # Never drain here: with every PUT failing, uploads cannot finish in this mount.
        res = run_cli("umount", "--no-wait", str(m.path))
        m.pid = None
    assert res.returncode == 0, res.stderr
    m.start()  # no faults: the new set goes up
    assert wait_durable(root / "step_1")["state"] == "durable"
    assert read_store(reader) == {"ckpt/step_1": new}
    m.stop()
    assert not m.unexpected_errors(), m.unexpected_errors()


def test_reused_inode_number_does_not_overwrite_published_object(mount_factory):
    """Objects are immutable (docs/FORMAT.md): keys name (node, ino, version). A file of a
    published set deleted through the mount (not the set root: the set stays published) must
    not have its inode number, and so its object key, reused by the next file created."""
    m = mount_factory("reuse")
    m.start()
    root = m.path / "ckpt"
    (root / "step_1.tmp").mkdir(parents=True)
    files = {}
    for rel in ("a.bin", "b.bin"):  # b.bin gets the highest inode number
        files[rel] = content(1, "ckpt/step_1", rel, MiB + len(rel), False)
        write_chunks(root / "step_1.tmp" / rel, files[rel], fsync=False)
    os.rename(root / "step_1.tmp", root / "step_1")
    assert wait_durable(root / "step_1")["state"] == "durable"
    ino_b = os.stat(root / "step_1" / "b.bin").st_ino
    os.unlink(root / "step_1" / "b.bin")
    wait_for(lambda: not (m.cache_dir / "data" / str(ino_b)).exists(), timeout=30,
             what="the deleted file's inode to be purged")
    other = content(2, "ckpt/other.bin", "", MiB + 5, False)
    write_chunks(root / "other.bin", other, fsync=False)
    assert wait_durable(root / "other.bin")["state"] == "durable"
    reader = FileStoreView(m.store_dir)
    manifests: dict = {}
    store = read_store(reader, manifests)  # TornSet if other.bin overwrote b.bin's object
    assert store == {"ckpt/step_1": files, "ckpt/other.bin": {"": other}}
    keys = [f["object"]["key"] for man in manifests.values() for f in man["files"]]
    assert len(set(keys)) == len(keys), keys
    m.stop()
    assert not m.unexpected_errors(), m.unexpected_errors()
