"""Members, commit intents and acknowledgements: how a commit of a directory written by several
nodes includes every file the other nodes closed before it, without any node's close() waiting
for the store (docs/ARCHITECTURE.md "Many nodes, one store", docs/FORMAT.md "Members, intents,
acknowledgements").

A node's part records (cachemgr.tiering.parts) are written in the background, so when rank 0 renames
`step.tmp` into place on node A, node B's record naming the file B closed a moment ago may not
be in the store yet. A DCP commit does not care (its `.metadata` names every storage file: A
waits for exactly those). A directory renamed into place or `ckptfs commit` has no such list, so
A asks:

  * **membership**: every mount PUTs `members/@<node>.json` before it serves its first request
    (`register`, at mount), renews it every lease/4 in the background and DELETEs it at a clean
    unmount once its records are all in the store (`leave`). A member whose record was last
    written more than `lease_s` (its own, from the record) + `LEASE_SKEW_S` ago is gone;
  * **intent**: the committer lists `members/`. No other live member: nothing more (a single
    node pays one LIST). Else it PUTs `intents/<id>.json` naming the set's paths and the live
    members it waits for;
  * **acknowledgement**: every node lists `intents/` every poll interval; for an intent naming
    it, it brings its records under the set's paths up to date in the store (every directory
    there, whatever is dirty or not: also files closed before a restart), then PUTs
    `acks/<id>/@<node>.json`;
  * the committer waits (in the background, bounded by --commit-timeout, from the commit) until
    every node it named has acknowledged or left cleanly (its member record deleted), deletes
    the intent and the acks, and then gathers the records as before
    (cachemgr.tiering.gather).

Why it is enough: a file B closed before the commit was closed before A wrote the intent (the
barrier orders them), so before B read it; B's ack is PUT only after its records, written by a
pass that started after B read the intent, are in the store; A reads the records after the
ack. A node registered after A's listing of `members/` registered after the commit, so every
file it closed came after the commit. A node whose lease had expired when A listed `members/` is
not waited for (a node that never comes back does not block commits after its lease); one that
was live then and dies is waited for until it comes back (same cache dir: it acknowledges) or
the commit times out, because it may have died between a close and that close's record.

The fence (a lease a node no longer holds is never acted on) is cachemgr.tiering.lease: every
ack, intent, part record and manifest this node writes first checks that the lease holds
(`Lease.ensure`) and carries its generation. After a new generation the node rewrites every part
record and acknowledges again every open intent that names it, and committers count an
acknowledgement only when its generation is the node's current one (they read the member
record): what a node said under a lease that ran out is ignored, not trusted. What the fence
cannot do is make a close that did not wait for the store count on a node cut off longer than
its lease: see docs/SEMANTICS.md.

State, its owner and its guards: `Members` owns the intents it has acknowledged (`_acked`:
(key, etag), so each version of an intent is acknowledged once per generation; `_acking`: those
being acknowledged now, so one intent has one acknowledging task) and the ids of this node's own
intents in use (`mine`, so a poll deletes only intents left over by an earlier daemon).
`CommitAcks` owns one commit's list of nodes to wait for, persisted in the index (`meta` row
`intent:<seq>`) before the intent is written, so a restarted committer asks the same nodes
again. Everything runs on the daemon's trio thread: one task renews (`_renew_loop`), one polls
the intents (a slow listing never delays a renewal); each intent is acknowledged in a task of
its own; `CommitAcks` runs inside the committer's gathering task. Invariant: an ack is PUT only
after `PartPublisher.sync` returned for every directory under the intent's roots here (the
records it needs are in the store), under the generation the ack names, with the lease held.

Crash states: a member record whose node died stays until its lease expires (committers that
listed it while live wait for it, or time out); an intent of this node left by a crash is
deleted by the next daemon's first poll (not in `mine`); an `intent:<seq>` row outlives its
intent until the set's commit asks again or the set leaves the live states (`close`).
"""

from __future__ import annotations

import json
import logging
import random
import stat
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import trio

from cachemgr.core.sets import LIVE_STATES
from cachemgr.format import validate
from cachemgr.peer.proto import PeerEndpoint
from cachemgr.store import NotFound, ObjectStore, StoreError
from cachemgr.tiering.lease import (
    LEASE_SKEW_S,
    MEMBERS,
    Lease,
    LeaseStats,
    encode_doc,
    member_key,
)

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.core.sets import SetRegistry
    from cachemgr.tiering.parts import PartPublisher

log = logging.getLogger(__name__)

INTENTS = "intents/"
ACKS = "acks/"
# `leave` at unmount: the part records and the member record's DELETE within LEAVE_S (a store
# that answers takes tens of ms; one that does not is not waited for longer than a mount waits
# for its registration); at least LEAVE_MIN_S even when an `umount --timeout` is spent: a
# store that answers still gets the node's records written and its member record dropped
LEAVE_S = 10.0
LEAVE_MIN_S = 1.0


def intent_key(iid: str) -> str:
    return f"{INTENTS}{iid}.json"


def acks_prefix(iid: str) -> str:
    return f"{ACKS}{iid}/"


def ack_key(iid: str, node: str) -> str:
    return f"{ACKS}{iid}/@{node}.json"


def parse_member_key(key: str) -> str | None:
    if key.startswith(MEMBERS + "@") and key.endswith(".json") and "/" not in key[len(MEMBERS):]:
        return key[len(MEMBERS) + 1:-len(".json")]
    return None


def parse_intent_key(key: str) -> str | None:
    """The intent id `<node>-<seq>-<instance>` of an intent key, or None."""
    if key.startswith(INTENTS) and key.endswith(".json") and "/" not in key[len(INTENTS):]:
        iid = key[len(INTENTS):-len(".json")]
        if iid.count("-") == 2:
            return iid
    return None


def parse_ack_key(key: str) -> tuple[str, str] | None:
    """(intent id, acknowledging node) of an ack key, or None."""
    if not key.startswith(ACKS) or not key.endswith(".json"):
        return None
    iid, _, last = key[len(ACKS):].partition("/")
    if not iid or not last.startswith("@") or "/" in last:
        return None
    return iid, last[1:-len(".json")]


def _load(data: bytes, kind: str) -> dict[str, Any] | None:
    """A member or intent document, validated (cachemgr.format.validate.protocol_doc), or None."""
    try:
        return validate.protocol_doc(data, kind)
    except validate.DocumentError as e:
        log.debug("not a valid %s: %s", kind, e)
        return None


@dataclass(frozen=True, slots=True)
class MemberStats:
    """`Members.statistics()`: the lease and the commit acknowledgements; `as_json` is what
    status shows (the lease's fields beside the others)."""

    lease: LeaseStats
    acks_sent: int
    acks_ignored: int
    intents_written: int
    intents_open: int

    def as_json(self) -> dict[str, object]:
        return {**asdict(self.lease), "acks_sent": self.acks_sent,
                "acks_ignored": self.acks_ignored, "intents_written": self.intents_written,
                "intents_open": self.intents_open}


class Members:
    """This node's membership, and its acknowledgements of other nodes' commit intents."""

    def __init__(self, *, store: ObjectStore, node: str, index: Index, sets: SetRegistry,
                 parts: PartPublisher, lease: Lease, poll: float) -> None:
        self.store = store
        self.node = node
        self.index = index
        self.sets = sets
        self.parts = parts
        self.lease = lease
        self.poll = poll
        self._acked: set[tuple[str, str]] = set()    # (intent key, etag) acknowledged
        self._acked_gen = 0               # the generation `_acked` was acknowledged under
        self._acking: set[str] = set()    # intent keys being acknowledged now
        self.mine: set[str] = set()       # ids of this node's intents in use now
        # trio time by which `leave` must end (`leave_by`: `ckptfs umount --timeout`); None:
        # LEAVE_S
        self._leave_by: float | None = None
        # statistics
        self.acks_sent = 0
        self.acks_ignored = 0             # other nodes' acks from a generation not current
        self.intents_written = 0
        # node -> its peer endpoint (None: it serves none), read once per record (`peers`);
        # at most one entry per member
        self._endpoints: dict[str, PeerEndpoint | None] = {}
        # (node, why) of member records found invalid and said so: said once, also when two
        # `peers()` calls (the peer client's background refresh and a restore's) read the
        # record concurrently
        self._said_invalid: set[tuple[str, str]] = set()
        # member key -> (etag, lease_s) of the records `live` found past this node's lease and
        # read: each version is read once, not at every call (dead nodes' records stay until
        # fsck; reading them all at every call cost a GET per dead node per call). At most one
        # entry per record of the last listing.
        self._leases: dict[str, tuple[str, float]] = {}

    @property
    def registered(self) -> bool:
        return self.lease.registered

    # -- membership ---------------------------------------------------------------------------

    async def register(self) -> None:
        await self.lease.register()

    def leave_by(self, seconds: float) -> None:
        """`leave` ends within `seconds` from now (at least LEAVE_MIN_S): what is left of an
        `umount --timeout` when the daemon is told to go (issue 36: the unmount during a hung
        store ended LEAVE_S past its --timeout)."""
        self._leave_by = trio.current_time() + max(LEAVE_MIN_S, seconds)

    async def leave(self) -> None:
        """At a clean unmount: once every part record is in the store, drop the member record
        (committers stop waiting for this node). If the records cannot be written, the member
        record stays: committers then wait for this node to come back, or time out. Within
        LEAVE_S (at most register_timeout), or by `leave_by`'s time if sooner."""
        if not self.registered:
            return
        bound = max(LEAVE_MIN_S, min(LEAVE_S, self.lease.register_timeout))
        if self._leave_by is not None:
            bound = min(bound, max(LEAVE_MIN_S, self._leave_by - trio.current_time()))
        with trio.move_on_after(bound) as scope:
            try:
                for d in sorted(self.parts.pending()):
                    await self.parts.sync_dir(d)
                await self.lease.drop()
                log.info("left the store's members (node %s)", self.node)
                return
            except StoreError as e:
                log.warning("node %s stays registered: its part records could not be written"
                            " at unmount: %s", self.node, e)
        if scope.cancelled_caught:
            log.warning("node %s stays registered: the store did not answer at unmount",
                        self.node)

    async def live(self) -> dict[str, float]:
        """{node: mtime of its member record} of every other node whose lease runs."""
        now = time.time()
        out: dict[str, float] = {}
        listed = await self.store.list(MEMBERS)
        for info in listed:
            node = parse_member_key(info.key)
            if node is None or node == self.node:
                continue
            if info.mtime + self.lease.lease + LEASE_SKEW_S >= now:
                out[node] = info.mtime
                continue
            # Expired by this node's lease: its own may be longer (read once per version).
            hit = self._leases.get(info.key)
            if hit is not None and hit[0] == info.etag:
                lease = hit[1]
            else:
                try:
                    doc = _load(await self.store.get(info.key), "member")
                except NotFound:
                    continue
                lease = doc["lease_s"] if doc else 0.0
                self._leases[info.key] = (info.etag, lease)
            if info.mtime + lease + LEASE_SKEW_S >= now:
                out[node] = info.mtime
        keys = {info.key for info in listed}
        for key in [k for k in self._leases if k not in keys]:
            del self._leases[key]
        return out

    async def peers(self, stale: frozenset[str] = frozenset()) -> list[PeerEndpoint]:
        """The other live members that serve peers (--peers), for restores from peers
        (cachemgr.peer.client): one LIST of `members/`, and one GET of a member's record the
        first time it is seen (and again when the caller names it `stale`: its endpoint did not
        answer). A record whose `peer` field is invalid is ignored, with one log line."""
        live = await self.live()
        for node in list(self._endpoints):
            if node not in live or node in stale:
                del self._endpoints[node]
        out = []
        for node in sorted(live):
            if node not in self._endpoints:
                self._endpoints[node] = await self._endpoint(node)
            ep = self._endpoints[node]
            if ep is not None:
                out.append(ep)
        return out

    async def _endpoint(self, node: str) -> PeerEndpoint | None:
        try:
            data = await self.store.get(member_key(node))
        except NotFound:
            return None
        try:
            doc = validate.protocol_doc(data, "member")
        except validate.DocumentError as e:
            if (node, str(e)) not in self._said_invalid:
                self._said_invalid.add((node, str(e)))
                log.warning("peers: member record of node %s ignored: %s", node, e)
            return None
        if doc["peer"] is None or doc["node"] != node:
            return None
        return PeerEndpoint(node, *doc["peer"])

    # -- the background task: renewals, intents of other nodes -------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._renew_loop)
            while True:
                try:
                    if self.registered:
                        await self._poll(nursery)
                except StoreError as e:
                    log.warning("members: %s; retrying", e)
                # +-10 %, as the store's listings (cachemgr.tiering.remote): no fleet in lockstep
                await trio.sleep(min(self.poll, self.lease.lease / 4) * random.uniform(0.9, 1.1))

    async def _renew_loop(self) -> None:
        """Renew every lease/4 (sooner while not registered or lapsed); its own task, so a slow
        listing of intents never makes the lease run out."""
        lease = self.lease
        while True:
            try:
                due = not lease.holds() or lease.left_s() <= lease.lease * 3 / 4
                if due and await lease.renew():
                    self._new_generation()
            except StoreError as e:
                log.warning("members: renewing node %s's lease: %s; retrying", self.node, e)
                await trio.sleep(min(5.0, lease.lease / 8))
                continue
            await trio.sleep(max(0.05, lease.left_s() - lease.lease * 3 / 4))

    def _new_generation(self) -> None:
        """After registering under a new generation: every record written again, every open
        intent that names this node acknowledged again (under the new generation)."""
        if self._acked_gen != self.lease.generation:
            if self._acked_gen:
                self.parts.mark_all(now=True)
            self._acked = set()
            self._acked_gen = self.lease.generation

    async def _poll(self, nursery: trio.Nursery) -> None:
        self._new_generation()
        listed = set()
        for info in await self.store.list(INTENTS):
            iid = parse_intent_key(info.key)
            if iid is None:
                continue
            listed.add(info.key)
            if iid.split("-", 1)[0] == self.node:
                if iid not in self.mine:  # left over by a commit before a restart
                    nursery.start_soon(self._drop_intent, iid)
                continue
            mark = (info.key, info.etag)
            if mark in self._acked or info.key in self._acking:
                continue
            self._acking.add(info.key)
            nursery.start_soon(self._ack, info.key, info.etag)
        self._acked = {a for a in self._acked if a[0] in listed}

    async def _drop_intent(self, iid: str) -> None:
        try:
            await drop_intent(self.store, iid)
        except StoreError as e:
            log.warning("cannot delete stale intent %s: %s", iid, e)

    def _dirs_under(self, roots: list[str]) -> list[int]:
        """Directories at or below `roots` here whose records a committer may need: those in an
        open set, and those with a record in the store."""
        out: list[int] = []
        for root in roots:
            ino = self.index.resolve(root)
            if ino is None:
                continue  # no such directory here: nothing of this node's under it
            row = self.index.get_inode(ino)
            if row is None or not stat.S_ISDIR(row[1]):
                continue
            dirs = [ino, *(r[1] for _d, _rel, r in self.index.walk_with_inodes(ino)
                           if stat.S_ISDIR(r[2]))]
            out.extend(d for d in dirs if d in self.parts.published or self.sets.in_open_set(d))
        return out

    async def _ack(self, key: str, etag: str) -> None:
        try:
            doc = _load(await self.store.get(key), "intent")
            iid = parse_intent_key(key)
            if doc is None or iid is None:
                log.warning("skipping intent %s: not a valid ckptfs intent", key)
                self._acked.add((key, etag))
                return
            if self.node not in doc["nodes"]:
                self._acked.add((key, etag))  # registered after it: nothing closed before it
                return
            roots = doc["roots"]
            while True:
                # The records first, then the ack, both under one generation with the lease
                # held: if it ran out meanwhile, again under the new one.
                await self.lease.ensure()
                self._new_generation()
                gen = self.lease.generation
                dirs = self._dirs_under(roots)
                await self.parts.sync(dirs)
                await self.lease.ensure()
                if self.lease.generation == gen:
                    break
            akey = ack_key(iid, self.node)
            await self.store.put(akey, encode_doc(
                "ack", node=self.node, intent=iid, acked_ns=time.time_ns(), dirs=len(dirs),
                generation=gen))
            if self.lease.generation != gen or not self.lease.holds():
                # The lease ran out while the ack was on its way: the committer ignores it
                # once this node registers again; the next poll acknowledges again.
                log.info("acknowledgement of %s sent as the lease ran out: sent again under"
                         " the next generation", key)
                return
            try:
                await self.store.head(key)
            except NotFound:
                # The committer deleted the intent, then listed its acks (drop_intent), while
                # this ack was on its way: had its listing seen the ack, it would have deleted
                # it; it did not, so the intent was gone before this PUT and this HEAD sees
                # that. The ack is taken back: nothing else ever would (only fsck).
                await self.store.delete(akey)
                self._acked.add((key, etag))
                log.info("node %s's commit of %s ended before this ack landed: ack removed",
                         doc["node"], doc["path"])
                return
            self.acks_sent += 1
            self._acked.add((key, etag))
            log.info("acknowledged node %s's commit of %s (%d directories here)",
                     doc["node"], doc["path"], len(dirs))
        except NotFound:
            pass  # the intent went: its commit no longer waits
        except StoreError as e:
            log.warning("cannot acknowledge intent %s yet: %s", key, e)
        finally:
            self._acking.discard(key)

    def commit_acks(self, seq: int, path: str, roots: list[str]) -> CommitAcks:
        return CommitAcks(self, seq, path, roots)


    def statistics(self) -> MemberStats:
        return MemberStats(lease=self.lease.statistics(), acks_sent=self.acks_sent,
                           acks_ignored=self.acks_ignored, intents_written=self.intents_written,
                           intents_open=len(self.mine))


async def drop_intent(store: ObjectStore, iid: str) -> None:
    # The intent first, then the acks listed: an ack PUT after that listing finds the intent
    # gone when its node checks (Membership._ack) and is taken back there.
    await store.delete(intent_key(iid))
    for info in await store.list(acks_prefix(iid)):
        await store.delete(info.key)


class CommitAcks:
    """The committer's side, for one directory set: which live nodes must acknowledge, the
    intent, and the acknowledgements received."""

    def __init__(self, members: Members, seq: int, path: str, roots: list[str]) -> None:
        self.m = members
        self.seq = seq
        self.iid = f"{members.node}-{seq}-{time.time_ns():x}"
        self.path = path
        self.roots = roots
        self.nodes: set[str] | None = None  # None: not decided yet
        self.acked: set[str] = set()
        self._ignored: set[tuple[str, str]] = set()  # (ack key, etag) of acks that do not count
        self.written = False
        self.done = False

    async def missing(self) -> list[str]:
        """Nodes still to acknowledge ([] once none is)."""
        store = self.m.store
        if self.done:
            return []
        index = self.m.index
        if self.nodes is None:
            # Nodes an earlier attempt asked (before a restart of this daemon) are asked again
            # even if their lease ran out since: they may have died between a close and its
            # record.
            asked = json.loads(index.meta(self._meta) or "[]")
            self.nodes = set(await self.m.live()) | set(asked)
            if not self.nodes:
                self.done = True  # no other node: nothing to ask
                return []
            with index.tx():
                index.set_meta(self._meta, json.dumps(sorted(self.nodes)))
        if not self.written:
            self.m.mine.add(self.iid)
            await self.m.lease.ensure()
            await store.put(intent_key(self.iid), encode_doc(
                "intent", node=self.m.node, path=self.path, roots=self.roots,
                nodes=sorted(self.nodes), written_ns=time.time_ns()))
            self.written = True
            self.m.intents_written += 1
            log.info("commit of %s waits for acknowledgements from node(s) %s", self.path,
                     ", ".join(sorted(self.nodes)))
        for info in await store.list(acks_prefix(self.iid)):
            parsed = parse_ack_key(info.key)
            if parsed is not None and parsed[1] in self.nodes and parsed[1] not in self.acked \
                    and await self._counts(info.key, info.etag, parsed[1]):
                self.acked.add(parsed[1])
        left = self.nodes - self.acked
        if left:
            # A node that left cleanly (its member record deleted) wrote its records first.
            present = {parse_member_key(i.key) for i in await store.list(MEMBERS)}
            gone = left - present
            if gone:
                log.info("commit of %s: node(s) %s left the store's members; not waiting for"
                         " them", self.path, ", ".join(sorted(gone)))
                self.nodes -= gone
                left -= gone
        if not left:
            self.done = True
            await self.close()
        return sorted(left)

    async def _counts(self, key: str, etag: str, node: str) -> bool:
        """Whether `node`'s ack counts: written under the generation its member record holds
        now (an ack from a generation whose lease ran out is ignored: the node acknowledges
        again under its new one). A node whose record is gone left cleanly: its ack counts."""
        store = self.m.store
        if (key, etag) in self._ignored:
            return False
        try:
            ack = _load(await store.get(key), "ack")
        except NotFound:
            return False
        if ack is None:
            self._ignored.add((key, etag))
            log.warning("commit of %s: ignoring %s: not a valid ckptfs ack", self.path, key)
            return False
        try:
            member = _load(await store.get(member_key(node)), "member")
        except NotFound:
            return True
        if member is not None and member["generation"] != ack["generation"]:
            self._ignored.add((key, etag))
            self.m.acks_ignored += 1
            log.info("commit of %s: ignoring node %s's acknowledgement from generation %d (it"
                     " registered again as %d after its lease ran out)", self.path, node,
                     ack["generation"], member["generation"])
            return False
        return True

    @property
    def _meta(self) -> str:
        return f"intent:{self.seq}"

    async def close(self) -> None:
        """Delete the intent and its acks (the commit no longer waits for them)."""
        index = self.m.index
        s = self.m.sets.get(self.seq)
        if self.done or s is None or s.state not in LIVE_STATES:  # else: asked again later
            with index.tx():
                index.delete_meta(self._meta)
        if self.written:
            try:
                await drop_intent(self.m.store, self.iid)
            except StoreError as e:
                log.warning("cannot delete intent %s (deleted at the next mount): %s",
                            self.iid, e)
        self.m.mine.discard(self.iid)
