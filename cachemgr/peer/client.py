"""Restore from peers, the client side (docs/ARCHITECTURE.md "Peers"): before a chunk comes
from the store, the live peers that may hold it are asked, in rendezvous order
(cachemgr.peer.proto), over HTTP/1.1 (h11 on trio streams).

Nothing a peer sends is trusted: a 200's Content-Length must be the chunk's size, no more than
that many body bytes are read (h11 frames the body by Content-Length; the stream is read one
bounded receive at a time), and the bytes are checked against the manifest's per-chunk CRC32C
(`verify_chunk`, as store bytes are) before the caller (cachemgr.restore.chunkfetch) writes them
into the file's cache file through the fill path. A peer that sends bad bytes, a wrong size, a
401 or a malformed response, stalls (no headers within `header_timeout`, a body slower than
`min_rate`) or cannot be reached is cut off for `cutoff_s`, named in one log line, and the chunk
comes from the next peer or the store. A 404 (the peer does not hold that file) is remembered
for `miss_s`, per peer and file, so a set's later chunks do not ask it again.

State, all on the daemon's trio thread: `_peers` (the last list of live peers with endpoints,
refreshed every PEER_LIST_TTL_S while restoring through `live_peers`, the members listing of
cachemgr.tiering.members, which answers or fails within its own deadline; one refresh at a time,
under `_listing`: only the fetches before the first list wait for it, instead of seeing an empty
list; after that a fetch that finds the list due only wakes `run` (`_due`), which refreshes it in
the background, and goes on with the last list: a store that does not answer never holds the
chunk fetches from live peers),
`_cut` (node -> until, why), `_miss` ((node, key) -> until, bounded), `_stale` (nodes whose
member record must be read again: unreachable at the endpoint it named). Nothing is durable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
import trio

from cachemgr.format.objects import StoredObject, chunk_span, verify_chunk
from cachemgr.peer.proto import (
    PeerConfig,
    PeerEndpoint,
    chunk_target,
    rendezvous,
    sign,
    writer_of,
)
from cachemgr.store import StoreError

log = logging.getLogger(__name__)

# live_peers(stale): the other live members with a peer endpoint; the records of the nodes in
# `stale` are read again (Members.peers)
LivePeers = Callable[[frozenset[str]], Awaitable[list[PeerEndpoint]]]
# local(key, crc, index): a chunk this node holds outside its cache files (another service's,
# given by the engine), or None
LocalChunk = Callable[[str, int, int], Awaitable[bytes | None]]

PEER_LIST_TTL_S = 10.0   # one LIST of members/ per this while restoring (1 page per 1,000 nodes)
MISS_MAX = 65536         # remembered 404s (~10 MB at most)
RECEIVE = 1 << 16        # bytes per receive: the most read beyond a response's framing


class PeerFault(Exception):
    """A peer misbehaved: `kind` (metrics label) and what it did (the log line)."""

    def __init__(self, kind: str, what: str) -> None:
        super().__init__(what)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class PeerClientStats:
    asked: int
    hits: int
    local_hits: int
    misses: int
    errors: dict[str, int]
    cut_off: list[dict[str, Any]]


class PeerClient:
    """Chunks from peers (see the module docstring)."""

    def __init__(self, *, cfg: PeerConfig, node: str, live_peers: LivePeers,
                 local: LocalChunk | None = None) -> None:
        """`local`: asked first, for chunks this node holds itself outside its cache files
        (another service's: a node resuming from a set it holds for another node)."""
        self.cfg = cfg
        self.node = node
        self._live_peers = live_peers
        self._local = local
        self._peers: list[PeerEndpoint] = []
        self._listed = -PEER_LIST_TTL_S - 1.0   # monotonic time of the last listing
        self._have_list = False                  # a listing ended (answered or failed)
        self._stale: set[str] = set()
        self._listing = trio.Lock()
        self._due = trio.Event()   # a fetch found the list due: `run` refreshes it
        self._cut: dict[str, tuple[float, str, str]] = {}  # node -> (until, address, why)
        self._miss: dict[tuple[str, str], float] = {}
        # statistics
        self.asked = 0
        self.hits = 0
        self.local_hits = 0  # chunks this node held itself outside its cache (`local`)
        self.misses = 0
        self.errors: dict[str, int] = {}

    async def run(self) -> None:
        """Refresh the list of live peers when a fetch found it due (background: no fetch
        waits for a refresh once there is a list)."""
        while True:
            await self._due.wait()
            self._due = trio.Event()
            async with self._listing:
                await self._refresh()

    async def _live(self) -> list[PeerEndpoint]:
        if not self._have_list:
            # the first list: concurrent fetches wait for it rather than see it empty
            async with self._listing:
                if not self._have_list:
                    await self._refresh()
        elif time.monotonic() - self._listed >= PEER_LIST_TTL_S or self._stale:
            self._due.set()
        return self._peers

    async def _refresh(self) -> None:
        """One listing (the caller holds `_listing`: one at a time)."""
        stale, self._stale = frozenset(self._stale), set()
        try:
            found = await self._live_peers(stale)
            self._peers = [p for p in found if p.node != self.node]
        except StoreError as e:
            log.warning("peers: cannot list the live members: %s; asking the store", e)
            self._peers = []
        self._listed = time.monotonic()
        self._have_list = True

    def _usable(self, p: PeerEndpoint, key: str, now: float) -> bool:
        cut = self._cut.get(p.node)
        if cut is not None:
            if cut[0] > now:
                return False
            del self._cut[p.node]
        miss = self._miss.get((p.node, key))
        return miss is None or miss <= now

    async def fetch(self, obj: StoredObject, i: int) -> bytes | None:
        """Raw chunk `i` of `obj`, verified, from the first peer that has it; None: none did
        (the caller asks the store)."""
        if self._local is not None:
            raw = await self._local(obj.key, obj.crc32c, i)
            if raw is not None and await trio.to_thread.run_sync(verify_chunk, obj, i, raw):
                self.local_hits += 1
                return raw
        now = time.monotonic()
        peers = [p for p in await self._live() if self._usable(p, obj.key, now)]
        for p in rendezvous(obj.key, peers, writer_of(obj.key))[:self.cfg.max_asked]:
            self.asked += 1
            try:
                raw = await self._ask(p, obj, i)
            except PeerFault as e:
                self._cut_off(p, e)
                continue
            if raw is not None:
                self.hits += 1
                return raw
            self.misses += 1
            if len(self._miss) >= MISS_MAX:
                self._miss.clear()
            self._miss[(p.node, obj.key)] = time.monotonic() + self.cfg.miss_s
        return None

    def _cut_off(self, p: PeerEndpoint, e: PeerFault) -> None:
        self.errors[e.kind] = self.errors.get(e.kind, 0) + 1
        if e.kind == "unreachable":
            self._stale.add(p.node)  # its record may name a new endpoint by now
        if p.node in self._cut:
            return  # cut off meanwhile by another fetch: logged once
        self._cut[p.node] = (time.monotonic() + self.cfg.cutoff_s, f"{p.host}:{p.port}", str(e))
        log.warning("peer %s %s: not asked again for %.0f s (chunks come from the store)",
                    p.describe(), e, self.cfg.cutoff_s)

    async def _ask(self, p: PeerEndpoint, obj: StoredObject, i: int) -> bytes | None:
        """The chunk from `p` (verified), None on a 404; PeerFault for anything else."""
        size = chunk_span(obj, i)[1]
        target = chunk_target(obj.key, obj.crc32c, i)
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=16384)
        # the name lookup too: trio runs getaddrinfo in a thread it abandons when cancelled,
        # so a resolver that does not answer holds this no longer than the connect bound
        with trio.move_on_after(self.cfg.header_timeout) as scope:
            try:
                stream = await trio.open_tcp_stream(p.host, p.port)
            except OSError as e:
                raise PeerFault("unreachable", f"is unreachable ({e.strerror or e})") from None
        if scope.cancelled_caught:
            raise PeerFault("stall", f"did not accept a connection within "
                            f"{self.cfg.header_timeout:.0f} s")
        async with stream:
            try:
                return await self._exchange(stream, conn, p, target, obj, i, size)
            except h11.ProtocolError as e:
                raise PeerFault("protocol", f"broke HTTP/1.1 ({e})") from None
            except (OSError, trio.BrokenResourceError) as e:
                raise PeerFault("unreachable", f"dropped the connection ({e})") from None

    async def _exchange(self, stream: trio.SocketStream, conn: h11.Connection, p: PeerEndpoint,
                        target: str, obj: StoredObject, i: int, size: int) -> bytes | None:
        headers = [(b"host", f"{p.host}:{p.port}".encode()), (b"connection", b"close"),
                   *sign(self.cfg.secret, "GET", target)]
        # the request and its answer's headers within header_timeout: a peer that takes the
        # connection and never reads or answers (a black hole) holds this fetch no longer
        with trio.move_on_after(self.cfg.header_timeout) as scope:
            await stream.send_all(conn.send(h11.Request(method="GET", target=target,
                                                        headers=headers))
                                  + (conn.send(h11.EndOfMessage()) or b""))
            ev = await _next(stream, conn)
        if scope.cancelled_caught:
            raise PeerFault("stall", f"sent no answer within {self.cfg.header_timeout:.0f} s")
        if not isinstance(ev, h11.Response):
            raise PeerFault("protocol", f"answered with {type(ev).__name__}, not a response")
        if ev.status_code == 404:
            return None
        if ev.status_code == 401:
            raise PeerFault("auth", "refused our requests (401: another --peer-secret-file?)")
        if ev.status_code != 200:
            raise PeerFault("status", f"answered HTTP {ev.status_code}")
        length = dict(ev.headers).get(b"content-length")
        if length is None or not length.isdigit() or int(length) != size:
            raise PeerFault("size", f"announced {length!r} bytes for {obj.key} chunk {i} of "
                            f"{size}")
        body = bytearray()
        budget = self.cfg.header_timeout + size / self.cfg.min_rate
        with trio.move_on_after(budget) as scope:
            while True:
                ev = await _next(stream, conn)
                if isinstance(ev, h11.Data):
                    body += ev.data
                    if len(body) > size:  # h11 frames by Content-Length: never, but bounded
                        raise PeerFault("size", f"sent more than {size} bytes")
                elif isinstance(ev, h11.EndOfMessage):
                    break
                else:
                    raise PeerFault("protocol", f"sent {type(ev).__name__} in a body")
        if scope.cancelled_caught:
            raise PeerFault("stall", f"sent {len(body)} of {size} bytes of {obj.key} chunk {i} "
                            f"in {budget:.0f} s")
        data = bytes(body)
        if not await trio.to_thread.run_sync(verify_chunk, obj, i, data):
            raise PeerFault("corrupt", f"sent bytes of {obj.key} chunk {i} that fail its "
                            "CRC32C")
        return data

    def statistics(self) -> PeerClientStats:
        now = time.monotonic()
        return PeerClientStats(
            asked=self.asked, hits=self.hits, local_hits=self.local_hits, misses=self.misses,
            errors=dict(self.errors),
            cut_off=[{"node": n, "address": a, "why": why, "for_s": round(u - now, 1)}
                     for n, (u, a, why) in self._cut.items() if u > now])


async def request(cfg: PeerConfig, p: PeerEndpoint, method: str, target: str, *,
                  body: bytes = b"", limit: int) -> tuple[int, dict[bytes, bytes], bytes]:
    """One authenticated request to peer `p` (a route another service owns, given by its path):
    (status, headers, body), the body at most `limit` bytes and framed by Content-Length, with
    the bounds of a chunk request (`header_timeout`, `min_rate`). PeerFault for anything that
    is not an HTTP answer within them; the caller judges the status and checks the bytes."""
    with trio.move_on_after(cfg.header_timeout) as scope:
        try:
            stream = await trio.open_tcp_stream(p.host, p.port)
        except OSError as e:
            raise PeerFault("unreachable", f"is unreachable ({e.strerror or e})") from None
    if scope.cancelled_caught:
        raise PeerFault("stall", f"did not accept a connection within {cfg.header_timeout:.0f} s")
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=16384)
    headers = [(b"host", f"{p.host}:{p.port}".encode()), (b"connection", b"close"),
               (b"content-length", str(len(body)).encode()), *sign(cfg.secret, method, target)]
    async with stream:
        try:
            # the request (its body at min_rate) and the answer's headers within their budget:
            # a peer that takes the connection and never reads (a black hole) holds no longer
            budget = cfg.header_timeout + len(body) / cfg.min_rate
            with trio.move_on_after(budget) as scope:
                await stream.send_all(conn.send(h11.Request(method=method, target=target,
                                                            headers=headers))
                                      + (conn.send(h11.Data(data=body)) if body else b"")
                                      + (conn.send(h11.EndOfMessage()) or b""))
                ev = await _next(stream, conn)
            if scope.cancelled_caught:
                raise PeerFault("stall", f"took no request or sent no answer within "
                                f"{budget:.0f} s")
            if not isinstance(ev, h11.Response):
                raise PeerFault("protocol", f"answered with {type(ev).__name__}")
            status, got = ev.status_code, {k.lower(): v for k, v in ev.headers}
            length = got.get(b"content-length", b"")
            if not length.isdigit() or int(length) > limit:
                raise PeerFault("size", f"announced {length!r} bytes (at most {limit})")
            data = bytearray()
            budget = cfg.header_timeout + int(length) / cfg.min_rate
            with trio.move_on_after(budget) as scope:
                while not isinstance(ev := await _next(stream, conn), h11.EndOfMessage):
                    if not isinstance(ev, h11.Data):
                        raise PeerFault("protocol", f"sent {type(ev).__name__} in a body")
                    data += ev.data
            if scope.cancelled_caught:
                raise PeerFault("stall", f"sent {len(data)} of {int(length)} bytes in "
                                f"{budget:.0f} s")
            return status, got, bytes(data)
        except h11.ProtocolError as e:
            raise PeerFault("protocol", f"broke HTTP/1.1 ({e})") from None
        except (OSError, trio.BrokenResourceError) as e:
            raise PeerFault("unreachable", f"dropped the connection ({e})") from None


async def _next(stream: trio.SocketStream, conn: h11.Connection) -> Any:
    """The next h11 event, receiving at most RECEIVE bytes at a time as h11 needs them."""
    while True:
        ev = conn.next_event()
        if ev is not h11.NEED_DATA:
            return ev
        conn.receive_data(await stream.receive_some(RECEIVE))
