"""The object-store seam, against both real backends: a file:// directory and S3 over HTTP
(moto_server on loopback, reached through boto3). Same assertions for both."""

import os

import pytest
import trio

from cachemgr.store import (
    LocalStore,
    NotFound,
    PreconditionFailed,
    RetryingStore,
    RetryPolicy,
    StoreError,
    TransientStoreError,
    crc32c,
    open_store,
)
from cachemgr.store.s3 import S3Options, S3Store
from tests.faultstore import FaultyStore


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return LocalStore(tmp_path / "store")
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    return S3Store(f"s3://{bucket}/some/prefix", S3Options(endpoint_url=endpoint,
                                                           path_style=True))


def run(fn, *args):
    return trio.run(fn, *args)


def test_put_get_head_list_delete(store):
    data = os.urandom(100_000)

    async def go():
        info = await store.put("sets/a/x.bin", data)
        assert info.size == len(data) and info.crc32c == crc32c(data)
        assert await store.get("sets/a/x.bin") == data
        assert await store.get("sets/a/x.bin", 10, 100) == data[10:110]
        assert await store.get("sets/a/x.bin", 99_990) == data[99_990:]
        h = await store.head("sets/a/x.bin")
        assert h.size == len(data) and h.crc32c == crc32c(data) and h.etag == info.etag
        await store.put("sets/b/y.bin", b"y")
        await store.put("other", b"z")
        keys = [i.key for i in await store.list("sets/")]
        assert keys == ["sets/a/x.bin", "sets/b/y.bin"]
        await store.delete("sets/a/x.bin")
        await store.delete("sets/a/x.bin")  # idempotent
        with pytest.raises(NotFound):
            await store.head("sets/a/x.bin")
        with pytest.raises(NotFound):
            await store.get("sets/a/x.bin")
        assert [i.key for i in await store.list("sets/")] == ["sets/b/y.bin"]

    run(go)


def test_overwrite_is_atomic_and_changes_etag(store):
    async def go():
        a = await store.put("k", b"old")
        b = await store.put("k", b"new!")
        assert a.etag != b.etag
        assert await store.get("k") == b"new!"

    run(go)


def test_conditional_put(store):
    async def go():
        first = await store.put("manifest.json", b"v1", if_none_match=True)
        with pytest.raises(PreconditionFailed):
            await store.put("manifest.json", b"v1-again", if_none_match=True)
        second = await store.put("manifest.json", b"v2", if_match=first.etag)
        with pytest.raises(PreconditionFailed):
            await store.put("manifest.json", b"v3", if_match=first.etag)  # stale etag
        assert await store.get("manifest.json") == b"v2"
        assert second.etag != first.etag

    run(go)


def test_multipart_parallel_parts(store):
    part = 5 << 20  # S3's minimum part size (except the last)
    data = os.urandom(3 * part + 12345)

    async def go():
        uid = await store.create_multipart("big/obj")
        parts = []

        async def up(n, chunk):
            parts.append(await store.upload_part("big/obj", uid, n, chunk))

        async with trio.open_nursery() as nursery:
            for i, off in enumerate(range(0, len(data), part)):
                nursery.start_soon(up, i + 1, data[off:off + part])
        info = await store.complete_multipart("big/obj", uid, parts, crc32c(data))
        assert info.size == len(data) and info.crc32c == crc32c(data)
        assert await store.get("big/obj") == data
        assert await store.get("big/obj", part - 5, 10) == data[part - 5:part + 5]
        # An aborted upload leaves no object.
        uid2 = await store.create_multipart("big/aborted")
        await store.upload_part("big/aborted", uid2, 1, b"x" * 100)
        await store.abort_multipart("big/aborted", uid2)
        with pytest.raises(NotFound):
            await store.head("big/aborted")

    run(go)


@pytest.mark.parametrize("bad", ["", "/abs", "a//b", "a/../b", "./a"])
def test_invalid_keys_are_refused(store, bad):
    async def go():
        with pytest.raises(StoreError):
            await store.put(bad, b"x")

    run(go)


def test_retrying_store_rides_out_throttling_and_5xx(store):
    import random

    faulty = FaultyStore(store)
    retrying = RetryingStore(faulty, RetryPolicy(attempts=6, base_delay=0.001, max_delay=0.01),
                             rng=random.Random(1))

    async def go():
        faulty.fail_next("put", 3)  # three 503 SlowDown in a row
        await retrying.put("k", b"payload")
        faulty.fail_every("get", 2)
        for _ in range(4):
            assert await retrying.get("k") == b"payload"
        # A permanent answer is not retried.
        calls = faulty.calls.get("head", 0)
        with pytest.raises(NotFound):
            await retrying.head("missing")
        assert faulty.calls["head"] == calls + 1
        # Exhausted retries surface the transient error.
        faulty.fail_next("delete", 10)
        with pytest.raises(TransientStoreError):
            await retrying.delete("k")

    run(go)
    assert retrying.stats.retries >= 3 + 2 + 5
    assert retrying.stats.failures == 1
    assert faulty.injected["put"] == 3


def test_open_store_urls(tmp_path):
    assert isinstance(open_store(f"file://{tmp_path}/s"), LocalStore)
    with pytest.raises(StoreError):
        open_store("file://relative/path")
    with pytest.raises(StoreError):
        open_store("gs://bucket")
    with pytest.raises(StoreError):
        open_store("s3://")
