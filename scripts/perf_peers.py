"""The peers of scripts/bench_perf.py's torch workloads: s3fs and rclone mounts (save through
them, durable polled in the store, warm and cold restore), rclone's cold restore over the store
ceiling's objects, and s3torchconnector's DCP reader and writer straight to S3.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from benchlib import BenchError, MiB
from perf_ckpt import Ranks, StateDict, fs_load, fs_save
from perf_core import BUCKET, RCLONE_FLAGS, REGION, Json, PeerMount, Perf, dir_bytes

if TYPE_CHECKING:
    from bench_fio import Mount


class Peers:
    def __init__(self, perf: Perf) -> None:
        self.p = perf

    def _peer(self, kind: str, prefix: str, cache: Path, mnt: Path) -> PeerMount:
        env = dict(os.environ)
        logf = self.p.out / f"{kind}.log"
        logf.unlink(missing_ok=True)
        if kind == "s3fs":
            if not shutil.which("s3fs"):
                raise BenchError("s3fs not installed (apt-get install s3fs failed?)")
            pw = self.p.work / "s3fs.passwd"
            pw.write_text("testing:testing\n")
            pw.chmod(0o600)
            cmd = ["s3fs", f"{BUCKET}:/{prefix}", str(mnt), "-f", "-o",
                   (f"passwd_file={pw},url={self.p.server.url},use_path_request_style,"
                   f"use_cache={cache},endpoint={REGION}")]
        else:
            if not shutil.which("rclone"):
                raise BenchError("rclone not installed (apt-get install rclone failed?)")
            conf = self.p.work / "rclone.conf"
            conf.write_text(f"[moto]\ntype = s3\nprovider = Other\naccess_key_id = testing\n"
                            f"secret_access_key = testing\nendpoint = {self.p.server.url}\n"
                            f"region = {REGION}\nforce_path_style = true\n")
            # rclone refuses a custom CA bundle with its own HTTP transport; plain http here
            env.pop("AWS_CA_BUNDLE", None)
            cmd = ["rclone", "--config", str(conf), "mount", f"moto:{BUCKET}/{prefix}", str(mnt),
                   "--vfs-cache-mode", "writes", "--cache-dir", str(cache),
                   *RCLONE_FLAGS]
        self.p.res["config"].setdefault(f"{kind}_cmd", shlex.join(cmd))
        cache.mkdir(parents=True, exist_ok=True)
        p = PeerMount(kind, cmd, mnt, env, logf)
        # s3fs needs the prefix to exist as a directory object or it shows an empty root
        if kind == "s3fs":
            self.p.s3.put_object(Bucket=BUCKET, Key=f"{prefix}/", Body=b"")
        p.open()
        self.p.peer_mounts.append(p)
        return p

    def run_fuse_peer(self, kind: str, wl: str, rep: int, rec: Json, ranks: Ranks | None,
                      sd: StateDict | None, sd_out: StateDict | None) -> None:
        prefix = f"{kind}/{wl}/{rep}"
        mnt = self.p.work / f"mnt-{kind}"
        cache = self.p.work / f"cache-{kind}"
        shutil.rmtree(cache, ignore_errors=True)
        p = self._peer(kind, prefix, cache, mnt)
        d = mnt / "step"
        try:
            t0 = time.perf_counter()

            def save_and_wait() -> float:
                s, n = fs_save(wl, d, ranks, sd, self.p.a.dcp_threads)
                rec.update(save_s=round(s, 3), bytes=n)
                want = {f"step/{k}": v for k, v in dir_bytes(d).items()}
                return self.p.wait_objects(prefix, want, t0, timeout=120 + n / 2e6,
                                         peer_log=p.logf)

            rec["durable_s"] = round(self.p.timed(rec, "save+durable", save_and_wait, drop=False),
                                     3)
            rec["commit_to_durable_s"] = round(rec["durable_s"] - rec["save_s"], 3)
            rec["warm_s"] = round(self.p.timed(rec, "warm",
                                             lambda: fs_load(wl, d, ranks, sd_out)), 3)
            rec["verified"] = self.verify_upload(d, f"{prefix}/step")
        finally:
            self.p.close_peer(p)
        shutil.rmtree(cache, ignore_errors=True)
        cache2 = self.p.work / f"cache-{kind}-cold"
        shutil.rmtree(cache2, ignore_errors=True)
        p = self._peer(kind, prefix, cache2, mnt)
        try:
            rec["cold_s"] = round(self.p.timed(rec, "cold",
                                             lambda: fs_load(wl, d, ranks, sd_out)), 3)
        finally:
            self.p.close_peer(p)
            shutil.rmtree(cache2, ignore_errors=True)
            self.p.delete_prefix(prefix)
        self.p.res["peers"].setdefault(f"{kind}:{wl}", "ok")

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
            body = self.p.s3.get_object(Bucket=BUCKET, Key=key)["Body"]
            while b := body.read(8 * MiB):
                h.update(b)
            return h.hexdigest()

        files = dir_bytes(d)
        bad = [r for r in files if sha_file(d / r) != sha_obj(f"{prefix}/{r}")]
        if bad:
            raise BenchError(f"sha256 of the stored object differs from the file: {bad[:3]}")
        return f"sha256 of {len(files)} stored objects = the files"

    def run_rclone_ro(self, wl: str, rep: int, ranks: Ranks | None, sd_out: StateDict | None,
                      prefix: str) -> Json:
        """rclone's cold restore when its own upload failed: a fresh `rclone mount` (empty
        cache) over the objects the store-ceiling step uploaded from the same checkpoint
        (same bytes, same store), read the same way as every other cold restore."""
        rec: Json = {"workload": wl, "rep": rep, "target": "rclone-ro", "source": prefix}
        mnt = self.p.work / "mnt-rclone"
        cache = self.p.work / "cache-rclone-ro"
        shutil.rmtree(cache, ignore_errors=True)
        p = self._peer("rclone", prefix, cache, mnt)
        try:
            rec["bytes"] = sum(o["Size"] for o in self.p.s3.list_objects_v2(
                Bucket=BUCKET, Prefix=prefix + "/").get("Contents", []))
            rec["cold_s"] = round(self.p.timed(rec, "cold",
                                             lambda: fs_load(wl, mnt, ranks, sd_out)), 3)
        finally:
            self.p.close_peer(p)
            shutil.rmtree(cache, ignore_errors=True)
        return rec

    def run_s3fs(self, wl: str, rep: int, rec: Json, ranks: Ranks | None, sd: StateDict | None,
                 sd_out: StateDict | None, ma: Mount | None) -> None:
        self.run_fuse_peer("s3fs", wl, rep, rec, ranks, sd, sd_out)

    def run_rclone(self, wl: str, rep: int, rec: Json, ranks: Ranks | None, sd: StateDict | None,
                 sd_out: StateDict | None, ma: Mount | None) -> None:
        self.run_fuse_peer("rclone", wl, rep, rec, ranks, sd, sd_out)

    def run_s3torch(self, wl: str, rep: int, rec: Json, ranks: Ranks | None, sd: StateDict | None,
                 sd_out: StateDict | None, ma: Mount | None) -> None:
        try:
            import torch.distributed.checkpoint as dcp
            from s3torchconnector._s3client import S3Client, S3ClientConfig
            from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
            from s3torchconnector.dcp.s3_file_system import S3FileSystem
        except Exception as e:
            raise BenchError(
                f"cannot import s3torchconnector: {e.__class__.__name__}: {e}") from e
        prefix = f"s3torch/{wl}/{rep}"
        path = f"s3://{BUCKET}/{prefix}"
        cfg = S3ClientConfig(force_path_style=True)

        def client() -> S3Client:
            # S3StorageWriter/Reader take no endpoint: give their file system a client for moto
            return S3Client(region=REGION, endpoint=self.p.server.url, s3client_config=cfg)

        def save() -> None:
            w = S3StorageWriter(region=REGION, path=path, s3client_config=cfg,
                                thread_count=self.p.a.dcp_threads)
            fs = w.fs  # (typed as torch's FileSystem by the writer it subclasses)
            assert isinstance(fs, S3FileSystem)
            fs._client = client()
            dcp.save(sd, storage_writer=w)

        def load() -> None:
            r = S3StorageReader(region=REGION, path=path, s3client_config=cfg)
            r.fs._client = client()
            dcp.load(sd_out, storage_reader=r)

        def clock(fn: Callable[[], None]) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                fn()
                return time.perf_counter() - t0
            return run

        rec["save_s"] = round(self.p.timed(rec, "save", clock(save), drop=False), 3)
        rec["durable_s"] = rec["save_s"]  # the save returns when S3 has every object
        rec["commit_to_durable_s"] = 0.0
        rec["bytes"] = sum(o["Size"] for o in self.p.s3.list_objects_v2(
            Bucket=BUCKET, Prefix=prefix + "/").get("Contents", []))
        rec["cold_s"] = round(self.p.timed(rec, "cold", clock(load)), 3)
        self.p.delete_prefix(prefix)
        self.p.res["peers"].setdefault(f"s3torch:{wl}", "ok")

