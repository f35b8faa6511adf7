"""FileCache: the one owner of cache-file data that is written off the event loop.

A cache file (`data/<ino>`) is written by two kinds of code: the FUSE data path on the daemon's
trio thread (write, truncate, a truncating open: synchronous, never interrupted by another task),
and restore, which fills files from the store in worker threads (`trio.to_thread`): restored
chunks, a damaged chunk fetched again, a whole-file download. A worker thread runs while the
event loop goes on, so without an owner an `open(O_TRUNC)` + write + close could land while a
thread is about to truncate the file to the old size and write an old chunk: the trainer would
read old bytes and the next upload would publish them.

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

Guards: the per-inode `trio.Lock`s in `_locks`, created on demand and dropped once free; only
trio tasks touch `_locks` (one thread). The worker thread only writes the file it was given.

Crash states: a fill interrupted by a crash leaves bytes in the cache file that no bitmap
records (`inodes.present` is written after the fill returns): they are fetched again.

Testing aid: with CKPTFS_TEST_HOLD_FILL=<gate path> in the daemon's environment, a fill's worker
thread waits while the gate file exists (after creating `<gate>.held`), so a test can run FUSE
operations while a fill is in flight and then release it: the races above, without sleeps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from contextlib import asynccontextmanager

import trio

log = logging.getLogger(__name__)

_HOLD_ENV = "CKPTFS_TEST_HOLD_FILL"


class FileCache:
    """Owner of the locks on cache files and of the writes into them from worker threads."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = str(data_dir)
        self._locks: dict[int, trio.Lock] = {}
        self._hold = os.environ.get(_HOLD_ENV) or None
        # statistics
        self.fills = 0
        self.fills_skipped = 0    # the content changed before the fill could write
        self.lock_waits = 0       # FUSE operations that waited for a fill in flight
        self.waiting = 0          # ... waiting now

    def path(self, ino: int) -> str:
        return f"{self.data_dir}/{ino}"

    def busy(self, ino: int) -> bool:
        """A fill of `ino` is in flight (its cache file must not be truncated now)."""
        lock = self._locks.get(ino)
        return lock is not None and lock.locked()

    @asynccontextmanager
    async def exclusive(self, ino: int):
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
            path = self.path(ino)
            hold = self._hold
            items = list(writes)

            def write() -> None:
                if hold is not None:
                    _wait_gate(hold)
                fd = os.open(path, os.O_RDWR)
                try:
                    if size is not None and os.fstat(fd).st_size < size:
                        os.ftruncate(fd, size)
                    for off, data in items:
                        mv = memoryview(data)
                        while mv:  # pwrite may write less than asked
                            k = os.pwrite(fd, mv, off)
                            mv = mv[k:]
                            off += k
                    if sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)

            await trio.to_thread.run_sync(write)
            self.fills += 1
            return True

    async def read(self, ino: int, off: int, length: int) -> bytes:
        """Read a range of `ino`'s cache file in a worker thread."""
        path = self.path(ino)

        def read() -> bytes:
            with open(path, "rb") as f:
                return os.pread(f.fileno(), length, off)

        return await trio.to_thread.run_sync(read)

    def statistics(self) -> dict:
        return {"fills": self.fills, "fills_skipped": self.fills_skipped,
                "fills_in_flight": sum(1 for lk in self._locks.values() if lk.locked()),
                "lock_waits": self.lock_waits, "waiting": self.waiting}


def _wait_gate(gate: str) -> None:
    """Testing aid (see the module docstring); runs in the worker thread."""
    if not os.path.exists(gate):
        return
    try:
        with open(gate + ".held", "w"):
            pass
    except OSError:
        pass
    while os.path.exists(gate):
        time.sleep(0.01)
