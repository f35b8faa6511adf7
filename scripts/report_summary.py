"""The summary of scripts/bench_perf.py's results.json that scripts/bench_report.py renders:
per-target medians [min–max] of every measurement, the data path each ckptfs target ran, and
the targets (goals) with their measured values. Every number comes from the JSON.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from benchlib import mmm

# a JSON document (results.json and its parts, the summary and its rows)
Json = dict[str, Any]
# median, min, max (None: nothing measured)
Mmm = list[float] | None

MiB = 1 << 20
GiB = 1 << 30
RSS_BOUND_MIB = 1024  # 64M parts x 8 in flight + 32M prefetch x 8 + the daemon itself

TARGET_NAMES = {
    "raw": "raw cache disk (ceiling)",
    "ckptfs": "ckptfs",
    "ckptfs-fuse": "ckptfs --no-passthrough",
    "s3fs": "s3fs-fuse (use_cache)",
    "rclone": "rclone mount --vfs-cache-mode writes --ignore-checksum --no-checksum",
    "rclone-ro": "rclone mount, cold restore only: reads the objects the store-ceiling step "
                 "uploaded (its own upload failed)",
    "s3torch": "s3torchconnector DCP (direct to S3)",
    "ceiling": "boto3 transfer manager (store ceiling)",
}


# the ckptfs targets, in report order; fio records of runs before ckptfs-fuse say "mount"
CKPTFS_TARGETS = ("ckptfs", "ckptfs-fuse")
FIO_COLORS = {"ckptfs": "#1f77b4", "ckptfs-fuse": "#17becf"}
# goals of the passthrough issue (fio, torch.save, DCP save, daemon CPU): see issue_targets
ISSUE_RATIO = 0.9
ISSUE_DCP_SAVE = 1.1
ISSUE_CPU_S_PER_GIB = 0.1


def fio_target(r: Json) -> str:
    t: str = r.get("target") or ""
    return "ckptfs" if t == "mount" else t


def mount_target(m: Json) -> str:
    t: str = m.get("target") or "ckptfs"
    return t


def f3(t: Sequence[float] | None, fmt: str = "{:.2f}") -> str:
    if not t:
        return "—"
    med, lo, hi = t
    if len({round(lo, 6), round(hi, 6)}) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(lo)}–{fmt.format(hi)}]"


def la_range(recs: Iterable[Json]) -> str:
    """min–max of the 1-minute load average over the start/end readings of these records."""
    vals: list[float] = []
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


def data_paths(res: Json) -> Json:
    """Per ckptfs target: the data path its mounts actually ran (from `ckptfs status --json`
    -> data_path, recorded per mount), as a label, with the evidence."""
    out: Json = {}
    mounts = res.get("mounts", [])
    present = [t for t in CKPTFS_TARGETS
               if any(mount_target(m) == t for m in mounts)
               or any(fio_target(r) == t for r in res.get("fio", []))
               or any(r.get("target") == t for r in res.get("torch", []))]
    for t in present:
        ms = [m for m in mounts if mount_target(m) == t]
        dps = [m.get("data_path") for m in ms]
        known = [d for d in dps if d]
        modes = Counter(d.get("mode") for d in known)
        reasons = list(dict.fromkeys(d.get("off_reason") for d in known
                                     if d.get("mode") != "passthrough" and d.get("off_reason")))
        opens = sum(d.get("passthrough_opens") or 0 for d in known)
        served = sum(((m.get("final_status") or {}).get("io") or {}).get(k) or 0
                     for m in ms for k in ("bytes_written", "bytes_read"))
        fio_recs = [r for r in res.get("fio", []) if fio_target(r) == t and "error" not in r]
        fio_moved = sum(r.get("io_bytes") or 0 for r in fio_recs
                        if "daemon_bytes_written" in r or "daemon_bytes_read" in r)
        fio_served = sum((r.get("daemon_bytes_written") or 0) + (r.get("daemon_bytes_read") or 0)
                         for r in fio_recs)
        why = "; ".join(reasons) or "no reason recorded"
        if not known:
            label, passthrough = "not recorded (run before data_path existed)", None
        elif modes.get("passthrough") == len(known):
            passthrough = opens > 0
            label = ("passthrough" if opens else
                     "passthrough on, but no open was answered in passthrough")
            if len(known) < len(dps):
                label += f" ({len(dps) - len(known)} of {len(dps)} mounts not recorded)"
        elif not modes.get("passthrough"):
            label, passthrough = f"fuse ({why})", False
        else:
            label = (f"mixed: passthrough on {modes.get('passthrough')} of {len(dps)} mounts, "
                     f"fuse ({why}) on the rest")
            passthrough = False
        out[t] = {"label": label, "passthrough": passthrough, "mounts": len(ms),
                  "modes": dict(modes), "off_reasons": reasons, "passthrough_opens": opens,
                  "daemon_served_bytes": served, "fio_bytes_moved": fio_moved,
                  "fio_daemon_served_bytes": fio_served}
    return out


def summarize(res: Json) -> Json:
    s: Json = {"fio": [], "torch": [], "ceiling": {}, "targets": [], "rss": []}
    s["data_paths"] = data_paths(res)
    fio = [r for r in res.get("fio", []) if "error" not in r and "bw_bytes" in r]
    phases = ["write", "read-warm", "read-cold"]
    jobs = sorted({r["numjobs"] for r in fio})
    cts = [t for t in CKPTFS_TARGETS if any(fio_target(r) == t for r in fio)]
    for ph in phases:
        for nj in jobs:
            sel = [r for r in fio if r["phase"] == ph and r["numjobs"] == nj]
            raw = {r["rep"]: r for r in sel if r["target"] == "raw"}
            row = {"phase": ph, "numjobs": nj, "raw_mbps": mmm([r["mbps"] for r in raw.values()]),
                   "loadavg": la_range(sel), "by": {}}
            for t in cts:
                mnt = {r["rep"]: r for r in sel if fio_target(r) == t}
                ratios = [mnt[k]["bw_bytes"] / raw[k]["bw_bytes"]
                          for k in raw.keys() & mnt.keys()]
                cpu = [m["daemon_cpu_s"] / (m["io_bytes"] / GiB) for m in mnt.values()
                       if m.get("daemon_cpu_s") is not None and m.get("io_bytes")]
                key = "daemon_bytes_written" if ph == "write" else "daemon_bytes_read"
                share = [m[key] / m["io_bytes"] for m in mnt.values()
                         if m.get(key) is not None and m.get("io_bytes")]
                row["by"][t] = {
                    "mbps": mmm([r["mbps"] for r in mnt.values()]), "ratio": mmm(ratios),
                    "daemon_cpu_s_per_gib": mmm(cpu),
                    "daemon_main_cpu_s_per_gib": mmm(
                        [m["daemon_main_thread_cpu_s"] / (m["io_bytes"] / GiB)
                         for m in mnt.values()
                         if m.get("daemon_main_thread_cpu_s") is not None and m.get("io_bytes")]),
                    "daemon_served_share": mmm(share),
                    "upload_drain_s": mmm([m.get("upload_drain_s") for m in mnt.values()]),
                    "n": len(ratios)}
            # the `ckptfs` target under the keys of earlier reports
            ck = row["by"].get("ckptfs") or {}
            row.update(mount_mbps=ck.get("mbps"), ratio=ck.get("ratio"),
                       daemon_cpu_s_per_gib=ck.get("daemon_cpu_s_per_gib"),
                       upload_drain_s=ck.get("upload_drain_s"), n=ck.get("n", 0))
            s["fio"].append(row)
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
        for t in ("raw", *CKPTFS_TARGETS, "s3fs", "rclone", "rclone-ro", "s3torch"):
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
            row["daemon_cpu_during_save_s_per_gib"] = mmm(
                [r["daemon_cpu_during_save_s"] / (r["bytes"] / GiB) for r in sel
                 if r.get("daemon_cpu_during_save_s") is not None and r.get("bytes")])
            row["daemon_main_cpu_during_save_s_per_gib"] = mmm(
                [r["daemon_main_thread_cpu_during_save_s"] / (r["bytes"] / GiB) for r in sel
                 if r.get("daemon_main_thread_cpu_during_save_s") is not None and r.get("bytes")])
            row["daemon_cpu_save_durable_s_per_gib"] = mmm(
                [r["daemon_cpu_save_s"] / (r["bytes"] / GiB) for r in sel
                 if r.get("daemon_cpu_save_s") is not None and r.get("bytes")])
            row["daemon_served_save_share"] = mmm(
                [(r.get("save_io") or {}).get("daemon_bytes_written", 0) / r["bytes"]
                 for r in sel if r.get("save_io") and r.get("bytes")])
            for ph, key in (("warm", "warm_io"), ("cold", "cold_io")):
                row[f"daemon_served_{ph}_share"] = mmm(
                    [(r.get(key) or {}).get("daemon_bytes_read", 0) / r["bytes"]
                     for r in sel if r.get(key) and r.get("bytes")])
                row[f"passthrough_opens_{ph}"] = mmm(
                    [(r.get(key) or {}).get("passthrough_opens") for r in sel if r.get(key)])
            row["passthrough_opens_save"] = mmm(
                [(r.get("save_io") or {}).get("passthrough_opens") for r in sel
                 if r.get("save_io")])
            row["node_peak_rss_mib"] = mmm([r.get("node_peak_rss_mib") for r in sel])
            row["cold_node_peak_rss_mib"] = mmm([r.get("cold_node_peak_rss_mib") for r in sel])
            errs = [r["error"] for r in res.get("torch", [])
                    if r["workload"] == wl and r["target"] == t and "error" in r]
            if errs:
                row["error"] = errs[0]
            s["torch"].append(row)
    s["targets"] = targets(res, s)
    s["issue_targets"] = issue_targets(res, s)
    for m in res.get("mounts", []):
        dpm = m.get("data_path") or {}
        s["rss"].append({"name": m.get("name"), "target": mount_target(m),
                         "data_path": (None if not dpm else dpm.get("mode") if
                                       dpm.get("mode") == "passthrough" else
                                       f"{dpm.get('mode')} ({dpm.get('off_reason')})"),
                         "bytes_through": m.get("bytes_through"),
                         "peak_rss_mib": m.get("peak_rss_sampled_mib") or m.get("peak_rss_mib")})
    return s


def _paired(res: Json, wl: str, num: str, den: str, key_num: str, key_den: str | None = None,
            invert: bool = False) -> Mmm:
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


def targets(res: Json, s: Json) -> list[Json]:
    out: list[Json] = []

    def add(name: str, goal: float, op: str, val: Mmm, why_key: str, note: str = "") -> None:
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
    a_mounts = [m for m in res.get("mounts", [])
                if str(m.get("name", "")).endswith("-A") and mount_target(m) == "ckptfs"]
    peaks = [m.get("peak_rss_sampled_mib") or m.get("peak_rss_mib") for m in a_mounts]
    tot = sum((m.get("bytes_through") or 0) for m in a_mounts)
    add(f"daemon peak RSS (MiB) while checkpointing {tot / GiB:.1f} GiB through one mount",
        RSS_BOUND_MIB, "<=", mmm(peaks), "rss")
    return out


def issue_targets(res: Json, s: Json) -> list[Json]:
    """The goals of the passthrough issue, each with the measured value of every ckptfs target
    (median [min–max] over repeats) and met / not met. Only measured values."""
    cts = [t for t in CKPTFS_TARGETS if t in s.get("data_paths", {})
           or any(t in r.get("by", {}) for r in s["fio"])]
    out = []

    def add(name: str, goal: float, op: str, vals: dict[str, Mmm], fmt: str = "{:.2f}",
            main: dict[str, Mmm] | None = None) -> None:
        by = {}
        for t in cts:
            v = vals.get(t)
            met = None
            if v:
                met = v[0] >= goal if op == ">=" else v[0] <= goal
            by[t] = {"measured": v, "met": met}
            if main is not None:  # the daemon's main thread alone (FUSE requests): evidence
                by[t]["main_thread"] = main.get(t)
        out.append({"target": name, "goal": f"{op} {goal:g}", "by": by, "fmt": fmt})

    phase_names = {"write": "fio write (end_fsync) mount/raw",
                   "read-warm": "fio read right after the write mount/raw",
                   "read-cold": "fio read after drop_caches mount/raw"}
    for ph, title in phase_names.items():
        for r in s["fio"]:
            if r["phase"] == ph:
                add(f"{title}, {r['numjobs']} job(s)", ISSUE_RATIO, ">=",
                    {t: (r["by"].get(t) or {}).get("ratio") for t in cts})
    add("mlperf per-rank torch.save: mount/raw throughput (raw save s / mount save s)",
        ISSUE_RATIO, ">=", {t: _paired(res, "mlperf", t, "raw", "save_s", invert=True)
                            for t in cts})
    add("DCP save time (trainer-visible): mount/raw", ISSUE_DCP_SAVE, "<=",
        {t: _paired(res, "dcp", t, "raw", "save_s") for t in cts})
    for r in s["fio"]:
        if r["phase"] == "write":
            add(f"daemon CPU s per GiB written: fio write, {r['numjobs']} job(s)",
                ISSUE_CPU_S_PER_GIB, "<=",
                {t: (r["by"].get(t) or {}).get("daemon_cpu_s_per_gib") for t in cts}, "{:.3f}",
                {t: (r["by"].get(t) or {}).get("daemon_main_cpu_s_per_gib") for t in cts})
    for wl, title in (("mlperf", "mlperf torch.save"), ("dcp", "DCP save")):
        rows = {r["target"]: r for r in s["torch"] if r["workload"] == wl}
        if any(t in rows for t in cts):
            add(f"daemon CPU s per GiB written: {title} (until the save returns)",
                ISSUE_CPU_S_PER_GIB, "<=",
                {t: (rows.get(t) or {}).get("daemon_cpu_during_save_s_per_gib") for t in cts},
                "{:.3f}",
                {t: (rows.get(t) or {}).get("daemon_main_cpu_during_save_s_per_gib")
                 for t in cts})
    return out

