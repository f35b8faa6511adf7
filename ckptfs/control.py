"""The daemon's control socket: a Unix socket answering one JSON request per connection.

Used by `ckptfs status`, `wait`, `commit`, `prefetch` and `ckptfs.wait_durable()`. The socket
lives in the runtime dir beside the mount's registration (a short path: Unix socket paths are
limited to 108 bytes, which a cache dir deep in a tree can exceed). Protocol: the client sends
one line of JSON (`{"op": "status"}`), the server answers one line of JSON and closes. Unknown
ops get `{"error": "..."}`. The server never lets a bad request reach the FUSE loop's error
path: every failure becomes an `error` reply.

Who may ask (docs/ARCHITECTURE.md "Control socket"): a root daemon's socket is 0666, so any
local user can connect, and every request is judged by the caller's credentials, which the
kernel attaches to the connection (SO_PEERCRED: pid, uid, gid; SO_PEERGROUPS: the supplementary
groups), never by anything the client says about itself. The handler gets them as a `Peer`.
The client, in turn, checks that the server is the uid it expects (SO_PEERCRED on its end), so a
socket planted by another user is never believed.

State: the server's only state is `per_uid` (open connections per uid, the bound on one
user's descriptors), local to one `serve` call and touched only by its tasks on the trio loop:
no lock. Handlers run on the loop too, so they may read the daemon's services directly. The
permission check (`check_access`) reads the cache index on the loop, as a handler.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import trio

log = logging.getLogger(__name__)

MAX_REQUEST = 64 * 1024
# Connections one non-root uid may hold open at once (a `wait` holds one until its set is
# durable): a bound, so one user cannot exhaust the daemon's file descriptors.
MAX_CONNECTIONS_PER_UID = 64
# SO_PEERGROUPS (Linux >= 4.13; asm-generic value, not exported by Python's socket module).
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True)
class Peer:
    """The credentials of the process at the other end of a control connection."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    def in_group(self, gid: int) -> bool:
        return gid == self.gid or gid in self.groups


Handler = Callable[[dict, Peer], Awaitable[dict]]


def peer_creds(sock) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer of a connected Unix socket, as the kernel recorded them."""
    return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))


def _peer_groups(sock, pid: int, uid: int) -> frozenset[int]:
    """The peer's supplementary groups: SO_PEERGROUPS (taken at connect, race-free), else
    /proc/<pid>/status if that process still has the peer's uid, else none (the check then
    errs on the side of refusing)."""
    for size in (256 * 4, 65536 * 4):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, size)
            return frozenset(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
        except OSError as e:
            if e.errno != errno.ERANGE:
                break
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        if int(fields["Uid"].split()[1]) == uid:
            return frozenset(int(g) for g in fields["Groups"].split())
    except (OSError, KeyError, ValueError, IndexError):
        pass
    return frozenset()


async def serve(path: Path, handler: Handler, *, mode: int = 0o600,
                task_status: Any = None) -> None:
    """Serve `handler` on a Unix socket at `path` (in a directory the caller created and
    checked). `mode`: 0666 for a root daemon that answers other users (each request is checked
    against the caller's credentials), 0600 otherwise. The daemon's side: trio is imported
    here, not by the clients (every `ckptfs` command imports this module)."""
    import trio

    if task_status is None:
        task_status = trio.TASK_STATUS_IGNORED
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(str(path))
    os.chmod(path, mode)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    per_uid: dict[int, int] = {}

    async def on_connection(stream: trio.SocketStream) -> None:
        await _handle(stream, handler, per_uid)

    task_status.started()
    try:
        await trio.serve_listeners(on_connection, [listener])
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


async def _handle(stream: trio.SocketStream, handler: Handler, per_uid: dict[int, int]) -> None:

    async with stream:
        try:
            pid, uid, gid = peer_creds(stream.socket)
        except OSError:
            log.warning("control connection without peer credentials: refused")
            return
        per_uid[uid] = per_uid.get(uid, 0) + 1
        try:
            await _answer(stream, handler, Peer(pid, uid, gid,
                                                _peer_groups(stream.socket, pid, uid)),
                          over_limit=uid != 0 and per_uid[uid] > MAX_CONNECTIONS_PER_UID)
        finally:
            per_uid[uid] -= 1
            if not per_uid[uid]:
                del per_uid[uid]


async def _answer(stream: trio.SocketStream, handler: Handler, peer: Peer,
                  over_limit: bool) -> None:
    import trio

    buf = b""
    try:
        with trio.move_on_after(10):
            while b"\n" not in buf and len(buf) < MAX_REQUEST:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                buf += chunk
        try:
            if over_limit:
                reply = {"error": f"too many control connections from uid {peer.uid} "
                         f"(limit {MAX_CONNECTIONS_PER_UID})", "errno": errno.EAGAIN}
            else:
                req = json.loads(buf.decode() or "{}")
                if not isinstance(req, dict):
                    raise ValueError("request must be a JSON object")
                reply = await handler(req, peer)
        except ValueError as e:
            reply = {"error": f"bad request: {e}"}
        except Exception as e:  # a bug in a handler must not take the daemon down
            log.exception("control request %r failed", buf[:200])
            reply = {"error": f"internal error: {e}"}
        await stream.send_all(json.dumps(reply).encode() + b"\n")
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


# ----------------------------------------------------------------------------------------------
# the caller's permission on the path, checked by the daemon
#
# The kernel checks every file operation through the mount (default_permissions); control
# requests do not go through the mount, so the daemon checks them itself, with the caller's
# credentials from SO_PEERCRED, against the mode bits in its index, the way the kernel would:
# search (x) on every directory on the way, then what the request needs on the path itself.
# What each op needs is in the daemon's op table (ckptfs/daemon.py CONTROL_OPS).

READ, WRITE, SEARCH = 4, 2, 1


def may(mode: int, uid: int, gid: int, peer: Peer, want: int) -> bool:
    """POSIX mode-bit check of `peer` on an inode: the owner class if the peer owns it, else
    the group class if it is in the group, else other; root passes."""
    if peer.uid == 0:
        return True
    if peer.uid == uid:
        bits = mode >> 6
    elif peer.in_group(gid):
        bits = mode >> 3
    else:
        bits = mode
    return bits & want == want


def check_access(index, peer: Peer, rel: str, want: int) -> None:
    """Raise FsError(EACCES) unless `peer` may `want` (READ or WRITE) the path `rel` (relative
    to the mount root) in the cache `index`. A missing component ends the walk: the request then
    answers for itself (ENOENT, "in no committed set"). A symlink is judged by its directory
    (its own mode is always 0777)."""
    from cachemgr.core.errors import FsError
    from cachemgr.core.index import ROOT_INO

    if peer.uid == 0:
        return
    parts = [p for p in rel.split("/") if p]
    ino, row = ROOT_INO, index.get_inode(ROOT_INO)
    where = "/"
    for i, name in enumerate(parts):
        if not stat.S_ISDIR(row[1]):
            return  # ENOTDIR: the request reports it
        if not may(row[1], row[2], row[3], peer, SEARCH):
            raise FsError(errno.EACCES, f"permission denied: uid {peer.uid} may not search "
                          f"{where} in the mount")
        child = index.lookup(ino, name.encode("utf-8", "surrogateescape"))
        if child is None:
            return
        crow = index.get_inode(child)
        if crow is None:
            return
        if stat.S_ISLNK(crow[1]) and i == len(parts) - 1:
            break  # judged by its directory: whoever may replace the link
        ino, row = child, crow
        where = "/" + "/".join(parts[:i + 1])
    if not may(row[1], row[2], row[3], peer, want):
        verb = "write" if want == WRITE else "read"
        raise FsError(errno.EACCES, f"permission denied: uid {peer.uid} may not {verb} "
                      f"{where} in the mount")


class UntrustedServer(OSError):
    """The process serving a control socket is not the one the client expects to talk to."""


def request(path: Path, req: dict, *, timeout: float | None = 10.0,
            expect_uid: int | None = None) -> dict:
    """Blocking client: send `req`, return the reply. Raises OSError if the daemon is gone, and
    UntrustedServer if `expect_uid` is given and the server runs as another uid (checked with
    SO_PEERCRED before anything is sent: a socket planted by another user gets no request and
    no say)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        if expect_uid is not None:
            _pid, uid, _gid = peer_creds(s)
            if uid != expect_uid:
                raise UntrustedServer(errno.EPERM, f"control socket {path} is served by uid "
                                      f"{uid}, not by the mount's daemon (uid {expect_uid})")
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf.decode())
