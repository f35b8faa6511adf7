"""The --cache-size / --keep-local policy: which durable data leaves the cache, and when writers
wait for room.

`Space` decides; the core (cachemgr.core.rawtree Residency, cachemgr.core.filecache) does the
eviction itself (`evict`, `eviction_candidates`, `cached_bytes`) and the restorer drops its partly
restored files (`drop_partials`). Policy:
  * replicas this node holds for other nodes (cachemgr.tiering.replicate, --replicas) count
    against --cache-size with the cache's own data, and go first: `make_room(need)` drops them
    (those of sets the store already holds first, then the oldest commits) before it evicts
    any of this node's own data;
  * `make_room(need)`: then evict durable data, least recently used first, until `need` more
    bytes fit under --cache-size; the newest durable set goes last (not never: when it is
    all that can make room, skipping it would block a writer for ever); then the chunks of
    partly restored files nobody has open;
  * `wait_for_room(need)`: backpressure for writers, woken by `Signals.changed` (an upload
    done, a set durable, space freed);
  * `retention(seq)`: after each publication (set `seq` durable), the data of all but the newest
    --keep-local durable sets (symlinks aside) is evicted. Each set is evicted once, when it
    falls out of the newest N: a watermark (`_retained`) remembers up to which seq that was
    done, so a publication walks only the sets that fell out since the last one (O(log N)
    plus those sets' files: O(1) amortised per publication, not a walk of every durable set).
    A set that falls out is evicted then (a file open at that moment stays); data read back
    into the cache later (a restore of an older checkpoint) stays until --cache-size needs its
    room, instead of being evicted again at the next publication.

Invariants: data not yet uploaded (`obj_version != version`) is never evicted (the core's
`evict` refuses it); files in `protect` are never evicted (a prefetch does not evict its own
set). State: `_retained` (every durable set below it was evicted when it fell out of the newest
--keep-local; in memory, trio thread; a restart starts it at 0, so the first publication walks
the durable sets once); the rest is read from the core and the set registry, on the trio
thread. Crash states: none here (eviction's are the core's: a cache file is removed only after
the index records it evicted).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cachemgr.core.sets import SetRegistry

if TYPE_CHECKING:
    from cachemgr.core.filecache import FileCache
    from cachemgr.core.rawtree import Residency
    from cachemgr.tiering.signals import Signals

log = logging.getLogger(__name__)


class ReplicaRoom(Protocol):
    """The replicas this node holds for others (cachemgr.tiering.replicate.ReplicaHolder)."""

    @property
    def replica_bytes(self) -> int: ...

    def drop_for_room(self, fits: Callable[[], bool]) -> bool:
        """Drop held replicas, in the order the module docstring gives, until `fits()`."""
        ...


@dataclass(frozen=True, slots=True)
class SpaceStats:
    """`Space.statistics()`: the cache-size policy (`dataclasses.asdict` for JSON)."""

    cache_size: int | None
    keep_local: int | None
    cached_bytes: int
    evicted: int
    waits: int


class Space:
    """Eviction and backpressure policy (see the module docstring)."""

    def __init__(self, *, files: FileCache, residency: Residency, sets: SetRegistry,
                 signals: Signals, forget: Callable[[int], None],
                 drop_partials: Callable[[int, set[int] | frozenset[int]], bool],
                 cache_size: int | None, keep_local: int | None,
                 replicas: ReplicaRoom | None = None) -> None:
        self.files = files
        self.replicas = replicas
        self.residency = residency
        self.sets = sets
        self.signals = signals
        self._forget = forget                # restore.restorer: a file's chunks left the cache
        self._drop_partials = drop_partials  # cachemgr.restore.restorer: drop partly restored files
        self.cache_size = cache_size
        self.keep_local = keep_local
        self.evicted = 0
        self.waits = 0
        self._retained = 0  # retention: durable sets below this seq were evicted (docstring)

    @property
    def limit(self) -> int | None:
        """--cache-size less the replicas held for other nodes (cachemgr.core.hooks.Room):
        writes wait for room above it, and the wait drops those replicas first."""
        if self.cache_size is None:
            return None
        return max(0, self.cache_size - self._replica_bytes())

    @property
    def capacity(self) -> int | None:
        """--cache-size (cachemgr.core.hooks.Room): a fallocate reserving more is refused; one
        within it waits while replicas are dropped and data evicted for it."""
        return self.cache_size

    def _replica_bytes(self) -> int:
        return 0 if self.replicas is None else self.replicas.replica_bytes

    def _fits(self, need: int, limit: int) -> bool:
        return self.files.cached_bytes + self._replica_bytes() + need <= limit

    def _evict(self, ino: int, version: int) -> None:
        if self.residency.evict(ino, version):
            self.evicted += 1
            self._forget(ino)

    def retention(self, seq: int) -> None:
        """--keep-local N, after set `seq` was published: evict the data of the durable sets
        that are no longer among the newest N."""
        n = self.keep_local
        if n is None:
            return
        cutoff = self.sets.newest_durable(skip=n, symlinks=False)  # newest one beyond N
        if cutoff is None:
            return
        # The sets that fell out since the last publication; and `seq` itself when it became
        # durable after newer ones (publication follows commit order, but a set superseded
        # while its manifest was in flight stays durable: cachemgr.tiering.publish).
        seqs = self.sets.durable_between(self._retained, cutoff)
        if seq < self._retained and seq <= cutoff and seq in self.sets.durable_between(seq, seq):
            seqs.append(seq)
        for s in seqs:
            for _rel, ino, version, *_ in self.sets.files(s):
                self._evict(ino, version)
        self._retained = max(self._retained, cutoff + 1)

    def make_room(self, need: int, protect: set[int] | frozenset[int] = frozenset()) -> bool:
        """Evict durable data, least recently used first, until `need` more bytes fit under
        --cache-size. Returns True if they fit. Files in `protect` are never evicted (a
        prefetch does not evict its own set)."""
        limit = self.cache_size
        if limit is None or self._fits(need, limit):
            return True
        # Replicas held for other nodes go before any of this node's own data.
        if self.replicas is not None and \
                self.replicas.drop_for_room(lambda: self._fits(need, limit)):
            return True
        newest = self.sets.newest_durable()
        keep = {r[1] for r in self.sets.files(newest)} if newest is not None else set()
        cands = [c for c in self.residency.eviction_candidates() if c[0] not in protect]
        # The newest durable set goes last, not never: when it is all that can make room (a
        # file being written plus the last checkpoint exceed the limit), skipping it would
        # block the writer forever.
        for ino, version in ([c for c in cands if c[0] not in keep] +
                             [c for c in cands if c[0] in keep]):
            self._evict(ino, version)
            if self._fits(need, limit):
                return True
        # Then the chunks of partly restored files nobody has open (they count too).
        return self._drop_partials(need, protect)

    async def wait_for_room(self, need: int) -> None:
        """Backpressure for writers: block until `need` bytes fit under --cache-size."""
        warned = False
        while not self.make_room(need):
            if not warned:
                log.warning("cache full (%d of %d bytes, none evictable yet): writers wait for"
                            " uploads", self.files.cached_bytes + self._replica_bytes(),
                            self.cache_size)
                warned = True
                self.waits += 1
            await self.signals.wait_changed()

    def statistics(self) -> SpaceStats:
        return SpaceStats(cache_size=self.cache_size, keep_local=self.keep_local,
                          cached_bytes=self.files.cached_bytes, evicted=self.evicted,
                          waits=self.waits)
