"""Small helpers shared by the benchmark scripts (bench_fio.py, bench_restore.py): /proc
readings and mount checks. No ckptfs import, so the scripts also run against a foreign tree."""

from __future__ import annotations

import os
from pathlib import Path


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
