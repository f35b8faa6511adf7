"""Store views: how the mount-less readers (cachemgr.format.storeread, restoreto, resumable)
read a store. Standard library only (boto3 for the S3 view, imported when one is opened).

A view has `listing(prefix) -> [(key, size)]`, `get(key, max_bytes) -> bytes | None` (small
documents) and `open(key) -> reader | None`; a reader has `key`, `size`, `read(offset, n)`
(exactly n bytes, or an error) and `close()`. `FileStoreView` (a file:// store, never through a
symlink) and `S3StoreView` (boto3) are the script's (`open_view`); ckptfs passes its own view
over cachemgr.store (ckptfs/storetools.py: the store the mount builds, retries included);
`BytesObject` is an object already in memory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from cachemgr.format.readerrors import CorruptError, StoreError, UsageError, show


class Reader(Protocol):
    """An open object of a store view: its key, its stored size, ranged reads, close."""

    @property
    def key(self) -> str: ...

    @property
    def size(self) -> int: ...

    def read(self, offset: int, n: int) -> bytes: ...

    def close(self) -> None: ...


class StoreView(Protocol):
    """What restore reads a store through (FileStoreView, S3StoreView, ckptfs's view over
    cachemgr.store)."""

    def listing(self, prefix: str) -> list[tuple[str, int]]: ...

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None: ...

    def open(self, key: str) -> Reader | None: ...


def key_parts(key: str) -> list[str]:
    """The components of an object key; CorruptError for one no store could hold."""
    parts = key.split("/") if isinstance(key, str) else [""]
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise CorruptError(f"{show(key)} is not an object key")
    return parts


# -- store views -------------------------------------------------------------------------------
# keys(prefix), listing(prefix) -> [(key, size)], get(key, max_bytes) -> bytes | None for small
# documents, open(key) -> an object reader (size, read(offset, n), close()) or None if missing.

class _FileObject:
    def __init__(self, key: str, fd: int, size: int) -> None:
        self.key, self.fd, self.size = key, fd, size

    def read(self, offset: int, n: int) -> bytes:
        b = self._pread(n, offset)
        if len(b) == n:
            return b  # the usual case: one pread, its bytes as they are (no copy)
        out = bytearray()
        while True:
            if not b:
                raise CorruptError(f"{self.key}: the object ends at {offset + len(out)} bytes")
            out += b
            if len(out) == n:
                return bytes(out)
            b = self._pread(n - len(out), offset + len(out))

    def _pread(self, n: int, offset: int) -> bytes:
        try:
            return os.pread(self.fd, n, offset)
        except OSError as e:
            raise StoreError(f"{self.key}: {e}") from None

    def close(self) -> None:
        os.close(self.fd)


class FileStoreView:
    """A file:// store: `<store_dir>/objects/<key>`. Keys are opened one component at a time
    with O_NOFOLLOW: a symlink, a FIFO or anything but a regular file in the store is never
    read through."""

    def __init__(self, store_dir: Path) -> None:
        self.root = Path(store_dir) / "objects"

    def listing(self, prefix: str) -> list[tuple[str, int]]:
        """(key, size) of every regular file whose key starts with `prefix` (like S3's listing:
        not only whole directories), leaving out the store's own in-flight temp files."""
        base = self.root / prefix.rpartition("/")[0]
        out = []
        try:
            if not stat.S_ISDIR(os.lstat(base).st_mode):
                return []
            for dirpath, _dirs, files in os.walk(base, followlinks=False):
                for name in files:
                    if name.startswith(".tmp-"):
                        continue
                    p = os.path.join(dirpath, name)
                    key = os.path.relpath(p, self.root)
                    if not key.startswith(prefix):
                        continue
                    try:
                        st = os.lstat(p)
                    except FileNotFoundError:
                        continue  # deleted while listing
                    if stat.S_ISREG(st.st_mode):
                        out.append((key, st.st_size))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"cannot list {base}: {e}") from None
        return sorted(out)

    def keys(self, prefix: str) -> list[str]:
        return [k for k, _ in self.listing(prefix)]

    def open(self, key: str) -> _FileObject | None:
        parts = key_parts(key)
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"{self.root}: {e}") from None
        try:
            for p in parts[:-1]:
                nfd = os.open(p, flags | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nfd
            # O_NONBLOCK: a FIFO in the store must not hang the restore (refused below).
            nfd = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
            os.close(fd)
            fd = nfd
            st = os.fstat(fd)
        except (FileNotFoundError, NotADirectoryError):
            os.close(fd)
            return None
        except OSError as e:
            os.close(fd)
            if e.errno == errno.ELOOP:
                raise CorruptError(f"{key}: a symlink in the store, not an object") from None
            raise StoreError(f"{key}: {e}") from None
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CorruptError(f"{key}: not a regular file in the store")
        return _FileObject(key, fd, st.st_size)

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        obj = self.open(key)
        if obj is None:
            return None
        try:
            if max_bytes is not None and obj.size > max_bytes:
                raise CorruptError(f"{key} is {obj.size} bytes (at most {max_bytes})")
            return obj.read(0, obj.size)
        finally:
            obj.close()


class _S3Object:
    def __init__(self, view: S3StoreView, key: str, size: int, etag: str | None) -> None:
        self.view, self.key, self.size, self.etag = view, key, size, etag

    def read(self, offset: int, n: int) -> bytes:
        if n <= 0:
            return b""
        kw = {"IfMatch": self.etag} if self.etag else {}
        with self.view._errors(self.key, missing="the object vanished while being read"):
            r = self.view.s3.get_object(Bucket=self.view.bucket, Key=self.view.prefix + self.key,
                                        Range=f"bytes={offset}-{offset + n - 1}", **kw)
            total = str(r.get("ContentRange", "")).rpartition("/")[2]
            body = r["Body"]
            try:
                data: bytes = body.read(n + 1)  # never more than asked, whatever the server sends
            finally:
                body.close()
        if total != str(self.size) or len(data) != n:
            raise CorruptError(f"{self.key}: the object changed while being read, or its "
                               f"range {offset}+{n} came back as {len(data)} bytes")
        return data

    def close(self) -> None:
        pass


class S3StoreView:
    def __init__(self, endpoint: str | None, bucket: str, prefix: str) -> None:
        try:
            import boto3
        except ImportError:
            raise StoreError("an s3:// store needs boto3 (pip install boto3)") from None
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""

    @contextlib.contextmanager
    def _errors(self, what: str, missing: str | None = None) -> Iterator[None]:
        """botocore's errors as StoreError (or CorruptError for a missing/changed object)."""
        import botocore.exceptions as be

        try:
            yield
        except be.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if missing and code in ("404", "NoSuchKey", "412", "PreconditionFailed"):
                raise CorruptError(f"{what}: {missing}") from None
            raise StoreError(f"{what}: {code or e}") from None
        except (be.BotoCoreError, OSError) as e:
            raise StoreError(f"{what}: {e}") from None

    def listing(self, prefix: str) -> list[tuple[str, int]]:
        out = []
        with self._errors(f"s3://{self.bucket}/{self.prefix}{prefix}"):
            for page in self.s3.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=self.prefix + prefix):
                out += [(o["Key"][len(self.prefix):], int(o.get("Size", 0)))
                        for o in page.get("Contents", [])]
        return sorted(out)

    def keys(self, prefix: str) -> list[str]:
        return [k for k, _ in self.listing(prefix)]

    def _missing(self, e: Exception) -> bool:
        import botocore.exceptions as be

        return isinstance(e, be.ClientError) and \
            str(e.response.get("Error", {}).get("Code", "")) in ("404", "NoSuchKey")

    def open(self, key: str) -> _S3Object | None:
        key_parts(key)
        try:
            h = self.s3.head_object(Bucket=self.bucket, Key=self.prefix + key)
        except Exception as e:
            if self._missing(e):
                return None
            with self._errors(key):
                raise
        return _S3Object(self, key, int(h["ContentLength"]), h.get("ETag"))

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        try:
            r = self.s3.get_object(Bucket=self.bucket, Key=self.prefix + key)
        except Exception as e:
            if self._missing(e):
                return None
            with self._errors(key):
                raise
        body = r["Body"]
        try:
            size = int(r.get("ContentLength", 0))
            if max_bytes is not None and size > max_bytes:
                raise CorruptError(f"{key} is {size} bytes (at most {max_bytes})")
            with self._errors(key):
                data: bytes = body.read() if max_bytes is None else body.read(max_bytes + 1)
        finally:
            body.close()
        if max_bytes is not None and len(data) > max_bytes:
            raise CorruptError(f"{key} is more than {max_bytes} bytes")
        return data


class BytesObject:
    """An object already in memory (storeread.decode())."""

    def __init__(self, key: str, data: bytes) -> None:
        self.key, self.data, self.size = key, memoryview(data), len(data)

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.data[offset:offset + n])

    def close(self) -> None:
        pass


def open_view(url: str, endpoint_url: str | None = None) -> FileStoreView | S3StoreView:
    if url.startswith("file://"):
        root = Path(url[len("file://"):])
        if not (root / "objects").is_dir():
            raise StoreError(f"{url}: no store there (no objects/ directory)")
        return FileStoreView(root)
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise UsageError(f"{url!r}: no bucket")
        return S3StoreView(endpoint_url, bucket, prefix)
    raise UsageError(f"unsupported store URL {url!r} (file:///dir or s3://bucket/prefix)")

