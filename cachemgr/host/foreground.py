"""The trainer first: the one signal by which background byte work (uploads) gives way to it.

The FUSE read and write paths note the time of every read and write they serve (`note`, one
monotonic() call), and an upload reads its next part only once the trainer has not written or
read for `QUIET_S`, or after waiting `MAX_DEFER_S` for that part (`yield_to`), so a trainer that
never pauses still lets every upload advance. The longest wait is per byte, not per piece: a
piece of `nbytes` waits at most MAX_DEFER_S * nbytes / DEFER_BYTES (a 64 MiB part the whole 2 s,
a 64 KiB file 2 ms), so under a trainer that never pauses each upload worker still moves at
least DEFER_BYTES per MAX_DEFER_S (32 MiB/s), whatever the size of its files. A flat 2 s a
piece held a DCP save of 8,192 shards of 64 KiB to 4 workers x 1 file per 2-4 s while the
shards were written: every upload waited for the commit, and the set became durable a whole
upload pass after it (issue 35). Measured (docs/PERFORMANCE.md): on a small machine
the upload's preads, CRCs and store sends otherwise take about half the daemon's CPU while the
trainer is still writing, and the trainer waits for it; a read right after the write lost
10-20% to the upload's copy beside it (docs/bench/overhead.md).

I/O the daemon never sees (FUSE passthrough: the kernel reads and writes the cache file) is
found by the `probe` given at construction (the daemon gives
`cachemgr.core.passthrough.Backings.busy_since_probe`: an fstat per file open for writing and a
/proc/PID/io read per process reading in passthrough): True means "written or read since last
asked".

One `Foreground` per mount, built by the composition root (ckptfs.daemon) and handed to who
notes (cachemgr.core.fs.Filesystem) and who gives way (cachemgr.transfer.upload.Uploader). Its
fields are read and written on the trio loop thread only; a worker thread waits through
`trio.from_thread.run(foreground.yield_to)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

QUIET_S = 0.1       # the trainer counts as busy this long after its last read or write
MAX_DEFER_S = 2.0   # the longest one wait gives way (for a piece of DEFER_BYTES or more)
DEFER_BYTES = 64 << 20  # the default part size (cachemgr.transfer.upload): one part, 2 s


class Foreground:
    """When the trainer last read or wrote (see the module docstring). Guarded by: the loop."""

    def __init__(self, probe: Callable[[], bool] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.last = 0.0      # `clock` time of the trainer's last read or write
        self._probe = probe  # I/O the daemon does not see (passthrough); None: there is none
        self._clock = clock  # tests give trio.current_time under a MockClock

    def note(self) -> None:
        """The trainer read or wrote just now."""
        self.last = self._clock()

    async def yield_to(self, nbytes: int | None = None) -> None:
        """Return once the trainer has been quiet for QUIET_S, or after MAX_DEFER_S scaled to
        the `nbytes` the caller will move next (None: a whole MAX_DEFER_S)."""
        longest = MAX_DEFER_S if nbytes is None else MAX_DEFER_S * min(1.0, nbytes / DEFER_BYTES)
        start = self._clock()
        while True:
            if self._probe is not None and self._probe():
                self.note()
            now = self._clock()
            idle = now - self.last
            waited = now - start
            if idle >= QUIET_S or waited >= longest:
                return
            await trio.sleep(min(QUIET_S - idle, longest - waited))
