#!/usr/bin/env python3
"""ckptfs crash and store-fault loop: N iterations of a realistic checkpoint loop, one random
fault each, every check after each iteration; the seed is printed and replayable.

    python scripts/fault_loop.py --iterations 12 --seed 7 --report fault-report.json
    python scripts/fault_loop.py --iterations 1000 --seed 1 --report long.json   # the long run
    python scripts/fault_loop.py --seed 7 --iterations 4 --faults store --workloads torch,dcp1
    python scripts/fault_loop.py --store rgw --iterations 100 --seed 20   # on a real S3 server
    python scripts/fault_loop.py --peers --iterations 100 --seed 30   # peers, black holes between

Two "nodes" (ckptfs mounts A and B, their own cache dirs; A's on a small tmpfs) share one S3
bucket on a moto_server (or, with `--store rgw`, a one-node Ceph RGW: scripts/rgw.sh; with
`--store seaweedfs`, a one-node SeaweedFS: scripts/seaweedfs.sh), reached
through tests/faultproxy.py. A trainer (2 gloo ranks: rank 0
writes through A, rank 1 through B) runs one workload per iteration (torch.save + `latest`
symlink, DCP with 1 rank, DCP with 2 ranks, rotation) while one fault hits (kill -9 of the
trainer or of a daemon at an aimed moment, a store fault at the proxy, a full cache disk).
After the fault is cleared (and a killed daemon remounted), the checks of docs/RELIABILITY.md
run; the first violated check stops the run (exit 1) with a one-line reason and the command
that replays it. Needs root (FUSE, tmpfs).

With `--peers` both nodes run `--peers` (default `--replicas 1`), each node's peer server behind
a fault proxy of its own (the address in its member record is the proxy's), and the faults
include `peer_blackhole`: one node's peer server takes every connection and answers nothing
(blackhole), or applies what it is asked and its answers never come back (oneway), for 12-20 s
while the workload runs and node b reads; a save must not wait for it, a read must go to the
store or another peer, and every check holds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from fault_checks import Checks, OnEvent, diff_trees, expected_tree, snapshot_tree
from fault_rig import PREFIX, Json, Node, Ref, Rig, Violation, log, log_tracebacks, unended_dumps
from fault_trainer import KEEP, short_exc, trainer_main

# re-exported: tests/faults/test_faults.py reads these from here
__all__ = ["FAULTS", "FAULT_GROUPS", "WORKLOADS", "Loop", "Node", "diff_trees", "expected_tree",
           "log_tracebacks", "main", "parse_list", "short_exc", "snapshot_tree", "unended_dumps"]

WORKLOADS = ("torch", "dcp1", "dcp2", "rotate")
# a read on node b while a peer hangs returns within this (the bound a hung peer is given before
# reads go to the store or another peer, docs/SEMANTICS.md "Peers", plus the read itself)
PEER_READ_S = 60.0
FAULTS = (
    "kill_trainer_writing", "kill_trainer_committed", "kill_trainer_deleting",
    "kill_daemon_writing", "kill_daemon_committed", "kill_daemon_uploading",
    "kill_daemon_publishing", "kill_daemon_deleting",
    "store_error", "store_reset", "store_truncate", "store_hangup", "store_slow",
    "store_outage", "store_blackhole", "disk_full", "peer_blackhole",
)
FAULT_GROUPS = {
    "kill": [f for f in FAULTS if f.startswith("kill_")],
    "kill_trainer": [f for f in FAULTS if f.startswith("kill_trainer")],
    "kill_daemon": [f for f in FAULTS if f.startswith("kill_daemon")],
    "store": [f for f in FAULTS if f.startswith("store_")],
    "disk": ["disk_full"],
    "peer": ["peer_blackhole"],
    "all": list(FAULTS),
}


class Aim:
    """One iteration's fault: which node a daemon kill hits, at which moment it fires (an
    event of the trainer, or a request held at the proxy), and the fault armed at the proxy
    or on the cache disk. The rng is drawn from in the order of the original schedule."""

    def __init__(self, loop: Loop, fault: str, workload: str, rng: random.Random) -> None:
        self.loop, self.fault, self.workload, self.rng = loop, fault, workload, rng
        self.rig = loop.rig
        self.is_kill = fault.startswith("kill_")
        self.moment = fault.split("_", 2)[2] if self.is_kill else ""
        # which node a daemon kill hits (dcp2: either node; else A)
        self.victim = self.draw_victim()
        self.pause_rank: int | None = None
        if self.moment in ("writing", "deleting") and not fault.endswith("daemon_deleting"):
            self.pause_rank = 1 if self.victim is self.rig.b else 0
        self.fired = False
        self.hold_release: bool | None = None
        self.until = 0.0   # store_blackhole: when the window ends (monotonic)
        self.watcher: threading.Thread | None = None
        self.detail = ""

    def draw_victim(self) -> Node:
        return self.rig.b if (self.workload == "dcp2" and self.rng.random() < 0.5) \
            else self.rig.a

    def fire_kill(self) -> None:
        if self.fault.startswith("kill_trainer"):
            self.loop.kill_trainer()
        else:
            self.victim.kill9()
            self.loop.killed.add(self.victim.name)
        self.fired = True

    def on_event(self, r: int, line: str) -> str | None:
        if self.fired or not self.is_kill:
            return None
        if self.moment in ("writing", "deleting") and line.startswith("W ") and \
                not self.fault.endswith("daemon_deleting"):
            self.fire_kill()
            return "stop"
        if self.moment == "committed" and line.startswith("C ") and r == 0 and \
                "latest" not in line:
            self.fire_kill()
            return "stop"
        return None

    def arm(self, ballast: Path) -> str:
        """Set the fault up (proxy rules, an outage, a full disk, a held request); returns
        the detail the report and the log give."""
        from tests.faultproxy import Rule

        px, fault, rng, moment = self.rig.proxy, self.fault, self.rng, self.moment
        if moment == "uploading":
            # the victim's own uploads (data/<node>/...): a is the victim unless dcp2 drew b
            self.victim = self.draw_victim()
            node_id = self.victim.status()["store"]["node"]
            px.set_rules([Rule("hold", ops={"put", "create_multipart", "upload_part"},
                               key=rf"^{PREFIX}/data/{node_id}/", delay=120)])
        elif moment == "publishing":
            px.set_rules([Rule("hold", ops={"put"}, key=rf"^{PREFIX}/manifests/", delay=120)])
        elif fault == "kill_daemon_deleting":
            px.set_rules([Rule("hold", ops={"delete"}, delay=120)])
        elif fault == "store_error":
            mode = rng.choice(["error500", "error503", "slowdown"])
            px.set_rules([Rule(mode, prob=0.4)])
            self.detail = mode
        elif fault in ("store_reset", "store_hangup"):
            px.set_rules([Rule(fault.split("_")[1], prob=0.3)])
        elif fault == "store_truncate":
            px.set_rules([Rule("truncate", ops={"get", "list"}, prob=0.5),
                          Rule("lost_reply", ops={"put", "upload_part"}, prob=0.2)])
        elif fault == "store_slow":
            px.set_rules([Rule("slow", prob=0.5, delay=1.0),
                          Rule("stall", prob=0.3, delay=1.0)])
        elif fault == "store_outage":
            secs = rng.uniform(5, 10)
            px.outage(secs)
            self.detail = f"{secs:.1f}s"
        elif fault == "store_blackhole":
            # the store takes every connection and answers nothing (blackhole), or applies the
            # requests and the answers never come back (oneway), for a window longer than the
            # control requests' deadline (10 s, cachemgr.store.s3.Deadlines): some calls end at
            # their deadline, the rest when clear() closes the held connections
            mode = rng.choice(["blackhole", "oneway"])
            secs = rng.uniform(12, 20)
            px.set_rules([Rule(mode)])
            self.until = time.monotonic() + secs
            self.detail = f"{mode} {secs:.1f}s"
        elif fault == "peer_blackhole":
            # one node's peer server (behind its proxy) answers nothing, or its answers are
            # dropped, for longer than a peer request's deadline: the other node's chunk
            # fetches, listings and replica pushes to it must give up on it and go on
            which = rng.choice(["a", "b"])
            mode = rng.choice(["blackhole", "oneway"])
            secs = rng.uniform(12, 20)
            self.rig.peer_proxies[which].set_rules([Rule(mode)])
            self.until = time.monotonic() + secs
            self.detail = f"{mode} at node {which}'s peer server {secs:.1f}s"
        elif fault == "disk_full":
            self.fill_disk(ballast)
        if moment in ("uploading", "publishing") or fault == "kill_daemon_deleting":
            self.hold()
        return self.detail

    def fill_disk(self, ballast: Path) -> None:
        free = shutil.disk_usage(self.rig.tmpfs).free
        leave = self.rng.choice([0, 64 << 10, 512 << 10])
        chunk = b"\xff" * (1 << 20)
        with open(ballast, "wb") as f:
            try:
                todo = max(0, free - leave)
                while todo > 0:
                    todo -= f.write(chunk[:min(todo, len(chunk))])
                    f.flush()
            except OSError:
                pass
        self.detail = f"{leave >> 10} KiB left"

    def hold(self) -> None:
        """The kill fires when the proxy holds the first aimed request; that request lands
        after the kill, or not."""
        px = self.rig.proxy
        self.hold_release = hold_release = self.rng.random() < 0.5
        self.detail = f"held request {'forwarded' if hold_release else 'dropped'} after the kill"
        if self.moment != "uploading":
            self.victim = self.rig.a  # the node that publishes and deletes

        def watcher() -> None:
            if px.wait_held(1, timeout=60):
                if not self.fired:
                    self.fire_kill()
                px.release(forward=hold_release)
        self.watcher = threading.Thread(target=watcher, daemon=True)
        self.watcher.start()


class Loop:
    rig: Rig
    checks: Checks

    def __init__(self, a: argparse.Namespace) -> None:
        self.args = a
        self.seed: int = a.seed
        self.workloads: list[str] = a.workloads
        self.faults: list[str] = a.faults
        self.report: Json = {"seed": a.seed, "iterations": [], "argv": sys.argv[1:],
                             "result": "running"}
        self.ref = Ref()
        self.next_step = 1
        self.dcp_kind: dict[str, str] = {}   # dcp path -> dcp1 / dcp2
        self.cur_rec: Json = {}
        self.killed: set[str] = set()
        self.stuck: list[str] = []

    # -- setup / teardown ---------------------------------------------------------------------

    def setup(self) -> None:
        self.rig.setup()
        self.checks = Checks(self.rig, self.ref, self.args, self.seed, self.report,
                             self.dcp_kind, self.run_cmd)

    # -- schedule -----------------------------------------------------------------------------

    def schedule(self, i: int) -> tuple[str, str, random.Random]:
        """(fault, workload, rng) of iteration i: faults and workloads cycle through seeded
        permutations, so that n iterations cover min(n, len) of each."""
        def pick(items: list[str], salt: str) -> str:
            cycle, pos = divmod(i, len(items))
            perm = list(items)
            random.Random(f"{self.seed}/{salt}/{cycle}").shuffle(perm)
            return perm[pos]
        fault = pick(self.faults, "fault")
        if fault.endswith("_deleting") and "rotate" in self.workloads:
            workload = "rotate"
        else:
            choices = [w for w in self.workloads
                       if not (fault.endswith("_deleting") and w != "rotate")]
            workload = pick(choices or list(self.workloads), "workload")
        return fault, workload, random.Random(f"{self.seed}:{i}")

    # -- one iteration ------------------------------------------------------------------------

    def run_cmd(self, it: int, cmd: Json, ranks: list[int], on_event: OnEvent | None = None,
                timeout: float = 120) -> Json:
        """Send cmd to `ranks`, record rank 0's events; on_event(rank, line) may return "stop"
        to stop reading (the fault took over). Returns {"err": [...], "T": [...]}."""
        kind = cmd["op"] if cmd["op"] in ("dcp1", "dcp2") else "pt"
        for r in ranks:
            self.rig.trainer.send(r, cmd)
        err: list[str] = []
        times: list[float] = []
        out: Json = {"err": err, "T": times, "stopped": False}
        pending = set(ranks)
        deadline = time.monotonic() + timeout
        while pending:
            for r in sorted(pending):
                ev = self.rig.trainer.events[r]
                try:
                    line = ev.next(max(0.05, min(0.2, deadline - time.monotonic())))
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise Violation(f"trainer rank {r} made no progress for {timeout:.0f}s "
                                        f"on {cmd} (a save blocked in the mount?)") from None
                    continue
                if line is None:
                    pending.discard(r)
                    continue
                if r == 0:
                    self.ref.event(line, kind, it)
                    if line.startswith("B ckpt/dcp_"):
                        self.dcp_kind[line.split()[1]] = kind
                if line.startswith("ERR"):
                    err.append(f"rank {r}: {line[4:]}")
                elif line.startswith("T "):
                    times.append(float(line.split()[1]))
                elif line == "DONE":
                    pending.discard(r)
                if on_event is not None and on_event(r, line) == "stop":
                    out["stopped"] = True
                    return out
        return out

    def drain_events(self, it: int) -> None:
        """Record what rank 0 said before it died or the fault stopped the reading."""
        if not self.rig.trainer.events:
            return
        ev = self.rig.trainer.events[0]
        while True:
            try:
                line = ev.next(0.5)
            except TimeoutError:
                return
            if line is None:
                return
            self.ref.event(line, None if not line.startswith("B ckpt/dcp_") else
                           "dcp", it)

    def workload_cmds(self, workload: str, pause_rank: int | None
                      ) -> list[tuple[Json, list[int]]]:
        cmds: list[tuple[Json, list[int]]] = []
        if workload == "rotate":
            n_pt = len([p for p, s in self.ref.sets.items() if p.endswith(".pt")
                        and s["committed"] is not None and not s["del_begun"]])
            for _ in range(max(1, KEEP + 1 - n_pt)):   # something to delete
                cmds.append(({"op": "torch", "step": self.take_step()}, [0]))
            cmds.append(({"op": "rotate", "pause_rank": pause_rank}, [0]))
            return cmds
        ranks = [0, 1] if workload == "dcp2" else [0]
        for k in range(2 if workload == "torch" else 1):
            c: Json = {"op": workload, "step": self.take_step()}
            if k == 0:
                c["pause_rank"] = pause_rank
            cmds.append((c, ranks))
        # a trainer rotates now and then whatever the workload: the cache disk stays bounded
        live = [p for p, s in self.ref.sets.items() if s["committed"] is not None
                and not s["del_begun"]]
        if len(live) > 4 * KEEP:
            cmds.append(({"op": "rotate"}, [0]))
        return cmds

    def take_step(self) -> int:
        s = self.next_step
        self.next_step += 1
        return s


    def iteration(self, i: int) -> Json:
        fault, workload, rng = self.schedule(i)
        rec: Json = {"i": i, "fault": fault, "workload": workload}
        self.cur_rec = rec
        log(f"[{i}] fault={fault} workload={workload}")
        proxies = self.rig.proxies()
        stats0 = {name: px.snapshot()["stats"] for name, px in proxies.items()}
        t0 = time.monotonic()
        if not self.rig.trainer.running():
            self.rig.trainer.start()
        self.killed = set()
        self.stuck = []
        aim = Aim(self, fault, workload, rng)
        cmds = self.workload_cmds(workload, aim.pause_rank)
        ballast = self.rig.tmpfs / "ballast"
        detail = aim.arm(ballast)
        rec["detail"] = detail
        if detail:
            log(f"[{i}]   {detail}")
        pre: list[str] = []      # violations found while the fault was on
        try:
            save_times, errs = self.run_workload(i, cmds, aim)
            pre += self.while_fault_on(aim, rec)
        finally:
            for px in proxies.values():
                px.clear()
            if ballast.exists():
                ballast.unlink()
        injected = self.report.setdefault("injected", {})   # the run's faults, by proxy mode
        for name, px in proxies.items():
            seen = {k: v - stats0[name].get(k, 0) for k, v in px.snapshot()["stats"].items()
                    if v - stats0[name].get(k, 0)}   # requests seen and faults injected
            if name == "store":
                rec["proxy"] = seen
            elif seen:
                rec.setdefault("peer_proxy", {})[name] = seen
            for k, v in seen.items():
                if k != "requests":   # the store's by mode; a peer's as peer_<mode>
                    mode = k if name == "store" else f"peer_{k}"
                    injected[mode] = injected.get(mode, 0) + v
        self.drain_events(i)
        if errs:
            rec["trainer_errors"] = errs[:5]
        pre += self.restart_after(fault, errs, rec)
        rec["fault_s"] = round(time.monotonic() - t0, 2)
        rec["save_s"] = save_times
        # a save must return at local speed whatever the store does
        if fault.startswith(("store_", "peer_")) and save_times and \
                max(save_times) > self.args.max_save_s:
            pre.insert(0, f"save_latency: a checkpoint save ({workload}) took "
                          f"{max(save_times):.1f}s under {fault} {detail} (limit "
                          f"{self.args.max_save_s}s): a save waits for the store")
        t1 = time.monotonic()
        self.check(i, rec, pre)
        rec["check_s"] = round(time.monotonic() - t1, 2)
        rec["total_s"] = round(time.monotonic() - t0, 2)
        return rec

    def run_workload(self, i: int, cmds: list[tuple[Json, list[int]]], aim: Aim
                     ) -> tuple[list[float], list[str]]:
        """The workload's commands until the fault's kill stops them; (save times, errors)."""
        save_times: list[float] = []
        errs: list[str] = []
        fault = aim.fault
        for cmd, ranks in cmds:
            if not self.rig.trainer.running():
                break
            res = self.run_cmd(i, cmd, ranks, on_event=aim.on_event)
            save_times += res["T"]
            errs += res["err"]
            if res["stopped"] or (aim.fired and fault.startswith("kill_trainer")):
                break
            if aim.fired and fault.startswith("kill_daemon"):
                break
        return save_times, errs

    def while_fault_on(self, aim: Aim, rec: Json) -> list[str]:
        """After the workload, with the fault still on: the aim must have fired; a store
        fault stays on a while (node b reads under it), an outage lasts its time."""
        fault, moment = aim.fault, aim.moment
        if aim.watcher is not None:
            aim.watcher.join(timeout=90)
            if not aim.fired:
                raise Violation(f"aim: {fault}: no held request appeared at the proxy within "
                                "60s (the aim missed: nothing to upload/publish/delete?)")
        if aim.is_kill and not aim.fired:
            raise Violation(f"aim: {fault}: the aimed moment never came (events: no "
                            f"{'W' if moment in ('writing', 'deleting') else 'C'} event)")
        pre: list[str] = []
        if fault.startswith("store_") and fault not in ("store_outage", "store_blackhole"):
            pre += self.checks.read_under_fault(rec)
            time.sleep(self.args.fault_hold)   # the fault stays on a while for uploads
        if fault == "peer_blackhole":
            # node b reads a set it has not read while a peer hangs: from the store or its
            # own replica, within the bound a hung peer is given (docs/SEMANTICS.md)
            pre += self.checks.read_under_fault(rec, within=PEER_READ_S)
            # and a fresh node, which asks the peers first, reads every published set
            pre += self.checks.read_on_fresh_node(rec["i"], rec, within=PEER_READ_S)
        if fault in ("store_outage", "store_blackhole", "peer_blackhole"):
            until = self.rig.proxy._outage_until if fault == "store_outage" else aim.until
            left = until - time.monotonic()
            if left > 0:
                time.sleep(left)               # the outage lasts its deliberate time
            rec["hung_at_end"] = sum(px.hung() for px in self.rig.proxies().values())
        return pre

    def restart_after(self, fault: str, errs: list[str], rec: Json) -> list[str]:
        """The fault is cleared: restart what it killed (the trainer, a killed daemon: a
        daemon that died on its own is a violation)."""
        pre: list[str] = []
        a, b = self.rig.a, self.rig.b
        if fault.startswith("kill_") or fault == "disk_full" or errs \
                or not self.rig.trainer.running():
            self.kill_trainer()
            self.rig.trainer.stop()
        if self.stuck:
            pre.append(f"trainer_stuck: a killed trainer rank stayed blocked in the mount for "
                       f"15s during {fault} (a FUSE request never answered); daemon(s) "
                       f"{self.stuck} were killed to free it")
            self.stuck = []
        for n in (a, b):
            if not n.alive():
                if n.name not in self.killed:
                    tail = " | ".join(n.log_file.read_text(errors="replace").splitlines()[-3:]) \
                        if n.log_file.exists() else ""
                    raise Violation(f"daemon_alive: daemon of node {n.name} died on its own "
                                    f"during {fault} (log tail: {tail})")
                rec.setdefault("remount_s", {})[n.name] = round(n.start(), 2)
        return pre

    # -- checks -------------------------------------------------------------------------------

    def check(self, i: int, rec: Json, pre: Sequence[str] = ()) -> None:
        """Every check, in order. The first violation raises; with --keep-going every check
        still runs and all violations are raised together."""
        found: list[str] = []
        if pre:
            if not self.args.keep_going:
                raise Violation(pre[0])
            found += pre
        ck = self.checks

        def fresh_mount() -> None:
            rec["fresh_mount_s"] = ck.fresh_mount_check(i)
        for name, fn in (("durable", ck.check_durable),
                         ("store", ck.check_store),
                         ("latest", ck.check_latest_and_lost),
                         ("fresh_mount", fresh_mount),
                         ("committing_node_loads", lambda: ck.committing_node_loads(i)),
                         ("logs", lambda: ck.check_logs(i))):
            try:
                fn()
            except Violation as e:
                if not self.args.keep_going:
                    raise Violation(f"{name}: {e}") from None
                found.append(f"{name}: {e}")
        if found:
            raise Violation(" || ".join(found))

    # -- main ---------------------------------------------------------------------------------

    def replay(self, i: int) -> str:
        cmd = [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO))
               else sys.executable, "scripts/fault_loop.py", "--seed", str(self.seed),
               "--iterations", str(i + 1)]
        if self.args.workloads_arg:
            cmd += ["--workloads", self.args.workloads_arg]
        if self.args.faults_arg:
            cmd += ["--faults", self.args.faults_arg]
        if self.args.store != "moto":
            cmd += ["--store", self.args.store]
        if self.args.peers:
            cmd.append("--peers")
        return " ".join(cmd)

    def write_report(self) -> None:
        if self.args.report:
            Path(self.args.report).write_text(json.dumps(self.report, indent=1) + "\n")

    def run(self) -> int:
        log(f"fault loop: seed {self.seed}, {self.args.iterations} iterations, faults "
            f"{','.join(self.faults)}, workloads {','.join(self.workloads)}")
        t0 = time.monotonic()
        failures = []
        self.rig = Rig(self.args, self.seed, self.ref)
        try:
            self.setup()
            log(f"work dir {self.rig.work}; {self.args.store} {self.rig.moto_url}; proxy "
                f"{self.rig.proxy.url}")
            for i in range(self.args.iterations):
                try:
                    rec = self.iteration(i)
                    rec["ok"] = True
                    log(f"[{i}]   ok in {rec['total_s']}s (saves {rec['save_s']}, fresh mount "
                        f"{rec.get('fresh_mount_s')}s)")
                except Violation as e:
                    fault, workload, _ = self.schedule(i)
                    rec = dict(self.cur_rec if self.cur_rec.get("i") == i else
                               {"i": i, "fault": fault, "workload": workload})
                    rec.update(ok=False, violation=str(e))
                    failures.append(rec)
                    self.report["iterations"].append(rec)
                    by = self.report.setdefault("violations_by_check", {})
                    for part in str(e).split(" || "):
                        name = part.split(":", 1)[0]
                        by[name] = by.get(name, 0) + 1
                    log(f"VIOLATION at iteration {i} ({fault}, {workload}): {e}")
                    log(f"replay: {self.replay(i)}")
                    if not self.args.keep_going:
                        raise
                    self.write_report()
                    self.recover()
                    continue
                self.report["iterations"].append(rec)
                self.write_report()
            # the end: a clean unmount drains everything, and every committed set is there
            self.rig.trainer.stop()
            for n in (self.rig.a, self.rig.b):
                n.stop()
            probs = self.checks.store_problems()
            if probs:
                raise Violation("after a clean unmount of both nodes: " + probs[0])
            if failures:
                raise Violation(f"{len(failures)} iteration(s) violated checks")
            self.report["result"] = "ok"
            log(f"fault loop ok: seed {self.seed}, {self.args.iterations} iterations in "
                f"{time.monotonic() - t0:.0f}s")
            return 0
        except Violation as e:
            self.report["result"] = "violation"
            self.report["violation"] = str(e)
            if failures and self.args.keep_going:
                log(f"fault loop FAILED (seed {self.seed}): "
                    + "; ".join(f"[{f['i']}] {f['violation']}" for f in failures))
            return 1
        except Exception as e:  # noqa: BLE001 - the harness itself broke
            self.report["result"] = "error"
            self.report["error"] = f"{e.__class__.__name__}: {e}"
            log(f"fault loop ERROR (harness, seed {self.seed}): {e.__class__.__name__}: {e}")
            traceback.print_exc()
            return 2
        finally:
            self.report["elapsed_s"] = round(time.monotonic() - t0, 1)
            self.write_report()
            self.rig.teardown()

    def kill_trainer(self) -> None:
        freed = self.rig.trainer.kill([self.rig.a, self.rig.b])
        self.killed |= set(freed)
        self.stuck += freed

    def recover(self) -> None:
        """--keep-going: after a violation, leave a clean state for the next iteration."""
        for px in self.rig.proxies().values():
            px.clear()
        self.rig.trainer.kill([self.rig.a, self.rig.b])
        self.rig.trainer.stop()
        for n in (self.rig.a, self.rig.b):
            if not n.alive():
                n.cleanup()
                n.start()


# -- trees ----------------------------------------------------------------------------------------



# ==============================================================================================


def parse_list(value: str, universe: Sequence[str],
               groups: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    out: list[str] = []
    for raw in value.split(","):
        item = raw.strip()
        if not item:
            continue
        if groups and item in groups:
            out += [x for x in groups[item] if x not in out]
        elif item in universe:
            if item not in out:
                out.append(item)
        else:
            raise argparse.ArgumentTypeError(f"unknown {item!r} (choose from "
                                             f"{', '.join(list(groups or []) + list(universe))})")
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "trainer":
        rank, world, init, mount, seed = argv[1:6]
        trainer_main(int(rank), int(world), init, mount, int(seed))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--store", choices=("moto", "rgw", "seaweedfs"), default="moto",
                   help="the S3 server behind the fault proxy: moto, or a one-node Ceph RGW "
                   "(scripts/rgw.sh) or SeaweedFS (scripts/seaweedfs.sh; docs/STORES.md)")
    p.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    p.add_argument("--workloads", dest="workloads_arg",
                   help=f"comma list of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--faults", dest="faults_arg",
                   help=f"comma list of fault kinds or groups ({', '.join(FAULT_GROUPS)}; "
                        "default: all)")
    p.add_argument("--report", help="write a JSON report here (after every iteration)")
    p.add_argument("--keep-going", action="store_true",
                   help="record a violation and go on (exit 1 at the end)")
    p.add_argument("--workdir", help="parent of the run's temporary directory")
    p.add_argument("--keep-workdir", action="store_true")
    p.add_argument("--cache-disk-mb", type=int, default=192, help="node A's tmpfs cache disk")
    p.add_argument("--max-save-s", type=float, default=5.0,
                   help="a save under a store fault must return within this")
    p.add_argument("--fault-hold", type=float, default=3.0,
                   help="seconds a store fault stays on after the saves returned")
    p.add_argument("--durable-timeout", type=float, default=90.0)
    p.add_argument("--peers", action="store_true",
                   help="both nodes run --peers, each peer server behind a fault proxy; the "
                   "faults include peer_blackhole")
    p.add_argument("--lease", type=float, default=10.0,
                   help="the nodes' --lease: short, so that store outages (5-10 s) run some "
                   "past it and the fence (a new generation) is exercised")
    a = p.parse_args(argv)
    try:
        a.workloads = parse_list(a.workloads_arg or ",".join(WORKLOADS), WORKLOADS)
        a.faults = parse_list(a.faults_arg or "all", FAULTS, FAULT_GROUPS)
        if not a.peers:
            named = [x.strip() for x in (a.faults_arg or "").split(",")]
            if any(x == "peer" or x.startswith("peer_") for x in named):
                raise argparse.ArgumentTypeError("peer faults need --peers")
            a.faults = [f for f in a.faults if not f.startswith("peer_")]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 10**6)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    if os.geteuid() != 0:
        print("fault_loop: needs root (FUSE mounts, a tmpfs)", file=sys.stderr)
        return 2
    return Loop(a).run()


if __name__ == "__main__":
    sys.exit(main())
