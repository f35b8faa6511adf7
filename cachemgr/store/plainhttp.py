"""The upload data path of `s3.S3Store` over plain HTTP (an `http://` endpoint): a cache file's
bytes go from the page cache to the socket by `sendfile(2)`, never through the interpreter or a
user-space buffer, on requests signed with SigV4's `UNSIGNED-PAYLOAD` (the signature covers the
method, path and headers; the body's integrity is its `x-amz-checksum-crc32c`, folded from the
chunk CRC32Cs the manifest needs anyway, and the HEAD after the PUT). Why (docs/PERFORMANCE.md
"Where the CPU goes"): on this VM the CRT spends 1.5-2.0 CPU-s per GiB to send a file to a sink
that costs nothing; an HTTP PUT whose body goes by `sendfile` costs 0.15. Over `https://` the
bytes must be encrypted in user space (kTLS is not built), so the CRT stays the data path there.

What it owns: a pool of idle keep-alive connections, the request threads, and the translation
of the store's answers into the store seam's errors. It does not own the object layout, the
retries (`RetryingStore` retries a failed file whole, as for the CRT), nor the integrity
checks (the uploader computes the chunk CRC32Cs before the PUT and HEADs after it:
cachemgr.transfer.upload).

Requests
    `put_file` <= the part size: one PUT, `x-amz-checksum-crc32c` the whole file's CRC32C (AWS
    and SeaweedFS check it on receipt, BadDigest; RGW 16.2 and moto do not),
    `x-amz-meta-ckptfs-crc32c` too so a HEAD can check it, as on the other paths.
    Bigger: a multipart upload whose parts go in parallel (at most `max_connections` requests
    of this client at once, every file together), each part's CRC32C folded from the chunk
    CRC32Cs (parts are whole chunks) and sent and listed at the completion; a failure aborts
    the upload (bounded, shielded) before the error is raised.

Threads and deadlines (docs/ARCHITECTURE.md "Store deadlines")
    Each request runs in a thread of its own (blocking socket calls, idle I/O priority: the
    sendfile reads the cache disk as the buffered path's preads do, at idle priority; CPU
    priority stays normal, as the CRT's and boto3's senders'), and the trio task awaits it
    within the deadline its bytes give (`Deadlines.data`). At the deadline, or when the caller
    is cancelled, the trio task shuts the socket down (`_Attempt.kill`), which ends the
    thread's blocked send or receive at once, and waits for the thread (at most `CANCEL_WAIT`,
    shielded) so that the cache file is no longer read when the call returns; then
    `DeadlineExceeded`. A store that accepts and never answers holds one connection per
    request in flight, and never longer than the deadline.

State and who guards it
    `_idle` (the pool): `_pool_lock` (a threading.Lock: request threads take and give back
    connections). `_Attempt.sock`/`killed`: the attempt's own lock (the request thread
    swaps in a fresh connection when a pooled one turned out closed; the trio task kills).
    `stats`: the trio thread only. The credentials callable is called in the request
    thread (signing), never on the trio thread.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import socket
import struct
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import trio
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from cachemgr.host import background
from cachemgr.store.base import (
    DeadlineExceeded,
    Pause,
    RangeCrcs,
    StoreError,
    TransientStoreError,
    answer_error,
    await_within,
    check_key,
    is_ip_or_local,
)

if TYPE_CHECKING:
    from cachemgr.store.base import Deadlines

log = logging.getLogger(__name__)

MiB = 1 << 20
S3_MAX_PARTS = 10_000
S3_MIN_PART = 5 * MiB
HEAD_MAX = 64 << 10      # an answer's status line and headers
BODY_MAX = 1 << 20       # an answer's body (an error document, a multipart upload's XML)
# After a kill, how long the request thread gets to notice (its socket calls end at once: the
# bound is for a sendfile blocked on a slow disk read)
CANCEL_WAIT = 10.0
META_CRC = "ckptfs-crc32c"


@dataclass
class PlainStats:
    """Counters of the plain HTTP data path (trio thread only)."""

    puts: int = 0
    put_bytes: int = 0
    parts: int = 0
    cancelled: int = 0          # requests killed at their deadline or by the caller
    reconnects: int = 0         # a pooled connection found closed by the store, sent again
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PlainOptions:
    bucket: str
    prefix: str
    endpoint_url: str           # http://host[:port]
    region: str
    path_style: bool
    credentials: Callable[[], tuple[str, str, str | None]]   # (key, secret, token), per request
    max_connections: int = 16
    part_size: int = 64 * MiB   # the mount's --part-size: the single-PUT limit and part size
    connect_timeout: float = 5.0
    # each blocking socket call of a request thread (a backstop: the deadline kills first)
    io_timeout: float = 60.0


class _Answer(NamedTuple):
    status: int
    headers: dict[str, str]     # lower-case names
    body: bytes


class _Stale(Exception):
    """A pooled connection turned out closed before the store answered a byte."""


class _Killed(Exception):
    """The trio task killed this request (deadline or cancellation)."""


class _Unsigned(S3SigV4Auth):  # type: ignore[misc]  # botocore has no types
    """SigV4 with `UNSIGNED-PAYLOAD` in place of the body's SHA-256 (botocore signs the body
    over plain HTTP unless told otherwise; the body is the cache file, sent by sendfile)."""

    def _should_sha256_sign_payload(self, request: AWSRequest) -> bool:
        return False


class _Attempt:
    """The connection one request is using, and whether the trio task has killed it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.killed = False

    def use(self, sock: socket.socket) -> None:
        with self._lock:
            if self.killed:
                sock.close()
                raise _Killed()
            self._sock = sock

    def kill(self) -> None:
        with self._lock:
            self.killed = True
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _b64crc(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def part_crcs(size: int, part: int, ranges: RangeCrcs | None) -> list[int] | None:
    """Each part's CRC32C, from the caller's (parts of `part` bytes, the last one short); None
    when the caller cannot give every one."""
    if ranges is None:
        return None
    out = []
    for off in range(0, size, part):
        crc = ranges.crc(off, min(part, size - off))
        if crc is None:
            return None
        out.append(crc)
    return out


class PlainHttpData:
    """Whole-file PUTs over plain HTTP, the body by sendfile (see the module docstring)."""

    def __init__(self, opts: PlainOptions, deadlines: Deadlines) -> None:
        u = urllib.parse.urlsplit(opts.endpoint_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"the plain HTTP data path needs an http:// endpoint, "
                             f"got {opts.endpoint_url!r}")
        self.opts = opts
        self.deadlines = deadlines
        self.stats = PlainStats()
        self._addr = (u.hostname, u.port or 80)
        host = u.hostname
        netloc = u.netloc
        if opts.path_style or is_ip_or_local(host):
            self._host, self._root = netloc, f"/{opts.bucket}/"
        else:
            self._host, self._root = f"{opts.bucket}.{netloc}", "/"
        self._pool_lock = threading.Lock()
        self._idle: list[socket.socket] = []        # guarded by _pool_lock
        self._limiter = trio.CapacityLimiter(opts.max_connections)
        self._closed = False

    # -- the seam -------------------------------------------------------------------------------

    async def put_file(self, key: str, fd: int, size: int, crc: int,
                       ranges: RangeCrcs | None, pause: Pause | None = None) -> str:
        """PUT the first `size` bytes of the open file `fd` as `key`, the whole file's CRC32C
        `crc` in its metadata; `ranges` gives the parts' CRC32Cs; `pause(bytes)` is awaited
        before each part goes (the trainer first). Returns the ETag the store answered ("" when
        it gave none)."""
        part = self._part_size(size, ranges.unit if ranges is not None else 0)
        if size <= part:
            headers = {"Content-Type": "application/octet-stream",
                       f"x-amz-meta-{META_CRC}": str(crc),
                       "x-amz-checksum-crc32c": _b64crc(crc)}
            ans = await self._request("PUT", key, "", headers, (fd, 0, size),
                                      self.deadlines.data(size), "put")
            self.stats.puts += 1
            self.stats.put_bytes += size
            return ans.headers.get("etag", "")
        return await self._multipart(key, fd, size, crc, part, part_crcs(size, part, ranges),
                                     pause)

    def _part_size(self, size: int, chunk_size: int) -> int:
        # parts of whole chunks (their CRCs fold), at least S3's smallest part, at most its
        # 10,000 parts
        unit = chunk_size or MiB
        part = max(self.opts.part_size, S3_MIN_PART, -(-size // S3_MAX_PARTS))
        return -(-part // unit) * unit

    async def _multipart(self, key: str, fd: int, size: int, crc: int, part: int,
                         crcs: list[int] | None, pause: Pause | None) -> str:
        headers = {"Content-Type": "application/octet-stream",
                   f"x-amz-meta-{META_CRC}": str(crc)}
        if crcs is not None:
            headers["x-amz-checksum-algorithm"] = "CRC32C"
        ans = await self._request("POST", key, "uploads=", headers, b"",
                                  self.deadlines.control, "create_multipart")
        m = re.search(rb"<UploadId>([^<]{1,1024})</UploadId>", ans.body)
        if m is None:
            raise StoreError(f"create_multipart {key}: no UploadId in the answer", key=key)
        upload_id = _unxml(m.group(1).decode("ascii", "replace"))
        qid = "uploadId=" + urllib.parse.quote(upload_id, safe="")
        n = -(-size // part)
        etags: list[str] = [""] * n
        try:
            await self._send_parts(key, fd, size, part, crcs, qid, etags, pause)
            parts = "".join(
                f"<Part><PartNumber>{i + 1}</PartNumber><ETag>{_xml(etags[i])}</ETag>"
                + (f"<ChecksumCRC32C>{_b64crc(crcs[i])}</ChecksumCRC32C>" if crcs else "")
                + "</Part>" for i in range(n))
            body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
            done = await self._request(
                "POST", key, qid, {"Content-Type": "application/xml"}, body,
                self.deadlines.complete + self.deadlines.complete_per_part * n, "complete")
            if b"<Error>" in done.body:  # S3 may answer 200 and report the failure in the body
                raise _error(500, done.body, "complete", key)
        except BaseException:
            with trio.CancelScope(shield=True), trio.move_on_after(self.deadlines.control):
                try:
                    await self._request("DELETE", key, qid, {}, b"", self.deadlines.control,
                                        "abort")
                except StoreError as e:
                    log.warning("abort of %s's multipart upload failed: %s", key, e)
            raise
        self.stats.puts += 1
        m = re.search(rb"<ETag>([^<]{0,1024})</ETag>", done.body)
        return _unxml(m.group(1).decode("ascii", "replace")) if m else ""

    async def _send_parts(self, key: str, fd: int, size: int, part: int,
                          crcs: list[int] | None, qid: str, etags: list[str],
                          pause: Pause | None) -> None:
        """Every part in parallel (the client's limiter bounds them), each once `pause` lets
        it go; the first store error is raised as it is, not in a group."""

        async def one(i: int) -> None:
            off = i * part
            length = min(part, size - off)
            if pause is not None:
                await pause(length)
            ph = {"x-amz-checksum-crc32c": _b64crc(crcs[i])} if crcs is not None else {}
            got = await self._request("PUT", key, f"partNumber={i + 1}&{qid}", ph,
                                      (fd, off, length), self.deadlines.data(length),
                                      "upload_part")
            etags[i] = got.headers.get("etag", "")
            if not etags[i]:
                raise StoreError(f"upload_part {key}: no ETag for part {i + 1}", key=key)
            self.stats.parts += 1
            self.stats.put_bytes += length

        try:
            async with trio.open_nursery() as nursery:
                for i in range(len(etags)):
                    nursery.start_soon(one, i)
        except BaseExceptionGroup as eg:
            errors, _rest = eg.split(StoreError)
            if errors is None:
                raise
            first: BaseException = errors
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None

    # -- one request ------------------------------------------------------------------------------

    async def _request(self, method: str, key: str, query: str, headers: dict[str, str],
                       body: bytes | tuple[int, int, int], deadline: float,
                       what: str) -> _Answer:
        """One request in a thread of its own, awaited within `deadline` (module docstring)."""
        target = self._root + urllib.parse.quote(self.opts.prefix + check_key(key),
                                                 safe="/-_.~")
        if query:
            target += "?" + query
        attempt = _Attempt()
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        box: dict[str, object] = {}
        reconnected: list[bool] = []

        def run() -> None:
            try:
                # signed here, not on the loop: the credential chain may refresh itself over
                # the network (STS, IMDS) when its credentials near their expiry
                head = self._head(method, target, headers, body)
                box["answer"] = background.run_idle(self._exchange, attempt, head, body,
                                                    reconnected, cpu=False)
            except BaseException as e:  # noqa: BLE001 - handed to the trio task
                box["error"] = e
            finally:
                try:
                    token.run_sync_soon(done.set)
                except trio.RunFinishedError:
                    pass

        def kill() -> None:  # the deadline, or the caller was cancelled
            attempt.kill()
            self.stats.cancelled += 1

        async with self._limiter:
            trio.lowlevel.start_thread_soon(run, lambda _: None, name=f"ckptfs {what}")
            timed_out = await await_within(done, deadline, kill, CANCEL_WAIT)
        if reconnected:
            self.stats.reconnects += 1
        if timed_out:
            raise DeadlineExceeded(f"{what} {key}: no answer within {deadline:.0f}s", key=key)
        err = box.get("error")
        if err is not None:
            if isinstance(err, StoreError):
                e = err
            elif isinstance(err, OSError):
                # no HTTP answer: refused, reset, a socket call timed out: worth retrying
                e = TransientStoreError(f"{what} {key}: {err}", key=key)
            else:
                raise err  # type: ignore[misc]  # a bug: as it is
            e.key = e.key or key
            name = type(e).__name__
            self.stats.errors[name] = self.stats.errors.get(name, 0) + 1
            raise e
        ans = box["answer"]
        assert isinstance(ans, _Answer)
        if not 200 <= ans.status < 300:
            e = _error(ans.status, ans.body, what, key)
            name = type(e).__name__
            self.stats.errors[name] = self.stats.errors.get(name, 0) + 1
            raise e
        return ans

    def _head(self, method: str, target: str, headers: dict[str, str],
              body: bytes | tuple[int, int, int]) -> bytes:
        """The request's line and signed headers."""
        length = len(body) if isinstance(body, bytes) else body[2]
        hdrs = {"Host": self._host, **headers}
        if method in ("PUT", "POST") or length:
            hdrs["Content-Length"] = str(length)
        req = AWSRequest(method=method, url=f"http://{self._host}{target}", headers=hdrs,
                         data=body if isinstance(body, bytes) else b"")
        k, s, t = self.opts.credentials()
        signer = S3SigV4Auth if isinstance(body, bytes) else _Unsigned
        signer(Credentials(k, s, t), "s3", self.opts.region).add_auth(req)
        lines = [f"{method} {target} HTTP/1.1"]
        lines += [f"{name}: {value}" for name, value in req.headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    # -- the request thread ---------------------------------------------------------------------

    def _connect(self, attempt: _Attempt) -> tuple[socket.socket, bool]:
        with self._pool_lock:
            sock = self._idle.pop() if self._idle else None
        pooled = sock is not None
        if sock is None:
            sock = socket.create_connection(self._addr, timeout=self.opts.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # blocking (sendfile needs it), each call bounded by the kernel's timeouts: a
            # backstop, the deadline's kill comes first
            sock.settimeout(None)
            tv = struct.pack("ll", int(self.opts.io_timeout), 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        attempt.use(sock)
        return sock, pooled

    def _give_back(self, sock: socket.socket) -> None:
        with self._pool_lock:
            if not self._closed and len(self._idle) < self.opts.max_connections:
                self._idle.append(sock)
                return
        sock.close()

    def _exchange(self, attempt: _Attempt, head: bytes, body: bytes | tuple[int, int, int],
                  reconnected: list[bool]) -> _Answer:
        while True:
            sock, pooled = self._connect(attempt)
            try:
                ans, keep = _send_and_read(sock, head, body)
            except _Stale:
                sock.close()
                if not pooled or attempt.killed:
                    raise TransientStoreError("the store closed the connection without "
                                              "answering") from None
                reconnected.append(True)
                continue
            except BaseException:
                sock.close()
                if attempt.killed:
                    raise _Killed() from None
                raise
            if keep and not attempt.killed:
                self._give_back(sock)
            else:
                sock.close()
            return ans

    def close(self) -> None:
        with self._pool_lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def _send_and_read(sock: socket.socket, head: bytes,
                   body: bytes | tuple[int, int, int]) -> tuple[_Answer, bool]:
    """Send one request and read its answer (blocking calls, a request thread). Returns the
    answer and whether the connection may be used again."""
    try:
        if isinstance(body, bytes):
            sock.sendall(head + body)
        else:
            fd, off, n = body
            sock.sendall(head, socket.MSG_MORE)
            end = off + n
            while off < end:
                k = _sendfile(sock, fd, off, end - off)
                if k == 0:
                    raise StoreError(f"cache file ends at byte {off}, expected {end}")
                off += k
    except (BrokenPipeError, ConnectionResetError):
        # the store may have answered early (an error) and closed: read what it said
        pass
    buf = bytearray()
    while True:
        try:
            got = sock.recv(65536)
        except ConnectionResetError:
            got = b""
        if not got:
            if not buf:
                raise _Stale()
            raise TransientStoreError("the store closed the connection mid-answer")
        buf += got
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            break
        if len(buf) > HEAD_MAX:
            raise StoreError(f"the store's answer has over {HEAD_MAX} bytes of headers")
    status, headers = _parse_head(bytes(buf[:end]))
    rest = bytes(buf[end + 4:])
    keep = headers.get("connection", "").lower() != "close"
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body_bytes = _read_chunked(sock, rest)
    elif "content-length" in headers:
        try:
            want = int(headers["content-length"])
        except ValueError:
            raise StoreError("the store's answer has a bad Content-Length") from None
        if not 0 <= want <= BODY_MAX:
            raise StoreError(f"the store's answer is {want} bytes, over {BODY_MAX}")
        body_bytes = _read_exact(sock, rest, want)
    elif status in (204, 304) or 100 <= status < 200:
        body_bytes = b""
    else:  # no length: up to the close
        body_bytes, keep = _read_to_close(sock, rest), False
    return _Answer(status, headers, body_bytes), keep


def _sendfile(sock: socket.socket, fd: int, off: int, n: int) -> int:
    return os.sendfile(sock.fileno(), fd, off, n)


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise StoreError(f"the store answered something other than HTTP: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _read_exact(sock: socket.socket, have: bytes, want: int) -> bytes:
    if len(have) > want:
        raise StoreError("the store sent more than its Content-Length")
    out = bytearray(have)
    while len(out) < want:
        got = sock.recv(min(65536, want - len(out)))
        if not got:
            raise TransientStoreError("the store closed the connection mid-answer")
        out += got
    return bytes(out)


def _read_to_close(sock: socket.socket, have: bytes) -> bytes:
    out = bytearray(have)
    while True:
        got = sock.recv(65536)
        if not got:
            return bytes(out)
        out += got
        if len(out) > BODY_MAX:
            raise StoreError(f"the store's answer is over {BODY_MAX} bytes")


def _read_chunked(sock: socket.socket, have: bytes) -> bytes:
    buf = bytearray(have)
    out = bytearray()

    def line() -> bytes:
        while True:
            i = buf.find(b"\r\n")
            if i >= 0:
                got = bytes(buf[:i])
                del buf[:i + 2]
                return got
            if len(buf) > 4096:
                raise StoreError("the store's chunked answer has a bad chunk header")
            more = sock.recv(65536)
            if not more:
                raise TransientStoreError("the store closed the connection mid-answer")
            buf.extend(more)

    while True:
        size_field = line().split(b";", 1)[0].strip()
        try:
            n = int(size_field, 16)
        except ValueError:
            raise StoreError("the store's chunked answer has a bad chunk size") from None
        if n == 0:
            while line():  # trailers, up to the empty line
                pass
            return bytes(out)
        if len(out) + n > BODY_MAX:
            raise StoreError(f"the store's answer is over {BODY_MAX} bytes")
        while len(buf) < n + 2:
            more = sock.recv(65536)
            if not more:
                raise TransientStoreError("the store closed the connection mid-answer")
            buf.extend(more)
        out += buf[:n]
        del buf[:n + 2]


def _xml(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace(
        '"', "&quot;")


def _unxml(s: str) -> str:
    return s.replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace(
        "&amp;", "&")


def _error(status: int, body: bytes, what: str, key: str) -> StoreError:
    m = re.search(rb"<Code>([^<]{1,128})</Code>", body)
    code = m.group(1).decode("ascii", "replace") if m else ""
    return answer_error(status, code, f"{what} {key}: {code or status}", key)
