"""The crash and store-fault suite (docs/RELIABILITY.md).

  * tests/faultproxy.py, the fault-injecting S3 proxy, on its own: every mode seen by boto3
    against moto_server, run-time switching (in process and over its control endpoint), holds.
  * a short pass of scripts/fault_loop.py with fixed seeds: every fault kind at least once,
    every check after every iteration. A violation fails the test with the loop's one-line
    reason and its replay command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import boto3
import botocore.config
import botocore.exceptions
import pytest

from tests.conftest import REPO, require_fuse
from tests.faultproxy import FaultProxy, Rule, classify

# ----------------------------------------------------------------------------------------------
# the proxy


@pytest.fixture
def proxied(s3_endpoint):
    """(proxy, boto3 client through it, bucket): no botocore retries, short timeouts."""
    proxy = FaultProxy(s3_endpoint, seed=1).start()
    cfg = botocore.config.Config(retries={"total_max_attempts": 1, "mode": "standard"},
                                 s3={"addressing_style": "path"}, read_timeout=5,
                                 connect_timeout=5)
    s3 = boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1", config=cfg)
    bucket = f"fp-{time.monotonic_ns()}"
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="data/x", Body=b"0123456789" * 10000)
    try:
        yield proxy, s3, bucket
    finally:
        proxy.stop()


def test_classify_s3_operations():
    assert classify("GET", "/b/data/x") == ("get", "data/x")
    assert classify("GET", "/b?list-type=2&prefix=manifests%2F") == ("list", "manifests/")
    assert classify("PUT", "/b/k?partNumber=2&uploadId=u") == ("upload_part", "k")
    assert classify("POST", "/b/k?uploads") == ("create_multipart", "k")
    assert classify("POST", "/b/k?uploadId=u") == ("complete_multipart", "k")
    assert classify("DELETE", "/b/k?uploadId=u") == ("abort_multipart", "k")
    assert classify("DELETE", "/b/manifests/a.json") == ("delete", "manifests/a.json")
    assert classify("HEAD", "/b/k") == ("head", "k")
    with pytest.raises(ValueError):
        Rule("explode")


def test_proxy_passes_requests_through(proxied):
    proxy, s3, bucket = proxied
    body = s3.get_object(Bucket=bucket, Key="data/x")["Body"].read()
    assert body == b"0123456789" * 10000
    assert s3.head_object(Bucket=bucket, Key="data/x")["ContentLength"] == 100000
    r = s3.get_object(Bucket=bucket, Key="data/x", Range="bytes=10-19")["Body"].read()
    assert r == b"0123456789"
    # multipart through the proxy
    up = s3.create_multipart_upload(Bucket=bucket, Key="mp")["UploadId"]
    e1 = s3.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=1,
                        Body=b"a" * (5 << 20))["ETag"]
    s3.complete_multipart_upload(Bucket=bucket, Key="mp", UploadId=up,
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e1}]})
    assert s3.head_object(Bucket=bucket, Key="mp")["ContentLength"] == 5 << 20
    assert proxy.snapshot()["stats"]["requests"] >= 7


@pytest.mark.parametrize("mode,code,status", [("error500", "InternalError", 500),
                                              ("error503", "ServiceUnavailable", 503),
                                              ("slowdown", "SlowDown", 503),
                                              ("error403", "AccessDenied", 403)])
def test_error_modes_answer_s3_xml_errors(proxied, mode, code, status):
    proxy, s3, bucket = proxied
    proxy.set_rules([Rule(mode, ops={"put"}, times=1)])
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key="data/y", Body=b"y")
    assert e.value.response["Error"]["Code"] == code
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert "data/y" not in keys  # not forwarded
    s3.put_object(Bucket=bucket, Key="data/y", Body=b"y")   # times=1: the next one passes
    assert proxy.snapshot()["stats"][mode] == 1


def test_connection_faults(proxied):
    proxy, s3, bucket = proxied
    conn_errors = (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)
    for mode in ("reset", "truncate", "hangup", "lost_reply"):
        proxy.set_rules([Rule(mode, ops={"get"})])
        with pytest.raises(conn_errors):
            s3.get_object(Bucket=bucket, Key="data/x")["Body"].read()
    # a reset mid request body: the PUT does not reach the store
    proxy.set_rules([Rule("reset", ops={"put"})])
    with pytest.raises(conn_errors):
        s3.put_object(Bucket=bucket, Key="data/reset", Body=b"z" * 100000)
    # lost_reply: the store applied the PUT, the client never heard
    proxy.set_rules([Rule("lost_reply", ops={"put"})])
    with pytest.raises(conn_errors):
        s3.put_object(Bucket=bucket, Key="data/lost", Body=b"l")
    proxy.clear()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert "data/lost" in keys and "data/reset" not in keys
    st = proxy.snapshot()["stats"]
    assert st["reset"] == 2 and st["truncate"] == 1 and st["hangup"] == 1
    assert st["lost_reply"] == 2


def test_slow_and_stall_delay_but_deliver(proxied):
    proxy, s3, bucket = proxied
    for mode in ("slow", "stall"):
        proxy.set_rules([Rule(mode, ops={"get"}, delay=0.6)])
        t0 = time.monotonic()
        assert s3.get_object(Bucket=bucket, Key="data/x")["Body"].read() == \
            b"0123456789" * 10000
        assert time.monotonic() - t0 >= 0.5, mode


def test_outage_and_key_filters(proxied):
    proxy, s3, bucket = proxied
    conn_errors = (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)
    proxy.outage(1.0)
    with pytest.raises(conn_errors):
        s3.list_objects_v2(Bucket=bucket)
    t0 = time.monotonic()
    while True:  # the outage ends by itself
        try:
            s3.list_objects_v2(Bucket=bucket)
            break
        except conn_errors:
            assert time.monotonic() - t0 < 5, "outage did not end"
    # rules filter on the key and count hits
    proxy.set_rules([Rule("error503", key=r"^manifests/")])
    s3.put_object(Bucket=bucket, Key="data/ok", Body=b"1")
    with pytest.raises(botocore.exceptions.ClientError):
        s3.put_object(Bucket=bucket, Key="manifests/m.json", Body=b"{}")
    assert proxy.rules()[0].hits == 1


def test_hold_and_release(proxied):
    proxy, s3, bucket = proxied
    proxy.set_rules([Rule("hold", ops={"put"}, key=r"^manifests/", delay=30)])
    errors = []

    def put(key):
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=b"{}")
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    t = threading.Thread(target=put, args=("manifests/a.json",))
    t.start()
    assert proxy.wait_held(1, timeout=10)
    assert proxy.release(forward=True) == 1
    t.join(10)
    assert not errors
    t = threading.Thread(target=put, args=("manifests/b.json",))
    t.start()
    assert proxy.wait_held(1, timeout=10)
    proxy.release(forward=False)   # dropped: closed unanswered, never applied
    t.join(10)
    assert len(errors) == 1
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert "manifests/a.json" in keys and "manifests/b.json" not in keys


def test_control_endpoint(proxied):
    proxy, s3, bucket = proxied

    def call(method, what, body=None):
        req = urllib.request.Request(proxy.url + "/__faultproxy__/" + what, method=method,
                                     data=None if body is None else json.dumps(body).encode())
        return json.loads(urllib.request.urlopen(req, timeout=5).read())
    call("POST", "rules", [{"mode": "slowdown", "ops": ["head"]}])
    with pytest.raises(botocore.exceptions.ClientError):
        s3.head_object(Bucket=bucket, Key="data/x")
    st = call("GET", "stats")
    assert st["stats"]["slowdown"] == 1 and st["rules"][0]["mode"] == "slowdown"
    call("DELETE", "rules")
    s3.head_object(Bucket=bucket, Key="data/x")
    assert call("GET", "stats")["rules"] == []


# ----------------------------------------------------------------------------------------------
# the loop: a short pass with fixed seeds


def run_loop(tmp_path, seed: int, iterations: int, faults: str, timeout: float = 600,
             extra: tuple[str, ...] = ()):
    require_fuse()
    if os.geteuid() != 0:
        pytest.skip("the fault loop needs root (FUSE, tmpfs)")
    report = tmp_path / "report.json"
    cmd = [sys.executable, "scripts/fault_loop.py", "--seed", str(seed), "--iterations",
           str(iterations), "--faults", faults, "--report", str(report),
           "--workdir", str(tmp_path), "--keep-workdir", *extra]  # logs stay for a post-mortem
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()   # the loop tears down what it started on SIGTERM
        out, _ = proc.communicate(timeout=180)
        pytest.fail(f"the fault loop (seed {seed}) ran past {timeout}s:\n{out[-3000:]}")
    lines = [ln for ln in out.splitlines() if ln.startswith(("VIOLATION", "replay:",
                                                             "fault loop"))]
    if proc.returncode != 0:
        pytest.fail("\n".join(lines) + "\n--- the loop's output ends ---\n" + out[-6000:],
                    pytrace=False)
    rep = json.loads(report.read_text())
    assert rep["result"] == "ok"
    return rep


@pytest.mark.slow  # tens of seconds: not in scripts/test.sh --quick
def test_fault_loop_kills(tmp_path):
    """Every kill -9 moment, of the trainer and of a daemon, once."""
    rep = run_loop(tmp_path, seed=1001, iterations=8, faults="kill")
    assert {r["fault"] for r in rep["iterations"]} == {
        "kill_trainer_writing", "kill_trainer_committed", "kill_trainer_deleting",
        "kill_daemon_writing", "kill_daemon_committed", "kill_daemon_uploading",
        "kill_daemon_publishing", "kill_daemon_deleting"}


@pytest.mark.slow  # tens of seconds: not in scripts/test.sh --quick
def test_fault_loop_store_and_disk(tmp_path):
    """Every store fault at the proxy, and a full cache disk, once."""
    rep = run_loop(tmp_path, seed=2002, iterations=8, faults="store,disk")
    assert {r["fault"] for r in rep["iterations"]} == {
        "store_error", "store_reset", "store_truncate", "store_hangup", "store_slow",
        "store_outage", "store_blackhole", "disk_full"}
    # the report counts the black hole's held requests with the other modes
    assert rep["injected"].get("blackhole", 0) + rep["injected"].get("oneway", 0) >= 1


@pytest.mark.slow  # tens of seconds: not in scripts/test.sh --quick
def test_fault_loop_peers(tmp_path):
    """Both nodes with --peers, each peer server behind a fault proxy: a peer that hangs
    (blackhole, oneway) while node b and a fresh node read, a daemon killed after a commit
    (its buddy holds the replica), the store a black hole with peers to fall back on."""
    rep = run_loop(tmp_path, seed=3003, iterations=3,
                   faults="peer,kill_daemon_committed,store_blackhole", extra=("--peers",))
    its = {r["fault"]: r for r in rep["iterations"]}
    assert set(its) == {"peer_blackhole", "kill_daemon_committed", "store_blackhole"}
    # the peer fault hung requests at a peer's proxy, and a fresh node read through it all
    hung = its["peer_blackhole"]
    assert rep["injected"].get("peer_blackhole", 0) + rep["injected"].get("peer_oneway", 0) >= 1
    assert hung["peer_read"]["files"] >= 1, hung


# ----------------------------------------------------------------------------------------------
# the loop's own machinery (no mounts): schedule, tree diff, log scan


def _loop(seed: int, faults: str = "all", workloads: str = "torch,dcp1,dcp2,rotate"):
    import argparse

    import fault_loop as fl

    a = argparse.Namespace(seed=seed, faults=fl.parse_list(faults, fl.FAULTS, fl.FAULT_GROUPS),
                           workloads=fl.parse_list(workloads, fl.WORKLOADS))
    return fl.Loop(a)


def test_schedule_covers_every_fault_and_replays():
    import fault_loop as fl

    loop = _loop(7)
    first = [loop.schedule(i)[:2] for i in range(len(fl.FAULTS))]
    assert {f for f, _ in first} == set(fl.FAULTS)             # one cycle: every fault once
    assert all(w == "rotate" for f, w in first if f.endswith("_deleting"))
    assert {w for _, w in first} == set(fl.WORKLOADS)
    again = _loop(7)
    assert [again.schedule(i)[:2] for i in range(40)] == \
        [loop.schedule(i)[:2] for i in range(40)]              # the seed replays
    assert [loop.schedule(i)[2].random() for i in range(3)] == \
        [again.schedule(i)[2].random() for i in range(3)]
    assert [_loop(8).schedule(i)[:2] for i in range(15)] != first
    sub = _loop(7, faults="store,disk_full")
    assert {sub.schedule(i)[0] for i in range(8)} == set(fl.FAULT_GROUPS["store"]) | {"disk_full"}
    with pytest.raises(argparse.ArgumentTypeError):
        fl.parse_list("kill,nonsense", fl.FAULTS, fl.FAULT_GROUPS)


def test_fresh_mount_diff_names_what_is_wrong():
    import fault_loop as fl

    ms = {
        "ckpt/dcp_1": {"kind": "dir", "files": [{"path": ".metadata", "size": 10},
                                                {"path": "__0_0.distcp", "size": 100}],
                       "symlinks": []},
        "ckpt/step_1.pt": {"kind": "file", "files": [{"path": "", "size": 7}]},
        "ckpt/latest": {"kind": "symlink", "target": "step_1.pt", "files": []},
    }
    want = fl.expected_tree(ms)
    assert want == {"ckpt/dcp_1/.metadata": ("f", 10), "ckpt/dcp_1/__0_0.distcp": ("f", 100),
                    "ckpt/step_1.pt": ("f", 7), "ckpt/latest": ("l", "step_1.pt")}
    assert fl.diff_trees(want, dict(want), ms) == ""
    have = {"ckpt/dcp_1/.metadata": ("f", 10), "ckpt/step_1.pt": ("f", 8),
            "ckpt/junk.tmp": ("f", 1)}
    d = fl.diff_trees(want, have, ms)
    assert "shows 1 of 3 published sets whole" in d
    assert "absent: ['ckpt/latest']" in d
    assert "ckpt/dcp_1 lacks ['__0_0.distcp']" in d
    assert "not published but shown: ['ckpt/junk.tmp']" in d
    assert "ckpt/step_1.pt is ('f', 8), published ('f', 7)" in d


def test_log_scan_and_exception_lines(tmp_path):
    import fault_loop as fl

    log = tmp_path / "d.log"
    log.write_text("2026-01-01 10:00:00,000 42 INFO x: fine\n"
                   "2026-01-01 10:00:01,000 42 ERROR ckptfs.fuse: flush(1,) failed: unexpected\n"
                   "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                   "sqlite3.OperationalError: database or disk is full\n"
                   "2026-01-01 10:00:02,000 42 INFO x: later\n")
    assert fl.log_tracebacks(log) == [
        ("ERROR ckptfs.fuse: flush(1,) failed: unexpected | "
         "sqlite3.OperationalError: database or disk is full")]
    assert fl.log_tracebacks(tmp_path / "none.log") == []
    e = RuntimeError("rank 0:\nTraceback ...\nFileNotFoundError: [Errno 2] gone: 'x'\n")
    assert fl.short_exc(e) == "RuntimeError: FileNotFoundError: [Errno 2] gone: 'x'"


def test_loop_reads_each_logged_stall_once_with_its_cause_and_the_loop_s_dumped_stack(tmp_path):
    import fault_loop as fl

    n = fl.Node("a", tmp_path, tmp_path / "cache", [])
    assert n.new_stalls() == []      # no log yet
    n.log_file.write_text(
        "2026-01-01 10:00:00,000 42 INFO ckptfs.stallwatch: stall watchdog: loop thread "
        "0x7f00000000aa, a stall is 1.0s without a turn, every thread's stack dumped after 1.0s\n"
        "2026-01-01 10:00:01,000 42 WARNING x: event loop stalled: no turn for 1.1s\n"
        "Timeout (0:00:01)!\n"
        "Thread 0x00007f00000000bb (most recent call first):\n"
        "  File \"/x/threading.py\", line 331 in wait\n\n"
        "Thread 0x00007f00000000aa (most recent call first):\n"
        "  File \"/x/ckptfs/y.py\", line 7 in checksum_on_the_loop\n\n"
        "2026-01-01 10:00:03,000 42 WARNING x: event loop ran again after a stall of 3.5s "
        "(cause busy: over the 3.9s since ...)\n")
    st = n.new_stalls()
    assert [(x["s"], x["cause"]) for x in st] == [(3.5, "busy")]
    assert st[0]["loop_stacks"] == [("Thread 0x00007f00000000aa (most recent call first):\n"
                                     "  File \"/x/ckptfs/y.py\", line 7 in checksum_on_the_loop")]
    with open(n.log_file, "a") as f:
        f.write("x event loop ran again after a stall of 31.0s\n"
                "Timeout (0:00:01)!\nThread 0x00007f00000000aa (most recent call first):\n"
                "  File \"/x/z.py\", line 1 in killed_during_it\n")
    assert [(x["s"], x["cause"]) for x in n.new_stalls()] == [(31.0, "?")]  # only the new
    assert n.new_stalls() == []
    assert "killed_during_it" in fl.unended_dumps(n.log_file)[0]
