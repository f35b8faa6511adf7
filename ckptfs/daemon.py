"""The daemon: the composition root of one mount. Builds every service once, runs them in one
nursery, and tears them down in the reverse order. `ckptfs.mount` decides *whether* to run it
(preflight, fork, readiness pipe); this module is what runs.

Start order (`run_daemon`, one step per `_Daemon` method, each step may fail the mount with a
documented exit code before the next one starts):
  1. lock       take the cache-dir lock (`mount.CacheLock`; fails: EXIT_CACHE_DIR). Nothing
                below runs, and nothing is torn down, without it.
  2. metrics    bind the --metrics port (`metrics.MetricsServer`; fails: EXIT_NOT_READY), before
                anything is mounted: a port that cannot be had fails the mount.
  3. cache      open the cache's owners: `Cache.open` (index + crash recovery; fails:
                EXIT_CACHE_DIR).
  4. store      open the object store (`open_backend`, then `ReadOnlyStore` if --read-only and
                `RetryingStore` over it), probe it (fails: EXIT_STORE), bind the cache dir to
                the store URL (another URL: EXIT_CACHE_DIR).
  5. services   bottom-up, each whole when its constructor returns: the foreground signal,
                `Engine` from the cache (it builds its services, each from the cache's owners
                it uses), the core `CacheFs` from the cache and those services, `Filesystem`,
                then `FuseOps`.
  6. mount      open the FUSE session (`fuse.mount_and_serve`; fails: EXIT_NOT_READY).
  7. serve      `trio.run`: one nursery holds, started in this order, the control socket, the
                engine's services, the metrics scrape hook (the loop's token), readiness (stat
                through the kernel, readahead, first store listing, registration, systemd's
                READY=1, notify), the STATUS= reporter and the signal handler; then the FUSE
                main loop runs until unmounted or signalled (STOPPING=1), and the nursery is
                cancelled.
Signals (`_on_signals`): SIGTERM/SIGINT unmount (what is pending resumes at the next mount);
SIGHUP is a reload: it reopens the log file at its path (logrotate) and nothing else, between
RELOADING=1 and READY=1 (ckptfs/sdnotify.py; `ExecReload=` of scripts/systemd/ckptfs@.service).
Teardown order (`_Daemon.teardown`, reverse, each step guarded so one failure skips nothing):
  metrics server closed first (no scrape waits on a loop that has ended); FUSE session closed
  (unmounting if still mounted); cache closed (persists its in-memory state); registration
  removed; lock released.

State: everything here is built and owned by the daemon's main thread before `trio.run`, then
by the trio loop thread. Other threads (the metrics HTTP thread) reach it only through the
snapshot the loop publishes (`metrics.LoopSnapshots`).

Control ops (`CONTROL_OPS`): op name -> (the permission the caller needs on `req["path"]`, the
handler). The protocol and every reply are those of ckptfs/control.py and README "Control socket".
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from .config import (
    ConfigError,
    MountConfig,
    default_store_note,
    default_store_url,
    load_peer_secret,
    parse_peer_seeds,
)
from .control import READ, WRITE, Peer, check_access
from .fmt import human
from .mount import (
    EXIT_CACHE_DIR,
    EXIT_ERROR,
    EXIT_NOT_READY,
    EXIT_OK,
    EXIT_STORE,
    EXIT_USAGE,
    FIRST_LISTING_TIMEOUT_S,
    CacheLock,
    MountError,
    Notify,
    control_mode,
    control_path,
    mount_source,
    register,
    reopen_logs,
    tune_readahead,
    unregister,
)
from .sdnotify import Notifier
from .stallwatch import StallWatch, from_env

if TYPE_CHECKING:
    from cachemgr.engine import Engine
    from cachemgr.host.foreground import Foreground
    from cachemgr.peer.proto import PeerConfig
    from cachemgr.store import ObjectStore

log = logging.getLogger(__name__)


def peer_config(cfg: MountConfig) -> PeerConfig | None:
    """--peers as the restore layer takes it (the secret read from its file again); None: off."""
    if not cfg.peers or cfg.peer_secret_file is None:
        return None
    from cachemgr.peer.proto import PeerConfig

    host, port, advertise = cfg.peer_endpoint
    return PeerConfig(secret=load_peer_secret(cfg.peer_secret_file), listen_host=host,
                      listen_port=port, advertise=advertise,
                      seeds=parse_peer_seeds(cfg.peer_seeds) if cfg.peer_seeds else ())

# STATUS= for `systemctl status`: recomputed this often (one `Engine.statistics()`, what a
# metrics scrape costs: about a millisecond of the loop) and sent when its text changed.
STATUS_INTERVAL_S = 5.0


def open_backend(cfg: MountConfig, store_url: str) -> ObjectStore:
    """The store `store_url` names, with the mount's --s3-* and --part-size options: the bottom
    of the mount's store stack, which `_Daemon.open_store` layers read-only and retries over.
    Looked up at each mount: the tests' daemons wrap it from outside to put a fault-injecting
    store below the retries (tests/daemon_hooks/sitecustomize.py)."""
    from cachemgr.store import open_store

    if not store_url.startswith("s3://"):
        return open_store(store_url)
    return open_store(store_url, endpoint_url=cfg.s3_endpoint, region=cfg.s3_region,
                      path_style=cfg.s3_path_style, profile=cfg.s3_profile,
                      allow_unconditional=cfg.store_ignores_conditions,
                      native=cfg.s3_transfer != "boto3",
                      native_gets=cfg.s3_transfer == "crt",
                      plain_http=cfg.s3_transfer == "auto",
                      part_size=cfg.part_size)


PROBE_LIST_S = 15.0


async def _probe_store(store, read_only: bool = False) -> None:
    """Fail the mount early on a store that cannot work at all (no such bucket, no access);
    transient trouble only warns: writes land in the cache and uploads retry. Then find out
    what the store does with conditional PUTs (docs/STORES.md); if it cannot be asked now,
    the first conditional PUT asks. A read-only mount asks nothing (the probe writes)."""
    import trio

    from cachemgr.store import StoreError

    # One LIST page's deadline (cachemgr.store.s3.Deadlines.list_page): a store that does not
    # answer costs the mount this once here, then the first listing's own deadlines, which
    # decide whether the namespace is complete.
    with trio.move_on_after(PROBE_LIST_S) as scope:
        try:
            await store.list("manifests/")
        except StoreError as e:
            if not e.transient:
                raise
            log.warning("object store not reachable yet (%s); uploads will retry", e)
            return
    if scope.cancelled_caught:
        log.warning("object store did not answer within %.0fs; uploads will retry",
                    PROBE_LIST_S)
        return
    if read_only:
        return
    with trio.move_on_after(30) as scope:
        try:
            await store.probe_conditional()
        except StoreError as e:
            # e.g. a credential that may list but not write: commits will say why they fail
            log.warning("cannot probe the store's conditional writes (%s); the first commit"
                        " will", e)
    if scope.cancelled_caught:
        log.warning("the store's conditional-write probe did not finish within 30s; the first"
                    " commit will probe again")


# ----------------------------------------------------------------------------------------------
# the control-op table


@dataclass
class Services:
    """What the control handlers reach: built once by `_Daemon`, read on the trio loop only."""

    cfg: MountConfig
    core: Any     # cachemgr.core.fs.CacheFs
    engine: Engine
    started: float  # time.time() when the services started (status: uptime_s)
    stallwatch: Any = None  # ckptfs.stallwatch.StallWatch (status: loop)


async def op_status(svc: Services, req: dict) -> dict:
    cfg = svc.cfg
    return {"pid": os.getpid(), "mountpoint": str(cfg.mountpoint),
            "cache_dir": str(cfg.cache_dir), "uptime_s": time.time() - svc.started,
            "read_only": cfg.read_only, "access": cfg.access,
            "owner": {"uid": cfg.uid, "gid": cfg.gid},
            "s3": {"endpoint_url": cfg.s3_endpoint, "region": cfg.s3_region,
                   "profile": cfg.s3_profile, "force_path_style": cfg.s3_path_style},
            **svc.core.status(), "tiering": svc.engine.status(),
            **({"loop": asdict(svc.stallwatch.statistics())} if svc.stallwatch is not None
               else {})}


async def op_prefetch(svc: Services, req: dict) -> dict:
    return svc.engine.restorer.prefetch_path(str(req["path"]))


async def op_commit(svc: Services, req: dict) -> dict:
    return {"seq": svc.engine.commit_path(str(req["path"]))}


async def op_wait(svc: Services, req: dict) -> dict:
    timeout = req.get("timeout")
    if req.get("replicated"):
        return await svc.engine.wait_replicated(
            str(req["path"]), None if timeout is None else float(timeout))
    return await svc.engine.wait(str(req["path"]), None if timeout is None else float(timeout))


async def op_leave_by(svc: Services, req: dict) -> dict:
    """`umount --timeout`: the unmount that follows ends within what is left of it (issue 36:
    a hung store made it end 10 s past it, the member record's bound)."""
    if svc.engine is not None:
        svc.engine.leave_by(float(req["seconds"]))
    return {}


@dataclass(frozen=True)
class ControlOp:
    needs: int  # what the caller needs on req["path"] (control.READ / WRITE); root passes
    handler: Callable[[Services, dict], Awaitable[dict]]


# status: read the mount root; wait and prefetch: read the path (opening a file for reading
# already prefetches its whole set, so prefetch asks no more than that); commit: write it;
# leave_by (umount --timeout): write the mount root, as an unmount needs.
CONTROL_OPS: dict[str, ControlOp] = {
    "status": ControlOp(READ, op_status),
    "prefetch": ControlOp(READ, op_prefetch),
    "commit": ControlOp(WRITE, op_commit),
    "wait": ControlOp(READ, op_wait),
    "leave_by": ControlOp(WRITE, op_leave_by),
}


class OwnedIndex:
    """The cache index as `control.check_access` reads it (lookup, get_inode), with --uid and
    --gid applied as the FUSE adapter reports them: a control request is judged by the owner
    the caller sees in `stat`, not by the one recorded in the cache."""

    def __init__(self, index: Any, uid: int | None, gid: int | None) -> None:
        self.index, self.uid, self.gid = index, uid, gid

    def lookup(self, parent: int, name: bytes) -> int | None:
        ino: int | None = self.index.lookup(parent, name)
        return ino

    def get_inode(self, ino: int) -> tuple | None:
        row = self.index.get_inode(ino)  # (ino, mode, uid, gid, ...)
        if row is None:
            return None
        return (row[0], row[1], row[2] if self.uid is None else self.uid,
                row[3] if self.gid is None else self.gid, *row[4:])


async def dispatch(svc: Services, req: dict, peer: Peer) -> dict:
    """Answer one control request: the caller's permission first, then the op's handler. Every
    failure is a reply (`{"error": ...}`, with `errno` for a filesystem refusal)."""
    from cachemgr.core.errors import FsError

    op: Any = req.get("op")
    try:
        entry = CONTROL_OPS.get(op)  # an unhashable op: TypeError, a bad request
        if entry is not None:
            if entry.needs == WRITE and svc.cfg.read_only:
                raise FsError(errno.EROFS, "read-only mount (--read-only)")
            index = svc.core.index if svc.cfg.uid is None and svc.cfg.gid is None else \
                OwnedIndex(svc.core.index, svc.cfg.uid, svc.cfg.gid)
            check_access(index, peer, str(req.get("path", "")), entry.needs)
            return await entry.handler(svc, req)
    except FsError as e:
        return {"error": e.msg, "errno": e.errno}
    except (KeyError, TypeError, ValueError) as e:
        return {"error": f"bad request: {e}"}
    return {"error": f"unknown op {op!r}"}


# ----------------------------------------------------------------------------------------------
# the daemon


class _StartFailed(Exception):
    """A start step failed: the mount ends with `code`, the parent is told `msg`."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code, self.msg = code, msg


class _Daemon:
    """One mount's services, built by the start steps in order and torn down in reverse."""

    def __init__(self, cfg: MountConfig, notify: Notify) -> None:
        self.cfg = cfg
        self._notify = notify
        self._notified = False
        self.store_url = cfg.store or default_store_url()
        self.lock = CacheLock(cfg.cache_dir)
        self.locked = False
        self.metrics_server: Any = None
        self.cache: Any = None
        self.core: Any = None
        self.store: Any = None
        self.engine: Any = None  # cachemgr.engine.Engine, from step 5
        self.ops: Any = None
        self.main: Callable[[], Awaitable[None]] | None = None  # the FUSE loop, once mounted
        self.mounted = False
        threshold, dump_after = from_env()  # CKPTFS_STALL_S, CKPTFS_STALL_DUMP_S
        # logs a stalled trio loop with its stack
        self.stallwatch = StallWatch(threshold, dump_after=dump_after)
        self.sd = Notifier()  # systemd's notify socket; a no-op outside a Type=notify unit
        self.serving: Any = None  # trio.Event, set once the mount is ready (serve() makes it)

    def tell(self, code: int, msg: str) -> None:
        """Tell the parent how the mount went: once, the first answer wins."""
        if not self._notified:
            self._notified = True
            self._notify(code, msg)

    # -- start steps ---------------------------------------------------------------------------

    def take_lock(self) -> None:  # step 1
        try:
            self.lock.acquire()
        except MountError as e:
            raise _StartFailed(e.code, e.msg) from e
        self.locked = True

    def bind_metrics(self) -> None:  # step 2
        if self.cfg.metrics_listen is None:
            return
        from . import __version__, metrics

        try:
            self.metrics_server = metrics.MetricsServer(*self.cfg.metrics_listen,
                                                        cache_dir=self.cfg.cache_dir,
                                                        version=__version__)
        except metrics.MetricsBindError as e:
            raise _StartFailed(EXIT_NOT_READY, str(e.strerror)) from e

    def open_cache(self) -> None:  # step 3
        from cachemgr.core.cache import Cache
        from cachemgr.core.errors import FsError

        from . import fuse

        cfg = self.cfg
        try:
            self.cache = Cache.open(cfg.cache_dir, backings=fuse.backings(cfg))
        except (FsError, OSError) as e:
            raise _StartFailed(EXIT_CACHE_DIR, f"cannot open cache in {cfg.cache_dir}: {e}") \
                from e

    def open_store(self) -> None:  # step 4
        import trio

        from cachemgr.store import RetryingStore, StoreError
        from cachemgr.store.wrappers import ReadOnlyStore

        cfg, store_url = self.cfg, self.store_url
        try:
            inner = open_backend(cfg, store_url)
            self.store = RetryingStore(ReadOnlyStore(inner) if cfg.read_only else inner)
            trio.run(_probe_store, self.store, cfg.read_only)
        except (StoreError, OSError) as e:
            raise _StartFailed(EXIT_STORE, f"object store {store_url} is unusable: {e}") from e
        except Exception as e:  # botocore config/credential errors
            raise _StartFailed(EXIT_STORE, f"object store {store_url} is unusable: "
                               f"{e.__class__.__name__}: {e}") from e
        found = self.store.conditional
        if found is not None and not found.honoured:
            if not cfg.store_ignores_conditions:
                raise _StartFailed(EXIT_STORE, (
                    f"object store {store_url}: conditional writes {found.describe()}; two "
                    "nodes committing one path would silently overwrite each other. Use a store "
                    "that honours them (docs/STORES.md), or mount with "
                    "--store-ignores-conditions if one node writes each path"))
            log.warning("store %s: conditional writes %s; --store-ignores-conditions: the last"
                        " node to commit a path wins", store_url, found.describe())
        index = self.cache.index
        bound = index.meta("store_url")
        if bound is not None and bound != store_url:
            raise _StartFailed(EXIT_CACHE_DIR, f"cache dir {cfg.cache_dir} holds data of store "
                               f"{bound}, not {store_url}; use that store or another --cache-dir")
        if bound is None:
            with index.tx():
                index.set_meta("store_url", store_url)

    def build_services(self) -> None:  # step 5
        from cachemgr.core.fs import CacheFs, Filesystem
        from cachemgr.host.foreground import Foreground

        from . import fuse

        cfg, cache = self.cfg, self.cache
        # Uploads hold back while the trainer writes or reads: the FUSE handlers note what they
        # serve; passthrough I/O never reaches the daemon: writes are found by fstat, reads by
        # the reader's /proc/PID/io (Backings.busy_since_probe).
        foreground = Foreground(cache.backings.busy_since_probe)
        try:
            peers = peer_config(cfg)
        except ConfigError as e:  # the secret file changed since the CLI checked it
            raise _StartFailed(EXIT_USAGE, str(e)) from e
        try:
            engine = self._engine(foreground, peers)
        except OSError as e:  # --peer-listen: the port is taken
            raise _StartFailed(EXIT_NOT_READY, f"--peers: cannot listen at "
                               f"{cfg.peer_listen or '0.0.0.0:0'}: {e.strerror or e}") from e
        core = CacheFs(cache, hooks=engine.commits, reads=engine.restorer, room=engine.space,
                       direct_io_writes=cfg.direct_io_writes and not cfg.writeback_cache)
        ops = fuse.FuseOps(Filesystem(core, foreground, io_threads=cfg.io_threads),
                           attr_timeout=cfg.attr_timeout, writeback_cache=cfg.writeback_cache,
                           passthrough=cache.backings.on,  # the kernel's answer: FuseOps.init
                           read_only=cfg.read_only, uid=cfg.uid, gid=cfg.gid)
        self.core = core
        self.engine, self.ops = engine, ops

    def _engine(self, foreground: Foreground, peers: PeerConfig | None) -> Engine:
        from cachemgr.engine import Engine, EngineConfig
        from cachemgr.transfer.upload import TransferConfig

        from . import fuse

        cfg = self.cfg
        return Engine(self.cache, self.store, EngineConfig(
            transfer=TransferConfig(part_size=cfg.part_size, compress=cfg.compress,
                                    max_parts_in_flight=cfg.parts_in_flight),
            file_concurrency=cfg.upload_files, cache_size=cfg.cache_size,
            keep_local=cfg.keep_local, prefetch=cfg.prefetch,
            prefetch_concurrency=cfg.prefetch_concurrency, prefetch_range=cfg.prefetch_range,
            refresh_interval=cfg.refresh_interval, commit_timeout=cfg.commit_timeout,
            lease=cfg.lease, read_only=cfg.read_only, peers=peers,
            replicas=0 if peers is None else 1 if cfg.replicas is None else cfg.replicas),
            foreground=foreground, kernel=fuse.KERNEL)

    def mount(self) -> None:  # step 6
        from . import fuse

        cfg = self.cfg
        try:
            self.main = fuse.mount_and_serve(self.ops, str(cfg.mountpoint),
                                             fuse.fuse_options(access=cfg.access,
                                                               read_only=cfg.read_only,
                                                               fsname=mount_source(self.store_url)))
        except RuntimeError as e:
            raise _StartFailed(EXIT_NOT_READY, f"mount of {cfg.mountpoint} failed: {e}") from e
        self.mounted = True
        log.info("mounted %s (cache %s, store %s%s, pid %d)", cfg.mountpoint, cfg.cache_dir,
                 self.store_url, self._default_note(), os.getpid())

    async def serve(self) -> None:  # step 7, on the trio loop
        import trio

        from . import control

        svc = Services(self.cfg, self.core, self.engine, started=time.time(),
                       stallwatch=self.stallwatch)
        self.serving = trio.Event()
        assert self.main is not None
        async with trio.open_nursery() as nursery:
            await nursery.start(self.stallwatch.beat)
            self.stallwatch.start()
            await nursery.start(partial(control.serve, mode=control_mode()),
                                control_path(self.cfg.mountpoint), partial(dispatch, svc))
            await nursery.start(self.engine.run)
            if self.metrics_server is not None:
                from . import metrics

                self.metrics_server.start(trio.lowlevel.current_trio_token(),
                                          partial(metrics.snapshot, self.core, self.ops,
                                                  self.engine.statistics))
            nursery.start_soon(self._ready)
            nursery.start_soon(self._on_signals)
            if self.sd.enabled:
                nursery.start_soon(self._report_status)
            await self.main()
            self.sd.stopping(f"unmounting {self.cfg.mountpoint}")
            nursery.cancel_scope.cancel()

    # -- tasks of the nursery --------------------------------------------------------------------

    def _default_note(self) -> str:
        return "" if self.cfg.store else f" ({default_store_note()})"

    async def _ready(self) -> None:
        import trio

        from . import fuse

        cfg = self.cfg
        await trio.to_thread.run_sync(os.stat, cfg.mountpoint)
        await trio.to_thread.run_sync(tune_readahead, cfg.mountpoint, cfg.read_ahead_kb)
        # The namespace is complete as of one listing of the store before the mount reports
        # ready: a job resuming right after `ckptfs mount` must never see an older checkpoint,
        # or none, because the listing was still being applied.
        remote = self.engine.remote
        with trio.move_on_after(FIRST_LISTING_TIMEOUT_S):
            await remote.first_listing.wait()
        why = remote.first_error if remote.first_listing.is_set() else \
            f"no answer within {FIRST_LISTING_TIMEOUT_S:.0f}s"
        if why is not None:
            peers = await self._sets_from_peers() if cfg.allow_empty_namespace else ""
            if not cfg.allow_empty_namespace:
                msg = (f"cannot list the sets in store {self.store_url} ({why}): the namespace "
                       "would be incomplete; retry when the store answers, or mount with "
                       "--allow-empty-namespace to see only this cache's sets"
                       f"{' and those peers hold replicas of' if cfg.peers else ''} until a "
                       "listing succeeds")
                log.error("%s", msg)
                self.tell(EXIT_STORE, msg)
                fuse.terminate()
                return
            log.warning("mounting without the store's sets (--allow-empty-namespace): %s;"
                        " they appear once a listing succeeds%s", why, peers)
        register(cfg)
        # systemd first: the mount helper exits once told below, and systemd must know the
        # daemon as the unit's main process by then (ckptfs@.service, NotifyAccess=all)
        self.sd.ready(self.status_line())
        self.serving.set()
        self.tell(EXIT_OK, f"mounted {cfg.mountpoint}{' read-only' if cfg.read_only else ''}"
                  f" (cache {cfg.cache_dir}, store "
                  f"{self.store_url}{self._default_note()}, pid {os.getpid()})")

    async def _sets_from_peers(self) -> str:
        """The store could not be listed: one ask of the peers for the replicas they hold
        (cachemgr.tiering.peernamespace), bounded; what it showed, for the log line."""
        import trio

        space = self.engine.peer_namespace
        if space is None:
            return ""
        with trio.move_on_after(FIRST_LISTING_TIMEOUT_S):
            try:
                answered = await space.pass_once()
            except Exception:  # a bug must not fail the mount: the supervised pass retries
                log.exception("asking the peers for their replicas failed")
                return "; asking the peers failed (see above)"
            shown = space.statistics().shown_sets
            return f"; {answered} peer(s) answered, {shown} set(s) shown from their replicas"
        return "; the peers did not answer in time"

    def status_line(self) -> str:
        """STATUS= for `systemctl status`: what is served and what a lost cache disk would
        take with it (README "Status")."""
        try:
            st = self.engine.statistics()
        except Exception:  # a status line must never take the mount down
            log.exception("STATUS= line: the engine statistics failed")
            return f"serving {self.cfg.mountpoint}"
        sets = st.sets
        by_state = sets.sets.by_state
        pending = sum(by_state.get(k, 0) for k in ("committed", "uploading"))
        durable = by_state.get("durable", 0)
        line = (f"serving {self.cfg.mountpoint}: {durable} set{'' if durable == 1 else 's'} "
                f"durable, {pending} pending ({human(sets.sets.pending_bytes)} not yet durable)")
        if sets.failed_sets:
            line += (f", {sets.failed_sets} FAILED ({human(sets.failed_bytes)} only in "
                     "the cache)")
        return line + f", store {st.store.health}"

    async def _report_status(self) -> None:
        """STATUS= every STATUS_INTERVAL_S once the mount is ready; only sent when the line
        changed."""
        import trio

        await self.serving.wait()
        while True:
            await trio.sleep(STATUS_INTERVAL_S)
            self.sd.status(self.status_line())

    def _reload(self) -> None:
        """SIGHUP: reopen the log file (logrotate renamed it); the mount keeps serving. Before
        the mount is ready, systemd hears nothing of it: a READY=1 now would say the mount
        answers when it does not yet."""
        ready = self.serving.is_set()
        if ready:
            self.sd.reloading(f"reloading: reopening the log of {self.cfg.mountpoint}")
        try:
            paths = reopen_logs()
            log.info("SIGHUP: reopened the log file %s", ", ".join(paths) or "(none: stderr)")
        except OSError as e:
            log.error("SIGHUP: cannot reopen the log file (%s); logging on to the old one", e)
        if ready:
            self.sd.reloaded(self.status_line())

    async def _on_signals(self) -> None:
        import trio

        from . import fuse

        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for sig in sigs:
                if sig == signal.SIGHUP:
                    self._reload()
                    continue
                log.info("signal %s: unmounting", signal.Signals(sig).name)
                self.sd.stopping(f"unmounting {self.cfg.mountpoint} (signal "
                                 f"{signal.Signals(sig).name})")
                fuse.terminate()
                return

    # -- teardown --------------------------------------------------------------------------------

    def teardown(self) -> None:
        """Undo the start steps that ran, in reverse; a failing step is logged, the rest run."""
        from . import fuse

        self.stallwatch.stop()
        if self.metrics_server is not None:
            try:
                self.metrics_server.close()  # first: no scrape waits on a loop that has ended
            except Exception:
                log.exception("stopping the metrics server failed")
        if self.mounted:
            try:
                fuse.close_session(unmount=True)
            except Exception:
                log.exception("closing the FUSE session failed")
        if self.engine is not None:
            try:
                self._warn_unsaved()
            except Exception:
                log.exception("counting the files in no committed set failed")
        if self.core is not None or self.cache is not None:
            try:
                (self.core or self.cache).close()
            except Exception:
                log.exception("closing the cache failed")
        unregister(self.cfg.mountpoint)
        self.lock.release()
        log.info("daemon exiting")


    def _warn_unsaved(self) -> None:
        """One log line at the end when closed files in no committed set stay behind: nothing
        uploads them, and a lost cache dir takes them (docs/SEMANTICS.md "Files in no set")."""
        u = self.engine.sets.unsaved(5)
        if u.files:
            more = f" and {u.files - len(u.paths)} more" if u.files > len(u.paths) else ""
            log.warning("%d file(s) (%d bytes) in no committed set stay only in this cache "
                        "dir: %s%s", u.files, u.bytes, ", ".join(u.paths), more)


def run_daemon(cfg: MountConfig, notify: Notify) -> int:
    """Run one mount until it is unmounted. `notify(code, msg)` is called exactly once: with
    EXIT_OK when the mount is ready, or with the error code before returning it."""
    import trio

    from cachemgr.host import allocator

    allocator.tune()  # before any thread: restore buffers reused, not mapped afresh each time
    d = _Daemon(cfg, notify)
    try:
        d.take_lock()        # 1
        d.bind_metrics()     # 2
        d.open_cache()       # 3
        d.open_store()       # 4
        d.build_services()   # 5
        d.mount()            # 6
        trio.run(d.serve)    # 7: until unmounted or signalled
        log.info("FUSE loop ended")
        return EXIT_OK
    except _StartFailed as e:
        log.error("%s", e.msg)
        d.tell(e.code, e.msg)
        return e.code
    except Exception as e:
        log.exception("daemon failed")
        d.tell(EXIT_ERROR, f"daemon failed: {e}")
        return EXIT_ERROR
    finally:
        if d.locked:
            d.teardown()
