#!/usr/bin/env python3
"""ckptfs end-to-end performance benchmark: the numbers of docs/PERFORMANCE.md.

Entry point: `bash scripts/bench.sh [--quick|--full]` (installs the extras, then runs this).

What it measures, all in one run, against one S3 store (a moto_server on 127.0.0.1 started
here) and on the same data:

  fio        scripts/fio/{write,read_warm,read_cold}.fio at 1, 4 and 8 writers: 1 MiB
             sequential writes of incompressible data (refill_buffers) with end_fsync=1, a read
             right after (page cache warm) and a read after sync + drop_caches; through a
             ckptfs mount of each ckptfs target (below) and on the raw cache disk, back to back
             (order rotated), reported as mount/raw.
  mlperf     an MLPerf-Storage-like checkpoint: R rank processes, each `torch.save`s its shard
             (fp16 model + fp32 optimizer state: master weights and two Adam moments) and
             fsyncs it, into `step_N.tmp/`, renamed to `step_N/` when every rank is done.
  dcp        torch.distributed.checkpoint save/load of a GPT-like state dict (embedding +
             transformer blocks, fp32), FileSystemWriter(thread_count=T, sync_files=True).

  For both torch workloads, per target: `save` (time until the trainer has control back),
  `durable` (time from the save's start until every byte is in the store), `warm` restore
  (same node, page cache dropped) and `cold` restore (a fresh node: empty cache, new mount).
  Targets (the peers):
    raw        the raw cache disk: the ceiling for save and warm restore
    ckptfs     `ckptfs mount --store s3://...` (durable: ckptfs.wait_durable): the default data
               path, FUSE passthrough (the kernel reads/writes whole cached files directly)
    ckptfs-fuse  the same with `--no-passthrough`: the daemon serves every byte (user space)
               Both ckptfs targets run in every section (fio, mlperf, dcp, profiles); the data
               path each mount actually ran (`ckptfs status --json` -> data_path: mode,
               off_reason, passthrough opens) is recorded per mount and per run.
    s3fs       s3fs-fuse with its local cache (use_cache=DIR), defaults otherwise
    rclone     rclone mount --vfs-cache-mode writes, defaults otherwise
    s3torch    (dcp only) s3torchconnector's S3StorageWriter/S3StorageReader straight to S3
    ceiling    boto3's transfer manager moving the same files up and down (64 MiB parts,
               8 in flight, all files at once): the store's own ceiling
  For peers, `durable` is polled in the store (every object present with its full size).
  A peer that cannot run is reported as "not available: <reason>", never estimated.

  The ckptfs daemon's RSS is sampled every 0.1 s during every run (peak reported, with the
  bytes that went through that mount). A last section records py-spy profiles of the daemon
  during a fio write, a fio read after drop_caches and a cold restore, for each ckptfs target.

Method: repeats (quick 1, full 3) with the target order rotated per repeat; medians with
min/max; ratios are computed per repeat from back-to-back runs, then the median taken.
os.getloadavg() is recorded at the start and end of every measurement. Before every timed
run: sync, then touch+free some anonymous memory (see scripts/bench_fio.py for why).
Reads that compare restores drop the page cache (sync; echo 3 > /proc/sys/vm/drop_caches).

Output: --out (default bench-results/perf): results.json, results.md, profiles; and unless
--no-docs: docs/PERFORMANCE.md, docs/bench/perf.json, docs/bench/perf-*.png.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import BenchError, GiB, MiB, RssSampler, is_mounted, loadavg, log, read_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUCKET = "bench"
REGION = "us-east-1"
CEIL_PART = 64 * MiB
CEIL_CONC = 8
# rclone compares the md5 of a file with the ETag of its PUT; moto answers rclone's PUTs with an
# ETag that is not the md5 of the bytes it stored (a different one at every retry, while the
# stored bytes equal the file's), so every upload fails "corrupted on transfer: md5 hash differ"
# and is retried forever (8 MiB multipart uploads fail the same way, with a 400 at completion),
# and a whole-file read of such an object fails at close (EIO) on the same comparison.
# rclone runs with --ignore-checksum (uploads) and --no-checksum (VFS reads and writes), and
# every uploaded object is then checked with sha256 against the file (verify_upload): a
# corrupted upload makes that run an error.
RCLONE_FLAGS = ["--ignore-checksum", "--no-checksum"]
# the ckptfs targets: name -> extra `ckptfs mount` arguments. "ckptfs" keeps its name (and its
# mount names and store prefixes) so results stay comparable with runs before passthrough.
CKPTFS_TARGETS: dict[str, list[str]] = {"ckptfs": [], "ckptfs-fuse": ["--no-passthrough"]}


def tsfx(target: str) -> str:
    """Suffix of a ckptfs target's mount names and store prefixes: '' or '-fuse'."""
    return target[len("ckptfs"):]


def main_thread_cpu_s(pid: int | None) -> float | None:
    """utime + stime of a daemon's main thread (tid = pid), in seconds: the trio thread that
    answers FUSE requests (inline with the default --io-threads 0). Reads of cache files for
    uploads and the store's HTTP calls run in worker threads (trio.to_thread), so the rest of
    the daemon's CPU (process total - this) is mostly upload/restore work."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def io_delta(st0: dict | None, st1: dict | None) -> dict:
    """What the daemon itself served between two `ckptfs status --json` readings (`io` counts
    only the requests the daemon served; passthrough I/O never reaches it), and the opens
    answered in passthrough."""
    if not st0 or not st1:
        return {}
    io0, io1 = st0.get("io") or {}, st1.get("io") or {}
    dp0, dp1 = st0.get("data_path") or {}, st1.get("data_path") or {}
    out = {"daemon_bytes_written": io1.get("bytes_written", 0) - io0.get("bytes_written", 0),
           "daemon_bytes_read": io1.get("bytes_read", 0) - io0.get("bytes_read", 0)}
    if dp1:
        out["passthrough_opens"] = (dp1.get("passthrough_opens", 0)
                                    - dp0.get("passthrough_opens", 0))
        out["data_path"] = dp1.get("mode")
    return out



def mmm(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return [statistics.median(xs), min(xs), max(xs)]


def fmt_mmm(t, fmt="{:.2f}"):
    if not t:
        return "—"
    med, lo, hi = t
    if lo == hi:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(lo)}–{fmt.format(hi)}]"


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def dir_bytes(d: Path) -> dict[str, int]:
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(d))] = p.stat().st_size
    return out


# ----------------------------------------------------------------------------------------------
# torch workload pieces (rank processes are spawned: this module is re-imported there)


def _rank_state(rank: int, nbytes: int):
    """One MLPerf-like rank shard: fp16 model (2 B/param) + fp32 optimizer state (master
    weights, exp_avg, exp_avg_sq: 12 B/param) = 14 B/param, in tensors of <= 32M params."""
    import torch

    g = torch.Generator().manual_seed(1234 + rank)
    params = nbytes // 14
    model, optim = {}, {}
    i = 0
    left = params
    while left > 0:
        n = min(left, 32 << 20)
        w = torch.randn(n, generator=g)
        model[f"layer{i}.weight"] = w.to(torch.float16)
        optim[f"layer{i}"] = {"master": w, "exp_avg": torch.randn(n, generator=g),
                              "exp_avg_sq": torch.rand(n, generator=g)}
        left -= n
        i += 1
    return {"rank": rank, "model": model, "optimizer": optim, "step": 100}


def _rank_main(rank: int, nbytes: int, conn) -> None:
    import torch

    torch.set_num_threads(1)
    state = _rank_state(rank, nbytes)
    conn.send(("ready", None))
    while True:
        cmd, path = conn.recv()
        if cmd == "exit":
            return
        try:
            t0 = time.perf_counter()
            if cmd == "save":
                torch.save(state, path)
                fd = os.open(path, os.O_RDONLY)  # MLPerf: fsync at the end of the checkpoint
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                n = os.path.getsize(path)
            elif cmd == "load":
                sd = torch.load(path, map_location="cpu", weights_only=True)
                n = sum(t.numel() * t.element_size() for t in sd["model"].values())
                n += sum(t.numel() * t.element_size() for o in sd["optimizer"].values()
                         for t in o.values())
                del sd
            else:
                raise ValueError(cmd)
            conn.send(("ok", (time.perf_counter() - t0, n)))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{e.__class__.__name__}: {e}"))


class Ranks:
    """R rank processes, each holding its shard; save/load run in all of them at once."""

    def __init__(self, n: int, total: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for r in range(n):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, total // n, b), daemon=True)
            p.start()
            self.conns.append(a)
            self.procs.append(p)
        for c in self.conns:
            if c.recv()[0] != "ready":
                raise BenchError("rank process failed to start")

    def run(self, cmd: str, paths: list[str]) -> tuple[float, int]:
        t0 = time.perf_counter()
        for c, p in zip(self.conns, paths):
            c.send((cmd, p))
        total, errors = 0, []
        for c in self.conns:
            st, val = c.recv()
            if st == "ok":
                total += val[1]
            else:
                errors.append(val)
        secs = time.perf_counter() - t0
        if errors:
            raise BenchError(f"rank {cmd} failed: {errors[0]}")
        return secs, total

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("exit", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()  # our own child process, by handle


def gpt_state_dict(nbytes: int):
    """A GPT-like fp32 state dict of about `nbytes`: token + position embeddings, blocks of
    (ln, qkv, proj, mlp up/down), final ln."""
    import torch

    d, vocab, ctx = 1024, 32000, 2048
    g = torch.Generator().manual_seed(7)
    sd = {"tok_emb.weight": torch.randn(vocab, d, generator=g),
          "pos_emb.weight": torch.randn(ctx, d, generator=g)}
    per_block = (3 * d * d + d * d + 8 * d * d + 4 * d) * 4
    nblocks = max(1, (nbytes - (vocab + ctx) * d * 4) // per_block)
    for i in range(nblocks):
        p = f"blocks.{i}."
        sd[p + "ln1.weight"] = torch.ones(d)
        sd[p + "attn.qkv.weight"] = torch.randn(3 * d, d, generator=g) * 0.02
        sd[p + "attn.proj.weight"] = torch.randn(d, d, generator=g) * 0.02
        sd[p + "ln2.weight"] = torch.ones(d)
        sd[p + "mlp.up.weight"] = torch.randn(4 * d, d, generator=g) * 0.02
        sd[p + "mlp.down.weight"] = torch.randn(d, 4 * d, generator=g) * 0.02
        sd[p + "mlp.up.bias"] = torch.randn(4 * d, generator=g)
    sd["ln_f.weight"] = torch.ones(d)
    return {"model": sd}


# ----------------------------------------------------------------------------------------------
# peers: FUSE mounts of other tools, run in the foreground so we own their pid


class PeerMount:
    def __init__(self, name: str, cmd: list[str], mnt: Path, env: dict, logf: Path) -> None:
        self.name, self.cmd, self.mnt, self.env, self.logf = name, cmd, mnt, env, logf
        self.proc: subprocess.Popen | None = None

    def open(self, timeout: float = 30) -> None:
        self.mnt.mkdir(parents=True, exist_ok=True)
        with open(self.logf, "a") as lf:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=lf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not is_mounted(self.mnt):
            if self.proc.poll() is not None:
                raise BenchError(f"{self.name} exited {self.proc.returncode}: "
                                 f"{read_file(self.logf)[-400:]}")
            if time.monotonic() > deadline:
                self.close()
                raise BenchError(f"{self.name} did not mount within {timeout}s")
            time.sleep(0.1)

    def close(self) -> None:
        if is_mounted(self.mnt):
            r = subprocess.run(["fusermount3", "-u", str(self.mnt)], capture_output=True,
                               text=True, timeout=120, check=False)
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True,
                               timeout=60, check=False)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.terminate()  # our own child, by pid
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(timeout=10)
        if is_mounted(self.mnt):
            log(f"!! {self.mnt} still mounted")


# ----------------------------------------------------------------------------------------------
# the run


class Perf:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out)
        self.t0 = time.monotonic()
        self.res: dict = {"meta": {}, "config": {}, "fio": [], "torch": [], "ceiling": [],
                          "peers": {}, "mounts": [], "profiles": {}, "errors": [],
                          "loadavg_start": loadavg()}
        self.rss = RssSampler(0.1)
        self.moto = None
        self.s3 = None
        self.step_no = 0
        self.open_mounts: list = []
        self.peer_mounts: list[PeerMount] = []

    # -- bookkeeping --

    def progress(self, msg: str) -> None:
        el = time.monotonic() - self.t0
        log(f"[{int(el) // 60:02d}:{int(el) % 60:02d}] {msg}")

    def error(self, msg: str) -> None:
        self.res["errors"].append(msg)
        self.progress(f"!! {msg}")

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.res["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / "results.json.tmp"
        tmp.write_text(json.dumps(self.res, indent=1, default=str) + "\n")
        os.replace(tmp, self.out / "results.json")

    def hygiene(self) -> None:
        from bench_fio import touch_memory

        os.sync()
        touch_memory(self.a.touch)

    # -- setup --

    def setup(self) -> None:
        from bench_fio import find_ckptfs, machine_info
        from bench_restore import MotoServer, s3_client

        a = self.a
        self.ckptfs = find_ckptfs(None)
        self.work = Path(tempfile.mkdtemp(prefix="ckptfs-perf-", dir=a.workdir))
        self.raw = self.work / "raw"
        self.raw.mkdir()
        self.out.mkdir(parents=True, exist_ok=True)
        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"})
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
            os.environ.pop(k, None)
        self.moto = MotoServer(sys.executable, self.work)
        self.moto.start()
        self.s3 = s3_client(self.moto.url)
        self.s3.create_bucket(Bucket=BUCKET)
        meta = machine_info(self.ckptfs, self.work)
        for k in ("s3fs", "rclone"):
            meta[k] = (subprocess.run([k, "--version"], capture_output=True, text=True,
                                      check=False)
                       .stdout.splitlines() or ["?"])[0] if shutil.which(k) else None
        try:
            import torch
            meta["torch"] = torch.__version__
        except ImportError:
            meta["torch"] = None
        try:
            from importlib.metadata import version
            meta["s3torchconnector"] = version("s3torchconnector")
        except Exception:  # noqa: BLE001
            meta["s3torchconnector"] = None
        probe = "import moto; print(moto.__version__)"
        meta["moto"] = subprocess.run([sys.executable, "-c", probe],
                                      capture_output=True, text=True, check=False).stdout.strip()
        self.res["meta"] = meta
        self.res["config"] = {
            "mode": "quick" if a.quick else "full",
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": [sys.argv[0], *sys.argv[1:]], "repeats": a.repeats,
            "fio_size": a.fio_size, "fio_jobs": a.jobs, "torch_size": a.torch_size,
            "ckptfs_targets": a.ckptfs_targets, "clk_tck": os.sysconf("SC_CLK_TCK"),
            "fio_jobs_by_target": {t: self.fio_jobs(t) for t in a.ckptfs_targets},
            "ranks": a.ranks, "dcp_threads": a.dcp_threads, "touch": a.touch,
            "workdir": str(self.work), "store": f"moto_server {self.moto.url} "
            f"({shlex.join(self.moto.cmd)})",
            "ckptfs_mount": shlex.join(["ckptfs", "mount", "MNT", "--cache-dir", "DIR",
                                        *self.ckptfs_args("PREFIX")]),
            "ckptfs_mounts": {t: shlex.join(["ckptfs", "mount", "MNT", "--cache-dir", "DIR",
                                             *self.ckptfs_args("PREFIX"), *CKPTFS_TARGETS[t]])
                              for t in a.ckptfs_targets},
            "ceiling": f"boto3 upload_file/download_file of every file in parallel, "
                       f"TransferConfig(multipart_chunksize={CEIL_PART >> 20} MiB, "
                       f"max_concurrency={CEIL_CONC})",
        }
        self.progress(f"moto_server {self.moto.url}; work dir {self.work}; "
                      f"results {self.out.absolute()}")

    def ckptfs_args(self, prefix: str) -> list[str]:
        url = self.moto.url if self.moto else "URL"
        return ["--store", f"s3://{BUCKET}/{prefix}", "--s3-endpoint", url, "--s3-path-style"]

    def fio_jobs(self, target: str) -> list[int]:
        """The fio job counts a target runs at (ckptfs-fuse: --fuse-jobs, default --jobs)."""
        if target == "ckptfs-fuse" and self.a.fuse_jobs:
            return [nj for nj in self.a.jobs if nj in self.a.fuse_jobs]
        return list(self.a.jobs)

    def new_ckptfs(self, name: str, prefix: str, target: str = "ckptfs"):
        from bench_fio import Mount

        cache = self.work / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        m = Mount(self.ckptfs, self.work / f"mnt-{name}", cache,
                  [*self.ckptfs_args(prefix), *CKPTFS_TARGETS[target]])
        m.keep_log_as = self.out / f"daemon-{name}.log"
        m.open()
        self.rss.watch(m.pid)
        m.info["name"] = name
        m.info["target"] = target
        self.open_mounts.append(m)
        dp = (m.status() or {}).get("data_path")
        m.info["data_path_at_mount"] = dp
        if target == "ckptfs" and (dp or {}).get("mode") != "passthrough":
            self.note(f"target ckptfs, mount {name}: NOT passthrough: "
                      f"{(dp or {}).get('off_reason') if dp else 'status has no data_path'}")
        return m

    def note(self, msg: str) -> None:
        self.res.setdefault("notes", []).append(msg)
        self.progress(f"!! {msg}")

    def close_ckptfs(self, m, bytes_through: int | None = None) -> None:
        peak = self.rss.peak_mib(m.pid) if m.pid else None
        try:
            m.close()
        finally:
            if m in self.open_mounts:
                self.open_mounts.remove(m)
        m.info["peak_rss_sampled_mib"] = peak
        m.info["bytes_through"] = bytes_through
        # the data path the mount ran: its last status (at unmount), else the one at mount
        m.info["data_path"] = ((m.info.get("final_status") or {}).get("data_path")
                               or m.info.get("data_path_at_mount"))
        self.res["mounts"].append(m.info)
        if not is_mounted(m.mnt):
            shutil.rmtree(m.cache, ignore_errors=True)

    # -- fio --

    def fio(self) -> None:
        from bench_fio import check_files, clean_dir, run_fio

        a = self.a
        cts = a.ckptfs_targets
        self.raw_fio = self.raw / "fio"
        self.raw_fio.mkdir(exist_ok=True)
        jobfile_out = self.out / "last-fio.json"
        n = a.repeats * sum(1 + sum(nj in self.fio_jobs(t) for t in cts) for nj in a.jobs) * 3
        k = 0
        for rep in range(a.repeats):
            mounts: dict = {}
            through = dict.fromkeys(cts, 0)
            try:
                for t in cts:
                    mounts[t] = self.new_ckptfs(f"fio{rep}{tsfx(t)}", f"fio{rep}{tsfx(t)}", t)
                for ji, nj in enumerate(a.jobs):
                    per_job = (a.fio_size // nj) // MiB * MiB
                    tl = ["raw"] + [t for t in cts if nj in self.fio_jobs(t)]
                    rot = (rep + ji) % len(tl)
                    order = tl[rot:] + tl[:rot]
                    for phase in ("write", "read-warm", "read-cold"):
                        for target in order:
                            m = mounts.get(target)
                            d = self.raw_fio if m is None else m.mnt
                            if phase == "write":
                                clean_dir(d)
                                if m is not None:
                                    m.wait_idle(600)
                            st0 = m.status() if m is not None else None
                            if phase == "read-cold":
                                drop_caches()
                            self.hygiene()
                            la0 = loadavg()
                            cpu0 = m.cpu_s() if m is not None else None
                            mcpu0 = main_thread_cpu_s(m.pid) if m is not None else None
                            rec = run_fio(phase, d, per_job, nj, jobfile_out,
                                          timeout=120 + a.fio_size / 10e6)
                            rec.update(rep=rep, numjobs=nj, phase=phase, target=target,
                                       loadavg=[la0, loadavg()])
                            if m is not None:
                                # main thread first, then all: its delta never exceeds the total
                                mcpu1 = main_thread_cpu_s(m.pid)
                                rec["daemon_cpu_s"] = round(m.cpu_s() - cpu0, 3)
                                if mcpu0 is not None and mcpu1 is not None:
                                    rec["daemon_main_thread_cpu_s"] = round(mcpu1 - mcpu0, 3)
                                rec.update(io_delta(st0, m.status()))
                                through[target] += (rec.get("io_bytes", 0)
                                                    if phase == "write" else 0)
                            if phase == "write" and "error" not in rec:
                                bad = check_files(d, per_job, nj)
                                if bad:
                                    rec["error"] = bad
                            if phase == "write" and m is not None:
                                drain, _ = m.wait_idle(600)
                                rec["upload_drain_s"] = round(drain, 2)
                            self.res["fio"].append(rec)
                            k += 1
                            if "error" in rec:
                                self.error(f"fio {phase} nj={nj} {target}: {rec['error']}")
                            served = ""
                            if m is not None:
                                b = rec.get("daemon_bytes_written" if phase == "write"
                                            else "daemon_bytes_read")
                                served = (f"  daemon served {b / MiB:.0f} MiB, "
                                          f"{rec.get('passthrough_opens', 0)} pt opens"
                                          if b is not None else "")
                            self.progress(f"fio {k}/{n}: rep {rep + 1} {phase:9s} nj={nj} "
                                          f"{target:11s} {rec.get('mbps', 0):7.0f} MB/s"
                                          f"  load {la0[0]:.1f}{served}")
                            self.save()
                    clean_dir(self.raw_fio)
                    for m in mounts.values():
                        m.wait_idle(600)
                        clean_dir(m.mnt)
                    for m in mounts.values():
                        m.wait_idle(600)
            finally:
                for t, m in mounts.items():
                    self.close_ckptfs(m, through[t])

    # -- store helpers --

    def wait_objects(self, prefix: str, want: dict[str, int], t0: float,
                     timeout: float = 900, peer_log: Path | None = None) -> float:
        """Seconds from t0 until every key prefix/<rel> exists with its size. Gives up when the
        peer's log shows an upload failing a second time (rclone retries forever)."""
        while True:
            text = read_file(peer_log) if peer_log is not None else ""
            if "failed to upload try #2" in text:
                bad = [ln for ln in text.splitlines() if " ERROR " in ln]
                raise BenchError(f"upload keeps failing: {bad[0].strip()[:300] if bad else ''}")
            have = {}
            pag = self.s3.get_paginator("list_objects_v2")
            for page in pag.paginate(Bucket=BUCKET, Prefix=prefix + "/"):
                for o in page.get("Contents", []):
                    have[o["Key"][len(prefix) + 1:]] = o["Size"]
            if all(have.get(k) == v for k, v in want.items()):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                raise BenchError(f"objects under {prefix} not complete after {timeout:.0f}s")
            time.sleep(0.1)

    def delete_prefix(self, prefix: str) -> None:
        pag = self.s3.get_paginator("list_objects_v2")
        for page in pag.paginate(Bucket=BUCKET, Prefix=prefix + "/"):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys})

    def ceiling(self, wl: str, rep: int, src: Path, keep: bool = False) -> dict:
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_chunksize=CEIL_PART, multipart_threshold=CEIL_PART,
                             max_concurrency=CEIL_CONC, use_threads=True)
        files = dir_bytes(src)
        prefix = f"ceiling/{wl}/{rep}"
        rec = {"workload": wl, "rep": rep, "target": "ceiling", "bytes": sum(files.values()),
               "files": len(files)}
        self.hygiene()
        la0 = loadavg()
        moto0 = self.moto.cpu_s()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(files)) as ex:
            list(ex.map(lambda r: self.s3.upload_file(str(src / r), BUCKET, f"{prefix}/{r}",
                                                      Config=cfg), files))
        rec["upload_s"] = round(time.perf_counter() - t0, 3)
        rec["upload_moto_busy"] = round((self.moto.cpu_s() - moto0) / rec["upload_s"], 2)
        dest = self.work / "ceiling-dl"
        shutil.rmtree(dest, ignore_errors=True)
        for r in files:
            (dest / r).parent.mkdir(parents=True, exist_ok=True)
        self.hygiene()
        moto0 = self.moto.cpu_s()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(files)) as ex:
            list(ex.map(lambda r: self.s3.download_file(BUCKET, f"{prefix}/{r}", str(dest / r),
                                                        Config=cfg), files))
        rec["download_s"] = round(time.perf_counter() - t0, 3)
        rec["download_moto_busy"] = round((self.moto.cpu_s() - moto0) / rec["download_s"], 2)
        got = dir_bytes(dest)
        if got != files:
            raise BenchError("ceiling download differs from the upload")
        rec["loadavg"] = [la0, loadavg()]
        shutil.rmtree(dest, ignore_errors=True)
        if not keep:
            self.delete_prefix(prefix)
        return rec

    # -- torch workloads --

    def torch_all(self) -> None:
        a = self.a
        for wl in a.workloads:
            self.workload(wl)

    def workload(self, wl: str) -> None:
        a = self.a
        ranks = None
        sd = sd_out = None
        try:
            t0 = time.perf_counter()
            if wl == "mlperf":
                ranks = Ranks(a.ranks, a.torch_size)
            else:
                sd = gpt_state_dict(a.torch_size)
                import torch
                sd_out = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}}
            self.progress(f"{wl}: state of {a.torch_size / GiB:.2f} GiB built in "
                          f"{time.perf_counter() - t0:.1f}s")
            cts = a.ckptfs_targets
            targets = (["raw", *cts, "s3fs", "rclone"] + (["s3torch"] if wl == "dcp" else []))
            mas: dict = {}
            through = dict.fromkeys(cts, 0)
            try:
                for t in cts:  # one node per ckptfs target takes every checkpoint in turn
                    mas[t] = self.new_ckptfs(f"{wl}{tsfx(t)}-A", f"{wl}{tsfx(t)}", t)
                for rep in range(a.repeats):
                    order = targets[rep % len(targets):] + targets[:rep % len(targets)]
                    for t in order:
                        if self.res["peers"].get(f"{t}:{wl}", "ok") != "ok":
                            continue
                        rec = {"workload": wl, "rep": rep, "target": t}
                        self.progress(f"{wl} rep {rep + 1}/{a.repeats}: {t} ...")
                        try:
                            if t in CKPTFS_TARGETS:
                                self.run_ckptfs(wl, rep, rec, ranks, sd, sd_out, mas[t], t)
                            else:
                                getattr(self, f"run_{t}")(wl, rep, rec, ranks, sd, sd_out, None)
                        except KeyboardInterrupt:
                            raise
                        except BaseException as e:  # noqa: BLE001
                            # (DCP's CheckpointException is a BaseException)
                            rec["error"] = self.explain(t, e)
                            self.error(f"{wl} {t} rep {rep + 1}: {rec['error']}")
                            rec["traceback"] = traceback.format_exc()[-2000:]
                            if rep == 0 and t != "raw" and t not in CKPTFS_TARGETS:
                                self.res["peers"][f"{t}:{wl}"] = f"not available: {rec['error']}"
                        if t in through:
                            through[t] += rec.get("bytes", 0)
                        self.res["torch"].append(rec)
                        dp = ""
                        if rec.get("save_io"):
                            io = rec["save_io"]
                            dp = (f"; data path {io.get('data_path')}, daemon served "
                                  f"{io.get('daemon_bytes_written', 0) / MiB:.0f} MiB of the "
                                  f"save, {io.get('passthrough_opens', 0)} pt opens")
                        self.progress("   " + ", ".join(
                            f"{k} {rec[k]:.2f}s" for k in ("save_s", "durable_s", "warm_s",
                                                           "cold_s") if rec.get(k) is not None)
                            + dp)
                        self.save()
                    # the store's ceiling on the same files (the raw target's)
                    src = self.raw / wl / f"step_{rep}"
                    # rclone's own upload failed in this repeat: measure its cold restore
                    # over the ceiling's objects instead (run_rclone_ro)
                    rclone_ro = not any(r["workload"] == wl and r["rep"] == rep and
                                        r["target"] == "rclone" and "error" not in r
                                        for r in self.res["torch"])
                    if src.exists():
                        self.progress(f"{wl} rep {rep + 1}: store ceiling (boto3) ...")
                        try:
                            c = self.ceiling(wl, rep, src, keep=rclone_ro)
                            self.res["ceiling"].append(c)
                            self.progress(f"   upload {c['upload_s']:.2f}s, download "
                                          f"{c['download_s']:.2f}s")
                            if rclone_ro:
                                self.progress(f"{wl} rep {rep + 1}: rclone cold restore of "
                                              f"the ceiling's objects ...")
                                try:
                                    r = self.run_rclone_ro(wl, rep, ranks, sd_out,
                                                           f"ceiling/{wl}/{rep}")
                                except Exception as e:  # noqa: BLE001
                                    r = {"workload": wl, "rep": rep, "target": "rclone-ro",
                                         "error": self.explain("rclone", e)}
                                    self.error(f"{wl} rclone-ro rep {rep + 1}: {r['error']}")
                                self.res["torch"].append(r)
                                self.progress(f"   cold {r.get('cold_s')}s")
                        except Exception as e:  # noqa: BLE001
                            self.error(f"{wl} ceiling rep {rep + 1}: {e}")
                        finally:
                            self.delete_prefix(f"ceiling/{wl}/{rep}")
                        shutil.rmtree(src, ignore_errors=True)
                    self.save()
            finally:
                for t, m in mas.items():
                    self.close_ckptfs(m, through[t])
        finally:
            if ranks is not None:
                ranks.close()

    def explain(self, t: str, e: BaseException) -> str:
        """The exception as one line, plus the peer's own complaint from its log if any."""
        msg = f"{e.__class__.__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        logf = self.out / f"{t}.log"
        if t in ("s3fs", "rclone") and logf.exists():
            bad = [ln for ln in read_file(logf).splitlines()
                   if "corrupted on transfer" in ln or " ERROR " in ln or "error" in ln.lower()]
            line = bad[0].strip()[:300] if bad else ""
            if line and line not in msg:  # (wait_objects already quotes the log line)
                msg += f" — {t} log: {line}"
        return msg

    # save/load through a directory, for the file-system targets

    def fs_save(self, wl: str, d: Path, ranks, sd) -> tuple[float, int]:
        """Save one checkpoint into the directory `d` (must not exist). Returns (s, bytes)."""
        if wl == "mlperf":
            tmp = d.with_name(d.name + ".tmp")
            tmp.mkdir(parents=True)
            t0 = time.perf_counter()
            _, _n = ranks.run("save", [str(tmp / f"rank{r}.pt") for r in range(len(ranks.conns))])
            os.rename(tmp, d)
            return time.perf_counter() - t0, sum(dir_bytes(d).values())
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        d.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        dcp.save(sd, storage_writer=FileSystemWriter(str(d), thread_count=self.a.dcp_threads,
                                                     sync_files=True))
        return time.perf_counter() - t0, sum(dir_bytes(d).values())

    def fs_load(self, wl: str, d: Path, ranks, sd_out) -> float:
        if wl == "mlperf":
            secs, _ = ranks.run("load", [str(d / f"rank{r}.pt") for r in range(len(ranks.conns))])
            return secs
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        t0 = time.perf_counter()
        dcp.load(sd_out, storage_reader=FileSystemReader(str(d)))
        return time.perf_counter() - t0

    def timed(self, rec: dict, key: str, fn, drop: bool = True):
        if drop:
            drop_caches()
        self.hygiene()
        la0 = loadavg()
        moto0 = self.moto.cpu_s()
        t0 = time.perf_counter()
        val = fn()
        secs = time.perf_counter() - t0
        rec.setdefault("loadavg", {})[key] = [la0, loadavg()]
        rec.setdefault("moto_busy", {})[key] = round((self.moto.cpu_s() - moto0) / max(secs, 1e-6),
                                                     2)
        return val

    def run_raw(self, wl, rep, rec, ranks, sd, sd_out, ma) -> None:
        d = self.raw / wl / f"step_{rep}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(d.with_name(d.name + ".tmp"), ignore_errors=True)
        s, n = self.timed(rec, "save", lambda: self.fs_save(wl, d, ranks, sd), drop=False)
        rec.update(save_s=round(s, 3), bytes=n)
        rec["warm_s"] = round(self.timed(rec, "warm", lambda: self.fs_load(wl, d, ranks, sd_out)),
                              3)
        # kept for the ceiling run of this repeat, then removed

    def run_ckptfs(self, wl, rep, rec, ranks, sd, sd_out, ma, target="ckptfs") -> None:
        import ckptfs

        d = ma.mnt / f"step_{rep}"
        _, st0 = ma.wait_idle(600)
        st0 = st0 or ma.status()
        cpu0 = ma.cpu_s()
        mcpu0 = main_thread_cpu_s(ma.pid)
        cpu_saved = []
        t0 = time.perf_counter()

        def save_and_wait():
            s, n = self.fs_save(wl, d, ranks, sd)
            # /proc reads: the daemon's CPU (main thread, then all threads: the main thread's
            # delta never exceeds the total's) until the save returned
            mc = main_thread_cpu_s(ma.pid)
            cpu_saved.extend([ma.cpu_s(), mc])
            rec.update(save_s=round(s, 3), bytes=n)
            ckptfs.wait_durable(str(d), timeout=1800)
            return time.perf_counter() - t0

        rec["durable_s"] = round(self.timed(rec, "save+durable", save_and_wait, drop=False), 3)
        rec["commit_to_durable_s"] = round(rec["durable_s"] - rec["save_s"], 3)
        rec["daemon_cpu_save_s"] = round(ma.cpu_s() - cpu0, 2)  # save + uploads until durable
        rec["daemon_cpu_during_save_s"] = round(cpu_saved[0] - cpu0, 3)
        if mcpu0 is not None and cpu_saved[1] is not None:
            rec["daemon_main_thread_cpu_during_save_s"] = round(cpu_saved[1] - mcpu0, 3)
        st1 = ma.status()
        rec["save_io"] = io_delta(st0, st1)
        rec["data_path"] = rec["save_io"].get("data_path")
        rec["warm_s"] = round(self.timed(rec, "warm", lambda: self.fs_load(wl, d, ranks, sd_out)),
                              3)
        rec["warm_io"] = io_delta(st1, ma.status())
        # a fresh node: empty cache dir, same store
        mb = self.new_ckptfs(f"{wl}{tsfx(target)}-B{rep}", f"{wl}{tsfx(target)}", target)
        try:
            t1 = time.perf_counter()
            while True:
                st = mb.status() or {}
                sets = (st.get("tiering") or {}).get("sets") or []
                if any(x.get("path") == d.name and x.get("state") == "durable" for x in sets):
                    break
                if time.perf_counter() - t1 > 120:
                    raise BenchError(f"{d.name} not visible on the fresh node after 120 s")
                time.sleep(0.1)
            rec["cold_visible_s"] = round(time.perf_counter() - t1 + mb.info["mount_s"], 3)
            cpu0 = mb.cpu_s()
            rec["cold_s"] = round(self.timed(
                rec, "cold", lambda: self.fs_load(wl, mb.mnt / d.name, ranks, sd_out)), 3)
            rec["daemon_cpu_cold_s"] = round(mb.cpu_s() - cpu0, 2)
            rec["cold_io"] = io_delta(st, mb.status())
            rec["cold_node_peak_rss_mib"] = self.rss.peak_mib(mb.pid)
        finally:
            self.close_ckptfs(mb, 0)
        rec["node_peak_rss_mib"] = self.rss.peak_mib(ma.pid)
        shutil.rmtree(d)  # deletes the set: its objects are GC'd by the daemon
        ma.wait_idle(600)

    def _peer(self, kind: str, prefix: str, cache: Path, mnt: Path) -> PeerMount:
        env = dict(os.environ)
        logf = self.out / f"{kind}.log"
        logf.unlink(missing_ok=True)
        if kind == "s3fs":
            if not shutil.which("s3fs"):
                raise BenchError("s3fs not installed (apt-get install s3fs failed?)")
            pw = self.work / "s3fs.passwd"
            pw.write_text("testing:testing\n")
            pw.chmod(0o600)
            cmd = ["s3fs", f"{BUCKET}:/{prefix}", str(mnt), "-f", "-o",
                   (f"passwd_file={pw},url={self.moto.url},use_path_request_style,"
                   f"use_cache={cache},endpoint={REGION}")]
        else:
            if not shutil.which("rclone"):
                raise BenchError("rclone not installed (apt-get install rclone failed?)")
            conf = self.work / "rclone.conf"
            conf.write_text(f"[moto]\ntype = s3\nprovider = Other\naccess_key_id = testing\n"
                            f"secret_access_key = testing\nendpoint = {self.moto.url}\n"
                            f"region = {REGION}\nforce_path_style = true\n")
            # rclone refuses a custom CA bundle with its own HTTP transport; plain http here
            env.pop("AWS_CA_BUNDLE", None)
            cmd = ["rclone", "--config", str(conf), "mount", f"moto:{BUCKET}/{prefix}", str(mnt),
                   "--vfs-cache-mode", "writes", "--cache-dir", str(cache),
                   *RCLONE_FLAGS]
        self.res["config"].setdefault(f"{kind}_cmd", shlex.join(cmd))
        cache.mkdir(parents=True, exist_ok=True)
        p = PeerMount(kind, cmd, mnt, env, logf)
        # s3fs needs the prefix to exist as a directory object or it shows an empty root
        if kind == "s3fs":
            self.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/", Body=b"")
        p.open()
        self.peer_mounts.append(p)
        return p

    def _close_peer(self, p: PeerMount) -> None:
        try:
            p.close()
        finally:
            if p in self.peer_mounts:
                self.peer_mounts.remove(p)

    def run_fuse_peer(self, kind, wl, rep, rec, ranks, sd, sd_out) -> None:
        prefix = f"{kind}/{wl}/{rep}"
        mnt = self.work / f"mnt-{kind}"
        cache = self.work / f"cache-{kind}"
        shutil.rmtree(cache, ignore_errors=True)
        p = self._peer(kind, prefix, cache, mnt)
        d = mnt / "step"
        try:
            t0 = time.perf_counter()

            def save_and_wait():
                s, n = self.fs_save(wl, d, ranks, sd)
                rec.update(save_s=round(s, 3), bytes=n)
                want = {f"step/{k}": v for k, v in dir_bytes(d).items()}
                return self.wait_objects(prefix, want, t0, timeout=120 + n / 2e6,
                                         peer_log=p.logf)

            rec["durable_s"] = round(self.timed(rec, "save+durable", save_and_wait, drop=False),
                                     3)
            rec["commit_to_durable_s"] = round(rec["durable_s"] - rec["save_s"], 3)
            rec["warm_s"] = round(self.timed(rec, "warm",
                                             lambda: self.fs_load(wl, d, ranks, sd_out)), 3)
            rec["verified"] = self.verify_upload(d, f"{prefix}/step")
        finally:
            self._close_peer(p)
        shutil.rmtree(cache, ignore_errors=True)
        cache2 = self.work / f"cache-{kind}-cold"
        shutil.rmtree(cache2, ignore_errors=True)
        p = self._peer(kind, prefix, cache2, mnt)
        try:
            rec["cold_s"] = round(self.timed(rec, "cold",
                                             lambda: self.fs_load(wl, d, ranks, sd_out)), 3)
        finally:
            self._close_peer(p)
            shutil.rmtree(cache2, ignore_errors=True)
            self.delete_prefix(prefix)
        self.res["peers"].setdefault(f"{kind}:{wl}", "ok")

    def verify_upload(self, d: Path, prefix: str) -> str:
        """sha256 of every file as the peer mount shows it against its object in the store
        (untimed). Raises BenchError on a difference."""
        def sha_file(path: Path) -> str:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while b := f.read(8 * MiB):
                    h.update(b)
            return h.hexdigest()

        def sha_obj(key: str) -> str:
            h = hashlib.sha256()
            body = self.s3.get_object(Bucket=BUCKET, Key=key)["Body"]
            while b := body.read(8 * MiB):
                h.update(b)
            return h.hexdigest()

        files = dir_bytes(d)
        bad = [r for r in files if sha_file(d / r) != sha_obj(f"{prefix}/{r}")]
        if bad:
            raise BenchError(f"sha256 of the stored object differs from the file: {bad[:3]}")
        return f"sha256 of {len(files)} stored objects = the files"

    def run_rclone_ro(self, wl: str, rep: int, ranks, sd_out, prefix: str) -> dict:
        """rclone's cold restore when its own upload failed: a fresh `rclone mount` (empty
        cache) over the objects the store-ceiling step uploaded from the same checkpoint
        (same bytes, same store), read the same way as every other cold restore."""
        rec = {"workload": wl, "rep": rep, "target": "rclone-ro", "source": prefix}
        mnt = self.work / "mnt-rclone"
        cache = self.work / "cache-rclone-ro"
        shutil.rmtree(cache, ignore_errors=True)
        p = self._peer("rclone", prefix, cache, mnt)
        try:
            rec["bytes"] = sum(o["Size"] for o in self.s3.list_objects_v2(
                Bucket=BUCKET, Prefix=prefix + "/").get("Contents", []))
            rec["cold_s"] = round(self.timed(rec, "cold",
                                             lambda: self.fs_load(wl, mnt, ranks, sd_out)), 3)
        finally:
            self._close_peer(p)
            shutil.rmtree(cache, ignore_errors=True)
        return rec

    def run_s3fs(self, wl, rep, rec, ranks, sd, sd_out, ma) -> None:
        self.run_fuse_peer("s3fs", wl, rep, rec, ranks, sd, sd_out)

    def run_rclone(self, wl, rep, rec, ranks, sd, sd_out, ma) -> None:
        self.run_fuse_peer("rclone", wl, rep, rec, ranks, sd, sd_out)

    def run_s3torch(self, wl, rep, rec, ranks, sd, sd_out, ma) -> None:
        try:
            import torch.distributed.checkpoint as dcp
            from s3torchconnector._s3client import S3Client, S3ClientConfig
            from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
        except Exception as e:
            raise BenchError(
                f"cannot import s3torchconnector: {e.__class__.__name__}: {e}") from e
        prefix = f"s3torch/{wl}/{rep}"
        path = f"s3://{BUCKET}/{prefix}"
        cfg = S3ClientConfig(force_path_style=True)

        def client():
            # S3StorageWriter/Reader take no endpoint: give their file system a client for moto
            return S3Client(region=REGION, endpoint=self.moto.url, s3client_config=cfg)

        def save():
            w = S3StorageWriter(region=REGION, path=path, s3client_config=cfg,
                                thread_count=self.a.dcp_threads)
            w.fs._client = client()
            dcp.save(sd, storage_writer=w)

        def load():
            r = S3StorageReader(region=REGION, path=path, s3client_config=cfg)
            r.fs._client = client()
            dcp.load(sd_out, storage_reader=r)

        def clock(fn):
            def run():
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0
            return run

        rec["save_s"] = round(self.timed(rec, "save", clock(save), drop=False), 3)
        rec["durable_s"] = rec["save_s"]  # the save returns when S3 has every object
        rec["commit_to_durable_s"] = 0.0
        rec["bytes"] = sum(o["Size"] for o in self.s3.list_objects_v2(
            Bucket=BUCKET, Prefix=prefix + "/").get("Contents", []))
        rec["cold_s"] = round(self.timed(rec, "cold", clock(load)), 3)
        self.delete_prefix(prefix)
        self.res["peers"].setdefault(f"s3torch:{wl}", "ok")

    # -- profiles --

    def profiles(self) -> None:
        """py-spy on the daemon of each ckptfs target: a fio write (nj=1), a fio read after
        drop_caches and a cold restore (sequential read of a fresh node's set). Not timed
        runs: sampling slows the daemon. Profile names of `ckptfs-fuse` end in `-fuse`."""
        pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.access(pyspy, os.X_OK):
            self.res["profiles"]["error"] = "not available: py-spy not installed"
            return
        for t in self.a.ckptfs_targets:
            self.profiles_of(pyspy, t)

    def profile(self, pyspy: str, m, name: str, target: str, fn) -> None:
        st0 = m.status()
        rec = self.pyspy(pyspy, m.pid, name, fn)
        io = io_delta(st0, m.status())
        rec.update(target=target, io=io, data_path=io.get("data_path"))
        self.res["profiles"][name] = rec
        self.progress(f"   profile {name}: {rec.get('samples')} samples in {rec.get('seconds')}"
                      f" s; data path {io.get('data_path')}")

    def profiles_of(self, pyspy: str, target: str) -> None:
        from bench_fio import run_fio

        sx = tsfx(target)
        size = self.a.fio_size
        m = self.new_ckptfs(f"prof{sx}", f"prof{sx}", target)
        try:
            self.profile(pyspy, m, f"fio-write-nj1{sx}", target, lambda: run_fio(
                "write", m.mnt, size, 1, self.out / "last-fio.json", 600))
            m.wait_idle(600)
            drop_caches()
            self.profile(pyspy, m, f"fio-read-cold-nj1{sx}", target, lambda: run_fio(
                "read-cold", m.mnt, size, 1, self.out / "last-fio.json", 600))
            # the file as a committed set: a directory renamed into place
            (m.mnt / "set.tmp").mkdir()
            os.rename(m.mnt / "ckpt.0", m.mnt / "set.tmp" / "ckpt.0")
            os.rename(m.mnt / "set.tmp", m.mnt / "set")
            import ckptfs
            ckptfs.wait_durable(str(m.mnt / "set"), timeout=900)
        finally:
            self.close_ckptfs(m, size)
        mb = self.new_ckptfs(f"prof{sx}-B", f"prof{sx}", target)
        try:
            t1 = time.monotonic()
            while not (mb.mnt / "set" / "ckpt.0").exists() and time.monotonic() - t1 < 60:
                time.sleep(0.2)
            drop_caches()

            def readall():
                with open(mb.mnt / "set" / "ckpt.0", "rb", buffering=0) as f:
                    while f.read(MiB):
                        pass

            self.profile(pyspy, mb, f"cold-restore-read{sx}", target, readall)
        finally:
            self.close_ckptfs(mb, 0)

    def pyspy(self, pyspy: str, pid: int, name: str, fn) -> dict:
        raw = self.out / f"profile-{name}.txt"
        svg = self.out / f"profile-{name}.svg"
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
        rec["top_self"] = sorted(([f, c / total] for f, c in selfc.items()),
                                 key=lambda x: -x[1])[:12] if total else []
        rec["top_inclusive"] = sorted(([f, c / total] for f, c in incl.items()),
                                      key=lambda x: -x[1])[:15] if total else []
        _ = svg
        return rec

    # -- cleanup --

    def cleanup(self) -> None:
        for p in list(self.peer_mounts):
            try:
                self._close_peer(p)
            except Exception as e:  # noqa: BLE001
                self.error(f"closing {p.name}: {e}")
        for m in list(self.open_mounts):
            try:
                self.close_ckptfs(m)
            except Exception as e:  # noqa: BLE001
                self.error(f"closing ckptfs mount: {e}")
        if self.moto is not None:
            self.moto.stop()
        self.rss.stop()
        still = [str(p) for p in self.work.glob("mnt-*") if is_mounted(p)] if hasattr(
            self, "work") else []
        if still:
            self.error(f"still mounted: {still}; temp dir kept")
        elif hasattr(self, "work") and not self.a.keep_tmp:
            shutil.rmtree(self.work, ignore_errors=True)
        (self.out / "last-fio.json").unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_perf.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="< 5 minutes: 256 MiB, 1 repeat")
    g.add_argument("--full", action="store_true",
                   help="fio 1 GiB, torch 512 MiB per checkpoint, 3 repeats (default)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--fio-size", default=None, help="bytes per fio run (all jobs together)")
    p.add_argument("--torch-size", default=None, help="bytes per torch checkpoint")
    p.add_argument("--jobs", default="1,4,8")
    p.add_argument("--ckptfs-targets", default=",".join(CKPTFS_TARGETS),
                   help="ckptfs targets to run: ckptfs (default mount: passthrough), "
                        "ckptfs-fuse (--no-passthrough); default both")
    p.add_argument("--fuse-jobs", default=None,
                   help="fio job counts for ckptfs-fuse (a subset of --jobs; default: --jobs)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--dcp-threads", type=int, default=4)
    p.add_argument("--workloads", default="mlperf,dcp")
    p.add_argument("--sections", default="fio,torch,profile")
    p.add_argument("--touch", default=None, help="memory touched+freed before each run")
    p.add_argument("--workdir", default="/var/tmp")
    p.add_argument("--out", default="bench-results/perf")
    p.add_argument("--no-docs", action="store_true",
                   help="do not write docs/PERFORMANCE.md, docs/bench/perf.json and plots")
    p.add_argument("--keep-tmp", action="store_true")
    return p


def parse_args(argv):
    from bench_fio import parse_size

    a = build_parser().parse_args(argv)
    a.quick = bool(a.quick)
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    a.fio_size = parse_size(a.fio_size or ("256m" if a.quick else "1g"))
    a.torch_size = parse_size(a.torch_size or ("256m" if a.quick else "512m"))
    a.touch = parse_size(a.touch or ("512m" if a.quick else "1g"))
    a.jobs = [int(x) for x in a.jobs.split(",")]
    a.fuse_jobs = [int(x) for x in a.fuse_jobs.split(",")] if a.fuse_jobs else None
    a.ckptfs_targets = [t for t in a.ckptfs_targets.split(",") if t]
    bad = [t for t in a.ckptfs_targets if t not in CKPTFS_TARGETS]
    if bad:
        raise SystemExit(f"bench_perf.py: unknown ckptfs target(s) {bad}; "
                         f"known: {', '.join(CKPTFS_TARGETS)}")
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.sections = [s for s in a.sections.split(",") if s]
    return a


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv=None) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        print("bench_perf.py: needs root (drop_caches, FUSE mounts)", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    perf = Perf(a)
    code = 0
    try:
        perf.setup()
        if "fio" in a.sections:
            perf.fio()
        if "torch" in a.sections:
            perf.torch_all()
        if "profile" in a.sections:
            perf.progress("profiles (py-spy) ...")
            try:
                perf.profiles()
            except Exception as e:  # noqa: BLE001
                perf.error(f"profiles: {e.__class__.__name__}: {e}")
    except KeyboardInterrupt:
        perf.error("interrupted: partial results")
        code = 130
    except Exception as e:  # noqa: BLE001
        perf.error(f"{e.__class__.__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    finally:
        perf.progress("cleaning up (unmount, stop moto) ...")
        perf.cleanup()
        perf.res["loadavg_end"] = loadavg()
        perf.save()
    import bench_report

    # The write-path overhead on RAM-backed ext4 (scripts/bench_overhead.py, which bench.sh
    # runs first in --full mode): its own section of docs/PERFORMANCE.md, with its commit.
    ov = REPO / "docs" / "bench" / "overhead.json"
    if not a.no_docs and ov.exists():
        perf.res["overhead"] = json.loads(ov.read_text())
    bench_report.write_all(perf.res, perf.out, None if a.no_docs else REPO / "docs")
    perf.progress(f"done: {perf.out / 'results.md'}"
                  + ("" if a.no_docs else ", docs/PERFORMANCE.md, docs/bench/perf.json"))
    return code


if __name__ == "__main__":
    sys.exit(main())
