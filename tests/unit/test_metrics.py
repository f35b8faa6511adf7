"""`ckptfs mount --metrics [ADDR:]PORT` (ckptfs.metrics), from the scraper's side: real mounts
scraped over HTTP and parsed with prometheus_client's parser, the numbers checked against what
the test did. Uploads are held back with the suite's store gate (CKPTFS_FAULTS `hold`), so the
"data at risk" numbers are seen while a checkpoint is committed and not durable, and again once
`ckptfs wait` says it is. Also: bad values exit 2, a port in use fails the mount (exit 6) and
leaves nothing behind, no port without --metrics, the server closes at unmount. In-process, in
addition: a busy or finished trio loop and a failing collector fail the scrape (503, one line,
logged once), never the loop.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import hold_uploads, is_mounted, run_cli, wait_for
from prometheus_client.parser import text_string_to_metric_families

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(port: int, path: str = "/metrics", host: str = "127.0.0.1") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


class Scrape:
    """One parsed scrape: samples by (name, labels)."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.types: dict[str, str] = {}
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            for s in fam.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def __call__(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]

    def get(self, name: str, default: float = 0.0, **labels: str) -> float:
        return self.samples.get((name, frozenset(labels.items())), default)

    def counters(self) -> dict[tuple[str, frozenset], float]:
        return {k: v for k, v in self.samples.items() if k[0].endswith("_total")}


def scrape(port: int) -> Scrape:
    code, text = fetch(port)
    assert code == 200, text
    return Scrape(text)


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


@pytest.mark.parametrize("value", ["abc", "0", "65536", "-1", "9100.5", ":9100",
                                   "1.2.3.999:9100", "[::1]9100", "[127.0.0.1]:9100",
                                   "example.com:9100", "127.0.0.1:"])
def test_bad_metrics_values_exit_2(tmp_path, value):
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = run_cli("mount", str(mp), "--cache-dir", str(tmp_path / "cache"),
                  f"--metrics={value}")
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: ") and "--metrics" in lines[0], \
        res.stderr
    assert not is_mounted(mp)


# ----------------------------------------------------------------------------------------------
# in-process, in addition: the scrape's way to the loop


class _Loop:
    """A real trio loop in a thread, holding its token; `block()` blocks the loop itself."""

    def __init__(self) -> None:
        import trio

        self.ready, self.release, self.blocked = (threading.Event(), threading.Event(),
                                                  threading.Event())
        self.calls = 0

        async def main():
            self.token = trio.lowlevel.current_trio_token()
            self.done = trio.Event()
            self.ready.set()
            await self.done.wait()

        self.thread = threading.Thread(target=trio.run, args=(main,))
        self.thread.start()
        assert self.ready.wait(30)

    def snapshot(self) -> dict:  # on the loop
        self.calls += 1
        return {"calls": self.calls}

    def block(self) -> None:
        def stuck():  # a loop busy in a long synchronous call
            self.blocked.set()
            self.release.wait(60)
        self.token.run_sync_soon(stuck)
        assert self.blocked.wait(30)

    def stop(self) -> None:
        self.release.set()
        self.token.run_sync_soon(self.done.set)
        self.thread.join(30)


def test_a_busy_or_finished_loop_fails_the_scrape_not_the_loop():
    from ckptfs.metrics import MAX_SNAPSHOTS_IN_FLIGHT, LoopSnapshots, ScrapeError

    loop = _Loop()
    try:
        snaps = LoopSnapshots(loop.token, loop.snapshot, timeout=0.5)
        assert snaps.get() == {"calls": 1}
        loop.block()
        with pytest.raises(ScrapeError, match="did not answer"):
            snaps.get()
        loop.release.set()
        # The abandoned request did nothing when the loop got to it; the next one is served.
        assert wait_for(lambda: snaps.get()) == {"calls": 2}

        # A flood: while the loop is busy, only MAX_SNAPSHOTS_IN_FLIGHT scrapes wait for it.
        loop.release.clear()
        loop.blocked.clear()
        loop.block()
        queued = []

        class Token:  # the loop's token, counting what is handed to the loop
            def run_sync_soon(self, fn):
                queued.append(fn)
                loop.token.run_sync_soon(fn)

        flood = LoopSnapshots(Token(), loop.snapshot, timeout=60)
        results = []
        waiting = [threading.Thread(target=lambda: results.append(flood.get()))
                   for _ in range(MAX_SNAPSHOTS_IN_FLIGHT)]
        for w in waiting:
            w.start()
        wait_for(lambda: len(queued) == MAX_SNAPSHOTS_IN_FLIGHT, what="the scrapes to queue")
        with pytest.raises(ScrapeError, match="already wait"):
            flood.get()
        assert len(queued) == MAX_SNAPSHOTS_IN_FLIGHT  # refused without reaching the loop
        loop.release.set()
        for w in waiting:
            w.join(60)
        n = MAX_SNAPSHOTS_IN_FLIGHT
        assert sorted(r["calls"] for r in results) == list(range(3, 3 + n))
        assert flood.get() == {"calls": 3 + n}
    finally:
        loop.stop()
    assert not loop.thread.is_alive()
    with pytest.raises(ScrapeError, match="stopped"):
        snaps.get()


def test_a_failing_collector_fails_the_scrape_once_logged(tmp_path, caplog):
    import ckptfs.metrics as metrics

    loop = _Loop()
    broken = {"on": True}

    def snap():  # on the loop: a bug, then a fixed one
        if broken["on"]:
            raise RuntimeError("boom")
        return {"io": {"reads": 0, "bytes_read": 0, "writes": 0, "bytes_written": 0},
                "cache": {"bytes": 5, "evictions": 0, "evicted_bytes": 0},
                "data_path": {"mode": "fuse"}, "fuse": {"requests": {"read": 1}, "errors": {}},
                "tiering": None, "now_ns": time.time_ns(), "took_s": 0.0}

    server = metrics.MetricsServer("127.0.0.1", 0, cache_dir=tmp_path, version="t")
    port = server.httpd.server_address[1]
    try:
        with pytest.raises(metrics.MetricsBindError, match="cannot listen") as e:
            metrics.MetricsServer("127.0.0.1", port, cache_dir=tmp_path, version="t")
        assert e.value.errno == errno.EADDRINUSE
        server.start(loop.token, snap)
        with caplog.at_level(logging.DEBUG, logger="ckptfs.metrics"):
            for _ in range(3):
                code, text = fetch(port)
                assert code == 503 and text.startswith("ckptfs: ") and \
                    len(text.strip().splitlines()) == 1, (code, text)
            warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warned) == 1 and "boom" in warned[0].getMessage() + str(
                warned[0].exc_info), warned
            broken["on"] = False
            s = scrape(port)
        assert s("ckptfs_cache_data_bytes") == 5
        assert s("ckptfs_data_path", mode="daemon") == 1
        assert s("ckptfs_fuse_requests_total", op="read") == 1
        assert loop.thread.is_alive()  # the loop never saw the error
    finally:
        server.close()
        loop.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_failed_sets_are_gauges_of_their_own(tmp_path):
    """ckptfs_failed_sets / ckptfs_failed_bytes carry the unresolved failed sets of the
    snapshot (Engine.statistics: those no later commit replaced), apart from
    ckptfs_sets{state="failed"}, which counts every set that ever failed. (A set the store
    refuses on a real mount: tests/test_status.py.)"""
    import ckptfs.metrics as metrics

    tiering = {
        "sets": {"by_state": {"durable": 3, "failed": 4}, "pending_files": 0,
                 "pending_bytes": 0, "oldest_live_committed_ns": None, "failed_sets": 2,
                 "failed_bytes": 12345, "unsaved_files": 3, "unsaved_bytes": 700,
                 "unsaved": ["a.tmp"], "handed_files": 0},
        "uploads": {"bytes": 0, "stored_bytes": 0, "parts": 0, "done": 0, "cancelled": 0,
                    "running": 0, "queued": 0},
        "restore": {"bytes": 0, "chunks": 0, "integrity_errors": 0, "damaged_cache_chunks": 0},
        "store": {"requests": {}, "retries": {}, "errors": {}, "health": "normal",
                  "consecutive_failures": 0},
        "cache_size": None,
    }
    snap = {"io": {"reads": 0, "bytes_read": 0, "writes": 0, "bytes_written": 0},
            "cache": {"bytes": 0, "evictions": 0, "evicted_bytes": 0},
            "data_path": {"mode": "passthrough"}, "fuse": {"requests": {}, "errors": {}},
            "tiering": tiering, "now_ns": time.time_ns(), "took_s": 0.0}
    fams = {f.name: f for f in metrics.families(snap, tmp_path)}
    for name, want in (("ckptfs_failed_sets", 2), ("ckptfs_failed_bytes", 12345),
                       ("ckptfs_unsaved_files", 3), ("ckptfs_unsaved_bytes", 700)):
        assert fams[name].type == "gauge"
        assert [(x.labels, x.value) for x in fams[name].samples] == [({}, want)]
    by_state = {x.labels["state"]: x.value for x in fams["ckptfs_sets"].samples}
    assert by_state["failed"] == 4 and by_state["committed"] == 0
    assert [x.value for x in fams["ckptfs_oldest_pending_set_age_seconds"].samples] == [0.0]
