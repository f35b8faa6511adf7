"""`ckptfs status`: the control socket answers, and the data path counters prove that large
writes reach the daemon as large requests (direct_io; not split into 4 KiB pages) when the
daemon serves file data. A set the store refuses for good is at risk (status, plain and
--json, the metrics, `ckptfs wait`, `ckptfs umount`) until a new commit of its path is
durable."""

import json
import os
import socket
import urllib.request

from conftest import run_cli, wait_for

from ckptfs.mount import EXIT_ERROR, EXIT_OK
from tests.faultproxy import FaultProxy, Rule


def status(m) -> dict:
    res = run_cli("status", str(m.path), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_large_writes_reach_the_daemon(mount_factory):
    # The daemon's own data path (with passthrough the kernel writes the cache file directly:
    # tests/test_passthrough.py).
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
    human = run_cli("status", str(mnt.path))
    assert human.returncode == 0 and "1 files" in human.stdout


def test_status_of_unmounted_path_fails_with_code_3(tmp_path):
    res = run_cli("status", str(tmp_path))
    assert res.returncode == 3
    assert res.stderr.startswith("ckptfs: ") and len(res.stderr.strip().splitlines()) == 1


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


def _at_risk(text: str) -> list[str]:
    """The "at risk" line of a plain status page and the lines under it that belong to it."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("at risk "))
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
