"""The rig of scripts/fault_loop.py: the store (moto, or a one-node Ceph RGW or SeaweedFS) behind
the fault proxy (tests/faultproxy.py), two ckptfs nodes on it, the trainer's two ranks
(scripts/fault_trainer.py), the reference of what the trainer did, and a poller of the store's
`latest`. Everything here is started by Rig.setup() and stopped by Rig.teardown().
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypedDict, TypeVar

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from procwait import Events
from procwait import wait_for as _wait_for

from cachemgr.format.docs import ManifestDoc
from ckptfs.stallwatch import Stall, parse_log

if TYPE_CHECKING:
    from tests.faultproxy import FaultProxy

# a daemon's event loop making no turn longer than this is a violation (issue 36), unless
# starved of CPU (ckptfs/stallwatch.py); the rig's daemons log and dump stacks at it
MAX_STALL_S = 1.0
STATUS_TRIES = 3          # a status request is asked this many times (10 s each) before failing
BUCKET = "ckpt-faults"
PREFIX = "p"

# a JSON document: a manifest, a daemon's status, a report record
Json = dict[str, Any]
T = TypeVar("T")


class SetRec(TypedDict):
    """What the trainer did to one checkpoint set (Ref.sets)."""
    kind: str | None
    step: int
    sha: str | None        # torch.save files: the sha256 of the bytes written
    begun: int             # the iteration its save began in
    committed: int | None  # the iteration its commit returned in
    del_begun: bool
    del_done: bool


def _pipe(f: IO[bytes] | None) -> IO[bytes]:
    """A child's stdin/stdout pipe (always there: every Popen here asks for them)."""
    assert f is not None
    return f


class Violation(Exception):
    """A check failed: the message is the one-line reason."""


def log(msg: str) -> None:
    print(msg, flush=True)


def wait_for(cond: Callable[[], T], timeout: float, what: str,
             exc: type[Exception] = Violation) -> T:
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


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
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
        self._stalls_seen = 0  # ended stalls of log_file returned by new_stalls
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
        # --allow-unsaved: a killed trainer leaves what it was writing in no set (a DCP
        # directory without its .metadata, a torch.save temporary); the loop judges the sets
        # (torn, lost, stuck), not the leftovers of an interrupted save
        res = cli("umount", str(self.mountpoint), "--timeout", str(int(timeout)),
                  "--allow-unsaved", timeout=timeout + 60)
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
        if self.pid is not None and self.alive():
            os.kill(self.pid, signal.SIGKILL)
        if is_mounted(self.mountpoint):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)],
                           capture_output=True)
        self.pid = None

    def status(self) -> Json:
        """The daemon's tiering status. A request that times out (10 s) is asked again, up to
        STATUS_TRIES in all: a daemon whose loop stalls that long is recorded (`slow_answers`;
        its log names where the loop was, ckptfs/stallwatch.py, and `check_logs` judges the
        stall's length), one that never answers is an error with its log's tail."""
        import ckptfs
        for attempt in range(STATUS_TRIES):
            try:
                tiering: Json = ckptfs.status(self.mountpoint)["tiering"]
                return tiering
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

    def new_stalls(self) -> list[Stall]:
        """The loop stalls the daemon logged since the last call that have ended (a stall
        whose end is not logged yet comes in a later call), each with its cause and the loop
        thread's stack from the dump taken during it (`log_stalls`)."""
        if not self.log_file.exists():
            return []
        with open(self.log_file, "rb") as f:
            f.seek(self._log_seen)
            new = f.read()
        self._log_seen += len(new)
        # (lease lapses are counted here too: the fence at work, cachemgr.tiering.members.Lease)
        self.lease_lapses += len(re.findall(rb"registered again as generation", new))
        stalls = log_stalls(self.log_file)
        fresh = stalls[self._stalls_seen:]
        self._stalls_seen = len(stalls)
        return fresh

    def tracebacks(self) -> list[str]:
        return log_tracebacks(self.log_file)


def log_stalls(path: Path) -> list[Stall]:
    """Every ended loop stall of a daemon log (ckptfs.stallwatch.parse_log)."""
    try:
        return parse_log(path.read_text(errors="replace"))[0]
    except FileNotFoundError:
        return []


def unended_dumps(path: Path) -> list[str]:
    """The loop thread's stack of each dump after the log's last stall end (a stall that had
    not ended when the log was read, or never did: the daemon was killed during it)."""
    try:
        return parse_log(path.read_text(errors="replace"))[1]
    except FileNotFoundError:
        return []


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
        self.procs: list[subprocess.Popen[bytes]] = []
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
                [sys.executable, str(REPO / "scripts" / "fault_loop.py"), "trainer", str(rank), "2",
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

    def send(self, rank: int, cmd: Json | str) -> None:
        data = (cmd if isinstance(cmd, str) else json.dumps(cmd)) + "\n"
        try:
            stdin = _pipe(self.procs[rank].stdin)
            stdin.write(data.encode())
            stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def kill(self, daemons: Sequence[Node] = ()) -> list[str]:
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
                    _pipe(p.stdin).close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        for p in self.procs:
            _pipe(p.stdout).close()
        self.procs, self.events = [], []


class Ref:
    """What the trainer did: the reference the store is judged against."""

    def __init__(self) -> None:
        self.sets: dict[str, SetRec] = {}    # pt / dcp paths: written once each
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

    def deletion_begun(self, path: str) -> bool:
        s = self.sets.get(path)
        return s is not None and s["del_begun"]

    def live_committed(self) -> list[str]:
        return [p for p, s in self.sets.items() if s["committed"] is not None
                and not s["del_begun"]]


class StoreView:
    """The store read directly from moto (never through the proxy)."""

    def __init__(self, endpoint: str) -> None:
        from ckpt_restore import S3StoreView
        self.v = S3StoreView(endpoint, BUCKET, PREFIX)

    def manifests(self) -> dict[str, ManifestDoc]:
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
        self.cur_rec: Json = {}
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

    def halt(self) -> None:
        self.stop_ev.set()
        self.join(10)

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



class Rig:
    """The store, the fault proxy, node A (its cache on a small tmpfs: the disk-full fault
    fills it) and node B, the trainer and the `latest` poller: started by setup(), every one
    stopped by teardown() (in reverse order, whatever setup reached)."""

    work: Path
    moto_url: str
    proxy: FaultProxy
    view: StoreView
    tmpfs: Path
    store_args: list[str]
    a: Node
    b: Node
    trainer: Trainer
    poller: LatestPoller
    # --peers: each node's peer server behind its own fault proxy, by node name (the address
    # the other nodes reach it at is the proxy's: see _peer_args)
    peer_proxies: dict[str, FaultProxy]

    def __init__(self, args: argparse.Namespace, seed: int, ref: Ref) -> None:
        self.args, self.seed, self.ref = args, seed, ref
        self.cleanups: list[Callable[[], object]] = []
        self.other_logs: list[Path] = []   # logs of fresh nodes, judged once by check_logs

    def _start_moto(self) -> str:
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mlog = open(self.work / "moto.log", "w")  # noqa: SIM115 - closed by the cleanup below
        moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=mlog, stderr=subprocess.STDOUT)

        def stop_moto() -> None:
            moto.terminate()
            moto.wait(timeout=20)
            mlog.close()
        self.cleanups.append(stop_moto)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                urllib.request.urlopen(url + "/moto-api/", timeout=1).read()
                return True
            except OSError:
                return moto.poll() is not None
        wait_for(up, 60, "moto_server", exc=RuntimeError)
        return url

    def _start_scripted(self, name: str) -> str:
        """A one-node store that scripts/<name>.sh runs (Ceph RGW, SeaweedFS: tests/stores.py),
        stopped by the cleanups."""
        where = self.work / name
        script = str(REPO / "scripts" / f"{name}.sh")
        # the script's credentials are ours; `weed` comes with this Python's environment
        env = dict(os.environ, PATH=os.pathsep.join((os.path.dirname(sys.executable),
                                                     os.environ["PATH"])))
        env[f"{name.upper()}_ACCESS_KEY"] = os.environ["AWS_ACCESS_KEY_ID"]
        env[f"{name.upper()}_SECRET_KEY"] = os.environ["AWS_SECRET_ACCESS_KEY"]
        self.cleanups.append(lambda: subprocess.run(["bash", script, "stop", str(where)],
                                                    capture_output=True, timeout=120))
        r = subprocess.run(["bash", script, "start", str(where)], capture_output=True,
                           text=True, env=env, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"cannot start {name}: {r.stderr.strip()[-300:]}")
        return r.stdout.strip().splitlines()[-1]

    def _start_store(self) -> None:
        import boto3
        import botocore.config

        from tests.faultproxy import FaultProxy

        self.moto_url = self._start_moto() if self.args.store == "moto" \
            else self._start_scripted(self.args.store)
        boto3.client("s3", endpoint_url=self.moto_url,
                     config=botocore.config.Config(s3={"addressing_style": "path"})
                     ).create_bucket(Bucket=BUCKET)
        self.proxy = FaultProxy(self.moto_url, seed=self.seed).start()
        self.cleanups.append(self.proxy.stop)
        self.view = StoreView(self.moto_url)

    def _mount_cache_disk(self) -> None:
        """Node A's cache on a small tmpfs (the disk-full fault fills it)."""
        self.tmpfs = self.work / "a-disk"
        self.tmpfs.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.cache_disk_mb}m",
                            "tmpfs", str(self.tmpfs)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cannot mount a tmpfs for the cache disk: {r.stderr.strip()}")
        self.cleanups.append(lambda: subprocess.run(["umount", "-l", str(self.tmpfs)],
                                                    capture_output=True))

    def setup(self) -> None:
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        # every daemon's stall watchdog at 1 s: a loop stall over 1 s is logged with its cause
        # and every thread's stack, and `check_logs` judges it (ckptfs/stallwatch.py)
        os.environ["CKPTFS_STALL_S"] = os.environ["CKPTFS_STALL_DUMP_S"] = str(MAX_STALL_S)
        base = Path(self.args.workdir) if self.args.workdir else None
        self.work = Path(tempfile.mkdtemp(prefix="ckptfs-faults-", dir=base))
        self.cleanups.append(lambda: shutil.rmtree(self.work, ignore_errors=True)
                             if not self.args.keep_workdir else None)
        self._start_store()
        self._mount_cache_disk()
        store = ["--store", f"s3://{BUCKET}/{PREFIX}", "--s3-endpoint", self.proxy.url,
                 "--s3-path-style", "--refresh-interval", "1", "--part-size", "5M",
                 "--lease", str(self.args.lease)]
        self.peer_proxies = {}
        a_args, b_args = store, store
        if self.args.peers:
            secret = self.work / "peer-secret"
            secret.write_bytes(os.urandom(32).hex().encode())
            secret.chmod(0o600)
            peers = store + ["--peers", "--peer-secret-file", str(secret)]
            a_args = peers + self._peer_args("a", "127.0.0.2")
            b_args = peers + self._peer_args("b", "127.0.0.3")
            # a fresh node of the checks serves on a port of the kernel's choice, unproxied
            store = peers + ["--peer-listen", "127.0.0.1:0", "--peer-address", "127.0.0.1"]
        self.store_args = store
        self.a = Node("a", self.work, self.tmpfs / "cache", a_args)
        self.b = Node("b", self.work, self.work / "b-cache", b_args)
        self.cleanups.append(self.b.cleanup)
        self.cleanups.append(self.a.cleanup)
        self.a.start()
        self.b.start()
        self.trainer = Trainer(self.work, self.a, self.b, self.seed)
        self.cleanups.append(lambda: self.trainer.kill([self.a, self.b]))
        self.poller = LatestPoller(self.view, self.ref)
        self.poller.start()
        self.cleanups.append(self.poller.halt)

    def _peer_args(self, name: str, address: str) -> list[str]:
        """Node `name`'s peer server listens on 127.0.0.1:<port> and advertises `address` (its
        member record's host; the port is the same): a fault proxy on address:port forwards to
        it, so every request another node makes to this node's peer server passes the proxy
        (a black hole, a one-way partition between peers). Loopback answers on all of
        127/8, so the proxy and the server share the port on two addresses; the port is
        fixed, so a remounted node is reached at the same place."""
        from tests.faultproxy import FaultProxy

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        px = FaultProxy(f"http://127.0.0.1:{port}", host=address, port=port,
                        seed=self.seed).start()
        self.cleanups.append(px.stop)
        self.peer_proxies[name] = px
        return ["--peer-listen", f"127.0.0.1:{port}", "--peer-address", address]

    def proxies(self) -> dict[str, FaultProxy]:
        """Every fault proxy by what it stands in front of: "store", "peer_a", "peer_b"."""
        return {"store": self.proxy, **{f"peer_{n}": px for n, px in self.peer_proxies.items()}}

    def teardown(self) -> None:
        for fn in reversed(self.cleanups):
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                log(f"cleanup: {e.__class__.__name__}: {e}")
