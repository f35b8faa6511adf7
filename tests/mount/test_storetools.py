"""`ckptfs ls`, `ckptfs restore`, `ckptfs fsck`: the store tools that need no mount.

Stores are written by real mounts (file:// and moto S3): sets written through the mount,
`ckptfs wait`, unmount; then the tools run as a user runs them (`python -m ckptfs ...`, stderr
not a terminal unless a test gives it a pty). Damage and garbage are planted in the store by
hand, the way another node, a crash or an attacker would leave them. What the tools report is
checked against an independent reader (scripts/ckpt_restore.py's manifests()) and against the
bytes written through the mount. (The tools' errors and bounds on stores no mount wrote:
tests/unit/test_storetools_unit.py.)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path

import crc32c
import pytest
from ckpt_restore import FileStoreView, S3StoreView, manifests

import ckptfs
from cachemgr.format import keys, readerrors, resumable, storeread, storeview, validate
from ckptfs import cli, storetools
from tests.conftest import REPO, ckptfs_cmd, run_cli
from tests.storetools_helpers import DEAD, LIVE, one_line, put

DAY = 86400


# -- a store written by a real mount -----------------------------------------------------------

def populate(m, store_args: list[str]) -> dict:
    """Through mount `m`: a directory set renamed into place (random and zero-filled files of
    several chunks, an empty file, a subdirectory, a symlink), a file set and a `latest`
    symlink set; each waited for, then unmounted. Returns {relative path: what it is} as read
    back through the mount."""
    m.start(*store_args)
    root = m.path / "ckpt"
    tmp = root / "step_1.tmp"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(os.urandom(9_000_000))        # 3 chunks, stored as is
    (tmp / "sub" / "z.bin").write_bytes(bytes(9_000_000))     # 3 lz4 frames
    (tmp / "empty").write_bytes(b"")
    os.symlink("a.bin", tmp / "link")
    os.rename(tmp, root / "step_1")
    (root / "model.pt").write_bytes(os.urandom(3_000_000))
    os.symlink("step_1", root / "latest")
    for p in ("step_1", "model.pt", "latest"):
        r = run_cli("wait", str(root / p), "--timeout", "120")
        assert r.returncode == 0, r.stderr
    want = tree(root)
    m.stop()
    return want


def tree(root: Path) -> dict:
    """{relative path: ('f', bytes, mode) | ('d', mode) | ('l', target)}, never following."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != ".ckptfs-restore"]
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            s = os.lstat(p)
            if stat.S_ISLNK(s.st_mode):
                out[rel] = ("l", os.readlink(p))
            elif stat.S_ISDIR(s.st_mode):
                out[rel] = ("d", stat.S_IMODE(s.st_mode))
            else:
                out[rel] = ("f", Path(p).read_bytes(), stat.S_IMODE(s.st_mode))
    return out


def snapshot(base: Path, skip: tuple[Path, ...]) -> dict:
    """Every path under `base` but the `skip` trees, with its type, size and mtime."""
    out = {}
    skipped = {str(s) for s in skip}
    for dirpath, dirs, files in os.walk(base):
        dirs[:] = [d for d in dirs if os.path.join(dirpath, d) not in skipped]
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            s = os.lstat(p)
            out[p] = (stat.S_IFMT(s.st_mode), s.st_size,
                      None if stat.S_ISDIR(s.st_mode) else s.st_mtime_ns)
    return out


@pytest.fixture
def file_store(mount_factory, tmp_path):
    """(store URL, store directory, what the sets hold) of a file:// store a mount wrote."""
    m = mount_factory()
    want = populate(m, [])
    return f"file://{m.store_dir}", m.store_dir, want


def obj(key: str, data: bytes, chunk: int = 4096) -> dict:
    """The description of an uncompressed object holding `data`, as ckptfs writes it."""
    chunks = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    return {"key": key, "size": len(data), "stored_size": len(data),
            "crc32c": crc32c.crc32c(data), "compression": "none", "frame_size": 0,
            "frames": None, "chunk_size": chunk, "chunk_crcs": [crc32c.crc32c(c) for c in chunks]}


def manifest_doc(path: str, node: str, files: list[dict]) -> dict:
    return {"format": "ckptfs-manifest", "version": 1, "path": path, "kind": "dir", "mode": 493,
            "commit": {"node": node, "seq": 1, "reason": "request",
                       "committed_ns": time.time_ns()},
            "total_bytes": sum(f["size"] for f in files), "files": files, "dirs": [],
            "symlinks": []}


def store_keys(store_dir: Path) -> set[str]:
    return set(FileStoreView(store_dir).keys(""))


def main_inproc(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def session(url: str) -> storetools.Session:
    return storetools.Session(argparse.Namespace(store=url, s3_endpoint=None, s3_region=None,
                                                 s3_path_style=False, s3_profile=None))


# -- ls, restore, fsck on a store a mount wrote ---------------------------------------------------

@pytest.mark.parametrize("kind", ["file", "s3"])
def test_ls_restore_fsck_of_what_a_mount_published(mount_factory, tmp_path, request, kind):
    m = mount_factory()
    if kind == "s3":
        endpoint, bucket = request.getfixturevalue("s3_bucket")
        url, s3 = f"s3://{bucket}/pre", ["--s3-endpoint", endpoint]
        view = S3StoreView(endpoint, bucket, "pre")
        t0 = time.time_ns()
        want = populate(m, ["--store", url, *s3])
    else:
        url, s3 = f"file://{m.store_dir}", []
        t0 = time.time_ns()
        want = populate(m, [])
        view = FileStoreView(m.store_dir)
    t1 = time.time_ns()
    published = manifests(view)  # the independent reader's view of the same store

    r = run_cli("ls", url, *s3, "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    got = json.loads(r.stdout)
    assert got["invalid"] == []
    assert [s["path"] for s in got["sets"]] == ["ckpt/latest", "ckpt/model.pt", "ckpt/step_1"]
    files = {"ckpt/step_1": [k for k, v in want.items() if k.startswith("step_1/") and
                             v[0] == "f"], "ckpt/model.pt": ["model.pt"], "ckpt/latest": []}
    for s in got["sets"]:
        pm = published[s["path"]]
        raw = sum(len(want[f][1]) for f in files[s["path"]])
        stored = sum(f["object"]["stored_size"] for f in pm["files"])
        node = pm["commit"]["node"]
        assert all(f["object"]["key"].startswith(f"data/{node}/") for f in pm["files"])
        assert (s["kind"], s["files"], s["bytes"], s["stored_bytes"]) == \
            (pm["kind"], len(files[s["path"]]), raw, stored)
        assert s["ratio"] == (round(stored / raw, 4) if raw else None)
        assert (s["node"], s["nodes"]) == (node, [node])
        assert t0 <= s["committed_ns"] <= t1
    step = next(s for s in got["sets"] if s["path"] == "ckpt/step_1")
    assert step["ratio"] < 0.75  # the zero-filled half is lz4-compressed
    r = run_cli("ls", url, *s3)
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert lines[0].split()[:3] == ["SET", "KIND", "FILES"]
    assert [ln.split()[:3] for ln in lines[1:]] == [
        ["ckpt/latest", "symlink", "0"], ["ckpt/model.pt", "file", "1"],
        ["ckpt/step_1", "dir", "3"]]
    r = run_cli("ls", url, "ckpt/step_1", *s3, "--json")
    assert [s["path"] for s in json.loads(r.stdout)["sets"]] == ["ckpt/step_1"]
    r = run_cli("ls", url, "ckpt/nothing", *s3)
    assert r.returncode == storetools.EXIT_NO_SET == 8 and one_line(r.stderr), r.stderr

    dest = tmp_path / "dest"
    for p in ("ckpt/step_1", "ckpt/model.pt", "ckpt/latest"):
        r = run_cli("restore", url, p, str(dest), *s3)
        assert r.returncode == 0, r.stderr
        assert r.stderr == ""  # not a terminal, and under 10 s: no progress lines
        assert f"restored {p} to" in r.stdout
    assert tree(dest / "ckpt") == want
    assert (dest / "ckpt" / "latest" / "a.bin").read_bytes() == want["step_1/a.bin"][1]

    for extra in ([], ["--verify"]):
        r = run_cli("fsck", url, *s3, *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        summary = r.stdout.splitlines()[-2:]
        assert "3 manifests (0 invalid), 4 objects named: 4 present, 0 missing" in summary[0]
        assert "; 0 problems" in summary[0] and summary[1].startswith("garbage: none")
        if extra:
            assert "4 read and CRC32C-checked" in summary[0]


# -- restore: resumable, repairs, never outside DEST ----------------------------------------------

class CutView(storeview.ObjectStoreView):
    """The store view, but the connection drops after `after` data reads (an interruption)."""

    def __init__(self, base: storeview.ObjectStoreView, after: int | None) -> None:
        super().__init__(base.loop, base.store, base.url)
        self.after, self.gets, self.lock = after, 0, threading.Lock()

    def call(self, afn, *args):
        if getattr(afn, "__name__", "") == "get" and args and str(args[0]).startswith("data/"):
            with self.lock:
                if self.after is not None and self.gets >= self.after:
                    raise readerrors.StoreError("connection reset (the test cut it)")
                self.gets += 1
        return super().call(afn, *args)


def _h(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:32]


def test_restore_resumes_after_an_interruption_and_repairs_its_target(file_store, tmp_path):
    url, store_dir, want = file_store
    dest = tmp_path / "dest"
    work = dest / ".ckptfs-restore" / f"{_h('ckpt/step_1')}.tmp"
    with session(url) as s:
        m = storeread.find_set(s.view, "ckpt/step_1")
        a = next(f["object"] for f in m["files"] if f["path"] == "a.bin")
        assert a["compression"] == "none" and len(a["chunk_crcs"]) == 3
        # One worker, two reads: chunks 0 and 1 of a.bin land, then the connection drops.
        with pytest.raises(readerrors.StoreError, match="connection reset"):
            resumable.restore_resumable(CutView(s.view, 2), m, dest, workers=1)
        assert not (dest / "ckpt" / "step_1").exists()  # built aside: no partial set visible
        part = work / _h("a.bin")
        assert part.stat().st_size == a["size"]
        with open(part, "r+b") as f:  # plant a wrong byte in chunk 0 of what it left
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))
        counted = CutView(s.view, None)
        r = resumable.restore_resumable(counted, m, dest, workers=3)
    # Fetched again: chunk 0 of a.bin (planted byte) and chunk 2 (never fetched). Chunk 1 is
    # kept, and so is sub/z.bin: its work file, created sparse by the first run, already holds
    # its zeros, and every chunk of it checks out against its CRC32C.
    assert r["bytes_fetched"] == a["size"] - a["chunk_size"]
    assert r["bytes_done"] == r["bytes_total"] == m["total_bytes"]
    assert tree(dest / "ckpt" / "step_1") == {k[len("step_1/"):]: v for k, v in want.items()
                                               if k.startswith("step_1/")}
    assert not work.exists()

    r = run_cli("restore", url, "ckpt/step_1", str(dest))  # nothing to do
    assert r.returncode == 0 and "(0 B fetched, 17.2 MiB already there" in r.stdout, r.stdout

    target = dest / "ckpt" / "step_1"
    (target / "sub" / "z.bin").unlink()  # a file deleted from the restored set: fetched again
    r = run_cli("restore", url, "ckpt/step_1", str(dest))
    assert r.returncode == 0, r.stderr
    assert (target / "sub" / "z.bin").read_bytes() == want["step_1/sub/z.bin"][1]

    (target / "a.bin").write_bytes(b"someone else's file")  # not restore's: refused
    before = snapshot(tmp_path, (store_dir,))
    r = run_cli("restore", url, "ckpt/step_1", str(dest))
    assert r.returncode == storetools.EXIT_DEST == 11 and one_line(r.stderr), r.stderr
    assert "a.bin" in r.stderr and "--overwrite" in r.stderr
    assert snapshot(tmp_path, (store_dir, dest / ".ckptfs-restore")) == \
        {k: v for k, v in before.items() if ".ckptfs-restore" not in k}
    r = run_cli("restore", url, "ckpt/step_1", str(dest), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert tree(dest / "ckpt") == {k: v for k, v in want.items() if k.startswith("step_1")}

    other = tmp_path / "other"  # a copy made by other means: verified, kept, not refused
    shutil.copytree(dest / "ckpt", other / "ckpt", symlinks=True)
    r = run_cli("restore", url, "ckpt/step_1", str(other))
    assert r.returncode == 0 and "(0 B fetched" in r.stdout, r.stdout + r.stderr


def test_restore_never_writes_outside_dest(file_store, tmp_path):
    url, store_dir, _ = file_store
    real = manifests(FileStoreView(store_dir))["ckpt/step_1"]
    node = real["commit"]["node"]
    f = next(x for x in real["files"] if x["size"])
    bad = manifest_doc("evil", node, [{"path": "../escaped", "size": f["size"], "mode": 0o644,
                                       "mtime_ns": 1, "object": f["object"]}])
    put(store_dir, "manifests/evil.json", json.dumps(bad).encode())
    dest = tmp_path / "dest"
    dest.mkdir()
    before = snapshot(tmp_path, (store_dir,))
    r = run_cli("restore", url, "evil", str(dest))
    assert r.returncode == storetools.EXIT_DAMAGE == 10 and one_line(r.stderr), r.stderr
    assert "invalid manifest" in r.stderr
    assert snapshot(tmp_path, (store_dir,)) == before

    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, dest / "ckpt")  # a symlink planted in DEST: never followed
    before = snapshot(tmp_path, (store_dir, dest / ".ckptfs-restore"))
    r = run_cli("restore", url, "ckpt/step_1", str(dest))
    assert r.returncode == storetools.EXIT_DEST and one_line(r.stderr), r.stderr
    assert os.listdir(outside) == []
    assert snapshot(tmp_path, (store_dir, dest / ".ckptfs-restore")) == before

    r = run_cli("ls", url)
    assert r.returncode == 0
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("INVALID")] == [
        f"INVALID  manifests/evil.json: invalid manifest: {_reason(bad)}"]
    r = run_cli("fsck", url)
    assert r.returncode == storetools.EXIT_DAMAGE, r.stdout
    assert "DAMAGED manifests/evil.json: invalid manifest" in r.stdout


def _reason(doc: dict) -> str:
    try:
        validate.manifest(json.dumps(doc).encode(), "manifests/evil.json")
    except validate.ManifestError as e:
        return str(e)
    raise AssertionError("valid")


def test_restore_shows_a_progress_bar_on_a_terminal_only(file_store, tmp_path):
    url, _, _ = file_store
    master, slave = os.openpty()
    try:
        p = subprocess.run(ckptfs_cmd("restore", url, "ckpt/step_1", str(tmp_path / "d")),
                           check=False, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=slave,
                           cwd=REPO, timeout=120, env={**os.environ, "COLUMNS": "120"})
        os.close(slave)
        slave = None
        tty = b""
        with contextlib.suppress(OSError):  # EIO once everything written is read
            while chunk := os.read(master, 65536):
                tty += chunk
    finally:
        os.close(master)
        if slave is not None:
            os.close(slave)
    assert p.returncode == 0
    text = tty.decode(errors="replace")
    assert "restore ckpt/step_1" in text and "3/3 files" in text, text
    r = run_cli("restore", url, "ckpt/model.pt", str(tmp_path / "d"))
    assert r.returncode == 0 and r.stderr == ""  # no terminal: no bar, no escape sequences


# -- fsck: garbage, repair, damage ----------------------------------------------------------------

def plant_garbage(store_dir: Path) -> dict[str, set[str]]:
    """Leftovers of a node that never returned (DEAD, gone for two days) and of a node that is
    live (LIVE, its member record fresh), and a fresh object no manifest names yet (a set
    still being published). Returns {"garbage": keys fsck must delete, "kept": keys it must
    keep}."""
    old = 2 * DAY
    orphan = f"data/{DEAD}/7/1/orphan.pt"
    put(store_dir, orphan, os.urandom(5000), age=old)
    part_obj = f"data/{DEAD}/8/1/__1_0.distcp"
    put(store_dir, part_obj, os.urandom(3000), age=old)
    rec = {"format": "ckptfs-part", "version": 1, "node": DEAD, "dir": "ckpt/step_9",
           "updated_ns": 1, "files": [{"name": "__1_0.distcp", "size": 3000, "mode": 420,
                                       "mtime_ns": 1, "object": obj(part_obj, b"x" * 3000)}]}
    validate.part_record(json.dumps(rec).encode(), keys.part_key("ckpt/step_9", DEAD))
    put(store_dir, keys.part_key("ckpt/step_9", DEAD), json.dumps(rec).encode(), age=old)
    put(store_dir, f"members/@{DEAD}.json", b'{"format": "ckptfs-member"}', age=old)
    put(store_dir, f"intents/{DEAD}-4-18a3c0de5f2b1c00.json", b"{}", age=old)
    fresh = f"data/{DEAD}/9/1/uploading.distcp"
    put(store_dir, fresh, os.urandom(1000))
    live_obj = f"data/{LIVE}/1/1/__2_0.distcp"
    put(store_dir, live_obj, os.urandom(2000), age=old)
    live_rec = dict(rec, node=LIVE, files=[dict(rec["files"][0], name="__2_0.distcp", size=2000,
                                                object=obj(live_obj, b"y" * 2000))])
    put(store_dir, keys.part_key("ckpt/step_9", LIVE), json.dumps(live_rec).encode(), age=old)
    live_unnamed = f"data/{LIVE}/2/1/older-version.pt"
    put(store_dir, live_unnamed, os.urandom(100), age=old)
    put(store_dir, f"members/@{LIVE}.json", b'{"format": "ckptfs-member"}')
    # a conditional-write probe's scratch object left by a crash, and one being probed now
    stale_probe, probing = "probe/6f1c0a3b9d2e4f5a8b7c6d5e4f3a2b1c", "probe/0123abcd.absent"
    put(store_dir, stale_probe, b"4", age=old)
    put(store_dir, probing, b"1")
    return {"garbage": {orphan, part_obj, keys.part_key("ckpt/step_9", DEAD),
                        f"members/@{DEAD}.json", f"intents/{DEAD}-4-18a3c0de5f2b1c00.json",
                        stale_probe},
            "kept": {fresh, live_obj, live_unnamed, keys.part_key("ckpt/step_9", LIVE),
                     f"members/@{LIVE}.json", probing}}


def test_fsck_lists_garbage_and_repair_deletes_exactly_it(file_store, tmp_path):
    url, store_dir, want = file_store
    published = store_keys(store_dir)
    planted = plant_garbage(store_dir)
    r = run_cli("fsck", url)
    assert r.returncode == 0, r.stdout + r.stderr
    listed = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("GARBAGE ")}
    assert listed == planted["garbage"]
    assert "not repaired: rerun with --repair" in r.stdout
    assert store_keys(store_dir) == published | planted["garbage"] | planted["kept"]

    r = run_cli("fsck", url, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    deleted = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("DELETED ")}
    assert deleted == planted["garbage"]
    assert f"repair: deleted {len(planted['garbage'])} " in r.stdout
    assert store_keys(store_dir) == published | planted["kept"]  # every named object stays

    r = run_cli("restore", url, "ckpt/step_1", str(tmp_path / "dest"))
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "dest" / "ckpt") == {k: v for k, v in want.items()
                                                if k.startswith("step_1")}
    r = run_cli("fsck", url, "--verify")
    assert r.returncode == 0 and "\ngarbage: none" in r.stdout, r.stdout


def test_fsck_repair_rechecks_the_manifests_right_before_deleting(file_store, monkeypatch):
    """A set published between the check and the deletion (gated: the test publishes it when
    repair starts) keeps the old object it names."""
    url, store_dir, _ = file_store
    data = os.urandom(6000)
    key = f"data/{DEAD}/5/1/late.pt"
    put(store_dir, key, data, age=2 * DAY)
    real_repair = storetools._Fsck.repair

    def publish_then_repair(self, garbage):
        assert key in {g[0] for g in garbage}  # it was garbage when checked
        doc = manifest_doc("ckpt/late", DEAD, [{"path": "late.pt", "size": len(data),
                                                "mode": 0o644, "mtime_ns": 1,
                                                "object": obj(key, data)}])
        put(store_dir, keys.manifest_key("ckpt/late"), json.dumps(doc).encode())
        return real_repair(self, garbage)

    monkeypatch.setattr(storetools._Fsck, "repair", publish_then_repair)
    rc, out, err = main_inproc("fsck", url, "--repair")
    assert rc == 0, out + err
    assert f"KEPT    {key}: named by a manifest now" in out
    assert (store_dir / "objects" / key).read_bytes() == data


@pytest.mark.parametrize("older_than", ["60", str(3 * DAY)])
def test_fsck_keeps_objects_younger_than_older_than(file_store, older_than):
    url, store_dir, _ = file_store
    key = f"data/{DEAD}/3/1/two-days-old"
    put(store_dir, key, b"x" * 100, age=2 * DAY)
    r = run_cli("fsck", url, "--repair", "--older-than", older_than)
    assert r.returncode == 0, r.stdout
    assert (store_dir / "objects" / key).exists() == (float(older_than) > 2 * DAY)


@pytest.mark.parametrize("how", ["missing", "truncated", "crc", "unreadable-manifest"])
def test_fsck_finds_damage_exit_10(file_store, tmp_path, how):
    url, store_dir, _ = file_store
    pm = manifests(FileStoreView(store_dir))["ckpt/step_1"]
    key = next(f["object"]["key"] for f in pm["files"] if f["path"] == "a.bin")
    p = store_dir / "objects" / key
    if how == "missing":
        p.unlink()
    elif how == "truncated":
        os.truncate(p, p.stat().st_size - 1)
    elif how == "crc":  # same size: only reading it tells
        with open(p, "r+b") as f:
            f.seek(5_000_000)
            b = f.read(1)
            f.seek(5_000_000)
            f.write(bytes([b[0] ^ 1]))
    else:
        (store_dir / "objects" / keys.manifest_key("ckpt/step_1")).write_bytes(b"{not json")
    r = run_cli("fsck", url)
    damaged = [ln for ln in r.stdout.splitlines() if ln.startswith("DAMAGED ")]
    if how == "crc":
        assert r.returncode == 0 and damaged == [], r.stdout
        r = run_cli("fsck", url, "--verify")
        damaged = [ln for ln in r.stdout.splitlines() if ln.startswith("DAMAGED ")]
        mkey = keys.manifest_key("ckpt/step_1")
        assert damaged == [f"DAMAGED {key}: chunk 1 CRC32C mismatch (named by {mkey})"], \
            r.stdout
    elif how == "unreadable-manifest":
        assert len(damaged) == 1 and "manifests/ckpt/step_1.json: invalid manifest" in damaged[0]
    else:
        assert len(damaged) == 1 and key in damaged[0], r.stdout
        assert ("missing" if how == "missing" else "the manifest says") in damaged[0]
    assert r.returncode == storetools.EXIT_DAMAGE == 10, r.stdout + r.stderr
    r = run_cli("restore", url, "ckpt/step_1", str(tmp_path / "d"))
    assert r.returncode == storetools.EXIT_DAMAGE and one_line(r.stderr), r.stderr
    assert not (tmp_path / "d" / "ckpt" / "step_1").exists()
    if how == "unreadable-manifest":
        # Its objects are unknown now: even at --older-than 0, no data object is deleted (the
        # part records the unmounted node left may go: at 0 s every node counts as gone).
        before = {k for k in store_keys(store_dir) if k.startswith("data/")}
        r = run_cli("fsck", url, "--repair", "--older-than", "0")
        assert r.returncode == storetools.EXIT_DAMAGE
        assert "could not be read at all" in r.stdout
        assert {k for k in store_keys(store_dir) if k.startswith("data/")} == before


def test_fsck_never_calls_a_mounted_nodes_records_garbage(mount_factory):
    """Liveness comes from the lease, not from --older-than: at --older-than 0 the member
    record of a node mounted right now (renewed every lease/4) is not garbage, and --repair
    leaves it; its lease is what says it is alive."""
    m = mount_factory("live")
    m.start()
    (m.path / "model.pt").write_bytes(b"x" * 1000)
    ckptfs.wait_durable(m.path / "model.pt", timeout=60)
    node = m.status()["tiering"]["store"]["node"]
    url = f"file://{m.store_dir}"
    member = f"members/@{node}.json"
    assert member in store_keys(m.store_dir)
    r = run_cli("fsck", url, "--older-than", "0", "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert member not in r.stdout, r.stdout
    assert member in store_keys(m.store_dir)
    m.stop()  # a clean unmount deletes its own record
    assert member not in store_keys(m.store_dir)
