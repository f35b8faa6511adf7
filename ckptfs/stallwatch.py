"""Loop-stall watchdog: says so, with where the loop was, when the daemon's trio loop stops
running.

Every FUSE request, every control request (`ckptfs status`, `wait`) and every tiering decision
runs on the one trio thread. A synchronous call that blocks it (a slow syscall on a busy disk,
a lock, a long computation holding the GIL) stalls all of them at once, and from outside it only
looks like a daemon that does not answer. The watchdog makes such a stall a log line that names
the code the loop was in:

  - `beat()`, a trio task, stamps the time every `period` seconds;
  - a daemon thread wakes every `period` seconds and, when the stamp is older than
    `threshold`, logs one warning with the loop thread's stack; when the loop runs again it
    logs how long the stall lasted.

A stall that lasts `dump_after` seconds (10 s) also dumps the stack of every thread into the log
file, from `faulthandler`'s C thread, which needs no GIL: the watchdog thread above cannot log
while another thread holds the GIL (a daemon frozen for 130-140 s in the fault loop, issue 36,
logged only when it ended), and the dump names that thread too. `beat` re-arms the dump at
every stamp, so it fires only when the loop has made no turn for `dump_after` seconds.

State: `_beat` is written by the loop task only and read by the watchdog thread (one float
store: atomic under the GIL); the counters (`stalls`, `longest_s`, `stalled_since`) are written
by the watchdog thread only, under `_lock`, and read through `statistics()` from any thread.
"""

from __future__ import annotations

import faulthandler
import logging
import sys
import threading
import time
import traceback
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD_S = 2.0
# A stall this long dumps every thread's stack into the log (faulthandler, no GIL needed).
DUMP_AFTER_S = 10.0


@dataclass(frozen=True, slots=True)
class LoopStats:
    """`StallWatch.statistics()`: the trio loop (`dataclasses.asdict` for JSON)."""

    stalls: int
    longest_s: float
    stalled_now_s: float


class StallWatch:
    def __init__(self, threshold: float = DEFAULT_THRESHOLD_S, period: float | None = None,
                 clock=time.monotonic, dump_after: float | None = DUMP_AFTER_S) -> None:
        self.threshold = threshold
        self.dump_after = dump_after
        self.period = period if period is not None else threshold / 4
        self._clock = clock
        self._beat = clock()
        self._loop_thread: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # guarded by _lock, written by the watchdog thread
        self.stalls = 0
        self.longest_s = 0.0
        self.stalled_since: float | None = None

    # -- the loop side ------------------------------------------------------------------------

    async def beat(self, task_status=None) -> None:
        """Run on the trio loop: stamp the time every `period` s, until cancelled."""
        import trio

        self._loop_thread = threading.get_ident()
        self._beat = self._clock()
        if task_status is not None:
            task_status.started()
        try:
            while True:
                self._arm_dump()
                await trio.sleep(self.period)
                self._beat = self._clock()
        finally:
            faulthandler.cancel_dump_traceback_later()

    def _arm_dump(self) -> None:
        """(Re-)arm faulthandler's dump of every thread's stack into the log file, due
        `dump_after` s from now; no log file (stderr: /dev/null in a daemon): nothing."""
        if not self.dump_after:
            return
        for h in logging.getLogger().handlers:
            stream = getattr(h, "stream", None)
            if isinstance(h, logging.FileHandler) and stream is not None and \
                    not stream.closed:
                faulthandler.dump_traceback_later(self.dump_after, repeat=False, file=stream)
                return

    # -- the watchdog thread ------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="ckptfs-stallwatch",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            self.check()

    def check(self) -> None:
        """One look at the stamp (the watchdog thread calls it every `period` s)."""
        now = self._clock()
        beat = self._beat
        age = now - beat
        with self._lock:
            since = self.stalled_since
            if age > self.threshold and since is None:
                self.stalled_since = beat
                self.stalls += 1
                where = self._loop_stack()
                log.warning("event loop stalled: no turn for %.1fs (FUSE and control requests "
                            "wait meanwhile); it is in:\n%s", age, where)
            elif since is not None and beat > since:
                # the loop stamped again: the stall ended at most `period` before that stamp
                took = beat - since
                self.longest_s = max(self.longest_s, took)
                self.stalled_since = None
                log.warning("event loop ran again after a stall of %.1fs", took)

    def _loop_stack(self) -> str:
        tid = self._loop_thread
        frame = sys._current_frames().get(tid) if tid is not None else None
        if frame is None:
            return "  (loop thread not found)"
        return "".join(traceback.format_stack(frame, limit=12)).rstrip()

    def statistics(self) -> LoopStats:
        with self._lock:
            now = self._clock()
            current = now - self.stalled_since if self.stalled_since is not None else 0.0
            return LoopStats(stalls=self.stalls, longest_s=round(max(self.longest_s, current), 3),
                             stalled_now_s=round(current, 3))
