"""The one decoder of stored objects: an object's stored bytes in, its raw bytes out, checked.

Every reader of objects goes through it: the daemon's chunk fetches and whole downloads
(cachemgr.transfer.download), `ckptfs restore` and `ckptfs fsck --verify`
(cachemgr.format.resumable, cachemgr.format.storeread) and scripts/ckpt_restore.py (storeread,
cachemgr.format.restoreto). Standard library, lz4 and crc32c only: nothing of cachemgr.store,
no trio (the script runs from a copy of the modules it names).

What it owns (docs/FORMAT.md "Compressed objects", "Chunk checksums"):

  * `Layout`, `Chunk`: the chunks of an object description (a chunk of an lz4 object is
    exactly one frame; an uncompressed object without chunk CRCs is cut into READ_BYTES
    pieces, checked by length only);
  * `ChunkDecoder`: one chunk, fed its stored bytes in pieces of any size, checked as they
    come: never more stored bytes than the chunk has; lz4 output bounded while it is produced
    (lz4 is never asked for more than what is left of the chunk's raw length plus one byte,
    whatever the frame's header claims: an "lz4 bomb" costs no memory); one complete frame with
    nothing after it; exactly its raw length; its CRC32C;
  * two forms of it: in memory (`decode_chunk`, `iter_chunks`, `decode_chunks`: a fetched
    buffer, each lz4 chunk decoded in one lz4 call, an uncompressed chunk a view of the buffer,
    no copy; every check done before a chunk is handed out), for the daemon; and streaming
    (`stream_chunk`: READ_BYTES stored bytes read at a time, raw pieces of at most READ_BYTES
    handed out as they are produced, the chunk's CRC checked after its last piece), for the
    tools, whose memory must not grow with the chunk size;
  * `ObjectCheck`: the chunks' CRC32Cs folded (`crc32c_combine`) into the whole-object
    CRC32C and size check, so no byte is checksummed twice.

Errors: `DecodeError` (a ValueError), one line naming the key and the chunk or frame (the same
words the tools always printed), with the CRC32C values in `detail`. Each
caller turns it into its own error (IntegrityError in the daemon: a read answers EIO;
CorruptError in the tools: exit 3 or 10). Every check is an explicit exception, never
`assert`: `python -O` behaves the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import crc32c as _crc32c
import lz4.frame

try:  # optional: the CRT's CRC32C, ~1.6x the crc32c package's speed here (0.05 against 0.08
    # CPU-s/GiB, docs/PERFORMANCE.md "Where the CPU goes"); the same values
    from awscrt.checksums import crc32c as _fast_crc32c
except ImportError:  # pragma: no cover - the stdlib-and-crc32c install (cachemgr.format)
    _fast_crc32c = None

READ_BYTES = 4 << 20  # streaming: the most read from the store, or handed out, at a time

_IDLE_CALLS = 16  # lz4 calls in a row that produce nothing before a frame is "stuck"


class DecodeError(ValueError):
    """Stored bytes that are not what their description says: `str()` is the one line a tool
    shows; `detail` (the CRC32C values) is added by the daemon to what it logs."""

    def __init__(self, msg: str, detail: str = "") -> None:
        super().__init__(msg)
        self.detail = detail


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32C (Castagnoli), hardware-accelerated."""
    if _fast_crc32c is not None:
        return int(_fast_crc32c(data, value))
    out: int = _crc32c.crc32c(data, value)
    return out


# ----------------------------------------------------------------------------------------------
# CRC32C combine: crc(A || B) from crc(A), crc(B) and len(B). zlib's crc32_combine (1.2.12+
# algorithm: multiply by x^(8*len2) modulo the polynomial) with the Castagnoli polynomial;
# CRC32C has the same reflected form and all-ones pre/post conditioning as CRC-32.

_POLY = 0x82F63B78  # CRC32C, reflected


def _multmodp(a: int, b: int) -> int:
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _make_x2n() -> list[int]:
    table = [0] * 32
    p = 1 << 30  # x^1
    table[0] = p
    for n in range(1, 32):
        p = table[n] = _multmodp(p, p)
    return table


_X2N = _make_x2n()  # x^(2^n) mod P


def _x2nmodp(n: int, k: int) -> int:
    p = 1 << 31  # x^0 == 1
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


@functools.lru_cache(maxsize=64)
def _shift_for(len2: int) -> int:
    return _x2nmodp(len2, 3)  # x^(8*len2) mod P: the same few lengths (chunks, ranges) recur


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of A||B given crc1 = crc32c(A), crc2 = crc32c(B), len2 = len(B) (~10 us)."""
    return _multmodp(_shift_for(len2), crc1) ^ crc2


# ----------------------------------------------------------------------------------------------
# chunks


class Chunk(NamedTuple):
    """One chunk of an object: its raw and stored place, and its CRC32C (None: no chunk CRCs,
    checked by length and lz4 structure only)."""

    number: int
    raw_off: int
    raw_len: int
    stored_off: int
    stored_len: int
    crc: int | None


class Layout:
    """The chunks of one object description (fields as in docs/FORMAT.md, already validated):
    for lz4 its frames; else its chunks of `chunk_size` when it has chunk CRCs, else pieces of
    READ_BYTES."""

    __slots__ = ("compressed", "count", "crcs", "offsets", "size", "step")

    def __init__(self, size: int, compression: str, frame_size: int,
                 frames: Sequence[int] | None, chunk_size: int,
                 chunk_crcs: Sequence[int] | None) -> None:
        self.size, self.crcs = size, chunk_crcs
        self.compressed = compression == "lz4"
        self.offsets: list[int] | None = None
        if self.compressed:
            if frames is None or frame_size <= 0:
                raise DecodeError("an lz4 object needs frames and a frame size")
            self.step = frame_size
            self.count = len(frames)
            acc, self.offsets = 0, [0]
            for n in frames:
                acc += n
                self.offsets.append(acc)
        else:
            self.step = chunk_size if chunk_crcs is not None and chunk_size > 0 else READ_BYTES
            self.count = -(-size // self.step)

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Layout:
        """The layout of a validated object description (a manifest's `files[].object`)."""
        return cls(obj["size"], obj["compression"], obj.get("frame_size") or 0,
                   obj.get("frames"), obj.get("chunk_size") or 0, obj.get("chunk_crcs"))

    def chunk(self, i: int) -> Chunk:
        if not 0 <= i < self.count:
            raise IndexError(f"no chunk {i} in {self.count}")
        raw = i * self.step
        n = min(self.step, self.size - raw)
        crc = self.crcs[i] if self.crcs is not None else None
        if self.offsets is not None:
            s = self.offsets[i]
            return Chunk(i, raw, n, s, self.offsets[i + 1] - s, crc)
        return Chunk(i, raw, n, raw, n, crc)

    def __iter__(self) -> Iterator[Chunk]:
        return (self.chunk(i) for i in range(self.count))


# ----------------------------------------------------------------------------------------------
# one chunk


class ChunkDecoder:
    """Chunk `chunk` of object `key`, fed its stored bytes in pieces of any size (`feed`, which
    yields the raw bytes as they are produced, each piece at most `max_out` bytes), then
    `finish` (every check that needs the whole chunk; returns its raw CRC32C). DecodeError at
    the first problem."""

    __slots__ = ("_d", "chunk", "crc", "got", "key", "max_out", "stored")

    def __init__(self, key: str, chunk: Chunk, *, lz4: bool, max_out: int = 0) -> None:
        self.key, self.chunk = key, chunk
        self.max_out = max_out if max_out > 0 else READ_BYTES
        self.got = self.stored = self.crc = 0
        self._d = _decompressor() if lz4 else None
        if not lz4 and chunk.stored_len != chunk.raw_len:
            raise DecodeError(f"{key}: chunk {chunk.number} is {chunk.stored_len} stored bytes "
                              f"for {chunk.raw_len} raw ones, uncompressed")

    def _what(self) -> str:
        return f"{self.key}: {'frame' if self._d is not None else 'chunk'} {self.chunk.number}"

    def feed(self, piece: bytes | memoryview) -> Iterator[bytes | memoryview]:
        """The raw bytes `piece` (the next stored bytes of the chunk) decodes to, checked so
        far: never more than the chunk's stored or raw length."""
        self.stored += len(piece)
        if self.stored > self.chunk.stored_len:
            raise DecodeError(f"{self._what()}: more than its {self.chunk.stored_len} stored "
                              "bytes")
        d = self._d
        if d is None:
            self.crc = crc32c(piece, self.crc)
            self.got += len(piece)
            if piece:
                yield piece
            return
        try:
            if d.eof:
                raise DecodeError(f"{self._what()} has {len(piece)} bytes of trailing data")
            out = d.decompress(piece, max_length=self._ask())
            idle = 0
            while True:
                if out:
                    self._count(out)
                    yield out
                if d.eof or d.needs_input:
                    break
                out = d.decompress(b"", max_length=self._ask())  # output pending: take it
                idle = idle + 1 if not out else 0
                if idle > _IDLE_CALLS:
                    raise DecodeError(f"{self._what()} makes no progress")
            if d.eof and d.unused_data:
                raise DecodeError(f"{self._what()} has {len(d.unused_data)} bytes of trailing "
                                  "data")
        except DecodeError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever lz4 makes of hostile bytes
            msg = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
            raise DecodeError(f"{self._what()} is not an lz4 frame ({msg})") from None

    def _ask(self) -> int:
        # What is left of the raw length, plus one byte to see a frame that holds more.
        return min(self.max_out, self.chunk.raw_len - self.got + 1)

    def _count(self, out: bytes) -> None:
        self.got += len(out)
        if self.got > self.chunk.raw_len:
            raise DecodeError(f"{self._what()} decompresses to more than the "
                              f"{self.chunk.raw_len} bytes the manifest states")
        self.crc = crc32c(out, self.crc)

    def finish(self) -> int:
        """Every check of the whole chunk: all its stored bytes, a frame that ended, exactly its
        raw length, its CRC32C. Returns the raw CRC32C."""
        c = self.chunk
        if self.stored != c.stored_len:
            raise DecodeError(f"{self._what()}: {self.stored} of its {c.stored_len} stored "
                              "bytes")
        if self._d is not None and not self._d.eof:
            raise DecodeError(f"{self._what()} does not end after its {self.got} bytes "
                              "(truncated, or more data than stated)")
        if self.got != c.raw_len:
            raise DecodeError(f"{self._what()} decompressed to {self.got} bytes, expected "
                              f"{c.raw_len}")
        if c.crc is not None and self.crc != c.crc:
            raise DecodeError(f"{self.key}: chunk {c.number} CRC32C mismatch",
                              f" (raw bytes [{c.raw_off}, {c.raw_off + c.raw_len})): "
                              f"{self.crc:08x}, the manifest says {c.crc:08x}")
        return self.crc


def _decompressor() -> Any:
    """A fresh lz4 frame decompressor (lz4 has no types)."""
    return lz4.frame.LZ4FrameDecompressor()


# ----------------------------------------------------------------------------------------------
# in memory (the daemon)


def decode_chunk(key: str, chunk: Chunk, stored: bytes | memoryview, *,
                 lz4: bool) -> bytes | memoryview:
    """The raw bytes of `chunk`, whose stored bytes are all of `stored`, every check done:
    one lz4 call for a frame; an uncompressed chunk is `stored` itself (no copy)."""
    dec = ChunkDecoder(key, chunk, lz4=lz4, max_out=chunk.raw_len + 1)
    out = list(dec.feed(stored))
    dec.finish()
    if len(out) == 1:
        return out[0]
    return b"".join(out)


def iter_chunks(key: str, blob: bytes | memoryview, chunks: Sequence[Chunk], *,
                lz4: bool) -> Iterator[tuple[Chunk, bytes | memoryview, int]]:
    """(chunk, raw bytes, raw CRC32C) of consecutive `chunks` whose stored bytes are exactly
    `blob`, one chunk at a time (a caller writes each one before the next is decoded), each
    checked before it is handed out. Uncompressed chunks are views into `blob`."""
    mv = memoryview(blob)
    want = sum(c.stored_len for c in chunks)
    if len(mv) != want:
        raise DecodeError(f"{key}: {len(mv)} stored bytes for chunks of {want}")
    pos = 0
    for c in chunks:
        piece = mv[pos:pos + c.stored_len]
        pos += c.stored_len
        dec = ChunkDecoder(key, c, lz4=lz4, max_out=c.raw_len + 1)
        out = list(dec.feed(piece))
        crc = dec.finish()
        yield c, out[0] if len(out) == 1 else b"".join(out), crc


def decode_chunks(key: str, blob: bytes | memoryview, chunks: Sequence[Chunk], *,
                  lz4: bool) -> bytes:
    """The raw bytes of consecutive `chunks` whose stored bytes are exactly `blob`, joined."""
    return b"".join(raw for _, raw, _ in iter_chunks(key, blob, chunks, lz4=lz4))


# ----------------------------------------------------------------------------------------------
# streaming (the tools)


def stream_chunk(read: Callable[[int, int], bytes | memoryview], dec: ChunkDecoder,
                 step: int = 0) -> Iterator[bytes | memoryview]:
    """The raw bytes of `dec`'s chunk, read from `read(offset, n)` (the object's stored bytes)
    at most `step` (default READ_BYTES) bytes at a time and handed out as they are decoded,
    each piece at most `dec.max_out` bytes; `dec.finish()` is called after the last one (its
    CRC32C is then `dec.crc`). DecodeError at the first problem."""
    step = step if step > 0 else READ_BYTES
    pos = dec.chunk.stored_off
    end = pos + dec.chunk.stored_len
    while pos < end:
        piece = read(pos, min(step, end - pos))
        if not piece:
            raise DecodeError(f"{dec.key}: the object ends at {pos} stored bytes")
        pos += len(piece)
        yield from dec.feed(piece)
    dec.finish()


# ----------------------------------------------------------------------------------------------
# the whole object


class ObjectCheck:
    """The whole-object check: the raw CRC32C and length of each chunk, added in order, folded
    into the object's; `finish` compares them with the description's."""

    __slots__ = ("crc", "key", "n", "size", "want")

    def __init__(self, key: str, size: int, crc: int) -> None:
        self.key, self.size, self.want = key, size, crc
        self.n = self.crc = 0

    def add(self, crc: int, raw_len: int) -> None:
        self.crc = crc32c_combine(self.crc, crc, raw_len)
        self.n += raw_len

    def finish(self) -> None:
        if self.n != self.size:
            raise DecodeError(f"{self.key}: {self.n} raw bytes, the manifest says {self.size}")
        if self.crc != self.want:
            raise DecodeError(f"{self.key}: CRC32C mismatch",
                              f": the downloaded content has {self.crc:08x}, the manifest "
                              f"says {self.want:08x}")
