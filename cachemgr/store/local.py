"""`file:///dir`: a directory with object-store semantics.

Layout under the root: `objects/<key>` holds each object's bytes, a sidecar
`meta/<h[:2]>/<h>.json` (h = sha1 of the key) holds its CRC32C; `multipart/<upload_id>/<n>`
holds pending parts.
Objects appear atomically: written to a temp file, fsync'd, then renamed (or hard-linked, for
If-None-Match, so that two writers racing for one key cannot both win). If-Match takes an
exclusive flock on a per-root lock file, so it is atomic across processes on one machine (the
multi-"node" tests run several mounts against one local store).

The etag is `<st_ino>-<st_mtime_ns>-<size>` of the object file: every put creates a new file, so
the etag changes with every version without hashing the data.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
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


class LocalStore(ObjectStore):
    supports_conditional_put = True

    def __init__(self, root: Path, *, threads: int = 8) -> None:
        self.root = root
        self.url = f"file://{root}"
        self._objects = root / "objects"
        self._meta = root / "meta"
        self._mp = root / "multipart"
        for d in (self._objects, self._meta, self._mp):
            d.mkdir(parents=True, exist_ok=True)
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
            raise TransientStoreError(f"file store: {e}") from None

    def _path(self, key: str) -> Path:
        return self._objects / check_key(key)

    def _meta_path(self, key: str) -> Path:
        # Named by a hash of the key: a sidecar must not make a 255-byte key component longer.
        h = hashlib.sha1(check_key(key).encode()).hexdigest()
        return self._meta / h[:2] / f"{h}.json"

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @staticmethod
    def _write_tmp(dir_: Path, data) -> Path:
        dir_.mkdir(parents=True, exist_ok=True)
        tmp = dir_ / f".tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def _info(self, key: str) -> ObjectInfo:
        p = self._path(key)
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"no object {key}", key=key) from None
        crc = None
        try:
            meta = json.loads(self._meta_path(key).read_text())
            if meta.get("etag") == _etag(st):
                crc = meta["crc32c"]
        except (FileNotFoundError, ValueError):
            pass
        return ObjectInfo(key, st.st_size, _etag(st), crc, st.st_mtime)

    def _publish(self, key: str, tmp: Path, crc: int, if_none_match: bool,
                 if_match: str | None) -> ObjectInfo:
        dst = self._path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            if if_none_match:
                try:
                    os.link(tmp, dst)  # atomic create-if-absent
                except FileExistsError:
                    raise PreconditionFailed(f"{key} exists", key=key) from None
                os.unlink(tmp)
            elif if_match is not None:
                with self._locked():
                    cur = self._info(key).etag if dst.exists() else None
                    if cur != if_match:
                        raise PreconditionFailed(f"{key} changed ({cur} != {if_match})", key=key)
                    os.rename(tmp, dst)
            else:
                os.rename(tmp, dst)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        st = os.stat(dst)
        info = ObjectInfo(key, st.st_size, _etag(st), crc, st.st_mtime)
        mp = self._meta_path(key)
        mp.parent.mkdir(parents=True, exist_ok=True)
        mtmp = mp.with_name(mp.name + f".{uuid.uuid4().hex}.tmp")
        mtmp.write_text(json.dumps({"etag": info.etag, "crc32c": crc}))
        os.rename(mtmp, mp)
        return info

    def _put(self, key, data, if_none_match, if_match) -> ObjectInfo:
        tmp = self._write_tmp(self._path(key).parent, data)
        return self._publish(key, tmp, crc32c(data), if_none_match, if_match)

    async def put(self, key, data, *, if_none_match=False, if_match=None) -> ObjectInfo:
        return await self._run(self._put, key, data, if_none_match, if_match)

    def _get(self, key: str, start: int, length: int | None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                if length is None:
                    f.seek(start)
                    return f.read()
                return os.pread(f.fileno(), length, start)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"no object {key}", key=key) from None

    async def get(self, key, start=0, length=None) -> bytes:
        return await self._run(self._get, key, start, length)

    async def head(self, key) -> ObjectInfo:
        return await self._run(self._info, key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        out = []
        for dirpath, _dirs, files in os.walk(self._objects):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self._objects)
                if key.startswith(prefix):
                    try:
                        out.append(self._info(key))
                    except NotFound:
                        pass  # deleted while listing
        return sorted(out, key=lambda i: i.key)

    async def list(self, prefix="") -> list[ObjectInfo]:
        return await self._run(self._list, prefix)

    def _delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        self._meta_path(key).unlink(missing_ok=True)

    async def delete(self, key) -> None:
        await self._run(self._delete, key)

    async def create_multipart(self, key) -> str:
        check_key(key)
        upload_id = uuid.uuid4().hex
        await self._run(lambda: (self._mp / upload_id).mkdir())
        return upload_id

    def _part_dir(self, upload_id: str) -> Path:
        d = self._mp / upload_id
        if not d.is_dir():
            raise NotFound(f"no multipart upload {upload_id}")
        return d

    def _upload_part(self, key, upload_id, number, data) -> Part:
        d = self._part_dir(upload_id)
        tmp = self._write_tmp(d, data)
        os.rename(tmp, d / str(number))
        return Part(number, f"{number}-{len(data)}", crc32c(data), len(data))

    async def upload_part(self, key, upload_id, number, data) -> Part:
        return await self._run(self._upload_part, key, upload_id, number, data)

    def _complete(self, key, upload_id, parts, crc) -> ObjectInfo:
        d = self._part_dir(upload_id)
        dst_dir = self._path(key).parent
        dst_dir.mkdir(parents=True, exist_ok=True)
        tmp = dst_dir / f".tmp-{uuid.uuid4().hex}"
        with open(tmp, "wb") as out:
            for p in sorted(parts, key=lambda p: p.number):
                src = d / str(p.number)
                if not src.exists() or src.stat().st_size != p.size:
                    tmp.unlink(missing_ok=True)
                    raise StoreError(f"part {p.number} of {key} missing or wrong size", key=key)
                with open(src, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        info = self._publish(key, tmp, crc, False, None)
        self._abort(upload_id)
        return info

    async def complete_multipart(self, key, upload_id, parts, crc32c) -> ObjectInfo:
        return await self._run(self._complete, key, upload_id, parts, crc32c)

    def _abort(self, upload_id: str) -> None:
        d = self._mp / upload_id
        if d.is_dir():
            for f in d.iterdir():
                f.unlink(missing_ok=True)
            d.rmdir()

    async def abort_multipart(self, key, upload_id) -> None:
        await self._run(self._abort, upload_id)


def _etag(st: os.stat_result) -> str:
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"
