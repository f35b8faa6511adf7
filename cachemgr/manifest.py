"""Set manifests: the JSON document that publishes a shard set in the store (docs/FORMAT.md).

A manifest is written once per commit, only after every object it names is in the store and
verified, with a single PUT to `manifests/<set path>.json` (atomic in S3 and in the file://
store). Its presence is the commit: readers list `manifests/` and trust nothing else.
"""

from __future__ import annotations

import json
import time

from .names import from_str, is_canonical_path, is_escaped
from .store import StoreError

FORMAT = "ckptfs-manifest"
FORMAT_VERSION = 1
# Version 2 is version 1 with its names in the escaped form of cachemgr.names (docs/FORMAT.md
# "Names"). It is written only for a set holding a name that needs an escape, so every other
# manifest stays version 1, byte for byte as before, and a version-1 reader refuses one it would
# misname instead of restoring files under the wrong names.
ESCAPED_VERSION = 2
VERSIONS = (FORMAT_VERSION, ESCAPED_VERSION)
MANIFEST_PREFIX = "manifests/"
MANIFEST_SUFFIX = ".json"


class ManifestError(ValueError):
    pass


class UnrepresentableError(StoreError):
    """A document holds a string JSON readers would refuse (a lone surrogate). A StoreError so
    that the set fails with this reason instead of stopping the worker that publishes it."""


def _surrogates(s: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in s)


def _legacy(s: str) -> str:
    """A path as the index may still hold it from before escaping (set layouts kept undecodable
    bytes as surrogates): its escaped form. Already escaped paths are returned as they are."""
    return from_str(s) if _surrogates(s) else s


def _path_fields(m: dict):
    """(container, field) of every name-bearing string of a manifest."""
    yield m, "path"
    if "target" in m:
        yield m, "target"
    for f in m.get("files", []):
        yield f, "path"
    for d in m.get("dirs", []):
        yield d, "path"
    for link in m.get("symlinks", []):
        yield link, "path"
        yield link, "target"


def manifest_key(path: str) -> str:
    return MANIFEST_PREFIX + path + MANIFEST_SUFFIX


def path_of_manifest_key(key: str) -> str | None:
    if key.startswith(MANIFEST_PREFIX) and key.endswith(MANIFEST_SUFFIX):
        return key[len(MANIFEST_PREFIX):-len(MANIFEST_SUFFIX)]
    return None


def build(*, path: str, kind: str, seq: int, node: str, reason: str, committed_ns: int,
          layout: dict, files: list[dict]) -> dict:
    """`files`: dicts with path, size, mode, mtime_ns and object (StoredObject.to_json()).
    Paths and targets are in the escaped form (cachemgr.names); the version says whether any of
    them holds an escape."""
    m = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "path": path,
        "kind": kind,
        "commit": {"node": node, "seq": seq, "reason": reason, "committed_ns": committed_ns,
                   "published_ns": time.time_ns()},
        "files": files,
        "dirs": layout.get("dirs", []),
        "symlinks": layout.get("symlinks", []),
    }
    if "mode" in layout:
        m["mode"] = layout["mode"]
    if kind == "symlink":
        m["target"] = layout["target"]
    m["total_bytes"] = sum(f["size"] for f in files)
    escaped = False
    for obj, k in _path_fields(m):
        obj[k] = _legacy(obj[k])
        escaped = escaped or is_escaped(obj[k])
    if escaped:
        m["version"] = ESCAPED_VERSION
    return m


def _strings(x):
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def dumps_checked(doc: dict, what: str, **kw) -> bytes:
    """JSON of a store document; UnrepresentableError if a string in it holds a lone surrogate
    (json.dumps would write it as a \\udcXX escape, which strict JSON parsers refuse)."""
    for s in _strings(doc):
        if _surrogates(s):
            raise UnrepresentableError(f"{what} cannot be written: {s!r} is not valid text")
    return json.dumps(doc, **kw).encode()


def dumps(m: dict) -> bytes:
    return dumps_checked(m, f"the manifest of {m.get('path')!r}", indent=1, sort_keys=True)


def normalize_paths(doc: dict, fields, *, what: str, error: type[ValueError]) -> None:
    """Bring the name-bearing fields of a parsed document to the escaped form: version-1
    documents hold names as they are (older ones may hold undecodable bytes as \\udcXX),
    version 2 in the escaped form, which must be canonical."""
    for obj, k in fields:
        v = obj.get(k)
        if not isinstance(v, str):
            raise error(f"{what}: {k} is not a string: {v!r}")
        if doc["version"] == FORMAT_VERSION:
            try:
                obj[k] = from_str(v)
            except UnicodeEncodeError:
                raise error(f"{what}: {k} {v!r} is not a name") from None
        elif not is_canonical_path(v):
            raise error(f"{what}: {k} {v!r} is not in the escaped form")


def load_document(data: bytes, *, what: str, fmt: str, versions: tuple[int, ...],
                  file_keys: set[str], error: type[ValueError]) -> dict:
    """Parse a versioned JSON document of the store (a manifest, a part record): its format and
    version must be known and every `files` entry must have `file_keys`; else `error`."""
    try:
        m = json.loads(data)
    except ValueError as e:
        raise error(f"{what} is not JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != fmt:
        raise error(f"not a ckptfs {what}")
    if m.get("version") not in versions:
        raise error(f"{what} version {m.get('version')} is not one of {list(versions)}")
    for f in m.get("files", []):
        if not isinstance(f, dict) or not file_keys <= f.keys():
            raise error(f"{what} file entry incomplete: {sorted(f) if isinstance(f, dict) else f}")
    return m


def loads(data: bytes) -> dict:
    """A manifest, with every path and target in the escaped form whatever its version."""
    m = load_document(data, what="manifest", fmt=FORMAT, versions=VERSIONS,
                      file_keys={"path", "size", "object"}, error=ManifestError)
    for k in ("dirs", "symlinks"):
        if not all(isinstance(e, dict) for e in m.get(k, [])):
            raise ManifestError(f"manifest {k} entry is not an object")
    normalize_paths(m, list(_path_fields(m)), what="manifest", error=ManifestError)
    return m
