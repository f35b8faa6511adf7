"""Reading and restoring published sets straight from a store, without a mount.

The one implementation behind `scripts/ckpt_restore.py` (restore with plain tools, ckptfs not
installed) and the mount-less verbs of `ckptfs` (`ckptfs ls`, `restore`, `fsck`:
ckptfs/storetools.py). Like cachemgr/{names,keys,validate}.py it needs only the standard library,
`lz4` and `crc32c` (and boto3 for the S3 view): no trio, nothing else of ckptfs, so the script
works from a copy of these five modules.

What it owns:

  * store *views*: `listing(prefix) -> [(key, size)]`, `get(key, max_bytes) -> bytes | None`
    (small documents), `open(key) -> reader | None` (a reader has `size`, `read(offset, n)`,
    `close()`). `FileStoreView` (a file:// store, never through a symlink) and `S3StoreView`
    (boto3) are the script's; ckptfs passes its own view over cachemgr.store (the same store
    the mount builds, retries included);
  * manifests: every one passes cachemgr.validate before use (`load_manifest`, `manifests`,
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
from collections.abc import Callable
from pathlib import Path

import crc32c
import lz4.frame

from . import keys, names, validate
from .names import unescape_path

# Exit codes of scripts/ckpt_restore.py (its docstring); `ckptfs` maps the classes to its own.
EXIT_OK = 0
EXIT_NO_SET = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_DEST = 4
EXIT_STORE = 5

READ_BYTES = 4 << 20  # the most read from the store, decompressed or written at a time


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
                data = body.read(n + 1)  # never more than asked, whatever the server sends
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
    def _errors(self, what: str, missing: str | None = None):
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

    def _missing(self, e) -> bool:
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
                data = body.read() if max_bytes is None else body.read(max_bytes + 1)
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


def open_view(url: str, endpoint_url: str | None = None):
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


def load_manifest(view, key: str, size: int | None = None) -> dict | None:
    """The validated, normalised manifest at `key`; None if there is none; CorruptError if it
    is invalid or bigger than validate.MAX_DOCUMENT_BYTES (`size`: from the listing, so that
    such a one is not even read)."""
    limit = validate.MAX_DOCUMENT_BYTES
    if size is not None and size > limit:
        raise CorruptError(f"{key}: a manifest of {size} bytes (at most {limit})")
    raw = view.get(key, max_bytes=limit)
    if raw is None:
        return None
    try:
        return validate.manifest(raw, key)
    except validate.ManifestError as e:
        if "is not the set of its key" in str(e) and _legacy_key(raw, key):
            try:
                return validate.manifest(raw)
            except validate.ManifestError as e2:
                e = e2
        raise CorruptError(f"{key}: invalid manifest: {e}") from None


def manifests(view, on_error: Callable[[str], None] | None = None) -> dict[str, dict]:
    """{set path (escaped form): manifest} of every published set, each validated and
    normalised by cachemgr.validate. An invalid manifest is passed to `on_error` (one line)
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


def find_set(view, set_path: str) -> dict:
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


def _checked(m) -> dict:
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

    def __init__(self, obj: dict) -> None:
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


def _lz4_frame(src, off: int, n: int, raw_len: int, i: int, chk: _Checker, sink) -> None:
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


def _stream(src, obj: dict, sink) -> None:
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


def _open(view, obj: dict):
    src = view.open(obj["key"])
    if src is None:
        raise CorruptError(f"{obj['key']}: object missing from the store")
    return src


def decode(obj: dict, stored: bytes) -> bytes:
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


def restore(view, m: dict) -> dict[str, bytes]:
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


def _write_file(view, obj: dict, dir_fd: int, name: bytes, mode: int, shown: str) -> None:
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


def _build_dir(view, m: dict, fd: int, shown: bytes) -> None:
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


def restore_to(view, m: dict, dest: Path) -> Path:
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


