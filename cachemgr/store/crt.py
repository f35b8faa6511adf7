"""The data path of `s3.S3Store` in native code: whole cache files PUT and GET by the AWS Common
Runtime's S3 client (`awscrt.s3.S3Client`), the bytes never entering the interpreter.

What it owns: two `S3Client`s and their event-loop threads (one for uploads, whose reads of the
cache disk are at idle I/O priority as the buffered path's preads are,
`cachemgr.host.background`; its CPU priority stays normal, as boto3's sending threads' does: the
CPU work of an upload that waits for the trainer is the CRC pass before the PUT, which runs at
idle priority between `Foreground.yield_to` checks; one for restores when they are turned on
(`S3Options.native_gets`), at normal priority: a restore is what a trainer waits for), and the
translation of their answers into the store seam's errors. It does not own the object layout,
the retries (`RetryingStore`: the CRT's own retries are off, `S3RetryMode.NONE`, so every retry
is counted where the others are), nor the integrity checks (the uploader computes the chunk
CRC32Cs, the downloader checks them before the file is marked cached: cachemgr.transfer).
Control requests (HEAD, LIST, DELETE, conditional manifest PUTs, the multipart calls of
compressed uploads) stay on boto3 (`s3.S3Store`).

Why awscrt directly and not boto3's CRT transfer manager (docs/ARCHITECTURE.md "Store data
path"): the transfer manager hides the `S3Request` whose `cancel()` is what makes a deadline
hold, takes no per-request checksum location (Ceph RGW 16.2 refuses the CRT's default trailing
checksum: `XAmzContentSHA256Mismatch`), and adds a Python future and callback layer per
transfer; the request is all we need.

Requests
    `put_file`: PUT_OBJECT with `send_filepath` (the CRT reads the file itself; over
    `part_size` it does a multipart upload with `max_connections` parts in flight). The CRT
    computes each request's CRC32C and sends it as `x-amz-checksum-crc32c` in the header
    (verified on receipt by AWS S3; ignored by RGW 16.2 and moto); the whole file's CRC32C,
    computed by the caller, goes in `x-amz-meta-ckptfs-crc32c` as on the boto3 path, so a HEAD
    can check it (for multipart objects too, unlike the boto3 path).
    `get_file`: GET_OBJECT of a byte range (a whole object, or a restore's run of chunks) with
    `recv_filepath` (the CRT splits it into parallel ranged GETs of `part_size` and writes each
    at its offset).

Deadlines (docs/ARCHITECTURE.md "Store deadlines"): each request is awaited within the deadline
its bytes give (`Deadlines.data`: 10 s + bytes at 4 MiB/s); past it, or when the caller is
cancelled, `S3Request.cancel()` is called and the CRT's answer awaited at most `CANCEL_WAIT`
(shielded) so the request's file is no longer read or written when the call returns; then
`DeadlineExceeded`. The connections a black hole keeps are the CRT's (at most
`max_connections` per client); its own connect timeout is `connect_timeout`.

Threads: the CRT calls `on_done` on one of its event-loop threads; it only records the answer
and wakes the trio task through the loop's `TrioToken` (`run_sync_soon`), so nothing here runs
Python on a CRT thread but that. Every other field is the trio thread's.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from cachemgr.host import background
from cachemgr.store.base import (
    DeadlineExceeded,
    StoreError,
    TransientStoreError,
    answer_error,
    await_within,
    check_key,
    is_ip_or_local,
)

try:  # optional: without it S3Store moves every byte through boto3
    import awscrt.auth
    import awscrt.exceptions
    import awscrt.http
    import awscrt.io
    import awscrt.s3
    HAVE_CRT = True
except ImportError:  # pragma: no cover - the fallback is tested with --s3-transfer boto3
    HAVE_CRT = False

log = logging.getLogger(__name__)

MiB = 1 << 20

# After cancel(), how long the CRT gets to report the request done (it stops reading or writing
# the request's file then). Its cancel is asynchronous but immediate for requests in flight:
# measured well under a second; 10 s so a wedged CRT does not hang an unmount forever.
CANCEL_WAIT = 10.0

META_CRC = "ckptfs-crc32c"


@dataclass
class CrtStats:
    """Counters of the native data path (trio thread only)."""

    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    cancelled: int = 0          # requests cancelled at their deadline or by the caller
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CrtOptions:
    bucket: str
    prefix: str
    endpoint_url: str | None
    region: str
    path_style: bool
    credentials: Callable[[], tuple[str, str, str | None]]   # (key, secret, token), per request
    max_connections: int = 16
    # the mount's --part-size (S3Options.part_size), 64 MiB by default: the buffered path's part
    # and range size (cachemgr.transfer.upload "Defaults and why": per-request costs amortised
    # over big requests); not measured apart for the CRT
    part_size: int = 64 * MiB
    connect_timeout: float = 5.0
    # the CRT's buffer pool, per client (its default is 2 GiB or more): what a client holds is
    # bounded by this, not by the buffered path's part tokens (docs/ARCHITECTURE.md "Store data
    # path")
    memory_limit: int = 1 << 30


class CrtData:
    """Whole-file PUTs and GETs through the CRT (see the module docstring)."""

    def __init__(self, opts: CrtOptions) -> None:
        self.opts = opts
        self.stats = CrtStats()
        if opts.endpoint_url:
            u = urllib.parse.urlsplit(opts.endpoint_url)
            self._tls = u.scheme == "https"
            netloc = u.netloc
            host = u.hostname or ""
        else:
            self._tls = True
            host = netloc = f"s3.{opts.region}.amazonaws.com"
        # Path style when asked, and for endpoints that cannot take a bucket in their name (an
        # IP address, localhost: moto, RGW); virtual-hosted otherwise, as boto3 does.
        if opts.path_style or is_ip_or_local(host):
            self._host = netloc
            self._root = f"/{opts.bucket}/"
        else:
            self._host = f"{opts.bucket}.{netloc}"
            self._root = "/"
        creds = awscrt.auth.AwsCredentialsProvider.new_delegate(self._credentials)
        signing = awscrt.auth.AwsSigningConfig(
            algorithm=awscrt.auth.AwsSigningAlgorithm.V4,
            signature_type=awscrt.auth.AwsSignatureType.HTTP_REQUEST_HEADERS,
            credentials_provider=creds, region=opts.region, service="s3",
            # S3's SigV4: the path signed as sent, encoded once and not normalised (awscrt's
            # defaults are the other AWS services': a key with '%' or a non-UTF-8 byte, sent as
            # %25 / %FF, was refused by RGW with SignatureDoesNotMatch; `//` or `/./` in a key
            # would be too)
            use_double_uri_encode=False, should_normalize_uri_path=False,
            # Over TLS the body is not hashed for the signature (its CRC32C is sent and checked);
            # over plain HTTP it is, as boto3 does (a local test store only).
            signed_body_value=(awscrt.auth.AwsSignedBodyValue.UNSIGNED_PAYLOAD if self._tls
                               else None),
            signed_body_header_type=awscrt.auth.AwsSignedBodyHeaderType.X_AMZ_CONTENT_SHA_256)
        before = set(os.listdir("/proc/self/task"))
        self._up_elg = awscrt.io.EventLoopGroup(1)
        _idle_threads_since(before)
        self._down_elg = awscrt.io.EventLoopGroup(1)
        self.up = self._client(self._up_elg, signing)
        self.down = self._client(self._down_elg, signing)

    def _credentials(self) -> awscrt.auth.AwsCredentials:
        key, secret, token = self.opts.credentials()
        return awscrt.auth.AwsCredentials(key, secret, token)

    def _client(self, elg: awscrt.io.EventLoopGroup,
                signing: awscrt.auth.AwsSigningConfig) -> awscrt.s3.S3Client:
        o = self.opts
        bootstrap = awscrt.io.ClientBootstrap(elg, awscrt.io.DefaultHostResolver(elg))
        return awscrt.s3.S3Client(
            bootstrap=bootstrap, region=o.region, signing_config=signing,
            tls_mode=(awscrt.s3.S3RequestTlsMode.ENABLED if self._tls
                      else awscrt.s3.S3RequestTlsMode.DISABLED),
            part_size=o.part_size, multipart_upload_threshold=o.part_size,
            memory_limit=o.memory_limit,
            max_active_connections_override=o.max_connections,
            retry_config=awscrt.s3.S3RetryConfig(retry_mode=awscrt.s3.S3RetryMode.NONE),
            connect_timeout_ms=int(o.connect_timeout * 1000))

    def _path(self, key: str) -> str:
        return self._root + urllib.parse.quote(self.opts.prefix + check_key(key), safe="/-_.~")

    async def put_file(self, key: str, path: str, size: int, crc: int,
                       deadline: float) -> str:
        """PUT the first `size` bytes of the file at `path` (all of it: the caller gives a
        /proc/self/fd path of a file it holds open) as `key`, the whole file's CRC32C `crc` in
        its metadata. Returns the ETag the store answered ("" when it gave none)."""
        headers = awscrt.http.HttpHeaders([
            ("Host", self._host), ("Content-Length", str(size)),
            ("Content-Type", "application/octet-stream"),
            (f"x-amz-meta-{META_CRC}", str(crc))])
        req = awscrt.http.HttpRequest("PUT", self._path(key), headers)
        checksum = awscrt.s3.S3ChecksumConfig(
            algorithm=awscrt.s3.S3ChecksumAlgorithm.CRC32C,
            location=awscrt.s3.S3ChecksumLocation.HEADER)
        got = await self._run(key, deadline, "put", self.up, {
            "type": awscrt.s3.S3RequestType.PUT_OBJECT, "request": req, "send_filepath": path,
            "checksum_config": checksum})
        self.stats.puts += 1
        self.stats.put_bytes += size
        return got.get("etag", "")

    async def get_file(self, key: str, path: str, start: int, length: int,
                       deadline: float) -> None:
        """GET bytes [start, start+length) of the object `key` into the file at `path`, from
        its offset 0 (created or truncated by the CRT; the caller gives a /proc/self/fd path of
        a file it holds: a cache file, or a memfd). The caller checks what landed there."""
        headers = awscrt.http.HttpHeaders([
            ("Host", self._host), ("Range", f"bytes={start}-{start + length - 1}")])
        req = awscrt.http.HttpRequest("GET", self._path(key), headers)
        await self._run(key, deadline, "get", self.down, {
            "type": awscrt.s3.S3RequestType.GET_OBJECT, "request": req, "recv_filepath": path})
        self.stats.gets += 1
        self.stats.get_bytes += length

    async def _run(self, key: str, deadline: float, what: str, client: awscrt.s3.S3Client,
                   kw: dict[str, Any]) -> dict[str, str]:
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        answer: dict[str, Any] = {}
        got: dict[str, str] = {}

        def wake() -> None:
            done.set()

        def on_headers(status_code: int, headers: list[tuple[str, str]], **_: Any) -> None:
            # a CRT thread, before on_done: the final answer's ETag (a dict write, no loop)
            for k, v in headers:
                if k.lower() == "etag":
                    got["etag"] = v

        def on_done(error: BaseException | None = None, status_code: int | None = None,
                    **_: Any) -> None:  # a CRT thread: record, wake the loop, nothing else
            answer["error"] = error
            answer["status"] = status_code
            try:
                token.run_sync_soon(wake)
            except trio.RunFinishedError:
                pass

        request = client.make_request(on_headers=on_headers, on_done=on_done, **kw)

        def cancel() -> None:
            # at the deadline, or the caller cancelled (an unmount, a superseded upload): the
            # CRT stops, and is no longer reading or writing the file once it answers
            request.cancel()
            self.stats.cancelled += 1

        timed_out = await await_within(done, deadline, cancel, CANCEL_WAIT)
        if timed_out:
            raise DeadlineExceeded(f"{what} {key}: no answer within {deadline:.0f}s", key=key)
        err = answer.get("error")
        if err is not None:
            e = _translate(err, what, key)
            self.stats.errors[type(e).__name__] = self.stats.errors.get(type(e).__name__, 0) + 1
            raise e
        return got

    def close(self) -> None:
        # The clients shut down when their last reference goes (NativeResource); dropping them
        # here makes that now rather than at interpreter exit.
        del self.up, self.down


def _idle_threads_since(before: set[str]) -> None:
    """Put the threads started since `before` (the upload client's event loop) at idle I/O
    priority for good (cachemgr.host.background: root only). Not idle CPU: the buffered path's
    sends run at normal CPU priority too, and in a first smoke round on this 2-core VM (a load
    of 8-12 from other work) the upload with a SCHED_IDLE event loop reached 0.57x of the CRT
    alone (one noisy round, not an A/B: a starved sender is what SCHED_IDLE means there)."""
    if not background.enabled():
        return
    for tid in set(os.listdir("/proc/self/task")) - before:
        background.idle_thread(int(tid), cpu=False)


def _translate(err: BaseException, what: str, key: str) -> StoreError:
    status = getattr(err, "status_code", None) or 0
    name = getattr(err, "name", type(err).__name__)
    body = getattr(err, "body", None) or b""
    code = ""
    if b"<Code>" in body:
        code = body.split(b"<Code>", 1)[1].split(b"</Code>", 1)[0].decode(errors="replace")
    msg = f"{what} {key}: {code or status or name}"
    if status:
        return answer_error(status, code, msg, key)
    # no HTTP answer: a connection refused, reset or cancelled, a read error: worth retrying
    return TransientStoreError(msg, key=key)
