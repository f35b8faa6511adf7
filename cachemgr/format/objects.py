"""What one stored object is, independent of how it is moved: `StoredObject` (the description
a set manifest carries) and its chunk geometry. No I/O, no trio: pure functions and one
frozen dataclass, safe to call from any thread. Decoding and checking stored bytes is
cachemgr.format.decode's (`chunk_at` hands it a chunk).

Integrity
    `StoredObject.crc32c` is the CRC32C of the RAW content. `decode.crc32c_combine` folds the
    CRCs of consecutive pieces into the CRC of their concatenation (GF(2) arithmetic, ~10 us
    per fold), so `cachemgr.transfer` checksums raw bytes once, piece by piece in any order,
    and still checks the whole file without re-reading it.

Chunks
    Every object is cut into raw chunks of `chunk_size` bytes (the frame size, 4 MiB by
    default, whether compressed or not; for lz4 a chunk is exactly one frame), and
    `chunk_crcs[i]` is the CRC32C of raw chunk i, [i*chunk_size, min((i+1)*chunk_size, size)).
    So any chunk can be checked on its own (`verify_chunk`, and the fetch paths of
    `cachemgr.transfer`). Objects from before chunk CRCs (`chunk_size` 0, `chunk_crcs`
    None) still read: their chunks are the lz4 frames, or DEFAULT_FRAME_SIZE slices of an
    uncompressed object, checked by length only (and by the whole-file CRC32C on download).

Invariants
    A `StoredObject` that exists satisfies `cachemgr.format.validate.object_geometry` (checked in
    `__post_init__`, for objects built here and for those read from the store alike), so the
    geometry functions below index `frames`, `offsets` and `chunk_crcs` without re-checking.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cachemgr.format.compress import DEFAULT_FRAME_SIZE, frame_offsets
from cachemgr.format.decode import Chunk, crc32c
from cachemgr.format.docs import ObjectDoc
from cachemgr.format.validate import object_geometry


@dataclass(frozen=True)
class StoredObject:
    """Where and how one file's bytes are stored; serialised into the set manifest.

    `size` and `crc32c` describe the RAW content; `stored_size` the object's bytes. For
    compression "lz4", `frames` is the tuple of stored frame lengths and raw frame i covers
    [i*frame_size, ...); for "none", frames is None and frame_size 0.

    `chunk_crcs[i]` is the CRC32C of raw chunk i, [i*chunk_size, min((i+1)*chunk_size, size))
    (for lz4, chunk_size == frame_size: chunks are frames). Objects written before chunk CRCs
    existed have chunk_size 0 and chunk_crcs None (see `chunk_span` for their chunks)."""

    key: str
    size: int
    stored_size: int
    crc32c: int
    compression: str = "none"              # "none" | "lz4"
    frame_size: int = 0
    frames: tuple[int, ...] | None = None
    chunk_size: int = 0
    chunk_crcs: tuple[int, ...] | None = None
    # Prefix sums of `frames` (not serialised, not compared): O(1) frame -> stored offset.
    offsets: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The one statement of these invariants (cachemgr.format.validate, also used for objects
        # read from the store and by scripts/ckpt_restore.py).
        for f in ("frames", "chunk_crcs"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, tuple(getattr(self, f)))
        try:
            object_geometry(self.size, self.stored_size, self.crc32c, self.compression,
                            self.frame_size, self.frames, self.chunk_size, self.chunk_crcs)
        except ValueError as e:
            raise ValueError(f"bad StoredObject {self.key!r}: {e}") from None
        if self.frames is not None:
            object.__setattr__(self, "offsets", frame_offsets(self.frames))

    def raw_frame_len(self, i: int) -> int:
        return min(self.frame_size, self.size - i * self.frame_size)

    def to_json(self) -> ObjectDoc:
        """A dict of JSON types (the manifest embeds it; `json.dumps` it for a string)."""
        return {"key": self.key, "size": self.size, "stored_size": self.stored_size,
                "crc32c": self.crc32c, "compression": self.compression,
                "frame_size": self.frame_size,
                "frames": list(self.frames) if self.frames is not None else None,
                "chunk_size": self.chunk_size,
                "chunk_crcs": list(self.chunk_crcs) if self.chunk_crcs is not None else None}

    @classmethod
    def from_json(cls, doc: ObjectDoc | dict[str, Any] | str | bytes) -> StoredObject:
        """Inverse of `to_json` (also accepts its `json.dumps` string); validates the index.
        Dicts written before chunk CRCs (no chunk_size/chunk_crcs) load with 0/None."""
        d: Mapping[str, Any] = json.loads(doc) if isinstance(doc, str | bytes) else doc
        frames = d["frames"]
        crcs = d.get("chunk_crcs")
        return cls(key=d["key"], size=int(d["size"]), stored_size=int(d["stored_size"]),
                   crc32c=int(d["crc32c"]), compression=d["compression"],
                   frame_size=int(d["frame_size"]),
                   frames=tuple(int(n) for n in frames) if frames is not None else None,
                   chunk_size=int(d.get("chunk_size") or 0),
                   chunk_crcs=tuple(int(c) for c in crcs) if crcs is not None else None)


# ----------------------------------------------------------------------------------------------
# chunk geometry


def chunk_size_of(obj: StoredObject) -> int:
    if obj.compression == "lz4":
        return obj.frame_size
    # An uncompressed object from before chunk CRCs: the default frame size is as good a cut
    # as any (there is nothing to check but lengths).
    return obj.chunk_size or DEFAULT_FRAME_SIZE


def chunk_count(obj: StoredObject) -> int:
    """How many raw chunks `obj` has (0 for an empty object)."""
    return math.ceil(obj.size / chunk_size_of(obj))


def chunk_span(obj: StoredObject, index: int) -> tuple[int, int]:
    """(raw_offset, raw_len) of raw chunk `index`. Raises IndexError outside [0, count)."""
    cs = chunk_size_of(obj)
    if not 0 <= index < math.ceil(obj.size / cs):
        raise IndexError(f"{obj.key}: no chunk {index} in {chunk_count(obj)}")
    off = index * cs
    return off, min(cs, obj.size - off)


def frames_of(obj: StoredObject) -> tuple[int, ...]:
    """The stored frame lengths of an lz4 object (ValueError for an uncompressed one)."""
    if obj.frames is None:
        raise ValueError(f"{obj.key}: not a framed (lz4) object")
    return obj.frames


def stored_span(obj: StoredObject, first: int, last: int) -> tuple[int, int]:
    """(stored_offset, stored_len) of chunks [first, last]."""
    if obj.compression == "lz4":
        offsets = obj.offsets
        assert offsets is not None  # set with `frames` in __post_init__
        s = offsets[first]
        return s, offsets[last + 1] - s
    cs = chunk_size_of(obj)
    s = first * cs
    return s, min((last + 1) * cs, obj.size) - s


def chunk_at(obj: StoredObject, index: int) -> Chunk:
    """Chunk `index` of `obj` as the decoder takes it (cachemgr.format.decode): its raw and
    stored place and its CRC32C. IndexError outside [0, count)."""
    off, n = chunk_span(obj, index)
    s, sn = stored_span(obj, index, index)
    return Chunk(index, off, n, s, sn,
                 obj.chunk_crcs[index] if obj.chunk_crcs is not None else None)


def verify_chunk(obj: StoredObject, index: int, raw: bytes | memoryview) -> bool:
    """Whether `raw` can be raw chunk `index` of `obj` (e.g. read back from a local cache file):
    its length must be the chunk's, and its CRC32C `obj.chunk_crcs[index]` when the object has
    chunk CRCs (True on length alone when it has none)."""
    _, n = chunk_span(obj, index)
    if len(raw) != n:
        return False
    return obj.chunk_crcs is None or crc32c(raw) == obj.chunk_crcs[index]
