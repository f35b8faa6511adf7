"""`ckptfs mount --metrics [ADDR:]PORT` (ckptfs.metrics), from the scraper's side: real mounts
scraped over HTTP and parsed with prometheus_client's parser, the numbers checked against what
the test did. Uploads are held back with the suite's store gate (CKPTFS_FAULTS `hold`), so the
"data at risk" numbers are seen while a checkpoint is committed and not durable, and again once
`ckptfs wait` says it is. Also: a port in use fails the mount (exit 6) and leaves nothing behind,
no port without --metrics, the server closes at unmount. (Bad values, and the scrape's way to
the loop in process: tests/unit/test_metrics.py.)
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time

import pytest

from tests.conftest import hold_uploads, is_mounted, run_cli, wait_for
from tests.metrics_helpers import Scrape, fetch, scrape

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address hex, port) of the TCP sockets process `pid` listens on (/proc, no tools)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr, port = cols[1].split(":")
                    out.append((addr, int(port, 16)))
    return out


# ----------------------------------------------------------------------------------------------
# real mounts


def test_metrics_follow_a_checkpoint_until_durable(mount_factory, monkeypatch, tmp_path):
    import torch

    gate = tmp_path / "uploads-held"
    for k, v in hold_uploads(gate).items():  # the daemon inherits this at mount
        monkeypatch.setenv(k, v)
    port = free_port()
    m = mount_factory()
    m.start("--metrics", str(port))
    monkeypatch.delenv("CKPTFS_FAULTS")
    base = scrape(port)
    assert base.types["ckptfs_fuse_requests"] == "counter"
    assert base("ckptfs_sets", state="committed") + base("ckptfs_sets", state="uploading") == 0
    assert base("ckptfs_oldest_pending_set_age_seconds") == 0
    assert base("ckptfs_failed_sets") == base("ckptfs_failed_bytes") == 0
    assert base.types["ckptfs_failed_sets"] == base.types["ckptfs_failed_bytes"] == "gauge"
    assert base("process_resident_memory_bytes") > 0
    mode = m.status()["data_path"]["mode"]
    want = "passthrough" if mode == "passthrough" else "daemon"
    assert base("ckptfs_data_path", mode=want) == 1
    assert sum(base.get("ckptfs_data_path", mode=x) for x in ("passthrough", "daemon")) == 1

    # A scraper runs all along: every scrape answers and no counter ever goes back.
    scrapes: list[Scrape] = []
    failures: list[str] = []
    stop = threading.Event()

    def scraper():
        while not stop.is_set():
            code, text = fetch(port)
            if code != 200:
                failures.append(f"{code}: {text}")
            else:
                scrapes.append(Scrape(text))
            stop.wait(0.02)  # pacing, not waiting for anything

    t = threading.Thread(target=scraper)
    t.start()
    try:
        wait_for(lambda: scrapes or failures, what="a first scrape")
        n_before = len(scrapes)
        ckpt = m.path / "step_1.tmp"
        ckpt.mkdir()
        for rank in range(3):
            torch.save({"w": torch.randn(256, 1024 + rank), "step": 1}, ckpt / f"rank{rank}.pt")
        sizes = [os.stat(ckpt / f"rank{rank}.pt").st_size for rank in range(3)]
        total = sum(sizes)
        t_commit = time.time()
        os.rename(ckpt, m.path / "step_1")  # commits the directory as one set
        wait_for(lambda: len(scrapes) > n_before + 2 or failures,
                 what="scrapes while the checkpoint is written")

        # Committed, not durable: everything it holds is pending, and its age grows.
        def held():
            s = scrape(port)
            live = s("ckptfs_sets", state="committed") + s("ckptfs_sets", state="uploading")
            return s if live == 1 and s("ckptfs_pending_upload_files") == 3 else None

        during = wait_for(held, what="the set to show as pending")
        assert during("ckptfs_pending_upload_bytes") == total
        assert during("ckptfs_sets", state="durable") == 0
        age = during("ckptfs_oldest_pending_set_age_seconds")
        assert 0 < age <= time.time() - t_commit + 1
        wait_for(lambda: scrape(port)("ckptfs_oldest_pending_set_age_seconds") > age,
                 what="the oldest pending set's age to grow")
        assert during("ckptfs_upload_files_total", result="done") == \
            base("ckptfs_upload_files_total", result="done")
        # The FUSE requests the test made were counted.
        for op, n in (("mkdir", 1), ("create", 3), ("rename", 1), ("release", 3)):
            got = during("ckptfs_fuse_requests_total", op=op) - \
                base("ckptfs_fuse_requests_total", op=op)
            assert got >= n, (op, got)
        if want == "daemon":  # with passthrough the kernel wrote the cache files itself
            assert during("ckptfs_fuse_bytes_total", op="write") - \
                base("ckptfs_fuse_bytes_total", op="write") == total

        gate.unlink()  # the store answers again
        res = run_cli("wait", str(m.path / "step_1"), "--timeout", "120")
        assert res.returncode == 0, res.stderr
        after = scrape(port)
    finally:
        stop.set()
        t.join(60)
    assert not failures, failures
    assert after("ckptfs_sets", state="durable") == 1
    assert after("ckptfs_sets", state="committed") + after("ckptfs_sets", state="uploading") == 0
    assert after("ckptfs_pending_upload_files") == 0
    assert after("ckptfs_pending_upload_bytes") == 0
    assert after("ckptfs_oldest_pending_set_age_seconds") == 0
    assert after("ckptfs_failed_sets") == during("ckptfs_failed_sets") == 0
    assert after("ckptfs_upload_bytes_total") - base("ckptfs_upload_bytes_total") >= total
    assert after("ckptfs_upload_files_total", result="done") - \
        base("ckptfs_upload_files_total", result="done") >= 3
    assert after("ckptfs_store_requests_total", op="put") > base.get(
        "ckptfs_store_requests_total", op="put")
    assert after("ckptfs_store_health", state="normal") == 1
    for seq in ([base, *scrapes], [base, during, after]):  # each in the order taken
        for a, b in itertools.pairwise(seq):
            for key, v in a.counters().items():
                assert b.samples.get(key, v) >= v, key

    m.stop()
    with pytest.raises(OSError):  # the server closed with the mount
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    assert not m.unexpected_errors()


def test_port_in_use_fails_the_mount_then_bytes_evictions_restores_count(mount_factory):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    m = mount_factory()
    try:
        res = m.start("--no-passthrough", "--metrics", str(busy), check=False)
    finally:
        taken.close()
    assert res.returncode == 6, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: "), res.stderr
    assert f"127.0.0.1:{busy}" in lines[0] and "cannot listen" in lines[0], lines
    assert not is_mounted(m.path)

    # Nothing was left behind: the same cache dir mounts at once on a free port, loopback only.
    # --keep-local 0: a durable set's data leaves the cache (an eviction) and is read back.
    port = free_port()
    m.start("--no-passthrough", "--keep-local", "0", "--metrics", str(port))
    assert listening_sockets(m.pid) == [("0100007F", port)]  # 127.0.0.1, little-endian hex
    base = scrape(port)
    assert base("ckptfs_data_path", mode="daemon") == 1
    assert base("ckptfs_data_path", mode="passthrough") == 0
    data = os.urandom(3 * MiB + 123)
    (m.path / "f.bin").write_bytes(data)
    res = run_cli("wait", str(m.path / "f.bin"), "--timeout", "120")
    assert res.returncode == 0, res.stderr
    evicted = scrape(port)
    assert evicted("ckptfs_cache_evictions_total") - base("ckptfs_cache_evictions_total") == 1
    assert evicted("ckptfs_cache_evicted_bytes_total") - \
        base("ckptfs_cache_evicted_bytes_total") == len(data)
    assert evicted("ckptfs_cache_data_bytes") == base("ckptfs_cache_data_bytes")
    assert (m.path / "f.bin").read_bytes() == data
    s = scrape(port)
    assert s("ckptfs_restore_bytes_total") - base("ckptfs_restore_bytes_total") >= len(data)
    assert s("ckptfs_restore_chunks_total") > base("ckptfs_restore_chunks_total")
    assert s("ckptfs_store_requests_total", op="get") > base.get("ckptfs_store_requests_total",
                                                                  op="get")
    assert s("ckptfs_fuse_bytes_total", op="write") - \
        base("ckptfs_fuse_bytes_total", op="write") == len(data)
    assert s("ckptfs_fuse_bytes_total", op="read") - \
        base("ckptfs_fuse_bytes_total", op="read") == len(data)
    assert s("ckptfs_fuse_requests_total", op="write") > base("ckptfs_fuse_requests_total",
                                                              op="write")
    assert s("ckptfs_fuse_requests_total", op="read") > base("ckptfs_fuse_requests_total",
                                                             op="read")
    assert fetch(port, "/")[0] == 404
    m.stop()
    assert not m.unexpected_errors()


def test_no_metrics_port_unless_asked(mount_factory):
    m = mount_factory()
    m.start()
    assert listening_sockets(m.pid) == []
    m.stop()
