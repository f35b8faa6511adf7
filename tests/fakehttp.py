"""Fake HTTP/1.1 peers for the peer tests (tests/multinode/test_peers.py, test_replicas*.py,
tests/mount/test_peernamespace_mount.py): a listening socket on 127.0.0.1, an accept loop in a
daemon thread, one request read per connection with h11, then the connection closed. What a fake
answers and what it records stays in its test file, in a subclass's `answer`.

    class Teapot(FakeHTTPServer):
        def answer(self, s, conn, req):
            send_response(s, conn, 418, body=b"short and stout")

    srv = Teapot()          # serving on srv.address until srv.close()

`request` is the other side: a raw client for a test that talks to a real node's peer server
with requests no node sends.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import h11

Headers = Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: dict[bytes, bytes]  # h11's: names lower-cased; a repeated name, its last value
    body: bytes

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.target).query)


class FakeHTTPServer:
    """Listens on 127.0.0.1 (any free port) from construction until `close()`. Each connection
    is served by `handle`, in its own daemon thread (`threaded`) or inline in the accept thread,
    one after the other; the socket is closed after it. `handle` reads one request and calls
    `answer` with it (nothing if the client closed first); a subclass overrides `answer`, and
    may wrap `handle`. A subclass sets its own state before calling `super().__init__()` (the
    accept thread starts there), and guards what `answer` shares with the test thread."""

    threaded = True       # False: connections are served one after the other
    timeout = 10.0        # each connection socket's timeout (s)
    accept_timeout = 0.2  # how soon the accept loop sees `stop` (s)

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.stop = threading.Event()  # set by close(): the accept loop ends; answers may wait
        self._threads: list[threading.Thread] = []  # appended to by the accept thread only
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def handle(self, s: socket.socket, conn: h11.Connection) -> None:
        req = read_request(s, conn)
        if req is not None:
            self.answer(s, conn, req)

    def answer(self, s: socket.socket, conn: h11.Connection, req: Request) -> None:
        raise NotImplementedError

    def _accept(self) -> None:
        self.sock.settimeout(self.accept_timeout)
        while not self.stop.is_set():
            try:
                s, _ = self.sock.accept()
            except TimeoutError:
                continue
            if not self.threaded:
                self._connection(s)
                continue
            t = threading.Thread(target=self._connection, args=(s,), daemon=True)
            self._threads.append(t)
            t.start()

    def _connection(self, s: socket.socket) -> None:
        with s:
            s.settimeout(self.timeout)
            self.handle(s, h11.Connection(h11.SERVER))

    def close(self) -> None:
        self.stop.set()
        self._thread.join(5)
        for t in self._threads:  # the accept thread has ended: the list no longer grows
            t.join(5)
        self.sock.close()


def read_request(s: socket.socket, conn: h11.Connection) -> Request | None:
    """The next request on `s`, its body read whole; None if the client closed first."""
    head, body = None, bytearray()
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            data = s.recv(65536)
            if not data:
                return None
            conn.receive_data(data)
        elif isinstance(ev, h11.Request):
            head = ev
        elif isinstance(ev, h11.Data):
            body += ev.data
        elif isinstance(ev, h11.EndOfMessage) and head is not None:
            return Request(head.method.decode(), head.target.decode(), dict(head.headers),
                           bytes(body))
        else:
            return None


def send_response(s: socket.socket, conn: h11.Connection, status: int, headers: Headers = (),
                  body: bytes = b"") -> None:
    """A whole answer: `status`, a content-length, then `headers`, then `body`."""
    s.sendall(_send(conn, h11.Response(status_code=status, headers=[
        ("content-length", str(len(body))), *headers]), h11.Data(data=body), h11.EndOfMessage()))


def send_head(s: socket.socket, conn: h11.Connection, status: int, length: int,
              first: bytes = b"") -> None:
    """The start of an answer that announces `length` bytes of body and sends only `first`."""
    s.sendall(_send(conn, h11.Response(status_code=status, headers=[
        ("content-length", str(length))]), h11.Data(data=first)))


def _send(conn: h11.Connection, *events: h11.Event) -> bytes:
    return b"".join(conn.send(ev) or b"" for ev in events)


def request(port: int, method: str, target: str, headers: Sequence[tuple[bytes, bytes]] = (),
            body: bytes = b"", into: bytearray | None = None) -> int:
    """One request to 127.0.0.1:`port` on a connection of its own (`connection: close`, a
    content-length when there is a `body`), its answer read to the end: the status; the
    answer's body is appended to `into` if given."""
    conn = h11.Connection(h11.CLIENT)
    length = [(b"content-length", str(len(body)).encode())] if body else []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(_send(conn, h11.Request(method=method, target=target, headers=[
            (b"host", b"x"), (b"connection", b"close"), *length, *headers]),
            *([h11.Data(data=body)] if body else []), h11.EndOfMessage()))
        status = 0
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(s.recv(65536))
            elif isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data) and into is not None:
                into += ev.data
            elif isinstance(ev, h11.EndOfMessage | h11.ConnectionClosed):
                return status
