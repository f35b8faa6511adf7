"""FileCache: the one owner of the cache files (`data/<ino>`) and of what they hold.

It owns: creating and deleting cache files, the accounting of the bytes they hold
(`cached_bytes`, what --cache-size limits, and the holes files were grown over), the last-use
times eviction orders by, and every write into a cache file made off the event loop (restore's
fills), with the per-file locks that keep those writes from racing the FUSE data path.

A cache file is written by two kinds of code: the FUSE data path on the daemon's trio thread
(write, truncate, a truncating open: synchronous, never interrupted by another task; through the
handle's own fd, cachemgr.core.handles; with --io-threads the pwrite itself runs in a worker thread
while the request waits, cachemgr.core.fs.Filesystem), and restore, which fills files from the store
in worker threads (`trio.to_thread`): restored chunks, a damaged chunk fetched again, a
whole-file download. A worker thread runs while the event loop goes on, so without an owner an
`open(O_TRUNC)` + write + close could land while a thread is about to truncate the file to the
old size and write an old chunk: the trainer would read old bytes and the next upload would
publish them.

The contract (S3QL's block cache does the same with its per-block lock):

  * every fill from the store goes through `fill()`: it takes the file's lock, then checks
    `still_valid()` (the content it fetched is still the file's content and nobody writes it)
    on the event loop, then hands the write to a worker thread and keeps the lock until the
    thread is back;
  * every change of a file's content from the FUSE side that may meet a fill (an open for
    writing or with O_TRUNC, a truncate, a fetch before writing) runs under `exclusive(ino)`:
    it waits for a fill in flight, and the fill after it sees the change in `still_valid()`;
  * eviction and dropping restored chunks (`os.truncate` to 0, on the event loop) skip a file
    whose lock is held (`busy`).

Accounting invariant: `cached_bytes` = sum over linked regular files whose data is cached of
(size - hole) + the chunks restore holds of partly restored files (cachemgr.restore.chunkfetch
counts them per file and tells this module: `chunks_in`, `chunks_out`). Every change of a file's
size or residency goes through a method here (`resized`, `grew`, `dropped`, `refilled`,
`hole_settled`), inside the caller's `InodeTable.tx`, whose rollback restores the accounting
(`savepoint`). Every decrease tells the space listener (`on_space_freed`, subscribed by tiering), so
writers waiting for room under --cache-size look again and no wakeup is lost.

Guards: only trio tasks on the loop thread touch the accounting and `_locks` (one thread); the
per-inode `trio.Lock`s in `_locks` are created on demand and dropped once free. A worker thread
(`write_fill`) only writes the file it was given, and reads nothing here.

Crash states: a fill interrupted by a crash leaves bytes in the cache file that no bitmap
records (`inodes.present` is written after the fill returns): they are fetched again. A cache
file created in a transaction that never committed is a stray file: `CacheFs.recover()` deletes
it, and recomputes the holes from st_blocks.

`fill` looks `write_fill` up at each fill, a module function: the tests' daemons wrap it from
outside (tests/daemon_hooks/sitecustomize.py) to hold a fill in flight, its lock held, while
FUSE operations run: the races above, without sleeps.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from cachemgr.host.nodefiles import open_private

log = logging.getLogger(__name__)

# fallocate(2) modes (linux/falloc.h): those FUSE passes on (fs/fuse/file.c
# fuse_file_fallocate refuses every other with EOPNOTSUPP before asking the daemon).
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10
FALLOC_MODES = FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def fallocate(fd: int, mode: int, off: int, length: int) -> None:
    """fallocate(2) with its mode (os.posix_fallocate has none); OSError on failure."""
    if _libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def write_fill(path: str, writes: list[tuple[int, bytes | memoryview]], size: int | None,
               sync: bool) -> None:
    """A fill's writes, in the worker thread `FileCache.fill` runs them in (the file's lock held
    by the fill): extend the cache file at `path` to `size` if it is shorter, write each
    (offset, data) in full, fsync if `sync`. Touches that file only."""
    fd = os.open(path, os.O_RDWR)
    try:
        if size is not None and os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        for start, data in writes:
            mv, off = memoryview(data), start
            while mv:  # pwrite may write less than asked
                k = os.pwrite(fd, mv, off)
                mv = mv[k:]
                off += k
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class FileCacheStats:
    """`FileCache.statistics()`: cache files and fills (`dataclasses.asdict` for JSON)."""

    fills: int
    fills_skipped: int
    fills_in_flight: int
    lock_waits: int
    waiting: int
    cached_bytes: int
    holes: int


class FileCache:
    """Owner of the cache files, their accounting, and the writes into them from worker
    threads."""

    # A file counts as having a hole only when its blocks cover less than its length by more
    # than this: block rounding and filesystem preallocation stay out of the accounting.
    HOLE_MIN = 1 << 20

    def __init__(self, data_dir: str, cached_bytes: int = 0) -> None:
        self.data_dir = str(data_dir)
        self._locks: dict[int, trio.Lock] = {}
        # Bytes of file data held in cache files (evicted files excluded): what --cache-size
        # limits (see the module docstring).
        self.cached_bytes = cached_bytes
        # Bytes of a cached file's length that are a hole the file was grown over (truncate
        # up), by ino: --cache-size counts the blocks a file holds, not its length, so
        # `truncate -s 100T` costs nothing. Recomputed from st_blocks at recovery and whenever
        # the last writer of a file with a hole closes it.
        self._holes: dict[int, int] = {}
        self._last_used: dict[int, float] = {}
        # told that cached bytes went down (the --cache-size waiters): `on_space_freed`
        self._on_freed: list[Callable[[], None]] = []
        # statistics
        self.fills = 0
        self.fills_skipped = 0    # the content changed before the fill could write
        self.lock_waits = 0       # FUSE operations that waited for a fill in flight
        self.waiting = 0          # ... waiting now

    def on_space_freed(self, listener: Callable[[], None]) -> None:
        """`listener()` runs at every decrease of `cached_bytes` (subscribed by tiering as it
        is built: writers waiting for room look again)."""
        self._on_freed.append(listener)

    def path(self, ino: int) -> str:
        return f"{self.data_dir}/{ino}"

    # -- files ---------------------------------------------------------------------------------

    def sync_data_dir(self) -> None:
        """fsync the data directory: the names of cache files created since are durable. Any
        thread (it touches no state of this object)."""
        dfd = os.open(self.data_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def create(self, ino: int) -> None:
        """An empty, private cache file for `ino` (truncated if it exists)."""
        os.close(open_private(self.path(ino), os.O_WRONLY | os.O_TRUNC))

    def unlink(self, ino: int) -> None:
        try:
            os.unlink(self.path(ino))
        except FileNotFoundError:
            pass

    def remove(self, ino: int) -> None:
        """`ino` is gone for good: its cache file and what is known of it."""
        self.unlink(ino)
        self._last_used.pop(ino, None)

    def used(self, ino: int) -> None:
        """`ino` was opened now (eviction drops the least recently used first)."""
        self._last_used[ino] = time.monotonic()

    def last_used(self, ino: int, default: float) -> float:
        return self._last_used.get(ino, default)

    # -- accounting ----------------------------------------------------------------------------

    def savepoint(self, inos: Iterable[int]) -> Callable[[], None]:
        """An undo for the accounting of `inos` and `cached_bytes` as they are now
        (`InodeTable.tx` runs it when its transaction rolls back)."""
        cached = self.cached_bytes
        holes = [(ino, self._holes.get(ino)) for ino in inos]

        def undo() -> None:
            self.cached_bytes = cached
            for ino, h in holes:
                if h is None:
                    self._holes.pop(ino, None)
                else:
                    self._holes[ino] = h

        return undo

    def hole(self, ino: int) -> int:
        return self._holes.get(ino, 0)

    def has_hole(self, ino: int) -> bool:
        return ino in self._holes

    def holes_total(self) -> int:
        return sum(self._holes.values())

    def note_hole(self, ino: int, st: os.stat_result, size: int | None = None) -> None:
        """Record the hole of cache file `ino` from its stat (the caller adjusts
        cached_bytes)."""
        length = st.st_size if size is None else size
        hole = length - st.st_blocks * 512
        if hole > self.HOLE_MIN:
            self._holes[ino] = hole
        else:
            self._holes.pop(ino, None)

    def _freed(self) -> None:
        for listener in self._on_freed:
            listener()

    def grew(self, delta: int) -> None:
        """Written data changed the files' total by `delta` bytes (a write past the end, a
        passthrough writer's size taken in)."""
        self.cached_bytes += delta
        if delta < 0:
            self._freed()

    def filled(self, ino: int, n: int) -> None:
        """`n` bytes were written below the old end of `ino`, which has a hole: they count now,
        at most the hole's size (they may have overwritten data instead: `hole_settled`
        recounts exactly at the last close), so --cache-size sees a writer filling a sparse
        file as it writes, not only when it closes."""
        hole = self._holes.get(ino, 0)
        take = min(n, hole)
        if take <= 0:
            return
        if hole - take:
            self._holes[ino] = hole - take
        else:
            self._holes.pop(ino, None)
        self.cached_bytes += take

    def resized(self, ino: int, old: int, size: int) -> None:
        """A cached file was truncated from `old` to `size`: growing adds a hole (no block is
        written), shrinking cuts the hole first (it is at the end)."""
        hole = self._holes.get(ino, 0)
        new_hole = hole + size - old if size > old else max(0, min(hole - (old - size), size))
        self.cached_bytes += (size - new_hole) - (old - hole)
        if new_hole:
            self._holes[ino] = new_hole
        else:
            self._holes.pop(ino, None)
        if size < old:
            self._freed()

    def dropped(self, ino: int, size: int) -> int:
        """The cached data of a file of `size` bytes no longer counts (truncated to 0, evicted,
        purged). Returns the bytes freed."""
        freed = size - self._holes.pop(ino, 0)
        self.cached_bytes -= freed
        self._freed()
        return freed

    def evicted(self, ino: int, size: int) -> int:
        """Empty `ino`'s cache file for eviction (its data is in the store). Returns the bytes
        freed."""
        os.truncate(self.path(ino), 0)
        return self.dropped(ino, size)

    def holes_found(self) -> None:
        """Recovery recorded every cached file's hole (`note_hole`): `cached_bytes`, summed
        from the index's sizes at start, stops counting them."""
        self.cached_bytes -= self.holes_total()

    def chunks_in(self, n: int) -> None:
        """`n` bytes of restored chunks of a partly restored file were written: they count
        until the file is whole (then `refilled` counts its size) or dropped
        (cachemgr.restore.chunkfetch keeps how many per file)."""
        self.cached_bytes += n

    def chunks_out(self, n: int, *, freed: bool = True) -> None:
        """`n` bytes of restored chunks no longer count: dropped (`freed`: writers waiting for
        room are told), or the file became whole (its size is counted by `refilled` instead)."""
        self.cached_bytes -= n
        if freed and n:
            self._freed()

    def refilled(self, ino: int, size: int) -> None:
        """An evicted file's cache file holds all its `size` bytes again."""
        self._holes.pop(ino, None)  # restored: every chunk written
        self.cached_bytes += size

    def hole_settled(self, ino: int, size: int) -> None:
        """The last writer of `ino` closed: bytes written into its hole count from now on, so
        the hole is taken from the blocks again (a passthrough writer may also have written
        sparsely: the daemon saw no offsets)."""
        old_hole = self._holes.pop(ino, 0)
        try:
            self.note_hole(ino, os.stat(self.path(ino)), size=size)
        except OSError:
            self._holes[ino] = old_hole
        self.cached_bytes += old_hole - self._holes.get(ino, 0)

    # -- fills from the store ------------------------------------------------------------------

    def busy(self, ino: int) -> bool:
        """A fill of `ino` is in flight (its cache file must not be truncated now)."""
        lock = self._locks.get(ino)
        return lock is not None and lock.locked()

    @asynccontextmanager
    async def exclusive(self, ino: int) -> AsyncIterator[None]:
        """Hold `ino`'s lock: no fill writes its cache file meanwhile."""
        lock = self._locks.setdefault(ino, trio.Lock())
        if lock.locked():
            self.lock_waits += 1
            self.waiting += 1
            try:
                await lock.acquire()
            finally:
                self.waiting -= 1
        else:
            await lock.acquire()
        try:
            yield
        finally:
            lock.release()
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._locks.pop(ino, None)

    async def fill(self, ino: int, writes: Iterable[tuple[int, bytes | memoryview]], *,
                   size: int | None, still_valid: Callable[[], bool],
                   sync: bool = False) -> bool:
        """Write `writes` [(offset, data), ...] into `ino`'s cache file in a worker thread,
        first extending the file to `size` if it is shorter (a restored file keeps its logical
        size while chunks arrive). Nothing is written unless `still_valid()` holds once the
        lock is taken. Returns whether it wrote. OSError (ENOSPC...) propagates."""
        async with self.exclusive(ino):
            if not still_valid():
                self.fills_skipped += 1
                return False
            await trio.to_thread.run_sync(write_fill, self.path(ino), list(writes), size, sync)
            self.fills += 1
            return True

    async def read(self, ino: int, off: int, length: int) -> bytes:
        """Read a range of `ino`'s cache file in a worker thread."""
        path = self.path(ino)

        def read() -> bytes:
            with open(path, "rb") as f:
                return os.pread(f.fileno(), length, off)

        return await trio.to_thread.run_sync(read)

    def statistics(self) -> FileCacheStats:
        return FileCacheStats(fills=self.fills, fills_skipped=self.fills_skipped,
                              fills_in_flight=sum(1 for lk in self._locks.values() if lk.locked()),
                              lock_waits=self.lock_waits, waiting=self.waiting,
                              cached_bytes=self.cached_bytes, holes=len(self._holes))
