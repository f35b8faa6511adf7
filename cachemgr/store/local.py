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
open descriptor per level).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import uuid
from pathlib import Path

import trio

from .base import (
    NotFound,
    ObjectInfo,
    ObjectStore,
    Part,
    PreconditionFailed,
    StoreError,
    TransientStoreError,
    check_key,
    crc32c,
)

MAX_DEPTH = 256          # components of a key
SIDECAR_MAX = 4096       # bytes of a sidecar read at most; a longer one counts as absent
FILE_MODE = 0o600
DIR_MODE = 0o700

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted where a file should be must not block the opener.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _symlink_error(key: str | None, where: str) -> StoreError:
    what = f" key {key!r}" if key is not None else ""
    return StoreError(f"file store refuses{what}: a symlink is in the way at {where} (symlinks"
                      f" under the store root are never followed)", key=key)


class LocalStore(ObjectStore):
    supports_conditional_put = True

    def __init__(self, root: Path, *, threads: int = 8) -> None:
        self.root = root
        self.url = f"file://{root}"
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(OSError):
                os.chmod(root, DIR_MODE)  # created here: the store's own directory
        for top in ("objects", "meta", "multipart"):
            try:
                os.close(self._open_dir([top], create=True, key=None))
            except OSError as e:
                raise StoreError(f"file store {root}: cannot open {top}/: {e}") from None
        self._limiter = trio.CapacityLimiter(threads)

    async def _run(self, fn, *args):
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

    @staticmethod
    def _split(key: str) -> tuple[list[str], str]:
        parts = check_key(key).split("/")
        if len(parts) > MAX_DEPTH:
            raise StoreError(f"file store cannot hold this key: more than {MAX_DEPTH}"
                             f" components", key=key)
        return parts[:-1], parts[-1]

    @staticmethod
    def _meta_name(key: str) -> tuple[list[str], str]:
        # Named by a hash of the key: a sidecar must not make a 255-byte key component longer.
        h = hashlib.sha1(check_key(key).encode()).hexdigest()
        return ["meta", h[:2]], f"{h}.json"

    def _open_dir(self, parts: list[str], *, create: bool, key: str | None) -> int:
        """A descriptor of root/<parts...>, walked without following any symlink. Missing
        directories are created (0700) if `create`, else FileNotFoundError. A symlink in the
        way: StoreError; a non-directory: NotADirectoryError."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, name in enumerate(parts):
                nfd = self._open_child_dir(fd, name, create, key, "/".join(parts[:i + 1]))
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _open_child_dir(fd: int, name: str, create: bool, key: str | None, where: str) -> int:
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
        except NotADirectoryError:
            _refuse_symlink(fd, name, key, where)
            raise
        created = False
        try:
            os.mkdir(name, DIR_MODE, dir_fd=fd)
            created = True
        except FileExistsError:
            pass  # made meanwhile by another writer
        try:
            nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except NotADirectoryError:
            _refuse_symlink(fd, name, key, where)
            raise
        if created:
            try:
                os.fchmod(nfd, DIR_MODE)  # the umask may have taken bits off
            except BaseException:
                os.close(nfd)
                raise
        return nfd

    def _lstat_object(self, dfd: int, name: str, key: str) -> os.stat_result:
        """lstat of the object `name` in directory `dfd`: NotFound unless a regular file,
        StoreError if a symlink."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise NotFound(f"no object {key}", key=key) from None
        if stat.S_ISLNK(st.st_mode):
            raise _symlink_error(key, f"objects/{key}")
        if not stat.S_ISREG(st.st_mode):
            raise NotFound(f"no object {key} (not a regular file)", key=key)
        return st

    def _object_dir(self, key: str, *, create: bool) -> tuple[int, str]:
        """(descriptor of the object's directory, its name in it). Without `create`, NotFound
        when a directory on the way is missing or is not one."""
        dirs, name = self._split(key)
        try:
            return self._open_dir(["objects", *dirs], create=create, key=key), name
        except (FileNotFoundError, NotADirectoryError):
            if create:
                raise
            raise NotFound(f"no object {key}", key=key) from None

    @contextlib.contextmanager
    def _locked(self):
        rfd = self._open_dir([], create=False, key=None)
        try:
            fd = _create_or_open(rfd, ".lock")
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _symlink_error(None, ".lock") from None
            raise
        finally:
            os.close(rfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreError("file store: .lock is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- reading --------------------------------------------------------------------------------

    def _crc(self, key: str, st: os.stat_result, meta_fd: int | None = None) -> int | None:
        """The CRC32C the sidecar records for this version of the object, or None: sidecars
        are untrusted, and anything but a well-formed one for this etag counts as absent."""
        dirs, name = self._meta_name(key)
        try:
            if meta_fd is None:
                dfd = self._open_dir(dirs, create=False, key=key)
            else:
                dfd = self._open_child_dir(meta_fd, dirs[1], False, key, "/".join(dirs))
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            finally:
                os.close(dfd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                raw = b""
                while len(raw) <= SIDECAR_MAX:
                    chunk = os.read(fd, SIDECAR_MAX + 1 - len(raw))
                    if not chunk:
                        break
                    raw += chunk
            finally:
                os.close(fd)
            if len(raw) > SIDECAR_MAX:
                return None
            meta = json.loads(raw)
        except (OSError, StoreError, ValueError, RecursionError):
            return None
        if not isinstance(meta, dict):
            return None
        crc, etag = meta.get("crc32c"), meta.get("etag")
        if type(crc) is not int or not 0 <= crc < 1 << 32 or not isinstance(etag, str):
            return None
        return crc if etag == _etag(st) else None

    def _info(self, key: str) -> ObjectInfo:
        dfd, name = self._object_dir(key, create=False)
        try:
            st = self._lstat_object(dfd, name, key)
        finally:
            os.close(dfd)
        return ObjectInfo(key, st.st_size, _etag(st), self._crc(key, st), st.st_mtime)

    def _get(self, key: str, start: int, length: int | None) -> bytes:
        dfd, name = self._object_dir(key, create=False)
        try:
            self._lstat_object(dfd, name, key)
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                raise NotFound(f"no object {key}", key=key) from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise _symlink_error(key, f"objects/{key}") from None
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

    async def get(self, key, start=0, length=None) -> bytes:
        return await self._run(self._get, key, start, length)

    async def head(self, key) -> ObjectInfo:
        return await self._run(self._info, key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        # Start at the deepest directory the prefix names whole (keys never hold "", "." or
        # ".." components, so a prefix that does matches nothing).
        base = prefix.rpartition("/")[0]
        base_parts = base.split("/") if base else []
        if any(p in ("", ".", "..") for p in base_parts) or len(base_parts) >= MAX_DEPTH or \
                "\0" in base:
            return []
        try:
            top = self._open_dir(["objects", *base_parts], create=False, key=None)
        except (FileNotFoundError, NotADirectoryError, StoreError):
            return []  # nothing there, or a symlink: never descended into
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                return []  # a component no key can have
            raise
        try:
            meta_fd = self._open_dir(["meta"], create=False, key=None)
        except (OSError, StoreError):
            meta_fd = None  # no CRCs known
        out = []
        # Depth-first, one open descriptor per level: (fd, key prefix of its entries, names
        # of its subdirectories still to visit).
        stack: list[tuple[int, str, list[str]]] = []
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
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    continue  # deleted meanwhile, or replaced by a symlink: not descended into
                self._scan(child, f"{rel}{name}/", prefix, stack, out, meta_fd)
        finally:
            for fd, _rel, _subdirs in stack:
                os.close(fd)
            if meta_fd is not None:
                os.close(meta_fd)
        return sorted(out, key=lambda i: i.key)

    def _scan(self, fd: int, rel: str, prefix: str, stack: list, out: list,
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
                        out.append(ObjectInfo(key, st.st_size, _etag(st),
                                              self._crc(key, st, meta_fd), st.st_mtime))
        except BaseException:
            os.close(fd)
            raise
        stack.append((fd, rel, subdirs))

    async def list(self, prefix="") -> list[ObjectInfo]:
        return await self._run(self._list, prefix)

    # -- writing --------------------------------------------------------------------------------

    @staticmethod
    def _write_tmp(dfd: int, data) -> tuple[str, os.stat_result]:
        """A new fsync'd temp file in directory `dfd` holding `data`: (name, its stat)."""
        return _fill_tmp(dfd, lambda f: f.write(data))

    def _refuse_object_symlink(self, dfd: int, name: str, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                raise _symlink_error(key, f"objects/{key}")

    def _publish(self, key: str, dfd: int, name: str, tmp: str, st: os.stat_result,
                 crc: int, if_none_match: bool, if_match: str | None) -> ObjectInfo:
        """Move temp file `tmp` (stat `st`) to `name`, both in directory `dfd`."""
        try:
            if if_none_match:
                try:
                    # atomic create-if-absent; linkat never follows a symlink at either name
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    self._refuse_object_symlink(dfd, name, key)
                    raise PreconditionFailed(f"{key} exists", key=key) from None
                os.unlink(tmp, dir_fd=dfd)
            elif if_match is not None:
                with self._locked():
                    try:
                        cur = _etag(self._lstat_object(dfd, name, key))
                    except NotFound:
                        cur = None
                    if cur != if_match:
                        raise PreconditionFailed(f"{key} changed ({cur} != {if_match})", key=key)
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            else:
                self._refuse_object_symlink(dfd, name, key)
                os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        # The etag of the file this call wrote (link and rename change neither its inode nor
        # its mtime), not of whatever another writer may have put there since.
        return ObjectInfo(key, st.st_size, _etag(st), crc, st.st_mtime)

    def _write_sidecar(self, mfd: int, key: str, info: ObjectInfo) -> None:
        _dirs, name = self._meta_name(key)
        mtmp = f"{name}.{uuid.uuid4().hex}.tmp"
        fd = _create(mfd, mtmp)
        try:
            with open(fd, "wb") as f:
                f.write(json.dumps({"etag": info.etag, "crc32c": info.crc32c}).encode())
            # rename replaces whatever has the name (a planted symlink included), never
            # following it
            os.rename(mtmp, name, src_dir_fd=mfd, dst_dir_fd=mfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(mtmp, dir_fd=mfd)
            raise

    def _store(self, key: str, fill, crc: int, if_none_match: bool,
               if_match: str | None) -> ObjectInfo:
        """Write a temp file next to the object (`fill(dfd)` -> (tmp, stat)), publish it, then
        its sidecar. The sidecar's directory is opened first: a symlink in its way fails the
        put before the object appears."""
        dfd, name = self._object_dir(key, create=True)
        try:
            mfd = self._open_dir(self._meta_name(key)[0], create=True, key=key)
            try:
                tmp, st = fill(dfd)
                info = self._publish(key, dfd, name, tmp, st, crc, if_none_match, if_match)
                self._write_sidecar(mfd, key, info)
                return info
            finally:
                os.close(mfd)
        finally:
            os.close(dfd)

    def _put(self, key, data, if_none_match, if_match) -> ObjectInfo:
        return self._store(key, lambda dfd: self._write_tmp(dfd, data), crc32c(data),
                           if_none_match, if_match)

    async def put(self, key, data, *, if_none_match=False, if_match=None) -> ObjectInfo:
        return await self._run(self._put, key, data, if_none_match, if_match)

    def _delete(self, key: str) -> None:
        try:
            dfd, name = self._object_dir(key, create=False)
        except NotFound:
            pass
        else:
            try:
                try:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    st = None
                if st is not None and stat.S_ISLNK(st.st_mode):
                    raise _symlink_error(key, f"objects/{key}")
                if st is not None and not stat.S_ISDIR(st.st_mode):  # a directory: no object
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=dfd)
            finally:
                os.close(dfd)
        dirs, mname = self._meta_name(key)
        try:
            mfd = self._open_dir(dirs, create=False, key=key)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(mname, dir_fd=mfd)  # whatever it is (a symlink: the link itself)
        finally:
            os.close(mfd)

    async def delete(self, key) -> None:
        await self._run(self._delete, key)

    # -- multipart ------------------------------------------------------------------------------

    def _create_mp(self, key: str, upload_id: str) -> None:
        mfd = self._open_dir(["multipart"], create=True, key=key)
        try:
            os.close(self._open_child_dir(mfd, upload_id, True, key, f"multipart/{upload_id}"))
        finally:
            os.close(mfd)

    async def create_multipart(self, key) -> str:
        self._split(key)
        upload_id = uuid.uuid4().hex
        await self._run(self._create_mp, key, upload_id)
        return upload_id

    def _part_dir(self, key: str, upload_id: str) -> int:
        if not _valid_upload_id(upload_id):
            raise NotFound(f"no multipart upload {upload_id}", key=key)
        try:
            return self._open_dir(["multipart", upload_id], create=False, key=key)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"no multipart upload {upload_id}", key=key) from None

    def _upload_part(self, key, upload_id, number, data) -> Part:
        self._split(key)
        number = int(number)
        d = self._part_dir(key, upload_id)
        try:
            tmp, _st = self._write_tmp(d, data)
            try:
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISLNK(os.stat(str(number), dir_fd=d,
                                            follow_symlinks=False).st_mode):
                        raise _symlink_error(key, f"multipart/{upload_id}/{number}")
                os.rename(tmp, str(number), src_dir_fd=d, dst_dir_fd=d)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=d)
                raise
        finally:
            os.close(d)
        return Part(number, f"{number}-{len(data)}", crc32c(data), len(data))

    async def upload_part(self, key, upload_id, number, data) -> Part:
        return await self._run(self._upload_part, key, upload_id, number, data)

    def _complete(self, key, upload_id, parts, crc) -> ObjectInfo:
        self._split(key)
        d = self._part_dir(key, upload_id)
        try:
            def assemble(dfd: int) -> tuple[str, os.stat_result]:
                def fill(out) -> None:
                    for p in sorted(parts, key=lambda p: p.number):
                        self._copy_part(d, key, upload_id, p, out)
                return _fill_tmp(dfd, fill)

            info = self._store(key, assemble, crc, False, None)
        finally:
            os.close(d)
        # Published: leftover parts are garbage, not a failure of this call.
        with contextlib.suppress(OSError, StoreError):
            self._abort(key, upload_id)
        return info

    @staticmethod
    def _copy_part(d: int, key: str, upload_id: str, p: Part, out) -> None:
        bad = StoreError(f"part {p.number} of {key} missing or wrong size", key=key)
        try:
            fd = os.open(str(int(p.number)), _READ_FLAGS, dir_fd=d)
        except FileNotFoundError:
            raise bad from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _symlink_error(key, f"multipart/{upload_id}/{p.number}") from None
            raise
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != p.size:
                raise bad
            while chunk := f.read(1 << 20):
                out.write(chunk)

    async def complete_multipart(self, key, upload_id, parts, crc32c) -> ObjectInfo:
        return await self._run(self._complete, key, upload_id, parts, crc32c)

    def _abort(self, key: str, upload_id: str) -> None:
        if not _valid_upload_id(upload_id):
            return
        try:
            mfd = self._open_dir(["multipart"], create=False, key=key)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            try:
                d = self._open_child_dir(mfd, upload_id, False, key, f"multipart/{upload_id}")
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

    async def abort_multipart(self, key, upload_id) -> None:
        await self._run(self._abort, key, upload_id)


def _refuse_symlink(dfd: int, name: str, key: str | None, where: str) -> None:
    """Raise the symlink StoreError if `name` in `dfd` is a symlink (an open with O_NOFOLLOW |
    O_DIRECTORY says only ENOTDIR)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _symlink_error(key, where)


def _create(dfd: int, name: str) -> int:
    """A new file `name` in `dfd`, mode 0600 whatever the umask; never through a symlink."""
    return _private(os.open(name, _CREATE_FLAGS, FILE_MODE, dir_fd=dfd))


def _create_or_open(dfd: int, name: str) -> int:
    """`name` in `dfd` opened read-write, created 0600 if absent; never through a symlink."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=dfd)
    except FileExistsError:
        return os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                       dir_fd=dfd)
    return _private(fd)


def _private(fd: int) -> int:
    """`fd`, a file just created, given FILE_MODE exactly (the umask may have narrowed it)."""
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _valid_upload_id(upload_id) -> bool:
    return (isinstance(upload_id, str) and upload_id not in ("", ".", "..")
            and "/" not in upload_id and "\0" not in upload_id)


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def _fill_tmp(dfd: int, fill) -> tuple[str, os.stat_result]:
    """A new temp file in directory `dfd`, written by `fill(file)` and fsync'd: (name, its
    stat). Removed again if anything fails."""
    tmp = f".tmp-{uuid.uuid4().hex}"
    fd = _create(dfd, tmp)
    try:
        with open(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(fd)
            return tmp, os.fstat(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
