"""`ckptfs restore`: a set restored into DEST in parallel, resumably (`restore_resumable`), and
the thread pool the store tools share (`run_parallel`).

Owns the restore's state in DEST (the layout below), the planning of what each file needs, and
its worker threads. Objects are read through a store view (cachemgr.format.views; ckptfs
passes cachemgr.format.storeview's, so every read is a ranged GET of cachemgr.store, the
mount's store layer, retries and deadlines included) and decoded chunk by chunk by
cachemgr.format.decode, each chunk checked against its CRC32C as it arrives; paths are resolved
inside DEST by cachemgr.format.restoreto's helpers (never through a symlink). Not needed by
scripts/ckpt_restore.py.

The workers are threads (`run_parallel`), each blocking on its store read (the store's trio
loop runs on a thread of its own: cachemgr.format.storeview.StoreLoop); moving this engine onto
that loop (trio tasks instead of threads, the file work in trio.to_thread) is not done yet.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypedDict, cast

from cachemgr.format import decode as decoding
from cachemgr.format.decode import ChunkDecoder, DecodeError, Layout, stream_chunk
from cachemgr.format.docs import FileDoc, ObjectDoc
from cachemgr.format.names import unescape_path
from cachemgr.format.readerrors import (
    CorruptError,
    DestinationError,
    RestoreError,
    UsageError,
    show,
)
from cachemgr.format.restoreto import (
    Tree,
    opendir,
    path_names,
    rmtree,
    set_dirs,
    split,
    target_free,
)
from cachemgr.format.storeread import Manifest, checked
from cachemgr.format.views import Reader, StoreView


class RestoreProgress(TypedDict):
    """What `restore_resumable` has done so far (its `progress` callback gets copies)."""

    bytes_total: int
    bytes_done: int       # verified in place: fetched, or already there
    bytes_fetched: int
    files_total: int
    files_done: int


class RestoreResult(RestoreProgress):
    """`restore_resumable`'s answer: the totals, where the set went, and how long it took."""

    target: Path
    seconds: float


ProgressFn = Callable[[RestoreProgress], None]

# # Layout in DEST (all of it inside DEST, nothing else is ever written):
#
#   DEST/.ckptfs-restore/<h>.lock      flock: one restore of a set into DEST at a time
#   DEST/.ckptfs-restore/<h>.json      what this restore verified (below); kept after success
#   DEST/.ckptfs-restore/<h>.partial/  a directory set being built (when its target is new)
#   DEST/.ckptfs-restore/<h>.tmp/      files being fetched (flat, one per file, by hash)
#
# with h = sha256 of the set path (escaped form), 32 hex digits. A file is fetched into its work
# file, read back and checked whole (size, CRC32C, chunk CRC32Cs), fsync'd, and only then
# renamed to its place: a file at its final name is always complete and verified. A directory
# set whose target does not exist (or is an empty directory) is built in `<h>.partial` and
# renamed into place once every file, symlink and mode is in: until then the target does not
# exist. An existing target (a set restored before, maybe interrupted in a repair, or one
# restored by other means) is repaired in place, file by file.
#
# The state file lists, per file, the (size, mtime_ns, ctime_ns, ino) of the file restore put
# or verified at its place and the CRC32C of the content it verified there: a file whose stat
# still matches is taken as verified without reading it (ctime cannot be set back by a user),
# and it is "ours": a newer manifest of the set may replace it. Any other existing file at a
# path of the set is read and checked: if it holds the set's content it is kept, else it is an
# unrelated file and restore refuses to replace it unless asked (overwrite=True). A rerun after
# an interruption re-reads the work files it left and fetches only the chunks that are missing
# or wrong. Deleting `.ckptfs-restore` is always safe: a rerun then reads the files back to
# check them instead of trusting their stat.

STATE_DIR = b".ckptfs-restore"
STATE_FORMAT = "ckptfs-restore-state"
MAX_STATE_BYTES = 1 << 30  # a state file listing 1,000,000 files is ~100 MB
DEFAULT_WORKERS = 8        # ranged GETs in flight; memory is about 2 x decode.READ_BYTES each
_END = object()


class _Stopped(RestoreError):
    """Another worker failed or the restore was interrupted: stop at the next piece."""


def _scan(fd: int, obj: ObjectDoc, geo: Layout, stop: threading.Event) -> tuple[list[int], bool]:
    """Check the local file `fd` against its object `obj` (chunks `geo`): (the chunks whose
    bytes are not known to be right, whether the whole file is right: its size, CRC32C and
    every chunk CRC32C). Reads decode.READ_BYTES at a time, each byte checksummed once (the
    chunks' CRCs folded into the whole one). Without chunk CRCs only the whole file can be
    judged."""
    step = decoding.READ_BYTES
    try:
        have = os.fstat(fd).st_size
        whole = 0
        bad: list[int] = []
        for i in range(geo.count):
            if stop.is_set():
                raise _Stopped("stopped")
            u = geo.chunk(i)
            c, pos, end = 0, u.raw_off, u.raw_off + u.raw_len
            while pos < end:
                data = os.pread(fd, min(step, end - pos), pos)
                if not data:
                    break
                c = decoding.crc32c(data, c)
                pos += len(data)
            if pos < end:  # the file ends here: this chunk and every later one are missing
                bad.extend(range(i, geo.count))
                break
            whole = decoding.crc32c_combine(whole, c, u.raw_len)
            if u.crc is None or c != u.crc:
                bad.append(i)
    except OSError as e:
        raise DestinationError(f"reading back a restored file: {e.strerror}") from None
    if have == obj["size"] and whole == obj["crc32c"] and \
            (obj["chunk_crcs"] is None or not bad):
        return [], True
    return (list(range(geo.count)) if obj["chunk_crcs"] is None else bad), False


def _fetch_unit(src: Reader, obj: ObjectDoc, geo: Layout, i: int, fd: int,
                stop: threading.Event) -> int:
    """Fetch chunk i of object `obj` from reader `src` into file `fd` at its raw offset,
    decoded and checked as it arrives (cachemgr.format.decode); returns its raw length."""
    c = geo.chunk(i)
    dec = ChunkDecoder(obj["key"], c, lz4=geo.compressed)
    pos = c.raw_off

    def read(off: int, n: int) -> bytes:
        if stop.is_set():
            raise _Stopped("stopped")
        return src.read(off, n)

    try:
        for data in stream_chunk(read, dec):
            mv = memoryview(data)
            try:
                while mv:
                    w = os.pwrite(fd, mv, pos)
                    mv, pos = mv[w:], pos + w
            except OSError as e:
                raise DestinationError(f"writing a restored file: {e.strerror}") from None
    except DecodeError as e:
        raise CorruptError(str(e)) from None
    return c.raw_len


def run_parallel(items: Iterable[Any], fn: Callable[[Any], None], workers: int,
                 stop: threading.Event, tick: Callable[[], None]) -> None:
    """fn(item) for every item, in `workers` threads taking the next item of one shared
    iterator (no queue of futures: memory does not grow with the number of items). The first
    error stops the others at their next piece and is raised once all have stopped; an
    interrupt in the calling thread (KeyboardInterrupt) likewise. `tick()` runs in the calling
    thread about five times a second."""
    it = iter(items)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                with lock:
                    x = next(it, _END)
                if x is _END:
                    return
                fn(x)
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=run, name=f"ckptfs-restore-{i}", daemon=True)
               for i in range(max(1, workers))]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.2)
                tick()
    except BaseException:
        stop.set()
        for t in threads:
            t.join()
        raise
    real = [e for e in errors if not isinstance(e, _Stopped)]
    if real:
        raise real[0]
    if errors:
        raise errors[0]


def _sig(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class _State:
    """DEST/.ckptfs-restore/<h>.json: what this restore verified at each place (see above).
    Written tmp + fsync + rename, at most once a second (less often if writing it is slow)
    while files complete, and at the end.
    A state file that does not parse, or belongs to another set, is ignored (everything is
    then read back and checked instead)."""

    def __init__(self, dir_fd: int, name: bytes, m: Manifest) -> None:
        self.dir_fd, self.name, self.path = dir_fd, name, m["path"]
        self.manifest = hashlib.sha256(json.dumps(m, sort_keys=True).encode(
            "utf-8", "surrogatepass")).hexdigest()
        self.lock = threading.Lock()
        self.last = 0.0
        self.interval = 1.0  # seconds between two writes while files complete
        self.files: dict[str, list[int]] = {}
        self.links: dict[str, list[int]] = {}
        self.keep = {f["path"] for f in m["files"]}, {s["path"] for s in m["symlinks"]} | (
            {""} if m["kind"] == "symlink" else set())
        self._load()

    def _load(self) -> None:
        try:
            fd = os.open(self.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.dir_fd)
        except OSError:
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            raw = os.read(fd, MAX_STATE_BYTES + 1)
        except OSError:
            return
        finally:
            os.close(fd)
        try:
            d = json.loads(raw) if len(raw) <= MAX_STATE_BYTES else None
        except (ValueError, RecursionError):
            return
        if not isinstance(d, dict) or d.get("format") != STATE_FORMAT or \
                d.get("version") != 1 or d.get("set") != self.path:
            return

        def records(v: Any, n: int) -> dict[str, list[int]]:
            if not isinstance(v, dict):
                return {}
            return {k: r for k, r in v.items() if isinstance(k, str) and isinstance(r, list)
                    and len(r) == n and all(type(x) is int for x in r)}

        self.files = records(d.get("files"), 5)
        self.links = records(d.get("links"), 2)

    def file_ok(self, rel: str, st: os.stat_result, obj: ObjectDoc) -> bool | None:
        """True: the file at `rel` is the one this restore verified with `obj`'s content;
        False: it is the one it verified, with other content (ours to replace); None: not
        known (another file, or none recorded)."""
        with self.lock:
            r = self.files.get(rel)
        if r is None or r[:4] != _sig(st):
            return None
        return bool(r[0] == obj["size"] and r[4] == obj["crc32c"])

    def link_ours(self, rel: str, st: os.stat_result) -> bool:
        with self.lock:
            return self.links.get(rel) == [st.st_ino, st.st_ctime_ns]

    def record_file(self, rel: str, st: os.stat_result, crc: int) -> None:
        with self.lock:
            self.files[rel] = _sig(st) + [crc]
        self.flush()

    def record_link(self, rel: str, st: os.stat_result) -> None:
        with self.lock:
            self.links[rel] = [st.st_ino, st.st_ctime_ns]

    def flush(self, done: bool = False, force: bool = False) -> None:
        with self.lock:
            now = time.monotonic()
            if not (force or done) and now - self.last < self.interval:
                return
            self.last = now
            doc = {"format": STATE_FORMAT, "version": 1, "set": self.path,
                   "manifest": self.manifest, "done": done,
                   "files": {k: v for k, v in self.files.items() if k in self.keep[0]},
                   "links": {k: v for k, v in self.links.items() if k in self.keep[1]}}
            data = json.dumps(doc, separators=(",", ":")).encode("utf-8", "surrogatepass")
            tmp = self.name + b".tmp"
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=self.dir_fd)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                             os.O_CLOEXEC, 0o600, dir_fd=self.dir_fd)
                try:
                    mv = memoryview(data)
                    while mv:
                        mv = mv[os.write(fd, mv):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
                # Workers wait for this lock: writing a big state (a set of 100,000s of files)
                # must take a small share of the time (at most 1/20th).
                self.interval = max(1.0, 20 * (time.monotonic() - now))
            except OSError as e:
                raise DestinationError(f"cannot write the restore state in "
                                       f"{STATE_DIR.decode()}: {e.strerror}") from None


class _Job:
    """One file of the set: where it goes and what is left to fetch."""

    __slots__ = ("comps", "entry", "geo", "name", "remaining", "replace", "shown", "src",
                 "todo", "work")

    def __init__(self, entry: FileDoc, comps: tuple[bytes, ...], name: bytes,
                 shown: str) -> None:
        self.entry, self.comps, self.name, self.shown = entry, comps, name, shown
        self.geo = Layout.of(entry["object"])
        self.work = hashlib.sha256(entry["path"].encode("utf-8", "surrogatepass")) \
            .hexdigest()[:32].encode()
        self.replace = False
        self.todo: list[int] | range | None = range(0)  # None: verified at its place
        self.remaining = 0
        self.src: Reader | None = None


def _walk(root_fd: int, comps: tuple[bytes, ...], shown: str) -> int:
    """A new descriptor of directory root/<comps>, opened one component at a time without
    following a symlink (thread-safe: no shared cursor, unlike Tree)."""
    fd = os.dup(root_fd)
    try:
        for c in comps:
            nfd = opendir(fd, c, shown)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lstat(dir_fd: int, name: bytes, shown: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise DestinationError(f"{shown}: {e.strerror}") from None


def _ensure_writable(fd: int) -> None:
    """u+rwx on a directory of the set while it is filled (its mode comes at the end)."""
    st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)


def _open_regular(dir_fd: int, name: bytes, shown: str) -> int:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError as e:
        raise DestinationError(f"{shown}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DestinationError(f"{shown} changed while it was checked")
    return fd


def _open_work(wfd: int, name: bytes) -> tuple[int, bool]:
    """The work file `name` (read-write) and whether it is new. Anything else at that name in
    the restore's own work directory is removed first."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):
        try:
            return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=wfd), True
        except FileExistsError:
            pass
        try:
            fd = os.open(name, flags, dir_fd=wfd)
        except FileNotFoundError:
            continue
        except OSError:
            rmtree(wfd, name)  # a symlink, a directory: not what we left there
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd, False
        os.close(fd)
        rmtree(wfd, name)
    raise DestinationError("the restore's work directory keeps changing")


def _prune(fd: int, prefix: tuple[bytes, ...], dirs: dict[tuple[bytes, ...], int],
           m: Manifest) -> None:
    """In the restore's own staging directory: remove every entry the set does not have there
    (left by an earlier run of an older manifest of the set), never following a symlink."""
    files = {path_names(f["path"]) for f in m["files"]}
    links = {path_names(s["path"]) for s in m["symlinks"]}

    def walk(dfd: int, prefix: tuple[bytes, ...]) -> None:
        _ensure_writable(dfd)
        for n in os.listdir(dfd):
            nb = os.fsencode(n)
            c = prefix + (nb,)
            st = os.stat(nb, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) and c in dirs:
                sub = opendir(dfd, nb, "the restore's staging directory")
                try:
                    walk(sub, c)
                finally:
                    os.close(sub)
            elif not ((stat.S_ISREG(st.st_mode) and c in files) or
                      (stat.S_ISLNK(st.st_mode) and c in links)):
                rmtree(dfd, nb)

    walk(fd, prefix)


def _make_dirs(root_fd: int, modes: dict[tuple[bytes, ...], int], target: bytes, staged: bool,
               overwrite: bool) -> None:
    """Every directory of the set under `root_fd`, made or opened without following a symlink,
    u+rwx while the set is filled in. A file or symlink in the way is replaced only in the
    restore's own staging directory or with `overwrite`."""
    tree = Tree(root_fd, target)
    try:
        for comps in sorted(modes, key=lambda c: (len(c), c)):
            pfd = tree.dir(comps[:-1])
            shown = show(b"/".join((target,) + comps))
            st = _lstat(pfd, comps[-1], shown)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                if not (staged or overwrite):
                    raise DestinationError(f"{shown} is in the way of a directory of the set: "
                                           "--overwrite replaces it")
                os.unlink(comps[-1], dir_fd=pfd)
                st = None
            if st is None:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(comps[-1], 0o700, dir_fd=pfd)
            dfd = opendir(pfd, comps[-1], shown)
            try:
                _ensure_writable(dfd)
            finally:
                os.close(dfd)
    finally:
        tree.close()


def _classify(job: _Job, view: StoreView, state: _State, root_fd: int, wfd: int, staged: bool,
              overwrite: bool, stop: threading.Event,
              count: Callable[..., None]) -> None:
    """What file `job` needs: nothing (its place already holds the set's content: job.todo is
    None), or its work file filled in (job.todo: the units still to fetch, job.src: its
    reader). Refuses (DestinationError) to replace what restore did not put there."""
    obj, mode, rel = job.entry["object"], job.entry["mode"], job.entry["path"]
    pfd = _walk(root_fd, job.comps, job.shown)
    try:
        st = _lstat(pfd, job.name, job.shown)
        if st is not None and stat.S_ISREG(st.st_mode):
            known = state.file_ok(rel, st, obj)
            ok = bool(known)
            if known is None or stat.S_IMODE(st.st_mode) != mode:
                fd = _open_regular(pfd, job.name, job.shown)
                try:
                    if known is None:
                        _, ok = _scan(fd, obj, job.geo, stop)
                    if ok and stat.S_IMODE(st.st_mode) != mode:
                        os.fchmod(fd, mode)
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
            if ok:
                state.record_file(rel, st, obj["crc32c"])
                job.todo = None
                count(done=obj["size"], files=1)
                return
            job.replace = staged or known is False or overwrite
            if not job.replace:
                raise DestinationError(f"{job.shown} exists with other content than the set's, "
                                       "and this restore did not put it there: --overwrite "
                                       "replaces it")
        elif st is not None and stat.S_ISDIR(st.st_mode):
            if not staged:
                raise DestinationError(f"{job.shown} is a directory where the set has a file: "
                                       "remove it or restore elsewhere")
            rmtree(pfd, job.name)
        elif st is not None:
            if not (staged or overwrite):
                raise DestinationError(f"{job.shown} exists and is not a regular file: "
                                       "--overwrite replaces it")
            job.replace = True
    finally:
        os.close(pfd)
    fd, fresh = _open_work(wfd, job.work)
    try:
        if fresh:
            todo: list[int] | range = range(job.geo.count)
        else:
            todo, ok = _scan(fd, obj, job.geo, stop)
        os.ftruncate(fd, obj["size"])
    finally:
        os.close(fd)
    job.todo, job.remaining = todo, len(todo)
    count(done=obj["size"] - sum(job.geo.chunk(i).raw_len for i in todo))
    if todo:
        src = view.open(obj["key"])
        if src is None:
            raise CorruptError(f"{obj['key']}: object missing from the store")
        if src.size != obj["stored_size"]:
            src.close()
            raise CorruptError(f"{obj['key']}: {src.size} bytes in the store, the manifest "
                               f"says {obj['stored_size']}")
        job.src = src


def _place(wfd: int, work: bytes, pfd: int, name: bytes, replace: bool, shown: str) -> None:
    """Move a verified work file to its place: over what is there if `replace`, else only if
    nothing is (a link, then the work name goes; rename after a check where links fail)."""
    try:
        if replace:
            os.rename(work, name, src_dir_fd=wfd, dst_dir_fd=pfd)
            return
        try:
            os.link(work, name, src_dir_fd=wfd, dst_dir_fd=pfd, follow_symlinks=False)
        except FileExistsError:
            raise DestinationError(f"{shown} appeared while it was restored: rerun") from None
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            if _lstat(pfd, name, shown) is not None:
                raise DestinationError(f"{shown} appeared while it was restored: "
                                       "rerun") from None
            os.rename(work, name, src_dir_fd=wfd, dst_dir_fd=pfd)
            return
        os.unlink(work, dir_fd=wfd)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise DestinationError(f"{shown}: DEST/{STATE_DIR.decode()} is on another "
                                   "filesystem than the target (a mount point inside DEST?): "
                                   "restore elsewhere") from None
        raise DestinationError(f"cannot put {shown} in place: {e.strerror}") from None


def _finish(job: _Job, state: _State, root_fd: int, wfd: int, stop: threading.Event) -> None:
    """Read the work file back and check it whole, give it its mode, fsync it and move it to
    its place; record it."""
    obj = job.entry["object"]
    try:
        fd = os.open(job.work, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=wfd)
    except OSError as e:
        raise DestinationError(f"{job.shown}: its work file: {e.strerror}") from None
    try:
        _, ok = _scan(fd, obj, job.geo, stop)
        if not ok:
            raise CorruptError(f"{obj['key']}: the fetched content fails its CRC32C (the "
                               "object in the store is damaged)")
        os.fchmod(fd, job.entry["mode"])
        os.fsync(fd)
    finally:
        os.close(fd)
    pfd = _walk(root_fd, job.comps, job.shown)
    try:
        _place(wfd, job.work, pfd, job.name, job.replace, job.shown)
        st = os.stat(job.name, dir_fd=pfd, follow_symlinks=False)
    finally:
        os.close(pfd)
    state.record_file(job.entry["path"], st, obj["crc32c"])


def _put_symlink(state: _State, pfd: int, name: bytes, rel: str, target: bytes, shown: str,
                 wfd: int, *, staged: bool, overwrite: bool) -> None:
    """The symlink `name` -> `target` in `pfd` (never followed): kept if it is there, replaced
    if restore put it there (or `overwrite`, or in its own staging directory)."""
    st = _lstat(pfd, name, shown)
    replace = False
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            with contextlib.suppress(OSError):
                if os.readlink(name, dir_fd=pfd) == target:
                    state.record_link(rel, st)
                    return
        if stat.S_ISDIR(st.st_mode):
            if not staged:
                raise DestinationError(f"{shown} is a directory where the set has a symlink: "
                                       "remove it or restore elsewhere")
            rmtree(pfd, name)
        elif staged or overwrite or (stat.S_ISLNK(st.st_mode) and state.link_ours(rel, st)):
            replace = True
        else:
            raise DestinationError(f"{shown} exists and is not the set's symlink: --overwrite "
                                   "replaces it")
    try:
        if replace:
            tmp = b"link-" + secrets.token_hex(8).encode()
            os.symlink(target, tmp, dir_fd=wfd)
            os.rename(tmp, name, src_dir_fd=wfd, dst_dir_fd=pfd)
        else:
            os.symlink(target, name, dir_fd=pfd)
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileExistsError:
        raise DestinationError(f"{shown} appeared while it was restored: rerun") from None
    except OSError as e:
        raise DestinationError(f"cannot create symlink {shown}: {e.strerror}") from None
    state.record_link(rel, st)


class _Progress:
    """The numbers `progress` gets: counted by the workers under a lock, handed out as copies."""

    def __init__(self, m: Manifest, progress: ProgressFn | None) -> None:
        self.snap: RestoreProgress = {
            "bytes_total": m["total_bytes"], "bytes_done": 0, "bytes_fetched": 0,
            "files_total": len(m["files"]), "files_done": 0}
        self._lock = threading.Lock()
        self._progress = progress

    def count(self, done: int = 0, fetched: int = 0, files: int = 0) -> None:
        with self._lock:
            self.snap["bytes_done"] += done
            self.snap["bytes_fetched"] += fetched
            self.snap["files_done"] += files

    def tick(self) -> None:
        if self._progress is not None:
            with self._lock:
                s = self.snap.copy()
            self._progress(s)


class _Resumable:
    """One run of `restore_resumable`, in its steps: open DEST and the state (`open`), lay out
    the target and plan its files (`plan`), check what is there and fetch the rest (`fetch`),
    then symlinks, modes and the rename into place (`finish_dir`); `close` releases every
    descriptor, reader and the lock whatever happened."""

    def __init__(self, view: StoreView, m: Manifest, dest: Path, overwrite: bool,
                 workers: int, progress: ProgressFn | None) -> None:
        self.t0 = time.monotonic()
        self.view, self.m, self.overwrite, self.workers = view, m, overwrite, workers
        self.dest_b = os.fsencode(dest)
        self.parents, self.name = split(m["path"])
        if (self.parents + (self.name,))[0] == STATE_DIR:
            raise DestinationError(f"{m['path']!r}: restore keeps its state in "
                                   f"DEST/{STATE_DIR.decode()}; restore this set with "
                                   "scripts/ckpt_restore.py")
        self.target = os.path.join(self.dest_b, *self.parents, self.name)
        self.shown_t = show(self.target)
        self.h = hashlib.sha256(m["path"].encode("utf-8", "surrogatepass")).hexdigest()[:32] \
            .encode()
        self.stop = threading.Event()
        self.progress = _Progress(m, progress)
        self.fds: list[int] = []
        self.lfd: int | None = None
        self.jobs: list[_Job] = []
        self.state: _State | None = None
        self.staged = False
        self.modes: dict[tuple[bytes, ...], int] = {}
        # set by open() and plan(): DEST's parent of the target, the work directory, the root
        # the set's paths are resolved in (the target, its staging directory, or for a file
        # set the parent)
        self.sfd = self.pfd = self.wfd = self.root_fd = -1

    def result(self) -> RestoreResult:
        self.progress.tick()
        snap = self.progress.snap
        return {"bytes_total": snap["bytes_total"], "bytes_done": snap["bytes_done"],
                "bytes_fetched": snap["bytes_fetched"], "files_total": snap["files_total"],
                "files_done": snap["files_done"], "target": Path(os.fsdecode(self.target)),
                "seconds": time.monotonic() - self.t0}

    def open(self) -> _State:
        """DEST, its state directory (private), the lock of this set's restore, the state
        file, the target's parents (created) and the work directory."""
        dest_b, h = self.dest_b, self.h
        try:
            os.makedirs(dest_b, exist_ok=True)
            dfd = os.open(dest_b, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise DestinationError(f"{show(dest_b)}: {e.strerror}") from None
        self.fds.append(dfd)
        self.sfd = sfd = opendir(dfd, STATE_DIR, show(os.path.join(dest_b, STATE_DIR)),
                                  create=True)
        self.fds.append(sfd)
        os.fchmod(sfd, 0o700)  # private: it records what was verified
        try:
            self.lfd = os.open(h + b".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                               | os.O_CLOEXEC, 0o600, dir_fd=sfd)
            fcntl.flock(self.lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DestinationError(f"another restore of {self.m['path']!r} into "
                                   f"{show(dest_b)} is running") from None
        except OSError as e:
            raise DestinationError(f"cannot lock the restore state: {e.strerror}") from None
        self.state = state = _State(sfd, h + b".json", self.m)
        pfd = dfd
        for i, c in enumerate(self.parents):
            pfd = opendir(pfd, c, show(os.path.join(dest_b, *self.parents[:i + 1])),
                           create=True)
            self.fds.append(pfd)
        self.pfd = pfd
        self.wfd = opendir(sfd, h + b".tmp", "the restore's work directory", create=True)
        self.fds.append(self.wfd)
        _ensure_writable(self.wfd)
        return state

    def symlink_set(self, state: _State) -> None:
        """A symlink set: the link itself, nothing to fetch."""
        _put_symlink(state, self.pfd, self.name, "", unescape_path(self.m["target"]),
                     self.shown_t, self.wfd, staged=False, overwrite=self.overwrite)
        self.done(state)

    def plan(self) -> None:
        """Where the set's files go (`root_fd`, `staged`: built in <h>.partial, or repaired in
        place), its directories made, one `_Job` per file."""
        m, name, shown_t = self.m, self.name, self.shown_t
        if m["kind"] == "file":
            self.root_fd = self.pfd
            self.jobs = [_Job(m["files"][0], (), name, shown_t)]
            return
        st_t = _lstat(self.pfd, name, shown_t)
        if st_t is not None and not stat.S_ISDIR(st_t.st_mode):
            raise DestinationError(f"{shown_t} exists and is not a directory (the set is "
                                   "one): remove it or restore elsewhere")
        empty = False
        if st_t is not None:
            tfd = opendir(self.pfd, name, shown_t)
            try:
                empty = not os.listdir(tfd)
            finally:
                os.close(tfd)
        self.staged = st_t is None or empty
        if self.staged:
            self.root_fd = opendir(self.sfd, self.h + b".partial",
                                    "the restore's staging directory", create=True)
        else:
            self.root_fd = opendir(self.pfd, name, shown_t)
        self.fds.append(self.root_fd)
        _ensure_writable(self.root_fd)
        self.modes = set_dirs(m)
        if self.staged:
            _prune(self.root_fd, (), self.modes, m)
        _make_dirs(self.root_fd, self.modes, self.target, self.staged, self.overwrite)
        for f in m["files"]:
            comps, nm = split(f["path"])
            self.jobs.append(_Job(f, comps, nm,
                                  show(b"/".join((self.target, *comps, nm)))))

    def fetch(self, state: _State) -> None:
        """Check what each file's place holds (in parallel), then fetch the missing units of
        the rest, each file read back whole and put in place once its last unit is in."""
        p = self.progress

        def classify(job: _Job) -> None:
            _classify(job, self.view, state, self.root_fd, self.wfd, self.staged,
                      self.overwrite, self.stop, p.count)

        run_parallel(self.jobs, classify, self.workers, self.stop, p.tick)
        lock = threading.Lock()

        def fetch(item: tuple[_Job, int | None]) -> None:
            job, i = item
            if i is not None:
                n = self._fetch_unit(job, i)
                p.count(done=n, fetched=n)
                with lock:
                    job.remaining -= 1
                    if job.remaining:
                        return
            _finish(job, state, self.root_fd, self.wfd, self.stop)
            p.count(files=1)

        run_parallel(self._units(), fetch, self.workers, self.stop, p.tick)

    def _units(self) -> Iterator[tuple[_Job, int | None]]:
        """(job, unit) for every unit still to fetch; (job, None) for a file with none left
        (its work file only needs checking and moving into place)."""
        for job in self.jobs:
            if job.todo is None:
                continue  # already verified at its place
            if not job.todo:
                yield job, None
            for i in job.todo:
                yield job, i

    def _fetch_unit(self, job: _Job, i: int) -> int:
        n = 0
        for attempt in (1, 2):  # a chunk mangled in transit: read it once more
            try:
                fd = os.open(job.work, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=self.wfd)
            except OSError as e:
                raise DestinationError(f"{job.shown}: its work file: {e.strerror}") from None
            try:
                src = cast(Reader, job.src)  # set by _classify: the job has units to fetch
                n = _fetch_unit(src, job.entry["object"], job.geo, i, fd, self.stop)
                break
            except CorruptError:
                if attempt == 2:
                    raise
            finally:
                os.close(fd)
        return n

    def finish_dir(self, state: _State) -> None:
        """A directory set: its symlinks, the directories' modes (deepest first), then the
        staged tree renamed into place."""
        m, root_fd, shown_t, pfd = self.m, self.root_fd, self.shown_t, self.pfd
        for s in m["symlinks"]:
            comps, nm = split(s["path"])
            pfd2 = _walk(root_fd, comps, shown_t)
            try:
                _put_symlink(state, pfd2, nm, s["path"], unescape_path(s["target"]),
                             show(b"/".join((self.target, *comps, nm))), self.wfd,
                             staged=self.staged, overwrite=self.overwrite)
            finally:
                os.close(pfd2)
        for comps in sorted(self.modes, key=lambda c: (-len(c), c)):
            dfd2 = _walk(root_fd, comps, shown_t)
            try:
                os.fchmod(dfd2, self.modes[comps])
            finally:
                os.close(dfd2)
        os.fchmod(root_fd, m["mode"])
        if self.staged:
            state.flush(force=True)
            target_free(pfd, self.name, "dir", shown_t)
            try:
                os.rename(self.h + b".partial", self.name, src_dir_fd=self.sfd, dst_dir_fd=pfd)
            except OSError as e:
                raise DestinationError(f"cannot rename the restored set into {shown_t}: "
                                       f"{e.strerror}") from None
        with contextlib.suppress(OSError):
            os.fsync(pfd)

    def done(self, state: _State) -> None:
        state.flush(done=True)
        with contextlib.suppress(OSError):
            os.rmdir(self.h + b".tmp", dir_fd=self.sfd)  # empty unless a file of the set failed

    def failed(self, e: BaseException) -> None:
        """Stop the workers, keep what was verified; an OSError becomes one line (raised)."""
        self.stop.set()
        if self.state is not None:
            with contextlib.suppress(RestoreError):
                self.state.flush(force=True)
        if isinstance(e, OSError):
            raise DestinationError(f"restoring into {show(self.dest_b)}: {e.strerror or e}") \
                from None

    def close(self) -> None:
        for job in self.jobs:
            if job.src is not None:
                job.src.close()
        if self.lfd is not None:
            os.close(self.lfd)
        for fd in reversed(self.fds):
            os.close(fd)


def restore_resumable(view: StoreView, m: Manifest, dest: Path, *, overwrite: bool = False,
                      workers: int = DEFAULT_WORKERS,
                      progress: ProgressFn | None = None) -> RestoreResult:
    """Restore set `m` at DEST/<set path> with up to `workers` ranged reads in flight, resuming
    whatever an earlier run into the same DEST left, and repairing a target an earlier run
    restored (see the layout comment above). Every path is resolved inside DEST without
    following a symlink, every byte is checked as it arrives and every file is read back and
    checked whole before it takes its place. An existing file at a path of the set that holds
    other content and that restore did not put there is refused (DestinationError) unless
    `overwrite`; entries of an existing target that the set does not name are left alone.

    `view`'s readers (`open`) are kept for the files being fetched: use a view whose readers
    hold no descriptor (cachemgr.format.storeview.ObjectStoreView, ckptfs's).
    `progress(snapshot)` is called in the calling thread a few times a second with a dict:
    bytes_total, bytes_done, bytes_fetched, files_total, files_done. Returns the final
    snapshot with `target` and `seconds`. RestoreError (one line) if anything is wrong;
    KeyboardInterrupt stops the workers at their next piece and keeps what they verified."""
    m = checked(m)
    if workers < 1:
        raise UsageError("workers must be at least 1")
    r = _Resumable(view, m, dest, overwrite, workers, progress)
    try:
        state = r.open()
        if m["kind"] == "symlink":
            r.symlink_set(state)
            return r.result()
        r.plan()
        r.fetch(state)
        if m["kind"] == "dir":
            r.finish_dir(state)
        r.done(state)
        return r.result()
    except BaseException as e:
        r.failed(e)
        raise
    finally:
        r.close()
