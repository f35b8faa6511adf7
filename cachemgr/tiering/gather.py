"""Gathering other nodes' files of a set before its manifest is built (multi-node commits).

A directory set committed by DCP, a rename or `ckptfs commit` may hold files that other nodes
wrote (docs/ARCHITECTURE.md "Many nodes"). Before the publisher (cachemgr.tiering.publish) builds
its manifest, `Gatherer.gather(seq)` waits until every such file is durable in the store, reading
the other nodes' part records (cachemgr.tiering.parts) and, where the set's `.metadata` does not say
which files it needs, the other live nodes' acknowledgements of the commit's intent
(cachemgr.tiering.members).

State (all in memory, trio thread only, owned here):
  * `_foreign[seq]`: the other nodes' durable files of set `seq`, ready for its manifest;
    filled by `gather`, taken by the publisher (`foreign`, `forget`);
  * `_waiting[seq]`: what set `seq` still waits for (status "waiting_for");
  * `_gathering`: the sets a `gather` task runs for (at most one task per set).
Crash states: nothing durable. After a restart every live set is queued for publish again
(cachemgr.tiering.commit `recover`) and its gathering starts over from `.metadata` and the records.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from cachemgr.core.errors import FsError
from cachemgr.core.sets import DCP_METADATA, LIVE_STATES, SetRegistry
from cachemgr.format import names
from cachemgr.format.dcp import storage_files
from cachemgr.format.docs import FileDoc, GatheredFile
from cachemgr.store import ObjectStore, StoreError
from cachemgr.tiering.parts import RecordCache, read_records
from cachemgr.tiering.progress import WaitingFor

if TYPE_CHECKING:
    from cachemgr.core.filecache import FileCache
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.tiering.members import CommitAcks
    from cachemgr.tiering.signals import Signals

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GatherStats:
    """`Gatherer.statistics()`: other nodes' files (`dataclasses.asdict` for JSON)."""

    gathering: int
    waiting: int
    ready: int


class Gatherer:
    """Other nodes' files of the sets being published (see the module docstring)."""

    def __init__(self, *, table: InodeTable, files: FileCache, index: Index, sets: SetRegistry,
                 store: ObjectStore, node: str, signals: Signals, ensure_all: Callable[[int], Any],
                 commit_acks: Callable[[int, str, list[str]], CommitAcks],
                 commit_timeout: float, gather_poll: float) -> None:
        self.table = table
        self.files = files
        self.index = index
        self.sets = sets
        self.store = store
        self.node = node
        self.signals = signals
        self._ensure_all = ensure_all    # cachemgr.restore.restorer: bring a file's data back
        self._commit_acks = commit_acks  # tiering.members: other nodes acknowledge a commit
        self.commit_timeout = commit_timeout
        self.gather_poll = gather_poll
        self._foreign: dict[int, list[GatheredFile]] = {}
        self._waiting: dict[int, WaitingFor] = {}
        self._gathering: set[int] = set()

    # -- for the publisher --------------------------------------------------------------------

    def gathered(self, seq: int) -> bool:
        """`gather(seq)` has found every other node's file of set `seq`."""
        return seq in self._foreign

    def start(self, seq: int) -> bool:
        """Claim the gathering of set `seq`: False if a `gather` task already runs for it."""
        if seq in self._gathering:
            return False
        self._gathering.add(seq)
        return True

    def foreign(self, seq: int) -> list[GatheredFile]:
        return self._foreign.get(seq, [])

    def forget(self, seq: int) -> None:
        """Set `seq` was published or ended: drop what was gathered for it."""
        self._waiting.pop(seq, None)
        self._foreign.pop(seq, None)

    def waiting(self, seq: int) -> WaitingFor | None:
        """What set `seq` waits for, for status (None: nothing)."""
        return self._waiting.get(seq)

    def first_waiting(self) -> int | None:
        """The lowest seq of the sets that wait for other nodes (None: none)."""
        return min(self._waiting) if self._waiting else None

    def held_seqs(self) -> set[int]:
        """The sets gathered or waited for now (never pruned: cachemgr.tiering.history)."""
        return set(self._foreign) | set(self._waiting) | self._gathering

    def gathering(self, seq: int) -> bool:
        """A `gather` task runs for set `seq` now (status: what a stuck set waits for)."""
        return seq in self._gathering

    def statistics(self) -> GatherStats:
        return GatherStats(gathering=len(self._gathering), waiting=len(self._waiting),
                           ready=len(self._foreign))

    def fail(self, seq: int, path: str, msg: str) -> None:
        """Set `seq` can never be published as committed: `failed`, with `msg` as its error."""
        log.error("set %d (%s) failed: %s", seq, path, msg)
        with self.index.tx():
            self.sets.set_state(seq, "failed", msg)
        self.forget(seq)
        self.signals.changed_now()

    # -- gathering ----------------------------------------------------------------------------

    def _dcp_required(self, seq: int) -> set[str] | None:
        """Storage files named by the set's `.metadata` (None: not readable)."""
        for rel, ino, _version, _size, _mode, _mtime, _obj in self.sets.files(seq):
            if rel == DCP_METADATA:
                try:
                    with open(self.files.path(ino), "rb") as f:
                        data = f.read()
                except OSError as e:
                    log.warning("set %d: cannot read its .metadata: %s", seq, e)
                    return None
                if not data and self.index.inode_fields(ino, "cached") == (0,):
                    return None  # evicted; the caller fetches it first
                required = storage_files(data)  # names as DCP wrote them (os-style str)
                return None if required is None else {names.from_str(n) for n in required}
        return None

    async def _required(self, seq: int) -> set[str] | None:
        """The files a DCP set needs, from its `.metadata` (brought back first if evicted)."""
        for rel, ino, *_ in self.sets.files(seq):
            if rel == DCP_METADATA and not self.table.get(ino).cached:
                try:
                    await self._ensure_all(ino)
                except (FsError, StoreError, OSError) as e:
                    log.warning("set %d: cannot bring its .metadata back: %s", seq, e)
        return self._dcp_required(seq)

    async def gather(self, seq: int, ready: Callable[[int], None]) -> None:
        """Wait until every file of set `seq` written by other nodes is durable, then call
        `ready(seq)` (`foreign(seq)` holds them); nothing if the set ended or failed meanwhile.
        What the set must include:
          * DCP: every storage file its `.metadata` names (the ones not in this node's
            directory must come from other nodes' part records, durable);
          * otherwise (a directory renamed into place, `ckptfs commit`), or when `.metadata`
            cannot be read: every file another node announced under the set's path or the path
            it was renamed from, each durable. Closes do not wait for their records, so first
            every other live node acknowledges the commit's intent, which it does once its
            records under those paths are in the store (cachemgr.tiering.members); a node alone pays
            one LIST of the members.
        Fails the set after `commit_timeout` seconds since its commit. Call `start` first."""
        acks = None
        try:
            s = self.sets.get(seq)
            if s is None:
                return
            layout = json.loads(s.layout)
            roots = [s.path] + ([layout["from"]] if layout.get("from") else [])
            local = {r[0] for r in self.sets.files(seq)}
            # an amend of a DCP directory: its `.metadata` still names the files it needs
            required = await self._required(seq) if s.reason in ("dcp", "amend") else None
            if required is None:
                acks = self._commit_acks(seq, s.path, roots)
            foreign = await self._poll(seq, roots, local, required, acks)
            if foreign is None:
                return
            self._waiting.pop(seq, None)
            self._foreign[seq] = [{**f, "node": node} for node, f in foreign.values()]
            if foreign:
                log.info("set %d (%s): %d file(s) from node(s) %s are durable", seq, s.path,
                         len(foreign), ", ".join(sorted({node for node, _f in foreign.values()})))
            ready(seq)
        finally:
            self._gathering.discard(seq)
            if acks is not None and not acks.done:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await acks.close()

    async def _poll(self, seq: int, roots: list[str], local: set[str],
                    required: set[str] | None,
                    acks: CommitAcks | None) -> dict[str, tuple[str, FileDoc]] | None:
        """Look until nothing is missing: the other nodes' durable files, or None if the set
        ended or failed."""
        cache: RecordCache = {}
        pause = 0.1
        while True:
            s = self.sets.get(seq)
            if s is None or s.state not in LIVE_STATES:
                self._waiting.pop(seq, None)
                return None
            foreign: dict[str, tuple[str, FileDoc]] = {}
            pending: set[str] = set()
            unacked: list[str] = []
            if acks is not None:
                try:
                    unacked = await acks.missing()
                except StoreError as e:
                    log.warning("set %d: asking the other nodes for their records failed:"
                                " %s", seq, e)
                    unacked = ["(store unreachable)"]
            if not unacked and (required is None or not required <= local):
                bad: dict[str, str] = {}
                try:
                    foreign, pending = await self._collect(roots, local, cache, bad)
                except StoreError as e:
                    log.warning("set %d: reading other nodes' part records failed: %s",
                                seq, e)
                    pending = {"(store unreachable)"}
                if bad:
                    # A record the store holds for this set that no honest node could
                    # have written: publishing without it could leave a file out,
                    # publishing with it could name anything. The set fails, saying why.
                    key, why = min(bad.items())
                    self.fail(seq, s.path, f"part record {key} is invalid: {why}")
                    return None
            if required is not None:
                waiting = sorted(required - local - set(foreign))
            else:
                waiting = sorted(pending)
            if not waiting and not unacked:
                return foreign
            waited = (time.time_ns() - s.committed_ns) / 1e9
            nodes = sorted({node for node, _f in foreign.values()})
            w: WaitingFor = {"files": waiting[:50], "missing": len(waiting),
                             "nodes_seen": nodes, "waited_s": round(waited, 1),
                             "timeout_s": self.commit_timeout}
            if unacked:
                w["acks_from"] = unacked[:50]
            self._waiting[seq] = w
            if waited >= self.commit_timeout:
                what = (f"{len(waiting)} file(s) from other nodes: {', '.join(waiting[:10])}"
                        if not unacked else
                        f"acknowledgements from node(s) {', '.join(unacked[:10])}")
                self.fail(seq, s.path,
                          f"commit timed out after {waited:.0f}s waiting for {what}")
                return None
            if pause >= 1.0 or len(self._waiting) == 1:
                if unacked:
                    log.info("set %d (%s) waits for acknowledgements from node(s) %s"
                             " (%.0fs)", seq, s.path, ", ".join(unacked[:10]), waited)
                else:
                    log.info("set %d (%s) waits for %d file(s) from other nodes (%.0fs)",
                             seq, s.path, len(waiting), waited)
            self.signals.changed_now()
            await trio.sleep(min(pause, max(0.01, self.commit_timeout - waited)))
            pause = min(pause * 2, self.gather_poll)

    async def _collect(self, roots: list[str], local: set[str], cache: RecordCache,
                       bad: dict[str, str]) -> tuple[dict[str, tuple[str, FileDoc]], set[str]]:
        """Other nodes' files under `roots`, by path inside the set: ({rel: (node, entry)}
        of durable ones, {rel} of announced ones not durable yet). A path this node has
        itself is never taken from another node; a path several nodes have is taken from the
        newest durable copy."""
        foreign: dict[str, tuple[str, FileDoc]] = {}
        pending: set[str] = set()
        for root in roots:
            for rec in await read_records(self.store, root, self.node, cache, bad):
                d = rec["dir"]
                sub = "" if d == root else d[len(root) + 1:]
                for f in rec["files"]:  # validated (cachemgr.format.validate.part_record)
                    rel = f"{sub}/{f['name']}" if sub else f["name"]
                    if rel in local:
                        continue
                    if f["object"] is None:
                        pending.add(rel)
                        continue
                    entry: FileDoc = {"path": rel, "size": f["size"], "mode": f["mode"],
                                      "mtime_ns": f["mtime_ns"], "object": f["object"]}
                    old = foreign.get(rel)
                    if old is None or entry["mtime_ns"] > old[1]["mtime_ns"]:
                        foreign[rel] = (rec["node"], entry)
        return foreign, pending - set(foreign)
