#!/usr/bin/env python3
"""A fleet on one bucket (issue 35): N in-process nodes (real CacheFs + Engine, no FUSE, one
trio loop; tests/fleet.py) share one store, in memory (every request counted) or moto. Each
node writes its rank's DCP shard into `ck/step1`, node 0 renames `.metadata` into place (the
DCP commit) and publishes; then a steady window; then M fresh nodes list the store and read
the set. Reported (bench-results/sim_fleet.{json,md}): time to publish, requests per node (by
operation, median and max) per phase, requests per key prefix, the busiest prefix's peak rate
against S3's per-prefix limits, and whether per-node requests stay flat as N grows.

  PYTHONPATH=$PWD python scripts/sim_fleet.py                 # N = 10, 100, 1000 in memory
  PYTHONPATH=$PWD python scripts/sim_fleet.py --quick         # N = 10, 100
  PYTHONPATH=$PWD python scripts/sim_fleet.py --moto --sizes 10,100

Time in the simulation is this process's: every node shares one CPU, so seconds measure the
protocol's rounds plus the simulation's own CPU, not a real fleet's wall clock; the request
counts are exact. `--latency` adds a fixed delay to every in-memory request.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fleet import (
    S3_GET_PER_S,
    S3_PUT_PER_S,
    FleetResult,
    MemStore,
    run_fleet,
)

PHASES = ("start", "commit", "idle", "restore")
# The requests every node makes every pass whatever happens (docs/ARCHITECTURE.md "Many nodes"):
# LIST manifests/, LIST intents/, the member record's renewal. Counted apart from the rest of a
# phase (what the commit or the restore itself asked), whose count is independent of how long
# the phase lasted.
PERIODIC = {("list", "manifests"), ("list", "intents"), ("put", "members")}
PRODUCTION_INTERVAL_S = 10.0  # --refresh-interval's default


def _stats(values: list[int]) -> dict[str, float]:
    return {"median": statistics.median(values) if values else 0,
            "max": max(values) if values else 0}


def _no_data(prefixes: dict[str, dict[str, int]]) -> dict[str, Any]:
    """`prefixes` with the data/<node> ones summed into one entry."""
    out: dict[str, Any] = {p: v for p, v in prefixes.items() if not p.startswith("data/")}
    data: dict[str, int] = {}
    for p, v in prefixes.items():
        if p.startswith("data/"):
            for op, c in v.items():
                data[op] = data.get(op, 0) + c
    out["data/*"] = data
    return out


def summarise(r: FleetResult, n: int, interval: float) -> dict:
    """The report of one run (JSON-able)."""
    log = r.log
    committer = r.nodes[0]
    phases = {}
    for ph in PHASES:
        who = r.readers if ph == "restore" else r.nodes
        per = log.per_node(ph, who)
        periodic = log.per_node(ph, who, only=PERIODIC)
        event = log.per_node(ph, who, exclude=PERIODIC)
        totals = {node: sum(ops.values()) for node, ops in per.items()}
        ev_totals = {node: sum(ops.values()) for node, ops in event.items()}
        others = [v for node, v in totals.items() if node != committer]
        ops = sorted({op for o in per.values() for op in o})
        row: dict[str, Any] = {"per_node": _stats(list(totals.values())),
               "per_node_by_op": {op: _stats([per[node].get(op, 0) for node in per])
                                  for op in ops}}
        row["event_per_node"] = _stats(list(ev_totals.values()))
        row["periodic_per_node"] = _stats([sum(o.values()) for o in periodic.values()])
        if ph in ("commit", "idle"):
            row["committer"] = totals.get(committer, 0)
            row["per_other_node"] = _stats(others)
            row["event_per_other_node"] = _stats([v for node, v in ev_totals.items()
                                                  if node != committer])
            row["event_by_op_other_nodes"] = {
                op: _stats([event[node].get(op, 0) for node in event if node != committer])
                for op in sorted({op for o in event.values() for op in o})}
            row["committer_by_op"] = per.get(committer, {})
        if ph == "idle":
            passes = r.idle_s / interval
            row["passes"] = round(passes, 1)
            row["per_node_per_pass"] = {k: round(v / passes, 2)
                                        for k, v in row["per_node"].items()}
        phases[ph] = row
    prefixes = log.per_prefix()
    peaks = log.peak_rates()
    busiest = {}
    for cls, limit in (("GET", S3_GET_PER_S), ("PUT", S3_PUT_PER_S)):
        cand = [(rate, p) for (c, p), rate in peaks.items() if c == cls]
        if cand:
            rate, p = max(cand)
            busiest[cls] = {"prefix": p, "peak_per_s": rate, "limit_per_s": limit,
                            "share": round(rate / limit, 3)}
    # the steady window's rate per prefix, at the production refresh interval: the simulation
    # runs its passes every `interval` seconds, a fleet every 10
    idle_rate = {p: round(sum(v.values()) / r.idle_s * interval / PRODUCTION_INTERVAL_S, 1)
                 for p, v in log.per_prefix("idle").items()}
    top = sorted(prefixes.items(), key=lambda kv: -sum(kv[1].values()))
    # the data prefixes: one per node (data/<node>) -> summarised, not listed
    data = [sum(v.values()) for p, v in prefixes.items() if p.startswith("data/")]
    shown: dict[str, Any] = {p: v for p, v in top if not p.startswith("data/")}
    shown["data/<node> (each)"] = _stats(data) | {"prefixes": len(data)}
    return {"n": n, "readers": len(r.readers), "interval_s": interval,
            "start_s": round(r.start_s, 2), "publish_s": round(r.publish_s, 2),
            "visible_s": round(r.visible_s, 2), "restore_s": round(r.restore_s, 2),
            "phases": phases, "prefixes": shown, "busiest": busiest,
            "prefixes_by_phase": {ph: _no_data(log.per_prefix(ph)) for ph in PHASES},
            "steady_per_s_at_10s_interval": idle_rate,
            "store_keys": r.keys}


def markdown(runs: list[dict], args: argparse.Namespace) -> str:
    lines = [f"# Fleet simulation ({args.store}; `{' '.join(sys.argv[1:])}`)", "",
             ("Requests per node: median (max). Commit: the writers from the first write to"
              " every node holding the set; the committer (node 0) apart. Idle: per refresh"
              " interval. Restore: each fresh node from its start to its files read."), "",
             ("| N | publish s | all hold it s | commit req/node (+ periodic) | committer req |"
             " idle req/node/pass | restore readers | restore req/node (+ periodic) |"
             " busiest GET prefix (peak/s vs 5,500) | busiest PUT prefix (peak/s vs 3,500) |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        c, i, rs = r["phases"]["commit"], r["phases"]["idle"], r["phases"]["restore"]
        b = r["busiest"]

        def bz(cls: str, b: dict = b) -> str:
            x = b.get(cls)
            return "-" if x is None else f"`{x['prefix']}` {x['peak_per_s']}"
        lines.append(
            f"| {r['n']} | {r['publish_s']} | {r['visible_s']} |"
            f" {c['event_per_other_node']['median']} ({c['event_per_other_node']['max']})"
            f" + {c['periodic_per_node']['median']} |"
            f" {c['committer']} | {i['per_node_per_pass']['median']}"
            f" ({i['per_node_per_pass']['max']}) | {r['readers']} |"
            f" {rs['event_per_node']['median']} ({rs['event_per_node']['max']})"
            f" + {rs['periodic_per_node']['median']} | {bz('GET')} |"
            f" {bz('PUT')} |")
    lines += ["", ("Per operation, median per node (commit, other nodes / committer; idle per"
                   " pass; restore):"), ""]
    for r in runs:
        c = r["phases"]["commit"]
        ops = {op: s["median"] for op, s in c["event_by_op_other_nodes"].items()}
        idle = {op: round(s["median"] / r["phases"]["idle"]["passes"], 2)
                for op, s in r["phases"]["idle"]["per_node_by_op"].items()}
        rest = {op: s["median"] for op, s in r["phases"]["restore"]["per_node_by_op"].items()}
        lines.append(f"- N={r['n']}: commit {ops}, committer {c['committer_by_op']};"
                     f" idle {idle}; restore {rest}")
    lines += ["", "Requests per prefix, whole run (largest first):", ""]
    for r in runs:
        top = list(r["prefixes"].items())[:8]
        lines.append(f"- N={r['n']}: " + "; ".join(f"`{p}` {v}" for p, v in top))
    lines += ["", ("Steady rate per prefix at --refresh-interval 10 (requests/s, from the idle"
                   " window):"), ""]
    for r in runs:
        lines.append(f"- N={r['n']}: " + "; ".join(
            f"`{p}` {v}" for p, v in sorted(r["steady_per_s_at_10s_interval"].items())))
    lines += ["", (f"Per node, median (commit: other nodes, without the periodic listings):"
                   f" {flat(runs)}"), ""]
    return "\n".join(lines)


def flat(runs: list[dict]) -> str:
    meds = [(r["n"], r["phases"]["commit"]["event_per_other_node"]["median"],
             r["phases"]["idle"]["per_node_per_pass"]["median"],
             r["phases"]["restore"]["event_per_node"]["median"]) for r in runs]
    return ", ".join(f"N={n}: commit {c}, idle/pass {i}, restore {s}" for n, c, i, s in meds)


def start_moto() -> tuple[subprocess.Popen, str]:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    return proc, url


def moto_store(url: str, n: int):
    import uuid

    import boto3
    import botocore.config

    from cachemgr.store import open_store

    bucket = f"fleet-{n}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                 config=botocore.config.Config(s3={"addressing_style": "path"})).create_bucket(
        Bucket=bucket)
    return open_store(f"s3://{bucket}", endpoint_url=url, path_style=True, region="us-east-1",
                      max_connections=32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,100,1000", help="node counts, comma-separated")
    ap.add_argument("--quick", action="store_true", help="N = 10, 100")
    ap.add_argument("--moto", action="store_true", help="moto_server instead of memory")
    ap.add_argument("--readers", type=int, default=50, help="fresh nodes restoring: min(N, R)")
    ap.add_argument("--interval", type=float, default=1.0,
                    help="refresh interval and gather poll, seconds (production: 10 and 5)")
    ap.add_argument("--lease", type=float, default=600.0,
                    help="lease seconds (production 120; long here: the simulation's own CPU"
                    " must not make leases lapse)")
    ap.add_argument("--idle", type=float, default=5.0, help="steady window, seconds")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds per in-memory request")
    ap.add_argument("--out", default=str(REPO / "bench-results"))
    ap.add_argument("--workdir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the nodes' cache directories go (default: tmpfs)")
    args = ap.parse_args()
    sizes = [10, 100] if args.quick else [int(x) for x in args.sizes.split(",")]
    args.store = "moto" if args.moto else f"memory, latency {args.latency}s"
    moto = None
    if args.moto:
        moto = start_moto()
    runs = []
    try:
        for n in sizes:
            base = moto_store(moto[1], n) if moto else MemStore(latency=args.latency)
            # tmpfs: N SQLite indexes and N x N cache files are the simulation's own cost
            with tempfile.TemporaryDirectory(prefix="fleet-", dir=args.workdir) as d:
                t = time.monotonic()
                r = trio.run(functools.partial(
                    run_fleet, Path(d), base, n, min(n, args.readers), interval=args.interval,
                    lease=args.lease, idle=args.idle))
                s = summarise(r, n, args.interval)
                s["wall_s"] = round(time.monotonic() - t, 1)
                s["maxrss_mib"] = round(
                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
                runs.append(s)
                print(json.dumps({k: s[k] for k in ("n", "publish_s", "visible_s", "restore_s",
                                                    "wall_s", "maxrss_mib", "busiest")}),
                      flush=True)
    finally:
        if moto:
            moto[0].terminate()
            moto[0].wait(10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "moto" if args.moto else "mem"
    (out / f"sim_fleet_{tag}.json").write_text(json.dumps(
        {"args": vars(args), "runs": runs}, indent=1))
    md = markdown(runs, args)
    (out / f"sim_fleet_{tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
