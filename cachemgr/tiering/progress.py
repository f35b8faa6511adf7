"""Progress: "is it durable yet?" — `ckptfs wait`, and the per-set rows of `ckptfs status`.

`Progress` answers questions about the sets and never changes them: `wait(path)` follows the
set holding a path (through supersession to the newest set of that path) until it is durable
or ends; a directory that is not (inside) one set is waited for as a whole (`_wait_dir`,
docs/SEMANTICS.md "Waiting for a directory"); `set_rows` gives status its recent sets with
their progress, what each waits for (cachemgr.tiering.gather) and which earlier set it is published
after (cachemgr.tiering.publish); `failed_sets` the failed sets that nothing has replaced since,
over every set (status and metrics count them as at risk); `stuck_sets` the sets pending (committed
or uploading) longer than a threshold (`STUCK_AFTER_S`), over every set whatever its age or
position, each with what it waits for (`waits_for`, one of `WAITS_FOR`) and why, in one line:
the same per-set facts as `set_rows`, and what the upload queue, the store's health, the
gatherer and the namespace FIFO say about it (`Probes`, handed in by cachemgr.engine per
call).

Waiting: every wait request sleeps on `Signals.changed` (woken at every set state change, and
at closes and removals, `Signals.wake_waiters`) and re-reads what it waits for from the index
at each wake (one query for all the sets of a directory wait). State: only each request's own
locals; trio thread only; nothing durable (a wait in flight at a crash is the client's to
repeat).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import trio

from cachemgr.core.errors import FsError
from cachemgr.core.sets import KEPT_STATES, LIVE_STATES, SetRegistry, SetRow
from cachemgr.format import names

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.tiering.signals import Signals, StoreHealth
    from cachemgr.tiering.uploadqueue import UploadQueueStats

log = logging.getLogger(__name__)

# `ckptfs wait`'s answer, sent to the CLI as JSON: {"state", "seq", "path", "error"}, and for
# a directory what it waited for (docs/SEMANTICS.md "Waiting")
Reply = dict[str, object]


class WaitingFor(TypedDict):
    """What a set waits for from other nodes (cachemgr.tiering.gather): status "waiting_for"."""

    files: list[str]          # the first 50 of them
    missing: int
    nodes_seen: list[str]
    waited_s: float
    timeout_s: float
    acks_from: NotRequired[list[str]]  # nodes whose acknowledgement it waits for (first 50)


class SetStatusRow(TypedDict):
    """One set as `ckptfs status` shows it (`Progress.set_rows`); the optional fields are
    there when they apply."""

    seq: int
    path: str
    kind: str
    state: str
    reason: str | None
    files: int
    bytes: int
    bytes_uploaded: int
    committed_ns: int
    durable_ns: int | None
    error: str | None
    origin: str
    waiting_for: NotRequired[WaitingFor]   # other nodes' files or acknowledgements
    after_set: NotRequired[int]            # published once that set is (commit order)
    replicas: NotRequired[int]             # --replicas: buddies holding it
    replicated: NotRequired[bool]
    # a stuck set (`Progress.stuck_sets`): its age, what it waits for and why, and the head of
    # the queue it is in
    age_s: NotRequired[float]
    waits_for: NotRequired[str]
    why: NotRequired[str]
    behind_set: NotRequired[int]
    head_waits_for: NotRequired[str]


@dataclass(frozen=True, slots=True)
class FailedSet:
    """`Progress.failed_sets`: a failed set still at risk (`dataclasses.asdict` for JSON)."""

    seq: int
    path: str
    bytes: int
    error: str | None
    committed_ns: int


@dataclass(frozen=True, slots=True)
class StuckSet:
    """A stuck set as metrics name it (`Progress.stuck_sets`' row, its first fields)."""

    seq: int
    path: str
    state: str
    committed_ns: int
    age_s: float
    waits_for: str
    why: str

    @classmethod
    def of(cls, row: SetStatusRow) -> StuckSet:
        return cls(seq=row["seq"], path=row["path"], state=row["state"],
                   committed_ns=row["committed_ns"], age_s=row.get("age_s", 0.0),
                   waits_for=row.get("waits_for", "unknown"), why=row.get("why", ""))

# Set states in which a set no longer holds its path's content: a directory that held one
# of these and was written file by file since is waited for as a directory (`Progress.wait`).
_ENDED = ("superseded", "failed", "deleting", "deleted")
_ALL_STATES = ("committed", "uploading", "durable", "failed", "superseded", "replaced",
               "deleting", "deleted", "replicated")

# A set pending (committed or uploading) longer than this is *stuck*: status (plain and --json)
# and the metrics name it with what it waits for, whatever its age or position among the sets.
# 120 s: longer than what a healthy set waits for anything but its own bytes (the store's
# retries give up within a minute, a commit waits for another node's acknowledgement one poll
# interval, 10 s by default), and the default --lease, after which a node that died is no longer
# waited for; a set pending past it waits for something that does not end by itself, or for a
# very large upload (then named with its bytes uploaded so far, which is worth seeing too). A
# mount whose --commit-timeout is shorter than 4 x 120 s names a set at a quarter of it
# (`stuck_after`): a commit that waits for other nodes is named well before it fails.
STUCK_AFTER_S = 120.0
# status --json lists at most this many stuck sets, oldest first (`stuck_sets` counts them all)
STUCK_SHOWN = 20
# What a stuck set waits for (`waits_for`), the most precise the code knows, in this order:
#   open_for_writing  a file of the set is still open for writing here: its upload starts at its
#                     last close (a commit that came before a writer's close)
#   content_gone      a file's committed content is no longer in the cache and nothing
#                     superseded the set: it can never be uploaded (a bug)
#   store             the store fails (StoreHealth: consecutive failures, last error), while the
#                     set needs it (uploads, publication, other nodes' records)
#   uploads           files not in the store yet, their uploads queued or running
#   upload_lost       files not in the store yet and nothing queued or running to upload them
#                     (a bug: a remount queues them again)
#   other_nodes       files other nodes write, not durable yet (cachemgr.tiering.gather)
#   acks              other nodes' acknowledgements of the commit (cachemgr.tiering.members)
#   gathering         the gatherer is reading .metadata, part records or acknowledgements
#   commit_order      published after an earlier set this node committed (cachemgr.tiering.publish)
#   publish_queued    its publication is queued in the namespace FIFO
#   publishing        the namespace worker is publishing it now (its objects' HEADs, its
#                     manifest PUT)
#   unknown           none of the above: nothing known will make it durable (a bug)
WAITS_FOR = ("open_for_writing", "content_gone", "store", "uploads", "upload_lost",
             "other_nodes", "acks", "gathering", "commit_order", "publish_queued", "publishing",
             "unknown")
# the waits_for that no wait will end: status shows them in red, not yellow
STUCK_FOR_GOOD = ("content_gone", "upload_lost", "unknown")


def stuck_after(commit_timeout: float) -> float:
    """The stuck threshold of a mount with --commit-timeout `commit_timeout` (seconds):
    STUCK_AFTER_S, or a quarter of the commit timeout where that is shorter."""
    return min(STUCK_AFTER_S, commit_timeout / 4)


@dataclass(frozen=True)
class Probes:
    """What `Progress.stuck_sets` asks the services Progress is not built with
    (cachemgr.engine hands them in per call; each is read, never changed)."""
    uploads: UploadQueueStats                 # queued, running, rate
    health: StoreHealth                       # consecutive failures, last error
    gathering: Callable[[int], bool]          # Gatherer.gathering: a gather task runs for seq
    publish_queued: Callable[[int], int | None]  # Publisher.publish_queued: events ahead of it
    publishing: Callable[[int], bool] = lambda seq: False  # Publisher.publishing: in hand now


@dataclass(frozen=True, slots=True)
class ProgressStats:
    """`Progress.statistics()`: `ckptfs wait` (`dataclasses.asdict` for JSON)."""

    waits: int


class Progress:
    """Waits and per-set progress (see the module docstring)."""

    def __init__(self, *, table: InodeTable, index: Index, sets: SetRegistry, signals: Signals,
                 waiting_for: Callable[[int], WaitingFor | None],
                 blocked_by: Callable[[int], int | None]) -> None:
        self.table = table
        self.index = index
        self.sets = sets
        self.signals = signals
        self._waiting_for = waiting_for  # cachemgr.tiering.gather: what a set waits for
        self._blocked_by = blocked_by    # cachemgr.tiering.publish: the set it is published after
        self.waits = 0
        # the sets each directory wait in flight follows (its `pending` and `durable`, which it
        # changes in place): held in the index while it runs (cachemgr.tiering.history)
        self._dir_waits: dict[int, tuple[set[int], set[int]]] = {}
        self._dir_wait_ids = 0

    def held_seqs(self) -> set[int]:
        """The sets the directory waits in flight will look up again (never pruned)."""
        out: set[int] = set()
        for pending, durable in self._dir_waits.values():
            out |= pending | durable
        return out

    # -- status -------------------------------------------------------------------------------

    def set_rows(self, limit: int) -> tuple[list[SetStatusRow], int]:
        """The `limit` most recent sets as status shows them, and the bytes of live sets not
        uploaded yet."""
        sets = []
        pending = 0
        for s in self.sets.recent(limit):
            row = self._row(s, self.sets.files(s.seq))
            if s.state in LIVE_STATES:
                pending += row["bytes"] - row["bytes_uploaded"]
            sets.append(row)
        return sets, pending

    def _row(self, s: SetRow, files: list[tuple[Any, ...]]) -> SetStatusRow:
        """Set `s` (with its `files`) as status shows it: progress, what it waits for
        (cachemgr.tiering.gather) and the set it is published after (cachemgr.tiering.publish)."""
        total = sum(f[3] for f in files)
        done = sum(json.loads(f[6])["size"] for f in files if f[6])
        row: SetStatusRow = {"seq": s.seq, "path": s.path, "kind": s.kind, "state": s.state,
               "reason": s.reason, "files": len(files), "bytes": total,
               "bytes_uploaded": done, "committed_ns": s.committed_ns,
               "durable_ns": s.durable_ns, "error": s.error, "origin": s.origin}
        waiting = self._waiting_for(s.seq)
        if waiting is not None:
            # waited_s as of now, not as of the gather loop's last look
            row["waiting_for"] = {**waiting, "waited_s": round(
                (time.time_ns() - s.committed_ns) / 1e9, 1)}
        after = self._blocked_by(s.seq)
        if after is not None and s.state in LIVE_STATES:
            row["after_set"] = after  # published once that one is
        return row

    # -- stuck sets: pending longer than a threshold, over every set --------------------------

    def stuck_sets(self, after_s: float, probes: Probes,
                   limit: int = STUCK_SHOWN) -> tuple[int, list[SetStatusRow]]:
        """The sets pending (committed or uploading) for `after_s` seconds or more, over every
        set: how many, and the oldest `limit` of them, oldest first, each a `set_rows` row with
        `age_s`, `waits_for` (one of WAITS_FOR) and `why` (one line for a person) added. A set
        published after another in commit order also names the oldest pending set
        (`behind_set`: the head of the queue it is in) and what that one waits for."""
        now = time.time_ns()
        cut = now - int(after_s * 1e9)
        live = self.sets.by_states(LIVE_STATES)  # seq order: the first is the head of the queue
        old = sorted((s for s in live if s.committed_ns <= cut),
                     key=lambda s: (s.committed_ns, s.seq))
        rows = []
        head: tuple[SetRow, str, str] | None = None
        for s in old[:limit]:
            files = self.sets.files(s.seq)
            row = self._row(s, files)
            row["age_s"] = round((now - s.committed_ns) / 1e9, 1)
            kind, why = self._why(s, row, files, probes)
            if kind == "commit_order" and live and live[0].seq < s.seq:
                if head is None:
                    h = live[0]
                    hfiles = self.sets.files(h.seq)
                    head = (h, *self._why(h, self._row(h, hfiles), hfiles, probes))
                h, hkind, hwhy = head
                row["behind_set"] = h.seq
                row["head_waits_for"] = hkind
                why += f"; the oldest pending set, {h.seq} ({h.path}), waits for: {hwhy}"
            row["waits_for"], row["why"] = kind, why
            rows.append(row)
        return len(old), rows

    def _why(self, s: SetRow, row: SetStatusRow, files: list[tuple[Any, ...]],
             probes: Probes) -> tuple[str, str]:
        """What set `s` (its status `row`, its `files`) waits for (`WAITS_FOR`) and one line
        saying so, the most precise the code knows (see WAITS_FOR for the order)."""
        h = probes.health
        failing = (f"the store is failing ({h.consecutive_failures} failure(s) in a row; last"
                   f" error: {h.last_error or '?'})") if h.consecutive_failures else ""
        missing = [(f[0], f[1], f[2]) for f in files if not f[6]]
        if missing:
            return self._why_uploads(s, row, missing, probes, failing)
        w = row.get("waiting_for")
        if w is not None:
            unreachable = "(store unreachable)"
            if unreachable in w.get("acks_from", []) or unreachable in w.get("files", []):
                return "store", (f"the store cannot be read for other nodes' records or"
                                 f" acknowledgements{'; ' + failing if failing else ''}")
            timeout = f"{w['waited_s']:.0f}s of its {w['timeout_s']:.0f}s commit timeout"
            if w.get("acks_from"):
                return "acks", (f"acknowledgements of the commit from node(s)"
                                f" {', '.join(w['acks_from'][:10])} ({timeout})")
            return "other_nodes", (f"{w['missing']} file(s) other nodes write, not durable"
                                   f" yet: {_some(w['files'], 5)} ({timeout}; node(s) seen:"
                                   f" {', '.join(w['nodes_seen']) or 'none'})")
        if probes.gathering(s.seq):
            return "gathering", ("gathering other nodes' files of it (reading its .metadata,"
                                 " their part records or acknowledgements)"
                                 + (f"; {failing}" if failing else ""))
        after = row.get("after_set")
        if after is not None:
            a = self.sets.get(after)
            if a is not None and a.state in LIVE_STATES:
                return "commit_order", (f"published after set {after} ({a.path}, {a.state}),"
                                        " committed before it (commit order)")
            # That one ended: this one is released at the namespace worker's next look.
            return "commit_order", (f"published after set {after}, which is"
                                    f" {a.state if a is not None else 'gone'} now: released"
                                    " at the namespace worker's next look")
        ahead = probes.publish_queued(s.seq)
        if probes.publishing(s.seq):
            return "publishing", ("the namespace worker is publishing it now (checking its"
                                  " objects, writing its manifest)"
                                  + (f"; {failing}" if failing else ""))
        if failing:
            return "store", f"its publication: {failing}"
        if ahead is not None:
            return "publish_queued", (f"its publication is queued behind {ahead} namespace"
                                      " event(s)")
        return "unknown", ("NOTHING KNOWN: every file is uploaded, and nothing gathers, holds,"
                           " queues or publishes it: nothing will make it durable (a bug; a"
                           " remount queues it again)")

    def _why_uploads(self, s: SetRow, row: SetStatusRow, missing: list[tuple[str, int, int]],
                     probes: Probes, failing: str) -> tuple[str, str]:
        """A set with files not in the store yet (`missing`: rel, ino, version): why not."""
        n, total = len(missing), row["files"]
        progress = (f"{n} of {total} file(s) not in the store yet ({_size(row['bytes_uploaded'])}"
                    f" of {_size(row['bytes'])} uploaded)")
        writing: list[str] = []
        gone: list[str] = []
        for rel_, ino, version in missing:
            rel = f"{s.path}/{rel_}" if rel_ else s.path  # its path in the mount
            node = self.table.if_loaded(ino)
            if node is not None and node.writers:
                writing.append(rel)
                continue
            fields = self.index.inode_fields(ino, "version", "nlink", "cached")
            if fields is None or fields[0] != version or fields[1] == 0 or fields[2] != 1:
                gone.append(rel)
        if writing:
            return "open_for_writing", (f"{progress}: {_some(writing, 5)} still open for"
                                        " writing here (its upload starts at its last close)")
        if gone:
            return "content_gone", (f"{progress}: the committed content of {_some(gone, 5)} is"
                                    " no longer in the cache and the set was not superseded:"
                                    " nothing can upload it (a bug)")
        q = probes.uploads
        queue = (f"upload queue: {q.queued} queued, {q.running} running,"
                 f" {_size(q.rate_bytes_per_s)}/s")
        if failing:
            return "store", f"{progress}; {failing}; {queue}"
        if q.queued or q.running:
            return "uploads", f"{progress}; {queue}"
        return "upload_lost", (f"NOTHING KNOWN: {progress} and no upload queued or running"
                               " (a lost upload: a bug; a remount queues it again)")

    def failed_sets(self) -> list[FailedSet]:
        """The unresolved failed sets, over every set (not only the recent ones), oldest first:
        each a FailedSet. A failed set is unresolved while it is
        still what its path holds: no later set of its path (in any state) nor of a directory
        above it (which absorbed it), and the path still leads to the set's root inode (not
        removed, nor renamed away or over). Its bytes are then only in this node's cache: it
        is at risk, as a set not durable yet is (docs/SEMANTICS.md "Durability window"). A
        later commit of the path resolves it (at risk again only if that one fails too)."""
        out = []
        for r, nbytes in self.sets.failed_newest():
            held = self.sets.holding(r.path)
            if held is None or held.seq != r.seq:
                continue  # a directory above it was committed since: that set holds the path
            if self._at_path(r.path) != r.root_ino:
                continue  # removed or replaced since: there is nothing of it left to lose
            out.append(FailedSet(seq=r.seq, path=r.path, bytes=nbytes, error=r.error,
                                 committed_ns=r.committed_ns))
        return out

    def statistics(self) -> ProgressStats:
        return ProgressStats(waits=self.waits)

    # -- waiting for one set ------------------------------------------------------------------

    async def wait(self, path: str, timeout: float | None) -> Reply:
        """Wait until the set holding `path` is durable (following supersession to the newest
        set of that path). Returns {"state", "seq", "path", "error"}. `path` as os functions
        give it (`ckptfs wait PATH`). A directory that is not (inside) one set is waited for
        as a whole (`_wait_dir`)."""
        self.waits += 1
        path = names.from_str(path.strip("/"))
        s = self.sets.holding(path) if path else None
        if s is None or s.state in _ENDED:
            # Not in one set, or the set that held it ended and the directory has been written
            # file by file since (a set below it committed later): the sets under it.
            under = self._newest_under(path)
            if s is None or any(r.seq > s.seq and r.path != path for r in under.values()):
                ino = self._dir_ino(path)
                if ino is not None:
                    return await self._wait_dir(path, ino, under, timeout)
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                s = self.sets.holding(path)
                if s is None:
                    return {"state": "none", "error": f"{path or '/'} is not in any committed"
                            " set"}
                if s.state in ("durable", "failed", "deleted", "deleting", "replaced"):
                    return {"state": s.state, "seq": s.seq, "path": s.path, "error": s.error}
                await self.signals.wait_changed()
        s = self.sets.holding(path)
        return {"state": "timeout", "seq": s.seq if s else None, "path": s.path if s else None,
                "error": f"not durable after {timeout}s (state {s.state if s else '?'})"}

    async def wait_until(self, path: str, timeout: float | None,
                         reached: Callable[[SetRow], str | None], what: str) -> Reply:
        """Wait until `reached(set)` names a state for the set holding `path` (following
        supersession), or the set ends (durable, failed, ...): `ckptfs wait --replicated`. One
        set: a directory of many sets is not waited for as a whole here."""
        self.waits += 1
        path = names.from_str(path.strip("/"))
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                s = self.sets.holding(path) if path else None
                if s is None:
                    return {"state": "none", "error": f"{path or '/'} is not in any committed"
                            " set"}
                got = reached(s)
                if got is not None:
                    return {"state": got, "seq": s.seq, "path": s.path, "error": None}
                if s.state in ("durable", "failed", "deleted", "deleting", "replaced"):
                    return {"state": s.state, "seq": s.seq, "path": s.path, "error": s.error}
                await self.signals.wait_changed()
        s = self.sets.holding(path) if path else None
        return {"state": "timeout", "seq": s.seq if s else None, "path": s.path if s else None,
                "error": f"not {what} after {timeout}s (state {s.state if s else '?'})"}

    # -- waiting for a directory of many sets (docs/SEMANTICS.md "Waiting for a directory") ----
    #
    # What is waited for is fixed at the call: the newest commit of each path at or under the
    # directory, if it is committed, uploading or durable, and every file under it that is
    # open for writing (it commits at its last close, or the wait says why not). A set that
    # ended (failed, deleted) or a file in no set ends the wait with the reason. One request,
    # woken by `Signals.changed` (every set state change, and closes and removals); each wake
    # re-reads the pending sets in one query.

    def _newest_under(self, path: str) -> dict[str, SetRow]:
        """The newest set (any state) of each path at or under `path` ("" = the mount root)."""
        rows = (self.sets.at_or_under(path, _ALL_STATES) if path
                else self.sets.by_states(_ALL_STATES))
        return {r.path: r for r in rows}  # ordered by seq: the newest of each path wins

    def _dir_ino(self, path: str) -> int | None:
        ino = self._at_path(path) if path else 1
        if ino is None:
            return None
        try:
            return ino if self.table.get(ino).is_dir else None
        except FsError:
            return None

    def _at_path(self, path: str) -> int | None:
        """The inode at `path` now, None if there is none."""
        return self.index.resolve(path)

    def _first_failed(self, newest: dict[str, SetRow]) -> Reply | None:
        """A failed set still there, not written anew below and not absorbed by a later commit
        of a directory above it (as `failed_sets` counts it): the directory cannot be
        durable."""
        for p, r in newest.items():
            if r.state == "failed" and self._at_path(p) == r.root_ino and not any(
                    (q.startswith(p + "/") or p.startswith(q + "/")) and x.seq > r.seq
                    for q, x in newest.items()):
                return {"state": "failed", "seq": r.seq, "path": r.path, "error": r.error}
        return None

    def _dir_contents(self, path: str, dir_ino: int, newest: dict[str, SetRow],
                      pending: set[int]) -> tuple[dict[int, str], list[str]]:
        """Files under the directory open for writing (waited for), and files in no set."""
        prefix = path + "/" if path else ""
        # Every file under the directory must be in one of those sets (its current content),
        # or be open for writing (waited for): anything else is in no set, and nothing will
        # commit it on its own (a temporary name, a directory that is not committed yet).
        contents = self.sets.contents_of(pending)
        set_paths = {newest_path for newest_path, r in newest.items() if r.seq in pending}
        files, layout = self.sets.snapshot(dir_ino)
        writing: dict[int, str] = {}  # ino -> path of files open for writing, waited for
        loose: list[str] = []
        for rel, ino, version, *_ in files:
            if (ino, version) not in contents:
                if self.table.get(ino).writers:
                    writing[ino] = prefix + rel
                else:
                    loose.append(prefix + rel)
        for link in layout["symlinks"]:
            p = prefix + link["path"]
            parts = p.split("/")
            if not any("/".join(parts[:i]) in set_paths for i in range(len(parts), 0, -1)):
                loose.append(p)
        return writing, loose

    async def _wait_dir(self, path: str, dir_ino: int, newest: dict[str, SetRow],
                        timeout: float | None) -> Reply:
        where = path or "/"
        failed = self._first_failed(newest)
        if failed is not None:
            return failed
        pending = {r.seq for r in newest.values() if r.state in KEPT_STATES}
        writing, loose = self._dir_contents(path, dir_ino, newest, pending)
        if loose:
            return _uncommitted(where, sorted(loose))
        if not pending and not writing:
            return {"state": "none", "path": path,
                    "error": f"{where} holds no committed set"}
        log.info("wait %s: %d set(s) committed under it, %d file(s) open for writing", where,
                 len(pending), len(writing))
        durable: set[int] = set()
        self._dir_wait_ids += 1
        token = self._dir_wait_ids
        self._dir_waits[token] = (pending, durable)
        try:
            return await self._follow_dir(where, path, pending, durable, writing, timeout)
        finally:
            del self._dir_waits[token]

    async def _follow_dir(self, where: str, path: str, pending: set[int], durable: set[int],
                          writing: dict[int, str], timeout: float | None) -> Reply:
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                ended = self._dir_step(pending, durable, writing)
                if ended is not None:
                    return ended
                if not pending and not writing:
                    log.info("wait %s: %d sets durable", where, len(durable))
                    return {"state": "durable", "path": path, "sets": len(durable)}
                await self.signals.wait_changed()
        n = len(pending) + len(durable)
        names_ = sorted(r.path for r in self._rows(pending))
        msg = (f"{where}: not durable after {timeout}s: {len(pending)} of {n} set(s) still"
               f" pending"
               + (f" ({_some(names_)})" if names_ else ""))
        if writing:
            msg += (f"; {len(writing)} file(s) still open for writing"
                    f" ({_some(sorted(writing.values()))})")
        return {"state": "timeout", "path": path, "sets": n, "pending": len(pending),
                "open": len(writing), "error": msg}

    def _rows(self, seqs: set[int]) -> list[SetRow]:
        """The sets `seqs`, in one query (a directory wait looks at all of them at each wake)."""
        return self.sets.rows(seqs)

    def _closed_files(self, pending: set[int], durable: set[int],
                      writing: dict[int, str]) -> Reply | None:
        """Files waited for that were closed since: their sets are waited for instead."""
        for ino, p in list(writing.items()):
            try:
                node = self.table.get(ino)
            except FsError:
                node = None
            if node is None or not node.nlink:
                return {"state": "deleted", "path": p, "error": f"{p} was removed while open for"
                        " writing, before any commit of it"}
            if node.writers:
                continue
            del writing[ino]
            s = self.sets.set_of_file(ino)  # committed at its close (or a rename since)
            if s is None:
                return _uncommitted(p, [p], closed=True)
            if s.seq not in durable:
                pending.add(s.seq)
        return None

    def _dir_step(self, pending: set[int], durable: set[int],
                  writing: dict[int, str]) -> Reply | None:
        """One look at what a directory wait waits for: moves durable sets out of `pending`,
        follows sets replaced by a newer commit, turns closed files into their sets. Returns
        the reply that ends the wait, or None to go on waiting."""
        ended = self._closed_files(pending, durable, writing)
        if ended is not None:
            return ended
        todo = self._rows(pending)
        while todo:
            r = todo.pop()
            if r.state == "durable":
                pending.discard(r.seq)
                durable.add(r.seq)
                continue
            if r.state in LIVE_STATES:
                continue
            newer = self.sets.holding(r.path)
            if newer is not None and newer.seq > r.seq:
                # A later commit of its path, or of a directory above it (absorbed), took its
                # place: that one is waited for instead (as `wait` follows one set).
                pending.discard(r.seq)
                if newer.seq not in durable and newer.seq not in pending:
                    pending.add(newer.seq)
                    todo.append(newer)
                continue
            if r.state in ("failed", "deleting", "deleted"):
                return {"state": "deleted" if r.state != "failed" else "failed", "seq": r.seq,
                        "path": r.path, "error": r.error}
            if r.state == "replaced":  # was durable; its successor is (not reached: newer)
                pending.discard(r.seq)
                durable.add(r.seq)
                continue
            # superseded, no later commit yet: its content changed (a rewrite) or went away.
            ino = self._at_path(r.path)
            if ino is None:  # removed, or renamed away, before its upload
                return {"state": "deleted", "seq": r.seq, "path": r.path,
                        "error": f"{r.path} is no longer in the mount ({r.error})"}
            if r.kind == "file" and self.table.get(ino).is_reg:
                pending.discard(r.seq)  # the file is waited for: its next commit, at its close
                writing[ino] = r.path
                return self._dir_step(pending, durable, writing)
            # A directory set one of whose files was rewritten: waits for its next commit.
        return None


def _size(n: float) -> str:
    """A byte count for a person: 512 B, 1.5 KiB, ... (as ckptfs.fmt.human)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _some(paths: list[str], n: int = 5) -> str:
    """The first `n` of `paths`, and how many more."""
    more = f" and {len(paths) - n} more" if len(paths) > n else ""
    return ", ".join(paths[:n]) + more


def _uncommitted(where: str, paths: list[str], closed: bool = False) -> Reply:
    """The reply of a directory wait that found files in no committed set (`closed`: a file it
    waited for was closed and nothing committed it)."""
    what = (f"{where} was closed but is in no committed set" if closed else
            f"{where} holds {len(paths)} file(s) in no committed set: {_some(paths)}")
    return {"state": "uncommitted", "path": where, "files": paths[:50], "count": len(paths),
            "error": f"{what}; not durable (a temporary name, a directory that is no set or "
                     "another node's: nothing commits it on its own; `ckptfs commit` it, or "
                     "remove it)"}
