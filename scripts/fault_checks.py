"""The checks of scripts/fault_loop.py (docs/RELIABILITY.md), run after every iteration once
the fault is cleared: every committed set durable, the store matching what the trainer did,
`latest` never ahead of what it names, nothing published lost, a fresh mount listing and
serving the store at once, the committing node loading a multi-node set, no traceback and no
long event-loop stall in any daemon's log; and, while a store fault is on, node b reading a
checkpoint right or failing (never wrong bytes).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from fault_rig import (
    MAX_STALL_S,
    Json,
    Node,
    Ref,
    Rig,
    SetRec,
    Violation,
    log_stalls,
    log_tracebacks,
    sha256,
    unended_dumps,
    wait_for,
)
from fault_trainer import make_state, short_exc

from cachemgr.format.docs import ManifestDoc
from ckptfs.stallwatch import MACHINE_CAUSES, Stall

# on_event(rank, line) of Loop.run_cmd: "stop" stops the reading
OnEvent = Callable[[int, str], str | None]


class RunCmd(Protocol):
    """Loop.run_cmd: a command to the trainer's ranks; returns {"err", "T", "stopped"}."""

    def __call__(self, it: int, cmd: Json, ranks: list[int], on_event: OnEvent | None = None,
                 timeout: float = 120) -> Json: ...
# a tree of a mount or of the published sets: {path: ("f", size) | ("l", target)}
Tree = dict[str, tuple[str, int | str | None]]


class Checks:
    """The checks, on the rig's nodes and store, against the trainer's reference."""

    def __init__(self, rig: Rig, ref: Ref, args: argparse.Namespace, seed: int,
                 report: Json, dcp_kind: dict[str, str], run_cmd: RunCmd) -> None:
        self.rig, self.ref, self.args, self.seed, self.report = rig, ref, args, seed, report
        self.dcp_kind = dcp_kind             # dcp path -> dcp1 / dcp2 (kept up by the loop)
        self.run_cmd = run_cmd
        self.a, self.b, self.view, self.poller = rig.a, rig.b, rig.view, rig.poller
        self.trainer = rig.trainer
        self.seen_tracebacks: set[str] = set()
        self.read_by_b: set[str] = set()

    def check_durable(self) -> None:
        import ckptfs

        # every committed set durable (through the node that committed it: A)
        for path in self.ref.live_committed() + (["ckpt/latest"] if self.ref.latest_committed
                                                  else []):
            try:
                ckptfs.wait_durable(self.a.path / path, timeout=self.args.durable_timeout)
            except ckptfs.NotDurable as e:
                if e.state == "deleted":
                    continue
                raise Violation(f"committed set {path} is not durable on node a: {e}") from None

        # both nodes settle (uploads done, no set pending)
        def settled() -> bool:
            for n in (self.a, self.b):
                t = n.status()
                if t["uploads"]["queued"] or t["uploads"]["running"] or t["pending_sets"]:
                    return False
            return True
        try:
            wait_for(settled, self.args.durable_timeout, "nodes a and b to settle")
        except Violation:
            pend, why = [], []
            for n in (self.a, self.b):
                t = n.status()
                pend += [(n.name, s["path"], s["state"], s.get("waiting_for"))
                         for s in t["sets"] if s["state"] in ("committed", "uploading")]
                up = t["uploads"]
                stuck = [(x["seq"], x["path"], x.get("waits_for"), x.get("why"))
                         for x in t.get("stuck", [])]
                why.append(f"node {n.name}: {t['pending_sets']} pending sets, uploads "
                           f"{up['queued']} queued / {up['running']} running, stuck {stuck}")
            raise Violation(f"nodes did not settle within {self.args.durable_timeout:.0f}s; "
                            f"pending: {pend}; " + "; ".join(why)) from None

    def check_store(self) -> None:
        """The store against the reference (deletions may still be on their way)."""
        problems: list[str] = []

        def store_ok() -> bool:
            nonlocal problems
            problems = self.store_problems()
            return not problems
        try:
            wait_for(store_ok, 30, "the store to match the reference")
        except Violation:
            raise Violation(problems[0] + (f" (+{len(problems) - 1} more)"
                                           if len(problems) > 1 else "")) from None

    def check_latest_and_lost(self) -> None:
        """latest never named an unpublished set; nothing durable was lost."""
        with self.poller.lock:
            v = list(self.poller.violations)
            self.poller.violations.clear()
            ever = set(self.poller.ever)
        if v:
            raise Violation(v[0])
        now = self.view.set_paths()
        lost = sorted(p for p in ever - now if not self.ref.deletion_begun(p)
                      and p != "ckpt/latest")
        if lost:
            raise Violation(f"published set(s) vanished from the store without being deleted: "
                            f"{lost}")

    def check_logs(self, i: int) -> None:
        """No tracebacks in any daemon's log (each reported once); no event-loop stall longer
        than MAX_STALL_S (1 s) in any daemon's log, unless the daemon's own accounting puts it
        on the machine (ckptfs.stallwatch.MACHINE_CAUSES: the loop thread runnable without a
        CPU, or the machine's tasks stalled on memory, for all but 1 s of it), which is counted
        apart in the report (`loop_stalls_by_cause`), never hidden. Every stall over 1 s goes into
        the report (`loop_stalls`) with its cause and the loop thread's dumped stack."""
        slow: list[str] = []
        for n in (self.a, self.b):
            if n.lease_lapses:
                self.report.setdefault("lease_lapses", {})[n.name] = n.lease_lapses
            slow += self.judge_stalls(i, n.name, n.log_file, n.new_stalls())
            for tb in n.tracebacks():
                if tb not in self.seen_tracebacks:
                    self.seen_tracebacks.add(tb)
                    raise Violation(f"node {n.name}'s log {n.log_file} has a traceback: {tb}")
        while self.rig.other_logs:   # fresh nodes' logs: each judged once, then removed
            lf = self.rig.other_logs.pop()
            tbs = log_tracebacks(lf)
            if tbs:
                raise Violation(f"{lf} has a traceback: {tbs[0]}")
            stalls = log_stalls(lf) + [Stall(s=MAX_STALL_S, cause="unended", line="(dumped; "
                                             "no end logged)", loop_stacks=[d])
                                       for d in unended_dumps(lf)]
            if not self.args.keep_workdir:
                lf.unlink(missing_ok=True)
            slow += self.judge_stalls(i, lf.name, lf, stalls)
        if slow:
            raise Violation(" | ".join(slow))

    def judge_stalls(self, i: int, node: str, log_file: Path, stalls: list[Stall]) -> list[str]:
        """Record every stall over MAX_STALL_S; a violation for each whose cause is not the
        machine's, quoting the loop thread's stack."""
        over = [st for st in stalls if st["s"] > MAX_STALL_S or st["cause"] == "unended"]
        for st in over:
            self.report.setdefault("loop_stalls", []).append(
                {"iteration": i, "node": node, **st})
            self.report.setdefault("loop_stalls_by_cause", {})
            by = self.report["loop_stalls_by_cause"]
            by[st["cause"]] = by.get(st["cause"], 0) + 1
        out = []
        for st in over:
            if st["cause"] in MACHINE_CAUSES:
                continue
            stack = st["loop_stacks"][0] if st["loop_stacks"] else "(no dump)"
            out.append(f"daemon_responsive: {node}'s event loop made no turn for {st['s']:.1f}s "
                       f"(limit {MAX_STALL_S:.0f}s), cause {st['cause']}; {st['line']}; the "
                       f"loop thread was in ({log_file}):\n{stack}")
        return out

    def store_problems(self) -> list[str]:
        out: list[str] = []
        ms = self.view.manifests()
        for path, m in sorted(ms.items()):
            if path == "ckpt/latest":
                out += self.latest_problems(m, ms)
                continue
            s = self.ref.sets.get(path)
            if s is None:
                out.append(f"the store has set {path}, which the trainer never wrote")
                continue
            if s["del_done"]:
                out.append(f"{path} is still published after its deletion returned")
                continue
            out += self.set_problems(path, m, s)
        for path in self.ref.live_committed():
            if path not in ms:
                out.append(f"{path} was committed (iteration {self.ref.sets[path]['committed']})"
                           " and never deleted, but is not in the store")
        if self.ref.latest_committed and "ckpt/latest" not in ms:
            out.append("ckpt/latest was committed but is not in the store")
        return out

    def latest_problems(self, m: ManifestDoc, ms: dict[str, ManifestDoc]) -> list[str]:
        """The store's ckpt/latest against the targets the trainer switched it to."""
        target = m.get("target")
        if m["kind"] != "symlink":
            return [f"ckpt/latest in the store is a {m['kind']}, not a symlink"]
        if target not in self.ref.latest_begun:
            return [f"ckpt/latest in the store names {target}, never a target of latest"]
        if f"ckpt/{target}" not in ms:
            return [f"ckpt/latest in the store names {target}, which is not published"]
        allowed = set(self.ref.latest_begun[max(self.ref.latest_done_idx, 0):])
        if target not in allowed:
            return [(f"ckpt/latest in the store names {target}; the trainer "
                    f"last committed latest -> "
                    f"{self.ref.latest_begun[self.ref.latest_done_idx]}")]
        return []

    def set_problems(self, path: str, m: ManifestDoc, s: SetRec) -> list[str]:
        """A published set restored from the store against what the trainer saved."""
        from ckpt_restore import restore

        try:
            data = restore(self.view.v, m)
        except AssertionError as e:
            return [f"published set {path} is torn: {e}"]
        if path.endswith(".pt"):
            return self.pt_problems(path, data, s)
        return self.dcp_problems(path, m, s)

    def pt_problems(self, path: str, data: dict[str, bytes], s: SetRec) -> list[str]:
        import torch

        if s["sha"] is None:
            return [f"{path} is published but the trainer never finished writing it"]
        if sha256(data.get("", b"")) != s["sha"]:
            return [(f"published {path} differs from what the trainer saved "
                    f"(sha256 {sha256(data.get('', b''))[:12]} != {s['sha'][:12]})")]
        obj = torch.load(io.BytesIO(data[""]), weights_only=True)
        want = make_state(self.seed, s["step"], "pt")
        if not (torch.equal(obj["model"]["w"], want["model"]["w"]) and
                torch.equal(obj["optim"]["m"], want["optim"]["m"])):
            return [f"published {path} loads tensors other than step {s['step']}'s"]
        return []

    def dcp_problems(self, path: str, m: ManifestDoc, s: SetRec) -> list[str]:
        import torch
        from ckpt_restore import restore_to
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        kind = self.dcp_kind.get(path, "dcp1")
        want_files = {".metadata", "__0_0.distcp"} | (
            {"__1_0.distcp"} if kind == "dcp2" else set())
        have = {f["path"] for f in m["files"]}
        if have != want_files:
            return [(f"published {path} ({kind}) has files {sorted(have)}, the "
                    f"save wrote {sorted(want_files)}")]
        with tempfile.TemporaryDirectory(dir=self.rig.work) as td:
            root = restore_to(self.view.v, m, Path(td))
            full = make_state(self.seed, s["step"], kind)
            target = {k: torch.zeros_like(v) for k, v in full.items()}
            try:
                dcp_load(target, checkpoint_id=str(root), no_dist=True)
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                return [f"published {path} does not dcp.load from the store: {short_exc(e)}"]
            bad = [k for k, v in full.items() if not torch.equal(target[k], v)]
            if bad:
                return [(f"published {path} loads tensors that differ from step "
                        f"{s['step']}'s: {bad}")]
        return []

    def read_under_fault(self, rec: Json, within: float = 90.0) -> list[str]:
        """With the store fault (or a peer's) still on, node b reads the newest published
        torch.save checkpoint it has not read yet (fetched from the store through the proxy,
        or from a peer): the bytes must be exactly the trainer's, or the read must fail (EIO)
        - never wrong bytes - and it returns within `within` seconds."""
        pts = sorted((s["step"], p) for p, s in self.ref.sets.items()
                     if p.endswith(".pt") and s["committed"] is not None and not s["del_begun"]
                     and p not in self.read_by_b)
        if not pts:
            return []
        path = pts[-1][1]
        self.read_by_b.add(path)
        p = self.b.path / path
        try:
            wait_for(lambda: self.view.v.get(f"manifests/{path}.json") is not None and
                     p.exists(), 60, f"{path} on node b")
        except Violation:
            rec["read_under_fault"] = f"{path}: not listed on b within 60s (not judged)"
            return []
        t0 = time.monotonic()
        got = read_file_bounded(p, within)
        rec["read_under_fault_s"] = round(time.monotonic() - t0, 2)
        if isinstance(got, str):
            rec["read_under_fault"] = f"{path}: {got}"
            if "timed out" in got:
                return [(f"read_under_fault: reading {path} through node b did not return "
                         f"within {within:.0f}s under {rec['fault']} {rec.get('detail', '')}")]
            return []   # an error is allowed; wrong bytes are not
        rec["read_under_fault"] = f"{path}: ok"
        if sha256(got) != self.ref.sets[path]["sha"]:
            return [(f"read_under_fault: node b read {path} under {rec['fault']} and got "
                     f"{len(got)} bytes that differ from what the trainer saved")]
        return []

    def read_on_fresh_node(self, i: int, rec: Json, within: float) -> list[str]:
        """With a peer's fault still on (the store healthy): a fresh node (empty cache,
        --peers) reads every file of every published set, each within `within` seconds and
        bit-exactly: chunks from the peers first, the hung one given up on at its deadline
        and cut off, the rest from the store. An error is a violation here (the store
        answers: it is the fallback), unless the set changed in the store meanwhile."""
        from ckpt_restore import RestoreError, restore

        # (a set whose deletion the trainer began may go while it is read: a rotation's
        # rmdir deletes its manifest, then its objects; the other checks skip them too)
        ms = {p: m for p, m in self.view.manifests().items() if not self.ref.deletion_begun(p)}
        node = Node(f"peerread{i}", self.rig.work, self.rig.work / f"peerread{i}-cache",
                    self.rig.store_args)
        self.rig.other_logs.append(node.log_file)
        files, slowest, t0 = 0, 0.0, time.monotonic()
        try:
            node.start()
            for path, m in ms.items():
                try:
                    want = restore(self.view.v, m)
                except RestoreError as e:
                    now = self.view.manifests().get(path)
                    if now is None or now["commit"] != m["commit"]:
                        continue   # deleted or replaced meanwhile: not judged
                    return [f"store: {path} is published but does not restore: {e}"]
                for f, data in want.items():
                    p = node.path / path / f if f else node.path / path
                    t = time.monotonic()
                    got = read_file_bounded(p, within)
                    slowest = max(slowest, time.monotonic() - t)
                    files += 1
                    if got == data:
                        continue
                    now = self.view.manifests().get(path)
                    if now is None or now["commit"] != m["commit"]:
                        continue   # deleted or replaced meanwhile: not judged
                    why = got if isinstance(got, str) else f"{len(got)} bytes that differ"
                    return [(f"peer_read: a fresh node read {path}/{f} while "
                             f"{rec.get('detail', 'a peer hung')}: {why}")]
        finally:
            node.cleanup()
            shutil.rmtree(node.cache_dir, ignore_errors=True)
        rec["peer_read"] = {"files": files, "s": round(time.monotonic() - t0, 2),
                            "slowest_s": round(slowest, 2)}
        return []

    def fresh_mount_check(self, i: int) -> float:
        for attempt in range(3):
            before = self.view.manifests()
            node = Node(f"fresh{i}", self.rig.work, self.rig.work / f"fresh{i}-cache-{attempt}",
                        self.rig.store_args)
            self.rig.other_logs.append(node.log_file)
            try:
                took = node.start()
                tree = snapshot_tree(node.path)          # at once: no waiting
                after = self.view.manifests()
                if set(after) != set(before) or any(
                        after[p]["commit"] != before[p]["commit"] for p in after):
                    continue   # the store changed meanwhile: judge again
                want = expected_tree(before)
                diff = diff_trees(want, tree, before)
                if diff:
                    raise Violation(f"a fresh mount (empty cache dir, same store) listed at "
                                    f"once after `ckptfs mount` returned: {diff}")
                # and it serves them bit-exactly
                from ckpt_restore import restore
                for path, m in before.items():
                    for f, data in restore(self.view.v, m).items():
                        p = node.path / path / f if f else node.path / path
                        got = read_file_bounded(p, 60)
                        if got != data:
                            why = got if isinstance(got, str) else "bytes differ"
                            raise Violation(f"a fresh mount reads {p.relative_to(node.path)} "
                                            f"wrong: {why}")
                return round(took, 3)
            finally:
                node.cleanup()
                shutil.rmtree(node.cache_dir, ignore_errors=True)
        raise Violation("the store kept changing while a fresh mount was checked (3 tries)")

    def committing_node_loads(self, i: int) -> None:
        ms = self.view.manifests()
        # A set whose deletion began is not the job's any more: a rotation that removes a
        # directory file by file and was interrupted leaves the set published (SEMANTICS:
        # removing a file inside a durable set leaves the published set as it was) while node
        # a no longer shows the files the trainer removed (as the other checks, skip it).
        todo = [p for p in ms if self.dcp_kind.get(p) == "dcp2"
                and not self.ref.deletion_begun(p)]
        if not todo:
            return
        if not self.trainer.running():
            self.trainer.start()
        for path in todo:
            s = self.ref.sets[path]
            res: dict[str, str] = {}

            def on_event(r: int, line: str, res: dict[str, str] = res) -> None:
                if line.startswith("LOAD "):
                    res["r"] = line.split(" ", 2)[2]
            out = self.run_cmd(i, {"op": "load_dcp", "path": path, "step": s["step"],
                                   "kind": "dcp2"}, [0], on_event=on_event, timeout=120)
            if res.get("r") != "ok":
                res.setdefault("r", "; ".join(out["err"]) or "no answer")
                names = sorted(os.listdir(self.a.path / path)) \
                    if (self.a.path / path).is_dir() else "absent"
                raise Violation(f"the committing node a cannot dcp.load multi-node set {path}: "
                                f"{res.get('r')} (a lists {names}; the manifest names "
                                f"{sorted(f['path'] for f in ms[path]['files'])})")


# -- trees ---------------------------------------------------------------------------------------


def snapshot_tree(root: Path) -> Tree:
    """{path: ("f", size) | ("l", target)} of every file and symlink under root."""
    out: Tree = {}
    for dirpath, dirs, files in os.walk(root):
        for n in files + dirs:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("l", os.readlink(p))
            elif n in files:
                out[rel] = ("f", st.st_size)
    return out


def expected_tree(ms: dict[str, ManifestDoc]) -> Tree:
    out: Tree = {}
    for path, m in ms.items():
        if m["kind"] == "symlink":
            out[path] = ("l", m.get("target"))
        elif m["kind"] == "file":
            out[path] = ("f", m["files"][0]["size"])
        else:
            for f in m["files"]:
                out[f"{path}/{f['path']}"] = ("f", f["size"])
            for s in m.get("symlinks", []):
                out[f"{path}/{s['path']}"] = ("l", s["target"])
    return out


def diff_trees(want: Tree, have: Tree, ms: dict[str, ManifestDoc]) -> str:
    """What a mount's tree lacks or has beyond the published sets, by set."""
    parts = []
    absent, partial = [], []
    for path in sorted(ms):
        mine = [p for p in want if p == path or p.startswith(path + "/")]
        missing = [p for p in mine if p not in have]
        if missing and len(missing) == len(mine):
            absent.append(path)
        elif missing:
            partial.append(f"{path} lacks {[p[len(path) + 1:] for p in missing][:5]}")
    shown = len(ms) - len(absent) - len(partial)
    if absent or partial:
        parts.append(f"it shows {shown} of {len(ms)} published sets whole")
    if absent:
        parts.append(f"absent: {absent[:8]}{' ...' if len(absent) > 8 else ''}")
    if partial:
        parts.append("incomplete: " + "; ".join(partial[:4]))
    extra = sorted(set(have) - set(want))
    if extra:
        parts.append(f"not published but shown: {extra[:6]}")
    wrong = sorted(p for p in set(want) & set(have) if want[p] != have[p])
    if wrong:
        parts.append("wrong: " + ", ".join(f"{p} is {have[p]}, published {want[p]}"
                                           for p in wrong[:4]))
    return "; ".join(parts)


def read_file_bounded(p: Path, timeout: float) -> bytes | str:
    """A file's bytes read by a child process (a hung mount cannot hang the loop), or a
    string saying why not."""
    code = "import sys; sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())"
    try:
        r = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"read timed out after {timeout}s"
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace").strip().splitlines()
        return f"read failed: {err[-1] if err else r.returncode}"
    return r.stdout

