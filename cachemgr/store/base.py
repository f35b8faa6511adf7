"""The object-store seam: one async interface every backend implements.

Backends: `local.LocalStore` (file:///dir, a directory with object semantics) and `s3.S3Store`
(s3://bucket/prefix through boto3). Wrappers compose on top (`wrappers.RetryingStore`,
`wrappers.ReadOnlyStore`). Everything above this seam (upload, commit, prefetch) sees only
`ObjectStore`.

Keys are '/'-separated strings relative to the store's root/prefix. Every object carries a CRC32C
of its whole content (`ObjectInfo.crc32c`), stored as S3's additional checksum (or its local
equivalent) and verified by readers.

Errors: every failure is a `StoreError`. `transient` ones (throttling, 5xx, timeouts, connection
resets) may succeed if retried; `RetryingStore` does that. `NotFound` and `PreconditionFailed`
are answers, not faults, and are never retried.
"""

from __future__ import annotations

import abc
import base64
import builtins
import errno
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import crc32c as _crc32c
import trio

try:  # optional: the CRT's CRC32C, faster (cachemgr.format.decode says how much)
    from awscrt.checksums import crc32c as _fast_crc32c
except ImportError:  # pragma: no cover - boto3-only installs
    _fast_crc32c = None

log = logging.getLogger(__name__)

# Scratch objects of a mount's conditional-write probe (s3.S3Store.probe_conditional,
# docs/STORES.md): the one prefix the seam itself writes under; the layout (cachemgr.format.keys)
# keeps it free.
PROBE_PREFIX = "probe/"


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32C (Castagnoli), hardware-accelerated: ~8.7 GB/s on this machine with the crc32c
    package, ~20 with the CRT's (measured)."""
    if _fast_crc32c is not None:
        return int(_fast_crc32c(data, value))
    return _crc32c.crc32c(data, value)


def crc32c_b64(value: int) -> str:
    """S3's encoding of a CRC32C: base64 of the 4 big-endian bytes."""
    return base64.b64encode(value.to_bytes(4, "big")).decode()

# awaited with the bytes about to be sent: returns when they may go (`put_file`)
Pause = Callable[[int], Awaitable[None]]


@dataclass(frozen=True)
class RangeCrcs:
    """What `put_file`'s caller knows of a file's CRC32Cs: `crc(off, n)` is that of bytes
    [off, off+n), folded from the chunk CRC32Cs it computed (the folding is the format's:
    cachemgr.format.decode), for ranges on multiples of `unit` (the chunk size); None for any
    other range."""

    unit: int
    crc: Callable[[int, int], int | None]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str                   # opaque version token, for If-Match
    crc32c: int | None = None   # full-object CRC32C when the store recorded one
    mtime: float = 0.0


@dataclass(frozen=True, slots=True)
class Part:
    number: int                 # 1-based, as in S3
    etag: str
    crc32c: int
    size: int


@dataclass(frozen=True, slots=True)
class Staged:
    """A local file copied into a store that can take one whole (`ObjectStore.stage_file`),
    not yet visible under `key`: `publish_staged` makes it the object, `discard_staged` drops
    it. `size` is what was copied (short if the source shrank), `crc32c` what `inspect`
    returned for the copy."""

    key: str
    handle: Any   # the backend's own (file://: the temp file's name and stat)
    size: int
    crc32c: int


@dataclass(frozen=True, slots=True)
class ConditionalWrites:
    """What a store was found to do with conditional PUTs: probed on a scratch key at mount
    (`ObjectStore.probe_conditional`), never assumed. S3-compatible stores differ here
    (docs/STORES.md): Ceph RGW 16.2 refuses If-Match with the quoted ETag that HeadObject
    returns and takes it bare; AWS S3, moto and SeaweedFS take both."""

    if_none_match: bool       # PUT If-None-Match: * on an existing key answers 412
    if_match: bool            # PUT If-Match: a wrong ETag 412, the current one replaces
    etag_form: str = "quoted"  # the ETag form If-Match needs: "quoted" ("..."), or "bare"
    missing_if_match: str = ""  # If-Match on a missing key: "404" (AWS), "412" (RGW, SeaweedFS)

    @property
    def honoured(self) -> bool:
        return self.if_none_match and self.if_match

    def describe(self) -> str:
        if self.honoured:
            absent = f"; If-Match on a missing key: {self.missing_if_match}" \
                if self.missing_if_match else ""
            return f"honoured (If-None-Match, If-Match with the {self.etag_form} ETag{absent})"
        missing = [h for h, ok in (("If-None-Match", self.if_none_match),
                                   ("If-Match", self.if_match)) if not ok]
        return f"NOT honoured: the store ignores {' and '.join(missing)}"


def bare_etag(etag: str) -> str:
    """An ETag without its quotes (and weak prefix): the form compared inside ckptfs is the
    store's own, this is only for stores that want it so in If-Match."""
    e = etag[2:] if etag.startswith("W/") else etag
    return e[1:-1] if len(e) >= 2 and e[0] == e[-1] == '"' else e


def quoted_etag(etag: str) -> str:
    return f'"{bare_etag(etag)}"'


class StoreError(Exception):
    errno = errno.EIO
    transient = False

    def __init__(self, msg: str, *, key: str | None = None) -> None:
        super().__init__(msg)
        self.key = key


class NotFound(StoreError):
    errno = errno.ENOENT


class PreconditionFailed(StoreError):
    """A conditional write lost: If-None-Match found an object, or If-Match a different one."""

    errno = errno.EEXIST


class TransientStoreError(StoreError):
    """Throttling (503 SlowDown), 5xx, timeouts, connection resets: worth retrying."""

    transient = True


class DeadlineExceeded(TransientStoreError):
    """The store did not answer a try within its deadline (a black hole: connections accepted,
    nothing answered; s3.S3Store's per-class deadlines, docs/ARCHITECTURE.md "Store
    deadlines"). A failure like a refusal for the store's health; `RetryingStore` tries a call
    at most `RetryPolicy.deadline_attempts` times when its tries end so."""


class IntegrityError(StoreError):
    """Bytes read back do not match their recorded checksum."""

    transient = True  # a re-read may succeed (a flipped bit in transit)


MiB = 1 << 20


@dataclass(frozen=True)
class Deadlines:
    """The deadline of one try of each class of request, in seconds (docs/ARCHITECTURE.md
    "Store deadlines" has the table with retries). A request that moves bytes gets `base` plus
    its bytes at `floor_rate`; the others a fixed bound.

    - `base` 10 s: connect, TLS, signing and the store's first byte, which S3 answers in tens
      of milliseconds; 10 s is two orders of magnitude of slack for a loaded store or node.
    - `floor_rate` 4 MiB/s per connection: 16 connections at the floor move 64 MiB/s, a tenth of
      a 10 Gbit/s NIC and half of a 1 Gbit/s one; a connection slower than this is treated as
      not answering (a 64 MiB part: 26 s; a 4 MiB chunk: 11 s).
    - a read whole (no range: manifests, part records, member records) gets `base` for its
      answer's headers, then its body's size from them at `floor_rate` (`S3Store._sized`: a
      1 KiB part record 10 s, not the 26 s of the 64 MiB cap of a document, issue 36).
    - `control` 10 s: HEAD, DELETE, create and abort of a multipart upload (no body).
    - `list_page` 15 s: one page of ListObjectsV2 (1,000 keys, ~300 KB of XML); a listing
      gets this per page, so a long listing is never cut short for being long.
    - `complete` 30 s + 0.05 s per part: S3 may take long to assemble a large upload (it
      keeps the connection alive with whitespace meanwhile).
    - `queue` 30 s: the wait for a free connection (a token of the limiter) before a request
      starts; longer than a thread that talks to a black hole lives (25 s, module docstring).
    """

    base: float = 10.0
    floor_rate: float = 4 * MiB
    control: float = 10.0
    list_page: float = 15.0
    complete: float = 30.0
    complete_per_part: float = 0.05
    queue: float = 30.0

    def data(self, nbytes: int) -> float:
        """A request that moves `nbytes`."""
        return self.base + nbytes / self.floor_rate


@dataclass
class RetryStats:
    """The retry layer's counters (cachemgr.store.wrappers.RetryingStore; status, metrics)."""

    calls: int = 0
    retries: int = 0
    failures: int = 0
    by_error: dict[str, int] = field(default_factory=dict)   # retries, by the error retried
    by_op: dict[str, int] = field(default_factory=dict)      # calls, by operation
    # errors handed to the caller (retries exhausted, or not transient): (op, error class)
    errors: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DataClientStats:
    """`ObjectStore.data_statistics()`: which client moves data bytes (`client`: sendfile,
    crt, boto3, local) and its counters, None where that client has none (`as_json` leaves
    those out)."""

    client: str
    restores_by: str | None = None   # sendfile and crt: what reads objects back
    why: str | None = None           # boto3: why the native client is off
    puts: int | None = None
    put_bytes: int | None = None
    parts: int | None = None         # sendfile: parts sent
    gets: int | None = None          # crt
    get_bytes: int | None = None
    cancelled: int | None = None
    reconnects: int | None = None    # sendfile
    errors: dict[str, int] | None = None

    def as_json(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class ObjectStore(abc.ABC):
    """Async object store. Implementations must be safe to call from many trio tasks at once."""

    url: str

    @property
    def supports_conditional_put(self) -> bool:
        """True if put() honours if_none_match/if_match atomically. Callers that cannot rely on
        them (a store found to ignore them, mounted with the override) write unconditionally."""
        return False

    @property
    def conditional(self) -> ConditionalWrites | None:
        """What `probe_conditional` found (None: not probed yet)."""
        return ConditionalWrites(self.supports_conditional_put, self.supports_conditional_put)

    async def probe_conditional(self) -> ConditionalWrites:
        """Find out, on a scratch key, whether this store honours If-None-Match and If-Match
        on PUT and in which ETag form, and remember it (`conditional`). Backends whose
        conditional writes are their own code (file://) answer without a request."""
        found = self.conditional
        assert found is not None
        return found

    @abc.abstractmethod
    async def put(self, key: str, data: bytes | memoryview, *, if_none_match: bool = False,
                  if_match: str | None = None) -> ObjectInfo:
        """Store `data` under `key` atomically (readers see the old or the new object). With
        `if_none_match`, fail with PreconditionFailed if the key exists; with `if_match=etag`,
        fail unless the current object has that etag."""

    @abc.abstractmethod
    async def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        """Bytes [start, start+length) of the object (to the end if length is None)."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo:
        """Metadata of `key`; NotFound if absent."""

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove `key`; absent keys are not an error (idempotent)."""

    @abc.abstractmethod
    async def create_multipart(self, key: str) -> str:
        """Start a multipart upload; returns its upload id."""

    @abc.abstractmethod
    async def upload_part(self, key: str, upload_id: str, number: int,
                          data: bytes | memoryview) -> Part:
        """Upload part `number` (1-based); parts may be uploaded in any order, concurrently."""

    @abc.abstractmethod
    async def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[Part],
                                 crc32c: int) -> ObjectInfo:
        """Assemble `parts` (sorted by number) into the object; `crc32c` is the whole object's
        checksum, recorded with it. The object appears atomically."""

    @abc.abstractmethod
    async def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop an unfinished multipart upload and its parts (idempotent)."""

    # -- whole local files (file://): copied in by the kernel, not through user space --------

    @property
    def stages_files(self) -> bool:
        """True if `stage_file` works: the upload of an uncompressed cache file then copies it
        in whole (copy_file_range) instead of reading it into buffers and writing parts."""
        return False

    async def stage_file(self, key: str, fd: int, size: int,
                         inspect: Callable[[memoryview], int],
                         pause: Callable[[], None] | None = None) -> Staged:
        """Copy the first `size` bytes of the local file `fd` in, not yet visible; call
        `inspect` on the copy (read-only, in the store's worker thread) for its CRC32C. The
        caller then checks the source was not changed meanwhile and publishes or discards.
        `pause`, if given, is called in the worker thread between steps of the copy (the
        uploader waits there while the trainer reads or writes)."""
        raise NotImplementedError

    async def stage_path(self, key: str, path: str, size: int,
                         inspect: Callable[[memoryview], int],
                         skip: Callable[[int], bool]) -> Staged | None:
        """`stage_file` of the file at `path`, opened, asked `skip(fd)` (True: stage nothing,
        return None; e.g. the file will be compressed) and copied in one go: for a small file
        (cachemgr.transfer.upload `SMALL_STAGED`) one worker-thread hop instead of three. No
        `pause`: a small file is one step of the copy and of the CRC pass anyway."""
        raise NotImplementedError

    async def publish_staged(self, staged: Staged) -> ObjectInfo:
        """Make a staged copy the object at its key (unconditionally, atomically). The info
        returned is the object this publication made (what a `head` right after would answer,
        were nothing else to write or delete the key meanwhile), so the caller need not HEAD
        it again."""
        raise NotImplementedError

    async def discard_staged(self, staged: Staged) -> None:
        """Drop a staged copy (idempotent)."""
        raise NotImplementedError

    # -- whole local files through a native client (s3:// with awscrt: cachemgr.store.crt) ----

    @property
    def data_path(self) -> str:
        """What moves data bytes between cache files and this store, for status: "crt" (the
        AWS Common Runtime, in native code, both ways), "crt-up" (uploads by the CRT, restores
        by boto3), "boto3", "local" (file://)."""
        return "local"

    def data_statistics(self) -> DataClientStats:
        """For status: which client moves data bytes (as `data_path`) and its counters."""
        return DataClientStats(client=self.data_path)

    def retry_statistics(self) -> RetryStats | None:
        """For status and metrics: the retry layer's counters (a RetryingStore in the stack,
        cachemgr.store.wrappers), or None for a stack without one."""
        return None

    @property
    def sends_files(self) -> bool:
        """True if `put_file` works: an uncompressed cache file goes up whole, read by the
        store's native client (no part buffers in the interpreter)."""
        return False

    @property
    def gets_files(self) -> bool:
        """True if `get_file` works and is to be used: uncompressed bytes come down written by
        the store's native client (s3:// with awscrt, when turned on: docs/ARCHITECTURE.md
        "Store data path" says why it is off by default)."""
        return False

    async def put_file(self, key: str, fd: int, size: int, crc32c: int,
                       ranges: RangeCrcs | None = None,
                       pause: Pause | None = None) -> ObjectInfo:
        """Store the first `size` bytes of the open local file `fd` as `key` (unconditionally,
        atomically; multipart inside the client as it sees fit); `crc32c` is the caller's
        CRC32C of those bytes, recorded with the object; `ranges` gives the CRC32C of a part
        of whole chunks (a client that sends parts sends each one's); a client that sends parts
        awaits `pause(bytes)` before each (the uploader's wait for the trainer). The caller checks
        afterwards that the file did not change meanwhile, and HEADs the object."""
        raise NotImplementedError

    async def get_file(self, key: str, fd: int, start: int, length: int) -> None:
        """Write bytes [start, start+length) of the object `key` into the open local file `fd`
        (a cache file, or a memfd), from its offset 0 (truncating it). Nothing is checked here:
        the caller checks every chunk before a byte is used."""
        raise NotImplementedError

    async def aclose(self) -> None:
        return None


def answer_error(status: int, code: str, msg: str, key: str | None) -> StoreError:
    """An S3 error answer (HTTP `status`, the XML's `<Code>`) as the seam's error, for the
    clients that read answers themselves (cachemgr.store.crt, cachemgr.store.plainhttp)."""
    if status == 404 or code in ("NoSuchKey", "NoSuchUpload"):
        return NotFound(msg, key=key)
    if status in (409, 412):
        return PreconditionFailed(msg, key=key)
    if status >= 500 or status in (408, 429) or code in ("SlowDown", "RequestTimeout"):
        return TransientStoreError(msg, key=key)
    return StoreError(msg, key=key)


def is_ip_or_local(host: str) -> bool:
    """A host that cannot take a bucket in its name (an IP address, localhost: moto, RGW): such
    an endpoint is addressed path-style."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def await_within(done: trio.Event, deadline: float, stop: Callable[[], None],
                       grace: float) -> bool:
    """Wait for `done` (set when a native client's request ends) at most `deadline` seconds.
    Past it, or when the caller is cancelled, call `stop()` (the client's cancel) and wait for
    `done` again, shielded, at most `grace` seconds, so the request no longer touches the
    caller's file when this returns. Returns whether the deadline passed; a request still
    going after `grace` is logged."""
    timed_out = False
    try:
        with trio.move_on_after(deadline):
            await done.wait()
        timed_out = not done.is_set()
    finally:
        if not done.is_set():
            stop()
            with trio.CancelScope(shield=True), trio.move_on_after(grace):
                await done.wait()
            if not done.is_set():
                log.warning("a store request still going %.0fs after it was stopped", grace)
    return timed_out


def check_key(key: str) -> str:
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in key.split("/")):
        raise StoreError(f"invalid object key {key!r}", key=key)
    return key
