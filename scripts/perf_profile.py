"""The profiles of scripts/bench_perf.py: py-spy on the daemon of each ckptfs target during a
fio write, a fio read after drop_caches and a cold restore (untimed: sampling slows the daemon).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from benchlib import MiB
from perf_core import Json, Perf, drop_caches, io_delta, tsfx

if TYPE_CHECKING:
    from bench_fio import Mount


class Profiles:
    def __init__(self, perf: Perf) -> None:
        self.p = perf

    def run(self) -> None:
        """py-spy on the daemon of each ckptfs target: a fio write (nj=1), a fio read after
        drop_caches and a cold restore (sequential read of a fresh node's set). Not timed
        runs: sampling slows the daemon. Profile names of `ckptfs-fuse` end in `-fuse`."""
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.access(pyspy, os.X_OK):
            self.p.res["profiles"]["error"] = "not available: py-spy not installed"
            return
        for t in self.p.a.ckptfs_targets:
            self.profiles_of(pyspy, t)

    def profile(self, pyspy: str, m: Mount, name: str, target: str, fn: Callable[[], object]
                ) -> None:
        st0 = m.status()
        rec = self.pyspy(pyspy, m.pid, name, fn)
        io = io_delta(st0, m.status())
        rec.update(target=target, io=io, data_path=io.get("data_path"))
        self.p.res["profiles"][name] = rec
        self.p.progress(f"   profile {name}: {rec.get('samples')} samples in {rec.get('seconds')}"
                      f" s; data path {io.get('data_path')}")

    def profiles_of(self, pyspy: str, target: str) -> None:
        from bench_fio import run_fio

        sx = tsfx(target)
        size = self.p.a.fio_size
        m = self.p.new_ckptfs(f"prof{sx}", f"prof{sx}", target)
        try:
            self.profile(pyspy, m, f"fio-write-nj1{sx}", target, lambda: run_fio(
                "write", m.mnt, size, 1, self.p.out / "last-fio.json", 600))
            m.wait_idle(600)
            drop_caches()
            self.profile(pyspy, m, f"fio-read-cold-nj1{sx}", target, lambda: run_fio(
                "read-cold", m.mnt, size, 1, self.p.out / "last-fio.json", 600))
            # the file as a committed set: a directory renamed into place
            (m.mnt / "set.tmp").mkdir()
            os.rename(m.mnt / "ckpt.0", m.mnt / "set.tmp" / "ckpt.0")
            os.rename(m.mnt / "set.tmp", m.mnt / "set")
            import ckptfs
            ckptfs.wait_durable(str(m.mnt / "set"), timeout=900)
        finally:
            self.p.close_ckptfs(m, size)
        mb = self.p.new_ckptfs(f"prof{sx}-B", f"prof{sx}", target)
        try:
            t1 = time.monotonic()
            while not (mb.mnt / "set" / "ckpt.0").exists() and time.monotonic() - t1 < 60:
                time.sleep(0.2)
            drop_caches()

            def readall() -> None:
                with open(mb.mnt / "set" / "ckpt.0", "rb", buffering=0) as f:
                    while f.read(MiB):
                        pass

            self.profile(pyspy, mb, f"cold-restore-read{sx}", target, readall)
        finally:
            self.p.close_ckptfs(mb, 0)

    def pyspy(self, pyspy: str, pid: int | None, name: str, fn: Callable[[], object]) -> Json:
        raw = self.p.out / f"profile-{name}.txt"
        svg = self.p.out / f"profile-{name}.svg"
        cmd = [pyspy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
               "--output", str(raw), "--nonblocking", "--threads"]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)
        t0 = time.perf_counter()
        fn()
        secs = time.perf_counter() - t0
        p.send_signal(signal.SIGINT)  # our own py-spy, by pid: it writes the profile and exits
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        rec = {"cmd": shlex.join(cmd), "seconds": round(secs, 2), "raw": str(raw)}
        if not raw.exists():
            rec["error"] = f"not available: py-spy wrote no profile: {err.strip()[-300:]}"
            return rec
        selfc: dict[str, int] = {}
        incl: dict[str, int] = {}
        total = 0
        for line in raw.read_text().splitlines():
            stack, _, cnt = line.rpartition(" ")
            try:
                c = int(cnt)
            except ValueError:
                continue
            frames = [f for f in stack.split(";") if not f.startswith("thread (")]
            if not frames:
                continue
            total += c
            selfc[frames[-1]] = selfc.get(frames[-1], 0) + c
            for f in set(frames):
                incl[f] = incl.get(f, 0) + c
        rec["samples"] = total
        rec["top_self"] = sorted(((f, c / total) for f, c in selfc.items()),
                                 key=lambda x: -x[1])[:12] if total else []
        rec["top_inclusive"] = sorted(((f, c / total) for f, c in incl.items()),
                                      key=lambda x: -x[1])[:15] if total else []
        _ = svg
        return rec

