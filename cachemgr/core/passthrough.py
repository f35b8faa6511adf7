"""Backings: the owner of FUSE passthrough backing files (Linux 6.9+, docs/ARCHITECTURE.md
"Data path").

When a file's data is whole in the cache, its open reply can name the cache file as the backing
file: the kernel then does reads, writes and mmap on it directly and the daemon sees none of
them. The kernel's rules (fs/fuse/iomode.c, passthrough.c) shape this class:

  * one backing file per inode at a time: every passthrough open of an inode names the same
    backing id, registered at its first passthrough open and dropped at its last release;
  * while an inode has a passthrough open, every other open of it must be passthrough too (the
    kernel answers EIO otherwise); an inode open in page-cache mode cannot be opened in
    passthrough (ETXTBSY, EIO to the caller). `CacheFs` keeps both: a file goes passthrough
    only when nobody has it open, and stays so while anyone does;
  * registering needs CAP_SYS_ADMIN, a kernel that granted FUSE_CAP_PASSTHROUGH at init, and a
    backing filesystem no deeper in a stack than the mount allows.

What the kernel writes the daemon learns from the backing file: `refresh()` reads its size and
mtime (fstat) at getattr, lookup, setattr, flush, fsync and release of a file with a passthrough
writer, and the content version was bumped at the write-open, as for any writer.

Guards: only the event-loop thread calls into this class (FUSE handlers and core, one thread);
`_by_ino` maps ino -> Backing, created by the first `acquire` of an inode and removed by its
last `release`; `_readers` maps an opener's pid -> its read-only passthrough handles, the same
way (the upload scheduler's "the trainer is reading", `read_since_probe`). Crash states:
none. Backing ids and fds die with the daemon's /dev/fuse fd.

`register`/`unregister` are the binding's calls (pyfuse3.passthrough_open/close), injected by
the FUSE adapter so that nothing here imports pyfuse3; tests pass fakes.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Data-path modes, as `ckptfs status` shows them.
PASSTHROUGH = "passthrough"
USER_SPACE = "fuse"

# A process that opened a file in passthrough for reading counts as "the trainer is reading"
# (`busy_since_probe`) while its read counter (/proc/PID/io rchar) grows, for this long after
# its latest open: a restore, or a read right after the write, gets the memory bandwidth and
# CPU before the uploads; a process that keeps a file open while it reads elsewhere (a data
# loader) stops holding uploads back after this.
READ_HOLD_S = 60.0


def read_counter(pid: int) -> int | None:
    """`rchar` of /proc/PID/io (bytes the process read by any syscall; the whole thread group
    for a thread id), or None if it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            data = f.read()
    except OSError:
        return None
    for line in data.splitlines():
        if line.startswith(b"rchar:"):
            return int(line[6:])
    return None


@dataclass(slots=True)
class Backing:
    backing_id: int
    fd: int               # the daemon's fd on the cache file (what fstat reads)
    handles: int = 0      # passthrough handles open on the inode
    writers: int = 0      # ... of them with write access
    seen_mtime_ns: int = 0  # the backing file's mtime the daemon last took in
    seen_size: int = 0
    probed: tuple[int, int] = (0, 0)  # (size, mtime) at the last `wrote_since_probe`


@dataclass(slots=True)
class _Reader:
    """A process with passthrough read-only handles open (key: the opener's pid)."""
    handles: int
    since: float          # monotonic time of its latest open
    rchar: int = -1       # its read counter at the last probe (-1: not read yet)


@dataclass(frozen=True, slots=True)
class BackingStats:
    """`Backings.statistics()`: the data path (`dataclasses.asdict` for JSON)."""

    mode: str
    off_reason: str | None
    open_backings: int
    passthrough_opens: int
    passthrough_reader_processes: int
    user_space_opens_of_whole_files: int
    attr_refreshes: int


class Backings:
    """Backing files registered with the kernel, by inode; and the data-path mode."""

    def __init__(self, register: Callable[[int], int] | None = None,
                 unregister: Callable[[int], None] | None = None, *,
                 off_reason: str | None = None) -> None:
        self._register = register
        self._unregister = unregister
        self._by_ino: dict[int, Backing] = {}
        self._readers: dict[int, _Reader] = {}  # opener pid -> its read-only handles
        self.clock: Callable[[], float] = time.monotonic  # tests move it
        self.read_counter: Callable[[int], int | None] = read_counter
        # None: on. Otherwise why the daemon serves every byte itself (said once in the log).
        self.off_reason: str | None = off_reason if register is not None else (
            off_reason or "no passthrough binding")
        # statistics
        self.opens = 0             # passthrough opens answered
        self.fallbacks = 0         # opens of whole files served by the daemon (see CacheFs)
        self.refreshes = 0         # times the daemon took in a size/mtime the kernel wrote

    @property
    def on(self) -> bool:
        return self.off_reason is None

    @property
    def mode(self) -> str:
        return PASSTHROUGH if self.on else USER_SPACE

    def turn_off(self, reason: str) -> None:
        """From now on every open is served by the daemon (files open in passthrough stay
        so until closed). Logged once."""
        if self.off_reason is None:
            self.off_reason = reason
            log.warning("data path: FUSE passthrough off (%s); the daemon serves file data",
                        reason)

    def active(self, ino: int) -> bool:
        """`ino` has passthrough handles open: every new open of it must be passthrough."""
        return ino in self._by_ino

    def writing(self, ino: int) -> bool:
        b = self._by_ino.get(ino)
        return b is not None and b.writers > 0

    def acquire(self, ino: int, path: str, writable: bool, pid: int = 0) -> int:
        """A passthrough open of `ino` (cache file `path`) by process `pid` (0: unknown): its
        backing id (registering it at the inode's first). OSError if the kernel refuses; the
        caller then serves the open itself."""
        b = self._by_ino.get(ino)
        if b is None:
            assert self._register is not None
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                backing_id = self._register(fd)
                if backing_id <= 0:
                    raise OSError(errno.EIO, f"backing id {backing_id}")
            except BaseException:
                os.close(fd)
                raise
            st = os.fstat(fd)
            b = self._by_ino[ino] = Backing(backing_id, fd, seen_mtime_ns=st.st_mtime_ns,
                                            seen_size=st.st_size)
        b.handles += 1
        if writable:
            b.writers += 1
        elif pid > 0:
            r = self._readers.get(pid)
            if r is None:
                self._readers[pid] = _Reader(1, self.clock())
            else:
                r.handles += 1
                r.since = self.clock()
        self.opens += 1
        return b.backing_id

    def release(self, ino: int, writable: bool, pid: int = 0) -> None:
        """A passthrough handle of `ino` is gone (`pid` as given to `acquire`); the last one
        drops the backing id."""
        if not writable and pid > 0:
            r = self._readers.get(pid)
            if r is not None:
                r.handles -= 1
                if r.handles <= 0:
                    del self._readers[pid]
        b = self._by_ino.get(ino)
        if b is None:
            return
        b.handles -= 1
        if writable:
            b.writers -= 1
        if b.handles > 0:
            return
        del self._by_ino[ino]
        try:
            if self._unregister is not None:
                self._unregister(b.backing_id)
        except OSError as e:  # the kernel dropped it already (unmount): nothing leaks
            log.debug("passthrough_close(%d) for inode %d: %s", b.backing_id, ino, e)
        finally:
            os.close(b.fd)

    def refresh(self, ino: int) -> os.stat_result | None:
        """The backing file's stat if the kernel changed it since the daemon last looked (size
        or mtime), else None. Only for inodes with a passthrough writer."""
        b = self._by_ino.get(ino)
        if b is None or b.writers == 0:
            return None
        st = os.fstat(b.fd)
        if st.st_mtime_ns == b.seen_mtime_ns and st.st_size == b.seen_size:
            return None
        b.seen_mtime_ns = st.st_mtime_ns
        b.seen_size = st.st_size
        self.refreshes += 1
        return st

    def wrote_since_probe(self) -> bool:
        """Has any passthrough writer written since the last call? (The upload scheduler's
        "the trainer is writing" signal, cachemgr.host.foreground: the daemon
        sees no write requests of these files.)"""
        wrote = False
        for b in self._by_ino.values():
            if b.writers:
                st = os.fstat(b.fd)
                now = (st.st_size, st.st_mtime_ns)
                if now != b.probed:
                    b.probed = now
                    wrote = True
        return wrote

    def read_since_probe(self) -> bool:
        """Has a process with a passthrough read handle (opened in the last READ_HOLD_S) read
        since the last call? The daemon sees no read requests of these files either; the
        process's read counter stands in for them. Its first probe only takes the baseline."""
        now = self.clock()
        read = False
        for pid, r in self._readers.items():
            if now - r.since > READ_HOLD_S:
                continue
            c = self.read_counter(pid)
            if c is None:
                continue
            if r.rchar >= 0 and c != r.rchar:
                read = True
            r.rchar = c
        return read

    def busy_since_probe(self) -> bool:
        """The upload scheduler's foreground probe: a passthrough writer wrote, or a passthrough
        reader read, since the last call (both are asked, so both baselines move)."""
        wrote = self.wrote_since_probe()
        return self.read_since_probe() or wrote

    def close_all(self) -> None:
        self._readers.clear()
        for ino in list(self._by_ino):
            b = self._by_ino.pop(ino)
            os.close(b.fd)

    def statistics(self) -> BackingStats:
        return BackingStats(mode=self.mode, off_reason=self.off_reason,
                            open_backings=len(self._by_ino), passthrough_opens=self.opens,
                            passthrough_reader_processes=len(self._readers),
                            user_space_opens_of_whole_files=self.fallbacks,
                            attr_refreshes=self.refreshes)
