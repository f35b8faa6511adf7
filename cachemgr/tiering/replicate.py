"""Replicated before durable (--replicas K, docs/ARCHITECTURE.md "Peers", docs/SEMANTICS.md
"Replicated"): every set this node commits is copied, in the background and in commit order,
to K buddies (cachemgr.tiering.replicaproto.buddies: the peers of highest rendezvous weight for
this node's id), before the store has it. Never on the trainer's path: the hooks that commit a
set do nothing here; this service reads the committed sets from the index and offers them.

Protocol (the peer port of --peers, cachemgr.peer.server; routes in cachemgr.tiering.replicaproto):

  * the origin POSTs an offer (`/v1/replica/offer`): the set's descriptor, the entries its
    manifest would hold (files with rel/size/mode/mtime, dirs, symlinks), its seq, commit time,
    the origin's id, generation and peer endpoint; validated on receipt
    (cachemgr.format.validate.replica_offer: paths inside the set, sizes bounded);
  * the buddy answers 200 (held), 202 (pulling: the origin offers again every OFFER_POLL_S),
    507 (no room: the origin asks the next peer in rendezvous order), 400 (refused);
  * the buddy pulls each file by range (`/v1/replica/file?seq&i&off&len`, MAX_RANGE bytes):
    the origin serves exactly the committed content version (410 once the file changed: the
    newer commit is offered in its turn) with the range's CRC32C, which the buddy checks;
  * the buddy writes under `<cache>/replicas/<origin>/<seq>.part/<i>` (file names are indices,
    never names from the request), fsyncs each file, writes `descriptor.json` (fsynced), renames
    the directory to `<seq>` and fsyncs its parent: a replica is held iff that directory
    exists. The next offer is then answered 200 and the origin counts the buddy.

Bounds: offers queue at most MAX_QUEUED per buddy (503 beyond); replica bytes held or being
pulled count against the buddy's --cache-size with its own cached bytes (or its disk's free
space less DISK_RESERVE without one): 507 when an offer would not fit. A buddy drops a replica
once the store holds that path's manifest committed at or after it, or its origin's newer
commit of the same path is held.

Holders are confirmed (`ReplicaOrigin._confirm`): a buddy counted for a set not durable yet
is offered it again every CONFIRM_S (or --refresh-interval if shorter); an answer other than
200, or none, stops counting it (its notice of a drop was lost, it restarted without its cache
dir, it is gone), and the set is offered again by the rules above until K buddies hold it.

State, its owner and its guards (all on the daemon's trio thread, no await between a read and
its update): `ReplicaOrigin.holders` (seq -> buddies holding it; in memory: after a restart the
origin offers again and buddies that hold it answer 200 at once), `_pulling` (seq -> buddies
pulling it), `_answered` ((seq, buddy) -> when and where it last answered 200), `_peers` (the
last listing of live peers, replaced whole by `_list_loop`); `ReplicaHolder.held` / `pulling`
((origin, seq) -> descriptor) and the byte counts. Durable: the index's meta row
`replica_peers` (the peers this node last asked first, at most K + EXTRA_ASKED, JSON), read at
start, so an origin that restarts while the store is down offers to them at once.
Crash states: a `<seq>.part` directory (a pull cut short) is removed at the next start; a
`<seq>` directory without a readable descriptor is removed too.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from cachemgr.core.errors import IndexFull
from cachemgr.core.sets import LIVE_STATES, SetRegistry
from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.format.decode import crc32c, crc32c_combine
from cachemgr.format.keys import manifest_key
from cachemgr.format.objects import StoredObject, chunk_count, chunk_span, verify_chunk
from cachemgr.host.nodefiles import fsync_dir
from cachemgr.peer.client import PeerFault, request
from cachemgr.peer.proto import PeerConfig, PeerEndpoint, sign_response
from cachemgr.store import NotFound, ObjectStore, StoreError
from cachemgr.tiering.replicaproto import (
    DROPPED_ROUTE,
    FILE_ROUTE,
    H_CRC,
    MAX_NAMESPACE_BYTES,
    MAX_RANGE,
    NAMESPACE_ROUTE,
    OFFER_ROUTE,
    buddies,
    file_target,
    parse_file_target,
)
from cachemgr.tiering.takeover import Owned, Takeover, replica_manifest, sweep

if TYPE_CHECKING:
    from cachemgr.core.filecache import FileCache
    from cachemgr.core.index import Index
    from cachemgr.tiering.lease import Lease
    from cachemgr.tiering.members import Members
    from cachemgr.tiering.progress import SetStatusRow
    from cachemgr.tiering.signals import Signals

log = logging.getLogger(__name__)

OFFER_POLL_S = 0.5          # an origin offers a set being pulled again this often
PEER_LIST_S = 10.0          # an origin lists the live peers at most this often: 1 LIST each
MAX_QUEUED = 64             # offers a buddy queues (503 beyond)
DISK_RESERVE = 1 << 30      # free bytes a buddy without --cache-size keeps for itself
FAILED_S = 10.0             # an offer whose pull failed is refused (409) this long
EXTRA_ASKED = 3             # peers past the K buddies an origin asks per set and pass
REFUSED_S = 10.0            # a peer that refused a set (507, 409, ...) is not asked again for it
CONFIRM_S = 10.0            # an origin offers a set again to each buddy it counts this often
PEERS_META = "replica_peers"  # index meta: the peers last asked first (JSON)
DESCRIPTOR = "descriptor.json"

Reply = tuple[int, bytes, list[tuple[bytes, bytes]]]
# upload(local path, object key, size): the stored object (cachemgr.transfer.upload)
Upload = Callable[[str, str, int], Awaitable[StoredObject]]


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    replicas: int                 # K
    buddies: list[str]            # this node's K buddies (its last listing of live peers)
    replicated_sets: int          # this node's live sets held by K buddies
    offers_sent: int
    held_for_others: int          # replicas this node holds for other nodes
    replica_bytes: int
    pulling: int
    pulls_failed: int
    offers_refused: int
    dropped: int
    served_ranges: int
    taken_over: int               # replicas this node published for nodes that died


class ReplicaOrigin:
    """This node's side as an origin: offers its committed sets, serves their bytes, and
    confirms the buddies it counts (`_confirm`). Cost of the confirmations: one offer POST
    (the set's descriptor: ~100 bytes a file, at most replicaproto.MAX_OFFER_BYTES) per set per
    counted buddy per CONFIRM_S while the set is not durable; a buddy that does not answer is
    asked once per pass, not once per set."""

    def __init__(self, *, index: Index, sets: SetRegistry, files: FileCache, node: str,
                 lease: Lease, members: Members, cfg: PeerConfig, k: int,
                 endpoint: tuple[str, int], signals: Signals, interval: float) -> None:
        """`interval`: the live peers are listed this often (at most PEER_LIST_S), and each
        counted buddy is confirmed this often (at most CONFIRM_S)."""
        self.index, self.sets, self.files, self.node = index, sets, files, node
        self.interval = min(interval, PEER_LIST_S)
        self.confirm_every = min(interval, CONFIRM_S)
        self.lease, self.members, self.cfg, self.k = lease, members, cfg, k
        self.endpoint, self.signals = endpoint, signals
        self.holders: dict[int, set[str]] = {}
        self._pulling: dict[int, set[str]] = {}
        self._refused: dict[tuple[int, str], float] = {}  # (seq, node) -> until (monotonic)
        # (seq, node) -> when (monotonic) and where it last answered 200: a key per holder
        self._answered: dict[tuple[int, str], tuple[float, PeerEndpoint]] = {}
        self._remembered = index.meta(PEERS_META) or "[]"
        self._peers: list[PeerEndpoint] = self._recall()  # until a listing answers
        self.offers_sent = 0
        self.served_ranges = 0

    def held_by(self, seq: int) -> int:
        return len(self.holders.get(seq, ()))

    def replicated(self, seq: int) -> bool:
        return self.held_by(seq) >= self.k

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._list_loop)
            while True:
                await self._pass()
                with trio.move_on_after(OFFER_POLL_S):
                    await self.signals.wait_changed()

    async def _list_loop(self) -> None:
        """List the live peers every `interval`, with or without sets to offer (so the list is
        at hand when the store goes down), beside the passes, which use the last list that
        answered: a store that does not answer (its retries take seconds) never holds up an
        offer, and an outage is when replicas matter most."""
        while True:
            try:
                peers = await self.members.peers()
            except StoreError as e:
                log.debug("replicas: cannot list the members (%s): offering to the last known",
                          e)
            else:
                self._peers = peers
                self._remember(peers)
            await trio.sleep(self.interval)

    def _recall(self) -> list[PeerEndpoint]:
        """The peers this node asked first at its last listing (`PEERS_META`): a daemon that
        restarts while the store is down offers its sets to them (its buddies answer 200 at
        once for the replicas they hold)."""
        try:
            return [PeerEndpoint(n, h, p) for n, h, p in json.loads(self._remembered)
                    if isinstance(n, str) and isinstance(h, str) and type(p) is int]
        except (ValueError, TypeError):
            log.warning("replicas: index meta %s unreadable: waiting for a listing", PEERS_META)
            return []

    def _remember(self, peers: list[PeerEndpoint]) -> None:
        """Keep the peers this node asks first (at most K + EXTRA_ASKED) in the index, when
        they changed (rarely: rendezvous order moves only when one of them comes or goes)."""
        first = json.dumps([[p.node, p.host, p.port]
                            for p in buddies(self.node, peers)[:self.k + EXTRA_ASKED]])
        if first == self._remembered:
            return
        try:
            with self.index.tx():
                self.index.set_meta(PEERS_META, first)
        except IndexFull:
            log.warning("cache disk full: this node's replica buddies not kept in the index")
            return
        self._remembered = first

    def known_peers(self) -> list[PeerEndpoint]:
        """The live peers of the last listing that answered (no request)."""
        return list(self._peers)

    def buddies(self) -> list[str]:
        """This node's K buddies as of its last listing of the live peers."""
        return [p.node for p in buddies(self.node, self._peers)[:self.k]]

    async def _pass(self) -> None:
        live = [s for s in self.sets.by_states(LIVE_STATES) if s.origin == "local"]
        keep = {s.seq for s in live}
        for gone in set(self.holders) - keep:
            del self.holders[gone]
        for gone in set(self._pulling) - keep:
            del self._pulling[gone]
        self._answered = {k: v for k, v in self._answered.items()
                          if k[1] in self.holders.get(k[0], ())}
        now = time.monotonic()
        self._refused = {k: u for k, u in self._refused.items() if u > now and k[0] in keep}
        peers = self._peers
        await self._confirm([s.seq for s in live], peers)
        todo = sorted((s for s in live if not self.replicated(s.seq)), key=lambda s: s.seq)
        for s in todo:  # commit order: each buddy queues its offers in the order they come
            await self._offer(s.seq, peers)

    async def _confirm(self, seqs: list[int], peers: list[PeerEndpoint]) -> None:
        """Offer each set of `seqs` (live: not durable yet) again to each buddy counted for it
        whose last 200 is `confirm_every` old, at its endpoint in the last listing (else where
        it answered): one that answers anything but 200 is counted no more (`_send`), and this
        pass offers the set again. A buddy that does not answer at all is not asked for the
        other sets in this pass (each would wait for its timeout): it is counted for none."""
        listed = {p.node: p for p in peers}
        silent: set[str] = set()
        for seq in seqs:
            body: bytes | None = None
            for node in sorted(self.holders.get(seq, ())):
                at, where = self._answered.get((seq, node), (-1e9, listed.get(node)))
                if time.monotonic() - at < self.confirm_every:
                    continue
                where = listed.get(node, where)
                if where is None or node in silent:
                    self._count_off(seq, node, "does not answer")
                    self._refused[(seq, node)] = time.monotonic() + REFUSED_S
                    continue
                body = body or self._descriptor(seq)
                if body is None:
                    break
                if await self._send(seq, where, body) is None:
                    silent.add(node)

    def _count_off(self, seq: int, node: str, why: str) -> None:
        """`node` no longer counts as holding set `seq` (it said so, or cannot be asked)."""
        held = self.holders.get(seq, set())
        if node not in held:
            return
        held.discard(node)
        self._answered.pop((seq, node), None)
        log.info("replicas: %s no longer holds set %d (%s): %d of %d buddies hold it; offering"
                 " it again", node, seq, why, len(held), self.k)

    def _descriptor(self, seq: int) -> bytes | None:
        s = self.sets.get(seq)
        if s is None:
            return None
        layout = json.loads(s.layout or "{}")
        doc: dict[str, Any] = {
            "format": "ckptfs-replica-offer", "version": 1, "origin": self.node,
            "generation": self.lease.generation, "seq": seq, "path": s.path, "kind": s.kind,
            "committed_ns": s.committed_ns, "reason": s.reason,
            "endpoint": {"host": self.endpoint[0], "port": self.endpoint[1]},
            "files": [{"rel": f[0], "size": f[3], "mode": f[4], "mtime_ns": f[5]}
                      for f in self.sets.files(seq)],
            "dirs": layout.get("dirs", []), "symlinks": layout.get("symlinks", [])}
        if "mode" in layout:
            doc["mode"] = layout["mode"]
        if s.kind == "symlink":
            doc["target"] = layout.get("target")
        return json.dumps(doc, sort_keys=True).encode()

    async def _offer(self, seq: int, peers: list[PeerEndpoint]) -> None:
        body = self._descriptor(seq)
        if body is None:
            return
        now = time.monotonic()
        for p in buddies(self.node, peers)[:self.k + EXTRA_ASKED]:
            held = self.holders.setdefault(seq, set())
            pulling = self._pulling.setdefault(seq, set())
            if len(held) >= self.k:
                break
            if p.node in held or (len(held) + len(pulling) >= self.k and p.node not in pulling) \
                    or self._refused.get((seq, p.node), 0.0) > now:
                continue
            await self._send(seq, p, body)

    async def _send(self, seq: int, p: PeerEndpoint, body: bytes) -> int | None:
        """Offer set `seq` to `p` and record the answer (returned; None: no answer): 200 counts
        `p` as a holder; 202 marks it pulling; anything else, or none, neither (a holder counted
        until now is counted no more), and `p` is not asked for the set again for REFUSED_S."""
        try:
            status, _h, text = await request(self.cfg, p, "POST", OFFER_ROUTE, body=body,
                                             limit=4096)
        except PeerFault as e:
            log.debug("replicas: offer of set %d to %s: %s", seq, p.describe(), e)
            self._count_off(seq, p.node, f"no answer: {e}")
            self._pulling.get(seq, set()).discard(p.node)
            self._refused[(seq, p.node)] = time.monotonic() + REFUSED_S
            return None
        self.offers_sent += 1
        # read after the await: `dropped` may have changed them meanwhile
        held = self.holders.setdefault(seq, set())
        pulling = self._pulling.setdefault(seq, set())
        if status == 200:
            self._answered[(seq, p.node)] = (time.monotonic(), p)
            pulling.discard(p.node)
            if p.node not in held:
                held.add(p.node)
                if len(held) == self.k:
                    log.info("set %d replicated to %s", seq, ", ".join(sorted(held)))
                self.signals.wake_waiters()
            return status
        self._count_off(seq, p.node, f"it answered {status}")
        if status == 202:
            pulling.add(p.node)
            return status
        pulling.discard(p.node)
        self._refused[(seq, p.node)] = time.monotonic() + REFUSED_S
        log.debug("replicas: %s answered %d to the offer of set %d: %s", p.describe(),
                  status, seq, text[:200].decode("utf-8", "replace"))
        return status

    def dropped(self, body: bytes) -> Reply:
        """A buddy says it dropped its replica of set `seq` (it needed the room): one holder
        less; the next pass offers the set again (that buddy first: it answers 507 while it
        has no room, and the next peer in rendezvous order is asked)."""
        try:
            doc = json.loads(body)
            node, origin, seq = doc["node"], doc["origin"], doc["seq"]
            ok = isinstance(node, str) and origin == self.node and type(seq) is int
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return 400, b"not a notice of a dropped replica of this node", []
        held = self.holders.get(seq)
        if held is not None and node in held:
            held.discard(node)
            log.info("replicas: %s dropped its replica of set %d (%d of %d buddies hold it"
                     " now): offering it again", node, seq, len(held), self.k)
            self.signals.changed_now()
        return 200, b"noted", []

    async def serve_file(self, target: str) -> Reply:
        """A range of a committed file of a live local set, with its CRC32C; 410 once the file's
        content is no longer the committed version."""
        ask = parse_file_target(target)
        if ask is None:
            return 400, b"not a replica file request", []
        s = self.sets.get(ask.seq)
        if s is None or s.state not in LIVE_STATES or s.origin != "local":
            return 404, b"no such set here", []
        files = self.sets.files(ask.seq)
        if not 0 <= ask.index < len(files):
            return 404, b"no such file", []
        _rel, ino, version, size = files[ask.index][:4]
        if ask.off + ask.length > size:
            return 400, b"range past the end", []

        def current() -> bool:
            v = self.index.inode_fields(ino, "version")
            return v is not None and v[0] == version

        if not current():
            return 410, b"changed since its commit", []

        def read() -> tuple[bytes, int]:
            with open(self.files.path(ino), "rb") as f:
                got = os.pread(f.fileno(), ask.length, ask.off)
            return got, crc32c(got)  # the CRC too, off the loop

        try:
            data, crc = await trio.to_thread.run_sync(read)
        except OSError as e:
            log.warning("replicas: cannot read inode %d for a buddy: %s", ino, e)
            return 404, b"not readable here", []
        if not current() or len(data) != ask.length:
            return 410, b"changed since its commit", []
        self.served_ranges += 1
        return 200, data, [(H_CRC, str(crc).encode())]


class ReplicaHolder:
    """This node's side as a buddy: takes offers, pulls, holds, drops and takes over
    replicas."""

    def __init__(self, *, cache_dir: Path, node: str, cfg: PeerConfig, store: ObjectStore,
                 files: FileCache, cache_size: int | None, interval: float,
                 takeover: Takeover, known_durable: Callable[[str, int], bool],
                 owned: Owned) -> None:
        """`known_durable(path, committed_ns)`: whether this node already knows the store
        holds that commit of `path` or a later one (its own registry of sets; no request).
        `owned(path, keys)`: those object keys this node's index owns or names (the takeover
        records' sweep, cachemgr.tiering.takeover)."""
        self.takeover = takeover
        self._owned = owned
        self._known_durable = known_durable
        self.root = cache_dir / "replicas"
        self.node, self.cfg, self.store, self.files = node, cfg, store, files
        self.cache_size, self.interval = cache_size, interval
        self.held: dict[tuple[str, int], dict[str, Any]] = {}
        self.pulling: dict[tuple[str, int], dict[str, Any]] = {}
        self._failed: dict[tuple[str, int], float] = {}
        self._send, self._recv = trio.open_memory_channel[dict[str, Any]](MAX_QUEUED)
        # notices to origins of replicas dropped for room: at most one per replica dropped,
        # and a replica is only dropped after it was pulled (bounded by MAX_QUEUED offers)
        self._tell, self._told = trio.open_memory_channel[tuple[str, int, PeerEndpoint]](
            float("inf"))
        # what a held replica is served as (serve_chunk, manifests): built on first use,
        # forgotten with the replica (_forget); trio thread only, like `held`
        self._objs: dict[tuple[str, int], list[StoredObject] | None] = {}
        self._docs: dict[tuple[str, int], str | None] = {}
        self.served_chunks = 0
        self.replica_bytes = 0
        self.pulls_failed = 0
        self.offers_refused = 0
        self.dropped = 0

    @staticmethod
    def _bytes(desc: dict[str, Any]) -> int:
        return sum(f["size"] for f in desc["files"])

    def _room(self) -> int:
        reserved = self.replica_bytes + sum(self._bytes(d) for d in self.pulling.values())
        if self.cache_size is not None:
            return self.cache_size - self.files.cached_bytes - reserved
        st = os.statvfs(self.root.parent)
        return st.f_bavail * st.f_frsize - DISK_RESERVE - reserved

    # -- the offer ----------------------------------------------------------------------------

    def offer(self, body: bytes, peer: str) -> Reply:
        try:
            desc = validate.replica_offer(body)
        except validate.DocumentError as e:
            self.offers_refused += 1
            log.warning("replicas: refused an offer from peer %s: %s", peer, e)
            return 400, b"invalid offer", []
        key = (desc["origin"], desc["seq"])
        if desc["origin"] == self.node:
            return 400, b"an offer from this node", []
        if key in self.held:
            return 200, b"held", []
        # failed before pulling: a pull that failed is still in `pulling` while its partial
        # files are removed (a thread), and an offer meanwhile is refused, not told "pulling"
        if self._failed.get(key, 0.0) > time.monotonic():
            return 409, b"its last pull failed", []
        if key in self.pulling:
            return 202, b"pulling", []
        if self._bytes(desc) > self._room():
            self.offers_refused += 1
            return 507, b"no room for this replica", []
        try:
            self._send.send_nowait(desc)
        except trio.WouldBlock:
            return 503, b"too many offers queued", []
        self.pulling[key] = desc
        return 202, b"pulling", []

    # -- the pulls ----------------------------------------------------------------------------

    async def run(self) -> None:
        await trio.to_thread.run_sync(self._load)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._drop_loop)
            nursery.start_soon(self._notice_loop)
            async for desc in self._recv:
                await self._pull_one(desc)

    def _load(self) -> None:
        """The replicas a previous daemon left: whole ones are held, partial ones removed."""
        if not self.root.is_dir():
            return
        for odir in self.root.iterdir():
            if odir.name.startswith("."):
                continue  # the takeover records (cachemgr.tiering.takeover)
            for d in odir.iterdir() if odir.is_dir() else ():
                try:
                    desc = validate.replica_offer((d / DESCRIPTOR).read_bytes(),
                                                  max_bytes=validate.MAX_DOCUMENT_BYTES)
                    ok = not d.name.endswith(".part") and d.name == str(desc["seq"]) and \
                        desc["origin"] == odir.name
                except (OSError, validate.DocumentError):
                    ok = False
                if not ok:
                    shutil.rmtree(d, ignore_errors=True)
                    continue
                self.held[(desc["origin"], desc["seq"])] = desc
                self.replica_bytes += self._bytes(desc)

    async def _pull_one(self, desc: dict[str, Any]) -> None:
        key = (desc["origin"], desc["seq"])
        origin = PeerEndpoint(desc["origin"], *desc["endpoint"])
        part = self.root / desc["origin"] / f"{desc['seq']}.part"
        try:
            await trio.to_thread.run_sync(self._fresh, part)
            for i, f in enumerate(desc["files"]):
                f["crcs"] = await self._pull_file(origin, desc, i, f["size"], part / str(i))
            await trio.to_thread.run_sync(self._seal, part, desc)
        except (PeerFault, OSError) as e:
            self.pulls_failed += 1
            self._failed[key] = time.monotonic() + FAILED_S
            await trio.to_thread.run_sync(lambda: shutil.rmtree(part, ignore_errors=True))
            what = f"peer {origin.describe()} {e}" if isinstance(e, PeerFault) else str(e)
            log.warning("replicas: set %d of node %s (%s) not replicated here: %s",
                        desc["seq"], desc["origin"], desc["path"], what)
            return
        finally:
            self.pulling.pop(key, None)
        self.held[key] = desc
        self.replica_bytes += self._bytes(desc)
        log.info("replicas: holding set %d of node %s (%s, %d bytes)", desc["seq"],
                 desc["origin"], desc["path"], self._bytes(desc))
        for old, d in list(self.held.items()):  # the origin's older commits of the same path
            if old[0] == key[0] and old[1] < key[1] and d["path"] == desc["path"]:
                await self._drop(old, "a newer commit of its path is held")

    def _fresh(self, part: Path) -> None:
        """An empty `part` directory; `replicas/` and the origin's directory private (0700:
        other users never read other nodes' checkpoint bytes, as under `data/`)."""
        shutil.rmtree(part, ignore_errors=True)
        for d in (self.root, part.parent, part):
            d.mkdir(mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)

    async def _pull_file(self, origin: PeerEndpoint, desc: dict[str, Any], i: int, size: int,
                         dest: Path) -> list[int]:
        """Pull file `i` into `dest`, range by range from offset 0, each range's CRC32C
        checked; returns those CRCs (the replica's chunk CRCs, validate.REPLICA_CHUNK)."""
        crcs: list[int] = []
        fd = await trio.to_thread.run_sync(
            lambda: os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        try:
            off = 0
            while off < size:
                n = min(MAX_RANGE, size - off)
                status, headers, data = await request(
                    self.cfg, origin, "GET", file_target(desc["seq"], i, off, n), limit=n)
                if status == 410:
                    raise PeerFault("changed", f"says file {i} changed since its commit")
                if status != 200 or len(data) != n:
                    raise PeerFault("status", f"answered HTTP {status} ({len(data)} bytes) for "
                                    f"file {i} at {off}")
                crc = headers.get(H_CRC, b"")
                if not crc.isdigit() or int(crc) != await trio.to_thread.run_sync(crc32c, data):
                    raise PeerFault("corrupt", f"sent bytes of file {i} at {off} that fail "
                                    "their CRC32C")
                await trio.to_thread.run_sync(os.pwrite, fd, data, off)
                crcs.append(int(crc))
                off += n
            await trio.to_thread.run_sync(os.fsync, fd)
        finally:
            os.close(fd)
        return crcs

    def _seal(self, part: Path, desc: dict[str, Any]) -> None:
        doc = {"format": "ckptfs-replica-offer", "version": 1, **desc,
               "endpoint": {"host": desc["endpoint"][0], "port": desc["endpoint"][1]}}
        with open(part / DESCRIPTOR, "wb") as f:
            f.write(json.dumps(doc, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(part)
        final = part.with_name(str(desc["seq"]))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(part, final)
        fsync_dir(final.parent)

    # -- dropping -----------------------------------------------------------------------------

    async def _drop(self, key: tuple[str, int], why: str) -> None:
        desc = self._forget(key)
        if desc is None:
            return
        d = self.root / key[0] / str(key[1])
        await trio.to_thread.run_sync(lambda: shutil.rmtree(d, ignore_errors=True))
        log.info("replicas: dropped set %d of node %s (%s): %s", key[1], key[0], desc["path"],
                 why)

    def _drop_now(self, key: tuple[str, int], why: str) -> None:
        """`_drop` without an await (for `drop_for_room`)."""
        desc = self._forget(key)
        if desc is None:
            return
        shutil.rmtree(self.root / key[0] / str(key[1]), ignore_errors=True)
        log.info("replicas: dropped set %d of node %s (%s): %s", key[1], key[0], desc["path"],
                 why)

    # -- serving held replicas to restoring nodes (cachemgr.tiering.peernamespace) ---------------

    def _objects(self, key: tuple[str, int], desc: dict[str, Any]) -> list[StoredObject] | None:
        if key not in self._objs:
            self._objs[key] = virtual_objects(desc)
        return self._objs[key]

    def manifests(self) -> list[tuple[int, str]]:
        """(committed_ns, manifest JSON) of every held replica that can be served (its chunk
        CRCs known), built once per replica (`_docs`)."""
        out = []
        for key, desc in self.held.items():
            if key not in self._docs:
                objs = self._objects(key, desc)
                self._docs[key] = None if objs is None else \
                    mf.dumps(replica_manifest(desc, objs)).decode()
            doc = self._docs[key]
            if doc is not None:
                out.append((int(desc["committed_ns"]), doc))
        return out

    async def serve_chunk(self, key: str, crc: int, index: int) -> bytes | None:
        """Chunk `index` of a held replica's file, asked for by its virtual object (`key`,
        `crc` its whole CRC32C; virtual_key): the raw bytes once they match the CRC32C this
        node checked when it pulled them; None when it is not such a chunk held here."""
        m = _VIRTUAL.fullmatch(key)
        if m is None:
            return None
        rkey, i = (m.group(1), int(m.group(2))), int(m.group(3))
        desc = self.held.get(rkey)
        objs = None if desc is None else self._objects(rkey, desc)
        if objs is None or i >= len(objs) or objs[i].crc32c != crc or \
                not 0 <= index < chunk_count(objs[i]):
            return None
        obj = objs[i]
        start, length = chunk_span(obj, index)
        path = self.root / rkey[0] / str(rkey[1]) / str(i)

        def read() -> bytes | None:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), length, start)
            return data if len(data) == length and verify_chunk(obj, index, data) else None

        try:
            data = await trio.to_thread.run_sync(read)
        except OSError:  # dropped meanwhile
            return None
        if data is None:
            log.warning("replicas: chunk %d of file %d of set %d of node %s fails its CRC32C "
                        "here; not served", index, i, rkey[1], rkey[0])
        else:
            self.served_chunks += 1
        return data

    def _forget(self, key: tuple[str, int]) -> dict[str, Any] | None:
        self._objs.pop(key, None)
        self._docs.pop(key, None)
        desc = self.held.pop(key, None)
        if desc is not None:
            self.replica_bytes -= self._bytes(desc)
            self.dropped += 1
        return desc

    def drop_for_room(self, fits: Callable[[], bool]) -> bool:
        """Part of cachemgr.tiering.space make_room (a writer or a restore needs the room):
        drop held replicas until `fits()`, before any of this node's own data is evicted.
        Those of sets this node knows the store holds go first, then the oldest commits. The
        origin of a replica dropped before its set was durable is told (`_notice_loop`): the
        set is no longer replicated there, and its next pass offers it again. Synchronous (no
        await between the decision and the drop): a replica being pulled is not held yet and
        is not dropped; its directory is removed here, on the trio thread (a few files)."""
        order = sorted(self.held.items(), key=lambda kv: (
            not self._known_durable(kv[1]["path"], int(kv[1]["committed_ns"])),
            int(kv[1]["committed_ns"]), kv[0]))
        for key, desc in order:
            if fits():
                return True
            durable = self._known_durable(desc["path"], int(desc["committed_ns"]))
            self._drop_now(key, "durable in the store" if durable else
                           "this node needs the room")
            if not durable:
                origin = PeerEndpoint(desc["origin"], *desc["endpoint"])
                self._tell.send_nowait((key[0], key[1], origin))
        return fits()

    async def _notice_loop(self) -> None:
        """Tell each origin of a replica dropped for room (POST DROPPED_ROUTE): it counts one
        buddy less for that set. A notice that cannot be delivered is logged and given up:
        the origin is then down or cut off (after a restart it offers its sets again)."""
        async for origin, seq, where in self._told:
            body = json.dumps({"node": self.node, "origin": origin, "seq": seq}).encode()
            try:
                status, _h, _t = await request(self.cfg, where, "POST", DROPPED_ROUTE,
                                               body=body, limit=4096)
            except PeerFault as e:
                log.info("replicas: cannot tell %s that its set %d was dropped here: %s",
                         where.describe(), seq, e)
                continue
            if status != 200:
                log.info("replicas: %s answered %d to the notice that its set %d was dropped"
                         " here", where.describe(), status, seq)

    async def durable_in_store(self, desc: dict[str, Any]) -> bool:
        """Whether the store's manifest of the replica's path is its commit or a later one, in
        the order the manifest writer keeps (mf.Commit: what a takeover would not replace;
        cachemgr.tiering.manifests). StoreError: the store cannot say now."""
        try:
            data = await self.store.get(manifest_key(desc["path"]))
        except NotFound:
            return False
        try:
            m = validate.manifest(data)
        except validate.DocumentError:
            return False
        replica = mf.Commit(int(desc["committed_ns"]), desc["origin"], int(desc["seq"]))
        return not replica.later_than(mf.commit_of(m))

    async def _drop_loop(self) -> None:
        """Every `interval`: drop the replicas the store holds (or holds a newer commit of),
        and take over those whose origin's lease expired (`Takeover`)."""
        while True:
            await trio.sleep(self.interval)
            try:
                await sweep(self.takeover.records, self.store, self._owned)
            except StoreError as e:
                log.debug("replicas: cannot sweep the takeover records: %s", e)
            if not self.held:
                continue
            try:
                live = set(await self.takeover.live())
            except StoreError as e:
                log.debug("replicas: cannot list the members: %s", e)
                continue
            for key, desc in sorted(self.held.items(), key=lambda kv: kv[0][1]):
                try:
                    if await self.durable_in_store(desc):
                        await self._drop(key, "durable in the store")
                    elif key[0] not in live and await self.takeover.publish(
                            desc, self.root / key[0] / str(key[1])):
                        await self._drop(key, "taken over: durable in the store")
                except StoreError as e:
                    log.debug("replicas: cannot check the store for %s: %s", desc["path"], e)
                    break


def virtual_key(origin: str, seq: int, i: int) -> str:
    """The object key under which the buddies holding replica (origin, seq) serve its file
    `i` to peers (GET /v1/chunk): never an object in the store."""
    return f"data/{origin}/replica/{seq}/{i}"


_VIRTUAL = re.compile(r"data/([^/]+)/replica/([0-9]{1,19})/([0-9]{1,7})")


def virtual_objects(desc: dict[str, Any]) -> list[StoredObject] | None:
    """The files of a held replica as objects of REPLICA_CHUNK chunks with the CRC32Cs the
    buddy checked when it pulled them; None for a replica held without them (an older
    daemon's)."""
    out = []
    for i, f in enumerate(desc["files"]):
        crcs = f.get("crcs")
        if crcs is None:
            return None
        whole = 0
        for j, c in enumerate(crcs):
            whole = crc32c_combine(whole, c, min(validate.REPLICA_CHUNK,
                                                 f["size"] - j * validate.REPLICA_CHUNK))
        out.append(StoredObject(key=virtual_key(desc["origin"], desc["seq"], i),
                                size=f["size"], stored_size=f["size"], crc32c=whole,
                                chunk_size=validate.REPLICA_CHUNK, chunk_crcs=tuple(crcs)))
    return out


class Replication:
    """Both sides, and the routes the peer server hands them (cachemgr.peer.server)."""

    def __init__(self, origin: ReplicaOrigin, holder: ReplicaHolder) -> None:
        self.origin, self.holder = origin, holder

    async def route(self, method: str, target: str, body: bytes, peer: str) -> Reply:
        path = urlsplit(target).path
        if path == OFFER_ROUTE and method == "POST":
            return self.holder.offer(body, peer)
        if path == FILE_ROUTE and method == "GET":
            return await self.origin.serve_file(target)
        if path == DROPPED_ROUTE and method == "POST":
            return self.origin.dropped(body)
        if path == NAMESPACE_ROUTE and method == "GET":
            return self.namespace(target)
        return 404, b"no such route", []

    def namespace(self, target: str) -> Reply:
        """GET NAMESPACE_ROUTE: the manifests of the replicas held here, newest commit first,
        at most MAX_NAMESPACE_BYTES (older ones left out: `truncated`), with the live peers
        this node knows (a fresh node finds the others through it), signed."""
        o = self.origin
        peers = [{"node": p.node, "host": p.host, "port": p.port} for p in o.known_peers()]
        peers.append({"node": o.node, "host": o.endpoint[0], "port": o.endpoint[1]})
        sets, size, truncated = [], 4096 + len(json.dumps(peers)), False
        for _ns, doc in sorted(self.holder.manifests(), reverse=True):
            if size + len(doc) + 64 > MAX_NAMESPACE_BYTES:
                truncated = True
                break
            sets.append(doc)
            size += len(doc) + 64
        body = json.dumps({"format": "ckptfs-peer-namespace", "version": 1, "node": o.node,
                           "peers": peers, "sets": sets, "truncated": truncated}).encode()
        return 200, body, [sign_response(o.cfg.secret, target, body),
                           (b"content-type", b"application/json")]

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.origin.run)
            nursery.start_soon(self.holder.run)

    def set_fields(self, row: SetStatusRow) -> None:
        """What status adds to a set's row: buddies holding it, replicated or not."""
        n = self.origin.held_by(row["seq"])
        row["replicas"] = n
        row["replicated"] = row["state"] == "durable" or n >= self.origin.k

    def statistics(self, live: Callable[[], list[int]]) -> ReplicaStats:
        o, h = self.origin, self.holder
        return ReplicaStats(
            replicas=o.k, buddies=o.buddies(),
            replicated_sets=sum(1 for s in live() if o.replicated(s)),
            offers_sent=o.offers_sent, held_for_others=len(h.held),
            replica_bytes=h.replica_bytes, pulling=len(h.pulling), pulls_failed=h.pulls_failed,
            offers_refused=h.offers_refused, dropped=h.dropped, served_ranges=o.served_ranges,
            taken_over=h.takeover.taken_over)
