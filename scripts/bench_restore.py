#!/usr/bin/env python3
"""Cold-restore throughput of ckptfs from an S3 store, against the store's own ceiling.

What it measures
    A checkpoint set (a DCP-like directory: --files files of random, incompressible bytes plus a
    small `.metadata`, --size in all) is written once through a ckptfs mount (node A) into an
    S3 store (a moto_server on 127.0.0.1 started by this script), waited durable and unmounted
    (with --peers, A is mounted with --peers and stays mounted to the end as the peer that
    holds the set: that its cache holds the set whole, nothing evicted, is checked once the set
    is durable and before every peer-read run; its CPU time is counted apart from `other busy`
    in every run). Then, per repeat:

      ceiling   boto3 alone downloads the set's objects (`download_file` per object, all objects
                in parallel, `TransferConfig(max_concurrency=8, multipart_chunksize=C)`) for
                C = ckptfs's chunk size (4 MiB: what an on-demand read GETs), each prefetch
                GET size (--prefetch-range; the mount's default unless swept) and each of
                --ceiling-chunks: what the store delivers with no ckptfs in the way. The table
                gives ckptfs's ratio to the ceiling at its own GET size and to the best one.
      prefetch  a fresh mount (node B: empty cache dir, same store, --prefetch-concurrency N,
                and --prefetch-range R if swept) and a timed `ckptfs prefetch <set>`: the
                whole set restored into the cache.
      read      another fresh mount B, the set's files read sequentially (1 MiB reads, like
                `cat`) with prefetch on: opening the first file prefetches the whole set, the
                reads wait for the chunks they cover.
      peer-read (only with --peers) a fresh mount B with --peers reads the set exactly as `read`
                does, while node A, the writer, is still mounted with --peers and holds the
                set whole in its cache: each 4 MiB chunk comes from A over HTTP (h11, HMAC),
                not from the store. Recorded beside MB/s: the bytes B got from peers and from
                the store (a run with more than 10% from the store is flagged `store-fed` and
                left out of the medians: it did not measure a restore from a peer), B's and
                A's daemon CPU time and moto's. `read` and `peer-read` run back to back for
                each N and R (their order reversed on every other repeat), so results.md gives
                the ratio peer-read/read pair by pair: median [min-max] over the repeats.

    for each N in --concurrency (and each R in --prefetch-range; the order is reversed on every
    other repeat, so a drift of the machine does not favour one value). MB/s are 10^6 bytes/s
    of raw file content (the objects are stored uncompressed: the data is random). `prefetch`
    is timed as the wall time of the `ckptfs prefetch` command (what a user waits for,
    including the CLI's start-up, `cli_startup_s`, and its 0.2 s status polling); the daemon's
    own job time is recorded beside it (`daemon job MB/s`: the better measure of small sets).

    Per run the daemon's CPU time, the moto server's CPU time (moto is one Python process: a
    `moto busy` near 1.0 core means the store is the bottleneck) and the daemon's peak RSS
    (VmHWM from /proc/<pid>/status, read just before unmounting) are recorded.

    Hygiene (as in scripts/bench_fio.py): right before every timed run the script waits (up to
    --idle-wait s) until no more than --max-other-busy CPUs are busy with anything but its own
    processes, syncs, and touches then frees --touch-gib GiB of anonymous memory (this VM returns
    freed memory to the host after ~2 s, and first touches are then several times slower).
    During each run it measures the CPU time the whole machine spent beyond the daemon, moto and
    itself (`other busy`, ~0 on an idle machine); a run above --max-other-busy competed with
    something else (a test suite, another benchmark: on 2 CPUs that halves the numbers) and is
    flagged `contended` and left out of the medians, unless every run of its row is.

    moto answers a ranged GET by reading the whole object and slicing it, so its cost per GET
    grows with the object's size: numbers depend on --size/--files, not only on N, and a
    --quick run is not comparable with a full one.

Output (--out, default bench-results/restore)
    results.json  machine, versions, configuration, every run (written after each run)
    results.md    the table: per mode, GET size and N, MB/s median [min-max], ratios to the
                  store ceiling, daemon CPU per GiB, moto/machine/other busy, peak RSS; the
                  ceilings; with --peers also, per GET size and N, read and peer-read MB/s,
                  their ratio pair by pair (median [min-max]), the share from peers, B's and
                  A's daemon CPU per GiB; every error
    daemon-*.log  the log of any daemon that logged a warning or an error

Run (needs FUSE, fusermount3, the ckptfs CLI and moto[server] in the same venv):
    .venv/bin/python scripts/bench_restore.py --quick        # 128 MiB, 1 repeat: ~1-3 min
    .venv/bin/python scripts/bench_restore.py                # 512 MiB, 3 repeats
    .venv/bin/python scripts/bench_restore.py --size 256M --repeats 2 --concurrency 4,8,16
    .venv/bin/python scripts/bench_restore.py --quick --prefetch-range 4M,32M,64M
    .venv/bin/python scripts/bench_restore.py --quick --peers  # + peer-read: ~2-5 min

With --peers every node (A and each peer-read B) gets `--peers --peer-secret-file F
--peer-address 127.0.0.1 --peer-listen 127.0.0.1:0 --replicas 0` (no replication: only the
restore from a peer is measured), F holding 32 random bytes (mode 0600, in the run's temp dir).

Always unmounts what it mounted (`ckptfs umount --no-wait`, falling back to
`fusermount3 -u -z`) and stops its moto server, by pid, in `finally`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import mmap
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from benchlib import (
    CLK_TCK,
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
from restore_report import MODES, PEER_MODE, SET_PATH, Json, fmt_size, report

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUCKET = "ckptfs-bench"
PREFIX = "bench"



# ----------------------------------------------------------------------------------------------
# small helpers



def parse_int_list(s: str) -> list[int]:
    try:
        xs = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {s!r}") from None
    if not xs or any(x < 1 for x in xs):
        raise argparse.ArgumentTypeError(f"need positive integers: {s!r}")
    return xs


def parse_size_list(s: str) -> list[int]:
    return [parse_size(x) for x in s.split(",") if x.strip()]


def touch_memory(nbytes: int) -> float:
    """Fault in and free `nbytes` of anonymous memory; returns the touch rate in GiB/s."""
    if nbytes <= 0:
        return 0.0
    m = mmap.mmap(-1, nbytes)
    chunk = b"\x5a" * (64 * MiB)
    t0 = time.perf_counter()
    try:
        for off in range(0, nbytes, len(chunk)):
            n = min(len(chunk), nbytes - off)
            m[off:off + n] = chunk[:n]
        return nbytes / GiB / max(time.perf_counter() - t0, 1e-9)
    finally:
        m.close()



def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (all CPUs; /proc/stat, not idle/iowait)."""
    fields = [int(x) for x in read_file("/proc/stat").splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLK_TCK  # user..steal, less idle+iowait


def self_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (the ckptfs CLI commands)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def delta(x1: float | None, x0: float | None) -> float:
    """x1 - x0 of two CPU-time readings of a process that ran at both (a None: it had
    exited, and the run fails with that)."""
    if x1 is None or x0 is None:
        raise BenchError("a process's CPU time could not be read (did it exit?)")
    return x1 - x0


def read_sequentially(paths: list[Path], block: int) -> tuple[int, float]:
    """Read `paths` in order, `block` bytes per read, like `cat`: (bytes read, seconds)."""
    buf = bytearray(block)
    view = memoryview(buf)
    nbytes = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                k = f.readinto(view)
                if not k:
                    break
                nbytes += k
    return nbytes, time.perf_counter() - t0


def machine_info(python: str, ckptfs: str, work: Path) -> Json:
    """The machine, the versions of what runs, the git state of this checkout."""
    cpu = ""
    for line in read_file("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    probe = ("import sys, boto3, moto, pyfuse3, trio; print(boto3.__version__, "
             "moto.__version__, pyfuse3.__version__, trio.__version__, "
             "sys.version.split()[0])")
    v = run_text([python, "-c", probe]).split()
    v = v if len(v) == 5 else ["?"] * 5
    return {
        "hostname": platform.node(), "cpu": cpu, "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "boto3": v[0], "moto": v[1], "pyfuse3": v[2], "trio": v[3], "python": v[4],
        "ckptfs": run_text([ckptfs, "--version"]), "ckptfs_cli": ckptfs,
        "git_head": run_text(["git", "-C", str(REPO), "rev-parse", "HEAD"]),
        "git_dirty": bool(run_text(["git", "-C", str(REPO), "status", "--porcelain",
                                    "--untracked-files=no"])),
        "workdir": str(work),
    }


# ----------------------------------------------------------------------------------------------
# --peers: node A, still mounted, serves the set to the peer-read mounts

# A peer-read run whose node B got more than this share of what it fetched from the store did
# not measure a restore from a peer (A lost chunks, B did not find A, A was cut off): flagged
# store-fed and left out of the medians. Not 0: a chunk a peer was too slow for (no answer in
# 5 s: docs/ARCHITECTURE.md "Peers") comes from the store without spoiling the measurement.
STORE_FED_SHARE = 0.10


def write_secret(path: Path) -> None:
    """32 random bytes, mode 0600 from creation on (a node refuses a secret others can read)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, os.urandom(32))
    finally:
        os.close(fd)


def peer_args(secret: Path) -> list[str]:
    """The `ckptfs mount` flags of every --peers node here: one loopback address, the port of
    the kernel's choice, no replication (only the restore from a peer is measured)."""
    return ["--peers", "--peer-secret-file", str(secret), "--peer-address", "127.0.0.1",
            "--peer-listen", "127.0.0.1:0", "--replicas", "0"]


def peer_bytes(st: Json) -> tuple[int, int, int]:
    """(bytes restored from peers, from the store, served to peers) in a --peers node's status."""
    p = (st.get("tiering") or {}).get("peers") or {}
    return ((p.get("restored_from_peers") or {}).get("bytes", 0),
            (p.get("restored_from_store") or {}).get("bytes", 0),
            (p.get("server") or {}).get("served_bytes", 0))


def check_holder(a: Mount, total: int) -> Json:
    """Node A's status, after checking that A is up and its cache holds the whole set (`total`
    bytes of file data present in the cache, nothing ever evicted); BenchError if not."""
    st = a.status()
    if st is None or not a.alive():
        raise BenchError("node A (the peer that holds the set) is gone")
    cache = st.get("cache") or {}
    if cache.get("evictions") or cache.get("evicted_bytes") or \
            cache.get("cached_bytes", 0) < total:
        raise BenchError(f"node A's cache no longer holds the set whole: {cache}")
    return st


def peer_record(rec: Json, b0: Json, b1: Json, a0: Json, a1: Json) -> None:
    """The peer-read numbers of a run from B's and A's status before (b0, a0) and after it."""
    fp, fs = (x1 - x0 for x1, x0 in zip(peer_bytes(b1)[:2], peer_bytes(b0)[:2]))
    rec.update(from_peers_bytes=fp, from_store_bytes=fs,
               a_served_bytes=peer_bytes(a1)[2] - peer_bytes(a0)[2],
               store_fed=fp == 0 or fs > STORE_FED_SHARE * (fp + fs))


def peer_note(r: Json) -> str:
    """The progress line's peer part of a run (empty for runs without node A)."""
    if r.get("a_daemon_cpu_s") is None:
        return ""
    out = f", A CPU {r['a_daemon_cpu_s']:.1f}s"
    if "from_peers_bytes" in r:
        out += (f", {r['from_peers_bytes'] / 1e6:.0f} MB from peers, "
                f"{r['from_store_bytes'] / 1e6:.0f} MB from the store"
                + (" STORE-FED: left out of the medians" if r.get("store_fed") else ""))
    return out



# ----------------------------------------------------------------------------------------------
# the S3 store: a moto_server of our own


class MotoServer:
    def __init__(self, python: str, workdir: Path) -> None:
        self.python = python
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "moto.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.cmd = [python, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def start(self, timeout: float = 60.0) -> None:
        with open(self.log_path, "w") as logf:
            self.proc = subprocess.Popen(self.cmd, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"moto_server exited ({self.proc.returncode}): "
                                 f"{read_file(self.log_path)[-800:]}")
            try:
                urllib.request.urlopen(self.url + "/moto-api/", timeout=1).read()
                return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"moto_server did not answer within {timeout:.0f}s")
            time.sleep(0.1)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def cpu_s(self) -> float | None:
        return proc_cpu_s(self.pid)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # our own child, by pid
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def s3_client(endpoint: str, pool: int = 64) -> Any:  # a boto3 S3 client (boto3 is untyped)
    import boto3
    import botocore.config

    cfg = botocore.config.Config(
        max_pool_connections=pool, s3={"addressing_style": "path"},
        retries={"max_attempts": 2, "mode": "standard"},
        # as ckptfs does: no extra checksum on every response
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required")
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=cfg)


# ----------------------------------------------------------------------------------------------
# a ckptfs mount


class Mount:
    """One ckptfs mount; `close()` always leaves nothing mounted and no daemon running."""

    def __init__(self, ckptfs: str, mnt: Path, cache: Path, args: list[str], name: str) -> None:
        self.ckptfs = ckptfs
        self.mnt = mnt
        self.cache = cache
        self.name = name
        self.log_file = cache.parent / f"{cache.name}.log"
        self.cmd = [ckptfs, "mount", str(mnt), "--cache-dir", str(cache),
                    "--log-file", str(self.log_file), *args]
        self.pid: int | None = None
        self.info: Json = {"cmd": shlex.join(self.cmd)}

    def open(self) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.cache.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        res = subprocess.run(self.cmd, check=False, capture_output=True, text=True, timeout=120)
        self.info["mount_s"] = round(time.perf_counter() - t0, 3)
        out = (res.stdout + res.stderr).strip()
        m = re.search(r"\bpid (\d+)", out)
        if m:
            self.pid = int(m.group(1))
            self.info["pid"] = self.pid
        if res.returncode != 0:
            raise BenchError(f"mount failed (exit {res.returncode}): {out}")
        if self.pid is None:
            raise BenchError(f"mount succeeded but printed no pid: {out!r}")

    def status(self) -> Json | None:
        try:
            res = subprocess.run([self.ckptfs, "status", "--json", str(self.mnt)], check=False,
                                 capture_output=True, text=True, timeout=60)
            return json.loads(res.stdout) if res.returncode == 0 else None
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def alive(self) -> bool:
        return self.pid is not None and pid_alive(self.pid) and is_mounted(self.mnt)

    def cpu_s(self) -> float | None:
        return proc_cpu_s(self.pid)

    def close(self, wait_uploads: bool = False, keep_log_as: Path | None = None) -> None:
        if self.pid is not None:
            hwm = proc_status_kb(self.pid, "VmHWM")
            self.info["peak_rss_mib"] = round(hwm / 1024, 1) if hwm is not None else None
            self.info["daemon_cpu_s_total"] = self.cpu_s()
        steps = []
        if is_mounted(self.mnt):
            cmd = [self.ckptfs, "umount", str(self.mnt)] + ([] if wait_uploads else ["--no-wait"])
            try:
                res = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                     timeout=900 if wait_uploads else 120)
                steps.append(f"{shlex.join(cmd[1:])}: exit {res.returncode} "
                             f"{(res.stdout + res.stderr).strip()}")
                ok = res.returncode == 0
            except subprocess.TimeoutExpired:
                steps.append(f"{shlex.join(cmd[1:])}: timed out")
                ok = False
            if not ok or is_mounted(self.mnt):
                res = subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False,
                                     capture_output=True, text=True, timeout=60)
                steps.append(f"fusermount3 -u -z: exit {res.returncode} {res.stderr.strip()}")
        if self.pid is not None:
            deadline = time.monotonic() + 30
            while pid_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            for sig in (signal.SIGTERM, signal.SIGKILL):  # our own daemon, by pid
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
        text = read_file(self.log_file)
        bad = [ln for ln in text.splitlines()
               if re.search(r" (WARNING|ERROR|CRITICAL) |Traceback|unexpected", ln)]
        if bad:
            self.info["daemon_log_problems"] = bad[:30]
            if keep_log_as is not None:
                keep_log_as.parent.mkdir(parents=True, exist_ok=True)
                keep_log_as.write_text(text + "\n")
                self.info["daemon_log_copy"] = str(keep_log_as)
        self.pid = None


# ----------------------------------------------------------------------------------------------
# the benchmark


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.ckptfs = find_ckptfs(a.ckptfs)
        venv_py = Path(self.ckptfs).parent / "python"
        self.python = str(venv_py) if venv_py.exists() else sys.executable
        a.workdir.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="ckptfs-bench-restore-", dir=a.workdir))
        self.out: Path = a.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.moto = MotoServer(self.python, self.work)
        self.mounts: list[Mount] = []  # open ones, closed in finally
        self.store_url = f"s3://{BUCKET}/{PREFIX}"
        self.files: list[Json] = []  # manifest entries of the set
        self.total = 0
        self.results: Json = {}
        # --peers: the shared secret, and node A kept mounted from setup() to the end of run()
        self.secret = self.work / "peer.secret"
        self.holder: Mount | None = None

    # -- bookkeeping --

    def save(self) -> None:
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.results, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, self.out / "results.json")

    def mount_args(self, extra: list[str]) -> list[str]:
        return ["--store", self.store_url, "--s3-endpoint", self.moto.url, "--s3-path-style",
                *extra]

    def new_mount(self, name: str, extra: list[str], mnt: str = "mnt") -> Mount:
        cache = self.work / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        m = Mount(self.ckptfs, self.work / mnt, cache, self.mount_args(extra), name)
        self.mounts.append(m)
        m.open()
        return m

    def close_mount(self, m: Mount, wait_uploads: bool = False) -> None:
        try:
            m.close(wait_uploads=wait_uploads, keep_log_as=self.out / f"daemon-{m.name}.log")
        finally:
            if m in self.mounts:
                self.mounts.remove(m)
            shutil.rmtree(m.cache, ignore_errors=True)

    # -- setup: store, the set, node A --

    def setup(self) -> None:
        a = self.a
        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
        os.environ.pop("AWS_PROFILE", None)
        os.environ.pop("AWS_SESSION_TOKEN", None)
        log(f"moto_server on {self.moto.url} (work dir {self.work})")
        self.moto.start()
        self.s3 = s3_client(self.moto.url)
        self.s3.create_bucket(Bucket=BUCKET)
        t0 = time.perf_counter()
        self.results["cli_startup_s"] = None
        run_text([self.ckptfs, "--version"])
        self.results["cli_startup_s"] = round(time.perf_counter() - t0, 3)

        per = a.size // a.files
        sizes = [per] * a.files
        sizes[-1] += a.size - per * a.files
        log(f"node A: writing {SET_PATH} ({a.files} files, {fmt_size(a.size)} of random bytes)")
        if a.peers:
            write_secret(self.secret)
            ma = self.new_mount("A", peer_args(self.secret), "mnt-A")
        else:
            ma = self.new_mount("A", [])
        setup: Json = {"mount": ma.info}
        try:
            ckpt = ma.mnt / "ckpt"
            ckpt.mkdir()
            tmp = ckpt / "step_1.tmp"
            tmp.mkdir()
            t0 = time.perf_counter()
            names = []
            for i, n in enumerate(sizes):
                name = f"__{i}_0.distcp"
                names.append(name)
                with open(tmp / name, "wb", buffering=0) as f:
                    left = n
                    while left:
                        k = min(left, 16 * MiB)
                        f.write(os.urandom(k))
                        left -= k
                    os.fsync(f.fileno())
            meta = json.dumps({"storage": dict(zip(names, sizes))}).encode()
            with open(tmp / ".metadata", "wb") as mf:
                mf.write(meta)
                mf.flush()
                os.fsync(mf.fileno())
            os.rename(tmp, ckpt / "step_1")
            setup["write_s"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            res = subprocess.run([self.ckptfs, "wait", str(ckpt / "step_1"), "--timeout",
                                  str(a.run_timeout)], check=False, capture_output=True,
                                 text=True, timeout=a.run_timeout + 60)
            setup["upload_wait_s"] = round(time.perf_counter() - t0, 3)
            if res.returncode != 0:
                raise BenchError(f"ckptfs wait failed ({res.returncode}): "
                                 f"{(res.stdout + res.stderr).strip()}")
            log(f"  written in {setup['write_s']:.1f}s, durable {setup['upload_wait_s']:.1f}s "
                "later")
        finally:
            if not a.peers:  # with --peers, A stays (cleanup() closes it after a failure)
                self.close_mount(ma, wait_uploads=True)

        key = f"{PREFIX}/manifests/{SET_PATH}.json"
        m = json.loads(self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        self.files = m["files"]
        self.total = sum(f["size"] for f in self.files)
        # the shards are random: stored raw (`.metadata`, a few hundred bytes, may be lz4)
        comp = {f["object"]["compression"] for f in self.files if f["size"] >= MiB}
        chunk = max((f["object"].get("chunk_size") or 0) for f in self.files)
        setup.update({"manifest_key": key, "total_bytes": self.total,
                      "files": [{"path": f["path"], "size": f["size"],
                                 "key": f["object"]["key"],
                                 "stored_size": f["object"]["stored_size"],
                                 "compression": f["object"]["compression"]}
                                for f in self.files],
                      "chunk_size": chunk})
        if comp != {"none"}:
            log(f"!! objects are stored with compression {sorted(comp)}: MB/s below count "
                "raw bytes")
        self.chunk_size = chunk
        if a.peers:
            self.holder = ma
            setup["holder_cache"] = check_holder(ma, self.total).get("cache")
        self.results["setup"] = setup
        self.save()

    # -- hygiene --

    def other_load(self, pids: list[int | None], interval: float = 1.0) -> float:
        """Busy CPUs over `interval` not spent by `pids` (our daemon, moto) or this script."""
        def ours() -> float:
            return self_cpu_s() + sum(proc_cpu_s(p) or 0.0 for p in pids)
        b0, o0 = machine_busy_s(), ours()
        time.sleep(interval)
        return (machine_busy_s() - b0 - (ours() - o0)) / interval

    def prepare(self, rec: Json, pids: list[int | None]) -> None:
        """Right before a timed run: wait (up to --idle-wait s) until nothing else keeps a CPU
        busy, flush dirty pages, touch and free memory (see the docstring)."""
        t0 = time.monotonic()
        other = self.other_load(pids)
        while other > self.a.max_other_busy and time.monotonic() - t0 < self.a.idle_wait:
            other = self.other_load(pids)
        rec["idle_wait_s"] = round(time.monotonic() - t0, 1)
        rec["other_busy_before"] = round(other, 2)
        os.sync()
        rec["touch_gib_s"] = round(touch_memory(int(self.a.touch_gib * GiB)), 2)

    def flag_contended(self, rec: Json) -> None:
        if rec.get("other_busy") is not None:
            rec["contended"] = rec["other_busy"] > self.a.max_other_busy

    # -- the store's ceiling --

    def ceiling(self, rep: int, chunk: int) -> Json:
        from boto3.s3.transfer import TransferConfig

        dest = self.work / "ceiling"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        cfg = TransferConfig(max_concurrency=8, multipart_chunksize=chunk,
                             multipart_threshold=chunk, use_threads=True)
        objs = [f["object"] for f in self.files]
        rec: Json = {"rep": rep, "chunk": chunk,
                     "cmd": f"boto3 download_file x{len(objs)} in parallel, TransferConfig("
                            f"max_concurrency=8, multipart_chunksize={chunk}, "
                            f"multipart_threshold={chunk})"}
        self.prepare(rec, [self.moto.pid])
        moto0, busy0, self0 = self.moto.cpu_s(), machine_busy_s(), self_cpu_s()
        t0 = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=len(objs)) as ex:
                futs = [ex.submit(self.s3.download_file, BUCKET, f"{PREFIX}/{o['key']}",
                                  str(dest / f"{i}"), Config=cfg) for i, o in enumerate(objs)]
                for fu in futs:
                    fu.result()
            secs = time.perf_counter() - t0
            got = sum((dest / f"{i}").stat().st_size for i in range(len(objs)))
            stored = sum(o["stored_size"] for o in objs)
            if got != stored:
                raise BenchError(f"downloaded {got} bytes, expected {stored}")
            rec.update(seconds=round(secs, 3), mb_s=round(self.total / 1e6 / secs, 1),
                       moto_busy=round(delta(self.moto.cpu_s(), moto0) / secs, 2),
                       machine_busy=round((machine_busy_s() - busy0) / secs, 2))
            rec["other_busy"] = round(rec["machine_busy"] - rec["moto_busy"]
                                      - (self_cpu_s() - self0) / secs, 2)
            self.flag_contended(rec)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            rec["error"] = f"{e.__class__.__name__}: {e}"
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        return rec

    # -- ckptfs restores --

    def wait_visible(self, m: Mount, timeout: float = 60) -> float:
        """Wait until mount B has materialised the set from the store (via its status, so no
        negative dentry gets cached by a lookup that came too early)."""
        t0 = time.monotonic()
        while True:
            st = m.status()
            if st is not None:
                sets = (st.get("tiering") or {}).get("sets") or []
                if any(s["path"] == SET_PATH and s["state"] == "durable" for s in sets):
                    return time.monotonic() - t0
            if not m.alive():
                raise BenchError("daemon died before the set appeared")
            if time.monotonic() - t0 > timeout:
                raise BenchError(f"{SET_PATH} did not appear in mount B within {timeout:.0f}s")
            time.sleep(0.1)

    def restore_run(self, rep: int, mode: str, n: int, rng: str | None) -> Json:
        a = self.a
        name = f"B-r{rep + 1}-{mode}-c{n}" + (f"-r{rng}" if rng else "")
        extra = ["--prefetch-concurrency", str(n), "--refresh-interval", "0"]
        if rng:
            extra += ["--prefetch-range", rng]
        extra += shlex.split(a.mount_args)
        if mode == PEER_MODE:
            extra += peer_args(self.secret)
        rec: Json = {"rep": rep, "mode": mode, "concurrency": n,
                     "prefetch_range": self.range_bytes(rng)}
        m = None
        hold = self.holder  # --peers: node A, whose CPU is counted apart in every run
        try:
            m = self.new_mount(name, extra)
            rec["mount"] = m.info
            rec["visible_after_s"] = round(self.wait_visible(m), 3)
            setdir = m.mnt / SET_PATH
            st0 = m.status() or {}
            fetched0 = st0.get("tiering", {}).get("restore", {}).get("bytes_fetched", 0)
            a0 = check_holder(hold, self.total) if hold and mode == PEER_MODE else {}
            self.prepare(rec, [self.moto.pid, m.pid] + ([hold.pid] if hold else []))
            cpu0, moto0, busy0 = m.cpu_s(), self.moto.cpu_s(), machine_busy_s()
            self0, hold0 = self_cpu_s(), (hold.cpu_s() if hold else 0.0)
            if mode == "prefetch":
                cmd = [self.ckptfs, "prefetch", str(setdir)]
                rec["cmd"] = shlex.join(cmd)
                t0 = time.perf_counter()
                res = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                     timeout=a.run_timeout)
                secs = time.perf_counter() - t0
                out = (res.stdout + res.stderr).strip()
                rec["output"] = out
                if res.returncode != 0:
                    raise BenchError(f"ckptfs prefetch exit {res.returncode}: {out}")
                mm = re.search(r" in ([\d.]+)s", out)
                rec["cli_reported_s"] = float(mm.group(1)) if mm else None
                nbytes = self.total
            else:
                paths = [setdir / f["path"] for f in sorted(self.files, key=lambda f: f["path"])]
                rec["cmd"] = f"sequential read of {len(paths)} files, 1 MiB reads"
                nbytes, secs = read_sequentially(paths, a.read_block)
                if nbytes != self.total:
                    raise BenchError(f"read {nbytes} bytes, expected {self.total}")
            cpu1, moto1, busy1 = m.cpu_s(), self.moto.cpu_s(), machine_busy_s()
            self1, hold1 = self_cpu_s(), (hold.cpu_s() if hold else 0.0)
            st1 = m.status() or {}
            rs = st1.get("tiering", {}).get("restore", {})
            if hold:
                rec["a_daemon_cpu_s"] = round(delta(hold1, hold0), 2)
                rec["set_policy"] = (rs.get("set_policies") or {}).get(SET_PATH)
            if hold and mode == PEER_MODE:
                peer_record(rec, st0, st1, a0, hold.status() or {})
            rec["bytes_fetched"] = rs.get("bytes_fetched", 0) - fetched0
            rec["chunks_fetched"] = rs.get("chunks_fetched")
            rec["integrity_errors"] = rs.get("integrity_errors")
            jobs = [j for j in rs.get("jobs", []) if j.get("path") == SET_PATH]
            if jobs:
                j = jobs[-1]
                rec["job"] = {k: j.get(k) for k in ("files", "bytes_total", "bytes_done",
                                                    "finished", "error", "seconds")}
                if j.get("error"):
                    rec["job_error"] = j["error"]
            if mode == "prefetch":
                if not jobs or not jobs[-1].get("finished") or \
                        jobs[-1].get("bytes_done") != jobs[-1].get("bytes_total"):
                    raise BenchError(f"prefetch job incomplete: {rec.get('job')}")
                cached = st1.get("cache", {}).get("bytes")
                rec["cache_bytes"] = cached
            rec.update(seconds=round(secs, 3), bytes=nbytes,
                       mb_s=round(nbytes / 1e6 / secs, 1),
                       daemon_cpu_s=round(delta(cpu1, cpu0), 2) if cpu0 is not None else None,
                       moto_busy=(round(delta(moto1, moto0) / secs, 2) if moto0 is not None
                                  else None),
                       machine_busy=round((busy1 - busy0) / secs, 2))
            if cpu0 is not None and moto0 is not None:
                # busy CPUs not accounted to the daemon, moto or this script: other load on the
                # machine (kernel work on their behalf, e.g. FUSE request handling, counts too)
                rec["other_busy"] = round(rec["machine_busy"] - (
                    delta(cpu1, cpu0) + delta(moto1, moto0) + (self1 - self0)
                    + delta(hold1, hold0)) / secs, 2)
                self.flag_contended(rec)
            if rec["integrity_errors"]:
                raise BenchError(f"{rec['integrity_errors']} chunks failed their CRC32C")
            job_s = (rec.get("job") or {}).get("seconds")
            if job_s:
                rec["daemon_job_mb_s"] = round(self.total / 1e6 / job_s, 1)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            rec["error"] = f"{e.__class__.__name__}: {e}"
        finally:
            if m is not None:
                self.close_mount(m)
                rec["peak_rss_mib"] = m.info.get("peak_rss_mib")
                if m.info.get("daemon_log_problems"):
                    rec["daemon_log_problems"] = m.info["daemon_log_problems"][:5]
        return rec

    # -- main loop --

    def range_bytes(self, rng: str | None) -> int:
        """Bytes per prefetch GET: --prefetch-range's value, or the mount's default (one chunk
        for a ckptfs without --prefetch-range)."""
        if rng:
            return parse_size(rng)
        return self.default_range or self.chunk_size

    def detect_prefetch_range(self) -> int | None:
        """The `--prefetch-range` default of this ckptfs (from `ckptfs mount --help`), or None
        if it has no such option (it then fetches one chunk per GET)."""
        text = " ".join(run_text([self.ckptfs, "mount", "--help"]).split())
        if "--prefetch-range" not in text:
            return None
        m = re.search(r"--prefetch-range PREFETCH_RANGE .*?default (\w+)\)", text)
        return parse_size(m.group(1)) if m else None

    def run(self) -> None:
        a = self.a
        t_start = time.monotonic()
        self.default_range = self.detect_prefetch_range()
        if a.prefetch_range and self.default_range is None:
            raise BenchError("this ckptfs has no --prefetch-range option")
        self.results = {
            "benchmark": "ckptfs cold restore from S3 (moto_server on loopback)",
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "config": {"size": a.size, "files": a.files, "concurrency": a.concurrency,
                       "repeats": a.repeats, "ceiling_chunks": a.ceiling_chunks,
                       "read_block": a.read_block, "touch_gib": a.touch_gib,
                       "max_other_busy": a.max_other_busy, "idle_wait": a.idle_wait,
                       "prefetch_range": a.prefetch_range, "mount_args": a.mount_args,
                       "default_prefetch_range": self.default_range,
                       "quick": a.quick, "argv": sys.argv[1:]},
            "machine": machine_info(self.python, self.ckptfs, self.work),
            "moto_cmd": shlex.join(self.moto.cmd),
            "ceiling": [], "runs": [], "errors": [],
        }
        self.save()
        self.setup()
        ranges = a.prefetch_range or [None]
        chunks = []
        for c in [self.chunk_size] + [self.range_bytes(r) for r in ranges] + a.ceiling_chunks:
            if c not in chunks:
                chunks.append(c)
        self.results["ceiling_chunks_used"] = chunks
        nruns = a.repeats * (len(chunks) + len(ranges) * len(a.concurrency)
                             * len(self.modes(0)))
        k = 0
        width = max(len(m) for m in self.modes(0))  # of the mode in the progress lines
        for rep in range(a.repeats):
            for c in chunks:
                k += 1
                r = self.ceiling(rep, c)
                self.results["ceiling"].append(r)
                self._progress(k, nruns, rep, f"ceiling boto3 {fmt_size(c)} ranges", r)
                self.save()
            order = a.concurrency if rep % 2 == 0 else list(reversed(a.concurrency))
            for rng in (ranges if rep % 2 == 0 else list(reversed(ranges))):
                for n in order:
                    for mode in self.modes(rep):
                        k += 1
                        r = self.restore_run(rep, mode, n, rng)
                        self.results["runs"].append(r)
                        label = (f"{mode:<{width}} N={n:<2} range "
                                 f"{fmt_size(self.range_bytes(rng))}")
                        self._progress(k, nruns, rep, label, r)
                        self.save()
        if self.holder is not None:  # node A: its peak RSS and log go into setup's mount
            self.close_mount(self.holder)
            self.holder = None
        self.results["wall_s"] = round(time.monotonic() - t_start, 1)
        self.results["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
        self.save()

    def modes(self, rep: int) -> list[str]:
        """The modes of repeat `rep` for each N and R: with --peers, `read` and `peer-read` back
        to back, in reverse order every other repeat, so that each pair shares the machine's
        state and a drift favours neither."""
        if not self.a.peers:
            return list(MODES)
        pair = ["read", PEER_MODE] if rep % 2 == 0 else [PEER_MODE, "read"]
        return [m for m in MODES if m != "read"] + pair

    def _progress(self, k: int, total: int, rep: int, what: str, r: Json) -> None:
        head = f"[{k:>3}/{total}] rep {rep + 1}/{self.a.repeats} {what}: "
        if "error" in r:
            self.results["errors"].append(f"rep {rep + 1} {what}: {r['error']}")
            log(head + "ERROR " + r["error"])
            return
        if "daemon_cpu_s" in r:
            job = (r.get("job") or {}).get("seconds")
            extra = (f", daemon job {job:.2f}s" if job else "") + (
                f", daemon CPU {r['daemon_cpu_s']:.1f}s, moto busy {r['moto_busy']:.2f}, "
                f"machine busy {r['machine_busy']:.2f} (other {r.get('other_busy')}), "
                f"peak RSS {r.get('peak_rss_mib')} MiB") + peer_note(r)
        else:
            extra = (f", moto busy {r['moto_busy']:.2f}, machine busy {r['machine_busy']:.2f} "
                     f"(other {r.get('other_busy')})")
        log(head + f"{fmt_size(self.total)} in {r['seconds']:.2f}s = {r['mb_s']:.1f} MB/s"
            + extra + f" (touch {r['touch_gib_s']} GiB/s"
            + (f", waited {r['idle_wait_s']}s for an idle machine" if r.get("idle_wait_s", 0) > 2
               else "") + ")" + (" CONTENDED: left out of the medians" if r.get("contended")
                                 else ""))

    # -- report --

    def report(self) -> str:
        text = report(self.results, self.a.max_other_busy)
        (self.out / "results.md").write_text(text)
        return text

    def cleanup(self) -> None:
        for m in list(self.mounts):
            try:
                self.close_mount(m)
            except Exception as e:  # noqa: BLE001
                log(f"!! cleanup of {m.mnt}: {e}")
        try:
            self.moto.stop()
        except Exception as e:  # noqa: BLE001
            log(f"!! stopping moto_server pid {self.moto.pid}: {e}")
        stuck = [p for p in (self.work / "mnt", self.work / "mnt-A") if is_mounted(p)]
        if stuck:
            log(f"!! {', '.join(map(str, stuck))} still mounted: not removing {self.work}")
        elif not self.a.keep_workdir:
            shutil.rmtree(self.work, ignore_errors=True)


def _interrupt(signum: int, _frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="ckptfs cold-restore throughput vs the store "
                                "ceiling (see the module docstring)")
    p.add_argument("--size", type=parse_size, default=None,
                   help="total size of the checkpoint set (default 512M; --quick: 128M)")
    p.add_argument("--files", type=int, default=4, help="shard files in the set (default 4)")
    p.add_argument("--concurrency", type=parse_int_list, default=[1, 2, 4, 8, 16],
                   help="--prefetch-concurrency values (default 1,2,4,8,16)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--quick", action="store_true", help="128 MiB, 1 repeat")
    p.add_argument("--prefetch-range", type=lambda s: [x.strip() for x in s.split(",")
                                                       if x.strip()], default=None,
                   help="--prefetch-range values to sweep (e.g. 4M,32M,64M; default: the "
                   "mount's own default)")
    p.add_argument("--mount-args", default="",
                   help="more `ckptfs mount` arguments for the restoring mounts, one string")
    p.add_argument("--peers", action="store_true",
                   help="also measure mode peer-read: a fresh --peers mount reads the set from "
                   "node A (the writer, kept mounted with --peers, its cache holding the set), "
                   "beside each read run (adds one mount and one read of the set per N and R)")
    p.add_argument("--ceiling-chunks", type=parse_size_list, default=[64 * MiB],
                   help="boto3 multipart_chunksize values for the store ceiling, beside "
                   "ckptfs's chunk size and each prefetch GET size, which are always measured "
                   "(default 64M)")
    p.add_argument("--read-block", type=parse_size, default=MiB,
                   help="read size of the sequential read (default 1M)")
    p.add_argument("--touch-gib", type=float, default=2.0,
                   help="GiB of memory touched and freed before each timed run (default 2)")
    p.add_argument("--max-other-busy", type=float, default=0.25,
                   help="CPUs busy with other work (not the daemon, moto or this script) "
                   "above which a run is flagged contended and left out of the medians, and "
                   "below which the machine counts as idle before a run (default 0.25)")
    p.add_argument("--idle-wait", type=float, default=120.0,
                   help="seconds to wait for an idle machine before each run (default 120)")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds one prefetch or upload wait may take (default 1800)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "restore",
                   help="output directory (default bench-results/restore)")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"),
                   help="where the temp dir (cache dirs, mount point) is made (default /var/tmp)")
    p.add_argument("--keep-workdir", action="store_true", help="do not delete the temp dir")
    p.add_argument("--ckptfs", default=None, help="the ckptfs CLI (default: beside python)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.size is None:
        a.size = 128 * MiB if a.quick else 512 * MiB
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if a.files < 1 or a.size < a.files or a.repeats < 1:
        log("need --files >= 1, --size >= --files bytes and --repeats >= 1")
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    a.out = a.out.absolute()
    try:
        bench = Bench(a)
    except BenchError as e:
        log(f"error: {e}")
        return 2
    code = 0
    try:
        bench.run()
    except KeyboardInterrupt as e:
        log(f"interrupted ({e}): cleaning up")
        bench.results.setdefault("errors", []).append(f"interrupted: {e}")
        code = 130
    except BenchError as e:
        log(f"error: {e}")
        bench.results.setdefault("errors", []).append(str(e))
        code = 1
    finally:
        bench.cleanup()
        if bench.results:
            bench.save()
            try:
                text = bench.report()
                log("")
                log(text)
                log(f"results: {bench.out / 'results.md'}, {bench.out / 'results.json'}")
            except Exception as e:  # noqa: BLE001 - a partial run may not have a table
                log(f"no report: {e.__class__.__name__}: {e}")
    if code == 0 and bench.results.get("errors"):
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
