"""The documents of the peer namespace tests (tests/unit/test_peernamespace.py,
tests/mount/test_peernamespace_mount.py): a held replica's descriptor, the manifest a buddy
builds from it, a namespace answer.
"""

from __future__ import annotations

import json
import time
from typing import Any

from cachemgr.format import validate
from cachemgr.format.decode import crc32c
from cachemgr.tiering.replicate import replica_manifest, virtual_objects

SECRET = b"peerspace-secret-for-tests-01234"
CHUNK = validate.REPLICA_CHUNK
ORIGIN = "lostnode"   # the node whose replicas the fake peer holds (never mounted)
FAKE = "fakepeer"     # the fake peer's node id


# ----------------------------------------------------------------------------------------------
# documents: a held replica's descriptor, the manifest a buddy builds from it, a namespace answer


def chunk_crcs(data: bytes) -> list[int]:
    return [crc32c(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK)]


def descriptor(files: dict[str, bytes], *, path: str = "run/step_9", seq: int = 7,
               origin: str = ORIGIN, kind: str = "dir",
               committed_ns: int | None = None) -> dict[str, Any]:
    """A held replica's descriptor as the buddy seals it (validate.replica_offer's fields, each
    file with the CRC32Cs of its REPLICA_CHUNKs), validated."""
    doc = {"format": "ckptfs-replica-offer", "version": 1, "origin": origin, "generation": 1,
           "seq": seq, "path": path, "kind": kind,
           "committed_ns": time.time_ns() if committed_ns is None else committed_ns,
           "reason": "rename", "endpoint": {"host": "127.0.0.1", "port": 9},
           "files": [{"rel": rel, "size": len(data), "mode": 0o644, "mtime_ns": 1,
                      "crcs": chunk_crcs(data)} for rel, data in files.items()],
           "dirs": [], "symlinks": []}
    return validate.replica_offer(json.dumps(doc).encode(),
                                  max_bytes=validate.MAX_DOCUMENT_BYTES)


def manifest_of(desc: dict[str, Any]) -> dict[str, Any]:
    objs = virtual_objects(desc)
    assert objs is not None
    return replica_manifest(desc, objs)


def namespace_doc(sets: list[str], *, port: int, **over: Any) -> dict[str, Any]:
    doc = {"format": "ckptfs-peer-namespace", "version": 1, "node": FAKE,
           "peers": [{"node": FAKE, "host": "127.0.0.1", "port": port}], "sets": sets,
           "truncated": False}
    doc.update(over)
    return doc
