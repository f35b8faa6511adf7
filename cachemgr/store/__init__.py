"""Object-store backends behind one async interface (see `base.ObjectStore`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachemgr.store.base import (
    DeadlineExceeded,
    IntegrityError,
    NotFound,
    ObjectInfo,
    ObjectStore,
    Part,
    PreconditionFailed,
    StoreError,
    TransientStoreError,
    crc32c,
)
from cachemgr.store.local import LocalStore
from cachemgr.store.wrappers import RetryingStore, RetryPolicy

__all__ = [
    "DeadlineExceeded", "IntegrityError", "LocalStore", "NotFound", "ObjectInfo", "ObjectStore",
    "Part", "PreconditionFailed", "RetryPolicy", "RetryingStore", "StoreError",
    "TransientStoreError", "crc32c", "open_store",
]


def open_store(url: str, **s3_opts: Any) -> ObjectStore:
    """`file:///abs/dir` or `s3://bucket[/prefix]` (options: endpoint_url, region, path_style,
    profile, max_connections). Raises StoreError for anything else."""
    if url.startswith("file://"):
        path = url[len("file://"):]
        if not path.startswith("/"):
            raise StoreError(f"file:// store needs an absolute path: {url!r}")
        return LocalStore(Path(path))
    if url.startswith("s3://"):
        from cachemgr.store.s3 import S3Options, S3Store

        return S3Store(url, S3Options(**s3_opts))
    raise StoreError(f"unsupported store URL {url!r} (use s3://bucket/prefix or file:///dir)")
