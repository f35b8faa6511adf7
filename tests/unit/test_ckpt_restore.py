"""scripts/ckpt_restore.py trusts nothing read from the store: every manifest is validated by
cachemgr.format.validate, every path is resolved inside the destination without following a symlink,
every check is an explicit exception (the same under `python -O`), and objects are streamed.

The stores here are file:// stores written by hand (`objects/<key>`), so that any document or
object can be made: valid ones (restored byte for byte) and hostile ones (refused with a
documented exit code, nothing written outside the destination, nothing left at the target).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import ckpt_restore as cr
import crc32c
import lz4.frame
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachemgr.format import decode, keys, names, validate

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ckpt_restore.py"
NODE = "n1"
# The exit codes scripts/ckpt_restore.py documents.
OK, NO_SET, USAGE, CORRUPT, DEST, STORE = 0, 1, 2, 3, 4, 5
RESTORE_CODES = {OK, NO_SET, USAGE, CORRUPT, DEST}


# -- a store written by hand -------------------------------------------------------------------

class Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "objects").mkdir(parents=True)
        self.n = 0

    @property
    def url(self) -> str:
        return f"file://{self.root}"

    def path(self, key: str) -> Path:
        return self.root / "objects" / key

    def put(self, key: str, data: bytes) -> None:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def obj(self, data: bytes, compression: str = "none", frame: int = 4096) -> dict:
        """An object holding `data`, as ckptfs describes it (chunk CRCs included)."""
        self.n += 1
        key = f"data/{NODE}/{self.n}/1/f{self.n}"
        chunks = [data[i:i + frame] for i in range(0, len(data), frame)]
        d = {"key": key, "size": len(data), "crc32c": crc32c.crc32c(data),
             "compression": compression, "chunk_size": frame,
             "chunk_crcs": [crc32c.crc32c(c) for c in chunks]}
        if compression == "lz4":
            stored = [lz4.frame.compress(c) for c in chunks]
            d.update(frame_size=frame, frames=[len(s) for s in stored])
            blob = b"".join(stored)
        else:
            blob = data
        d["stored_size"] = len(blob)
        self.put(key, blob)
        return d

    def manifest(self, doc, key: str | None = None) -> str:
        """Publish `doc` (a dict, or raw bytes) at `key` (default: its path's key)."""
        key = key or keys.manifest_key(doc["path"])
        self.put(key, doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        return key


def doc(path: str, kind: str = "dir", files=(), dirs=(), symlinks=(), target=None,
        version: int = 2, mode: int = 0o755) -> dict:
    d = {"format": "ckptfs-manifest", "version": version, "path": path, "kind": kind,
         "commit": {"node": NODE, "seq": 1, "reason": "request", "committed_ns": 1},
         "files": list(files), "dirs": list(dirs), "symlinks": list(symlinks)}
    if kind == "dir":
        d["mode"] = mode
    if target is not None:
        d["target"] = target
    d["total_bytes"] = sum(f["size"] for f in files)
    return d


def file_entry(path: str, obj: dict, mode: int = 0o644) -> dict:
    return {"path": path, "size": obj["size"], "mode": mode, "mtime_ns": 1, "object": obj}


def tree(root: bytes) -> dict:
    """{relative path: ('f', bytes, mode) | ('d', mode) | ('l', target)}, never following."""
    out = {}
    st_ = os.lstat(root)
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            s = os.lstat(p)
            if stat.S_ISLNK(s.st_mode):
                out[rel] = ("l", os.readlink(p))
            elif stat.S_ISDIR(s.st_mode):
                out[rel] = ("d", stat.S_IMODE(s.st_mode))
            else:
                with open(p, "rb") as f:
                    out[rel] = ("f", f.read(), stat.S_IMODE(s.st_mode))
    out[b"."] = ("d", stat.S_IMODE(st_.st_mode))
    return out


def snapshot(base: Path, skip: tuple[Path, ...]) -> dict:
    """Everything under `base` but the `skip` trees: what a restore must never change."""
    out = {}
    skipped = {os.fsencode(s) for s in skip}
    for dirpath, dirs, files in os.walk(os.fsencode(base)):
        dirs[:] = [d for d in dirs if os.path.join(dirpath, d) not in skipped]
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            s = os.lstat(p)
            out[p] = (s.st_mode, s.st_size,  # a directory's mtime: its entries are here
                      None if stat.S_ISDIR(s.st_mode) else s.st_mtime_ns,
                      os.readlink(p) if stat.S_ISLNK(s.st_mode) else None)
    return out


def run_main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cr.main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def run_cli(*argv: str, optimize: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *(["-O"] if optimize else []), str(SCRIPT), *argv],
                          check=False, capture_output=True, text=True, timeout=120)


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and err.startswith("ckpt_restore: ") and \
        "Traceback" not in err


@pytest.fixture
def sample(tmp_path):
    """A store with a dir set (names that are not UTF-8, lz4 and plain objects, modes, empty
    dirs, symlinks with absolute and '..' targets), a file set, a symlink set and a version-1
    set at the key of its literal name (docs/FORMAT.md "Names"); and the trees they restore."""
    s = Store(tmp_path / "store")
    data = {b"a.bin": os.urandom(10_000), b"sub/b\xff.bin": bytes(30_000) + os.urandom(5000),
            b"sub/deep/empty": b"", b"x%.pt": os.urandom(100)}
    comp = {b"a.bin": "none", b"sub/b\xff.bin": "lz4", b"sub/deep/empty": "lz4",
            b"x%.pt": "none"}
    modes = {b"a.bin": 0o600, b"sub/b\xff.bin": 0o4755, b"sub/deep/empty": 0o444,
             b"x%.pt": 0o777}
    files = [file_entry(names.escape_path(p), s.obj(d, comp[p]), modes[p])
             for p, d in data.items()]
    dirs = [{"path": "sub", "mode": 0o750}, {"path": "sub/deep", "mode": 0o555},
            {"path": "nothing\xe9", "mode": 0o700}]
    links = [{"path": "link", "target": "a.bin"}, {"path": "sub/abs", "target": "/etc/passwd"},
             {"path": "up%FF", "target": "../../../%FE"}]
    s.manifest(doc("run/step_%FF", files=files, dirs=dirs, symlinks=links, mode=0o2775))
    model = os.urandom(50_000)
    s.manifest(doc("run/model.pt", "file", [file_entry("", s.obj(model, "lz4"), 0o640)]))
    s.manifest(doc("run/latest", "symlink", target="step_%FF"))
    legacy = os.urandom(77)
    s.manifest(doc("old/ckpt-%C3%A9.pt", "file", [file_entry("", s.obj(legacy))], version=1))
    want_dir = {b".": ("d", 0o775), b"a.bin": ("f", data[b"a.bin"], 0o600),
                b"sub": ("d", 0o750), b"sub/b\xff.bin": ("f", data[b"sub/b\xff.bin"], 0o755),
                b"sub/deep": ("d", 0o555), b"sub/deep/empty": ("f", b"", 0o444),
                b"x%.pt": ("f", data[b"x%.pt"], 0o775), b"nothing\xc3\xa9": ("d", 0o700),
                b"link": ("l", b"a.bin"), b"sub/abs": ("l", b"/etc/passwd"),
                b"up\xff": ("l", b"../../../\xfe")}
    return s, {"run/step_%FF": want_dir, "run/model.pt": ("f", model, 0o640),
               "run/latest": ("l", b"step_\xff"), "old/ckpt-%25C3%25A9.pt": ("f", legacy, 0o644)}


def restored(dest: Path, set_path: str):
    p = os.path.join(os.fsencode(dest), names.unescape_path(set_path))
    s = os.lstat(p)
    if stat.S_ISDIR(s.st_mode):
        return tree(p)
    if stat.S_ISLNK(s.st_mode):
        return ("l", os.readlink(p))
    with open(p, "rb") as f:
        return ("f", f.read(), stat.S_IMODE(s.st_mode))


# -- valid sets --------------------------------------------------------------------------------

def test_valid_sets_restore_byte_exact_with_their_masked_modes(sample, tmp_path):
    """Names as bytes, contents, modes (masked: never setuid/setgid/world-writable), empty
    dirs, symlinks created as links; by the escaped form `list` prints and by the real path."""
    s, want = sample
    rc, out, err = run_main("list", s.url)
    assert rc == 0 and err == ""
    assert [line.split()[-1] for line in out.splitlines()] == sorted(want)
    dest = tmp_path / "dest"
    for set_path in want:
        rc, out, err = run_main("restore", s.url, set_path, str(dest))
        assert (rc, err) == (0, ""), err
        assert restored(dest, set_path) == want[set_path], set_path
    # By the real path (argv bytes), into another destination; the legacy one by its literal.
    dest2 = tmp_path / "dest2"
    for real in (b"run/step_\xff", b"run/model.pt", b"old/ckpt-%C3%A9.pt"):
        rc, _, err = run_main("restore", s.url, os.fsdecode(real), str(dest2))
        assert (rc, err) == (0, ""), err
    assert restored(dest2, "run/step_%FF") == want["run/step_%FF"]
    r = run_cli("restore", s.url, os.fsdecode(b"run/step_\xff"), str(tmp_path / "dest4"))
    assert (r.returncode, r.stderr) == (0, "")
    assert restored(tmp_path / "dest4", "run/step_%FF") == want["run/step_%FF"]
    assert restored(dest2, "old/ckpt-%25C3%25A9.pt") == want["old/ckpt-%25C3%25A9.pt"]
    # The library functions the other tests use read the same.
    ms = cr.manifests(cr.FileStoreView(s.root))
    assert set(ms) == set(want)
    got = cr.restore(cr.FileStoreView(s.root), ms["run/step_%FF"])
    assert got == {names.escape_path(p): want["run/step_%FF"][p][1]
                   for p in (b"a.bin", b"sub/b\xff.bin", b"sub/deep/empty", b"x%.pt")}
    out = cr.restore_to(cr.FileStoreView(s.root), ms["run/step_%FF"], tmp_path / "dest3")
    assert tree(os.fsencode(out)) == want["run/step_%FF"]
    assert not [n for n in os.listdir(tmp_path / "dest3" / "run") if n.startswith(".")]


def test_restore_never_replaces_what_is_at_the_target(sample, tmp_path):
    s, want = sample
    del want["old/ckpt-%25C3%25A9.pt"]
    dest = tmp_path / "dest"
    for set_path in want:
        assert run_main("restore", s.url, set_path, str(dest))[0] == 0
    before = snapshot(tmp_path, ())
    for set_path in want:
        rc, _, err = run_main("restore", s.url, set_path, str(dest))
        assert rc == DEST and one_line(err) and "exists" in err, (set_path, err)
    assert snapshot(tmp_path, ()) == before
    # A dir set may take the place of an empty directory (not of a symlink to one).
    (tmp_path / "d2" / "run" / "step_\udcff").mkdir(parents=True)
    assert run_main("restore", s.url, "run/step_%FF", str(tmp_path / "d2"))[0] == 0
    assert restored(tmp_path / "d2", "run/step_%FF") == want["run/step_%FF"]
    (tmp_path / "d3" / "run").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    os.symlink(tmp_path / "empty", tmp_path / "d3" / "run" / "step_\udcff")
    assert run_main("restore", s.url, "run/step_%FF", str(tmp_path / "d3"))[0] == DEST
    assert os.listdir(tmp_path / "empty") == []


# -- the destination: nothing is ever followed -------------------------------------------------

def test_a_symlink_set_then_a_set_under_it_does_not_write_through_it(tmp_path):
    """Set `a` is a symlink to a directory outside DEST, set `a/x` a file: restoring both into
    one DEST must not write the file through the link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    s = Store(tmp_path / "store")
    s.manifest(doc("a", "symlink", target=str(outside)))
    s.manifest(doc("a/x", "file", [file_entry("", s.obj(b"pwned"))]))
    s.manifest(doc("a/d", files=[file_entry("f", s.obj(b"pwned"))]))
    dest = tmp_path / "dest"
    before = snapshot(tmp_path, (dest,))
    assert run_main("restore", s.url, "a", str(dest))[0] == 0
    for set_path in ("a/x", "a/d"):
        rc, _, err = run_main("restore", s.url, set_path, str(dest))
        assert rc == DEST and one_line(err), err
    assert os.listdir(outside) == []
    assert snapshot(tmp_path, (dest,)) == before
    assert os.readlink(dest / "a") == str(outside)


def test_symlinks_planted_in_the_destination_are_not_followed(tmp_path):
    s = Store(tmp_path / "store")
    s.manifest(doc("ckpt/model.pt", "file", [file_entry("", s.obj(b"new"))]))
    s.manifest(doc("ckpt/step_1", files=[file_entry("f", s.obj(b"new"))]))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    # DEST/ckpt is a symlink to a directory elsewhere.
    dest.mkdir()
    os.symlink(outside, dest / "ckpt")
    before = snapshot(tmp_path, (dest,))
    for set_path in ("ckpt/model.pt", "ckpt/step_1"):
        rc, _, err = run_main("restore", s.url, set_path, str(dest))
        assert rc == DEST and one_line(err) and "not a directory" in err, err
    # DEST2/ckpt/model.pt is a symlink to a file elsewhere.
    dest2 = tmp_path / "dest2"
    (dest2 / "ckpt").mkdir(parents=True)
    os.symlink(victim, dest2 / "ckpt" / "model.pt")
    rc, _, err = run_main("restore", s.url, "ckpt/model.pt", str(dest2))
    assert rc == DEST and "exists" in err, err
    assert snapshot(tmp_path, (dest, dest2)) == before
    assert victim.read_bytes() == b"precious" and os.listdir(outside) == []


def test_hostile_manifests_are_refused_and_write_nothing_outside(tmp_path):
    """Paths with '..', absolute paths, a file under a symlink of the same set: each refused
    by the validator (exit 3; `list` reports each in one line on stderr and goes on), also when
    handed straight to restore_to()."""
    base = tmp_path / "w"
    dest = base / "a" / "b" / "dest"
    outside = str(tmp_path / "outside")
    s = Store(tmp_path / "store")
    good = s.obj(b"pwned")
    evil = {
        "up": doc("../../../x", "file", [file_entry("", good)]),
        "abs": doc(outside, "file", [file_entry("", good)]),
        "inner": doc("s", files=[file_entry("../../../../../outside", good)]),
        "absfile": doc("s", files=[file_entry(outside, good)]),
        "linkfile": doc("s", files=[file_entry("l/x", good)],
                        symlinks=[{"path": "l", "target": str(tmp_path)}]),
        "nul": doc("s", files=[file_entry("a\0b", good)]),
    }
    for name, d in evil.items():
        s.manifest(d, key=f"manifests/{name}.json")
    s.manifest(doc("fine", "file", [file_entry("", good)]))
    before = snapshot(tmp_path, (dest,))
    rc, out, err = run_main("list", s.url)
    assert rc == 0 and out.split() == ["file", "5", "fine"]
    assert len(err.splitlines()) == len(evil) and "Traceback" not in err
    assert all(line.startswith("ckpt_restore: skipped manifests/") for line in err.splitlines())
    for name, d in evil.items():
        rc, _, err = run_main("restore", s.url, name, str(dest))
        assert rc == CORRUPT and one_line(err), (name, err)
        with pytest.raises(cr.RestoreError):
            cr.restore_to(cr.FileStoreView(s.root), d, dest)
    assert snapshot(tmp_path, (dest,)) == before
    assert not os.path.exists(outside)


def test_the_store_is_read_without_following_symlinks(tmp_path):
    """An object key that is a symlink in a file:// store (to a file with the right size and
    CRC32C) is not read; nor a manifest that is one."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"secret bytes")
    s = Store(tmp_path / "store")
    o = s.obj(b"secret bytes")
    s.path(o["key"]).unlink()
    os.symlink(secret, s.path(o["key"]))
    s.manifest(doc("f", "file", [file_entry("", o)]))
    dest = tmp_path / "dest"
    rc, _, err = run_main("restore", s.url, "f", str(dest))
    assert rc == CORRUPT and one_line(err) and "symlink" in err, err
    assert not (dest / "f").exists()
    os.symlink(s.path(keys.manifest_key("f")), s.path("manifests/g.json"))
    os.mkfifo(s.path("manifests/h.json"))
    rc, out, err = run_main("list", s.url)
    assert rc == 0 and out.split()[-1] == "f" and err == ""
    for name in ("g", "h"):  # a symlink, a FIFO (not opened for good: no hang)
        rc, _, err = run_main("restore", s.url, name, str(dest))
        assert rc == CORRUPT and one_line(err), err


def test_an_oversized_manifest_is_not_read(tmp_path, monkeypatch):
    s = Store(tmp_path / "store")
    s.manifest(doc("fine", "file", [file_entry("", s.obj(b"x"))]))
    big = s.path("manifests/big.json")
    with open(big, "wb") as f:  # sparse
        f.truncate(validate.MAX_DOCUMENT_BYTES + 1)
    read = []
    real_open = getattr(cr.FileStoreView, "open", None)
    monkeypatch.setattr(cr.FileStoreView, "open",
                        lambda self, key: read.append(key) or real_open(self, key),
                        raising=False)
    rc, out, err = run_main("list", s.url)
    assert rc == 0 and out.split()[-1] == "fine"
    assert one_line(err) and "manifests/big.json" in err
    assert "manifests/big.json" not in read
    rc, _, err = run_main("restore", s.url, "big", str(tmp_path / "d"))
    assert rc == CORRUPT and one_line(err), err


# -- corrupt objects: explicit errors, also under python -O ------------------------------------

def _corrupt_store(tmp_path: Path, how: str) -> Store:
    s = Store(tmp_path / "store")
    data = os.urandom(20_000)
    o = s.obj(data, "lz4" if how.startswith("lz4") else "none", frame=8192)
    p = s.path(o["key"])
    blob = bytearray(p.read_bytes())
    if how == "flip":           # a byte of the content: chunk 1 and the whole CRC32C
        blob[9000] ^= 1
    elif how == "short":        # the object is shorter than its stored_size
        blob = blob[:-1]
    elif how == "missing":
        blob = None
    elif how == "lz4-expand":   # frame 0 decompresses to more than frame_size (sizes fixed up)
        big = lz4.frame.compress(bytes(8192 * 3))
        blob = bytearray(big + blob[o["frames"][0]:])
        o["stored_size"] += len(big) - o["frames"][0]
        o["frames"][0] = len(big)
    elif how == "lz4-garbage":
        blob[20:40] = bytes(20)
    if blob is None:
        p.unlink()
    else:
        p.write_bytes(bytes(blob))
    s.manifest(doc("ck/model.pt", "file", [file_entry("", o)]))
    return s


@pytest.mark.parametrize("how", ["flip", "short", "missing", "lz4-expand", "lz4-garbage"])
def test_corrupt_objects_fail_with_exit_3_even_under_python_O(tmp_path, how):
    """The CLI under `python -O` (which strips asserts): exit 3, one line, nothing restored."""
    s = _corrupt_store(tmp_path, how)
    dest = tmp_path / "dest"
    r = run_cli("restore", s.url, "ck/model.pt", str(dest), optimize=True)
    assert r.returncode == CORRUPT and one_line(r.stderr), r.stderr
    assert r.stdout == ""
    assert os.listdir(dest / "ck") == []  # no partial file, no temp file


def test_chunk_crc_mismatch_names_the_chunk(tmp_path):
    s = Store(tmp_path / "store")
    o = s.obj(os.urandom(3 * 4096 + 5))
    o["chunk_crcs"][2] ^= 1
    stored = s.path(o["key"]).read_bytes()
    with pytest.raises(cr.CorruptError, match="chunk 2 CRC32C mismatch"):
        cr.decode(o, stored)
    s.manifest(doc("f", "file", [file_entry("", o)]))
    rc, _, err = run_main("restore", s.url, "f", str(tmp_path / "d"))
    assert rc == CORRUPT and "chunk 2" in err


# -- fuzz --------------------------------------------------------------------------------------

NAMES = [b"a", b"b.bin", b"\xffx", b"sub/c", b"sub/d%", b"e\xe9", b"sub/deep/f"]


def _mutations(base: Path) -> dict:
    """name -> f(doc, store, draw): a change to a valid manifest or its objects."""
    outside = str(base / "outside")

    def files(d):
        return d["files"] if isinstance(d.get("files"), list) else []

    def add(d, field, entry):
        if field not in d or d[field] is None:
            d[field] = []
        if isinstance(d[field], list):
            d[field].append(entry)

    def any_file(d, draw):
        fs = [f for f in files(d) if isinstance(f, dict) and isinstance(f.get("object"), dict)]
        return fs[draw(st.integers(0, len(fs) - 1))] if fs else None

    def stored_file(s, f):
        """The stored object file of entry `f`, if an earlier mutation left it one."""
        k = f["object"].get("key")
        if not isinstance(k, str) or not k.startswith(f"data/{NODE}/") or ".." in k:
            return None
        p = s.path(k)
        return p if p.is_file() and not p.is_symlink() else None

    def ints(*vs):
        return all(type(v) is int for v in vs)

    def set_path(d, s, draw):
        d["path"] = draw(st.sampled_from(
            ["..", "../x", "../../../../x", "s/../../x", outside, "s/./x", "", "s//x", "a\0b",
             "x/", 5, None, ["x"], "%FF%", "s/%2F"]))

    def file_path(d, s, draw):
        f = any_file(d, draw)
        if f:
            f["path"] = draw(st.sampled_from(
                ["..", "../../../../../outside", "x/../../../../../outside", outside, "/",
                 "a\0b", ".", "", 7, "sub/../../../outside"]))

    def link_then_file(d, s, draw):
        add(d, "symlinks", {"path": "ln", "target": str(base)})
        add(d, "files", file_entry("ln/escaped", s.obj(b"pwned")))

    def link_then_dir(d, s, draw):
        add(d, "symlinks", {"path": "ln", "target": str(base)})
        add(d, "dirs", {"path": "ln/escaped", "mode": 0o755})

    def dir_under_file(d, s, draw):
        f = any_file(d, draw)
        if f and isinstance(f.get("path"), str) and f["path"] and isinstance(d.get("dirs"), list):
            add(d, "dirs", {"path": f["path"] + "/d", "mode": 0o755})

    def duplicate(d, s, draw):
        f = any_file(d, draw)
        if f:
            d["files"].append(dict(f))  # any_file: d["files"] is a list

    def size(d, s, draw):
        f = any_file(d, draw)
        if f:
            v = draw(st.sampled_from([2 ** 62, -1, True, 1.5, "10", None, 2 ** 64, 0]))
            target = draw(st.sampled_from(["file", "object", "both", "stored"]))
            if target in ("file", "both"):
                f["size"] = v
            if target in ("object", "both"):
                f["object"]["size"] = v
            if target == "stored":
                f["object"]["stored_size"] = v

    def crc(d, s, draw):
        f = any_file(d, draw)
        if f:
            o = f["object"]
            crcs = o.get("chunk_crcs")
            if draw(st.booleans()) or not (isinstance(crcs, list) and crcs and ints(crcs[-1])):
                if ints(o.get("crc32c")):
                    o["crc32c"] ^= 1 << draw(st.integers(0, 31))
            else:
                crcs[-1] ^= 1

    def flip_byte(d, s, draw):
        f = any_file(d, draw)
        p = f and stored_file(s, f)
        if p and p.stat().st_size:
            b = bytearray(p.read_bytes())
            b[draw(st.integers(0, len(b) - 1))] ^= 1 << draw(st.integers(0, 7))
            p.write_bytes(bytes(b))

    def resize_object(d, s, draw):
        f = any_file(d, draw)
        p = f and stored_file(s, f)
        if p:
            b = p.read_bytes()
            how = draw(st.sampled_from(["cut", "grow", "delete", "symlink", "dir"]))
            p.unlink()
            if how == "cut":
                p.write_bytes(b[:-1])
            elif how == "grow":
                p.write_bytes(b + b"\0")
            elif how == "symlink":
                (base / "secret").write_bytes(b)
                os.symlink(base / "secret", p)
            elif how == "dir":
                p.mkdir()

    def compression(d, s, draw):
        f = any_file(d, draw)
        if f:
            f["object"]["compression"] = draw(st.sampled_from(
                ["zstd", None, 5, "LZ4", "", "none", "lz4"]))

    def lz4_frame(d, s, draw):
        lz = [f for f in files(d) if isinstance(f, dict) and isinstance(f.get("object"), dict)
              and f["object"].get("compression") == "lz4" and stored_file(s, f)
              and isinstance(f["object"].get("frames"), list) and f["object"]["frames"]
              and ints(*f["object"]["frames"], f["object"].get("frame_size"),
                       f["object"].get("size"), f["object"].get("stored_size"))]
        if not lz:
            return
        o = lz[0]["object"]
        fs = o["frame_size"]
        how = draw(st.sampled_from(["expand", "short", "garbage", "shift", "two", "bound"]))
        p = stored_file(s, lz[0])
        blob = p.read_bytes()
        first, rest = blob[:o["frames"][0]], blob[o["frames"][0]:]
        if how == "expand":
            first = lz4.frame.compress(bytes(fs + draw(st.integers(1, 3 * fs))))
        elif how == "short":
            first = lz4.frame.compress(bytes(max(0, min(fs, o["size"]) - 1)))
        elif how == "garbage":
            first = draw(st.binary(min_size=1, max_size=64))
        elif how == "two":  # two lz4 frames in the place of one
            half = min(fs, o["size"]) // 2
            first = lz4.frame.compress(bytes(half)) + lz4.frame.compress(bytes(half))
        elif how == "shift" and len(o["frames"]) > 1:
            o["frames"][0] -= 1
            o["frames"][1] += 1
            return
        elif how == "bound":
            o["frames"][0] = validate.lz4_frame_bound(fs) + 1
            return
        p.write_bytes(first + rest)
        o["stored_size"] += len(first) - o["frames"][0]
        o["frames"][0] = len(first)

    def key(d, s, draw):
        f = any_file(d, draw)
        if f:
            f["object"]["key"] = draw(st.sampled_from(
                ["../../secret", "/etc/passwd", f"data/{NODE}/../../../secret",
                 "data/other/1/x", f"data/{NODE}/./x", "manifests/x.json", 7,
                 f"data/{NODE}//x", f"data/{NODE}/nothing"]))

    def wrong_type(d, s, draw):
        field = draw(st.sampled_from(["files", "dirs", "symlinks", "kind", "format", "version",
                                      "commit", "mode", "target"]))
        d[field] = draw(st.sampled_from(
            [{}, "x", [1], 5, None, "fifo", 3, "2", True, [None], [{"path": 1}], 2 ** 70]))

    def mode(d, s, draw):
        v = draw(st.sampled_from([0o7777, -1, "755", 2 ** 40, 0o4755, 0, 0o1777, 0o2700]))
        f = any_file(d, draw)
        if f and draw(st.booleans()):
            f["mode"] = v
        else:
            d["mode"] = v

    def link_target(d, s, draw):
        add(d, "symlinks", {"path": "lnk", "target": draw(st.sampled_from(
            ["", "a\0b", 5, "/", "../../../../../../etc", outside, "%FF", "x" * 5000]))})

    def version(d, s, draw):
        d["version"] = draw(st.sampled_from([1, 3, 0, -1, "1"]))

    def total(d, s, draw):
        d["total_bytes"] = draw(st.sampled_from([-1, 2 ** 63, "0", None]))

    def raw(d, s, draw):
        return draw(st.sampled_from(
            [b"", b"{", b"[]", b"null", b'{"format": "ckptfs-manifest", "version": 2}',
             b"\xff\xfe", b"[" * 100_000, json.dumps(d).encode()[:-1], b'"x"' * 3]))

    return {f.__name__: f for f in (
        set_path, file_path, link_then_file, link_then_dir, dir_under_file, duplicate, size,
        crc, flip_byte, resize_object, compression, lz4_frame, key, wrong_type, mode,
        link_target, version, total, raw)}


MUTATION_NAMES = sorted(_mutations(Path("/")))


@settings(max_examples=int(os.environ.get("FUZZ_N", "800")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(["dir", "dir", "file", "symlink"]),
       muts=st.lists(st.sampled_from(MUTATION_NAMES), max_size=3))
def test_fuzz_manifests_and_objects(tmp_path, data, kind, muts):
    """Valid sets (drawn) restore byte for byte; mutated ones (paths with '..', absolute, NUL,
    a file under a symlink, huge or negative sizes, wrong types, wrong CRCs, unknown
    compression, lz4 frames that expand beyond frame_size, missing/short/symlinked objects...)
    make `restore` exit with a documented code, never raise, never leave anything at the
    target, never make a setuid or world-writable file, never touch anything outside DEST."""
    draw = data.draw
    base = Path(tempfile.mkdtemp(dir=tmp_path))
    try:
        s = Store(base / "store")
        dest = base / "w" / "a" / "b" / "dest"
        dest.parent.mkdir(parents=True)
        want: dict = {}
        if kind == "symlink":
            d = doc("s/ln", "symlink", target=draw(st.sampled_from(["x", "/abs", "../../.."])))
            want = ("l", os.fsencode(d["target"]))
        elif kind == "file":
            body = draw(st.binary(max_size=3000))
            o = s.obj(body, draw(st.sampled_from(["none", "lz4"])),
                      draw(st.sampled_from([64, 1000, 4096])))
            d = doc("s/f.bin", "file", [file_entry("", o, 0o600)])
            want = ("f", body, 0o600)
        else:
            picked = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
            frame = draw(st.sampled_from([64, 1000, 4096]))
            want = {b".": ("d", 0o755)}
            files = []
            for n in picked:
                body = draw(st.binary(max_size=3000))
                files.append(file_entry(names.escape_path(n), s.obj(
                    body, draw(st.sampled_from(["none", "lz4"])), frame)))
                want[n] = ("f", body, 0o644)
                for i in range(1, n.count(b"/") + 1):
                    want[b"/".join(n.split(b"/")[:i])] = ("d", 0o755)
            d = doc("s/step_%FF", files=files, dirs=[{"path": "empty", "mode": 0o700}],
                    symlinks=[{"path": "ln", "target": "a"}])
            want.update({b"empty": ("d", 0o700), b"ln": ("l", b"a")})
        mutate = _mutations(base)
        for name in muts:
            if isinstance(d, dict):
                d = mutate[name](d, s, draw) or d
        raw = d if isinstance(d, bytes) else json.dumps(d).encode()
        try:
            key = keys.manifest_key(validate.path(d["path"], 2, "path"))
            set_arg = d["path"]
        except (validate.DocumentError, TypeError, KeyError, IndexError):
            key, set_arg = "manifests/evil.json", "evil"
        s.manifest(raw, key=key)
        try:
            validate.manifest(raw, key)
            valid = True
        except validate.ManifestError:
            # or a version-1 manifest at the key of its literal path (docs/FORMAT.md "Names")
            try:
                valid = d["version"] == 1 and key == f"manifests/{d['path']}.json" and \
                    bool(validate.manifest(raw))
            except (validate.ManifestError, TypeError, KeyError, IndexError):
                valid = False
        (base / "outside_file").write_bytes(b"keep")
        before = snapshot(base, (dest, base / "d2"))

        rc, out, err = run_main("list", s.url)
        assert rc == 0 and "Traceback" not in err
        assert len(err.splitlines()) == (0 if valid else 1), err
        assert len(out.splitlines()) == (1 if valid else 0), out
        rc, _, err = run_main("restore", s.url, set_arg, str(dest))
        assert rc in RESTORE_CODES, (rc, err)
        assert (rc == 0) == (err == "") and (rc == 0 or one_line(err)), err
        if not valid:
            assert rc == CORRUPT, err
        if not muts:
            assert rc == 0, err
            assert restored(dest, d["path"]) == want
        if rc != 0 and dest.exists():
            assert all(not fs for _, _, fs in os.walk(dest)), "partial output left"
        for dirpath, dirs, files in os.walk(dest):
            for n in dirs + files:
                m = os.lstat(os.path.join(dirpath, n)).st_mode
                assert stat.S_ISLNK(m) or not m & 0o7002, (n, oct(m))
        if isinstance(d, dict):  # the library entry point, given the raw document
            try:
                cr.restore_to(cr.FileStoreView(s.root), d, base / "d2")
            except cr.RestoreError as e:
                assert "\n" not in str(e)
        assert snapshot(base, (dest, base / "d2")) == before
    finally:
        for dirpath, dirs, _ in os.walk(base):
            for n in dirs:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    os.chmod(p, 0o755)
        shutil.rmtree(base)


# -- S3: ranged reads --------------------------------------------------------------------------

def test_s3_store_restores_by_ranges_and_refuses_a_corrupt_object(s3_bucket, tmp_path,
                                                                    monkeypatch):
    import boto3

    endpoint, bucket = s3_bucket
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    local = Store(tmp_path / "local")
    data = {"a": os.urandom(50_000), "b": bytes(40_000) + os.urandom(100)}
    fs = [file_entry("a", local.obj(data["a"], "none", 8192)),
          file_entry("b", local.obj(data["b"], "lz4", 8192))]
    local.manifest(doc("ck/step_1", files=fs))
    bad = dict(fs[0]["object"], crc32c=fs[0]["object"]["crc32c"] ^ 1)
    local.manifest(doc("ck/bad", "file", [file_entry("", bad)]))
    for p in (tmp_path / "local" / "objects").rglob("*"):
        if p.is_file():
            s3.put_object(Bucket=bucket, Key="pre/" + str(p.relative_to(
                tmp_path / "local" / "objects")), Body=p.read_bytes())
    # many ranges; frames in pieces (the decoder's streaming step: cachemgr.format.decode)
    monkeypatch.setattr(decode, "READ_BYTES", 3000)
    url = f"s3://{bucket}/pre"
    rc, out, err = run_main("list", url, "--endpoint-url", endpoint)
    assert rc == 0 and [ln.split()[-1] for ln in out.splitlines()] == ["ck/bad", "ck/step_1"]
    rc, _, err = run_main("restore", url, "ck/step_1", str(tmp_path / "d"),
                          "--endpoint-url", endpoint)
    assert (rc, err) == (0, "")
    assert restored(tmp_path / "d", "ck/step_1") == {
        b".": ("d", 0o755), b"a": ("f", data["a"], 0o644), b"b": ("f", data["b"], 0o644)}
    rc, _, err = run_main("restore", url, "ck/bad", str(tmp_path / "d"),
                          "--endpoint-url", endpoint)
    assert rc == CORRUPT and one_line(err) and "CRC32C mismatch" in err
    assert not (tmp_path / "d" / "ck" / "bad").exists()
    rc, _, err = run_main("restore", url, "ck/nothing", str(tmp_path / "d"),
                          "--endpoint-url", endpoint)
    assert rc == NO_SET and one_line(err)


# -- bounded memory ----------------------------------------------------------------------------

@pytest.mark.parametrize("compression", ["lz4", "none"])
def test_a_256_mib_file_restores_in_bounded_memory(tmp_path, compression):
    """One 256 MiB file (zeros: lz4 frames, or a sparse uncompressed object) restored by the
    CLI in a child process whose peak RSS stays under 150 MiB."""
    size, frame = 256 << 20, 4 << 20
    zeros = bytes(frame)
    whole = 0
    for _ in range(size // frame):
        whole = crc32c.crc32c(zeros, value=whole)
    s = Store(tmp_path / "store")
    key = f"data/{NODE}/1/1/big"
    p = s.path(key)
    p.parent.mkdir(parents=True)
    o = {"key": key, "size": size, "crc32c": whole, "compression": compression,
         "chunk_size": frame, "chunk_crcs": [crc32c.crc32c(zeros)] * (size // frame)}
    with open(p, "wb") as f:
        if compression == "lz4":
            z = lz4.frame.compress(zeros)
            for _ in range(size // frame):
                f.write(z)
            o.update(frame_size=frame, frames=[len(z)] * (size // frame))
        else:
            f.truncate(size)
    o["stored_size"] = p.stat().st_size
    s.manifest(doc("big.bin", "file", [file_entry("", o)]))
    dest = tmp_path / "dest"
    # The script run as __main__, then its own peak RSS (VmHWM: this process's memory since
    # exec; ru_maxrss of a child would also count the pytest process it was forked from).
    probe = ("import runpy, sys\n"
             "sys.argv = sys.argv[1:]\n"
             "try:\n"
             "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    rc = e.code\n"
             "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')]\n"
             "print(hwm[0].split()[1], file=sys.stderr)\n"
             "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", probe, str(SCRIPT), "restore", s.url, "big.bin",
                        str(dest)], check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    peak_kib = int(r.stderr.split()[-1])
    assert peak_kib < 150 * 1024, f"peak RSS {peak_kib // 1024} MiB"
    out = dest / "big.bin"
    assert out.stat().st_size == size
    got = 0
    with open(out, "rb") as f:
        while b := f.read(frame):
            got = crc32c.crc32c(b, value=got)
    assert got == whole


# -- without ckptfs installed ------------------------------------------------------------------

def test_the_script_needs_only_the_stdlib_modules_of_cachemgr(tmp_path):
    """A copy of the script beside only the modules it declares (`MODULES`: cachemgr/__init__.py
    and the stdlib-only modules of cachemgr/format/, the decoder among them) validates with them
    (an invalid manifest: one line on stderr in `list`, exit 3 in `restore`), loads every one of
    them and imports nothing else of ckptfs (no trio, no pyfuse3, no boto3 for file://)."""
    repo = Path(__file__).resolve().parents[2]
    copy = tmp_path / "copy"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, copy / "scripts")
    assert "cachemgr/format/decode.py" in cr.MODULES and "cachemgr/__init__.py" in cr.MODULES
    for m in cr.MODULES:
        (copy / m).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / m, copy / m)
    want = sorted(m.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
                  for m in cr.MODULES)
    s = Store(tmp_path / "store")
    s.manifest(doc("ok", "file", [file_entry("", s.obj(b"fine"))]))
    s.manifest(doc("../bad", "file", [file_entry("", s.obj(b"x"))]), key="manifests/bad.json")
    probe = ("import runpy, sys\n"
             "sys.argv = ['ckpt_restore.py'] + sys.argv[1:]\n"
             "try:\n"
             f"    runpy.run_path({str(copy / 'scripts' / 'ckpt_restore.py')!r}, "
             "run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    rc = e.code\n"
             "import cachemgr\n"
             "print('cachemgr', cachemgr.__file__)\n"
             "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] in "
             "('cachemgr', 'ckptfs', 'trio', 'pyfuse3', 'boto3', 'botocore')))\n"
             "sys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", probe, "list", s.url], check=False,
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout and f"cachemgr {copy / 'cachemgr' / '__init__.py'}" in r.stdout
    assert f"loaded {want}" in r.stdout, r.stdout  # exactly MODULES: no trio, nothing else
    assert "trio" not in r.stdout.split("loaded", 1)[1]
    assert one_line(r.stderr) and "manifests/bad.json" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", probe, "restore", s.url, "bad",
                        str(tmp_path / "d")], check=False, capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == CORRUPT and one_line(r.stderr), r.stderr
