"""Uploads, ranged reads and verified downloads of one file (cachemgr.transfer.upload,
cachemgr.transfer.download, cachemgr.format.compress, cachemgr.format.decode), against both real
backends: a file:// directory and S3 over HTTP (moto_server on loopback).

Parts are 5 MiB (S3's minimum) and lz4 frames 1 MiB so that multipart uploads, several frames
per part and frame-crossing reads all happen on small files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import resource
from pathlib import Path

import lz4.frame
import numpy as np
import pytest
import trio

from cachemgr.format import compress
from cachemgr.format.decode import (
    Chunk,
    DecodeError,
    crc32c_combine,
    decode_chunk,
    decode_chunks,
)
from cachemgr.format.objects import (
    StoredObject,
    chunk_count,
    chunk_span,
    verify_chunk,
)
from cachemgr.host.foreground import Foreground
from cachemgr.store import (
    IntegrityError,
    LocalStore,
    NotFound,
    RetryingStore,
    RetryPolicy,
    crc32c,
)
from cachemgr.store.s3 import S3Options, S3Store
from cachemgr.store.wrappers import _Wrapper
from cachemgr.transfer import upload
from cachemgr.transfer.download import download_chunk, download_file, read_range
from cachemgr.transfer.upload import Superseded, TransferConfig, Uploader, _Producer
from tests.faultstore import FaultyStore

PART = 5 << 20
FRAME = 1 << 20
SIZES = [0, 1, PART - 1, PART, 3 * PART + 123]


def cfg(**kw) -> TransferConfig:
    # stage_files off: these tests are of the part machinery, on both stores; the file://
    # whole-file copy has its own tests (test_staged_*)
    base = {"part_size": PART, "max_parts_in_flight": 4, "compress": "off", "frame_size": FRAME,
            "stage_files": False}
    base.update(kw)
    return TransferConfig(**base)


class Env:
    """A store under test, plus a way to see its pending multipart uploads."""

    def __init__(self, kind: str, store, pending) -> None:
        self.kind = kind
        self.store = store
        self.pending = pending


@pytest.fixture(params=["file", "s3"])
def env(request, tmp_path) -> Env:
    if request.param == "file":
        store = LocalStore(tmp_path / "store")
        return Env("file", store, lambda: sorted(os.listdir(tmp_path / "store" / "multipart")))
    import boto3

    endpoint, bucket = request.getfixturevalue("s3_bucket")
    # The buffered path (boto3, parts and their accounting): what these tests take apart. The
    # native one (awscrt, whole files) has its own tests: tests/stores/test_store_crt.py.
    store = S3Store(f"s3://{bucket}/p", S3Options(endpoint_url=endpoint, path_style=True,
                                                  native=False))
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def pending():
        return client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])

    return Env("s3", store, pending)


def mixed(size: int, seed: int = 0) -> bytes:
    """Alternating 256 KiB of random bytes and of zeros: lz4 ratio ~2, bit errors visible."""
    rng = random.Random(seed)
    out = bytearray(size)
    for off in range(0, size, 512 << 10):
        n = min(256 << 10, size - off)
        out[off:off + n] = rng.randbytes(n)
    return bytes(out)


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


class Recorder(_Wrapper):
    """Records every call (op, args) that reaches the inner store."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.log: list[tuple] = []

    async def _do(self, op, *args, **kw):
        self.log.append((op, *args[:3]) if op == "get" else (op, *args[:1]))
        return await getattr(self.inner, op)(*args, **kw)


# ----------------------------------------------------------------------------------------------
# compress.py and decode.py units


def test_frames_for_range():
    lengths = [10, 20, 30, 40]  # raw frames of 100 bytes, last one shorter
    offs = compress.frame_offsets(lengths)
    assert offs == [0, 10, 30, 60, 100]
    for kw in ({}, {"offsets": offs}):
        assert compress.frames_for_range(100, lengths, 0, 1, **kw) == (0, 0, 0, 10)
        assert compress.frames_for_range(100, lengths, 0, 100, **kw) == (0, 0, 0, 10)
        assert compress.frames_for_range(100, lengths, 99, 2, **kw) == (0, 1, 0, 30)
        assert compress.frames_for_range(100, lengths, 100, 100, **kw) == (1, 1, 10, 30)
        assert compress.frames_for_range(100, lengths, 150, 200, **kw) == (1, 3, 10, 100)
        assert compress.frames_for_range(100, lengths, 350, 10**9, **kw) == (3, 3, 60, 100)
    with pytest.raises(ValueError):
        compress.frames_for_range(100, lengths, 400, 1)
    with pytest.raises(ValueError):
        compress.frames_for_range(100, lengths, 0, 0)


def _frames(lengths, raw_lengths, first=0):
    """The decoder's chunks of consecutive lz4 frames (no chunk CRCs: lengths and structure)."""
    out, pos = [], 0
    for i, (n, r) in enumerate(zip(lengths, raw_lengths, strict=True), start=first):
        out.append(Chunk(i, i * FRAME, r, pos, n, None))
        pos += n
    return out


def _frame(stored, raw_len, index=0):
    """One stored frame through the decoder, as a chunk fetch decodes it."""
    return decode_chunk("k", Chunk(index, 0, raw_len, 0, len(stored), None), stored, lz4=True)


def test_frames_decompress_independently():
    data = mixed(3 * FRAME + 17)
    frames = [compress.compress_frame(data[o:o + FRAME]) for o in range(0, len(data), FRAME)]
    lengths = [len(f) for f in frames]
    raws = [FRAME, FRAME, FRAME, 17]
    blob = b"".join(frames)
    assert decode_chunks("k", blob, _frames(lengths, raws), lz4=True) == data
    # Any frame alone, and any run of frames, decompresses without its predecessors.
    assert decode_chunks("k", frames[2], _frames(lengths[2:3], raws[2:3], 2),
                         lz4=True) == data[2 * FRAME:3 * FRAME]
    assert decode_chunks("k", b"".join(frames[1:]), _frames(lengths[1:], raws[1:], 1),
                         lz4=True) == data[FRAME:]
    with pytest.raises(DecodeError):
        decode_chunks("k", frames[0], _frames(lengths[:1], [FRAME - 1]), lz4=True)
    with pytest.raises(DecodeError):
        decode_chunks("k", b"\0" * lengths[0], _frames(lengths[:1], raws[:1]), lz4=True)


def _lz4_bomb(raw_bytes: int) -> bytes:
    """One lz4 frame of `raw_bytes` zeros, built 64 MiB at a time (1 GiB gives ~4 MB), with no
    content size in its header: only decompressing it tells how big it is."""
    c = lz4.frame.LZ4FrameCompressor(block_size=lz4.frame.BLOCKSIZE_MAX4MB,
                                      content_checksum=False)
    out = [c.begin()]
    piece = bytes(64 << 20)
    for done in range(0, raw_bytes, len(piece)):
        out.append(c.compress(piece[:min(len(piece), raw_bytes - done)]))
    out.append(c.flush())
    return b"".join(out)


def test_decompress_is_bounded_by_the_stated_raw_length():
    bomb = _lz4_bomb(1 << 30)
    assert len(bomb) < 8 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    with pytest.raises(DecodeError, match="frame 3 decompresses to more than the 1048576 bytes"):
        _frame(bomb, FRAME, index=3)
    with pytest.raises(DecodeError, match="more than"):
        decode_chunks("k", bomb, [Chunk(0, 0, FRAME, 0, len(bomb), None)], lz4=True)
    # Streaming, a few bytes at a time: bounded while it is produced, too.
    with pytest.raises(DecodeError, match="more than"):
        from cachemgr.format.decode import ChunkDecoder, stream_chunk

        dec = ChunkDecoder("k", Chunk(0, 0, FRAME, 0, len(bomb), None), lz4=True,
                           max_out=64 << 10)
        for _ in stream_chunk(lambda off, n: bomb[off:off + n], dec, step=4096):
            pass
    # Bounded: a few MiB of output and lz4 buffers, not the GiB the frame holds.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10
    good = compress.compress_frame(b"x" * 1000)
    assert _frame(good, 1000) == b"x" * 1000
    with pytest.raises(DecodeError, match="decompressed to 1000 bytes, expected 1001"):
        _frame(good, 1001)         # fewer bytes than stated
    with pytest.raises(DecodeError, match="more than"):
        _frame(good, 999)
    with pytest.raises(DecodeError, match="trailing data"):
        _frame(good + b"junk", 1000)
    with pytest.raises(DecodeError, match="trailing data"):
        _frame(good + good, 1000)  # a second frame hidden behind the first
    with pytest.raises(DecodeError, match="does not end"):
        _frame(good[:-4], 1000)    # no end mark
    with pytest.raises(DecodeError, match="frame 7"):
        _frame(b"\0" * 20, 1000, index=7)


def test_should_compress_is_cheap_and_right():
    calls = []

    def sampler(data):
        def fn(off, n):
            calls.append((off, n))
            return data[off:off + n]
        return fn

    weights = np.random.default_rng(0).standard_normal(4 << 20, dtype=np.float32).tobytes()
    assert not compress.should_compress(sampler(weights), len(weights))
    assert not compress.should_compress(sampler(os.urandom(1 << 20)), 1 << 20)
    zeros = bytes(16 << 20)
    assert compress.should_compress(sampler(zeros), len(zeros))
    assert compress.should_compress(sampler(mixed(8 << 20)), 8 << 20)
    # The work is bounded whatever the size: a 1 TiB "file" of zeros costs 8 reads of 64 KiB.
    calls.clear()
    assert compress.should_compress(lambda off, n: calls.append((off, n)) or bytes(n), 1 << 40)
    assert len(calls) == compress.SAMPLE_WINDOWS
    assert all(n == compress.SAMPLE_WINDOW for _, n in calls)
    assert calls[0][0] == 0 and calls[-1][0] + calls[-1][1] == 1 << 40  # spread to the end
    assert not compress.should_compress(lambda off, n: b"", 0)


def test_crc32c_combine():
    rng = random.Random(3)
    for _ in range(300):
        a = rng.randbytes(rng.choice([0, 1, rng.randint(0, 5000)]))
        b = rng.randbytes(rng.choice([0, 1, rng.randint(0, 5000)]))
        assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_config_and_stored_object_validation(tmp_path):
    assert TransferConfig().single_put_max == TransferConfig().part_size == 64 << 20
    for bad in ({"part_size": (5 << 20) - 1}, {"max_parts_in_flight": 0},
                {"compress": "zstd"}, {"frame_size": 128 << 20},
                {"single_put_max": 6 << 30}):
        with pytest.raises(ValueError):
            TransferConfig(**bad)
    o = StoredObject("k", 2 * FRAME + 1, 60, 7, "lz4", FRAME, (10, 20, 30))
    assert StoredObject.from_json(o.to_json()) == o
    import json
    assert StoredObject.from_json(json.dumps(o.to_json())) == o
    with pytest.raises(ValueError):
        StoredObject("k", 2 * FRAME + 1, 60, 7, "lz4", FRAME, (10, 50))  # too few frames
    with pytest.raises(ValueError):
        StoredObject("k", 2 * FRAME + 1, 61, 7, "lz4", FRAME, (10, 20, 30))  # sum mismatch
    with pytest.raises(ValueError):
        StoredObject("k", 5, 4, 7)  # uncompressed but stored_size != size
    # Chunk CRCs: one per chunk, lz4 chunks are its frames, and they round-trip through JSON.
    c = StoredObject("k", 2 * FRAME + 1, 2 * FRAME + 1, 7, chunk_size=FRAME,
                     chunk_crcs=(1, 2, 3))
    assert StoredObject.from_json(json.dumps(c.to_json())) == c
    assert c.to_json()["chunk_crcs"] == [1, 2, 3] and c.to_json()["chunk_size"] == FRAME
    lz = dataclasses.replace(o, chunk_size=FRAME, chunk_crcs=(4, 5, 6))
    assert StoredObject.from_json(lz.to_json()) == lz != o
    assert StoredObject("k", 0, 0, 0, chunk_size=FRAME, chunk_crcs=()).chunk_crcs == ()
    for bad in ({"chunk_size": FRAME, "chunk_crcs": (1, 2)},            # too few
                {"chunk_size": FRAME, "chunk_crcs": (1, 2, 3, 4)},      # too many
                {"chunk_size": 0, "chunk_crcs": (1, 2, 3)},             # no chunk size
                {"chunk_size": FRAME, "chunk_crcs": (1, 2, 1 << 32)},   # not a CRC32C
                {"chunk_size": -1}):
        with pytest.raises(ValueError):
            dataclasses.replace(c, **bad)
    with pytest.raises(ValueError):  # lz4 chunks must be its frames
        dataclasses.replace(o, chunk_size=2 * FRAME, chunk_crcs=(1, 2))
    with pytest.raises(ValueError):
        StoredObject("k", 0, 0, 0, chunk_size=FRAME, chunk_crcs=(0,))
    # More than 10,000 parts' worth grows the part size instead of failing.
    up = Uploader(LocalStore(tmp_path / "store"), TransferConfig())
    assert up.part_size_for(1 << 30, False) == 64 << 20
    big = up.part_size_for(1 << 40, False)
    assert big % (1 << 20) == 0 and big * 10_000 >= 1 << 40


# ----------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("mode", ["off", "lz4", "auto"])
def test_round_trip(env, tmp_path, mode):
    up = Uploader(env.store, cfg(compress=mode))

    async def go():
        for i, size in enumerate(SIZES):
            data = mixed(size, seed=i)
            key = f"sets/s1/f{i}.bin"
            sent = []
            obj = await up.upload_file(write(tmp_path, f"in{i}", data), key, size=size,
                                       progress=sent.append)
            assert sum(sent) == size
            assert obj.size == size and obj.crc32c == crc32c(data)
            assert StoredObject.from_json(obj.to_json()) == obj
            if size == 0 or mode == "off":
                assert obj.compression == "none" and obj.stored_size == size
            elif mode == "lz4" or size >= FRAME:  # auto: half zeros -> compressed
                assert obj.compression == "lz4"
                assert obj.frames is not None and len(obj.frames) == -(-size // FRAME)
            if obj.compression == "lz4" and size >= FRAME:
                assert obj.stored_size < 0.6 * size
            info = await env.store.head(key)
            assert info.size == obj.stored_size
            # Bit-exact through both read paths.
            dest = tmp_path / f"out{i}"
            got = []
            await download_file(env.store, obj, dest, range_size=2 * FRAME + 5, concurrency=3,
                                progress=got.append)
            assert sum(got) == size
            assert dest.read_bytes() == data
            assert await read_range(env.store, obj, 0, size + 10) == data

    trio.run(go)
    st = up.statistics()
    assert st.uploads == len(SIZES) and st.parts_in_flight == 0
    # Only the 3-part-plus file needs a multipart upload when stored uncompressed; compressed it
    # is ~7.5 MiB stored, still more than one part.
    assert st.multipart == 1 and st.single_puts == len(SIZES) - 1
    assert env.pending() == []


@pytest.mark.parametrize("kind", ["randn", "urandom", "zeros"])
def test_auto_skips_random_and_compresses_zeros(env, tmp_path, kind):
    size = 3 * PART + 123
    if kind == "randn":
        data = np.random.default_rng(1).standard_normal(size // 4 + 1,
                                                        dtype=np.float32).tobytes()[:size]
    elif kind == "urandom":
        data = os.urandom(size)
    else:
        data = bytes(size)
    up = Uploader(env.store, cfg(compress="auto"))

    async def go():
        obj = await up.upload_file(write(tmp_path, "f", data), "k", size=size)
        if kind == "zeros":
            assert obj.compression == "lz4"
            assert obj.stored_size < size // 100  # ~255x on zeros
            assert up.stats.single_puts == 1  # all of it fits in one part once compressed
        else:
            assert obj.compression == "none" and obj.frames is None
            assert obj.stored_size == size
            assert up.stats.multipart == 1
        assert (await env.store.head("k")).size == obj.stored_size
        await download_file(env.store, obj, tmp_path / "out")
        assert (tmp_path / "out").read_bytes() == data

    trio.run(go)


@pytest.mark.parametrize("mode", ["off", "lz4"])
def test_read_range_fetches_only_needed_frames(env, tmp_path, mode):
    size = 3 * PART + 123
    data = mixed(size, seed=5)
    rec = Recorder(env.store)

    async def go():
        obj = await Uploader(rec, cfg(compress=mode)).upload_file(
            write(tmp_path, "f", data), "k", size=size)
        cases = [
            (0, 1), (FRAME, FRAME), (FRAME - 10, 20), (2 * FRAME - 1, 1), (2 * FRAME, 1),
            (FRAME - 1, 3 * FRAME + 2), (PART - 3, 7), (size - 123, 123), (size - 5, 100),
            (size - 1, 1), (0, size),
        ]
        for off, n in cases:
            rec.log.clear()
            got = await read_range(rec, obj, off, n)
            assert got == data[off:off + n], (off, n)
            [(op, key, start, length)] = rec.log  # exactly one ranged GET
            assert op == "get" and key == "k"
            end = min(off + n, size)
            if mode == "off":
                assert (start, length) == (off, end - off)
            else:
                first, last = off // FRAME, (end - 1) // FRAME
                assert start == sum(obj.frames[:first])
                assert length == sum(obj.frames[first:last + 1])
        rec.log.clear()
        assert await read_range(rec, obj, size, 10) == b""
        assert await read_range(rec, obj, size + 100, 10) == b""
        assert await read_range(rec, obj, 3, 0) == b""
        assert rec.log == []  # nothing to fetch, no request

    trio.run(go)


# ----------------------------------------------------------------------------------------------
# superseded, cancelled, faults, corruption


@pytest.mark.parametrize("valid_calls", [0, 2, 4])
def test_superseded_aborts_and_leaves_nothing(env, tmp_path, valid_calls):
    """still_valid is asked once per part (4 parts here) and once before completing: turning
    False before the first part, mid-upload, or just before completion publishes nothing."""
    size = 4 * PART
    data = mixed(size)
    calls = []

    def still_valid():
        calls.append(1)
        return len(calls) <= valid_calls

    up = Uploader(env.store, cfg(max_parts_in_flight=2))

    async def go():
        with pytest.raises(Superseded):
            await up.upload_file(write(tmp_path, "f", data), "sets/s/f", size=size,
                                 still_valid=still_valid)
        with pytest.raises(NotFound):
            await env.store.head("sets/s/f")
        assert await env.store.list("") == []

    trio.run(go)
    assert len(calls) == valid_calls + 1  # stopped at the first False
    assert env.pending() == []
    st = up.statistics()
    assert st.superseded == 1 and st.parts_in_flight == 0
    assert st.aborted == (1 if valid_calls else 0)  # no multipart existed before the first part


def test_a_superseded_upload_of_very_compressible_data_stops_within_a_step(tmp_path,
                                                                          monkeypatch):
    """A file of zeros (a file just laid out with fallocate) compresses into one part however
    big it is. The producer works through a part in steps of STEP_RAW raw bytes and the upload
    asks still_valid after each, so a file rewritten right after its close stops costing CPU
    within a step; a part built in many steps is stored bit-exact."""
    monkeypatch.setattr(_Producer, "STEP_RAW", 2 * FRAME)
    read: list[int] = []
    real = upload._pread_exact

    def counting(fd: int, n: int, off: int) -> bytes:
        read.append(n)
        return real(fd, n, off)
    monkeypatch.setattr(upload, "_pread_exact", counting)
    store = LocalStore(tmp_path / "store")
    up = Uploader(store, cfg(compress="lz4"))
    size = 64 * FRAME
    calls: list[int] = []

    def still_valid() -> bool:
        calls.append(1)
        return len(calls) < 2

    async def go() -> None:
        with pytest.raises(Superseded):
            await up.upload_file(write(tmp_path, "zeros", bytes(size)), "k", size=size,
                                 still_valid=still_valid)
        assert await store.list("") == []
        # Two steps read (still_valid said yes after the first), not the 64 MiB of the part.
        assert sum(read) == 2 * 2 * FRAME
        # Many steps per part (4 parts of mixed data, 1 MiB steps), all valid: bit-exact.
        monkeypatch.setattr(_Producer, "STEP_RAW", FRAME)
        data = mixed(3 * PART + 123, seed=5)
        obj = await up.upload_file(write(tmp_path, "mixed", data), "m", size=len(data))
        assert obj.compression == "lz4" and obj.crc32c == crc32c(data)
        dest = tmp_path / "out"
        await download_file(store, obj, dest, range_size=2 * FRAME, concurrency=2)
        assert dest.read_bytes() == data

    trio.run(go)
    assert len(calls) == 2
    assert up.stats.superseded == 1


def test_cancellation_aborts_multipart(env, tmp_path):
    size = 4 * PART
    up = Uploader(env.store, cfg(max_parts_in_flight=2))

    async def go():
        with trio.CancelScope() as scope:
            # Cancel from inside the upload, as soon as the first part is acknowledged.
            await up.upload_file(write(tmp_path, "f", mixed(size)), "k", size=size,
                                 progress=lambda n: scope.cancel())
        assert scope.cancelled_caught
        with pytest.raises(NotFound):
            await env.store.head("k")

    trio.run(go)
    assert up.stats.aborted == 1 and up.stats.abort_failures == 0
    assert env.pending() == []


@pytest.mark.parametrize("mode", ["off", "lz4"])
def test_transient_faults_are_ridden_out(env, tmp_path, mode):
    faulty = FaultyStore(env.store)
    store = RetryingStore(faulty, RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.005),
                          rng=random.Random(1))
    big, small = mixed(3 * PART + 123, seed=7), mixed(PART // 2, seed=8)

    async def go():
        up = Uploader(store, cfg(compress=mode))
        faulty.fail_next("create_multipart", 2)
        faulty.fail_every("upload_part", 2)
        faulty.fail_next("complete_multipart", 1)
        faulty.fail_next("put", 2)
        faulty.fail_next("head", 1)
        faulty.fail_every("get", 3)
        for name, data in (("big", big), ("small", small)):
            obj = await up.upload_file(write(tmp_path, name, data), name, size=len(data))
            assert obj.crc32c == crc32c(data)
            await download_file(store, obj, tmp_path / f"{name}.out", range_size=FRAME,
                                concurrency=4)
            assert (tmp_path / f"{name}.out").read_bytes() == data
            assert await read_range(store, obj, FRAME - 7, FRAME) == data[FRAME - 7:2 * FRAME - 7]

    trio.run(go)
    for op in ("create_multipart", "upload_part", "complete_multipart", "put", "head", "get"):
        assert faulty.injected.get(op, 0) >= 1, op
    assert store.stats.retries == sum(faulty.injected.values())
    assert store.stats.failures == 0
    assert env.pending() == []


@pytest.mark.parametrize("mode", ["off", "lz4"])
def test_corrupt_object_fails_download(env, tmp_path, mode):
    size = 2 * PART + 99
    data = mixed(size, seed=11)

    async def go():
        obj = await Uploader(env.store, cfg(compress=mode)).upload_file(
            write(tmp_path, "f", data), "k", size=size)
        stored = bytearray(await env.store.get("k"))
        assert len(stored) == obj.stored_size
        # Flip one byte in each of a few places (header, literal run, last frame): each alone
        # must be caught, whether lz4 notices or only the end-to-end CRC32C does.
        for pos in (5, len(stored) // 2 + 1, len(stored) - 3):
            bad = bytearray(stored)
            bad[pos] ^= 0x40
            await env.store.put("k", bytes(bad))
            with pytest.raises(IntegrityError):
                await download_file(env.store, obj, tmp_path / "out", range_size=FRAME)
        # A truncated object is caught too, by length.
        await env.store.put("k", bytes(stored[:-1]))
        with pytest.raises(IntegrityError):
            await download_file(env.store, obj, tmp_path / "out")
        with pytest.raises(IntegrityError):
            await read_range(env.store, obj, size - 10, 10)
        # Restored, it downloads again.
        await env.store.put("k", bytes(stored))
        await download_file(env.store, obj, tmp_path / "out")
        assert (tmp_path / "out").read_bytes() == data

    trio.run(go)


# ----------------------------------------------------------------------------------------------
# the memory bound


class PartGate(_Wrapper):
    """Counts concurrent upload_part calls. Each call waits until `gate` calls are in flight (or
    every expected part has started), so the test provokes maximal concurrency on purpose
    instead of hoping the scheduler produces it."""

    def __init__(self, inner, gate: int, total: int, limiter=None) -> None:
        super().__init__(inner)
        self.gate, self.total, self.limiter = gate, total, limiter
        self.in_flight = self.peak = self.started = self.peak_tokens = 0
        self._changed = trio.Event()

    def _kick(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def upload_part(self, key, upload_id, number, data):
        self.in_flight += 1
        self.started += 1
        self.peak = max(self.peak, self.in_flight)
        if self.limiter is not None:
            self.peak_tokens = max(self.peak_tokens, self.limiter.statistics().borrowed_tokens)
        self._kick()
        try:
            with trio.fail_after(30):
                while self.in_flight < self.gate and self.started < self.total:
                    await self._changed.wait()
            return await self.inner.upload_part(key, upload_id, number, data)
        finally:
            self.in_flight -= 1
            self._kick()


def test_parts_in_flight_bounded_per_upload(env, tmp_path):
    size = 6 * PART + 1  # 7 parts
    data = mixed(size, seed=2)
    gate = PartGate(env.store, gate=2, total=7)
    up = Uploader(gate, cfg(max_parts_in_flight=2))

    async def go():
        obj = await up.upload_file(write(tmp_path, "f", data), "k", size=size)
        await download_file(env.store, obj, tmp_path / "out")

    trio.run(go)
    assert gate.started == 7
    assert gate.peak == 2  # reached, never exceeded
    assert up.stats.peak_parts_in_flight == 2  # buffers alive, including the one being read
    assert (tmp_path / "out").read_bytes() == data


def test_parts_in_flight_bounded_across_uploads(env, tmp_path):
    """Two concurrent uploads (4 parts each, 4 allowed each) share a limiter of 2 tokens."""
    size = 3 * PART + 7
    limiter = trio.CapacityLimiter(2)
    gate = PartGate(env.store, gate=2, total=8, limiter=limiter)
    up = Uploader(gate, cfg(max_parts_in_flight=4), parts_limiter=limiter)
    datas = [mixed(size, seed=20), mixed(size, seed=21)]

    async def go():
        objs = {}

        async def one(i):
            objs[i] = await up.upload_file(write(tmp_path, f"f{i}", datas[i]), f"k{i}",
                                           size=size)

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(one, i)
        for i in range(2):
            await download_file(env.store, objs[i], tmp_path / f"out{i}")
            assert (tmp_path / f"out{i}").read_bytes() == datas[i]

    trio.run(go)
    assert gate.started == 8
    assert gate.peak == 2 and gate.peak_tokens <= 2
    assert up.stats.peak_parts_in_flight == 2
    assert limiter.statistics().borrowed_tokens == 0


# ----------------------------------------------------------------------------------------------
# per-chunk checksums


def chunk_crcs_of(data: bytes, cs: int) -> tuple[int, ...]:
    return tuple(crc32c(data[o:o + cs]) for o in range(0, len(data), cs))


CHUNK_SIZES = [0, 1, FRAME - 1, FRAME, 3 * FRAME + 5]


@pytest.mark.parametrize("mode", ["off", "lz4", "auto"])
def test_chunk_crcs_recorded(tmp_path, mode):
    store = LocalStore(tmp_path / "store")
    up = Uploader(store, cfg(compress=mode))
    # The last case is a multipart upload (4 parts) of zeros: one compressed part, or 4 raw.
    cases = [mixed(n, seed=n) for n in CHUNK_SIZES] + [bytes(3 * PART + 5)]

    async def go():
        for i, data in enumerate(cases):
            size = len(data)
            obj = await up.upload_file(write(tmp_path, f"f{i}", data), f"k{i}", size=size)
            assert obj.chunk_size == FRAME  # the frame size, compressed or not
            assert obj.chunk_crcs == chunk_crcs_of(data, FRAME)
            assert len(obj.chunk_crcs) == chunk_count(obj) == math.ceil(size / FRAME)
            assert obj.crc32c == crc32c(data)  # still the whole file's, folded from the chunks
            if obj.compression == "lz4":
                assert obj.frame_size == FRAME and len(obj.frames) == len(obj.chunk_crcs)
            if mode == "lz4" and size:
                assert obj.compression == "lz4"
            for j in range(chunk_count(obj)):
                off, n = chunk_span(obj, j)
                assert (off, n) == (j * FRAME, min(FRAME, size - j * FRAME))
                assert verify_chunk(obj, j, data[off:off + n])
            again = StoredObject.from_json(json.dumps(obj.to_json()))
            assert again == obj and again.chunk_crcs == obj.chunk_crcs

    trio.run(go)
    assert up.stats.multipart == (1 if mode == "off" else 0)


@pytest.mark.parametrize("frame", [3 << 20, (1 << 20) + 7])
def test_chunk_crcs_straddle_parts(tmp_path, frame):
    """Uncompressed parts (5 MiB) that do not hold whole chunks: a chunk's CRC carries over from
    one part to the next."""
    store = LocalStore(tmp_path / "store")
    size = 3 * PART + 5
    data = mixed(size, seed=9)
    up = Uploader(store, cfg(frame_size=frame))

    async def go():
        obj = await up.upload_file(write(tmp_path, "f", data), "k", size=size)
        assert up.stats.parts == 4 and obj.compression == "none"
        assert obj.chunk_size == frame and obj.chunk_crcs == chunk_crcs_of(data, frame)
        assert obj.crc32c == crc32c(data)
        got = [await download_chunk(store, obj, j) for j in range(chunk_count(obj))]
        assert b"".join(got) == data
        await download_file(store, obj, tmp_path / "out", range_size=2 * frame + 1)
        assert (tmp_path / "out").read_bytes() == data

    trio.run(go)


@pytest.mark.parametrize("mode", ["off", "lz4"])
def test_fetch_chunk_bit_exact(env, tmp_path, mode):
    size = 3 * PART + 5  # multipart when uncompressed, 16 chunks, short last one
    data = mixed(size, seed=13)
    rec = Recorder(env.store)

    async def go():
        obj = await Uploader(rec, cfg(compress=mode)).upload_file(
            write(tmp_path, "f", data), "k", size=size)
        assert obj.compression == ("lz4" if mode == "lz4" else "none")
        n_chunks = chunk_count(obj)
        assert n_chunks == 16
        for j in range(n_chunks):
            rec.log.clear()
            raw = await download_chunk(rec, obj, j)
            off, n = chunk_span(obj, j)
            assert raw == data[off:off + n] and len(raw) == n
            [(op, key, start, length)] = rec.log  # exactly one ranged GET: just this chunk
            assert op == "get" and key == "k"
            if mode == "off":
                assert (start, length) == (off, n)
            else:
                assert (start, length) == (sum(obj.frames[:j]), obj.frames[j])
            assert verify_chunk(obj, j, raw)
            assert not verify_chunk(obj, j, raw[:-1])  # wrong length
            bad = bytearray(raw)
            bad[len(bad) // 2] ^= 1
            assert not verify_chunk(obj, j, bytes(bad))
        rec.log.clear()
        for j in (-1, n_chunks):
            with pytest.raises(IndexError):
                await download_chunk(rec, obj, j)
            with pytest.raises(IndexError):
                chunk_span(obj, j)
        assert rec.log == []
        # An empty object has no chunks.
        empty = await Uploader(env.store, cfg(compress=mode)).upload_file(
            write(tmp_path, "e", b""), "e", size=0)
        assert chunk_count(empty) == 0 and empty.chunk_crcs == ()
        with pytest.raises(IndexError):
            await download_chunk(env.store, empty, 0)

    trio.run(go)


@pytest.mark.parametrize("mode", ["off", "lz4"])
def test_fetch_chunk_detects_flipped_byte(env, tmp_path, mode):
    size = 4 * FRAME + 77
    data = mixed(size, seed=17)
    bad_chunk = 2

    async def go():
        obj = await Uploader(env.store, cfg(compress=mode)).upload_file(
            write(tmp_path, "f", data), "k", size=size)
        stored = await env.store.get("k")
        # A byte inside chunk 2's stored bytes, in its leading 256 KiB of random bytes (stored
        # as literals by lz4, after ~1 KiB of headers and literal-length bytes, so lz4 decodes
        # it without complaint: only the CRC can catch it).
        start = obj.offsets[bad_chunk] if mode == "lz4" else bad_chunk * FRAME
        pos = start + 5000
        bad = bytearray(stored)
        bad[pos] ^= 0x10
        await env.store.put("k", bytes(bad))
        with pytest.raises(IntegrityError, match=r"chunk 2 .*CRC32C"):
            await download_chunk(env.store, obj, bad_chunk)
        for j in range(chunk_count(obj)):
            if j != bad_chunk:
                off, n = chunk_span(obj, j)
                assert await download_chunk(env.store, obj, j) == data[off:off + n]
        # download_file names the bad chunk too.
        with pytest.raises(IntegrityError, match="chunk 2 "):
            await download_file(env.store, obj, tmp_path / "out", range_size=FRAME)
        # A truncated object: the last chunk's GET comes back short.
        await env.store.put("k", stored[:-1])
        with pytest.raises(IntegrityError):
            await download_chunk(env.store, obj, chunk_count(obj) - 1)
        assert await download_chunk(env.store, obj, 0) == data[:FRAME]
        if mode == "lz4":
            # Damage lz4 does notice (chunk 2's frame header) is an IntegrityError naming it.
            bad = bytearray(stored)
            bad[start + 5] ^= 0xFF
            await env.store.put("k", bytes(bad))
            with pytest.raises(IntegrityError, match="frame 2"):
                await download_chunk(env.store, obj, bad_chunk)
            assert await download_chunk(env.store, obj, 3) == data[3 * FRAME:4 * FRAME]

    trio.run(go)


def test_download_checks_chunk_and_whole_crcs(tmp_path):
    """A manifest whose chunk CRCs or whole-file CRC disagree with the content fails, each on
    its own."""
    store = LocalStore(tmp_path / "store")
    data = mixed(3 * FRAME + 5, seed=19)

    async def go():
        for mode in ("off", "lz4"):
            obj = await Uploader(store, cfg(compress=mode)).upload_file(
                write(tmp_path, "f", data), mode, size=len(data))
            crcs = list(obj.chunk_crcs)
            crcs[3] ^= 1
            wrong_chunk = dataclasses.replace(obj, chunk_crcs=tuple(crcs))
            with pytest.raises(IntegrityError, match="chunk 3 "):
                await download_file(store, wrong_chunk, tmp_path / "out")
            with pytest.raises(IntegrityError, match="chunk 3 "):
                await download_chunk(store, wrong_chunk, 3)
            wrong_whole = dataclasses.replace(obj, crc32c=obj.crc32c ^ 1)
            with pytest.raises(IntegrityError, match="downloaded content"):
                await download_file(store, wrong_whole, tmp_path / "out")
            await download_file(store, obj, tmp_path / "out", range_size=1)  # 1 chunk per range
            assert (tmp_path / "out").read_bytes() == data

    trio.run(go)


@pytest.mark.parametrize("mode", ["off", "lz4"])
def test_old_style_object_without_chunk_crcs(tmp_path, mode):
    """Manifests written before chunk CRCs load, and their chunks fetch (checked by length and
    lz4 structure only)."""
    store = LocalStore(tmp_path / "store")
    size = 2 * compress.DEFAULT_FRAME_SIZE + 12345
    data = mixed(size, seed=23)

    async def go():
        new = await Uploader(store, cfg(compress=mode)).upload_file(
            write(tmp_path, "f", data), "k", size=size)
        d = new.to_json()
        del d["chunk_size"], d["chunk_crcs"]
        old = StoredObject.from_json(json.dumps(d))
        assert old.chunk_size == 0 and old.chunk_crcs is None
        assert old.to_json()["chunk_crcs"] is None
        # lz4: chunks are the frames; none: DEFAULT_FRAME_SIZE slices.
        cs = FRAME if mode == "lz4" else compress.DEFAULT_FRAME_SIZE
        assert chunk_count(old) == math.ceil(size / cs)
        for j in range(chunk_count(old)):
            off, n = chunk_span(old, j)
            assert (off, n) == (j * cs, min(cs, size - j * cs))
            raw = await download_chunk(store, old, j)
            assert raw == data[off:off + n]
            assert verify_chunk(old, j, raw) and not verify_chunk(old, j, raw + b"x")
            assert verify_chunk(old, j, bytes(n))  # no CRC to hold it against
        await download_file(store, old, tmp_path / "out", range_size=3 * FRAME)
        assert (tmp_path / "out").read_bytes() == data
        if mode == "off":
            # No chunk CRC: a flipped byte goes unnoticed by download_chunk (the whole-file CRC in
            # download_file still catches it).
            bad = bytearray(data)
            bad[5] ^= 1
            await store.put("k", bytes(bad))
            assert await download_chunk(store, old, 0) == bytes(bad[:cs])
            with pytest.raises(IntegrityError):
                await download_file(store, old, tmp_path / "out")
            with pytest.raises(IntegrityError):
                await download_chunk(store, new, 0)

    trio.run(go)


def test_ckpt_restore_checks_chunk_crcs(tmp_path):
    """scripts/ckpt_restore.decode (the no-ckptfs reader) checks chunk_crcs when present and
    reads old objects without them."""
    from ckpt_restore import RestoreError, decode

    store = LocalStore(tmp_path / "store")
    data = mixed(3 * FRAME + 5, seed=29)

    async def go():
        for mode in ("off", "lz4"):
            obj = await Uploader(store, cfg(compress=mode)).upload_file(
                write(tmp_path, "f", data), mode, size=len(data))
            stored = await store.get(mode)
            d = json.loads(json.dumps(obj.to_json()))
            assert decode(d, stored) == data
            d["chunk_crcs"][1] ^= 1
            with pytest.raises(RestoreError, match="chunk 1"):
                decode(d, stored)
            del d["chunk_crcs"], d["chunk_size"]
            assert decode(d, stored) == data

    trio.run(go)


# ----------------------------------------------------------------------------------------------
# file:// stores: the whole file copied in by the kernel (ObjectStore.stage_file)


@pytest.mark.parametrize("cross_fs", [False, True])
def test_staged_uploads_match_the_part_path_bit_for_bit(tmp_path, monkeypatch, cross_fs):
    """An uncompressed upload to a file:// store is one kernel copy (copy_file_range, or
    sendfile where the two filesystems refuse it), no parts: the same object, CRC and chunk
    CRCs as the part path, read back bit-exactly, and nothing left in the store but it."""
    from cachemgr.store import local

    if cross_fs:
        def refuse(*a, **kw):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(local.os, "copy_file_range", refuse)
    staged = LocalStore(tmp_path / "staged")
    parts = LocalStore(tmp_path / "parts")

    async def go():
        up = Uploader(staged, cfg(stage_files=True))
        ref = Uploader(parts, cfg())
        for i, size in enumerate(SIZES):
            data = mixed(size, seed=i)
            src = write(tmp_path, f"in{i}", data)
            sent: list[int] = []
            obj = await up.upload_file(src, f"k{i}", size=size, progress=sent.append)
            want = await ref.upload_file(src, f"k{i}", size=size)
            assert obj == want                       # key, sizes, CRC, chunk CRCs
            assert sum(sent) == size
            assert await read_range(staged, obj, 0, size + 10) == data
        st = up.statistics()
        assert st.staged == len(SIZES) and st.multipart == 0 and st.parts == 0
        assert sorted(i.key for i in await staged.list()) == [f"k{i}" for i in range(len(SIZES))]
    trio.run(go)
    leftovers = [n for _d, _s, files in os.walk(tmp_path / "staged") for n in files
                 if n.startswith(".tmp-")]
    assert leftovers == []


def test_staged_upload_is_dropped_when_the_file_changes_during_the_copy(tmp_path):
    """The source is checked after the copy, as after each part's read: a file rewritten while
    the kernel copied it is Superseded, and nothing is published or left behind. Gated: the
    change happens inside the store's copy."""
    store = LocalStore(tmp_path / "store")
    src = write(tmp_path, "in", mixed(3 * PART))
    valid = [True]

    class Changing(_Wrapper):
        async def stage_file(self, key, fd, size, inspect, pause=None):
            staged = await self.inner.stage_file(key, fd, size, inspect, pause)
            valid[0] = False                        # a writer opened the file meanwhile
            return staged

    async def go():
        up = Uploader(Changing(store), cfg(stage_files=True))
        with pytest.raises(Superseded):
            await up.upload_file(src, "k", size=3 * PART, still_valid=lambda: valid[0])
        assert up.statistics().superseded == 1
        assert await store.list() == []
        # a source shorter than the size asked for: SourceChanged, nothing published
        valid[0] = True
        with pytest.raises(OSError):
            await Uploader(store, cfg(stage_files=True)).upload_file(src, "k2",
                                                                     size=3 * PART + 1)
        assert await store.list() == []
    trio.run(go)
    leftovers = [n for _d, _s, files in os.walk(tmp_path / "store") for n in files
                 if n.startswith(".tmp-")]
    assert leftovers == []


def test_a_staged_copy_gives_way_to_the_trainer_between_its_steps(tmp_path, monkeypatch):
    """The kernel's copy of a whole file (file:// stores) goes in steps, and before each step
    after the first the uploader waits while the trainer reads or writes (the foreground probe
    says busy): a copy that started just before a read does not run beside all of it. Gated by
    the probe: the trainer is busy for the first probe asked from inside the copy, then idle."""
    from cachemgr.store import local

    monkeypatch.setattr(local, "COPY_STEP", 1 << 20)
    store = LocalStore(tmp_path / "store")
    data = mixed(5 << 20)
    src = write(tmp_path, "in", data)
    in_copy = [False]
    log: list[str] = []

    class Recording(_Wrapper):
        async def stage_file(self, key, fd, size, inspect, pause=None):
            def paused() -> None:
                in_copy[0] = True
                log.append("pause")
                pause()
            return await self.inner.stage_file(key, fd, size, inspect, paused)

    busy = [1]

    def probe() -> bool:
        if not in_copy[0]:
            return False
        log.append("probe")
        if busy[0]:
            busy[0] -= 1
            log.append("busy")
            return True
        return False

    async def go():
        up = Uploader(Recording(store), cfg(stage_files=True), foreground=Foreground(probe))
        obj = await up.upload_file(src, "k", size=len(data), still_valid=lambda: True)
        assert obj.size == len(data)
        assert await store.get("k") == data
    trio.run(go)
    assert log.count("pause") == 4  # 5 steps of 1 MiB
    # the busy answer made the first pause wait: it asked again before the copy went on
    assert log[:4] == ["pause", "probe", "busy", "probe"], log


def test_the_crc_pass_over_a_staged_copy_gives_way_between_its_steps(tmp_path, monkeypatch):
    """After the copy, the chunk CRCs are computed over it in steps with the same wait for the
    trainer between them, and the CRCs come out the same as in one pass."""
    from cachemgr.store import local

    monkeypatch.setattr(local, "COPY_STEP", 1 << 30)  # the copy in one step: no pause there
    monkeypatch.setattr(upload, "STAGED_CRC_STEP", 1 << 20)
    waits = [0]

    class Counting(Foreground):
        async def yield_to(self, nbytes: int | None = None) -> None:
            waits[0] += 1
            await super().yield_to(nbytes)

    data = mixed((5 << 20) + 123)
    src = write(tmp_path, "in", data)
    store = LocalStore(tmp_path / "store")

    async def go():
        up = Uploader(store, cfg(stage_files=True), foreground=Counting())
        obj = await up.upload_file(src, "k", size=len(data), still_valid=lambda: True)
        assert await store.get("k") == data
        return obj
    obj = trio.run(go)
    # two waits before the copy (the upload's first read, the staged path), then one before
    # each CRC step after the first: 6 steps of 1 MiB
    assert waits[0] == 2 + 5
    monkeypatch.setattr(upload, "STAGED_CRC_STEP", 1 << 30)
    whole = trio.run(lambda: Uploader(LocalStore(tmp_path / "store2"), cfg(stage_files=True))
                     .upload_file(src, "k", size=len(data), still_valid=lambda: True))
    assert obj == whole  # the same chunk CRCs, combined CRC and size


def test_a_cancelled_staged_copy_stops_at_its_next_step_and_leaves_nothing(tmp_path,
                                                                            monkeypatch):
    """An unmount (the upload's scope cancelled) does not wait for the kernel to copy the rest
    of a large file: the copy stops before its next step and its temp file is removed. Gated:
    the cancel happens inside the copy's first pause."""
    from cachemgr.store import local

    monkeypatch.setattr(local, "COPY_STEP", 1 << 20)
    store = LocalStore(tmp_path / "store")
    src = write(tmp_path, "in", mixed(5 << 20))
    scope = trio.CancelScope()
    pauses = [0]

    class Recording(_Wrapper):
        async def stage_file(self, key, fd, size, inspect, pause=None):
            def paused() -> None:
                pauses[0] += 1
                if pauses[0] == 1:
                    trio.from_thread.run_sync(scope.cancel)
                pause()
            return await self.inner.stage_file(key, fd, size, inspect, paused)

    async def go():
        up = Uploader(Recording(store), cfg(stage_files=True))
        with scope:
            await up.upload_file(src, "k", size=5 << 20, still_valid=lambda: True)
        assert scope.cancelled_caught
        assert await store.list() == []
    trio.run(go)
    assert pauses[0] == 1  # stopped at the first step boundary after the cancel
    leftovers = [n for _d, _s, files in os.walk(tmp_path / "store") for n in files]
    assert leftovers == []


def test_staging_is_off_for_compression_and_for_fault_injection(tmp_path):
    """lz4 frames are made in user space (the part path); a FaultyStore keeps uploads on the
    operations its rules name."""
    store = LocalStore(tmp_path / "store")
    assert store.stages_files and RetryingStore(store).stages_files
    assert not FaultyStore(store).stages_files
    src = write(tmp_path, "in", mixed(PART))

    async def go():
        up = Uploader(store, cfg(stage_files=True, compress="lz4"))
        obj = await up.upload_file(src, "k", size=PART)
        assert obj.compression == "lz4" and up.statistics().staged == 0
        up = Uploader(FaultyStore(store), cfg(stage_files=True))
        await up.upload_file(src, "k2", size=PART)
        assert up.statistics().staged == 0 and up.statistics().single_puts == 1
    trio.run(go)


@pytest.mark.parametrize("compress", ["off", "auto"])
def test_a_small_file_is_staged_in_two_worker_thread_hops(tmp_path, monkeypatch, compress):
    """Issue 35: a small file's upload to a file:// store took five worker-thread hops (open,
    compressibility sample, copy and CRCs, rename, HEAD), most of a 64 KiB DCP shard's upload
    cost. Now two: open + sample + copy + CRCs in one, the rename and its read-back in the
    other; the same object as the part path. A compressible small file takes the part path
    (lz4), after the one hop that sampled it."""
    store = LocalStore(tmp_path / "store")
    hops: list[str] = []
    real = trio.to_thread.run_sync

    async def counting(fn, *args, **kw):
        hops.append(getattr(fn, "__name__", repr(fn)))
        return await real(fn, *args, **kw)

    monkeypatch.setattr(trio.to_thread, "run_sync", counting)
    data = random.Random(1).randbytes(64 << 10)
    src = write(tmp_path, "in", data)
    zeros = write(tmp_path, "zeros", bytes(64 << 10))

    async def go():
        up = Uploader(store, cfg(stage_files=True, compress=compress))
        obj = await up.upload_file(src, "k", size=len(data), still_valid=lambda: True)
        assert len(hops) == 2, hops
        hops.clear()
        want = await Uploader(LocalStore(tmp_path / "ref"), cfg()).upload_file(src, "k",
                                                                               size=len(data))
        assert obj == want
        assert await store.get("k") == data
        assert up.statistics().staged == 1 and up.statistics().uploads == 1
        hops.clear()
        z = await up.upload_file(zeros, "z", size=64 << 10, still_valid=lambda: True)
        assert z.compression == ("lz4" if compress == "auto" else "none")
        assert await read_range(store, z, 0, 64 << 10) == bytes(64 << 10)
        assert up.statistics().uploads == 2
    trio.run(go)


def test_a_small_file_changed_during_its_copy_is_not_published(tmp_path):
    """The two-hop path keeps the staged path's check: the source is asked after the copy and
    before the rename; a change in between discards the copy (nothing in the store)."""
    store = LocalStore(tmp_path / "store")
    src = write(tmp_path, "in", mixed(64 << 10))
    valid = [True]

    class Changing(_Wrapper):
        async def stage_path(self, key, path, size, inspect, skip):
            staged = await self.inner.stage_path(key, path, size, inspect, skip)
            valid[0] = False                        # a writer opened the file meanwhile
            return staged

    async def go():
        up = Uploader(Changing(store), cfg(stage_files=True))
        with pytest.raises(Superseded):
            await up.upload_file(src, "k", size=64 << 10, still_valid=lambda: valid[0])
        assert await store.list() == []
        # a file gone before its upload: the OSError of its open, not a store error
        with pytest.raises(FileNotFoundError):
            await Uploader(store, cfg(stage_files=True)).upload_file(tmp_path / "gone", "k2",
                                                                     size=10)
    trio.run(go)
    leftovers = [n for _d, _s, files in os.walk(tmp_path / "store") for n in files
                 if n.startswith(".tmp-")]
    assert leftovers == []
