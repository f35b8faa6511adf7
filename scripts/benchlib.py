"""Small helpers shared by the benchmark scripts (bench_fio.py, bench_restore.py,
bench_perf.py): sizes, /proc readings, mount checks, finding the ckptfs CLI. No ckptfs import,
so the scripts also run against a foreign tree."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parent.parent


class BenchError(Exception):
    pass


def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", s.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (examples: 512M, 4g, 1073741824)")
    mult = {"": 1, "k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}[m.group(2)]
    return int(float(m.group(1)) * mult)


def run_text(args: list[str], timeout: float = 60) -> str:
    """A command's output (for the machine description), or why it is unavailable."""
    try:
        res = subprocess.run(args, check=False, capture_output=True, text=True, timeout=timeout)
        return (res.stdout or res.stderr).strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({e.__class__.__name__})"


def _stat_cpu_s(stat_path: str) -> float | None:
    """utime + stime of a /proc/.../stat file, in seconds (None: the process is gone)."""
    try:
        stat = Path(stat_path).read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process (all threads), in seconds."""
    return None if pid is None else _stat_cpu_s(f"/proc/{pid}/stat")


def main_thread_cpu_s(pid: int | None) -> float | None:
    """utime + stime of a daemon's main thread (tid = pid), in seconds: the trio thread that
    answers FUSE requests (inline with the default --io-threads 0). Reads of cache files for
    uploads and the store's HTTP calls run in worker threads (trio.to_thread), so the rest of
    the daemon's CPU (process total - this) is mostly upload/restore work."""
    return None if pid is None else _stat_cpu_s(f"/proc/{pid}/task/{pid}/stat")


def mmm(values: Iterable[float | None]) -> list[float] | None:
    """[median, min, max] of the values that are not None (None if there is none)."""
    xs = [x for x in values if x is not None]
    if not xs:
        return None
    return [statistics.median(xs), min(xs), max(xs)]


def find_ckptfs(explicit: str | None) -> str:
    candidates = [explicit] if explicit else [
        str(Path(sys.executable).parent / "ckptfs"),
        str(REPO / ".venv" / "bin" / "ckptfs"),
        shutil.which("ckptfs"),
    ]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise BenchError("ckptfs CLI not found: pass --ckptfs PATH (e.g. .venv/bin/ckptfs)")


def log(msg: str) -> None:
    print(msg, flush=True)


def read_file(path: str | Path, default: str = "") -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


def is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4].replace("\\040", " ") == target for line in f)


def proc_status_kb(pid: int, key: str) -> int | None:
    """A `kB` field of /proc/<pid>/status (e.g. VmHWM), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child is not running any more
    return "State:\tZ" not in read_file(f"/proc/{pid}/status")


def loadavg() -> list[float]:
    """The 1/5/15-minute load averages (os.getloadavg), rounded; recorded around every
    measurement because other jobs on this machine disturb timings."""
    return [round(x, 2) for x in os.getloadavg()]


def proc_rss_kb(pid: int) -> int | None:
    return proc_status_kb(pid, "VmRSS")


class RssSampler:
    """Samples VmRSS of a set of pids in a background thread (every `interval` s) and keeps
    the peak per pid; `peak_mib(pid)` also folds in the kernel's own VmHWM when readable."""

    def __init__(self, interval: float = 0.1) -> None:
        import threading

        self.interval = interval
        self.pids: dict[int, int] = {}  # pid -> peak kB seen
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")
        self._thread.start()

    def watch(self, pid: int) -> None:
        with self._lock:
            self.pids.setdefault(pid, 0)

    def _sample(self) -> None:
        with self._lock:
            pids = list(self.pids)
        for pid in pids:
            kb = proc_rss_kb(pid)
            if kb is not None:
                with self._lock:
                    self.pids[pid] = max(self.pids[pid], kb)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def peak_mib(self, pid: int) -> float | None:
        self._sample()
        hwm = proc_status_kb(pid, "VmHWM") or 0
        with self._lock:
            kb = max(self.pids.get(pid, 0), hwm)
        return round(kb / 1024, 1) if kb else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
