#!/usr/bin/env python3
"""Restore a checkpoint from a ckptfs store without ckptfs: manifests, objects, lz4 frames and
CRC32C, exactly as docs/FORMAT.md describes (needs only boto3, lz4 and crc32c).

    python scripts/ckpt_restore.py list    file:///var/lib/ckptfs/store
    python scripts/ckpt_restore.py restore s3://bucket/prefix ckpt/step_100 ./restored \
        [--endpoint-url URL]

The tests and the main job use the same functions to check what ckptfs published.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import crc32c
import lz4.frame


class FileStoreView:
    def __init__(self, store_dir: Path) -> None:
        self.root = Path(store_dir) / "objects"

    def keys(self, prefix: str) -> list[str]:
        """Every key starting with `prefix` (like S3's listing: not only whole directories),
        leaving out the store's own in-flight temp files."""
        base = self.root / prefix.rpartition("/")[0]
        if not base.is_dir():
            return []
        keys = (str(p.relative_to(self.root)) for p in base.rglob("*")
                if p.is_file() and not p.name.startswith(".tmp-"))
        return sorted(k for k in keys if k.startswith(prefix))

    def get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None


class S3StoreView:
    def __init__(self, endpoint: str, bucket: str, prefix: str) -> None:
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    def keys(self, prefix: str) -> list[str]:
        out = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix):
            out += [o["Key"][len(self.prefix):] for o in page.get("Contents", [])]
        return sorted(out)

    def get(self, key: str) -> bytes | None:
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None


# Names (docs/FORMAT.md "Names"): a version-2 manifest holds its paths and symlink targets in
# the escaped form, where `%25` is '%' and `%80`..`%FF` are bytes that are not UTF-8; a
# component holding none of these escapes is its UTF-8 text. Version 1 holds names as they are.
_ESCAPE = re.compile(r"%(25|[89A-F][0-9A-F])")


def unescape_name(s: str) -> bytes:
    pieces = _ESCAPE.split(s)  # literal, hex, literal, hex, ..., literal
    return b"".join(bytes((int(p, 16),)) if i % 2 else p.encode("utf-8")
                    for i, p in enumerate(pieces))


def name_bytes(m: dict, path: str) -> bytes:
    """The real bytes of a path (or symlink target) field of manifest `m`."""
    if m["version"] == 2:
        return b"/".join(unescape_name(c) for c in path.split("/"))
    # Version 1: the name as it is (old writers wrote undecodable bytes as \udcXX escapes).
    return path.encode("utf-8", "surrogateescape")


def manifests(view) -> dict[str, dict]:
    """{set path: manifest} of every published set (keyed by the manifest's `path` field: the
    escaped form for version 2)."""
    out = {}
    for key in view.keys("manifests/"):
        raw = view.get(key)
        if raw is None:  # the set was deleted between the listing and the get
            continue
        m = json.loads(raw)
        assert m["format"] == "ckptfs-manifest" and m["version"] in (1, 2)
        assert key == f"manifests/{m['path']}.json"
        out[m["path"]] = m
    return out


def decode(obj: dict, stored: bytes) -> bytes:
    assert len(stored) == obj["stored_size"], f"{obj['key']}: stored size"
    if obj["compression"] == "none":
        raw = stored
    else:
        assert obj["compression"] == "lz4"
        parts, off = [], 0
        for n in obj["frames"]:
            parts.append(lz4.frame.decompress(stored[off:off + n]))
            off += n
        assert off == len(stored)
        raw = b"".join(parts)
    assert len(raw) == obj["size"], f"{obj['key']}: raw size"
    assert crc32c.crc32c(raw) == obj["crc32c"], f"{obj['key']}: CRC32C mismatch"
    crcs = obj.get("chunk_crcs")
    if crcs is not None:  # optional, additive (docs/FORMAT.md "Chunk checksums")
        cs = obj["chunk_size"]
        assert cs > 0 and len(crcs) == -(-len(raw) // cs), f"{obj['key']}: chunk count"
        if obj["compression"] == "lz4":
            assert cs == obj["frame_size"], f"{obj['key']}: chunks are not frames"
        view = memoryview(raw)
        for i, c in enumerate(crcs):
            assert crc32c.crc32c(view[i * cs:(i + 1) * cs]) == c, \
                f"{obj['key']}: chunk {i} CRC32C mismatch"
    return raw


def restore(view, m: dict) -> dict[str, bytes]:
    """{file path inside the set: bytes}, every object checked end to end."""
    out = {}
    for f in m["files"]:
        stored = view.get(f["object"]["key"])
        assert stored is not None, f"{f['object']['key']}: object missing from the store"
        out[f["path"]] = decode(f["object"], stored)
    return out


def restore_to(view, m: dict, dest: Path) -> Path:
    """Materialise a set under `dest` (as a user restoring without ckptfs would), with the
    exact byte names of the manifest."""
    root = os.path.join(os.fsencode(dest), name_bytes(m, m["path"]))
    if m["kind"] == "file":
        os.makedirs(os.path.dirname(root), exist_ok=True)
        with open(root, "wb") as f:
            f.write(restore(view, m)[""])
        return Path(os.fsdecode(root))
    if m["kind"] == "symlink":
        os.makedirs(os.path.dirname(root), exist_ok=True)
        os.symlink(name_bytes(m, m["target"]), root)
        return Path(os.fsdecode(root))
    os.makedirs(root, exist_ok=True)
    for d in m["dirs"]:
        os.makedirs(os.path.join(root, name_bytes(m, d["path"])), exist_ok=True)
    for path, data in restore(view, m).items():
        dst = os.path.join(root, name_bytes(m, path))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
    for s in m["symlinks"]:
        os.symlink(name_bytes(m, s["target"]), os.path.join(root, name_bytes(m, s["path"])))
    return Path(os.fsdecode(root))


def open_view(url: str, endpoint_url: str | None = None):
    if url.startswith("file://"):
        return FileStoreView(Path(url[len("file://"):]))
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        return S3StoreView(endpoint_url, bucket, prefix)
    raise SystemExit(f"ckpt_restore: unsupported store URL {url!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="list the published sets")
    ls.add_argument("store")
    r = sub.add_parser("restore", help="restore one set into a directory")
    r.add_argument("store")
    r.add_argument("set_path")
    r.add_argument("dest", type=Path)
    for q in (ls, r):
        q.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"))
    a = p.parse_args(argv)
    view = open_view(a.store, a.endpoint_url)
    ms = manifests(view)
    if a.cmd == "list":
        for path, m in sorted(ms.items()):
            print(f"{m['kind']:<8} {m['total_bytes']:>14}  {path}")
        return 0
    # SET_PATH as `list` prints it (the escaped form), or the real path (bytes from argv).
    real = os.fsencode(a.set_path)
    found = ms.get(a.set_path) or next(
        (m for m in ms.values() if name_bytes(m, m["path"]) == real), None)
    if found is None:
        print(f"ckpt_restore: no set {a.set_path!r} in {a.store}", file=sys.stderr)
        return 1
    out = restore_to(view, found, a.dest)
    print(f"restored {a.set_path} to {out} (every CRC32C checked)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
