"""Sets committed elsewhere appear here: `RemoteSync` lists the store's manifests every
`interval` seconds and materialises the sets other nodes (or an earlier cache of this node)
published, as evicted files whose data `cachemgr.restore.restorer.Restorer` serves on demand.

What happens to a listed manifest at path P (docs/SEMANTICS.md "Many nodes"):

  * nothing at P here: the set is created (names, sizes, modes, times from the manifest). Files
    of the set that *this* node wrote (its own objects, `data/<this node>/...`) are not fetched
    again: their cached inodes are moved into place (e.g. this node's `step_100.tmp/__3_0.distcp`
    when another node renamed its `step_100.tmp` to `step_100`), and directories the move left
    empty are removed — the rename happens on every node;
  * a directory at P that is not a set here and holds only this node's own files of the
    manifest (the DCP shards this node wrote into the directory rank 0 committed): the set is
    completed in place around them (*adoption*);
  * a set at P restored from an older manifest: replaced (files still open keep it until the
    next listing);
  * a set committed here and still uploading: left alone (the conditional manifest PUT decides
    which commit wins, cachemgr.engine); a set committed here and durable whose manifest
    was since replaced by another node's later commit: replaced like a restored one;
  * anything else (local data the manifest does not name, open files): left alone, logged, and
    retried at the next listing.

A restored set whose manifest left the store is removed here.

The tree changes of an apply (what is created, moved, adopted or removed, and what refuses it)
are `cachemgr.tiering.materialise.Materialiser`'s; this module decides what is listed, read,
validated and applied, and when.

State, its owner and its guards: `RemoteSync` owns what it learned from the listings: manifests
refused (`_invalid`, until their etag changes), paths of hashed manifest keys (`_long`), object
keys other nodes' manifests name (`_named`, so deleting a set here never deletes an object a
manifest still names), sets not applied and why (`_blocked`), and `first_listing` (the mount is
ready once it is set). The sets it applies are recorded in the set registry (cachemgr.core.sets,
origin "remote"). Everything runs on the daemon's trio thread: a listing reads the changed
manifests first (concurrent GETs), then applies them with no await in between, so a FUSE
request (same thread) never sees half a listing; each apply is one transaction of the index and
the in-memory inodes (`CacheFs.transaction`: an apply refused half-way by a name conflict rolls
back whole). After a change it marks every part record for a rewrite (`mark_parts`: paths may
have moved) and tells waiters the namespace changed (`changed`).

Crash states: none of its own beyond the index: an apply is committed whole or not at all; what
is in memory is rebuilt by the first listing after a restart.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from cachemgr.core.errors import FsError
from cachemgr.core.hooks import KernelNotifier
from cachemgr.core.sets import KEPT_STATES, LIVE_STATES, SetRow
from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.format.docs import GatheredFile
from cachemgr.format.names import to_str, unescape_name
from cachemgr.store import NotFound, ObjectInfo, ObjectStore, StoreError
from cachemgr.tiering.materialise import InTheWay, Manifest, Materialiser

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.core.rawtree import RawTree
    from cachemgr.core.sets import SetRegistry

log = logging.getLogger(__name__)

# Manifest GETs in flight during one listing: a fresh node lists every set once, and a GET is
# ~5 ms against the test store and 10-30 ms against S3, so 1,000 sets take ~0.3-2 s at 16.
_GET_CONCURRENCY = 16
# JSON bytes of manifests read and held at once by one listing step (each at most
# validate.MAX_DOCUMENT_BYTES): what bounds a listing's memory, whatever the store holds.
_HOLD_BYTES = 64 << 20


_InTheWay = InTheWay  # the name this module used before cachemgr.tiering.materialise


def peer_etag(m: Manifest) -> str:
    """The etag a set shown from peers' replicas is recorded with: its commit, whichever peer
    built the manifest (two buddies' manifests of one replica differ in published_ns only)."""
    return f"peer:{m['commit']['node']}:{m['commit']['seq']}"


def _b(s: str) -> bytes:
    """The name (bytes) of one component of a set path (escaped form, cachemgr.format.names)."""
    return unescape_name(s)


@dataclass(frozen=True, slots=True)
class RemoteStats:
    """`RemoteSync.statistics()`: the store's listings (`dataclasses.asdict` for JSON)."""

    interval_s: float
    syncs: int
    last_sync: float | None
    restored_sets: int
    adopted_files: int
    removed_sets: int
    not_restored: dict[str, str]
    invalid_manifests: dict[str, str]
    invalid_count: int


class RemoteSync:
    """Materialise the store's sets in the local namespace; see the module docstring."""

    def __init__(self, *, table: InodeTable, tree: RawTree, index: Index, sets: SetRegistry,
                 store: ObjectStore, kernel: KernelNotifier, node: str, interval: float,
                 mark_parts: Callable[[], None], changed: Callable[[], None],
                 hold_bytes: int = _HOLD_BYTES) -> None:
        """`mark_parts`: every part record must be looked at again (PartPublisher.mark_all: a
        subtree moved or went). `changed`: the namespace changed (wakes waiters on sets and
        space: the Engine's `signals.changed_now`). `hold_bytes`: the JSON read per listing step."""
        self.table = table
        self.tree = tree
        self.index = index
        self.sets = sets
        self.store = store
        self.node = node
        self.mark_parts = mark_parts
        self.changed = changed
        self.mat = Materialiser(table=table, tree=tree, index=index, sets=sets, kernel=kernel,
                                node=node)
        self.interval = interval
        self.hold_bytes = hold_bytes
        self.syncs = 0
        self.last_sync: float | None = None
        self.applied = 0
        self.adopted_files = 0
        self.removed = 0
        self._blocked: dict[str, str] = {}  # path -> why it was not applied (logged once)
        # Manifests that failed validation: key -> (etag, why); skipped until their etag
        # changes, so each is logged once (cachemgr.format.validate).
        self._invalid: dict[str, tuple[str, str]] = {}
        # Set paths of hashed manifest keys (cachemgr.format.keys), learned from their documents.
        self._long: dict[str, str] = {}
        # Object keys each listed manifest of another node names (key -> keys), so that deleting
        # a set here never deletes an object another manifest still names.
        self._named: dict[str, frozenset[str]] = {}
        # Set once the first listing finished (applied, or failed: `first_error`). The mount
        # reports ready only after it (ckptfs.mount), so a job resuming right after `ckptfs
        # mount` sees every set the store held then.
        self.first_listing = trio.Event()
        self.first_error: str | None = None
        # Listings that failed in a row (0 once one succeeds), and when the last one that
        # succeeded began (wall clock): sets shown from peers' replicas
        # (cachemgr.tiering.peernamespace) that no peer holds any more go only once a listing that
        # began after that answer did not list them.
        self.failed_listings = 0
        self.listed_from: float | None = None
        self._peer_missing: dict[int, float] = {}  # seq of a "replicated" set -> since when

    async def run(self) -> None:
        """List the store every `interval` seconds. The first listing is what a mount waits for
        (`first_listing`): `ckptfs mount` returns only once the namespace holds every set the
        store listed then. With interval 0 the store is listed once (until a listing
        succeeds)."""
        while True:
            began = time.time()
            try:
                await self.sync_once()
                self.first_error = None
                self.listed_from, self.failed_listings = began, 0
            except StoreError as e:
                log.warning("listing the store's sets failed: %s", e)
                self.failed_listings += 1
                if self.syncs == 0:
                    self.first_error = str(e)
            self.first_listing.set()
            if self.interval <= 0 and self.syncs:
                return
            # +-10 %: nodes mounted in the same second drift apart instead of listing the
            # store in lockstep (a fleet's LISTs of `manifests/` arrive spread over the interval)
            await trio.sleep((self.interval if self.interval > 0 else 1.0) *
                             random.uniform(0.9, 1.1))

    async def sync_once(self) -> None:
        """One listing of the store, applied as one step: every manifest that changed is read
        first (concurrently, no namespace change meanwhile), then all of them are applied with
        no await in between, so the FUSE loop (the same trio thread) never serves a request
        that sees half a listing. Sets are applied in commit order, symlinks after every other
        set, and sets that left the store are removed last: a `latest` link never shows before
        the checkpoint it names, and the checkpoint it named before goes only after it moved.

        Every manifest is validated (cachemgr.format.validate) before use; one that fails is skipped
        and reported once (`invalid`, until its etag changes), and the rest apply. Memory is
        bounded: a manifest over MAX_DOCUMENT_BYTES is not read, and the changed manifests of
        one listing are read and applied in steps of at most `hold_bytes` of JSON (a listing
        of more than that applies in several steps, each in commit order)."""
        listed: dict[str, ObjectInfo] = {}  # manifest key -> ObjectInfo
        for info in await self.store.list(mf.MANIFEST_PREFIX):
            if mf.is_manifest_key(info.key):
                listed[info.key] = info
        # Forget what no longer is: bad documents replaced or gone, paths of hashed keys.
        for key in [k for k, (etag, _why) in self._invalid.items()
                    if k not in listed or etag != listed[k].etag]:
            del self._invalid[key]
        for key in [k for k in self._long if k not in listed]:
            del self._long[key]
        for key in [k for k in self._named if k not in listed]:
            del self._named[key]
        todo: list[tuple[str, ObjectInfo]] = []
        for key, info in sorted(listed.items()):
            if key in self._invalid:
                continue  # reported once; read again when its etag changes
            path = mf.path_of_manifest_key(key) or self._long.get(key)
            if path is None or self._wanted(path, info.etag):
                todo.append((key, info))
        at = 0
        while at < len(todo):
            batch: list[tuple[str, ObjectInfo]] = []
            size = 0
            while at < len(todo) and (not batch or size + todo[at][1].size <= self.hold_bytes):
                batch.append(todo[at])
                size += todo[at][1].size
                at += 1
            await self._sync_batch(batch)
        for s in self.sets.by_states(("durable",)):
            if s.origin != "local" and mf.manifest_key(s.path) not in listed:
                try:
                    self._remove(s)
                    self._blocked.pop(s.path, None)
                except Exception as e:  # a full disk, a bug: the others go on, retried later
                    why = f"left the store, not removed here: {e}"
                    if self._blocked.get(s.path) != why:
                        log.warning("set %s %s", s.path, why,
                                    exc_info=not isinstance(e, FsError))
                        self._blocked[s.path] = why
        self.syncs += 1
        self.last_sync = time.time()

    async def _sync_batch(self, batch: list[tuple[str, ObjectInfo]]) -> None:
        """Read the manifests of `batch` ([(key, info)]), then apply them in one step."""
        got: dict[str, Manifest] = {}
        limiter = trio.CapacityLimiter(_GET_CONCURRENCY)

        async def get_one(key: str, info: ObjectInfo) -> None:
            if info.size > validate.MAX_DOCUMENT_BYTES:
                self._reject(key, info.etag, f"it is {info.size} bytes, more than the"
                             f" {validate.MAX_DOCUMENT_BYTES} a manifest may have")
                return
            async with limiter:
                try:
                    data = await self.store.get(key)
                except NotFound:
                    return  # deleted between the listing and the GET: a set being deleted
            try:
                # parsed and validated in a worker thread: a manifest of 10,000 files is MiBs
                # of JSON, hundreds of ms on the loop (issue 36, item 3); `data` is this
                # task's own
                got[key] = await trio.to_thread.run_sync(mf.loads, data, key)
            except mf.ManifestError as e:
                self._reject(key, info.etag, str(e))

        async with trio.open_nursery() as n:
            for key, info in batch:
                n.start_soon(get_one, key, info)
        # From here on: no await until the batch is applied.
        ready = [(key, info, got[key]) for key, info in batch if key in got]
        ready.sort(key=lambda x: (x[2]["kind"] == "symlink", x[2]["commit"]["committed_ns"],
                                  x[2]["path"]))
        for key, info, m in ready:
            path = m["path"]
            if mf.path_of_manifest_key(key) is None:
                self._long[key] = path
            if m["commit"]["node"] == self.node:
                continue  # published by this cache
            # Remembered until the set is applied here (the index knows its objects then).
            self._named[key] = frozenset(f["object"]["key"] for f in m["files"])
            if self._wanted(path, info.etag):  # again: a local commit may have come meanwhile
                cur = self.sets.newest_at(path)
                if cur is not None and cur.state == "replicated" and \
                        cur.committed_ns > int(m["commit"].get("committed_ns", 0)):
                    continue  # peers hold a newer commit than the store's (not durable yet)
                try:
                    if self._apply(m, info.etag, cur):
                        self._named.pop(key, None)
                except Exception as e:  # one set must not stop the others
                    # A bug, not bad input (that is refused above): the set's transaction
                    # rolled back whole, the next listing tries again.
                    why = f"internal error {e!r}"
                    if self._blocked.get(path) != why:
                        log.exception("store set %s not restored", path)
                        self._blocked[path] = why

    def _reject(self, key: str, etag: str, why: str) -> None:
        """Manifest `key` (at `etag`) must not be used: skipped, logged once, shown in status."""
        self._invalid[key] = (etag, why)
        log.warning("skipping manifest %s: %s", key, why)

    def keys_named_elsewhere(self, path: str, keys: set[str]) -> set[str]:
        """Those of `keys` (object keys) that a manifest of the store other than `path`'s
        names, as of the last listing (sets applied here: see SetRegistry)."""
        mine = mf.manifest_key(path)
        out: set[str] = set()
        for key, named in self._named.items():
            if key != mine:
                out |= keys & named
        return out

    def _wanted(self, path: str, etag: str) -> bool:
        """Should the listed manifest of `path` (with `etag`) be applied here?"""
        cur = self.sets.newest_at(path)
        if cur is not None and cur.etag == etag:
            return False
        # Ours and pending (its conditional PUT settles the race), being deleted, or
        # published before manifests' etags were recorded: local wins.
        return not (cur is not None and cur.origin == "local" and (
            cur.state in ("committed", "uploading", "deleting") or
            (cur.state == "durable" and cur.etag is None)))

    # -- applying one manifest ---------------------------------------------------------------

    def _apply(self, m: Manifest, etag: str, cur: SetRow | None,
               state: str = "durable") -> bool:
        """Make the manifest's set the one at its path here; False if it was not applied.
        `state` "replicated": a manifest peers built from their replicas (apply_from_peers)."""
        path = m["path"]
        parts = path.split("/")
        name = _b(parts[-1])
        moved: list[tuple[int, bytes]] = []
        try:
            # One transaction tied to memory (InodeTable.tx): if the apply fails half
            # way, the index, the in-memory inodes and the cache files are as they were (cache
            # files of removed entries are deleted only once it committed).
            with self.table.tx():
                # ensure_dirs takes names as os functions do (undecodable bytes as surrogates).
                parent = self.tree.ensure_dirs([to_str(p) for p in parts[:-1]])
                root, files, moved, adopted = self.mat.install(m, parent, name, cur)
                if cur is not None and cur.state in KEPT_STATES:
                    self.sets.set_state(cur.seq, "replaced", "a newer manifest in the store")
                self.sets.record_remote(m, root, etag, files, state)
        except InTheWay as e:
            if self._blocked.get(path) != str(e):
                log.info("store set %s not restored here: %s", path, e)
                self._blocked[path] = str(e)
            return False
        except FsError as e:
            if self._blocked.get(path) != str(e):
                log.warning("store set %s not restored: %s", path, e)
                self._blocked[path] = str(e)
            return False
        self._blocked.pop(path, None)
        self.applied += 1
        self.adopted_files += adopted
        log.info("restored set %s from the %s (%d files, %d of them written here, %d bytes,"
                 " committed by node %s)", path,
                 "store" if state == "durable" else "replicas peers hold", len(m["files"]),
                 adopted, m.get("total_bytes", 0), m["commit"].get("node"))
        for d, n in moved:
            self.mat.invalidate(d, n)
        self.mat.invalidate(parent, name)
        self.mark_parts()
        self.changed()
        return True

    # -- sets shown from the replicas peers hold (cachemgr.tiering.peernamespace) -----------------

    def apply_from_peers(self, found: list[Manifest], asked_at: float) -> int:
        """Show the sets of `found` (manifests peers built from the replicas they hold, each
        validated, one per path: the newest commit) that are newer than what this node has at
        their paths, in commit order, as "replicated" sets; then remove the "replicated" sets
        no peer holds any more once a store listing that began after `asked_at` (when the
        peers were asked) did not replace them. No await: like a listing, all in one step.
        Returns how many sets were applied."""
        applied = 0
        held = {peer_etag(m) for m in found}
        for m in sorted(found, key=lambda x: (x["kind"] == "symlink",
                                             x["commit"]["committed_ns"], x["path"])):
            cur = self.sets.newest_at(m["path"])
            if m["commit"]["node"] == self.node or (cur is not None and (
                    cur.etag == peer_etag(m) or cur.state in ("deleting", *LIVE_STATES) or
                    (cur.state in KEPT_STATES and
                     cur.committed_ns >= int(m["commit"]["committed_ns"])))):
                continue
            try:
                applied += self._apply(m, peer_etag(m), cur, state="replicated")
            except Exception as e:  # one set must not stop the others (a bug: rolled back)
                why = f"internal error {e!r}"
                if self._blocked.get(m["path"]) != why:
                    log.exception("peers' set %s not shown", m["path"])
                    self._blocked[m["path"]] = why
        shown = self.sets.by_states(("replicated",))
        seqs = {s.seq for s in shown}  # forget sets replaced or removed meanwhile
        self._peer_missing = {q: t for q, t in self._peer_missing.items() if q in seqs}
        for s in shown:
            if s.etag in held:
                self._peer_missing.pop(s.seq, None)
                continue
            since = self._peer_missing.setdefault(s.seq, asked_at)
            if self.listed_from is not None and self.listed_from > since:
                self._peer_missing.pop(s.seq, None)
                self._remove(s, "no peer holds its replica and the store does not list it")
        return applied

    # -- the committing node's own multi-node set ------------------------------------------

    def complete_local(self, seq: int, root: int, foreign: list[GatheredFile]) -> int:
        """Show the files other nodes wrote in set `seq`, committed here (Materialiser)."""
        return self.mat.complete_local(seq, root, foreign)

    # -- a set that left the store -----------------------------------------------------------

    def _remove(self, s: SetRow, why: str = "its manifest left the store") -> None:
        dir_path, _slash, last = s.path.rpartition("/")
        parent = self.index.resolve(dir_path)
        name = _b(last)
        with self.index.tx():
            if parent is not None and self.index.lookup(parent, name) == s.root_ino and \
                    not self.mat.busy(s.root_ino):
                self.tree.remove_tree(parent, name)
            self.sets.set_state(s.seq, "deleted", why)
        self.removed += 1
        log.info("set %s removed here: %s", s.path, why)
        if parent is not None:
            self.mat.invalidate(parent, name)
        self.mark_parts()
        self.changed()


    def statistics(self) -> RemoteStats:
        return RemoteStats(interval_s=self.interval, syncs=self.syncs, last_sync=self.last_sync,
                           restored_sets=self.applied, adopted_files=self.adopted_files,
                           removed_sets=self.removed, not_restored=dict(self._blocked),
                           invalid_manifests={k: why for k, (_e, why) in
                                              sorted(self._invalid.items())[:100]},
                           invalid_count=len(self._invalid))
