"""Part records: how a node tells the store which files it wrote into a set that may be
committed on another node (docs/FORMAT.md "Part records", docs/ARCHITECTURE.md "Many nodes").

On a cluster every node writes its ranks' shards into its own mount; the commit (DCP's
`.metadata` rename, a directory rename, `ckptfs commit`) happens on one node only. That node
can only publish the set once every shard is durable, whichever node wrote it, so each node
keeps, per directory it writes into, one small JSON object in the store:

    parts/<dir path>/@<node>.json   {"node", "dir", "files": [{name, size, mode, mtime_ns,
                                      object | null}]}

listing its own files in that directory: `object` is the uploaded object (durable) or null
(closed or being written, upload pending). A record is written

  * soon after the last writer of a file in an open set closes it (the close marks the
    directory and returns at once: nothing on the trainer's write path waits for the store);
  * when another node's commit of a directory set asks for it (cachemgr.tiering.members: this node's
    records under the set's paths are brought up to date, then acknowledged), which is what
    lets that commit include every file closed here before it;
  * again when that file's upload finishes (the entry gets its object);
  * again, or deleted, when files in the directory change, move or go away, and under its new
    key when the directory is renamed.

Cost, and why background writes are spaced: a record lists every file of this node in its
directory, so writing one costs O(D) (D files: the index rows, the JSON, the PUT). Written
after every close, a DCP save of F shards into one directory cost O(F^2) (measured in process:
1,024 shards of 64 KiB, 512 record PUTs, 64 s of the daemon's thread; the writer fell from 140
to 27 files/s by 2,048). So a directory's record is not written again in the background
before `SPACING` times as long as its last write took has passed since that write ended: the
marks in between are merged into one write, record writing takes at most 1/(SPACING + 1) of
the daemon's thread whatever D, and the cost per file closed stays flat. A `sync` (another
node's commit, cachemgr.tiering.members) does not wait for the spacing, nor do the records
written again under a new lease generation (`mark_all(now=True)`; a write that spanned the new
registration leaves no spacing behind): the spacing measures the write's wall time, a store
that hung makes it long, and a committer ignores the old generation's records (issue 36: a
record written in 14 s across a black hole was written again under the new generation 112 s
later, and the other node's commit waited that long).

Only directories in an open set (see cachemgr.core.sets.in_open_set) get records; single files that
commit themselves never need one. The committer lists `parts/<set path>/` (and the path the set
was renamed from), reads the other nodes' records, and waits until every file it must include
is durable (cachemgr.engine). Records are never read to serve data: a manifest is still
the only thing that makes a set visible.

State, its owner and its guards: `PartPublisher` owns which records this node has in the
store (`published`: dir ino -> {"path", "digest"}), persisted in the index (`meta` rows
`part:<dir ino>`) so a record is updated or deleted after a restart too; and which directories
must be looked at again (`_dirty`, with the waiters of `sync`). Everything runs on the daemon's
trio thread: `run` is one task and the only writer of records while it runs (`sync_dir` is
also called by cachemgr.tiering.members at unmount, once `run` is gone); the hooks (`mark`,
`mark_all`) are synchronous, called from FUSE handlers, tiering and remote sync on the same thread.
Invariants: a directory's `meta` row is written only after its record's PUT (and the DELETE of
the record under the directory's old path) and removed only after its DELETE; a directory
marked is written once its spacing has passed (`_not_before`, below), one with a `sync` waiter
by the pass that starts next, so `sync` returns only once its directories' records were
written after the call (or raises).

Crash states: a record may be stale (a file deleted, or its upload finished, just before the
crash): recovery (`run` starts with `mark_all`) rewrites or deletes every record that has a
`meta` row. A crash between a record's PUT and its `meta` row leaves a record the index does
not know: if the row named the directory's old path, recovery writes the new one and deletes
the old; if there was no row, the record is brought up to date the next time its directory is
marked (a file in it closes, moves or goes). A failed pass is retried after `retry_pause`; its
error is kept in `statistics().last_error` and told to `report_error` (the store's last
error in `ckptfs status`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from cachemgr.format import validate
from cachemgr.format.docs import PartFile, PartRecordDoc
from cachemgr.format.keys import LONG_PARTS_PREFIX, PARTS_PREFIX, part_key
from cachemgr.format.manifest import ESCAPED_VERSION, dumps_checked
from cachemgr.format.names import escape_name, is_escaped
from cachemgr.store import NotFound, ObjectStore, StoreError

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import Inode
    from cachemgr.tiering.lease import Lease

log = logging.getLogger(__name__)

FORMAT = "ckptfs-part"
FORMAT_VERSION = 1
# As for manifests (cachemgr.format.manifest): version 2 is version 1 with `dir` and the files'
# `name`s in the escaped form of cachemgr.format.names, written only when one of them holds an
# escape (the versions a reader accepts: cachemgr.format.validate).
_META = "part:"
# Records whose natural key no store could hold live under LONG_PREFIX, named by a hash of
# their directory's path (cachemgr.format.keys); a committer lists it beside its set's prefix.
PREFIX, LONG_PREFIX = PARTS_PREFIX, LONG_PARTS_PREFIX

PartError = validate.PartError

# A directory's record is written in the background at most once per SPACING x the time its
# last write took (module docstring). 8: at most a ninth of the daemon's thread goes to records
# during a big DCP save (at 4, a profile of 1,024 shards through a mount still found 22% of the
# daemon's busy time in record passes), and an upload that finishes reaches the record within
# 8 x its cost (~0.5 s for 8,192 shards on this machine) for a committer on another node,
# which asks with `sync` anyway when it needs the record now.
SPACING = 8.0


_T = TypeVar("_T")


async def off_loop(fn: Callable[..., _T], *args: object) -> _T:
    """Run `fn(*args)` in a worker thread (the record's digest and JSON: 0.9 s for 8,192
    files on a loaded 2-core machine, a loop stall on the trio thread). Module-level so a test
    on a trio MockClock can run it inline: time a worker thread takes is real, and an
    autojumping MockClock turns it into a nondeterministic amount of virtual time."""
    return await trio.to_thread.run_sync(fn, *args)


def records_prefix(path: str) -> str:
    """Prefix listing the records of every directory at or below `path`."""
    return f"{PREFIX}{path}/"


def parse_key(key: str) -> tuple[str, str] | None:
    """(dir path, node) of a record key, or None."""
    if not key.startswith(PREFIX) or not key.endswith(".json"):
        return None
    head, _, last = key[len(PREFIX):].rpartition("/")
    if not head or not last.startswith("@"):
        return None
    return head, last[1:-len(".json")]


def build(node: str, dir_path: str, files: list[PartFile],
          generation: int = 0) -> PartRecordDoc:
    """`dir_path` and the files' names in the escaped form (cachemgr.format.names); `generation`:
    the writer's lease generation (cachemgr.tiering.lease.Lease)."""
    escaped = is_escaped(dir_path) or any(is_escaped(f["name"]) for f in files)
    return {"format": FORMAT, "version": ESCAPED_VERSION if escaped else FORMAT_VERSION,
            "node": node, "dir": dir_path, "updated_ns": time.time_ns(),
            "generation": generation, "files": files}


def dumps(rec: PartRecordDoc) -> bytes:
    return dumps_checked(rec, f"the part record of {rec.get('dir')!r}", sort_keys=True)


def loads(data: bytes, key: str | None = None) -> PartRecordDoc:
    """A part record read from the store (from `key`, which must be the key of its own
    directory and node), validated and normalised by cachemgr.format.validate: `dir` and every
    file's `name` in the escaped form, every field present, objects under data/<its node>/."""
    return validate.part_record(data, key)


def _digest(path: str, files: list[dict[str, Any]], gen: int) -> str:
    """What of a record a committer needs (`PartRecords.sync_dir`), hashed."""
    return hashlib.sha1(json.dumps(
        [path, [(f["name"], f["object"] and f["object"]["key"]) for f in files], gen],
        sort_keys=True).encode()).hexdigest()


class _Waiter:
    """Set once a pass over its directory finished; `ok` tells whether the record got to the
    store (a failed pass releases its waiters too, so nobody hangs on an outage)."""

    __slots__ = ("ev", "ok")

    def __init__(self) -> None:
        self.ev = trio.Event()
        self.ok = False


@dataclass(frozen=True, slots=True)
class PartStats:
    """`PartPublisher.statistics()`: this node's part records (`dataclasses.asdict` for JSON)."""

    records: int
    puts: int
    deletes: int
    dirty: int
    failed_passes: int
    last_error: str | None


class PartPublisher:
    """Keeps this node's part records in the store in step with its files."""

    def __init__(self, *, index: Index, store: ObjectStore, node: str, lease: Lease,
                 inode_if_loaded: Callable[[int], Inode | None], retry_pause: float,
                 report_error: Callable[[str], None] | None = None) -> None:
        """`inode_if_loaded`: the in-memory inode of a file if the core has it loaded (sizes
        of open files live there: InodeTable.if_loaded). `report_error`: told the text of
        each failed pass (the store's last error in `ckptfs status`). `lease`: no record is
        written or deleted unless it holds, and each names its generation."""
        self.index = index
        self.store = store
        self.node = node
        self.lease = lease
        self._inode_if_loaded = inode_if_loaded
        self.retry_pause = retry_pause
        self._report_error = report_error
        self._dirty: dict[int, list[_Waiter]] = {}
        self._inflight: set[int] = set()  # directories of the pass running now
        # the directories not to be written in the background before a time (trio.current_time)
        self._not_before: dict[int, float] = {}
        self._wake = trio.Event()
        self.published: dict[int, dict[str, str]] = {}
        # (recorded path, dir ino) of every record in `published`, sorted: the records at or
        # under a path moved or removed are a range of it (`mark_moved`), found by bisection
        self._by_path: list[tuple[str, int]] = []
        for key, value in self.index.meta_with_prefix(_META):
            self._record(int(key[len(_META):]), json.loads(value))
        # statistics
        self.puts = 0
        self.deletes = 0
        self.syncs_failed = 0
        self.last_error: str | None = None

    # -- hooks (synchronous) -----------------------------------------------------------------

    def mark(self, dir_ino: int) -> None:
        """Directory `dir_ino`'s record must be brought up to date (by the publisher task, in
        the background: never awaited on the write path; no sooner than its spacing)."""
        self._dirty.setdefault(dir_ino, [])
        self._wake.set()

    def mark_all(self, *, now: bool = False) -> None:
        """Every directory with a record (a restart; a listing that moved paths: any may have
        changed). O(records): not on the write path (`mark_moved` is). `now`: no spacing (a
        new lease generation: the records in the store are under the old one, which
        committers ignore, so they are as good as absent)."""
        if now:
            self._not_before.clear()
        for ino in list(self.published):
            self.mark(ino)

    def mark_moved(self, paths: list[str], dirs: list[int]) -> None:
        """A subtree at one of `paths` moved or went, and files left or entered the
        directories `dirs`: the records whose directory was at or under one of `paths` (their
        path changed, or they went) and those of `dirs` are looked at again. What a rename or
        removal asks at each call: O(log R + the records it marks) for R records, where
        `mark_all` would look at every record."""
        hit: set[int] = {d for d in dirs if d in self.published}
        for p in paths:
            if not p:
                hit.update(self.published)  # the mount root: every record
                continue
            i = bisect.bisect_left(self._by_path, (p,))
            while i < len(self._by_path) and self._by_path[i][0] == p:
                hit.add(self._by_path[i][1])
                i += 1
            i = bisect.bisect_left(self._by_path, (p + "/",))
            end = p + "0"  # the character after '/': the end of the paths under p
            while i < len(self._by_path) and self._by_path[i][0] < end:
                hit.add(self._by_path[i][1])
                i += 1
        for ino in sorted(hit):
            self.mark(ino)

    def _record(self, dir_ino: int, rec: dict[str, str]) -> None:
        """`published[dir_ino] = rec`, and its place in `_by_path`."""
        self._unrecord(dir_ino)
        self.published[dir_ino] = rec
        bisect.insort(self._by_path, (rec["path"], dir_ino))

    def _unrecord(self, dir_ino: int) -> None:
        old = self.published.pop(dir_ino, None)
        if old is not None:
            i = bisect.bisect_left(self._by_path, (old["path"], dir_ino))
            if i < len(self._by_path) and self._by_path[i] == (old["path"], dir_ino):
                del self._by_path[i]

    async def sync(self, dir_inos: Iterable[int]) -> None:
        """Bring these directories' records up to date in the store: returns once a pass that
        started after this call has written each of them; StoreError if one failed (another
        node's commit waits for this: cachemgr.tiering.members acknowledges only after it)."""
        waiters = []
        for d in set(dir_inos):
            w = _Waiter()  # a waiter: the spacing does not apply (run)
            self._dirty.setdefault(d, []).append(w)
            waiters.append(w)
        self._wake.set()
        for w in waiters:
            await w.ev.wait()
        if not all(w.ok for w in waiters):
            raise StoreError("part records could not be written to the store")

    def pending(self) -> set[int]:
        """Directories whose record may not be in the store as it should be yet."""
        return set(self._dirty) | self._inflight

    # -- the record of one directory ---------------------------------------------------------

    def files_of(self, dir_ino: int) -> list[PartFile]:
        """This node's own files directly in `dir_ino` (not those materialised from another
        node's manifest: version 0), with their object when their current content is in."""
        out: list[PartFile] = []
        for name, ino, mode, row_size, row_mtime, version, row_writing, _target, obj, \
                obj_version in self.index.children_with_inodes(dir_ino):
            if not stat.S_ISREG(mode) or version <= 0:
                continue
            node = self._inode_if_loaded(ino)
            size, mtime_ns, writing = row_size, row_mtime, row_writing
            if node is not None:  # sizes of open files live in memory
                size, mtime_ns, writing = node.size, node.mtime_ns, node.writing
            durable = obj is not None and obj_version == version and not writing
            out.append({"name": escape_name(bytes(name)), "size": size,
                        "mode": mode & 0o7777, "mtime_ns": mtime_ns,
                        "object": json.loads(obj) if durable else None})
        out.sort(key=lambda f: f["name"])
        return out

    async def sync_dir(self, dir_ino: int) -> None:
        """Write (or delete) directory `dir_ino`'s record now, in the caller's task; StoreError
        if the store refused. `run` does this for marked directories; cachemgr.tiering.members calls
        it at unmount for every pending one (the publisher task is gone by then)."""
        path = self.index.path_of(dir_ino)
        files = self.files_of(dir_ino) if path else []
        old = self.published.get(dir_ino)
        if files and path:
            gen = self.lease.generation
            # mtimes of files being written change with every write; the digest leaves them
            # out so a record is rewritten when what a committer needs changes (or the lease
            # generation: after a lapse every record is written again under the new one).
            # Computed, like the record's JSON, in a worker thread: `files` is this call's own
            # list, which nothing else touches; a directory of 8,192 files is 1.3 MiB of JSON,
            # 0.9 s on this loaded 2-core machine, a loop stall on the trio thread (issue 36)
            digest = await off_loop(_digest, path, files, gen)
            if old is None or old["path"] != path or old["digest"] != digest:
                await self.lease.ensure()
                if self.lease.generation != gen:
                    return await self.sync_dir(dir_ino)  # registered again meanwhile
                body = await off_loop(
                    lambda: dumps(build(self.node, path, files, gen)))
                await self.store.put(part_key(path, self.node), body)
                self.puts += 1
                if old is not None and old["path"] != path:
                    await self.store.delete(part_key(old["path"], self.node))
                    self.deletes += 1
                rec = {"path": path, "digest": digest}
                self._record(dir_ino, rec)
                with self.index.tx():
                    self.index.set_meta(f"{_META}{dir_ino}", json.dumps(rec))
        elif old is not None:
            await self.lease.ensure()
            await self.store.delete(part_key(old["path"], self.node))
            self.deletes += 1
            self._unrecord(dir_ino)
            with self.index.tx():
                self.index.delete_meta(f"{_META}{dir_ino}")

    def _due(self) -> tuple[dict[int, list[_Waiter]], float | None]:
        """The marked directories to write now (those with a waiter, or past their spacing),
        taken out of `_dirty`; and when the next one left there is due (None: none left)."""
        now = trio.current_time()
        due: dict[int, list[_Waiter]] = {}
        later: float | None = None
        for d, waiters in list(self._dirty.items()):
            at = self._not_before.get(d, 0.0)
            if at <= now or waiters:
                due[d] = self._dirty.pop(d)
            else:
                later = at if later is None else min(later, at)
        return due, later

    async def run(self) -> None:
        self.mark_all()  # after a restart: rewrite or drop what may be stale
        while True:
            dirty, later = self._due()
            if not dirty:
                self._wake = trio.Event()
                with trio.move_on_at(later if later is not None else float("inf")):
                    await self._wake.wait()
                continue
            self._inflight = set(dirty)
            for dir_ino, waiters in dirty.items():
                try:
                    started = trio.current_time()
                    gen = self.lease.generation
                    await self.sync_dir(dir_ino)
                    ended = trio.current_time()
                    if self.lease.generation != gen:
                        # written while the node registered again: under the old generation,
                        # which committers ignore (and `mark_all(now=True)` missed it if it
                        # was its first write); the new one is due now, not SPACING x a
                        # write that waited on the store (a black hole: 14 s, then 112 s
                        # without this, issue 36)
                        self._not_before.pop(dir_ino, None)
                        self._dirty.setdefault(dir_ino, [])
                    elif dir_ino in self.published:
                        self._not_before[dir_ino] = ended + SPACING * (ended - started)
                    else:
                        self._not_before.pop(dir_ino, None)
                except StoreError as e:
                    log.warning("part record of directory %d: %s; retrying", dir_ino, e)
                    self.last_error = f"{time.strftime('%H:%M:%S')} part record: {e}"
                    if self._report_error is not None:
                        self._report_error(self.last_error)
                    self.syncs_failed += 1
                    # Waiters are released (not ok); the record is retried after a pause.
                    self._dirty.setdefault(dir_ino, [])
                    for w in waiters:
                        w.ev.set()
                    self._inflight.discard(dir_ino)
                    await trio.sleep(self.retry_pause)
                    continue
                self._inflight.discard(dir_ino)
                for w in waiters:
                    w.ok = True
                    w.ev.set()
            self._inflight = set()

    def statistics(self) -> PartStats:
        return PartStats(records=len(self.published), puts=self.puts, deletes=self.deletes,
                         dirty=len(self.pending()), failed_passes=self.syncs_failed,
                         last_error=self.last_error)



@dataclass(slots=True)
class InvalidRecord:
    """`read_records`' cache entry of a record that failed validation: why, its directory if
    it can be told, and whether it was logged (once per cache)."""

    why: str
    dir: str | None
    logged: bool = False


# read_records' cache: {key: (etag, the record or why it is invalid)}
RecordCache = dict[str, tuple[str, PartRecordDoc | InvalidRecord]]


async def read_records(store: ObjectStore, path: str, self_node: str,
                       cache: RecordCache,
                       bad: dict[str, str]) -> list[PartRecordDoc]:
    """Every other node's part record at or below `path`. `cache` ({key: (etag, record)}) is
    reused across calls so that only changed records are read again. A record that fails
    validation is left out and put in `bad` ({key: why}) when it is a record of a directory
    at or below `path`; the caller decides (a set whose other-node records are invalid fails
    with that reason). An invalid record under a hashed key (cachemgr.format.keys) whose directory
    cannot be told, or is elsewhere, is logged once per `cache` and skipped."""
    out = []
    listed = await store.list(records_prefix(path)) + await store.list(LONG_PREFIX)
    for info in listed:
        parsed = parse_key(info.key)
        if parsed is None or parsed[1] == self_node:
            continue
        hit = cache.get(info.key)
        if hit is not None and hit[0] == info.etag:
            rec = hit[1]
        else:
            why = data = None
            if info.size > validate.MAX_DOCUMENT_BYTES:
                why = f"it is {info.size} bytes"
            else:
                try:
                    data = await store.get(info.key)
                except NotFound:  # deleted between the listing and the get
                    continue
                try:
                    # off the loop: a record of 8,192 files is 1.3 MiB of JSON, 0.5 s to
                    # parse on this loaded 2-core machine (issue 36, item 3)
                    rec = await trio.to_thread.run_sync(loads, data, info.key)
                except PartError as e:
                    why = str(e)
            if why is not None:
                # Whose directory is it? A plain key says (at or below `path`: it was listed
                # under it). A hashed key, which every committer lists, only through a
                # document that names a directory hashing to the key; else nobody's.
                d = parsed[0] if not info.key.startswith(LONG_PREFIX) else \
                    _hashed_dir(data, info.key) if data is not None else None
                rec = InvalidRecord(why, d)
            cache[info.key] = (info.etag, rec)
        if isinstance(rec, InvalidRecord):
            d = rec.dir
            if d is not None and (d == path or d.startswith(path + "/")):
                bad[info.key] = rec.why
            elif not rec.logged:  # another set's invalid record must not fail this one
                rec.logged = True
                log.warning("skipping part record %s: %s", info.key, rec.why)
            continue
        if rec["dir"] == path or rec["dir"].startswith(path + "/"):
            out.append(rec)
    return out


def _hashed_dir(data: bytes, key: str) -> str | None:
    """The directory of the record `data` at hashed key `key` (cachemgr.format.keys), if its
    document names one (and a node) that map to that key; else None."""
    try:
        doc = json.loads(data)
        d = validate.path(doc["dir"], doc["version"], "dir", PartError)
        node = validate.node_id(doc["node"], "node", PartError)
    except (ValueError, RecursionError, TypeError, KeyError):
        return None
    return d if part_key(d, node) == key else None
