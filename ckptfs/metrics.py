"""Prometheus metrics of a mount: `ckptfs mount --metrics [ADDR:]PORT` serves `/metrics`.

Who owns what:
  * The numbers belong to the services that count them, all on the trio loop thread:
    `CacheFs.stats` and `cached_bytes` (data path, evictions), `FuseOps.statistics()` (requests
    by handler), `Backings.statistics()` (data path mode), `Engine.statistics()` (sets, uploads,
    restores, the store's requests, retries and errors).
  * This module owns the HTTP server (`MetricsServer`: a `ThreadingHTTPServer` in a thread of
    its own) and the collector that turns a snapshot into metric families.

How a scrape reaches the loop: the HTTP thread never reads loop-owned state. It hands the loop
`snapshot()` with `TrioToken.run_sync_soon` and waits on a `concurrent.futures.Future` for at
most SNAPSHOT_TIMEOUT_S; `snapshot()` runs between two tasks' steps on the loop and returns plain
copies (ints, dicts), which the HTTP thread then reads at leisure. The loop never waits for the
HTTP thread. A loop that is busy past the timeout, or gone (unmounting), answers the scrape with
503 and a one-line reason; nothing is queued for later but one callback that finds its future
cancelled and does nothing. What needs no loop state (the cache disk's free space, the process's
memory) is read in the HTTP thread.

Failure contract: the daemon never dies from metrics. A port that cannot be bound fails the
mount before anything is mounted (`MetricsServer.__init__` raises `MetricsBindError`). Once
serving, an error while collecting fails that scrape (503 or 500, one line), is logged once
(again only when the reason changes, and once more when scrapes work again), and goes no
further: a `run_sync_soon` callback never raises into the loop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

if TYPE_CHECKING:
    from cachemgr.core.fs import CacheFs
    from cachemgr.core.passthrough import BackingStats
    from cachemgr.engine import EngineStats, PeerStats, SetTotals

    from .fuse import FuseOps, RequestStats

log = logging.getLogger(__name__)

# Prometheus' default scrape_timeout is 10 s: a loop that has not run the snapshot by then gets
# a 503 with the reason before the scraper gives up on its own. A snapshot itself took 0.4 ms
# with one set, 0.7-4 ms with 300 sets (220 pending) on a loaded 2-core machine
# (`ckptfs_metrics_snapshot_seconds` shows it).
SNAPSHOT_TIMEOUT_S = 5.0
# How long serve_forever sleeps between looks at the shutdown flag: what unmount waits at most.
POLL_INTERVAL_S = 0.1
# Anyone who can reach the port can scrape: at most this many snapshots wait for the loop at
# once (Prometheus scrapes one at a time; more gets 503), and a connection that sends nothing
# is dropped after REQUEST_TIMEOUT_S, so a flood costs the loop a bounded amount of work.
MAX_SNAPSHOTS_IN_FLIGHT = 4
REQUEST_TIMEOUT_S = 10.0

# Every set state (cachemgr/core/schema.sql): each is exported, 0 when no set is in it, so an alert
# on `delta(ckptfs_sets{state="failed"}[1h]) > 0` has a series from the first scrape.
SET_STATES = ("committed", "uploading", "durable", "failed", "superseded", "replaced",
              "deleting", "deleted", "replicated")
HEALTH_STATES = ("normal", "unstable", "down")


class MetricsBindError(OSError):
    """The metrics address cannot be bound; the mount fails with this message."""


class ScrapeError(Exception):
    """A scrape cannot be answered now (the loop is busy or gone); the reason is one line."""


# ----------------------------------------------------------------------------------------------
# on the loop thread


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Plain copies of every counter the metrics show (`snapshot`), read by the HTTP thread."""

    reads: int                  # the daemon's own reads and writes (CacheFs.stats)
    bytes_read: int
    writes: int
    bytes_written: int
    cached_bytes: int           # what --cache-size bounds
    evictions: int
    evicted_bytes: int
    data_path: BackingStats
    fuse: RequestStats
    tiering: EngineStats | None
    now_ns: int
    took_s: float               # what taking it cost the loop


def snapshot(core: CacheFs, ops: FuseOps, tiering: Callable[[], EngineStats]) -> Snapshot:
    """Plain copies of every counter the metrics show. Runs on the trio loop thread only.
    `tiering` is `Engine.statistics` (given by the composition root, ckptfs.daemon)."""
    t0 = time.perf_counter()
    st = core.stats
    engine = tiering()
    return Snapshot(reads=st.reads, bytes_read=st.bytes_read, writes=st.writes,
                    bytes_written=st.bytes_written, cached_bytes=core.files.cached_bytes,
                    evictions=st.evictions, evicted_bytes=st.evicted_bytes,
                    data_path=core.backings.statistics(), fuse=ops.statistics(),
                    tiering=engine, now_ns=time.time_ns(), took_s=time.perf_counter() - t0)


# ----------------------------------------------------------------------------------------------
# in the HTTP server's threads


class LoopSnapshots:
    """Gets a snapshot from the trio loop for the calling (non-loop) thread."""

    def __init__(self, token, fn: Callable[[], Snapshot], timeout: float = SNAPSHOT_TIMEOUT_S):
        self.token = token
        self.fn = fn
        self.timeout = timeout
        self._slots = threading.BoundedSemaphore(MAX_SNAPSHOTS_IN_FLIGHT)

    def get(self) -> Snapshot:
        if not self._slots.acquire(blocking=False):
            raise ScrapeError(f"{MAX_SNAPSHOTS_IN_FLIGHT} scrapes already wait for the "
                              "daemon's event loop")
        try:
            return self._get()
        finally:
            self._slots.release()

    def _get(self) -> Snapshot:
        import trio

        fut: concurrent.futures.Future = concurrent.futures.Future()

        def job() -> None:  # on the loop: must never raise (it would crash trio)
            if not fut.set_running_or_notify_cancel():
                return  # the scrape gave up waiting
            try:
                fut.set_result(self.fn())
            except Exception as e:  # noqa: BLE001 (handed to the scrape, never to trio)
                fut.set_exception(e)

        try:
            self.token.run_sync_soon(job)
        except trio.RunFinishedError:
            raise ScrapeError("the daemon's event loop has stopped (unmounting)") from None
        try:
            return fut.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # still queued: the job then does nothing
            raise ScrapeError(f"the daemon's event loop did not answer within "
                              f"{self.timeout:.0f}s (busy)") from None


def _counter(name: str, doc: str, value: float | None = None,
             labels: tuple[str, ...] = ()) -> CounterMetricFamily:
    # prometheus_client appends `_total` to a counter's samples itself.
    if labels:
        return CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
    return CounterMetricFamily(name.removesuffix("_total"), doc, value=value)


def families(s: Snapshot, cache_dir: Path) -> Iterator[Metric]:
    """The metric families of snapshot `s` (see README "Metrics" for the list)."""
    fuse = s.fuse
    m: CounterMetricFamily | GaugeMetricFamily
    m = _counter("ckptfs_fuse_requests_total", "FUSE requests the daemon answered, by "
                 "operation. With passthrough the kernel reads and writes files the cache holds"
                 " whole without the daemon: those reads and writes are not counted here.",
                 labels=("op",))
    for op, n in sorted(fuse.requests.items()):
        m.add_metric([op], n)
    yield m
    m = _counter("ckptfs_fuse_errors_total", "FUSE requests refused, by operation and errno "
                 "name (ENOENT from lookup is normal)", labels=("op", "errno"))
    for (op, err), n in sorted(fuse.errors.items()):
        m.add_metric([op, _errno_name(err)], n)
    yield m
    m = _counter("ckptfs_fuse_bytes_total", "Bytes of file data the daemon served, by "
                 "operation. With passthrough only what the daemon served (files not held whole"
                 " in the cache): the kernel's own reads and writes are not counted.",
                 labels=("op",))
    m.add_metric(["read"], s.bytes_read)
    m.add_metric(["write"], s.bytes_written)
    yield m

    dp = s.data_path
    mode = "passthrough" if dp.mode == "passthrough" else "daemon"
    m = GaugeMetricFamily("ckptfs_data_path", "Data path of the mount: 1 for the mode in use. "
                          "passthrough: the kernel reads and writes whole cached files itself; "
                          "daemon: the daemon serves every byte", labels=("mode",))
    for name in ("passthrough", "daemon"):
        m.add_metric([name], 1.0 if name == mode else 0.0)
    yield m
    yield _counter("ckptfs_passthrough_opens_total", "Opens served by FUSE passthrough",
                   dp.passthrough_opens)

    yield GaugeMetricFamily("ckptfs_cache_data_bytes", "Bytes of file data held in the cache "
                            "(what --cache-size bounds)", value=s.cached_bytes)
    yield _counter("ckptfs_cache_evictions_total", "Cached files whose data was dropped from "
                   "the cache (it is durable in the store; read back on demand)", s.evictions)
    yield _counter("ckptfs_cache_evicted_bytes_total", "Bytes freed by evictions",
                   s.evicted_bytes)
    try:  # no loop state: read here, in the HTTP thread
        vfs = os.statvfs(cache_dir)
    except OSError as e:
        log.debug("statvfs(%s): %s", cache_dir, e)
    else:
        yield GaugeMetricFamily("ckptfs_cache_disk_free_bytes", "Free bytes on the cache disk "
                                "(available to the daemon)", value=vfs.f_bavail * vfs.f_frsize)
        yield GaugeMetricFamily("ckptfs_cache_disk_size_bytes", "Size of the cache disk",
                                value=vfs.f_blocks * vfs.f_frsize)

    if s.tiering is not None:
        yield from _tiering_families(s.tiering, s.now_ns)

    yield GaugeMetricFamily("ckptfs_metrics_snapshot_seconds", "Time the event loop spent "
                            "taking this scrape's snapshot", value=s.took_s)


def _tiering_families(t: EngineStats, now_ns: int) -> Iterator[Metric]:
    totals = t.sets
    sets = totals.sets
    m: CounterMetricFamily | GaugeMetricFamily
    m = GaugeMetricFamily("ckptfs_sets", "Shard sets by state (committed -> uploading -> "
                          "durable; failed, superseded, replaced, deleting, deleted). failed "
                          "counts every set that ever failed, also those saved again since: "
                          "ckptfs_failed_sets counts the ones still at risk",
                          labels=("state",))
    by_state = dict.fromkeys(SET_STATES, 0) | sets.by_state
    for state, n in by_state.items():
        m.add_metric([state], n)
    yield m
    yield GaugeMetricFamily("ckptfs_pending_upload_files", "Files of committed sets not "
                            "uploaded yet", value=sets.pending_files)
    yield GaugeMetricFamily("ckptfs_pending_upload_bytes", "Bytes of committed sets' files "
                            "not uploaded yet", value=sets.pending_bytes)
    oldest = sets.oldest_live_committed_ns
    age = 0.0 if oldest is None else max(0.0, (now_ns - oldest) / 1e9)
    yield GaugeMetricFamily("ckptfs_oldest_pending_set_age_seconds", "Seconds since the oldest "
                            "committed set that is not durable yet was committed; 0 when every "
                            "set is durable. Its data is only in this node's cache until then.",
                            value=age)
    yield GaugeMetricFamily("ckptfs_failed_sets", "Committed sets that failed for good (e.g. "
                            "the store refused their manifest) and that no later commit of "
                            "their path has replaced: not in the store, only in this node's "
                            "cache, and no upload will make them durable; 0 when none",
                            value=totals.failed_sets)
    yield GaugeMetricFamily("ckptfs_failed_bytes", "Bytes of the files of those failed sets "
                            "(ckptfs_failed_sets)", value=totals.failed_bytes)
    yield GaugeMetricFamily("ckptfs_unsaved_files", "Closed files in no committed set (a "
                            "temporary name never renamed, shards of a DCP directory whose "
                            ".metadata never came, a file in a directory that is no set): "
                            "nothing uploads them as they are; only in this node's cache. "
                            "ckptfs status names them; 0 when none",
                            value=totals.unsaved.files)
    yield GaugeMetricFamily("ckptfs_unsaved_bytes", "Bytes of those files "
                            "(ckptfs_unsaved_files)", value=totals.unsaved.bytes)
    yield from _stuck_families(totals, now_ns)

    up = t.uploads
    yield _counter("ckptfs_upload_bytes_total", "Bytes of file data uploaded (before "
                   "compression; an upload retried from the start counts again)", up.bytes)
    yield _counter("ckptfs_upload_stored_bytes_total", "Bytes stored by completed uploads "
                   "(after compression)", up.stored_bytes)
    yield _counter("ckptfs_upload_parts_total", "Multipart upload parts sent", up.parts)
    m = _counter("ckptfs_upload_files_total", "File uploads finished, by result (cancelled: the"
                 " content changed or was deleted first)", labels=("result",))
    m.add_metric(["done"], up.done)
    m.add_metric(["cancelled"], up.cancelled)
    yield m
    m = GaugeMetricFamily("ckptfs_upload_queue_files", "File uploads running or queued",
                          labels=("state",))
    m.add_metric(["running"], up.running)
    m.add_metric(["queued"], up.queued)
    yield m

    r = t.restore
    yield _counter("ckptfs_restore_bytes_total", "Bytes read back from the store (prefetch and "
                   "read-through)", r.bytes_fetched)
    yield _counter("ckptfs_restore_chunks_total", "Chunks read back from the store",
                   r.chunks_fetched)
    yield _counter("ckptfs_restore_integrity_errors_total", "Chunks read from the store that "
                   "failed their checksum (read again)", r.integrity_errors)
    yield _counter("ckptfs_restore_damaged_cache_chunks_total", "Cached chunks found damaged "
                   "and fetched again", r.damaged_cache_chunks)

    yield from _peer_families(t.peers)

    st = t.store
    retry = st.retry
    m = _counter("ckptfs_store_requests_total", "Object store calls, by operation (each call "
                 "once, however many times it was retried)", labels=("op",))
    for op, n in sorted(({} if retry is None else retry.by_op).items()):
        m.add_metric([op], n)
    yield m
    m = _counter("ckptfs_store_retries_total", "Object store calls retried after a transient "
                 "error, by error kind", labels=("error",))
    for kind, n in sorted(({} if retry is None else retry.by_error).items()):
        m.add_metric([kind], n)
    yield m
    m = _counter("ckptfs_store_errors_total", "Object store calls that failed (not transient, "
                 "or retries exhausted), by operation and error kind (NotFound from get/head "
                 "can be normal)", labels=("op", "error"))
    for (op, kind), n in sorted(({} if retry is None else retry.errors).items()):
        m.add_metric([op, kind], n)
    yield m
    m = GaugeMetricFamily("ckptfs_store_health", "Object store health as the daemon sees it: 1 "
                          "for the current state (normal; unstable: recent failures; down: 5 or "
                          "more in a row)", labels=("state",))
    for state in HEALTH_STATES:
        m.add_metric([state], 1.0 if state == st.health else 0.0)
    yield m
    yield GaugeMetricFamily("ckptfs_store_consecutive_failures", "Store operations failed in a "
                            "row since the last success", value=st.consecutive_failures)
    lease = t.members.lease
    yield GaugeMetricFamily("ckptfs_lease_held", "1 while this node's lease in the store "
                            "runs (other nodes' directory commits wait for it), else 0",
                            value=1.0 if lease.lease_held else 0.0)
    yield _counter("ckptfs_lease_lapses_total", "Times this node's lease ran out before a "
                   "renewal reached the store (it then registered under a new generation)",
                   lease.lease_lapses)
    if t.cache_size is not None:
        yield GaugeMetricFamily("ckptfs_cache_size_limit_bytes", "--cache-size",
                                value=t.cache_size)


PEER_ERROR_KINDS = ("auth", "corrupt", "size", "stall", "unreachable", "protocol", "status")


def _peer_families(p: PeerStats | None) -> Iterator[Metric]:
    """--peers (cachemgr.peer): always present, 0 on a mount without it, so
    a dashboard over many nodes sums them alike."""
    client = None if p is None else p.client
    server = None if p is None else p.server
    rep = None if p is None else p.replication
    yield _counter("ckptfs_restore_peer_bytes_total", "Bytes restored from peers (each chunk "
                   "checked against its CRC32C) instead of the store",
                   0 if p is None else p.chunks.peer_bytes)
    yield _counter("ckptfs_peer_served_bytes_total", "Bytes of verified chunks this node "
                   "served to peers", 0 if server is None else server.served_bytes)
    m = _counter("ckptfs_peer_errors_total", "Peers cut off by this node's restores, by what "
                 "they did (auth: 401; corrupt: CRC32C mismatch; size: wrong length; stall: too "
                 "slow; unreachable; protocol: not HTTP/1.1; status: another answer)",
                 labels=("kind",))
    errors = {} if client is None else client.errors
    for kind in PEER_ERROR_KINDS:
        m.add_metric([kind], errors.get(kind, 0))
    yield m
    yield GaugeMetricFamily("ckptfs_replicated_sets", "This node's committed sets not durable "
                            "yet that K buddies hold (--replicas; 0 without it)",
                            value=0 if rep is None else rep.replicated_sets)
    yield GaugeMetricFamily("ckptfs_replica_bytes", "Bytes of replicas this node holds for "
                            "other nodes' sets (--replicas; counted against --cache-size)",
                            value=0 if rep is None else rep.replica_bytes)


def _stuck_families(sets: SetTotals, now_ns: int) -> Iterator[Metric]:
    """The sets pending longer than the stuck threshold (cachemgr.tiering.progress.stuck_sets): how
    many, the oldest one's age, and each of the oldest 20 by name with what it waits for."""
    stuck = sets.stuck
    yield GaugeMetricFamily("ckptfs_stuck_sets", "Committed sets pending (not durable yet) "
                            "longer than ckptfs_stuck_threshold_seconds, over every set; 0 when "
                            "none. `ckptfs status` names each with what it waits for",
                            value=sets.stuck_sets)
    yield GaugeMetricFamily("ckptfs_stuck_threshold_seconds", "How long a set may be "
                            "pending before it counts as stuck (120 s, or a quarter of "
                            "--commit-timeout if shorter)", value=sets.stuck_after_s)
    oldest = min((x.committed_ns for x in stuck), default=None)
    yield GaugeMetricFamily("ckptfs_oldest_stuck_set_age_seconds", "Seconds since the oldest "
                            "stuck set was committed; 0 when no set is stuck",
                            value=0.0 if oldest is None else max(0.0, (now_ns - oldest) / 1e9))
    m = GaugeMetricFamily("ckptfs_stuck_set_age_seconds", "Each stuck set (the oldest 20), by "
                          "seq and path, with what it waits for (waits_for: open_for_writing, "
                          "content_gone, store, uploads, upload_lost, other_nodes, acks, "
                          "gathering, commit_order, publish_queued, unknown): seconds since "
                          "its commit", labels=("seq", "path", "state", "waits_for"))
    for x in stuck:
        m.add_metric([str(x.seq), x.path, x.state, x.waits_for],
                     max(0.0, (now_ns - x.committed_ns) / 1e9))
    yield m


def _errno_name(err: int) -> str:
    import errno

    return errno.errorcode.get(err, str(err))


class CkptfsCollector:
    """A prometheus_client collector: one loop snapshot per scrape, converted here."""

    def __init__(self, source: Callable[[], Snapshot], cache_dir: Path, version: str) -> None:
        self.source = source
        self.cache_dir = cache_dir
        self.version = version
        self._lock = threading.Lock()  # guards _failing (scrapes run in parallel threads)
        self._failing: str | None = None

    def describe(self) -> list:
        return []  # nothing to check at registration (and no scrape at registration)

    def collect(self) -> Iterator[Metric]:
        try:
            s = self.source()
            out = list(families(s, self.cache_dir))
        except ScrapeError as e:
            self._failed(str(e), exc_info=False)
            raise
        except Exception as e:  # noqa: BLE001 (a bug: this scrape fails, the daemon goes on)
            self._failed(f"collecting metrics failed: {e!r}", exc_info=True)
            raise ScrapeError(f"collecting metrics failed: {e.__class__.__name__}") from None
        with self._lock:
            if self._failing is not None:
                log.info("metrics: scrapes answered again")
                self._failing = None
        info = GaugeMetricFamily("ckptfs_info", "ckptfs version", labels=("version",))
        info.add_metric([self.version], 1.0)
        yield info
        yield from out

    def _failed(self, why: str, exc_info: bool) -> None:
        with self._lock:
            first = why != self._failing
            self._failing = why
        if first:
            log.warning("metrics: scrape failed: %s", why, exc_info=exc_info)
        else:
            log.debug("metrics: scrape failed: %s", why)


class _Handler(BaseHTTPRequestHandler):
    server_version = "ckptfs-metrics"
    timeout = REQUEST_TIMEOUT_S
    server: _Server

    def do_GET(self) -> None:
        if urlsplit(self.path).path != "/metrics":
            self._reply(404, "text/plain; charset=utf-8", b"ckptfs: only /metrics here\n")
            return
        encoder, ctype = choose_encoder(self.headers.get("Accept", ""))
        try:
            body = encoder(self.server.registry)
        except ScrapeError as e:
            self._reply(503, "text/plain; charset=utf-8", f"ckptfs: {e}\n".encode())
            return
        except Exception as e:  # noqa: BLE001 (encoding; our collector raises ScrapeError)
            log.warning("metrics: encoding failed: %r", e)
            self._reply(500, "text/plain; charset=utf-8",
                        f"ckptfs: encoding failed: {e.__class__.__name__}\n".encode())
            return
        self._reply(200, ctype, body)

    def _reply(self, code: int, ctype: str, body: bytes) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError as e:  # the scraper went away
            log.debug("metrics: reply not sent: %s", e)

    def log_message(self, format: str, *args) -> None:
        log.debug("metrics: %s %s", self.address_string(), format % args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a scrape stuck on a dying loop never holds the daemon's exit
    registry: CollectorRegistry

    def handle_error(self, request, client_address) -> None:
        # called by socketserver inside its except clause: exc_info is the failure
        log.debug("metrics: request from %s failed", client_address,
                  exc_info=True)  # noqa: LOG014


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """The /metrics endpoint. Binds in the constructor (before the mount, so a bad port fails
    the mount with nothing mounted); `start` serves once the loop runs; `close` stops it."""

    def __init__(self, host: str, port: int, *, cache_dir: Path, version: str) -> None:
        self.host, self.port = host, port
        self.cache_dir = cache_dir
        self.version = version
        v6 = ":" in host
        try:
            self.httpd: _Server = (_Server6 if v6 else _Server)((host, port), _Handler)
        except OSError as e:
            shown = f"[{host}]:{port}" if v6 else f"{host}:{port}"
            raise MetricsBindError(e.errno, f"--metrics {shown}: cannot listen there: "
                                   f"{e.strerror or e}") from None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host  # AF_INET(6): a str
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self, token, snapshot_fn: Callable[[], Snapshot]) -> None:
        """Serve /metrics; snapshots come from the loop of `token` (called on the loop)."""
        registry = CollectorRegistry()
        registry.register(CkptfsCollector(LoopSnapshots(token, snapshot_fn).get,
                                          self.cache_dir, self.version))
        ProcessCollector(registry=registry)  # process_resident_memory_bytes etc. (Linux /proc)
        self.httpd.registry = registry
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        kwargs={"poll_interval": POLL_INTERVAL_S},
                                        name="ckptfs-metrics", daemon=True)
        self._thread.start()
        log.info("metrics: serving http://%s/metrics", self.address)

    def close(self) -> None:
        """Stop serving and release the port (scrapes in flight end on their own)."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()
