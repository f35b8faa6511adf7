"""The store's documents as types (docs/FORMAT.md): what `cachemgr.format.validate` returns
after checking every field, and what `cachemgr.format.manifest.build` writes. TypedDicts: the
documents stay the plain JSON dicts they are on the wire (`json.dumps` them as they are), and
mypy checks every key their readers use."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class ObjectDoc(TypedDict):
    """A stored object, as a manifest names it ("object" of a file; StoredObject.to_json)."""

    key: str
    size: int
    stored_size: int
    crc32c: int
    compression: str              # "none" or "lz4"
    frame_size: int
    frames: list[int] | None      # lz4: each frame's stored length
    chunk_size: int               # 0: written before chunk CRCs
    chunk_crcs: list[int] | None


class FileDoc(TypedDict):
    """A file of a set."""

    path: str                     # escaped form (cachemgr.format.names); "" for a file set
    size: int
    mode: int
    mtime_ns: int
    object: ObjectDoc


class GatheredFile(FileDoc):
    """A file of a set that another node wrote (cachemgr.tiering.gather, from its part
    record): a manifest entry and the node it came from (`node` is dropped from the
    manifest; it names the node in `commit.nodes`)."""

    node: str


class PartFile(TypedDict):
    """A file of a part record: one node's file in a directory another node may commit."""

    name: str
    size: int
    mode: int
    mtime_ns: int
    object: ObjectDoc | None      # None: not uploaded yet (announced)


class PartRecordDoc(TypedDict):
    """A part record (docs/FORMAT.md "Part records")."""

    format: str
    version: int
    node: str
    dir: str
    updated_ns: int
    generation: int               # the writer's lease generation
    files: list[PartFile]


class DirDoc(TypedDict):
    path: str
    mode: int
    mtime_ns: int | None


class LinkDoc(TypedDict):
    path: str
    target: str


# "from" is a keyword: the functional form
CommitDoc = TypedDict("CommitDoc", {
    "node": str,                  # the committing node
    "seq": int,
    "reason": str,
    "committed_ns": int,
    "published_ns": NotRequired[int],
    "nodes": NotRequired[list[str]],  # a directory commit of several nodes: every writer
    "from": NotRequired[str],     # the path the set was renamed from
    # a buddy that published the set from its replica (written; readers keep only the
    # fields above)
    "taken_over_by": NotRequired[str],
})


class ManifestDoc(TypedDict):
    """A manifest (docs/FORMAT.md "Manifest")."""

    format: str
    version: int
    path: str
    kind: str                     # "dir", "file" or "symlink"
    commit: CommitDoc
    mode: NotRequired[int]        # a directory set's own mode
    target: NotRequired[str]      # a symlink set's target
    files: list[FileDoc]
    dirs: list[DirDoc]
    symlinks: list[LinkDoc]
    total_bytes: int
