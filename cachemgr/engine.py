"""The engine: cachemgr's composition root, above every layer (docs/ARCHITECTURE.md "Layers
and modules").

`Engine` is built from the cache's owners (cachemgr.core.cache.Cache) and the object store. It
builds every service once, bottom-up, each given only the owners it uses (of the inode table,
the file cache, the raw tree, residency and the index: never the `Cache`) and its collaborators
as typed constructor arguments; no service builds another layer's services. It subscribes them
to the owners' events (an inode purged, cached bytes freed), starts their tasks in one nursery
(`run`) and answers the daemon (`status`, `statistics`, `wait`, `commit_path`). The core is
built after it, from its services: `commits` (the core's hooks), `restorer` (read-through),
`space` (room).

The order, by layer:

  cachemgr.transfer  Uploader (the bytes of one file to the store)
  cachemgr.peer      the peer socket, bound first so the member record names its port
  cachemgr.tiering   Lease, PartPublisher, Members: membership, which a restore asks for peers
  cachemgr.peer      PeerClient (chunks from peers), given the live peers by `_live_peers`
  cachemgr.restore   Restorer (read-through, prefetch), WholeFileFetcher (a whole evicted file back)
  cachemgr.tiering   RemoteSync, Replication (--replicas), PeerNamespace, Gatherer, Space,
                     Publisher, UploadQueue, Committer, Progress, History
  cachemgr.peer      PeerServer, given the chunks (`_serve_chunk`) and the replica routes

The one cycle, broken here at composition time only: the Restorer is given `make_room` and
`fetch`, delegations to `Space` and `WholeFileFetcher`, which are built after it from its `forget`.
What a lower layer asks of a higher one (the live peers, a chunk a replica holds, room) is a
typed callable it declares, which the engine binds; the lower layer never sees the service.

The services of tiering (each module's docstring states its invariants, what guards them and
its crash states):

  cachemgr.tiering.signals   Signals (the wake-ups between services) and StoreHealth (last error)
  cachemgr.tiering.commit    Committer: the on_* hooks, `ckptfs commit`, crash recovery (`recover`)
  cachemgr.tiering.uploadqueue   UploadQueue: the upload queue and its `file_concurrency` workers
  cachemgr.tiering.publish   Publisher: the namespace FIFO worker: publish / unpublish / GC /
                             retention
  cachemgr.tiering.gather    Gatherer: other nodes' files of a set, before its manifest
  cachemgr.tiering.space     Space: the --cache-size / --keep-local policy, backpressure for writers
  cachemgr.tiering.progress  Progress: `ckptfs wait` and the per-set rows of status

Data flow: the core calls the synchronous hooks (`on_*`) from FUSE handlers, inside the index
transaction of the operation that triggers them (Committer); they record facts in the index
and queue work — uploads (UploadQueue) and namespace events (Publisher) — and never do I/O to
the store. An upload done tells the Publisher its set is ready; the Publisher gathers other
nodes' files if the set may have some (Gatherer), PUTs the manifest in commit order, and
applies retention (Space). Every set state change wakes the waiters (Signals.changed): `wait`
(Progress) and writers waiting for room (Space).

Everything runs on the trio thread; no service's state is touched from another thread. Tasks,
all in one nursery, started in this order: the restorer, remote sync, (registration), the
upload workers, the namespace worker, history, the part records publisher, membership, and
with --peers the peer server, replication and the peer namespace. Teardown: all are cancelled
when the FUSE loop ends (then membership leaves, shielded); everything they did not finish is
resumed from the index at the next mount (`Committer.recover`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from cachemgr.core.hooks import KernelNotifier
from cachemgr.core.sets import LIVE_STATES, SetRegistry, SetStats, Unsaved
from cachemgr.format.objects import StoredObject
from cachemgr.host import background
from cachemgr.host.foreground import Foreground
from cachemgr.peer import server as peerserve
from cachemgr.peer.client import PeerClient, PeerClientStats
from cachemgr.peer.proto import PeerConfig, PeerEndpoint
from cachemgr.restore.chunkfetch import ChunkStats
from cachemgr.restore.restorer import Restorer
from cachemgr.restore.wholefile import FetchStats, WholeFileFetcher
from cachemgr.store import DeadlineExceeded, ObjectStore, StoreError
from cachemgr.store.base import RetryStats
from cachemgr.tiering.commit import CommitStats, Committer
from cachemgr.tiering.gather import Gatherer, GatherStats
from cachemgr.tiering.history import History, HistoryStats
from cachemgr.tiering.lease import Lease
from cachemgr.tiering.members import Members, MemberStats
from cachemgr.tiering.parts import PartPublisher
from cachemgr.tiering.peernamespace import PeerNamespace, PeerSpaceStats
from cachemgr.tiering.progress import Probes, Progress, ProgressStats, Reply, StuckSet
from cachemgr.tiering.progress import stuck_after as stuck_threshold
from cachemgr.tiering.publish import Publisher, PublishStats
from cachemgr.tiering.remote import RemoteSync
from cachemgr.tiering.replicaproto import REPLICA_PREFIX
from cachemgr.tiering.replicate import ReplicaHolder, ReplicaOrigin, ReplicaStats, Replication
from cachemgr.tiering.signals import Signals, StoreHealth
from cachemgr.tiering.space import Space, SpaceStats
from cachemgr.tiering.takeover import Takeover, TakeoverRecords
from cachemgr.tiering.uploadqueue import UploadQueue, UploadQueueStats
from cachemgr.transfer.upload import TransferConfig, Uploader

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from cachemgr.core.cache import Cache

__all__ = ["Engine", "EngineConfig"]

log = logging.getLogger(__name__)

# status lists at most this many failed sets (it counts them all: failed_sets, failed_bytes)
FAILED_SHOWN = 20
# The peer client's listing of the live members (one LIST of members/ and a GET of each new
# member's record) is given up after this: a restore then asks the peers the namespace answers
# named, or the store (cachemgr.peer.client holds no fetch behind it once it has a list).
# One store LIST page's deadline (s3.Deadlines.list_page, 15 s) less a margin: a listing that
# took longer than one page's worth on one try is an outage, not a slow page.
PEER_LISTING_DEADLINE_S = 10.0


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """`Engine.services()`: each tiering service's own statistics (status and metrics show
    them as "services")."""

    commit: CommitStats
    publish: PublishStats
    gather: GatherStats
    space: SpaceStats
    fetch: FetchStats
    progress: ProgressStats
    history: HistoryStats


@dataclass(frozen=True, slots=True)
class PeerStats:
    """`Engine.peers_statistics()` (--peers): what this node served and restored from peers
    vs the store; `as_json` is status's "peers"."""

    replication: ReplicaStats | None   # None: --replicas 0
    server: peerserve.PeerServerStats | None
    client: PeerClientStats | None
    namespace: PeerSpaceStats | None
    chunks: ChunkStats                 # the restores: from peers and from the store

    def as_json(self) -> dict[str, object]:
        c = self.chunks
        return {"replication": _json(self.replication), "server": _json(self.server),
                "restored_from_peers": {"bytes": c.peer_bytes, "chunks": c.peer_chunks},
                "restored_from_store": {"bytes": c.bytes_fetched, "chunks": c.chunks_fetched},
                "namespace": _json(self.namespace), "client": _json(self.client)}


@dataclass(frozen=True, slots=True)
class SetTotals:
    """`EngineStats.sets`: the sets over every set (not only the recent ones), and what is at
    risk (failed, unsaved, stuck)."""

    sets: SetStats
    failed_sets: int        # failed for good and not replaced since (Progress.failed_sets)
    failed_bytes: int
    unsaved: Unsaved        # closed files in no committed set
    stuck_after_s: float
    stuck_sets: int         # how many; `stuck` names the oldest STUCK_SHOWN
    stuck: list[StuckSet]


@dataclass(frozen=True, slots=True)
class StoreTotals:
    """`EngineStats.store`: the store's health and the retry layer's counters (copies)."""

    health: str
    consecutive_failures: int
    retry: RetryStats | None  # None: a bare store (no retry layer)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """`Engine.statistics()`: counters and totals for metrics (ckptfs.metrics) and the
    daemon's STATUS= line. Plain copies: the caller may keep them (another thread reads them)
    after the loop has moved on."""

    sets: SetTotals
    store: StoreTotals
    uploads: UploadQueueStats
    restore: ChunkStats
    cache_size: int | None
    members: MemberStats      # this node's lease (ckptfs_lease_held, ckptfs_lease_lapses_total)
    peers: PeerStats | None   # None: no --peers
    services: ServiceStats


def _json(stats: DataclassInstance | None) -> dict[str, object] | None:
    """A statistics dataclass (or None) as JSON-ready dicts."""
    return None if stats is None else asdict(stats)


@dataclass(frozen=True)
class EngineConfig:
    transfer: TransferConfig = field(default_factory=TransferConfig)
    file_concurrency: int = 4        # files uploading at once (each with its parts in flight)
    cache_size: int | None = None    # bytes of file data kept in the cache before eviction
    keep_local: int | None = None    # keep data of only the newest N durable sets locally
    retry_pause: float = 1.0         # pause before re-queueing an upload that failed
    # restore policy (cachemgr.restore.restorer): auto, set, file, reads or none (--prefetch)
    prefetch: str = "auto"
    prefetch_concurrency: int = 8    # GETs in flight per prefetch (memory: x prefetch_range)
    prefetch_range: int = 64 << 20   # bytes per prefetch GET (runs of adjacent chunks)
    refresh_interval: float = 10.0   # seconds between listings of the store's manifests
    commit_timeout: float = 1800.0   # a commit waiting for other nodes' files fails after this
    gather_poll: float = 5.0         # longest pause between listings of other nodes' records
    lease: float = 120.0             # a node's membership lapses this long after its last renewal
    register_timeout: float = 20.0   # the mount waits at most this to register (tiering.members)
    # A read-only mount (ckptfs --read-only): only the services that read the store run (the
    # restorer, remote sync); nothing uploads, publishes, deletes or registers, and no member
    # record is written: the node writes no file, so no commit elsewhere needs to wait for it.
    read_only: bool = False
    # How long the index remembers sets that ended (cachemgr.tiering.history): the newest
    # `history_keep` sets and those committed in the last `history_age` seconds always stay.
    history_keep: int = 200
    history_age: float = 300.0
    # --peers: restore from and serve to other nodes (cachemgr.peer)
    peers: PeerConfig | None = None
    # --replicas K: buddies every committed set is copied to before the store has it
    # (cachemgr.tiering.replicate); 0: off. Only with `peers`.
    replicas: int = 0


class Engine:
    """Every service of a mount, built and run (see the module docstring)."""

    def __init__(self, cache: Cache, store: ObjectStore, cfg: EngineConfig, *,
                 foreground: Foreground, kernel: KernelNotifier) -> None:
        self.cache = cache
        self.index = cache.index
        self.sets = SetRegistry(self.index)
        self.store = store
        self.cfg = cfg
        self.node: str = self.index.meta("node_id") or "node"
        self.signals = Signals()
        self.store_health = StoreHealth()
        self._parts = trio.CapacityLimiter(max(1, cfg.transfer.max_parts_in_flight))
        self.uploader = Uploader(store, cfg.transfer, self._parts, foreground=foreground)
        # The room and fetch calls go through this object's delegations because Space and
        # WholeFileFetcher are built after the restorer (they take its `forget`): a cycle broken at
        # composition time only. --peers: the socket is bound first, so the member record
        # names its port.
        peer_sock = None if cfg.peers is None or cfg.read_only else peerserve.bind(cfg.peers)
        self.lease = Lease(store=store, node=self.node, index=self.index, lease=cfg.lease,
                           register_timeout=cfg.register_timeout,
                           peer=None if peer_sock is None or cfg.peers is None else
                           (cfg.peers.advertise, peer_sock.getsockname()[1]))
        self.parts = PartPublisher(index=self.index, store=store, node=self.node,
                                   lease=self.lease, inode_if_loaded=cache.table.if_loaded,
                                   retry_pause=cfg.retry_pause,
                                   report_error=self.store_health.record)
        self.members = Members(store=store, node=self.node, index=self.index, sets=self.sets,
                               parts=self.parts, lease=self.lease,
                               poll=cfg.refresh_interval if cfg.refresh_interval > 0 else 10.0)
        # --peers: chunks from other nodes before the store; the live peers from membership
        # (or, during a store outage, the peer namespace), and first the replicas held here
        self.peer_client = None if cfg.peers is None else PeerClient(
            cfg=cfg.peers, node=self.node, live_peers=self._live_peers,
            local=self._replica_chunk)
        self.restorer = Restorer(table=cache.table, files=cache.files,
                                 residency=cache.residency, cache_dir=cache.cache_dir,
                                 index=self.index, sets=self.sets, store=store,
                                 cache_size=cfg.cache_size, make_room=self.make_room,
                                 fetch_whole=self.fetch, live_members=self.members.live,
                                 peers=self.peer_client,
                                 concurrency=cfg.prefetch_concurrency, mode=cfg.prefetch,
                                 range_size=cfg.prefetch_range)
        self.remote = RemoteSync(table=cache.table, tree=cache.tree, index=self.index,
                                 sets=self.sets, store=store, kernel=kernel, node=self.node,
                                 interval=cfg.refresh_interval,
                                 mark_parts=self.parts.mark_all, changed=self.signals.changed_now)
        self.replication = None if peer_sock is None or cfg.peers is None or \
            cfg.replicas <= 0 else self._replication(cfg.peers, peer_sock.getsockname()[1])
        # --peers: the sets peers hold replicas of, shown while the store cannot be listed
        self.peer_namespace = None if cfg.peers is None else PeerNamespace(
            cfg=cfg.peers, node=self.node, remote=self.remote, sets=self.sets,
            interval=cfg.refresh_interval,
            local=None if self.replication is None else self.replication.holder.manifests)
        self.peer_server = None if peer_sock is None or cfg.peers is None else \
            peerserve.PeerServer(cfg=cfg.peers, sock=peer_sock,
                                 serve_chunk=self._serve_chunk,
                                 routes={} if self.replication is None else
                                 {REPLICA_PREFIX: self.replication.route})
        self._build_services()
        self.running = False

    def _replication(self, peers: PeerConfig, port: int) -> Replication:
        """--replicas K (cachemgr.tiering.replicate): this node as an origin and as a buddy."""
        cache, cfg = self.cache, self.cfg

        async def upload(path: str, key: str, size: int) -> StoredObject:
            return await self.uploader.upload_file(path, key, size=size)

        return Replication(
            ReplicaOrigin(index=self.index, sets=self.sets, files=cache.files, node=self.node,
                          lease=self.lease, members=self.members, cfg=peers, k=cfg.replicas,
                          endpoint=(peers.advertise, port), signals=self.signals,
                          interval=cfg.refresh_interval if cfg.refresh_interval > 0 else 10.0),
            ReplicaHolder(cache_dir=cache.cache_dir, node=self.node, cfg=peers,
                          store=self.store, files=cache.files, cache_size=cfg.cache_size,
                          interval=cfg.refresh_interval if cfg.refresh_interval > 0 else 10.0,
                          takeover=Takeover(store=self.store, node=self.node, lease=self.lease,
                                            live=self.members.live, upload=upload,
                                            records=TakeoverRecords(cache.cache_dir /
                                                                    "replicas")),
                          known_durable=self._known_durable, owned=self._owned))

    def _owned(self, path: str, keys: set[str]) -> set[str]:
        """Those of `keys` this node's index owns (its objects table), a kept set here names,
        or another manifest of the store names (as of the last listing): objects a takeover
        record's sweep must not delete (cachemgr.tiering.takeover)."""
        mine = {k for k in keys if self.sets.object_content(k) is not None}
        return mine | self.sets.keys_named_by_others(-1, keys) | \
            self.remote.keys_named_elsewhere(path, keys)

    async def _live_peers(self, stale: frozenset[str]) -> list[PeerEndpoint]:
        """The live peers for restores: the members listing (Members.peers), within
        PEER_LISTING_DEADLINE_S; while the store cannot be listed or does not answer, the peers
        the namespace answers named (PeerNamespace), at once while the store's last listing
        failed (a fresh node during an outage must not wait a listing deadline per restore)."""
        ns = self.peer_namespace
        if ns is not None and ns.known and self.remote.failed_listings:
            return ns.known_peers(stale)
        try:
            with trio.move_on_after(PEER_LISTING_DEADLINE_S):
                return await self.members.peers(stale)
            raise DeadlineExceeded(f"the members listing: no answer within "
                                   f"{PEER_LISTING_DEADLINE_S:.0f}s")
        except StoreError:
            if self.peer_namespace is None or not self.peer_namespace.known:
                raise
            return self.peer_namespace.known_peers(stale)

    async def _replica_chunk(self, key: str, crc: int, index: int) -> bytes | None:
        """A chunk of a replica this node holds (ReplicaHolder.serve_chunk), for its own
        restores: a buddy resuming from the set it holds a replica of."""
        if self.replication is None:
            return None
        raw: bytes | None = await self.replication.holder.serve_chunk(key, crc, index)
        return raw

    async def _serve_chunk(self, key: str, crc: int, index: int) -> bytes | None:
        """GET /v1/chunk: a chunk of a replica held here (its virtual object), else one this
        cache holds verified (ChunkFetcher.serve_chunk)."""
        raw = await self._replica_chunk(key, crc, index)
        return raw if raw is not None else \
            await self.restorer.chunks.serve_chunk(key, crc, index)

    def _known_durable(self, path: str, committed_ns: int) -> bool:
        """Does this node's registry hold a durable set of `path` committed at or after
        `committed_ns` (its own, or one the last listing restored here)?"""
        s = self.sets.newest_at(path)
        return s is not None and s.state == "durable" and s.committed_ns >= committed_ns

    def _build_services(self) -> None:
        """The rest of tiering's services and the fetcher, each given its collaborators (see
        the module docstring)."""
        cfg, restorer, parts, cache = self.cfg, self.restorer, self.parts, self.cache
        self.gatherer = Gatherer(
            table=cache.table, files=cache.files, index=self.index, sets=self.sets,
            store=self.store, node=self.node, signals=self.signals,
            ensure_all=restorer.ensure_all, commit_acks=self.members.commit_acks,
            commit_timeout=cfg.commit_timeout, gather_poll=cfg.gather_poll)
        self.space = Space(
            files=cache.files, residency=cache.residency, sets=self.sets, signals=self.signals,
            forget=restorer.forget, drop_partials=restorer.drop_partials,
            cache_size=cfg.cache_size, keep_local=cfg.keep_local,
            replicas=None if self.replication is None else self.replication.holder)
        self.publisher = Publisher(
            index=self.index, sets=self.sets, store=self.store, node=self.node,
            signals=self.signals, health=self.store_health, gatherer=self.gatherer,
            complete_local=self.remote.complete_local,
            keys_named_elsewhere=self.remote.keys_named_elsewhere,
            retention=self.space.retention, retry_pause=cfg.retry_pause,
            fence=self.lease.ensure,
            lease_epoch=lambda: self.lease.generation if self.lease.holds() else None)
        self.uploads = UploadQueue(
            table=cache.table, files=cache.files, index=self.index, sets=self.sets,
            uploader=self.uploader, node=self.node, signals=self.signals,
            health=self.store_health, mark_dir=parts.mark,
            dir_published=lambda ino: ino in parts.published, ready=self.publisher.publish,
            verified=self.publisher.verified, gc=self.publisher.gc, spawn=self.publisher.spawn,
            retry_pause=cfg.retry_pause)
        self.commits = Committer(
            table=cache.table, index=self.index, sets=self.sets, uploads=self.uploads,
            publisher=self.publisher, signals=self.signals, forget=restorer.forget,
            written=restorer.clean.add, mark_dir=parts.mark, mark_moved=parts.mark_moved)
        self.fetcher = WholeFileFetcher(
            table=cache.table, files=cache.files, residency=cache.residency, index=self.index,
            store=self.store, wait_for_room=self.space.wait_for_room, obj_of=restorer.obj_of,
            forget=restorer.forget)
        self.progress = Progress(table=cache.table, index=self.index, sets=self.sets,
                                 signals=self.signals, waiting_for=self.gatherer.waiting,
                                 blocked_by=self.publisher.blocked_by)
        self.history = History(index=self.index, sets=self.sets, signals=self.signals,
                               held=[self.publisher.held_seqs, self.gatherer.held_seqs,
                                     self.progress.held_seqs],
                               keep_recent=cfg.history_keep, keep_age=cfg.history_age)
        # what the cache's owners tell: an inode purged (a partly restored file's chunks go
        # with it, GC looks again), cached bytes freed (writers waiting for room look again)
        cache.table.on_purged(self.commits.on_purge)
        cache.files.on_space_freed(self.signals.changed_now)

    # ==========================================================================================
    # the service

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.commits.recover()
        if self.cfg.read_only:
            await self._run_read_only(task_status)
            return
        try:
            async with trio.open_nursery() as nursery:
                # The first listing runs while the node registers: both wait on the store, and
                # a store that does not answer must cost a mount one of their deadlines, not
                # both in a row (issue 36: a fresh node mounts within 60 s of a black hole).
                await nursery.start(self.restorer.run)  # what the listing may prefetch with
                nursery.start_soon(self._supervised, self.remote.run)
                await self.members.register()  # before the first request is served
                self.running = True
                for _ in range(max(1, self.cfg.file_concurrency)):
                    nursery.start_soon(self._supervised, self.uploads.worker)
                nursery.start_soon(self._supervised, self.publisher.worker)
                nursery.start_soon(self._supervised, self.history.run)
                nursery.start_soon(self._supervised, self.parts.run)
                nursery.start_soon(self._supervised, self.members.run)
                if self.peer_server is not None:
                    nursery.start_soon(self._supervised, self.peer_server.run)
                if self.replication is not None:
                    nursery.start_soon(self._supervised, self.replication.run)
                if self.peer_namespace is not None:
                    nursery.start_soon(self._supervised, self.peer_namespace.run)
                task_status.started()
        finally:
            self.running = False
            with trio.CancelScope(shield=True):
                await self.members.leave()

    async def _run_read_only(self, task_status: Any) -> None:
        """`run` of a read-only mount: the store is read, never written (EngineConfig); what
        recovery queued stays queued for the next read-write mount of this cache."""
        self.running = True
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.restorer.run)
                nursery.start_soon(self._supervised, self.remote.run)
                if self.peer_namespace is not None:
                    nursery.start_soon(self._supervised, self.peer_namespace.run)
                task_status.started()
        finally:
            self.running = False

    async def _supervised(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run a worker forever: a bug in tiering must never take the mount down with it.
        The failure is logged with its traceback and shown in status; the worker restarts."""
        while True:
            try:
                await fn()
                return
            except Exception as e:
                self.store_health.failed(f"internal: {e!r}")
                log.exception("tiering worker %s failed; restarting it", fn.__name__)
                await trio.sleep(self.cfg.retry_pause)

    # ==========================================================================================
    # what the daemon asks

    def commit_path(self, path: str) -> int:
        return self.commits.commit_path(path)

    def leave_by(self, seconds: float) -> None:
        """The unmount that follows leaves the store's members within `seconds`
        (Members.leave_by: what an `umount --timeout` has left)."""
        self.members.leave_by(seconds)

    # -- space and read-through: cachemgr.tiering.space, cachemgr.restore.wholefile ----------------

    def make_room(self, need: int, protect: set[int] | frozenset[int] = frozenset()) -> bool:
        return self.space.make_room(need, protect)

    async def fetch(self, ino: int) -> None:
        await self.fetcher.fetch(ino)

    # ==========================================================================================
    # questions

    async def wait(self, path: str, timeout: float | None) -> Reply:
        return await self.progress.wait(path, timeout)

    async def wait_replicated(self, path: str, timeout: float | None) -> Reply:
        """`ckptfs wait --replicated`: until the set holding `path` is held by K buddies, or
        durable (state "replicated" / "durable"; "off" without --replicas)."""
        if self.replication is None:
            return {"state": "off", "error": "replication is off on this mount (it needs "
                    "--peers and --replicas K > 0)"}
        rep = self.replication.origin
        # a set shown from the replicas peers hold (cachemgr.tiering.peernamespace) is replicated
        return await self.progress.wait_until(
            path, timeout, lambda s: "replicated" if s.state == "replicated" or (
                s.state in LIVE_STATES and rep.replicated(s.seq)) else None, "replicated")

    def services(self) -> ServiceStats:
        """Each tiering service's own statistics (status and metrics show them as "services")."""
        return ServiceStats(commit=self.commits.statistics(),
                            publish=self.publisher.statistics(),
                            gather=self.gatherer.statistics(), space=self.space.statistics(),
                            fetch=self.fetcher.statistics(), progress=self.progress.statistics(),
                            history=self.history.statistics())

    def _probes(self, uploads: UploadQueueStats) -> Probes:
        return Probes(uploads=uploads, health=self.store_health,
                      gathering=self.gatherer.gathering,
                      publish_queued=self.publisher.publish_queued,
                      publishing=self.publisher.publishing)

    def status(self, limit: int = 50, stuck_after: float | None = None) -> dict[str, object]:
        """`ckptfs status --json`'s "tiering" (a JSON document; docs/ARCHITECTURE.md
        "Status"). `stuck_after`: the stuck threshold in seconds (None: the mount's,
        cachemgr.tiering.progress.stuck_after of --commit-timeout)."""
        sets, pending = self.progress.set_rows(limit)
        if self.replication is not None:
            for row in sets:
                if row["origin"] == "local":
                    self.replication.set_fields(row)
        live = self.sets.by_states(LIVE_STATES)
        after_s = stuck_threshold(self.cfg.commit_timeout) if stuck_after is None else stuck_after
        up = self.uploads.statistics()
        nstuck, stuck = self.progress.stuck_sets(after_s, self._probes(up))
        failed = self.progress.failed_sets()
        retry = self.store.retry_statistics()  # transient errors ridden out (None: no retries)
        first_waiting = self.gatherer.first_waiting()
        h = self.store_health
        found = self.store.conditional  # docs/STORES.md: probed at mount, None until then
        restore = self.restorer.statistics()
        unsaved = self.sets.unsaved(FAILED_SHOWN)
        peers = self.peers_statistics()
        return {
            "store": {"url": self.store.url, "node": self.node, "health": h.health(),
                      "conditional_writes": None if found is None else {
                          "honoured": found.honoured, "if_none_match": found.if_none_match,
                          "if_match": found.if_match, "etag_form": found.etag_form,
                          "missing_if_match": found.missing_if_match,
                          "summary": found.describe()},
                      "last_error": h.last_error, "consecutive_failures": h.consecutive_failures,
                      "retries": 0 if retry is None else retry.retries,
                      "retry_failures": 0 if retry is None else retry.failures,
                      # which client moves data bytes (docs/ARCHITECTURE.md "Store data
                      # path"): sendfile, crt-up, crt, boto3, local; and its counters
                      "data_path": self.store.data_path,
                      "data_client": self.store.data_statistics().as_json()},
            # upload threads at idle CPU and I/O priority (cachemgr.host.background; root only)
            "uploads": {"queued": up.queued, "running": up.running, "done": up.done,
                        "cancelled": up.cancelled, "bytes_uploaded": up.bytes,
                        "rate_bytes_per_s": up.rate_bytes_per_s,
                        "idle_priority": background.enabled()},
            # the chunk fetcher's and the prefetcher's statistics side by side
            "restore": {**asdict(restore.chunks), **asdict(restore.prefetch)},
            "filecache": asdict(self.cache.files.statistics()),
            "remote": asdict(self.remote.statistics()),
            "parts": asdict(self.parts.statistics()),
            "members": self.members.statistics().as_json(),
            "peers": None if peers is None else peers.as_json(),
            "pending_sets": len(live),
            # deletions whose manifest waits for sets committed before them (commit order)
            "deletes_waiting": self.publisher.deletes_waiting(),
            # of which waiting for files other nodes write, or published after such a set
            # (commit order): nothing this node can finish
            "waiting_sets": len([s for s in live if first_waiting is not None and
                                 s.seq >= first_waiting]),
            "pending_bytes": pending,
            # failed for good and not replaced since (Progress.failed_sets): also at risk, and
            # no upload will ever make them durable; the first FAILED_SHOWN of them, oldest first
            "failed_sets": len(failed),
            "failed_bytes": sum(f.bytes for f in failed),
            "failed": [asdict(f) for f in failed[:FAILED_SHOWN]],
            # closed files in no committed set (SetRegistry.unsaved): at risk too, and nothing
            # will upload them as they are; the first FAILED_SHOWN paths; `handed_files`: how
            # many of them are in the store, named in a part record for a commit on another node
            "unsaved_files": unsaved.files, "unsaved_bytes": unsaved.bytes,
            "unsaved": unsaved.paths, "handed_files": unsaved.handed,
            # when the oldest pending set was committed (None: none), whatever its position
            "oldest_pending_committed_ns": min((s.committed_ns for s in live), default=None),
            # pending longer than stuck_after_s (cachemgr.tiering.progress.stuck_sets), over every
            # set: how many, and the oldest STUCK_SHOWN, each a row of "sets" with age_s, waits_for
            # (cachemgr.tiering.progress.WAITS_FOR) and why (one line) added
            "stuck_after_s": after_s,
            "stuck_sets": nstuck,
            "stuck": stuck,
            "sets": sets,
            "services": asdict(self.services()),
        }

    def statistics(self, stuck_after: float | None = None) -> EngineStats:
        """Counters and totals for metrics (ckptfs.metrics): what `status` shows, over every set
        instead of the recent ones, and without per-set detail but the stuck sets' names and
        why (at most STUCK_SHOWN). Plain data, copied: the caller may keep it after the loop
        has moved on. `stuck_after` as in `status`."""
        retry = self.store.retry_statistics()  # None: a bare store (no retry layer)
        failed = self.progress.failed_sets()
        after_s = stuck_threshold(self.cfg.commit_timeout) if stuck_after is None else stuck_after
        up = self.uploads.statistics()
        nstuck, stuck = self.progress.stuck_sets(after_s, self._probes(up))
        return EngineStats(
            sets=SetTotals(sets=self.sets.statistics(), failed_sets=len(failed),
                           failed_bytes=sum(f.bytes for f in failed),
                           unsaved=self.sets.unsaved(FAILED_SHOWN), stuck_after_s=after_s,
                           stuck_sets=nstuck, stuck=[StuckSet.of(x) for x in stuck]),
            store=StoreTotals(
                health=self.store_health.health(),
                consecutive_failures=self.store_health.consecutive_failures,
                retry=None if retry is None else RetryStats(
                    calls=retry.calls, retries=retry.retries, failures=retry.failures,
                    by_error=dict(retry.by_error), by_op=dict(retry.by_op),
                    errors=dict(retry.errors))),
            uploads=up, restore=self.restorer.statistics().chunks, cache_size=self.cfg.cache_size,
            members=self.members.statistics(), peers=self.peers_statistics(),
            services=self.services())

    def replication_statistics(self) -> ReplicaStats | None:
        """--replicas: this node's sets held by buddies and what it holds for others (None:
        off)."""
        if self.replication is None:
            return None
        return self.replication.statistics(
            lambda: [s.seq for s in self.sets.by_states(LIVE_STATES) if s.origin == "local"])

    def peers_statistics(self) -> PeerStats | None:
        """--peers: what this node served and restored from peers vs the store (None: off)."""
        if self.cfg.peers is None:
            return None
        client = self.peer_client
        return PeerStats(
            replication=self.replication_statistics(),
            server=None if self.peer_server is None else self.peer_server.statistics(),
            client=None if client is None else client.statistics(),
            namespace=None if self.peer_namespace is None else self.peer_namespace.statistics(),
            chunks=self.restorer.statistics().chunks)

