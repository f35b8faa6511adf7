"""The peer server (--peers, docs/ARCHITECTURE.md "Peers"): other nodes' restores ask it for
the chunks this node holds verified (cachemgr.peer.proto: routes, auth), and the services that
own other routes get their authenticated requests.

Why here: it is transport. What it serves comes from the services above, given to it by the
engine (cachemgr.engine): `serve_chunk` (restore's ChunkFetcher.serve_chunk: which chunks of
which cache file hold verified data, and the chunks other services hold) and `routes` (a handler
per target prefix). It imports nothing above cachemgr.format; its endpoint is advertised in this
node's member record.

Bounds: at most `max_connections` connections at once (the next is answered 503 and closed);
the request line and headers at most MAX_HEAD bytes buffered (h11's max_incomplete_event_size:
beyond it, 431 and closed), a target at most MAX_TARGET (414); each request at most
`request_timeout` from its first byte to its last response byte, and a keep-alive connection
idle at most IDLE_S. A chunk is read whole (4 MiB) in a
worker thread and checked before any byte is sent, so memory is at most max_connections x one
chunk, and the loop never reads the disk. It never asks the store: a chunk it does not hold
verified is a 404.

State, its owner and its guards: the listening socket (bound at construction, so its port is
known before the member record is written); `_replay` (nonces seen, proto.ReplayCache) and
the counters, touched only by connection tasks on the daemon's trio thread, with no await
between a read and its update.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import h11
import trio

from cachemgr.peer.proto import (
    CHUNK_ROUTE,
    MAX_BODY,
    MAX_TARGET,
    PeerConfig,
    ReplayCache,
    check_auth,
    parse_chunk_target,
)

log = logging.getLogger(__name__)

# serve_chunk(key, crc, index): the chunk's raw bytes when held verified, else None
ServeChunk = Callable[[str, int, int], Awaitable[bytes | None]]
# route(method, target, body, peer): (status, body, extra headers) of a request under the
# route's prefix, called only once the request is authenticated and its body read (<= MAX_BODY)
Route = Callable[[str, str, bytes, str], Awaitable[tuple[int, bytes, list[tuple[bytes, bytes]]]]]

MAX_HEAD = 8192          # bytes of request line + headers (a signed request is ~600)
IDLE_S = 10.0            # a keep-alive connection with no request for this long is closed
SEND_SLICE = 256 << 10   # bytes per send of a body
WARN_EVERY_S = 10.0      # refusals are logged at most this often (then at debug)


@dataclass(frozen=True, slots=True)
class PeerServerStats:
    endpoint: str
    connections: int
    served_chunks: int
    served_bytes: int
    not_held: int
    refused_auth: int
    bad_requests: int
    busy: int
    internal_errors: int


class _Close(Exception):
    """End the connection (after the response that was sent)."""


class PeerServer:
    """Serves verified chunks to peers (see the module docstring)."""

    def __init__(self, *, cfg: PeerConfig, sock: socket.socket, serve_chunk: ServeChunk,
                 routes: Mapping[str, Route] | None = None) -> None:
        """`sock`: the listening socket (`bind`), bound before the services that advertise
        its port are built. `routes`: target prefix -> its handler (a prefix under /v1/ that
        no route has, and is not the chunk route, is a 404)."""
        self.cfg = cfg
        self._serve_chunk = serve_chunk
        self._routes = dict(routes or {})
        self._sock = sock
        self.port: int = sock.getsockname()[1]
        self._replay = ReplayCache()
        self._warned = 0.0
        # statistics
        self.connections = 0
        self.served_chunks = 0
        self.served_bytes = 0
        self.not_held = 0
        self.refused_auth = 0
        self.bad_requests = 0
        self.busy = 0
        self.internal_errors = 0

    @property
    def endpoint(self) -> tuple[str, int]:
        """What other nodes connect to (the member record's `peer`)."""
        return self.cfg.advertise, self.port

    async def run(self) -> None:
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._sock))
        log.info("peers: serving chunks at %s:%d (listening on %s)", self.cfg.advertise,
                 self.port, self.cfg.listen_host)
        async with listener:
            await trio.serve_listeners(self._connection, [listener])

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            if self.connections >= self.cfg.max_connections:
                self.busy += 1
                conn = h11.Connection(h11.SERVER)
                with trio.move_on_after(1.0), _quiet():
                    await self._respond(stream, conn, 503, b"busy")
                return
            self.connections += 1
            try:
                await self._serve(stream)
            except _Close:
                pass
            except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError,
                    OSError) as e:
                log.debug("peer connection ended: %s", e)
            except Exception:  # a bug in one request: that connection ends, the server serves on
                self.internal_errors += 1
                log.exception("peers: a request failed inside the peer server; its connection"
                              " was closed")
            finally:
                self.connections -= 1

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        while True:
            with trio.move_on_after(IDLE_S) as idle:
                req = await self._read(stream, conn, h11.Request)
            if idle.cancelled_caught or not isinstance(req, h11.Request):
                return
            with trio.move_on_after(self.cfg.request_timeout) as scope:
                await self._request(stream, conn, req)
            if scope.cancelled_caught or conn.our_state is not h11.DONE or \
                    conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _read(self, stream: trio.SocketStream, conn: h11.Connection,
                    kind: type, body: bytearray | None = None) -> object:
        """The next event of `kind` (a Request; its EndOfMessage), body data kept in `body`
        (at most MAX_BODY: beyond it, 413 and the connection ends) or skipped; None
        when the peer closed the connection. A malformed or oversized request is answered
        (400, 431) and ends the connection."""
        try:
            while True:
                ev = await _event(stream, conn)
                if isinstance(ev, kind):
                    return ev
                if isinstance(ev, h11.Data) and body is not None:
                    body += ev.data
                    if len(body) > MAX_BODY:
                        self.bad_requests += 1
                        with _quiet():
                            await self._respond(stream, conn, 413, b"body too large")
                        raise _Close
                if isinstance(ev, h11.ConnectionClosed) or ev is h11.PAUSED:
                    return None
        except h11.RemoteProtocolError as e:
            self.bad_requests += 1
            with _quiet():
                await self._respond(stream, conn, e.error_status_hint, b"bad request")
            raise _Close from None

    async def _request(self, stream: trio.SocketStream, conn: h11.Connection,
                       req: h11.Request) -> None:
        body = bytearray()
        if await self._read(stream, conn, h11.EndOfMessage, body) is None:
            raise _Close
        if len(req.target) > MAX_TARGET:
            self.bad_requests += 1
            await self._respond(stream, conn, 414, b"target too long")
            return
        target = req.target.decode("ascii", "replace")
        headers = {k.lower(): v for k, v in req.headers}
        why = check_auth(self.cfg.secret, self._replay, req.method.decode("ascii", "replace"),
                         target, headers)
        peer = stream.socket.getpeername()
        if why is not None:
            self.refused_auth += 1
            self._warn("peers: refused a request from %s:%s: %s", peer[0], peer[1], why)
            await self._respond(stream, conn, 401, b"unauthorized")
            return
        route = next((r for prefix, r in self._routes.items() if target.startswith(prefix)),
                     None)
        if route is not None:
            status, out, extra = await route(req.method.decode("ascii", "replace"), target,
                                             bytes(body), f"{peer[0]}:{peer[1]}")
            await self._respond(stream, conn, status, out, extra)
            return
        if urlsplit(target).path != CHUNK_ROUTE:  # a route no service of this node has
            await self._respond(stream, conn, 404, b"no such route here")
            return
        if req.method != b"GET":
            self.bad_requests += 1
            await self._respond(stream, conn, 405, b"only GET")
            return
        ask = parse_chunk_target(target)
        if ask is None:
            self.bad_requests += 1
            await self._respond(stream, conn, 400, b"not a chunk request")
            return
        data = await self._serve_chunk(ask.key, ask.crc, ask.index)
        if data is None:
            self.not_held += 1
            await self._respond(stream, conn, 404, b"not held here")
            return
        await self._respond(stream, conn, 200, data)
        self.served_chunks += 1
        self.served_bytes += len(data)

    async def _respond(self, stream: trio.SocketStream, conn: h11.Connection, status: int,
                       body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        ctype = b"application/octet-stream" if status == 200 else b"text/plain"
        await stream.send_all(conn.send(h11.Response(status_code=status, headers=[
            (b"content-length", str(len(body)).encode()), (b"content-type", ctype),
            *(extra or [])])) or b"")
        for off in range(0, len(body), SEND_SLICE):
            await stream.send_all(conn.send(h11.Data(data=body[off:off + SEND_SLICE])) or b"")
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")

    def _warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned >= WARN_EVERY_S:
            self._warned = now
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

    def statistics(self) -> PeerServerStats:
        return PeerServerStats(
            endpoint=f"{self.cfg.advertise}:{self.port}", connections=self.connections,
            served_chunks=self.served_chunks, served_bytes=self.served_bytes,
            not_held=self.not_held, refused_auth=self.refused_auth,
            bad_requests=self.bad_requests, busy=self.busy,
            internal_errors=self.internal_errors)


def bind(cfg: PeerConfig) -> socket.socket:
    """The listening socket of --peer-listen; OSError if it cannot be had (a port in use)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.listen_host, cfg.listen_port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class _quiet:
    """Swallow a peer hanging up while it is told "busy" (nothing else to do with it)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: object) -> bool:
        return et is not None and issubclass(et, (trio.BrokenResourceError, OSError,
                                                  h11.ProtocolError, trio.ClosedResourceError))


async def _event(stream: trio.SocketStream, conn: h11.Connection) -> object:
    while True:
        ev = conn.next_event()
        if ev is not h11.NEED_DATA:
            return ev
        conn.receive_data(await stream.receive_some(1 << 14))
