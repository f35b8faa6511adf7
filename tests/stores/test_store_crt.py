"""The store's data path in native code (cachemgr.store.crt, docs/ARCHITECTURE.md "Store data
path"): uncompressed cache files PUT and objects GET whole by the AWS Common Runtime, on the
session's S3 endpoint (moto, or RGW with CKPTFS_TEST_S3=rgw).

  * it is the path used (counters of the client, RetryingStore's ops) and what it stores reads
    back bit-exact, whole and as a restore's runs of chunks, with the whole file's CRC32C in the
    object's metadata (multipart too);
  * a corrupt object is refused by the read-back check, the file left empty, and as chunks;
  * faults injected on put / get (FaultyStore below RetryingStore, as CKPTFS_FAULTS does) reach
    it and are retried and counted;
  * a file written under its PUT makes the upload Superseded and leaves no object;
  * a black hole ends a PUT and a GET at their deadline (S3Request.cancel());
  * with the native path off (S3Options(native=False), `ckptfs mount --s3-transfer boto3`)
    boto3 moves the bytes;
    by default restores (GETs) stay on boto3 and uploads go native (`crt-up`).
"""

from __future__ import annotations

import os
import time

import pytest
import trio

from cachemgr.store import (
    DeadlineExceeded,
    IntegrityError,
    NotFound,
    RetryingStore,
    RetryPolicy,
)
from cachemgr.store.s3 import Deadlines, S3Options, S3Store
from cachemgr.transfer.download import download_chunks, download_file
from cachemgr.transfer.upload import Superseded, TransferConfig, Uploader
from tests.conftest import s3_client, s3_store
from tests.faultproxy import FaultProxy, Rule
from tests.faultstore import FaultyStore

pytest.importorskip("awscrt")
pytestmark = pytest.mark.s3

MiB = 1 << 20


def _store(endpoint: str, bucket: str, **kw) -> S3Store:
    """Native both ways (GETs are off by default: `native_gets`), by the CRT (over http://
    uploads go by sendfile by default: `plain_http`, tests/stores/test_store_plainhttp.py)."""
    kw.setdefault("native_gets", True)
    kw.setdefault("plain_http", False)
    return s3_store(endpoint, bucket, **kw)


def _file(tmp_path, name: str, size: int, seed: int = 0) -> tuple[str, bytes]:
    data = (seed.to_bytes(4, "big") + os.urandom(4091)) * (size // 4095) + os.urandom(size % 4095)
    p = tmp_path / name
    p.write_bytes(data)
    return str(p), data


@pytest.mark.parametrize("size", [1000, 64 * MiB + 4097])  # one PUT; multipart inside the CRT
def test_native_round_trip(s3_bucket, tmp_path, size):
    endpoint, bucket = s3_bucket
    s3 = _store(endpoint, bucket)
    assert s3.data_path == "crt" and s3.sends_files and s3.gets_files
    store = RetryingStore(s3)
    src, data = _file(tmp_path, "src", size)
    up = Uploader(store, TransferConfig(compress="off"))

    async def go():
        obj = await up.upload_file(src, "data/f", size=size)
        head = await store.head("data/f")
        assert head.size == size and head.crc32c == obj.crc32c  # metadata, multipart too
        assert obj.chunk_crcs is not None and len(obj.chunk_crcs) == -(-size // obj.chunk_size)
        dest = tmp_path / "dest"
        got: list[int] = []
        await download_file(store, obj, dest, progress=got.append)
        assert dest.read_bytes() == data and sum(got) == size
        assert oct(dest.stat().st_mode & 0o777) == "0o600"  # a cache file (host.nodefiles)
        # a restore's run of chunks (chunkfetch): one ranged GET into a memory file, mapped
        cs = obj.chunk_size
        last = (size - 1) // cs
        raws = await download_chunks(store, obj, 0, last)
        assert b"".join(bytes(r) for r in raws) == data
        if last >= 2:
            raws = await download_chunks(store, obj, 1, 2)
            assert [bytes(r) for r in raws] == [data[cs:2 * cs], data[2 * cs:3 * cs]]
        del raws

    trio.run(go)
    assert up.stats.native == 1 and up.stats.parts == 0 and up.stats.multipart == 0
    assert store.stats.by_op.get("put_file") == 1
    assert store.stats.by_op.get("get_file") == (3 if size > 8 * MiB else 2)
    assert "put" not in store.stats.by_op and "get" not in store.stats.by_op
    d = s3.data_statistics()
    assert d.client == "crt" and d.put_bytes == size and d.get_bytes is not None
    assert d.get_bytes >= 2 * size
    if size > 64 * MiB:  # the CRT split it: S3's multipart ETag ends in -<parts>
        etag = s3_client(endpoint).head_object(Bucket=bucket, Key="p/data/f")["ETag"]
        assert etag.strip('"').endswith("-2"), etag


@pytest.mark.parametrize("name", ["shard-%FF.distcp", "a b+c=d&e;f.bin", "\u00fcn\u00ef.bin",
                                  "x%2Fy~z.bin"])
def test_a_key_with_characters_to_encode_is_signed_as_sent(s3_bucket, tmp_path, name):
    """The CRT signs the path encoded once and not normalised (S3's SigV4): a key holding '%'
    (ckptfs escapes a non-UTF-8 byte of a name as %XX, docs/FORMAT.md), a space, '+', '&',
    or UTF-8 goes up and comes back. Real S3 servers check the signature (the RGW and
    SeaweedFS passes; moto does not): with awscrt's default double encoding RGW refused
    'shard-%FF.distcp' with SignatureDoesNotMatch."""
    endpoint, bucket = s3_bucket
    store = RetryingStore(_store(endpoint, bucket))
    key = f"data/n1/7/1/{name}"
    src, data = _file(tmp_path, "src", 3000)
    up = Uploader(store, TransferConfig(compress="off"))

    async def go():
        obj = await up.upload_file(src, key, size=3000)
        await download_file(store, obj, tmp_path / "dest")

    trio.run(go)
    assert (tmp_path / "dest").read_bytes() == data
    assert up.stats.native == 1 and store.stats.by_op.get("get_file") == 1
    assert s3_client(endpoint).head_object(Bucket=bucket, Key=f"p/{key}")["ContentLength"] == 3000


def test_a_corrupt_object_is_refused_and_the_file_left_empty(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    store = RetryingStore(_store(endpoint, bucket))
    size = 9 * MiB + 5
    src, data = _file(tmp_path, "src", size)
    up = Uploader(store, TransferConfig(compress="off"))

    async def go():
        obj = await up.upload_file(src, "data/f", size=size)
        bad = bytearray(data)
        bad[5 * MiB + 17] ^= 0x01  # one bit, in the second chunk
        s3_client(endpoint).put_object(Bucket=bucket, Key="p/data/f", Body=bytes(bad))
        dest = tmp_path / "dest"
        with pytest.raises(IntegrityError, match="CRC32C"):
            await download_file(store, obj, dest)
        assert dest.stat().st_size == 0  # nothing unchecked stays behind
        with pytest.raises(IntegrityError, match="chunk 1 CRC32C"):
            await download_chunks(store, obj, 0, 2)  # a restore's run: refused too
        assert [bytes(r) for r in await download_chunks(store, obj, 2, 2)] == [data[8 * MiB:]]
        s3_client(endpoint).put_object(Bucket=bucket, Key="p/data/f", Body=data[:-1])
        with pytest.raises(IntegrityError, match="bytes"):  # short: refused on its size
            await download_file(store, obj, dest)
        assert dest.stat().st_size == 0

    trio.run(go)
    assert up.stats.native == 1


def test_faults_reach_the_native_path_and_are_retried(s3_bucket, tmp_path):
    """FaultyStore below RetryingStore (CKPTFS_FAULTS' place): rules on put / upload_part / get
    apply to the native whole-file calls; each fault is one counted retry."""
    endpoint, bucket = s3_bucket
    faulty = FaultyStore(_store(endpoint, bucket))
    faulty.fail_next("put", 1)
    faulty.fail_next("upload_part", 1)
    faulty.fail_next("get", 1)
    store = RetryingStore(faulty, RetryPolicy(base_delay=0.001))
    size = 3 * MiB
    src, data = _file(tmp_path, "src", size)

    async def go():
        obj = await Uploader(store, TransferConfig(compress="off")).upload_file(
            src, "data/f", size=size)
        await download_file(store, obj, tmp_path / "dest")
        assert (tmp_path / "dest").read_bytes() == data

    trio.run(go)
    assert faulty.injected == {"put_file": 2, "get_file": 1}
    assert store.stats.retries == 3 and store.stats.by_op["put_file"] == 1
    assert store.stats.by_error == {"TransientStoreError": 3}


def test_a_file_written_under_its_put_is_superseded_and_leaves_nothing(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    store = RetryingStore(_store(endpoint, bucket))
    size = 5 * MiB
    src, _ = _file(tmp_path, "src", size)
    asked: list[bool] = []

    class AfterPut(RetryingStore):
        async def put_file(self, *a, **kw):  # the trainer's write lands during the PUT
            info = await super().put_file(*a, **kw)
            asked.append(True)
            return info

    wrapped = AfterPut(store)

    def still_valid() -> bool:
        return not asked

    async def go():
        with pytest.raises(Superseded):
            await Uploader(wrapped, TransferConfig(compress="off")).upload_file(
                src, "data/f", size=size, still_valid=still_valid)
        with pytest.raises(NotFound):
            await store.head("data/f")

    trio.run(go)


SHORT = Deadlines(base=1.0, control=1.0, list_page=1.0, complete=1.0, queue=2.0,
                  floor_rate=64 * MiB)


def test_a_black_hole_ends_a_native_put_and_get_at_their_deadline(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    size = 2 * MiB
    src, data = _file(tmp_path, "src", size)
    s3_client(endpoint).put_object(Bucket=bucket, Key="p/data/x", Body=data)
    with FaultProxy(endpoint, seed=1) as proxy:
        s3 = _store(proxy.url, bucket, connect_timeout=2, deadlines=SHORT)
        assert s3.sends_files
        proxy.set_rules([Rule("blackhole")])
        took: dict[str, float] = {}

        async def go():
            fd = os.open(src, os.O_RDONLY)
            out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                for name, call in (("put", lambda: s3.put_file("data/y", fd, size, 0)),
                                   ("get", lambda: s3.get_file("data/x", out, 0, size))):
                    t0 = time.monotonic()
                    with pytest.raises(DeadlineExceeded, match="no answer within"):
                        await call()
                    took[name] = time.monotonic() - t0
            finally:
                os.close(fd)
                os.close(out)
            # the caller cancelled (an unmount): the request is cancelled too, at once
            t0 = time.monotonic()
            with trio.move_on_after(0.3) as scope:
                fd1 = os.open(src, os.O_RDONLY)
                try:
                    await s3.put_file("data/z", fd1, size, 0)
                finally:
                    os.close(fd1)
            assert scope.cancelled_caught
            took["cancelled"] = time.monotonic() - t0
            # RetryingStore asks a black hole at most deadline_attempts (2) times
            rs = RetryingStore(s3, RetryPolicy(base_delay=0.001))
            with pytest.raises(DeadlineExceeded):
                fd2 = os.open(src, os.O_RDONLY)
                try:
                    await rs.put_file("data/y", fd2, size, 0)
                finally:
                    os.close(fd2)
            assert rs.stats.retries == 1

        trio.run(go)
        assert proxy.hung() >= 1
    # the deadline (1 s + 2 MiB at 64 MiB/s) plus the cancel's answer; slack for a loaded VM
    assert all(t < 6 for t in took.values()), took
    assert s3.data_statistics().cancelled == 5


def test_boto3_moves_the_bytes_when_the_native_path_is_off(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    off = _store(endpoint, bucket, native=False)
    assert off.data_path == "boto3" and not off.sends_files
    assert off.data_statistics().as_json() == {"client": "boto3",
                                               "why": "turned off (--s3-transfer boto3)"}
    store = RetryingStore(off)
    size = 3 * MiB
    src, data = _file(tmp_path, "src", size)
    up = Uploader(store, TransferConfig(compress="off"))

    async def go():
        obj = await up.upload_file(src, "data/f", size=size)
        await download_file(store, obj, tmp_path / "dest")
        assert (tmp_path / "dest").read_bytes() == data

    trio.run(go)
    assert up.stats.native == 0 and up.stats.single_puts == 1
    assert "put_file" not in store.stats.by_op and store.stats.by_op["put"] == 1
    assert "get_file" not in store.stats.by_op and store.stats.by_op["get"] == 1


def test_by_default_uploads_go_native_and_restores_stay_on_boto3(s3_bucket, tmp_path):
    """Native GETs were measured dearer in CPU than boto3's on this machine (docs/PERFORMANCE.md
    "Store data path"): off unless asked (S3Options(native_gets=True), `ckptfs mount
    --s3-transfer crt`)."""
    endpoint, bucket = s3_bucket
    s3 = _store(endpoint, bucket, native_gets=False)
    assert S3Options() == S3Options(native=True, native_gets=False, plain_http=True)
    assert s3.data_path == "crt-up" and s3.sends_files and not s3.gets_files
    assert s3.data_statistics().restores_by == "boto3"
    store = RetryingStore(s3)
    size = 9 * MiB
    src, data = _file(tmp_path, "src", size)
    up = Uploader(store, TransferConfig(compress="off"))

    async def go():
        obj = await up.upload_file(src, "data/f", size=size)
        await download_file(store, obj, tmp_path / "dest")
        assert (tmp_path / "dest").read_bytes() == data
        assert b"".join(bytes(r) for r in await download_chunks(store, obj, 0, 2)) == data

    trio.run(go)
    assert store.stats.by_op["put_file"] == 1 and "get_file" not in store.stats.by_op
    assert _store(endpoint, bucket, native_gets=True).data_path == "crt"
