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


def load_document(data: bytes, *, what: str, fmt: str, version: int, file_keys: set[str],
                  error: type[ValueError]) -> dict:
    """Parse a versioned JSON document of the store (a manifest, a part record): its format and
    version must match and every `files` entry must have `file_keys`; else `error`."""
    try:
        m = json.loads(data)
    except ValueError as e:
        raise error(f"{what} is not JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != fmt:
        raise error(f"not a ckptfs {what}")
    if m.get("version") != version:
        raise error(f"{what} version {m.get('version')} is not {version}")
    for f in m.get("files", []):
        if not isinstance(f, dict) or not file_keys <= f.keys():
            raise error(f"{what} file entry incomplete: {sorted(f) if isinstance(f, dict) else f}")
    return m


def loads(data: bytes) -> dict:
    return load_document(data, what="manifest", fmt=FORMAT, version=FORMAT_VERSION,
                         file_keys={"path", "size", "object"}, error=ManifestError)
