"""The namespace worker: publish, unpublish, garbage-collect and retain, in commit order.

`Publisher` owns one FIFO of namespace events (`_events`) and the one task that works through
it (`worker`): publishing a set whose objects are all uploaded (its manifest PUT), deleting the
manifest of a set deleted or moved away, collecting garbage, and applying --keep-local
retention after each publication. One FIFO, so a delete and a later re-publish of one path can
never be reordered. Helper tasks (gathering other nodes' files, cachemgr.tiering.gather; uploads
re-queued after a pause, cachemgr.tiering.uploadqueue) run in the worker's own nursery (`spawn`).

Invariants (all on the trio thread; the FIFO is appended to by the commit hooks, the upload
workers and recovery, synchronously, and consumed only by the worker — no locks):
  * a manifest is PUT only after every object it names has been uploaded and its size checked
    in the store (`_check_objects`): by a HEAD, or, for an object in `_verified`, by the
    uploader's read-back right after its PUT (see `verified`);
  * `_verified` (key -> stored size, lease generation) holds only objects of this node that
    this process uploaded and read back, that no manifest it published since names and that
    its GC has not deleted: entries are added by the upload workers (`verified`) and removed
    by the publication naming them and by the GC pass deleting them, so it never holds more
    than the `objects` rows of this node; one is used only under the lease generation it was
    added in;
  * publication follows commit order: a set is held back (`_blocked`: seq -> the earlier live
    seq) while a set this node committed before it is still live, and released by
    `_release_blocked` when a "release" event comes (queued by `_on_set_changed`, a listener of
    `Signals.changed_now`);
  * an unpublish (`Unpublish(seq, path, horizon)`) waits in `_blocked_unpublish` while a set
    with seq <= horizon (committed before the deletion) is live;
  * set states only move forward: committed -> uploading -> durable -> replaced/deleting ->
    deleted; committed/uploading -> superseded/failed/deleted;
  * a commit replacing sets at *other* paths (moves, nested sets) records them in `_absorb`;
    they are unpublished when it becomes durable; a set that will not become durable hands
    them on: to the commit that supersedes or absorbs it (`inherit`), to the next commit at
    or over its path after a rewrite superseded it (`inherit_superseded`), or to the deletion
    of its path (`unpublish_absorbed`), so a path renamed away never stays in the store;
  * garbage keys the store refused to delete for good (`Collector.refused`) are not tried again
    until a restart.

Crash states: all of this is in memory. A crash between a manifest PUT and the index recording
it leaves a live set whose manifest is in the store: it is published again (the PUT is
idempotent, and `_put_manifest` recognises its own manifest). `deleting` sets have their
manifest deletion retried. After a crash, old manifests recorded only in `_absorb` stay until
their path is committed again or deleted: visible, never torn. Recovery (cachemgr.tiering.commit
`recover`) queues every live set for publish again in seq order, every `deleting` set's
unpublish, and a GC.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import trio

from cachemgr.core.sets import LIVE_STATES, SetRegistry, SetRow
from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.format.docs import FileDoc, GatheredFile, ManifestDoc, ObjectDoc
from cachemgr.format.objects import StoredObject
from cachemgr.store import NotFound, ObjectStore, StoreError
from cachemgr.tiering.manifests import NOTHING, ManifestWriter, Seen

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.tiering.gather import Gatherer
    from cachemgr.tiering.signals import Signals, StoreHealth

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class Publish:
    """Publish set `seq` (its objects are all uploaded): its manifest PUT, in commit order."""

    seq: int
    kind: ClassVar[str] = "publish"


@dataclass(frozen=True, slots=True)
class Unpublish:
    """Delete set `seq`'s manifest at `path`, once no set with seq <= `horizon` is live (those
    committed before the deletion); `horizon` None: no longer waits."""

    seq: int
    path: str
    horizon: int | None
    kind: ClassVar[str] = "unpublish"


@dataclass(frozen=True, slots=True)
class Gc:
    """A GC pass (queued ones in a row coalesce)."""

    kind: ClassVar[str] = "gc"


@dataclass(frozen=True, slots=True)
class Release:
    """Look again at the sets held back by commit order (`_release_blocked`)."""

    kind: ClassVar[str] = "release"


# The namespace FIFO's events, one class each (compared by value: `GC in events`)
Event = Publish | Unpublish | Gc | Release
GC, RELEASE = Gc(), Release()


class _LostRace(Exception):
    pass


@dataclass(frozen=True, slots=True)
class PublishStats:
    """`Publisher.statistics()`: the namespace worker (`dataclasses.asdict` for JSON)."""

    events: int
    blocked: int
    deletes_waiting: int
    gc_refused: int
    published: int
    unpublished: int
    gc_deleted: int


class Publisher:
    """The namespace FIFO and its worker (see the module docstring)."""

    def __init__(self, *, index: Index, sets: SetRegistry, store: ObjectStore, node: str,
                 signals: Signals, health: StoreHealth, gatherer: Gatherer,
                 complete_local: Callable[[int, int, list[GatheredFile]], object],
                 keys_named_elsewhere: Callable[[str, set[str]], set[str]],
                 retention: Callable[[int], None], retry_pause: float,
                 fence: Callable[[], Awaitable[None]],
                 lease_epoch: Callable[[], int | None]) -> None:
        """`fence`: awaited before every manifest PUT (cachemgr.tiering.lease.Lease.ensure: no set
        is published on a lease this node no longer holds). `lease_epoch`: the generation of
        the lease this node holds now, None while it holds none (`verified`)."""
        self.index = index
        self.sets = sets
        self.store = store
        self.node = node
        self.signals = signals
        self.health = health
        self.gatherer = gatherer
        self._complete_local = complete_local  # tiering.remote: show other nodes' files here
        self._keys_named_elsewhere = keys_named_elsewhere  # cachemgr.tiering.remote: last listing
        self._retention = retention            # cachemgr.tiering.space: --keep-local
        self.retry_pause = retry_pause
        self._lease_epoch = lease_epoch
        self._writer = ManifestWriter(store, fence)  # every manifest PUT (its one rule)
        self._events: deque[Event] = deque()
        self._spawn: list[Callable[[], Awaitable[None]]] = []
        self._absorb: dict[int, set[tuple[int, str]]] = {}
        self._blocked: dict[int, int] = {}
        self._blocked_unpublish: list[Unpublish] = []
        # key -> (stored size, lease generation): see the invariants; trio thread only
        self._verified: dict[str, tuple[int, int]] = {}
        self._collector = Collector(index=index, sets=sets, store=store, node=node,
                                    health=health, forget=self._forget_verified)
        self._guarded: int | None = None  # the index transaction whose undo is registered
        self._current: Event | None = None  # the event the worker is handling now
        self.published = 0
        self.unpublished = 0
        self.heads = 0  # objects HEADed before publication (`_check_objects`)
        signals.on_set_changed(self._on_set_changed)

    # -- queueing (synchronous) ---------------------------------------------------------------

    def _guard(self) -> None:
        """Call before changing `_events` or `_absorb`. Inside an index transaction (the commit
        hooks, recording a publication) the first change records both as they were, put back
        if the transaction rolls back: an event or an absorbed set must not outlive the set
        records it follows (an unpublish queued by a rename that failed would delete a durable
        set's manifest; an absorb recorded under a seq that rolled back would be inherited by
        the next commit, which reuses the seq). The worker never runs inside a transaction, so
        nothing is taken from the FIFO between the record and a rollback."""
        serial = self.index.tx_serial
        if serial is None or serial == self._guarded:
            return
        self._guarded = serial
        events = deque(self._events)
        absorb = {k: set(v) for k, v in self._absorb.items()}

        def undo() -> None:
            self._events = events
            self._absorb = absorb
        self.index.on_rollback(undo)

    def publish(self, seq: int) -> None:
        """Queue the publish of set `seq` (its objects are all uploaded)."""
        self._guard()
        self._events.append(Publish(seq))

    def unpublish(self, seq: int, path: str, horizon: int) -> None:
        """Queue the deletion of set `seq`'s manifest at `path`, once every set with seq <=
        `horizon` is published or gone."""
        self._guard()
        self._events.append(Unpublish(seq, path, horizon))

    def gc(self, full: bool = False) -> None:
        """Queue a GC pass: over the contents that may have lost their last reference since
        the last pass (SetRegistry.take_unreferenced: O(what changed)), or `full`, over every
        object (recovery, once per mount)."""
        self._guard()
        self._collector.full = self._collector.full or full
        self._events.append(GC)

    def absorb(self, seq: int, old_seq: int, old_path: str) -> None:
        """Set `old_seq` at `old_path` goes from the store once set `seq` is durable."""
        self._guard()
        self._absorb.setdefault(seq, set()).add((old_seq, old_path))

    def inherit(self, seq: int, old_seq: int) -> None:
        """Set `old_seq` will not become durable in place of set `seq` (superseded by it, or
        absorbed into it): what it was to take from the store once durable, set `seq` takes
        (a renamed-away path's manifest must not outlive the rename's later re-commit)."""
        self._guard()
        moved = self._absorb.pop(old_seq, None)
        if moved:
            self._absorb.setdefault(seq, set()).update(moved)

    def inherit_superseded(self, seq: int, paths: list[str]) -> None:
        """Set `seq` inherits (`inherit`) from every earlier superseded set at or under one of
        `paths` (its own path, the paths it absorbs: a set superseded by a rewrite of its file,
        then renamed on, or re-committed). Looks only at the sets with something absorbed:
        few, in memory."""
        for old_seq in [k for k in self._absorb if k < seq]:
            old = self.sets.get(old_seq)
            if old is not None and old.state == "superseded" and \
                    any(_at_or_under(old.path, p) for p in paths):
                self.inherit(seq, old_seq)

    def unpublish_absorbed(self, paths: list[str], horizon: int, why: str) -> list[int]:
        """The sets at or under `paths` are deleted or renamed away and will never be durable
        (call after marking them `deleting`): the durable sets they were to take from the
        store once durable (`absorb`: the path a set was renamed from, sets it absorbed or
        inherited) go now, each deleted like them, after every set with seq <= `horizon`.
        Else a path renamed away, then its new name removed before the rename's set was
        durable, would stay in the store for good: nothing would ever take it out, and the
        path is in no tree to remove it from. Returns the seqs now `deleting`."""
        self._guard()
        gone: list[int] = []
        for seq in sorted(self._absorb):
            s = self.sets.get(seq)
            if s is None or s.state in (*LIVE_STATES, "durable") or \
                    not any(_at_or_under(s.path, p) for p in paths):
                continue
            for old_seq, old_path in sorted(self._absorb.pop(seq)):
                prev = self.sets.get(old_seq)
                if prev is not None and prev.state == "durable":
                    self.sets.set_state(old_seq, "deleting", why)
                    self._events.append(Unpublish(old_seq, old_path, horizon))
                    gone.append(old_seq)
        return gone

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run `fn` as a helper task in the worker's nursery."""
        self._spawn.append(fn)
        self.signals.wake_ns()

    def verified(self, key: str, stored_size: int) -> None:
        """The upload workers (cachemgr.tiering.uploadqueue): object `key`, of this node, was just
        PUT and then read back at `stored_size` bytes (cachemgr.transfer.upload `_finish`: a
        HEAD, or the store's own read-back of a staged file), and recorded in the index.

        Its publication need not HEAD it again while this node holds, without a lapse, the
        lease it held then. That HEAD guards the time between the upload and the manifest PUT
        (seconds, or minutes behind a big upload queue), and in it only these delete an object
        under this node's `data/<node>/` prefix: this node's GC, which never deletes the
        current content of a linked file nor an object a kept set names
        (`SetRegistry.garbage`), and a live set holds only current contents (a change
        supersedes it); another node, which deletes only objects of its own or, as a
        committer, of the nodes whose files it gathered (`_delete_foreign_objects`:
        `validate.is_own_object` keeps this node's out); `ckptfs fsck --repair`, which deletes
        unnamed objects only of nodes whose lease ran out (docs/FORMAT.md "Garbage"): a lapse
        starts a new lease generation (cachemgr.tiering.lease.Lease), so an object verified
        under an earlier generation is HEADed; and someone outside ckptfs, or a store that
        loses data, which no check at publication rules out for the moment after it either.
        So the skip is for this process's own fresh uploads only: a restart forgets them, an
        object named again by a later set (an unchanged file in the next save) is HEADed then,
        as are other nodes' objects."""
        epoch = self._lease_epoch()
        if epoch is not None:
            self._verified[key] = (stored_size, epoch)

    def _forget_verified(self, key: str) -> None:
        self._verified.pop(key, None)

    def ready(self, seq: int) -> None:
        """Set `seq` has every object it needs: publish it (wakes the worker)."""
        self.publish(seq)
        self.signals.wake_ns()

    def _on_set_changed(self) -> None:
        if (self._blocked or self._blocked_unpublish) and RELEASE not in self._events:
            # A set may have left the live states: sets published in commit order after it
            # are looked at again, in the namespace FIFO.
            self._guard()
            self._events.append(RELEASE)
            self.signals.wake_ns()

    def _release_blocked(self) -> None:
        """Queue the publish of every set held back by commit order whose earlier sets are now
        all published or gone (seq order: the FIFO publishes them in commit order)."""
        for seq in sorted(self._blocked):
            if self.sets.earlier_live(seq) is None:
                del self._blocked[seq]
                self._events.append(Publish(seq))
        held, self._blocked_unpublish = self._blocked_unpublish, []
        for ev in held:
            if ev.horizon is None or self.sets.earlier_live(ev.horizon + 1) is None:
                self._events.append(Unpublish(ev.seq, ev.path, None))
            else:
                self._blocked_unpublish.append(ev)

    # -- questions ----------------------------------------------------------------------------

    def blocked_by(self, seq: int) -> int | None:
        """The earlier set that set `seq` is published after (commit order), if held back."""
        return self._blocked.get(seq)

    def publishing(self, seq: int) -> bool:
        """Is the worker publishing set `seq` right now? Status: what a stuck set waits for."""
        return self._current == Publish(seq)

    def idle(self) -> bool:
        """No namespace event queued or being applied (what a caller waits for to see the
        namespace settle: an event may queue the next, as a PUT that lands for a removed path
        queues its unpublish)."""
        return not self._events and self._current is None and not self._spawn

    def held_seqs(self) -> set[int]:
        """The sets this worker will look up again (queued events, the one being applied,
        held back by commit order, absorbed or absorbing): never pruned from the index
        (cachemgr.tiering.history). O(its queues), not O(sets)."""
        out = set(self._absorb) | set(self._blocked) | set(self._blocked.values())
        for moved in self._absorb.values():
            out.update(old_seq for old_seq, _path in moved)
        for ev in (*self._events, *self._blocked_unpublish,
                   *(() if self._current is None else (self._current,))):
            if isinstance(ev, Publish | Unpublish):
                out.add(ev.seq)
        return out

    def deletes_waiting(self) -> int:
        return len(self._blocked_unpublish)

    def publish_queued(self, seq: int) -> int | None:
        """How many namespace events are ahead of set `seq`'s queued publish (None: no publish
        of it is queued). Status: what a stuck set waits for."""
        for i, ev in enumerate(self._events):
            if ev == Publish(seq):
                return i
        return None

    def statistics(self) -> PublishStats:
        return PublishStats(events=len(self._events), blocked=len(self._blocked),
                            deletes_waiting=len(self._blocked_unpublish),
                            gc_refused=len(self._collector.refused),
                            published=self.published, unpublished=self.unpublished,
                            gc_deleted=self._collector.deleted)

    # -- the worker ---------------------------------------------------------------------------

    async def worker(self) -> None:
        async with trio.open_nursery() as helpers:
            while True:
                while self._spawn:
                    helpers.start_soon(self._helper, self._spawn.pop(0))
                if not self._events:
                    await self.signals.wait_ns()
                    continue
                ev = self._events.popleft()
                if isinstance(ev, Release):
                    self._release_blocked()
                    continue
                self._current = ev
                try:
                    if isinstance(ev, Publish):
                        await self._publish(ev.seq)
                    elif isinstance(ev, Unpublish):
                        if ev.horizon is not None and \
                                self.sets.earlier_live(ev.horizon + 1) is not None:
                            self._blocked_unpublish.append(ev)  # see _release_blocked
                            continue
                        await self._unpublish(ev.seq, ev.path)
                    elif GC not in self._events:  # a Gc: bursts coalesce
                        await self._collector.run()
                except StoreError as e:
                    await self._event_failed(ev, e)
                except Exception as e:  # a bug: it must not take the queue and helpers along
                    log.exception("namespace event %s failed", ev)
                    await self._event_crashed(ev, e)
                finally:
                    self._current = None

    async def _helper(self, fn: Callable[[], Awaitable[None]]) -> None:
        """A helper task (a gather, a requeue): a bug in it is logged and shown in status; it
        does not cancel the worker and the other helpers with it."""
        try:
            await fn()
        except Exception as e:
            self.health.failed(f"internal: {e!r}")
            log.exception("namespace helper task %s failed", getattr(fn, "__name__", fn))

    async def _event_crashed(self, ev: Event, e: Exception) -> None:
        """An event whose handling raised something other than a store error (a bug). A
        publish fails its set with the reason (visible, never silently stuck); an unpublish is
        tried again after a pause (a manifest must not outlive its deletion); a gc is dropped
        (the next one redoes it)."""
        self.health.failed(f"internal: {e!r}")
        if isinstance(ev, Publish):
            with self.index.tx():
                s = self.sets.get(ev.seq)
                if s is not None and s.state in LIVE_STATES:
                    self.sets.set_state(ev.seq, "failed", f"internal error while publishing: "
                                        f"{e!r}")
            self.signals.changed_now()
        elif isinstance(ev, Unpublish):
            await trio.sleep(self.retry_pause)
            self._events.append(ev)

    async def _event_failed(self, ev: Event, e: StoreError) -> None:
        self.health.failed(f"{ev.kind}: {e}")
        if e.transient:
            log.warning("%s failed (%s); retrying in %.1fs", ev, e, self.retry_pause)
            await trio.sleep(self.retry_pause)
            self._events.appendleft(ev)
        elif isinstance(ev, Publish):
            log.error("set %d cannot be published: %s", ev.seq, e)
            with self.index.tx():
                self.sets.set_state(ev.seq, "failed", f"the store refused its manifest: {e}")
            self.signals.changed_now()
        else:
            log.error("%s failed for good: %s", ev, e)

    async def _publish(self, seq: int) -> None:
        s = self.sets.get(seq)
        if s is None or s.state not in LIVE_STATES or self.sets.missing_uploads(seq):
            return
        if _gathers(s) and not self.gatherer.gathered(seq):
            # Other nodes may hold files of this set: wait for them first (its own task, so
            # the FIFO goes on); it queues this publish again when they are all durable.
            if self.gatherer.start(seq):
                self.spawn(lambda: self.gatherer.gather(seq, self.ready))
            return
        earlier = self.sets.earlier_live(seq)
        if earlier is not None:
            # Publication follows commit order: the store never shows a set (a `latest` link,
            # a newer checkpoint) before one this node committed earlier is published or has
            # failed. Re-queued by `_release_blocked` once `earlier` leaves the live states.
            self._blocked[seq] = earlier
            return
        self._blocked.pop(seq, None)
        # The set's rows are read here, on the loop (a snapshot: later changes to the index
        # do not reach it), and turned into the manifest's entries in a worker thread, as the
        # manifest is built and serialised below: O(F) work that held FUSE requests for
        # ~0.5 s at 8,192 files (issue 35; issue 36: JSON of a big manifest never holds the
        # loop). The threads get lists and dicts only this task holds while they run (the
        # gathered entries: the Gatherer touches them again only at `forget`, after the PUT).
        rows = self.sets.files(seq)
        foreign = self.gatherer.foreign(seq)
        files = await trio.to_thread.run_sync(_entries, rows, foreign)
        # Verify every object is really there (a GC of another set, or a store losing data,
        # must not publish a manifest pointing at nothing).
        bad = await self._check_objects(files)
        if bad is not None:
            self.gatherer.fail(seq, s.path,
                               f"object {bad} vanished from the store before publication")
            return
        m, data = await trio.to_thread.run_sync(
            _manifest, {"path": s.path, "kind": s.kind, "seq": seq, "node": self.node,
                        "reason": s.reason, "committed_ns": s.committed_ns, "layout": s.layout,
                        "files": files},
            foreign)
        # The set may have been superseded or deleted while we checked.
        s = self.sets.get(seq)
        if s is None or s.state not in LIVE_STATES:
            return
        try:
            etag = await self._put_manifest(s, m, data)
        except _LostRace as lost:
            with self.index.tx():
                self.sets.set_state(seq, "superseded", str(lost))
            log.warning("set %d (%s): %s", seq, s.path, lost)
            self.gatherer.forget(seq)
            self.signals.changed_now()
            return
        self.gatherer.forget(seq)
        for f in files:  # named by a manifest now: a later set naming them HEADs them
            self._verified.pop(f["object"]["key"], None)
        if not self._record_published(s, etag, foreign):
            return
        self.published += 1
        self.health.succeeded()  # a store that took a manifest is up again, uploads or not
        log.info("set %d durable: %s (%d files, %d bytes)", seq, s.path, len(files),
                 m["total_bytes"])
        self.signals.changed_now()
        self._events.append(GC)
        self._retention(seq)

    def _record_published(self, s: SetRow, etag: str, foreign: list[GatheredFile]) -> bool:
        """Set `s`'s manifest is in the store (etag `etag`): record it durable, and what it
        replaces. False if it was deleted while the PUT was in flight (then unpublished)."""
        seq = s.seq
        with self.index.tx():
            self._guard()
            s2 = self.sets.get(seq)
            # Superseded while the PUT was in flight (a later commit of the same path, its
            # content changed, absorbed): its manifest is now the store's at its path, in place
            # of the older durable one, and it is whole. Taking it back out would leave the path
            # with no manifest until its successor publishes (a crash in between: a published
            # `latest.pt` gone from the store). It stays, as durable; its successor replaces it
            # in commit order.
            kept = s2 is not None and s2.state == "superseded"
            # ... unless its path left the tree meanwhile (removed, or renamed away, after the
            # supersession and before any later set of it): then nothing will ever replace
            # this manifest, and the removed path would be listed by every node for good.
            orphan = kept and self.index.resolve(s.path) is None
            if s2 is None or (s2.state not in LIVE_STATES and not kept) or orphan:
                # Deleted while the PUT was in flight: take the manifest back out.
                self.sets.set_etag(seq, etag)
                self._events.appendleft(Unpublish(seq, s.path, None))
                if s2 is not None and s2.state == "deleted":
                    self.sets.set_state(seq, "deleting")
                if orphan:
                    log.info("set %d (%s): its path went while its manifest was on its way: "
                             "taking the manifest back out", seq, s.path)
                return False
            self.sets.set_state(seq, "durable")
            self.sets.set_etag(seq, etag)
            if foreign and not kept:
                # The committing node shows the set as published: the other nodes' files
                # appear beside its own, read by range from the store as on any node.
                self._complete_local(seq, s2.root_ino, foreign)
            for old in self.sets.at_or_under(s.path, ("durable",)):
                if old.seq != seq and old.path == s.path:
                    self.sets.set_state(old.seq, "replaced", f"replaced by set {seq}")
            for old_seq, old_path in self._absorb.pop(seq, set()):
                prev = self.sets.get(old_seq)
                if prev is not None and prev.state == "durable":
                    if old_path == s.path:
                        self.sets.set_state(old_seq, "replaced", f"replaced by set {seq}")
                    else:
                        self.sets.set_state(old_seq, "deleting", f"absorbed by set {seq}")
                        self._events.append(Unpublish(old_seq, old_path, None))
        return True

    async def _check_objects(self, files: list[FileDoc]) -> str | None:
        """HEAD every object a manifest will name, 16 at a time, but those this process just
        uploaded and verified at the size the manifest names (`verified`); the key of one that
        is missing, else None. A size mismatch is a StoreError (retried)."""
        verified, epoch = self._verified, self._lease_epoch()
        files = [f for f in files if epoch is None or
                 verified.get(f["object"]["key"]) != (f["object"]["stored_size"], epoch)]
        self.heads += len(files)
        missing: list[str] = []
        errors: list[StoreError] = []
        limiter = trio.CapacityLimiter(16)

        async def one(f: FileDoc) -> None:
            # Errors are collected, not raised: a nursery would wrap them in an ExceptionGroup.
            async with limiter:
                try:
                    info = await self.store.head(f["object"]["key"])
                except NotFound:
                    missing.append(f["object"]["key"])
                    return
                except StoreError as e:
                    errors.append(e)
                    return
            if info.size != f["object"]["stored_size"]:
                errors.append(StoreError(f"object {f['object']['key']} has size {info.size},"
                                         f" expected {f['object']['stored_size']}"))

        async with trio.open_nursery() as n:
            for f in files:
                n.start_soon(one, f)
        if errors:
            raise errors[0]
        return min(missing) if missing else None

    async def _put_manifest(self, s: SetRow, m: ManifestDoc, data: bytes) -> str:
        """Write the manifest `m` of set `s`, serialised as `data`, with the one rule of which
        commit of a path the store keeps (cachemgr.tiering.manifests): the first PUT is
        conditional on the manifest this node's index knows at the path (`_seen`). The store
        holding this very set already (PUT before a crash or a lost reply, or by a buddy that
        took it over while this node was gone) counts as published; a later commit there raises
        _LostRace. Returns the etag of the manifest that publishes the set."""
        done = await self._writer.write(m, data, self._seen(s.path))
        if done.outcome == "same":
            assert done.there is not None
            # its objects may be a buddy's, not ours (adopt_takeover)
            await adopt_takeover(self.index, self.sets, self.store, self.node, s, done.there)
        elif done.outcome == "later":
            assert done.there is not None
            c = done.there["commit"]
            raise _LostRace(f"a concurrent commit of {s.path} on node {c['node']}, later"
                            f" than this one, is in the store")
        return done.etag

    def _seen(self, path: str) -> Seen | None:
        """The manifest this node's index knows at `path` (SetRegistry.known_set): that of a
        set of its own, or one applied from the store (whose seq is the other node's, not
        known here: never needed, the node ids differ). None if the index cannot say."""
        known = self.sets.known_set(path)
        if known is None:
            return NOTHING
        if known.etag is None:
            return None
        if known.origin == "local":
            return Seen(known.etag, mf.Commit(known.committed_ns, self.node, known.seq))
        if known.origin != self.node:
            return Seen(known.etag, mf.Commit(known.committed_ns, known.origin, 0))
        return None

    async def _unpublish(self, seq: int, path: str) -> None:
        # Only remove the manifest if it is not a newer set's. A newer set still uploading does
        # not count: until it publishes, the manifest there is an older one, whose objects GC
        # deletes once this set is gone (the namespace worker also runs every publish, so
        # none is in flight now).
        newer = [x for x in self.sets.at_or_under(path, ("durable",))
                 if x.path == path and x.seq > seq]
        s = self.sets.get(seq)
        if not newer and s is not None and s.etag is not None and \
                self.store.supports_conditional_put:
            # Another node may have replaced this set's manifest with a later commit: that one
            # is not ours to delete. (A check, then a DELETE: a replacement landing in between
            # is deleted with it; docs/SEMANTICS.md "Many nodes" names this window.)
            try:
                info = await self.store.head(mf.manifest_key(path))
                if info.etag != s.etag:
                    log.info("set %d (%s): the store holds another node's later manifest of"
                             " this path; leaving it", seq, path)
                    newer = [s]
            except NotFound:
                pass
        if not newer:
            # (not fenced: taking a set out of the store asks nothing of the other nodes, and
            # must not wait for a registration a store refusing PUTs would never take)
            await self.store.delete(mf.manifest_key(path))
            if s is not None and s.origin != "local":
                await self._delete_foreign_objects(s, path)
        with self.index.tx():
            s = self.sets.get(seq)
            if s is not None and s.state == "deleting":
                self.sets.set_state(seq, "deleted")
        self.unpublished += 1
        self.health.succeeded()
        self.signals.changed_now()
        self._events.append(GC)

    async def _delete_foreign_objects(self, s: SetRow, path: str) -> None:
        """A set restored from another node's manifest: its objects are not in this node's
        `objects` table, so GC would never collect them. The manifest is gone; its objects go
        too, but only those that another node wrote (this node's own are its GC's) and that no
        other set here and no other manifest in the store (as of the last listing) names: a
        planted manifest naming another set's objects must not take them with it."""
        keys = {json.loads(obj_json)["key"] for *_rest, obj_json in self.sets.files(s.seq)
                if obj_json}
        keys = {k for k in keys if not validate.is_own_object(k, self.node)}
        keys -= self.sets.keys_named_by_others(s.seq, keys)
        keys -= self._keys_named_elsewhere(path, keys)
        for key in sorted(keys):
            await self.store.delete(key)


class Collector:
    """Garbage collection of this node's objects, one pass at a time in the namespace worker
    (`Publisher` owns it and runs its passes in FIFO order). A pass looks at the contents that
    may have lost their last reference since the last one (SetRegistry.take_unreferenced), or
    at every object after `full` (recovery): its cost follows what changed. State: the keys the
    store refused to delete for good (`refused`, not tried again until a restart), whether the
    next pass is full, and a counter; trio thread only."""

    def __init__(self, *, index: Index, sets: SetRegistry, store: ObjectStore, node: str,
                 health: StoreHealth, forget: Callable[[str], None]) -> None:
        self.index = index
        self.sets = sets
        self.store = store
        self.node = node
        self.health = health
        self._forget = forget  # Publisher: a deleted key is no longer verified
        self.refused: set[str] = set()
        self.full = False
        self.deleted = 0

    async def run(self) -> None:
        full, self.full = self.full, False
        contents = self.sets.take_unreferenced()
        try:
            await self._collect(self.sets.garbage() if full else self.sets.garbage_of(contents))
        except BaseException:
            # retried as a whole (a transient error, a cancelled worker): the candidates too
            self.full = self.full or full
            for ino, version in contents:
                self.sets.note_unreferenced(ino, version)
            raise

    async def _collect(self, garbage: list[str]) -> None:
        keys = [k for k in garbage if k not in self.refused]
        # A takeover object is owned by the last file here materialised from a manifest naming
        # it (cachemgr.tiering.materialise); another set here may name it too (the same content
        # at a new path): it stays while any kept set names it.
        taken = {k for k in keys if validate.is_takeover_object(k, self.node)}
        if taken:
            named = self.sets.keys_named_by_others(-1, taken)
            keys = [k for k in keys if k not in named]
        done = 0
        for key in keys:
            content = self.sets.object_content(key)
            try:
                await self.store.delete(key)
            except StoreError as e:
                if e.transient:
                    raise  # retried as a whole after a pause
                # Refused for good (e.g. a symlink planted in a file:// store): this key is
                # left alone, logged once, and the garbage after it is still collected.
                self.refused.add(key)
                self.health.error(f"gc: {e}")
                log.warning("gc: cannot delete %s: %s; leaving it", key, e)
                continue
            if content is not None and self.sets.noted(*content):
                # Noted again while the DELETE was in flight: an upload of this content ended
                # (cachemgr.tiering.uploadqueue `_orphan_check`), and its PUT may have landed
                # after the DELETE. The row stays, and the next pass deletes the key again.
                continue
            self._forget(key)
            with self.index.tx():
                self.sets.forget_object(key)
            done += 1
        self.deleted += done
        if done:
            log.info("gc: deleted %d unreferenced objects", done)


async def adopt_takeover(index: Index, sets: SetRegistry, store: ObjectStore, node: str,
                         s: SetRow, cur: ManifestDoc) -> None:
    """Publisher._put_manifest: the store holds set `s` of node `node` as a buddy published
    it from its replica (cachemgr.tiering.replicate.Takeover): the manifest names the buddy's
    objects, and this node's own uploads of the same files are named by no manifest. Each
    file whose object there has the same size and CRC32C is pointed at the buddy's object
    (its set row and, if still its content, its inode: an eviction then re-fetches from a key
    that exists); then this node's own key is deleted and its row forgotten, unless another
    set here names it. In that order: a crash after the first step leaves the row, which GC
    collects with the set's content (never while the index names the key). The buddy's
    objects are the buddy's to collect (materialise: it owns them). Nothing to do when the
    manifest there names this node's objects (its own PUT)."""
    theirs = {f["path"]: f["object"] for f in cur.get("files", [])}
    mine: list[str] = []
    with index.tx():
        for rel, ino, version, size, _mode, _mtime, obj_json in sets.files(s.seq):
            if not obj_json:
                continue
            own, other = json.loads(obj_json), theirs.get(rel)
            if other is None or validate.is_own_object(other["key"], node) or \
                    not validate.is_own_object(own["key"], node) or \
                    (other["size"], other["crc32c"]) != (size, own["crc32c"]):
                continue
            other_json = json.dumps(StoredObject.from_json(other).to_json())
            sets.set_file_object(s.seq, rel, other_json)
            index.set_uploaded(ino, version, other_json)
            mine.append(own["key"])
    mine = sorted(set(mine) - sets.keys_named_by_others(s.seq, set(mine)))
    for key in mine:
        await store.delete(key)
        with index.tx():
            sets.forget_object(key)
    if mine:
        by = ", ".join(n for n in cur["commit"].get("nodes", []) if n != node)
        log.info("set %d (%s): published by %s while this node was gone: its %d files now"
                 " read from that node's objects; deleted this node's copies", s.seq,
                 s.path, by or "another node", len(mine))


def _at_or_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _gathers(s: SetRow) -> bool:
    """Can other nodes hold files of set `s`? Directories committed by DCP, a rename or a
    request (or an amend of one of those) can; single files and symlinks commit on the node
    that has them."""
    return s.kind == "dir" and s.reason in ("dcp", "rename", "request", "amend")


def _entries(rows: list[tuple[Any, ...]], foreign: list[GatheredFile]) -> list[FileDoc]:
    """A worker thread (`Publisher._publish`): the manifest entries of a set's rows
    (SetRegistry.files) and of the files gathered from other nodes (without their `node`),
    sorted by path."""
    files: list[FileDoc] = []
    for rel, _ino, _version, _size, mode, mtime_ns, obj_json in rows:
        obj: ObjectDoc = json.loads(obj_json)
        files.append({"path": rel, "size": obj["size"], "mode": mode, "mtime_ns": mtime_ns,
                      "object": obj})
    files += ({"path": f["path"], "size": f["size"], "mode": f["mode"],
               "mtime_ns": f["mtime_ns"], "object": f["object"]} for f in foreign)
    return sorted(files, key=lambda f: f["path"])


def _manifest(fields: dict[str, Any],
              foreign: list[GatheredFile]) -> tuple[ManifestDoc, bytes]:
    """A worker thread (`Publisher._publish`): the manifest of a set (`mf.build` of `fields`,
    its `layout` still JSON) and its serialised form."""
    node, files = fields["node"], fields["files"]
    m = mf.build(**{**fields, "layout": json.loads(fields["layout"])})
    # every node whose objects it names (docs/FORMAT.md `commit.nodes`): the gathered
    # files' and those of other nodes' files already in this tree (an amend after they
    # were shown here, a set adopted from another node's manifest)
    nodes = sorted({node} | {f["node"] for f in foreign} |
                   {k.split("/")[1] for f in files
                    if (k := f["object"]["key"]).startswith("data/") and k.count("/") > 1})
    if len(nodes) > 1:
        m["commit"]["nodes"] = nodes
    return m, mf.dumps(m)
