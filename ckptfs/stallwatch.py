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
logged only when it ended), and the dump names that thread too. The watchdog thread re-arms
the dump after every new stamp (`_rearm`), so it fires only when the loop has made no turn for
`dump_after` seconds; not the loop, whose re-arm waited for faulthandler's previous C thread to
end (a 1.3 s stall of its own on a loaded machine).

Both are set by the environment of the daemon (`CKPTFS_STALL_S`, the threshold, default 2 s;
`CKPTFS_STALL_DUMP_S`, default 10 s): the test suite and the fault loop run their daemons at
1 s and 1 s, and a stall over 1 s there is a failure (issue 36).

Why the loop made no turn: the end-of-stall line says what the loop thread did meanwhile, from
the kernel's per-thread scheduler counters (`/proc/self/task/<tid>/schedstat`: time on a CPU,
time runnable on a run queue), sampled at every check:
  - `starved`: without the time it spent runnable on a run queue, waiting for a CPU, it would
    have turned within the threshold (a machine more loaded than it has cores: nothing in this
    process could have made it turn sooner);
  - `memory`: otherwise, where that wait and the time the machine's tasks were stalled on
    memory (`/proc/pressure/memory`, PSI 'some': reclaim, refaults of evicted code pages)
    explain all but the threshold of it (a machine out of memory: the 39 s freeze of both
    fault-loop daemons at once, issue 36, ended when the kernel's OOM killer killed another
    job's 16 GiB process); or, where the process had major page faults in the window (its
    code pages, evicted under that pressure, read back from disk while a thread held the
    GIL: the 3-4 s stalls of the 300-iteration run, the loop thread asleep at the GIL in
    trio's `run`), that wait and the machine's tasks' wait on memory or I/O (PSI) explain
    all but the threshold. The line gives the process's own RSS and major faults, so that a
    daemon that is itself the cause shows it (a file:// store's threads mmap store files,
    LocalStore: their faults count too);
  - `busy`: otherwise, where it ran on a CPU for most of the rest (code on the loop that
    computes too long, or a C call that holds it);
  - `blocked`: otherwise, it slept (a blocking syscall on the loop, a lock, or the GIL held by
    another thread: the dump of every thread says which).

State: `_beat` is written by the loop task only and read by the watchdog thread (one float
store: atomic under the GIL); the counters (`stalls`, `longest_s`, `stalled_since`) are written
by the watchdog thread only, under `_lock`, and read through `statistics()` from any thread.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypedDict

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD_S = 2.0
# A stall this long dumps every thread's stack into the log (faulthandler, no GIL needed).
DUMP_AFTER_S = 10.0


def from_env(environ: Mapping[str, str] = os.environ) -> tuple[float, float]:
    """(threshold, dump_after) from CKPTFS_STALL_S and CKPTFS_STALL_DUMP_S (seconds, > 0)."""
    def get(name: str, default: float) -> float:
        raw = environ.get(name, "")
        try:
            v = float(raw) if raw else default
        except ValueError:
            v = 0.0
        if not v > 0:
            log.warning("%s=%r is not a number of seconds > 0: %s s", name, raw, default)
            return default
        return v
    return get("CKPTFS_STALL_S", DEFAULT_THRESHOLD_S), get("CKPTFS_STALL_DUMP_S", DUMP_AFTER_S)


def _sched(native_id: int | None) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable without one) of a thread of this process, or None
    where the kernel does not count them."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return None


# the causes outside the process: the machine gave the loop no CPU, or had no memory
MACHINE_CAUSES = frozenset({"starved", "memory"})


def cause(window_s: float, on_cpu_s: float, waiting_s: float, threshold: float,
          memory_s: float | None = None, io_s: float | None = None, majflt: int = 0) -> str:
    """What a stall was, from what the loop thread did over a window of `window_s` around it
    (module docstring): `starved` only where the loop would have turned within `threshold`
    had it been given a CPU whenever it was runnable (the window less the run-queue wait;
    the window's slack, normal turns around the stall, counts against this claim); `memory`
    where that wait and the time the machine's tasks were stalled on memory (`memory_s`, PSI
    'some') together explain all but `threshold` of it, or, where the process itself had
    major page faults in the window (`majflt`: pages evicted under memory pressure read back
    from disk, the GIL held meanwhile), the time the machine's tasks waited on memory or on
    I/O for them (`io_s`, PSI 'some') does; else `busy` where it ran on a CPU for most of the
    rest, `blocked` where it slept."""
    rest = window_s - waiting_s
    if rest <= threshold:
        return "starved"
    if memory_s is not None and rest - memory_s <= threshold:
        return "memory"
    if majflt and memory_s is not None and io_s is not None and \
            rest - max(memory_s, io_s) <= threshold:
        return "memory"
    return "busy" if on_cpu_s >= rest / 2 else "blocked"


def _psi_some(what: str) -> float | None:
    """The machine's PSI 'some' total of `what` (memory, io), seconds; None without PSI."""
    try:
        with open(f"/proc/pressure/{what}", "rb") as f:
            some = f.readline()
        return int(some.rsplit(b"total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True, slots=True)
class _Sample:
    """The counters the watchdog thread reads at each check (see `cause`)."""

    t: float
    sched: tuple[float, float] | None  # the loop thread's (on a CPU, runnable) seconds
    cpu: float                         # the process's CPU seconds
    majflt: int                        # the process's major page faults
    rss_mib: int
    mem: float | None                  # the machine's PSI memory 'some' total, seconds
    io: float | None                   # the machine's PSI io 'some' total, seconds

    @staticmethod
    def take(now: float, native_id: int | None) -> _Sample:
        majflt, rss = 0, 0
        try:
            with open("/proc/self/stat", "rb") as f:
                stat = f.read()
            majflt = int(stat[stat.rindex(b")") + 2:].split()[9])
            with open("/proc/self/statm", "rb") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
        except (OSError, ValueError, IndexError):
            pass
        return _Sample(now, _sched(native_id), time.process_time(), majflt, rss,
                       _psi_some("memory"), _psi_some("io"))


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
        self._loop_native: int | None = None
        # the loop thread's scheduler counters and the process's CPU time at the last check
        # that saw no stall (watchdog thread only): the start of a stall's accounting
        self._sample: _Sample | None = None
        # True while `beat` runs (written by the loop, read by the watchdog thread: a bool)
        self._beating = False
        # the stamp after which the dump was last armed (watchdog thread only): the dump is
        # re-armed by the watchdog thread when it sees a newer stamp, never by the loop
        self._armed_for: float | None = None
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
        self._loop_native = threading.get_native_id()
        self._beat = self._clock()
        log.info("stall watchdog: loop thread 0x%x, a stall is %.1fs without a turn, every "
                 "thread's stack dumped after %ss", self._loop_thread, self.threshold,
                 self.dump_after)
        self._beating = True
        if task_status is not None:
            task_status.started()
        try:
            while True:
                await trio.sleep(self.period)
                self._beat = self._clock()
        finally:
            self._beating = False

    def _rearm(self) -> None:
        """The watchdog thread, every `period` s: while the loop stamps, re-arm the dump after
        each new stamp, so it fires `dump_after` s (plus at most `period`) after the loop's last
        turn. Here, not on the loop: re-arming cancels the previous timer, which waits for
        faulthandler's C thread to end; on the loop that wait was itself a stall (1.3 s once,
        the loop thread asleep in `dump_traceback_later`, a test run on a loaded machine). A
        thread holding the GIL stops this thread too: then nothing re-arms, and the C thread
        dumps with no GIL, as before."""
        if not self._beating:
            if self._armed_for is not None:
                faulthandler.cancel_dump_traceback_later()
                self._armed_for = None
            return
        beat = self._beat
        if beat != self._armed_for:
            self._arm_dump()
            self._armed_for = beat

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
            self._rearm()
        if self._armed_for is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_for = None

    def check(self) -> None:
        """One look at the stamp (the watchdog thread calls it every `period` s)."""
        now = self._clock()
        beat = self._beat
        age = now - beat
        sample = _Sample.take(now, self._loop_native)
        with self._lock:
            since = self.stalled_since
            if since is None and age <= self.threshold:
                self._sample = sample
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
                log.warning("event loop ran again after a stall of %.1fs%s", took,
                            self._accounting(sample))
                self._sample = sample

    def _accounting(self, now: _Sample) -> str:
        """What the loop thread, the process and the machine did from the last check before
        the stall to now (a window a little longer than the stall): `cause`, and its
        figures."""
        was = self._sample
        if was is None or was.sched is None or now.sched is None:
            return ""
        window = now.t - was.t
        on, waiting = now.sched[0] - was.sched[0], now.sched[1] - was.sched[1]
        mem = None if now.mem is None or was.mem is None else now.mem - was.mem
        io = None if now.io is None or was.io is None else now.io - was.io
        majflt = now.majflt - was.majflt
        what = cause(window, on, waiting, self.threshold, mem, io, majflt)
        return (f" (cause {what}: over the {window:.1f}s since the last turn seen, the loop "
                f"thread ran {on:.2f}s on a CPU and waited {waiting:.2f}s runnable for one; "
                f"the process used {now.cpu - was.cpu:.2f}s of CPU, had "
                f"{majflt} major page faults, RSS {now.rss_mib} MiB; the machine's tasks "
                f"waited on memory {'?' if mem is None else f'{mem:.2f}'}s, on I/O "
                f"{'?' if io is None else f'{io:.2f}'}s)")

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


# -- reading a daemon's log (the fault loop's checks, the test suite's mount fixture) ----------


class Stall(TypedDict):
    """A loop stall a daemon logged: its length, its cause (busy, starved, blocked, or '?'
    where the kernel gave no counters), the accounting of its end line, and the loop thread's
    stack from each faulthandler dump taken during it ('most recent call first')."""

    s: float
    cause: str
    line: str
    loop_stacks: list[str]


_STALL_END = re.compile(r"ran again after a stall of ([0-9.]+)s(?: \(cause (\w+))?")
_LOOP_THREAD = re.compile(r"stall watchdog: loop thread (0x[0-9a-f]+)")
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d")


def parse_log(text: str) -> tuple[list[Stall], list[str]]:
    """Every ended stall of a daemon's log, in order, each with the dumps taken before its
    end; and the loop thread's stack of each dump after the last end (a stall not ended yet,
    or never: the daemon was killed during it)."""
    lines = text.splitlines()
    loop_tid: int | None = None
    stalls: list[Stall] = []
    pending: list[str] = []
    i = 0
    while i < len(lines):
        ln = lines[i]
        m = _LOOP_THREAD.search(ln)
        if m:
            loop_tid = int(m.group(1), 16)
        if ln.startswith("Timeout (") and ln.rstrip().endswith("!"):
            j = i + 1   # the dump runs until the next log line or the next dump
            while j < len(lines) and not _LOG_LINE.match(lines[j]) and \
                    not lines[j].startswith("Timeout ("):
                j += 1
            pending.append(_loop_thread_stack(lines[i + 1:j], loop_tid))
            i = j
            continue
        m = _STALL_END.search(ln)
        if m:
            stalls.append(Stall(s=float(m.group(1)), cause=m.group(2) or "?",
                                line=ln[ln.index("ran again"):], loop_stacks=pending))
            pending = []
        i += 1
    return stalls, pending


def _loop_thread_stack(dump: list[str], loop_tid: int | None) -> str:
    """The loop thread's block of a faulthandler dump (the whole dump where the loop thread is
    not known)."""
    blocks: list[list[str]] = []
    for ln in dump:
        if ln.startswith(("Thread 0x", "Current thread 0x")):
            blocks.append([ln])
        elif blocks and ln.strip():
            blocks[-1].append(ln)
    for b in blocks:
        m = re.search(r"[Tt]hread (0x[0-9a-f]+)", b[0])
        if m and loop_tid is not None and int(m.group(1), 16) == loop_tid:
            return "\n".join(b)
    return "\n".join(ln for ln in dump if ln.strip())
