"""The plots of scripts/bench_report.py (docs/bench/perf-*.png): fio MB/s per target, the
torch workloads' times, the targets against their goals. matplotlib is optional (the `bench`
extra): without it there are no plots, and the report says so.
"""

from __future__ import annotations

from pathlib import Path

from report_summary import CKPTFS_TARGETS, FIO_COLORS, TARGET_NAMES, GiB, Json, Mmm

# plots


def plots(res: Json, s: Json, outdir: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [f"not available: matplotlib ({e})"]
    outdir.mkdir(parents=True, exist_ok=True)
    made: list[str] = []
    mode = res.get("config", {}).get("mode", "?")

    def err(t: Mmm) -> list[list[float]]:
        return [[t[0] - t[1]], [t[2] - t[0]]] if t else [[0], [0]]

    # fio
    rows = [r for r in s["fio"] if r["raw_mbps"] and any(b["mbps"] for b in r["by"].values())]
    if rows:
        dp = s.get("data_paths", {})
        series = [("raw", "raw cache disk", "#888")] + [
            (t, f"{TARGET_NAMES[t]} [{(dp.get(t) or {}).get('label', '?')}]", FIO_COLORS[t])
            for t in CKPTFS_TARGETS if any(t in r["by"] for r in rows)]
        fig, ax = plt.subplots(figsize=(11, 4.4))
        x = range(len(rows))
        w = 0.8 / len(series)
        for i, (t, lab, col) in enumerate(series):
            xs: list[float] = []
            ys: list[float] = []
            bars: list[list[float]] = [[], []]
            for xi, r in zip(x, rows):
                v = r["raw_mbps"] if t == "raw" else (r["by"].get(t) or {}).get("mbps")
                if not v:
                    continue
                xs.append(xi + (i - (len(series) - 1) / 2) * w)
                ys.append(v[0])
                bars[0].append(v[0] - v[1])
                bars[1].append(v[2] - v[0])
                if t != "raw" and (r["by"][t] or {}).get("ratio"):
                    ax.annotate(f"{r['by'][t]['ratio'][0]:.2f}x", (xs[-1], v[0]),
                                ha="center", va="bottom", fontsize=6)
            ax.bar(xs, ys, w, yerr=bars, capsize=2, label=lab[:90], color=col)
        ax.set_xticks(list(x), [f"{r['phase']}\nnj={r['numjobs']}" for r in rows], fontsize=8)
        ax.set_ylabel("MB/s (median, min/max bars)")
        ax.set_yscale("log")
        ax.set_title(f"fio, 1 MiB sequential, incompressible: mounts vs raw, mount/raw above "
                     f"the bars ({mode} run)")
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
        colors = {"raw": "#888", "ckptfs": "#1f77b4", "ckptfs-fuse": "#17becf",
                  "s3fs": "#ff7f0e", "rclone": "#2ca02c", "s3torch": "#d62728",
                  "ceiling": "#9467bd"}
        for ax, wl in zip(axes[0], wls):
            rows = [r for r in s["torch"] if r["workload"] == wl and r["n"]]
            c = s["ceiling"].get(wl)
            if c and c["upload_s"]:
                rows = rows + [{"target": "ceiling", "durable_s": c["upload_s"],
                                "cold_s": c["download_s"]}]
            w = 0.8 / max(1, len(rows))
            for i, r in enumerate(rows):
                xs, ys = [], []
                es: list[list[float]] = [[], []]
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



def scale_plot(res: Json, outdir: Path) -> list[str]:
    """scripts/bench_scale.py: commits/s and creates/s against N (log x), median with min/max
    bars, and the commit rename's p99 latency."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [f"not available: matplotlib ({e})"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, rows, what in ((axes[0], "n", res["commits"], "sets in the index"),
                                (axes[1], "entries", res["creates"], "entries in the directory")):
        xs = sorted({r[key] for r in rows})
        if not xs:
            continue
        for metric, col, lab in (("rate", "#1f77b4", "per second"),
                                 ("p99_ms", "#d62728", "p99 ms")):
            vals = [sorted(r[metric] for r in rows if r[key] == x) for x in xs]
            med = [v[len(v) // 2] for v in vals]
            err = [[m - v[0] for m, v in zip(med, vals)], [v[-1] - m for m, v in zip(med, vals)]]
            a = ax if metric == "rate" else ax.twinx()
            a.errorbar(xs, med, yerr=err, color=col, marker="o", capsize=3, label=lab)
            a.set_ylabel(lab, color=col)
            a.set_ylim(bottom=0)
        ax.set_xscale("log")
        ax.set_xlabel(what)
        ax.set_title("commits" if key == "n" else "creates")
    fig.suptitle("ckptfs: cost against history and directory size (median, min/max bars)")
    fig.tight_layout()
    outdir.mkdir(parents=True, exist_ok=True)
    fig.savefig(outdir / "scale.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return ["scale.png"]
