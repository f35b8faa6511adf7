"""A fault-injecting HTTP proxy for S3 (in front of moto_server), for the crash and store-fault
suite (scripts/fault_loop.py, tests/faults/test_faults.py).

    proxy = FaultProxy("http://127.0.0.1:5000").start()     # listens on 127.0.0.1, any port
    proxy.set_rules([Rule("slowdown", ops={"put", "upload_part"}, prob=0.3)])
    ...                                                       # point clients at proxy.url
    proxy.clear()
    proxy.stop()

Every request is read whole from the client, classified as an S3 operation (`op`: get, head,
put, delete, list, create_multipart, upload_part, complete_multipart, abort_multipart, other)
and on its key (the path after the bucket), and the first matching rule decides what happens.
Modes (what an S3 client meets in the wild):

  error500 / error503 / slowdown   an S3 XML error (InternalError 500, ServiceUnavailable 503,
                                   SlowDown 503); the request never reaches the store
  strip_conditions  forwarded without its If-None-Match and If-Match headers: a store that
               ignores conditional writes (moto only: a store that checks signatures refuses
               the altered request)
  error403     an S3 XML AccessDenied 403, not forwarded: a refusal for good (not transient:
               the client does not retry it), e.g. aimed at a manifest PUT to fail its set
  reset        connection reset: mid request body for requests with a body (not forwarded),
               else mid response body (forwarded: the store applied it)
  truncate     forwarded; the response claims its full Content-Length, carries only part of the
               body, then the connection closes
  hangup       the connection is closed without an answer; not forwarded
  lost_reply   forwarded (the store applied it), then the connection is closed without an answer
  slow         forwarded; the response body trickles out in small pieces over `delay` seconds
  stall        the request waits `delay` seconds, then is forwarded
  outage       every request (whatever the rule's filters) is reset at once: the store is down
  hold         the request waits at a gate until `release()` (forward it, or drop it: the
               connection closes unanswered), or `delay` seconds (then forwarded); `held()`
               counts waiting requests, so a test can aim at "a manifest PUT is in flight"
  blackhole    a black hole: the request is read whole, never forwarded, never answered, and
               the connection stays open until the proxy is told (`clear()`, `unhang()`,
               `DELETE /__faultproxy__/rules`) or stopped; then it is closed unanswered.
               A rule without filters makes the whole store one: connections accepted, nothing
               answered (a store behind a dead load balancer, a full accept queue upstream)
  oneway       forwarded (the store applies it), its answer dropped, the connection kept open
               as in blackhole: a reply path that is gone (an asymmetric partition)

`hung()` counts the connections held by blackhole and oneway, `wait_hung(n)` waits for them; the
threads that hold them end at `unhang()`, `clear()` and `stop()`.

Rules are switched at run time: `set_rules`, `add_rule`, `clear`, `outage(seconds)` in process,
or over HTTP on the proxy's own port: `POST /__faultproxy__/rules` (a JSON list of rule dicts),
`DELETE /__faultproxy__/rules`, `POST /__faultproxy__/release?forward=1`,
`POST /__faultproxy__/unhang`,
`GET /__faultproxy__/stats`.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import socketserver
import struct
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field, replace

MODES = ("error500", "error503", "slowdown", "error403", "reset", "truncate", "hangup",
         "lost_reply", "slow", "stall", "outage", "hold", "strip_conditions", "blackhole",
         "oneway")
OPS = ("get", "head", "put", "delete", "list", "create_multipart", "upload_part",
       "complete_multipart", "abort_multipart", "other")
CONTROL = "/__faultproxy__/"

_ERRORS = {
    "error500": (500, "Internal Server Error", "InternalError",
                 "We encountered an internal error. Please try again."),
    "error503": (503, "Service Unavailable", "ServiceUnavailable",
                 "Service is unable to handle request."),
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error403": (403, "Forbidden", "AccessDenied", "Access Denied"),
}


@dataclass
class Rule:
    mode: str
    ops: set[str] | None = None       # None: every operation
    key: str | None = None            # regex searched in the object key (None: any key)
    prob: float = 1.0                 # chance that a matching request is hit
    times: int | None = None          # hit at most this many requests (None: no limit)
    delay: float = 2.0                # slow / stall / hold: seconds
    hits: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown fault mode {self.mode!r}")
        if self.ops is not None:
            self.ops = set(self.ops)
            bad = self.ops - set(OPS)
            if bad:
                raise ValueError(f"unknown S3 operations {sorted(bad)}")
        self._re = re.compile(self.key) if self.key else None

    def matches(self, op: str, key: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.ops is not None and op not in self.ops:
            return False
        return self._re is None or bool(self._re.search(key))

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ops"] = sorted(self.ops) if self.ops is not None else None
        return d


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    op: str
    key: str


def classify(method: str, target: str) -> tuple[str, str]:
    """(S3 operation, object key) of a path-style request `METHOD /bucket/key?query`."""
    url = urllib.parse.urlsplit(target)
    q = urllib.parse.parse_qs(url.query, keep_blank_values=True)
    parts = urllib.parse.unquote(url.path).lstrip("/").split("/", 1)
    key = parts[1] if len(parts) > 1 else ""
    if method == "GET":
        op = "list" if not key else "get"
    elif method == "HEAD":
        op = "head"
    elif method == "PUT":
        op = "upload_part" if "partNumber" in q else "put"
    elif method == "POST":
        op = "create_multipart" if "uploads" in q else \
            "complete_multipart" if "uploadId" in q else "other"
    elif method == "DELETE":
        op = "abort_multipart" if "uploadId" in q else "delete"
    else:
        op = "other"
    if op == "list":
        key = q.get("prefix", [""])[0]
    return op, key


class _Gate:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.waiting = 0
        self.generation = 0
        self.decision: dict[int, bool] = {}


class FaultProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0,
                 seed: int | None = None) -> None:
        u = urllib.parse.urlsplit(upstream)
        self.upstream = (u.hostname, u.port or 80)
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._outage_until: float = 0.0
        self._rng = random.Random(seed)
        self._gate = _Gate()
        self._conns: set[socket.socket] = set()
        # connections held by blackhole / oneway: they wait on _hang until its generation moves
        # (unhang, clear, stop); _threads: every serving thread, joined by stop()
        self._hang = threading.Condition()
        self._hang_gen = 0
        self._hung = 0
        self._stopping = False
        self._threads: set[threading.Thread] = set()
        self.stats: dict[str, int] = {"requests": 0, **dict.fromkeys(MODES, 0)}
        self.log: list[tuple[str, str, str]] = []   # (op, key, mode) of every injected fault
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self._thread: threading.Thread | None = None

    # -- life cycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="faultproxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._hang:
            self._stopping = True
        self.clear()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            threads = list(self._threads)
        for t in threads:  # the held ones were woken by clear(); all sockets are shut
            t.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- control ----------------------------------------------------------------------------

    def set_rules(self, rules: list[Rule]) -> None:
        with self._lock:
            self._rules = list(rules)

    def add_rule(self, rule: Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def rules(self) -> list[Rule]:
        with self._lock:
            return list(self._rules)

    def clear(self, release_forward: bool = True) -> None:
        """No more faults: rules and outage off, held requests released (forwarded), the
        connections held by blackhole / oneway closed."""
        with self._lock:
            self._rules = []
            self._outage_until = 0.0
        self.release(forward=release_forward)
        self.unhang()

    def unhang(self) -> int:
        """Close, unanswered, every connection held by blackhole / oneway; returns how many
        were held (a rule still in place holds the next ones)."""
        with self._hang:
            n = self._hung
            self._hang_gen += 1
            self._hang.notify_all()
            return n

    def hung(self) -> int:
        with self._hang:
            return self._hung

    def wait_hung(self, n: int = 1, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._hang:
            while self._hung < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._hang.wait(left)
            return True

    def _hold_open(self) -> None:
        """A blackhole / oneway connection: nothing more is read or sent until unhang()."""
        with self._hang:
            gen = self._hang_gen
            self._hung += 1
            self._hang.notify_all()
            try:
                while self._hang_gen == gen and not self._stopping:
                    self._hang.wait()
            finally:
                self._hung -= 1

    def outage(self, seconds: float | None = None) -> None:
        """The store is unreachable (every connection reset) for `seconds`, or until clear()."""
        with self._lock:
            self._outage_until = float("inf") if seconds is None else time.monotonic() + seconds

    def held(self) -> int:
        with self._gate.cond:
            return self._gate.waiting

    def wait_held(self, n: int = 1, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._gate.cond:
            while self._gate.waiting < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._gate.cond.wait(left)
            return True

    def release(self, forward: bool = True) -> int:
        """Let every held request go (forwarded, or dropped unanswered); returns how many."""
        g = self._gate
        with g.cond:
            n = g.waiting
            g.decision[g.generation] = forward
            g.generation += 1
            g.cond.notify_all()
            return n

    def snapshot(self) -> dict:
        with self._lock:
            return {"stats": dict(self.stats), "rules": [r.to_dict() for r in self._rules],
                    "outage": self._outage_until > time.monotonic(), "held": self.held(),
                    "hung": self.hung()}

    # -- serving ----------------------------------------------------------------------------

    def _pick(self, op: str, key: str) -> Rule | None:
        with self._lock:
            self.stats["requests"] += 1
            if self._outage_until > time.monotonic():
                self.stats["outage"] += 1
                self.log.append((op, key, "outage"))
                return Rule("outage")
            for r in self._rules:
                if r.mode == "outage":
                    continue
                if r.matches(op, key) and self._rng.random() < r.prob:
                    r.hits += 1
                    self.stats[r.mode] += 1
                    self.log.append((op, key, r.mode))
                    return r
        return None

    def _serve(self, sock: socket.socket) -> None:
        with self._lock:
            self._conns.add(sock)
            self._threads.add(threading.current_thread())
        up: http.client.HTTPConnection | None = None
        rfile = sock.makefile("rb")
        try:
            while True:
                req = self._read_request(sock, rfile)
                if req is None:
                    return
                if urllib.parse.urlsplit(req.target).path.startswith(CONTROL):
                    self._control(sock, req)
                    continue
                rule = self._pick(req.op, req.key)
                mode = rule.mode if rule else None
                if mode == "outage":
                    return _reset(sock)
                if mode in _ERRORS:
                    self._send_error(sock, req, *_ERRORS[mode])
                    continue
                if mode == "hangup":
                    return
                if mode == "blackhole":
                    return self._hold_open()
                if mode == "reset" and req.body:
                    return _reset(sock)  # (the body was read: to the client it is mid-send)
                if mode == "stall":
                    time.sleep(rule.delay)  # the fault itself: a store that answers late
                if mode == "hold" and not self._hold(rule.delay):
                    return  # dropped: closed unanswered
                if mode == "strip_conditions":
                    req = replace(req, headers=[
                        (k, v) for k, v in req.headers
                        if k.lower() not in ("if-none-match", "if-match")])
                if up is None:
                    up = http.client.HTTPConnection(*self.upstream, timeout=120)
                try:
                    status, reason, headers, body = self._forward(up, req)
                except (OSError, http.client.HTTPException):
                    up.close()
                    up = None
                    return _reset(sock)
                if mode == "lost_reply":
                    return
                if mode == "oneway":
                    return self._hold_open()
                head = self._head(req, status, reason, headers, len(body))
                if mode in ("reset", "truncate") and body:
                    sock.sendall(head + body[:max(1, len(body) // 2)])
                    return _reset(sock) if mode == "reset" else None
                if mode == "slow" and body:
                    sock.sendall(head)
                    pieces = 10
                    step = -(-len(body) // pieces)
                    for off in range(0, len(body), step):
                        time.sleep(rule.delay / pieces)  # the fault: a slow body
                        sock.sendall(body[off:off + step])
                    continue
                sock.sendall(head + (b"" if req.method == "HEAD" else body))
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())
            if up is not None:
                up.close()
            try:
                rfile.close()
                sock.close()
            except OSError:
                pass

    def _hold(self, max_s: float) -> bool:
        g = self._gate
        with g.cond:
            gen = g.generation
            g.waiting += 1
            g.cond.notify_all()
            try:
                deadline = time.monotonic() + max_s
                while g.generation == gen:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return True
                    g.cond.wait(left)
                return g.decision[gen]
            finally:
                g.waiting -= 1

    @staticmethod
    def _read_request(sock: socket.socket, rfile) -> Request | None:
        line = rfile.readline(65537)
        if not line:
            return None
        try:
            method, target, version = line.decode("latin-1").split()
        except ValueError:
            return None
        headers = []
        while True:
            h = rfile.readline(65537)
            if h in (b"\r\n", b"\n", b""):
                break
            name, _, value = h.decode("latin-1").partition(":")
            headers.append((name.strip(), value.strip()))
        hd = {k.lower(): v for k, v in headers}
        if hd.get("expect", "").lower() == "100-continue":
            sock.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if "chunked" in hd.get("transfer-encoding", "").lower():
            chunks = []
            while True:
                size = int(rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(rfile.read(size))
                rfile.readline()
            body = b"".join(chunks)
            headers = [(k, v) for k, v in headers if k.lower() != "transfer-encoding"]
            headers.append(("Content-Length", str(len(body))))
        else:
            n = int(hd.get("content-length", "0") or 0)
            body = rfile.read(n) if n else b""
        op, key = classify(method, target)
        return Request(method, target, version, headers, body, op, key)

    @staticmethod
    def _forward(up: http.client.HTTPConnection, req: Request):
        up.putrequest(req.method, req.target, skip_host=True, skip_accept_encoding=True)
        for k, v in req.headers:
            if k.lower() in ("expect", "connection", "keep-alive"):
                continue
            up.putheader(k, v)
        if req.body and not any(k.lower() == "content-length" for k, _ in req.headers):
            up.putheader("Content-Length", str(len(req.body)))
        up.endheaders(req.body or None)
        r = up.getresponse()
        body = r.read()
        return r.status, r.reason, r.getheaders(), body

    @staticmethod
    def _head(req: Request, status: int, reason: str, headers, n: int) -> bytes:
        out = [f"HTTP/1.1 {status} {reason}"]
        have_len = False
        for k, v in headers:
            kl = k.lower()
            if kl in ("transfer-encoding", "connection", "keep-alive"):
                continue
            if kl == "content-length":
                if req.method == "HEAD":
                    have_len = True
                    out.append(f"{k}: {v}")
                continue
            out.append(f"{k}: {v}")
        if req.method != "HEAD" or not have_len:
            out.append(f"Content-Length: {n}")
        return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")

    @staticmethod
    def _send_error(sock, req: Request, status: int, reason: str, code: str, msg: str) -> None:
        rid = f"{random.getrandbits(64):016X}"
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                f"<Message>{msg}</Message><Resource>{req.target}</Resource>"
                f"<RequestId>{rid}</RequestId></Error>").encode()
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
                f"x-amz-request-id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        sock.sendall(head + (b"" if req.method == "HEAD" else body))

    def _control(self, sock, req: Request) -> None:
        url = urllib.parse.urlsplit(req.target)
        what = url.path[len(CONTROL):].strip("/")
        q = urllib.parse.parse_qs(url.query)
        status, out = 200, {}
        try:
            if what == "rules" and req.method == "POST":
                self.set_rules([Rule(**d) for d in json.loads(req.body or b"[]")])
            elif what == "rules" and req.method == "DELETE":
                self.clear()
            elif what == "outage" and req.method == "POST":
                s = q.get("seconds", [None])[0]
                self.outage(None if s is None else float(s))
            elif what == "unhang" and req.method == "POST":
                out = {"closed": self.unhang()}
            elif what == "release" and req.method == "POST":
                out = {"released": self.release(q.get("forward", ["1"])[0] != "0")}
            elif what == "stats":
                out = self.snapshot()
            else:
                status, out = 404, {"error": f"no control endpoint {req.method} {what}"}
        except (ValueError, TypeError) as e:
            status, out = 400, {"error": str(e)}
        body = json.dumps(out).encode()
        sock.sendall(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0): the peer sees ECONNRESET."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
