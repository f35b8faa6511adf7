#!/usr/bin/env python3
"""CPU seconds per GiB of one upload to a file:// store, in-process (no FUSE, no daemon): the
uploader's own cost, the part of "daemon CPU with upload" that is not the request path.

    python scripts/bench_upload_cpu.py                     # 1 GiB in /dev/shm, 3 rounds
    python scripts/bench_upload_cpu.py --size 512M --dir /var/tmp --rounds 5

Each round uploads the same random file (incompressible: `auto` compression samples it and
stores it raw) with `cachemgr.transfer.upload.Uploader` to a fresh `LocalStore` in `--dir`, once
by the whole-file kernel copy (`ObjectStore.stage_file`, the default) and once by the part path
(parts read into buffers, `stage_files=False`), alternating which goes first. CPU is the
process's user+system time over the upload (every thread); also a CRC32C pass over 64 MiB in
memory, for scale. Prints the median and the spread of each.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GiB = 1 << 30


def size_arg(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> int:
    import trio

    from cachemgr.store import LocalStore
    from cachemgr.store.base import crc32c
    from cachemgr.transfer.upload import TransferConfig, Uploader

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=size_arg, default=GiB)
    ap.add_argument("--dir", default="/dev/shm", help="where the file and the store go")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptfs-upcpu-", dir=a.dir))
    try:
        src = work / "src"
        with open(src, "wb") as f:
            left = a.size
            while left:
                n = min(left, 8 << 20)
                f.write(os.urandom(n))
                left -= n
        buf = os.urandom(64 << 20)
        c0 = cpu()
        crc32c(buf)
        crc_s = (cpu() - c0) * GiB / len(buf)
        results: dict[str, list[tuple[float, float]]] = {"kernel copy": [], "parts": []}
        for r in range(a.rounds):
            order = ["kernel copy", "parts"] if r % 2 == 0 else ["parts", "kernel copy"]
            for how in order:
                store_dir = work / "store"
                shutil.rmtree(store_dir, ignore_errors=True)
                up = Uploader(LocalStore(store_dir),
                              TransferConfig(stage_files=how == "kernel copy"))

                async def one(up: Uploader = up) -> None:
                    await up.upload_file(src, "k", size=a.size)
                c0, t0 = cpu(), time.monotonic()
                trio.run(one)
                results[how].append(((cpu() - c0) * GiB / a.size,
                                     (time.monotonic() - t0) * GiB / a.size))
        print(f"bench_upload_cpu: {a.size >> 20} MiB to a file:// store in {a.dir}, "
              f"{a.rounds} rounds; CRC32C alone {crc_s:.3f} CPU s/GiB")
        for how, rs in results.items():
            c = [x[0] for x in rs]
            w = [x[1] for x in rs]
            print(f"  {how:12} CPU {statistics.median(c):.3f} s/GiB ({min(c):.3f}-{max(c):.3f}),"
                  f" wall {statistics.median(w):.3f} s/GiB ({min(w):.3f}-{max(w):.3f})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
