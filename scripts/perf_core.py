"""The core of scripts/bench_perf.py: the run's results and bookkeeping, its store (a
moto_server), its ckptfs mounts and peer mounts, and the helpers every section uses (timed runs,
the store's objects, the daemon's CPU and I/O readings). The sections (perf_fio, perf_torch,
perf_peers, perf_profile) get a Perf in their constructor.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    BenchError,
    MiB,
    RssSampler,
    is_mounted,
    loadavg,
    log,
    read_file,
)

if TYPE_CHECKING:
    from bench_fio import Mount
    from bench_restore import MotoServer

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


# a JSON document: results.json and its records, a daemon's status
Json = dict[str, Any]
T = TypeVar("T")

def tsfx(target: str) -> str:
    """Suffix of a ckptfs target's mount names and store prefixes: '' or '-fuse'."""
    return target[len("ckptfs"):]


def io_delta(st0: Json | None, st1: Json | None) -> Json:
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



def fmt_mmm(t: Sequence[float] | None, fmt: str = "{:.2f}") -> str:
    if not t:
        return "—"
    med, lo, hi = t
    if lo == hi:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(lo)}–{fmt.format(hi)}]"


def cpu_delta(x1: float | None, x0: float | None) -> float:
    """x1 - x0 of two CPU-time readings of a process that ran at both (a None: it had exited,
    and the run fails with that)."""
    if x1 is None or x0 is None:
        raise BenchError("a process's CPU time could not be read (did it exit?)")
    return x1 - x0


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


class PeerMount:
    def __init__(self, name: str, cmd: list[str], mnt: Path, env: dict[str, str],
                 logf: Path) -> None:
        self.name, self.cmd, self.mnt, self.env, self.logf = name, cmd, mnt, env, logf
        self.proc: subprocess.Popen[bytes] | None = None

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
        self.res: Json = {"meta": {}, "config": {}, "fio": [], "torch": [], "ceiling": [],
                          "peers": {}, "mounts": [], "profiles": {}, "errors": [],
                          "loadavg_start": loadavg()}
        self.rss = RssSampler(0.1)
        self.moto: MotoServer | None = None
        self.s3: Any = None   # a boto3 S3 client (boto3 has no types)
        self.step_no = 0
        self.open_mounts: list[Mount] = []
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
        from bench_fio import machine_info
        from bench_restore import MotoServer, s3_client
        from benchlib import find_ckptfs

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
        self.server.start()
        self.s3 = s3_client(self.server.url)
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
            "workdir": str(self.work), "store": f"moto_server {self.server.url} "
            f"({shlex.join(self.server.cmd)})",
            "ckptfs_mount": shlex.join(["ckptfs", "mount", "MNT", "--cache-dir", "DIR",
                                        *self.ckptfs_args("PREFIX")]),
            "ckptfs_mounts": {t: shlex.join(["ckptfs", "mount", "MNT", "--cache-dir", "DIR",
                                             *self.ckptfs_args("PREFIX"), *CKPTFS_TARGETS[t]])
                              for t in a.ckptfs_targets},
            "ceiling": f"boto3 upload_file/download_file of every file in parallel, "
                       f"TransferConfig(multipart_chunksize={CEIL_PART >> 20} MiB, "
                       f"max_concurrency={CEIL_CONC})",
        }
        self.progress(f"moto_server {self.server.url}; work dir {self.work}; "
                      f"results {self.out.absolute()}")

    @property
    def server(self) -> MotoServer:
        """The store's moto_server (setup() starts it)."""
        assert self.moto is not None, "Perf.setup() starts the store"
        return self.moto

    def ckptfs_args(self, prefix: str) -> list[str]:
        url = self.server.url if self.moto else "URL"
        return ["--store", f"s3://{BUCKET}/{prefix}", "--s3-endpoint", url, "--s3-path-style"]

    def fio_jobs(self, target: str) -> list[int]:
        """The fio job counts a target runs at (ckptfs-fuse: --fuse-jobs, default --jobs)."""
        if target == "ckptfs-fuse" and self.a.fuse_jobs:
            return [nj for nj in self.a.jobs if nj in self.a.fuse_jobs]
        return list(self.a.jobs)

    def new_ckptfs(self, name: str, prefix: str, target: str = "ckptfs") -> Mount:
        from bench_fio import Mount

        cache = self.work / f"cache-{name}"
        shutil.rmtree(cache, ignore_errors=True)
        m = Mount(self.ckptfs, self.work / f"mnt-{name}", cache,
                  [*self.ckptfs_args(prefix), *CKPTFS_TARGETS[target]])
        m.keep_log_as = self.out / f"daemon-{name}.log"
        m.open()
        assert m.pid is not None  # Mount.open() read it from `ckptfs mount`
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

    def peak_mib(self, m: Mount) -> float | None:
        """The peak RSS sampled of a mount's daemon."""
        return self.rss.peak_mib(m.pid) if m.pid else None

    def close_ckptfs(self, m: Mount, bytes_through: int | None = None) -> None:
        peak = self.peak_mib(m)
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

    def timed(self, rec: Json, key: str, fn: Callable[[], T], drop: bool = True) -> T:
        if drop:
            drop_caches()
        self.hygiene()
        la0 = loadavg()
        moto0 = self.server.cpu_s()
        t0 = time.perf_counter()
        val = fn()
        secs = time.perf_counter() - t0
        rec.setdefault("loadavg", {})[key] = [la0, loadavg()]
        rec.setdefault("moto_busy", {})[key] = round(
            cpu_delta(self.server.cpu_s(), moto0) / max(secs, 1e-6), 2)
        return val

    def close_peer(self, p: PeerMount) -> None:
        try:
            p.close()
        finally:
            if p in self.peer_mounts:
                self.peer_mounts.remove(p)

    def cleanup(self) -> None:
        for p in list(self.peer_mounts):
            try:
                self.close_peer(p)
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
