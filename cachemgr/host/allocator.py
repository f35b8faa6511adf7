"""The daemon's memory allocator, tuned for its big short-lived buffers (glibc `mallopt`).

A restore receives each ranged GET (64 MiB by default: `--prefetch-range`) into a fresh buffer
in a worker thread, checks its chunks and writes them into the cache (cachemgr.restore,
cachemgr.transfer.download). With glibc's defaults every such buffer is a fresh `mmap`: its
pages are faulted in and zeroed by the kernel as the bytes arrive and unmapped when it is
freed, which on this VM cost as much as receiving the bytes (docs/PERFORMANCE.md "Where the CPU
goes": 1.38 CPU-s/GiB into a fresh 64 MiB buffer per range against 0.84 into a reused one).

`tune()` makes glibc keep such buffers in its heap and reuse their pages:
  - every thread allocates from the main arena (`M_ARENA_MAX` 1): a thread's own arena is made
    of 64 MiB heaps, which cannot hold a 64 MiB buffer, so it would be mapped anyway;
  - a buffer is mapped on its own only from `MMAP_THRESHOLD` (256 MiB) up;
  - free memory at the top of the heap goes back to the kernel past `TRIM_THRESHOLD` (256 MiB).
The cost: up to about the restore's buffers in flight (8 x 64 MiB by default) stays in the
daemon after a restore instead of going back at once. Measured (scripts/bench_store_path.py,
the `ckptfs` restore on moto, 2 interleaved A/B rounds of 4 x 256 MiB): 1.18-1.29 CPU-s/GiB
without, 0.81-0.86 with.

Called once, at the daemon's start, before it starts any thread (an arena is chosen when a
thread first allocates). `CKPTFS_MALLOC_DEFAULTS=1` leaves glibc's defaults (for comparing).
Not glibc (musl), or mallopt refused: nothing changes, said once at debug level.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 256 << 20


def tune() -> bool:
    """Apply the settings above; True if glibc took all three."""
    if os.environ.get("CKPTFS_MALLOC_DEFAULTS") == "1":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as e:
        log.debug("allocator left as it is (no mallopt): %s", e)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    took = [mallopt(_M_ARENA_MAX, 1), mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)]
    if not all(took):
        log.debug("allocator: mallopt took %s of (arena_max, mmap_threshold, trim_threshold)",
                  took)
    return all(took)
