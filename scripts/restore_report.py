"""The report of scripts/bench_restore.py (results.md): the store ceilings and the ckptfs
restores of a results.json, medians [min-max] over the uncontended runs; with --peers, the
restores from a peer against `read`, pair by pair.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from benchlib import GiB, MiB

SET_PATH = "ckpt/step_1"
MODES = ("prefetch", "read")
PEER_MODE = "peer-read"  # --peers only
ROW_ORDER = (*MODES, PEER_MODE)

# a JSON document: results.json, one of its runs
Json = dict[str, Any]


def fmt_size(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB} GiB"
    if n % MiB == 0:
        return f"{n // MiB} MiB"
    return f"{n / MiB:.1f} MiB"


def mmm(values: list[float | None]) -> tuple[float, float, float] | None:
    xs = [x for x in values if x is not None]
    if not xs:
        return None
    return statistics.median(xs), min(xs), max(xs)


def clean(rs: list[Json]) -> list[Json]:
    """Runs not contended by other load; all of them if none is clean."""
    c = [r for r in rs if not r.get("contended")]
    return c or rs


def usable(rs: list[Json]) -> list[Json]:
    """Runs that did not fail and, for peer-read, were not fed by the store (those are left
    out of the medians, contended or not)."""
    return [r for r in rs if "error" not in r and not r.get("store_fed")]


def runs_col(rs: list[Json]) -> str:
    """`clean/total` runs; the medians are over the clean ones (all, if none is)."""
    ok = usable(rs)
    n_clean = sum(1 for r in ok if not r.get("contended"))
    fed = sum(1 for r in rs if r.get("store_fed") and "error" not in r)
    return f"{n_clean}/{len(rs)}" + (" (all contended)" if ok and not n_clean else "") + (
        f" ({fed} store-fed)" if fed else "")


def header(res: Json) -> list[str]:
    cfg = res["config"]
    setup = res.get("setup", {})
    lines = ["# ckptfs cold restore from S3 (moto_server on loopback)", ""]
    mach = res["machine"]
    lines.append(f"{res.get('started')}: {mach['cpus']} CPUs ({mach['cpu']}), kernel "
                 f"{mach['kernel']}, Python {mach['python']}, boto3 {mach['boto3']}, moto "
                 f"{mach['moto']}, {mach['ckptfs']} ({mach['git_head'][:10]}"
                 f"{', dirty tree' if mach['git_dirty'] else ''}).")
    nf = len(setup.get("files", []))
    stored = sorted({f["compression"] for f in setup.get("files", []) if f["size"] >= MiB})
    lines.append(f"Set: `{SET_PATH}`, {nf} files ({cfg['files']} shards of random bytes + "
                 f"`.metadata`), {fmt_size(setup.get('total_bytes', 0))}, chunk "
                 f"{fmt_size(setup.get('chunk_size') or 0)}, stored "
                 f"{'/'.join(stored)}. "
                 f"Repeats: {cfg['repeats']}. Wall time: {res.get('wall_s', '?')} s.")
    lines.append("MB/s = 10^6 B/s of file content; median [min-max] over the repeats. "
                 "`prefetch` = wall time of `ckptfs prefetch` (includes "
                 f"~{res.get('cli_startup_s', 0):.2f}s CLI start-up); `read` = sequential "
                 "1 MiB reads of every file, prefetch on. Each run on a fresh mount with an "
                 "empty cache dir.")
    if any(r["mode"] == PEER_MODE for r in res["runs"]):
        lines.append("`peer-read` = the same reads on a mount with --peers while node A, the "
                     "writer, stays mounted with --peers and holds the set in its cache.")
    lines.append("")
    return lines


def ceiling_table(res: Json) -> tuple[list[str], dict[int, float]]:
    """The store ceilings, and the median MB/s of each range size measured."""
    lines: list[str] = []
    # ceilings
    head = "## Store ceiling (boto3 download_file, 8 threads per object, objects in parallel)"
    lines += [head, "",
              "| range size | MB/s | moto busy | machine busy | other busy | runs |",
              "|---|---|---|---|---|---|"]
    ceil: dict[int, float] = {}
    for c in res.get("ceiling_chunks_used", []):
        allc = [r for r in res["ceiling"] if r["chunk"] == c]
        rs = clean([r for r in allc if "error" not in r])
        t = mmm([r["mb_s"] for r in rs])
        b = mmm([r["moto_busy"] for r in rs])
        mb = mmm([r.get("machine_busy") for r in rs]) or (0, 0, 0)
        ob = mmm([r.get("other_busy") for r in rs]) or (0, 0, 0)
        if t:
            ceil[c] = t[0]
            assert b is not None  # the runs that have mb_s have moto_busy
            lines.append(f"| {fmt_size(c)} | {t[0]:.1f} [{t[1]:.1f}-{t[2]:.1f}] | "
                         f"{b[0]:.2f} | {mb[0]:.2f} | {ob[0]:.2f} | {runs_col(allc)} |")
        else:
            lines.append(f"| {fmt_size(c)} | failed | | | | |")
    lines.append("")
    return lines, ceil


def restore_table(res: Json, ceil: dict[int, float]) -> list[str]:
    best = max(ceil.values()) if ceil else None
    best_c = max(ceil, key=lambda c: ceil[c]) if ceil else None
    lines: list[str] = []
    # restores
    lines += ["## ckptfs restore", "",
              "| mode | GET size | N | MB/s | x ceiling (same GET size) | x best ceiling"
              + (f" ({fmt_size(best_c)})" if best_c else "")
              + " | daemon job MB/s | daemon CPU s/GiB | moto busy | machine busy "
              "| other busy | peak RSS MiB | runs |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rows = []
    for r in res["runs"]:
        key = (ROW_ORDER.index(r["mode"]), r["prefetch_range"], r["concurrency"])
        if key not in rows:
            rows.append(key)
    for mi, rng, n in sorted(rows):
        mode = ROW_ORDER[mi]
        same = ceil.get(rng)
        rs = [r for r in res["runs"] if r["mode"] == mode and r["concurrency"] == n
              and r["prefetch_range"] == rng]
        nerr = sum(1 for r in rs if "error" in r)
        ok = clean(usable(rs))
        t = mmm([r["mb_s"] for r in ok])
        if not t:
            what = f"failed ({nerr})" if nerr == len(rs) else "no usable run"
            lines.append(f"| {mode} | {fmt_size(rng)} | {n} | {what} "
                         "| | | | | | | | | |")
            continue
        dj = mmm([r.get("daemon_job_mb_s") for r in ok])
        cpu = mmm([r["daemon_cpu_s"] / (r["bytes"] / GiB) for r in ok
                   if r.get("daemon_cpu_s") is not None])
        busy = mmm([r.get("moto_busy") for r in ok])
        mbusy = mmm([r.get("machine_busy") for r in ok])
        obusy = mmm([r.get("other_busy") for r in ok])
        rss: list[float] = [r["peak_rss_mib"] for r in ok if r.get("peak_rss_mib") is not None]
        lines.append(
            f"| {mode} | {fmt_size(rng)} | {n} | {t[0]:.1f} [{t[1]:.1f}-{t[2]:.1f}]"
            + (f" ({nerr} failed)" if nerr else "") + " | "
            + (f"{t[0] / same:.2f}" if same else "-")
            + (f" (job {dj[0] / same:.2f})" if same and dj and mode == "prefetch" else "")
            + " | "
            + (f"{t[0] / best:.2f}" if best else "-") + " | "
            + (f"{dj[0]:.1f}" if dj else "-") + " | "
            + (f"{cpu[0]:.2f}" if cpu else "-") + " | "
            + (f"{busy[0]:.2f}" if busy else "-") + " | "
            + (f"{mbusy[0]:.2f}" if mbusy else "-") + " | "
            + (f"{obusy[0]:.2f}" if obusy else "-") + " | "
            + (f"{max(rss):.0f}" if rss else "-") + " | "
            + runs_col(rs) + " |")
    lines.append("")
    return lines


Pair = tuple[Json, Json]  # (read, peer-read) of one repeat, one GET size, one N


def peer_pairs(res: Json) -> dict[tuple[int, int], list[Pair]]:
    """The (read, peer-read) runs of each repeat, by (GET size, N), in run order."""
    by: dict[tuple[int, int, int], dict[str, Json]] = {}
    for r in res["runs"]:
        if r["mode"] in ("read", PEER_MODE):
            by.setdefault((r["prefetch_range"], r["concurrency"], r["rep"]), {})[r["mode"]] = r
    out: dict[tuple[int, int], list[Pair]] = {}
    for (rng, n, _rep), d in by.items():
        if "read" in d and PEER_MODE in d:
            out.setdefault((rng, n), []).append((d["read"], d[PEER_MODE]))
    return out


def pairs_col(ps: list[Pair], used: list[Pair], all_contended: bool) -> str:
    failed = sum(1 for p in ps if any("error" in r for r in p))
    fed = sum(1 for p in ps if not any("error" in r for r in p) and p[1].get("store_fed"))
    return f"{len(used)}/{len(ps)}" + (" (all contended)" if all_contended else "") + (
        f" ({fed} store-fed)" if fed else "") + (f" ({failed} failed)" if failed else "")


def per_gib(ps: list[Pair], key: str) -> tuple[float, float, float] | None:
    """`key` (CPU seconds) of the peer-read runs per GiB read."""
    return mmm([p[1][key] / (p[1]["bytes"] / GiB) for p in ps if p[1].get(key) is not None])


def peer_table(res: Json) -> list[str]:
    """--peers: each peer-read against the read of the same repeat, GET size and N."""
    by = peer_pairs(res)
    if not by:
        return []
    lines = ["## Restore from a peer (--peers): peer-read vs read, pair by pair", "",
             ("| GET size | N | read MB/s | peer-read MB/s | peer-read/read | from peers "
              "| B daemon CPU s/GiB | A daemon CPU s/GiB | moto busy | other busy | pairs |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (rng, n), ps in sorted(by.items()):
        ok = [p for p in ps if not any("error" in r for r in p) and not p[1].get("store_fed")]
        used = [p for p in ok if not any(r.get("contended") for r in p)] or ok
        cont = bool(ok) and all(any(r.get("contended") for r in p) for p in ok)
        ratio = mmm([p[1]["mb_s"] / p[0]["mb_s"] for p in used])
        if ratio is None:
            lines.append(f"| {fmt_size(rng)} | {n} | | | none usable | | | | | | "
                         f"{pairs_col(ps, used, cont)} |")
            continue
        rd, pr = (mmm([p[k]["mb_s"] for p in used]) for k in (0, 1))
        share = mmm([p[1]["from_peers_bytes"] / max(p[1]["from_peers_bytes"]
                                                     + p[1]["from_store_bytes"], 1)
                     for p in used])
        b_cpu, a_cpu = per_gib(used, "daemon_cpu_s"), per_gib(used, "a_daemon_cpu_s")
        moto, other = (mmm([p[1].get(k) for p in used]) for k in ("moto_busy", "other_busy"))
        assert rd and pr and share  # every used pair has MB/s and peer bytes
        lines.append(
            f"| {fmt_size(rng)} | {n} | {rd[0]:.1f} [{rd[1]:.1f}-{rd[2]:.1f}] | "
            f"{pr[0]:.1f} [{pr[1]:.1f}-{pr[2]:.1f}] | "
            f"{ratio[0]:.2f} [{ratio[1]:.2f}-{ratio[2]:.2f}] | {100 * share[1]:.1f}% | "
            + " | ".join(f"{x[0]:.2f}" if x else "-" for x in (b_cpu, a_cpu, moto, other))
            + f" | {pairs_col(ps, used, cont)} |")
    policies = sorted({str(r.get("set_policy")) for ps in by.values() for p in ps for r in p})
    lines += ["", ("`peer-read/read`: each peer-read run's MB/s over the read run of the same "
              "repeat, GET size and N (run back to back, in reverse order every other repeat), "
              "median [min-max] over the pairs; the MB/s columns are medians over the same "
              "pairs. `from peers`: the smallest share, over those pairs, of what node B "
              "fetched that came from a peer (`ckptfs status`: tiering.peers."
              "restored_from_peers vs restored_from_store); a run that got more than 10% from "
              "the store is `store-fed` and its pair left out. `A daemon CPU`: node A (the "
              "writer, serving the chunks) per GiB read by B; `moto busy`, `other busy`: of "
              "the peer-read runs (A's CPU is counted apart from `other busy`). `pairs`: "
              "pairs used / all; a pair is left out when either run was contended (unless all "
              "are), failed or was store-fed. Restore policy of node B (`--prefetch auto`, "
              f"tiering.restore.set_policies): {', '.join(policies)}."), ""]
    return lines


def footer(res: Json, max_other_busy: float) -> list[str]:
    setup = res.get("setup", {})
    lines: list[str] = []
    lines.append("`GET size`: bytes per prefetch GET (`--prefetch-range`; a read not covered "
                 "by the prefetch yet GETs its own chunk). `x ceiling (same GET size)`: "
                 "against boto3 with ranges of that size (`job`: the daemon job's MB/s "
                 "against it). "
                 "`daemon job MB/s`: the daemon's own prefetch job time (open or request to "
                 "last chunk stored). `moto busy`: moto_server CPU seconds per wall second "
                 "(one Python process; ~1.0 = the store is saturated); `machine busy`: busy "
                 f"CPU seconds of the whole machine ({os.cpu_count()} CPUs) per wall second; "
                 "`other busy`: the part of it not spent by the daemon, moto or this "
                 "script (other load on the machine, and kernel work such as FUSE request "
                 "handling and page-cache writeback; ~0 on an idle machine): above ~0.2 "
                 "means the runs competed with something else. `runs`: uncontended / all runs; "
                 "MB/s and the other columns are medians over the uncontended runs (runs with "
                 f"`other busy` > {max_other_busy} are left out, unless all are). "
                 "`peak RSS`: the "
                 "daemon's VmHWM before unmount, max over the repeats.")
    if setup:
        lines.append(f"Setup: node A wrote the set in {setup.get('write_s')} s, durable "
                     f"{setup.get('upload_wait_s')} s later.")
    if res.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in res["errors"]]
    return lines


def report(res: Json, max_other_busy: float) -> str:
    """results.md: the ceilings, the restores against them, the notes, every error."""
    lines = header(res)
    ceil_lines, ceil = ceiling_table(res)
    lines += ceil_lines
    lines += restore_table(res, ceil)
    lines += peer_table(res)
    lines += footer(res, max_other_busy)
    return "\n".join(lines) + "\n"
