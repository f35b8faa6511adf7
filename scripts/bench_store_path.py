#!/usr/bin/env python3
"""The store data path, measured (issue 37): ckptfs's upload and cold fetch of cache files against
the same bytes moved by boto3's own `upload_file` / `download_file` and by the AWS Common Runtime's
S3 client alone (the ceiling), on Ceph RGW and moto in one run.

    python scripts/bench_store_path.py                        # 4 x 256 MiB, 5 rounds, both servers
    python scripts/bench_store_path.py --files 4 --size 256M --rounds 5 --servers rgw,moto \\
        --out docs/bench/store_path

Methods, each in its own process (so its CPU time is its own, read from /proc/<pid>/stat):

  ckptfs        cachemgr.transfer.upload.Uploader.upload_file, and download.download_chunks in runs
                of 64 MiB, 8 in flight, each run written at its offset by a worker thread,
                through RetryingStore(S3Store) with the native data path (cachemgr.store.crt):
                the code the daemon runs for a file's upload (commit -> durable) and for a cold
                restore's prefetch (chunkfetch), CRC32C per chunk computed before the PUT and
                checked before a chunk is written, HEAD after each PUT, `auto` compression
                sampling; no FUSE, no index; the default data path (`--s3-transfer auto`): over
                http:// uploads by plain HTTP, the body by sendfile (cachemgr.store.plainhttp),
                restores' GETs by boto3
  ckptfs-mount  the same through a real mount (default options, FUSE passthrough): the files
                copied into `set.tmp/` of a fresh mount and the directory renamed to `set`
                (a directory commit), `ckptfs wait set` (durable); then a fresh mount on an
                empty cache dir and `ckptfs prefetch set` (a cold restore into the cache).
                Times: rename -> durable, and the prefetch command. CPU: the daemon's (from
                /proc/<pid>/stat), from before the first file is created to durable (the
                uploads start as each file is closed, before the commit), and over the
                prefetch; the `ckptfs` commands' own CPU is not in it
  ckptfs-crt    the same with uploads by the CRT (cachemgr.store.crt: S3Options(plain_http=
                False), the default over https://)
  ckptfs-crt-gets  the same with the restore's GETs by the CRT too (`--s3-transfer crt`:
                one ranged GET per run into a memfd, mapped)
  ckptfs-boto3  the same with S3Options(native=False): the buffered boto3 path
  boto3         boto3's S3Transfer upload_file / download_file (64 MiB parts, 8 threads)
  crt           awscrt.s3.S3Client alone: PUT send_filepath (CRC32C in the header, as ckptfs
                sends it), GET recv_filepath: the ceiling

Each round runs every method once, in a rotated order (interleaved rounds), on fresh keys; a
method uploads every file, then downloads every object into fresh files in --dir (RAM-backed
by default: the disk is not what is measured). Reported per method and server: median and
spread (min..max) of upload and download wall time as MB/s and as a ratio to `crt` in the same
round; CPU-s per GiB of the client process (user+system, every thread); CPU-s per GiB of the
server processes (radosgw + ceph-osd + ceph-mon; moto_server) during the method, apart: a
local server's cost is not the client's. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

MiB = 1 << 20
GiB = 1 << 30
METHODS = ("crt", "ckptfs", "ckptfs-mount", "ckptfs-crt", "ckptfs-crt-gets", "ckptfs-boto3",
           "boto3")
CLK = os.sysconf("SC_CLK_TCK")


def size_arg(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)


def pid_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / CLK


def self_cpu() -> float:
    t = os.times()
    return t.user + t.system


# ----------------------------------------------------------------------------------------------
# the worker: one method, one round


def _boto3(endpoint: str) -> Any:
    import boto3
    import botocore.config

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=botocore.config.Config(
                            s3={"addressing_style": "path"}, max_pool_connections=16,
                            request_checksum_calculation="when_required",
                            response_checksum_validation="when_required"))


def _through_a_mount(a: argparse.Namespace, files: list[str], size: int) -> dict[str, float]:
    """ckptfs-mount: commit -> durable and a cold prefetch through real mounts (docstring)."""
    from bench_restore import Mount
    from benchlib import find_ckptfs, proc_cpu_s

    ckptfs = find_ckptfs(None)
    base = Path(a.dir) / ("mount-" + a.tag.replace("/", "-"))
    args = ["--store", f"s3://{a.bucket}/{a.tag}/mount", "--endpoint-url", a.endpoint,
            "--force-path-style"]
    out: dict[str, float] = {}
    for name in ("up", "down"):
        m = Mount(ckptfs, base / f"{name}-mnt", base / f"{name}-cache", args, name)
        try:
            m.open()
            c0 = proc_cpu_s(m.pid)
            assert c0 is not None, "the daemon is gone"
            if name == "up":
                tmp = m.mnt / "set.tmp"
                tmp.mkdir()
                for i, src in enumerate(files):
                    shutil.copyfile(src, tmp / f"__{i}_0.distcp")
                w0 = time.perf_counter()
                os.rename(tmp, m.mnt / "set")
                cmd = [ckptfs, "wait", str(m.mnt / "set"), "--timeout", "600"]
            else:
                w0 = time.perf_counter()
                cmd = [ckptfs, "prefetch", str(m.mnt / "set")]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                raise SystemExit(f"{' '.join(cmd[1:2])}: exit {r.returncode}: "
                                 f"{(r.stdout + r.stderr).strip()[-400:]}")
            out[name + "_s"] = time.perf_counter() - w0
            c1 = proc_cpu_s(m.pid)
            assert c1 is not None, "the daemon is gone"
            out[name + "_cpu"] = c1 - c0
            if name == "down":  # read back through the mount (after the clock): the same bytes
                for i, src in enumerate(files):
                    shard = m.mnt / "set" / f"__{i}_0.distcp"
                    if shard.stat().st_size != size or not filecmp.cmp(src, shard, shallow=False):
                        raise SystemExit(f"{shard} differs from {src} after the restore")
        finally:
            m.close(wait_uploads=name == "up")
    shutil.rmtree(base, ignore_errors=True)
    return out


def worker(a: argparse.Namespace) -> None:
    """Upload the files, then download them; print one JSON line of timings and CPU."""
    files = [str(Path(a.dir) / f"src{i}") for i in range(a.files)]
    dests = [str(Path(a.dir) / f"dst-{a.method}-{i}") for i in range(a.files)]
    keys = [f"{a.tag}/{a.method}/f{i}" for i in range(a.files)]
    size = os.path.getsize(files[0])
    out: dict[str, float] = {}
    if a.method == "ckptfs-mount":
        out = _through_a_mount(a, files, size)
    elif a.method.startswith("ckptfs"):
        import trio

        from cachemgr.host import allocator
        allocator.tune()  # as the daemon does at its start (CKPTFS_MALLOC_DEFAULTS=1: not)

        from cachemgr.store import RetryingStore
        from cachemgr.store.s3 import S3Options, S3Store
        from cachemgr.transfer.download import download_chunks
        from cachemgr.transfer.upload import Uploader

        s3 = S3Store(f"s3://{a.bucket}", S3Options(
            endpoint_url=a.endpoint, region="us-east-1", path_style=True,
            native=a.method != "ckptfs-boto3", native_gets=a.method == "ckptfs-crt-gets",
            plain_http=a.method == "ckptfs"))
        want = {"ckptfs": "sendfile", "ckptfs-crt": "crt-up", "ckptfs-crt-gets": "crt",
                "ckptfs-boto3": "boto3"}
        assert s3.data_path == want[a.method], s3.data_path
        store = RetryingStore(s3)
        up = Uploader(store)
        objs: list[Any] = [None] * a.files

        async def upload() -> None:
            async with trio.open_nursery() as n:
                for i in range(a.files):
                    async def one(i: int = i) -> None:
                        objs[i] = await up.upload_file(files[i], keys[i], size=size)
                    n.start_soon(one)

        async def download() -> None:
            # a cold restore's prefetch (cachemgr.restore.prefetch, chunkfetch): runs of
            # adjacent chunks of up to 64 MiB (`prefetch_range`), 8 GETs in flight
            # (`prefetch_concurrency`), each run verified (download_chunks) and written at its
            # offset in a worker thread, as FileCache.fill does
            lim = trio.CapacityLimiter(8)
            fds = [os.open(d, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for d in dests]

            async def run(i: int, first: int, last: int) -> None:
                async with lim:
                    raws = await download_chunks(store, objs[i], first, last)

                    def fill() -> None:
                        off = first * objs[i].chunk_size
                        for r in raws:
                            os.pwrite(fds[i], r, off)
                            off += len(r)
                    await trio.to_thread.run_sync(fill)
                    del raws

            try:
                async with trio.open_nursery() as n:
                    for i in range(a.files):
                        per = (64 * MiB) // objs[i].chunk_size
                        count = -(-size // objs[i].chunk_size)
                        for first in range(0, count, per):
                            n.start_soon(run, i, first, min(first + per, count) - 1)
            finally:
                for fd in fds:
                    os.close(fd)

        for name, fn in (("up", upload), ("down", download)):
            c0, w0 = self_cpu(), time.perf_counter()
            trio.run(fn)
            out[name + "_s"] = time.perf_counter() - w0
            out[name + "_cpu"] = self_cpu() - c0
        assert up.stats.native == (0 if a.method == "ckptfs-boto3" else a.files)
    elif a.method == "boto3":
        from concurrent.futures import ThreadPoolExecutor

        from boto3.s3.transfer import TransferConfig
        c = _boto3(a.endpoint)
        tc = TransferConfig(multipart_threshold=64 * MiB, multipart_chunksize=64 * MiB,
                            max_concurrency=8)
        with ThreadPoolExecutor(a.files) as ex:
            for name, job in (
                    ("up", lambda i: c.upload_file(files[i], a.bucket, keys[i], Config=tc)),
                    ("down", lambda i: c.download_file(a.bucket, keys[i], dests[i], Config=tc))):
                c0, w0 = self_cpu(), time.perf_counter()
                list(ex.map(job, range(a.files)))
                out[name + "_s"] = time.perf_counter() - w0
                out[name + "_cpu"] = self_cpu() - c0
    else:
        from cachemgr.store.crt import CrtData, CrtOptions
        crt = CrtData(CrtOptions(bucket=a.bucket, prefix="", endpoint_url=a.endpoint,
                                 region="us-east-1", path_style=True,
                                 credentials=lambda: ("testing", "testing", None)))
        import awscrt.http
        import awscrt.s3

        def put(i: int) -> Any:
            h = awscrt.http.HttpHeaders([("Host", crt._host), ("Content-Length", str(size)),
                                         ("Content-Type", "application/octet-stream")])
            return crt.up.make_request(
                type=awscrt.s3.S3RequestType.PUT_OBJECT,
                request=awscrt.http.HttpRequest("PUT", crt._path(keys[i]), h),
                send_filepath=files[i], checksum_config=awscrt.s3.S3ChecksumConfig(
                    algorithm=awscrt.s3.S3ChecksumAlgorithm.CRC32C,
                    location=awscrt.s3.S3ChecksumLocation.HEADER))

        def get(i: int) -> Any:
            h = awscrt.http.HttpHeaders([("Host", crt._host)])
            return crt.down.make_request(
                type=awscrt.s3.S3RequestType.GET_OBJECT,
                request=awscrt.http.HttpRequest("GET", crt._path(keys[i]), h),
                recv_filepath=dests[i])

        for name, make in (("up", put), ("down", get)):
            c0, w0 = self_cpu(), time.perf_counter()
            reqs = [make(i) for i in range(a.files)]
            for r in reqs:
                r.finished_future.result()
            out[name + "_s"] = time.perf_counter() - w0
            out[name + "_cpu"] = self_cpu() - c0
    for i in range(a.files if a.method != "ckptfs-mount" else 0):  # (checked through the mount)
        if os.path.getsize(dests[i]) != size:
            raise SystemExit(f"{a.method}: {dests[i]} is not {size} bytes")
        os.unlink(dests[i])
    print(json.dumps(out), flush=True)


# ----------------------------------------------------------------------------------------------
# the driver


class Server:
    def __init__(self, kind: str, work: Path) -> None:
        self.kind = kind
        self.dir = work / kind
        self.proc: subprocess.Popen[bytes] | None = None
        if kind == "moto":
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.log = open(work / "moto.log", "wb")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                          "-p", str(port)], stdout=self.log,
                                         stderr=subprocess.STDOUT)
            self.endpoint = f"http://127.0.0.1:{port}"
            self.pids = [self.proc.pid]
            for _ in range(300):
                try:
                    _boto3(self.endpoint).list_buckets()
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    time.sleep(0.2)
        else:
            r = subprocess.run(["bash", str(REPO / "scripts" / "rgw.sh"), "start", str(self.dir)],
                               capture_output=True, text=True, check=True, timeout=900)
            self.endpoint = r.stdout.strip().splitlines()[-1]
            self.pids = [int((self.dir / "pids" / n).read_text()) for n in ("mon", "osd", "rgw")]
        self.bucket = f"bench-{uuid.uuid4().hex[:8]}"
        _boto3(self.endpoint).create_bucket(Bucket=self.bucket)

    def cpu(self) -> float:
        return sum(pid_cpu(p) for p in self.pids)

    def clean(self, tag: str) -> None:
        c = _boto3(self.endpoint)
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=tag):
            for o in page.get("Contents", []):
                c.delete_object(Bucket=self.bucket, Key=o["Key"])
        if self.kind == "rgw":  # RGW frees deleted objects' data at its GC, hours later by
            # default: a memstore OSD (8 GiB, scripts/rgw.sh) would fill within a few rounds
            subprocess.run(["radosgw-admin", "-c", str(self.dir / "ceph.conf"), "gc", "process",
                            "--include-all"], capture_output=True, timeout=300)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.log.close()
        else:
            subprocess.run(["bash", str(REPO / "scripts" / "rgw.sh"), "stop", str(self.dir)],
                           capture_output=True, timeout=300)


def mmm(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--size", type=size_arg, default=256 * MiB)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--servers", default="rgw,moto")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dir", default="/dev/shm", help="where the files go (RAM by default)")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--method", help=argparse.SUPPRESS)   # worker mode
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--bucket", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    if a.method:
        worker(a)
        return 0
    methods = a.methods.split(",")
    work = Path(tempfile.mkdtemp(prefix="ckptfs-storepath-", dir=a.dir))
    servers: list[Server] = []
    rows: list[dict[str, Any]] = []
    try:
        for i in range(a.files):
            with open(work / f"src{i}", "wb") as f:
                for _ in range(a.size // (64 * MiB)):
                    f.write(os.urandom(64 * MiB))
                f.write(os.urandom(a.size % (64 * MiB)))
        for kind in a.servers.split(","):
            servers.append(Server(kind, work))
            print(f"{kind}: {servers[-1].endpoint}", flush=True)
        for rnd in range(a.rounds):
            for srv in servers:
                order = methods[rnd % len(methods):] + methods[:rnd % len(methods)]
                for m in order:
                    tag = f"r{rnd}"
                    # a run that fails (the CRT alone has no retries: a store stalled by this
                    # loaded VM fails it, AWS_ERROR_HTTP_CHANNEL_THROUGHPUT_FAILURE) is run
                    # again on fresh keys, at most twice, and the row says so
                    for attempt in range(3):
                        s0 = srv.cpu()
                        r = subprocess.run(
                            [sys.executable, __file__, "--method", m, "--endpoint",
                             srv.endpoint, "--bucket", srv.bucket, "--tag", f"{tag}/{attempt}",
                             "--dir", str(work), "--files", str(a.files)], capture_output=True,
                            text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(REPO)))
                        if r.returncode == 0:
                            break
                        print(f"{m} on {srv.kind} failed (try {attempt + 1}): "
                              f"{r.stderr.strip().splitlines()[-1:]}", flush=True)
                    else:
                        raise SystemExit(f"{m} on {srv.kind}: {r.stderr[-2000:]}")
                    got = json.loads(r.stdout.strip().splitlines()[-1])
                    got.update(server=srv.kind, method=m, round=rnd, failed_tries=attempt,
                               server_cpu=srv.cpu() - s0, load=os.getloadavg()[0])
                    rows.append(got)
                    print(json.dumps(got), flush=True)
                srv.clean(f"r{rnd}/")
    finally:
        for srv in servers:
            srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    total = a.files * a.size
    summary: dict[str, Any] = {}
    for kind in a.servers.split(","):
        base = {(r["round"]): r for r in rows if r["server"] == kind and r["method"] == "crt"}
        for m in methods:
            rs = [r for r in rows if r["server"] == kind and r["method"] == m]
            s: dict[str, Any] = {}
            for d in ("up", "down"):
                s[f"{d}_MBps"] = mmm([total / r[f"{d}_s"] / 1e6 for r in rs])
                s[f"{d}_cpu_s_per_GiB"] = mmm([r[f"{d}_cpu"] / (total / GiB) for r in rs])
                if base:
                    s[f"{d}_vs_crt"] = mmm([base[r["round"]][f"{d}_s"] / r[f"{d}_s"]
                                            for r in rs])
            s["server_cpu_s_per_GiB_moved"] = mmm([r["server_cpu"] / (2 * total / GiB)
                                                    for r in rs])
            summary[f"{kind}/{m}"] = s
    doc = {"bench": "store_path", "files": a.files, "size": a.size, "rounds": a.rounds,
           "cpus": os.cpu_count(), "command": " ".join(["python"] + sys.argv),
           "summary": summary, "rows": rows}
    md = [(f"# Store data path ({a.files} x {a.size // MiB} MiB per method and round, "
           f"{a.rounds} interleaved rounds; medians, min..max)"), "",
          ("| server | method | upload MB/s | x crt | upload CPU-s/GiB | download MB/s | x crt | "
           "download CPU-s/GiB | server CPU-s/GiB |"), "|---|---|---|---|---|---|---|---|---|"]

    def fmt(x: dict[str, float] | None, p: int = 2) -> str:
        if x is None:
            return "-"
        return f"{x['median']:.{p}f} ({x['min']:.{p}f}..{x['max']:.{p}f})"

    for key, s in summary.items():
        kind, m = key.split("/")
        md.append(f"| {kind} | {m} | {fmt(s['up_MBps'], 0)} | {fmt(s.get('up_vs_crt'))} | "
                  f"{fmt(s['up_cpu_s_per_GiB'])} | {fmt(s['down_MBps'], 0)} | "
                  f"{fmt(s.get('down_vs_crt'))} | {fmt(s['down_cpu_s_per_GiB'])} | "
                  f"{fmt(s['server_cpu_s_per_GiB_moved'])} |")
    print("\n".join(md))
    if a.out:
        Path(a.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
        Path(a.out + ".md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
