"""The daemon's control socket: a Unix socket answering one JSON request per connection.

Used by `ckptfs status` (and later by `wait`, `commit`, `prefetch`). The socket lives in the
runtime dir beside the mount's registration (a short path: Unix socket paths are limited to 108
bytes, which a cache dir deep in a tree can exceed). Protocol: the client sends one line of JSON
(`{"op": "status"}`), the server answers one line of JSON and closes. Unknown ops get
`{"error": "..."}`. The server never lets a bad request reach the FUSE loop's error path: every
failure becomes an `error` reply.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
Handler = Callable[[dict], Awaitable[dict]]


async def serve(path: Path, handler: Handler, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    task_status.started()
    try:
        await trio.serve_listeners(lambda stream: _handle(stream, handler), [listener])
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


async def _handle(stream: trio.SocketStream, handler: Handler) -> None:
    async with stream:
        buf = b""
        try:
            with trio.move_on_after(10):
                while b"\n" not in buf and len(buf) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        break
                    buf += chunk
            try:
                req = json.loads(buf.decode() or "{}")
                if not isinstance(req, dict):
                    raise ValueError("request must be a JSON object")
                reply = await handler(req)
            except ValueError as e:
                reply = {"error": f"bad request: {e}"}
            except Exception as e:  # a bug in a handler must not take the daemon down
                log.exception("control request %r failed", buf[:200])
                reply = {"error": f"internal error: {e}"}
            await stream.send_all(json.dumps(reply).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def request(path: Path, req: dict, *, timeout: float | None = 10.0) -> dict:
    """Blocking client: send `req`, return the reply. Raises OSError if the daemon is gone."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf.decode())
