"""Python API for training code: ask a ckptfs mount about durability, and wait for it.

    import ckptfs
    torch.save(state, "/mnt/ckpt/step_100.pt")
    ckptfs.wait_durable("/mnt/ckpt/step_100.pt", timeout=600)   # in the object store now

Every function takes a path inside a ckptfs mount and talks to that mount's daemon over its
control socket. Nothing here imports pyfuse3 or the cache manager. Any user may call them on a
root daemon's mount: the daemon answers what the caller may read (status, wait_durable,
prefetch) or write (commit), and refuses the rest with CkptfsError code 9 (EXIT_ACCESS).

State: none in the caller's process. Each call finds the mount (mountinfo + the daemon's
registration in the runtime dir), opens one control connection, and closes it; the daemon's
state stays on its trio loop, which answers one request per connection (ckptfs/control.py).
Safe to call from any thread.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from . import control
from .mount import (
    EXIT_ACCESS,
    EXIT_ERROR,
    EXIT_NO_SET,
    EXIT_STORE,
    EXIT_USAGE,
    find_mount,
    mount_owner,
    registration,
)


class CkptfsError(Exception):
    """A request to the daemon failed. `code` is the CLI exit code for the same failure."""

    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code


class NotDurable(CkptfsError):
    """wait_durable ended without the set being durable: `state` is failed, deleted, timeout,
    none (the path is in no committed set) or uncommitted (a directory holds a file in no
    committed set)."""

    def __init__(self, msg: str, state: str, code: int) -> None:
        super().__init__(msg, code)
        self.state = state


def locate(path: str | os.PathLike) -> tuple[Path, str]:
    """(mount point, path relative to it) of `path`, which must be inside a ckptfs mount."""
    p = Path(os.path.abspath(path))
    for cand in (p, *p.parents):
        entry = find_mount(cand)
        if entry is not None:
            if entry["fstype"] != "fuse.ckptfs":
                break
            return cand, str(p.relative_to(cand)) if p != cand else ""
    raise CkptfsError(f"{path} is not inside a ckptfs mount", code=3)


def _request(mountpoint: Path, req: dict, timeout: float | None = 10.0) -> dict:
    notes: list[str] = []
    reg = registration(mountpoint, notes)
    if reg is None:
        owner = mount_owner(find_mount(mountpoint))
        if owner not in (None, 0, os.getuid()) and os.getuid() != 0:
            raise CkptfsError(f"{mountpoint} is mounted by uid {owner}: its daemon answers "
                              "only that user and root", code=EXIT_ACCESS)
        why = "".join(f"; {n}" for n in notes)
        raise CkptfsError(f"no daemon registered for {mountpoint} (it may have died){why}")
    try:
        reply = control.request(Path(reg["control"]), req, timeout=timeout,
                                expect_uid=reg["daemon_uid"])
    except (OSError, ValueError) as e:
        raise CkptfsError(f"daemon for {mountpoint} (pid {reg['pid']}) is not answering: "
                          f"{e}") from None
    return reply


def _failed(reply: dict) -> CkptfsError:
    """The exception for an error reply: its errno picks the exit code."""
    codes: dict[object, int] = {errno.ENOENT: EXIT_USAGE, errno.EACCES: EXIT_ACCESS}
    code = codes.get(reply.get("errno"), EXIT_ERROR)
    return CkptfsError(reply["error"], code=code)


def status(mountpoint: str | os.PathLike) -> dict:
    mp, _ = locate(mountpoint)
    reply = _request(mp, {"op": "status"})
    if "error" in reply:
        raise _failed(reply)
    return reply


def commit(path: str | os.PathLike) -> int:
    """Commit the file or directory at `path` as a shard set now; returns its sequence number."""
    mp, rel = locate(path)
    reply = _request(mp, {"op": "commit", "path": rel})
    if "error" in reply:
        raise _failed(reply)
    return int(reply["seq"])


def prefetch(path: str | os.PathLike) -> dict:
    """Start fetching the set holding `path` (or every file under it) into the cache; returns
    the job ({"path", "files", "bytes_total", "bytes_done", "finished", "error"}). Progress is
    in status(mountpoint)["tiering"]["restore"]["jobs"]."""
    mp, rel = locate(path)
    reply = _request(mp, {"op": "prefetch", "path": rel})
    if "error" in reply and "path" not in reply:
        raise _failed(reply)
    return reply


def leave_by(mountpoint: str | os.PathLike, seconds: float) -> None:
    """The unmount that follows ends within `seconds` (at least 1 s): the daemon leaves the
    store's members by then, written or not (`ckptfs umount --timeout`)."""
    mp, _ = locate(mountpoint)
    reply = _request(mp, {"op": "leave_by", "path": "", "seconds": float(seconds)}, timeout=5.0)
    if "error" in reply:
        raise _failed(reply)


def wait_durable(path: str | os.PathLike, timeout: float | None = None) -> dict:
    """Block until the set holding `path` is durable in the object store. Returns the set's
    {"state": "durable", "seq", "path"}; raises NotDurable otherwise, and CkptfsError with
    code 9 (EXIT_ACCESS) if the caller may not read `path`.

    A directory that is not (inside) one set (DeepSpeed's `global_stepN/`, each file its own
    set) is waited for as a whole: every set committed under it at the call, and every file
    under it open for writing (docs/SEMANTICS.md "Waiting for a directory"). Returns
    {"state": "durable", "path", "sets": N}; raises NotDurable with state "uncommitted" (code
    8) if a file under it is in no committed set, "none" (code 8) if it holds no committed
    set, "timeout" (code 7) when `timeout` (for the whole wait) runs out, "failed"/"deleted"
    (code 1) if one of its sets did."""
    return _wait(path, timeout, replicated=False)


def wait_replicated(path: str | os.PathLike, timeout: float | None = None) -> dict:
    """Block until the set holding `path` is held by its K buddies (--replicas), fsynced on
    their disks, or durable (docs/SEMANTICS.md "Replicated"). Returns {"state": "replicated"
    or "durable", "seq", "path"}; raises NotDurable as `wait_durable` does (state "timeout":
    code 7), and with state "off" (code 1) on a mount without replication. One set: a
    directory of several is not waited for as a whole."""
    return _wait(path, timeout, replicated=True)


def _wait(path: str | os.PathLike, timeout: float | None, *, replicated: bool) -> dict:
    mp, rel = locate(path)
    sock_timeout = None if timeout is None else timeout + 30
    req: dict = {"op": "wait", "path": rel, "timeout": timeout}
    if replicated:
        req["replicated"] = True
    reply = _request(mp, req, timeout=sock_timeout)
    state = reply.get("state")
    if state == "durable" or (replicated and state == "replicated"):
        return reply
    msg = reply.get("error") or f"set is {state}"
    if state in ("none", "uncommitted"):
        raise NotDurable(msg, state, EXIT_NO_SET)
    if state == "timeout":
        raise NotDurable(msg, "timeout", EXIT_STORE)
    if state == "off":
        raise NotDurable(msg, "off", EXIT_ERROR)
    if state is None:
        raise _failed({**reply, "error": msg})
    raise NotDurable(f"set {reply.get('path')} is {state}: {msg}", state, EXIT_ERROR)
