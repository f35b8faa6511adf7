#!/usr/bin/env python3
"""Restore a checkpoint from a ckptfs store without ckptfs: manifests, objects, lz4 frames and
CRC32C, exactly as docs/FORMAT.md describes (needs only boto3 for s3://, lz4 and crc32c, and
the modules of this checkout listed in MODULES below, which need nothing else: no trio, nothing
of ckptfs).

    python scripts/ckpt_restore.py list    file:///var/lib/ckptfs/store
    python scripts/ckpt_restore.py restore s3://bucket/prefix ckpt/step_100 ./restored \\
        [--endpoint-url URL]

Nothing read from the store is trusted. Every manifest passes cachemgr.format.validate (the rules
ckptfs itself reads the store with) before it is used; `list` reports an invalid one on stderr
in one line and goes on. Every object is streamed to its file a few MiB at a time (lz4 frame by
frame, each frame bounded by its raw length), its size, CRC32C and chunk CRC32Cs checked as it
arrives. A set is built under a temporary name next to its target with file-descriptor-relative
calls that never follow a symlink (neither one the manifest makes, nor one already in DEST) and
renamed into place only when every file checked out; on any error nothing is left at the target.
The target DEST/<set path> must not exist (a directory set may replace an empty directory);
ckpt_restore never overwrites or merges. DEST itself is taken as given (created if missing);
directories between DEST and the target are created as needed and must be real directories,
not symlinks. Symlinks of the set are created last, as links (their targets may be absolute or
hold '..'; they are never followed). Permission bits come from the manifest, masked by the
validator (never setuid, setgid, sticky or world-writable).

Exit codes (one line on stderr for each failure, never a traceback; the same under python -O):
  0  done
  1  no such set in the store
  2  usage: bad arguments, an unsupported store URL, a SET_PATH that is not a set path
  3  invalid or corrupt data in the store: a manifest that fails validation (or is bigger than
     cachemgr.format.validate.MAX_DOCUMENT_BYTES), an object missing, of the wrong size, failing its
     CRC32C (whole or per chunk), or an lz4 frame that is not exactly its raw length
  4  the destination: the target exists, a symlink or a file is in the way, a write failed
  5  the store cannot be read (I/O error, network, permissions; boto3 missing for s3://)

The implementation is cachemgr/format/storeread.py (manifests, objects) over
cachemgr/format/decode.py (the one decoder of stored objects, also the mount's) and
cachemgr/format/restoreto.py (the destination), shared with `ckptfs restore` (which adds
parallel ranged reads, resuming and a progress bar, and reads the store as the mount does). This
file is its plain command line: it keeps working without ckptfs installed, from a copy of this file
and the modules in MODULES. The tests and the main job use the same functions (re-exported here)
to check what ckptfs published.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import stat
import sys
from pathlib import Path

# The modules this script runs on, relative to the checkout: the standard library, lz4 and
# crc32c are all they need (no trio; boto3 only for s3://). A copy of this file beside exactly
# these runs (tests/unit/test_ckpt_restore.py copies this list). This checkout's copy is used when
# ckptfs is not installed (and when it is installed in editable mode from elsewhere: an entry of
# sys.path comes before the editable finder); a regular install comes first.
MODULES = [
    "cachemgr/__init__.py",
    "cachemgr/format/__init__.py",
    "cachemgr/format/names.py",          # path escaping
    "cachemgr/format/keys.py",           # the key layout
    "cachemgr/format/docs.py",           # the documents as types
    "cachemgr/format/validate.py",       # every document checked before use
    "cachemgr/format/readerrors.py",     # the errors and their exit codes
    "cachemgr/format/decode.py",         # the one decoder of stored objects
    "cachemgr/format/views.py",          # what a store view is (the views are below)
    "cachemgr/format/storeread.py",      # manifests and objects
    "cachemgr/format/restoreto.py",      # the atomic restore into DEST
]
_REPO = Path(__file__).resolve().parent.parent
if all((_REPO / m).is_file() for m in MODULES) and str(_REPO) not in sys.path:
    sys.path.append(str(_REPO))
from collections.abc import Callable, Iterator

from cachemgr.format import storeread
from cachemgr.format.names import unescape_name, unescape_path
from cachemgr.format.readerrors import (
    EXIT_CORRUPT,
    EXIT_DEST,
    EXIT_NO_SET,
    EXIT_OK,
    EXIT_STORE,
    EXIT_USAGE,
    CorruptError,
    DestinationError,
    NoSuchSet,
    RestoreError,
    StoreError,
    UsageError,
    show,
)
from cachemgr.format.restoreto import restore_to
from cachemgr.format.storeread import Manifest, decode, find_set, load_manifest, restore
from cachemgr.format.views import StoreView

# What the tests, the fault loop and train_demo import from here.
__all__ = [
    "EXIT_CORRUPT", "EXIT_DEST", "EXIT_NO_SET", "EXIT_OK", "EXIT_STORE", "EXIT_USAGE",
    "MODULES", "CorruptError", "DestinationError", "FileStoreView", "NoSuchSet", "RestoreError",
    "S3StoreView", "StoreError", "UsageError", "decode", "find_set", "load_manifest", "main",
    "manifests", "open_view", "restore", "restore_to", "unescape_name", "unescape_path",
]


# -- the store: this script's own views (cachemgr.format.views protocols) ------------------------
# ckptfs reads stores through cachemgr.store (async, trio: cachemgr.format.storeview); this script
# must run without trio and without ckptfs, so it reads them through these: a file:// store with
# plain descriptor-relative opens, an s3:// store with one boto3 client. They are the format's
# independent reference reader (docs/FORMAT.md "Restoring without ckptfs"). keys(prefix),
# listing(prefix) -> [(key, size)], get(key, max_bytes) -> bytes | None for small documents,
# open(key) -> an object reader (size, read(offset, n), close()) or None if missing.

def key_parts(key: str) -> list[str]:
    """The components of an object key; CorruptError for one no store could hold."""
    parts = key.split("/") if isinstance(key, str) else [""]
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise CorruptError(f"{show(key)} is not an object key")
    return parts



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


def _warn(msg: str) -> None:
    print(f"ckpt_restore: skipped {msg}", file=sys.stderr)


def manifests(view: StoreView, on_error: Callable[[str], None] = _warn) -> dict[str, Manifest]:
    """storeread.manifests, reporting each invalid manifest on stderr (one line)."""
    return storeread.manifests(view, on_error)


def _show(b: bytes) -> str:
    return repr(os.fsdecode(b))


# -- the command line --------------------------------------------------------------------------

def _run(a: argparse.Namespace) -> int:
    view = open_view(a.store, a.endpoint_url)
    if a.cmd == "list":
        for path, m in sorted(manifests(view).items()):
            print(f"{m['kind']:<8} {m['total_bytes']:>14}  {path}")
        return EXIT_OK
    m = find_set(view, a.set_path)
    out = restore_to(view, m, a.dest)
    # The escaped form and repr(): stdout may not take the bytes of a name (strict UTF-8).
    print(f"restored {m['path']} to {_show(os.fsencode(out))} (every CRC32C checked)")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 done, 1 no such set, 2 usage, 3 invalid or corrupt data in the "
               "store, 4 destination refused or not writable, 5 store unreadable",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="list the published sets (invalid manifests: stderr)")
    ls.add_argument("store")
    r = sub.add_parser("restore", help="restore one set into a directory")
    r.add_argument("store")
    r.add_argument("set_path")
    r.add_argument("dest", type=Path)
    for q in (ls, r):
        q.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"))
    a = p.parse_args(argv)  # exits 2 on bad arguments
    try:
        return _run(a)
    except RestoreError as e:
        print(f"ckpt_restore: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ckpt_restore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
