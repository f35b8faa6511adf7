#!/usr/bin/env python3
"""A/B of the trainer-visible time of a per-rank torch.save checkpoint on three targets in one
run: the raw cache disk, a ckptfs mount with FUSE passthrough (the default) and one with
--no-passthrough, rounds alternating in order.

Each round: R rank processes (forked, torch already imported) each `torch.save` a dict of fp32
tensors (--mib MiB) to `step_N.tmp/rankR.pt` by path, then open it read-only and fsync it (as
MLPerf-Storage does); the directory is renamed to `step_N` when all are done (the commit).
Between rounds: `sync`, and for the mounts `ckptfs wait` until the step is durable, so no
upload overlaps the next round. Prints per target the median and every sample (seconds).

Run (root, after scripts/setup.sh):
    .venv/bin/python scripts/bench_save_ab.py --rounds 8 --ranks 4 --mib 96
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CKPTFS = [sys.executable, "-m", "ckptfs"]


def _rank(d: str, r: int, mib: int) -> None:
    import torch

    torch.set_num_threads(1)
    n = (mib << 20) // 4
    state = {f"t{i}": torch.randn(n // 8) for i in range(8)}
    p = f"{d}/rank{r}.pt"
    torch.save(state, p)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _round(root: Path, step: int, ranks: int, mib: int) -> float:
    tmp = root / f"step_{step}.tmp"
    tmp.mkdir()
    ps = [mp.Process(target=_rank, args=(str(tmp), r, mib)) for r in range(ranks)]
    t0 = time.perf_counter()
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    os.rename(tmp, root / f"step_{step}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mib", type=int, default=96, help="MiB per rank")
    ap.add_argument("--workdir", default="/var/tmp")
    a = ap.parse_args()
    import torch  # noqa: F401  (imported once here: the forked ranks inherit it)

    mp.set_start_method("fork")
    work = Path(tempfile.mkdtemp(prefix="ckptfs-save-ab-", dir=a.workdir))
    targets = {"raw": work / "raw", "passthrough": work / "mnt-pt", "fuse": work / "mnt-fuse"}
    for p in targets.values():
        p.mkdir()
    mounted = []
    try:
        for name, extra in (("passthrough", []), ("fuse", ["--no-passthrough"])):
            mnt = targets[name]
            subprocess.run([*CKPTFS, "mount", str(mnt), "--cache-dir", str(work / f"c-{name}"),
                            "--store", f"file://{work}/s-{name}", *extra], check=True,
                           capture_output=True)
            mounted.append(mnt)
        res: dict[str, list[float]] = {t: [] for t in targets}
        order = list(targets)
        for i in range(a.rounds):
            for t in (order if i % 2 == 0 else order[::-1]):
                os.sync()
                res[t].append(_round(targets[t], i, a.ranks, a.mib))
                if t != "raw":
                    subprocess.run([*CKPTFS, "wait", str(targets[t] / f"step_{i}")],
                                   check=True, capture_output=True)
        for t, v in res.items():
            print(f"{t:12s} median {statistics.median(v):.3f} s   "
                  + " ".join(f"{x:.2f}" for x in v))
    finally:
        for mnt in mounted:
            subprocess.run([*CKPTFS, "umount", str(mnt)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
