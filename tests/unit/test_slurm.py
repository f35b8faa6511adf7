"""deploy/slurm: the real prolog and epilog scripts, run as slurmd runs them (root, a job's
environment: SLURM_JOB_ID, SLURM_JOB_USER, SLURM_JOB_UID, SLURM_JOB_GID, SLURMD_NODENAME), on
a config file like /etc/ckptfs/slurm.conf, against moto S3 (through tests/faultproxy.py for the
store outage). The job's process runs as the job's user (nobody) and writes through the mount.
A fake `scontrol` on PATH records what the epilog asks of Slurm.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, is_mounted, new_bucket, require_fuse
from tests.faultproxy import FaultProxy

SLURM = REPO / "deploy" / "slurm"
VENV_BIN = Path(sys.executable).parent
JOB_UID = JOB_GID = 65534  # nobody
_job_ids = itertools.count(1)


class Node:
    """One node's Slurm side: a config file, a job environment per job, the scripts."""

    def __init__(self, root: Path, store: str, options: str) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.bin = root / "bin"
        self.bin.mkdir()
        self.scontrol_log = root / "scontrol.args"
        # `show hostnames`: the lines of self.hostnames; with self.scontrol_fails present, an
        # error and exit 1. Every call's arguments are recorded.
        self.hostnames = root / "hostnames"
        self.scontrol_fails = root / "scontrol.fail"
        fake = self.bin / "scontrol"
        fake.write_text(
            f'#!/bin/sh\nprintf "%s\\n" "$*" >> {self.scontrol_log}\n'
            'if [ "$1 $2" = "show hostnames" ]; then\n'
            f'    if [ -e {self.scontrol_fails} ]; then\n'
            '        echo "scontrol: error: Unable to contact slurm controller" >&2; exit 1\n'
            '    fi\n'
            f'    cat {self.hostnames}\n'
            'fi\n')
        fake.chmod(0o755)
        self.settings = {
            "CKPTFS_SLURM_STORE": store,
            "CKPTFS_SLURM_OPTIONS": options,
            "CKPTFS_SLURM_MOUNT_ROOT": str(root / "ckpt"),
            "CKPTFS_SLURM_CACHE_ROOT": str(root / "cache"),
            "CKPTFS_SLURM_LOG_DIR": str(root / "log"),
            "CKPTFS_BIN": str(VENV_BIN / "ckptfs"),
            "CKPTFS_SLURM_PYTHON": sys.executable,
        }
        self.write_conf()
        self.mounted: list[Path] = []

    def write_conf(self, **change: str) -> None:
        lines = ["# /etc/ckptfs/slurm.conf of a test node", ""]
        lines += [f"{k}={v}" for k, v in {**self.settings, **change}.items()]
        self.conf.write_text("\n".join(lines) + "\n")

    def job_env(self, job_id: str, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTFS_", "SLURM"))}
        env.update(PATH=f"{self.bin}:{env.get('PATH', '/usr/bin:/bin')}",
                   CKPTFS_SLURM_CONF=str(self.conf), SLURM_JOB_ID=job_id,
                   SLURM_JOB_USER="nobody", SLURM_JOB_UID=str(JOB_UID),
                   SLURM_JOB_GID=str(JOB_GID), SLURMD_NODENAME="node1", SLURM_CLUSTER_NAME="t")
        env.update(extra)
        return env

    def run(self, script: str, job_id: str, **extra: str) -> subprocess.CompletedProcess:
        res = subprocess.run([str(SLURM / script)], capture_output=True, text=True,
                             env=self.job_env(job_id, **extra), timeout=300, cwd="/")
        mp = self.root / "ckpt" / job_id
        if script == "prolog.sh" and is_mounted(mp):
            self.mounted.append(mp)
        return res

    def mp(self, job_id: str) -> Path:
        return self.root / "ckpt" / job_id

    def cache(self, job_id: str) -> Path:
        return self.root / "cache" / f"job-{job_id}"

    def cleanup(self) -> None:
        for mp in self.mounted:
            if is_mounted(mp):
                subprocess.run([str(VENV_BIN / "ckptfs"), "umount", str(mp), "--no-wait"],
                               capture_output=True, timeout=120)
            if is_mounted(mp):
                subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True)


@pytest.fixture
def node_root():
    """A node's directories, outside pytest's 0700 tmp dirs: the job's user must reach its
    mount point."""
    d = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def s3_node(node_root, moto_server):
    require_fuse()
    bucket = new_bucket(moto_server)
    node = Node(node_root, f"s3://{bucket}/ckpt",
                f"--s3-endpoint {moto_server} --s3-path-style --s3-region us-east-1")
    node.bucket, node.endpoint = bucket, moto_server
    yield node
    node.cleanup()


def job_id() -> str:
    return f"{os.getpid()}{next(_job_ids):03d}"


def as_job_user(script: str, *args: str) -> subprocess.CompletedProcess:
    """A process of the job: /bin/sh as the job's user (who cannot reach this venv's python)."""
    return subprocess.run(["/bin/sh", "-c", script, "job", *args], capture_output=True,
                          user=JOB_UID, group=JOB_GID, extra_groups=[], timeout=120, cwd="/")


def save(node: Node, d: Path, data: bytes) -> subprocess.CompletedProcess:
    """The job saves a checkpoint: d/run/step_1.pt (copied from a file the test wrote)."""
    src = node.root / "src.pt"
    src.write_bytes(data)
    src.chmod(0o644)
    return as_job_user('mkdir -p "$1/run" && cp "$2" "$1/run/step_1.pt"', str(d), str(src))


def load(d: Path) -> subprocess.CompletedProcess:
    return as_job_user('cat "$1/run/step_1.pt"', str(d))


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def s3_keys(node: Node) -> list[str]:
    import boto3

    s3 = boto3.client("s3", endpoint_url=node.endpoint, region_name="us-east-1")
    return [o["Key"] for o in s3.list_objects_v2(Bucket=node.bucket).get("Contents", [])]




# ----------------------------------------------------------------------------------------------


def test_prolog_mounts_the_job_writes_epilog_drains_and_the_next_job_resumes(s3_node):
    node, data = s3_node, os.urandom(1 << 18)
    job = job_id()
    res = node.run("prolog.sh", job)
    assert res.returncode == 0, res.stderr
    mp = node.mp(job)
    assert one_line(res.stdout).startswith(f"ckptfs-slurm prolog: job {job}: mounted {mp} ")
    st = os.stat(mp)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (JOB_UID, JOB_GID, 0o700)
    assert (node.root / "log" / f"job-{job}.log").exists()

    w = save(node, mp, data)
    assert w.returncode == 0, w.stderr
    res = node.run("epilog.sh", job)
    assert res.returncode == 0, res.stdout + res.stderr
    assert one_line(res.stdout) == (f"ckptfs-slurm epilog: job {job}: every set durable in "
                                    f"{node.settings['CKPTFS_SLURM_STORE']}; unmounted {mp}")
    assert not is_mounted(mp) and not mp.exists()
    assert not node.cache(job).exists()  # drained: the job's cache is freed
    assert "ckpt/manifests/run/step_1.pt.json" in s3_keys(node)
    assert not node.scontrol_log.exists()

    # The job requeued (or the next one) on a fresh cache: the checkpoint comes from the store.
    nxt = job_id()
    res = node.run("prolog.sh", nxt)
    assert res.returncode == 0, res.stderr
    r = load(node.mp(nxt))
    assert r.returncode == 0 and r.stdout == data, r.stderr
    # the restored checkpoint is the job user's (job mode mounts with --uid/--gid): the job
    # writes into the restored directory and replaces the restored file, and saves beside them
    run = node.mp(nxt) / "run"
    assert (os.stat(run).st_uid, os.stat(run / "step_1.pt").st_uid) == (JOB_UID, JOB_UID)
    w = as_job_user('echo new > "$1/run/extra.pt" && cp "$1/run/extra.pt" "$1/run/step_1.pt"',
                    str(node.mp(nxt)))
    assert w.returncode == 0, w.stderr
    assert (run / "step_1.pt").read_bytes() == b"new\n"
    assert save(node, node.mp(nxt) / "step_2", b"resumed").returncode == 0
    assert os.stat(node.mp(nxt) / "step_2" / "run" / "step_1.pt").st_uid == JOB_UID
    res = node.run("epilog.sh", nxt)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not is_mounted(node.mp(nxt))


def test_store_outage_epilog_reports_bytes_at_risk_and_drains_the_node(node_root, moto_server):
    """The store goes down after the mount: the epilog's bounded drain ends after its timeout,
    one line says how many bytes in how many sets are only in which cache dir, the node is
    drained (exit 1, scontrol reason), and the cache is kept: mounted again once the store is
    back, its upload finishes."""
    require_fuse()
    bucket = new_bucket(moto_server)
    with FaultProxy(moto_server) as proxy:
        node = Node(node_root, f"s3://{bucket}/ckpt",
                    f"--s3-endpoint {proxy.url} --s3-path-style --s3-region us-east-1")
        node.bucket, node.endpoint = bucket, moto_server
        try:
            job, data = job_id(), os.urandom(1 << 18)
            res = node.run("prolog.sh", job)
            assert res.returncode == 0, res.stderr
            proxy.outage()
            w = save(node, node.mp(job), data)
            assert w.returncode == 0, w.stderr
            node.write_conf(CKPTFS_SLURM_DRAIN_TIMEOUT="3")
            res = node.run("epilog.sh", job)
            assert res.returncode == 1, res.stdout + res.stderr
            line = one_line(res.stdout)
            cache = node.cache(job)
            assert line.startswith(f"ckptfs-slurm epilog: job {job} on node1: drain of "
                                   f"{node.mp(job)} not finished within 3s (after "), line
            assert line.endswith(f": 256.0 KiB in 1 set(s) (1 pending, 0 failed) NOT in the "
                                 f"store, only in the cache {cache} (log {node.root}/log/"
                                 f"job-{job}.log)"), line
            assert not is_mounted(node.mp(job)) and (cache / "index.sqlite").exists()
            reason = one_line(node.scontrol_log.read_text())
            assert reason == (f"update NodeName=node1 State=DRAIN Reason=ckptfs: job {job} "
                              f"left 256.0 KiB in 1 set(s) only in {cache}")
            assert "ckpt/manifests/run/step_1.pt.json" not in s3_keys(node)

            # README "Recovering a kept cache": mount it again, unmount with the drain
            proxy.clear()
            mp = node.root / "recover"
            mp.mkdir()
            node.mounted.append(mp)
            ckptfs = str(VENV_BIN / "ckptfs")
            res = subprocess.run([ckptfs, "mount", str(mp), "--cache-dir", str(cache),
                                  "--store", node.settings["CKPTFS_SLURM_STORE"],
                                  "--s3-endpoint", proxy.url, "--s3-path-style"],
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stderr
            res = subprocess.run([ckptfs, "umount", str(mp), "--timeout", "60"],
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stderr
            assert "ckpt/manifests/run/step_1.pt.json" in s3_keys(node)
        finally:
            proxy.clear()
            node.cleanup()


@pytest.mark.parametrize("change,why", [
    ({"CKPTFS_SLURM_STORE": ""}, "CKPTFS_SLURM_STORE is not set ("),
    ({"CKPTFS_SLURM_STORE": "gs://b"}, "CKPTFS_SLURM_STORE must be s3://bucket[/prefix] or"),
    ({"CKPTFS_SLURM_MODE": "cluster"}, "CKPTFS_SLURM_MODE must be job or node, not 'cluster'"),
    ({"CKPTFS_SLURM_DRAIN_TIMEOUT": "10m"}, "CKPTFS_SLURM_DRAIN_TIMEOUT must be whole seconds"),
    ({"CKPTFS_BIN": "/nonexistent/ckptfs"}, "ckptfs not found (CKPTFS_BIN=/nonexistent/"),
    ({"MOUNT_ROOT": "/x"}, "line 3: expected CKPTFS_*=VALUE or AWS_*=VALUE, got 'MOUNT_ROOT=/x'"),
])
def test_prolog_on_a_bad_config_fails_with_one_line(node_root, change, why):
    node = Node(node_root, "s3://bucket/p", "")
    if "MOUNT_ROOT" in change:
        node.conf.write_text("# a typo\n\nMOUNT_ROOT=/x\n")
    else:
        node.write_conf(**change)
    res = node.run("prolog.sh", job_id())
    assert res.returncode == 1, res.stdout + res.stderr
    assert why in one_line(res.stderr) and one_line(res.stderr).startswith(
        "ckptfs-slurm prolog: "), res.stderr
    assert not (node.root / "ckpt").exists()  # nothing made before the config was whole


def test_prolog_whose_mount_fails_says_why_in_one_line(s3_node):
    """A store that cannot work (no such bucket): ckptfs's own one-line reason and exit code,
    no mount point left behind; the epilog of that job finds nothing to do."""
    node = s3_node
    node.write_conf(CKPTFS_SLURM_STORE="s3://no-such-bucket-here/p")
    job = job_id()
    res = node.run("prolog.sh", job)
    assert res.returncode == 1, res.stdout + res.stderr
    line = one_line(res.stderr)
    assert re.match(rf"ckptfs-slurm prolog: job {job}: mount of {node.mp(job)} failed "
                    r"\(ckptfs exit 7\): object store s3://no-such-bucket-here/p is unusable",
                    line), line
    assert not node.mp(job).exists()
    res = node.run("epilog.sh", job)
    assert res.returncode == 0 and res.stdout == "", res.stdout + res.stderr


def test_node_mode_one_mount_a_directory_per_user_kept_across_jobs(s3_node):
    node = s3_node
    node.write_conf(CKPTFS_SLURM_MODE="node")
    mp = node.root / "ckpt"
    node.mounted.append(mp)
    a, b = job_id(), job_id()
    for job in (a, b):
        res = node.run("prolog.sh", job)
        assert res.returncode == 0, res.stderr
    with open("/proc/self/mountinfo") as f:
        assert sum(ln.split()[4] == str(mp) for ln in f) == 1
    userdir = mp / "nobody"
    st = os.stat(userdir)
    assert (st.st_uid, st.st_mode & 0o777) == (JOB_UID, 0o700)
    assert save(node, userdir, b"node mode").returncode == 0
    res = node.run("epilog.sh", a)
    assert res.returncode == 0, res.stdout + res.stderr
    assert one_line(res.stdout) == (f"ckptfs-slurm epilog: job {a}: every set under {userdir} "
                                    f"durable in {node.settings['CKPTFS_SLURM_STORE']}")
    assert is_mounted(mp)  # the node's mount stays for the next jobs
    assert "ckpt/manifests/nobody/run/step_1.pt.json" in s3_keys(node)


def test_example_config_is_read_as_documented():
    """deploy/slurm/slurm.conf.example through the scripts' own reader: the paths of a job in
    job mode (the environment's CKPTFS_BIN wins over the file's)."""
    script = (f'. {SLURM}/ckptfs-slurm.sh; load_config; job_paths; '
              'echo "$MP $CACHE $LOG $CKPTFS_SLURM_STORE $CKPTFS_SLURM_DRAIN_TIMEOUT '
              '$CKPTFS_SLURM_OPTIONS"')
    env = {"PATH": os.environ["PATH"], "CKPTFS_SLURM_CONF": str(SLURM / "slurm.conf.example"),
           "CKPTFS_BIN": str(VENV_BIN / "ckptfs"), "SLURM_JOB_ID": "42"}
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["/ckpt/42", "/nvme/ckptfs/job-42",
                                  "/var/log/ckptfs/job-42.log", "s3://my-bucket/checkpoints",
                                  "600", "--s3-region", "us-east-1", "--cache-size", "400G"]


# --- peers (README.md here, "Peers") -----------------------------------------------------------

PEER_HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # loopback: the job's three "nodes"


def free_port() -> int:
    """A port nobody on this host listens on now (the kernel's choice), for the peer server."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def peer_secret(node: Node) -> tuple[Path, str]:
    """The shared secret file as an admin deploys it: root's, 0600."""
    secret = secrets.token_hex(32)
    f = node.root / "peer.secret"
    f.write_text(secret + "\n")
    f.chmod(0o600)
    return f, secret


def daemon_argv(mp: Path) -> tuple[dict, list[str]]:
    """`ckptfs status --json` of the mount, and its daemon's command line."""
    res = subprocess.run([str(VENV_BIN / "ckptfs"), "status", str(mp), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    with open(f"/proc/{int(st['pid'])}/cmdline", "rb") as f:
        return st, f.read().decode().split("\0")[:-1]


def option(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def test_prolog_with_peer_keys_mounts_with_peers_seeded_by_the_jobs_nodes(s3_node):
    """CKPTFS_SLURM_PEER_*: the daemon runs with --peers, listens on the job's port, and has
    every node of the job (scontrol show hostnames) as a seed at that port; the secret is
    passed by its path only. The epilog drains and unmounts as without peers."""
    node = s3_node
    port = free_port()
    secret_file, secret = peer_secret(node)
    node.hostnames.write_text("\n".join(PEER_HOSTS) + "\n")
    # PEER_PORTS=1: the job's port is PEER_PORT + id % 1, exactly the free port
    node.write_conf(CKPTFS_SLURM_PEER_SECRET=str(secret_file), CKPTFS_SLURM_PEER_PORT=str(port),
                    CKPTFS_SLURM_PEER_PORTS="1", CKPTFS_SLURM_PEER_ADDRESS="127.0.0.1",
                    CKPTFS_SLURM_PEER_REPLICAS="2")
    job = job_id()
    res = node.run("prolog.sh", job, SLURM_JOB_NODELIST="node[1-3]")
    assert res.returncode == 0, res.stdout + res.stderr
    mp = node.mp(job)
    assert one_line(res.stdout).startswith(f"ckptfs-slurm prolog: job {job}: mounted {mp} ")
    assert one_line(node.scontrol_log.read_text()) == "show hostnames node[1-3]"

    st, argv = daemon_argv(mp)
    peers = st["tiering"]["peers"]
    assert peers is not None and peers["server"] is not None, st["tiering"]
    assert peers["server"]["endpoint"].endswith(f":{port}"), peers["server"]
    assert "--peers" in argv, argv
    assert option(argv, "--peer-seeds").split(",") == [f"{h}:{port}" for h in PEER_HOSTS]
    assert option(argv, "--peer-listen") == f"0.0.0.0:{port}"
    assert option(argv, "--peer-secret-file") == str(secret_file)
    assert option(argv, "--peer-address") == "127.0.0.1"
    assert option(argv, "--replicas") == "2"
    assert "--allow-empty-namespace" not in argv  # not asked for
    assert secret not in "\0".join(argv)
    assert secret not in (node.root / "log" / f"job-{job}.log").read_text()

    assert save(node, mp, b"with peers").returncode == 0
    res = node.run("epilog.sh", job, SLURM_JOB_NODELIST="node[1-3]")
    assert res.returncode == 0, res.stdout + res.stderr
    assert one_line(res.stdout) == (f"ckptfs-slurm epilog: job {job}: every set durable in "
                                    f"{node.settings['CKPTFS_SLURM_STORE']}; unmounted {mp}")
    assert not is_mounted(mp) and not node.cache(job).exists()
    assert "ckpt/manifests/run/step_1.pt.json" in s3_keys(node)


def test_allow_empty_namespace_key_adds_the_flag(s3_node):
    """CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE=1 (with peers): the mount has --allow-empty-namespace;
    in node mode the port is CKPTFS_SLURM_PEER_PORT itself, whatever the job id."""
    node = s3_node
    port = free_port()
    secret_file, _ = peer_secret(node)
    node.hostnames.write_text("127.0.0.1\n")
    node.write_conf(CKPTFS_SLURM_MODE="node", CKPTFS_SLURM_PEER_SECRET=str(secret_file),
                    CKPTFS_SLURM_PEER_PORT=str(port), CKPTFS_SLURM_PEER_ADDRESS="127.0.0.1",
                    CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE="1")
    mp = node.root / "ckpt"
    node.mounted.append(mp)
    res = node.run("prolog.sh", job_id(), SLURM_JOB_NODELIST="node1")
    assert res.returncode == 0, res.stdout + res.stderr
    _, argv = daemon_argv(mp)
    assert "--allow-empty-namespace" in argv and "--replicas" not in argv, argv
    assert option(argv, "--peer-seeds") == f"127.0.0.1:{port}"


@pytest.mark.parametrize("change,why", [
    ({"CKPTFS_SLURM_PEER_PORT": "seventy"},
     "CKPTFS_SLURM_PEER_PORT must be a number from 1 to 65535, not 'seventy'"),
    ({"CKPTFS_SLURM_PEER_PORT": "70000"},
     "CKPTFS_SLURM_PEER_PORT must be a number from 1 to 65535, not '70000'"),
    ({"CKPTFS_SLURM_PEER_PORT": "0"},
     "CKPTFS_SLURM_PEER_PORT must be a number from 1 to 65535, not '0'"),
    ({"CKPTFS_SLURM_PEER_PORTS": "-3"},
     "CKPTFS_SLURM_PEER_PORTS must be a number from 1 to 65535, not '-3'"),
    ({"CKPTFS_SLURM_PEER_PORT": "65000"},  # + 1000 ports: some jobs would get 65536 and up
     "CKPTFS_SLURM_PEER_PORT + CKPTFS_SLURM_PEER_PORTS - 1 must be at most 65535, not 65999"),
    ({"CKPTFS_SLURM_PEER_REPLICAS": "many"},
     "CKPTFS_SLURM_PEER_REPLICAS must be a number from 0 to 16, not 'many'"),
    ({"CKPTFS_SLURM_PEER_SECRET": "peer.secret"},
     "CKPTFS_SLURM_PEER_SECRET must be an absolute path, not 'peer.secret'"),
    ({"CKPTFS_SLURM_PEER_SECRET": "/nonexistent/peer.secret"},
     "peer secret /nonexistent/peer.secret (CKPTFS_SLURM_PEER_SECRET) is not a readable file"),
    ({"CKPTFS_SLURM_PEER_SECRET": "", "CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE": "1"},
     "CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE=1 needs peers (CKPTFS_SLURM_PEER_SECRET)"),
    ({"CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE": "yes"},
     "CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE must be 0 or 1, not 'yes'"),
    ({"CKPTFS_SLURM_OPTIONS": "--peers --peer-seeds x:1"},
     "CKPTFS_SLURM_OPTIONS may not hold --peer*, --replicas or --allow-empty-namespace"),
])
def test_prolog_on_bad_peer_settings_fails_with_one_line(node_root, change, why):
    node = Node(node_root, "s3://bucket/p", "")
    secret_file, _ = peer_secret(node)
    node.hostnames.write_text("127.0.0.1\n")
    node.write_conf(**{"CKPTFS_SLURM_PEER_SECRET": str(secret_file), **change})
    res = node.run("prolog.sh", job_id(), SLURM_JOB_NODELIST="node1")
    assert res.returncode == 1, res.stdout + res.stderr
    line = one_line(res.stderr)
    assert why in line and line.startswith("ckptfs-slurm prolog: "), res.stderr
    assert not (node.root / "ckpt").exists()  # nothing made before the peers were known


@pytest.mark.parametrize("case", ["scontrol fails", "no node list"])
def test_prolog_that_cannot_name_the_jobs_nodes_fails_with_one_line(node_root, case):
    """The seeds are the job's nodes: scontrol failing, or no SLURM_JOB_NODELIST, fails the
    prolog (exit 1) in one line, before anything is mounted or made."""
    node = Node(node_root, "s3://bucket/p", "")
    secret_file, _ = peer_secret(node)
    node.write_conf(CKPTFS_SLURM_PEER_SECRET=str(secret_file))
    job = job_id()
    if case == "scontrol fails":
        node.scontrol_fails.touch()
        res = node.run("prolog.sh", job, SLURM_JOB_NODELIST="node[1-3]")
        why = (f"ckptfs-slurm prolog: job {job}: scontrol show hostnames 'node[1-3]' failed "
               "(exit 1): scontrol: error: Unable to contact slurm controller")
        assert one_line(node.scontrol_log.read_text()) == "show hostnames node[1-3]"
    else:
        res = node.run("prolog.sh", job)
        why = (f"ckptfs-slurm prolog: job {job}: SLURM_JOB_NODELIST is not set: the peers are "
               "the job's nodes")
    assert res.returncode == 1, res.stdout + res.stderr
    assert one_line(res.stderr) == why
    assert not (node.root / "ckpt").exists()


def test_example_config_peer_keys_give_the_documented_port():
    """slurm.conf.example's commented peer keys, uncommented: job 42 in job mode listens on
    CKPTFS_SLURM_PEER_PORT + 42 % CKPTFS_SLURM_PEER_PORTS."""
    text = (SLURM / "slurm.conf.example").read_text()
    peer_lines = [ln[1:] for ln in text.splitlines() if ln.startswith("#CKPTFS_SLURM_PEER_")]
    assert {ln.split("=")[0] for ln in peer_lines} >= {
        "CKPTFS_SLURM_PEER_SECRET", "CKPTFS_SLURM_PEER_PORT", "CKPTFS_SLURM_PEER_PORTS"}
    with tempfile.NamedTemporaryFile("w", suffix=".conf") as conf:
        conf.write(text + "\n".join(peer_lines) + "\n")
        conf.flush()
        env = {"PATH": os.environ["PATH"], "CKPTFS_SLURM_CONF": conf.name,
               "CKPTFS_BIN": str(VENV_BIN / "ckptfs")}
        out = {}
        for job in ("42", "1042", "999"):
            res = subprocess.run(
                ["bash", "-c", f'. {SLURM}/ckptfs-slurm.sh; load_config; echo "$PEER_PORT"'],
                capture_output=True, text=True, env={**env, "SLURM_JOB_ID": job}, timeout=60)
            assert res.returncode == 0, res.stderr
            out[job] = int(res.stdout)
    assert out == {"42": 7112, "1042": 7112, "999": 8069}


def test_a_job_of_more_nodes_than_ckptfs_takes_seeds_is_seeded_by_its_first_64(node_root):
    """ckptfs takes at most 64 --peer-seeds (one answering seed names the others): a job of
    70 nodes seeds every node's mount with the same first 64 of its node list."""
    node = Node(node_root, "s3://bucket/p", "")
    secret_file, _ = peer_secret(node)
    hosts = [f"gpu{i:03d}" for i in range(70)]
    node.hostnames.write_text("\n".join(hosts) + "\n")
    node.write_conf(CKPTFS_SLURM_PEER_SECRET=str(secret_file))
    script = (f'. {SLURM}/ckptfs-slurm.sh; load_config; peer_mount_args; '
              'printf "%s\\n" "${PEER_ARGS[@]}"')
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env=node.job_env("5", SLURM_JOB_NODELIST="gpu[000-069]"))
    assert res.returncode == 0, res.stderr
    argv = res.stdout.splitlines()
    assert option(argv, "--peer-seeds").split(",") == [f"{h}:7075" for h in hosts[:64]]


def test_two_jobs_on_one_port_the_second_prolog_fails_with_one_line(s3_node):
    """README "Peers", the port: jobs whose ports collide (here PEER_PORTS=1, so every job gets
    PEER_PORT): the second job's mount cannot bind, and its prolog fails in one line, exit 1,
    leaving the first job's mount alone."""
    node = s3_node
    port = free_port()
    secret_file, _ = peer_secret(node)
    node.hostnames.write_text("127.0.0.1\n")
    node.write_conf(CKPTFS_SLURM_PEER_SECRET=str(secret_file), CKPTFS_SLURM_PEER_PORT=str(port),
                    CKPTFS_SLURM_PEER_PORTS="1", CKPTFS_SLURM_PEER_ADDRESS="127.0.0.1")
    first, second = job_id(), job_id()
    res = node.run("prolog.sh", first, SLURM_JOB_NODELIST="node1")
    assert res.returncode == 0, res.stdout + res.stderr
    res = node.run("prolog.sh", second, SLURM_JOB_NODELIST="node1")
    assert res.returncode == 1, res.stdout + res.stderr
    line = one_line(res.stderr)
    assert line.startswith(f"ckptfs-slurm prolog: job {second}: mount of {node.mp(second)} "
                           "failed (ckptfs exit "), line
    assert str(port) in line, line
    assert not node.mp(second).exists() and is_mounted(node.mp(first))
