"""Moving one cache file into one object: single PUT or multipart, optionally lz4 framed, with
the chunk CRCs computed on the way (downloads: cachemgr.transfer.download).

This module owns the byte movement of one upload and its integrity checks; it does not decide
*what* to upload or when (the scheduler does), and it does not retry (the caller wraps the store
in `RetryingStore`, and retries a whole transfer on `IntegrityError`). What an object is
(`StoredObject`, chunk geometry) lives in `cachemgr.format.objects`, `crc32c_combine` in
`cachemgr.format.decode`.

Threads and state
    Everything here runs on the caller's trio loop except the byte work, which goes to
    `trio.to_thread` workers: an upload's `_Producer.next_part` (pread, CRC, lz4; one call at a
    time per upload, the upload awaits each, so the producer's fields have one user at a time),
    `should_compress` sampling (both at idle CPU and I/O priority: `cachemgr.host.background`, so
    the next checkpoint's save gets the machine first). `UploadStats` and an upload's part
    table are touched only by the loop. Before each part, and between the steps of a staged
    copy, the upload gives way to the trainer (`cachemgr.host.foreground`, the mount's one
    `Foreground`, given at construction). Nothing here is durable: a crash mid-upload leaves at
    most an incomplete multipart upload (the bucket lifecycle rule removes it).

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
    - frame_size 4 MiB and the `auto` threshold: see `cachemgr.format.compress`.

Integrity
    The uploader computes the chunk CRCs on the way (memoryview slices of each part, ~0.5 ms per
    4 MiB) and derives the whole-file CRC32C from them, so the raw bytes are checksummed once;
    readers check them (cachemgr.transfer.download). After completion, `head()` must report the
    stored size (and CRC32C when the store recorded one).
"""

from __future__ import annotations

import errno
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from cachemgr.format.compress import (
    DEFAULT_FRAME_SIZE,
    MODES,
    compress_frame,
    should_compress,
)
from cachemgr.format.decode import crc32c_combine
from cachemgr.format.objects import StoredObject
from cachemgr.host.background import run_idle
from cachemgr.host.foreground import Foreground
from cachemgr.store.base import (
    IntegrityError,
    NotFound,
    ObjectInfo,
    ObjectStore,
    Part,
    RangeCrcs,
    Staged,
    StoreError,
    crc32c,
)

__all__ = ["SourceChanged", "Superseded", "TransferConfig", "UploadStats", "Uploader",
           "unwrap_group"]

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
# A shielded abort must not hang a cancellation forever on a dead store; after this the upload
# is left to the bucket's lifecycle rule (and logged).
ABORT_TIMEOUT = 30.0
# lz4's worst case: incompressible input grows by 1/255 plus a few bytes of block and frame
# headers (64 per frame is generous for 1 MiB blocks in a 4 MiB frame).
_LZ4_FRAME_SLACK = 64


# Files up to this size go to a store that stages files (file://) in two worker-thread hops
# (`Uploader._upload_small`) instead of five: what each hop costs (a thread handoff, the idle
# priority set and reset, ~0.1-0.2 ms of the daemon's CPU) was most of the upload of a 64 KiB
# DCP shard (issue 35). Below COPY_STEP and STAGED_CRC_STEP, so such a copy never pauses.
SMALL_STAGED = 1 << 20

# The CRC pass over a staged copy (file:// stores) goes in steps of this many bytes with the
# same wait between them as the copy's (measured: with only the copy in steps, the daemon still
# used 0.1-0.5 s of CPU during a 0.6 s read of 1 GiB right after its write, 4 readers).
STAGED_CRC_STEP = 16 << 20
# The CRC pass before a native PUT (`Uploader._upload_native`) reads this much per worker-thread
# call: 16 calls per GiB, each ~10 ms of work here, so a superseding write or the trainer is
# seen within that (the same order as a part's read on the buffered path).
NATIVE_CRC_STEP = 64 << 20
# ... read in pieces of this much into one buffer that stays in the CPU's cache: the CRC then
# reads what the copy just wrote from the cache, not from memory. Measured here (1 GiB in the
# page cache, pread + CRC32C): 0.20 CPU-s/GiB with 1 MiB pieces, 0.31 with 64 MiB ones.
NATIVE_CRC_READ = 1 << 20


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


def _crc_step(prod: _Producer, fd: int, buf: bytearray, off: int, n: int, size: int) -> None:
    """The chunk CRCs of bytes [off, off+n) of the file (a worker thread; one buffer of
    NATIVE_CRC_READ reused)."""
    mv = memoryview(buf)
    end = off + n
    while off < end:
        want = min(len(mv), end - off)
        got = 0
        while got < want:
            k = os.preadv(fd, [mv[got:want]], off + got)
            if not k:
                raise SourceChanged(f"cache file ends at byte {off + got}, expected {size}")
            got += k
        off += want
        prod._checksum(mv[:want], off >= size)


def _pread_sample(fd: int, off: int, n: int) -> bytes:
    return os.pread(fd, n, off)


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

    @property
    def crc_raw(self) -> int:
        """CRC32C of the raw bytes checksummed so far (the whole file's once they all are),
        folded from the completed chunks and the one being filled."""
        return crc32c_combine(self._done_crc, self._cur_crc, self._cur_len)

    def range_crcs(self) -> RangeCrcs:
        """The CRC32C of any range of whole chunks, folded from the chunk CRCs (once the file
        is checksummed whole: `put_file` sends parts of whole chunks)."""
        cs, crcs, size = self.frame_size, self.chunk_crcs, self.size

        def crc(off: int, n: int) -> int | None:
            if off % cs or (n % cs and off + n != size) or off + n > size or \
                    len(crcs) != -(-size // cs):
                return None
            out = 0
            for i in range(off // cs, -(-(off + n) // cs)):
                out = crc32c_combine(out, crcs[i], min(cs, size - i * cs))
            return out

        return RangeCrcs(cs, crc)

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

    # Raw bytes one call of `next_part` works through at most when compressing: a part of very
    # compressible data covers far more raw bytes than its stored target (a file of zeros, such
    # as one just laid out with fallocate, is one part), and a worker thread cannot be
    # cancelled. Between calls the upload checks `still_valid`, trio cancellation and the
    # trainer (`Foreground.yield_to`), so an upload superseded by the next write-open stops
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
    native: int = 0      # whole files PUT by the store's native client (s3:// with awscrt)
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


def unwrap_group(eg: BaseExceptionGroup) -> BaseException | None:
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
                 parts_limiter: trio.CapacityLimiter | None = None, *,
                 foreground: Foreground | None = None) -> None:
        self.store = store
        self.cfg = cfg or TransferConfig()
        self.parts_limiter = parts_limiter
        # whom uploads give way to (cachemgr.host.foreground); None: nobody (a tool's upload)
        self._foreground = foreground if foreground is not None else Foreground()
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
        path = os.fspath(path)
        try:
            if size <= SMALL_STAGED and self.cfg.stage_files and self.store.stages_files and \
                    self.cfg.compress != "lz4":
                obj = await self._upload_small(path, key, size, still_valid, progress)
                if obj is not None:
                    return obj
                # to be compressed: the part path below (the sample is taken again)
            fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                return await self._upload(fd, key, size, still_valid, progress)
            finally:
                os.close(fd)
        except SourceChanged:
            # A file that shrank under us is a superseded one if the caller says so.
            self._check(still_valid, key)
            raise

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
        # The wait is scaled to the bytes to move (cachemgr.host.foreground): a small file
        # waits milliseconds, a file of a part or more the whole MAX_DEFER_S.
        await self._foreground.yield_to(size)
        compressed = await self._decide(fd, size)
        if not compressed and cfg.stage_files and self.store.stages_files:
            return await self._upload_staged(fd, key, size, still_valid, progress)
        if not compressed and size and self.store.sends_files:
            return await self._upload_native(fd, key, size, still_valid, progress)
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

    async def _upload_small(self, path: str, key: str, size: int,
                            still_valid: Callable[[], bool],
                            progress: Callable[[int], None] | None) -> StoredObject | None:
        """A file of at most SMALL_STAGED bytes to a store that copies local files in whole
        (file://): the `_upload_staged` path in two worker-thread hops instead of five (the
        open, the compressibility sample, the copy and its CRCs in one `stage_path`; the
        rename and the object's info in one `publish_staged`), with the same checks in the same
        order. None (nothing staged) if the sample says compress."""
        cfg = self.cfg
        await self._foreground.yield_to(size)
        self._check(still_valid, key)
        prod = _Producer(-1, size, False, cfg.frame_size, math.inf)

        def skip(fd: int) -> bool:  # in the store's worker thread: compress it instead?
            if size == 0 or cfg.compress == "off":
                return False
            return run_idle(should_compress, lambda off, n: _pread_sample(fd, off, n), size)

        def inspect(mv: memoryview) -> int:  # one step: the copy is below STAGED_CRC_STEP
            prod._checksum(mv, True)
            return prod.crc_raw

        staged = await self.store.stage_path(key, path, size, inspect, skip)
        if staged is None:
            return None
        self.stats.uploads += 1
        return await self._publish_copy(staged, prod, key, size, still_valid, progress)

    async def _upload_staged(self, fd: int, key: str, size: int,
                             still_valid: Callable[[], bool],
                             progress: Callable[[int], None] | None) -> StoredObject:
        """An uncompressed file to a store that copies local files in whole (file://): the
        kernel copies it (no read into buffers, no parts), the chunk CRCs are computed over the
        copy, and the copy is published only if the source did not change meanwhile (the check
        follows the copy, as it follows each part's read on the other path)."""
        cfg = self.cfg
        await self._foreground.yield_to(size)
        self._check(still_valid, key)
        prod = _Producer(fd, size, False, cfg.frame_size, math.inf)

        def pause() -> None:  # in the store's worker thread, between steps of the work
            trio.from_thread.check_cancelled()  # an unmount stops the copy here (tmp removed)
            trio.from_thread.run(self._foreground.yield_to)

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
        return await self._publish_copy(staged, prod, key, size, still_valid, progress)

    async def _publish_copy(self, staged: Staged, prod: _Producer, key: str, size: int,
                            still_valid: Callable[[], bool],
                            progress: Callable[[int], None] | None) -> StoredObject:
        """Publish a staged copy whose CRCs `prod` holds, if the source did not change (else
        discard it); the store's read-back after the rename stands for the HEAD."""
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
        self.stats.staged += 1
        return await self._finish_whole(prod, key, size, still_valid, progress, info,
                                        read_back=info)

    async def _upload_native(self, fd: int, key: str, size: int,
                             still_valid: Callable[[], bool],
                             progress: Callable[[int], None] | None) -> StoredObject:
        """An uncompressed file to a store whose client reads local files itself (s3:// over
        http:// by sendfile, cachemgr.store.plainhttp; with awscrt, cachemgr.store.crt): the
        chunk CRCs are computed first, in steps of NATIVE_CRC_STEP (read in pieces of
        NATIVE_CRC_READ into one reused buffer; idle priority, `still_valid` and the trainer
        between steps), then the client PUTs the file (multipart and parallel parts inside
        it), then `still_valid` is asked again: a file written meanwhile makes the upload
        Superseded (the object, under this version's key that no manifest will name, is
        deleted). The checks bracket the PUT as they bracket each part's read on the other
        path, so the CRC32Cs recorded are those of the bytes sent."""
        self._check(still_valid, key)
        prod = _Producer(fd, size, False, self.cfg.frame_size, math.inf)
        buf = bytearray(min(size, NATIVE_CRC_READ))
        off = 0
        while off < size:
            n = min(NATIVE_CRC_STEP, size - off)
            await self._foreground.yield_to(n)
            await trio.to_thread.run_sync(run_idle, _crc_step, prod, fd, buf, off, n, size)
            off += n
            self._check(still_valid, key)
        del buf
        try:
            info = await self.store.put_file(key, fd, size, prod.crc_raw, prod.range_crcs(),
                                              self._foreground.yield_to)
        except StoreError:
            self._check(still_valid, key)  # written under the PUT: superseded, not failed
            raise
        if not still_valid():
            self.stats.superseded += 1
            with trio.CancelScope(shield=True), trio.move_on_after(ABORT_TIMEOUT):
                try:
                    await self.store.delete(key)
                except StoreError as e:
                    log.warning("superseded upload %s left in the store: %s", key, e)
            raise Superseded(key)
        self.stats.native += 1
        return await self._finish_whole(prod, key, size, still_valid, progress, info)

    async def _finish_whole(self, prod: _Producer, key: str, size: int,
                            still_valid: Callable[[], bool],
                            progress: Callable[[int], None] | None, info: ObjectInfo,
                            read_back: ObjectInfo | None = None) -> StoredObject:
        """The end of an upload the store took whole (staged or native): all `size` raw
        bytes stored as they are, one PUT, then `_finish`."""
        prod.raw_off = prod.stored = size
        prod.crc_stored = prod.crc_raw
        self.stats.single_puts += 1
        if progress is not None:
            progress(size)
        job = _Job(key, prod, trio.Semaphore(1), still_valid, progress)
        return await self._finish(job, size, False, info, read_back=read_back)

    async def _next_chunk(self, job: _Job) -> tuple[_Chunk, object]:
        """Once the trainer pauses (or waited long enough) and a part token is free, read the
        next part in a worker thread and ask `still_valid`. The token is the caller's to give
        back, after the part's buffer is dropped."""
        prod = job.prod
        await self._foreground.yield_to(int(min(prod.target, prod.size - prod.raw_off)))
        token = await self._acquire(job.sem)
        try:
            while True:
                chunk = await trio.to_thread.run_sync(run_idle, job.prod.next_part)
                self._check(job.still_valid, job.key)
                if chunk is not None:
                    break
                await self._foreground.yield_to()  # a step of a long part: a checkpoint between
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
            e = unwrap_group(eg)
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

    async def _finish(self, job: _Job, size: int, compressed: bool, info: ObjectInfo,
                      read_back: ObjectInfo | None = None) -> StoredObject:
        """Check what the store says it holds (`read_back`: what it read back when it
        published, ObjectStore.publish_staged; else a HEAD), count the upload, describe the
        object."""
        key, prod, st, cfg = job.key, job.prod, self.stats, self.cfg
        head = read_back if read_back is not None else await self.store.head(key)
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
