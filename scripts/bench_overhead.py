#!/usr/bin/env python3
"""ckptfs's own overhead on the write path, measured where the disk cannot hide it: the raw
directory and the cache dir both on ext4 over a RAM-backed loop device (a file on /dev/shm),
so the ratio mount/raw is ckptfs's cost and not this VM's disk, which swings 2-4x from minute
to minute.

    python scripts/bench_overhead.py                       # 5 interleaved rounds, ~7 minutes
    python scripts/bench_overhead.py --rounds 9 --size 512M --json out.json   # quicker, noisier
    python scripts/bench_overhead.py --mount-opt=--no-passthrough

Each round runs every workload on the raw directory and on the mount, in an order that
alternates from round to round, each run starting with the mount idle (every upload done) and
the previous run's files removed. Reported per workload: the median ratio mount/raw (throughput;
for times, raw/mount, so that > 1 is always "ckptfs faster") and its spread over the rounds, a
warning when the spread is wider than the gap from 1.0 the median reports; the FUSE requests
the daemon answered per MiB written and per file, by operation (from its --metrics endpoint);
and the daemon's CPU seconds per GiB: on the request path (during the workload) and including
the upload to the file:// store (until the mount is idle again).

Workloads: fio sequential writes with end_fsync (64 KiB and 1 MiB blocks; 1, 4, 8 writers), a read
of those files right after (page cache, 4 passes), the same read with the mount idle before it (the
write untimed; what is left when no upload runs beside the readers), and after sync + drop_caches
(the write is not timed, and the mount is idle before the read), 4 ranks torch.save + fsync (the
slowest rank's own timing), a DCP save (torch.distributed.checkpoint, one process, 4 writer threads,
sync_files) of a GPT-like state dict, and "save while the previous checkpoint uploads" (ratio:
idle-mount save time / busy-mount save time, each the second save into an emptied directory; the raw
disk runs the same sequence as a control). Each save runs --save-repeats times per round. The CPU of
a plain copy of what each raw run wrote into the store's tmpfs is reported beside the daemon's
("copy floor"). While it runs, freed memory stays in the VM (free page reporting delayed, restored
at the end: "Freed memory" below). Needs root (loop device, mount, FUSE, the page cache dropped),
fio and torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
# a JSON document: a daemon's status, the report and its rows
Json = dict[str, Any]
# a workload: fn(dir) -> MB/s or seconds; prep(dir) runs untimed before it
Work = Callable[[Path], float]
Prep = Callable[[Path], object]
Workload = tuple[str, Work, int, int, Prep | None]
MiB = 1 << 20

TORCH_SAVE = r"""
import os, sys, time, torch
path, mib, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(rank)
sd = {"w": torch.randn(mib * (1 << 20) // 4, generator=g)}
print("ready", flush=True)
sys.stdin.readline()  # every rank has its tensor: the saves start together
t0 = time.perf_counter()
with open(path, "wb") as f:
    torch.save(sd, f)
    f.flush()
    os.fsync(f.fileno())
print(time.perf_counter() - t0)
"""


def sh(*cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", s.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


class RamDisk:
    """ext4 on a loop device over a file in /dev/shm, mounted at `path`."""

    def __init__(self, size: int, where: Path, mkfs_args: tuple[str, ...] = ()) -> None:
        self.img = Path(tempfile.mktemp(prefix="ckptfs-bench-", suffix=".img", dir="/dev/shm"))
        self.path = where
        # Every page of the image allocated up front, and no discard (mkfs's, or the loop
        # device's): otherwise a write into a block never written before allocates a tmpfs page
        # and one into a block freed by a delete does not, and that swung back-to-back saves
        # 3-4x, on the raw disk as on the mount, by what had been deleted before them.
        with open(self.img, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, size)
        sh("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard",
           *mkfs_args, str(self.img))
        self.dev = sh("losetup", "--find", "--show", str(self.img)).stdout.strip()
        where.mkdir(parents=True, exist_ok=True)
        sh("mount", self.dev, str(where))

    def close(self) -> None:
        subprocess.run(["umount", str(self.path)], capture_output=True)
        subprocess.run(["losetup", "-d", self.dev], capture_output=True)
        self.img.unlink(missing_ok=True)


class Mount:
    def __init__(self, root: Path, opts: list[str]) -> None:
        self.path = root / "mnt"
        self.cache = root / "disk" / "cache"
        self.store = root / "store"  # on /dev/shm's tmpfs: the store costs no cache-disk I/O
        for p in (self.path, self.store):
            p.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        r = sh(PY, "-m", "ckptfs", "mount", str(self.path), "--cache-dir", str(self.cache),
               "--store", f"file://{self.store}", "--metrics", f"127.0.0.1:{self.port}", *opts,
               cwd=REPO)
        m = re.search(r"pid (\d+)", r.stdout)
        if m is None:
            raise RuntimeError(f"ckptfs mount printed no pid: {r.stdout!r}")
        self.pid = int(m.group(1))
        st = self.status()
        self.data_path = st["data_path"]["mode"]

    def status(self) -> Json:
        st: Json = json.loads(sh(PY, "-m", "ckptfs", "status", str(self.path), "--json",
                                 cwd=REPO).stdout)
        return st

    def wait_idle(self, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = self.status()["tiering"]
            if not (t["pending_sets"] or t["uploads"]["running"] or t["uploads"]["queued"]):
                return
            time.sleep(0.1)
        raise RuntimeError("the mount did not become idle")

    def requests(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                      timeout=10).read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^ckptfs_fuse_requests_total\{op="([a-z_]+)"\} ([0-9.e+]+)$', text, re.M)}

    def cpu(self) -> float:
        return sum(self.cpu_split())

    def cpu_split(self) -> tuple[float, float]:
        """The daemon's (user, system) CPU seconds so far (all its threads)."""
        f = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        return int(f[11]) / tck, int(f[12]) / tck

    def close(self) -> None:
        subprocess.run([PY, "-m", "ckptfs", "umount", str(self.path)], capture_output=True,
                       cwd=REPO, timeout=600)


def children_cpu() -> float:
    """User + system CPU seconds of this process's waited-for children (fio, the ranks)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def clear(d: Path) -> None:
    for p in list(d.iterdir()) if d.exists() else []:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


DCP_SAVE = r"""
import os, sys, time, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
path, mib = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(0)
n = mib * (1 << 20) // 4
# GPT-like: an embedding, 8 blocks of 4 matrices, their Adam moments (fp32)
shapes = [("emb", n // 2)] + [(f"b{i}.{w}", n // 64) for i in range(8) for w in "qkvo"]
sd = {}
for name, numel in shapes:
    for kind in ("w", "m", "v"):
        sd[f"{kind}.{name}"] = torch.randn(numel // 3, generator=g)
t0 = time.perf_counter()
dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=4, sync_files=True))
print(time.perf_counter() - t0)
"""


def copy_floor(src: Path, dst: Path) -> float:
    """CPU seconds (user + system, of this thread) of copying every file under `src` into
    `dst` the way the upload to a file:// store copies (cachemgr.store.local.copy_in:
    copy_file_range, sendfile across filesystems): the least an upload of those bytes costs."""
    sys.path.insert(0, str(REPO))
    from cachemgr.store.local import copy_in

    dst.mkdir(parents=True, exist_ok=True)
    r0 = resource.getrusage(resource.RUSAGE_THREAD)
    for i, f in enumerate(sorted(p for p in src.rglob("*") if p.is_file())):
        s_fd = os.open(f, os.O_RDONLY)
        d_fd = os.open(dst / str(i), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            copy_in(s_fd, d_fd, os.fstat(s_fd).st_size)
        finally:
            os.close(s_fd)
            os.close(d_fd)
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    shutil.rmtree(dst, ignore_errors=True)
    return (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def dcp_save(d: Path, mib: int) -> float:
    """Seconds of one DCP save of about `mib` MiB into a new directory under `d`."""
    r = sh(PY, "-c", DCP_SAVE, str(d / "dcp"), str(mib))
    return float(r.stdout.split()[-1])


def fio(d: Path, rw: str, bs: str, jobs: int, size: int, loops: int = 1) -> float:
    """MB/s of a fio run in `d` (bytes over the whole run, end_fsync included). `loops`
    reads the files that many times (a read from the page cache of 512 MiB takes ~0.1 s here:
    too short to time without it)."""
    r = sh("fio", "--name=b", f"--directory={d}", f"--rw={rw}", f"--bs={bs}",
           f"--numjobs={jobs}", f"--size={size // jobs}", "--ioengine=psync",
           "--end_fsync=1" if rw == "write" else "--invalidate=0", "--group_reporting",
           f"--loops={loops}", "--output-format=json")
    job = json.loads(r.stdout)["jobs"][0]
    side = job["write" if rw == "write" else "read"]
    return side["io_bytes"] / (side["runtime"] / 1000) / 1e6 if side["runtime"] else 0.0


def torch_save(d: Path, ranks: int, mib: int, tag: str) -> float:
    """Seconds of the slowest rank's torch.save + fsync (ranks in parallel, started together
    once every rank has its tensor), as each rank timed it: the processes' start, torch's
    import and the tensor's generation stay out (before the barrier, a rank's save overlapped
    the others' generation by chance, and save times swung 4x)."""
    procs = [subprocess.Popen([PY, "-c", TORCH_SAVE, str(d / f"{tag}_rank{r}.pt"), str(mib),
                               str(r)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for r in range(ranks)]
    for p in procs:  # a barrier: the ranks' start and tensor generation stay out of the saves
        assert p.stdout is not None and p.stdin is not None  # both PIPE
        if p.stdout.readline() != "ready\n":
            raise RuntimeError("torch.save rank failed before its save")
    times = []
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError("torch.save failed")
        times.append(float(out.split()[-1]))
    return max(times)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.results: dict[str, dict[str, list[float]]] = {}
        self.requests: dict[str, dict[str, list[float]]] = {}
        self.cpu: dict[str, dict[str, list[float]]] = {}
        # CPU seconds of the workload's own processes, by workload and target (raw, mount)
        self.wcpu: dict[str, dict[str, list[float]]] = {}
        self.data_path = "?"  # what the mount reported (status data_path.mode)
        # CPU seconds of copying what a raw-disk write workload wrote into the store's tmpfs
        # (`copy_floor`), by workload: the floor under the daemon's upload CPU
        self.floor: dict[str, list[float]] = {}
        self.floor_dir: Path | None = None

    def workloads(self) -> list[Workload]:
        """(name, fn(dir) -> value, bytes, files, prep(dir) or None); value: MB/s or seconds.
        `prep` runs untimed before `fn` (then the mount goes idle and the page cache is
        dropped); the bytes and files are what `fn` writes or reads."""
        a, size = self.a, self.a.size
        out: list[Workload] = [("fio 64 KiB writes, 1 writer",
                                lambda d: fio(d, "write", "64k", 1, size), size, 1, None)]

        def write(j: int) -> Work:
            return lambda d: fio(d, "write", "1m", j, size)

        def read(j: int, loops: int = 1) -> Work:
            return lambda d: fio(d, "read", "1m", j, size, loops=loops)

        def write_read(j: int) -> Work:
            return lambda d: (fio(d, "write", "1m", j, size),
                              fio(d, "read", "1m", j, size, loops=4))[1]
        for j in a.jobs:
            out.append((f"fio 1 MiB writes, {j} writers", write(j), size, j, None))
            out.append((f"read right after, {j} writers", write_read(j), size, j, None))
            out.append((f"read after drop_caches, {j} writers", read(j), size, j, write(j)))
            if j > 1:
                # The read right after, but with the mount idle (every upload done) before it:
                # what is left of the gap when no upload runs beside the readers.
                out.append((f"read with the mount idle first, {j} writers", read(j, loops=4),
                            size, j, write(j)))
        out.append((f"{a.ranks} ranks torch.save + fsync (s)",
                    lambda d: torch_save(d, a.ranks, a.torch_mib, "s"),
                    a.ranks * a.torch_mib * MiB, a.ranks, None))
        out.append(("DCP save, 4 threads + sync_files (s)",
                    lambda d: dcp_save(d, a.ranks * a.torch_mib),
                    a.ranks * a.torch_mib * MiB, 5, None))
        return out

    def one(self, name: str, fn: Work, target: str, d: Path, m: Mount | None,
            prep: Prep | None = None) -> None:
        clear(d)
        if prep is not None:
            prep(d)
            if m is not None:
                m.wait_idle()
            if "drop_caches" in name:
                drop_caches()
        if m is not None:
            m.wait_idle()
            req0, (user0, sys0) = m.requests(), m.cpu_split()
            cpu0 = user0 + sys0
        w0 = children_cpu()
        value = fn(d)
        self.wcpu.setdefault(name, {}).setdefault(target, []).append(children_cpu() - w0)
        self.results.setdefault(name, {}).setdefault(target, []).append(value)
        if m is None and prep is None and self.floor_dir is not None:
            self.floor.setdefault(name, []).append(copy_floor(d, self.floor_dir))
        if m is not None:
            # The daemon's CPU before the metrics scrape, which costs it CPU too.
            (user1, sys1), req1 = m.cpu_split(), m.requests()
            cpu1 = user1 + sys1
            self.cpu.setdefault(name, {}).setdefault("user", []).append(user1 - user0)
            m.wait_idle()
            cpu2 = m.cpu()
            delta = {op: req1.get(op, 0) - req0.get(op, 0) for op in req1}
            self.requests.setdefault(name, {}).update(
                {op: self.requests.get(name, {}).get(op, []) + [v] for op, v in delta.items()})
            self.cpu.setdefault(name, {}).setdefault("request", []).append(cpu1 - cpu0)
            self.cpu[name].setdefault("with upload", []).append(cpu2 - cpu0)

    def save_while_uploading(self, target: str, d: Path, m: Mount | None) -> None:
        """The same save on an idle target, then right after a first save (the mount then
        uploads the first while the second is written)."""
        a = self.a
        # Both timed saves are the second save after the directory was emptied, so that they
        # differ only in the wait before them (on the raw disk, in nothing: the control). A
        # third save in a row, or one right after a delete, runs at another speed here on
        # the raw disk too (docs/bench/overhead.md).
        clear(d)
        torch_save(d, a.ranks, a.torch_mib, "p")
        if m is not None:
            m.wait_idle()
        idle = torch_save(d, a.ranks, a.torch_mib, "idle")
        clear(d)
        if m is not None:
            m.wait_idle()
        torch_save(d, a.ranks, a.torch_mib, "p")
        busy = torch_save(d, a.ranks, a.torch_mib, "busy")  # the mount uploads "p" meanwhile
        clear(d)
        name = "save while the previous one uploads (idle/busy)"
        self.results.setdefault(name, {}).setdefault(target, []).append(idle / busy)

    def run(self) -> Json:
        a = self.a
        work = Path(tempfile.mkdtemp(prefix="ckptfs-overhead-", dir="/dev/shm"))
        disk = RamDisk(a.disk, work / "disk")
        raw = work / "disk" / "raw"
        raw.mkdir()
        self.floor_dir = work / "floor"  # beside the store, on /dev/shm's tmpfs
        m = None
        try:
            m = Mount(work, a.mount_opt)
            self.data_path = m.data_path
            print(f"bench_overhead: ext4 on a {a.disk >> 20} MiB RAM-backed loop device; "
                  f"mount data path {m.data_path}; {a.rounds} rounds", flush=True)
            for rnd in range(a.rounds):
                order = [("raw", raw, None), ("mount", m.path, m)]
                if rnd % 2:
                    order.reverse()
                for name, fn, _n, _f, prep in self.workloads():
                    if a.only and not any(o in name for o in a.only):
                        continue
                    # A save takes 0.2-0.8 s here: more samples per round than a fio run.
                    for _ in range(a.save_repeats if name.endswith("(s)") else 1):
                        for target, d, mm in order:
                            self.one(name, fn, target, d, mm, prep)
                for _ in range(a.save_repeats if not a.only or any(
                        o in "save while the previous one uploads" for o in a.only) else 0):
                    for target, d, mm in order:
                        self.save_while_uploading(target, d, mm)
                print(f"  round {rnd + 1}/{a.rounds} done", flush=True)
                clear(raw)
                clear(m.path)
        finally:
            if m is not None:
                m.close()
            disk.close()
            shutil.rmtree(work, ignore_errors=True)
        return self.report()

    def report(self) -> Json:
        rows = []
        sizes = {name: (n, f) for name, _fn, n, f, _p in self.workloads()}
        for name, by in self.results.items():
            raw, mnt = by.get("raw", []), by.get("mount", [])
            if name.startswith("save while"):
                ratios = mnt  # already idle/busy on the mount
            elif name.endswith("(s)"):
                ratios = [r / x for r, x in zip(raw, mnt, strict=True)]  # times: raw/mount
            else:
                ratios = [x / r for r, x in zip(raw, mnt, strict=True)]
            med = statistics.median(ratios)
            spread = (min(ratios), max(ratios))
            row: Json = {"workload": name, "median": round(med, 3),
                   "spread": [round(spread[0], 3), round(spread[1], 3)],
                   "raw": [round(v, 3) for v in raw], "mount": [round(v, 3) for v in mnt],
                   "warning": spread[1] - spread[0] > abs(1 - med)}
            if name.startswith("save while") and raw:
                # The control: the same three saves on the raw disk (idle/busy there), what
                # back-to-back saves cost without ckptfs.
                row["raw_control"] = round(statistics.median(raw), 3)
                row["raw_control_spread"] = [round(min(raw), 3), round(max(raw), 3)]
            if name in sizes:
                nbytes, nfiles = sizes[name]
                req = {op: statistics.median(v) for op, v in self.requests.get(name, {}).items()}
                row["requests_per_mib"] = {op: round(v / (nbytes / MiB), 3)
                                           for op, v in req.items() if v}
                row["requests_per_file"] = {op: round(v / nfiles, 1)
                                            for op, v in req.items() if v}
                cpu = self.cpu.get(name, {})
                gib = nbytes / (1 << 30)
                row["daemon_cpu_s_per_gib"] = {k: round(statistics.median(v) / gib, 3)
                                               for k, v in cpu.items()}
                if self.floor.get(name):
                    row["daemon_cpu_s_per_gib"]["copy floor"] = round(
                        statistics.median(self.floor[name]) / gib, 3)
                # What the mount costs in CPU beyond the raw disk, all processes counted: the
                # workload's own CPU on the mount plus the daemon's (request path), less the
                # workload's CPU on the raw disk, round by round. The kernel's writeback at an
                # fsync is charged to whoever calls fsync: fio on the raw disk, the daemon on
                # the mount; this nets it out.
                w = self.wcpu.get(name, {})
                extra = [(wm + dm - wr) / gib for wm, dm, wr in
                         zip(w.get("mount", []), cpu.get("request", []), w.get("raw", []),
                             strict=False)]
                if extra:
                    row["extra_cpu_s_per_gib"] = round(statistics.median(extra), 3)
                    row["extra_cpu_spread"] = [round(min(extra), 3), round(max(extra), 3)]
            rows.append(row)
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], text=True,
                              capture_output=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                     "--untracked-files=no"], text=True,
                                    capture_output=True).stdout.strip())
        import platform
        meta = {"time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "git_head": head, "git_dirty": dirty, "kernel": platform.release(),
                "cpus": os.cpu_count(), "loadavg_end": round(os.getloadavg()[0], 2),
                "data_path": self.data_path}
        return {"args": dict(vars(self.a)), "meta": meta, "rows": rows}


def print_report(rep: Json) -> None:
    print(f"\n{'workload':52} {'median':>7}  spread        requests/MiB (per file)   "
          f"daemon CPU s/GiB (request path / with upload; user on the request path)   "
          f"extra CPU s/GiB over raw")
    for r in rep["rows"]:
        req = ", ".join(f"{op} {v}" for op, v in r.get("requests_per_mib", {}).items()) or "-"
        per_file = ", ".join(f"{op} {v}" for op, v in r.get("requests_per_file", {}).items())
        cpu = r.get("daemon_cpu_s_per_gib", {})
        warn = "  WARNING: spread wider than the gap" if r["warning"] else ""
        print(f"{r['workload']:52} {r['median']:7.3f}  {r['spread'][0]:.2f}-{r['spread'][1]:.2f}"
              f"  {req} ({per_file})  {_cpu(cpu)}   {_extra(r)}{warn}{_control(r)}")


def _cpu(cpu: Json) -> str:
    out = f"{cpu.get('request', '-')} / {cpu.get('with upload', '-')}; user {cpu.get('user', '-')}"
    if "copy floor" in cpu:
        out += f"; copy floor {cpu['copy floor']}"
    return out


def _control(r: Json) -> str:
    if "raw_control" not in r:
        return ""
    lo, hi = r["raw_control_spread"]
    return f" (the raw disk, same saves: {r['raw_control']:.3f} [{lo:.2f}-{hi:.2f}])"


def _extra(r: Json) -> str:
    if "extra_cpu_s_per_gib" not in r:
        return "-"
    lo, hi = r["extra_cpu_spread"]
    return f"{r['extra_cpu_s_per_gib']} [{lo}-{hi}]"


def markdown(rep: Json, argv: list[str]) -> str:
    """The report as docs/bench/overhead.md: the command, the machine, the table."""
    import platform

    a = rep["args"]
    held = rep.get("meta", {}).get("freed_memory_held_ms")
    freed = (f"held in the VM for {held} ms (free page reporting delayed)" if held
             else "returned to the host at once, as this VM does")
    lines = [
        "# ckptfs write-path overhead (scripts/bench_overhead.py)", "",
        (f"_Written by `{' '.join(['python', 'scripts/bench_overhead.py', *argv])}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; kernel {platform.release()}, "
        f"{os.cpu_count()} CPUs, load average at the end {os.getloadavg()[0]:.2f}._"), "",
        (f"Raw directory and cache dir on ext4 over a {a['disk'] >> 20} MiB RAM-backed loop "
        f"device; {a['rounds']} interleaved rounds (the order alternates), the mount idle "
        f"before each run; {a['size'] >> 20} MiB per fio run, {a['ranks']} ranks x "
        f"{a['torch_mib']} MiB per save; mount options: {' '.join(a['mount_opt']) or 'defaults'}"
        f"; freed memory {freed}."),
        ("Ratio: mount/raw throughput (for the save, raw time / mount time; for the save while "
        "uploading, idle-mount time / busy-mount time), so > 1 is ckptfs faster; median and "
        "[min-max] over the rounds. FUSE requests the daemon answered (its metrics), per MiB "
        "written and per file; daemon CPU seconds per GiB during the workload and until the "
        "upload to the file:// store was done, and its user CPU alone during the workload "
        "(its own work: the rest is the kernel's, such as the writeback an fsync does). Extra "
        "CPU: the workload's processes plus the daemon during the workload on the mount, less "
        "the workload's processes on the raw disk, per GiB (median [min-max] over the rounds): "
        "what the mount costs in CPU, all processes counted, with an fsync's writeback on "
        "both sides. Copy floor: the CPU of copying the same files from the raw disk into the "
        "store's tmpfs as the upload does (copy_file_range), per GiB: the least an upload "
        "costs. The save while uploading shows in parentheses the same three saves on the raw "
        f"disk (back-to-back saves without ckptfs). Saves run {a.get('save_repeats', 1)} "
        "times per round."), "",
        ("| workload | median | spread | requests per MiB | requests per file | daemon CPU s/GiB "
        "(request path / with upload; user on the request path) | extra CPU s/GiB |"),
        "|---|---:|---|---|---|---|---|"]
    for r in rep["rows"]:
        req = ", ".join(f"{op} {v}" for op, v in r.get("requests_per_mib", {}).items()) or "-"
        pf = ", ".join(f"{op} {v}" for op, v in r.get("requests_per_file", {}).items()) or "-"
        cpu = r.get("daemon_cpu_s_per_gib", {})
        warn = " (spread wider than the gap)" if r["warning"] else ""
        lines.append(f"| {r['workload']} | {r['median']:.3f} | {r['spread'][0]:.2f}-"
                     f"{r['spread'][1]:.2f}{warn}{_control(r)} | {req} | {pf} | {_cpu(cpu)} | "
                     f"{_extra(r)} |")
    return "\n".join(lines) + "\n"


# Freed memory: this VM returns free memory to its host at once (virtio-balloon free page
# reporting, /sys/module/page_reporting/parameters/min_free_ms = 0), and the first touch of a
# page the host took back faults in the host. So a write into the page cache or tmpfs is 3-4x
# slower when the memory it gets was freed a while ago than when a delete just freed it
# (4 ranks x 96 MiB torch.save + fsync: 0.6-0.8 s against 0.17-0.2 s), and every ratio swings
# by what ran before it. A machine that owns its memory does not do this; the bench holds freed
# pages in the guest for its length (min_free_ms raised, restored at the end) unless told not.
PAGE_REPORTING = Path("/sys/module/page_reporting/parameters/min_free_ms")


class held_freed_memory:
    """Raise min_free_ms to `ms` for the block (0 or no such knob: nothing); `as` gives the
    value in force during the block (None: not held)."""

    def __init__(self, ms: int) -> None:
        self.ms = ms
        self.old: str | None = None

    def __enter__(self) -> int | None:
        if self.ms <= 0 or not PAGE_REPORTING.exists():
            return None
        try:
            self.old = PAGE_REPORTING.read_text().strip()
            PAGE_REPORTING.write_text(str(self.ms))
        except OSError as e:
            print(f"bench_overhead: cannot hold freed memory ({e}); ratios will swing more",
                  file=sys.stderr)
            self.old = None
            return None
        return self.ms

    def __exit__(self, *exc: object) -> None:
        if self.old is not None:
            PAGE_REPORTING.write_text(self.old)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--size", type=parse_size, default=parse_size("1G"),
                   help="bytes per fio run (all writers together; default 1G: shorter runs "
                   "cannot resolve 5%% on a 2-core VM, docs/bench/overhead.md)")
    p.add_argument("--jobs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--save-repeats", type=int, default=3,
                   help="runs of each save workload per round (default 3: a save takes "
                   "0.2-0.8 s here)")
    p.add_argument("--torch-mib", type=int, default=96, help="MiB per rank (default 96)")
    p.add_argument("--disk", type=parse_size, default=parse_size("4G"),
                   help="size of the RAM-backed ext4 (default 4G)")
    p.add_argument("--mount-opt", action="append", default=[],
                   help="extra `ckptfs mount` option (repeatable), e.g. "
                   "--mount-opt=--no-passthrough")
    p.add_argument("--hold-freed-memory", type=int, default=300_000, metavar="MS",
                   help="while the bench runs, keep freed pages in this VM for MS ms before "
                   "they go back to the host (free page reporting; default 300000, the most this "
                   "kernel takes; 0: leave it "
                   "as it is)")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="run only the workloads whose name contains TEXT (repeatable), e.g. "
                   "--only 'read right after' --only 'mount idle first'")
    p.add_argument("--json", help="write the report here as JSON")
    p.add_argument("--markdown", help="write the report here as markdown "
                   "(docs/bench/overhead.md)")
    a = p.parse_args()
    if os.geteuid() != 0:
        print("bench_overhead: needs root (loop device, mount, FUSE)", file=sys.stderr)
        return 2
    with held_freed_memory(a.hold_freed_memory) as held:
        rep = Bench(a).run()
    rep["meta"]["freed_memory_held_ms"] = held
    print_report(rep)
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(markdown(rep, sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
