#!/usr/bin/env python3
"""ckptfs crash and store-fault loop: N iterations of a realistic checkpoint loop, one random
fault each, every check after each iteration; the seed is printed and replayable.

    python scripts/fault_loop.py --iterations 12 --seed 7 --report fault-report.json
    python scripts/fault_loop.py --iterations 1000 --seed 1 --report long.json   # the long run
    python scripts/fault_loop.py --seed 7 --iterations 4 --faults store --workloads torch,dcp1
    python scripts/fault_loop.py --store rgw --iterations 100 --seed 20   # on a real S3 server

Two "nodes" (ckptfs mounts A and B, their own cache dirs; A's on a small tmpfs) share one S3
bucket on a moto_server (or, with `--store rgw`, a one-node Ceph RGW: scripts/rgw.sh), reached
through tests/faultproxy.py. A trainer (2 gloo ranks: rank 0
writes through A, rank 1 through B) runs one workload per iteration (torch.save + `latest`
symlink, DCP with 1 rank, DCP with 2 ranks, rotation) while one fault hits (kill -9 of the
trainer or of a daemon at an aimed moment, a store fault at the proxy, a full cache disk).
After the fault is cleared (and a killed daemon remounted), the checks of docs/RELIABILITY.md
run; the first violated check stops the run (exit 1) with a one-line reason and the command
that replays it. Needs root (FUSE, tmpfs).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from procwait import Events
from procwait import wait_for as _wait_for

WORKLOADS = ("torch", "dcp1", "dcp2", "rotate")
FAULTS = (
    "kill_trainer_writing", "kill_trainer_committed", "kill_trainer_deleting",
    "kill_daemon_writing", "kill_daemon_committed", "kill_daemon_uploading",
    "kill_daemon_publishing", "kill_daemon_deleting",
    "store_error", "store_reset", "store_truncate", "store_hangup", "store_slow",
    "store_outage", "disk_full",
)
FAULT_GROUPS = {
    "kill": [f for f in FAULTS if f.startswith("kill_")],
    "kill_trainer": [f for f in FAULTS if f.startswith("kill_trainer")],
    "kill_daemon": [f for f in FAULTS if f.startswith("kill_daemon")],
    "store": [f for f in FAULTS if f.startswith("store_")],
    "disk": ["disk_full"],
    "all": list(FAULTS),
}
KEEP = 2                  # rotation keeps the newest KEEP checkpoints of each kind
STATUS_TRIES = 3          # a status request is asked this many times (10 s each) before failing
MAX_STALL_S = 30.0        # a daemon's event loop making no turn longer than this is a violation
BUCKET = "ckpt-faults"
PREFIX = "p"


class Violation(Exception):
    """A check failed: the message is the one-line reason."""


# ==============================================================================================
# trainer (a subprocess: `fault_loop.py trainer RANK WORLD INIT MOUNT SEED`), commands on stdin
# as JSON lines, events on stdout, one per line:
#   B <path> <step>   a save/commit of path begins        W <path>   paused mid-write/delete
#   H <path> <sha>    a torch.save file closed (sha256)   C <path> <step>  the commit returned
#   T <seconds>       the save call took this long        X/Y <path> a deletion begins/returned
#   LOAD <path> ok|<error>                                ERR <msg>  the command failed
#   DONE              the command finished


def short_exc(e: BaseException) -> str:
    """One line for an exception (DCP's CheckpointException carries every rank's traceback:
    keep its last error line)."""
    text = str(e)
    errs = re.findall(r"\b\w+(?:Error|Exception): [^\n]*", text)
    msg = errs[-1] if errs else text.replace("\n", " ")
    return f"{e.__class__.__name__}: {msg}"[:500]


def make_state(seed: int, step: int, kind: str):
    """The deterministic training state saved at `step`: plain tensors (the reference)."""
    import torch

    g = torch.Generator().manual_seed(seed * 100003 + step)
    if kind == "pt":
        return {"model": {"w": torch.randn(256, 1024, generator=g),
                          "b": torch.randn(1024, generator=g)},
                "optim": {"m": torch.randn(128, 512, generator=g).to(torch.bfloat16)},
                "step": step}
    if kind == "dcp1":
        return {"w": torch.randn(512, 300, generator=g),
                "emb": torch.randint(-2**40, 2**40, (300, 64), generator=g),
                "step": torch.tensor(step)}
    assert kind == "dcp2"
    return {"sharded_w": torch.randn(512, 257, generator=g),
            "sharded_i": torch.randint(-2**40, 2**40, (256, 33), generator=g),
            "replicated": torch.randn(200, 100, generator=g).to(torch.float16),
            "step": torch.tensor(step)}


def _raise(e: OSError) -> None:
    raise e


def trainer_main(rank: int, world: int, init: str, mount: str, seed: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

    torch.set_num_threads(1)
    root = Path(mount) / "ckpt"
    out = sys.stdout

    def ev(*a) -> None:
        out.write(" ".join(str(x) for x in a) + "\n")
        out.flush()

    def pause(path: str) -> None:
        ev("W", path)
        sys.stdin.readline()  # "go" (or EOF: the orchestrator is done with us)

    mesh = None
    if world > 1:
        from datetime import timedelta

        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (world,))

    class Hashing:
        """What torch.save writes to `path`, hashed on the way; pauses after the first write."""

        def __init__(self, f, path: str, do_pause: bool) -> None:
            self.f, self.path, self.do_pause = f, path, do_pause
            self.h = hashlib.sha256()

        def write(self, b) -> int:
            n = self.f.write(b)
            self.h.update(b)
            if self.do_pause:
                self.do_pause = False
                self.f.flush()
                pause(self.path)
            return n

        def flush(self) -> None:
            self.f.flush()

    class PausingStream:
        def __init__(self, f, path: str) -> None:
            self._f, self._path, self._paused = f, path, False

        def write(self, b):
            n = self._f.write(b)
            if not self._paused:
                self._paused = True
                self._f.flush()
                pause(self._path)
            return n

        def __getattr__(self, name):
            return getattr(self._f, name)

    class PausingFS(FileSystem):
        def __init__(self, set_path: str) -> None:
            super().__init__()
            self.set_path = set_path

        def create_stream(self, path, mode):
            from contextlib import contextmanager

            @contextmanager
            def cm():
                with FileSystem.create_stream(self, path, mode) as s:
                    if "w" in mode and str(path).endswith(".distcp"):
                        yield PausingStream(s, self.set_path)
                    else:
                        yield s
            return cm()

    def save_torch(step: int, do_pause: bool) -> None:
        rel = f"ckpt/step_{step}.pt"
        ev("B", rel, step)
        t0 = time.monotonic()
        with open(root / f"step_{step}.pt.tmp", "wb") as f:
            w = Hashing(f, rel, do_pause)
            torch.save(make_state(seed, step, "pt"), w)
        ev("H", rel, w.h.hexdigest())
        os.rename(root / f"step_{step}.pt.tmp", root / f"step_{step}.pt")
        ev("T", f"{time.monotonic() - t0:.3f}")
        ev("C", rel, step)
        ev("B", "ckpt/latest", step)
        try:
            os.unlink(root / "latest.tmp")
        except FileNotFoundError:
            pass
        os.symlink(f"step_{step}.pt", root / "latest.tmp")
        os.rename(root / "latest.tmp", root / "latest")
        ev("C", "ckpt/latest", step)

    def save_dcp(step: int, kind: str, pause_rank: int | None) -> None:
        rel = f"ckpt/dcp_{step}"
        full = make_state(seed, step, kind)
        if kind == "dcp2":
            from torch.distributed.tensor import Shard, distribute_tensor
            sd = {k: distribute_tensor(v, mesh, [Shard(0)]) if k.startswith("sharded") else v
                  for k, v in full.items()}
        else:
            sd = full
        if rank == 0:
            ev("B", rel, step)
        writer = FileSystemWriter(str(root / f"dcp_{step}"))
        if pause_rank == rank:
            writer.fs = PausingFS(rel)
        t0 = time.monotonic()
        dcp.save(sd, storage_writer=writer, no_dist=kind != "dcp2")
        if rank == 0:
            ev("T", f"{time.monotonic() - t0:.3f}")
            ev("C", rel, step)

    def rotate(do_pause: bool) -> None:
        kinds: dict[str, list[tuple[int, str]]] = {"pt": [], "dcp": []}
        junk = []
        for name in sorted(os.listdir(root)):
            if name in ("latest", "latest.tmp"):
                continue
            m = re.fullmatch(r"(step_(\d+)\.pt)|(dcp_(\d+))", name)
            if m and m.group(1):
                kinds["pt"].append((int(m.group(2)), name))
            elif m and (root / name / ".metadata").exists():
                kinds["dcp"].append((int(m.group(4)), name))
            else:
                junk.append(name)  # leftovers of saves a fault interrupted
        try:
            protected = os.readlink(root / "latest")   # never delete what latest names
        except OSError:
            protected = None
        old = [n for v in kinds.values() for _, n in sorted(v)[:-KEEP] if n != protected]
        for name in old + junk:
            p = root / name
            ev("X", f"ckpt/{name}")
            if p.is_dir() and not p.is_symlink():
                # os.walk swallows a failed listing by default: a daemon killed mid-rotate
                # (ENOTCONN) then looked like a deletion that returned, with nothing deleted.
                for dirpath, _dirs, files in os.walk(p, topdown=False, onerror=_raise):
                    for n in sorted(files):
                        os.unlink(Path(dirpath) / n)
                        if do_pause:
                            do_pause = False
                            pause(f"ckpt/{name}")
                    os.rmdir(dirpath)
            else:
                p.unlink()
                if do_pause:
                    do_pause = False
                    pause(f"ckpt/{name}")
            ev("Y", f"ckpt/{name}")

    def load_dcp(path: str, step: int, kind: str) -> str:
        full = make_state(seed, step, kind)
        target = {k: torch.zeros_like(v) for k, v in full.items()}
        dcp.load(target, checkpoint_id=str(Path(mount) / path), no_dist=True)
        bad = [k for k, v in full.items() if not torch.equal(target[k], v)]
        return "ok" if not bad else f"tensors differ: {bad}"

    root.mkdir(exist_ok=True)
    ev("READY")
    for line in sys.stdin:
        if not line.strip() or line.strip() == "go":
            continue
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "torch":
                save_torch(cmd["step"], cmd.get("pause_rank") == rank)
            elif op in ("dcp1", "dcp2"):
                save_dcp(cmd["step"], op, cmd.get("pause_rank"))
            elif op == "rotate":
                rotate(cmd.get("pause_rank") == rank)
            elif op == "load_dcp":
                try:
                    r = load_dcp(cmd["path"], cmd["step"], cmd["kind"])
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - judged outside
                    r = short_exc(e)
                ev("LOAD", cmd["path"], r)
            elif op == "exit":
                break
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a fault made it fail
            ev("ERR", f"{op}: {short_exc(e)}")
        ev("DONE")
    if world > 1:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001, S110 - the trainer is exiting; nothing to tell
            pass


# ==============================================================================================
# orchestrator side


def log(msg: str) -> None:
    print(msg, flush=True)


def wait_for(cond, timeout: float, what: str, exc=Violation):
    """procwait.wait_for, failing with a Violation by default."""
    return _wait_for(cond, timeout, what, exc)


def pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    from ckptfs.mount import pid_running
    return pid_running(pid)


def is_mounted(path: Path) -> bool:
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfs", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


class Node:
    """One ckptfs mount (a "node") on the shared store."""

    def __init__(self, name: str, work: Path, cache_dir: Path, store_args: list[str]) -> None:
        self.name = name
        self.mountpoint = work / f"{name}-mnt"
        self.cache_dir = cache_dir
        self.log_file = work / f"{name}.log"
        self.args = store_args
        self.pid: int | None = None
        self.slow_answers = 0  # status requests that timed out (asked again)
        self._log_seen = 0     # bytes of log_file read by new_stalls
        self.lease_lapses = 0  # "registered again as generation" lines read by new_stalls
        self.mountpoint.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self.mountpoint

    def start(self) -> float:
        """Mount; returns how long `ckptfs mount` took."""
        t0 = time.monotonic()
        res = cli("mount", str(self.mountpoint), "--cache-dir", str(self.cache_dir),
                  "--log-file", str(self.log_file), *self.args)
        took = time.monotonic() - t0
        if res.returncode != 0:
            raise Violation(f"node {self.name}: ckptfs mount failed ({res.returncode}): "
                            f"{res.stderr.strip()}")
        m = re.search(r"pid (\d+)", res.stdout)
        self.pid = int(m.group(1)) if m else None
        return took

    def stop(self, timeout: float = 120) -> None:
        res = cli("umount", str(self.mountpoint), "--timeout", str(int(timeout)),
                  timeout=timeout + 60)
        if res.returncode != 0:
            raise Violation(f"node {self.name}: ckptfs umount failed ({res.returncode}): "
                            f"{res.stderr.strip()}")
        if self.pid is not None:
            wait_for(lambda: not pid_alive(self.pid), 30, f"node {self.name}'s daemon to exit")
        self.pid = None

    def kill9(self) -> None:
        if self.pid is not None and pid_alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)
            wait_for(lambda: not pid_alive(self.pid), 30, f"node {self.name}'s daemon to die",
                     exc=RuntimeError)
        self.pid = None

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def cleanup(self) -> None:
        try:
            if is_mounted(self.mountpoint) and self.alive():
                cli("umount", str(self.mountpoint), "--timeout", "30", timeout=90)
        except subprocess.TimeoutExpired:
            pass
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)],
                           capture_output=True)
        self.pid = None

    def status(self) -> dict:
        """The daemon's tiering status. A request that times out (10 s) is asked again, up to
        STATUS_TRIES in all: a daemon whose loop stalls that long is recorded (`slow_answers`;
        its log names where the loop was, ckptfs/stallwatch.py, and `check_logs` judges the
        stall's length), one that never answers is an error with its log's tail."""
        import ckptfs
        for attempt in range(STATUS_TRIES):
            try:
                return ckptfs.status(self.mountpoint)["tiering"]
            except ckptfs.CkptfsError as e:
                if "not answering" not in str(e):
                    raise  # (a timeout means a socket is there: asked again whatever self.pid)
                self.slow_answers += 1
                if attempt == STATUS_TRIES - 1:
                    tail = self.log_file.read_text(errors="replace").splitlines()[-40:] \
                        if self.log_file.exists() else []
                    raise ckptfs.CkptfsError(
                        f"{e} ({STATUS_TRIES} tries); node {self.name}'s log ends:\n"
                        + "\n".join(tail), e.code) from None
        raise AssertionError("unreachable")

    def new_stalls(self) -> list[float]:
        """Lengths of the loop stalls the daemon logged since the last call."""
        if not self.log_file.exists():
            return []
        with open(self.log_file, "rb") as f:
            f.seek(self._log_seen)
            new = f.read()
        self._log_seen += len(new)
        # (lease lapses are counted here too: the fence at work, cachemgr.tiering.members.Lease)
        self.lease_lapses += len(re.findall(rb"registered again as generation", new))
        return [float(m) for m in re.findall(rb"ran again after a stall of ([0-9.]+)s", new)]

    def tracebacks(self) -> list[str]:
        return log_tracebacks(self.log_file)


def log_tracebacks(path: Path) -> list[str]:
    """One line per traceback in a log: the line that logged it (without its timestamp and
    pid) and the exception it ends with."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for i, ln in enumerate(lines):
        if not ln.startswith("Traceback"):
            continue
        head = re.sub(r"^\S+ \S+ \d+ ", "", lines[i - 1]) if i else ""
        exc = next((x for x in lines[i + 1:] if x and not x.startswith(" ")), "?")
        out.append(f"{head} | {exc}")
    return out


class Trainer:
    """Two gloo ranks, rank 0 on node A's mount, rank 1 on node B's (started on demand)."""

    def __init__(self, work: Path, a: Node, b: Node, seed: int) -> None:
        self.work, self.a, self.b, self.seed = work, a, b, seed
        self.procs: list[subprocess.Popen] = []
        self.events: list[Events] = []
        self.starts = 0

    def running(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def start(self) -> None:
        self.stop()
        self.starts += 1
        init = self.work / f"pg-{self.starts}"
        errlog = open(self.work / "trainer.log", "ab")  # noqa: SIM115 - the trainers' stderr
        for rank, node in enumerate((self.a, self.b)):
            p = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "trainer", str(rank), "2",
                 str(init), str(node.path), str(self.seed)],
                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog,
                env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'scripts'}"})
            self.procs.append(p)
            self.events.append(Events(p, exc=TimeoutError))
        errlog.close()
        for r in range(2):
            line = self.events[r].next(120)
            if line != "READY":
                raise RuntimeError(f"trainer rank {r} did not start ({line!r}); see "
                                   f"{self.work / 'trainer.log'}")

    def send(self, rank: int, cmd: dict | str) -> None:
        data = (cmd if isinstance(cmd, str) else json.dumps(cmd)) + "\n"
        try:
            self.procs[rank].stdin.write(data.encode())
            self.procs[rank].stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def kill(self, daemons: list[Node] = ()) -> list[str]:
        """kill -9 every rank. A rank blocked in a FUSE request cannot die before the daemon
        answers: if it does not within 15 s, the daemons are killed too; returns their names
        (the caller reports it)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        freed: list[str] = []
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                for d in daemons:
                    if d.alive():
                        d.kill9()
                        freed.append(d.name)
                p.wait(timeout=30)
        return freed

    def stop(self) -> None:
        if not self.procs:
            return
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                self.send(r, {"op": "exit"})
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        for p in self.procs:
            p.stdout.close()
        self.procs, self.events = [], []


class Ref:
    """What the trainer did: the reference the store is judged against."""

    def __init__(self) -> None:
        self.sets: dict[str, dict] = {}      # pt / dcp paths: written once each
        self.latest_begun: list[str] = []    # targets latest was being switched to, in order
        self.latest_committed: list[str] = []
        self.latest_done_idx = -1            # index in latest_begun of the last committed

    def event(self, line: str, kind: str | None, it: int) -> None:
        p = line.split()
        if not p:
            return
        tag = p[0]
        if tag == "B" and p[1] == "ckpt/latest":
            self.latest_begun.append(f"step_{p[2]}.pt")
        elif tag == "C" and p[1] == "ckpt/latest":
            self.latest_committed.append(f"step_{p[2]}.pt")
            self.latest_done_idx = len(self.latest_begun) - 1
        elif tag == "B":
            self.sets[p[1]] = {"kind": kind, "step": int(p[2]), "sha": None, "begun": it,
                               "committed": None, "del_begun": False, "del_done": False}
        elif tag == "H":
            self.sets[p[1]]["sha"] = p[2]
        elif tag == "C":
            self.sets[p[1]]["committed"] = it
        elif tag == "X" and p[1] in self.sets:
            self.sets[p[1]]["del_begun"] = True
        elif tag == "Y" and p[1] in self.sets:
            self.sets[p[1]]["del_done"] = True

    def live_committed(self) -> list[str]:
        return [p for p, s in self.sets.items() if s["committed"] is not None
                and not s["del_begun"]]


class StoreView:
    """The store read directly from moto (never through the proxy)."""

    def __init__(self, endpoint: str) -> None:
        from ckpt_restore import S3StoreView
        self.v = S3StoreView(endpoint, BUCKET, PREFIX)

    def manifests(self) -> dict[str, dict]:
        from ckpt_restore import manifests
        return manifests(self.v)

    def set_paths(self) -> set[str]:
        return {k[len("manifests/"):-len(".json")] for k in self.v.keys("manifests/")}


class LatestPoller(threading.Thread):
    """Polls the store: every set ever published, and whether `latest` ever names a set that
    is not published."""

    def __init__(self, view: StoreView, ref: Ref) -> None:
        super().__init__(daemon=True, name="latest-poller")
        self.view, self.ref = view, ref
        self.stop_ev = threading.Event()
        self.ever: set[str] = set()
        self.deleted_seen: set[str] = set()
        self.violations: list[str] = []
        self.seen_tracebacks: set[str] = set()
        self.read_by_b: set[str] = set()
        self.cur_rec: dict = {}
        self.killed: set[str] = set()
        self.stuck: list[str] = []
        self.polls = 0
        self.lock = threading.Lock()

    def _latest(self) -> tuple[str, str] | None:
        s3 = self.view.v.s3
        try:
            r = s3.get_object(Bucket=BUCKET, Key=f"{PREFIX}/manifests/ckpt/latest.json")
        except s3.exceptions.NoSuchKey:
            return None
        m = json.loads(r["Body"].read())
        return r["ETag"], m.get("target") or next(
            (s.get("target") for s in m.get("symlinks", [])), "")

    def run(self) -> None:
        s3 = self.view.v.s3
        prev: set[str] = set()
        while not self.stop_ev.is_set():
            try:
                first = self._latest()
                paths = self.view.set_paths()
                with self.lock:
                    self.polls += 1
                    self.ever |= paths
                    self.deleted_seen |= prev - paths
                prev = paths
                if first is not None:
                    etag, target = first
                    tpath = f"ckpt/{target}"
                    if tpath not in paths:
                        try:
                            again = s3.head_object(Bucket=BUCKET,
                                                   Key=f"{PREFIX}/manifests/ckpt/latest.json")
                            same = again["ETag"] == etag
                        except Exception:  # noqa: BLE001 - gone: the sample is void
                            same = False
                        if same:
                            with self.lock:
                                if tpath in self.ever:
                                    msg = (f"latest in the store names {tpath}, which was "
                                           "published and has been deleted from the store")
                                else:
                                    msg = (f"latest in the store names {tpath}, which is not "
                                           "published (latest was published before the "
                                           "checkpoint it names)")
                                if msg not in self.violations:
                                    self.violations.append(msg)
            except Exception:  # noqa: BLE001, S110 - a moto hiccup: next poll
                pass
            self.stop_ev.wait(0.05)


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


# ----------------------------------------------------------------------------------------------


class Loop:
    def __init__(self, a: argparse.Namespace) -> None:
        self.args = a
        self.seed = a.seed
        self.workloads = a.workloads
        self.faults = a.faults
        self.report: dict = {"seed": a.seed, "iterations": [], "argv": sys.argv[1:],
                             "result": "running"}
        self.cleanups: list = []
        self.ref = Ref()
        self.next_step = 1
        self.dcp_kind: dict[str, str] = {}   # dcp path -> dcp1 / dcp2
        self.violations: list[str] = []
        self.seen_tracebacks: set[str] = set()
        self.read_by_b: set[str] = set()
        self.cur_rec: dict = {}
        self.killed: set[str] = set()
        self.stuck: list[str] = []

    # -- setup / teardown ---------------------------------------------------------------------

    def _start_moto(self) -> str:
        import socket
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mlog = open(self.work / "moto.log", "w")  # noqa: SIM115 - closed by the cleanup below
        moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=mlog, stderr=subprocess.STDOUT)
        self.cleanups.append(lambda: (moto.terminate(), moto.wait(timeout=20), mlog.close()))
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).read()
                return True
            except OSError:
                return moto.poll() is not None
        wait_for(up, 60, "moto_server", exc=RuntimeError)
        return url

    def _start_rgw(self) -> str:
        """A one-node Ceph RGW (scripts/rgw.sh), stopped by the cleanups."""
        where = self.work / "rgw"
        script = str(REPO / "scripts" / "rgw.sh")
        env = dict(os.environ, RGW_ACCESS_KEY=os.environ["AWS_ACCESS_KEY_ID"],
                   RGW_SECRET_KEY=os.environ["AWS_SECRET_ACCESS_KEY"])
        self.cleanups.append(lambda: subprocess.run(["bash", script, "stop", str(where)],
                                                    capture_output=True, timeout=120))
        r = subprocess.run(["bash", script, "start", str(where)], capture_output=True,
                           text=True, env=env, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"cannot start Ceph RGW: {r.stderr.strip()[-300:]}")
        return r.stdout.strip().splitlines()[-1]

    def setup(self) -> None:
        import boto3
        import botocore.config

        from tests.faultproxy import FaultProxy

        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        base = Path(self.args.workdir) if self.args.workdir else None
        self.work = Path(tempfile.mkdtemp(prefix="ckptfs-faults-", dir=base))
        self.cleanups.append(lambda: shutil.rmtree(self.work, ignore_errors=True)
                             if not self.args.keep_workdir else None)
        self.moto_url = self._start_rgw() if self.args.store == "rgw" else self._start_moto()
        boto3.client("s3", endpoint_url=self.moto_url,
                     config=botocore.config.Config(s3={"addressing_style": "path"})
                     ).create_bucket(Bucket=BUCKET)
        self.proxy = FaultProxy(self.moto_url, seed=self.seed).start()
        self.cleanups.append(self.proxy.stop)
        self.view = StoreView(self.moto_url)
        # node A's cache on a small tmpfs (the disk-full fault fills it)
        self.tmpfs = self.work / "a-disk"
        self.tmpfs.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.cache_disk_mb}m",
                            "tmpfs", str(self.tmpfs)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs for the cache disk: {r.stderr.strip()}")
        self.cleanups.append(lambda: subprocess.run(["umount", "-l", str(self.tmpfs)],
                                                    capture_output=True))
        store = ["--store", f"s3://{BUCKET}/{PREFIX}", "--s3-endpoint", self.proxy.url,
                 "--s3-path-style", "--refresh-interval", "1", "--part-size", "5M",
                 "--lease", str(self.args.lease)]
        self.store_args = store
        self.a = Node("a", self.work, self.tmpfs / "cache", store)
        self.b = Node("b", self.work, self.work / "b-cache", store)
        self.cleanups.append(self.b.cleanup)
        self.cleanups.append(self.a.cleanup)
        self.a.start()
        self.b.start()
        self.killed: set[str] = set()
        self.trainer = Trainer(self.work, self.a, self.b, self.seed)
        self.cleanups.append(lambda: self.trainer.kill([self.a, self.b]))
        self.poller = LatestPoller(self.view, self.ref)
        self.poller.start()
        self.cleanups.append(lambda: (self.poller.stop_ev.set(), self.poller.join(10)))
        self.other_logs: list[Path] = []

    def teardown(self) -> None:
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                log(f"cleanup: {e.__class__.__name__}: {e}")

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

    def run_cmd(self, it: int, cmd: dict, ranks: list[int], on_event=None,
                timeout: float = 120) -> dict:
        """Send cmd to `ranks`, record rank 0's events; on_event(rank, line) may return "stop"
        to stop reading (the fault took over). Returns {"err": [...], "T": [...]}."""
        kind = cmd["op"] if cmd["op"] in ("dcp1", "dcp2") else "pt"
        for r in ranks:
            self.trainer.send(r, cmd)
        out = {"err": [], "T": [], "stopped": False}
        pending = set(ranks)
        deadline = time.monotonic() + timeout
        while pending:
            for r in sorted(pending):
                ev = self.trainer.events[r]
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
                    out["err"].append(f"rank {r}: {line[4:]}")
                elif line.startswith("T "):
                    out["T"].append(float(line.split()[1]))
                elif line == "DONE":
                    pending.discard(r)
                if on_event is not None and on_event(r, line) == "stop":
                    out["stopped"] = True
                    return out
        return out

    def drain_events(self, it: int) -> None:
        """Record what rank 0 said before it died or the fault stopped the reading."""
        if not self.trainer.events:
            return
        ev = self.trainer.events[0]
        while True:
            try:
                line = ev.next(0.5)
            except TimeoutError:
                return
            if line is None:
                return
            self.ref.event(line, None if not line.startswith("B ckpt/dcp_") else
                           "dcp", it)

    def workload_cmds(self, workload: str, pause_rank: int | None) -> list[tuple[dict, list]]:
        cmds = []
        if workload == "rotate":
            n_pt = len([p for p, s in self.ref.sets.items() if p.endswith(".pt")
                        and s["committed"] is not None and not s["del_begun"]])
            for _ in range(max(1, KEEP + 1 - n_pt)):   # something to delete
                cmds.append(({"op": "torch", "step": self.take_step()}, [0]))
            cmds.append(({"op": "rotate", "pause_rank": pause_rank}, [0]))
            return cmds
        ranks = [0, 1] if workload == "dcp2" else [0]
        for k in range(2 if workload == "torch" else 1):
            c = {"op": workload, "step": self.take_step()}
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

    def iteration(self, i: int) -> dict:
        fault, workload, rng = self.schedule(i)
        rec = {"i": i, "fault": fault, "workload": workload}
        self.cur_rec = rec
        log(f"[{i}] fault={fault} workload={workload}")
        stats0 = self.proxy.snapshot()["stats"]
        t0 = time.monotonic()
        if not self.trainer.running():
            self.trainer.start()
        self.killed = set()
        self.stuck = []
        px = self.proxy
        detail = ""
        save_times: list[float] = []
        errs: list[str] = []
        pre: list[str] = []      # violations found while the fault was on
        is_kill = fault.startswith("kill_")
        moment = fault.split("_", 2)[2] if is_kill else ""
        # which node a daemon kill hits (dcp2: either node; else A)
        victim = self.b if (workload == "dcp2" and rng.random() < 0.5) else self.a
        pause_rank = None
        if moment in ("writing", "deleting") and not fault.endswith("daemon_deleting"):
            pause_rank = 1 if victim is self.b else 0
        cmds = self.workload_cmds(workload, pause_rank)
        ballast = self.tmpfs / "ballast"
        from tests.faultproxy import Rule

        state = {"fired": False}

        def fire_kill() -> None:
            if fault.startswith("kill_trainer"):
                self.kill_trainer()
            else:
                victim.kill9()
                self.killed.add(victim.name)
            state["fired"] = True

        def on_event(r: int, line: str):
            if state["fired"] or not is_kill:
                return None
            if moment in ("writing", "deleting") and line.startswith("W ") and \
                    not fault.endswith("daemon_deleting"):
                fire_kill()
                return "stop"
            if moment == "committed" and line.startswith("C ") and r == 0 and \
                    "latest" not in line:
                fire_kill()
                return "stop"
            return None

        hold_release = None
        if moment == "uploading":
            # the victim's own uploads (data/<node>/...): a is the victim unless dcp2 drew b
            victim = self.b if (workload == "dcp2" and rng.random() < 0.5) else self.a
            node_id = victim.status()["store"]["node"]
            px.set_rules([Rule("hold", ops={"put", "create_multipart", "upload_part"},
                               key=rf"^{PREFIX}/data/{node_id}/", delay=120)])
        elif moment == "publishing":
            px.set_rules([Rule("hold", ops={"put"}, key=rf"^{PREFIX}/manifests/", delay=120)])
        elif fault == "kill_daemon_deleting":
            px.set_rules([Rule("hold", ops={"delete"}, delay=120)])
        elif fault == "store_error":
            mode = rng.choice(["error500", "error503", "slowdown"])
            px.set_rules([Rule(mode, prob=0.4)])
            detail = mode
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
            detail = f"{secs:.1f}s"
        elif fault == "disk_full":
            free = shutil.disk_usage(self.tmpfs).free
            leave = rng.choice([0, 64 << 10, 512 << 10])
            chunk = b"\xff" * (1 << 20)
            with open(ballast, "wb") as f:
                try:
                    todo = max(0, free - leave)
                    while todo > 0:
                        todo -= f.write(chunk[:min(todo, len(chunk))])
                        f.flush()
                except OSError:
                    pass
            detail = f"{leave >> 10} KiB left"
        if moment in ("uploading", "publishing") or fault == "kill_daemon_deleting":
            hold_release = rng.random() < 0.5   # the held request lands after the kill, or not
            detail = f"held request {'forwarded' if hold_release else 'dropped'} after the kill"
            if moment != "uploading":
                victim = self.a  # the node that publishes and deletes

            def watcher() -> None:
                if px.wait_held(1, timeout=60):
                    if not state["fired"]:
                        fire_kill()
                    px.release(forward=hold_release)
            wt = threading.Thread(target=watcher, daemon=True)
            wt.start()
        rec["detail"] = detail
        if detail:
            log(f"[{i}]   {detail}")
        try:
            for cmd, ranks in cmds:
                if not self.trainer.running():
                    break
                res = self.run_cmd(i, cmd, ranks, on_event=on_event)
                save_times += res["T"]
                errs += res["err"]
                if res["stopped"] or (state["fired"] and fault.startswith("kill_trainer")):
                    break
                if state["fired"] and fault.startswith("kill_daemon"):
                    break
            if hold_release is not None:
                wt.join(timeout=90)
                if not state["fired"]:
                    raise Violation(f"aim: {fault}: no held request appeared at the proxy within "
                                    "60s (the aim missed: nothing to upload/publish/delete?)")
            if is_kill and not state["fired"]:
                raise Violation(f"aim: {fault}: the aimed moment never came (events: no "
                                f"{'W' if moment in ('writing', 'deleting') else 'C'} event)")
            if fault.startswith("store_") and fault != "store_outage":
                pre += self.read_under_fault(rec)
                time.sleep(self.args.fault_hold)   # the fault stays on a while for uploads
            if fault == "store_outage":
                left = px._outage_until - time.monotonic()
                if left > 0:
                    time.sleep(left)               # the outage lasts its deliberate time
        finally:
            px.clear()
            if ballast.exists():
                ballast.unlink()
        rec["proxy"] = {k: v - stats0.get(k, 0) for k, v in px.snapshot()["stats"].items()
                        if v - stats0.get(k, 0)}   # requests seen and faults injected
        self.drain_events(i)
        if errs:
            rec["trainer_errors"] = errs[:5]
        # -- the fault is cleared: restart what it killed, then check --
        if fault.startswith("kill_") or fault == "disk_full" or errs \
                or not self.trainer.running():
            self.kill_trainer()
            self.trainer.stop()
        if self.stuck:
            pre.append(f"trainer_stuck: a killed trainer rank stayed blocked in the mount for "
                       f"15s during {fault} (a FUSE request never answered); daemon(s) "
                       f"{self.stuck} were killed to free it")
            self.stuck = []
        for n in (self.a, self.b):
            if not n.alive():
                if n.name not in self.killed:
                    tail = " | ".join(n.log_file.read_text(errors="replace").splitlines()[-3:]) \
                        if n.log_file.exists() else ""
                    raise Violation(f"daemon_alive: daemon of node {n.name} died on its own "
                                    f"during {fault} (log tail: {tail})")
                rec.setdefault("remount_s", {})[n.name] = round(n.start(), 2)
        rec["fault_s"] = round(time.monotonic() - t0, 2)
        rec["save_s"] = save_times
        # a save must return at local speed whatever the store does
        if fault.startswith("store_") and save_times and max(save_times) > self.args.max_save_s:
            pre.insert(0, f"save_latency: a checkpoint save ({workload}) took "
                          f"{max(save_times):.1f}s under {fault} {detail} (limit "
                          f"{self.args.max_save_s}s): a save waits for the store")
        t1 = time.monotonic()
        self.check(i, rec, pre)
        rec["check_s"] = round(time.monotonic() - t1, 2)
        rec["total_s"] = round(time.monotonic() - t0, 2)
        return rec

    # -- checks -------------------------------------------------------------------------------

    def check(self, i: int, rec: dict, pre: list[str] = ()) -> None:
        """Every check, in order. The first violation raises; with --keep-going every check
        still runs and all violations are raised together."""
        found: list[str] = []
        if pre:
            if not self.args.keep_going:
                raise Violation(pre[0])
            found += pre
        for name, fn in (("durable", self.check_durable),
                         ("store", self.check_store),
                         ("latest", self.check_latest_and_lost),
                         ("fresh_mount", lambda: rec.__setitem__(
                             "fresh_mount_s", self.fresh_mount_check(i))),
                         ("committing_node_loads", lambda: self.committing_node_loads(i)),
                         ("logs", self.check_logs)):
            try:
                fn()
            except Violation as e:
                if not self.args.keep_going:
                    raise Violation(f"{name}: {e}") from None
                found.append(f"{name}: {e}")
        if found:
            raise Violation(" || ".join(found))

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
        def settled():
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

        def store_ok():
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
        lost = sorted(p for p in ever - now if not self.ref.sets.get(p, {}).get("del_begun")
                      and p != "ckpt/latest")
        if lost:
            raise Violation(f"published set(s) vanished from the store without being deleted: "
                            f"{lost}")

    def check_logs(self) -> None:
        """No tracebacks in any daemon's log (each reported once); no event-loop stall longer
        than MAX_STALL_S (shorter ones are recorded in the report)."""
        for n in (self.a, self.b):
            stalls = n.new_stalls()
            if n.lease_lapses:
                self.report.setdefault("lease_lapses", {})[n.name] = n.lease_lapses
            if stalls:
                self.report.setdefault("loop_stalls_s", {}).setdefault(n.name, []).extend(stalls)
                if max(stalls) > MAX_STALL_S:
                    raise Violation(f"daemon_responsive: node {n.name}'s event loop made no turn "
                                    f"for {max(stalls):.0f}s (limit {MAX_STALL_S:.0f}s); its log "
                                    f"{n.log_file} says where it was")
            for tb in n.tracebacks():
                if tb not in self.seen_tracebacks:
                    self.seen_tracebacks.add(tb)
                    raise Violation(f"node {n.name}'s log {n.log_file} has a traceback: {tb}")
        while self.other_logs:   # fresh nodes' logs: each judged once, then removed
            lf = self.other_logs.pop()
            tbs = log_tracebacks(lf)
            if tbs:
                raise Violation(f"{lf} has a traceback: {tbs[0]}")
            if not self.args.keep_workdir:
                lf.unlink(missing_ok=True)

    def store_problems(self) -> list[str]:
        import torch
        import torch.distributed.checkpoint as dcp
        from ckpt_restore import restore, restore_to
        from torch.distributed.checkpoint.api import CheckpointException

        out: list[str] = []
        ms = self.view.manifests()
        for path, m in sorted(ms.items()):
            if path == "ckpt/latest":
                target = m.get("target")
                if m["kind"] != "symlink":
                    out.append(f"ckpt/latest in the store is a {m['kind']}, not a symlink")
                elif target not in self.ref.latest_begun:
                    out.append(f"ckpt/latest in the store names {target}, never a target of "
                               "latest")
                elif f"ckpt/{target}" not in ms:
                    out.append(f"ckpt/latest in the store names {target}, which is not "
                               "published")
                else:
                    allowed = set(self.ref.latest_begun[max(self.ref.latest_done_idx, 0):])
                    if target not in allowed:
                        out.append(f"ckpt/latest in the store names {target}; the trainer "
                                   f"last committed latest -> "
                                   f"{self.ref.latest_begun[self.ref.latest_done_idx]}")
                continue
            s = self.ref.sets.get(path)
            if s is None:
                out.append(f"the store has set {path}, which the trainer never wrote")
                continue
            if s["del_done"]:
                out.append(f"{path} is still published after its deletion returned")
                continue
            try:
                data = restore(self.view.v, m)
            except AssertionError as e:
                out.append(f"published set {path} is torn: {e}")
                continue
            if path.endswith(".pt"):
                if s["sha"] is None:
                    out.append(f"{path} is published but the trainer never finished writing it")
                elif sha256(data.get("", b"")) != s["sha"]:
                    out.append(f"published {path} differs from what the trainer saved "
                               f"(sha256 {sha256(data.get('', b''))[:12]} != {s['sha'][:12]})")
                else:
                    obj = torch.load(io.BytesIO(data[""]), weights_only=True)
                    want = make_state(self.seed, s["step"], "pt")
                    if not (torch.equal(obj["model"]["w"], want["model"]["w"]) and
                            torch.equal(obj["optim"]["m"], want["optim"]["m"])):
                        out.append(f"published {path} loads tensors other than step "
                                   f"{s['step']}'s")
            else:
                kind = self.dcp_kind.get(path, "dcp1")
                want_files = {".metadata", "__0_0.distcp"} | (
                    {"__1_0.distcp"} if kind == "dcp2" else set())
                have = {f["path"] for f in m["files"]}
                if have != want_files:
                    out.append(f"published {path} ({kind}) has files {sorted(have)}, the "
                               f"save wrote {sorted(want_files)}")
                    continue
                with tempfile.TemporaryDirectory(dir=self.work) as td:
                    root = restore_to(self.view.v, m, Path(td))
                    full = make_state(self.seed, s["step"], kind)
                    target = {k: torch.zeros_like(v) for k, v in full.items()}
                    try:
                        dcp.load(target, checkpoint_id=str(root), no_dist=True)
                    except (Exception, CheckpointException) as e:  # noqa: BLE001
                        out.append(f"published {path} does not dcp.load from the store: "
                                   f"{short_exc(e)}")
                        continue
                    bad = [k for k, v in full.items() if not torch.equal(target[k], v)]
                    if bad:
                        out.append(f"published {path} loads tensors that differ from step "
                                   f"{s['step']}'s: {bad}")
        for path in self.ref.live_committed():
            if path not in ms:
                out.append(f"{path} was committed (iteration {self.ref.sets[path]['committed']})"
                           " and never deleted, but is not in the store")
        if self.ref.latest_committed and "ckpt/latest" not in ms:
            out.append("ckpt/latest was committed but is not in the store")
        return out

    def read_under_fault(self, rec: dict) -> list[str]:
        """With the store fault still on, node b reads the newest published torch.save
        checkpoint it has not read yet (fetched from the store through the proxy): the bytes
        must be exactly the trainer's, or the read must fail (EIO) - never wrong bytes."""
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
        got = read_file_bounded(p, 90)
        if isinstance(got, str):
            rec["read_under_fault"] = f"{path}: {got}"
            if "timed out" in got:
                return [(f"read_under_fault: reading {path} through node b did not return "
                         f"within 90s under {rec['fault']}")]
            return []   # an error is allowed; wrong bytes are not
        rec["read_under_fault"] = f"{path}: ok"
        if sha256(got) != self.ref.sets[path]["sha"]:
            return [(f"read_under_fault: node b read {path} under {rec['fault']} and got "
                     f"{len(got)} bytes that differ from what the trainer saved")]
        return []

    def fresh_mount_check(self, i: int) -> float:
        for attempt in range(3):
            before = self.view.manifests()
            node = Node(f"fresh{i}", self.work, self.work / f"fresh{i}-cache-{attempt}",
                        self.store_args)
            self.other_logs.append(node.log_file)
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
                and not self.ref.sets.get(p, {}).get("del_begun")]
        if not todo:
            return
        if not self.trainer.running():
            self.trainer.start()
        for path in todo:
            s = self.ref.sets[path]
            res: dict = {}

            def on_event(r, line, path=path, res=res):
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

    # -- main ---------------------------------------------------------------------------------

    def replay(self, i: int) -> str:
        cmd = [os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO))
               else sys.executable, "scripts/fault_loop.py", "--seed", str(self.seed),
               "--iterations", str(i + 1)]
        if self.args.workloads_arg:
            cmd += ["--workloads", self.args.workloads_arg]
        if self.args.faults_arg:
            cmd += ["--faults", self.args.faults_arg]
        return " ".join(cmd)

    def write_report(self) -> None:
        if self.args.report:
            Path(self.args.report).write_text(json.dumps(self.report, indent=1) + "\n")

    def run(self) -> int:
        log(f"fault loop: seed {self.seed}, {self.args.iterations} iterations, faults "
            f"{','.join(self.faults)}, workloads {','.join(self.workloads)}")
        t0 = time.monotonic()
        failures = []
        try:
            self.setup()
            log(f"work dir {self.work}; {self.args.store} {self.moto_url}; proxy "
                f"{self.proxy.url}")
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
            self.trainer.stop()
            for n in (self.a, self.b):
                n.stop()
            probs = self.store_problems()
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
            self.teardown()

    def kill_trainer(self) -> None:
        freed = self.trainer.kill([self.a, self.b])
        self.killed |= set(freed)
        self.stuck += freed

    def recover(self) -> None:
        """--keep-going: after a violation, leave a clean state for the next iteration."""
        self.proxy.clear()
        self.trainer.kill([self.a, self.b])
        self.trainer.stop()
        for n in (self.a, self.b):
            if not n.alive():
                n.cleanup()
                n.start()


# -- trees ----------------------------------------------------------------------------------------


def snapshot_tree(root: Path) -> dict[str, tuple]:
    """{path: ("f", size) | ("l", target)} of every file and symlink under root."""
    out: dict[str, tuple] = {}
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


def expected_tree(ms: dict[str, dict]) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
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


def diff_trees(want: dict, have: dict, ms: dict[str, dict]) -> str:
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


def read_file_bounded(p: Path, timeout: float):
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


# ==============================================================================================


def parse_list(value: str, universe, groups=None) -> list[str]:
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
    p.add_argument("--store", choices=("moto", "rgw"), default="moto",
                   help="the S3 server behind the fault proxy: moto, or a one-node Ceph RGW "
                   "(scripts/rgw.sh; docs/STORES.md)")
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
    p.add_argument("--lease", type=float, default=10.0,
                   help="the nodes' --lease: short, so that store outages (5-10 s) run some "
                   "past it and the fence (a new generation) is exercised")
    a = p.parse_args(argv)
    try:
        a.workloads = parse_list(a.workloads_arg or ",".join(WORKLOADS), WORKLOADS)
        a.faults = parse_list(a.faults_arg or "all", FAULTS, FAULT_GROUPS)
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1, 10**6)
    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)
    if os.geteuid() != 0:
        print("fault_loop: needs root (FUSE mounts, a tmpfs)", file=sys.stderr)
        return 2
    return Loop(a).run()


if __name__ == "__main__":
    sys.exit(main())
