"""History: how long the index remembers sets that ended (docs/SEMANTICS.md "How long the index
remembers a set").

Every commit adds a `sets` row and a `set_files` row per file. Without pruning they pile up for
the life of the cache: the rows of sets that were superseded, replaced, deleted or failed and
re-committed are history nobody acts on. `History` owns the policy that drops them;
`SetRegistry.prune` does the SQL. A set that ended is pruned once all of these hold:

  * its state is one it never leaves (ENDED_STATES: superseded, failed, replaced, deleted);
  * a later set of the same path exists (so `newest_at`, `holding`, `known_etag`,
    `failed_newest`, `dir_set_of` answer as before: they look at the newest set of a path), or
    it is `deleted` (its path went; a `ckptfs wait` of that path then answers "none" instead
    of "deleted");
  * it is not among the newest `keep_recent` sets (`ckptfs status` lists the newest 50) and
    was committed more than `keep_age` seconds ago;
  * no service holds its seq in memory (`held`: the namespace FIFO, absorbed and blocked sets,
    the gatherer, directory waits): those look it up again later.

Objects are not History's: an object row goes when GC deletes the object from the store
(cachemgr.tiering.publish), which the states above already allowed (no set that holds objects is
ever pruned). So what the index keeps is bounded by the sets that hold data (committed,
uploading, durable, deleting, replicated), the newest set of each path, the newest
`keep_recent`, and what `keep_age` seconds of commits add.

When: a pass runs after every `every` commits (woken by `Signals.changed`), off the write path,
in batches of `batch` sets per index transaction with a checkpoint between them, so a pass never
holds the loop for long. Cost of a pass: one walk of `sets_by_state` over the ended sets still
kept (bounded as above) plus O(log N) per pruned row: O(1) amortised per commit.

State: `pruned` (a counter) and the seq of the last pass; trio thread only. Crash: each batch is
one transaction; a crash between batches leaves the rest for the next pass.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.core.sets import SetRegistry
    from cachemgr.tiering.signals import Signals

log = logging.getLogger(__name__)

# The newest sets are never pruned, whatever their state: `ckptfs status` shows the newest 50,
# and a few times that leaves the recent history readable in the index with the sqlite3 shell.
KEEP_RECENT = 200
# An ended set younger than this stays: 5 minutes is longer than any in-memory reference to a
# set survives without being `held` (a publish event, a wait's step runs within a wake-up),
# and long enough for a human to look at what just happened. At 100 commits/s it keeps 30,000
# rows: costs are O(log N), so this only bounds the index's size.
KEEP_AGE_S = 300.0
# A pass every 256 commits: a few ms of work each (a batch of `BATCH` deletes is about as many
# B-tree seeks), so pruning adds well under 1% to a commit.
PRUNE_EVERY = 256
BATCH = 500


@dataclass(frozen=True, slots=True)
class HistoryStats:
    """`History.statistics()` (`dataclasses.asdict` for JSON)."""

    pruned: int
    passes: int


class History:
    """Prunes the index's records of sets that ended (see the module docstring)."""

    def __init__(self, *, index: Index, sets: SetRegistry, signals: Signals,
                 held: list[Callable[[], set[int]]], keep_recent: int = KEEP_RECENT,
                 keep_age: float = KEEP_AGE_S, every: int = PRUNE_EVERY,
                 batch: int = BATCH) -> None:
        """`held`: each returns the seqs a service holds in memory (never pruned)."""
        self.index = index
        self.sets = sets
        self.signals = signals
        self._held = held
        self.keep_recent = keep_recent
        self.keep_age = keep_age
        self.every = every
        self.batch = batch
        self._last = -every  # the first wake-up runs a pass: history left by an older ckptfs
        self.pruned = 0
        self.passes = 0

    async def run(self) -> None:
        while True:
            if self.sets.max_seq() - self._last >= self.every:
                await self.prune()
            await self.signals.wait_changed()

    async def prune(self) -> int:
        """One pass; returns the number of sets pruned."""
        top = self.sets.max_seq()
        self._last = top
        held: set[int] = set()
        for f in self._held:
            held |= f()
        seqs = self.sets.prunable(before_seq=top - self.keep_recent + 1,
                                  before_ns=time.time_ns() - int(self.keep_age * 1e9))
        seqs = [s for s in seqs if s not in held]
        for i in range(0, len(seqs), self.batch):
            with self.index.tx():
                self.sets.prune(seqs[i:i + self.batch])
            await trio.lowlevel.checkpoint()
        self.passes += 1
        self.pruned += len(seqs)
        if seqs:
            log.debug("history: pruned %d ended sets (up to seq %d)", len(seqs), seqs[-1])
        return len(seqs)

    def statistics(self) -> HistoryStats:
        return HistoryStats(pruned=self.pruned, passes=self.passes)
