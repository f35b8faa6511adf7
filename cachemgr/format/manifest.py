"""Set manifests: the JSON document that publishes a shard set in the store (docs/FORMAT.md).

A manifest is written once per commit, only after every object it names is in the store and
verified, with a single PUT to `manifests/<set path>.json` (atomic in S3 and in the file://
store). Its presence is the commit: readers list `manifests/` and trust nothing else.

Of two commits of one path, the store keeps the later (`Commit.later_than`, docs/SEMANTICS.md
"Conflicts"); cachemgr.tiering.manifests is the one writer, and applies it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from cachemgr.format import validate
from cachemgr.format.docs import FileDoc, ManifestDoc

# Keys live in cachemgr.format.keys (stdlib only, shared with scripts/ckpt_restore.py); re-exported.
from cachemgr.format.keys import (
    MANIFEST_PREFIX,
    MANIFEST_SUFFIX,
    is_manifest_key,
    manifest_key,
    path_of_manifest_key,
)
from cachemgr.format.names import from_str, is_escaped
from cachemgr.store import StoreError

FORMAT = "ckptfs-manifest"
FORMAT_VERSION = 1
# Version 2 is version 1 with its names in the escaped form of cachemgr.format.names (docs/FORMAT.md
# "Names"). It is written only for a set holding a name that needs an escape, so every other
# manifest stays version 1, byte for byte as before, and a version-1 reader refuses one it would
# misname instead of restoring files under the wrong names.
ESCAPED_VERSION = 2
VERSIONS = validate.VERSIONS  # what a reader accepts: (FORMAT_VERSION, ESCAPED_VERSION)


ManifestError = validate.ManifestError


class UnrepresentableError(StoreError):
    """A document holds a string JSON readers would refuse (a lone surrogate). A StoreError so
    that the set fails with this reason instead of stopping the worker that publishes it."""


def _surrogates(s: str) -> bool:
    return any("\ud800" <= c <= "\udfff" for c in s)


def _legacy(s: str) -> str:
    """A path as the index may still hold it from before escaping (set layouts kept undecodable
    bytes as surrogates): its escaped form. Already escaped paths are returned as they are."""
    return from_str(s) if _surrogates(s) else s


def _path_fields(m: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str]]:
    """(container, field) of every name-bearing string of a manifest."""
    yield m, "path"
    if "from" in m["commit"]:
        yield m["commit"], "from"
    if "target" in m:
        yield m, "target"
    for f in m.get("files", []):
        yield f, "path"
    for d in m.get("dirs", []):
        yield d, "path"
    for link in m.get("symlinks", []):
        yield link, "path"
        yield link, "target"


def build(*, path: str, kind: str, seq: int, node: str, reason: str, committed_ns: int,
          layout: dict[str, Any], files: list[FileDoc]) -> ManifestDoc:
    """`files`: dicts with path, size, mode, mtime_ns and object (StoredObject.to_json()).
    Paths and targets are in the escaped form (cachemgr.format.names); the version says whether any
    of them holds an escape."""
    m: ManifestDoc = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "path": path,
        "kind": kind,
        "commit": {"node": node, "seq": seq, "reason": reason, "committed_ns": committed_ns,
                   "published_ns": time.time_ns()},
        "files": files,
        "dirs": layout.get("dirs", []),
        "symlinks": layout.get("symlinks", []),
        "total_bytes": sum(f["size"] for f in files),
    }
    if layout.get("from"):
        # The path the set was renamed from: the only other place whose files of their own
        # the other nodes may move into the set (cachemgr.tiering.remote "adoption").
        m["commit"]["from"] = layout["from"]
    if "mode" in layout:
        m["mode"] = layout["mode"]
    if kind == "symlink":
        m["target"] = layout["target"]
    escaped = False
    for obj, k in _path_fields(cast(dict[str, Any], m)):
        obj[k] = _legacy(obj[k])
        escaped = escaped or is_escaped(obj[k])
    if escaped:
        m["version"] = ESCAPED_VERSION
    return m


@dataclass(frozen=True, slots=True)
class Commit:
    """A commit of a path, as its manifest names it (`commit_of`), in the one order of a path's
    commits: of two manifests of one path the store keeps the later commit's
    (cachemgr.tiering.manifests, docs/SEMANTICS.md "Conflicts").

    One node's commits are ordered by their `seq`: its own commit order, which its wall clock
    may not follow (a clock stepped back), and a node id is a cache's own (random at its
    creation), so (node, seq) names one commit. Commits of two nodes are ordered by
    `committed_ns` (each node's wall clock), a tie going to the larger node id. Neither of two
    commits is later exactly when they are the same commit (same node and seq). A manifest a
    buddy wrote for a node whose lease ran out (`commit.taken_over_by`) carries that node's id,
    seq and commit time: it is ordered where its origin's own manifest would be. While each
    node's clock does not step back between two commits of a path, this is the order of
    (committed_ns, node, seq)."""

    committed_ns: int
    node: str
    seq: int

    def later_than(self, other: Commit) -> bool:
        if self.node == other.node:
            return self.seq > other.seq
        return (self.committed_ns, self.node) > (other.committed_ns, other.node)


def commit_of(m: ManifestDoc) -> Commit:
    """The commit manifest `m` publishes (`m` as `build` makes it or `loads` returns it)."""
    c = m["commit"]
    return Commit(int(c["committed_ns"]), str(c["node"]), int(c["seq"]))


def _strings(x: object) -> Iterator[str]:
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def dumps_checked(doc: Mapping[str, Any], what: str, **kw: Any) -> bytes:
    """JSON of a store document; UnrepresentableError if a string in it holds a lone surrogate
    (json.dumps would write it as a \\udcXX escape, which strict JSON parsers refuse) or if it
    is bigger than a reader accepts (validate.MAX_DOCUMENT_BYTES)."""
    # The check is one compact dump without escapes encoded as UTF-8, which fails exactly on a
    # lone surrogate: C code, O(size). (A walk over every string in Python took ~0.1 ms an
    # entry, 50 s of the daemon's CPU over the part records of a 1,024-shard DCP save.) Only
    # when it fails are the strings walked, to name the culprit.
    try:
        json.dumps(doc, ensure_ascii=False, check_circular=False).encode()
    except UnicodeEncodeError:
        for s in _strings(doc):
            if _surrogates(s):
                raise UnrepresentableError(
                    f"{what} cannot be written: {s!r} is not valid text") from None
        raise
    out = json.dumps(doc, **kw).encode()
    if len(out) > validate.MAX_DOCUMENT_BYTES:
        # Every reader refuses it (cachemgr.format.validate): fail here, loud, rather than
        # publish a set nobody can see (docs/FORMAT.md "How big a set can be").
        raise UnrepresentableError(
            f"{what} would be {len(out)} bytes, more than the {validate.MAX_DOCUMENT_BYTES} a"
            " reader accepts: commit its files as several sets")
    return out


def dumps(m: ManifestDoc) -> bytes:
    return dumps_checked(m, f"the manifest of {m.get('path')!r}", indent=1, sort_keys=True)


def loads(data: bytes, key: str | None = None) -> ManifestDoc:
    """A manifest read from the store (from `key`, which must be its own path's key),
    validated and normalised by cachemgr.format.validate: every path and target in the escaped form
    whatever its version, optional fields present, modes masked. ManifestError if it must not
    be used."""
    return validate.manifest(data, key)


__all__ = ["ESCAPED_VERSION", "FORMAT", "FORMAT_VERSION", "MANIFEST_PREFIX", "MANIFEST_SUFFIX",
           "VERSIONS", "Commit", "ManifestError", "UnrepresentableError", "build",
           "commit_of", "dumps", "dumps_checked", "is_manifest_key", "loads", "manifest_key",
           "path_of_manifest_key"]
