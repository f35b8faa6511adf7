"""`file:///dir`: a directory with object-store semantics.

Layout under the root: `objects/<key>` holds each object's bytes, a sidecar
`meta/<h[:2]>/<h>.json` (h = sha1 of the key) holds its CRC32C; `multipart/<upload_id>/<n>`
holds pending parts; `.lock` serialises If-Match puts.
Objects appear atomically: written to a temp file, fsync'd, then renamed (or hard-linked, for
If-None-Match, so that two writers racing for one key cannot both win). If-Match takes an
exclusive flock on a per-root lock file, so it is atomic across processes on one machine (the
multi-"node" tests run several mounts against one local store).

The etag is `<st_ino>-<st_mtime_ns>-<size>` of the object file: every put creates a new file, so
the etag changes with every version without hashing the data.

Trust: the directory is shared by several nodes, and anyone who can write to it can plant
anything in it, while the daemon reading it may run as root. So nothing under the root is
trusted:

- Symlinks are never followed. Every path is walked from a descriptor of the root, one
  component at a time, with O_NOFOLLOW (directories also O_DIRECTORY; missing ones are created
  with mkdirat); renames, links and unlinks are relative to the walked directory's descriptor.
  (The root itself is what the operator configured; it may be a symlink.) An operation on a key
  whose path under `objects/` holds a symlink, in a directory or as the object itself, fails
  with a permanent `StoreError` that names the key and says a symlink is in the way: put (plain,
  If-None-Match, If-Match), delete, multipart upload/complete/abort, and get and head too (a
  read does not answer NotFound there: something is in the way, and saying so beats silently
  reporting the object absent). The same holds for a symlinked `objects/`, `meta/`,
  `multipart/`, `meta/<h[:2]>/` or `multipart/<upload_id>/` on writes, and for a symlinked
  `.lock`. Listing never descends into a symlinked directory and never reports a symlink (nor
  a FIFO, socket or device: only regular files are objects; head/get of one of those answer
  NotFound).
- Sidecars only tell a CRC, and only when they are a regular file (no symlink) of at most 4 KiB
  holding a JSON object with an int `crc32c` in [0, 2**32) and a string `etag` equal to the
  object's current etag. Anything else (`[]`, `null`, `{"crc32c": "x"}`, garbage, a huge file,
  a symlink anywhere on the sidecar's path) reads as no sidecar: the CRC is unknown (None).
- Files the store writes (objects, sidecars, temp files, parts, the lock file) are created 0600
  and directories it creates 0700, whatever the process umask (fchmod after creating).

A key deeper than `MAX_DEPTH` components is refused (a listing descends at most that deep, one
open descriptor per level). The no-follow walking and the private-file helpers live in
`cachemgr.store.localfs` (`RootTree`); this module is the object-store semantics on top.

State and threads: the store's state is the directory itself; a LocalStore holds no mutable
state of its own (root, url, a `trio.CapacityLimiter` of `threads` workers). Every operation
runs in a worker thread (`_run`) and opens and closes its own descriptors, so any number may
run at once, in this process or in others sharing the directory. What keeps them apart: the
atomicity of rename/link within one directory, O_EXCL temp names (`.tmp-<uuid>`), and for
If-Match the flock on `.lock` (held from the etag check to the rename).

Crash states (a writer killed at any instruction; nothing is repaired at start-up):
- a put/complete: the temp file (`objects/.../.tmp-<uuid>`, fsync'd or partial) is left; it is
  never listed nor read as an object, and the old object (or none) stays visible. Killed after
  the rename/link but before the sidecar: the new object has a stale sidecar (etag of the old
  version) or none, which reads as "CRC unknown" (None), never as a wrong CRC.
- a sidecar write: a `<name>.<uuid>.tmp` beside it; the old sidecar stays until the rename.
- a multipart upload: `multipart/<upload_id>/` with its parts and temp files, until aborted
  (the caller's abort, or an operator's cleanup; S3's lifecycle rule has no equivalent here).
- complete: after the object is published, the leftover parts are garbage, not a failure.
Objects are fsync'd before they are renamed into place; the directory entries themselves are not
fsync'd, so a power loss (not a process crash) may forget the most recent puts, and sidecars
are not fsync'd at all (one read back empty after a power loss counts as absent: CRC None).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import trio

from cachemgr.store.base import (
    NotFound,
    ObjectInfo,
    ObjectStore,
    Part,
    PreconditionFailed,
    Staged,
    StoreError,
    TransientStoreError,
    crc32c,
)
from cachemgr.store.localfs import (
    DIR_FLAGS,
    DIR_MODE,
    MAX_DEPTH,
    READ_FLAGS,
    RootTree,
    etag_of,
    fill_tmp,
    symlink_error,
    valid_upload_id,
)

_T = TypeVar("_T")
# the directories a listing has open: (fd, key prefix of its entries, subdirectories to visit)
_Stack = list[tuple[int, str, list[str]]]


class _SourceError(Exception):
    """`LocalStore.stage_path`: an OSError of the source file, not of the store."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class LocalStore(ObjectStore):
    @property
    def supports_conditional_put(self) -> bool:
        return True  # _publish: link() creates only if absent; If-Match checks under a lock

    def __init__(self, root: Path, *, threads: int = 8) -> None:
        self.root = root
        self.url = f"file://{root}"
        self._tree = RootTree(root)
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                os.chmod(root, DIR_MODE)  # created here: the store's own directory
        for top in ("objects", "meta", "multipart"):
            try:
                os.close(self._tree.open_dir([top], create=True, key=None))
            except OSError as e:
                raise StoreError(f"file store {root}: cannot open {top}/: {e}") from None
        self._limiter = trio.CapacityLimiter(threads)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except OSError as e:
            # A key this directory cannot represent (a path component over 255 bytes, an object
            # where the key needs a directory) is refused for good; anything else the disk says
            # (ENOSPC, EIO) may pass.
            if e.errno in (errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.EINVAL):
                raise StoreError(f"file store cannot hold this key: {e}") from None
            if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink (one planted in a race)
                raise StoreError(f"file store: a symlink is in the way: {e}") from None
            raise TransientStoreError(f"file store: {e}") from None

    # -- walking without following symlinks ----------------------------------------------------

    # -- reading --------------------------------------------------------------------------------

    def _info(self, key: str) -> ObjectInfo:
        dfd, name = self._tree.object_dir(key, create=False)
        try:
            st = self._tree.lstat_object(dfd, name, key)
        finally:
            os.close(dfd)
        return ObjectInfo(key, st.st_size, etag_of(st), self._tree.sidecar_crc(key, st),
                          st.st_mtime)

    def _get(self, key: str, start: int, length: int | None) -> bytes:
        dfd, name = self._tree.object_dir(key, create=False)
        try:
            self._tree.lstat_object(dfd, name, key)
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                raise NotFound(f"no object {key}", key=key) from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise symlink_error(key, f"objects/{key}") from None
                raise
        finally:
            os.close(dfd)
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotFound(f"no object {key} (not a regular file)", key=key)
            if length is None:
                f.seek(start)
                return f.read()
            return os.pread(fd, length, start)

    async def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        return await self._run(self._get, key, start, length)

    async def head(self, key: str) -> ObjectInfo:
        return await self._run(self._info, key)

    def _list(self, prefix: str) -> builtins.list[ObjectInfo]:
        # Start at the deepest directory the prefix names whole (keys never hold "", "." or
        # ".." components, so a prefix that does matches nothing).
        base = prefix.rpartition("/")[0]
        base_parts = base.split("/") if base else []
        if any(p in ("", ".", "..") for p in base_parts) or len(base_parts) >= MAX_DEPTH or \
                "\0" in base:
            return []
        try:
            top = self._tree.open_dir(["objects", *base_parts], create=False, key=None)
        except (FileNotFoundError, NotADirectoryError, StoreError):
            return []  # nothing there, or a symlink: never descended into
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                return []  # a component no key can have
            raise
        try:
            meta_fd = self._tree.open_dir(["meta"], create=False, key=None)
        except (OSError, StoreError):
            meta_fd = None  # no CRCs known
        out: builtins.list[ObjectInfo] = []
        # Depth-first, one open descriptor per level: (fd, key prefix of its entries, names
        # of its subdirectories still to visit).
        stack: _Stack = []
        try:
            self._scan(top, base + "/" if base else "", prefix, stack, out, meta_fd)
            while stack:
                fd, rel, subdirs = stack[-1]
                if not subdirs:
                    os.close(fd)
                    stack.pop()
                    continue
                name = subdirs.pop()
                try:
                    child = os.open(name, DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue  # deleted meanwhile, or replaced by a symlink: not descended into
                self._scan(child, f"{rel}{name}/", prefix, stack, out, meta_fd)
        finally:
            for fd, _rel, _subdirs in stack:
                os.close(fd)
            if meta_fd is not None:
                os.close(meta_fd)
        return sorted(out, key=lambda i: i.key)

    def _scan(self, fd: int, rel: str, prefix: str, stack: _Stack,
              out: builtins.list[ObjectInfo],
              meta_fd: int | None) -> None:
        """Report the regular files in directory `fd` whose key starts with `prefix` and push
        it with the subdirectories worth visiting (symlinks are neither)."""
        subdirs = []
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    key = rel + entry.name
                    if entry.is_symlink():
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        sub = key + "/"
                        if (sub.startswith(prefix) or prefix.startswith(sub)) and \
                                sub.count("/") < MAX_DEPTH:
                            subdirs.append(entry.name)
                        continue
                    if entry.name.startswith(".tmp-") or not key.startswith(prefix):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # deleted while listing
                    if stat.S_ISREG(st.st_mode):
                        crc = self._tree.sidecar_crc(key, st, meta_fd)
                        out.append(ObjectInfo(key, st.st_size, etag_of(st), crc, st.st_mtime))
        except BaseException:
            os.close(fd)
            raise
        stack.append((fd, rel, subdirs))

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        return await self._run(self._list, prefix)

    # -- writing --------------------------------------------------------------------------------

    @staticmethod
    def _write_tmp(dfd: int, data: bytes | memoryview) -> tuple[str, os.stat_result]:
        """A new fsync'd temp file in directory `dfd` holding `data`: (name, its stat)."""
        return fill_tmp(dfd, lambda f: f.write(data))

    def _publish(self, key: str, dfd: int, name: str, tmp: str, st: os.stat_result,
                 crc: int, if_none_match: bool, if_match: str | None) -> ObjectInfo:
        """Move temp file `tmp` (stat `st`) to `name`, both in directory `dfd`."""
        try:
            if if_none_match:
                try:
                    # atomic create-if-absent; linkat never follows a symlink at either name
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    self._tree.refuse_object_symlink(dfd, name, key)
                    raise PreconditionFailed(f"{key} exists", key=key) from None
                os.unlink(tmp, dir_fd=dfd)
            elif if_match is not None:
                with self._tree.locked():
                    try:
                        cur = etag_of(self._tree.lstat_object(dfd, name, key))
                    except NotFound:
                        cur = None
                    if cur != if_match:
                        raise PreconditionFailed(f"{key} changed ({cur} != {if_match})", key=key)
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                self._tree.refuse_object_symlink(dfd, name, key)
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        # The etag of the file this call wrote (link and rename change neither its inode nor
        # its mtime), not of whatever another writer may have put there since.
        return ObjectInfo(key, st.st_size, etag_of(st), crc, st.st_mtime)

    def _store(self, key: str, fill: Callable[[int], tuple[str, os.stat_result]], crc: int,
               if_none_match: bool,
               if_match: str | None) -> ObjectInfo:
        """Write a temp file next to the object (`fill(dfd)` -> (tmp, stat)), publish it, then
        its sidecar. The sidecar's directory is opened first: a symlink in its way fails the
        put before the object appears."""
        dfd, name = self._tree.object_dir(key, create=True)
        try:
            mfd = self._tree.open_dir(self._tree.meta_name(key)[0], create=True, key=key)
            try:
                tmp, st = fill(dfd)
                info = self._publish(key, dfd, name, tmp, st, crc, if_none_match, if_match)
                self._tree.write_sidecar(mfd, key, info)
                return info
            finally:
                os.close(mfd)
        finally:
            os.close(dfd)

    def _put(self, key: str, data: bytes | memoryview, if_none_match: bool,
             if_match: str | None) -> ObjectInfo:
        return self._store(key, lambda dfd: self._write_tmp(dfd, data), crc32c(data),
                           if_none_match, if_match)

    async def put(self, key: str, data: bytes | memoryview, *, if_none_match: bool = False,
                  if_match: str | None = None) -> ObjectInfo:
        return await self._run(self._put, key, data, if_none_match, if_match)

    # -- whole local files: staged by the kernel's copy, published by a rename ----------------

    @property
    def stages_files(self) -> bool:
        return True

    def _stage(self, key: str, fd: int, size: int, inspect: Callable[[memoryview], int],
               pause: Callable[[], None] | None) -> Staged:
        from cachemgr.host.background import run_idle  # an upload's copy is background work

        dfd, _name = self._tree.object_dir(key, create=True)
        try:
            tmp, st = fill_tmp(dfd, lambda f: run_idle(copy_in, fd, f.fileno(), size, pause))
            try:
                crc = run_idle(_inspect_tmp, dfd, tmp, st.st_size, inspect)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
        finally:
            os.close(dfd)
        return Staged(key, (tmp, st), st.st_size, crc)

    async def stage_file(self, key: str, fd: int, size: int,
                         inspect: Callable[[memoryview], int],
                         pause: Callable[[], None] | None = None) -> Staged:
        return await self._run(self._stage, key, fd, size, inspect, pause)

    def _stage_path(self, key: str, path: str, size: int, inspect: Callable[[memoryview], int],
                    skip: Callable[[int], bool]) -> Staged | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise _SourceError(e) from None
        try:
            try:
                if skip(fd):
                    return None
            except OSError as e:
                raise _SourceError(e) from None
            return self._stage(key, fd, size, inspect, None)
        finally:
            os.close(fd)

    async def stage_path(self, key: str, path: str, size: int,
                         inspect: Callable[[memoryview], int],
                         skip: Callable[[int], bool]) -> Staged | None:
        from cachemgr.host.background import run_idle  # all of it is background work

        try:
            return await self._run(run_idle, self._stage_path, key, path, size, inspect, skip)
        except _SourceError as e:
            # The source (a cache file) failed to open or to read for `skip`: its OSError, as
            # the caller's own open would have raised it (ENOENT: deleted meanwhile), not a
            # store error.
            raise e.error from None

    def _publish_staged(self, staged: Staged) -> ObjectInfo:
        tmp, st = staged.handle
        # The object as this publication made it (ObjectStore.publish_staged), from the inode
        # it renamed into place: the uploader does not HEAD. Not read back by key: a deletion
        # right after the rename (a GC pass collecting the object of a file deleted meanwhile)
        # would turn a publication that happened into NotFound, which an S3 PUT never does.
        return self._store(staged.key, lambda _dfd: (tmp, st), staged.crc32c, False, None)

    async def publish_staged(self, staged: Staged) -> ObjectInfo:
        return await self._run(self._publish_staged, staged)

    def _discard_staged(self, staged: Staged) -> None:
        tmp, _st = staged.handle
        try:
            dfd, _name = self._tree.object_dir(staged.key, create=False)
        except (OSError, StoreError):
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
        finally:
            os.close(dfd)

    async def discard_staged(self, staged: Staged) -> None:
        await self._run(self._discard_staged, staged)

    def _delete(self, key: str) -> None:
        try:
            dfd, name = self._tree.object_dir(key, create=False)
        except NotFound:
            pass
        else:
            try:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISLNK(st.st_mode):
                    raise symlink_error(key, f"objects/{key}")
                if st is not None and not stat.S_ISDIR(st.st_mode):  # a directory: no object
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
            finally:
                os.close(dfd)
        dirs, mname = self._tree.meta_name(key)
        try:
            mfd = self._tree.open_dir(dirs, create=False, key=key)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(mname, dir_fd=mfd)  # whatever it is (a symlink: the link itself)
        finally:
            os.close(mfd)

    async def delete(self, key: str) -> None:
        await self._run(self._delete, key)

    # -- multipart ------------------------------------------------------------------------------

    def _create_mp(self, key: str, upload_id: str) -> None:
        mfd = self._tree.open_dir(["multipart"], create=True, key=key)
        try:
            os.close(self._tree.open_child_dir(mfd, upload_id, True, key, f"multipart/{upload_id}"))
        finally:
            os.close(mfd)

    async def create_multipart(self, key: str) -> str:
        self._tree.split(key)
        upload_id = uuid.uuid4().hex
        await self._run(self._create_mp, key, upload_id)
        return upload_id

    def _part_dir(self, key: str, upload_id: str) -> int:
        if not valid_upload_id(upload_id):
            raise NotFound(f"no multipart upload {upload_id}", key=key)
        try:
            return self._tree.open_dir(["multipart", upload_id], create=False, key=key)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"no multipart upload {upload_id}", key=key) from None

    def _upload_part(self, key: str, upload_id: str, number: int,
                     data: bytes | memoryview) -> Part:
        self._tree.split(key)
        number = int(number)
        d = self._part_dir(key, upload_id)
        try:
            tmp, _st = self._write_tmp(d, data)
            try:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISLNK(os.stat(str(number), dir_fd=d,
                                            follow_symlinks=False).st_mode):
                        raise symlink_error(key, f"multipart/{upload_id}/{number}")
                os.rename(tmp, str(number), src_dir_fd=d, dst_dir_fd=d)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise
        finally:
            os.close(d)
        return Part(number, f"{number}-{len(data)}", crc32c(data), len(data))

    async def upload_part(self, key: str, upload_id: str, number: int,
                          data: bytes | memoryview) -> Part:
        return await self._run(self._upload_part, key, upload_id, number, data)

    def _complete(self, key: str, upload_id: str, parts: builtins.list[Part],
                  crc: int) -> ObjectInfo:
        self._tree.split(key)
        d = self._part_dir(key, upload_id)
        try:
            def assemble(dfd: int) -> tuple[str, os.stat_result]:
                def fill(out: IO[bytes]) -> None:
                    for p in sorted(parts, key=lambda p: p.number):
                        self._copy_part(d, key, upload_id, p, out)
                return fill_tmp(dfd, fill)

            info = self._store(key, assemble, crc, False, None)
        finally:
            os.close(d)
        # Published: leftover parts are garbage, not a failure of this call.
        with contextlib.suppress(OSError, StoreError):
            self._abort(key, upload_id)
        return info

    @staticmethod
    def _copy_part(d: int, key: str, upload_id: str, p: Part, out: IO[bytes]) -> None:
        bad = StoreError(f"part {p.number} of {key} missing or wrong size", key=key)
        try:
            fd = os.open(str(int(p.number)), READ_FLAGS, dir_fd=d)
        except FileNotFoundError:
            raise bad from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise symlink_error(key, f"multipart/{upload_id}/{p.number}") from None
            raise
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != p.size:
                raise bad
            while chunk := f.read(1 << 20):
                out.write(chunk)

    async def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[Part],
                                 crc32c: int) -> ObjectInfo:
        return await self._run(self._complete, key, upload_id, parts, crc32c)

    def _abort(self, key: str, upload_id: str) -> None:
        if not valid_upload_id(upload_id):
            return
        try:
            mfd = self._tree.open_dir(["multipart"], create=False, key=key)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            try:
                d = self._tree.open_child_dir(mfd, upload_id, False, key, f"multipart/{upload_id}")
            except (FileNotFoundError, NotADirectoryError):
                return
            try:
                for name in os.listdir(d):
                    # unlink removes a symlink itself, never what it points to
                    try:
                        os.unlink(name, dir_fd=d)
                    except FileNotFoundError:
                        pass
                    except IsADirectoryError:
                        raise StoreError(f"file store: multipart/{upload_id}/{name} is a"
                                         f" directory; cannot abort the upload", key=key) from None
            finally:
                os.close(d)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(upload_id, dir_fd=mfd)
        finally:
            os.close(mfd)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._run(self._abort, key, upload_id)




# A staged copy goes in steps of this many bytes, `pause` called between them: a step takes a
# few milliseconds, so an upload gives way to the trainer's reads and writes within one.
COPY_STEP = 16 << 20


def copy_in(src: int, dst: int, size: int, pause: Callable[[], None] | None = None) -> int:
    """Copy bytes [0, size) of `src` to the same offsets of `dst` in the kernel
    (copy_file_range; sendfile across filesystems that refuse it), in steps of COPY_STEP with
    `pause()` before each step after the first. Stops early at the end of a shorter source;
    returns what was copied."""
    off = 0
    cfr = True
    while off < size:
        if pause is not None and off:
            pause()
        n = min(size - off, COPY_STEP)
        if cfr:
            try:
                got = os.copy_file_range(src, dst, n, off, off)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                cfr = False
                os.lseek(dst, off, os.SEEK_SET)
                continue
        else:
            got = os.sendfile(dst, src, off, n)
        if got == 0:
            break  # the source is shorter than `size`
        off += got
    return off


def _inspect_tmp(dfd: int, tmp: str, size: int, inspect: Callable[[memoryview], int]) -> int:
    """`inspect` over the staged copy, mapped read-only (no copy into user space)."""
    import mmap

    if size == 0:
        return inspect(memoryview(b""))
    fd = os.open(tmp, READ_FLAGS, dir_fd=dfd)
    try:
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        m.madvise(mmap.MADV_SEQUENTIAL)
        mv = memoryview(m)
        try:
            return inspect(mv)
        finally:
            mv.release()
    finally:
        m.close()
