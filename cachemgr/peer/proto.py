"""The peer protocol (docs/ARCHITECTURE.md "Peers"): what a request for a chunk looks like on
the wire, how it is authenticated, and in which order a node asks its peers. No I/O: the
server is cachemgr.peer.server, the client cachemgr.peer.client.

Routes (HTTP/1.1, h11 on both sides; all under `/v1/`):

    GET /v1/chunk?key=<object key>&crc=<object CRC32C>&i=<chunk index>
        200 with exactly the chunk's raw bytes (Content-Length = the chunk's size), 404 when
        this node does not hold that chunk verified, 401 when authentication fails, 400 for a
        malformed request, 503 when the server is at its connection limit.

    Other routes are given to the server by prefix (`PeerServer(routes=...)`): the transport
    authenticates them, bounds their bodies (MAX_BODY) and hands them on; what they mean is the
    service's that owns them (cachemgr.tiering's, given by the engine). A prefix no service
    owns on this node is answered 404.

Authentication: every request carries `X-Ckptfs-Time` (unix seconds), `X-Ckptfs-Nonce` (32 hex
digits, random) and `X-Ckptfs-Auth`, the hex HMAC-SHA256 with the shared secret of
"ckptfs-peer-v1\\n<METHOD>\\n<target>\\n<time>\\n<nonce>" (target: path and query as sent). A
server refuses a time more than `CLOCK_WINDOW_S` away from its own and a nonce it saw within
that window (`ReplayCache`, bounded): a captured request cannot be replayed later. Responses are
not signed: the client trusts no byte a peer sends until it matched the manifest's per-chunk
CRC32C, which a peer cannot change (the manifest comes from the store). An answer whose bytes no
store document can check is signed by its server (`sign_response`, `X-Ckptfs-Signature`: the
HMAC of the target and the body's SHA-256), and its target carries a fresh random value, so an
answer recorded earlier does not pass for the answer to a later request.

Order (`rendezvous`): highest-random-weight hashing of (object key, node id), so every node
asks the peers holding a file in the same order and a node's place does not move when others
come and go; the file's writer (the node its object key names) goes first: it holds the file
whole as long as its cache keeps it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import parse_qs, quote, urlsplit

PROTOCOL = "ckptfs-peer-v1"
CHUNK_ROUTE = "/v1/chunk"
CLOCK_WINDOW_S = 60.0         # a request's time may differ from the server's by this much
REPLAY_CACHE_MAX = 100_000    # nonces remembered: ~8 MB; beyond it, requests are refused (401)
MAX_TARGET = 4096             # bytes of path+query a server accepts (object keys <= 1,024)
H_TIME, H_NONCE, H_AUTH = b"x-ckptfs-time", b"x-ckptfs-nonce", b"x-ckptfs-auth"
H_SIG = b"x-ckptfs-signature"  # a signed answer's HMAC (`sign_response`)
MAX_BODY = 1 << 20            # a request's body (validate.MAX_PROTOCOL_BYTES): beyond it, 413


@dataclass(frozen=True)
class PeerConfig:
    """--peers: the secret (never logged: repr hides it), where to listen, what to advertise,
    and the client's bounds."""

    secret: bytes = field(repr=False)
    listen_host: str = "0.0.0.0"  # every interface: other nodes must reach it (--peer-listen)
    listen_port: int = 0          # 0: a port of the kernel's choice, advertised in the record
    advertise: str = "127.0.0.1"  # the address other nodes use (--peer-address)
    header_timeout: float = 5.0   # connect + response headers, per request
    # bytes/s a body must keep up (plus header_timeout of slack): a 4 MiB chunk has 5.5 s; a
    # node-to-node link moves it in well under 0.5 s (1 Gb/s: ~120 MiB/s)
    min_rate: float = 8 << 20
    cutoff_s: float = 300.0       # a misbehaving peer is not asked again for this long
    miss_s: float = 60.0          # a peer that answered 404 for a file is not asked for it
    max_asked: int = 3            # peers asked per chunk before the store
    max_connections: int = 32     # the server's concurrent connections (memory: x 4 MiB)
    request_timeout: float = 30.0  # the server's bound on one request, headers to last byte
    # --peer-seeds: (host, port) of peers to ask when the store cannot be listed (a fresh
    # node has no member records to find them by)
    seeds: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class PeerEndpoint:
    """A live peer, from its member record (cachemgr.tiering.members)."""

    node: str
    host: str
    port: int

    def describe(self) -> str:
        return f"{self.node} at {self.host}:{self.port}"


def chunk_target(key: str, crc: int, index: int) -> str:
    return f"{CHUNK_ROUTE}?key={quote(key, safe='')}&crc={crc}&i={index}"


@dataclass(frozen=True, slots=True)
class ChunkRequest:
    key: str
    crc: int
    index: int


def route_query(target: str, route: str) -> dict[str, list[str]] | None:
    """The query fields of a request target on `route`, parsed within the transport's bounds
    (at most MAX_TARGET bytes, 8 fields); None when the target is longer, names another route
    or has more fields. Every route's own parser starts here."""
    if len(target) > MAX_TARGET:
        return None
    parts = urlsplit(target)
    if parts.path != route:
        return None
    try:
        return parse_qs(parts.query, strict_parsing=False, max_num_fields=8)
    except ValueError:  # more than max_num_fields
        return None


def parse_chunk_target(target: str) -> ChunkRequest | None:
    """The chunk a request target names, or None when it is not a well-formed chunk request."""
    q = route_query(target, CHUNK_ROUTE)
    if q is None:
        return None
    try:
        (key,), (crc,), (i,) = q["key"], q["crc"], q["i"]
    except (KeyError, ValueError):
        return None
    if not (crc.isascii() and crc.isdigit() and i.isascii() and i.isdigit()) or not key:
        return None
    if len(crc) > 10 or len(i) > 9 or len(key.encode()) > 1024:
        return None
    return ChunkRequest(key, int(crc), int(i))


def _mac(secret: bytes, method: str, target: str, ts: str, nonce: str) -> str:
    msg = f"{PROTOCOL}\n{method}\n{target}\n{ts}\n{nonce}".encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, target: str, now: float | None = None) -> list[
        tuple[bytes, bytes]]:
    """The authentication headers of a request."""
    ts = str(int(time.time() if now is None else now))
    nonce = os.urandom(16).hex()
    return [(H_TIME, ts.encode()), (H_NONCE, nonce.encode()),
            (H_AUTH, _mac(secret, method, target, ts, nonce).encode())]


def _response_mac(secret: bytes, target: str, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    return hmac.new(secret, f"{PROTOCOL}-response\n{target}\n{digest}".encode(),
                    hashlib.sha256).hexdigest()


def sign_response(secret: bytes, target: str, body: bytes) -> tuple[bytes, bytes]:
    """The H_SIG header of an answer to `target`: the HMAC of the target and the body's
    SHA-256. Only answers whose bytes cannot be checked against a store document are signed
    (the target should carry a fresh random value, which the signature then covers)."""
    return H_SIG, _response_mac(secret, target, body).encode()


def check_response(secret: bytes, target: str, body: bytes, sig: bytes | None) -> bool:
    """Whether `sig` (the answer's H_SIG) is this secret's signature of `body` for `target`."""
    try:
        got = (sig or b"").decode("ascii")
    except UnicodeDecodeError:
        return False
    return len(got) == 64 and hmac.compare_digest(got, _response_mac(secret, target, body))


class ReplayCache:
    """Nonces seen within the clock window, oldest first; bounded (REPLAY_CACHE_MAX): when full
    of nonces still in the window, new requests are refused rather than remembered badly."""

    def __init__(self, window: float = CLOCK_WINDOW_S, limit: int = REPLAY_CACHE_MAX) -> None:
        self.window = window
        self.limit = limit
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when seen (wall clock)

    def add(self, nonce: str, now: float) -> bool:
        """False if `nonce` was seen within the window (a replay) or the cache is full."""
        # A nonce is kept for twice the window: a request stamped `window` in the future stays
        # acceptable for 2 x window of the server's time.
        while self._seen:
            first, t = next(iter(self._seen.items()))
            if now - t <= 2 * self.window:
                break
            del self._seen[first]
        if nonce in self._seen or len(self._seen) >= self.limit:
            return False
        self._seen[nonce] = now
        return True

    def __len__(self) -> int:
        return len(self._seen)


def check_auth(secret: bytes, replay: ReplayCache, method: str, target: str,
               headers: dict[bytes, bytes], now: float | None = None) -> str | None:
    """None if the request is authentic and fresh, else why not (for the server's log)."""
    now = time.time() if now is None else now
    ts, nonce, mac = headers.get(H_TIME), headers.get(H_NONCE), headers.get(H_AUTH)
    if ts is None or nonce is None or mac is None:
        return "no authentication headers"
    try:
        t, n, m = ts.decode("ascii"), nonce.decode("ascii"), mac.decode("ascii")
    except UnicodeDecodeError:
        return "malformed authentication headers"
    if not (t.isdigit() and len(t) <= 12 and len(n) == 32 and len(m) == 64):
        return "malformed authentication headers"
    if not hmac.compare_digest(m, _mac(secret, method, target, t, n)):
        return "bad HMAC (another secret?)"
    if abs(int(t) - now) > CLOCK_WINDOW_S:
        return f"timestamp {int(t) - now:+.0f} s from this node's clock"
    if not replay.add(n, now):
        return "nonce replayed"
    return None


def rendezvous(key: str, peers: list[PeerEndpoint], writer: str | None) -> list[PeerEndpoint]:
    """`peers` in the order to ask them for the object `key`: its writer first, then by
    highest-random-weight (a stable order every node agrees on)."""
    def weight(p: PeerEndpoint) -> bytes:
        return hashlib.sha256(f"{key}\0{p.node}".encode("utf-8", "surrogatepass")).digest()

    ranked = sorted(peers, key=weight, reverse=True)
    return sorted(ranked, key=lambda p: p.node != writer)  # stable: the writer moves to front


def writer_of(key: str) -> str | None:
    """The node an object key names (cachemgr.tiering.uploadqueue.object_key: data/<node>/...)."""
    parts = key.split("/", 2)
    return parts[1] if len(parts) == 3 and parts[0] == "data" else None
