"""Uploads over plain HTTP with the body sent by sendfile (cachemgr.store.plainhttp, docs/
ARCHITECTURE.md "Store data path"): the default data path of an s3:// store on an http://
endpoint, on the session's S3 endpoint (moto, or RGW / SeaweedFS with CKPTFS_TEST_S3).

  * it is the path used by default over http:// (status, counters, RetryingStore's ops), and
    what it stores reads back bit-exact, with the file's CRC32C in the metadata; a file over the
    part size goes as a multipart upload of parallel parts, each with its CRC32C folded from the
    chunk CRC32Cs (a wrong one is refused by the store where it checks them);
  * a key with characters to encode is signed as sent (real servers check the signature);
  * every fault of the fault proxy (errors, resets, truncated and lost answers, a black hole)
    ends in the store seam's error of the right kind, within the deadline, and nothing is
    left half-stored; the caller's cancellation ends the request at once;
  * a pooled connection the store closed meanwhile is replaced, not reported as a failure;
  * `--s3-transfer crt` and https:// endpoints keep the CRT.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import trio

from cachemgr.store import (
    DeadlineExceeded,
    NotFound,
    RetryingStore,
    RetryPolicy,
    StoreError,
    TransientStoreError,
)
from cachemgr.store.base import RangeCrcs, crc32c, crc32c_b64
from cachemgr.store.s3 import Deadlines, S3Options, S3Store
from cachemgr.transfer.download import download_file
from cachemgr.transfer.upload import TransferConfig, Uploader
from tests.conftest import s3_client, s3_store
from tests.fakehttp import FakeHTTPServer, Request, send_response
from tests.faultproxy import FaultProxy, Rule

pytestmark = pytest.mark.s3

MiB = 1 << 20


def _file(tmp_path, name: str, size: int) -> tuple[str, bytes]:
    data = os.urandom(size)
    p = tmp_path / name
    p.write_bytes(data)
    return str(p), data


@pytest.mark.parametrize("size", [1000, 12 * MiB + 4097])  # one PUT; 3 parts of 5 MiB
def test_sendfile_round_trip(s3_bucket, tmp_path, size):
    endpoint, bucket = s3_bucket
    s3 = s3_store(endpoint, bucket, part_size=5 * MiB)
    assert s3.data_path == "sendfile" and s3.sends_files and not s3.gets_files
    store = RetryingStore(s3)
    src, data = _file(tmp_path, "src", size)
    up = Uploader(store, TransferConfig(compress="off", part_size=5 * MiB, frame_size=MiB))

    async def go():
        obj = await up.upload_file(src, "data/f", size=size)
        head = await store.head("data/f")
        assert head.size == size and head.crc32c == obj.crc32c  # metadata, multipart too
        dest = tmp_path / "dest"
        await download_file(store, obj, dest)
        assert dest.read_bytes() == data

    trio.run(go)
    assert up.stats.native == 1 and up.stats.parts == 0
    assert store.stats.by_op.get("put_file") == 1 and "put" not in store.stats.by_op
    d = s3.data_statistics()
    assert d.client == "sendfile" and d.restores_by == "boto3"
    assert d.put_bytes == size and d.puts == 1 and d.errors == {}
    head = s3_client(endpoint).head_object(Bucket=bucket, Key="p/data/f")
    if size > 5 * MiB:
        assert d.parts == 3
        assert head["ETag"].strip('"').endswith("-3"), head["ETag"]
    else:
        assert d.parts == 0 and "-" not in head["ETag"]
    assert s3_client(endpoint).get_object(Bucket=bucket, Key="p/data/f")["Body"].read() == data


def test_each_part_waits_for_the_trainer_before_it_goes(s3_bucket, tmp_path):
    """`pause(bytes)` (the uploader's Foreground.yield_to) is awaited before each part: while it
    holds them, no part's byte goes; released, the upload completes."""
    endpoint, bucket = s3_bucket
    s3 = s3_store(endpoint, bucket, part_size=5 * MiB)
    size = 12 * MiB + 4097
    src, data = _file(tmp_path, "src", size)
    asked: list[int] = []
    all_held, go_on = trio.Event(), trio.Event()

    async def pause(n: int) -> None:
        asked.append(n)
        if len(asked) == 3:
            all_held.set()
        await go_on.wait()

    async def main() -> None:
        fd = os.open(src, os.O_RDONLY)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(s3.put_file, "data/p", fd, size, 0, None, pause)
                with trio.fail_after(30):
                    await all_held.wait()
                st = s3.data_statistics()
                assert st.parts == 0 and st.put_bytes == 0, st
                go_on.set()
        finally:
            os.close(fd)

    trio.run(main)
    assert sorted(asked) == [2 * MiB + 4097, 5 * MiB, 5 * MiB]
    assert s3.data_statistics().parts == 3
    assert s3_client(endpoint).get_object(Bucket=bucket, Key="p/data/p")["Body"].read() == data


class _RecordingS3(FakeHTTPServer):
    """Answers a PUT, a multipart upload's create, part and completion as S3 does, recording
    every request: what the client sent is checked against the file's bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.requests: list[Request] = []   # guarded by lock
        super().__init__()

    def answer(self, s, conn, req: Request) -> None:
        with self.lock:
            self.requests.append(req)
        if req.method == "HEAD":  # what was stored: the file's size and its metadata
            first = self.requests[0]
            s.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {self.size}\r\nETag: \"h\"\r\n"
                      f"x-amz-meta-ckptfs-crc32c: "
                      f"{first.headers[b'x-amz-meta-ckptfs-crc32c'].decode()}\r\n"
                      f"Connection: close\r\n\r\n".encode())
        elif req.method == "POST" and "?uploads" in req.target:
            body = (b"<InitiateMultipartUploadResult><UploadId>u+1/x</UploadId>"
                    b"</InitiateMultipartUploadResult>")
            send_response(s, conn, 200, body=body)
        elif req.method == "POST":
            send_response(s, conn, 200, body=b"<CompleteMultipartUploadResult><ETag>"
                          b"&quot;whole-3&quot;</ETag></CompleteMultipartUploadResult>")
        else:
            send_response(s, conn, 200, [("etag", f'"e{len(self.requests)}"')])


@pytest.mark.parametrize("size", [3 * MiB + 5, 12 * MiB + 4097])
def test_what_goes_on_the_wire_carries_the_bytes_crc32cs(tmp_path, monkeypatch, size):
    """moto and RGW 16.2 do not check `x-amz-checksum-crc32c` (AWS S3 and SeaweedFS do): so
    the requests themselves are checked here. Through the uploader (its chunk CRCs
    folded into each part's), every body is the file's bytes, signed UNSIGNED-PAYLOAD, with
    the CRC32C of exactly those bytes in its header, the parts' listed again at the completion
    with their ETags, and the whole file's CRC32C in the metadata."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    srv = _RecordingS3(size)
    try:
        s3 = s3_store(f"http://{srv.address}", "bucket", part_size=5 * MiB)
        src, data = _file(tmp_path, "src", size)
        up = Uploader(s3, TransferConfig(compress="off", frame_size=MiB))

        obj = trio.run(lambda: up.upload_file(src, "data/f", size=size))
    finally:
        srv.close()
    assert obj.crc32c == crc32c(data) and up.stats.native == 1
    reqs = [r for r in srv.requests if r.method != "HEAD"]
    puts = [r for r in reqs if r.method == "PUT"]
    assert b"".join(r.body for r in sorted(puts, key=lambda r: int(
        r.query.get("partNumber", ["1"])[0]))) == data
    for r in puts:
        assert r.headers[b"x-amz-content-sha256"] == b"UNSIGNED-PAYLOAD"
        assert r.headers[b"authorization"].startswith(b"AWS4-HMAC-SHA256 Credential=k/")
        assert r.headers[b"x-amz-checksum-crc32c"] == crc32c_b64(crc32c(r.body)).encode()
    whole = str(crc32c(data)).encode()
    if size <= 5 * MiB:
        assert len(reqs) == 1 and reqs[0].headers[b"x-amz-meta-ckptfs-crc32c"] == whole
        return
    create, complete = reqs[0], reqs[-1]
    assert create.headers[b"x-amz-meta-ckptfs-crc32c"] == whole
    assert create.headers[b"x-amz-checksum-algorithm"] == b"CRC32C"
    assert sorted(int(r.query["partNumber"][0]) for r in puts) == [1, 2, 3]
    assert all(r.query["uploadId"] == ["u+1/x"] for r in puts + [complete])
    for r in puts:  # each part listed with the ETag its PUT was answered and its CRC32C
        n = int(r.query["partNumber"][0])
        etag = f"&quot;e{srv.requests.index(r) + 1}&quot;"
        crc = crc32c_b64(crc32c(r.body))
        assert (f"<Part><PartNumber>{n}</PartNumber><ETag>{etag}</ETag><ChecksumCRC32C>{crc}"
                "</ChecksumCRC32C></Part>").encode() in complete.body


def test_a_part_sent_with_a_wrong_crc32c_is_refused_where_the_store_checks(s3_bucket, tmp_path):
    """The parts' CRC32Cs are the caller's (folded from its chunk CRC32Cs): one that does not
    match the bytes fails the upload where the store checks them (AWS S3, SeaweedFS: BadDigest),
    leaving no object and no open upload; where it does not (moto and RGW 16.2, found so
    here) what is stored is the file, and the HEAD after the PUT is what checks it.
    test_what_goes_on_the_wire_carries_the_bytes_crc32cs checks the values sent."""
    endpoint, bucket = s3_bucket
    s3 = s3_store(endpoint, bucket, part_size=5 * MiB)
    size = 7 * MiB
    src, data = _file(tmp_path, "src", size)
    wrong = RangeCrcs(MiB, lambda off, n: 12345)

    async def go() -> str:
        fd = os.open(src, os.O_RDONLY)
        try:
            try:
                await s3.put_file("data/w", fd, size, 0, wrong)
            except StoreError as e:
                return f"refused: {e}"
            return "stored"
        finally:
            os.close(fd)

    outcome = trio.run(go)
    if os.environ.get("CKPTFS_TEST_S3") == "seaweedfs":  # it checks them (BadDigest), found so
        assert outcome.startswith("refused"), outcome
    c = s3_client(endpoint)
    if outcome.startswith("refused"):
        with pytest.raises(c.exceptions.ClientError):
            c.head_object(Bucket=bucket, Key="p/data/w")
        ups = c.list_multipart_uploads(Bucket=bucket, Prefix="p/data/w").get("Uploads", [])
        assert ups == [], ups  # aborted
    else:  # a store that does not check part checksums: what it stored is the file
        assert c.get_object(Bucket=bucket, Key="p/data/w")["Body"].read() == data


@pytest.mark.parametrize("name", ["shard-%FF.distcp", "a b+c=d&e;f.bin", "\u00fcn\u00ef.bin",
                                  "x%2Fy~z.bin"])
def test_a_key_with_characters_to_encode_is_signed_as_sent(s3_bucket, tmp_path, name):
    endpoint, bucket = s3_bucket
    store = RetryingStore(s3_store(endpoint, bucket))
    key = f"data/n1/7/1/{name}"
    src, data = _file(tmp_path, "src", 3000)
    up = Uploader(store, TransferConfig(compress="off"))

    async def go():
        obj = await up.upload_file(src, key, size=3000)
        assert await store.get(key) == data
        assert (await store.head(key)).crc32c == obj.crc32c

    trio.run(go)
    assert store.stats.by_op.get("put_file") == 1


SHORT = Deadlines(base=1.0, control=1.0, list_page=1.0, complete=1.0, queue=2.0,
                  floor_rate=64 * MiB)

# (fault mode, the error the store seam raises). Not here: "slow" and "stall" are answered in
# time, "truncate" cuts an answer's body and a PUT's answer has none.
FAULTS = [("error500", TransientStoreError), ("error503", TransientStoreError),
          ("slowdown", TransientStoreError), ("error403", StoreError),
          ("reset", TransientStoreError), ("hangup", TransientStoreError),
          ("lost_reply", (TransientStoreError, DeadlineExceeded)),
          ("blackhole", DeadlineExceeded), ("oneway", DeadlineExceeded)]


@pytest.mark.parametrize("mode,error", FAULTS, ids=[m for m, _ in FAULTS])
@pytest.mark.parametrize("size", [2 * MiB, 7 * MiB])  # one PUT; a multipart upload
def test_every_fault_ends_in_the_right_error_within_the_deadline(s3_bucket, tmp_path, mode,
                                                                  error, size):
    endpoint, bucket = s3_bucket
    src, data = _file(tmp_path, "src", size)
    crc = crc32c(data)  # stores that check `x-amz-checksum-crc32c` (SeaweedFS) refuse a wrong one
    with FaultProxy(endpoint, seed=1) as proxy:
        s3 = s3_store(proxy.url, bucket, connect_timeout=2, deadlines=SHORT, part_size=5 * MiB)
        assert s3.data_path == "sendfile"
        ops = {"put", "upload_part"} if mode != "lost_reply" else {"put", "complete_multipart"}
        proxy.set_rules([Rule(mode, ops=ops, delay=30)])

        async def go() -> float:
            fd = os.open(src, os.O_RDONLY)
            try:
                t0 = time.monotonic()
                with pytest.raises(error) as got:
                    await s3.put_file(f"data/{mode}", fd, size, crc, None)
                assert not isinstance(got.value, NotFound)
                return time.monotonic() - t0
            finally:
                os.close(fd)

        took = trio.run(go)
        proxy.set_rules([])
        # the deadline (1 s + the bytes at 64 MiB/s; a multipart's abort: 1 s more) plus slack
        assert took < 8, (mode, took)
        c = s3_client(endpoint)
        if mode not in ("lost_reply", "oneway"):  # a lost answer: stored, maybe; that is fine
            with pytest.raises(c.exceptions.ClientError):
                c.head_object(Bucket=bucket, Key=f"p/data/{mode}")
        # and the same client, the fault gone, stores the file (no poisoned connection); with
        # the normal deadlines: a store on a loaded machine may take over SHORT's second a part
        assert s3.plain is not None
        s3.plain.deadlines = Deadlines()

        async def again() -> None:
            fd = os.open(src, os.O_RDONLY)
            try:
                await s3.put_file(f"data/{mode}-2", fd, size, crc, None)
            finally:
                os.close(fd)

        trio.run(again)
        assert c.head_object(Bucket=bucket, Key=f"p/data/{mode}-2")["ContentLength"] == size
        s3.plain.close()


def test_the_callers_cancellation_ends_a_put_at_once(s3_bucket, tmp_path):
    """An unmount, a superseded upload: the request thread's socket is shut down and the call
    returns once the thread no longer reads the file; RetryingStore asks a black hole at most
    twice."""
    endpoint, bucket = s3_bucket
    size = 2 * MiB
    src, data = _file(tmp_path, "src", size)
    crc = crc32c(data)
    with FaultProxy(endpoint, seed=1) as proxy:
        s3 = s3_store(proxy.url, bucket, connect_timeout=2, deadlines=SHORT)
        proxy.set_rules([Rule("blackhole")])

        async def go() -> float:
            fd = os.open(src, os.O_RDONLY)
            try:
                t0 = time.monotonic()
                with trio.move_on_after(0.3) as scope:
                    await s3.put_file("data/z", fd, size, crc, None)
                assert scope.cancelled_caught
                took = time.monotonic() - t0
                rs = RetryingStore(s3, RetryPolicy(base_delay=0.001))
                with pytest.raises(DeadlineExceeded):
                    await rs.put_file("data/y", fd, size, crc)
                assert rs.stats.retries == 1
                return took
            finally:
                os.close(fd)

        took = trio.run(go)
        assert proxy.hung() >= 1
    assert took < 3, took
    assert s3.data_statistics().cancelled == 3


def test_a_pooled_connection_the_store_closed_is_replaced(s3_bucket, tmp_path):
    """Keep-alive connections wait in a pool; a store (or a proxy) may close one while it
    waits. The next request on it finds it closed before any answer, and is sent again on a
    new connection: counted, not an error."""
    endpoint, bucket = s3_bucket
    src, data = _file(tmp_path, "src", 5000)
    with FaultProxy(endpoint, seed=1) as proxy:
        s3 = s3_store(proxy.url, bucket)

        async def put(key: str) -> None:
            fd = os.open(src, os.O_RDONLY)
            try:
                await s3.put_file(key, fd, 5000, crc32c(data), None)
            finally:
                os.close(fd)

        trio.run(put, "data/a")
        assert s3.plain is not None and len(s3.plain._idle) == 1
        # the store side closes the idle connection: what a server's keep-alive timeout does
        s3.plain._idle[0].shutdown(0)  # SHUT_RD: the next recv reads the end at once
        trio.run(put, "data/b")
    st = s3.data_statistics()
    assert st.reconnects == 1 and st.errors == {}, st
    assert s3_client(endpoint).get_object(Bucket=bucket, Key="p/data/b")["Body"].read() == data


def test_the_crt_stays_where_sendfile_is_not_used(s3_bucket):
    pytest.importorskip("awscrt")
    endpoint, bucket = s3_bucket
    assert s3_store(endpoint, bucket, native_gets=True).data_path == "sendfile"  # uploads only
    assert s3_store(endpoint, bucket, plain_http=False).data_path == "crt-up"
    assert s3_store(endpoint, bucket, native=False).data_path == "boto3"
    https = S3Store("s3://b/p", S3Options(endpoint_url="https://127.0.0.1:9", region="us-east-1",
                                          path_style=True))
    assert https.data_path == "crt-up"
