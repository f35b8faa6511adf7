"""Read a ckptfs store the way docs/FORMAT.md tells a user to: manifests, objects, lz4 frames,
CRC32C. No ckptfs code is used, so these helpers check the format as well as the contents."""

from __future__ import annotations

import json
from pathlib import Path

import crc32c
import lz4.frame


class FileStoreView:
    def __init__(self, store_dir: Path) -> None:
        self.root = Path(store_dir) / "objects"

    def keys(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.exists():
            return []
        return sorted(str(p.relative_to(self.root)) for p in base.rglob("*")
                      if p.is_file() and not p.name.startswith(".tmp-"))

    def get(self, key: str) -> bytes:
        return (self.root / key).read_bytes()


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

    def get(self, key: str) -> bytes:
        return self.s3.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()


def manifests(view) -> dict[str, dict]:
    """{set path: manifest} of every published set."""
    out = {}
    for key in view.keys("manifests/"):
        m = json.loads(view.get(key))
        assert m["format"] == "ckptfs-manifest" and m["version"] == 1
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
    return raw


def restore(view, m: dict) -> dict[str, bytes]:
    """{file path inside the set: bytes}, every object checked end to end."""
    return {f["path"]: decode(f["object"], view.get(f["object"]["key"])) for f in m["files"]}


def restore_to(view, m: dict, dest: Path) -> Path:
    """Materialise a set under `dest` (as a user restoring without ckptfs would)."""
    import os

    root = dest / m["path"]
    if m["kind"] == "file":
        root.parent.mkdir(parents=True, exist_ok=True)
        root.write_bytes(restore(view, m)[""])
        return root
    root.mkdir(parents=True, exist_ok=True)
    for d in m["dirs"]:
        (root / d["path"]).mkdir(parents=True, exist_ok=True)
    for path, data in restore(view, m).items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    for s in m["symlinks"]:
        os.symlink(s["target"], root / s["path"])
    return root
