#!/usr/bin/env python3
"""fio benchmark of ckptfs mount options against the raw cache disk.

What it measures
    Checkpoint-like I/O with fio (job files in scripts/fio/), for several variants of the
    `ckptfs mount` tuning options, each compared with the raw cache disk in the same run:

      write      every job writes its own file: 1 MiB buffered write()s of incompressible data
                 (refill_buffers, randrepeat=0), then fsync (end_fsync=1); the fsync is timed
      read-warm  the same files read back at once, nothing dropped (raw: a page-cache read;
                 ckptfs: every request goes through the daemon, which reads from the page cache)
      read-cold  the same files read back after `sync; echo 3 > /proc/sys/vm/drop_caches`

    at 1, 4 and 8 parallel jobs (files), the per-job size scaled so the total stays fixed.

How
    A temp dir is made under --workdir (default /var/tmp, which must be on a real disk). Inside
    it, `raw/` is a plain directory and `cache-*` / `mnt/` are the cache dir and mount point of
    the ckptfs mounts, so both sides use the same filesystem. For every repeat and every variant
    a fresh cache dir is mounted with `ckptfs mount`; then, for every job count, the three phases
    run on the raw dir and through the mount, back to back (which one goes first alternates),
    and the mount is unmounted in a `finally` (`ckptfs umount`, falling back to
    `fusermount3 -u -z`). Variants are rotated between repeats.

    Hygiene (measured on the development VM): right before every timed
    fio run the script syncs and touches then frees a few GiB of anonymous memory, because this
    VM returns freed memory to the host after ~2 s and the next first touch is then 3-30x slower;
    the touch rate is recorded with every sample. Cold reads drop the page cache first.

    Tiering: ckptfs uploads every closed file to its object store in the background. Each mount
    gets its own file:// store in the temp dir (or --store URL), and before every timed run the
    script waits until the daemon's uploads are idle (`ckptfs status --json`), so each number is
    the FUSE data path alone; the drain time after each mount run is recorded beside it.
    --overlap-uploads skips the wait (uploads then compete with the following runs).

    Bandwidth is fio's own (--output-format=json, group_reporting: all bytes over the job's
    runtime, which includes the end_fsync). MB/s are 10^6 bytes/s. Per sample the daemon's CPU
    time (utime+stime from /proc/<pid>/stat) and the FUSE requests it served (count, average
    size, from `ckptfs status`) are recorded; per mount its peak RSS (VmHWM from
    /proc/<pid>/status, read just before unmounting). A mount is checked before and after every
    run; if its daemon died, its remaining runs are skipped and its log is copied to --out.

Output (--out, default bench-results/)
    results.json  machine, kernel, fio/pyfuse3/libfuse versions, the configuration, every
                  command, every mount and every sample (written after each sample)
    results.md    per variant and job: raw and mount MB/s as median [min-max], the mount/raw
                  ratio as the median [min-max] of the paired (back-to-back) ratios, daemon CPU
                  per GiB, FUSE request size, upload drain; per variant: peak RSS; every error
    daemon-*.log  the daemon log of any mount that died or logged warnings/errors

Needs root (drop_caches, FUSE mounts), fio, fusermount3 and the ckptfs CLI. Run:
    sudo .venv/bin/python scripts/bench_fio.py --quick          # sanity run, a few minutes
    sudo .venv/bin/python scripts/bench_fio.py                  # full run (see --help)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import errno
import json
import mmap
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchlib import (
    BenchError,
    GiB,
    MiB,
    find_ckptfs,
    is_mounted,
    log,
    parse_size,
    pid_alive,
    proc_cpu_s,
    proc_status_kb,
    read_file,
    run_text,
)

# a JSON document: results.json, its records, a daemon's status
Json = dict[str, Any]

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIO_DIR = HERE / "fio"
PHASES = ("write", "read-warm", "read-cold")
JOB_FILES = {"write": "write.fio", "read-warm": "read_warm.fio", "read-cold": "read_cold.fio"}
FIO_DDIR = {"write": "write", "read-warm": "read", "read-cold": "read"}

# name -> extra `ckptfs mount` arguments
PRESET_VARIANTS: dict[str, list[str]] = {
    "default": [],
    "no-direct-io": ["--no-direct-io"],
    "writeback-cache": ["--writeback-cache"],
    "io-threads-4": ["--io-threads", "4"],
    "read-ahead-0": ["--read-ahead-kb", "0"],
}
DEFAULT_VARIANTS = list(PRESET_VARIANTS)




# ----------------------------------------------------------------------------------------------
# small helpers



def fmt_size(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB} GiB"
    if n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n} B"



def mountinfo_entry(path: Path) -> Json | None:
    """The /proc/self/mountinfo entry of the filesystem holding `path` (longest prefix)."""
    path = Path(os.path.realpath(path))
    best = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            mp = parts[4].replace("\\040", " ")
            inside = path == Path(mp) or Path(mp) in path.parents
            if inside and (best is None or len(mp) >= len(best["mountpoint"])):
                best = {"mountpoint": mp, "fstype": parts[sep + 1], "source": parts[sep + 2]}
    return best


def touch_memory(nbytes: int) -> float:
    """Fault in and free `nbytes` of anonymous memory; returns the seconds the touch took."""
    if nbytes <= 0:
        return 0.0
    m = mmap.mmap(-1, nbytes)
    chunk = b"\x5a" * (64 * MiB)
    t0 = time.perf_counter()
    try:
        for off in range(0, nbytes, len(chunk)):
            n = min(len(chunk), nbytes - off)
            m[off:off + n] = chunk[:n]
        return time.perf_counter() - t0
    finally:
        m.close()


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")



def rep_label(rec: Json) -> str:
    return (f"{rec['rep'] + 1} {rec['variant']} {rec['target']} {rec['phase']} "
            f"nj={rec['numjobs']}")


def median_min_max(values: Iterable[float | None]) -> tuple[float, float, float] | None:
    xs = [x for x in values if x is not None]
    if not xs:
        return None
    return statistics.median(xs), min(xs), max(xs)


# ----------------------------------------------------------------------------------------------
# environment



def machine_info(ckptfs: str, workdir: Path) -> Json:
    cpu = ""
    for line in read_file("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem_kb = 0
    for line in read_file("/proc/meminfo").splitlines():
        if line.startswith("MemTotal:"):
            mem_kb = int(line.split()[1])
    venv_python = Path(ckptfs).parent / "python"
    py = str(venv_python) if venv_python.exists() else sys.executable
    probe = "import sys, pyfuse3, trio; print(pyfuse3.__version__, trio.__version__, sys.version)"
    pyver = run_text([py, "-c", probe]).split()[:3]
    # the libfuse the binding loads (its rpath: ckptfs/native's build), not the system's
    # pkg-config one, which the daemon does not run with where the passthrough build is installed
    maps = run_text([py, "-c", "import pyfuse3; print(open('/proc/self/maps').read())"])
    loaded = sorted({ln.split()[-1] for ln in maps.splitlines() if "libfuse3.so" in ln})
    libfuse = loaded[0].rsplit(".so.", 1)[-1] if loaded else "?"
    fs = mountinfo_entry(workdir) or {}
    disk: Json = {"filesystem": fs}
    src = fs.get("source", "")
    if src.startswith("/dev/"):
        dev = Path(os.path.realpath(src)).name
        qdir = Path(f"/sys/class/block/{dev}/queue")
        if not qdir.exists():  # a partition: the queue is on the parent disk
            qdir = Path(os.path.realpath(f"/sys/class/block/{dev}")).parent / "queue"
        for k in ("read_ahead_kb", "rotational", "scheduler", "max_sectors_kb"):
            disk[k] = read_file(qdir / k, "?")
    git_head = run_text(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    git_dirty = bool(run_text(["git", "-C", str(REPO), "status", "--porcelain",
                               "--untracked-files=no"]))
    return {
        "hostname": platform.node(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_total_gib": round(mem_kb / (1 << 20), 1),
        "kernel": platform.release(),
        "kernel_version": platform.version(),
        "cmdline_page_reporting": "page_reporting" in read_file("/proc/cmdline"),
        "thp": read_file("/sys/kernel/mm/transparent_hugepage/enabled"),
        "fio": run_text(["fio", "--version"]),
        "pyfuse3": pyver[0] if len(pyver) == 3 else "?",
        "trio": pyver[1] if len(pyver) == 3 else "?",
        "python": pyver[2] if len(pyver) == 3 else "?",
        "libfuse": libfuse,
        "libfuse_path": loaded[0] if loaded else "?",
        "libfuse_system": run_text(["pkg-config", "--modversion", "fuse3"]),
        "fusermount3": run_text(["fusermount3", "-V"]),
        "ckptfs": run_text([ckptfs, "--version"]),
        "ckptfs_cli": ckptfs,
        "git_head": git_head,
        "git_dirty": git_dirty,
        "workdir_disk": disk,
    }


# ----------------------------------------------------------------------------------------------
# a ckptfs mount


class Mount:
    """One fresh ckptfs mount; `close()` always leaves nothing mounted and no daemon running."""

    def __init__(self, ckptfs: str, mnt: Path, cache: Path, args: list[str]) -> None:
        self.ckptfs = ckptfs
        self.mnt = mnt
        self.cache = cache
        self.cmd = [ckptfs, "mount", str(mnt), "--cache-dir", str(cache), *args]
        self.pid: int | None = None
        self.info: Json = {"cmd": shlex.join(self.cmd)}
        self.dead = False
        self.keep_log_as: Path | None = None  # where to copy the daemon log if it had problems

    def open(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        res = subprocess.run(self.cmd, check=False, capture_output=True, text=True, timeout=120)
        self.info["mount_s"] = round(time.perf_counter() - t0, 3)
        out = (res.stdout + res.stderr).strip()
        self.info["mount_output"] = out
        m = re.search(r"\bpid (\d+)", out)
        if m:
            self.pid = int(m.group(1))
        if res.returncode != 0:
            raise BenchError(f"mount failed (exit {res.returncode}): {out}")
        if self.pid is None:
            raise BenchError(f"mount succeeded but printed no pid: {out!r}")
        self.info["pid"] = self.pid
        dev = os.stat(self.mnt).st_dev
        bdi = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}"
        self.info["bdi_read_ahead_kb"] = read_file(f"{bdi}/read_ahead_kb", "?")
        conn = f"/sys/fs/fuse/connections/{os.minor(dev)}"
        # only when fusectl is mounted (/sys/fs/fuse/connections); None otherwise
        self.info["fuse_max_background"] = read_file(f"{conn}/max_background") or None
        self.info["fuse_congestion_threshold"] = (read_file(f"{conn}/congestion_threshold")
                                                  or None)
        self.conn_dir = conn

    def check_alive(self) -> str | None:
        """None if the mount answers, else why not."""
        if self.pid is not None and not pid_alive(self.pid):
            return f"daemon pid {self.pid} is gone"
        try:
            os.stat(self.mnt)
        except OSError as e:
            return f"stat of the mount point failed: {os.strerror(e.errno or errno.EIO)}"
        if not is_mounted(self.mnt):
            return "mount point is no longer mounted"
        return None

    def cpu_s(self) -> float | None:
        return proc_cpu_s(self.pid) if self.pid else None

    def status(self) -> Json | None:
        """`ckptfs status --json` of this mount, or None if it does not answer."""
        try:
            res = subprocess.run([self.ckptfs, "status", "--json", str(self.mnt)], check=False,
                                 capture_output=True, text=True, timeout=60)
            return json.loads(res.stdout) if res.returncode == 0 else None
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def wait_idle(self, timeout: float) -> tuple[float, Json | None]:
        """Wait until the daemon has no upload or store work pending (tiering idle).
        Returns (seconds waited, last status); status None if the mount cannot tell."""
        t0 = time.monotonic()
        while True:
            st = self.status()
            t = (st or {}).get("tiering")
            if st is None or not t:
                return time.monotonic() - t0, st
            up = t.get("uploads", {})
            if not (t.get("pending_sets") or up.get("running") or up.get("queued")):
                return time.monotonic() - t0, st
            if time.monotonic() - t0 > timeout:
                return time.monotonic() - t0, st
            time.sleep(0.25)

    def close(self) -> None:
        if self.pid is not None and not self.dead:
            st = self.status()
            if st is not None:
                (st.get("tiering") or {}).pop("sets", None)
                self.info["final_status"] = st
        if self.pid is not None:
            hwm = proc_status_kb(self.pid, "VmHWM")
            self.info["peak_rss_mib"] = round(hwm / 1024, 1) if hwm is not None else None
            self.info["daemon_cpu_s_total"] = self.cpu_s()
        steps = []
        if is_mounted(self.mnt):
            res = subprocess.run([self.ckptfs, "umount", str(self.mnt), "--timeout", "120"],
                                 check=False, capture_output=True, text=True, timeout=180)
            steps.append(f"ckptfs umount: exit {res.returncode} "
                         f"{(res.stdout + res.stderr).strip()}")
            if res.returncode != 0 or is_mounted(self.mnt):
                res = subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)],
                                     check=False, capture_output=True, text=True, timeout=60)
                steps.append(f"fusermount3 -u -z: exit {res.returncode} {res.stderr.strip()}")
        if self.pid is not None:
            deadline = time.monotonic() + 30
            while pid_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(self.pid):  # our own daemon, by pid
                abort = Path(getattr(self, "conn_dir", "/nonexistent")) / "abort"
                if abort.exists():
                    abort.write_text("1")
                    steps.append("aborted the FUSE connection")
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    if not pid_alive(self.pid):
                        break
                    os.kill(self.pid, sig)
                    steps.append(f"sent {sig.name} to daemon pid {self.pid}")
                    time.sleep(2)
        if steps:
            self.info["unmount"] = steps
        if is_mounted(self.mnt):
            self.info["unmount_error"] = f"{self.mnt} is STILL MOUNTED"
            log(f"!! {self.mnt} is still mounted; unmount it by hand: fusermount3 -u -z {self.mnt}")
        # anything the daemon logged above INFO is worth a look: keep the log
        logf = self.cache / "ckptfs.log"
        text = read_file(logf)
        bad = [ln for ln in text.splitlines()
               if re.search(r" (WARNING|ERROR|CRITICAL) |Traceback", ln)]
        if bad or self.dead:
            self.info["daemon_log_problems"] = bad[:50]
            self.info["daemon_log_tail"] = text.splitlines()[-120:]
            if self.keep_log_as is not None:
                self.keep_log_as.parent.mkdir(parents=True, exist_ok=True)
                self.keep_log_as.write_text(text + "\n")
                self.info["daemon_log_copy"] = str(self.keep_log_as)


# ----------------------------------------------------------------------------------------------
# fio


def run_fio(phase: str, directory: Path, per_job: int, numjobs: int, out_json: Path,
            timeout: float) -> Json:
    env = dict(os.environ, DIR=str(directory), SIZE=str(per_job), NUMJOBS=str(numjobs))
    job = FIO_DIR / JOB_FILES[phase]
    cmd = ["fio", "--output-format=json", f"--output={out_json}", "--eta=never", str(job)]
    rec: Json = {"cmd": f"DIR={directory} SIZE={per_job} NUMJOBS={numjobs} {shlex.join(cmd)}"}
    out_json.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # fio's own process group, started just above
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stderr = "(fio did not exit after SIGKILL: stuck in the kernel?)"
        rec["error"] = f"fio timed out after {timeout:.0f}s"
    except BaseException:  # Ctrl-C: stop our fio before the mount is unmounted under it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        raise
    rec["wall_s"] = round(time.perf_counter() - t0, 3)
    rec["fio_rc"] = proc.returncode
    if stderr.strip():
        rec["fio_stderr"] = stderr.strip()[-4000:]
    problems = [rec.pop("error")] if "error" in rec else []
    if proc.returncode != 0:
        problems.append(f"fio exit {proc.returncode}")
    if proc.returncode != 0 and stderr.strip():
        problems.append(f"fio stderr: {stderr.strip()[-500:]}")
    text = read_file(out_json)
    start = re.search(r"^\{", text, re.MULTILINE)  # fio may print warnings before the JSON
    if start:
        try:
            data = json.loads(text[start.start():])
            j = data["jobs"][0]
            d = j[FIO_DDIR[phase]]
            rec.update(
                bw_bytes=d["bw_bytes"],
                mbps=round(d["bw_bytes"] / 1e6, 1),
                io_bytes=d["io_bytes"],
                runtime_ms=d["runtime"],
                clat_mean_us=round(d.get("clat_ns", {}).get("mean", 0) / 1000, 1),
                clat_p99_us=round(d.get("clat_ns", {}).get("percentile", {})
                                  .get("99.000000", 0) / 1000, 1),
                fio_usr_cpu=j.get("usr_cpu"),
                fio_sys_cpu=j.get("sys_cpu"),
                fio_job_error=j.get("error", 0),
            )
            if j.get("error"):
                problems.append(f"fio job error {j['error']} ({os.strerror(j['error'])})")
        except (ValueError, KeyError, IndexError) as e:
            problems.append(f"cannot parse fio JSON: {e.__class__.__name__}: {e}")
    else:
        problems.append("fio wrote no JSON")
    expected = per_job * numjobs
    if not problems and rec.get("io_bytes") != expected:
        problems.append(f"fio moved {rec.get('io_bytes')} bytes, expected {expected}")
    if problems:
        rec["error"] = "; ".join(problems)
    return rec


def clean_dir(d: Path) -> None:
    for p in d.iterdir():
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def check_files(d: Path, per_job: int, numjobs: int) -> str | None:
    for i in range(numjobs):
        p = d / f"ckpt.{i}"
        try:
            size = p.stat().st_size
        except OSError as e:
            return f"{p.name}: {e.strerror}"
        if size != per_job:
            return f"{p.name}: size {size}, expected {per_job}"
    return None


# ----------------------------------------------------------------------------------------------
# the run


class Bench:
    def __init__(self, a: argparse.Namespace, variants: dict[str, list[str]]) -> None:
        self.a = a
        self.variants = variants
        self.out = Path(a.out)
        self.samples: list[Json] = []
        self.mounts: list[Json] = []
        self.errors: list[str] = []
        self.meta: Json = {}
        self.config: Json = {}
        self.n_runs = a.repeats * len(variants) * len(a.jobs) * 2 * len(PHASES)
        self.run_no = 0
        self.t_start = time.monotonic()
        # ckptfs with tiering: give every mount its own store in the temp dir (unless --store)
        self.store_arg = "--store" in run_text([a.ckptfs, "mount", "--help"])

    # -- bookkeeping ---------------------------------------------------------------------------

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"meta": self.meta, "config": self.config, "mounts": self.mounts,
               "samples": self.samples, "errors": self.errors,
               "summary": self.summary(), "elapsed_s": round(time.monotonic() - self.t_start, 1)}
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.out / "results.json")

    def error(self, msg: str) -> None:
        self.errors.append(msg)
        log(f"!! {msg}")

    # -- one timed run -------------------------------------------------------------------------

    def timed(self, rep: int, variant: str, target: str, phase: str, nj: int, d: Path,
              mount: Mount | None) -> Json:
        a = self.a
        per_job = (a.size // nj) // MiB * MiB
        if phase == "read-cold":
            drop_caches()
        else:
            os.sync()
        before = mount.check_alive() if mount else None
        st0 = mount.status() if mount and not before else None
        touch_s = touch_memory(a.touch_bytes)
        rec: Json
        if before:  # never let fio write into the bare mount-point directory
            rec = {"error": f"mount gone before the run: {before}"}
            cpu0 = cpu1 = None
        else:
            cpu0 = mount.cpu_s() if mount else None
            rec = run_fio(phase, d, per_job, nj, self.out / "last-fio.json", a.fio_timeout)
            cpu1 = mount.cpu_s() if mount else None
        rec = {"rep": rep, "variant": variant, "target": target, "phase": phase,
               "numjobs": nj, "per_job_bytes": per_job, "total_bytes": per_job * nj,
               "touch_s": round(touch_s, 3),
               "touch_gib_s": round(a.touch_bytes / GiB / touch_s, 2) if touch_s else None,
               **rec}
        if cpu0 is not None and cpu1 is not None and "error" not in rec:
            rec["daemon_cpu_s"] = round(cpu1 - cpu0, 3)
        if mount is not None and st0 is not None and "error" not in rec:
            self.mount_counters(rec, mount, st0)
        if phase == "write" and "error" not in rec:
            bad = check_files(d, per_job, nj)
            if bad:
                rec["error"] = f"after write: {bad}"
        if mount is not None:
            why = before or mount.check_alive()
            if why:  # even if fio succeeded: it may have run on the bare directory
                if not before:
                    rec["error"] = "; ".join(filter(None, [rec.get("error"), f"mount: {why}"]))
                mount.dead = True
                mount.info.setdefault("died", f"during rep {rep + 1} {target} {phase} "
                                              f"nj={nj}: {why}")
        self.samples.append(rec)
        self.run_no += 1
        elapsed = time.monotonic() - self.t_start
        bw = f"{rec['mbps']:8.1f} MB/s" if "mbps" in rec and "error" not in rec else "  FAILED     "
        cpu = f" daemon {rec['daemon_cpu_s']:.2f} cpu-s" if "daemon_cpu_s" in rec else ""
        if rec.get("fuse_avg_request_kib"):
            cpu += f", {rec['fuse_avg_request_kib']:.0f} KiB/req"
        if rec.get("uploaded_bytes"):
            cpu += (f", upload {rec['uploaded_bytes'] / MiB:.0f} MiB drained in "
                    f"{rec['upload_drain_s']:.1f}s")
        touch = f", touch {rec['touch_gib_s']:.1f} GiB/s" if rec["touch_gib_s"] else ""
        log(f"[{self.run_no:4d}/{self.n_runs}] {elapsed:6.0f}s  rep {rep + 1} "
            f"{variant:<16} {target:<5} {phase:<9} nj={nj:<2} {bw}  "
            f"({rec.get('runtime_ms', 0) / 1000:.1f}s{touch}){cpu}")
        if "error" in rec:
            self.error(f"rep {rep + 1} {variant} {target} {phase} nj={nj}: {rec['error']}")
        self.save()
        return rec

    def mount_counters(self, rec: Json, mount: Mount, st0: Json) -> None:
        """FUSE requests the run caused (from `ckptfs status`), then, unless
        --overlap-uploads, wait for the uploads it started and record how long they took."""
        st1 = mount.status()
        if st1 is None:
            return
        io0, io1 = st0.get("io", {}), st1.get("io", {})
        reqs, nbytes = (("write_requests", "bytes_written") if rec["phase"] == "write"
                        else ("read_requests", "bytes_read"))
        n = io1.get(reqs, 0) - io0.get(reqs, 0)
        b = io1.get(nbytes, 0) - io0.get(nbytes, 0)
        rec["fuse_requests"] = n
        rec["fuse_bytes"] = b
        rec["fuse_avg_request_kib"] = round(b / n / 1024, 1) if n else None
        if self.a.overlap_uploads:
            return
        waited, st2 = mount.wait_idle(self.a.upload_timeout)
        up0 = ((st0.get("tiering") or {}).get("uploads") or {}).get("bytes_uploaded")
        up2 = (((st2 or {}).get("tiering") or {}).get("uploads") or {}).get("bytes_uploaded")
        if up0 is not None and up2 is not None:
            rec["uploaded_bytes"] = up2 - up0
            rec["upload_drain_s"] = round(waited, 2)  # after the run, until tiering was idle
        t2 = (st2 or {}).get("tiering") or {}
        health = (t2.get("store") or {}).get("health", "normal")
        if waited > self.a.upload_timeout or health != "normal":
            rec["upload_warning"] = (f"uploads not idle after {waited:.0f}s "
                                     f"({t2.get('pending_sets')} sets pending), store {health}: "
                                     f"{(t2.get('store') or {}).get('last_error')}")
            self.error(f"rep {rep_label(rec)}: {rec['upload_warning']}")

    def sequence(self, rep: int, variant: str, target: str, nj: int, d: Path,
                 mount: Mount | None) -> None:
        """write, read-warm, read-cold of one set of files, then delete them."""
        clean_dir(d)
        try:
            for phase in PHASES:
                rec = self.timed(rep, variant, target, phase, nj, d, mount)
                if "error" in rec and (phase == "write" or (mount and mount.dead)):
                    self.skip(rep, variant, target, nj, PHASES[PHASES.index(phase) + 1:])
                    break
        finally:
            if not (mount and mount.dead):
                clean_dir(d)
                if mount is not None and not self.a.overlap_uploads:
                    mount.wait_idle(self.a.upload_timeout)  # deletes reach the store

    def skip(self, rep: int, variant: str, target: str, nj: int, phases: Iterable[str]) -> None:
        for phase in phases:
            self.samples.append({"rep": rep, "variant": variant, "target": target,
                                 "phase": phase, "numjobs": nj, "skipped": True,
                                 "error": "skipped after an earlier failure"})
            self.run_no += 1
            log(f"[{self.run_no:4d}/{self.n_runs}] skipped: rep {rep + 1} {variant} {target} "
                f"{phase} nj={nj}")

    def run(self, tmp: Path) -> None:
        a = self.a
        raw = tmp / "raw"
        raw.mkdir()
        mnt = tmp / "mnt"
        names = list(self.variants)
        for rep in range(a.repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]  # rotate per repeat
            for vi, variant in enumerate(order):
                cache = tmp / f"cache-{variant}-r{rep + 1}"
                store = tmp / f"store-{variant}-r{rep + 1}"
                margs = list(self.variants[variant])
                if self.store_arg and "--store" not in margs:
                    margs += ["--store", a.store or f"file://{store}"]
                mount = Mount(a.ckptfs, mnt, cache, margs)
                mount.keep_log_as = self.out / f"daemon-{variant}-r{rep + 1}.log"
                minfo = {"rep": rep, "variant": variant, **mount.info}
                self.mounts.append(minfo)
                try:
                    try:
                        mount.open()
                    except (BenchError, OSError, subprocess.SubprocessError) as e:
                        self.error(f"rep {rep + 1} {variant}: {e}")
                        minfo["error"] = str(e)
                        mount.dead = True  # keeps the daemon log (mount.close)
                        for nj in a.jobs:
                            for target in ("raw", "mount"):
                                self.skip(rep, variant, target, nj, PHASES)
                        continue
                    minfo.update(mount.info)
                    log(f"--- rep {rep + 1}/{a.repeats} {variant}: mounted (pid {mount.pid}, "
                        f"read_ahead_kb {mount.info['bdi_read_ahead_kb']})")
                    for ji, nj in enumerate(a.jobs):
                        targets = ["raw", "mount"]
                        if (rep + vi + ji) % 2:
                            targets.reverse()
                        for target in targets:
                            if target == "mount" and mount.dead:
                                self.skip(rep, variant, target, nj, PHASES)
                                continue
                            if target == "raw":
                                self.sequence(rep, variant, "raw", nj, raw, None)
                            else:
                                self.sequence(rep, variant, "mount", nj, mnt, mount)
                finally:
                    mount.close()
                    minfo.update(mount.info)
                    if "unmount_error" in mount.info:
                        self.error(f"rep {rep + 1} {variant}: {mount.info['unmount_error']}")
                    if "died" in mount.info:
                        self.error(f"rep {rep + 1} {variant}: mount died "
                                   f"{mount.info['died']}")
                    if mount.info.get("daemon_log_problems"):
                        self.error(f"rep {rep + 1} {variant}: daemon logged "
                                   f"{len(mount.info['daemon_log_problems'])} warning/error "
                                   f"line(s), first: {mount.info['daemon_log_problems'][0]}"
                                   + (f" (log: {mount.info['daemon_log_copy']})"
                                      if "daemon_log_copy" in mount.info else ""))
                    if not is_mounted(mnt):
                        shutil.rmtree(cache, ignore_errors=True)
                        shutil.rmtree(store, ignore_errors=True)
                    self.save()
                    if mount.pid is not None:
                        rss = mount.info.get("peak_rss_mib")
                        log(f"--- rep {rep + 1}/{a.repeats} {variant}: unmounted, peak RSS "
                            + (f"{rss} MiB" if rss is not None else "unknown (daemon gone)"))

    # -- summary -------------------------------------------------------------------------------

    def summary(self) -> list[Json]:
        rows = []
        ok = [s for s in self.samples if "error" not in s and "bw_bytes" in s]
        for variant in self.variants:
            for phase in PHASES:
                for nj in self.a.jobs:
                    sel = [s for s in ok if (s["variant"], s["phase"], s["numjobs"])
                           == (variant, phase, nj)]
                    raw = {s["rep"]: s for s in sel if s["target"] == "raw"}
                    mnt = {s["rep"]: s for s in sel if s["target"] == "mount"}
                    ratios = [mnt[r]["bw_bytes"] / raw[r]["bw_bytes"]
                              for r in sorted(raw.keys() & mnt.keys()) if raw[r]["bw_bytes"]]
                    cpu = [m["daemon_cpu_s"] / (m["io_bytes"] / GiB) for m in mnt.values()
                           if m.get("daemon_cpu_s") is not None and m.get("io_bytes")]
                    rows.append({
                        "variant": variant, "phase": phase, "numjobs": nj,
                        "raw_mbps": median_min_max([s["mbps"] for s in raw.values()]),
                        "mount_mbps": median_min_max([s["mbps"] for s in mnt.values()]),
                        "ratio": median_min_max(ratios),
                        "daemon_cpu_s_per_gib": median_min_max(cpu),
                        "fuse_avg_request_kib": median_min_max(
                            [m.get("fuse_avg_request_kib") for m in mnt.values()]),
                        "upload_drain_s": median_min_max(
                            [m.get("upload_drain_s") for m in mnt.values()]),
                        "n_raw": len(raw), "n_mount": len(mnt),
                    })
        return rows

    def markdown(self) -> str:
        m, c = self.meta, self.config

        def mmm(t: tuple[float, float, float] | None, fmt: str = "{:.0f}") -> str:
            if t is None:
                return "—"
            med, lo, hi = t
            return f"{fmt.format(med)} [{fmt.format(lo)}–{fmt.format(hi)}]"

        disk = m.get("workdir_disk", {})
        quick = " — QUICK sanity run" if c.get("quick") else ""
        touch = (f"{fmt_size(c['touch_bytes'])} of memory touched and freed before each run."
                 if c.get("touch_bytes") else "no memory touched before the runs (--touch 0).")
        lines = [
            "# ckptfs fio benchmark: mount variants vs the raw cache disk",
            "",
            (f"Run {c.get('started')} ({len(self.samples)} samples, "
             f"{round(time.monotonic() - self.t_start)} s){quick}."),
            (f"Machine: {m.get('cpu')}, {m.get('cpus')} CPUs, {m.get('mem_total_gib')} GiB; "
             f"kernel {m.get('kernel')}; {m.get('fio')}; pyfuse3 {m.get('pyfuse3')}, "
             f"libfuse {m.get('libfuse')}, trio {m.get('trio')}, Python {m.get('python')}; "
             f"{m.get('ckptfs')} at {str(m.get('git_head'))[:12]}"
             f"{' (dirty tree)' if m.get('git_dirty') else ''}."),
            (f"Disk: {disk.get('filesystem', {}).get('source')} "
             f"({disk.get('filesystem', {}).get('fstype')}, "
             f"read_ahead_kb {disk.get('read_ahead_kb')})."),
            (f"Total {fmt_size(c.get('size_bytes', 0))} per run split over numjobs files, "
             f"1 MiB blocks; {c.get('repeats')} repeat(s); {touch}"),
            "",
            ("MB/s = 10^6 B/s as fio reports it, median [min–max]. mount/raw = median [min–max] "
             "of the ratios of back-to-back pairs. write includes the final fsync; read-warm "
             "reads right after the write with nothing dropped; read-cold reads after sync + "
             "drop_caches. Daemon CPU is the ckptfs daemon's utime+stime per GiB moved. "
             "FUSE request KiB: bytes / requests the daemon served in the run (ckptfs status). "
             "Upload drain: seconds after the write until the daemon's uploads to its store "
             + ("were done (not waited for: --overlap-uploads)." if c.get("overlap_uploads")
                else "were done; every run starts with the uploads idle.")),
            "",
            ("| variant | job | raw MB/s | mount MB/s | mount/raw | daemon CPU s/GiB | "
             "FUSE request KiB | upload drain s |"),
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in self.summary():
            lines.append(f"| {r['variant']} | {r['phase']} nj={r['numjobs']} | "
                         f"{mmm(r['raw_mbps'])} | {mmm(r['mount_mbps'])} | "
                         f"{mmm(r['ratio'], '{:.2f}')} | "
                         f"{mmm(r['daemon_cpu_s_per_gib'], '{:.2f}')} | "
                         f"{mmm(r['fuse_avg_request_kib'])} | "
                         f"{mmm(r['upload_drain_s'], '{:.1f}') if r['phase'] == 'write' else ''} |")
        lines += ["",
                  ("| variant | mount options | mounts | peak RSS MiB (median [min–max]) | "
                   "bdi read_ahead_kb | mount failed | daemon died |"),
                  "|---|---|---:|---:|---:|---:|---:|"]
        for variant, args in self.variants.items():
            ms = [x for x in self.mounts if x["variant"] == variant]
            rss = median_min_max([x.get("peak_rss_mib") for x in ms])
            ra = sorted({str(x.get("bdi_read_ahead_kb")) for x in ms if "bdi_read_ahead_kb" in x})
            failed = sum(1 for x in ms if "error" in x)
            died = sum(1 for x in ms if "died" in x)
            lines.append(f"| {variant} | `{shlex.join(args) or '(none)'}` | {len(ms)} | "
                         f"{mmm(rss, '{:.1f}')} | {', '.join(ra) or '—'} | {failed} | {died} |")
        if c.get("store"):
            note = f"Every mount also got `--store` ({c['store']}); commands in results.json."
            lines += ["", note]
        lines += ["", "## Errors", ""]
        lines += [f"- {e}" for e in self.errors] or ["none"]
        lines.append("")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_fio.py",
        description="Benchmark ckptfs mount option variants against the raw cache disk with\n"
        "fio: checkpoint-like sequential write (+fsync), warm read and cold read at several\n"
        "job counts, raw and mount interleaved, repeated. Needs root. Details: the module\n"
        "docstring of this script.",
        epilog="preset variants (mount arguments):\n" + "\n".join(
            f"  {k:<16} {shlex.join(v) or '(defaults)'}" for k, v in PRESET_VARIANTS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="sanity run: --size 256m --repeats 1 --touch 1g unless given")
    p.add_argument("--size", type=parse_size, default=None,
                   help="total bytes per run, split evenly over the jobs' files (default 4g; "
                   "quick 256m)")
    p.add_argument("--repeats", type=int, default=None,
                   help="repeats of everything (default 3; quick 1); medians over these")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated preset variants (default: all presets)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="an extra variant with its own mount arguments, e.g. "
                   "--variant 'ra4096=--read-ahead-kb 4096' (repeatable)")
    p.add_argument("--jobs", default="1,4,8",
                   help="comma-separated numjobs values (default 1,4,8)")
    p.add_argument("--out", default="bench-results",
                   help="output directory for results.json and results.md (default "
                   "bench-results/)")
    p.add_argument("--workdir", default="/var/tmp",
                   help="where the temp dir with the raw dir, cache dirs and mount point is "
                   "made; must be on the disk to measure (default /var/tmp)")
    p.add_argument("--touch", type=parse_size, default=None, dest="touch_bytes",
                   help="memory to touch and free before each timed run (default 3g; quick 1g; "
                   "0 to skip)")
    p.add_argument("--fio-timeout", type=float, default=None,
                   help="seconds before a fio run is killed (default 60 + size at 20 MB/s)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="object store for the mounts (default: a fresh file:// store per mount "
                   "in the temp dir, so nothing lands in the machine's default store)")
    p.add_argument("--overlap-uploads", action="store_true",
                   help="do not wait for the daemon's uploads between runs (default: wait until "
                   "tiering is idle before every run and record how long the drain took)")
    p.add_argument("--upload-timeout", type=float, default=600.0,
                   help="seconds to wait for uploads to drain (default 600)")
    p.add_argument("--ckptfs", default=None,
                   help="the ckptfs CLI (default: next to this Python, then .venv/bin, PATH)")
    p.add_argument("--keep-tmp", action="store_true",
                   help="keep the temp dir (raw files, cache dirs, daemon logs) afterwards")
    return p


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, list[str]]]:
    p = build_parser()
    a = p.parse_args(argv)
    if a.size is None:
        a.size = 256 * MiB if a.quick else 4 * GiB
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if a.touch_bytes is None:
        a.touch_bytes = 1 * GiB if a.quick else 3 * GiB
    try:
        a.jobs = [int(x) for x in a.jobs.split(",") if x.strip()]
    except ValueError:
        p.error(f"--jobs: not a list of integers: {a.jobs!r}")
    if not a.jobs or min(a.jobs) < 1:
        p.error("--jobs needs positive integers")
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.size // max(a.jobs) < MiB:
        p.error(f"--size {a.size} leaves less than 1 MiB per job at numjobs={max(a.jobs)}")
    variants: dict[str, list[str]] = {}
    for name in [v.strip() for v in a.variants.split(",") if v.strip()]:
        if name not in PRESET_VARIANTS:
            p.error(f"unknown variant {name!r}; presets: {', '.join(PRESET_VARIANTS)}")
        variants[name] = PRESET_VARIANTS[name]
    for spec in a.variant:
        name, sep, rest = spec.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            p.error(f"--variant {spec!r}: expected NAME=ARGS with a simple NAME")
        variants[name] = shlex.split(rest)
    if not variants:
        p.error("no variants selected")
    if a.fio_timeout is None:
        a.fio_timeout = 60 + a.size / 20e6
    return a, variants


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    a, variants = parse_args(argv)
    # SIGTERM and SIGHUP unwind like Ctrl-C, so the finally blocks unmount everything
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    if os.geteuid() != 0:
        print("bench_fio.py: needs root (drop_caches, FUSE mounts)", file=sys.stderr)
        return 2
    for tool in ("fio", "fusermount3"):
        if not shutil.which(tool):
            print(f"bench_fio.py: {tool} not found (scripts/setup.sh installs it)", file=sys.stderr)
            return 2
    try:
        a.ckptfs = find_ckptfs(a.ckptfs)
    except BenchError as e:
        print(f"bench_fio.py: {e}", file=sys.stderr)
        return 2
    workdir = Path(a.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    fs = mountinfo_entry(workdir) or {}
    if fs.get("fstype") in ("tmpfs", "ramfs") or str(fs.get("fstype", "")).startswith("fuse"):
        print(f"bench_fio.py: {workdir} is on {fs.get('fstype')}, not the cache disk; "
              "pass --workdir on the disk to measure", file=sys.stderr)
        return 2
    free = shutil.disk_usage(workdir).free
    if free < 3 * a.size:
        print(f"bench_fio.py: {workdir} has {fmt_size(free)} free, need ~{fmt_size(3 * a.size)}",
              file=sys.stderr)
        return 2

    bench = Bench(a, variants)
    bench.out.mkdir(parents=True, exist_ok=True)
    bench.meta = machine_info(a.ckptfs, workdir)
    tmp = Path(tempfile.mkdtemp(prefix="ckptfs-bench-", dir=workdir))
    bench.config = {
        "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "argv": sys.argv, "quick": a.quick, "size_bytes": a.size, "repeats": a.repeats,
        "jobs": a.jobs, "variants": variants, "touch_bytes": a.touch_bytes,
        "fio_timeout_s": a.fio_timeout, "workdir": str(workdir), "tmpdir": str(tmp),
        "store": a.store or ("per-mount file:// store in tmpdir" if bench.store_arg else None),
        "overlap_uploads": a.overlap_uploads, "upload_timeout_s": a.upload_timeout,
        "job_files": {ph: str(FIO_DIR / f) for ph, f in JOB_FILES.items()},
        "hygiene": "os.sync() (drop_caches for read-cold) then touch+free touch_bytes of "
                   "anonymous memory right before every fio run",
    }
    log(f"bench_fio: {len(variants)} variant(s) x {len(a.jobs)} job count(s) x "
        f"{len(PHASES)} phases x raw+mount x {a.repeats} repeat(s) = {bench.n_runs} fio runs; "
        f"{fmt_size(a.size)} per run; temp dir {tmp}; results in {Path(a.out).absolute()}")
    code = 0
    try:
        bench.run(tmp)
    except KeyboardInterrupt:
        log("interrupted: unmounted, writing partial results")
        code = 130
    finally:
        if is_mounted(tmp / "mnt"):
            bench.error(f"{tmp / 'mnt'} still mounted at exit")
        elif not a.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        (bench.out / "last-fio.json").unlink(missing_ok=True)
        bench.save()
        (bench.out / "results.md").write_text(bench.markdown())
    log("")
    log((bench.out / "results.md").read_text())
    log(f"wrote {bench.out / 'results.json'} and {bench.out / 'results.md'} "
        f"in {time.monotonic() - bench.t_start:.0f} s")
    if bench.errors and code == 0:
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
