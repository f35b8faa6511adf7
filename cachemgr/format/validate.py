"""Strict validation of every document read from the store (docs/FORMAT.md "Validation").

Every node reads what other nodes wrote to a shared bucket, and anyone who can write to that
bucket can put anything there: an older ckptfs, a bug, a half-written object, a hostile peer.
Nothing read from the store is used before it passed through this module:

  * `manifest(data, key)` — a set manifest, from the bytes of the object at `key`;
  * `part_record(data, key)` — a node's part record (cachemgr.tiering.parts);
  * `protocol_doc(data, kind)` — a member, intent or ack document (cachemgr.tiering.members);
  * `stored_object(d, writers)` — one file's object description (also checks the geometry a
    `cachemgr.format.objects.StoredObject` needs, via `object_geometry`);
  * `node_id(v)`, `path(v, version)`, `symlink_target(v, version)`, `object_key(v, writers)`
    — the pieces.

A document that fails raises `DocumentError` (`ManifestError`, `PartError`) with a one-line
reason; callers skip that one document, log it once and go on. A document that passes is
returned *normalised*: names in the escaped form of cachemgr.format.names whatever its version,
optional fields filled in, permission bits masked (`MODE_MASK`), so no caller needs `.get`
with a default or a second check.

This module needs only the standard library and cachemgr.format.names, so `scripts/ckpt_restore.py`
(which restores without ckptfs installed) uses the very same rules.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any, cast

from cachemgr.format.docs import (
    CommitDoc,
    DirDoc,
    FileDoc,
    LinkDoc,
    ManifestDoc,
    ObjectDoc,
    PartFile,
    PartRecordDoc,
)
from cachemgr.format.keys import MAX_KEY_BYTES, manifest_key, part_key
from cachemgr.format.names import from_str, is_canonical_path, unescape_name, unescape_path

# -- limits (docs/FORMAT.md "Validation") ------------------------------------------------------
MAX_DOCUMENT_BYTES = 64 << 20  # a manifest or part record; bigger ones are not read at all
MAX_ENTRIES = 1_000_000        # files + dirs + symlinks of one manifest, files of one record
MAX_NAME_BYTES = 255           # one path component (NAME_MAX)
MAX_PATH_BYTES = 4095          # a whole path or symlink target (PATH_MAX less the NUL)
MAX_FILE_SIZE = (1 << 63) - 1  # st_size is a signed 64-bit number
MAX_CHUNK = 64 << 20           # frame_size / chunk_size: what one chunk read may allocate
MAX_CLOCK_AHEAD_NS = 3600 * 10**9  # a commit time further in the future than this is refused
# Permission bits taken from the store: rwx for user and group, r-x for others. Never setuid,
# setgid or sticky, never world-writable, whatever the document says.
MODE_MASK = 0o775
FORMATS = {"manifest": "ckptfs-manifest", "part": "ckptfs-part"}
VERSIONS = (1, 2)  # 2: names in the escaped form (docs/FORMAT.md "Names")
# Node ids: what a mount makes (8 hex digits) and anything like it; never the word the index
# uses for "committed here" (cachemgr.core.sets origin "local").
_NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RESERVED_NODE_IDS = frozenset({"local"})
_REASON_RE = re.compile(r"[a-z_:-]{1,32}")
_INT64 = 1 << 63


class DocumentError(ValueError):
    """A store document that must not be used; the message is one line naming the problem."""


class ManifestError(DocumentError):
    pass


class PartError(DocumentError):
    pass


# -- scalars -----------------------------------------------------------------------------------

def _int(v: object, what: str, lo: int, hi: int, error: type[DocumentError]) -> int:
    if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
        raise error(f"{what} must be an integer in [{lo}, {hi}], not {_short(v)}")
    return v


def _str(v: object, what: str, error: type[DocumentError]) -> str:
    if not isinstance(v, str):
        raise error(f"{what} must be a string, not {_short(v)}")
    return v


def _short(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _mode(v: object, what: str, error: type[DocumentError], default: int) -> int:
    if v is None:
        return default & MODE_MASK
    return _int(v, what, 0, 0o7777, error) & MODE_MASK


def node_id(v: object, what: str = "node id", error: type[DocumentError] = DocumentError) -> str:
    s = _str(v, what, error)
    if not _NODE_RE.fullmatch(s) or s in RESERVED_NODE_IDS:
        raise error(f"{what} {_short(s)} is not a node id")
    return s


# -- names -------------------------------------------------------------------------------------

def _component(c: str, what: str, error: type[DocumentError]) -> None:
    if c in ("", ".", ".."):
        raise error(f"{what}: {_short(c)} is not a name")
    b = unescape_name(c)
    if b"\0" in b or b"/" in b:
        raise error(f"{what}: a name holds a NUL or '/'")
    if len(b) > MAX_NAME_BYTES:
        raise error(f"{what}: a name is {len(b)} bytes (at most {MAX_NAME_BYTES})")


def _normal(v: object, version: int, what: str, error: type[DocumentError]) -> str:
    """A name-bearing field in the escaped form: version 1 holds names as they are (older
    writers put undecodable bytes as \\udcXX), version 2 in the escaped form, canonical."""
    s = _str(v, what, error)
    if version == 1:
        try:
            return from_str(s)
        except UnicodeEncodeError:
            raise error(f"{what} {_short(s)} is not a name") from None
    if not is_canonical_path(s):
        raise error(f"{what} {_short(s)} is not in the escaped form")
    return s


def path(v: object, version: int, what: str, error: type[DocumentError] = DocumentError, *,
         empty_ok: bool = False) -> str:
    """A relative '/'-separated path of single valid names (no '', '.', '..', NUL, no leading
    or trailing '/'), at most MAX_PATH_BYTES; in the escaped form."""
    s = _normal(v, version, what, error)
    if s == "" and empty_ok:
        return s
    for c in s.split("/"):
        _component(c, what, error)
    if len(unescape_path(s)) > MAX_PATH_BYTES:
        raise error(f"{what} is longer than {MAX_PATH_BYTES} bytes")
    return s


def symlink_target(v: object, version: int, what: str, error: type[DocumentError]) -> str:
    """A symlink target: any bytes but NUL, 1..MAX_PATH_BYTES (it may be absolute or hold '..':
    it is only ever stored as a link, never followed by ckptfs)."""
    s = _normal(v, version, what, error)
    b = unescape_path(s)
    if not b or b"\0" in b or len(b) > MAX_PATH_BYTES:
        raise error(f"{what} is not a symlink target")
    return s


def object_key(v: object, writers: frozenset[str], what: str, error: type[DocumentError]) -> str:
    """An object key under `data/<writer>/` for one of `writers`, with no empty, '.' or '..'
    component, valid text, at most MAX_KEY_BYTES."""
    s = _str(v, what, error)
    parts = s.split("/")
    if len(parts) < 3 or parts[0] != "data" or any(p in ("", ".", "..") for p in parts) or \
            "\0" in s or len(s.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise error(f"{what} {_short(s)} is not an object key")
    try:
        s.encode()  # fails exactly on a surrogate (C speed: one key per file of a manifest)
    except UnicodeEncodeError:
        raise error(f"{what} {_short(s)} is not valid text") from None
    if parts[1] not in writers:
        raise error(f"{what} {_short(s)} is not under data/<a node that wrote this set>/")
    return s


# -- objects -----------------------------------------------------------------------------------

def lz4_frame_bound(frame_size: int) -> int:
    """The largest stored length of one lz4 frame of `frame_size` raw bytes (LZ4F's
    compressFrameBound, rounded up generously)."""
    return frame_size + frame_size // 255 + 1024


def object_geometry(size: int, stored_size: int, crc: int, compression: str, frame_size: int,
                    frames: Sequence[int] | None, chunk_size: int,
                    chunk_crcs: Sequence[int] | None) -> None:
    """The invariants of a stored object's description (cachemgr.format.objects.StoredObject):
    ValueError if they do not hold."""
    if not 0 <= size <= MAX_FILE_SIZE or not 0 <= stored_size <= MAX_FILE_SIZE or \
            not 0 <= crc < 1 << 32:
        raise ValueError(f"bad sizes or crc ({size}, {stored_size}, {crc})")
    if compression == "none":
        if frames is not None or stored_size != size:
            raise ValueError("an uncompressed object with frames, or stored_size != size")
    elif compression == "lz4":
        if frames is None or not 0 < frame_size <= MAX_CHUNK:
            raise ValueError(f"an lz4 object needs frames and a frame_size in (0, {MAX_CHUNK}]")
        if len(frames) != -(-size // frame_size):
            raise ValueError(f"{len(frames)} frames cannot hold {size} bytes in frames of "
                             f"{frame_size}")
        bound = lz4_frame_bound(frame_size)
        if any(not 0 < n <= bound for n in frames):
            raise ValueError(f"an lz4 frame length is not in (0, {bound}]")
        if sum(frames) != stored_size:
            raise ValueError(f"frame lengths sum to {sum(frames)}, stored_size is {stored_size}")
        if chunk_size and chunk_size != frame_size:
            raise ValueError("an lz4 object whose chunks are not its frames")
    else:
        raise ValueError(f"unknown compression {_short(compression)}")
    if not 0 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size {chunk_size} is not in [0, {MAX_CHUNK}]")
    if chunk_crcs is not None:
        if chunk_size <= 0:
            raise ValueError("chunk CRCs without a chunk_size")
        if len(chunk_crcs) != -(-size // chunk_size):
            raise ValueError(f"{len(chunk_crcs)} chunk CRCs cannot cover {size} bytes in chunks"
                             f" of {chunk_size}")
        if not all(0 <= c < 1 << 32 for c in chunk_crcs):
            raise ValueError("a chunk CRC is out of range")


def _int_list(v: object, what: str, error: type[DocumentError]) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise error(f"{what} must be a list of integers")
    return v


def stored_object(d: object, writers: frozenset[str], size: int | None = None, *,
                  what: str = "object",
                  error: type[DocumentError] = DocumentError) -> ObjectDoc:
    """One file's object description (docs/FORMAT.md "Manifest"), normalised: every field
    present with its type, geometry checked, key under `data/<writer>/`; `size`, if given, is
    the file's size the object must hold."""
    if not isinstance(d, dict):
        raise error(f"{what} is not an object")
    key = object_key(d.get("key"), writers, f"{what} key", error)
    osize = _int(d.get("size"), f"{what} size", 0, MAX_FILE_SIZE, error)
    if size is not None and osize != size:
        raise error(f"{what} {_short(key)} holds {osize} bytes, the file {size}")
    stored = _int(d.get("stored_size"), f"{what} stored_size", 0, MAX_FILE_SIZE, error)
    crc = _int(d.get("crc32c"), f"{what} crc32c", 0, (1 << 32) - 1, error)
    compression = d.get("compression", "none")
    frame_size = _int(d.get("frame_size", 0), f"{what} frame_size", 0, MAX_CHUNK, error)
    frames = d.get("frames")
    if frames is not None:
        frames = _int_list(frames, f"{what} frames", error)
    chunk_size = d.get("chunk_size", 0)  # absent or null: written before chunk CRCs
    chunk_size = _int(0 if chunk_size is None else chunk_size, f"{what} chunk_size", 0,
                      MAX_CHUNK, error)
    crcs = d.get("chunk_crcs")
    if crcs is not None:
        crcs = _int_list(crcs, f"{what} chunk_crcs", error)
    try:
        object_geometry(osize, stored, crc, compression, frame_size, frames, chunk_size, crcs)
    except ValueError as e:
        raise error(f"{what} {_short(key)}: {e}") from None
    return {"key": key, "size": osize, "stored_size": stored, "crc32c": crc,
            "compression": compression, "frame_size": frame_size, "frames": frames,
            "chunk_size": chunk_size, "chunk_crcs": crcs}


# -- documents ---------------------------------------------------------------------------------

def parse(data: bytes, kind: str, error: type[DocumentError]) -> dict[str, Any]:
    """The JSON object of a store document of `kind` ("manifest", "part"), format and version
    checked; bounded in size and nesting."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise error(f"{kind} is {len(data)} bytes (at most {MAX_DOCUMENT_BYTES})")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise error(f"{kind} is not JSON: {str(e).splitlines()[0][:80]}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMATS[kind]:
        raise error(f"not a ckptfs {kind}")
    if doc.get("version") not in VERSIONS or type(doc.get("version")) is not int:
        raise error(f"{kind} version {_short(doc.get('version'))} is not one of {list(VERSIONS)}")
    return doc


def _list(v: object, what: str, error: type[DocumentError],
          limit: int = MAX_ENTRIES) -> list[dict[str, Any]]:
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > limit:
        raise error(f"{what} must be a list of at most {limit} entries")
    if not all(isinstance(e, dict) for e in v):
        raise error(f"a {what} entry is not an object")
    return v


def _commit(c: object, version: int, now_ns: int) -> CommitDoc:
    E = ManifestError
    if not isinstance(c, dict):
        raise E("commit is not an object")
    node = node_id(c.get("node"), "commit.node", E)
    out: CommitDoc = {"node": node,
           "seq": _int(c.get("seq"), "commit.seq", 0, _INT64 - 1, E),
           "reason": _str(c.get("reason", "?"), "commit.reason", E),
           "committed_ns": _int(c.get("committed_ns"), "commit.committed_ns", 0,
                                now_ns + MAX_CLOCK_AHEAD_NS, E)}
    if not _REASON_RE.fullmatch(out["reason"]) and out["reason"] != "?":
        raise E(f"commit.reason {_short(out['reason'])} is not a reason")
    if "published_ns" in c:
        out["published_ns"] = _int(c["published_ns"], "commit.published_ns", 0, _INT64 - 1, E)
    if "nodes" in c:
        nodes = c["nodes"]
        if not isinstance(nodes, list) or len(nodes) > MAX_ENTRIES:
            raise E("commit.nodes is not a list of node ids")
        nodes = [node_id(n, "commit.nodes entry", E) for n in nodes]
        if node not in nodes or len(set(nodes)) != len(nodes):
            raise E("commit.nodes must list distinct nodes, the committing one among them")
        out["nodes"] = sorted(nodes)
    if "from" in c:
        out["from"] = path(c["from"], version, "commit.from", E)
    return out


def _check_tree(kind: str, files: list[FileDoc], dirs: list[DirDoc],
                links: list[LinkDoc]) -> None:
    """Every entry once; nothing under a file or a symlink."""
    E = ManifestError
    if kind == "file":
        if len(files) != 1 or files[0]["path"] != "" or dirs or links:
            raise E("a file set holds exactly one file, at path ''")
        return
    if kind == "symlink":
        if files or dirs or links:
            raise E("a symlink set holds no entries")
        return
    leaves: set[str] = set()
    seen: set[str] = set()
    for e in files + dirs + links:
        if e["path"] == "":
            raise E("an entry of a directory set has an empty path")
        if e["path"] in seen:
            raise E(f"{_short(e['path'])} is listed twice")
        seen.add(e["path"])
    for e in files + links:
        leaves.add(e["path"])
    for p in seen:
        head = p
        while "/" in head:
            head = head.rsplit("/", 1)[0]
            if head in leaves:
                raise E(f"{_short(p)} is under a file or a symlink")


def manifest(data: bytes, key: str | None = None, *,
             now_ns: int | None = None) -> ManifestDoc:
    """A manifest (docs/FORMAT.md "Manifest"), validated and normalised. `key`: the key it was
    read from, which must be the key of its own `path` (cachemgr.format.keys.manifest_key): the key
    is how every node finds, replaces and deletes a set, so a manifest naming another path is
    refused."""
    E = ManifestError
    m = parse(data, "manifest", E)
    v = m["version"]
    now_ns = time.time_ns() if now_ns is None else now_ns
    set_path = path(m.get("path"), v, "path", E)
    if key is not None and manifest_key(set_path) != key:
        raise E(f"its path {_short(set_path)} is not the set of its key")
    kind = m.get("kind")
    if kind not in ("dir", "file", "symlink"):
        raise E(f"kind {_short(kind)} is not dir, file or symlink")
    c = _commit(m.get("commit"), v, now_ns)
    writers = frozenset(c.get("nodes", [c["node"]]))
    mode = _mode(m.get("mode"), "mode", E, 0o755) if kind == "dir" else None
    target = symlink_target(m.get("target"), v, "target", E) if kind == "symlink" else None
    raw_files = _list(m.get("files"), "files", E)
    raw_dirs = _list(m.get("dirs"), "dirs", E)
    raw_links = _list(m.get("symlinks"), "symlinks", E)
    if len(raw_files) + len(raw_dirs) + len(raw_links) > MAX_ENTRIES:
        raise E(f"more than {MAX_ENTRIES} entries")
    files: list[FileDoc] = []
    for f in raw_files:
        size = _int(f.get("size"), "file size", 0, MAX_FILE_SIZE, E)
        files.append({
            "path": path(f.get("path"), v, "file path", E, empty_ok=kind == "file"),
            "size": size,
            "mode": _mode(f.get("mode"), "file mode", E, 0o644),
            "mtime_ns": _int(f.get("mtime_ns", 0), "file mtime_ns", -_INT64, _INT64 - 1, E),
            "object": stored_object(f.get("object"), writers, size, what="file object",
                                    error=E)})
    dirs: list[DirDoc] = []
    for d in raw_dirs:
        mt = d.get("mtime_ns")
        dirs.append({"path": path(d.get("path"), v, "dir path", E),
                     "mode": _mode(d.get("mode"), "dir mode", E, 0o755),
                     "mtime_ns": None if mt is None else
                     _int(mt, "dir mtime_ns", -_INT64, _INT64 - 1, E)})
    links: list[LinkDoc] = [{"path": path(s.get("path"), v, "symlink path", E),
              "target": symlink_target(s.get("target"), v, "symlink target", E)}
             for s in raw_links]
    _check_tree(kind, files, dirs, links)
    total = sum(f["size"] for f in files)
    if "total_bytes" in m and (type(m["total_bytes"]) is not int or m["total_bytes"] != total):
        raise E(f"total_bytes {_short(m['total_bytes'])} is not the sum of its files' sizes")
    # in the order it had on the wire (a replica re-serialises it)
    out: dict[str, Any] = {"format": m["format"], "version": v, "path": set_path, "kind": kind,
                           "commit": c}
    if mode is not None:
        out["mode"] = mode
    if target is not None:
        out["target"] = target
    out.update(files=files, dirs=dirs, symlinks=links, total_bytes=total)
    return cast(ManifestDoc, out)  # every field checked above


def part_record(data: bytes, key: str | None = None) -> PartRecordDoc:
    """A part record (docs/FORMAT.md "Part records"), validated and normalised. `key`: the key
    it was read from, which must be the key of its own directory and node."""
    E = PartError
    r = parse(data, "part", E)
    v = r["version"]
    node = node_id(r.get("node"), "node", E)
    d = path(r.get("dir"), v, "dir", E)
    if key is not None and part_key(d, node) != key:
        raise E(f"it names directory {_short(d)} of node {node}, not the ones of its key")
    files: list[PartFile] = []
    names: set[str] = set()
    for f in _list(r.get("files"), "files", E):
        name = path(f.get("name"), v, "file name", E)
        if "/" in name or name in names:
            raise E(f"{_short(name)} is not a single file name, or is listed twice")
        names.add(name)
        size = _int(f.get("size"), "file size", 0, MAX_FILE_SIZE, E)
        obj = f.get("object")
        files.append({"name": name, "size": size,
                      "mode": _mode(f.get("mode"), "file mode", E, 0o644),
                      "mtime_ns": _int(f.get("mtime_ns", 0), "file mtime_ns", -_INT64,
                                       _INT64 - 1, E),
                      "object": None if obj is None else stored_object(
                          obj, frozenset({node}), size, what="file object", error=E)})
    return {"format": r["format"], "version": v, "node": node, "dir": d,
            "updated_ns": _int(r.get("updated_ns", 0), "updated_ns", 0, _INT64 - 1, E),
            "generation": _int(r.get("generation", 0), "generation", 0, _INT64 - 1, E),
            "files": files}


# Members, intents and acknowledgements (cachemgr.tiering.members): small protocol documents.
MAX_PROTOCOL_BYTES = 1 << 20
MAX_LEASE_S = 3600.0  # a member claiming a longer lease is taken at this one


def protocol_doc(data: bytes, kind: str) -> dict[str, Any]:
    """A member, intent or ack document (docs/FORMAT.md "Members, intents,
    acknowledgements"), validated: DocumentError if it must not be used. Returns the fields a
    reader uses: member {node, lease_s, generation, peer ((host, port) or None)}; intent
    {node, path, roots, nodes}; ack {node, generation}. A document without a generation
    (written before generations) has 0."""
    E = DocumentError
    if len(data) > MAX_PROTOCOL_BYTES:
        raise E(f"{kind} is {len(data)} bytes (at most {MAX_PROTOCOL_BYTES})")
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        raise E(f"{kind} is not JSON") from None
    if not isinstance(d, dict) or d.get("format") != f"ckptfs-{kind}" or \
            d.get("version") != 1 or type(d.get("version")) is not int:
        raise E(f"not a ckptfs {kind}")
    out: dict[str, Any] = {"node": node_id(d.get("node"), f"{kind} node", E)}
    if kind == "member":
        lease = d.get("lease_s", 0)
        if type(lease) not in (int, float) or not 0 <= lease < float("inf"):
            raise E(f"member lease_s {_short(lease)} is not a duration")
        out["lease_s"] = min(float(lease), MAX_LEASE_S)
        peer = d.get("peer")
        out["peer"] = None if peer is None else peer_endpoint(peer, E)
    if kind in ("member", "ack"):
        gen = d.get("generation", 0)
        if type(gen) is not int or not 0 <= gen < 1 << 63:
            raise E(f"{kind} generation {_short(gen)} is not a generation number")
        out["generation"] = gen
    if kind == "intent":
        out["path"] = path(d.get("path"), 2, "intent path", E)
        roots = d.get("roots")
        if not isinstance(roots, list) or len(roots) > 1000:
            raise E("intent roots is not a list of paths")
        out["roots"] = [path(r, 2, "intent root", E) for r in roots]
        nodes = d.get("nodes")
        if not isinstance(nodes, list) or len(nodes) > MAX_ENTRIES:
            raise E("intent nodes is not a list of node ids")
        out["nodes"] = [node_id(n, "intent nodes entry", E) for n in nodes]
    return out


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-:")


def is_host(s: object) -> bool:
    """A host name or an IP address as a member record's `peer` may name it (and so as
    --peer-address and --peer-seeds may give it)."""
    return isinstance(s, str) and 1 <= len(s) <= 253 and set(s) <= _HOST_CHARS


def peer_endpoint(v: object, error: type[DocumentError] = DocumentError) -> tuple[str, int]:
    """A member record's `peer` ({"host": name or IP address, "port": 1..65535}: where the
    node serves chunks to peers, cachemgr.peer.server) as (host, port)."""
    if not isinstance(v, dict) or set(v) != {"host", "port"}:
        raise error("member peer is not {host, port}")
    host, port = v["host"], v["port"]
    if not is_host(host):
        raise error(f"member peer host {_short(host)} is not a host name or address")
    if type(port) is not int or not 1 <= port <= 65535:
        raise error(f"member peer port {_short(port)} is not a port")
    return host, port


MAX_REPLICA_FILES = 100_000   # files of one replica offer (its JSON is at most 1 MiB anyway)
MAX_REPLICA_BYTES = 1 << 50   # bytes of one offered set
# A buddy pulls a replica's files in ranges of this many bytes from offset 0 and checks each
# range's CRC32C; a held replica's descriptor keeps them as the file's chunk CRCs (`crcs`), so
# it can serve the file to a restoring node as an object of chunks this size
# (cachemgr.tiering.replicate, docs/FORMAT.md "Replica descriptor").
REPLICA_CHUNK = 4 << 20


def replica_offer(data: bytes, max_bytes: int = MAX_PROTOCOL_BYTES) -> dict[str, Any]:
    """A replica offer (cachemgr.tiering.replicate; docs/ARCHITECTURE.md "Peers"), validated:
    DocumentError if it must not be used. Paths are relative, inside the set (`path`), in the
    escaped form; sizes bounded (each file and their total at most MAX_REPLICA_BYTES); the
    origin a node id, its endpoint a peer endpoint. Returns the fields a buddy uses: origin,
    generation, seq, path, kind, committed_ns, reason, endpoint, files [{rel, size, mode,
    mtime_ns}], dirs [{path, mode, mtime_ns}], symlinks [{path, target}], mode, target. A held
    replica's descriptor (the same document, `max_bytes` MAX_DOCUMENT_BYTES) may give a file
    `crcs`: the CRC32C of each REPLICA_CHUNK of it, checked for count and range."""
    E = DocumentError
    if len(data) > max_bytes:
        raise E(f"offer is {len(data)} bytes (at most {max_bytes})")
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        raise E("offer is not JSON") from None
    if not isinstance(d, dict) or d.get("format") != "ckptfs-replica-offer" or \
            type(d.get("version")) is not int or d.get("version") != 1:
        raise E("not a ckptfs replica offer")
    kind = d.get("kind")
    if kind not in ("file", "dir", "symlink"):
        raise E(f"offer kind {_short(kind)} is not file, dir or symlink")
    out: dict[str, Any] = {
        "origin": node_id(d.get("origin"), "offer origin", E),
        "generation": _int(d.get("generation"), "offer generation", 0, (1 << 63) - 1, E),
        "seq": _int(d.get("seq"), "offer seq", 1, (1 << 62), E),
        "path": path(d.get("path"), 2, "offer path", E), "kind": kind,
        "committed_ns": _int(d.get("committed_ns"), "offer committed_ns", 0, 1 << 63, E),
        "reason": _str(d.get("reason", ""), "offer reason", E)[:200],
        "endpoint": peer_endpoint(d.get("endpoint"), E),
        "mode": _mode(d.get("mode"), "offer mode", E, 0o755),
        "target": None if kind != "symlink" else
        symlink_target(d.get("target"), 2, "offer target", E)}
    files = _list(d.get("files", []), "offer files", E, MAX_REPLICA_FILES)
    total = 0
    out["files"] = []
    for f in files:
        if not isinstance(f, dict):
            raise E("offer file is not an object")
        rel = path(f.get("rel"), 2, "offer file rel", E, empty_ok=kind == "file")
        if (kind == "file" and rel != "") or (kind != "dir" and len(files) > 1):
            raise E("offer of a single file holds another path")
        size = _int(f.get("size"), "offer file size", 0, MAX_REPLICA_BYTES, E)
        total += size
        if total > MAX_REPLICA_BYTES:
            raise E(f"offer is over {MAX_REPLICA_BYTES} bytes")
        entry = {"rel": rel, "size": size,
                 "mode": _mode(f.get("mode"), "offer file mode", E, 0o644),
                 "mtime_ns": _int(f.get("mtime_ns", 0), "offer mtime_ns", 0, 1 << 63, E)}
        if f.get("crcs") is not None:
            crcs = _int_list(f["crcs"], "replica file crcs", E)
            if len(crcs) != -(-size // REPLICA_CHUNK) or not all(0 <= c < 1 << 32 for c in crcs):
                raise E(f"replica file {_short(rel)}: its crcs do not cover {size} bytes")
            entry["crcs"] = crcs
        out["files"].append(entry)
    out["dirs"] = [{"path": path(x.get("path"), 2, "offer dir", E),
                    "mode": _mode(x.get("mode"), "offer dir mode", E, 0o755),
                    "mtime_ns": _int(x.get("mtime_ns", 0), "offer dir mtime_ns", 0, 1 << 63, E)}
                   for x in _list(d.get("dirs", []), "offer dirs", E, MAX_REPLICA_FILES)]
    out["symlinks"] = [{"path": path(x.get("path"), 2, "offer symlink", E),
                        "target": symlink_target(x.get("target"), 2, "offer symlink target", E)}
                       for x in _list(d.get("symlinks", []), "offer symlinks", E,
                                     MAX_REPLICA_FILES)]
    if kind != "dir" and (out["dirs"] or out["symlinks"]):
        raise E("offer of a single file or symlink holds a directory tree")
    return out


def is_own_object(key: str, node: str) -> bool:
    """Is `key` (a validated object key) one that `node` wrote?"""
    return key.startswith(f"data/{node}/")


def is_takeover_object(key: str, node: str) -> bool:
    """Is `key` one that `node` wrote publishing another node's replica
    (`data/<node>/takeover/<origin>/<seq>/<i>`, cachemgr.tiering.replicate.Takeover)?"""
    return key.startswith(f"data/{node}/takeover/")


__all__ = ["MAX_CHUNK", "MAX_DOCUMENT_BYTES", "MAX_ENTRIES", "MODE_MASK", "DocumentError",
           "ManifestError", "PartError", "is_own_object", "is_takeover_object",
           "lz4_frame_bound", "manifest", "node_id", "object_geometry", "part_record", "path",
           "peer_endpoint", "protocol_doc", "replica_offer", "stored_object"]


MAX_NAMESPACE_PEERS = 100_000  # peers one namespace answer may name
MAX_NAMESPACE_SETS = 100_000   # sets one namespace answer may hold


def peer_namespace(data: bytes) -> dict[str, Any]:
    """A peer's namespace answer (GET /v1/replica/namespace, cachemgr.tiering.peernamespace;
    docs/FORMAT.md "Peer namespace"), validated: DocumentError if it must not be used. Returns
    {node, peers [(node, host, port)], sets [manifest JSON bytes, each still to be validated as
    a manifest], truncated}."""
    E = DocumentError
    if len(data) > MAX_DOCUMENT_BYTES:
        raise E(f"namespace answer is {len(data)} bytes (at most {MAX_DOCUMENT_BYTES})")
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        raise E("namespace answer is not JSON") from None
    if not isinstance(d, dict) or d.get("format") != "ckptfs-peer-namespace" or \
            type(d.get("version")) is not int or d.get("version") != 1:
        raise E("not a ckptfs peer namespace answer")
    peers = []
    for p in _list(d.get("peers"), "namespace peers", E, MAX_NAMESPACE_PEERS):
        ep = peer_endpoint({"host": p.get("host"), "port": p.get("port")}, E)
        peers.append((node_id(p.get("node"), "namespace peer node", E), *ep))
    sets = d.get("sets")
    if not isinstance(sets, list) or len(sets) > MAX_NAMESPACE_SETS or \
            not all(isinstance(s, str) for s in sets):
        raise E(f"namespace sets must be a list of at most {MAX_NAMESPACE_SETS} documents")
    if type(d.get("truncated")) is not bool:
        raise E("namespace truncated is not true or false")
    try:
        docs = [s.encode() for s in sets]
    except UnicodeEncodeError:  # JSON may escape a lone surrogate: not text, not a manifest
        raise E("a namespace set is not valid text") from None
    return {"node": node_id(d.get("node"), "namespace node", E), "peers": peers,
            "sets": docs, "truncated": d["truncated"]}
