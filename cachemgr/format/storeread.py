"""Reading and restoring published sets straight from a store, without a mount.

The one implementation behind `scripts/ckpt_restore.py` (restore with plain tools, ckptfs not
installed) and the mount-less verbs of `ckptfs` (`ckptfs ls`, `restore`, `fsck`:
ckptfs/storetools.py). Like cachemgr/format/{names,keys,validate}.py it needs only the standard
library, `lz4` and `crc32c` (and boto3 for the S3 view): no trio, nothing else of ckptfs, so the
script works from a copy of these five modules.

What it owns:

  * store *views*: `listing(prefix) -> [(key, size)]`, `get(key, max_bytes) -> bytes | None`
    (small documents), `open(key) -> reader | None` (a reader has `size`, `read(offset, n)`,
    `close()`). `FileStoreView` (a file:// store, never through a symlink) and `S3StoreView`
    (boto3) are the script's; ckptfs passes its own view over cachemgr.store (the same store
    the mount builds, retries included);
  * manifests: every one passes cachemgr.format.validate before use (`load_manifest`, `manifests`,
    `find_set`);
  * objects: streamed a few MiB at a time, every byte counted and checked against the
    manifest's CRC32C and chunk CRC32Cs, lz4 frames decompressed with bounded output
    (`stream_object`, `decode`);
  * the destination: every path resolved inside DEST with directory-fd-relative calls that never
    follow a symlink. Two ways to fill it:
      - `restore_to` (the script): sequential, atomic: the set is built under a temporary name
        and renamed into place; the target must not exist; nothing is left on error;
      - `restore_resumable` (`ckptfs restore`): parallel ranged reads, resumable, repairs a
        target it restored before (see its docstring).

Every check is an explicit exception (a `RestoreError`, one line), never `assert`: `python -O`
behaves the same.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import crc32c
import lz4.frame

from cachemgr.format import keys, names, validate
from cachemgr.format.names import unescape_path

# Exit codes of scripts/ckpt_restore.py (its docstring); `ckptfs` maps the classes to its own.
EXIT_OK = 0
EXIT_NO_SET = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_DEST = 4
EXIT_STORE = 5

READ_BYTES = 4 << 20  # the most read from the store, decompressed or written at a time

# A manifest (or one of its entries) that passed cachemgr.format.validate: JSON, fields in
# FORMAT.md.
Manifest = dict[str, Any]
ProgressFn = Callable[[dict[str, int]], None]


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


class RestoreError(Exception):
    """A restore that cannot go on; str() is one line, exit_code what main() exits with."""

    exit_code = EXIT_CORRUPT

    def __str__(self) -> str:
        return " ".join(super().__str__().splitlines())


class NoSuchSet(RestoreError):
    exit_code = EXIT_NO_SET


class UsageError(RestoreError):
    exit_code = EXIT_USAGE


class CorruptError(RestoreError):
    """Invalid or corrupt data in the store."""
    exit_code = EXIT_CORRUPT


class DestinationError(RestoreError):
    exit_code = EXIT_DEST


class StoreError(RestoreError):
    exit_code = EXIT_STORE


def _show(b: bytes | str) -> str:
    """A name for a one-line message."""
    return repr(os.fsdecode(b) if isinstance(b, bytes) else b)


def _key_parts(key: str) -> list[str]:
    parts = key.split("/") if isinstance(key, str) else [""]
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise CorruptError(f"{_show(key)} is not an object key")
    return parts


# -- store views -------------------------------------------------------------------------------
# keys(prefix), listing(prefix) -> [(key, size)], get(key, max_bytes) -> bytes | None for small
# documents, open(key) -> an object reader (size, read(offset, n), close()) or None if missing.

class _FileObject:
    def __init__(self, key: str, fd: int, size: int) -> None:
        self.key, self.fd, self.size = key, fd, size

    def read(self, offset: int, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            try:
                b = os.pread(self.fd, n - len(out), offset + len(out))
            except OSError as e:
                raise StoreError(f"{self.key}: {e}") from None
            if not b:
                raise CorruptError(f"{self.key}: the object ends at {offset + len(out)} bytes")
            out += b
        return bytes(out)

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
        parts = _key_parts(key)
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
        _key_parts(key)
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


class _BytesObject:
    """An object already in memory (decode())."""

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


# -- manifests ---------------------------------------------------------------------------------

def _legacy_key(raw: bytes, key: str) -> bool:
    """A version-1 manifest at `manifests/<its path as written>.json`: how ckptfs keyed a name
    before escaping existed (docs/FORMAT.md "Names": a literal `ckpt-%C3%A9.pt`)."""
    try:
        doc = validate.parse(raw, "manifest", validate.ManifestError)
    except validate.ManifestError:
        return False
    p = doc.get("path")
    return doc["version"] == 1 and isinstance(p, str) and key == f"manifests/{p}.json"


def load_manifest(view: StoreView, key: str, size: int | None = None) -> Manifest | None:
    """The validated, normalised manifest at `key`; None if there is none; CorruptError if it
    is invalid or bigger than validate.MAX_DOCUMENT_BYTES (`size`: from the listing, so that
    such a one is not even read)."""
    limit = validate.MAX_DOCUMENT_BYTES
    if size is not None and size > limit:
        raise CorruptError(f"{key}: a manifest of {size} bytes (at most {limit})")
    raw = view.get(key, max_bytes=limit)
    if raw is None:
        return None
    return parse_manifest(raw, key)


def parse_manifest(raw: bytes, key: str) -> Manifest:
    """The manifest whose bytes `raw` were read from `key`, validated and normalised (a
    version-1 manifest at the key of its literal name included); CorruptError otherwise."""
    try:
        return validate.manifest(raw, key)
    except validate.ManifestError as e:
        if "is not the set of its key" in str(e) and _legacy_key(raw, key):
            try:
                return validate.manifest(raw)
            except validate.ManifestError as e2:
                e = e2
        raise CorruptError(f"{key}: invalid manifest: {e}") from None


def manifests(view: StoreView, on_error: Callable[[str], None] | None = None
              ) -> dict[str, Manifest]:
    """{set path (escaped form): manifest} of every published set, each validated and
    normalised by cachemgr.format.validate. An invalid manifest is passed to `on_error` (one line)
    if given, and left out."""
    out = {}
    for key, size in view.listing(keys.MANIFEST_PREFIX):
        if not keys.is_manifest_key(key):
            continue
        try:
            m = load_manifest(view, key, size)
        except CorruptError as e:
            if on_error is not None:
                on_error(str(e))
            continue
        if m is not None:  # None: the set was deleted between the listing and the get
            out[m["path"]] = m
    return out


def find_set(view: StoreView, set_path: str) -> Manifest:
    """The manifest of SET_PATH as `list` prints it (the escaped form), or as the real path
    (bytes from argv), or at the key a version-1 manifest of that literal name has (see
    _legacy_key). NoSuchSet, UsageError, or CorruptError for an invalid manifest."""
    forms = [set_path] if names.is_canonical_path(set_path) else []
    forms.append(names.escape_path(os.fsencode(set_path)))
    tried = []
    for p in forms:
        try:
            validate.path(p, 2, "set path", validate.ManifestError)
        except validate.ManifestError:
            continue
        tried.append(keys.manifest_key(p))
        with contextlib.suppress(UnicodeDecodeError):  # the key a version-1 writer gave it
            tried.append(f"{keys.MANIFEST_PREFIX}{unescape_path(p).decode()}"
                         f"{keys.MANIFEST_SUFFIX}")
    if not tried:
        raise UsageError(f"{set_path!r} is not a set path")
    err = None
    for key in dict.fromkeys(tried):
        try:
            m = load_manifest(view, key)
        except CorruptError as e:
            err = err or e
            continue
        if m is not None:
            return m
    if err is not None:
        raise err
    raise NoSuchSet(f"no set {set_path!r} in the store")


def _checked(m: Any) -> Manifest:
    """A manifest given to restore()/restore_to() checked again (they are public: the caller's
    dict is not trusted either). A normalised manifest (from manifests(), load_manifest())
    passes unchanged: its names are in the escaped form whatever its version."""
    if not isinstance(m, dict):
        raise CorruptError("a manifest is a JSON object")
    v = m.get("version")
    try:
        data = json.dumps({**m, "version": 2} if type(v) is int and v in (1, 2) else m).encode()
    except (TypeError, ValueError, RecursionError) as e:
        raise CorruptError(f"not a manifest: {e}") from None
    try:
        return validate.manifest(data)
    except validate.ManifestError as e:
        raise CorruptError(f"invalid manifest: {e}") from None


# -- objects -----------------------------------------------------------------------------------

class _Checker:
    """Counts the raw bytes of one object and checks its CRC32C and chunk CRC32Cs as they
    arrive; CorruptError at the first byte too many or the first bad chunk."""

    def __init__(self, obj: Manifest) -> None:
        self.obj, self.key, self.size = obj, obj["key"], obj["size"]
        self.crcs = obj["chunk_crcs"]
        self.cs = obj["chunk_size"] if self.crcs is not None else 0
        self.n = self.crc = self.ccrc = self.ci = 0

    def feed(self, data: bytes) -> None:
        if self.n + len(data) > self.size:
            raise CorruptError(f"{self.key}: more than its {self.size} raw bytes")
        self.crc = crc32c.crc32c(data, value=self.crc)
        if not self.cs:
            self.n += len(data)
            return
        mv = memoryview(data)
        while mv:
            take = min(len(mv), self.cs - self.n % self.cs)
            self.ccrc = crc32c.crc32c(mv[:take], value=self.ccrc)
            self.n += take
            mv = mv[take:]
            if self.n % self.cs == 0 or self.n == self.size:
                if self.ccrc != self.crcs[self.ci]:
                    raise CorruptError(f"{self.key}: chunk {self.ci} CRC32C mismatch")
                self.ci += 1
                self.ccrc = 0

    def finish(self) -> None:
        if self.n != self.size:
            raise CorruptError(f"{self.key}: {self.n} raw bytes, the manifest says {self.size}")
        if self.crc != self.obj["crc32c"]:
            raise CorruptError(f"{self.key}: CRC32C mismatch")
        if self.cs and self.ci != len(self.crcs):
            raise CorruptError(f"{self.key}: {self.ci} chunks, {len(self.crcs)} chunk CRCs")


def _lz4_frame(src: Reader, off: int, n: int, raw_len: int, i: int,
               chk: _Checker | _UnitChecker, sink: Callable[[bytes], None]) -> None:
    """Frame `i` of an lz4 object: `n` stored bytes at `off`, exactly `raw_len` raw bytes,
    read and decompressed at most READ_BYTES at a time."""
    key = src.key
    d = lz4.frame.LZ4FrameDecompressor()
    got = 0
    pos, end = off, off + n

    def out(data: bytes) -> None:
        nonlocal got
        got += len(data)
        if got > raw_len:
            raise CorruptError(f"{key}: frame {i} decompresses to more than {raw_len} bytes")
        if data:
            chk.feed(data)
            sink(data)

    try:
        while pos < end:
            if d.eof:
                raise CorruptError(f"{key}: frame {i} ends before its {n} stored bytes")
            piece = src.read(pos, min(READ_BYTES, end - pos))
            pos += len(piece)
            out(d.decompress(piece, max_length=READ_BYTES))
            idle = 0
            while not d.eof and not d.needs_input:  # output pending: take it a piece at a time
                data = d.decompress(b"", max_length=READ_BYTES)
                idle = idle + 1 if not data else 0
                if idle > 16:
                    raise CorruptError(f"{key}: frame {i} makes no progress")
                out(data)
            if d.eof and (d.unused_data or pos < end):
                raise CorruptError(f"{key}: frame {i} ends before its {n} stored bytes")
    except RestoreError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever lz4 makes of hostile bytes
        msg = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
        raise CorruptError(f"{key}: frame {i} is not an lz4 frame ({msg})") from None
    if not d.eof:
        raise CorruptError(f"{key}: frame {i} is incomplete")
    if got != raw_len:
        raise CorruptError(f"{key}: frame {i} decompresses to {got} bytes, not {raw_len}")


def _stream(src: Reader, obj: Manifest, sink: Callable[[bytes], None]) -> None:
    """Every raw byte of object `obj` (a validated description) from reader `src` to `sink`, a
    few MiB at a time, checked; CorruptError at the first problem."""
    key, stored = obj["key"], obj["stored_size"]
    if src.size != stored:
        raise CorruptError(f"{key}: {src.size} bytes in the store, the manifest says {stored}")
    chk = _Checker(obj)
    if obj["compression"] == "none":
        off = 0
        while off < stored:
            data = src.read(off, min(READ_BYTES, stored - off))
            off += len(data)
            chk.feed(data)
            sink(data)
    else:
        off, fs = 0, obj["frame_size"]
        for i, n in enumerate(obj["frames"]):
            _lz4_frame(src, off, n, min(fs, obj["size"] - i * fs), i, chk, sink)
            off += n
    chk.finish()


def _open(view: StoreView, obj: Manifest) -> Reader:
    src = view.open(obj["key"])
    if src is None:
        raise CorruptError(f"{obj['key']}: object missing from the store")
    return src


def decode(obj: Manifest, stored: bytes) -> bytes:
    """The raw content of object description `obj` (checked on its own, any key) whose stored
    bytes are `stored`: every size and CRC32C checked; CorruptError otherwise. Small objects
    only (tests): the CLI streams."""
    if not isinstance(obj, dict):
        raise CorruptError("an object description is a JSON object")
    key = str(obj.get("key"))
    try:  # the geometry and types, whatever the key (validate wants one under data/<node>/)
        o = validate.stored_object({**obj, "key": "data/x/o"}, frozenset({"x"}),
                                   what=f"object {key!r}", error=validate.DocumentError)
    except validate.DocumentError as e:
        raise CorruptError(str(e).replace("'data/x/o'", repr(key))) from None
    o["key"] = key
    out = bytearray()
    _stream(_BytesObject(o["key"], stored), o, out.extend)
    return bytes(out)


def restore(view: StoreView, m: Manifest) -> dict[str, bytes]:
    """{file path inside the set (escaped form): bytes}, every object checked end to end.
    Holds the whole set in memory: for tests and small sets; restore_to() streams."""
    m = _checked(m)
    out = {}
    for f in m["files"]:
        src = _open(view, f["object"])
        try:
            buf = bytearray()
            _stream(src, f["object"], buf.extend)
        finally:
            src.close()
        out[f["path"]] = bytes(buf)
    return out


def verify_object(view: StoreView, obj: Manifest) -> None:
    """Read object `obj` (a validated description) back from the store and check every byte
    as a restore would (stored size, lz4 frames, CRC32C, chunk CRC32Cs), a few MiB at a time,
    keeping nothing: CorruptError at the first problem (`ckptfs fsck --verify`)."""
    src = _open(view, obj)
    try:
        _stream(src, obj, lambda _data: None)
    finally:
        src.close()


# -- the destination ---------------------------------------------------------------------------

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _name(c: bytes) -> bytes:
    if c in (b"", b".", b"..") or b"/" in c or b"\0" in c:
        raise CorruptError(f"{_show(c)} is not a name")  # the validator refuses these first
    return c


def _opendir(fd: int, name: bytes, shown: str, create: bool = False) -> int:
    """The directory `name` in directory `fd`, never through a symlink; created if missing
    and `create`."""
    for _ in range(3):
        try:
            return os.open(_name(name), _DIR, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise DestinationError(f"{shown} vanished") from None
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise DestinationError(f"cannot create {shown}: {e.strerror}") from None
        except (NotADirectoryError, OSError) as e:
            if isinstance(e, NotADirectoryError) or e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise DestinationError(f"{shown} is not a directory (a symlink or a file is "
                                       "in the way)") from None
            raise DestinationError(f"{shown}: {e.strerror}") from None
    raise DestinationError(f"{shown} keeps changing")


class _Tree:
    """Directories under one directory fd, opened component by component with O_NOFOLLOW; the
    last one opened is kept (entries come sorted, so siblings share it)."""

    def __init__(self, root_fd: int, shown: bytes) -> None:
        self.root_fd, self.shown = root_fd, shown
        self.cur: tuple[tuple[bytes, ...], int] | None = None

    def dir(self, comps: tuple[bytes, ...]) -> int:
        if not comps:
            return self.root_fd
        if self.cur and self.cur[0] == comps:
            return self.cur[1]
        self.close()
        fd = self.root_fd
        try:
            for i, c in enumerate(comps):
                nfd = _opendir(fd, c, _show(b"/".join((self.shown,) + comps[:i + 1])))
                if fd != self.root_fd:
                    os.close(fd)
                fd = nfd
        except BaseException:
            if fd != self.root_fd:
                os.close(fd)
            raise
        self.cur = (comps, fd)
        return fd

    def close(self) -> None:
        if self.cur:
            os.close(self.cur[1])
            self.cur = None


def _comps(path: str) -> tuple[bytes, ...]:
    """The names (bytes) of a validated escaped-form path, each checked again."""
    return tuple(_name(c) for c in unescape_path(path).split(b"/"))


def _split(path: str) -> tuple[tuple[bytes, ...], bytes]:
    comps = _comps(path)
    return comps[:-1], comps[-1]


def _write_file(view: StoreView, obj: Manifest, dir_fd: int, name: bytes, mode: int,
                shown: str) -> None:
    """A new file `name` in `dir_fd` (O_EXCL|O_NOFOLLOW: never an existing one, never through a
    symlink) holding the checked content of `obj`, then `mode`. On error it is removed."""
    src = _open(view, obj)
    try:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as e:
            raise DestinationError(f"cannot create {shown}: {e.strerror}") from None
        try:
            def sink(data: bytes) -> None:
                mv = memoryview(data)
                while mv:
                    try:
                        mv = mv[os.write(fd, mv):]
                    except OSError as e:
                        raise DestinationError(f"writing {shown}: {e.strerror}") from None

            _stream(src, obj, sink)
            try:
                os.fchmod(fd, mode)
            except OSError as e:
                raise DestinationError(f"chmod {shown}: {e.strerror}") from None
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
        os.close(fd)
    finally:
        src.close()


def _build_dir(view: StoreView, m: Manifest, fd: int, shown: bytes) -> None:
    """The entries of dir set `m` inside the new empty directory `fd`: directories, files,
    then symlinks, then the directories' modes (deepest first, so that a mode without write or
    search permission does not get in the way)."""
    modes: dict[tuple[bytes, ...], int] = {}
    for d in m["dirs"]:
        modes[_comps(d["path"])] = d["mode"]
    for e in m["files"] + m["symlinks"] + m["dirs"]:  # directories only implied by entries
        comps = _comps(e["path"])
        for i in range(1, len(comps)):
            modes.setdefault(comps[:i], 0o755)
    tree = _Tree(fd, shown)
    try:
        for comps in sorted(modes, key=lambda c: (len(c), c)):
            pfd = tree.dir(comps[:-1])
            try:
                os.mkdir(comps[-1], 0o700, dir_fd=pfd)
            except OSError as e:
                raise DestinationError(f"cannot create {_show(b'/'.join((shown,) + comps))}: "
                                       f"{e.strerror}") from None
        for f in sorted(m["files"], key=lambda f: unescape_path(f["path"])):
            parent, name = _split(f["path"])
            _write_file(view, f["object"], tree.dir(parent), name, f["mode"],
                        _show(shown + b"/" + unescape_path(f["path"])))
        for s in m["symlinks"]:
            parent, name = _split(s["path"])
            try:
                os.symlink(unescape_path(s["target"]), name, dir_fd=tree.dir(parent))
            except OSError as e:
                raise DestinationError(f"cannot create symlink "
                                       f"{_show(shown + b'/' + unescape_path(s['path']))}: "
                                       f"{e.strerror}") from None
        for comps in sorted(modes, key=lambda c: (-len(c), c)):
            parent, name = comps[:-1], comps[-1]
            dfd = _opendir(tree.dir(parent), name, _show(b"/".join((shown,) + comps)))
            try:
                os.fchmod(dfd, modes[comps])
            except OSError as e:
                raise DestinationError(f"chmod: {e.strerror}") from None
            finally:
                os.close(dfd)
    finally:
        tree.close()


def _target_free(parent_fd: int, name: bytes, kind: str, shown: str) -> None:
    """The set's target must not exist; a dir set may take the place of an empty directory."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as e:
        raise DestinationError(f"{shown}: {e.strerror}") from None
    if kind == "dir" and stat.S_ISDIR(st.st_mode):
        fd = _opendir(parent_fd, name, shown)
        try:
            empty = not os.listdir(fd)
        finally:
            os.close(fd)
        if empty:
            return
    raise DestinationError(f"{shown} exists (a restore never replaces anything: remove it "
                           "or restore elsewhere)")


def restore_to(view: StoreView, m: Manifest, dest: Path) -> Path:
    """Materialise set `m` at DEST/<set path> (as a user restoring without ckptfs would), with
    the exact byte names of the manifest; returns that path. Every path is resolved inside
    DEST without following a symlink; the set is built under a temporary name beside its
    target and renamed into place only when every object checked out (nothing is left behind
    on error). RestoreError (one line) if anything is wrong."""
    m = _checked(m)
    dest_b = os.fsencode(dest)
    parents, name = _split(m["path"])
    target = os.path.join(dest_b, *parents, name)
    shown = _show(target)
    try:
        os.makedirs(dest_b, exist_ok=True)
        dfd = os.open(dest_b, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise DestinationError(f"{_show(dest_b)}: {e.strerror}") from None
    fds = [dfd]
    try:
        for i, c in enumerate(parents):
            fds.append(_opendir(fds[-1], c, _show(os.path.join(dest_b, *parents[:i + 1])),
                                create=True))
        pfd = fds[-1]
        _target_free(pfd, name, m["kind"], shown)
        if m["kind"] == "symlink":
            try:
                os.symlink(unescape_path(m["target"]), name, dir_fd=pfd)
            except OSError as e:
                raise DestinationError(f"cannot create symlink {shown}: {e.strerror}") from None
            return Path(os.fsdecode(target))
        tmp = b".ckpt_restore-" + secrets.token_hex(8).encode() + b".tmp"
        if m["kind"] == "file":
            f = m["files"][0]
            _write_file(view, f["object"], pfd, tmp, f["mode"], shown)
        else:
            try:
                os.mkdir(tmp, 0o700, dir_fd=pfd)
            except OSError as e:
                raise DestinationError(f"cannot create a directory in "
                                       f"{_show(os.path.dirname(target))}: {e.strerror}") from None
            try:
                tfd = _opendir(pfd, tmp, shown)
                try:
                    _build_dir(view, m, tfd, target)
                    os.fchmod(tfd, m["mode"])
                finally:
                    os.close(tfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    _rmtree(pfd, tmp)
                raise
        try:
            _target_free(pfd, name, m["kind"], shown)  # again: nothing appeared meanwhile
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except BaseException as e:
            with contextlib.suppress(OSError):
                _rmtree(pfd, tmp)
            if isinstance(e, OSError):
                raise DestinationError(f"cannot rename into {shown}: {e.strerror}") from None
            raise
        return Path(os.fsdecode(target))
    finally:
        for fd in fds:
            os.close(fd)


def _rmtree(dir_fd: int, name: bytes) -> None:
    """Remove `name` in `dir_fd` (a file or a tree we made); never follows a symlink."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, _DIR, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o700)  # its modes may already be applied
        with os.scandir(fd) as it:
            entries = [e.name for e in it]
    finally:
        os.close(fd)
    if entries:
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.rmdir(name, dir_fd=dir_fd)




# -- resumable, parallel restore (`ckptfs restore`) --------------------------------------------
#
# Layout in DEST (all of it inside DEST, nothing else is ever written):
#
#   DEST/.ckptfs-restore/<h>.lock      flock: one restore of a set into DEST at a time
#   DEST/.ckptfs-restore/<h>.json      what this restore verified (below); kept after success
#   DEST/.ckptfs-restore/<h>.partial/  a directory set being built (when its target is new)
#   DEST/.ckptfs-restore/<h>.tmp/      files being fetched (flat, one per file, by hash)
#
# with h = sha256 of the set path (escaped form), 32 hex digits. A file is fetched into its work
# file, read back and checked whole (size, CRC32C, chunk CRC32Cs), fsync'd, and only then
# renamed to its place: a file at its final name is always complete and verified. A directory
# set whose target does not exist (or is an empty directory) is built in `<h>.partial` and
# renamed into place once every file, symlink and mode is in: until then the target does not
# exist. An existing target (a set restored before, maybe interrupted in a repair, or one
# restored by other means) is repaired in place, file by file.
#
# The state file lists, per file, the (size, mtime_ns, ctime_ns, ino) of the file restore put
# or verified at its place and the CRC32C of the content it verified there: a file whose stat
# still matches is taken as verified without reading it (ctime cannot be set back by a user),
# and it is "ours": a newer manifest of the set may replace it. Any other existing file at a
# path of the set is read and checked: if it holds the set's content it is kept, else it is an
# unrelated file and restore refuses to replace it unless asked (overwrite=True). A rerun after
# an interruption re-reads the work files it left and fetches only the chunks that are missing
# or wrong. Deleting `.ckptfs-restore` is always safe: a rerun then reads the files back to
# check them instead of trusting their stat.

STATE_DIR = b".ckptfs-restore"
STATE_FORMAT = "ckptfs-restore-state"
MAX_STATE_BYTES = 1 << 30  # a state file listing 1,000,000 files is ~100 MB
DEFAULT_WORKERS = 8        # ranged GETs in flight; memory is about 2 x READ_BYTES each
_END = object()


class _Stopped(RestoreError):
    """Another worker failed or the restore was interrupted: stop at the next piece."""


class _Geometry:
    """The units of one object: the pieces that are fetched, checked and resumed on their own.
    Its chunks when it has chunk CRCs (an lz4 chunk is its frame), else its lz4 frames (checked
    by length), else READ_BYTES pieces (checked by length); the whole CRC32C covers them all."""

    def __init__(self, obj: Manifest) -> None:
        self.obj = obj
        size = obj["size"]
        self.offsets: list[int] | None = None
        if obj["compression"] == "lz4":
            self.step = obj["frame_size"]
            self.count = len(obj["frames"])
            self.offsets = [0]
            for n in obj["frames"]:
                self.offsets.append(self.offsets[-1] + n)
        else:
            self.step = obj["chunk_size"] if obj["chunk_crcs"] is not None else READ_BYTES
            self.count = -(-size // self.step)

    def unit(self, i: int) -> tuple[int, int, int, int, int | None]:
        """(raw offset, raw length, stored offset, stored length, CRC32C or None) of unit i."""
        raw = i * self.step
        n = min(self.step, self.obj["size"] - raw)
        crcs = self.obj["chunk_crcs"]
        crc = crcs[i] if crcs is not None else None
        if self.offsets is not None:
            return raw, n, self.offsets[i], self.offsets[i + 1] - self.offsets[i], crc
        return raw, n, raw, n, crc


class _UnitChecker:
    def __init__(self, key: str, i: int, n: int, crc: int | None) -> None:
        self.key, self.i, self.n, self.want = key, i, n, crc
        self.got = self.crc = 0

    def feed(self, data: bytes) -> None:
        if self.got + len(data) > self.n:
            raise CorruptError(f"{self.key}: piece {self.i} holds more than its {self.n} bytes")
        self.crc = crc32c.crc32c(data, value=self.crc)
        self.got += len(data)

    def finish(self) -> None:
        if self.got != self.n:
            raise CorruptError(f"{self.key}: piece {self.i} holds {self.got} bytes, not "
                               f"{self.n}")
        if self.want is not None and self.crc != self.want:
            raise CorruptError(f"{self.key}: chunk {self.i} CRC32C mismatch")


def _scan(fd: int, geo: _Geometry, stop: threading.Event) -> tuple[list[int], bool]:
    """Check the local file `fd` against its object: (the units whose bytes are not known to
    be right, whether the whole file is right: its size, CRC32C and every chunk CRC32C). Reads
    READ_BYTES at a time. Without chunk CRCs only the whole file can be judged."""
    obj = geo.obj
    try:
        have = os.fstat(fd).st_size
        whole = 0
        bad: list[int] = []
        for i in range(geo.count):
            if stop.is_set():
                raise _Stopped("stopped")
            raw, n, _, _, want = geo.unit(i)
            c, pos, end = 0, raw, raw + n
            while pos < end:
                data = os.pread(fd, min(READ_BYTES, end - pos), pos)
                if not data:
                    break
                c = crc32c.crc32c(data, value=c)
                whole = crc32c.crc32c(data, value=whole)
                pos += len(data)
            if pos < end:  # the file ends here: this unit and every later one are missing
                bad.extend(range(i, geo.count))
                break
            if want is None or c != want:
                bad.append(i)
    except OSError as e:
        raise DestinationError(f"reading back a restored file: {e.strerror}") from None
    if have == obj["size"] and whole == obj["crc32c"] and \
            (obj["chunk_crcs"] is None or not bad):
        return [], True
    return (list(range(geo.count)) if obj["chunk_crcs"] is None else bad), False


def _fetch_unit(src: Reader, geo: _Geometry, i: int, fd: int, stop: threading.Event) -> int:
    """Fetch unit i of `geo`'s object from reader `src` into file `fd` at its raw offset,
    checked as it arrives; returns its raw length."""
    raw, n, s_off, s_len, want = geo.unit(i)
    key = geo.obj["key"]
    chk = _UnitChecker(key, i, n, want)
    pos = raw

    def sink(data: bytes) -> None:
        nonlocal pos
        mv = memoryview(data)
        try:
            while mv:
                w = os.pwrite(fd, mv, pos)
                mv, pos = mv[w:], pos + w
        except OSError as e:
            raise DestinationError(f"writing a restored file: {e.strerror}") from None

    if geo.offsets is not None:
        _lz4_frame(src, s_off, s_len, n, i, chk, sink)
    else:
        off, end = s_off, s_off + s_len
        while off < end:
            if stop.is_set():
                raise _Stopped("stopped")
            data = src.read(off, min(READ_BYTES, end - off))
            off += len(data)
            chk.feed(data)
            sink(data)
    chk.finish()
    return n


def run_parallel(items: Iterable[Any], fn: Callable[[Any], None], workers: int,
                 stop: threading.Event, tick: Callable[[], None]) -> None:
    """fn(item) for every item, in `workers` threads taking the next item of one shared
    iterator (no queue of futures: memory does not grow with the number of items). The first
    error stops the others at their next piece and is raised once all have stopped; an
    interrupt in the calling thread (KeyboardInterrupt) likewise. `tick()` runs in the calling
    thread about five times a second."""
    it = iter(items)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                with lock:
                    x = next(it, _END)
                if x is _END:
                    return
                fn(x)
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=run, name=f"ckptfs-restore-{i}", daemon=True)
               for i in range(max(1, workers))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
                tick()
    except BaseException:
        stop.set()
        for t in threads:
            t.join()
        raise
    real = [e for e in errors if not isinstance(e, _Stopped)]
    if real:
        raise real[0]
    if errors:
        raise errors[0]


def _sig(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class _State:
    """DEST/.ckptfs-restore/<h>.json: what this restore verified at each place (see above).
    Written tmp + fsync + rename, at most once a second (less often if writing it is slow)
    while files complete, and at the end.
    A state file that does not parse, or belongs to another set, is ignored (everything is
    then read back and checked instead)."""

    def __init__(self, dir_fd: int, name: bytes, m: Manifest) -> None:
        self.dir_fd, self.name, self.path = dir_fd, name, m["path"]
        self.manifest = hashlib.sha256(json.dumps(m, sort_keys=True).encode(
            "utf-8", "surrogatepass")).hexdigest()
        self.lock = threading.Lock()
        self.last = 0.0
        self.interval = 1.0  # seconds between two writes while files complete
        self.files: dict[str, list[int]] = {}
        self.links: dict[str, list[int]] = {}
        self.keep = {f["path"] for f in m["files"]}, {s["path"] for s in m["symlinks"]} | (
            {""} if m["kind"] == "symlink" else set())
        self._load()

    def _load(self) -> None:
        try:
            fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.dir_fd)
        except OSError:
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            raw = os.read(fd, MAX_STATE_BYTES + 1)
        except OSError:
            return
        finally:
            os.close(fd)
        try:
            d = json.loads(raw) if len(raw) <= MAX_STATE_BYTES else None
        except (ValueError, RecursionError):
            return
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT or \
                d.get("version") != 1 or d.get("set") != self.path:
            return

        def records(v: Any, n: int) -> dict[str, list[int]]:
            if not isinstance(v, dict):
                return {}
            return {k: r for k, r in v.items() if isinstance(k, str) and isinstance(r, list)
                    and len(r) == n and all(type(x) is int for x in r)}

        self.files = records(d.get("files"), 5)
        self.links = records(d.get("links"), 2)

    def file_ok(self, rel: str, st: os.stat_result, obj: Manifest) -> bool | None:
        """True: the file at `rel` is the one this restore verified with `obj`'s content;
        False: it is the one it verified, with other content (ours to replace); None: not
        known (another file, or none recorded)."""
        with self.lock:
            r = self.files.get(rel)
        if r is None or r[:4] != _sig(st):
            return None
        return bool(r[0] == obj["size"] and r[4] == obj["crc32c"])

    def link_ours(self, rel: str, st: os.stat_result) -> bool:
        with self.lock:
            return self.links.get(rel) == [st.st_ino, st.st_ctime_ns]

    def record_file(self, rel: str, st: os.stat_result, crc: int) -> None:
        with self.lock:
            self.files[rel] = _sig(st) + [crc]
        self.flush()

    def record_link(self, rel: str, st: os.stat_result) -> None:
        with self.lock:
            self.links[rel] = [st.st_ino, st.st_ctime_ns]

    def flush(self, done: bool = False, force: bool = False) -> None:
        with self.lock:
            now = time.monotonic()
            if not (force or done) and now - self.last < self.interval:
                return
            self.last = now
            doc = {"format": STATE_FORMAT, "version": 1, "set": self.path,
                   "manifest": self.manifest, "done": done,
                   "files": {k: v for k, v in self.files.items() if k in self.keep[0]},
                   "links": {k: v for k, v in self.links.items() if k in self.keep[1]}}
            data = json.dumps(doc, separators=(",", ":")).encode("utf-8", "surrogatepass")
            tmp = self.name + b".tmp"
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=self.dir_fd)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
                try:
                    mv = memoryview(data)
                    while mv:
                        mv = mv[os.write(fd, mv):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                # Workers wait for this lock: writing a big state (a set of 100,000s of files)
                # must take a small share of the time (at most 1/20th).
                self.interval = max(1.0, 20 * (time.monotonic() - now))
            except OSError as e:
                raise DestinationError(f"cannot write the restore state in "
                                       f"{STATE_DIR.decode()}: {e.strerror}") from None


class _Job:
    """One file of the set: where it goes and what is left to fetch."""

    __slots__ = ("comps", "entry", "geo", "name", "remaining", "replace", "shown", "src",
                 "todo", "work")

    def __init__(self, entry: Manifest, comps: tuple[bytes, ...], name: bytes,
                 shown: str) -> None:
        self.entry, self.comps, self.name, self.shown = entry, comps, name, shown
        self.geo = _Geometry(entry["object"])
        self.work = hashlib.sha256(entry["path"].encode("utf-8", "surrogatepass")) \
            .hexdigest()[:32].encode()
        self.replace = False
        self.todo: list[int] | range | None = range(0)  # None: verified at its place
        self.remaining = 0
        self.src: Reader | None = None


def _walk(root_fd: int, comps: tuple[bytes, ...], shown: str) -> int:
    """A new descriptor of directory root/<comps>, opened one component at a time without
    following a symlink (thread-safe: no shared cursor, unlike _Tree)."""
    fd = os.dup(root_fd)
    try:
        for c in comps:
            nfd = _opendir(fd, c, shown)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lstat(dir_fd: int, name: bytes, shown: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DestinationError(f"{shown}: {e.strerror}") from None


def _ensure_writable(fd: int) -> None:
    """u+rwx on a directory of the set while it is filled (its mode comes at the end)."""
    st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)


def _open_regular(dir_fd: int, name: bytes, shown: str) -> int:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as e:
        raise DestinationError(f"{shown}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DestinationError(f"{shown} changed while it was checked")
    return fd


def _open_work(wfd: int, name: bytes) -> tuple[int, bool]:
    """The work file `name` (read-write) and whether it is new. Anything else at that name in
    the restore's own work directory is removed first."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):
        try:
            return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=wfd), True
        except FileExistsError:
            pass
        try:
            fd = os.open(name, flags, dir_fd=wfd)
        except FileNotFoundError:
            continue
        except OSError:
            _rmtree(wfd, name)  # a symlink, a directory: not what we left there
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd, False
        os.close(fd)
        _rmtree(wfd, name)
    raise DestinationError("the restore's work directory keeps changing")


def _set_dirs(m: Manifest) -> dict[tuple[bytes, ...], int]:
    """{directory of a dir set (names): its mode}: the manifest's directories and those only
    implied by its entries (0o755), as restore_to makes them."""
    modes: dict[tuple[bytes, ...], int] = {}
    for d in m["dirs"]:
        modes[_comps(d["path"])] = d["mode"]
    for e in m["files"] + m["symlinks"] + m["dirs"]:
        comps = _comps(e["path"])
        for i in range(1, len(comps)):
            modes.setdefault(comps[:i], 0o755)
    return modes


def _prune(fd: int, prefix: tuple[bytes, ...], dirs: dict[tuple[bytes, ...], int],
           m: Manifest) -> None:
    """In the restore's own staging directory: remove every entry the set does not have there
    (left by an earlier run of an older manifest of the set), never following a symlink."""
    files = {_comps(f["path"]) for f in m["files"]}
    links = {_comps(s["path"]) for s in m["symlinks"]}

    def walk(dfd: int, prefix: tuple[bytes, ...]) -> None:
        _ensure_writable(dfd)
        for n in os.listdir(dfd):
            nb = os.fsencode(n)
            c = prefix + (nb,)
            st = os.stat(nb, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) and c in dirs:
                sub = _opendir(dfd, nb, "the restore's staging directory")
                try:
                    walk(sub, c)
                finally:
                    os.close(sub)
            elif not ((stat.S_ISREG(st.st_mode) and c in files) or
                      (stat.S_ISLNK(st.st_mode) and c in links)):
                _rmtree(dfd, nb)

    walk(fd, prefix)


def _make_dirs(root_fd: int, modes: dict[tuple[bytes, ...], int], target: bytes, staged: bool,
               overwrite: bool) -> None:
    """Every directory of the set under `root_fd`, made or opened without following a symlink,
    u+rwx while the set is filled in. A file or symlink in the way is replaced only in the
    restore's own staging directory or with `overwrite`."""
    tree = _Tree(root_fd, target)
    try:
        for comps in sorted(modes, key=lambda c: (len(c), c)):
            pfd = tree.dir(comps[:-1])
            shown = _show(b"/".join((target,) + comps))
            st = _lstat(pfd, comps[-1], shown)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                if not (staged or overwrite):
                    raise DestinationError(f"{shown} is in the way of a directory of the set: "
                                           "--overwrite replaces it")
                os.unlink(comps[-1], dir_fd=pfd)
                st = None
            if st is None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(comps[-1], 0o700, dir_fd=pfd)
            dfd = _opendir(pfd, comps[-1], shown)
            try:
                _ensure_writable(dfd)
            finally:
                os.close(dfd)
    finally:
        tree.close()


def _classify(job: _Job, view: StoreView, state: _State, root_fd: int, wfd: int, staged: bool,
              overwrite: bool, stop: threading.Event,
              count: Callable[..., None]) -> None:
    """What file `job` needs: nothing (its place already holds the set's content: job.todo is
    None), or its work file filled in (job.todo: the units still to fetch, job.src: its
    reader). Refuses (DestinationError) to replace what restore did not put there."""
    obj, mode, rel = job.entry["object"], job.entry["mode"], job.entry["path"]
    pfd = _walk(root_fd, job.comps, job.shown)
    try:
        st = _lstat(pfd, job.name, job.shown)
        if st is not None and stat.S_ISREG(st.st_mode):
            known = state.file_ok(rel, st, obj)
            ok = bool(known)
            if known is None or stat.S_IMODE(st.st_mode) != mode:
                fd = _open_regular(pfd, job.name, job.shown)
                try:
                    if known is None:
                        _, ok = _scan(fd, job.geo, stop)
                    if ok and stat.S_IMODE(st.st_mode) != mode:
                        os.fchmod(fd, mode)
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
            if ok:
                state.record_file(rel, st, obj["crc32c"])
                job.todo = None
                count(done=obj["size"], files=1)
                return
            job.replace = staged or known is False or overwrite
            if not job.replace:
                raise DestinationError(f"{job.shown} exists with other content than the set's, "
                                       "and this restore did not put it there: --overwrite "
                                       "replaces it")
        elif st is not None and stat.S_ISDIR(st.st_mode):
            if not staged:
                raise DestinationError(f"{job.shown} is a directory where the set has a file: "
                                       "remove it or restore elsewhere")
            _rmtree(pfd, job.name)
        elif st is not None:
            if not (staged or overwrite):
                raise DestinationError(f"{job.shown} exists and is not a regular file: "
                                       "--overwrite replaces it")
            job.replace = True
    finally:
        os.close(pfd)
    fd, fresh = _open_work(wfd, job.work)
    try:
        if fresh:
            todo: list[int] | range = range(job.geo.count)
        else:
            todo, ok = _scan(fd, job.geo, stop)
        os.ftruncate(fd, obj["size"])
    finally:
        os.close(fd)
    job.todo, job.remaining = todo, len(todo)
    count(done=obj["size"] - sum(job.geo.unit(i)[1] for i in todo))
    if todo:
        src = view.open(obj["key"])
        if src is None:
            raise CorruptError(f"{obj['key']}: object missing from the store")
        if src.size != obj["stored_size"]:
            src.close()
            raise CorruptError(f"{obj['key']}: {src.size} bytes in the store, the manifest "
                               f"says {obj['stored_size']}")
        job.src = src


def _place(wfd: int, work: bytes, pfd: int, name: bytes, replace: bool, shown: str) -> None:
    """Move a verified work file to its place: over what is there if `replace`, else only if
    nothing is (a link, then the work name goes; rename after a check where links fail)."""
    try:
        if replace:
            os.rename(work, name, src_dir_fd=wfd, dst_dir_fd=pfd)
            return
        try:
            os.link(work, name, src_dir_fd=wfd, dst_dir_fd=pfd, follow_symlinks=False)
        except FileExistsError:
            raise DestinationError(f"{shown} appeared while it was restored: rerun") from None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if _lstat(pfd, name, shown) is not None:
                raise DestinationError(f"{shown} appeared while it was restored: "
                                       "rerun") from None
            os.rename(work, name, src_dir_fd=wfd, dst_dir_fd=pfd)
            return
        os.unlink(work, dir_fd=wfd)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise DestinationError(f"{shown}: DEST/{STATE_DIR.decode()} is on another "
                                   "filesystem than the target (a mount point inside DEST?): "
                                   "restore elsewhere") from None
        raise DestinationError(f"cannot put {shown} in place: {e.strerror}") from None


def _finish(job: _Job, state: _State, root_fd: int, wfd: int, stop: threading.Event) -> None:
    """Read the work file back and check it whole, give it its mode, fsync it and move it to
    its place; record it."""
    obj = job.entry["object"]
    try:
        fd = os.open(job.work, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=wfd)
    except OSError as e:
        raise DestinationError(f"{job.shown}: its work file: {e.strerror}") from None
    try:
        _, ok = _scan(fd, job.geo, stop)
        if not ok:
            raise CorruptError(f"{obj['key']}: the fetched content fails its CRC32C (the "
                               "object in the store is damaged)")
        os.fchmod(fd, job.entry["mode"])
        os.fsync(fd)
    finally:
        os.close(fd)
    pfd = _walk(root_fd, job.comps, job.shown)
    try:
        _place(wfd, job.work, pfd, job.name, job.replace, job.shown)
        st = os.stat(job.name, dir_fd=pfd, follow_symlinks=False)
    finally:
        os.close(pfd)
    state.record_file(job.entry["path"], st, obj["crc32c"])


def _put_symlink(state: _State, pfd: int, name: bytes, rel: str, target: bytes, shown: str,
                 wfd: int, *, staged: bool, overwrite: bool) -> None:
    """The symlink `name` -> `target` in `pfd` (never followed): kept if it is there, replaced
    if restore put it there (or `overwrite`, or in its own staging directory)."""
    st = _lstat(pfd, name, shown)
    replace = False
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            with contextlib.suppress(OSError):
                if os.readlink(name, dir_fd=pfd) == target:
                    state.record_link(rel, st)
                    return
        if stat.S_ISDIR(st.st_mode):
            if not staged:
                raise DestinationError(f"{shown} is a directory where the set has a symlink: "
                                       "remove it or restore elsewhere")
            _rmtree(pfd, name)
        elif staged or overwrite or (stat.S_ISLNK(st.st_mode) and state.link_ours(rel, st)):
            replace = True
        else:
            raise DestinationError(f"{shown} exists and is not the set's symlink: --overwrite "
                                   "replaces it")
    try:
        if replace:
            tmp = b"link-" + secrets.token_hex(8).encode()
            os.symlink(target, tmp, dir_fd=wfd)
            os.rename(tmp, name, src_dir_fd=wfd, dst_dir_fd=pfd)
        else:
            os.symlink(target, name, dir_fd=pfd)
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileExistsError:
        raise DestinationError(f"{shown} appeared while it was restored: rerun") from None
    except OSError as e:
        raise DestinationError(f"cannot create symlink {shown}: {e.strerror}") from None
    state.record_link(rel, st)


class _Progress:
    """The numbers `progress` gets: counted by the workers under a lock, handed out as copies."""

    def __init__(self, m: Manifest, progress: ProgressFn | None) -> None:
        self.snap = {"bytes_total": m["total_bytes"], "bytes_done": 0, "bytes_fetched": 0,
                     "files_total": len(m["files"]), "files_done": 0}
        self._lock = threading.Lock()
        self._progress = progress

    def count(self, done: int = 0, fetched: int = 0, files: int = 0) -> None:
        with self._lock:
            self.snap["bytes_done"] += done
            self.snap["bytes_fetched"] += fetched
            self.snap["files_done"] += files

    def tick(self) -> None:
        if self._progress is not None:
            with self._lock:
                s = dict(self.snap)
            self._progress(s)


class _Resumable:
    """One run of `restore_resumable`, in its steps: open DEST and the state (`open`), lay out
    the target and plan its files (`plan`), check what is there and fetch the rest (`fetch`),
    then symlinks, modes and the rename into place (`finish_dir`); `close` releases every
    descriptor, reader and the lock whatever happened."""

    def __init__(self, view: StoreView, m: Manifest, dest: Path, overwrite: bool,
                 workers: int, progress: ProgressFn | None) -> None:
        self.t0 = time.monotonic()
        self.view, self.m, self.overwrite, self.workers = view, m, overwrite, workers
        self.dest_b = os.fsencode(dest)
        self.parents, self.name = _split(m["path"])
        if (self.parents + (self.name,))[0] == STATE_DIR:
            raise DestinationError(f"{m['path']!r}: restore keeps its state in "
                                   f"DEST/{STATE_DIR.decode()}; restore this set with "
                                   "scripts/ckpt_restore.py")
        self.target = os.path.join(self.dest_b, *self.parents, self.name)
        self.shown_t = _show(self.target)
        self.h = hashlib.sha256(m["path"].encode("utf-8", "surrogatepass")).hexdigest()[:32] \
            .encode()
        self.stop = threading.Event()
        self.progress = _Progress(m, progress)
        self.fds: list[int] = []
        self.lfd: int | None = None
        self.jobs: list[_Job] = []
        self.state: _State | None = None
        self.staged = False
        self.modes: dict[tuple[bytes, ...], int] = {}
        # set by open() and plan(): DEST's parent of the target, the work directory, the root
        # the set's paths are resolved in (the target, its staging directory, or for a file
        # set the parent)
        self.sfd = self.pfd = self.wfd = self.root_fd = -1

    def result(self) -> dict[str, Any]:
        self.progress.tick()
        return {**self.progress.snap, "target": Path(os.fsdecode(self.target)),
                "seconds": time.monotonic() - self.t0}

    def open(self) -> _State:
        """DEST, its state directory (private), the lock of this set's restore, the state
        file, the target's parents (created) and the work directory."""
        dest_b, h = self.dest_b, self.h
        try:
            os.makedirs(dest_b, exist_ok=True)
            dfd = os.open(dest_b, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise DestinationError(f"{_show(dest_b)}: {e.strerror}") from None
        self.fds.append(dfd)
        self.sfd = sfd = _opendir(dfd, STATE_DIR, _show(os.path.join(dest_b, STATE_DIR)),
                                  create=True)
        self.fds.append(sfd)
        os.fchmod(sfd, 0o700)  # private: it records what was verified
        try:
            self.lfd = os.open(h + b".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o600, dir_fd=sfd)
            fcntl.flock(self.lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DestinationError(f"another restore of {self.m['path']!r} into "
                                   f"{_show(dest_b)} is running") from None
        except OSError as e:
            raise DestinationError(f"cannot lock the restore state: {e.strerror}") from None
        self.state = state = _State(sfd, h + b".json", self.m)
        pfd = dfd
        for i, c in enumerate(self.parents):
            pfd = _opendir(pfd, c, _show(os.path.join(dest_b, *self.parents[:i + 1])),
                           create=True)
            self.fds.append(pfd)
        self.pfd = pfd
        self.wfd = _opendir(sfd, h + b".tmp", "the restore's work directory", create=True)
        self.fds.append(self.wfd)
        _ensure_writable(self.wfd)
        return state

    def symlink_set(self, state: _State) -> None:
        """A symlink set: the link itself, nothing to fetch."""
        _put_symlink(state, self.pfd, self.name, "", unescape_path(self.m["target"]),
                     self.shown_t, self.wfd, staged=False, overwrite=self.overwrite)
        self.done(state)

    def plan(self) -> None:
        """Where the set's files go (`root_fd`, `staged`: built in <h>.partial, or repaired in
        place), its directories made, one `_Job` per file."""
        m, name, shown_t = self.m, self.name, self.shown_t
        if m["kind"] == "file":
            self.root_fd = self.pfd
            self.jobs = [_Job(m["files"][0], (), name, shown_t)]
            return
        st_t = _lstat(self.pfd, name, shown_t)
        if st_t is not None and not stat.S_ISDIR(st_t.st_mode):
            raise DestinationError(f"{shown_t} exists and is not a directory (the set is "
                                   "one): remove it or restore elsewhere")
        empty = False
        if st_t is not None:
            tfd = _opendir(self.pfd, name, shown_t)
            try:
                empty = not os.listdir(tfd)
            finally:
                os.close(tfd)
        self.staged = st_t is None or empty
        if self.staged:
            self.root_fd = _opendir(self.sfd, self.h + b".partial",
                                    "the restore's staging directory", create=True)
        else:
            self.root_fd = _opendir(self.pfd, name, shown_t)
        self.fds.append(self.root_fd)
        _ensure_writable(self.root_fd)
        self.modes = _set_dirs(m)
        if self.staged:
            _prune(self.root_fd, (), self.modes, m)
        _make_dirs(self.root_fd, self.modes, self.target, self.staged, self.overwrite)
        for f in m["files"]:
            comps, nm = _split(f["path"])
            self.jobs.append(_Job(f, comps, nm,
                                  _show(b"/".join((self.target, *comps, nm)))))

    def fetch(self, state: _State) -> None:
        """Check what each file's place holds (in parallel), then fetch the missing units of
        the rest, each file read back whole and put in place once its last unit is in."""
        p = self.progress

        def classify(job: _Job) -> None:
            _classify(job, self.view, state, self.root_fd, self.wfd, self.staged,
                      self.overwrite, self.stop, p.count)

        run_parallel(self.jobs, classify, self.workers, self.stop, p.tick)
        lock = threading.Lock()

        def fetch(item: tuple[_Job, int | None]) -> None:
            job, i = item
            if i is not None:
                n = self._fetch_unit(job, i)
                p.count(done=n, fetched=n)
                with lock:
                    job.remaining -= 1
                    if job.remaining:
                        return
            _finish(job, state, self.root_fd, self.wfd, self.stop)
            p.count(files=1)

        run_parallel(self._units(), fetch, self.workers, self.stop, p.tick)

    def _units(self) -> Iterator[tuple[_Job, int | None]]:
        """(job, unit) for every unit still to fetch; (job, None) for a file with none left
        (its work file only needs checking and moving into place)."""
        for job in self.jobs:
            if job.todo is None:
                continue  # already verified at its place
            if not job.todo:
                yield job, None
            for i in job.todo:
                yield job, i

    def _fetch_unit(self, job: _Job, i: int) -> int:
        n = 0
        for attempt in (1, 2):  # a chunk mangled in transit: read it once more
            try:
                fd = os.open(job.work, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=self.wfd)
            except OSError as e:
                raise DestinationError(f"{job.shown}: its work file: {e.strerror}") from None
            try:
                src = cast(Reader, job.src)  # set by _classify: the job has units to fetch
                n = _fetch_unit(src, job.geo, i, fd, self.stop)
                break
            except CorruptError:
                if attempt == 2:
                    raise
            finally:
                os.close(fd)
        return n

    def finish_dir(self, state: _State) -> None:
        """A directory set: its symlinks, the directories' modes (deepest first), then the
        staged tree renamed into place."""
        m, root_fd, shown_t, pfd = self.m, self.root_fd, self.shown_t, self.pfd
        for s in m["symlinks"]:
            comps, nm = _split(s["path"])
            pfd2 = _walk(root_fd, comps, shown_t)
            try:
                _put_symlink(state, pfd2, nm, s["path"], unescape_path(s["target"]),
                             _show(b"/".join((self.target, *comps, nm))), self.wfd,
                             staged=self.staged, overwrite=self.overwrite)
            finally:
                os.close(pfd2)
        for comps in sorted(self.modes, key=lambda c: (-len(c), c)):
            dfd2 = _walk(root_fd, comps, shown_t)
            try:
                os.fchmod(dfd2, self.modes[comps])
            finally:
                os.close(dfd2)
        os.fchmod(root_fd, m["mode"])
        if self.staged:
            state.flush(force=True)
            _target_free(pfd, self.name, "dir", shown_t)
            try:
                os.rename(self.h + b".partial", self.name, src_dir_fd=self.sfd, dst_dir_fd=pfd)
            except OSError as e:
                raise DestinationError(f"cannot rename the restored set into {shown_t}: "
                                       f"{e.strerror}") from None
        with contextlib.suppress(OSError):
            os.fsync(pfd)

    def done(self, state: _State) -> None:
        state.flush(done=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.h + b".tmp", dir_fd=self.sfd)  # empty unless a file of the set failed

    def failed(self, e: BaseException) -> None:
        """Stop the workers, keep what was verified; an OSError becomes one line (raised)."""
        self.stop.set()
        if self.state is not None:
            with contextlib.suppress(RestoreError):
                self.state.flush(force=True)
        if isinstance(e, OSError):
            raise DestinationError(f"restoring into {_show(self.dest_b)}: {e.strerror or e}") \
                from None

    def close(self) -> None:
        for job in self.jobs:
            if job.src is not None:
                job.src.close()
        if self.lfd is not None:
            os.close(self.lfd)
        for fd in reversed(self.fds):
            os.close(fd)


def restore_resumable(view: StoreView, m: Manifest, dest: Path, *, overwrite: bool = False,
                      workers: int = DEFAULT_WORKERS,
                      progress: ProgressFn | None = None) -> dict[str, Any]:
    """Restore set `m` at DEST/<set path> with up to `workers` ranged reads in flight, resuming
    whatever an earlier run into the same DEST left, and repairing a target an earlier run
    restored (see the layout comment above). Every path is resolved inside DEST without
    following a symlink, every byte is checked as it arrives and every file is read back and
    checked whole before it takes its place. An existing file at a path of the set that holds
    other content and that restore did not put there is refused (DestinationError) unless
    `overwrite`; entries of an existing target that the set does not name are left alone.

    `view`'s readers (`open`) are kept for the files being fetched: use a view whose readers
    hold no descriptor (ckptfs's view over cachemgr.store). `progress(snapshot)` is called in
    the calling thread a few times a second with a dict: bytes_total, bytes_done,
    bytes_fetched, files_total, files_done. Returns the final snapshot with `target` and
    `seconds`. RestoreError (one line) if anything is wrong; KeyboardInterrupt stops the
    workers at their next piece and keeps what they verified."""
    m = _checked(m)
    if workers < 1:
        raise UsageError("workers must be at least 1")
    r = _Resumable(view, m, dest, overwrite, workers, progress)
    try:
        state = r.open()
        if m["kind"] == "symlink":
            r.symlink_set(state)
            return r.result()
        r.plan()
        r.fetch(state)
        if m["kind"] == "dir":
            r.finish_dir(state)
        r.done(state)
        return r.result()
    except BaseException as e:
        r.failed(e)
        raise
    finally:
        r.close()
