"""Files under a root directory that strangers may write to: every path walked from a descriptor
of the root, one component at a time, never following a symlink (`cachemgr.store.local`'s trust
rules, stated there). `RootTree` is the walking; the functions below create files private to
this process (0600, directories 0700, whatever the umask), write temp files durably, and name
an object file's version (its etag).

No state of its own beyond the root path: every call opens what it needs and closes it before
returning (or on the error path), so it is safe from any number of threads at once. Durability
is the caller's sequence: `fill_tmp` leaves an fsync'd temp file (`.tmp-<uuid>`, never listed
as an object), which the caller renames or links into place; `write_sidecar` renames its temp
file over the sidecar. A crash leaves at most such temp files behind, never a partial object or
sidecar.
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from cachemgr.store.base import NotFound, ObjectInfo, StoreError, check_key

MAX_DEPTH = 256          # components of a key
SIDECAR_MAX = 4096       # bytes of a sidecar read at most; a longer one counts as absent
FILE_MODE = 0o600
DIR_MODE = 0o700

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted where a file should be must not block the opener.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC





class RootTree:
    """Walks paths under `root` without following symlinks: `objects/<key>` (the objects),
    `meta/<h[:2]>/<h>.json` (their CRC sidecars), `multipart/<upload_id>/` and `.lock`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def split(key: str) -> tuple[list[str], str]:
        parts = check_key(key).split("/")
        if len(parts) > MAX_DEPTH:
            raise StoreError(f"file store cannot hold this key: more than {MAX_DEPTH}"
                             f" components", key=key)
        return parts[:-1], parts[-1]

    @staticmethod
    def meta_name(key: str) -> tuple[list[str], str]:
        # Named by a hash of the key: a sidecar must not make a 255-byte key component longer.
        h = hashlib.sha1(check_key(key).encode()).hexdigest()
        return ["meta", h[:2]], f"{h}.json"

    def open_dir(self, parts: list[str], *, create: bool, key: str | None) -> int:
        """A descriptor of root/<parts...>, walked without following any symlink. Missing
        directories are created (0700) if `create`, else FileNotFoundError. A symlink in the
        way: StoreError; a non-directory: NotADirectoryError."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, name in enumerate(parts):
                nfd = self.open_child_dir(fd, name, create, key, "/".join(parts[:i + 1]))
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def open_child_dir(fd: int, name: str, create: bool, key: str | None, where: str) -> int:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
        except NotADirectoryError:
            refuse_symlink(fd, name, key, where)
            raise
        created = False
        try:
            os.mkdir(name, DIR_MODE, dir_fd=fd)
            created = True
        except FileExistsError:
            pass  # made meanwhile by another writer
        try:
            nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
        except NotADirectoryError:
            refuse_symlink(fd, name, key, where)
            raise
        if created:
            try:
                os.fchmod(nfd, DIR_MODE)  # the umask may have taken bits off
            except BaseException:
                os.close(nfd)
                raise
        return nfd

    def lstat_object(self, dfd: int, name: str, key: str) -> os.stat_result:
        """lstat of the object `name` in directory `dfd`: NotFound unless a regular file,
        StoreError if a symlink."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            raise NotFound(f"no object {key}", key=key) from None
        if stat.S_ISLNK(st.st_mode):
            raise symlink_error(key, f"objects/{key}")
        if not stat.S_ISREG(st.st_mode):
            raise NotFound(f"no object {key} (not a regular file)", key=key)
        return st

    def object_dir(self, key: str, *, create: bool) -> tuple[int, str]:
        """(descriptor of the object's directory, its name in it). Without `create`, NotFound
        when a directory on the way is missing or is not one."""
        dirs, name = self.split(key)
        try:
            return self.open_dir(["objects", *dirs], create=create, key=key), name
        except (FileNotFoundError, NotADirectoryError):
            if create:
                raise
            raise NotFound(f"no object {key}", key=key) from None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        rfd = self.open_dir([], create=False, key=None)
        try:
            fd = create_or_open(rfd, ".lock")
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise symlink_error(None, ".lock") from None
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

    def sidecar_crc(self, key: str, st: os.stat_result, meta_fd: int | None = None) -> int | None:
        """The CRC32C the sidecar records for this version of the object, or None: sidecars
        are untrusted, and anything but a well-formed one for this etag counts as absent."""
        dirs, name = self.meta_name(key)
        try:
            if meta_fd is None:
                dfd = self.open_dir(dirs, create=False, key=key)
            else:
                dfd = self.open_child_dir(meta_fd, dirs[1], False, key, "/".join(dirs))
            try:
                fd = os.open(name, READ_FLAGS, dir_fd=dfd)
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
        return crc if etag == etag_of(st) else None

    def refuse_object_symlink(self, dfd: int, name: str, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                raise symlink_error(key, f"objects/{key}")

    def write_sidecar(self, mfd: int, key: str, info: ObjectInfo) -> None:
        _dirs, name = self.meta_name(key)
        mtmp = f"{name}.{uuid.uuid4().hex}.tmp"
        fd = create_private(mfd, mtmp)
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


def symlink_error(key: str | None, where: str) -> StoreError:
    what = f" key {key!r}" if key is not None else ""
    return StoreError(f"file store refuses{what}: a symlink is in the way at {where} (symlinks"
                      f" under the store root are never followed)", key=key)



def refuse_symlink(dfd: int, name: str, key: str | None, where: str) -> None:
    """Raise the symlink StoreError if `name` in `dfd` is a symlink (an open with O_NOFOLLOW |
    O_DIRECTORY says only ENOTDIR)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise symlink_error(key, where)


def create_private(dfd: int, name: str) -> int:
    """A new file `name` in `dfd`, mode 0600 whatever the umask; never through a symlink."""
    return make_private(os.open(name, CREATE_FLAGS, FILE_MODE, dir_fd=dfd))


def create_or_open(dfd: int, name: str) -> int:
    """`name` in `dfd` opened read-write, created 0600 if absent; never through a symlink."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=dfd)
    except FileExistsError:
        return os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                       dir_fd=dfd)
    return make_private(fd)


def make_private(fd: int) -> int:
    """`fd`, a file just created, given FILE_MODE exactly (the umask may have narrowed it)."""
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def valid_upload_id(upload_id: object) -> bool:
    return (isinstance(upload_id, str) and upload_id not in ("", ".", "..")
            and "/" not in upload_id and "\0" not in upload_id)


def etag_of(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


def fill_tmp(dfd: int, fill: Callable[[IO[bytes]], Any]) -> tuple[str, os.stat_result]:
    """A new temp file in directory `dfd`, written by `fill(file)` and fsync'd: (name, its
    stat). Removed again if anything fails."""
    tmp = f".tmp-{uuid.uuid4().hex}"
    fd = create_private(dfd, tmp)
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
