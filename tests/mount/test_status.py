"""`ckptfs status`: the control socket answers, and the data path counters prove that large
writes reach the daemon as large requests (direct_io; not split into 4 KiB pages) when the
daemon serves file data. A set the store refuses for good is at risk (status, plain and
--json, the metrics, `ckptfs wait`, `ckptfs umount`) until a new commit of its path is
durable. A set pending longer than the stuck threshold is named, with what it waits for,
whatever its position among the sets (status plain and --json, the metrics), until it is
durable. (The status of a path that is not mounted: tests/unit/test_status_unit.py.)"""

import os
import socket
import urllib.request

from ckptfs.mount import EXIT_ERROR, EXIT_OK
from tests.conftest import run_cli, wait_for
from tests.faultproxy import FaultProxy, Rule
from tests.status_helpers import status


def test_large_writes_reach_the_daemon(mount_factory):
    # The daemon's own data path (with passthrough the kernel writes the cache file directly:
    # tests/mount/test_passthrough.py).
    mnt = mount_factory()
    mnt.start("--no-passthrough")
    before = status(mnt)["io"]
    chunk = os.urandom(8 << 20)
    with open(mnt.path / "big.bin", "wb", buffering=0) as f:
        for _ in range(4):
            f.write(chunk)
    after = status(mnt)["io"]
    n = after["write_requests"] - before["write_requests"]
    nbytes = after["bytes_written"] - before["bytes_written"]
    assert nbytes == 32 << 20
    # 1 MiB is libfuse's cap; an unaligned user buffer costs at most one extra split per MiB.
    assert nbytes / n >= 512 << 10, f"{n} write requests for 32 MiB"


def test_status_reports_cache_contents(mnt):
    (mnt.path / "d").mkdir()
    (mnt.path / "d" / "f").write_bytes(b"x" * 1000)
    os.symlink("d/f", mnt.path / "latest")
    st = status(mnt)
    assert st["pid"] == mnt.pid
    assert st["cache"]["files"] == 1
    assert st["cache"]["dirs"] == 2  # root and d
    assert st["cache"]["symlinks"] == 1
    assert st["cache"]["bytes"] == 1000
    assert set(st["loop"]) == {"stalls", "longest_s", "stalled_now_s"}  # the stall watchdog runs
    human = run_cli("status", str(mnt.path))
    assert human.returncode == 0 and "1 files" in human.stdout


# ----------------------------------------------------------------------------------------------
# a set the store refuses for good


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _metrics(port: int) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(x.name, frozenset(x.labels.items())): x.value
            for fam in text_string_to_metric_families(text) for x in fam.samples}


def _at_risk(text: str, label: str = "at risk") -> list[str]:
    """The "at risk" line (or another row's) of a plain status page and the lines under it
    that belong to it."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(label + " "))
    out = [lines[i]]
    for ln in lines[i + 1:]:
        if not ln.startswith("  "):  # the next row of the summary
            break
        out.append(ln.strip())
    return out


def test_a_set_the_store_refuses_is_at_risk_until_saved_again(mount_factory, moto_server):
    """The store (S3 through the fault proxy) answers the manifest PUT of run/model.pt with
    403 AccessDenied: the set fails for good. Until a new save of the path is durable, status
    (--json and plain), the metrics, `ckptfs wait` on the file and on its directory, and
    `ckptfs umount` all say so, also after a remount; never "every committed set is
    durable"."""
    import boto3
    import torch

    bucket = f"refuse-{os.getpid()}-{_free_port()}"
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket=bucket)
    with FaultProxy(moto_server) as proxy:
        port = _free_port()
        m = mount_factory()
        m.start("--store", f"s3://{bucket}/p", "--s3-endpoint", proxy.url, "--s3-path-style",
                "--metrics", str(port))
        run = m.path / "run"
        run.mkdir()
        torch.save({"w": torch.ones(64)}, run / "other.pt")  # a durable neighbour
        assert run_cli("wait", str(run / "other.pt"), "--timeout", "60").returncode == EXIT_OK
        proxy.set_rules([Rule("error403", ops={"put"}, key=r"manifests/run/model\.pt\.json$")])
        torch.save({"w": torch.randn(256, 256)}, run / "model.pt")
        size = os.stat(run / "model.pt").st_size

        def failed():
            t = m.status()["tiering"]
            return t if t["failed_sets"] else None

        t = wait_for(failed, timeout=60, what="the set to fail")
        assert proxy.snapshot()["stats"]["error403"] >= 1
        assert t["failed_sets"] == 1 and t["failed_bytes"] == size, t
        assert t["pending_sets"] == 0 and t["pending_bytes"] == 0, t
        (f,) = t["failed"]
        assert f["path"] == "run/model.pt" and f["bytes"] == size, f
        assert f["error"].startswith("the store refused its manifest: AccessDenied"), f
        assert any(s["seq"] == f["seq"] and s["state"] == "failed" for s in t["sets"])

        def check_failed_everywhere() -> None:
            res = run_cli("status", str(m.path))
            assert res.returncode == EXIT_OK, res.stderr
            risk = _at_risk(res.stdout)
            assert "every committed set is durable" not in res.stdout, res.stdout
            assert "in 1 set FAILED, not in the store" in risk[0], risk
            assert risk[1].startswith("run/model.pt (the store refused its manifest: "
                                      "AccessDenied"), risk
            got = _metrics(port)
            assert got[("ckptfs_failed_sets", frozenset())] == 1
            assert got[("ckptfs_failed_bytes", frozenset())] == size
            assert got[("ckptfs_sets", frozenset({("state", "failed")}))] == 1
            # `ckptfs wait` on the file, and on its directory (not itself a set): exit 1
            for p in (run / "model.pt", run):
                res = run_cli("wait", str(p), "--timeout", "30")
                assert res.returncode == EXIT_ERROR, (p, res.returncode, res.stderr)
                line = res.stderr.strip()
                assert line.startswith("ckptfs: set run/model.pt is failed: the store refused"
                                       " its manifest: AccessDenied") and "\n" not in line, line

        check_failed_everywhere()
        # `ckptfs umount` does not pretend it is durable either; a remount still knows.
        res = run_cli("umount", str(m.path))
        assert res.returncode == EXIT_OK, res.stderr
        assert "1 set FAILED and not in the store, only in the cache: run/model.pt" in \
            res.stderr, res.stderr
        m.pid = None
        m.start()
        check_failed_everywhere()

        # The store takes it again: a new save of the path is durable, and nothing is at risk.
        proxy.clear()
        torch.save({"w": torch.randn(256, 256)}, run / "model.pt")
        res = run_cli("wait", str(run / "model.pt"), "--timeout", "60")
        assert res.returncode == EXIT_OK, res.stderr
        t = m.status()["tiering"]
        assert (t["failed_sets"], t["failed_bytes"], t["failed"]) == (0, 0, []), t
        res = run_cli("status", str(m.path))
        assert "0 B in 0 sets: every committed set is durable" in _at_risk(res.stdout)[0], \
            res.stdout
        got = _metrics(port)
        assert got[("ckptfs_failed_sets", frozenset())] == 0
        assert got[("ckptfs_failed_bytes", frozenset())] == 0
        assert got[("ckptfs_sets", frozenset({("state", "failed")}))] == 1  # its history
        res = run_cli("wait", str(run), "--timeout", "60")
        assert res.returncode == EXIT_OK and "2 sets durable" in res.stdout, res
        m.stop()
        assert not m.unexpected_errors()


# ----------------------------------------------------------------------------------------------
# a set pending longer than the stuck threshold


def test_a_set_pending_past_the_threshold_is_named_stuck(mount_factory, monkeypatch, tmp_path):
    """Uploads are held in the store (CKPTFS_FAULTS hold). --commit-timeout 4 makes the stuck
    threshold 1 s (a quarter of it; 120 s by default). old.pt is written, then churn.pt 55
    times (each commit supersedes the one before), so old.pt is not among the 50 sets status
    lists: status --json (tiering.stuck, stuck_sets), plain status (the "stuck" row) and the
    metrics (ckptfs_stuck_sets, ckptfs_stuck_set_age_seconds by path) still name it, with
    what it waits for (its upload, running), oldest first; churn.pt waits for it in commit
    order. Once the store takes the uploads, nothing is stuck any more."""
    gate = tmp_path / "uploads-held"
    gate.touch()
    monkeypatch.setenv("CKPTFS_FAULTS", f"put@data/=hold:{gate},create_multipart@data/=hold:"
                       f"{gate},upload_part@data/=hold:{gate}")
    port = _free_port()
    m = mount_factory()
    m.start("--commit-timeout", "4", "--metrics", str(port))
    monkeypatch.delenv("CKPTFS_FAULTS")
    got = _metrics(port)
    assert got[("ckptfs_stuck_sets", frozenset())] == 0
    assert got[("ckptfs_oldest_stuck_set_age_seconds", frozenset())] == 0
    assert got[("ckptfs_stuck_threshold_seconds", frozenset())] == 1.0
    t = status(m)["tiering"]
    assert (t["stuck_after_s"], t["stuck_sets"], t["stuck"]) == (1.0, 0, [])
    assert "\nstuck " not in run_cli("status", str(m.path)).stdout

    (m.path / "old.pt").write_bytes(os.urandom(300_000))
    for i in range(55):
        (m.path / "churn.pt").write_bytes(bytes([i]) * 1000)

    def both_stuck():
        t = status(m)["tiering"]
        return t if t["stuck_sets"] == 2 else None

    t = wait_for(both_stuck, timeout=60, what="both pending sets to be named stuck")
    assert t["pending_sets"] == 2
    assert "old.pt" not in [s["path"] for s in t["sets"]]  # older than the 50 listed
    old, churn = t["stuck"]  # oldest first
    assert (old["path"], old["state"], old["waits_for"]) == ("old.pt", "uploading", "uploads")
    assert old["age_s"] >= 1.0 and old["committed_ns"] == t["oldest_pending_committed_ns"]
    assert old["why"].startswith("1 of 1 file(s) not in the store yet (0 B of 293.0 KiB"
                                 " uploaded); upload queue: "), old
    assert churn["path"] == "churn.pt" and churn["waits_for"] in ("uploads", "commit_order")

    res = run_cli("status", str(m.path))
    assert res.returncode == EXIT_OK, res.stderr
    rows = _at_risk(res.stdout, "stuck")
    assert rows[0] == "stuck      2 sets pending longer than 1s, oldest first:", rows
    assert rows[1].startswith(f"set {old['seq']} old.pt (uploading "), rows
    assert ", uploads): 1 of 1 file(s) not in the store yet (0 B of 293.0 KiB uploaded)" \
        in rows[1], rows
    assert rows[2].startswith(f"set {churn['seq']} churn.pt ("), rows
    risk = _at_risk(res.stdout)[0]
    age = int(risk.split("the oldest committed ")[1].split("s ago")[0])
    assert age >= 1, risk  # old.pt's age, though it is not among the sets listed

    got = _metrics(port)
    assert got[("ckptfs_stuck_sets", frozenset())] == 2
    assert got[("ckptfs_oldest_stuck_set_age_seconds", frozenset())] >= 1
    named = {dict(labels)["path"]: (dict(labels), v) for (name, labels), v in got.items()
             if name == "ckptfs_stuck_set_age_seconds"}
    assert set(named) == {"old.pt", "churn.pt"}, named
    labels, age = named["old.pt"]
    assert labels == {"seq": str(old["seq"]), "path": "old.pt", "state": "uploading",
                      "waits_for": "uploads"} and age >= 1, named

    gate.unlink()  # the store takes the uploads
    for p in ("old.pt", "churn.pt"):
        res = run_cli("wait", str(m.path / p), "--timeout", "60")
        assert res.returncode == EXIT_OK, res.stderr
    t = status(m)["tiering"]
    assert (t["stuck_sets"], t["stuck"], t["oldest_pending_committed_ns"]) == (0, [], None)
    res = run_cli("status", str(m.path))
    assert "\nstuck " not in res.stdout and "every committed set is durable" in res.stdout
    got = _metrics(port)
    assert got[("ckptfs_stuck_sets", frozenset())] == 0
    assert not [k for k in got if k[0] == "ckptfs_stuck_set_age_seconds"]
    m.stop()
    assert not m.unexpected_errors()
