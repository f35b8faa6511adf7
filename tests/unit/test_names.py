"""File names that are not UTF-8 (Linux names are bytes): the escaped form of cachemgr.format.names
(docs/FORMAT.md "Names"), and sets holding such names through real mounts: uploaded, published
(S3 keys and strict JSON), restored with their exact byte names on a fresh node and without
ckptfs, rotated away, with every directory's link count right; plus names with '%' and
non-ASCII UTF-8, whose keys and manifests must stay exactly what they always were.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import ckpt_restore
import pytest
from ckpt_restore import FileStoreView, S3StoreView, manifests, restore_to
from conftest import REPO, ckptfs_cmd, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfs
from cachemgr.core.fs import CacheFs
from cachemgr.format import manifest as mf
from cachemgr.format import names
from cachemgr.store import StoreError
from cachemgr.tiering import parts

# ----------------------------------------------------------------------------------------------
# the escaping itself

names_bytes = st.binary(min_size=1, max_size=40).filter(lambda b: b"/" not in b and b"\0" not in b)
# Names mixing the bytes that matter: '%', hex digits, UTF-8 lead/continuation bytes, 0xFF.
tricky = st.lists(st.sampled_from([b"%", b"2", b"5", b"F", b"C3", b"A9", b"\xc3", b"\xa9",
                                   b"\xff", b"\xe9", b"a", "é".encode(), b"%25", b"%FF"]),
                  min_size=1, max_size=8).map(b"".join)


@pytest.mark.parametrize("name, form", [
    ("ckpt-é.pt".encode(), "ckpt-é.pt"),
    (b"50%.pt", "50%.pt"),
    (b"a%20b", "a%20b"),
    (b"x%c3", "x%c3"),
    (b"ckpt-\xff.pt", "ckpt-%FF.pt"),
    (b"step_\xe9\xff%", "step_%E9%FF%25"),
    (b"ckpt-%C3%A9.pt", "ckpt-%25C3%25A9.pt"),
    (b"%25", "%2525"),
    (b"\xc3", "%C3"),
])
def test_escaped_forms_of_the_format_doc(name, form):
    assert names.escape_name(name) == form
    assert names.unescape_name(form) == name
    assert ckpt_restore.unescape_name(form) == name


@settings(max_examples=400, deadline=None)
@given(st.one_of(names_bytes, tricky))
def test_escape_round_trips_and_is_valid_utf8(name):
    form = names.escape_name(name)
    form.encode("utf-8")  # strict: no surrogates, a valid S3 key / SQLite text / JSON string
    assert names.unescape_name(form) == name
    assert ckpt_restore.unescape_name(form) == name  # the restore script reads it the same way
    assert names.is_canonical_path(form)
    path = name + b"/" + name
    assert names.escape_path(path) == form + "/" + form
    assert names.unescape_path(names.escape_path(path)) == path


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=30).filter(lambda s: "/" not in s and "\0" not in s))
def test_valid_utf8_names_keep_their_text_unless_they_hold_an_escape(text):
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates are not names
        return
    form = names.escape_name(raw)
    if not names.is_escaped(text):
        assert form == text  # every key such a name ever had is unchanged
    else:
        assert form != text and names.unescape_name(form) == raw


def test_no_two_names_share_a_form():
    cands = [b"a%FF", b"a\xff", b"a%25FF", b"a%2525FF", b"a%", b"a%25", b"a\xff%", b"a%C3%A9",
             "aé".encode(), b"a\xc3\xa9%25", b"a%c3", b"a%20"]
    forms = [names.escape_name(c) for c in cands]
    assert len(set(forms)) == len(cands), forms
    assert not names.is_canonical_path("a%FFb%")  # a bare '%' beside escapes: not written
    assert not names.is_canonical_path("a\udcff")


def test_object_keys_are_valid_utf8_and_plain_names_keep_theirs():
    from cachemgr.tiering.uploadqueue import object_key

    assert object_key("n1", 7, 2, "ckpt/ckpt-é.pt") == "data/n1/7/2/ckpt-é.pt"
    assert object_key("n1", 7, 2, "ckpt/50%.pt") == "data/n1/7/2/50%.pt"
    assert object_key("n1", 7, 2, "c/" + "x" * 120) == "data/n1/7/2/" + "x" * 100
    long_form = names.escape_name(b"\xff" * 255)
    key = object_key("n1", 7, 2, "c/" + long_form)
    assert key.endswith("%FF") and len(key.rsplit("/", 1)[1]) <= 100
    key = object_key("n1", 7, 2, "c/" + "x" * 98 + long_form)  # cut inside an escape
    assert key.rsplit("/", 1)[1] == "x" * 98


# ----------------------------------------------------------------------------------------------
# manifests and part records


def _strict(data: bytes) -> dict:
    """Parse like a strict JSON parser: a lone surrogate (\\udcXX) is refused."""
    doc = json.loads(data.decode("utf-8"))

    def walk(x):
        if isinstance(x, str):
            x.encode("utf-8")
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    return doc


def _obj(key: str) -> dict:
    return {"key": key, "size": 1, "stored_size": 1, "crc32c": 0, "compression": "none",
            "frame_size": 0, "frames": None, "chunk_size": 4194304, "chunk_crcs": [0]}


def _manifest(path: str, rels: list[str], dirs=(), links=()) -> dict:
    files = [{"path": r, "size": 1, "mode": 0o644, "mtime_ns": 1, "object": _obj(f"data/n/{i}/1/x")}
             for i, r in enumerate(rels)]
    layout = {"dirs": [{"path": d, "mode": 0o755, "mtime_ns": 1} for d in dirs],
              "symlinks": [{"path": p, "target": t} for p, t in links], "mode": 0o755}
    return mf.build(path=path, kind="dir", seq=1, node="n", reason="dcp", committed_ns=1,
                    layout=layout, files=files)


def test_plain_manifests_stay_version_1_byte_for_byte():
    m = _manifest("ckpt/step-é", ["50%.pt", "a%20b", "x%c3"], dirs=["sub"],
                  links=[("latest", "50%.pt")])
    assert m["version"] == 1
    assert mf.dumps(m) == json.dumps(m, indent=1, sort_keys=True).encode()  # as always written
    assert mf.loads(mf.dumps(m)) == m


def test_escaped_manifests_are_version_2_strict_json_and_read_back():
    m = _manifest("ckpt/step_%FF", ["__0_0.distcp", "sub%E9/x%FE.bin", "50%.pt"],
                  dirs=["sub%E9", "empty%FE%25"], links=[("link%FF", "../t%FF/x")])
    assert m["version"] == 2
    data = mf.dumps(m)
    assert b"\\ud" not in data
    assert _strict(data) == mf.loads(data) == m
    # A version-2 field that is not in the escaped form is refused, not guessed at.
    bad = json.loads(data)
    bad["files"][0]["path"] = "a%FFb%"
    with pytest.raises(mf.ManifestError):
        mf.loads(json.dumps(bad).encode())
    bad["version"] = 3
    with pytest.raises(mf.ManifestError):
        mf.loads(json.dumps(bad).encode())


def test_legacy_surrogates_are_read_and_written_as_escapes():
    # An index or a store of an older ckptfs holds undecodable bytes as surrogates (a set
    # layout's empty directory b"d\xff", a symlink target): they become escapes, exactly.
    m = _manifest("ckpt/s", ["f"], dirs=["d\udcff"], links=[("l", "t\udcfe")])
    assert m["version"] == 2 and m["dirs"][0]["path"] == "d%FF"
    assert m["symlinks"][0]["target"] == "t%FE"
    old = json.loads(mf.dumps(_manifest("ckpt/s", ["f"])))
    old["dirs"] = [{"path": "d\udcff", "mode": 0o755, "mtime_ns": 1}]
    got = mf.loads(json.dumps(old).encode())  # ensure_ascii: "d\\udcff" in the JSON
    assert got["version"] == 1 and got["dirs"][0]["path"] == "d%FF"
    # A version-1 literal name that looks escaped reads as its escaped form.
    old["path"] = "ckpt/x%C3"
    assert mf.loads(json.dumps(old).encode())["path"] == "ckpt/x%25C3"
    # Nothing writes a lone surrogate: refused as a store error (the set fails with it).
    doc = _manifest("ckpt/s", ["f"])
    doc["commit"]["reason"] = "x\udcff"
    with pytest.raises(StoreError):
        mf.dumps(doc)


def test_part_records_with_escaped_names():
    d = names.escape_path(b"run/step_\xff.tmp")
    assert d == "run/step_%FF.tmp"
    key = parts.part_key(d, "6d60a523")
    assert key == "parts/run/step_%FF.tmp/@6d60a523.json"
    assert parts.parse_key(key) == (d, "6d60a523")
    rec = parts.build("n1", d, [{"name": "x%FE.bin", "size": 3, "mode": 0o644, "mtime_ns": 1,
                                 "object": None},
                                {"name": "__0_0.distcp", "size": 3, "mode": 0o644,
                                 "mtime_ns": 1, "object": None}])
    assert rec["version"] == 2
    data = parts.dumps(rec)
    assert _strict(data) == parts.loads(data) == rec
    plain = parts.build("n1", "run/step_1.tmp", [{"name": "50%.pt", "size": 3, "mode": 0o644,
                                                  "mtime_ns": 1, "object": None}])
    assert plain["version"] == 1
    assert parts.dumps(plain) == json.dumps(plain, sort_keys=True).encode()
    legacy = dict(plain, dir="run/s\udcff", files=[{"name": "f\udcfe", "size": 1}])
    got = parts.loads(json.dumps(legacy).encode())
    assert got["dir"] == "run/s%FF" and got["files"][0]["name"] == "f%FE"
    for bad_name in ("a/b", ""):
        with pytest.raises(parts.PartError):
            parts.loads(json.dumps(dict(rec, files=[{"name": bad_name, "size": 1}])).encode())


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
