"""Sets from peers while the store is down (--peers; docs/SEMANTICS.md "Replicated",
docs/ARCHITECTURE.md "Peers"): a node that cannot list the store asks its peers for the
replicas they hold and shows those sets, so a job restarted on a fresh node during an outage
resumes from the checkpoint its dead node had only replicated.

Who is asked: this node itself (the replicas it holds, in process: a buddy resuming the job of
the node it holds a replica of sees that set), the `--peer-seeds` (host:port; a name is resolved
at every pass and each of its addresses asked, e.g. a Kubernetes headless service or a Slurm
node list), and every peer the answers named (a buddy names the live peers it knows, so one seed
finds the others). Each answer (GET /v1/replica/namespace, cachemgr.peer.proto) must
carry the HMAC of the request's random target and of its body (`check_response`): the manifests
in it have no store document to be checked against, so they are trusted only as far as a node
holding the shared secret is. Each manifest is then validated like a store's
(cachemgr.format.validate), and its files' chunks are checked, when read, against the CRC32Cs
the buddy checked when it pulled them.

What is shown (cachemgr.tiering.remote.RemoteSync.apply_from_peers): per path, the newest
commit any peer holds, when it is newer than what this node has there, as a "replicated" set
(cachemgr.core.sets); its files read from the peers holding the replica (GET /v1/chunk of
`data/<origin>/replica/<seq>/<i>`), never from the store, which has no such object. Once the
store lists the path's manifest (the buddy took the set over, or its origin came back), that
replaces it as any newer manifest does; a set no peer holds any more goes only once a store
listing that began after the peers said so did not list it.

When: a pass every `interval` while the store cannot be listed (since the mount, or for
OUTAGE_LISTINGS listings in a row) or "replicated" sets are shown; the mount waits for one
pass when its first listing failed (ckptfs.daemon). Cost: one GET per peer known per
interval, only then.

State, its owner and its guards: `known` (node -> endpoint, from the answers) and the counters,
written only by a pass, on the daemon's trio thread; one pass at a time (`_lock`). What a pass
applies is RemoteSync's (the set registry and the namespace), in one step with no await.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from cachemgr.core.sets import SetRegistry
from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.format.docs import ManifestDoc
from cachemgr.peer.client import PeerFault, request
from cachemgr.peer.proto import H_SIG, PeerConfig, PeerEndpoint, check_response
from cachemgr.tiering.replicaproto import MAX_NAMESPACE_BYTES, namespace_target

if TYPE_CHECKING:
    from cachemgr.tiering.remote import RemoteSync

log = logging.getLogger(__name__)

# local(): (committed_ns, manifest JSON) of each replica this node holds
LocalManifests = Callable[[], list[tuple[int, str]]]

MAX_ASKED = 64        # peers asked per pass (the seeds' addresses first)
ASK_CONCURRENCY = 16  # of them at once
WARN_EVERY_S = 60.0   # a peer's bad answer is logged at most this often
OUTAGE_LISTINGS = 2   # failed listings in a row (after one succeeded) that make an outage


@dataclass(frozen=True, slots=True)
class PeerSpaceStats:
    passes: int
    answered: int           # peers that answered the last pass
    shown_sets: int         # "replicated" sets shown here now
    refused: int            # answers refused (bad signature, invalid document or manifest)
    last_pass: float | None


class PeerNamespace:
    """See the module docstring."""

    def __init__(self, *, cfg: PeerConfig, node: str, remote: RemoteSync, sets: SetRegistry,
                 interval: float, local: LocalManifests | None = None) -> None:
        """`local`: the manifests of the replicas this node holds itself (ReplicaHolder): shown
        like a peer's, so a buddy resuming a lost node's job sees the sets it holds."""
        self.cfg, self.node, self.remote, self.sets = cfg, node, remote, sets
        self._local = local
        self.interval = interval if interval > 0 else 10.0
        self.known: dict[str, PeerEndpoint] = {}
        self._lock = trio.Lock()
        self._warned: dict[str, float] = {}  # address -> when its last refusal was logged
        self.passes = 0
        self.answered = 0
        self.refused = 0
        self.last_pass: float | None = None

    def wanted(self) -> bool:
        """Whether a pass is due: the store cannot be listed (the first listing failed, or
        OUTAGE_LISTINGS in a row did: one failed listing is no outage), or sets from peers are
        shown."""
        r = self.remote
        return (r.first_listing.is_set() and r.failed_listings > 0 and
                (r.syncs == 0 or r.failed_listings >= OUTAGE_LISTINGS)) or \
            bool(self.sets.by_states(("replicated",)))

    async def run(self) -> None:
        while True:
            if self.wanted():
                await self.pass_once()
            await trio.sleep(self.interval)

    def known_peers(self, stale: frozenset[str] = frozenset()) -> list[PeerEndpoint]:
        """The peers the last answers named (for restores while the members cannot be
        listed: cachemgr.peer.client)."""
        return [p for n, p in sorted(self.known.items()) if n not in stale]

    async def _targets(self) -> list[PeerEndpoint]:
        out: dict[tuple[str, int], PeerEndpoint] = {}
        for host, port in self.cfg.seeds:
            try:
                # getaddrinfo runs in a thread trio abandons when cancelled: a resolver that
                # does not answer holds a pass no longer than header_timeout
                with trio.fail_after(self.cfg.header_timeout):
                    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except trio.TooSlowError:
                self._warn(f"{host}:{port}", "peers: --peer-seeds %s:%d: no answer from the "
                           "resolver within %.0f s", host, port, self.cfg.header_timeout)
                continue
            except OSError as e:
                self._warn(f"{host}:{port}", "peers: --peer-seeds %s:%d does not resolve (%s)",
                           host, port, e)
                continue
            for info in infos:
                addr = str(info[4][0])
                out.setdefault((addr, port), PeerEndpoint("seed", addr, port))
        for p in self.known.values():
            out.setdefault((p.host, p.port), p)
        return list(out.values())[:MAX_ASKED]

    async def pass_once(self) -> int:
        """Ask the peers, show what they hold; the number of peers that answered."""
        async with self._lock:
            asked_at = time.time()
            answers: list[dict[str, Any]] = []
            limiter = trio.CapacityLimiter(ASK_CONCURRENCY)

            async def ask(p: PeerEndpoint) -> None:
                async with limiter:
                    got = await self._ask(p)
                if got is not None:
                    answers.append(got)

            async with trio.open_nursery() as n:
                for p in await self._targets():
                    n.start_soon(ask, p)
            if self._local is not None:  # the replicas this node holds: an answer of its own
                answers.append({"node": self.node, "peers": [],
                                "sets": [mf.loads(doc.encode()) for _ns, doc in self._local()]})
            # From here on: no await until the sets are applied.
            newest: dict[str, ManifestDoc] = {}
            named = {p.node: p for a in answers for p in a["peers"] if p.node != self.node}
            if named:  # the peers the answers name now: one gone from all of them is dropped
                self.known = named
            for a in answers:
                for m in a["sets"]:
                    cur = newest.get(m["path"])
                    # the later commit, as the store would keep it (mf.Commit)
                    if cur is None or mf.commit_of(m).later_than(mf.commit_of(cur)):
                        newest[m["path"]] = m
            self.passes += 1
            self.answered = sum(a["node"] != self.node for a in answers)
            self.last_pass = time.time()
            if answers:
                self.remote.apply_from_peers(list(newest.values()), asked_at)
            return self.answered

    async def _ask(self, p: PeerEndpoint) -> dict[str, Any] | None:
        """One peer's answer, checked: {peers [PeerEndpoint], sets [manifest]}; None (logged)
        when it cannot be had or must not be used."""
        target = namespace_target()
        where = f"{p.host}:{p.port}"
        try:
            status, headers, body = await request(self.cfg, p, "GET", target,
                                                  limit=MAX_NAMESPACE_BYTES)
        except PeerFault as e:
            self._warn(where, "peers: %s %s; its replicas are not shown", where, e)
            return None
        if status != 200:
            self._warn(where, "peers: %s answered HTTP %d for its replicas", where, status)
            return None
        if not check_response(self.cfg.secret, target, body, headers.get(H_SIG)):
            self.refused += 1
            self._warn(where, "peers: %s sent a namespace answer that fails its signature "
                       "(another secret?); ignored", where)
            return None
        try:
            doc = validate.peer_namespace(body)
        except validate.DocumentError as e:
            self.refused += 1
            self._warn(where, "peers: %s sent an invalid namespace answer (%s); ignored",
                       where, e)
            return None
        sets = []
        for data in doc["sets"]:
            try:
                m = mf.loads(data)
            except mf.ManifestError as e:
                self.refused += 1
                self._warn(where, "peers: %s sent an invalid manifest (%s); skipped", where, e)
                continue
            sets.append(m)
        if doc["truncated"]:
            log.debug("peers: %s holds more replicas than one answer carries", where)
        return {"peers": [PeerEndpoint(*x) for x in doc["peers"]], "sets": sets,
                "node": doc["node"]}

    def _warn(self, where: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned.get(where, -1e9) >= WARN_EVERY_S:
            self._warned[where] = now
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

    def statistics(self) -> PeerSpaceStats:
        return PeerSpaceStats(passes=self.passes, answered=self.answered,
                              shown_sets=len(self.sets.by_states(("replicated",))),
                              refused=self.refused, last_pass=self.last_pass)
