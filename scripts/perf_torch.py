"""The torch workloads of scripts/bench_perf.py (mlperf: per-rank torch.save; dcp: DCP of a
GPT-like state dict): per target save, durable, warm and cold restore, and the store's ceiling
(boto3) on the same files.
"""

from __future__ import annotations

import shutil
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from benchlib import BenchError, GiB, MiB, loadavg, main_thread_cpu_s, read_file
from perf_ckpt import Ranks, StateDict, fs_load, fs_save, gpt_state_dict
from perf_core import (
    BUCKET,
    CEIL_CONC,
    CEIL_PART,
    CKPTFS_TARGETS,
    Json,
    Perf,
    cpu_delta,
    dir_bytes,
    io_delta,
    tsfx,
)
from perf_peers import Peers

if TYPE_CHECKING:
    from bench_fio import Mount


# run_<target>(wl, rep, rec, ranks, sd, sd_out, node A's mount or None)
Runner = Callable[[str, int, Json, Ranks | None, StateDict | None, StateDict | None,
                   "Mount | None"], None]


class TorchBench:
    def __init__(self, perf: Perf, peers: Peers) -> None:
        self.p, self.peers = perf, peers

    def runner(self, t: str) -> Runner:
        """The run of a target that is not a ckptfs mount: the raw disk, or a peer."""
        runners: dict[str, Runner] = {"raw": self.run_raw, "s3fs": self.peers.run_s3fs,
                                      "rclone": self.peers.run_rclone,
                                      "s3torch": self.peers.run_s3torch}
        return runners[t]

    def torch_all(self) -> None:
        a = self.p.a
        for wl in a.workloads:
            self.workload(wl)

    def workload(self, wl: str) -> None:
        a = self.p.a
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
            self.p.progress(f"{wl}: state of {a.torch_size / GiB:.2f} GiB built in "
                          f"{time.perf_counter() - t0:.1f}s")
            cts = a.ckptfs_targets
            targets = (["raw", *cts, "s3fs", "rclone"] + (["s3torch"] if wl == "dcp" else []))
            mas: Json = {}
            through = dict.fromkeys(cts, 0)
            try:
                for t in cts:  # one node per ckptfs target takes every checkpoint in turn
                    mas[t] = self.p.new_ckptfs(f"{wl}{tsfx(t)}-A", f"{wl}{tsfx(t)}", t)
                for rep in range(a.repeats):
                    order = targets[rep % len(targets):] + targets[:rep % len(targets)]
                    for t in order:
                        if self.p.res["peers"].get(f"{t}:{wl}", "ok") != "ok":
                            continue
                        rec = {"workload": wl, "rep": rep, "target": t}
                        self.p.progress(f"{wl} rep {rep + 1}/{a.repeats}: {t} ...")
                        try:
                            if t in CKPTFS_TARGETS:
                                self.run_ckptfs(wl, rep, rec, ranks, sd, sd_out, mas[t], t)
                            else:
                                self.runner(t)(wl, rep, rec, ranks, sd, sd_out, None)
                        except KeyboardInterrupt:
                            raise
                        except BaseException as e:  # noqa: BLE001
                            # (DCP's CheckpointException is a BaseException)
                            rec["error"] = self.explain(t, e)
                            self.p.error(f"{wl} {t} rep {rep + 1}: {rec['error']}")
                            rec["traceback"] = traceback.format_exc()[-2000:]
                            if rep == 0 and t != "raw" and t not in CKPTFS_TARGETS:
                                self.p.res["peers"][f"{t}:{wl}"] = f"not available: {rec['error']}"
                        if t in through:
                            through[t] += rec.get("bytes", 0)
                        self.p.res["torch"].append(rec)
                        dp = ""
                        if rec.get("save_io"):
                            io = rec["save_io"]
                            dp = (f"; data path {io.get('data_path')}, daemon served "
                                  f"{io.get('daemon_bytes_written', 0) / MiB:.0f} MiB of the "
                                  f"save, {io.get('passthrough_opens', 0)} pt opens")
                        self.p.progress("   " + ", ".join(
                            f"{k} {rec[k]:.2f}s" for k in ("save_s", "durable_s", "warm_s",
                                                           "cold_s") if rec.get(k) is not None)
                            + dp)
                        self.p.save()
                    # the store's ceiling on the same files (the raw target's)
                    src = self.p.raw / wl / f"step_{rep}"
                    # rclone's own upload failed in this repeat: measure its cold restore
                    # over the ceiling's objects instead (run_rclone_ro)
                    rclone_ro = not any(r["workload"] == wl and r["rep"] == rep and
                                        r["target"] == "rclone" and "error" not in r
                                        for r in self.p.res["torch"])
                    if src.exists():
                        self.p.progress(f"{wl} rep {rep + 1}: store ceiling (boto3) ...")
                        try:
                            c = self.ceiling(wl, rep, src, keep=rclone_ro)
                            self.p.res["ceiling"].append(c)
                            self.p.progress(f"   upload {c['upload_s']:.2f}s, download "
                                          f"{c['download_s']:.2f}s")
                            if rclone_ro:
                                self.p.progress(f"{wl} rep {rep + 1}: rclone cold restore of "
                                              f"the ceiling's objects ...")
                                try:
                                    r = self.peers.run_rclone_ro(wl, rep, ranks, sd_out,
                                                           f"ceiling/{wl}/{rep}")
                                except Exception as e:  # noqa: BLE001
                                    r = {"workload": wl, "rep": rep, "target": "rclone-ro",
                                         "error": self.explain("rclone", e)}
                                    self.p.error(f"{wl} rclone-ro rep {rep + 1}: {r['error']}")
                                self.p.res["torch"].append(r)
                                self.p.progress(f"   cold {r.get('cold_s')}s")
                        except Exception as e:  # noqa: BLE001
                            self.p.error(f"{wl} ceiling rep {rep + 1}: {e}")
                        finally:
                            self.p.delete_prefix(f"ceiling/{wl}/{rep}")
                        shutil.rmtree(src, ignore_errors=True)
                    self.p.save()
            finally:
                for t, m in mas.items():
                    self.p.close_ckptfs(m, through[t])
        finally:
            if ranks is not None:
                ranks.close()

    def explain(self, t: str, e: BaseException) -> str:
        """The exception as one line, plus the peer's own complaint from its log if any."""
        msg = f"{e.__class__.__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
        logf = self.p.out / f"{t}.log"
        if t in ("s3fs", "rclone") and logf.exists():
            bad = [ln for ln in read_file(logf).splitlines()
                   if "corrupted on transfer" in ln or " ERROR " in ln or "error" in ln.lower()]
            line = bad[0].strip()[:300] if bad else ""
            if line and line not in msg:  # (wait_objects already quotes the log line)
                msg += f" — {t} log: {line}"
        return msg

    # save/load through a directory, for the file-system targets

    def ceiling(self, wl: str, rep: int, src: Path, keep: bool = False) -> Json:
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_chunksize=CEIL_PART, multipart_threshold=CEIL_PART,
                             max_concurrency=CEIL_CONC, use_threads=True)
        files = dir_bytes(src)
        prefix = f"ceiling/{wl}/{rep}"
        rec: Json = {"workload": wl, "rep": rep, "target": "ceiling", "bytes": sum(files.values()),
               "files": len(files)}
        self.p.hygiene()
        la0 = loadavg()
        moto0 = self.p.server.cpu_s()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(files)) as ex:
            list(ex.map(lambda r: self.p.s3.upload_file(str(src / r), BUCKET, f"{prefix}/{r}",
                                                      Config=cfg), files))
        rec["upload_s"] = round(time.perf_counter() - t0, 3)
        rec["upload_moto_busy"] = round(cpu_delta(self.p.server.cpu_s(), moto0)
                                        / rec["upload_s"], 2)
        dest = self.p.work / "ceiling-dl"
        shutil.rmtree(dest, ignore_errors=True)
        for r in files:
            (dest / r).parent.mkdir(parents=True, exist_ok=True)
        self.p.hygiene()
        moto0 = self.p.server.cpu_s()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(files)) as ex:
            list(ex.map(lambda r: self.p.s3.download_file(BUCKET, f"{prefix}/{r}", str(dest / r),
                                                        Config=cfg), files))
        rec["download_s"] = round(time.perf_counter() - t0, 3)
        rec["download_moto_busy"] = round(cpu_delta(self.p.server.cpu_s(), moto0)
                                          / rec["download_s"], 2)
        got = dir_bytes(dest)
        if got != files:
            raise BenchError("ceiling download differs from the upload")
        rec["loadavg"] = [la0, loadavg()]
        shutil.rmtree(dest, ignore_errors=True)
        if not keep:
            self.p.delete_prefix(prefix)
        return rec

    def run_raw(self, wl: str, rep: int, rec: Json, ranks: Ranks | None, sd: StateDict | None,
                 sd_out: StateDict | None, ma: Mount | None) -> None:
        d = self.p.raw / wl / f"step_{rep}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(d.with_name(d.name + ".tmp"), ignore_errors=True)
        s, n = self.p.timed(rec, "save", lambda: fs_save(wl, d, ranks, sd, self.p.a.dcp_threads),
                            drop=False)
        rec.update(save_s=round(s, 3), bytes=n)
        rec["warm_s"] = round(self.p.timed(rec, "warm", lambda: fs_load(wl, d, ranks, sd_out)),
                              3)
        # kept for the ceiling run of this repeat, then removed

    def run_ckptfs(self, wl: str, rep: int, rec: Json, ranks: Ranks | None, sd: StateDict | None,
                 sd_out: StateDict | None, ma: Mount,
                   target: str = "ckptfs") -> None:
        import ckptfs

        d = ma.mnt / f"step_{rep}"
        _, st0 = ma.wait_idle(600)
        st0 = st0 or ma.status()
        cpu0 = ma.cpu_s()
        mcpu0 = main_thread_cpu_s(ma.pid)
        cpu_saved: list[float | None] = []
        t0 = time.perf_counter()

        def save_and_wait() -> float:
            s, n = fs_save(wl, d, ranks, sd, self.p.a.dcp_threads)
            # /proc reads: the daemon's CPU (main thread, then all threads: the main thread's
            # delta never exceeds the total's) until the save returned
            mc = main_thread_cpu_s(ma.pid)
            cpu_saved.extend([ma.cpu_s(), mc])
            rec.update(save_s=round(s, 3), bytes=n)
            ckptfs.wait_durable(str(d), timeout=1800)
            return time.perf_counter() - t0

        rec["durable_s"] = round(self.p.timed(rec, "save+durable", save_and_wait, drop=False), 3)
        rec["commit_to_durable_s"] = round(rec["durable_s"] - rec["save_s"], 3)
        # save + uploads until durable
        rec["daemon_cpu_save_s"] = round(cpu_delta(ma.cpu_s(), cpu0), 2)
        rec["daemon_cpu_during_save_s"] = round(cpu_delta(cpu_saved[0], cpu0), 3)
        if mcpu0 is not None and cpu_saved[1] is not None:
            rec["daemon_main_thread_cpu_during_save_s"] = round(cpu_saved[1] - mcpu0, 3)
        st1 = ma.status()
        rec["save_io"] = io_delta(st0, st1)
        rec["data_path"] = rec["save_io"].get("data_path")
        rec["warm_s"] = round(self.p.timed(rec, "warm", lambda: fs_load(wl, d, ranks, sd_out)),
                              3)
        rec["warm_io"] = io_delta(st1, ma.status())
        # a fresh node: empty cache dir, same store
        mb = self.p.new_ckptfs(f"{wl}{tsfx(target)}-B{rep}", f"{wl}{tsfx(target)}", target)
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
            rec["cold_s"] = round(self.p.timed(
                rec, "cold", lambda: fs_load(wl, mb.mnt / d.name, ranks, sd_out)), 3)
            rec["daemon_cpu_cold_s"] = round(cpu_delta(mb.cpu_s(), cpu0), 2)
            rec["cold_io"] = io_delta(st, mb.status())
            rec["cold_node_peak_rss_mib"] = self.p.peak_mib(mb)
        finally:
            self.p.close_ckptfs(mb, 0)
        rec["node_peak_rss_mib"] = self.p.peak_mib(ma)
        shutil.rmtree(d)  # deletes the set: its objects are GC'd by the daemon
        ma.wait_idle(600)

