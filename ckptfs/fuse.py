"""The FUSE adapter: the only module that imports pyfuse3.

Thin and total: every handler decodes the kernel's arguments, awaits `cachemgr.core.fs.Filesystem`
(or calls its `CacheFs` for operations that never wait), and encodes the answer. No caching,
read-through, backpressure, upload or store logic lives here: those are the core's
(cachemgr.core.fs). `KERNEL` is the kernel notifier the composition root gives the core.

Error contract: pyfuse3 only understands `FUSEError`; any other exception escaping a handler stops
its main loop and leaves a dead mount behind. So every handler runs under `_guarded`:

  * `FsError`                        -> FUSEError(err.errno), logged at debug level (expected),
                                        ENOSPC/EDQUOT as one warning line ("cache disk refused");
  * `OSError` ENOSPC/EDQUOT/EFBIG    -> the same errno, logged as a warning with the reason;
  * SQLite's SQLITE_FULL             -> ENOSPC, one warning line (the index turns it into
                                        `IndexFull` inside its transactions; this catches the
                                        rest, e.g. a read that grows SQLite's shared memory);
  * any other exception              -> EIO, logged with traceback and the operation name.

`forget` must not raise at all (it answers no request), so it swallows and logs.

`_guarded` also counts each request by handler, and each refusal by (handler, errno), in plain
dicts on the loop thread (`FuseOps.statistics`, read by ckptfs.metrics through the loop).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyfuse3

from cachemgr.core.errors import FsError
from cachemgr.core.fs import CacheFs, Filesystem
from cachemgr.core.handles import OpenResult
from cachemgr.core.index import is_disk_full
from cachemgr.core.inodes import Caller, Inode
from cachemgr.core.passthrough import Backings

log = logging.getLogger(__name__)

# Errnos a disk condition produces that the application must see as they are (they are not
# bugs): a full cache disk must surface as ENOSPC, not EIO.
_PASSTHROUGH_OS_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
# Refusals of the cache disk (a full disk, also reported by the index as `IndexFull`): worth a
# warning, unlike the other refusals, which are the application's own doing.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})

# st_blksize reported for files: libfuse's largest request. Python's buffered I/O (and hence
# torch.save, which writes through a Python file object) sizes its buffer from st_blksize, so
# small writes reach the daemon coalesced into 1 MiB requests.
BLKSIZE = 1 << 20


# The handlers `_guarded` wraps, by name: FuseOps.requests counts each (metrics).
_OPS: list[str] = []
# The handlers that change something: EROFS on a read-only mount (--read-only). The kernel
# refuses them first on its ro mount; this holds even if a request gets through (the kernel's
# own checks differ between versions, e.g. an atime update), and `open` is judged by its flags.
_MODIFYING = frozenset({
    "setattr", "mknod", "mkdir", "symlink", "link", "unlink", "rmdir", "rename", "create",
    "write", "fallocate", "setxattr", "removexattr",
})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    op = fn.__name__
    _OPS.append(op)

    @functools.wraps(fn)
    async def wrapper(self: FuseOps, *args: Any) -> Any:
        # One dict increment on the loop thread: the whole cost of counting (ckptfs.metrics).
        self.requests[op] += 1
        try:
            if self.read_only and op in _MODIFYING:
                raise pyfuse3.FUSEError(errno.EROFS)
            return await fn(self, *args)
        except pyfuse3.FUSEError as e:
            err = e.errno
        except FsError as e:
            if e.errno in _DISK_ERRNOS:
                log.warning("%s%r: cache disk refused: %s", op, _brief(args), e)
            else:
                log.debug("%s%r: %s", op, _brief(args), e)
            err = e.errno
        except OSError as e:
            if e.errno in _PASSTHROUGH_OS_ERRNOS:
                log.warning("%s%r: cache disk refused: %s", op, _brief(args), e)
                err = e.errno
            else:
                log.exception("%s%r failed: unexpected OSError, answering EIO", op,
                              _brief(args))
                err = errno.EIO
        except sqlite3.OperationalError as e:
            if not is_disk_full(e):
                log.exception("%s%r failed: unexpected error, answering EIO", op, _brief(args))
                err = errno.EIO
            else:
                log.warning("%s%r: cache disk refused: index: %s", op, _brief(args), e)
                err = errno.ENOSPC
        except Exception:
            log.exception("%s%r failed: unexpected error, answering EIO", op, _brief(args))
            err = errno.EIO
        key = (op, err)
        self.errors[key] = self.errors.get(key, 0) + 1
        raise pyfuse3.FUSEError(err) from None

    return wrapper


def _caller(ctx: pyfuse3.RequestContext) -> Caller:
    """Who asks: set-id bits go on an unprivileged write or truncate (`CacheFs._kill_setid`)."""
    return Caller(ctx.uid, ctx.gid, ctx.pid)


def _brief(args: tuple) -> tuple:
    """Arguments for a log line: data buffers shown by size only; request contexts dropped."""
    out = []
    for a in args:
        if isinstance(a, (bytes, bytearray, memoryview)) and len(a) > 64:
            out.append(f"<{len(a)} bytes>")
        elif isinstance(a, (pyfuse3.RequestContext, pyfuse3.ReaddirToken)):
            continue
        else:
            out.append(a)
    return tuple(out)


class KernelInvalidator:
    """`cachemgr.core.hooks.KernelNotifier`: the composition root gives `KERNEL` to the core
    and to tiering. Before the kernel's INIT has been answered (`FuseOps.init` sets
    `session_ready`) the kernel caches no entry, so there is nothing to invalidate, and a
    notification sent then fails (ENOSYS, logged by pyfuse3 with a traceback): the store's first
    listing runs while the session starts, and its changes are dropped here. Loop thread only."""

    session_ready = False

    @classmethod
    def invalidate_entry(cls, parent: int, name: bytes) -> None:
        if not cls.session_ready:
            return
        # Asynchronous: a synchronous invalidation from the loop thread could deadlock on a
        # request the kernel is waiting for.
        pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)


KERNEL = KernelInvalidator()


@dataclass(frozen=True, slots=True)
class RequestStats:
    """`FuseOps.statistics()`: FUSE requests (copies) (`dataclasses.asdict` for JSON)."""

    requests: dict[str, int]
    errors: dict[tuple[str, int], int]


class FuseOps(pyfuse3.Operations):
    """pyfuse3 operations backed by a `cachemgr.core.fs.Filesystem`: decode, await, encode."""

    enable_writeback_cache = False  # measured: see docs/ARCHITECTURE.md
    supports_dot_lookup = True
    # FUSE passthrough (patched pyfuse3, ckptfs/native): asked for at init when the composition
    # root says it can work; cache files may sit on a stacked filesystem (overlayfs in a
    # container), at the price of this mount not being stackable itself.
    enable_passthrough = False
    max_backing_stack_depth = 1
    # FUSE_HANDLE_KILLPRIV_V2 (patched pyfuse3): the daemon clears set-id bits itself on an
    # unprivileged write, truncate and truncating open (cachemgr.core.inodes `kill_setid`) and on
    # chown (`kill_setid_on_chown`); granted, the kernel sets SB_NOSEC, so a write(2) to a file
    # without set-id bits stops asking the daemon for security.capability (one GETXATTR per
    # write before: docs/ARCHITECTURE.md "Data path").
    enable_killpriv_v2 = True

    def __init__(self, fs: Filesystem, *, attr_timeout: float = 10.0,
                 writeback_cache: bool = False, passthrough: bool = False,
                 read_only: bool = False, uid: int | None = None,
                 gid: int | None = None) -> None:
        super().__init__()
        # --read-only: the handlers in _MODIFYING and write opens answer EROFS.
        self.read_only = read_only
        # --uid / --gid: the owner every inode is reported with (None: the inode's own).
        self.uid, self.gid = uid, gid
        # pyfuse3 reads these at init (instance attributes over the class defaults above)
        self.enable_writeback_cache = writeback_cache
        self.enable_passthrough = passthrough
        self.fs = fs
        self.core: CacheFs = fs.core
        self.attr_timeout = attr_timeout
        # Requests answered, by handler, and refusals by (handler, errno): loop thread only;
        # `statistics()` copies them for the metrics snapshot.
        self.requests: dict[str, int] = dict.fromkeys(_OPS, 0)
        self.errors: dict[tuple[str, int], int] = {}

    def statistics(self) -> RequestStats:
        """Copies of the request counters (loop thread). With passthrough, reads and writes of
        files the cache holds whole go to the cache file in the kernel and are not counted."""
        return RequestStats(requests=dict(self.requests), errors=dict(self.errors))

    # -- encoding ----------------------------------------------------------------------------

    def _entry(self, node: Inode) -> pyfuse3.EntryAttributes:
        # A passthrough writer's size and mtime are in the cache file, not yet in the node.
        self.core.take_in_writes(node)
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.ino
        e.generation = 0
        e.entry_timeout = self.attr_timeout
        e.attr_timeout = self.attr_timeout
        e.st_mode = node.mode
        e.st_nlink = node.nlink
        e.st_uid = node.uid if self.uid is None else self.uid
        e.st_gid = node.gid if self.gid is None else self.gid
        e.st_rdev = node.rdev
        e.st_size = node.size
        e.st_blksize = BLKSIZE
        e.st_blocks = (node.size + 511) // 512
        e.st_atime_ns = node.atime_ns
        e.st_mtime_ns = node.mtime_ns
        e.st_ctime_ns = node.ctime_ns
        return e

    @staticmethod
    def _fileinfo(res: OpenResult) -> pyfuse3.FileInfo:
        if res.backing_id:
            return pyfuse3.FileInfo(fh=res.fh, direct_io=False, keep_cache=False,
                                    backing_id=res.backing_id)
        return pyfuse3.FileInfo(fh=res.fh, direct_io=res.direct_io, keep_cache=res.keep_cache)

    # -- lifecycle ---------------------------------------------------------------------------

    def init(self) -> None:
        KernelInvalidator.session_ready = True
        killpriv = getattr(pyfuse3, "killpriv_v2_active", lambda: False)()
        log.info("FUSE_HANDLE_KILLPRIV_V2 %s", "granted: no security.capability lookup per"
                 " write" if killpriv else "not granted (an unpatched pyfuse3 or an old"
                 " kernel): the kernel asks for security.capability at each write")
        b = self.core.backings
        if b.on and not (self.enable_passthrough and pyfuse3.passthrough_active()):
            b.turn_off("the kernel did not grant FUSE passthrough (needs Linux 6.9+ built with"
                       " CONFIG_FUSE_PASSTHROUGH)")  # says why, once
        elif b.on:
            log.info("FUSE session initialised; data path: passthrough for files the cache"
                     " holds whole (%s)", _LIBFUSE)
        else:
            log.info("FUSE session initialised; data path: the daemon serves file data (%s)",
                     b.off_reason)

    def forget(self, inode_list: list[tuple[int, int]]) -> None:  # type: ignore[override]
        for ino, n in inode_list:
            try:
                self.core.forget(ino, n)
            except Exception:
                log.exception("forget(%d, %d) failed; inode kept", ino, n)

    # -- namespace ---------------------------------------------------------------------------

    @_guarded
    async def lookup(self, parent_inode, name, ctx=None):
        return self._entry(self.core.lookup(parent_inode, name))

    @_guarded
    async def getattr(self, inode, ctx=None):
        return self._entry(self.core.getattr(inode))

    def _owner_change(self, want: int | None, forced: int | None) -> int | None:
        """The uid (gid) a chown asks the core to record: with --uid (--gid), none: the owner
        is the mount's, and a chown to another one is refused (EPERM, as chown(2) answers what
        a filesystem cannot do for the caller)."""
        if forced is None or want is None:
            return want
        if want != forced:
            raise pyfuse3.FUSEError(errno.EPERM)
        return None

    @_guarded
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = await self.fs.setattr(
            inode,
            truncating=bool(fields.update_size),
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=self._owner_change(attr.st_uid if fields.update_uid else None, self.uid),
            gid=self._owner_change(attr.st_gid if fields.update_gid else None, self.gid),
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            fh=fh,
            caller=_caller(ctx),
        )
        return self._entry(node)

    @_guarded
    async def readlink(self, inode, ctx):
        return self.core.readlink(inode)

    @_guarded
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._entry(self.core.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @_guarded
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._entry(self.core.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_guarded
    async def symlink(self, parent_inode, name, target, ctx):
        return self._entry(self.core.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_guarded
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._entry(self.core.link(inode, new_parent_inode, new_name))

    @_guarded
    async def unlink(self, parent_inode, name, ctx):
        self.core.unlink(parent_inode, name)

    @_guarded
    async def rmdir(self, parent_inode, name, ctx):
        self.core.rmdir(parent_inode, name)

    @_guarded
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self.core.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    # -- directories -------------------------------------------------------------------------

    @_guarded
    async def opendir(self, inode, ctx):
        return self.core.opendir(inode)

    @_guarded
    async def readdir(self, fh, start_id, token):
        for next_id, name, node in self.core.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._entry(node), next_id):
                break
            # readdirplus hands the kernel a reference for every entry it accepted.
            self.core.ref(node)

    @_guarded
    async def releasedir(self, fh):
        return None

    @_guarded
    async def fsyncdir(self, fh, datasync):
        self.core.fsyncdir(fh)

    # -- files -------------------------------------------------------------------------------

    @_guarded
    async def create(self, parent_inode, name, mode, flags, ctx):
        res, node = self.core.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid,
                                     _caller(ctx))
        return self._fileinfo(res), self._entry(node)

    @_guarded
    async def open(self, inode, flags, ctx):
        if self.read_only and flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        return self._fileinfo(await self.fs.open(inode, flags, _caller(ctx)))

    @_guarded
    async def read(self, fh, off, size):
        return await self.fs.read(fh, off, size)

    @_guarded
    async def write(self, fh, off, buf):
        return await self.fs.write(fh, off, buf)

    @_guarded
    async def flush(self, fh):
        self.core.flush(fh)  # never waits for the store (cachemgr.tiering.members)

    @_guarded
    async def fsync(self, fh, datasync):
        await self.fs.fsync(fh, bool(datasync))

    @_guarded
    async def fallocate(self, fh, mode, off, length):
        await self.fs.fallocate(fh, mode, off, length)

    @_guarded
    async def release(self, fh):
        self.core.release(fh)

    # -- xattrs ------------------------------------------------------------------------------

    @_guarded
    async def getxattr(self, inode, name, ctx):
        return self.core.getxattr(inode, name)

    @_guarded
    async def setxattr(self, inode, name, value, ctx):
        self.core.setxattr(inode, name, value)

    @_guarded
    async def listxattr(self, inode, ctx):
        return self.core.listxattr(inode)

    @_guarded
    async def removexattr(self, inode, name, ctx):
        self.core.removexattr(inode, name)

    # -- filesystem --------------------------------------------------------------------------

    @_guarded
    async def statfs(self, ctx):
        st = self.core.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize = st.f_bsize
        s.f_frsize = st.f_frsize
        s.f_blocks = st.f_blocks
        s.f_bfree = st.f_bfree
        s.f_bavail = st.f_bavail
        s.f_files = st.f_files
        s.f_ffree = st.f_ffree
        s.f_favail = st.f_favail
        s.f_namemax = 255
        return s


def _libfuse_loaded() -> str:
    """Which libfuse this process runs with (the binding's rpath picks ckptfs/native's build)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libfuse3.so" in line:
                    return "libfuse " + line.split()[-1]
    except OSError:
        pass
    return "libfuse unknown"


_LIBFUSE = _libfuse_loaded()
_CAP_SYS_ADMIN = 21


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0


def backings(cfg) -> Backings:
    """The data path a mount with `cfg` asks for: passthrough where this process can register
    backing files, else why not (the kernel's own answer comes at init: `FuseOps.init`)."""
    why = None
    if not cfg.passthrough:
        why = "--no-passthrough"
    elif cfg.writeback_cache:
        why = "--writeback-cache (the kernel's writeback cache excludes passthrough)"
    elif not hasattr(pyfuse3, "passthrough_open"):
        why = ("this pyfuse3 has no passthrough (the patched binding is not installed: "
               f"`ckptfs setup-native` builds it; a failed build says why in "
               f"{sys.prefix}/native/build.log)")
    elif not _has_cap_sys_admin():
        why = "not root (registering a backing file needs CAP_SYS_ADMIN)"
    if why is not None:
        return Backings(off_reason=why)
    return Backings(pyfuse3.passthrough_open, pyfuse3.passthrough_close)


def fuse_options(*, access: str | None, read_only: bool = False,
                 fsname: str = "ckptfs") -> set[str]:
    """The FUSE session's options: `access` is None, "allow_other" or "allow_root" (libfuse
    lets the kernel admit everyone and answers EACCES itself to anyone but root and the
    mounting user); `read_only` mounts the kernel side ro (MS_RDONLY: mountinfo says ro)."""
    opts = set(pyfuse3.default_options)  # default_permissions: the kernel checks mode bits
    opts.add(f"fsname={fsname}")
    opts.add("subtype=ckptfs")
    if access is not None:
        opts.add(access)
    if read_only:
        opts.add("ro")
    return opts


def mount_and_serve(ops: FuseOps, mountpoint: str, options: set[str]):
    """pyfuse3 entry points, kept here so nothing else imports pyfuse3."""
    pyfuse3.init(ops, mountpoint, options)
    return pyfuse3.main


def close_session(unmount: bool) -> None:
    pyfuse3.close(unmount=unmount)


def terminate() -> None:
    pyfuse3.terminate()


