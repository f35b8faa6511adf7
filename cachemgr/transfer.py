"""Moving one cache file to or from one object: uploads (single PUT or multipart, optionally lz4
framed), ranged reads, and parallel verified downloads.

This module owns the byte movement of one file and its integrity checks; it does not decide
*what* to upload or when (the scheduler does), and it does not retry (the caller wraps the store
in `RetryingStore`, and retries a whole transfer on `IntegrityError`). What an object is
(`StoredObject`, chunk geometry, `crc32c_combine`) lives in `cachemgr.objects`; the names are
re-exported here for the modules that import them from this one.

Threads and state
    Everything here runs on the caller's trio loop except the byte work, which goes to
    `trio.to_thread` workers: an upload's `_Producer.next_part` (pread, CRC, lz4; one call at a
    time per upload, the upload awaits each, so the producer's fields have one user at a time),
    `should_compress` sampling (both at idle CPU and I/O priority: `cachemgr.background`, so
    the next checkpoint's save gets the machine first), and a download's `_write_range` /
    chunk decoding (each worker thread gets its own range and writes only that range's bytes
    of the destination file; the per-range CRCs are stored by the loop, after the thread
    returns). `UploadStats` and an
    upload's part table are touched only by the loop. The foreground signal
    (`note_foreground`) is set by the FUSE handlers on the same loop. Nothing here is durable:
    a crash mid-upload leaves at most an incomplete multipart upload (the bucket lifecycle rule
    removes it) and mid-download a partial destination file, which the caller wrote to a temp
    name it discards.

Upload (`Uploader.upload_file`)
    A producer reads the cache file in order (`os.pread` in a worker thread), computes the raw
    content's CRC32C on the way (so it is always in order), compresses it in frames when asked,
    and cuts it into parts; each part is sent by its own task, up to `max_parts_in_flight` at
    once, and the upload is completed with the parts in order. An object whose raw size is at
    most `single_put_max` goes in one PUT; so does a compressed object whose stored bytes all
    fit in the first part (a GB of zeros is a few KiB). The multipart upload is created lazily,
    once a second part is certain. `still_valid()` is asked after each part is read (just
    before it is sent), after each step of a compressed part (`_Producer.STEP_RAW` raw bytes:
    a file of zeros is one part however big) and before completing: a superseded or deleted
    checkpoint stops costing bandwidth at the next part boundary and CPU within a step. Any
    failure, `Superseded` or trio cancellation aborts the multipart upload in a shielded cleanup
    (bounded by ABORT_TIMEOUT); a bucket lifecycle rule (AbortIncompleteMultipartUpload) is
    the backstop for a process that dies mid-upload. After completion, `head()` must report the
    stored size (and the stored CRC32C when the store recorded one), else IntegrityError.

Memory bound
    A part's buffer is allocated only after a token is taken, and the token is given back when
    the store has acknowledged the part. Tokens come from a per-upload semaphore of
    `max_parts_in_flight` and, when given, from a `parts_limiter` shared by all uploads (taken
    in that order, so one big upload cannot starve the others of the shared pool). So:

        uploads:   tokens x (part_size + one stored frame) + one raw frame per compressing upload
                   (defaults: 8 x 64 MiB = 512 MiB, shared across uploads with a shared limiter)
        downloads: concurrency x (range_size + one raw frame)   (defaults: 8 x 64 MiB = 512 MiB)

    (plus whatever the store client copies while sending). Single PUTs hold up to
    `single_put_max` raw bytes under one token. Files that would need more than S3's 10,000
    parts get a larger part size (rounded up to 1 MiB) instead of failing: at 64 MiB parts the
    plain limit is 625 GiB (Mountpoint for S3's 78 GiB cap at its default part size is a known
    complaint).

Defaults and why
    - part_size 64 MiB: measured early in development (notes not kept in the repository) at
      ~120 MB/s up and ~100 MB/s down on moto with 64 MiB parts and 8 threads, against ~24 MB/s
      down with 16 MiB parts; docs/PERFORMANCE.md still shows the effect (a moto ceiling of
      302 MB/s with 32 MiB parts, 403 MB/s with 64 MiB): per-request cost (~5 ms per small
      request on moto, plus boto3's per-call CPU on a 2-core VM) must be amortised over big
      requests. S3 itself accepts 5 MiB..5 GiB parts.
    - max_parts_in_flight 8: the 8 threads of that measurement; S3Store's default 16 connections
      leave room for concurrent downloads, heads and lists. 512 MiB of buffers per upload.
    - single_put_max = part_size: an object that fits in one part gains nothing from multipart
      (three requests instead of one) and PUT is atomic on every store.
    - download range_size 64 MiB, concurrency 8: the same measurement, downstream.
    - frame_size 4 MiB and the `auto` threshold: see `cachemgr.compress`.

Integrity
    `StoredObject.crc32c` (the raw content's CRC32C) is checked end to end by `download_file`
    after decompression: ranges are fetched and written in any order, each range's raw CRC32C
    is computed in the worker thread that decodes it, and the per-range values are folded in
    order with `crc32c_combine`, so the file is never re-read. `read_range` checks lengths and
    frame structure only (a ranged GET carries no checksum of its own); `download_file`,
    `fetch_chunk` and `fetch_chunks` are verified paths: `fetch_chunk` fetches one chunk (see
    `cachemgr.objects` "Chunks") with one ranged GET and checks it against `chunk_crcs`, so a
    read is served as soon as its range is in, and `download_file` checks every chunk it
    writes. The uploader computes the chunk CRCs on the way (memoryview slices of each part,
    ~0.5 ms per 4 MiB) and derives the whole-file CRC32C from them, so the raw bytes are
    checksummed once.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from .background import run_idle
from .compress import (
    DEFAULT_FRAME_SIZE,
    MODES,
    FrameError,
    compress_frame,
    frames_for_range,
    iter_decompress,
    should_compress,
)
from .nodefiles import open_private
from .objects import (
    StoredObject,
    chunk_count,
    chunk_size_of,
    chunk_span,
    crc32c_combine,
    crc_mismatch,
    frames_of,
    stored_span,
)
from .store.base import IntegrityError, NotFound, ObjectInfo, ObjectStore, Part, crc32c

# cachemgr.objects owns StoredObject and the chunk geometry (imported from there everywhere).
__all__ = [
    "Superseded",
    "TransferConfig",
    "Uploader",
    "download_file",
    "fetch_chunk",
    "fetch_chunks",
    "note_foreground",
    "read_range",
    "set_foreground_probe",
    "yield_to_foreground",
]

log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30
S3_MIN_PART = 5 * MiB        # every part but the last
S3_MAX_PART = 5 * GiB
S3_MAX_PARTS = 10_000
S3_MAX_PUT = 5 * GiB
S3_MAX_OBJECT = 5 << 40      # S3's largest object: 5 TiB (the part limits alone allow ~48 TiB)

DEFAULT_PART_SIZE = 64 * MiB
DEFAULT_PARTS_IN_FLIGHT = 8
DEFAULT_RANGE_SIZE = 64 * MiB
DEFAULT_DOWNLOAD_CONCURRENCY = 8
# A shielded abort must not hang a cancellation forever on a dead store; after this the upload
# is left to the bucket's lifecycle rule (and logged).
ABORT_TIMEOUT = 30.0
# lz4's worst case: incompressible input grows by 1/255 plus a few bytes of block and frame
# headers (64 per frame is generous for 1 MiB blocks in a 4 MiB frame).
_LZ4_FRAME_SLACK = 64


# Foreground first: the FUSE read and write paths note the time of every read and write here
# (one monotonic() call), and an upload reads its next part only once the trainer has not
# written or read for FOREGROUND_QUIET_S, or after waiting FOREGROUND_MAX_DEFER_S for that part
# (so a trainer that never pauses still lets every upload advance). Measured
# (docs/PERFORMANCE.md): on a small machine the upload's preads, CRCs and store sends otherwise
# take about half the daemon's CPU while the trainer is still writing, and the trainer waits
# for it; a read right after the write lost 10-20% to the upload's copy beside it
# (docs/bench/overhead.md).
# I/O the daemon never sees (FUSE passthrough: the kernel reads and writes the cache file) is
# found by a probe the composition root installs (`set_foreground_probe`:
# Backings.busy_since_probe, an fstat per file open for writing and a /proc/PID/io read per
# process reading in passthrough): True means "written or read since last asked".
# One process-wide signal (one daemon per process), read and written on the trio loop only.
FOREGROUND_QUIET_S = 0.1
FOREGROUND_MAX_DEFER_S = 2.0
# The CRC pass over a staged copy (file:// stores) goes in steps of this many bytes with the
# same wait between them as the copy's (measured: with only the copy in steps, the daemon still
# used 0.1-0.5 s of CPU during a 0.6 s read of 1 GiB right after its write, 4 readers).
STAGED_CRC_STEP = 16 << 20


@dataclass
class _Foreground:
    last: float = 0.0                           # monotonic time of the trainer's last write
    probe: Callable[[], bool] | None = None     # set by the composition root (passthrough)


_FOREGROUND = _Foreground()


def note_foreground() -> None:
    _FOREGROUND.last = time.monotonic()


def set_foreground_probe(probe: Callable[[], bool] | None) -> None:
    _FOREGROUND.probe = probe


async def yield_to_foreground() -> None:
    start = time.monotonic()
    while True:
        probe = _FOREGROUND.probe
        if probe is not None and probe():
            note_foreground()
        now = time.monotonic()
        idle = now - _FOREGROUND.last
        if idle >= FOREGROUND_QUIET_S or now - start >= FOREGROUND_MAX_DEFER_S:
            return
        await trio.sleep(FOREGROUND_QUIET_S - idle)


class Superseded(Exception):
    """`still_valid()` said no: the upload was aborted and nothing was published."""

    def __init__(self, key: str) -> None:
        super().__init__(f"upload of {key} superseded")
        self.key = key


class SourceChanged(OSError):
    """The cache file is shorter than the size the caller gave (it changed under the upload)."""

    def __init__(self, msg: str) -> None:
        super().__init__(errno.EIO, msg)


@dataclass(frozen=True)
class TransferConfig:
    part_size: int = DEFAULT_PART_SIZE
    max_parts_in_flight: int = DEFAULT_PARTS_IN_FLIGHT
    compress: str = "auto"                 # "auto" | "lz4" | "off"
    frame_size: int = DEFAULT_FRAME_SIZE
    single_put_max: int | None = None      # None: part_size
    stage_files: bool = True               # whole-file copy where the store can (file://)

    def __post_init__(self) -> None:
        if not S3_MIN_PART <= self.part_size <= S3_MAX_PART:
            raise ValueError(f"part_size must be within [5 MiB, 5 GiB] (S3's limits), "
                             f"got {self.part_size}")
        if self.max_parts_in_flight < 1:
            raise ValueError(f"max_parts_in_flight must be >= 1, got {self.max_parts_in_flight}")
        if self.compress not in MODES:
            raise ValueError(f"compress must be one of {MODES}, got {self.compress!r}")
        if not 4096 <= self.frame_size <= self.part_size:
            raise ValueError(f"frame_size must be within [4 KiB, part_size], "
                             f"got {self.frame_size}")
        if self.single_put_max is None:
            object.__setattr__(self, "single_put_max", self.part_size)
        elif not 0 <= self.single_put_max <= S3_MAX_PUT:
            raise ValueError(f"single_put_max must be within [0, 5 GiB] (S3's PUT limit), "
                             f"got {self.single_put_max}")


# ----------------------------------------------------------------------------------------------
# upload


def _pread_exact(fd: int, n: int, off: int) -> bytes:
    data = os.pread(fd, n, off)
    if len(data) == n or not data:
        if len(data) != n:
            raise SourceChanged(f"cache file ends before byte {off + n}")
        return data
    chunks = [data]
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, off + got)
        if not more:
            raise SourceChanged(f"cache file ends at byte {off + got}, expected {off + n}")
        chunks.append(more)
        got += len(more)
    return b"".join(chunks)


def _pread_sample(fd: int, off: int, n: int) -> bytes:
    return os.pread(fd, n, off)


# bytes in, bytes out; a memoryview in (a slice of one fetched buffer), a view or bytes out
_Blob = TypeVar("_Blob", bytes, memoryview)


@dataclass(slots=True)
class _Chunk:
    data: bytes | None
    raw_len: int
    last: bool


def _take(chunk: _Chunk) -> bytes:
    """The part's buffer, which from now on only the caller holds (so it is freed as soon as
    the caller drops it, before the part's token goes back)."""
    data = chunk.data
    assert data is not None, "a part's buffer is sent once"
    chunk.data = None
    return data


class _Producer:
    """Reads, checksums, (compresses) and cuts one file into parts, strictly in order. Each
    `next_part` runs in a worker thread; calls never overlap (the upload awaits each).

    The raw bytes are checksummed once, chunk by chunk (chunk = frame_size raw bytes, a frame
    when compressing; an uncompressed part need not hold whole chunks, so a chunk's CRC may
    carry over to the next part), and the whole-file CRC is folded from the chunk CRCs."""

    def __init__(self, fd: int, size: int, compressed: bool, frame_size: int,
                 target: float) -> None:
        self.fd = fd
        self.size = size
        self.compressed = compressed
        self.frame_size = frame_size  # also the chunk size
        self.target = target        # stored bytes per part (math.inf: one part)
        self.raw_off = 0
        self.crc_raw = 0
        self.crc_stored = 0
        self.stored = 0
        self.frames: list[int] = []
        self.chunk_crcs: list[int] = []
        self._done_crc = 0      # CRC32C of the completed chunks
        self._cur_crc = 0       # CRC32C and length of the chunk being filled (uncompressed)
        self._cur_len = 0
        # The compressed part being built across calls of `next_part` (see STEP_RAW).
        self._part_start: int | None = None
        self._pieces: list[bytes] = []
        self._got = 0

    def _chunk_done(self, crc: int, n: int) -> None:
        self.chunk_crcs.append(crc)
        self._done_crc = crc32c_combine(self._done_crc, crc, n)

    def _checksum(self, data: bytes | memoryview, last: bool) -> None:
        """Chunk CRCs of the next uncompressed raw bytes (memoryview slices, no copies)."""
        mv = memoryview(data)
        pos, end, cs = 0, len(mv), self.frame_size
        while pos < end:
            n = min(cs - self._cur_len, end - pos)
            self._cur_crc = crc32c(mv[pos:pos + n], self._cur_crc)
            self._cur_len += n
            pos += n
            if self._cur_len == cs:
                self._chunk_done(self._cur_crc, cs)
                self._cur_crc = self._cur_len = 0
        if last and self._cur_len:
            self._chunk_done(self._cur_crc, self._cur_len)
            self._cur_crc = self._cur_len = 0
        self.crc_raw = crc32c_combine(self._done_crc, self._cur_crc, self._cur_len)

    # Raw bytes one call of `next_part` works through at most when compressing: a part of very
    # compressible data covers far more raw bytes than its stored target (a file of zeros, such
    # as one just laid out with fallocate, is one part), and a worker thread cannot be
    # cancelled. Between calls the upload checks `still_valid`, trio cancellation and the
    # trainer (`yield_to_foreground`), so an upload superseded by the next write-open stops
    # within this much work instead of finishing the part.
    STEP_RAW = 4 << 20

    def next_part(self) -> _Chunk | None:
        """The next part, or None when this call did a step of work (STEP_RAW raw bytes,
        compressing) and the part is not complete yet: call again."""
        if not self.compressed:
            start = self.raw_off
            n = int(min(self.target, self.size - start))
            data = _pread_exact(self.fd, n, start)
            self._checksum(data, start + n >= self.size)
            self.crc_stored = self.crc_raw
        else:
            if self._part_start is None:
                self._part_start, self._pieces, self._got = self.raw_off, [], 0
            start = self._part_start
            stepped = 0
            while self.raw_off < self.size and self._got < self.target:
                if stepped >= self.STEP_RAW:
                    return None
                n = min(self.frame_size, self.size - self.raw_off)
                raw = _pread_exact(self.fd, n, self.raw_off)
                self._chunk_done(crc32c(raw), n)
                self.crc_raw = self._done_crc
                c = compress_frame(raw)
                del raw  # one raw frame alive at a time
                self._pieces.append(c)
                self.frames.append(len(c))
                self._got += len(c)
                self.raw_off += n
                stepped += n
            pieces, self._pieces, self._part_start = self._pieces, [], None
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            del pieces
            self.crc_stored = crc32c(data, self.crc_stored)
            n = self.raw_off - start
        self.raw_off = start + n
        self.stored += len(data)
        return _Chunk(data, n, self.raw_off >= self.size)


@dataclass
class UploadStats:
    uploads: int = 0
    single_puts: int = 0
    multipart: int = 0
    parts: int = 0
    compressed: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    superseded: int = 0
    staged: int = 0      # whole files copied in by the store (file://: copy_file_range)
    aborted: int = 0
    abort_failures: int = 0
    parts_in_flight: int = 0
    peak_parts_in_flight: int = 0


@dataclass
class _Job:
    """One upload in progress. Owned by the task running `Uploader._upload`; its part senders
    (tasks of the same loop) add to `parts`. `upload_id` is set while a multipart upload exists
    that must be aborted if the upload fails."""

    key: str
    prod: _Producer
    sem: trio.Semaphore
    still_valid: Callable[[], bool]
    progress: Callable[[int], None] | None
    upload_id: str | None = None
    parts: dict[int, Part] = field(default_factory=dict)


def _always() -> bool:
    return True


def _unwrap(eg: BaseExceptionGroup) -> BaseException | None:
    """The one exception a caller should see from a failed nursery: Superseded first, else the
    first leaf that is not a Cancelled. None if every leaf is a Cancelled (let the group reach
    the cancel scope that owns it)."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        else:
            leaves.append(e)

    walk(eg)
    real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    for e in real:
        if isinstance(e, Superseded):
            return e
    return real[0] if real else None


class Uploader:
    """Uploads cache files to objects. One Uploader may run many uploads concurrently; give all
    of them one `parts_limiter` to bound their combined part buffers."""

    def __init__(self, store: ObjectStore, cfg: TransferConfig | None = None,
                 parts_limiter: trio.CapacityLimiter | None = None) -> None:
        self.store = store
        self.cfg = cfg or TransferConfig()
        self.parts_limiter = parts_limiter
        self.stats = UploadStats()

    def statistics(self) -> UploadStats:
        return self.stats

    def part_size_for(self, size: int, compressed: bool) -> int:
        """The part size for a file of `size` raw bytes: cfg.part_size, grown (to a multiple of
        1 MiB) when the object would otherwise need more than 10,000 parts."""
        bound = size
        if compressed:
            nframes = math.ceil(size / self.cfg.frame_size)
            bound = size + size // 255 + nframes * _LZ4_FRAME_SLACK
        part = max(self.cfg.part_size, math.ceil(bound / S3_MAX_PARTS / MiB) * MiB)
        # A compressed part can overshoot its target by one stored frame.
        slack = self.cfg.frame_size + self.cfg.frame_size // 255 + _LZ4_FRAME_SLACK
        if part + (slack if compressed else 0) > S3_MAX_PART:
            raise ValueError(f"{size} bytes do not fit in {S3_MAX_PARTS} parts of at most 5 GiB")
        return part

    async def _acquire(self, sem: trio.Semaphore) -> object:
        await sem.acquire()
        token = object()
        if self.parts_limiter is not None:
            try:
                await self.parts_limiter.acquire_on_behalf_of(token)
            except BaseException:
                sem.release()
                raise
        st = self.stats
        st.parts_in_flight += 1
        st.peak_parts_in_flight = max(st.peak_parts_in_flight, st.parts_in_flight)
        return token

    def _release(self, sem: trio.Semaphore, token: object) -> None:
        self.stats.parts_in_flight -= 1
        if self.parts_limiter is not None:
            self.parts_limiter.release_on_behalf_of(token)
        sem.release()

    def _check(self, still_valid: Callable[[], bool], key: str) -> None:
        if not still_valid():
            raise Superseded(key)

    async def upload_file(self, path: str | os.PathLike[str], key: str, *, size: int,
                          still_valid: Callable[[], bool] = _always,
                          progress: Callable[[int], None] | None = None) -> StoredObject:
        """Upload the first `size` bytes of the cache file at `path` to `key`. Raises Superseded
        if `still_valid()` turns False (nothing published, multipart aborted), IntegrityError
        if the stored object does not read back at the right size, StoreError from the store,
        SourceChanged if the file is shorter than `size`."""
        if size < 0:
            raise ValueError(f"negative size {size}")
        if size > S3_MAX_OBJECT:
            # Checked before a byte is read: a sparse `truncate -s 10T` would otherwise stream
            # terabytes of zeros for an upload the store refuses at its end.
            raise ValueError(f"{size} bytes is more than the store's largest object (5 TiB)")
        fd = await trio.to_thread.run_sync(os.open, os.fspath(path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return await self._upload(fd, key, size, still_valid, progress)
        except SourceChanged:
            # A file that shrank under us is a superseded one if the caller says so.
            self._check(still_valid, key)
            raise
        finally:
            os.close(fd)

    async def _decide(self, fd: int, size: int) -> bool:
        mode = self.cfg.compress
        if size == 0 or mode == "off":
            return False  # nothing to gain on an empty file, and no frame index to keep
        if mode == "lz4":
            return True
        return await trio.to_thread.run_sync(
            run_idle, should_compress, lambda off, n: _pread_sample(fd, off, n), size)

    async def _upload(self, fd: int, key: str, size: int, still_valid: Callable[[], bool],
                      progress: Callable[[int], None] | None) -> StoredObject:
        cfg = self.cfg
        st = self.stats
        st.uploads += 1
        # The first read of the file (the compressibility sample) waits for the trainer too:
        # a file reopened for writing right after its close (a layout) is dropped before it.
        await yield_to_foreground()
        compressed = await self._decide(fd, size)
        if not compressed and cfg.stage_files and self.store.stages_files:
            return await self._upload_staged(fd, key, size, still_valid, progress)
        put_max = cfg.single_put_max
        assert put_max is not None  # TransferConfig.__post_init__ sets it
        target = math.inf if size <= put_max else self.part_size_for(size, compressed)
        job = _Job(key, _Producer(fd, size, compressed, cfg.frame_size, target),
                   trio.Semaphore(cfg.max_parts_in_flight), still_valid, progress)
        try:
            info = await self._put_or_parts(job)
        except BaseException as e:
            if isinstance(e, Superseded):
                st.superseded += 1
            if job.upload_id is not None:
                await self._abort(key, job.upload_id)
            raise
        return await self._finish(job, size, compressed, info)

    async def _upload_staged(self, fd: int, key: str, size: int,
                             still_valid: Callable[[], bool],
                             progress: Callable[[int], None] | None) -> StoredObject:
        """An uncompressed file to a store that copies local files in whole (file://): the
        kernel copies it (no read into buffers, no parts), the chunk CRCs are computed over the
        copy, and the copy is published only if the source did not change meanwhile (the check
        follows the copy, as it follows each part's read on the other path)."""
        cfg = self.cfg
        await yield_to_foreground()
        self._check(still_valid, key)
        prod = _Producer(fd, size, False, cfg.frame_size, math.inf)

        def pause() -> None:  # in the store's worker thread, between steps of the work
            trio.from_thread.check_cancelled()  # an unmount stops the copy here (tmp removed)
            trio.from_thread.run(yield_to_foreground)

        def inspect(mv: memoryview) -> int:  # the chunk CRCs over the copy, in steps too
            n = len(mv)
            for off in range(0, n, STAGED_CRC_STEP):
                if off:
                    pause()
                prod._checksum(mv[off:off + STAGED_CRC_STEP], off + STAGED_CRC_STEP >= n)
            if not n:
                prod._checksum(mv, True)
            return prod.crc_raw

        staged = await self.store.stage_file(key, fd, size, inspect, pause)
        try:
            if staged.size != size:
                raise SourceChanged(f"cache file for {key} is {staged.size} bytes, not {size}")
            self._check(still_valid, key)
            info = await self.store.publish_staged(staged)
        except BaseException as e:
            if isinstance(e, Superseded):
                self.stats.superseded += 1
            with trio.CancelScope(shield=True):
                await self.store.discard_staged(staged)
            raise
        prod.raw_off = size
        prod.stored = size
        prod.crc_stored = prod.crc_raw
        self.stats.single_puts += 1
        self.stats.staged += 1
        if progress is not None:
            progress(size)
        job = _Job(key, prod, trio.Semaphore(1), still_valid, progress)
        return await self._finish(job, size, False, info)

    async def _next_chunk(self, job: _Job) -> tuple[_Chunk, object]:
        """Once the trainer pauses (or waited long enough) and a part token is free, read the
        next part in a worker thread and ask `still_valid`. The token is the caller's to give
        back, after the part's buffer is dropped."""
        await yield_to_foreground()
        token = await self._acquire(job.sem)
        try:
            while True:
                chunk = await trio.to_thread.run_sync(run_idle, job.prod.next_part)
                self._check(job.still_valid, job.key)
                if chunk is not None:
                    break
                await yield_to_foreground()  # a step of a long part: a checkpoint between
        except BaseException:
            self._release(job.sem, token)
            raise
        return chunk, token

    async def _put_or_parts(self, job: _Job) -> ObjectInfo:
        """Send the file: one PUT when the first part is the last, else a multipart upload
        (created only now that a second part is certain), completed in part order."""
        chunk, token = await self._next_chunk(job)
        if chunk.last:
            try:
                info = await self.store.put(job.key, _take(chunk))
                self.stats.single_puts += 1
                if job.progress is not None:
                    job.progress(chunk.raw_len)
            finally:
                self._release(job.sem, token)
            return info
        try:
            upload_id = job.upload_id = await self.store.create_multipart(job.key)
        except BaseException:
            self._release(job.sem, token)
            raise
        self.stats.multipart += 1
        try:
            async with trio.open_nursery() as nursery:
                number = 1
                nursery.start_soon(self._send, job, upload_id, number, chunk, token)
                last: bool = chunk.last
                while not last:
                    chunk, token = await self._next_chunk(job)
                    number += 1
                    nursery.start_soon(self._send, job, upload_id, number, chunk, token)
                    last = chunk.last
        except BaseExceptionGroup as eg:
            e = _unwrap(eg)
            if e is None:
                raise
            raise e from None
        return await self._complete(job, upload_id)

    async def _send(self, job: _Job, upload_id: str, number: int, chunk: _Chunk,
                    token: object) -> None:
        raw_len = chunk.raw_len
        data = _take(chunk)
        try:
            part = await self.store.upload_part(job.key, upload_id, number, data)
        finally:
            del data  # drop the buffer before its token goes back
            self._release(job.sem, token)
        job.parts[number] = part
        self.stats.parts += 1
        if job.progress is not None:
            job.progress(raw_len)

    async def _complete(self, job: _Job, upload_id: str) -> ObjectInfo:
        key = job.key
        self._check(job.still_valid, key)
        ordered = [job.parts[n] for n in sorted(job.parts)]
        try:
            info = await self.store.complete_multipart(key, upload_id, ordered,
                                                       job.prod.crc_stored)
        except NotFound:
            # A retried complete whose first attempt succeeded but whose answer was
            # lost finds the upload gone: accept the object if it is the one we sent.
            info = await self.store.head(key)
            if info.size != sum(p.size for p in ordered):
                raise
            log.info("complete of %s answered NoSuchUpload; the object is there", key)
        job.upload_id = None  # published: nothing to abort any more
        return info

    async def _finish(self, job: _Job, size: int, compressed: bool,
                      info: ObjectInfo) -> StoredObject:
        """Check what the store says it holds, count the upload, describe the object."""
        key, prod, st, cfg = job.key, job.prod, self.stats, self.cfg
        head = await self.store.head(key)
        self._verify(key, head, prod)
        st.raw_bytes += size
        st.stored_bytes += prod.stored
        if compressed:
            st.compressed += 1
        log.debug("uploaded %s: %d raw, %d stored bytes, %s, etag %s", key, size, prod.stored,
                  "lz4" if compressed else "none", info.etag)
        return StoredObject(
            key=key, size=size, stored_size=prod.stored, crc32c=prod.crc_raw,
            compression="lz4" if compressed else "none",
            frame_size=cfg.frame_size if compressed else 0,
            frames=tuple(prod.frames) if compressed else None,
            chunk_size=cfg.frame_size, chunk_crcs=tuple(prod.chunk_crcs))

    @staticmethod
    def _verify(key: str, head: ObjectInfo, prod: _Producer) -> None:
        if head.size != prod.stored:
            raise IntegrityError(f"{key}: stored object is {head.size} bytes, sent {prod.stored}",
                                 key=key)
        if head.crc32c is not None and head.crc32c != prod.crc_stored:
            raise IntegrityError(f"{key}: store reports CRC32C {head.crc32c:08x}, sent "
                                 f"{prod.crc_stored:08x}", key=key)

    async def _abort(self, key: str, upload_id: str) -> None:
        self.stats.aborted += 1
        with trio.CancelScope(shield=True):
            with trio.move_on_after(ABORT_TIMEOUT) as scope:
                try:
                    await self.store.abort_multipart(key, upload_id)
                    return
                except Exception as e:  # noqa: BLE001 - cleanup must not mask the cause
                    log.warning("abort of multipart upload %s of %s failed: %s; left to the "
                                "bucket lifecycle rule", upload_id, key, e)
            if scope.cancelled_caught:
                log.warning("abort of multipart upload %s of %s timed out after %.0fs",
                            upload_id, key, ABORT_TIMEOUT)
            self.stats.abort_failures += 1


# ----------------------------------------------------------------------------------------------
# chunks


def _decode_chunk(obj: StoredObject, index: int, blob: _Blob) -> _Blob | bytes:
    # _decode checks the raw length too
    raw = _decode(obj, blob, index, index) if obj.compression == "lz4" else blob
    if obj.chunk_crcs is not None:
        c = crc32c(raw)
        if c != obj.chunk_crcs[index]:
            raise crc_mismatch(obj, index, c)
    return raw


async def fetch_chunk(store: ObjectStore, obj: StoredObject, index: int) -> bytes:
    """Raw chunk `index` of `obj` (`chunk_span` gives its place), verified: one ranged GET of
    exactly its stored bytes (its frame for lz4), decompressed and checked against
    `obj.chunk_crcs[index]` in a worker thread (length and frame structure only when the object
    has no chunk CRCs). Raises IntegrityError on any mismatch, IndexError for a chunk that does
    not exist."""
    chunk_span(obj, index)  # range check
    s, n = stored_span(obj, index, index)
    blob = await store.get(obj.key, s, n)
    if len(blob) != n:
        raise IntegrityError(f"{obj.key}: got {len(blob)} stored bytes of chunk {index} at {s}, "
                             f"expected {n}", key=obj.key)
    if obj.compression == "none" and obj.chunk_crcs is None:
        return blob  # nothing to decode or check: skip the thread hop
    return await trio.to_thread.run_sync(_decode_chunk, obj, index, blob)


async def fetch_chunks(store: ObjectStore, obj: StoredObject, first: int,
                       last: int) -> list[bytes | memoryview]:
    """Raw chunks [first, last] of `obj` with ONE ranged GET (fewer, larger requests: on a store
    with a per-request cost, 4 MiB GETs reach a fraction of what 64 MiB GETs do), each chunk
    decoded and verified as by `fetch_chunk`. IntegrityError names the first bad chunk.
    Chunks of an uncompressed object are read-only memoryviews into the one fetched buffer
    (no copy); lz4 chunks are bytes."""
    chunk_span(obj, first)
    chunk_span(obj, last)
    s, n = stored_span(obj, first, last)
    blob = await store.get(obj.key, s, n)
    if len(blob) != n:
        raise IntegrityError(f"{obj.key}: got {len(blob)} stored bytes of chunks {first}.."
                             f"{last} at {s}, expected {n}", key=obj.key)

    def split() -> list[bytes | memoryview]:
        out: list[bytes | memoryview] = []
        view = memoryview(blob).toreadonly()
        for i in range(first, last + 1):
            cs, cn = stored_span(obj, i, i)
            # a view, not a copy: _decode_chunk checks its CRC32C (lz4 decodes it into bytes)
            out.append(_decode_chunk(obj, i, view[cs - s:cs - s + cn]))
        return out

    return await trio.to_thread.run_sync(split)


# ----------------------------------------------------------------------------------------------
# reads


def _decode(obj: StoredObject, blob: bytes | memoryview, first: int, last: int) -> bytes:
    try:
        return b"".join(iter_decompress(
            blob, frames_of(obj)[first:last + 1],
            raw_lengths=[obj.raw_frame_len(i) for i in range(first, last + 1)], first=first))
    except FrameError as e:
        raise IntegrityError(f"{obj.key}: {e}", key=obj.key) from None


async def read_range(store: ObjectStore, obj: StoredObject, offset: int, length: int) -> bytes:
    """Raw bytes [offset, offset+length) of `obj`, clamped to its size: one ranged GET of just
    the stored bytes needed (whole frames for lz4), decompressed in a worker thread."""
    if offset < 0 or length < 0:
        raise ValueError(f"negative range: offset={offset} length={length}")
    end = min(offset + length, obj.size)
    if offset >= end:
        return b""
    if obj.compression == "none":
        data = await store.get(obj.key, offset, end - offset)
        if len(data) != end - offset:
            raise IntegrityError(f"{obj.key}: got {len(data)} bytes at {offset}, expected "
                                 f"{end - offset}", key=obj.key)
        return data
    first, last, s, e = frames_for_range(obj.frame_size, frames_of(obj), offset, end - offset,
                                         offsets=obj.offsets)
    blob = await store.get(obj.key, s, e - s)
    if len(blob) != e - s:
        raise IntegrityError(f"{obj.key}: got {len(blob)} stored bytes at {s}, expected {e - s}",
                             key=obj.key)
    raw = await trio.to_thread.run_sync(_decode, obj, blob, first, last)
    lo = offset - first * obj.frame_size
    if lo == 0 and len(raw) == end - offset:
        return raw
    return raw[lo:lo + end - offset]


@dataclass(frozen=True, slots=True)
class _Range:
    raw_off: int
    raw_len: int
    stored_off: int
    stored_len: int
    first: int      # chunks (= frames for lz4) [first, last]
    last: int


def _plan_ranges(obj: StoredObject, range_size: int) -> list[_Range]:
    # Whole chunks per range (so each chunk's CRC can be checked), as many as fit in range_size
    # raw bytes (at least one): bounded by raw size, so a range of highly compressible frames
    # stays a bounded write too.
    cs = chunk_size_of(obj)
    per = max(1, range_size // cs)
    n = chunk_count(obj)
    out = []
    for first in range(0, n, per):
        last = min(first + per, n) - 1
        raw_off = first * cs
        raw_end = min((last + 1) * cs, obj.size)
        s, sn = stored_span(obj, first, last)
        out.append(_Range(raw_off, raw_end - raw_off, s, sn, first, last))
    return out


def _pwrite_all(fd: int, data: bytes | memoryview, off: int) -> None:
    mv = memoryview(data)
    while mv:
        n = os.pwrite(fd, mv, off)
        mv = mv[n:]
        off += n


def _write_range(fd: int, obj: StoredObject, r: _Range, blob: bytes) -> int:
    """Decode one fetched range, check each chunk's CRC32C (when the object has chunk CRCs),
    write it at its raw offset, return the range's raw CRC32C (folded from its chunks')."""
    if len(blob) != r.stored_len:
        raise IntegrityError(f"{obj.key}: got {len(blob)} bytes at {r.stored_off}, expected "
                             f"{r.stored_len}", key=obj.key)
    crcs = obj.chunk_crcs
    if obj.compression == "none":
        if crcs is None:
            _pwrite_all(fd, blob, r.raw_off)
            return crc32c(blob)
        mv = memoryview(blob)
        crc = pos = 0
        for i in range(r.first, r.last + 1):
            _, n = chunk_span(obj, i)
            c = crc32c(mv[pos:pos + n])
            if c != crcs[i]:
                raise crc_mismatch(obj, i, c)
            crc = crc32c_combine(crc, c, n)
            pos += n
        _pwrite_all(fd, blob, r.raw_off)  # checked before a byte of it lands
        return crc
    crc = 0
    pos = r.raw_off
    try:
        for i, raw in enumerate(
                iter_decompress(blob, frames_of(obj)[r.first:r.last + 1],
                                raw_lengths=[obj.raw_frame_len(i)
                                             for i in range(r.first, r.last + 1)],
                                first=r.first),
                start=r.first):
            c = crc32c(raw)
            if crcs is not None and c != crcs[i]:
                raise crc_mismatch(obj, i, c)
            crc = crc32c_combine(crc, c, len(raw))
            _pwrite_all(fd, raw, pos)
            pos += len(raw)
    except FrameError as e:
        raise IntegrityError(f"{obj.key}: {e}", key=obj.key) from None
    return crc


def _open_dest(path: str | os.PathLike[str], size: int) -> int:
    fd = open_private(path, os.O_WRONLY | os.O_TRUNC)  # a cache file: 0600 (cachemgr.nodefiles)
    try:
        os.ftruncate(fd, size)  # sparse: ranges land in any order
    except BaseException:
        os.close(fd)
        raise
    return fd


async def download_file(store: ObjectStore, obj: StoredObject, dest_path: str | os.PathLike[str], *,
                        range_size: int = DEFAULT_RANGE_SIZE,
                        concurrency: int = DEFAULT_DOWNLOAD_CONCURRENCY,
                        limiter: trio.CapacityLimiter | None = None,
                        progress: Callable[[int], None] | None = None) -> None:
    """Fetch `obj` into `dest_path` (created or truncated to obj.size) with up to `concurrency`
    ranged GETs in flight (and, if given, a token of the shared `limiter` per range), each
    decoded and written with os.pwrite in a worker thread. Ranges are whole chunks; each
    chunk is checked against `obj.chunk_crcs` when present (before an uncompressed range is
    written). Raises IntegrityError if a chunk's or the raw content's CRC32C does not match
    (the caller retries). Does not fsync: the caller owns durability (write to a temp file,
    fsync, rename)."""
    if range_size <= 0 or concurrency < 1:
        raise ValueError(f"range_size and concurrency must be positive "
                         f"({range_size}, {concurrency})")
    ranges = _plan_ranges(obj, range_size)
    crcs: list[int | None] = [None] * len(ranges)
    fd = await trio.to_thread.run_sync(_open_dest, dest_path, obj.size)
    try:
        todo = iter(enumerate(ranges))  # shared by the workers: each takes the next range

        async def worker() -> None:
            for i, r in todo:
                token = object()
                if limiter is not None:
                    await limiter.acquire_on_behalf_of(token)
                try:
                    blob = await store.get(obj.key, r.stored_off, r.stored_len)
                    crcs[i] = await trio.to_thread.run_sync(_write_range, fd, obj, r, blob)
                    del blob
                finally:
                    if limiter is not None:
                        limiter.release_on_behalf_of(token)
                if progress is not None:
                    progress(r.raw_len)

        try:
            async with trio.open_nursery() as nursery:
                for _ in range(min(concurrency, len(ranges))):
                    nursery.start_soon(worker)
        except BaseExceptionGroup as eg:
            e = _unwrap(eg)
            if e is None:
                raise
            raise e from None
    finally:
        os.close(fd)
    total = 0
    for r, c in zip(ranges, crcs, strict=True):
        assert c is not None  # every worker stored its range's CRC, or the nursery raised
        total = crc32c_combine(total, c, r.raw_len)
    if total != obj.crc32c:
        raise IntegrityError(f"{obj.key}: downloaded content has CRC32C {total:08x}, manifest "
                             f"says {obj.crc32c:08x}", key=obj.key)
