"""`ckptfs mount --metrics [ADDR:]PORT` (ckptfs.metrics) without a mount: bad values exit 2. In
process: a busy or finished trio loop and a failing collector fail the scrape (503, one line,
logged once), never the loop; failed sets are gauges of their own. (Real mounts scraped over
HTTP: tests/mount/test_metrics_mount.py.)
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import pytest

from tests.conftest import is_mounted, run_cli, wait_for
from tests.metrics_helpers import fetch, scrape

# ----------------------------------------------------------------------------------------------
# bad values


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
        return _snapshot(cached_bytes=5, mode="fuse", requests={"read": 1})

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


def _zero(cls, **kw):
    """A statistics dataclass with every field 0 but those in `kw`."""
    return cls(**dict.fromkeys(cls.__dataclass_fields__, 0) | kw)


def _snapshot(*, cached_bytes=0, mode="passthrough", requests=None, tiering=None):
    """A metrics snapshot (ckptfs.metrics.Snapshot) as the loop would take it."""
    import ckptfs.metrics as metrics
    from cachemgr.core.passthrough import BackingStats
    from ckptfs.fuse import RequestStats

    return metrics.Snapshot(
        reads=0, bytes_read=0, writes=0, bytes_written=0, cached_bytes=cached_bytes,
        evictions=0, evicted_bytes=0, data_path=_zero(BackingStats, mode=mode, off_reason=None),
        fuse=RequestStats(requests=requests or {}, errors={}), tiering=tiering,
        now_ns=time.time_ns(), took_s=0.0)


def test_failed_sets_are_gauges_of_their_own(tmp_path):
    """ckptfs_failed_sets / ckptfs_failed_bytes carry the unresolved failed sets of the
    snapshot (Engine.statistics: those no later commit replaced), apart from
    ckptfs_sets{state="failed"}, which counts every set that ever failed. (A set the store
    refuses on a real mount: tests/mount/test_status.py.)"""
    import ckptfs.metrics as metrics
    from cachemgr.core.sets import SetStats, Unsaved
    from cachemgr.engine import EngineStats, SetTotals, StoreTotals
    from cachemgr.restore.chunkfetch import ChunkStats
    from cachemgr.tiering.lease import LeaseStats
    from cachemgr.tiering.members import MemberStats
    from cachemgr.tiering.uploadqueue import UploadQueueStats

    tiering = EngineStats(
        sets=SetTotals(
            sets=SetStats(by_state={"durable": 3, "failed": 4}, pending_files=0,
                          pending_bytes=0, oldest_live_committed_ns=None),
            failed_sets=2, failed_bytes=12345,
            unsaved=Unsaved(files=3, bytes=700, paths=["a.tmp"], handed=0),
            stuck_after_s=120.0, stuck_sets=0, stuck=[]),
        store=StoreTotals(health="normal", consecutive_failures=0, retry=None),
        uploads=_zero(UploadQueueStats), restore=_zero(ChunkStats), cache_size=None,
        members=_zero(MemberStats, lease=_zero(LeaseStats, last_lapse=None)), peers=None,
        services=None)  # families reads no service's own statistics
    snap = _snapshot(tiering=tiering)
    fams = {f.name: f for f in metrics.families(snap, tmp_path)}
    for name, want in (("ckptfs_failed_sets", 2), ("ckptfs_failed_bytes", 12345),
                       ("ckptfs_unsaved_files", 3), ("ckptfs_unsaved_bytes", 700)):
        assert fams[name].type == "gauge"
        assert [(x.labels, x.value) for x in fams[name].samples] == [({}, want)]
    by_state = {x.labels["state"]: x.value for x in fams["ckptfs_sets"].samples}
    assert by_state["failed"] == 4 and by_state["committed"] == 0
    assert [x.value for x in fams["ckptfs_oldest_pending_set_age_seconds"].samples] == [0.0]
