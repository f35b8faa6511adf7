"""Moving one object (or part of one) into the cache: ranged reads, verified chunk fetches and
parallel verified downloads of whole files (uploads: cachemgr.transfer.upload). It decides
neither what nor when (cachemgr.restore does) and does not retry (the caller wraps the store in
`RetryingStore`, and retries on `IntegrityError`).

Threads and state
    Everything here runs on the caller's trio loop except the byte work, which goes to
    `trio.to_thread` workers: a download's `_write_range` and chunk decoding (each worker thread
    gets its own range and writes only that range's bytes of the destination file; the
    per-range CRCs are stored by the loop, after the thread returns). Nothing here is durable:
    a crash mid-download leaves a partial destination file, which the caller wrote to a temp
    name it discards.

Memory bound
    downloads: concurrency x (range_size + one raw frame)   (defaults: 8 x 64 MiB = 512 MiB)
    range_size 64 MiB and concurrency 8: measured with the upload defaults
    (cachemgr.transfer.upload "Defaults and why"), downstream.

Integrity
    `StoredObject.crc32c` (the raw content's CRC32C) is checked end to end by `download_file`
    after decompression: ranges are fetched and written in any order, each range's raw CRC32C
    is computed in the worker thread that decodes it, and the per-range values are folded in
    order (`ObjectCheck`), so the file is never re-read. Every stored byte is decoded and
    checked by cachemgr.format.decode (the one decoder; its DecodeError becomes IntegrityError
    here). `read_range` checks lengths, frame structure and the CRCs of the whole chunks it
    fetched (a partial uncompressed chunk has only its length to check); `download_file`,
    `download_chunk` and `download_chunks` are verified paths: `download_chunk` fetches one chunk
    (see
    `cachemgr.format.objects` "Chunks") with one ranged GET and checks it against `chunk_crcs`, so a
    read is served as soon as its range is in, and `download_file` checks every chunk it
    writes (the uploader computed them on the way: cachemgr.transfer.upload).
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

from cachemgr.format.compress import frames_for_range
from cachemgr.format.decode import (
    DecodeError,
    ObjectCheck,
    crc32c_combine,
    decode_chunk,
    decode_chunks,
    iter_chunks,
)
from cachemgr.format.objects import (
    StoredObject,
    chunk_at,
    chunk_count,
    chunk_size_of,
    chunk_span,
    frames_of,
    stored_span,
)
from cachemgr.host.nodefiles import open_private
from cachemgr.store.base import IntegrityError, ObjectStore
from cachemgr.transfer.upload import unwrap_group

__all__ = ["download_chunk", "download_chunks", "download_file", "read_range"]

MiB = 1 << 20
DEFAULT_RANGE_SIZE = 64 * MiB
DEFAULT_DOWNLOAD_CONCURRENCY = 8

# ----------------------------------------------------------------------------------------------
# chunks


def _integrity(obj: StoredObject, e: DecodeError) -> IntegrityError:
    """The decoder's error as the daemon's (a read answers EIO; the caller may re-read), with
    the CRC32C values for the log."""
    return IntegrityError(f"{e}{e.detail}", key=obj.key)


def _decode_chunk(obj: StoredObject, index: int, blob: bytes | memoryview) -> bytes | memoryview:
    try:
        return decode_chunk(obj.key, chunk_at(obj, index), blob, lz4=obj.compression == "lz4")
    except DecodeError as e:
        raise _integrity(obj, e) from None


async def download_chunk(store: ObjectStore, obj: StoredObject, index: int) -> bytes:
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
    return bytes(await trio.to_thread.run_sync(_decode_chunk, obj, index, blob))


async def _get_mapped(store: ObjectStore, obj: StoredObject, start: int, n: int) -> mmap.mmap:
    """Stored bytes [start, start+n) of `obj` through the store's native client (s3:// with
    awscrt, cachemgr.store.crt), written by it into an anonymous memory file and handed back
    mapped read-only: no Python touches the bytes on their way in (a GET into memory through
    the CRT's per-read callback cost 2.6-3.1 CPU-s/GiB here, boto3's 1.4). The memory file is
    this call's alone, so nothing truncates it under the mapping; the mapping lives as long as
    the views into it (the chunks `download_chunks` returns)."""
    fd = os.memfd_create("ckptfs-chunks", os.MFD_CLOEXEC)
    try:
        await store.get_file(obj.key, fd, start, n)
        got = os.fstat(fd).st_size
        if got != n:
            raise IntegrityError(f"{obj.key}: got {got} stored bytes at {start}, expected {n}",
                                 key=obj.key)
        return mmap.mmap(fd, n, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


async def download_chunks(store: ObjectStore, obj: StoredObject, first: int,
                       last: int) -> list[bytes | memoryview]:
    """Raw chunks [first, last] of `obj` with ONE ranged GET (fewer, larger requests: on a store
    with a per-request cost, 4 MiB GETs reach a fraction of what 64 MiB GETs do), each chunk
    decoded and verified as by `download_chunk`. IntegrityError names the first bad chunk.
    Chunks of an uncompressed object are read-only memoryviews into the one fetched buffer
    (no copy; on the native data path a read-only mapping of the memory file the store's
    client wrote, `_get_mapped`); lz4 chunks are bytes."""
    chunk_span(obj, first)
    chunk_span(obj, last)
    s, n = stored_span(obj, first, last)
    blob: bytes | mmap.mmap
    if obj.compression == "none" and store.gets_files:
        blob = await _get_mapped(store, obj, s, n)
    else:
        blob = await store.get(obj.key, s, n)
    if len(blob) != n:
        raise IntegrityError(f"{obj.key}: got {len(blob)} stored bytes of chunks {first}.."
                             f"{last} at {s}, expected {n}", key=obj.key)

    def split() -> list[bytes | memoryview]:
        # views, not copies, of an uncompressed blob (lz4 decodes each chunk into bytes)
        chunks = [chunk_at(obj, i) for i in range(first, last + 1)]
        try:
            return [raw for _, raw, _ in iter_chunks(obj.key, memoryview(blob).toreadonly(),
                                                      chunks, lz4=obj.compression == "lz4")]
        except DecodeError as e:
            raise _integrity(obj, e) from None

    return await trio.to_thread.run_sync(split)


# ----------------------------------------------------------------------------------------------
# reads


def _decode(obj: StoredObject, blob: bytes | memoryview, first: int, last: int) -> bytes:
    try:
        return decode_chunks(obj.key, blob, [chunk_at(obj, i) for i in range(first, last + 1)],
                             lz4=True)
    except DecodeError as e:
        raise _integrity(obj, e) from None


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
    """Decode one fetched range chunk by chunk, each checked (its CRC32C when the object has
    chunk CRCs) before it is written at its raw offset, one decoded chunk held at a time;
    return the range's raw CRC32C (folded from its chunks')."""
    if len(blob) != r.stored_len:
        raise IntegrityError(f"{obj.key}: got {len(blob)} bytes at {r.stored_off}, expected "
                             f"{r.stored_len}", key=obj.key)
    chunks = [chunk_at(obj, i) for i in range(r.first, r.last + 1)]
    crc = 0
    try:
        for c, raw, ccrc in iter_chunks(obj.key, blob, chunks, lz4=obj.compression == "lz4"):
            _pwrite_all(fd, raw, c.raw_off)
            crc = crc32c_combine(crc, ccrc, c.raw_len)
    except DecodeError as e:
        raise _integrity(obj, e) from None
    return crc


def _open_dest(path: str | os.PathLike[str], size: int, readback: bool = False) -> int:
    # readback: the native path reads what its client wrote to check it
    fd = open_private(path, (os.O_RDWR if readback else os.O_WRONLY) | os.O_TRUNC)  # 0600
    try:
        os.ftruncate(fd, size)  # sparse: ranges land in any order
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_range(mm: mmap.mmap, obj: StoredObject, r: _Range) -> int:
    """Pass one range of a file the store's native client wrote through the decoder's gate
    (every chunk's length and CRC32C), read through a read-only mapping (no copy: a pread
    into a buffer cost 0.3 CPU-s per GiB here, the CRC32C itself under 0.1); its raw CRC32C."""
    chunks = [chunk_at(obj, i) for i in range(r.first, r.last + 1)]
    crc = 0
    err = None
    with memoryview(mm) as whole, whole[r.stored_off:r.stored_off + r.stored_len] as mv:
        try:
            for item in iter_chunks(obj.key, mv, chunks, lz4=False):
                crc = crc32c_combine(crc, item[2], item[0].raw_len)
                del item  # a view into the mapping: none may outlive this call
        except DecodeError as e:
            # raised after the views are released: the error's traceback holds this frame,
            # and a view in it would keep the mapping from closing
            err = _integrity(obj, e)
    if err is not None:
        raise err
    return crc


async def _download_native(store: ObjectStore, obj: StoredObject,
                           dest_path: str | os.PathLike[str], ranges: list[_Range],
                           limiter: trio.CapacityLimiter | None,
                           progress: Callable[[int], None] | None) -> None:
    """An uncompressed object through the store's native client (s3:// with awscrt,
    cachemgr.store.crt): it GETs the object in parallel ranges straight into the destination
    file, then every range is read back and checked (each chunk's CRC32C, the object's, the
    size) before this returns: the caller marks the file cached only then, so no byte is served
    unchecked; a file that fails is truncated to 0. One token of `limiter` is held for the
    download (the client bounds its own connections and buffers)."""
    token = object()
    if limiter is not None:
        await limiter.acquire_on_behalf_of(token)
    try:
        fd = await trio.to_thread.run_sync(_open_dest, dest_path, obj.size, True)
        try:
            await store.get_file(obj.key, fd, 0, obj.size)
            size = os.fstat(fd).st_size
            if size != obj.size:
                raise IntegrityError(f"{obj.key}: downloaded {size} bytes, the manifest says "
                                     f"{obj.size}", key=obj.key)
            check = ObjectCheck(obj.key, obj.size, obj.crc32c)
            # Mapped, not read: the file is this download's alone (its caller holds the file's
            # lock, cachemgr.core.filecache; nothing truncates it under the mapping) and its
            # size was just checked.
            with mmap.mmap(fd, obj.size, access=mmap.ACCESS_READ) as mm:
                for r in ranges:
                    check.add(await trio.to_thread.run_sync(_check_range, mm, obj, r),
                              r.raw_len)
                    if progress is not None:
                        progress(r.raw_len)
            try:
                check.finish()
            except DecodeError as e:
                raise _integrity(obj, e) from None
        except BaseException:
            os.ftruncate(fd, 0)  # nothing unchecked stays behind
            raise
        finally:
            os.close(fd)
    finally:
        if limiter is not None:
            limiter.release_on_behalf_of(token)


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
    if obj.compression == "none" and obj.size and store.gets_files:
        await _download_native(store, obj, dest_path, ranges, limiter, progress)
        return
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
            e = unwrap_group(eg)
            if e is None:
                raise
            raise e from None
    finally:
        os.close(fd)
    check = ObjectCheck(obj.key, obj.size, obj.crc32c)
    for r, c in zip(ranges, crcs, strict=True):
        assert c is not None  # every worker stored its range's CRC, or the nursery raised
        check.add(c, r.raw_len)
    try:
        check.finish()
    except DecodeError as e:
        raise _integrity(obj, e) from None
