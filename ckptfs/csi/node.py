"""The CSI Identity and Node services: what kubelet calls on the plugin's socket.

NodePublishVolume mounts ckptfs at the target path by running `ckptfs mount` (the CLI's own
checks, messages and readiness wait), NodeUnpublishVolume drains and unmounts it with `ckptfs
umount --timeout S` and removes the target dir. Both are idempotent as the CSI spec asks: a
volume published again at its target answers OK, and so does unpublishing a target that is not
mounted or does not exist. No stage/unstage (no STAGE_UNSTAGE_VOLUME capability): each publish
is its own mount, one per volume per node (its cache dir takes one daemon; a second target of
the same volume on the node is refused with FAILED_PRECONDITION).

State: `Inflight` only (the volume ids and target paths with a call in progress, guarded by its
lock; a second call on either answers ABORTED, as the spec asks for an operation pending). What
is published is read each time from the kernel's mount table and the daemons' registrations
(ckptfs.mount), so a restarted plugin knows what its predecessor mounted.

Each call runs on a gRPC worker thread and blocks it for at most MOUNT_TIMEOUT_S (publish) or
the drain timeout + UMOUNT_GRACE_S (unpublish).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from .. import __version__
from ..mount import (
    EXIT_CACHE_DIR,
    EXIT_MOUNTPOINT,
    EXIT_NO_FUSE,
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_STORE,
    EXIT_USAGE,
    MountError,
    check_fuse,
    find_mount,
    registration,
)
from . import DRIVER_NAME, csi_pb2, csi_pb2_grpc, volume
from .volume import CsiError, Plan, Settings

log = logging.getLogger(__name__)

FSTYPE = "fuse.ckptfs"
# `ckptfs mount` gives up itself after READY_TIMEOUT_S (90 s, ckptfs.mount); the margin covers
# the CLI's start and preflight.
MOUNT_TIMEOUT_S = 120.0
# After the drain, `ckptfs umount` unmounts and waits for the daemon to persist its index and
# exit (seconds on a large cache).
UMOUNT_GRACE_S = 60.0

# `ckptfs mount` exit code -> the status kubelet gets (it retries every failure with backoff;
# the code says whose problem it is).
_MOUNT_STATUS = {
    EXIT_USAGE: grpc.StatusCode.INVALID_ARGUMENT,        # a bad attribute value
    EXIT_MOUNTPOINT: grpc.StatusCode.FAILED_PRECONDITION,  # target not empty, mounted, ...
    EXIT_CACHE_DIR: grpc.StatusCode.FAILED_PRECONDITION,   # cache dir locked or unusable
    EXIT_NO_FUSE: grpc.StatusCode.FAILED_PRECONDITION,     # the node has no FUSE
    EXIT_NOT_READY: grpc.StatusCode.UNAVAILABLE,           # the daemon died or hung at start
    EXIT_STORE: grpc.StatusCode.UNAVAILABLE,               # the store is unusable (now)
}


class Inflight:
    """Keys with a call in progress. `_keys` is guarded by `_lock`, held only to test and
    update it (never across a mount)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: set[str] = set()

    @contextlib.contextmanager
    def hold(self, *keys: str) -> Iterator[None]:
        with self._lock:
            busy = [k for k in keys if k in self._keys]
            if busy:
                raise CsiError(grpc.StatusCode.ABORTED,
                               f"an operation on {busy[0]} is in progress; retry later")
            self._keys.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._keys.difference_update(keys)


F = TypeVar("F", bound=Callable[..., Any])


def rpc(fn: F) -> F:
    """A CsiError becomes its status; anything else INTERNAL with one log line."""

    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: Any) -> Any:
        try:
            return fn(self, request, context)
        except CsiError as e:
            context.abort(e.code, e.msg)
        except Exception as e:  # noqa: BLE001 (kubelet gets a status, the log one line)
            log.error("%s failed unexpectedly: %s: %s", fn.__name__, e.__class__.__name__, e)
            context.abort(grpc.StatusCode.INTERNAL,
                          f"unexpected error: {e.__class__.__name__}: {e}")
        return None  # not reached: abort raises

    return wrapper  # type: ignore[return-value]


class Identity(csi_pb2_grpc.IdentityServicer):
    @rpc
    def GetPluginInfo(self, request: Any, context: Any) -> csi_pb2.GetPluginInfoResponse:
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__)

    @rpc
    def GetPluginCapabilities(self, request: Any,
                              context: Any) -> csi_pb2.GetPluginCapabilitiesResponse:
        return csi_pb2.GetPluginCapabilitiesResponse()  # node only: no controller service

    @rpc
    def Probe(self, request: Any, context: Any) -> csi_pb2.ProbeResponse:
        try:
            check_fuse()
        except MountError as e:
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION, e.msg) from None
        resp = csi_pb2.ProbeResponse()
        resp.ready.value = True
        return resp


def _answers(path: Path) -> bool:
    """The FUSE mount at `path` answers (statfs always reaches the daemon)."""
    try:
        os.statvfs(path)
        return True
    except OSError:
        return False


def _daemon_cache_dir(target: Path) -> Path | None:
    """The cache dir of the live ckptfs daemon serving `target`, None if none answers there."""
    entry = find_mount(target)
    if entry is None or entry["fstype"] != FSTYPE or not _answers(target):
        return None
    reg = registration(target)
    return Path(reg["cache_dir"]) if reg else None


def _served_at(cache_dir: Path) -> Path | None:
    """The mount point where a live daemon serves `cache_dir`, if any."""
    with open("/proc/self/mountinfo") as f:
        lines = f.readlines()
    for line in lines:
        parts = line.split()
        sep = parts.index("-")
        if parts[sep + 1] != FSTYPE:
            continue
        # mountinfo writes space, tab, newline and backslash as \ooo
        mp = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4]))
        reg = registration(mp)
        if reg and Path(reg["cache_dir"]) == cache_dir and _answers(mp):
            return mp
    return None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = lines[-1] if lines else "no message"
    return line.removeprefix("ckptfs: ")


class Node(csi_pb2_grpc.NodeServicer):
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.inflight = Inflight()

    @rpc
    def NodeGetInfo(self, request: Any, context: Any) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(node_id=self.settings.node_id)

    @rpc
    def NodeGetCapabilities(self, request: Any,
                            context: Any) -> csi_pb2.NodeGetCapabilitiesResponse:
        return csi_pb2.NodeGetCapabilitiesResponse()  # no stage/unstage, no stats

    @rpc
    def NodePublishVolume(self, request: csi_pb2.NodePublishVolumeRequest,
                          context: Any) -> csi_pb2.NodePublishVolumeResponse:
        p = volume.plan(request, self.settings)
        with self.inflight.hold(f"volume {p.volume_id!r}", f"target {p.target}"):
            if self._already_published(p):
                log.info("volume %r already published at %s", p.volume_id, str(p.target))
            else:
                self._mount(p)
                log.info("published volume %r at %s (store %s, cache %s)", p.volume_id,
                         str(p.target), p.store, str(p.cache_dir))
        return csi_pb2.NodePublishVolumeResponse()

    def _already_published(self, p: Plan) -> bool:
        entry = find_mount(p.target)
        if entry is None:
            return False
        served = _daemon_cache_dir(p.target)
        if served == p.cache_dir:
            return True
        if entry["fstype"] == FSTYPE and served is None:
            return False  # a dead daemon's mount: `ckptfs mount` cleans it up
        raise CsiError(grpc.StatusCode.ALREADY_EXISTS,
                       f"{p.target} is already mounted ({entry['fstype']}) with another volume")

    def _mount(self, p: Plan) -> None:
        elsewhere = _served_at(p.cache_dir)
        if elsewhere is not None:
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"volume {p.volume_id!r} is already published on this node at "
                           f"{elsewhere}: ckptfs serves one mount per volume per node")
        self.settings.cache_root.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = not p.target.exists()
        p.target.mkdir(parents=True, exist_ok=True)
        try:
            # The CLI returns once the daemon it forked answers; the daemon lives on in its own
            # session (its parent is the container's init, tini in deploy/Dockerfile).
            res = subprocess.run(list(p.argv), env=dict(p.env), stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S,
                                 cwd="/")
        except subprocess.TimeoutExpired:
            # A daemon that comes up later is found by the retry (_already_published).
            raise CsiError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"ckptfs mount of volume {p.volume_id!r} at {p.target} did not "
                           f"return in {MOUNT_TIMEOUT_S:.0f}s") from None
        if res.returncode != EXIT_OK:
            if made and find_mount(p.target) is None:
                with contextlib.suppress(OSError):
                    os.rmdir(p.target)  # leave no dir of ours behind a refusal
            why = volume.redact(_last_line(res.stderr), p.secret_values)
            code = _MOUNT_STATUS.get(res.returncode, grpc.StatusCode.INTERNAL)
            log.warning("publish of volume %r at %s failed (exit %d): %s", p.volume_id,
                        str(p.target), res.returncode, why)
            raise CsiError(code, f"ckptfs mount failed (exit {res.returncode}): {why}")

    @rpc
    def NodeUnpublishVolume(self, request: csi_pb2.NodeUnpublishVolumeRequest,
                            context: Any) -> csi_pb2.NodeUnpublishVolumeResponse:
        volume_id = volume.require(request.volume_id, "volume_id")
        target = volume.target_path(request.target_path)
        with self.inflight.hold(f"volume {volume_id!r}", f"target {target}"):
            entry = find_mount(target)
            if entry is not None and entry["fstype"] != FSTYPE:
                raise CsiError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{target} is a {entry['fstype']} mount, not ckptfs")
            how = self._umount(volume_id, target) if entry is not None else "was not mounted"
            self._remove_target(target)
            log.info("unpublished volume %r at %s (%s)", volume_id, str(target), how)
        return csi_pb2.NodeUnpublishVolumeResponse()

    def _umount(self, volume_id: str, target: Path) -> str:
        """Drain and unmount `target`; what happened, for the log line."""
        drain = self.settings.drain_timeout
        argv = [sys.executable, "-m", "ckptfs", "umount", str(target), "--timeout", f"{drain:g}"]
        try:
            res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=drain + UMOUNT_GRACE_S, cwd="/")
        except subprocess.TimeoutExpired:
            res = None
        if find_mount(target) is not None:
            why = "timed out" if res is None else _last_line(res.stderr)
            busy = res is not None and "busy" in why
            raise CsiError(grpc.StatusCode.FAILED_PRECONDITION if busy
                           else grpc.StatusCode.INTERNAL, f"ckptfs umount {target}: {why}")
        if res is None:
            return "unmounted; the daemon was still exiting"
        if res.returncode == EXIT_STORE:
            log.warning("volume %r: uploads still pending after the %gs drain; they resume at "
                        "the next publish of this volume on this node", volume_id, drain)
            return f"unmounted, uploads pending after {drain:g}s"
        if res.returncode != EXIT_OK:
            return f"unmounted: {_last_line(res.stderr)}"
        return "drained and unmounted"

    @staticmethod
    def _remove_target(target: Path) -> None:
        try:
            os.rmdir(target)
        except FileNotFoundError:
            pass
        except OSError as e:
            code = (grpc.StatusCode.FAILED_PRECONDITION if e.errno == errno.ENOTEMPTY
                    else grpc.StatusCode.INTERNAL)
            raise CsiError(code, f"cannot remove target {target}: {e.strerror}") from None
