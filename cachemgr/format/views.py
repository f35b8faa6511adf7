"""Store views: what the mount-less readers (cachemgr.format.storeread, restoreto, resumable)
read a store through, as protocols. Standard library only (scripts/ckpt_restore.py's MODULES).

A view has `listing(prefix) -> [(key, size)]`, `get(key, max_bytes) -> bytes | None` (small
documents: never more than max_bytes read, CorruptError past it) and `open(key) -> reader |
None`; a reader has `key`, `size`, `read(offset, n)` (exactly n bytes, or an error) and
`close()`. Two stores implement them: ckptfs's tools read through cachemgr.store, the layer the
mount reads through (cachemgr.format.storeview: `ObjectStoreView`), and scripts/ckpt_restore.py,
which must run without trio and without ckptfs, through its own minimal file:// and s3://
views (`FileStoreView`, `S3StoreView`: the format's independent reference reader, in the script
itself). `BytesObject` is an object already in memory.
"""

from __future__ import annotations

from typing import Protocol


class Reader(Protocol):
    """An open object of a store view: its key, its stored size, ranged reads, close."""

    @property
    def key(self) -> str: ...

    @property
    def size(self) -> int: ...

    def read(self, offset: int, n: int) -> bytes: ...

    def close(self) -> None: ...


class StoreView(Protocol):
    """What the readers read a store through: ckptfs's view over cachemgr.store
    (cachemgr.format.storeview), or scripts/ckpt_restore.py's own file:// and s3:// views."""

    def listing(self, prefix: str) -> list[tuple[str, int]]: ...

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None: ...

    def open(self, key: str) -> Reader | None: ...


class BytesObject:
    """An object already in memory (storeread.decode())."""

    def __init__(self, key: str, data: bytes) -> None:
        self.key, self.data, self.size = key, memoryview(data), len(data)

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.data[offset:offset + n])

    def close(self) -> None:
        pass
