"""`s3://bucket/prefix`: Amazon S3 and S3-compatible stores through boto3.

boto3 is synchronous; every call runs in a worker thread under one `trio.CapacityLimiter`, which
bounds both threads and connections (the client's pool is sized to match). botocore's own
retries are turned off (`max_attempts=1`): `RetryingStore` owns the retry policy so that every
retry is visible in our statistics and logs.

Deadlines (docs/ARCHITECTURE.md "Store deadlines"): a store that accepts connections and never
answers (a black hole) must cost each call a known time, not botocore's read timeout times its
retries. Every request runs in `_thread`: `trio.to_thread.run_sync(..., abandon_on_cancel=True)`
inside `trio.move_on_after(deadline)`, the deadline chosen per class of operation from the bytes
it moves (`Deadlines`: a base latency plus the bytes at a floor rate per connection). A try that
has no answer by then raises `DeadlineExceeded` ("no answer within Xs", transient: a failure for
the store's health like a refusal) at once, and its thread is abandoned. Not an async HTTP
client: boto3 is where S3's signing, checksums, credential chain and error codes are right, and
one thread per request is what a store seam needs at our request rates; what must hold is the
deadline, and abandoning a thread gives exactly that.

What bounds the abandoned threads and their connections: trio releases an abandoned thread's
`CapacityLimiter` token only when the thread really ends (trio/_threads.py,
`report_back_in_trio_thread_fn` runs `limiter.release_on_behalf_of` once the worker returns), so
threads, abandoned or not, and their connections never exceed `max_connections` (the client's
pool is sized to match); a new call during an outage waits for a token (at most `Deadlines.queue`,
then `DeadlineExceeded` too). Each blocking socket call of a thread is bounded by botocore: a
connect or a send by `connect_timeout` (urllib3 sets the socket's timeout to it until the request
is sent), each receive by `read_timeout`; botocore does not retry (`max_attempts=1`). So a thread
talking to a black hole ends within connect_timeout + read_timeout (25 s) after its last byte
was taken; only a peer that trickles bytes can keep one longer, and it still holds its token.

Credentials come only from the standard AWS chain (environment, shared config/credentials
files, profile, instance metadata): this module never takes keys as arguments.

Conditional writes are probed, not assumed (`probe_conditional`, run at mount and, failing
that, before the first conditional PUT): S3-compatible stores differ (docs/STORES.md). Ceph RGW
16.2 refuses If-Match with the quoted ETag HeadObject returns and takes it bare, answers 412 (not
404) to If-Match on a missing key, ignores If-None-Match on CompleteMultipartUpload and answers
it with an empty ETag. So: If-Match is sent in the form the probe found; conditional writes are
only ever single PUTs (manifests); the ETag of a completed multipart upload comes from HEAD when
the answer has none.

Checksums: every PUT and part upload sends its CRC32C (`x-amz-checksum-crc32c`), which AWS S3
and SeaweedFS verify on receipt (Ceph RGW 16.2 and moto ignore it: the conformance suite says
so); the whole object's CRC32C is also stored as user metadata (`x-amz-meta-ckptfs-crc32c`),
because a multipart object's S3 checksum is a checksum of part checksums, not of the content.
Readers check every chunk against the manifest's CRC32Cs whatever the store did on receipt.
"""

from __future__ import annotations

import builtins
import logging
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import trio

from cachemgr.store import crt
from cachemgr.store.base import (
    PROBE_PREFIX,
    ConditionalWrites,
    DataClientStats,
    DeadlineExceeded,
    Deadlines,
    NotFound,
    ObjectInfo,
    ObjectStore,
    Part,
    Pause,
    PreconditionFailed,
    RangeCrcs,
    StoreError,
    TransientStoreError,
    bare_etag,
    check_key,
    crc32c,
    crc32c_b64,
    quoted_etag,
)
from cachemgr.store.crt import CrtData, CrtOptions
from cachemgr.store.plainhttp import PlainHttpData, PlainOptions

log = logging.getLogger(__name__)

META_CRC = "ckptfs-crc32c"

_TRANSIENT_CODES = {
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504",
}


MiB = 1 << 20


class _Held:
    """A limiter token already acquired for `borrower`, handed to `trio.to_thread.run_sync` as
    its limiter: the thread starts without waiting and the token is released when the thread
    really ends, abandoned or not (so the wait for a token has its own bound)."""

    def __init__(self, limiter: trio.CapacityLimiter, borrower: object) -> None:
        self._limiter = limiter
        self._borrower = borrower
        self.taken = False  # run_sync took the token over (it releases it from then on)

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        self.taken = True

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(self._borrower)


@dataclass(frozen=True)
class S3Options:
    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool = False
    profile: str | None = None
    max_connections: int = 16
    # The CRT's part and range size: the mount's --part-size, as the buffered path's parts
    part_size: int = 64 * MiB
    # botocore's bounds on each blocking socket call of a request's thread: a connect or a send
    # (connect_timeout), a receive (read_timeout). They bound how long an abandoned thread
    # lives (module docstring), not a request: that is `deadlines`.
    connect_timeout: float = 5.0
    read_timeout: float = 20.0
    deadlines: Deadlines = field(default_factory=Deadlines)
    # A store found to ignore conditional writes is used anyway, writing unconditionally (the
    # last writer of a path wins): `ckptfs mount --store-ignores-conditions`. Without it such a
    # store fails the conditional PUT (and the mount refuses it).
    allow_unconditional: bool = False
    # The data path (docs/ARCHITECTURE.md "Store data path"): whole uncompressed cache files
    # PUT and GET by the AWS Common Runtime (cachemgr.store.crt) where awscrt is installed;
    # False: every byte through boto3 (`ckptfs mount --s3-transfer boto3`).
    native: bool = True
    # GETs too (restores, `--s3-transfer crt`); off by default, measured dearer in CPU than
    # boto3's here (docs/ARCHITECTURE.md "Store data path")
    native_gets: bool = False
    # Over an http:// endpoint, uploads by plain HTTP with the body sent by sendfile
    # (cachemgr.store.plainhttp: measured far cheaper in CPU than the CRT there) instead of the
    # CRT; `ckptfs mount --s3-transfer auto` (the default). The CRT stays the data path over
    # https:// and with --s3-transfer crt.
    plain_http: bool = True


def parse_s3_url(url: str) -> tuple[str, str]:
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StoreError(f"no bucket in {url!r}")
    prefix = prefix.strip("/")
    return bucket, (prefix + "/" if prefix else "")


class S3Store(ObjectStore):
    def __init__(self, url: str, opts: S3Options = S3Options()) -> None:
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        session = boto3.session.Session(profile_name=opts.profile, region_name=opts.region)
        cfg = botocore.config.Config(
            retries={"max_attempts": 1, "mode": "standard"},
            max_pool_connections=opts.max_connections,
            connect_timeout=opts.connect_timeout,
            read_timeout=opts.read_timeout,
            # Path style only when asked: an explicit "auto" would override the AWS config
            # file's `s3 = addressing_style = path` (botocore merges client config over it).
            s3={"addressing_style": "path"} if opts.path_style else None,
            # We send our own CRC32C; don't let botocore compute another checksum per request.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.client = session.client("s3", endpoint_url=opts.endpoint_url, config=cfg)
        self._limiter = trio.CapacityLimiter(opts.max_connections)
        self.deadlines = opts.deadlines
        self._allow_unconditional = opts.allow_unconditional
        # What the probe found; written once by probe_conditional under _probe_lock (trio
        # thread only), read by put() and by callers through `supports_conditional_put`.
        self._conditional: ConditionalWrites | None = None
        self._probe_lock = trio.Lock()
        self.crt: CrtData | None = None
        self.plain: PlainHttpData | None = None
        self.crt_off_reason = ""
        if opts.plain_http and opts.native and \
                (opts.endpoint_url or "").lower().startswith("http://"):
            # uploads by sendfile, restores by boto3: no CRT needed
            self.plain = self._make_plain(session, opts)
        if self.plain is None:
            if not crt.HAVE_CRT:
                self.crt_off_reason = "awscrt is not installed"
            elif not opts.native:
                self.crt_off_reason = "turned off (--s3-transfer boto3)"
            else:
                self.crt = self._make_crt(session, opts)
        self._native_gets = self.crt is not None and opts.native_gets

    def _native_kw(self, session: boto3.session.Session, opts: S3Options) -> \
            dict[str, Any] | None:
        """The options both native data clients take (CrtOptions, PlainOptions), credentials,
        region and addressing as boto3 has them; None (and `crt_off_reason` said) without
        credentials."""
        if session.get_credentials() is None:
            self.crt_off_reason = "no credentials in the AWS chain when mounted"
            return None

        def credentials() -> tuple[str, str, str | None]:
            # boto3's chain, refreshed as boto3 refreshes it (one source of credentials)
            got = session.get_credentials()
            if got is None:
                raise StoreError("the AWS credential chain has no credentials any more")
            f = got.get_frozen_credentials()
            return f.access_key, f.secret_key, f.token

        # the addressing boto3 uses: the option, or the profile's `s3 = addressing_style = path`
        # (botocore merges it into the client's config)
        s3cfg = self.client.meta.config.s3 or {}
        return {"bucket": self.bucket, "prefix": self.prefix,
                "region": opts.region or session.region_name or "us-east-1",
                "endpoint_url": opts.endpoint_url,
                "path_style": opts.path_style or s3cfg.get("addressing_style") == "path",
                "credentials": credentials, "max_connections": opts.max_connections,
                "connect_timeout": opts.connect_timeout, "part_size": opts.part_size}

    def _make_crt(self, session: boto3.session.Session, opts: S3Options) -> CrtData | None:
        kw = self._native_kw(session, opts)
        return None if kw is None else CrtData(CrtOptions(**kw))

    def _make_plain(self, session: boto3.session.Session,
                    opts: S3Options) -> PlainHttpData | None:
        kw = self._native_kw(session, opts)
        if kw is None or not opts.endpoint_url:
            return None
        return PlainHttpData(PlainOptions(**kw), opts.deadlines)

    @property
    def data_path(self) -> str:
        if self.plain is not None:
            return "sendfile"
        if self.crt is None:
            return "boto3"
        return "crt" if self._native_gets else "crt-up"

    @property
    def sends_files(self) -> bool:
        return self.crt is not None or self.plain is not None

    @property
    def gets_files(self) -> bool:
        return self._native_gets

    @staticmethod
    def _fd_path(fd: int) -> str:
        # the CRT opens a path: this one is the very file the caller holds open, whatever
        # renames its name meanwhile
        return f"/proc/self/fd/{fd}"

    async def put_file(self, key: str, fd: int, size: int, crc32c: int,
                       ranges: RangeCrcs | None = None,
                       pause: Pause | None = None) -> ObjectInfo:
        if self.plain is not None:
            etag = await self.plain.put_file(key, fd, size, crc32c, ranges, pause)
            return ObjectInfo(key, size, etag, crc32c)
        assert self.crt is not None, "put_file without a native data path (sends_files)"
        etag = await self.crt.put_file(key, self._fd_path(fd), size, crc32c,
                                       self.deadlines.data(size))
        return ObjectInfo(key, size, etag, crc32c)

    async def get_file(self, key: str, fd: int, start: int, length: int) -> None:
        assert self.crt is not None, "get_file without a native data path (gets_files)"
        await self.crt.get_file(key, self._fd_path(fd), start, length,
                                self.deadlines.data(length))

    def data_statistics(self) -> DataClientStats:
        """For status: which client moves data bytes, and its counters."""
        if self.plain is not None:
            ps = self.plain.stats
            return DataClientStats(client="sendfile", restores_by="boto3", puts=ps.puts,
                                   put_bytes=ps.put_bytes, parts=ps.parts,
                                   cancelled=ps.cancelled, reconnects=ps.reconnects,
                                   errors=dict(ps.errors))
        if self.crt is None:
            return DataClientStats(client="boto3", why=self.crt_off_reason)
        st = self.crt.stats
        return DataClientStats(client="crt", restores_by="crt" if self._native_gets else "boto3",
                               puts=st.puts, put_bytes=st.put_bytes, gets=st.gets,
                               get_bytes=st.get_bytes, cancelled=st.cancelled,
                               errors=dict(st.errors))

    @property
    def conditional(self) -> ConditionalWrites | None:
        return self._conditional

    @property
    def supports_conditional_put(self) -> bool:
        # Not probed yet: callers go ahead with a conditional PUT, which probes first.
        return self._conditional is None or self._conditional.honoured

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    async def _thread(self, deadline: float, what: str, key: str | None,
                      fn: Callable[[], Any], scope: list[trio.CancelScope] | None = None) -> Any:
        """`fn()` in a worker thread, its answer awaited at most `deadline` seconds once a
        connection is free (at most `deadlines.queue`): else DeadlineExceeded at once, the
        thread abandoned (module docstring: what bounds it). `scope`: gets the deadline's
        cancel scope, which the thread may move (`_sized`)."""
        borrower = object()
        with trio.move_on_after(self.deadlines.queue) as queued:
            await self._limiter.acquire_on_behalf_of(borrower)
        if queued.cancelled_caught:
            raise DeadlineExceeded(f"{what} {key or ''}: no connection free within "
                                   f"{self.deadlines.queue:.0f}s", key=key)
        held = _Held(self._limiter, borrower)
        try:
            with trio.move_on_after(deadline) as bound:
                begun = bound.deadline - deadline
                if scope is not None:
                    scope.append(bound)
                # trio takes any "CapacityLimiter-like object" (run_sync's docstring); its
                # annotation names only CapacityLimiter
                return await trio.to_thread.run_sync(
                    fn, abandon_on_cancel=True, limiter=held)  # type: ignore[arg-type]
        finally:
            if not held.taken:  # cancelled before run_sync took it: no thread will release it
                self._limiter.release_on_behalf_of(borrower)
        deadline = bound.deadline - begun  # as `_sized` may have moved it
        raise DeadlineExceeded(f"{what} {key or ''}: no answer within {deadline:.0f}s", key=key)

    def _sized(self, scope: list[trio.CancelScope], nbytes: int) -> None:
        """From a request's thread, once the answer's headers give its size: its deadline,
        `deadlines.base` from its start, becomes `deadlines.data(nbytes)` from its start (a
        document read whole is given what its body needs, not what its 64 MiB cap would:
        issue 36)."""
        def move() -> None:
            scope[0].deadline += self.deadlines.data(nbytes) - self.deadlines.base
        try:
            trio.from_thread.run_sync(move)
        except trio.RunFinishedError:
            pass  # abandoned, and the run is over: nobody waits for this answer

    async def _call(self, key: str | None, deadline: float, fn: Callable[..., Any],
                    **kw: Any) -> Any:
        """`fn(**kw)` (a boto3 client method) in a worker thread within `deadline`, its errors
        translated."""
        def run() -> Any:
            try:
                return fn(**kw)
            except botocore.exceptions.ClientError as e:
                raise _translate(e, key) from None
            except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
                    botocore.exceptions.ReadTimeoutError,
                    botocore.exceptions.ConnectTimeoutError) as e:
                raise TransientStoreError(f"{fn.__name__} {key}: {e}", key=key) from None
        return await self._thread(deadline, fn.__name__, key, run)

    async def put(self, key: str, data: bytes | memoryview, *, if_none_match: bool = False,
                  if_match: str | None = None) -> ObjectInfo:
        conditions: dict[str, str] = {}
        if if_none_match or if_match is not None:
            caps = self._conditional or await self.probe_conditional()
            if not caps.honoured:
                if not self._allow_unconditional:
                    raise StoreError(f"the store {caps.describe()}: a conditional PUT of {key}"
                                     " cannot be made (see docs/STORES.md)", key=key)
            elif if_none_match:
                conditions["IfNoneMatch"] = "*"
            else:
                assert if_match is not None
                conditions["IfMatch"] = bare_etag(if_match) if caps.etag_form == "bare" \
                    else quoted_etag(if_match)
        return await self._put(key, data, conditions)

    async def _put(self, key: str, data: bytes | memoryview,
                   conditions: dict[str, str]) -> ObjectInfo:
        crc = crc32c(data)
        r = await self._call(key, self.deadlines.data(len(data)), self.client.put_object,
                             Bucket=self.bucket, Key=self._k(key), Body=bytes(data),
                             ChecksumCRC32C=crc32c_b64(crc), Metadata={META_CRC: str(crc)},
                             **conditions)
        return ObjectInfo(key, len(data), r["ETag"], crc)

    # -- the conditional-write probe ------------------------------------------------------------

    async def probe_conditional(self) -> ConditionalWrites:
        """PUT a scratch object under `probe/` with each condition and see what the store does
        with it (docs/STORES.md); the object is deleted whatever happens. Six to eight requests,
        once per mount. Raises StoreError if the store cannot be asked (then nothing is
        remembered and the next conditional PUT asks again)."""
        async with self._probe_lock:
            if self._conditional is not None:
                return self._conditional
            key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
            missing = key + ".absent"
            try:
                caps = await self._probe(key, missing)
            finally:
                with trio.CancelScope(shield=True):
                    for k in (key, missing):
                        try:
                            await self.delete(k)
                        except StoreError as e:
                            log.warning("conditional-write probe: cannot delete %s: %s", k, e)
            self._conditional = caps
            log.info("store %s: conditional writes %s", self.url, caps.describe())
            return caps

    async def _refused(self, key: str, data: bytes, conditions: dict[str, str]) -> bool:
        """Whether a PUT with `conditions` was refused (412)."""
        try:
            await self._put(key, data, conditions)
        except PreconditionFailed:
            return True
        return False

    async def _probe(self, key: str, missing: str) -> ConditionalWrites:
        await self._put(key, b"1", {"IfNoneMatch": "*"})  # a new key: written
        if_none_match = await self._refused(key, b"2", {"IfNoneMatch": "*"})
        wrong = await self._refused(key, b"3", {"IfMatch": quoted_etag("0" * 32)})
        current = (await self.head(key)).etag
        form = None
        for name, tag in (("quoted", quoted_etag(current)), ("bare", bare_etag(current))):
            if not await self._refused(key, b"4", {"IfMatch": tag}):
                form = name
                break
        if_match = wrong and form is not None
        absent = ""
        if if_match:
            try:
                await self._put(missing, b"5", {"IfMatch": quoted_etag(current)})
                if_match = False  # a PUT on a missing key passed If-Match: ignored after all
            except NotFound:
                absent = "404"
            except PreconditionFailed:
                absent = "412"
        return ConditionalWrites(if_none_match, if_match, form or "quoted", absent)

    async def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        kw: dict[str, Any] = {"Bucket": self.bucket, "Key": self._k(key)}
        if start or length is not None:
            if length == 0:
                return b""
            end = "" if length is None else str(start + length - 1)
            kw["Range"] = f"bytes={start}-{end}"

        # a read of unknown length (a document read whole): `base` for the answer's headers,
        # then its deadline sized to the body they announce (`_sized`)
        scope: list[trio.CancelScope] = []

        def fetch() -> bytes:
            try:
                r = self.client.get_object(**kw)
                if length is None:
                    self._sized(scope, int(r.get("ContentLength") or 0))
                body: bytes = r["Body"].read()
                return body
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") == "InvalidRange":
                    return b""
                raise _translate(e, key) from None
            except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
                    botocore.exceptions.ReadTimeoutError, ConnectionError) as e:
                raise TransientStoreError(f"get {key}: {e}", key=key) from None
        data: bytes = await self._thread(
            self.deadlines.base if length is None else self.deadlines.data(length),
            "get_object", key, fetch, scope)
        return data

    async def head(self, key: str) -> ObjectInfo:
        r = await self._call(key, self.deadlines.control, self.client.head_object,
                             Bucket=self.bucket, Key=self._k(key))
        crc = _crc_meta(r.get("Metadata", {}).get(META_CRC))
        size, etag, modified = r.get("ContentLength"), r.get("ETag"), r.get("LastModified")
        if not isinstance(size, int) or not isinstance(etag, str):
            raise StoreError(f"head {key}: the store's answer has no size or ETag", key=key)
        # Last-Modified is informational (ObjectInfo.mtime): a store that leaves it out is
        # not refused for it
        return ObjectInfo(key, size, etag, crc, modified.timestamp() if modified else 0.0)

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        """Every page in its own thread, each within `deadlines.list_page`: a long listing is
        never cut short for being long, a page that does not come is."""
        pages: Iterator[dict[str, Any]] = iter(self.client.get_paginator(
            "list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix))

        def page() -> dict[str, Any] | None:
            try:
                return next(pages, None)
            except botocore.exceptions.ClientError as e:
                raise _translate(e, prefix) from None
            except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
                    botocore.exceptions.ReadTimeoutError,
                    botocore.exceptions.ConnectTimeoutError) as e:
                raise TransientStoreError(f"list {prefix}: {e}") from None

        out = []
        while (got := await self._thread(self.deadlines.list_page, "list_objects_v2", prefix,
                                         page)) is not None:
            for o in got.get("Contents", []):
                out.append(ObjectInfo(o["Key"][len(self.prefix):], o["Size"], o["ETag"],
                                      None, o["LastModified"].timestamp()))
        return sorted(out, key=lambda i: i.key)

    async def delete(self, key: str) -> None:
        await self._call(key, self.deadlines.control, self.client.delete_object,
                         Bucket=self.bucket, Key=self._k(key))

    async def create_multipart(self, key: str) -> str:
        r = await self._call(key, self.deadlines.control, self.client.create_multipart_upload,
                             Bucket=self.bucket, Key=self._k(key), ChecksumAlgorithm="CRC32C")
        upload_id: str = r["UploadId"]
        return upload_id

    async def upload_part(self, key: str, upload_id: str, number: int,
                          data: bytes | memoryview) -> Part:
        crc = crc32c(data)
        r = await self._call(key, self.deadlines.data(len(data)), self.client.upload_part,
                             Bucket=self.bucket, Key=self._k(key), UploadId=upload_id,
                             PartNumber=number, Body=bytes(data), ChecksumCRC32C=crc32c_b64(crc))
        return Part(number, r["ETag"], crc, len(data))

    async def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[Part],
                                 crc32c: int) -> ObjectInfo:
        ordered = sorted(parts, key=lambda p: p.number)
        r = await self._call(
            key, self.deadlines.complete + self.deadlines.complete_per_part * len(ordered),
            self.client.complete_multipart_upload, Bucket=self.bucket, Key=self._k(key),
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": p.number, "ETag": p.etag,
                                        "ChecksumCRC32C": crc32c_b64(p.crc32c)}
                                       for p in ordered]},
        )
        # The whole object's CRC32C is not known when the upload is created (it streams), so it
        # is not in the object's metadata: callers record it in their manifest, and head() of a
        # multipart object reports crc32c=None. RGW 16.2 answers with an empty ETag: HEAD has it.
        etag = r.get("ETag") or (await self.head(key)).etag
        return ObjectInfo(key, sum(p.size for p in ordered), etag, crc32c)

    async def aclose(self) -> None:
        if self.crt is not None:
            self.crt.close()
            self.crt = None
        if self.plain is not None:
            self.plain.close()

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        try:
            await self._call(key, self.deadlines.control, self.client.abort_multipart_upload,
                             Bucket=self.bucket, Key=self._k(key), UploadId=upload_id)
        except NotFound:
            pass


def _translate(e: botocore.exceptions.ClientError, key: str | None) -> StoreError:
    err = e.response.get("Error", {})
    code = str(err.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    msg = f"{code or status}: {err.get('Message', '')} ({key})"
    if code in ("NoSuchKey", "404", "NotFound", "NoSuchUpload"):
        return NotFound(msg, key=key)
    if code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status in (409, 412):
        return PreconditionFailed(msg, key=key)
    if code in _TRANSIENT_CODES or status >= 500 or status == 429:
        return TransientStoreError(msg, key=key)
    return StoreError(msg, key=key)


def _crc_meta(v: object) -> int | None:
    """The CRC32C of an object's user metadata, or None (absent, or not one: metadata is
    anyone's to write, and a bad value must not stop a reader; it is then not checked)."""
    if isinstance(v, str) and v.isdigit() and len(v) <= 10 and int(v) < 1 << 32:
        return int(v)
    return None
