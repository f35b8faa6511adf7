"""In-process tests of what a node does with the store's documents: `cachemgr.format.validate` and
`cachemgr.tiering.remote.RemoteSync`, without FUSE or a daemon (issue "Trust nothing read from the
store").

`Harness` (tests/inproc.py) is a real `CacheFs` (built as tests/unit/test_core.py builds it), a
real `SetRegistry` on its index and a real `LocalStore` in a temporary directory, and a RemoteSync
built on them as `cachemgr.engine.Engine` builds it, with `StandIn` giving the interfaces the
Engine gives (`mark_parts`: PartPublisher.mark_all, `changed`: Engine._changed_now); the stand-in
is also connected to the core (`CacheFs.connect`) as its hooks, for what the core calls while
RemoteSync changes the tree (a purge, freed space), with a real `cachemgr.restore.restorer.Restorer`
behind them as its read-through. Sets are published as another node would publish them:
objects and manifests written with the store's API (manifests built with
`cachemgr.format.manifest.build`), and `RemoteSync.sync_once()` is run with trio.run.

  1. Fuzz of `validate.manifest` / `validate.part_record` (hypothesis): over arbitrary JSON,
     arbitrary bytes and mutations of valid documents only `DocumentError` escapes, and what is
     accepted holds the invariants the rest of ckptfs relies on. A list of named mutations
     that must be refused.
  2. RemoteSync over a store mixing valid and invalid manifests: valid sets appear exactly as
     published, invalid ones never, each invalid one is counted and logged once.
  3. All-or-nothing apply: a manifest whose apply fails half-way (after the entries of the set
     it replaces were removed) leaves that set as it was: index, in-memory inodes, cached
     bytes, cache files and set registry; the next listing applies it once the fault is gone.
"""

from __future__ import annotations

import copy
import errno
import inspect
import json
import logging
import os
import random
import re
import sqlite3
import stat
import tempfile
import time
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachemgr.core.errors import FsError, IndexFull
from cachemgr.core.fs import CacheFs
from cachemgr.core.index import ROOT_INO
from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.format.keys import manifest_key, part_key
from cachemgr.format.names import (
    escape_name,
    escape_path,
    is_canonical_path,
    unescape_name,
    unescape_path,
)
from cachemgr.format.objects import StoredObject
from cachemgr.store import StoreError
from cachemgr.tiering import members, parts
from tests.faultstore import FaultyStore
from tests.inproc import OTHER, Harness, memory_matches_index

THIRD = "77aa88bb"  # another writer of a multi-node set
_NOW = time.time_ns()  # a fixed bound for generated commit times (hypothesis replays)
FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_STORE = settings(max_examples=50, deadline=None,
                      suppress_health_check=[HealthCheck.too_slow,
                                             HealthCheck.function_scoped_fixture,
                                             HealthCheck.data_too_large])


# ==============================================================================================
# the harness (tests/inproc.py's `Harness`)


@pytest.fixture
def h(tmp_path):
    h = Harness(tmp_path)
    yield h
    try:
        h.core.index.conn.execute("SELECT 1")
    except sqlite3.ProgrammingError:
        return  # closed by the test
    h.close()


def resolve(core: CacheFs, path: str) -> int | None:
    """The inode at `path` (escaped form) in the index, or None."""
    ino = ROOT_INO
    for c in path.split("/"):
        row = core.index.get_inode(ino)
        if row is None or not stat.S_ISDIR(row[1]):
            return None
        ino = core.index.lookup(ino, unescape_name(c))
        if ino is None:
            return None
    return ino


def _entry(core: CacheFs, ino: int) -> tuple:
    """What the index says `ino` is: ("d",), ("f", size, mode, object key) or ("l", target)."""
    row = core.index.get_inode(ino)
    mode = row[1]
    if stat.S_ISDIR(mode):
        return ("d",)
    if stat.S_ISLNK(mode):
        return ("l", escape_path(bytes(row[10])))
    obj = core.index.conn.execute("SELECT obj FROM inodes WHERE ino=?", (ino,)).fetchone()[0]
    return ("f", row[4], stat.S_IMODE(mode), json.loads(obj)["key"] if obj else None)


def tree(core: CacheFs, ino: int) -> dict[str, tuple]:
    """{rel: _entry} of everything under directory `ino`, from the index."""
    out = {}
    stack = [(ino, "")]
    while stack:
        d, prefix = stack.pop()
        for _id, name, child in core.index.list_dentries(d, 0, 1 << 30):
            rel = prefix + escape_name(bytes(name))
            out[rel] = _entry(core, child)
            if out[rel] == ("d",):
                stack.append((child, rel + "/"))
    return out


def expected_tree(m: dict) -> dict[str, tuple]:
    """What the namespace holds under a dir set restored from manifest `m` (normalised)."""
    out: dict[str, tuple] = {}
    for f in m["files"]:
        out[f["path"]] = ("f", f["size"], f["mode"], f["object"]["key"])
    for s in m["symlinks"]:
        out[s["path"]] = ("l", s["target"])
    for rel in [d["path"] for d in m["dirs"]] + list(out):
        comps = rel.split("/")
        for i in range(1, len(comps) + (rel not in out)):  # its parents, and a listed dir
            out.setdefault("/".join(comps[:i]), ("d",))
    return out


def assert_set_restored(h: Harness, m: dict, etag: str | None = None) -> None:
    """The set of (normalised) manifest `m` is in the namespace exactly as published, and the
    set registry has it durable."""
    ino = resolve(h.core, m["path"])
    assert ino is not None, m["path"]
    if m["kind"] == "dir":
        assert _entry(h.core, ino) == ("d",)
        assert stat.S_IMODE(h.core.index.get_inode(ino)[1]) == m["mode"]
        assert tree(h.core, ino) == expected_tree(m)
    elif m["kind"] == "file":
        (f,) = m["files"]
        assert _entry(h.core, ino) == ("f", f["size"], f["mode"], f["object"]["key"])
    else:
        assert _entry(h.core, ino) == ("l", m["target"])
    s = h.sets.newest_at(m["path"])
    assert s is not None and s.state == "durable" and s.origin == m["commit"]["node"]
    assert s.root_ino == ino
    if etag is not None:
        assert s.etag == etag


def memory_problems(core: CacheFs) -> list[str]:
    """Differences between the in-memory inodes and the index, and `cached_bytes` against
    what the index's cached files hold (the same check as tests/unit/test_diskfull.py)."""
    return memory_matches_index(core)


# ==============================================================================================
# 1. validate: fuzz


def _ok_name_bytes(b: bytes) -> bool:
    return b not in (b".", b"..") and b"/" not in b and b"\0" not in b


NAME_BYTES = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\0"),
            min_size=1, max_size=8).map(lambda s: s.encode()),
    st.binary(min_size=1, max_size=8),
).filter(_ok_name_bytes)
NAMES = NAME_BYTES.map(escape_name)  # escaped form
NODES = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,12}", fullmatch=True).filter(
    lambda s: s != "local")
# A dir set's tree: {name: ("f", (data size, mode)) | ("l", target) | ("d", subtree)}.
_LEAF = st.one_of(st.tuples(st.just("f"), st.tuples(st.integers(0, 40), st.integers(0, 0o7777))),
                  st.tuples(st.just("l"), NAMES))
TREES = st.dictionaries(NAMES, st.recursive(
    _LEAF, lambda c: st.tuples(st.just("d"), st.dictionaries(NAMES, c, max_size=3)),
    max_leaves=6), max_size=4)


def flatten(t: dict, prefix: str = "") -> tuple[dict, list, dict]:
    """(files {rel: leaf}, dirs [rel], links {rel: target}) of a TREES value."""
    files, dirs, links = {}, [], {}
    for name, (kind, v) in sorted(t.items()):
        rel = prefix + name
        if kind == "f":
            files[rel] = v
        elif kind == "l":
            links[rel] = v
        else:
            dirs.append(rel)
            f2, d2, l2 = flatten(v, rel + "/")
            files.update(f2)
            dirs += d2
            links.update(l2)
    return files, dirs, links


@st.composite
def stored_objects(draw, writers: list[str], size: int) -> dict:
    """A valid StoredObject JSON of `size` raw bytes under data/<one of writers>/ (no store)."""
    key = f"data/{draw(st.sampled_from(writers))}/{draw(st.integers(1, 99))}/1/" + \
        draw(st.sampled_from(["f", "__0_0.distcp", "x.pt", "%C3%A9"]))
    crc = draw(st.integers(0, (1 << 32) - 1))
    if draw(st.booleans()):
        frame = draw(st.integers(1, 16))
        n = -(-size // frame)
        frames = draw(st.lists(st.integers(1, validate.lz4_frame_bound(frame)), min_size=n,
                               max_size=n))
        chunked = draw(st.booleans())
        o = StoredObject(key=key, size=size, stored_size=sum(frames), crc32c=crc,
                         compression="lz4", frame_size=frame, frames=tuple(frames),
                         chunk_size=frame if chunked else 0,
                         chunk_crcs=tuple(range(n)) if chunked else None)
    else:
        cs = draw(st.integers(0, 16))
        o = StoredObject(key=key, size=size, stored_size=size, crc32c=crc, chunk_size=cs,
                         chunk_crcs=tuple([7] * -(-size // cs)) if cs else None)
    return o.to_json()


@st.composite
def manifests(draw) -> dict:
    """A valid manifest document (as cachemgr.format.manifest.build writes it)."""
    kind = draw(st.sampled_from(["dir", "dir", "file", "symlink"]))
    path = "/".join(draw(st.lists(NAMES, min_size=1, max_size=3)))
    node = draw(NODES)
    writers = [node]
    extra = draw(st.lists(NODES, max_size=2, unique=True))
    writers += [n for n in extra if n != node]
    files: list[dict] = []
    layout: dict = {"dirs": [], "symlinks": [], "mode": draw(st.integers(0, 0o7777))}
    if kind == "dir":
        fs, ds, ls = flatten(draw(TREES))
        for rel, (size, mode) in fs.items():
            files.append({"path": rel, "size": size, "mode": mode,
                          "mtime_ns": draw(st.integers(-(1 << 63), (1 << 63) - 1)),
                          "object": draw(stored_objects(writers, size))})
        layout["dirs"] = [{"path": d, "mode": draw(st.integers(0, 0o7777)), "mtime_ns": 5}
                          for d in ds]
        layout["symlinks"] = [{"path": r, "target": t} for r, t in ls.items()]
        if draw(st.booleans()):
            layout["from"] = "/".join(draw(st.lists(NAMES, min_size=1, max_size=2)))
    elif kind == "file":
        size = draw(st.integers(0, 40))
        files.append({"path": "", "size": size, "mode": 0o644, "mtime_ns": 3,
                      "object": draw(stored_objects(writers, size))})
    else:
        layout["target"] = escape_path(draw(st.binary(min_size=1, max_size=30).filter(
            lambda b: b"\0" not in b)))
    m = mf.build(path=path, kind=kind, seq=draw(st.integers(0, 1 << 40)), node=node,
                 reason=draw(st.sampled_from(["dcp", "rename", "close", "request"])),
                 committed_ns=draw(st.integers(0, _NOW)), layout=layout, files=files)
    if len(writers) > 1:
        m["commit"]["nodes"] = writers
    return m


@st.composite
def part_records(draw) -> dict:
    node = draw(NODES)
    names = draw(st.lists(NAMES, max_size=4, unique=True))
    files = []
    for name in names:
        size = draw(st.integers(0, 40))
        files.append({"name": name, "size": size, "mode": draw(st.integers(0, 0o7777)),
                      "mtime_ns": 9, "object": draw(st.one_of(
                          st.none(), stored_objects([node], size)))})
    dir_path = "/".join(draw(st.lists(NAMES, min_size=1, max_size=3)))
    return parts.build(node, dir_path, files)


def _check_name_path(p: str, *, empty_ok: bool = False) -> None:
    """`p` is a relative path of single valid names, in the canonical escaped form."""
    if empty_ok and p == "":
        return
    assert isinstance(p, str) and is_canonical_path(p), p
    for c in p.split("/"):
        assert c not in ("", ".", ".."), p
        b = unescape_name(c)
        assert b not in (b".", b"..") and b"\0" not in b and b"/" not in b, p
        assert 0 < len(b) <= validate.MAX_NAME_BYTES, p
    assert len(unescape_path(p)) <= validate.MAX_PATH_BYTES


def _check_object(o: dict, writers: set[str], size: int) -> None:
    key = o["key"]
    comps = key.split("/")
    assert comps[0] == "data" and comps[1] in writers and len(comps) >= 3, key
    assert not any(p in ("", ".", "..") for p in comps) and "\0" not in key
    assert len(key.encode()) <= validate.MAX_KEY_BYTES  # encodes: no lone surrogate
    assert type(o["size"]) is int and o["size"] == size
    assert type(o["stored_size"]) is int and 0 <= o["stored_size"] <= validate.MAX_FILE_SIZE
    assert type(o["crc32c"]) is int and 0 <= o["crc32c"] < 1 << 32
    assert 0 <= o["chunk_size"] <= validate.MAX_CHUNK
    assert 0 <= o["frame_size"] <= validate.MAX_CHUNK
    StoredObject.from_json(o)  # its geometry holds (raises otherwise)


def check_manifest(out: dict, key: str | None, now_ns: int) -> None:
    """The invariants of a manifest validate.manifest accepted."""
    assert out["format"] == "ckptfs-manifest" and out["version"] in (1, 2)
    _check_name_path(out["path"])
    if key is not None:
        assert manifest_key(out["path"]) == key
    assert out["kind"] in ("dir", "file", "symlink")
    c = out["commit"]
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", c["node"]) and c["node"] != "local"
    assert type(c["seq"]) is int and 0 <= c["seq"] < 1 << 63
    assert type(c["committed_ns"]) is int
    assert 0 <= c["committed_ns"] <= now_ns + validate.MAX_CLOCK_AHEAD_NS
    writers = set(c.get("nodes", [c["node"]]))
    assert c["node"] in writers and all(w != "local" for w in writers)
    if "from" in c:
        _check_name_path(c["from"])
    if out["kind"] == "dir":
        assert out["mode"] & ~validate.MODE_MASK == 0
    if out["kind"] == "symlink":
        t = unescape_path(out["target"])
        assert 0 < len(t) <= validate.MAX_PATH_BYTES and b"\0" not in t
        assert not out["files"] and not out["dirs"] and not out["symlinks"]
    if out["kind"] == "file":
        assert len(out["files"]) == 1 and out["files"][0]["path"] == ""
        assert not out["dirs"] and not out["symlinks"]
    seen = set()
    for f in out["files"]:
        _check_name_path(f["path"], empty_ok=out["kind"] == "file")
        assert type(f["size"]) is int and 0 <= f["size"] <= validate.MAX_FILE_SIZE
        assert type(f["mode"]) is int and f["mode"] & ~validate.MODE_MASK == 0
        assert type(f["mtime_ns"]) is int and -(1 << 63) <= f["mtime_ns"] < 1 << 63
        _check_object(f["object"], writers, f["size"])
    for d in out["dirs"]:
        _check_name_path(d["path"])
        assert type(d["mode"]) is int and d["mode"] & ~validate.MODE_MASK == 0
    for s in out["symlinks"]:
        _check_name_path(s["path"])
        t = unescape_path(s["target"])
        assert 0 < len(t) <= validate.MAX_PATH_BYTES and b"\0" not in t
    leaves = {e["path"] for e in out["files"] + out["symlinks"]}
    for e in out["files"] + out["dirs"] + out["symlinks"]:
        assert e["path"] not in seen, e["path"]
        seen.add(e["path"])
        head = e["path"]
        while "/" in head:
            head = head.rsplit("/", 1)[0]
            assert head not in leaves, e["path"]
    assert out["total_bytes"] == sum(f["size"] for f in out["files"])


def check_part_record(out: dict, key: str | None) -> None:
    assert out["format"] == "ckptfs-part" and out["version"] in (1, 2)
    node = out["node"]
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", node) and node != "local"
    _check_name_path(out["dir"])
    if key is not None:
        assert part_key(out["dir"], node) == key
    names = set()
    for f in out["files"]:
        _check_name_path(f["name"])
        assert "/" not in f["name"] and f["name"] not in names
        names.add(f["name"])
        assert type(f["size"]) is int and 0 <= f["size"] <= validate.MAX_FILE_SIZE
        assert f["mode"] & ~validate.MODE_MASK == 0
        if f["object"] is not None:
            _check_object(f["object"], {node}, f["size"])
    assert type(out["updated_ns"]) is int and 0 <= out["updated_ns"] < 1 << 63


def try_manifest(data: bytes, key: str | None) -> dict | None:
    """validate.manifest: the normalised manifest, checked, or None if refused; anything but a
    DocumentError fails the test."""
    now = time.time_ns()
    try:
        out = validate.manifest(data, key, now_ns=now)
    except validate.DocumentError as e:
        assert "\n" not in str(e)  # one line, for the log and `ckptfs status`
        return None
    check_manifest(out, key, now)
    return out


def try_part_record(data: bytes, key: str | None) -> dict | None:
    try:
        out = validate.part_record(data, key)
    except validate.DocumentError as e:
        assert "\n" not in str(e)
        return None
    check_part_record(out, key)
    return out


# -- mutations -----------------------------------------------------------------------------------

DEEP = "\x00deep\x00"  # replaced by deeply nested JSON in the serialised text
NASTY = [
    None, True, False, 0, -1, 1, 7, 0o7777 + 1, (1 << 31), (1 << 32), (1 << 63) - 1, 1 << 63,
    -(1 << 63) - 1, 1 << 64, 10**30, 1.5, -0.0, 1e308, float("inf"), float("nan"),
    "", ".", "..", "/", "a/b", "/a", "a/", "a//b", "a/../b", "a\0b", "\0", "%", "%FF", "%2",
    "%41", "%25", "\udc80", "\ud800x", "x" * 256, "é" * 128, "local", "dcp", "none", "lz4",
    "zstd", "data/" + OTHER + "/1/1/f", "data/" + OTHER + "/../x", "data/zz/1/1",
    "manifests/x.json", "ckptfs-manifest", "ckptfs-part", [], {}, [0], [[[[]]]],
    {"path": "a"}, [{"path": "a"}], DEEP,
]


def _locations(doc, at=()):
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _locations(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _locations(v, (*at, i))


def _mutate(doc, at: tuple, action: str, value):
    """`doc` with one change at location `at`: replace its value, delete it, duplicate it
    (a list item) or add a key beside it."""
    if not at:
        return value if action == "replace" else doc
    doc = copy.deepcopy(doc)
    parent = doc
    for k in at[:-1]:
        parent = parent[k]
    k = at[-1]
    if action == "replace":
        parent[k] = value
    elif action == "delete":
        del parent[k]
    elif action == "dup" and isinstance(parent, list):
        parent.insert(k, copy.deepcopy(parent[k]))
    elif action == "add" and isinstance(parent, dict):
        parent[str(value) if not isinstance(value, str) else value] = copy.deepcopy(parent[k])
    else:
        parent[k] = value
    return doc


def serialise(doc, depth: int = 5000) -> bytes:
    text = json.dumps(doc)  # NaN and Infinity stay: json.loads reads them back
    return text.replace(json.dumps(DEEP), "[" * depth + "1" + "]" * depth).encode(
        "utf-8", "surrogatepass")


@st.composite
def mutated(draw, base) -> bytes:
    doc = draw(base)
    # Locations uniformly (sampled_from would favour the first: the format field), never the
    # root (replacing the whole document is what the arbitrary JSON tests do).
    rnd = random.Random(draw(st.integers(0, 1 << 32)))
    for _ in range(draw(st.integers(1, 3))):
        at = rnd.choice(list(_locations(doc))[1:] or [()])
        action = draw(st.sampled_from(["replace", "replace", "delete", "dup", "add"]))
        value = draw(st.one_of(st.sampled_from(NASTY), st.integers(), st.text(max_size=5)))
        doc = _mutate(doc, at, action, value)
    data = serialise(doc, draw(st.sampled_from([3, 500, 5000, 100_000])))
    cut = draw(st.sampled_from([None] * 7 + ["truncate", "junk", "bom"]))
    if cut == "truncate":
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif cut == "junk":
        data += draw(st.binary(min_size=1, max_size=4))
    elif cut == "bom":
        data = b"\xef\xbb\xbf" + data
    return data


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=20)


def _with_header(kind: str):
    """JSON objects with a valid format and version and anything else: validation goes past
    its first checks."""
    fmt = validate.FORMATS[kind]
    fields = ["path", "kind", "commit", "files", "dirs", "symlinks", "mode", "target",
              "total_bytes", "node", "dir", "updated_ns"]
    return st.fixed_dictionaries(
        {"format": st.just(fmt), "version": st.sampled_from([1, 2])},
        optional={f: st.one_of(JSONISH, st.sampled_from(NASTY)) for f in fields})


@FUZZ
@given(manifests())
def test_valid_manifests_are_accepted_and_normalised(m):
    key = mf.manifest_key(m["path"])
    out = try_manifest(mf.dumps(m), key)
    assert out is not None
    assert out["path"] == m["path"] and len(out["files"]) == len(m["files"])
    # A manifest naming another path than its key's is refused.
    assert try_manifest(mf.dumps(m), mf.manifest_key(m["path"] + "x")) is None


@FUZZ
@given(part_records())
def test_valid_part_records_are_accepted(r):
    out = try_part_record(parts.dumps(r), part_key(r["dir"], r["node"]))
    assert out is not None and len(out["files"]) == len(r["files"])


@FUZZ
@given(st.one_of(JSONISH, _with_header("manifest"), _with_header("part")),
       st.sampled_from([None, "manifests/a.json", "parts/a/@n.json"]))
def test_arbitrary_json_only_raises_document_errors(doc, key):
    data = serialise(doc)
    try_manifest(data, key if key is None or key.startswith("manifests/") else None)
    try_part_record(data, key if key is None or key.startswith("parts/") else None)


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_document_errors(data):
    assert try_manifest(data, None) is None
    assert try_part_record(data, None) is None


@FUZZ
@given(mutated(manifests()), st.booleans())
def test_mutated_manifests_only_raise_document_errors(data, with_key):
    key = None
    if with_key:
        try:
            key = mf.manifest_key(json.loads(data)["path"])
        except (ValueError, TypeError, KeyError, RecursionError):
            key = "manifests/x.json"
    try_manifest(data, key)


@FUZZ
@given(mutated(part_records()))
def test_mutated_part_records_only_raise_document_errors(data):
    try_part_record(data, None)


# -- named mutations that must be refused ----------------------------------------------------------

def _base_manifest() -> dict:
    """A valid dir manifest: an lz4 file with chunks, a plain file in a subdirectory, a dir,
    a symlink."""
    lz4 = StoredObject(key=f"data/{OTHER}/4/1/a", size=10, stored_size=9, crc32c=5,
                       compression="lz4", frame_size=4, frames=(3, 3, 3), chunk_size=4,
                       chunk_crcs=(1, 2, 3)).to_json()
    plain = StoredObject(key=f"data/{OTHER}/5/1/b", size=3, stored_size=3, crc32c=6).to_json()
    return mf.build(
        path="ckpt/step_1", kind="dir", seq=3, node=OTHER, reason="dcp",
        committed_ns=time.time_ns() - 10**9,
        layout={"dirs": [{"path": "sub", "mode": 0o755, "mtime_ns": 1}],
                "symlinks": [{"path": "ln", "target": "a"}], "mode": 0o755},
        files=[{"path": "a", "size": 10, "mode": 0o644, "mtime_ns": 1, "object": lz4},
               {"path": "sub/b", "size": 3, "mode": 0o644, "mtime_ns": 1, "object": plain}])


def _set(*path_and_value):
    *path, value = path_and_value

    def f(m):
        d = m
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return f


def _drop(*path):
    def f(m):
        d = m
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
    return f


def _add_file(entry):
    def f(m):
        m["files"].append(entry)
        m["total_bytes"] += entry.get("size", 0) if isinstance(entry.get("size"), int) else 0
    return f


def _file(path: str, size: int = 3, **obj) -> dict:
    o = {"key": f"data/{OTHER}/9/1/x", "size": size, "stored_size": size, "crc32c": 1,
         "compression": "none", "frame_size": 0, "frames": None, "chunk_size": 0,
         "chunk_crcs": None, **obj}
    return {"path": path, "size": size, "mode": 0o644, "mtime_ns": 1, "object": o}


MUST_REFUSE = {
    "not json": lambda m: "{",
    "not an object": lambda m: [m],
    "wrong format": _set("format", "ckptfs-part"),
    "version 3": _set("version", 3),
    "version true": _set("version", True),
    "version '1'": _set("version", "1"),
    "no path": _drop("path"),
    "path not a string": _set("path", ["ckpt"]),
    "empty path": _set("path", ""),
    "absolute path": _set("path", "/ckpt/step_1"),
    "dotdot in path": _set("path", "ckpt/../step_1"),
    "dot in path": _set("path", "./step_1"),
    "empty component": _set("path", "ckpt//step_1"),
    "trailing slash": _set("path", "ckpt/step_1/"),
    "NUL in path": _set("path", "ckpt/st\0ep"),
    "name of 256 bytes": _set("path", "ckpt/" + "x" * 256),
    "name of 256 bytes of UTF-8": _set("path", "ckpt/" + "é" * 128),
    "path over PATH_MAX": _set("path", "/".join(["x" * 200] * 21)),
    "v2 name not canonical": lambda m: m.update(version=2, path="ckpt/%41"),
    "v2 escaped slash": lambda m: m.update(version=2, path="ckpt/a%2Fb"),
    "v1 lone high surrogate": _set("path", "ckpt/\ud800"),
    "no kind": _drop("kind"),
    "kind fifo": _set("kind", "fifo"),
    "no commit": _drop("commit"),
    "commit not an object": _set("commit", [OTHER]),
    "commit.node local": _set("commit", "node", "local"),
    "commit.node empty": _set("commit", "node", ""),
    "commit.node with slash": _set("commit", "node", "a/b"),
    "commit.node an int": _set("commit", "node", 7),
    "commit.seq bool": _set("commit", "seq", True),
    "commit.seq negative": _set("commit", "seq", -1),
    "commit.seq 2**63": _set("commit", "seq", 1 << 63),
    "committed_ns 2**63": _set("commit", "committed_ns", 1 << 63),
    "committed_ns 2h ahead": _set("commit", "committed_ns", time.time_ns() + 2 * 3600 * 10**9),
    "committed_ns float": _set("commit", "committed_ns", 1.0),
    "commit.reason odd": _set("commit", "reason", "Bad Reason!"),
    "commit.from dotdot": _set("commit", "from", "../x"),
    "commit.nodes without node": _set("commit", "nodes", [THIRD]),
    "commit.nodes twice": _set("commit", "nodes", [OTHER, OTHER]),
    "commit.nodes local": _set("commit", "nodes", [OTHER, "local"]),
    "mode bool": _set("mode", True),
    "mode huge": _set("mode", 0o10000),
    "mode negative": _set("mode", -1),
    "files not a list": _set("files", {"a": 1}),
    "files entry not an object": _set("files", [1]),
    "too many entries": _set("dirs", [{}] * (validate.MAX_ENTRIES + 1)),
    "file without size": _drop("files", 0, "size"),
    "file size bool": lambda m: (m["files"][1].update(size=True),
                                 m["files"][1]["object"].update(size=True)),
    "file size negative": _set("files", 1, "size", -1),
    "file size 2**63": lambda m: (m["files"][1].update(size=1 << 63),
                                  m["files"][1]["object"].update(size=1 << 63,
                                                                 stored_size=1 << 63)),
    "file mode bool": _set("files", 0, "mode", False),
    "file mode huge": _set("files", 0, "mode", 1 << 40),
    "file mtime 2**63": _set("files", 0, "mtime_ns", 1 << 63),
    "file path empty": _set("files", 0, "path", ""),
    "file path NUL": _set("files", 0, "path", "a\0"),
    "file path dotdot": _set("files", 0, "path", ".."),
    "file path escapes": _set("files", 0, "path", "../../etc/passwd"),
    "file path absolute": _set("files", 0, "path", "/a"),
    "duplicate file paths": _set("files", 1, "path", "a"),
    "file and dir same path": _set("dirs", 0, "path", "a"),
    "symlink and file same path": _set("symlinks", 0, "path", "a"),
    "file under a file": _add_file(_file("a/x")),
    "dir under a file": _set("dirs", [{"path": "a/d", "mode": 0o755}]),
    "file under a symlink": _add_file(_file("ln/x")),
    "no object": _drop("files", 0, "object"),
    "object not an object": _set("files", 0, "object", "data/x"),
    "object key missing": _drop("files", 1, "object", "key"),
    "object key of another node": _set("files", 1, "object", "key", f"data/{THIRD}/5/1/b"),
    "object key local": _set("files", 1, "object", "key", "data/local/5/1/b"),
    "object key dotdot": _set("files", 1, "object", "key", f"data/{OTHER}/../x/b"),
    "object key empty component": _set("files", 1, "object", "key", f"data/{OTHER}//b"),
    "object key not under data": _set("files", 1, "object", "key", f"manifests/{OTHER}/x"),
    "object key too short": _set("files", 1, "object", "key", f"data/{OTHER}"),
    "object key surrogate": _set("files", 1, "object", "key", f"data/{OTHER}/\udcff"),
    "object key NUL": _set("files", 1, "object", "key", f"data/{OTHER}/a\0"),
    "object key too long": _set("files", 1, "object", "key", f"data/{OTHER}/" + "k/" * 600),
    "object size not the file's": _set("files", 1, "object", "size", 4),
    "object size bool": lambda m: (m["files"][1].update(size=1),
                                   m["files"][1]["object"].update(size=True, stored_size=1)),
    "object crc negative": _set("files", 1, "object", "crc32c", -1),
    "object crc 2**32": _set("files", 1, "object", "crc32c", 1 << 32),
    "object crc bool": _set("files", 1, "object", "crc32c", True),
    "unknown compression": _set("files", 1, "object", "compression", "zstd"),
    "compression null": _set("files", 1, "object", "compression", None),
    "none with stored_size != size": _set("files", 1, "object", "stored_size", 4),
    "none with frames": _set("files", 1, "object", "frames", [3]),
    "frames not summing": _set("files", 0, "object", "stored_size", 10),
    "frames too few": _set("files", 0, "object", "frames", [3, 6]),
    "frame of 0 bytes": _set("files", 0, "object", "frames", [0, 6, 3]),
    "frame over its bound": lambda m: m["files"][0]["object"].update(
        frames=[3, 3, 1 << 20], stored_size=6 + (1 << 20)),
    "frames not ints": _set("files", 0, "object", "frames", [3.0, 3, 3]),
    "frames bools": lambda m: m["files"][0]["object"].update(frames=[True] * 3, stored_size=3),
    "lz4 without frames": _set("files", 0, "object", "frames", None),
    "lz4 frame_size 0": _set("files", 0, "object", "frame_size", 0),
    "frame_size over MAX_CHUNK": _set("files", 0, "object", "frame_size",
                                      validate.MAX_CHUNK + 1),
    "lz4 chunks not frames": _set("files", 0, "object", "chunk_size", 2),
    "chunk crcs too few": _set("files", 0, "object", "chunk_crcs", [1, 2]),
    "chunk crc 2**32": _set("files", 0, "object", "chunk_crcs", [1, 2, 1 << 32]),
    "chunk crcs without chunk_size": lambda m: m["files"][1]["object"].update(
        chunk_size=0, chunk_crcs=[1]),
    "chunk_size negative": _set("files", 1, "object", "chunk_size", -4),
    "chunk_size over MAX_CHUNK": lambda m: m["files"][1]["object"].update(
        chunk_size=validate.MAX_CHUNK + 1, chunk_crcs=[1]),
    "total_bytes wrong": _set("total_bytes", 14),
    "dir path NUL": _set("dirs", 0, "path", "s\0b"),
    "dir mode huge": _set("dirs", 0, "mode", 0o70000),
    "dir mtime not an int": _set("dirs", 0, "mtime_ns", "1"),
    "symlink target empty": _set("symlinks", 0, "target", ""),
    "symlink target NUL": _set("symlinks", 0, "target", "a\0b"),
    "symlink target too long": _set("symlinks", 0, "target", "t" * 4096),
    "symlink target not a string": _set("symlinks", 0, "target", None),
    "file set with two files": _set("kind", "file"),
    "file set with a named file": lambda m: m.update(
        kind="file", files=m["files"][1:], dirs=[], symlinks=[], total_bytes=3),
    "symlink set with files": lambda m: m.update(kind="symlink", target="a"),
    "symlink set without target": lambda m: m.update(kind="symlink", files=[], dirs=[],
                                                      symlinks=[], total_bytes=0),
    "deeply nested path": _set("files", 0, "path", DEEP),
    "deeply nested files": _set("files", DEEP),
}


@pytest.mark.parametrize("why", sorted(MUST_REFUSE))
def test_named_mutations_are_refused(why):
    m = _base_manifest()
    assert try_manifest(mf.dumps(m), mf.manifest_key(m["path"])) is not None
    out = MUST_REFUSE[why](m)
    if isinstance(out, str):
        data = out.encode()
    else:
        data = serialise(out if isinstance(out, list) else m, depth=100_000)
    with pytest.raises(validate.DocumentError):
        validate.manifest(data, mf.manifest_key("ckpt/step_1"))


def test_normalisation_masks_modes_and_fills_defaults():
    m = _base_manifest()
    m["mode"] = 0o7777
    m["files"][0]["mode"] = 0o4777  # setuid, world-writable
    del m["files"][1]["mode"]
    m["dirs"][0]["mode"] = 0o2777
    out = validate.manifest(mf.dumps(m), mf.manifest_key(m["path"]))
    assert out["mode"] == 0o775 and out["files"][0]["mode"] == 0o775
    assert out["files"][1]["mode"] == 0o644 and out["dirs"][0]["mode"] == 0o775
    # A version-1 manifest of an older ckptfs: undecodable bytes as surrogates.
    m = _base_manifest()
    m["files"][0]["path"] = "a\udcff"
    out = validate.manifest(serialise(m), mf.manifest_key(m["path"]))
    assert out["files"][0]["path"] == "a%FF"


PART_MUST_REFUSE = {
    "node local": lambda r: r.update(node="local"),
    "dir dotdot": lambda r: r.update(dir="a/.."),
    "name with slash": lambda r: r["files"][0].update(name="a/b"),
    "name twice": lambda r: r["files"].append(dict(r["files"][0])),
    "name empty": lambda r: r["files"][0].update(name=""),
    "object of another node": lambda r: r["files"][0]["object"].update(
        key=f"data/{THIRD}/1/1/x"),
    "size bool": lambda r: (r["files"][0].update(size=True),
                            r["files"][0]["object"].update(size=True)),
    "updated_ns negative": lambda r: r.update(updated_ns=-1),
    "updated_ns 2**63": lambda r: r.update(updated_ns=1 << 63),
    "files not a list": lambda r: r.update(files="x"),
}


@pytest.mark.parametrize("why", sorted(PART_MUST_REFUSE))
def test_named_part_record_mutations_are_refused(why):
    obj = StoredObject(key=f"data/{OTHER}/1/1/x", size=3, stored_size=3, crc32c=1).to_json()
    r = parts.build(OTHER, "ckpt/step_1", [{"name": "x", "size": 3, "mode": 0o644,
                                            "mtime_ns": 1, "object": obj}])
    key = part_key("ckpt/step_1", OTHER)
    assert try_part_record(parts.dumps(r), key) is not None
    PART_MUST_REFUSE[why](r)
    with pytest.raises(validate.PartError):
        validate.part_record(serialise(r), key)
    # Read from another key: refused too.
    assert try_part_record(parts.dumps(r), part_key("ckpt/step_2", OTHER)) is None


# ==============================================================================================
# 2. RemoteSync over a store mixing valid and invalid manifests


def _skips(caplog, key: str | None = None) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "cachemgr.tiering.remote" and
            r.getMessage().startswith("skipping manifest") and
            (key is None or r.getMessage().startswith(f"skipping manifest {key}:"))]


def _normalised(m: dict) -> dict:
    return validate.manifest(mf.dumps(m), mf.manifest_key(m["path"]))


def _namespace_inodes(core: CacheFs) -> int:
    return 1 + len(tree(core, ROOT_INO))


@FUZZ_STORE
@given(st.lists(TREES, min_size=1, max_size=3), st.lists(mutated(manifests()), max_size=3),
       st.data())
def test_sync_applies_valid_sets_and_skips_invalid_ones_once(caplog, trees, bad, data):
    caplog.set_level(logging.INFO, logger="cachemgr.tiering.remote")
    caplog.clear()
    with tempfile.TemporaryDirectory() as tmp:
        h = Harness(Path(tmp))
        try:
            valid = []
            for i, t in enumerate(trees):
                files, dirs, links = flatten(t)
                m = h.manifest(f"v/s{i}", {rel: bytes([i]) * size
                                           for rel, (size, _mode) in files.items()},
                               dirs=dirs, links=links,
                               modes={rel: mode for rel, (_size, mode) in files.items()})
                valid.append((m, h.publish(m)))
            fm = h.manifest("v/file", {"": b"single"}, kind="file")
            valid.append((fm, h.publish(fm)))
            lm = h.manifest("v/latest", {}, kind="symlink", target="s0")
            valid.append((lm, h.publish(lm)))
            invalid = {}
            # A valid manifest read from another path's key.
            wm = h.manifest("w/real", {"a": b"x"})
            invalid[mf.manifest_key("w/other")] = mf.dumps(wm)
            for j, doc in enumerate(bad):
                key = data.draw(st.sampled_from([
                    mf.manifest_key(f"bad/{j}"), f"manifests/%25/{j:064x}.json",
                    mf.manifest_key(f"v/s{j}/inner")]), label="key")
                # still valid: make it not JSON
                invalid[key] = doc + b"}" if try_manifest(doc, key) is not None else doc
            invalid[mf.manifest_key("junk")] = b"\x00\xff" * 10
            for key, doc in invalid.items():
                h.put(key, doc)
            h.put("manifests/README", b"not a manifest key: not even read")

            h.sync()
            for m, etag in valid:
                assert_set_restored(h, _normalised(m), etag)
            want = {m["path"] for m, _e in valid}
            assert {s.path for s in h.sets.recent(1000)} == want
            assert {s.path for s in h.sets.by_states(("durable",))} == want
            assert {bytes(n) for _i, n, _c in h.core.index.list_dentries(ROOT_INO, 0, 99)} \
                == {b"v"}
            assert _namespace_inodes(h.core) == 2 + sum(
                1 + len(expected_tree(_normalised(m))) if m["kind"] == "dir" else 1
                for m, _e in valid)
            st_ = h.remote.statistics()
            assert st_.invalid_count == len(invalid)
            assert set(st_.invalid_manifests) == set(invalid)
            assert st_.not_restored == {} and st_.restored_sets == len(valid)
            for key in invalid:
                assert len(_skips(caplog, key)) == 1, key
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert h.core.check_consistency() == []
            assert memory_problems(h.core) == []

            logged = len(caplog.records)
            h.sync()  # logged once, not at every listing; nothing applied again
            assert caplog.records[logged:] == []
            assert h.remote.statistics().invalid_count == len(invalid)
            assert h.remote.statistics().restored_sets == len(valid)
        finally:
            h.close()


def test_invalid_manifest_is_logged_again_only_when_it_changes(h, caplog):
    caplog.set_level(logging.INFO, logger="cachemgr.tiering.remote")
    key = mf.manifest_key("ckpt/a")
    h.put(key, b"{")
    h.sync()
    h.sync()
    assert len(_skips(caplog, key)) == 1
    h.put(key, b"[]")  # another bad document: a new etag, logged once more
    h.sync()
    h.sync()
    assert len(_skips(caplog, key)) == 2
    assert h.remote.statistics().invalid_count == 1
    m = h.manifest("ckpt/a", {"x": b"123"})
    etag = h.publish(m)  # fixed: applied, no longer counted
    h.sync()
    assert_set_restored(h, _normalised(m), etag)
    assert h.remote.statistics().invalid_count == 0
    h.put(mf.manifest_key("ckpt/b"), b"{}")
    h.sync()
    assert h.remote.statistics().invalid_count == 1
    h.delete(mf.manifest_key("ckpt/b"))  # gone from the store: forgotten
    h.sync()
    assert h.remote.statistics().invalid_count == 0
    assert len(_skips(caplog)) == 3


def test_long_names_use_hashed_keys_and_bad_hashed_documents_are_skipped(h, caplog):
    caplog.set_level(logging.INFO, logger="cachemgr.tiering.remote")
    path = "ckpt/" + "n" * 251  # "<name>.json" is over 255 bytes: a hashed key
    m = h.manifest(path, {"x": b"1"})
    assert mf.path_of_manifest_key(mf.manifest_key(path)) is None
    etag = h.publish(m)
    # A hashed key whose document names another path, and one that is not a manifest.
    other = h.manifest("ckpt/short", {"y": b"2"})
    h.put(mf.manifest_key("ckpt/" + "m" * 251), mf.dumps(other))
    h.put("manifests/%25/" + "0" * 64 + ".json", b"nope")
    h.sync()
    h.sync()
    assert_set_restored(h, _normalised(m), etag)
    assert resolve(h.core, "ckpt/short") is None
    assert h.remote.statistics().invalid_count == 2
    assert len(_skips(caplog)) == 2


def test_a_manifest_over_the_size_limit_is_not_read(h, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="cachemgr.tiering.remote")
    m = h.manifest("ckpt/big", {"x": b"1"})
    h.publish(m)
    monkeypatch.setattr(validate, "MAX_DOCUMENT_BYTES", 100)
    got = []
    real_get = h.store.get

    async def get(key, *a, **kw):
        got.append(key)
        return await real_get(key, *a, **kw)

    monkeypatch.setattr(h.store, "get", get)
    h.sync()
    h.sync()
    assert got == [] and resolve(h.core, "ckpt/big") is None
    assert h.remote.statistics().invalid_count == 1 and len(_skips(caplog)) == 1


def test_invalid_replacement_leaves_the_restored_set(h, caplog):
    """A restored set whose manifest is overwritten by a bad document stays as it was (the
    bad one is skipped; the set is not treated as gone from the store)."""
    m = h.manifest("ckpt/s", {"a": b"1", "d/b": b"22"})
    etag = h.publish(m)
    h.sync()
    assert_set_restored(h, _normalised(m), etag)
    bad = _normalised(m) | {"commit": {"node": "local", "seq": 1, "committed_ns": 1}}
    h.put(mf.manifest_key("ckpt/s"), json.dumps(bad).encode())
    h.sync()
    assert_set_restored(h, _normalised(m), etag)
    assert h.remote.statistics().invalid_count == 1


def test_a_set_whose_manifest_left_the_store_is_removed(h):
    m = h.manifest("ckpt/gone", {"a": b"1", "d/b": b"22"}, dirs=["d"])
    h.publish(m)
    keep = h.manifest("ckpt/kept", {"x": b"3"})
    etag = h.publish(keep)
    h.sync()
    seq = h.sets.newest_at("ckpt/gone").seq
    h.delete(mf.manifest_key("ckpt/gone"))
    h.sync()
    assert resolve(h.core, "ckpt/gone") is None and h.sets.get(seq).state == "deleted"
    assert_set_restored(h, _normalised(keep), etag)
    assert h.remote.statistics().removed_sets == 1
    assert memory_problems(h.core) == [] and h.core.check_consistency() == []


def test_a_removal_that_fails_does_not_stop_the_listing(h, caplog):
    """A set that left the store but cannot be removed here (a full cache disk) is logged once
    and removed at a later listing; the listing goes on: the other sets are removed, the
    listing counts, sync_once does not raise."""
    caplog.set_level(logging.INFO, logger="cachemgr.tiering.remote")
    for name in ("a", "b"):
        h.publish(h.manifest(f"ckpt/{name}", {"x": b"1", "d/y": b"2"}))
    h.sync()
    for name in ("a", "b"):
        h.delete(mf.manifest_key(f"ckpt/{name}"))
    real_remove_tree = h.core.cache.tree.remove_tree
    armed = [True]

    def remove_tree(parent, name):  # ckpt/a cannot go (the index cannot be written)
        if armed[0] and name == b"a":
            raise IndexFull("disk full", released=False)
        return real_remove_tree(parent, name)

    h.core.cache.tree.remove_tree = remove_tree
    late = h.manifest("ckpt/c", {"z": b"3"})
    etag = h.publish(late)
    h.sync()
    h.sync()
    a = h.sets.newest_at("ckpt/a")
    assert a.state == "durable" and resolve(h.core, "ckpt/a") == a.root_ino
    assert "ckpt/a" in h.remote.statistics().not_restored
    assert resolve(h.core, "ckpt/b") is None and h.sets.newest_at("ckpt/b").state == "deleted"
    assert_set_restored(h, _normalised(late), etag)
    assert h.remote.syncs == 3
    assert len([r for r in caplog.records if "ckpt/a" in r.getMessage() and
                r.levelno >= logging.WARNING]) == 1
    assert memory_problems(h.core) == [] and h.core.check_consistency() == []
    armed[0] = False
    h.sync()
    assert resolve(h.core, "ckpt/a") is None and h.sets.get(a.seq).state == "deleted"
    assert h.remote.statistics().not_restored == {}
    assert memory_problems(h.core) == [] and h.core.check_consistency() == []


# ==============================================================================================
# 3. all-or-nothing apply


V1 = {"a.bin": b"A" * 1000, "b.bin": b"B" * 10, "sub/c.bin": b"C" * 20}
V2 = {"a.bin": b"a" * 7, "d.bin": b"D" * 30, "sub2/e.bin": b"E" * 5}
# _materialise's raw_create calls for V2 over V1: sub2, a.bin, d.bin, sub2/e.bin, ln.
RAW_CREATES_OF_V2 = 5


class Fault:
    """`owner.attr` (the raw tree's raw_create unless told: raw_create_files makes the files of
    a set at a new path, a directory at a time) refuses its `n`th call while armed: a
    full disk half-way through an apply, once every entry of the replaced set is removed."""

    def __init__(self, core: CacheFs, n: int, exc: Exception, *, owner=None,
                 attr: str = "raw_create") -> None:
        owner = core.cache.tree if owner is None else owner
        self.real = getattr(owner, attr)
        self.n = n
        self.exc = exc
        self.calls = 0
        self.armed = True
        self.raised = 0
        setattr(owner, attr, self)

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.armed and self.calls == self.n:
            self.raised += 1
            raise self.exc
        return self.real(*a, **kw)


def _memory(core: CacheFs, inos) -> dict:
    out = {}
    for ino in inos:
        node = core.cache.table.get(ino)
        out[ino] = (node.nlink, node.cached, node.size, node.mode, node.version)
    return out


def _v1(h: Harness) -> tuple[dict, str, int, dict]:
    """Restore V1 at ckpt/step and give a.bin a cached copy. Returns (manifest, etag, root
    ino, {rel: ino})."""
    m1 = h.manifest("ckpt/step", V1, dirs=["sub", "empty"], links={"ln": "a.bin"})
    etag1 = h.publish(m1)
    h.sync()
    assert_set_restored(h, _normalised(m1), etag1)
    root = resolve(h.core, "ckpt/step")
    inos = {rel: resolve(h.core, "ckpt/step/" + rel) for rel in tree(h.core, root)}
    a = inos["a.bin"]
    with open(h.core.cache.files.path(a), "r+b") as f:
        f.write(V1["a.bin"])
    h.core.cache.residency.fetched(a, len(V1["a.bin"]))
    assert h.core.files.cached_bytes == len(V1["a.bin"])
    return m1, etag1, root, inos


@pytest.mark.parametrize("refs", [False, True], ids=["no-kernel-refs", "kernel-refs"])
@pytest.mark.parametrize("exc", [FsError(errno.ENOSPC), IndexFull("disk full", released=False),
                                 RuntimeError("a bug")], ids=["ENOSPC", "IndexFull", "bug"])
@pytest.mark.parametrize("n", [1, 3, RAW_CREATES_OF_V2, "record"])
@pytest.mark.parametrize("then", ["reload", "retry"])
def test_failed_apply_changes_nothing(tmp_path, caplog, n, exc, refs, then):
    caplog.set_level(logging.INFO, logger="cachemgr.tiering.remote")
    h = Harness(tmp_path)
    _m1, etag1, root, inos = _v1(h)
    seq1 = h.sets.newest_at("ckpt/step").seq
    if refs:  # the kernel knows some of the set's inodes (a shell cd'ed in, an ls -l)
        for rel in ("a.bin", "sub", "sub/c.bin", "ln"):
            parent = root if "/" not in rel else inos[rel.rsplit("/", 1)[0]]
            h.core.lookup(parent, unescape_name(rel.rsplit("/", 1)[-1]))
    ckpt = resolve(h.core, "ckpt")
    watched = [ROOT_INO, ckpt, root, *inos.values()]
    before = _memory(h.core, watched)
    cached_before = h.core.files.cached_bytes
    tree_before = tree(h.core, root)

    m2 = h.manifest("ckpt/step", V2, dirs=["sub2"], links={"ln": "d.bin"})
    etag2 = h.publish(m2)
    if n == "record":  # every entry of V2 is in place, its set row is refused
        fault = Fault(h.core, 1, exc, owner=h.sets, attr="record_remote")
    else:
        fault = Fault(h.core, n, exc)
    h.sync()
    assert fault.raised == 1

    # Nothing of the apply is left: index, memory, cache files, set registry.
    assert "ckpt/step" in h.remote.statistics().not_restored
    assert h.remote.statistics().restored_sets == 1
    assert resolve(h.core, "ckpt/step") == root and tree(h.core, root) == tree_before
    assert {rel: resolve(h.core, "ckpt/step/" + rel) for rel in tree_before} == inos
    assert _memory(h.core, watched) == before
    assert h.core.files.cached_bytes == cached_before == len(V1["a.bin"])
    assert memory_problems(h.core) == []
    assert h.core.check_consistency() == []
    with open(h.core.cache.files.path(inos["a.bin"]), "rb") as f:
        assert f.read() == V1["a.bin"]
    s = h.sets.newest_at("ckpt/step")
    assert (s.seq, s.state, s.etag, s.root_ino) == (seq1, "durable", etag1, root)
    assert {r[0]: r[1] for r in h.sets.files(seq1)} == {
        rel: ino for rel, ino in inos.items() if rel in V1}
    assert not [r for r in h.sets.by_states(("durable", "replaced")) if r.seq != seq1]

    if then == "reload":
        # What a fresh load of the cache directory reports is what memory said.
        h.close()
        fresh = CacheFs.load(h.cache_dir)
        assert _memory(fresh, watched) == before
        assert fresh.files.cached_bytes == cached_before
        assert fresh.check_consistency() == []
        with open(fresh.cache.files.path(inos["a.bin"]), "rb") as f:
            assert f.read() == V1["a.bin"]
        fresh.close()
        h = Harness(tmp_path, h.store)
    else:
        fault.armed = False
    logged = len(caplog.records)
    h.sync()
    assert [r for r in caplog.records[logged:] if r.levelno >= logging.WARNING] == []
    assert_set_restored(h, _normalised(m2), etag2)
    assert h.sets.get(seq1).state == "replaced"
    assert "ckpt/step" not in h.remote.statistics().not_restored
    if then == "retry" and refs:
        # Replaced entries the kernel still knows stay (unlinked) until it forgets them.
        for rel in ("a.bin", "sub", "sub/c.bin", "ln"):
            h.core.forget(inos[rel], h.core.cache.table.get(inos[rel]).lookups)
    assert h.core.files.cached_bytes == 0  # the replaced cached copy is gone
    assert not os.path.exists(h.core.cache.files.path(inos["a.bin"]))
    assert memory_problems(h.core) == []
    assert h.core.check_consistency() == []
    mem = _memory(h.core, [ROOT_INO, ckpt, root])
    h.close()
    fresh = CacheFs.load(h.cache_dir)
    assert _memory(fresh, [ROOT_INO, ckpt, root]) == mem
    assert fresh.check_consistency() == []
    fresh.close()


def test_failed_apply_over_a_new_path_leaves_nothing(h):
    """A set at a path with nothing there yet: a failure half-way leaves no directory, no
    inode, no set row (the parents it created go too)."""
    m = h.manifest("new/deep/step", V2, dirs=["sub2"], links={"ln": "d.bin"})
    h.publish(m)
    inodes_before = h.core.index.all_inos()
    # new, deep, step, sub2 one by one; then the files a directory at a time
    # (RawTree.raw_create_files): a.bin and d.bin made, then sub2/e.bin refused
    Fault(h.core, 2, FsError(errno.ENOSPC), attr="raw_create_files")
    h.sync()
    assert h.core.index.all_inos() == inodes_before
    assert resolve(h.core, "new") is None and h.sets.newest_at("new/deep/step") is None
    assert memory_problems(h.core) == [] and h.core.check_consistency() == []
    assert h.core.cache.table.get(ROOT_INO).nlink == 2
    h.core.cache.tree.raw_create_files.armed = False
    h.sync()
    assert_set_restored(h, _normalised(m))


def test_failed_apply_keeps_a_partly_restored_file(h):
    """Chunks of a file being restored count in cached_bytes (ChunkFetcher.partial); an apply that
    removes the file and then fails must leave that count as it was, so the file, restored to
    the end afterwards, counts its size once."""
    big = bytes(range(40))
    m1 = h.manifest("ckpt/step", {"big": big, "b": b"y"}, chunk_size=8)
    h.publish(m1)
    h.sync()
    ino = resolve(h.core, "ckpt/step/big")
    r = h.t.restorer
    trio.run(r.ensure_range, ino, 0, 8)  # chunk 0 only
    assert r.chunks.partial == {ino: 8} and h.core.files.cached_bytes == 8
    h.publish(h.manifest("ckpt/step", {"big": b"z", "c": b"w"}))
    fault = Fault(h.core, 2, FsError(errno.ENOSPC))  # big, b removed; big made; c refused
    h.sync()
    assert fault.raised == 1 and resolve(h.core, "ckpt/step/big") == ino
    assert r.chunks.partial == {ino: 8} and h.core.files.cached_bytes == 8
    trio.run(r.ensure_range, ino, 0, 40)  # the rest
    assert h.core.cache.table.get(ino).cached and r.chunks.partial == {}
    assert h.core.files.cached_bytes == 40
    with open(h.core.cache.files.path(ino), "rb") as f:
        assert f.read() == big
    assert memory_problems(h.core) == [] and h.core.check_consistency() == []


def test_restorer_state_does_not_shadow_its_whole_object_fetch(h):
    """A prefetch of an object stored before chunk CRCs runs `Prefetcher._whole` (the whole
    object at once); the restorer's per-file state must not hide that method under the same
    name (it did: the prefetch then failed with "'set' object is not callable")."""
    assert inspect.iscoroutinefunction(h.t.restorer.prefetch._whole)


def test_part_publisher_keeps_its_last_error_and_reports_it(h):
    """PartPublisher, built as the Engine builds it (no Engine behind it), on a store that refuses
    once: the failed pass releases `sync` with StoreError, keeps its error in statistics() and
    tells `report_error` (the store's last error in `ckptfs status`); the retry (after
    retry_pause) deletes the record of a directory that is gone, and its index row."""
    node = h.t.node
    rec = {"path": "gone/dir", "digest": "x"}
    with h.core.index.tx():
        h.core.index.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                  ("part:999", json.dumps(rec)))
    h.put(part_key("gone/dir", node), b"{}")
    store = FaultyStore(h.store)
    store.fail_next("delete", 1, StoreError("injected refusal"))
    reported: list[str] = []
    lease = members.Lease(store=store, node=node, index=h.core.index, lease=30,
                          register_timeout=5)
    pp = parts.PartPublisher(index=h.core.index, store=store, node=node, lease=lease,
                             inode_if_loaded=h.core.cache.table.if_loaded, retry_pause=0,
                             report_error=reported.append)
    assert pp.published == {999: rec} and pp.statistics().last_error is None

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(pp.run)
            with pytest.raises(StoreError):
                await pp.sync([999])  # the first pass: its delete is refused
            err = pp.statistics().last_error
            assert err is not None and err.endswith("part record: injected refusal")
            assert reported == [err] and pp.statistics().failed_passes == 1
            await pp.sync([999])  # a pass after the retry
            n.cancel_scope.cancel()

    trio.run(main)
    assert pp.published == {} and pp.statistics().deletes == 1
    assert h.core.index.meta("part:999") is None
    assert part_key("gone/dir", node) not in [i.key for i in trio.run(h.store.list, "parts/")]


def test_restored_chunks_keep_off_the_released_index_reserve(h, monkeypatch):
    """While the index reserve is released (the cache disk was full), restored chunks are not
    written into the room it freed, as the trainer's writes are not (Index.data_may_take): the
    read fails to cache (ENOSPC, served from the store by the FUSE read), nothing is marked
    present, and once the disk has room again the chunks come in."""
    from types import SimpleNamespace

    import cachemgr.core.index as index_mod

    big = bytes(range(40))
    h.publish(h.manifest("ckpt/step", {"big": big}, chunk_size=8))
    h.sync()
    ino = resolve(h.core, "ckpt/step/big")
    r = h.t.restorer
    idx = h.core.index
    free = [idx.reserve_bytes + 4]   # less than the reserve plus one 8-byte chunk

    def statvfs(p):  # a small disk: the prefetch reserve (5% of it, ChunkFetcher.disk_room)
        # is below what is free; the index reserve is not
        return SimpleNamespace(f_bavail=free[0], f_frsize=1, f_blocks=100)
    monkeypatch.setattr(index_mod.os, "statvfs", statvfs)
    monkeypatch.setattr(idx, "reserve_held", False)
    with pytest.raises(OSError) as e:
        trio.run(r.ensure_range, ino, 0, 8)
    assert e.value.errno == errno.ENOSPC
    assert r.chunks.partial == {} and h.core.files.cached_bytes == 0
    assert idx.inode_fields(ino, "present")[0] is None
    free[0] = idx.reserve_bytes + 1000
    trio.run(r.ensure_range, ino, 0, 8)
    assert r.chunks.partial == {ino: 8} and h.core.files.cached_bytes == 8
