#!/usr/bin/env python3
"""Scale of one big set and of many sets through real ckptfs mounts (issue 35).

What it measures
    commit    one DCP-like set written by one writer into one directory of a fresh mount on a
              fresh `file://` store: `shards` = --shards files of --shard-size bytes (default
              8,192 x 64 KiB = 512 MiB), each written and fsynced as DCP does, then
              `.metadata.tmp` written and renamed to `.metadata` (the commit), against
              `8-files` = the same bytes as 8 files, saved the same way. Per run: the write
              time (first shard opened -> rename returned), its files/s per block of 1,024
              shards (flat if the per-file cost does not grow with the directory), the commit ->
              durable time (the rename -> `ckptfs wait` on the set returned), the objects in the
              store at that moment (must be every file), the daemon's CPU time and peak RSS.
              The two cases run back to back in every round, their order reversed on every
              other round, so a drift of the machine does not favour one.
    mount     a fresh node mounting a store that already holds --sets N dir sets of
              --files-per-set files each (default 1,000 and 10,000 sets of 10 files: 100,000
              files at 10,000). The store is generated directly (manifests only, written with
              cachemgr.format.manifest as a committing node would: a mount reads only
              manifests; no object is read), once per N. Per run: a fresh cache directory,
              the wall time of `ckptfs mount` (it returns once the first listing is applied:
              the whole namespace is there), that every set is visible (the set directories
              listed through the mount), the daemon's RSS right after and its peak (VmHWM),
              its CPU time. The Ns run in a different order every round.

    Medians and [min-max] over --rounds rounds. Everything (store, cache, mount point) lives in
    --workdir, by default /dev/shm (RAM-backed), so the disk is not what is measured.

Output (--out, default bench-results/scale-sets)
    results.json   machine, configuration, every run (written after each run)
    results.md     the tables
    with --docs also docs/bench/scale-sets.json, rendered into docs/PERFORMANCE.md's "Scale"
    section by scripts/bench_report.py (the next `bash scripts/bench.sh --full`)

Run (needs FUSE, fusermount3 and the ckptfs CLI in the same venv):
    .venv/bin/python scripts/bench_scale_sets.py --quick   # 1,024 shards; 1,000 + 2,000 sets
    .venv/bin/python scripts/bench_scale_sets.py           # 8,192 shards; 1,000 + 10,000 sets
    .venv/bin/python scripts/bench_scale_sets.py --only mount --sets 1000,3000 --rounds 3

Always unmounts what it mounted (`ckptfs umount`, falling back to `fusermount3 -u -z`) and
stops its daemons, by pid, in `finally`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pickle
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import (
    BenchError,
    find_ckptfs,
    is_mounted,
    log,
    parse_size,
    pid_alive,
    proc_cpu_s,
    proc_rss_kb,
    proc_status_kb,
    run_text,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
Json = dict[str, Any]
SET = "ckpt/step_100"
GEN_NODE = "benchgen01"  # the node id the generated manifests name


# ----------------------------------------------------------------------------------------------
# a DCP-like `.metadata` without torch


class _StorageInfo:
    """Stands for torch's `_StorageInfo`: cachemgr.format.dcp reads only `relative_path`."""

    def __init__(self, relative_path: str) -> None:
        self.relative_path = relative_path


class _Metadata:
    """Stands for torch's DCP `Metadata`: `storage_data` maps an item to its storage file."""

    def __init__(self, files: list[str]) -> None:
        self.storage_data = {f"item{i}": _StorageInfo(f) for i, f in enumerate(files)}


def dcp_metadata(files: list[str]) -> bytes:
    """A `.metadata` naming `files`, which ckptfs reads as it reads torch's (its unpickler
    resolves every class to an inert stub and reads `storage_data[*].relative_path`)."""
    return pickle.dumps(_Metadata(files), protocol=4)


# ----------------------------------------------------------------------------------------------
# mounts


class Mount:
    """One ckptfs mount; `close()` always leaves nothing mounted and no daemon running."""

    def __init__(self, ckptfs: str, mnt: Path, cache: Path, store: Path,
                 extra: list[str]) -> None:
        self.ckptfs = ckptfs
        self.mnt = mnt
        self.cache = cache
        self.log_file = cache.parent / f"{cache.name}.log"
        self.cmd = [ckptfs, "mount", str(mnt), "--cache-dir", str(cache), "--store",
                    f"file://{store}", "--log-file", str(self.log_file), *extra]
        self.pid: int | None = None

    def open(self) -> float:
        """Mount; the wall time `ckptfs mount` took to return."""
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.cache.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        res = subprocess.run(self.cmd, check=False, capture_output=True, text=True, timeout=600)
        took = time.perf_counter() - t0
        out = (res.stdout + res.stderr).strip()
        m = re.search(r"\bpid (\d+)", out)
        if m:
            self.pid = int(m.group(1))
        if res.returncode != 0:
            raise BenchError(f"mount failed (exit {res.returncode}): {out}")
        if self.pid is None:
            raise BenchError(f"mount succeeded but printed no pid: {out!r}")
        return took

    def wait(self, path: Path, timeout: float) -> float:
        """`ckptfs wait path`; its wall time."""
        t0 = time.perf_counter()
        res = subprocess.run([self.ckptfs, "wait", "--timeout", str(timeout), str(path)],
                             check=False, capture_output=True, text=True, timeout=timeout + 60)
        if res.returncode != 0:
            raise BenchError(f"ckptfs wait {path}: exit {res.returncode} "
                             f"{(res.stdout + res.stderr).strip()}")
        return time.perf_counter() - t0

    def close(self) -> Json:
        """Unmount (waiting for nothing) and stop the daemon; what was read of it before."""
        info: Json = {}
        if self.pid is not None:
            hwm = proc_status_kb(self.pid, "VmHWM")
            info["peak_rss_mib"] = round(hwm / 1024, 1) if hwm is not None else None
            info["daemon_cpu_s"] = proc_cpu_s(self.pid)
        if is_mounted(self.mnt):
            res = subprocess.run([self.ckptfs, "umount", "--no-wait", "--allow-unsaved",
                                  str(self.mnt)], check=False, capture_output=True, text=True,
                                 timeout=300)
            if res.returncode != 0 or is_mounted(self.mnt):
                info["umount"] = (res.stdout + res.stderr).strip()
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False,
                               capture_output=True, timeout=60)
        if self.pid is not None:
            deadline = time.monotonic() + 30
            while pid_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            for sig in (signal.SIGTERM, signal.SIGKILL):  # our own daemon, by pid
                if not pid_alive(self.pid):
                    break
                os.kill(self.pid, sig)
                time.sleep(2)
        try:
            text = self.log_file.read_text()
        except OSError:
            text = ""
        bad = [ln for ln in text.splitlines() if re.search(r" (ERROR|CRITICAL) |Traceback", ln)]
        if bad:
            info["daemon_log_problems"] = bad[:20]
        self.pid = None
        return info


def count_objects(store: Path, prefix: str) -> int:
    """Objects under `prefix` in a file:// store (its `objects/` tree; temp files are not)."""
    top = store / "objects" / prefix
    n = 0
    for _d, _dirs, files in os.walk(top):
        n += sum(1 for f in files if not f.startswith(".tmp-"))
    return n


# ----------------------------------------------------------------------------------------------
# generated stores (the mount case)


def fill_store(store: Path, sets: int, per_set: int, size: int = 1024) -> float:
    """`sets` dir sets of `per_set` files each, as manifests of node GEN_NODE in a file://
    store (no objects: a mount reads only manifests). Seconds it took."""
    sys.path.insert(0, str(REPO))
    from cachemgr.format import manifest as mf  # the project's own builder and writer
    from cachemgr.format.docs import FileDoc

    t0 = time.perf_counter()
    base = time.time_ns() - 10**12
    ino = 100
    for i in range(sets):
        path = f"ckpt/run{i // 1000:02d}/step_{i:05d}"
        files: list[FileDoc] = []
        for r in range(per_set):
            ino += 1
            name = f"__{r}_0.distcp"
            files.append({"path": name, "size": size, "mode": 0o644, "mtime_ns": base,
                          "object": {"key": f"data/{GEN_NODE}/{ino}/1/{name}", "size": size,
                                     "stored_size": size, "crc32c": 0, "compression": "none",
                                     "frame_size": 0, "frames": None, "chunk_size": 4 << 20,
                                     "chunk_crcs": [0]}})
        m = mf.build(path=path, kind="dir", seq=i + 1, node=GEN_NODE, reason="dcp",
                     committed_ns=base + i, layout={"dirs": [], "symlinks": [], "mode": 0o755},
                     files=files)
        p = store / "objects" / mf.manifest_key(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(mf.dumps(m))
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------------------------
# the benchmark


def mmm(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.ckptfs = find_ckptfs(a.ckptfs)
        a.workdir.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="ckptfs-bench-scale-", dir=a.workdir))
        self.mounts: list[Mount] = []
        self.out: Path = a.out
        self.results: Json = {
            "started": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                        "python": platform.python_version(),
                        "git": run_text(["git", "-C", str(REPO), "rev-parse", "--short",
                                         "HEAD"]),
                        "workdir_fs": run_text(["df", "-T", str(a.workdir)])},
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "commit": [], "mount": [], "errors": []}

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.results, indent=1) + "\n"
        (self.out / "results.json").write_text(text)
        (self.out / "results.md").write_text(self.report() + "\n")
        if self.a.docs:
            (REPO / "docs" / "bench" / "scale-sets.json").write_text(text)

    def mount(self, name: str, store: Path, extra: list[str] | None = None) -> Mount:
        m = Mount(self.ckptfs, self.work / f"mnt-{name}", self.work / f"cache-{name}", store,
                  ["--refresh-interval", "3600", *(extra or [])])
        self.mounts.append(m)
        return m

    def close(self, m: Mount) -> Json:
        info = m.close()
        self.mounts.remove(m)
        shutil.rmtree(m.cache, ignore_errors=True)
        return info

    # -- commit ---------------------------------------------------------------------------------

    def commit_run(self, case: str, nfiles: int, size: int, rnd: int) -> None:
        store = self.work / f"store-{case}"
        shutil.rmtree(store, ignore_errors=True)
        m = self.mount(case, store)
        rec: Json = {"case": case, "round": rnd, "files": nfiles, "file_bytes": size}
        try:
            m.open()
            d = m.mnt / SET
            d.mkdir(parents=True)
            data = os.urandom(size)
            names = [f"__{i}_0.distcp" for i in range(nfiles)]
            block = 1024
            rates: list[float] = []
            t0 = last = time.perf_counter()
            for i, name in enumerate(names):
                fd = os.open(d / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.write(fd, data)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if (i + 1) % block == 0:
                    now = time.perf_counter()
                    rates.append(round(block / (now - last), 1))
                    last = now
            (d / ".metadata.tmp").write_bytes(dcp_metadata(names))
            os.rename(d / ".metadata.tmp", d / ".metadata")
            t1 = time.perf_counter()
            rec["write_s"] = round(t1 - t0, 3)
            rec["files_per_s_by_block"] = rates
            rec["commit_to_durable_s"] = round(m.wait(d, self.a.run_timeout), 3)
            rec["total_s"] = round(time.perf_counter() - t0, 3)
            rec["objects_in_store"] = count_objects(store, "data/")
        except BenchError as e:
            rec["error"] = str(e)
            self.results["errors"].append(f"commit {case} round {rnd}: {e}")
        finally:
            rec.update(self.close(m))
            shutil.rmtree(store, ignore_errors=True)
        log(f"commit {case} round {rnd}: {rec}")
        self.results["commit"].append(rec)
        self.save()

    # -- mount ----------------------------------------------------------------------------------

    def mount_run(self, nsets: int, store: Path, rnd: int) -> None:
        m = self.mount(f"fresh{nsets}", store, ["--prefetch", "none"])
        rec: Json = {"sets": nsets, "files": nsets * self.a.files_per_set, "round": rnd}
        try:
            rec["mount_s"] = round(m.open(), 3)
            assert m.pid is not None
            rss = proc_rss_kb(m.pid)
            rec["rss_after_mount_mib"] = round(rss / 1024, 1) if rss is not None else None
            runs = sorted((m.mnt / "ckpt").iterdir())
            rec["sets_visible"] = sum(len(os.listdir(r)) for r in runs)
            if rec["sets_visible"] != nsets:
                raise BenchError(f"{rec['sets_visible']} sets visible, {nsets} in the store")
        except BenchError as e:
            rec["error"] = str(e)
            self.results["errors"].append(f"mount {nsets} round {rnd}: {e}")
        finally:
            rec.update(self.close(m))
        log(f"mount {nsets} sets round {rnd}: {rec}")
        self.results["mount"].append(rec)
        self.save()

    def run(self) -> None:
        a = self.a
        if "commit" in a.only:
            cases = [("shards", a.shards, a.shard_size),
                     ("8-files", 8, a.shards * a.shard_size // 8)]
            for rnd in range(a.rounds):
                for case, n, size in (cases if rnd % 2 == 0 else cases[::-1]):
                    self.commit_run(case, n, size, rnd)
        if "mount" in a.only:
            stores = {}
            for n in a.sets:
                stores[n] = self.work / f"gen-{n}"
                took = fill_store(stores[n], n, a.files_per_set)
                log(f"generated {n} sets x {a.files_per_set} files in {took:.1f}s")
            for rnd in range(a.rounds):
                order = a.sets if rnd % 2 == 0 else a.sets[::-1]
                for n in order:
                    self.mount_run(n, stores[n], rnd)

    # -- report ---------------------------------------------------------------------------------

    def report(self) -> str:
        return report(self.results)

    def cleanup(self) -> None:
        for m in list(self.mounts):
            try:
                self.close(m)
            except Exception as e:  # noqa: BLE001
                log(f"!! cleanup of {m.mnt}: {e}")
        if any(is_mounted(p) for p in self.work.glob("mnt-*")):
            log(f"!! something is still mounted under {self.work}: not removing it")
        elif not self.a.keep_workdir:
            shutil.rmtree(self.work, ignore_errors=True)


def report(r: Json, title: bool = True) -> str:
    """The markdown tables of a results.json (also docs/PERFORMANCE.md's "Scale" section:
    scripts/bench_report.py)."""
    out: list[str] = []
    h = "##" if title else "###"
    if title:
        out += [(f"# ckptfs scale: one big set, many sets ({r['started']}, git "
                 f"{r['machine']['git']}, {r['machine']['cpus']} CPUs)"), ""]
    ok = [x for x in r["commit"] if "error" not in x]
    if ok:
        head = ("| case | files | write | commit -> durable | total | files/s first block"
                " | files/s last block | daemon CPU s | peak RSS MiB | objects in store |")
        out += [f"{h} One set: commit -> durable (median [min-max] over rounds, seconds)", "",
                head, "|---|---|---|---|---|---|---|---|---|---|"]
        for case in ("shards", "8-files"):
            xs = [x for x in ok if x["case"] == case]
            if not xs:
                continue
            first = [x["files_per_s_by_block"][0] for x in xs if x["files_per_s_by_block"]]
            lastb = [x["files_per_s_by_block"][-1] for x in xs if x["files_per_s_by_block"]]
            out.append(
                f"| {case} | {xs[0]['files']} | {mmm([x['write_s'] for x in xs])} | "
                f"{mmm([x['commit_to_durable_s'] for x in xs])} | "
                f"{mmm([x['total_s'] for x in xs])} | {mmm(first)} | {mmm(lastb)} | "
                f"{mmm([x['daemon_cpu_s'] for x in xs if x.get('daemon_cpu_s')])} | "
                f"{mmm([x['peak_rss_mib'] for x in xs if x.get('peak_rss_mib')])} | "
                f"{', '.join(str(x['objects_in_store']) for x in xs)} |")
        for field, what in (("commit_to_durable_s", "commit -> durable (issue 35's bar: 2x)"),
                            ("total_s", "write + commit -> durable")):
            sh = {x["round"]: x[field] for x in ok if x["case"] == "shards"}
            ei = {x["round"]: x[field] for x in ok if x["case"] == "8-files"}
            ratios = [sh[k] / ei[k] for k in sh if k in ei and ei[k] > 0]
            if ratios:
                out += ["", f"shards / 8-files, {what}, round by round: {mmm(ratios)}x"]
        out.append("")
    okm = [x for x in r["mount"] if "error" not in x]
    if okm:
        head = "| sets | files | mount s | RSS after mount MiB | peak RSS MiB | daemon CPU s |"
        out += [f"{h} A fresh node's `ckptfs mount` on a store of N sets", "", head,
                "|---|---|---|---|---|---|"]
        for n in sorted({x["sets"] for x in okm}):
            xs = [x for x in okm if x["sets"] == n]
            out.append(f"| {n} | {xs[0]['files']} | {mmm([x['mount_s'] for x in xs])} | "
                       f"{mmm([x['rss_after_mount_mib'] for x in xs if x.get('rss_after_mount_mib')])} | "  # noqa: E501
                       f"{mmm([x['peak_rss_mib'] for x in xs if x.get('peak_rss_mib')])} | "
                       f"{mmm([x['daemon_cpu_s'] for x in xs if x.get('daemon_cpu_s')])} |")
        out.append("")
    if r["errors"]:
        out += [f"{h} Errors", ""] + [f"- {e}" for e in r["errors"]]
    return "\n".join(out)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="ckptfs at scale: one big set, many sets (see the "
                                "module docstring)")
    p.add_argument("--quick", action="store_true",
                   help="1,024 shards; 1,000 and 2,000 sets; 1 round")
    p.add_argument("--only", type=lambda s: s.split(","), default=["commit", "mount"],
                   help="commit, mount or both (default commit,mount)")
    p.add_argument("--shards", type=int, default=None, help="default 8192 (--quick: 1024)")
    p.add_argument("--shard-size", type=parse_size, default=64 << 10, help="default 64K")
    p.add_argument("--sets", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="set counts of the mount case (default 1000,10000; --quick 1000,2000)")
    p.add_argument("--files-per-set", type=int, default=10, help="default 10")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 1)")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds one commit -> durable wait may take (default 1800)")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "scale-sets",
                   help="output directory (default bench-results/scale-sets)")
    p.add_argument("--workdir", type=Path, default=Path("/dev/shm"),
                   help="where store, caches and mount points go (default /dev/shm)")
    p.add_argument("--docs", action="store_true",
                   help="also write docs/bench/scale-sets.json, which scripts/bench_perf.py "
                   "renders into docs/PERFORMANCE.md's \"Scale\" section")
    p.add_argument("--keep-workdir", action="store_true", help="do not delete the temp dir")
    p.add_argument("--ckptfs", default=None, help="the ckptfs CLI (default: beside python)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.shards = a.shards or (1024 if a.quick else 8192)
    a.sets = a.sets or ([1000, 2000] if a.quick else [1000, 10000])
    a.rounds = a.rounds or (1 if a.quick else 3)
    if a.shards < 8 or a.rounds < 1 or a.files_per_set < 1:
        log("need --shards >= 8, --rounds >= 1 and --files-per-set >= 1")
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    a.out = a.out.absolute()
    bench = Bench(a)
    code = 0
    try:
        bench.run()
    except KeyboardInterrupt as e:
        bench.results["errors"].append(f"interrupted: {e}")
        code = 130
    except BenchError as e:
        bench.results["errors"].append(str(e))
        code = 1
    finally:
        bench.cleanup()
        bench.save()
        log(bench.report())
        log(f"results: {bench.out / 'results.md'}, {bench.out / 'results.json'}")
    if code == 0 and bench.results["errors"]:
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
