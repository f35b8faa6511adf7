"""This node's lease: its member record in the store (`members/@<node>.json`), registration,
renewals, and the generation that fences what the node says once its lease ran out
(docs/ARCHITECTURE.md "Many nodes, one store"). Who else is a member, intents and
acknowledgements are cachemgr.tiering.members; every service that writes a protocol document
(part records, acks, intents, manifests) asks `Lease.ensure` first.

The fence (a lease a node no longer holds is never acted on): `Lease` owns this node's member
record. The lease runs for `lease_s` from the moment the PUT that last renewed it in time was
*sent* (the store stamps it later, so no other node can count it gone earlier). A renewal that
comes back after that (the store was unreachable or slow for longer than the lease) landed when
other nodes may already have taken this node for gone: the node then registers again under a new
*generation* (a number that only grows, kept in the index) before it does anything else in the
protocol. Every ack, intent, part record and manifest this node writes first checks, without a
request, that the lease holds (`Lease.ensure`; re-registering if it does not), and carries the
generation. After a new generation the node rewrites every part record and acknowledges again
every open intent that names it, and committers count an acknowledgement only when its
generation is the node's current one (they read the member record): what a node said under a
lease that ran out is ignored, not trusted. What the fence cannot do is make a close that did
not wait for the store count on a node cut off longer than its lease: see docs/SEMANTICS.md.

State, its owner and its guards: `Lease` owns the member record (`registered`, `generation`,
`_sent`); `renew` runs under `_lock`, so one PUT of the record is in flight at a time and a new
generation is taken once. Trio thread only. The generation is kept in the index (`meta` row
`lease_generation`), so it grows across restarts of the same cache dir.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from cachemgr.core.errors import IndexFull
from cachemgr.store import ObjectStore, StoreError

if TYPE_CHECKING:
    from cachemgr.core.index import Index

log = logging.getLogger(__name__)

MEMBERS = "members/"
LEASE_SKEW_S = 10.0  # seconds of clock difference (store vs node) a lease check allows for


def member_key(node: str) -> str:
    return f"{MEMBERS}@{node}.json"


def encode_doc(kind: str, **fields: Any) -> bytes:
    """A protocol document of `kind` (member, intent, ack: docs/FORMAT.md), as the store gets it."""
    return json.dumps({"format": f"ckptfs-{kind}", "version": 1, **fields},
                      sort_keys=True).encode()


@dataclass(frozen=True, slots=True)
class LeaseStats:
    """`Lease.statistics()`: this node's lease (`dataclasses.asdict` for JSON)."""

    registered: bool
    lease_s: float
    lease_held: bool
    lease_left_s: float
    generation: int
    renewals: int
    lease_lapses: int
    last_lapse: str | None


class Lease:
    """This node's member record: registration, renewals, and the generation that fences a
    lease that ran out (see the module docstring)."""

    def __init__(self, *, store: ObjectStore, node: str, index: Index, lease: float,
                 register_timeout: float, peer: tuple[str, int] | None = None) -> None:
        """`peer`: (host, port) this node serves peers at (--peers), written into the record."""
        self.store = store
        self.peer = peer
        self.node = node
        self.index = index
        self.lease = lease
        self.register_timeout = register_timeout
        self.registered = False
        self.generation = 0               # 0: not registered yet
        self._sent = 0.0                  # monotonic send time of the last in-time renewal
        self._lock = trio.Lock()          # one PUT of the record at a time
        # statistics
        self.renewals = 0
        self.lapses = 0
        self.last_lapse: str | None = None

    def holds(self) -> bool:
        """Whether no other node can count this one gone yet (no request: its own clock)."""
        return self.registered and time.monotonic() - self._sent < self.lease

    def left_s(self) -> float:
        return max(0.0, self._sent + self.lease - time.monotonic()) if self.registered else 0.0

    async def _put(self, generation: int) -> float:
        """PUT the record; the monotonic time it was sent."""
        sent = time.monotonic()
        extra = {} if self.peer is None else {
            "peer": {"host": self.peer[0], "port": self.peer[1]}}
        await self.store.put(member_key(self.node), encode_doc(
            "member", node=self.node, lease_s=self.lease, renewed_ns=time.time_ns(),
            pid=os.getpid(), generation=generation, **extra))
        return sent

    def _next_generation(self) -> int:
        """Larger than any this node's cache dir used before (the index keeps the last)."""
        last = int(self.index.meta("lease_generation") or 0)
        gen = max(time.time_ns(), last + 1, self.generation + 1)
        try:
            with self.index.tx():
                self.index.set_meta("lease_generation", str(gen))
        except IndexFull:
            # A full cache disk: the generation still grows in this process, and from the
            # clock across restarts; it is kept in the index at the next registration.
            log.warning("cache disk full: lease generation %d not kept in the index", gen)
        return gen

    async def renew(self, *, only_if_lapsed: bool = False) -> bool:
        """Register, renew, or (the lease ran out) register again under a new generation.
        True if a new generation began (the first registration included). StoreError if the
        store did not take it."""
        async with self._lock:
            if only_if_lapsed and self.holds():
                return False  # renewed by another task meanwhile
            if self.holds():
                sent = await self._put(self.generation)
                if time.monotonic() - self._sent < self.lease:
                    self._sent = sent  # answered before the lease ran out: it never lapsed
                    self.renewals += 1
                    return False
                # Answered after the lease ran out: it may have landed when other nodes had
                # already taken this node for gone. Fall through: a new generation.
            was = self.registered
            lapsed_s = time.monotonic() - self._sent - self.lease if was else 0.0
            gen = self._next_generation()
            sent = await self._put(gen)
            self.generation, self._sent, self.registered = gen, sent, True
            self.renewals += 1
            if was:
                self.lapses += 1
                self.last_lapse = time.strftime("%H:%M:%S")
                log.warning("node %s's lease (%.0fs) ran out %.1fs before the store took a"
                            " renewal: registered again as generation %d; what it said under"
                            " the old one is ignored, its part records are written again and"
                            " open commits acknowledged again", self.node, self.lease,
                            max(0.0, lapsed_s), gen)
            else:
                log.info("registered as node %s in the store (lease %.0fs, generation %d)",
                         self.node, self.lease, gen)
            return True

    async def ensure(self) -> None:
        """Before any write of the protocol: the lease holds, or the node registers again
        first. StoreError if it cannot (the caller retries later, having written nothing)."""
        if self.holds():
            return
        await self.renew(only_if_lapsed=True)
        if not self.holds():
            raise StoreError(f"node {self.node}'s lease ran out again while it registered")

    async def register(self) -> None:
        """At mount, before the first request is served (so no file can be closed here before
        another node can see this node). A store that does not answer does not stop the mount:
        the registration is retried in the background, and logged."""
        err = f"no answer in {self.register_timeout:.0f}s"
        with trio.move_on_after(self.register_timeout):
            try:
                await self.renew()
                return
            except StoreError as e:
                err = str(e)
        log.warning("could not register node %s in the store (%s); retrying in the background."
                    " Until then a directory committed on another node may miss files closed"
                    " here", self.node, err)

    async def drop(self) -> None:
        async with self._lock:
            await self.store.delete(member_key(self.node))
            self.registered = False

    def statistics(self) -> LeaseStats:
        return LeaseStats(registered=self.registered, lease_s=self.lease, lease_held=self.holds(),
                          lease_left_s=round(self.left_s(), 1), generation=self.generation,
                          renewals=self.renewals, lease_lapses=self.lapses,
                          last_lapse=self.last_lapse)
