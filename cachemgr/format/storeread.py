"""Published sets read straight from a store, without a mount: their manifests and objects.

The reader behind scripts/ckpt_restore.py (restore with plain tools, ckptfs not installed) and
the mount-less verbs of `ckptfs` (`ckptfs ls`, `restore`, `fsck`: ckptfs/storetools.py). Like
the rest of what the script runs on (its `MODULES`) it needs only the standard library, `lz4`
and `crc32c`: no trio, nothing of cachemgr.store.

What it owns:

  * manifests: every one passes cachemgr.format.validate before use (`load_manifest`,
    `parse_manifest`, `manifests`, `find_set`; `checked` for a manifest handed in);
  * objects: streamed from a store view (cachemgr.format.views) through the one decoder
    (cachemgr.format.decode: a few MiB at a time, every chunk and the whole object checked)
    into a sink (`stream_object`; `decode`, `restore`, `verify_object` on top of it).

Where the bytes go is elsewhere: cachemgr.format.restoreto (the script's atomic restore into a
directory) and cachemgr.format.resumable (`ckptfs restore`). Every check is an explicit
exception (a `RestoreError` of cachemgr.format.readerrors, one line), never `assert`:
`python -O` behaves the same.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

from cachemgr.format import keys, names, validate
from cachemgr.format.decode import ChunkDecoder, DecodeError, Layout, ObjectCheck, stream_chunk
from cachemgr.format.docs import ManifestDoc, ObjectDoc
from cachemgr.format.names import unescape_path
from cachemgr.format.readerrors import CorruptError, NoSuchSet, UsageError
from cachemgr.format.views import BytesObject, Reader, StoreView

# A manifest that passed cachemgr.format.validate: JSON, fields in FORMAT.md
Manifest = ManifestDoc
Sink = Callable[[bytes | memoryview], None]


# -- manifests ---------------------------------------------------------------------------------

def _legacy_key(raw: bytes, key: str) -> bool:
    """A version-1 manifest at `manifests/<its path as written>.json`: how ckptfs keyed a name
    before escaping existed (docs/FORMAT.md "Names": a literal `ckpt-%C3%A9.pt`)."""
    try:
        doc = validate.parse(raw, "manifest", validate.ManifestError)
    except validate.ManifestError:
        return False
    p = doc.get("path")
    return doc["version"] == 1 and isinstance(p, str) and key == f"manifests/{p}.json"


def load_manifest(view: StoreView, key: str, size: int | None = None) -> Manifest | None:
    """The validated, normalised manifest at `key`; None if there is none; CorruptError if it
    is invalid or bigger than validate.MAX_DOCUMENT_BYTES (`size`: from the listing, so that
    such a one is not even read)."""
    limit = validate.MAX_DOCUMENT_BYTES
    if size is not None and size > limit:
        raise CorruptError(f"{key}: a manifest of {size} bytes (at most {limit})")
    raw = view.get(key, max_bytes=limit)
    if raw is None:
        return None
    return parse_manifest(raw, key)


def parse_manifest(raw: bytes, key: str) -> Manifest:
    """The manifest whose bytes `raw` were read from `key`, validated and normalised (a
    version-1 manifest at the key of its literal name included); CorruptError otherwise."""
    try:
        return validate.manifest(raw, key)
    except validate.ManifestError as e:
        if "is not the set of its key" in str(e) and _legacy_key(raw, key):
            try:
                return validate.manifest(raw)
            except validate.ManifestError as e2:
                e = e2
        raise CorruptError(f"{key}: invalid manifest: {e}") from None


def manifests(view: StoreView, on_error: Callable[[str], None] | None = None
              ) -> dict[str, Manifest]:
    """{set path (escaped form): manifest} of every published set, each validated and
    normalised by cachemgr.format.validate. An invalid manifest is passed to `on_error` (one line)
    if given, and left out."""
    out = {}
    for key, size in view.listing(keys.MANIFEST_PREFIX):
        if not keys.is_manifest_key(key):
            continue
        try:
            m = load_manifest(view, key, size)
        except CorruptError as e:
            if on_error is not None:
                on_error(str(e))
            continue
        if m is not None:  # None: the set was deleted between the listing and the get
            out[m["path"]] = m
    return out


def find_set(view: StoreView, set_path: str) -> Manifest:
    """The manifest of SET_PATH as `list` prints it (the escaped form), or as the real path
    (bytes from argv), or at the key a version-1 manifest of that literal name has (see
    _legacy_key). NoSuchSet, UsageError, or CorruptError for an invalid manifest."""
    forms = [set_path] if names.is_canonical_path(set_path) else []
    forms.append(names.escape_path(os.fsencode(set_path)))
    tried = []
    for p in forms:
        try:
            validate.path(p, 2, "set path", validate.ManifestError)
        except validate.ManifestError:
            continue
        tried.append(keys.manifest_key(p))
        with contextlib.suppress(UnicodeDecodeError):  # the key a version-1 writer gave it
            tried.append(f"{keys.MANIFEST_PREFIX}{unescape_path(p).decode()}"
                         f"{keys.MANIFEST_SUFFIX}")
    if not tried:
        raise UsageError(f"{set_path!r} is not a set path")
    err = None
    for key in dict.fromkeys(tried):
        try:
            m = load_manifest(view, key)
        except CorruptError as e:
            err = err or e
            continue
        if m is not None:
            return m
    if err is not None:
        raise err
    raise NoSuchSet(f"no set {set_path!r} in the store")


def checked(m: Any) -> Manifest:
    """A manifest given to restore()/restore_to() checked again (they are public: the caller's
    dict is not trusted either). A normalised manifest (from manifests(), load_manifest())
    passes unchanged: its names are in the escaped form whatever its version."""
    if not isinstance(m, dict):
        raise CorruptError("a manifest is a JSON object")
    v = m.get("version")
    try:
        data = json.dumps({**m, "version": 2} if type(v) is int and v in (1, 2) else m).encode()
    except (TypeError, ValueError, RecursionError) as e:
        raise CorruptError(f"not a manifest: {e}") from None
    try:
        return validate.manifest(data)
    except validate.ManifestError as e:
        raise CorruptError(f"invalid manifest: {e}") from None


# -- objects -----------------------------------------------------------------------------------

def stream_object(src: Reader, obj: ObjectDoc, sink: Sink) -> None:
    """Every raw byte of object `obj` (a validated description) from reader `src` to `sink`,
    chunk by chunk, at most decode.READ_BYTES at a time, each chunk checked after its last
    piece and the whole object at the end; CorruptError at the first problem (what `sink`
    already got is then not to be used)."""
    key, stored = obj["key"], obj["stored_size"]
    if src.size != stored:
        raise CorruptError(f"{key}: {src.size} bytes in the store, the manifest says {stored}")
    lz4 = obj["compression"] == "lz4"
    whole = ObjectCheck(key, obj["size"], obj["crc32c"])
    try:
        for c in Layout.of(obj):
            dec = ChunkDecoder(key, c, lz4=lz4)
            for data in stream_chunk(src.read, dec):
                sink(data)
            whole.add(dec.crc, c.raw_len)
        whole.finish()
    except DecodeError as e:
        raise CorruptError(str(e)) from None


def open_object(view: StoreView, obj: ObjectDoc) -> Reader:
    """A reader of object `obj`; CorruptError if the store does not have it."""
    src = view.open(obj["key"])
    if src is None:
        raise CorruptError(f"{obj['key']}: object missing from the store")
    return src


def decode(obj: ObjectDoc, stored: bytes) -> bytes:
    """The raw content of object description `obj` (checked on its own, any key) whose stored
    bytes are `stored`: every size and CRC32C checked; CorruptError otherwise. Small objects
    only (tests): the CLI streams."""
    if not isinstance(obj, dict):
        raise CorruptError("an object description is a JSON object")
    key = str(obj.get("key"))
    try:  # the geometry and types, whatever the key (validate wants one under data/<node>/)
        o = validate.stored_object({**obj, "key": "data/x/o"}, frozenset({"x"}),
                                   what=f"object {key!r}", error=validate.DocumentError)
    except validate.DocumentError as e:
        raise CorruptError(str(e).replace("'data/x/o'", repr(key))) from None
    o["key"] = key
    out = bytearray()
    stream_object(BytesObject(o["key"], stored), o, out.extend)
    return bytes(out)


def restore(view: StoreView, m: Manifest) -> dict[str, bytes]:
    """{file path inside the set (escaped form): bytes}, every object checked end to end.
    Holds the whole set in memory: for small sets (the fault loop's checks of what a set
    restores to, scripts/fault_checks.py, through scripts/ckpt_restore.py); restoreto.restore_to
    streams."""
    m = checked(m)
    out = {}
    for f in m["files"]:
        src = open_object(view, f["object"])
        try:
            buf = bytearray()
            stream_object(src, f["object"], buf.extend)
        finally:
            src.close()
        out[f["path"]] = bytes(buf)
    return out


def verify_object(view: StoreView, obj: ObjectDoc) -> None:
    """Read object `obj` (a validated description) back from the store and check every byte
    as a restore would (stored size, lz4 frames, CRC32C, chunk CRC32Cs), a few MiB at a time,
    keeping nothing: CorruptError at the first problem (`ckptfs fsck --verify`)."""
    src = open_object(view, obj)
    try:
        stream_object(src, obj, lambda _data: None)
    finally:
        src.close()
