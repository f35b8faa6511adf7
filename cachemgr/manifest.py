"""Set manifests: the JSON document that publishes a shard set in the store (docs/FORMAT.md).

A manifest is written once per commit, only after every object it names is in the store and
verified, with a single PUT to `manifests/<set path>.json` (atomic in S3 and in the file://
store). Its presence is the commit: readers list `manifests/` and trust nothing else.
"""

from __future__ import annotations

import json
import time

FORMAT = "ckptfs-manifest"
FORMAT_VERSION = 1
MANIFEST_PREFIX = "manifests/"
MANIFEST_SUFFIX = ".json"


class ManifestError(ValueError):
    pass


def manifest_key(path: str) -> str:
    return MANIFEST_PREFIX + path + MANIFEST_SUFFIX


def path_of_manifest_key(key: str) -> str | None:
    if key.startswith(MANIFEST_PREFIX) and key.endswith(MANIFEST_SUFFIX):
        return key[len(MANIFEST_PREFIX):-len(MANIFEST_SUFFIX)]
    return None


def build(*, path: str, kind: str, seq: int, node: str, reason: str, committed_ns: int,
          layout: dict, files: list[dict]) -> dict:
    """`files`: dicts with path, size, mode, mtime_ns and object (StoredObject.to_json())."""
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
    return m


def dumps(m: dict) -> bytes:
    return json.dumps(m, indent=1, sort_keys=True).encode()


def loads(data: bytes) -> dict:
    try:
        m = json.loads(data)
    except ValueError as e:
        raise ManifestError(f"manifest is not JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ManifestError("not a ckptfs manifest")
    if m.get("version") != FORMAT_VERSION:
        raise ManifestError(f"manifest version {m.get('version')} is not {FORMAT_VERSION}")
    for f in m.get("files", []):
        if not {"path", "size", "object"} <= f.keys():
            raise ManifestError(f"manifest file entry incomplete: {sorted(f)}")
    return m
