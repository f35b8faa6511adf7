#!/usr/bin/env python3
"""Production scale (issue 35): what a commit and a create cost through a real mount as the
index's history and a directory grow.

What it measures
    commits   A mount per history size N (--sets, default 10,1000,10000) on a file:// store.
              Its history is built through the mount first: N sets under `hist/`, each a 4 KiB
              file written as `f<i>.tmp` and renamed to `f<i>`, every 10th a DCP-like directory
              (8 shards of 4 KiB `__<r>_0.distcp`, then `.metadata.tmp` renamed to `.metadata`),
              with `ckptfs wait hist` letting uploads drain every --drain-every sets and at the
              end. Then a window of --window commits of the same shape (new names) is timed:
              commits/s over the window's wall time, and the latency of each committing rename
              (`x.tmp` -> `x`, `.metadata.tmp` -> `.metadata`): p50, p99. Uploads run beside the
              window as they would in training; after it, `ckptfs wait win` waits for them:
              "window durable s" is the time from the window's first write until every set of
              it is durable (the background's pace).
    creates   One mount, one directory per size D (--entries, default 10,1000,10000) named
              `e<D>.tmp` (an open set: its files commit nothing) holding D empty subdirectories
              (--entry-files: empty files). A window of --creates creates (open
              O_CREAT|O_EXCL, close) in it is timed: creates/s and the p99 latency of one
              create, and the part records the daemon wrote meanwhile; the new files are then
              removed and the mount left to settle (untimed), so every round sees D entries.
    growth    While the largest history is built: at each N, the index's size (index.sqlite +
              its WAL), the daemon's RSS, and `tiering.services.history` (sets pruned, passes)
              from `ckptfs status --json`.

Rounds (--rounds): each round runs every window once, in an order reversed every other round,
so a drift of the machine (other jobs on a 2-core VM) does not favour one size. The largest
history is built once and grows by one window a round (the table gives the sets at each window's
start); every smaller one is built afresh each round (a new cache dir and store), so its window
always starts from N. Reported per size: median [min-max] over the rounds; the ratios
rate(largest)/rate(smallest) are taken round by round (the two windows ran back to back) and
reported as median [min-max], against the issue's bar (>= 0.8).

Where: the cache dirs and the stores on ext4 over a RAM-backed loop device (a file on /dev/shm,
scripts/bench_overhead.py RamDisk), so the VM's disk does not swing the numbers; needs root
(loop device, mount) and FUSE.

Output (--out, default bench-results/scale)
    results.json  configuration, machine load, every window and growth sample
    results.md    the tables
    scale.png     cost against N (with matplotlib, the `bench` extra)

Run:
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_scale.py --quick   # N 10,1000; ~1-2 min
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_scale.py           # N up to 10,000; ~15 min
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_scale.py --docs    # + docs/bench/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from bench_overhead import RamDisk
from bench_restore import Mount
from benchlib import (
    BenchError,
    MiB,
    find_ckptfs,
    is_mounted,
    loadavg,
    log,
    mmm,
    parse_size,
    proc_rss_kb,
    run_text,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
Json = dict[str, Any]


class Metadata:
    """Pickles as DCP's `.metadata` does, for what ckptfs reads of it (cachemgr.format.dcp:
    `storage_data`, each value's `relative_path`)."""

    def __init__(self, files: list[str]) -> None:
        self.storage_data = {i: StorageInfo(f) for i, f in enumerate(files)}


class StorageInfo:
    def __init__(self, relative_path: str) -> None:
        self.relative_path = relative_path


SHARD = b"s" * 4096
FILE = b"f" * 4096
META = pickle.dumps(Metadata([f"__{r}_0.distcp" for r in range(8)]))
BAR = 0.8  # issue 35: rate at the largest size / rate at the smallest


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of xs."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def one_set(root: Path, name: str, dcp: bool) -> float:
    """Write one set under `root`; returns the seconds of the rename that commits it."""
    if dcp:
        d = root / name
        d.mkdir()
        for r in range(8):
            (d / f"__{r}_0.distcp").write_bytes(SHARD)
        (d / ".metadata.tmp").write_bytes(META)
        t0 = time.perf_counter()
        os.rename(d / ".metadata.tmp", d / ".metadata")
        return time.perf_counter() - t0
    (root / f"{name}.tmp").write_bytes(FILE)
    t0 = time.perf_counter()
    os.rename(root / f"{name}.tmp", root / name)
    return time.perf_counter() - t0


def ms(x: float) -> float:
    return round(x * 1e3, 3)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.ckptfs = find_ckptfs(a.ckptfs)
        self.out: Path = a.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="ckptfs-scale-", dir="/var/tmp"))
        self.disk: RamDisk | None = None
        self.mounts: dict[str, Mount] = {}
        self.built: dict[str, int] = {}  # mount name -> sets written under hist/
        self._puts: dict[str, int | None] = {}
        self.results: Json = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "machine": {"nproc": os.cpu_count(), "kernel": run_text(["uname", "-r"]),
                        "python": sys.version.split()[0]},
            "commits": [], "creates": [], "growth": [], "errors": [],
            "argv": a.argv, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "git_head": run_text(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"])}

    # -- mounts ------------------------------------------------------------------------------

    def mount(self, name: str) -> Mount:
        """A fresh mount `name`: an empty cache dir and store on the RAM disk."""
        assert self.disk is not None
        base = self.disk.path / name
        shutil.rmtree(base, ignore_errors=True)
        (base / "store").mkdir(parents=True)
        m = Mount(self.ckptfs, self.work / f"mnt-{name}", base / "cache",
                  ["--store", f"file://{base / 'store'}", *self.a.mount_args.split()], name)
        m.open()
        self.mounts[name] = m
        self.built[name] = 0
        (m.mnt / "hist").mkdir()
        return m

    def unmount(self, name: str) -> None:
        m = self.mounts.pop(name, None)
        if m is None:
            return
        if is_mounted(m.mnt):  # files in open sets (the create dirs) are not saved: on purpose
            subprocess.run([self.ckptfs, "umount", "--no-wait", "--allow-unsaved", str(m.mnt)],
                           check=False, capture_output=True, timeout=300)
        m.close(keep_log_as=self.out / f"daemon-{name}.log")
        if m.info.get("daemon_log_problems"):
            self.results["errors"].append(f"{name}: daemon logged problems, "
                                          f"see {m.info.get('daemon_log_copy')}")

    def drain(self, m: Mount, what: str) -> None:
        res = subprocess.run([self.ckptfs, "wait", str(m.mnt / what)], check=False,
                             capture_output=True, text=True, timeout=1800)
        if res.returncode != 0:
            raise BenchError(f"ckptfs wait {what} on {m.name}: exit {res.returncode} "
                             f"{(res.stdout + res.stderr).strip()}")

    def sample(self, m: Mount) -> Json:
        """The index's size, the daemon's RSS and History's counters, now."""
        idx = sum(p.stat().st_size for p in m.cache.glob("index.sqlite*") if p.is_file())
        st = m.status() or {}
        hist = st.get("tiering", {}).get("services", {}).get("history", {})
        rss = proc_rss_kb(m.pid) if m.pid else None
        return {"index_mib": round(idx / MiB, 2),
                "rss_mib": round(rss / 1024, 1) if rss else None,
                "pruned": hist.get("pruned"), "passes": hist.get("passes")}

    def build(self, m: Mount, n: int, grow: bool) -> None:
        """Write history under hist/ until it holds `n` sets, draining every --drain-every."""
        marks = sorted({*range(0, n, self.a.drain_every), n} - {0})
        t0 = time.perf_counter()
        for mark in marks:
            for i in range(self.built[m.name], mark):
                one_set(m.mnt / "hist", f"h{i}", i % 10 == 9)
            self.built[m.name] = mark
            self.drain(m, "hist")
            if grow:
                self.results["growth"].append({"sets": mark, **self.sample(m)})
                log(f"  {m.name}: {mark} sets, {self.results['growth'][-1]}")
        log(f"  {m.name}: history of {n} sets built in {time.perf_counter() - t0:.1f} s")

    # -- windows -----------------------------------------------------------------------------

    def commit_window(self, m: Mount, n: int, rnd: int) -> Json:
        root = m.mnt / "win"
        root.mkdir(exist_ok=True)
        before = self.sample(m)
        lat: list[float] = []
        load0 = loadavg()
        t0 = time.perf_counter()
        for i in range(self.a.window):
            lat.append(one_set(root, f"r{rnd}_{i}", i % 10 == 9))
        wall = time.perf_counter() - t0
        self.drain(m, "win")
        drained = time.perf_counter() - t0
        rec = {"round": rnd, "n": n, "sets_at_start": self.built[m.name] + rnd * self.a.window
               if n == max(self.a.sets) else n,
               "commits": len(lat), "wall_s": round(wall, 4),
               "rate": round(len(lat) / wall, 1), "p50_ms": ms(pct(lat, 0.5)),
               "p99_ms": ms(pct(lat, 0.99)), "max_ms": ms(max(lat)), "load": load0,
               "durable_s": round(drained, 2),
               "before": before, "after": self.sample(m)}
        log(f"  commits N={n} round {rnd}: {rec['rate']}/s p99 {rec['p99_ms']} ms")
        return rec

    def create_window(self, m: Mount, d: int, rnd: int) -> Json:
        root = m.mnt / f"e{d}.tmp"
        self.parts_puts(m)
        lat: list[float] = []
        names = [root / f"new{k}" for k in range(self.a.creates)]
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
        load0 = loadavg()
        t0 = time.perf_counter()
        for p in names:
            t1 = time.perf_counter()
            os.close(os.open(p, flags, 0o644))
            lat.append(time.perf_counter() - t1)
        wall = time.perf_counter() - t0
        parts = self.parts_puts(m)
        for p in names:
            p.unlink()
        rec = {"round": rnd, "entries": d, "creates": len(lat), "wall_s": round(wall, 4),
               "rate": round(len(lat) / wall, 1), "p50_ms": ms(pct(lat, 0.5)),
               "p99_ms": ms(pct(lat, 0.99)), "load": load0, "part_record_puts": parts}
        self.settle(m)
        log(f"  creates D={d} round {rnd}: {rec['rate']}/s p99 {rec['p99_ms']} ms")
        return rec

    def parts_puts(self, m: Mount) -> int | None:
        """Part records written since the last call (cachemgr.tiering.parts: each close in an
        open set marks its directory, and a record lists every file in it)."""
        st = m.status() or {}
        puts = st.get("tiering", {}).get("parts", {}).get("puts")
        last = self._puts.get(m.name)
        self._puts[m.name] = puts
        return None if puts is None or last is None else puts - last

    def settle(self, m: Mount, timeout: float = 300) -> None:
        """Wait until no upload runs or waits and no part record is due."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            t = (m.status() or {}).get("tiering", {})
            up = t.get("uploads", {})
            if not (up.get("running") or up.get("queued") or t.get("parts", {}).get("dirty")):
                return
            time.sleep(0.2)
        raise BenchError(f"{m.name} did not settle in {timeout} s")

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> None:
        a = self.a
        # An inode per 4 KiB (mkfs's default: 16 KiB): 10,000 sets are ~40,000 files and
        # directories in the cache dir and ~60,000 in the store (data/<node>/<ino>/<version>/).
        self.disk = RamDisk(a.disk, self.work / "disk", ("-i", "4096"))
        log(f"bench_scale: cache dirs and stores on ext4 over a {a.disk >> 20} MiB RAM-backed "
            f"loop device ({self.disk.dev}); mounts under {self.work}")
        top = max(a.sets)
        log(f"building the largest history ({top} sets)")
        big = self.mount(f"n{top}")
        self.build(big, top, grow=True)
        dm = self.mount("dirs")
        for d in a.entries:
            root = dm.mnt / f"e{d}.tmp"
            root.mkdir()
            for k in range(d):
                # Empty subdirectories, not files: each file closed in an open set marks the
                # directory's part record, which lists every file in it, so 10,000 files
                # take O(D^2) to make (see --entry-files); a mkdir marks nothing.
                if a.entry_files:
                    os.close(os.open(root / f"e{k:05d}", os.O_CREAT | os.O_WRONLY, 0o644))
                else:
                    (root / f"e{k:05d}").mkdir()
        self.settle(dm)
        log(f"directories of {a.entries} entries made")
        for rnd in range(a.rounds):
            order = a.sets if rnd % 2 == 0 else a.sets[::-1]
            for n in order:
                if n == top:
                    m = big
                else:
                    self.unmount(f"n{n}")
                    m = self.mount(f"n{n}")
                    self.build(m, n, grow=False)
                self.results["commits"].append(self.commit_window(m, n, rnd))
            for d in (a.entries if rnd % 2 == 0 else a.entries[::-1]):
                self.results["creates"].append(self.create_window(dm, d, rnd))
            self.save()
        self.results["growth"].append({"sets": self.built[big.name] + a.rounds * a.window,
                                       "after": "all windows", **self.sample(big)})

    def cleanup(self) -> None:
        for name in list(self.mounts):
            try:
                self.unmount(name)
            except Exception as e:  # noqa: BLE001 - unmount the others whatever happened
                self.results["errors"].append(f"unmount {name}: {e}")
        if self.disk is not None:
            self.disk.close()
        if not self.a.keep_workdir:
            shutil.rmtree(self.work, ignore_errors=True)

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------
# the report


def _mmm(xs: list[float], nd: int = 1) -> str:
    t = mmm(xs)
    if t is None:
        return "-"
    return f"{t[0]:.{nd}f} [{t[1]:.{nd}f}-{t[2]:.{nd}f}]"


def ratios(rows: list[Json], key: str, small: int, large: int) -> list[float]:
    """rate(large)/rate(small), round by round."""
    by = {(r["round"], r[key]): r["rate"] for r in rows}
    return [by[(rnd, large)] / by[(rnd, small)] for rnd in sorted({r["round"] for r in rows})
            if (rnd, large) in by and (rnd, small) in by]


def summary(res: Json) -> Json:
    c, d = res["commits"], res["creates"]
    out: Json = {"commits": {}, "creates": {}}
    for n in sorted({r["n"] for r in c}):
        rs = [r for r in c if r["n"] == n]
        out["commits"][n] = {k: mmm(r[k] for r in rs) for k in ("rate", "p50_ms", "p99_ms")}
        out["commits"][n]["sets_at_start"] = [r["sets_at_start"] for r in rs]
    for e in sorted({r["entries"] for r in d}):
        rs = [r for r in d if r["entries"] == e]
        out["creates"][e] = {k: mmm(r[k] for r in rs) for k in ("rate", "p50_ms", "p99_ms")}
    if c:
        ns = sorted({r["n"] for r in c})
        out["commit_ratio"] = mmm(ratios(c, "n", ns[0], ns[-1]))
    if d:
        es = sorted({r["entries"] for r in d})
        out["create_ratio"] = mmm(ratios(d, "entries", es[0], es[-1]))
    return out


def verdict(r: list[float]) -> str:
    met = "met" if r[0] >= BAR else "NOT met"
    return (f"rate(largest)/rate(smallest), round by round: {r[0]:.2f} "
            f"[{r[1]:.2f}-{r[2]:.2f}] (bar >= {BAR}: {met})")


def markdown(res: Json, s: Json, title: str = "# ckptfs scale: history and directory size") -> str:
    """The report: `title` heads it, its tables one level below (docs/PERFORMANCE.md's
    "Scale: history and directory size" through scripts/bench_report.py)."""
    cfg = res["config"]
    c, d = res["commits"], res["creates"]
    mode = "quick" if cfg["quick"] else "full"
    h = "#" * (title.split(" ")[0].count("#") + 1)
    cmd = " ".join(["python scripts/bench_scale.py", *res.get("argv", [])])
    loads = [r["load"][0] for r in c + d]
    lines = [title, "", (f"_From `{cmd}` ({mode}, {res.get('time', '?')}, commit "
                         f"{res.get('git_head', '?')}): {cfg['rounds']} rounds, median "
                         f"[min-max]; {res['machine']['nproc']} CPUs, load average (1 min) "
                         f"{min(loads, default=0)}-{max(loads, default=0)} at the windows' "
                         "starts. Cache dirs and stores on ext4 over a RAM-backed loop "
                         "device; a file:// store._"), "",
             f"{h} Commits ({cfg['window']} per window; 1 in 10 a DCP-like directory)", "",
             ("| sets in the index | commits/s | commit rename p50 ms | p99 ms | "
              "window durable s |"), "| --- | --- | --- | --- | --- |"]
    for n in sorted({r["n"] for r in c}):
        rs = [r for r in c if r["n"] == n]
        starts = sorted({r["sets_at_start"] for r in rs})
        label = f"{starts[0]:,}" + (f"-{starts[-1]:,}" if len(starts) > 1 else "")
        lines.append(f"| {label} | {_mmm([r['rate'] for r in rs])} | "
                     f"{_mmm([r['p50_ms'] for r in rs], 2)} | "
                     f"{_mmm([r['p99_ms'] for r in rs], 2)} | "
                     f"{_mmm([r['durable_s'] for r in rs if 'durable_s' in r])} |")
    if s.get("commit_ratio"):
        r = s["commit_ratio"]
        lines += ["", verdict(r)]
    lines += ["", f"{h} Creates in one directory ({cfg['creates']} per window)", "",
              (f"Entries: empty {'files' if cfg['entry_files'] else 'subdirectories'}, in a "
               "directory named `*.tmp` (an open set)."), "",
              "| entries | creates/s | create p50 ms | p99 ms | part records written |",
              "| --- | --- | --- | --- | --- |"]
    for e in sorted({r["entries"] for r in d}):
        rs = [r for r in d if r["entries"] == e]
        puts = [r["part_record_puts"] for r in rs if r.get("part_record_puts") is not None]
        lines.append(f"| {e:,} | {_mmm([r['rate'] for r in rs])} | "
                     f"{_mmm([r['p50_ms'] for r in rs], 3)} | {_mmm([r['p99_ms'] for r in rs], 3)}"
                     f" | {_mmm(puts, 0)} |")
    if s.get("create_ratio"):
        r = s["create_ratio"]
        lines += ["", verdict(r)]
    lines += ["", f"{h} Index and daemon as history grows (the largest mount)", "",
              "| sets written | index.sqlite + WAL MiB | daemon RSS MiB | sets pruned | passes |",
              "| --- | --- | --- | --- | --- |"]
    for g in res["growth"]:
        lines.append(f"| {g['sets']:,}{' (after the windows)' if g.get('after') else ''} | "
                     f"{g['index_mib']} | {g['rss_mib']} | {g['pruned']} | {g['passes']} |")
    if res["errors"]:
        lines += ["", f"{h} Errors", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n"


def _interrupt(signum: int, _frame: FrameType | None) -> NoReturn:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def int_list(s: str) -> list[int]:
    try:
        xs = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {s!r}") from None
    if not xs or min(xs) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {s!r}")
    return sorted(set(xs))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="N 10,1000, directories 10,1000, 100-commit windows, 2 rounds")
    p.add_argument("--sets", type=int_list, default=None,
                   help="history sizes N (default 10,1000,10000)")
    p.add_argument("--entries", type=int_list, default=None,
                   help="directory sizes D (default 10,1000,10000)")
    p.add_argument("--entry-files", action="store_true",
                   help="make the directories' entries empty files (default: empty "
                   "subdirectories, much faster to make: no part record each)")
    p.add_argument("--window", type=int, default=None, help="commits per window (default 200)")
    p.add_argument("--creates", type=int, default=None, help="creates per window (default 500)")
    p.add_argument("--rounds", type=int, default=None, help="default 3 (--quick: 2)")
    p.add_argument("--drain-every", type=int, default=2000,
                   help="sets written between two drains while history is built (default 2000)")
    p.add_argument("--disk", type=parse_size, default=parse_size("2G"),
                   help="size of the RAM-backed ext4 for cache dirs and stores (default 2G)")
    p.add_argument("--mount-args", default="", help="extra `ckptfs mount` options")
    p.add_argument("--docs", action="store_true",
                   help="also write docs/bench/scale.json (and scale.png): the numbers of "
                   "docs/PERFORMANCE.md's \"Scale\" section at its next scripts/bench_report.py")
    p.add_argument("--out", type=Path, default=REPO / "bench-results" / "scale")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--ckptfs", default=None, help="the ckptfs CLI (default: beside python)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    a.argv = argv
    q = a.quick
    a.sets = a.sets or ([10, 1000] if q else [10, 1000, 10000])
    a.entries = a.entries or ([10, 1000] if q else [10, 1000, 10000])
    a.window = a.window or (100 if q else 200)
    a.creates = a.creates or (300 if q else 500)
    a.rounds = a.rounds or (2 if q else 3)
    a.out = a.out.absolute()
    if os.geteuid() != 0:
        log("bench_scale: needs root (a loop device for the RAM-backed ext4)")
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        bench = Bench(a)
    except BenchError as e:
        log(f"error: {e}")
        return 2
    code = 0
    try:
        bench.run()
    except KeyboardInterrupt as e:
        bench.results["errors"].append(f"interrupted: {e}")
        code = 130
    except (BenchError, OSError, subprocess.SubprocessError) as e:
        log(f"error: {e.__class__.__name__}: {e}")
        bench.results["errors"].append(f"{e.__class__.__name__}: {e}")
        code = 1
    finally:
        bench.cleanup()
        s = summary(bench.results)
        bench.results["summary"] = s
        bench.save()
        text = markdown(bench.results, s)
        (bench.out / "results.md").write_text(text)
        from report_plots import scale_plot
        bench.results["plots"] = scale_plot(bench.results, bench.out)
        bench.save()
        if a.docs:  # docs/PERFORMANCE.md's section comes from this (scripts/bench_report.py)
            docs = REPO / "docs" / "bench"
            shutil.copy(bench.out / "results.json", docs / "scale.json")
            if (bench.out / "scale.png").exists():
                shutil.copy(bench.out / "scale.png", docs / "scale.png")
        log("")
        log(text)
        log(f"results: {bench.out / 'results.md'}, {bench.out / 'results.json'}")
    if code == 0 and bench.results["errors"]:
        code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
