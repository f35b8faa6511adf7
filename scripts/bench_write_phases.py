"""Time the phases of one checkpoint-like file write in DIR: open(O_CREAT), N writes of 1 MiB,
fsync, close; prints milliseconds per phase. Run it on a raw directory and on a ckptfs mount in
turn to see which phase differs (docs/bench/overhead.md):

    python scripts/bench_write_phases.py DIR N
"""

import os
import sys
import time


def main() -> int:
    d, n, bs = sys.argv[1], int(sys.argv[2]), 1 << 20
    buf = os.urandom(bs)
    p = os.path.join(d, f"f{time.time_ns()}")
    t0 = time.perf_counter()
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    t1 = time.perf_counter()
    for _ in range(n):
        os.write(fd, buf)
    t2 = time.perf_counter()
    os.fsync(fd)
    t3 = time.perf_counter()
    os.close(fd)
    t4 = time.perf_counter()
    print(f"open {1e3 * (t1 - t0):.2f} write {1e3 * (t2 - t1):.1f} fsync {1e3 * (t3 - t2):.1f} "
          f"close {1e3 * (t4 - t3):.2f} ms")
    os.unlink(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
