"""The upload queue and its workers: cache files' content (ino, version) to the object store.

`UploadQueue` owns the queue of content waiting for its upload (`_jobs`), the uploads in flight
(`_running`), the close sequence that orders content closed but not committed, and the upload
statistics. `file_concurrency` workers (`worker`, started by cachemgr.engine) take the
most urgent job — files of committed sets in commit order first (priority = the set's seq), then
files closed but in no committed set yet, in close order — and upload it
(`transfer.Uploader`, multipart, bounded by a limiter of parts in flight shared by all files).

Invariants (all on the trio thread; the queue is touched by the commit hooks, synchronously
inside the core's transactions, and by the workers between their awaits — no locks):
  * a (ino, version) is in at most one of `_jobs` / `_running`; enqueueing it again only
    lowers (makes more urgent) its priority;
  * an upload whose content changes or goes away meanwhile is cancelled (`drop`,
    `drop_inode`, or `Superseded` from the uploader when the content is no longer valid);
  * object keys are per (ino, version) (`object_key`): a re-upload after a crash or a retry
    overwrites the same object;
  * a set's `missing_uploads` empties only after `record_upload` for each of its files, in
    the index transaction that records the object; the publisher is told then (`ready`);
  * `_heap` holds an entry (prio, key) for every job in `_jobs` at its current priority, and
    maybe stale ones (a job since taken, dropped, or made more urgent), skipped when popped;
    `_by_ino` holds the versions of each inode in `_jobs`;
  * `_left[seq]`, once the set has been looked at, holds a superset of its contents not yet
    recorded as uploaded (a set's missing contents only ever shrink after its commit).

Cost per file (issue 35: a DCP save of 8,192 shards): queueing, taking and dropping a job are
O(log Q) / O(1) for Q queued jobs (a `min` over the whole queue made a save of F shards
O(F^2)); an upload that lands tells its sets through `_left`, O(1), where asking the index
for each set's missing files was O(F) per upload; the index is asked once per set when
its first upload lands and once when `_left` empties (to confirm before `ready`).

Crash states: the queue is in memory. An upload in flight at a crash left either nothing or a
complete object under its key with no row recording it (`obj_version != version`): recovery
(cachemgr.tiering.commit `recover`) queues it again, and the PUT overwrites it. Objects recorded in
`objects` but named by no set are garbage (cachemgr.tiering.publish GC).

Failures: a transient store error (or OSError) is retried after `retry_pause`, keeping the
job's place in commit order; a refusal fails every live set needing the content, with the
reason, so umount and `ckptfs wait` stop waiting for them.
"""

from __future__ import annotations

import errno
import heapq
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from cachemgr.core.sets import LIVE_STATES, SetRegistry
from cachemgr.format import names
from cachemgr.format.objects import StoredObject
from cachemgr.store import StoreError
from cachemgr.transfer.upload import Superseded, Uploader

if TYPE_CHECKING:
    from cachemgr.core.filecache import FileCache
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.tiering.signals import Signals, StoreHealth

log = logging.getLogger(__name__)

# Priority of content closed but not in any committed set: after every committed set.
_UNCOMMITTED = 1 << 62

Spawn = Callable[[Callable[[], Awaitable[None]]], None]


@dataclass
class _Job:
    ino: int
    version: int
    prio: int
    cancel: trio.CancelScope | None = None


@dataclass(frozen=True, slots=True)
class UploadQueueStats:
    """`UploadQueue.statistics()`: the upload queue, metrics "uploads" (`dataclasses.asdict`
    for JSON)."""

    done: int
    cancelled: int
    bytes: int
    stored_bytes: int
    parts: int
    running: int
    queued: int
    rate_bytes_per_s: float   # over the last seconds (status, stuck sets' "why")


class UploadQueue:
    """Pending uploads, the workers that do them, and their statistics."""

    def __init__(self, *, table: InodeTable, files: FileCache, index: Index, sets: SetRegistry,
                 uploader: Uploader, node: str, signals: Signals, health: StoreHealth,
                 mark_dir: Callable[[int], object], dir_published: Callable[[int], bool],
                 ready: Callable[[int], None], verified: Callable[[str, int], None],
                 gc: Callable[[], None], spawn: Spawn, retry_pause: float) -> None:
        self.table = table
        self.files = files
        self.index = index
        self.sets = sets
        self.uploader = uploader
        self.node = node
        self.signals = signals
        self.health = health
        self._mark_dir = mark_dir            # cachemgr.tiering.parts: a directory's record is stale
        self._dir_published = dir_published  # cachemgr.tiering.parts: it has a record in the store
        self._ready = ready                  # tiering.publish: set `seq` has all its objects
        self._verified = verified            # tiering.publish: an object read back after its PUT
        self._gc = gc                        # tiering.publish: collect unreferenced objects
        self._spawn = spawn                  # a helper task (the requeue after a pause)
        self.retry_pause = retry_pause
        self._jobs: dict[tuple[int, int], _Job] = {}
        self._heap: list[tuple[int, tuple[int, int]]] = []  # (prio, key): see the invariants
        self._by_ino: dict[int, set[int]] = {}  # ino -> its versions in _jobs
        self._left: dict[int, set[tuple[int, int]]] = {}  # seq -> contents it may still need
        self._running: dict[tuple[int, int], _Job] = {}
        self._close_seq = 0
        # statistics
        self.bytes_uploaded = 0
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)
        self.uploads_done = 0
        self.uploads_cancelled = 0

    # -- the queue (synchronous: the commit hooks and recovery call these) --------------------

    # Inside an index transaction (the commit hooks), a queue change takes effect when the
    # transaction commits (Index.when_committed): one that rolls back (the operation failed)
    # neither queues content that never closed nor cancels an upload a set still needs.

    def enqueue(self, ino: int, version: int, prio: int | None = None) -> None:
        """Queue the upload of content (ino, version): `prio` is the seq of the set that needs
        it; None: the live set holding it, else after every committed set, in close order."""
        self.index.when_committed(lambda: self._enqueue(ino, version, prio))

    def _enqueue(self, ino: int, version: int, prio: int | None) -> None:
        key = (ino, version)
        if prio is None:
            live = self.sets.live_commit_seq(ino, version)
            if live is not None:
                prio = live
            else:
                self._close_seq += 1
                prio = _UNCOMMITTED + self._close_seq
        job = self._jobs.get(key)
        if job is None:
            if key in self._running:
                self._running[key].prio = min(self._running[key].prio, prio)
                return
            self._jobs[key] = _Job(ino, version, prio)
            self._by_ino.setdefault(ino, set()).add(version)
            heapq.heappush(self._heap, (prio, key))
        elif prio < job.prio:
            job.prio = prio
            heapq.heappush(self._heap, (prio, key))  # the old entry is stale now
        self.signals.wake_uploads()

    def _take(self, key: tuple[int, int]) -> _Job | None:
        """Job `key` out of `_jobs` (its heap entries go stale)."""
        job = self._jobs.pop(key, None)
        if job is not None:
            versions = self._by_ino.get(key[0])
            if versions is not None:
                versions.discard(key[1])
                if not versions:
                    del self._by_ino[key[0]]
        return job

    def drop(self, ino: int, version: int) -> None:
        """Content (ino, version) is changing: no upload of it (one in flight is cancelled)."""
        self.index.when_committed(lambda: self._drop(ino, version))

    def _drop(self, ino: int, version: int) -> None:
        job = self._running.get((ino, version))
        if job is not None and job.cancel is not None:
            job.cancel.cancel()
        self._take((ino, version))

    def drop_inode(self, ino: int) -> None:
        """File `ino` is gone: no upload of any of its content."""
        self.index.when_committed(lambda: self._drop_inode(ino))

    def _drop_inode(self, ino: int) -> None:
        for version in list(self._by_ino.get(ino, ())):
            self._take((ino, version))
        for key, job in list(self._running.items()):
            if key[0] == ino and job.cancel is not None:
                job.cancel.cancel()

    def queued(self) -> int:
        return len(self._jobs)

    def running(self) -> int:
        return len(self._running)

    def content_present(self, ino: int, version: int) -> bool:
        """The index holds content (ino, version) of a linked file in the cache."""
        row = self.index.inode_fields(ino, "version", "nlink", "cached")
        return row is not None and row[0] == version and row[1] > 0 and row[2] == 1

    # -- the workers --------------------------------------------------------------------------

    def _next_job(self) -> _Job | None:
        while self._heap:
            prio, key = heapq.heappop(self._heap)
            job = self._jobs.get(key)
            if job is not None and job.prio == prio:
                return self._take(key)
        return None

    async def worker(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                await self.signals.wait_uploads()
                continue
            await self._upload(job)

    def _valid(self, ino: int, version: int) -> bool:
        node = self.table.if_loaded(ino)
        if node is not None:
            return bool(node.version == version and node.nlink > 0 and not node.writers)
        return self.content_present(ino, version)

    def _key_for(self, ino: int, version: int, size: int) -> str:
        key = self.sets.object_key(ino, version)
        if key is None:
            key = object_key(self.node, ino, version, self.index.path_of(ino) or f"{ino}")
            with self.index.tx():
                self.sets.add_object(key, ino, version, size)
        with self.index.tx():
            for seq in self.sets.live_sets_of(ino, version):
                s = self.sets.get(seq)
                if s is not None and s.state == "committed":
                    self.sets.set_state(seq, "uploading")
        return key

    async def _upload(self, job: _Job) -> None:
        ino, version = job.ino, job.version
        if not self._valid(ino, version):
            return
        row = self.index.inode_fields(ino, "obj_version", "size")
        if row is None or row[0] == version:
            return  # already uploaded (e.g. enqueued twice)
        node = self.table.if_loaded(ino)
        size: int = node.size if node is not None else row[1]
        key = self._key_for(ino, version, size)
        self._running[(ino, version)] = job
        job.cancel = trio.CancelScope()
        obj: StoredObject | None = None
        try:
            with job.cancel:
                obj = await self.uploader.upload_file(
                    self.files.path(ino), key, size=size,
                    still_valid=lambda: self._valid(ino, version), progress=self._progress)
        except Superseded:
            self.uploads_cancelled += 1
            log.info("upload of %s cancelled: content changed", key)
        except StoreError as e:
            self._failed(job, key, e)
        except OSError as e:
            if e.errno == errno.ENOENT or not self._valid(ino, version):
                self.uploads_cancelled += 1  # deleted while uploading
            else:
                self._failed(job, key, e)
        except ValueError as e:
            # The content cannot be stored at all (e.g. larger than 10,000 parts of 5 GiB):
            # its sets fail with the reason instead of staying `uploading` for ever.
            self._fail_sets(job, f"{key} cannot be stored: {e}")
        except Exception as e:  # a bug: this upload's sets fail, said why; the worker goes on
            log.exception("upload of %s failed", key)
            self._fail_sets(job, f"upload of {key} failed: internal error {e!r}")
        finally:
            self._running.pop((ino, version), None)
            if not self._valid(ino, version):
                try:
                    self._orphan_check(key, ino, version, size)
                except Exception:  # a full index disk: the orphan waits for fsck, we go on
                    log.exception("cannot record the object of %s for collection", key)
        if obj is None:
            if job.cancel.cancelled_caught:
                self.uploads_cancelled += 1
            return
        self._uploaded(ino, version, obj)

    def _orphan_check(self, key: str, ino: int, version: int, size: int) -> None:
        """The content changed or went while its upload ran: the object may have landed in the
        store all the same (a PUT in flight, a lost reply), after a GC pass had already
        forgotten its row (it was garbage then, but not in the store yet). Its row again, and a
        GC pass, so that it is collected, not left unreferenced for ever."""
        if self.sets.object_key(ino, version) is None:
            with self.index.tx():
                self.sets.add_object(key, ino, version, size)
        self.sets.note_unreferenced(ino, version)
        self._gc()
        self.signals.wake_ns()  # the namespace worker runs the GC pass

    def _uploaded(self, ino: int, version: int, obj: StoredObject) -> None:
        self.health.succeeded()
        self.uploads_done += 1
        with self.index.tx():
            if self.index.get_inode(ino) is None:
                waiting: list[int] = []
            else:
                waiting = self.sets.record_upload(ino, version, json.dumps(obj.to_json()))
                # the uploader read it back at this size: its publication need not HEAD it
                self.index.when_committed(lambda: self._verified(obj.key, obj.stored_size))
        for seq in waiting:
            left = self._left.get(seq)
            if left is None:  # the first upload of this set to land: ask the index once
                self._forget_sets()
                left = self._left[seq] = {(i, v) for i, v, _ in self.sets.missing_uploads(seq)}
            left.discard((ino, version))
            if not left:
                # to confirm (O(F), once per set); if a file is still missing, the next upload
                # of the set to land asks the index again
                del self._left[seq]
                if not self.sets.missing_uploads(seq):
                    self._ready(seq)
        parent = self.index.parent_of(ino)
        if parent is not None and (self._dir_published(parent) or
                                   (parent != 1 and self.sets.in_open_set(parent))):
            self._mark_dir(parent)  # its entry in the part record now has its object
        self.signals.wake_ns()
        self.signals.changed_now()

    def _forget_sets(self) -> None:
        """`_left` of sets that left the live states (failed, superseded, deleted): they are
        never published (O(sets looked at), once per set)."""
        for seq in list(self._left):
            s = self.sets.get(seq)
            if s is None or s.state not in LIVE_STATES:
                del self._left[seq]

    def _failed(self, job: _Job, key: str, e: Exception) -> None:
        self.health.failed(f"upload {key}: {e}")
        transient = getattr(e, "transient", False) or isinstance(e, OSError)
        if transient:
            log.warning("upload of %s failed (%s); will retry", key, e)
            # Retries already backed off inside RetryingStore; pause, then requeue.
            self._requeue_later(job)  # keeps its priority: its place in commit order
        else:
            self._fail_sets(job, f"upload of {key} refused by the store: {e}")

    def _fail_sets(self, job: _Job, why: str) -> None:
        """The content (job.ino, job.version) will never be in the store: every live set that
        needs it fails with `why` (umount and `ckptfs wait` then stop waiting for them)."""
        log.error("%s", why)
        self.health.error(why)
        with self.index.tx():
            for seq in self.sets.live_sets_of(job.ino, job.version):
                self.sets.set_state(seq, "failed", why)
        self.signals.changed_now()

    def _requeue_later(self, job: _Job) -> None:
        async def later() -> None:
            await trio.sleep(self.retry_pause)
            if self._valid(job.ino, job.version):
                self.enqueue(job.ino, job.version, prio=job.prio)
        self._spawn(later)

    def _progress(self, n: int) -> None:
        self.bytes_uploaded += n
        self._rate.append((time.monotonic(), self.bytes_uploaded))

    # -- questions ----------------------------------------------------------------------------

    def rate(self) -> float:
        """Bytes per second uploaded over the last 10 seconds."""
        now = time.monotonic()
        pts = [(t, b) for t, b in self._rate if now - t <= 10]
        if len(pts) < 2 or pts[-1][0] == pts[0][0]:
            return 0.0
        return (pts[-1][1] - pts[0][1]) / (now - pts[0][0])

    def statistics(self) -> UploadQueueStats:
        """Metrics "uploads" (ckptfs.metrics) and status "uploads"."""
        up = self.uploader.statistics()
        return UploadQueueStats(done=self.uploads_done, cancelled=self.uploads_cancelled,
                                bytes=self.bytes_uploaded, stored_bytes=up.stored_bytes,
                                parts=up.parts, running=len(self._running), queued=len(self._jobs),
                                rate_bytes_per_s=self.rate())


def object_key(node: str, ino: int, version: int, path: str) -> str:
    """The key of the object holding content (ino, version) of the file at `path` (escaped
    form, cachemgr.format.names: valid UTF-8 whatever the name's bytes). The name is a hint for
    humans browsing the store, nothing reads it back (the manifest names the key); cut so a 255-byte
    file name, or its escaped form of up to 765, still makes a key every store can hold."""
    full = path.rsplit("/", 1)[-1]
    name = full[:100]
    if names.is_escaped(full):
        cut = name.rfind("%", len(name) - 2)
        if cut >= 0:
            name = name[:cut]  # not half an escape
    return f"data/{node}/{ino}/{version}/{name}"
