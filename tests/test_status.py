"""`ckptfs status`: the control socket answers, and the data path counters prove that large
writes reach the daemon as large requests (direct_io; not split into 4 KiB pages) when the
daemon serves file data."""

import json
import os

from conftest import run_cli


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
