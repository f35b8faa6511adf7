"""Tiering: uploads cache files to the object store, publishes committed sets atomically,
deletes and garbage-collects, evicts durable data, and answers "is it durable yet?".

Runs as one trio service inside the daemon (`Tiering.run`, started in the daemon's nursery
after the FUSE loop). The core calls the synchronous hooks (`on_*`) from FUSE handlers, inside
the index transaction of the operation that triggers them; hooks only record facts in the index
and wake the service, never do I/O to the store.

Tasks, all in one nursery (teardown: cancelled when the FUSE loop ends; everything they did
not finish is resumed from the index at the next mount):

  * `file_concurrency` upload workers: take the most urgent pending content (ino, version) —
    files of committed sets in commit order first, then files closed but not committed yet, in
    close order — and upload it (`transfer.Uploader`, multipart, bounded by a shared limiter of
    parts in flight). An upload whose content changes meanwhile is cancelled (`Superseded`).
  * one namespace task: publishes sets whose objects are all uploaded, deletes manifests of
    deleted/moved sets, in the order these events happened (one FIFO, so a delete and a later
    re-publish of one path can never be reordered); then garbage-collects objects nothing
    refers to, and applies retention.

Invariants:
  * A manifest is PUT only after every object it names has been uploaded and its size checked.
  * Data not yet uploaded (`obj_version != version`) is never evicted.
  * Set states only move forward: committed -> uploading -> durable -> replaced/deleting ->
    deleted; committed/uploading -> superseded/failed/deleted.

Crash states and recovery (`_recover`): a file open for writing at the crash (`writing = 1`) has
its version bumped and every live set holding the old content superseded; live sets re-queue
their missing uploads (keys are per (ino, version), so a re-upload overwrites the same object);
sets whose objects are all in are re-published (the manifest PUT is idempotent); `deleting`
sets have their manifest deletion retried; garbage is collected.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import stat
import time
from collections import deque
from dataclasses import dataclass, field, fields

import trio

from . import manifest as mf
from . import names, validate
from .dcp import storage_files
from .errors import FsError
from .members import Members
from .parts import PartPublisher, read_records
from .sets import DCP_METADATA, KEPT_STATES, LIVE_STATES, SetRegistry, SetRow, is_temp_name
from .store import NotFound, ObjectStore, PreconditionFailed, StoreError
from .transfer import StoredObject, Superseded, TransferConfig, Uploader, download_file

log = logging.getLogger(__name__)

# Priority of content closed but not in any committed set: after every committed set.
_UNCOMMITTED = 1 << 62


@dataclass(frozen=True)
class TieringConfig:
    transfer: TransferConfig = field(default_factory=TransferConfig)
    file_concurrency: int = 4        # files uploading at once (each with its parts in flight)
    cache_size: int | None = None    # bytes of file data kept in the cache before eviction
    keep_local: int | None = None    # keep data of only the newest N durable sets locally
    retry_pause: float = 1.0         # pause before re-queueing an upload that failed
    # restore policy (cachemgr.restore): auto, set, file, reads or none (--prefetch)
    prefetch: str = "auto"
    prefetch_concurrency: int = 8    # GETs in flight per prefetch (memory: x prefetch_range)
    prefetch_range: int = 64 << 20   # bytes per prefetch GET (runs of adjacent chunks)
    refresh_interval: float = 10.0   # seconds between listings of the store's manifests
    commit_timeout: float = 1800.0   # a commit waiting for other nodes' files fails after this
    gather_poll: float = 5.0         # longest pause between listings of other nodes' records
    lease: float = 120.0             # a node's membership lapses this long after its last renewal
    register_timeout: float = 20.0   # the mount waits at most this to register (cachemgr.members)


@dataclass
class _Job:
    ino: int
    version: int
    prio: int
    cancel: trio.CancelScope | None = None


class Tiering:
    def __init__(self, core, store: ObjectStore, cfg: TieringConfig) -> None:
        self.core = core
        self.index = core.index
        self.sets = SetRegistry(self.index)
        self.store = store
        self.cfg = cfg
        self.node = self.index.meta("node_id") or "node"
        self._parts = trio.CapacityLimiter(max(1, cfg.transfer.max_parts_in_flight))
        self.uploader = Uploader(store, cfg.transfer, self._parts)
        self._jobs: dict[tuple[int, int], _Job] = {}
        self._running: dict[tuple[int, int], _Job] = {}
        self._events: deque[tuple] = deque()
        self._wake_uploads = trio.Event()
        self._wake_ns = trio.Event()
        self._changed = trio.Event()
        self._fetches: dict[int, trio.Event] = {}
        self._close_seq = 0
        # Sets a commit replaces at *other* paths (moves, nested sets), published-away when it
        # becomes durable. In memory only: after a crash such old manifests stay until their
        # path is committed again or deleted, which is visible but never torn.
        self._absorb: dict[int, set[tuple[int, str]]] = {}
        self._spawn: list = []  # coroutines for the namespace worker's helper nursery
        from .remote import RemoteSync
        from .restore import Restorer

        def report_error(msg: str) -> None:  # the store's last error in `ckptfs status`
            self.last_error = msg

        self.parts = PartPublisher(index=self.index, store=store, node=self.node,
                                   inode_if_loaded=core.inode_if_loaded,
                                   retry_pause=cfg.retry_pause, report_error=report_error)
        self.members = Members(store=store, node=self.node, index=self.index, sets=self.sets,
                               parts=self.parts, lease=cfg.lease,
                               poll=cfg.refresh_interval if cfg.refresh_interval > 0 else 10.0,
                               register_timeout=cfg.register_timeout)
        self.restorer = Restorer(core=core, index=self.index, sets=self.sets, store=store,
                                 cache_size=cfg.cache_size, make_room=self.make_room,
                                 space_freed=self.on_space_freed, fetch_whole=self.fetch,
                                 live_members=self.members.live,
                                 concurrency=cfg.prefetch_concurrency, mode=cfg.prefetch,
                                 range_size=cfg.prefetch_range)
        self.remote = RemoteSync(core=core, index=self.index, sets=self.sets, store=store,
                                 node=self.node, interval=cfg.refresh_interval,
                                 mark_parts=self.parts.mark_all, changed=self._changed_now)
        # Multi-node commits (see `_gather`): other nodes' durable files of a set, ready for its
        # manifest, and what a set still waits for (status). In memory: recomputed after a
        # restart from `.metadata` and the part records.
        self._foreign: dict[int, list[dict]] = {}
        self._waiting: dict[int, dict] = {}
        self._gathering: set[int] = set()
        # Sets ready to publish but held back by an earlier live set (commit order): seq ->
        # the earlier seq. Owned by the namespace worker; in memory (after a restart every
        # live set is queued for publish again in seq order and re-checked).
        self._blocked: dict[int, int] = {}
        # Garbage keys the store refused to delete for good: not tried again until a restart.
        self._gc_refused: set[str] = set()
        # Unpublish events ("unpublish", seq, path, horizon) held back until no set with
        # seq <= horizon (committed before the deletion) is live. Namespace worker only.
        self._blocked_unpublish: list[tuple] = []
        self.running = False
        # statistics
        self.bytes_uploaded = 0
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)
        self.last_error: str | None = None
        self.consecutive_failures = 0
        self.uploads_done = 0
        self.uploads_cancelled = 0

    # ==========================================================================================
    # hooks from the core (synchronous, inside the operation's transaction)

    def _poke(self) -> None:
        self._wake_uploads.set()
        self._wake_ns.set()

    def _changed_now(self) -> None:
        self._wake_waiters()
        if (self._blocked or self._blocked_unpublish) and ("release",) not in self._events:
            # A set may have left the live states: sets published in commit order after it
            # are looked at again, in the namespace FIFO.
            self._events.append(("release",))
            self._wake_ns.set()

    def _release_blocked(self) -> None:
        """Queue the publish of every set held back by commit order whose earlier sets are now
        all published or gone (seq order: the FIFO publishes them in commit order)."""
        for seq in sorted(self._blocked):
            if self.sets.earlier_live(seq) is None:
                del self._blocked[seq]
                self._events.append(("publish", seq))
        held, self._blocked_unpublish = self._blocked_unpublish, []
        for ev in held:
            if self.sets.earlier_live(ev[3] + 1) is None:
                self._events.append(ev[:3])
            else:
                self._blocked_unpublish.append(ev)

    def on_content_change(self, ino: int, old_version: int) -> None:
        """A file's content (ino, old_version) is about to change (write-open or truncate)."""
        for seq in self.sets.supersede_content(ino, old_version, "a file was modified before"
                                               " the set became durable"):
            log.info("set %d superseded: content of inode %d changed", seq, ino)
        self.restorer.forget(ino)
        job = self._running.get((ino, old_version))
        if job is not None and job.cancel is not None:
            job.cancel.cancel()
        self._jobs.pop((ino, old_version), None)
        self._changed_now()

    def on_close(self, node, parent_ino: int, name: bytes) -> None:
        """The last writer of a regular file closed it."""
        # Written through this daemon: nothing to check against the store on its reads (the
        # per-chunk check is for data at rest across restarts, see cachemgr.restore).
        self.restorer.clean.add(node.ino)
        self._enqueue(node.ino, node.version)
        if self.sets.in_open_set(parent_ino):
            self.parts.mark(parent_ino)  # another node may commit this directory
        elif not is_temp_name(_s(name)):
            path = self.index.path_of(node.ino)
            if path:
                self._commit(path, node.ino, "close")
        self._wake_waiters()  # a directory wait may wait for this close

    def announce_dir(self, node) -> None:
        """A writer of `node` is closing (flush): if the file is in an open set, its directory's
        part record is brought up to date in the background (cachemgr.parts). Never waits:
        a commit on another node that needs the record asks for it (cachemgr.members)."""
        if node.nlink == 0 or node.writers != 1:
            return
        row = self.index.conn.execute(
            "SELECT parent FROM dentries WHERE ino=? LIMIT 1", (node.ino,)).fetchone()
        if row is not None and row[0] != 1 and self.sets.in_open_set(row[0]):
            self.parts.mark(row[0])

    def on_rename(self, src, dst, old_parent: int, old_name: bytes, new_parent: int,
                  new_name: bytes, old_path: str) -> None:
        new_path = self.index.path_of(src.ino)
        if new_path is None:
            return
        moved = self.sets.at_or_under(old_path, KEPT_STATES) if old_path else []
        committed = commits_at_close = False
        self.parts.mark_all()  # record keys follow their directories' paths
        if stat.S_ISDIR(src.mode):
            self._commit(new_path, src.ino, "rename", absorb_paths=[old_path, new_path],
                         from_path=old_path)
            committed = True
        elif _s(new_name) == DCP_METADATA:
            dir_path = self.index.path_of(new_parent)
            if dir_path:  # the mount root itself is never a set
                self._commit(dir_path, new_parent, "dcp", absorb_paths=[dir_path, old_path])
                committed = True
        elif not is_temp_name(_s(new_name)) and not self.sets.in_open_set(new_parent):
            if stat.S_ISREG(src.mode) and src.writing:
                commits_at_close = True
            else:
                self._commit(new_path, src.ino, "rename", absorb_paths=[old_path])
                committed = True
        if not committed:
            # The old path is gone, and so is whatever the rename replaced at the new path.
            replaced = self.sets.at_or_under(new_path, KEPT_STATES) if dst is not None else []
            if commits_at_close:
                # A file still open for writing (its close's RELEASE may reach the daemon after
                # the rename: `close(); os.replace(tmp, "latest.pt")`) commits at its last
                # close as `new_path`, and that commit replaces the set there once it is
                # published. Deleting that set now would take its manifest out of the store
                # before its successor is in: a crash in between would leave no `latest.pt`.
                replaced = [x for x in replaced if x.path != new_path]
            gone = moved + replaced
            if gone:
                self._delete_sets(gone, f"renamed away ({old_path} -> {new_path})")

    def on_remove(self, node, path: str) -> None:
        """`path` (a file, empty directory or symlink) was unlinked/removed."""
        victims = self.sets.at_or_under(path, KEPT_STATES)
        if victims:
            self._delete_sets(victims, "deleted through the mount")
        self.parts.mark_all()
        if stat.S_ISREG(node.mode):
            # A set that still needed this file's upload can never be published as committed.
            for seq in self.sets.supersede_content(node.ino, node.version, f"{path} was deleted"
                                                   " before its upload"):
                log.info("set %d superseded: %s deleted before its upload", seq, path)
            for key in list(self._jobs):
                if key[0] == node.ino:
                    self._jobs.pop(key, None)
            for key, job in list(self._running.items()):
                if key[0] == node.ino and job.cancel is not None:
                    job.cancel.cancel()
        self._enqueue_gc()
        self._wake_waiters()  # a directory wait may wait for this file

    def on_symlink(self, node, parent_ino: int, name: bytes) -> None:
        if not is_temp_name(_s(name)) and not self.sets.in_open_set(parent_ino):
            path = self.index.path_of(node.ino)
            if path:
                self._commit(path, node.ino, "symlink")

    def on_space_freed(self) -> None:
        """The cache holds fewer bytes (a file deleted, truncated or evicted): wake writers
        waiting in `wait_for_room`."""
        self._changed_now()

    def on_purge(self, ino: int) -> None:
        self.restorer.forget(ino)  # a partly restored file's chunks leave the cache with it
        self._enqueue_gc()

    # -- commit / delete bookkeeping ----------------------------------------------------------

    def commit_path(self, path: str) -> int:
        """`ckptfs commit PATH` (PATH relative to the mount root, as os functions give it)."""
        path = names.from_str(path.strip("/"))
        if not path:
            raise FsError(errno.EINVAL, "the mount root cannot be a set; commit a directory in it")
        ino = self._resolve(path)
        with self.index.tx():
            node = self.core.inode(ino)
            if node.is_reg and node.writers:
                raise FsError(errno.EBUSY, f"{path} is still open for writing")
            return self._commit(path, ino, "request", absorb_paths=[path])

    def _resolve(self, path: str) -> int:
        """The inode at `path` (escaped form, cachemgr.names)."""
        ino = self.index.resolve(path)
        if ino is None:
            raise FsError(errno.ENOENT, f"no such file: {path}")
        return ino

    def _commit(self, path: str, root_ino: int, reason: str,
                absorb_paths: list[str] | None = None, from_path: str | None = None) -> int:
        with self.index.tx():
            # Sets under the new set's path (or at the path it came from) are absorbed: their
            # manifests go once this one is durable.
            absorbed = []
            for p in absorb_paths or []:
                if p:
                    absorbed += [s for s in self.sets.at_or_under(p, KEPT_STATES)
                                 if s.path != path or s.kind != _kind_of(self.index, root_ino)]
            for s in self.sets.at_or_under(path, LIVE_STATES):
                if s.path != path and s not in absorbed:
                    absorbed.append(s)
            seq = self.sets.commit(path, root_ino, reason, from_path)
            for s in absorbed:
                if s.state in LIVE_STATES:
                    self.sets.set_state(s.seq, "superseded", f"absorbed by set {seq} ({path})")
                self._absorb.setdefault(seq, set()).add((s.seq, s.path))
            missing = self.sets.missing_uploads(seq)
        for ino, version, _size in missing:
            self._enqueue(ino, version, prio=seq)
        log.info("commit %d: %s (%s), %d files to upload", seq, path, reason, len(missing))
        if not missing:
            self._events.append(("publish", seq))
        self._poke()
        self._changed_now()
        return seq

    def _delete_sets(self, victims, why: str) -> None:
        for s in victims:
            # Durable: its manifest must go from the store. Live ones too: a crash between a
            # manifest PUT and the index recording it leaves a live set whose manifest is in
            # the store (and so may a superseded one's be, at the same path); unpublishing a
            # path with no manifest costs one DELETE.
            self.sets.set_state(s.seq, "deleting", why)
            # In commit order too: the deletion comes after every set committed so far, so
            # its manifest goes only once they are published or gone (a rotation must not
            # delete the checkpoint the store's `latest` still names while the new `latest`
            # waits for its upload).
            self._events.append(("unpublish", s.seq, s.path, self.sets.max_seq()))
            log.info("set %d (%s) %s", s.seq, s.path, why)
        self._poke()
        self._changed_now()

    def _enqueue(self, ino: int, version: int, prio: int | None = None) -> None:
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
        else:
            job.prio = min(job.prio, prio)
        self._wake_uploads.set()

    def _enqueue_gc(self) -> None:
        self._events.append(("gc",))
        self._wake_ns.set()

    # ==========================================================================================
    # the service

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self._recover()
        await self.members.register()  # before the first request is served (cachemgr.members)
        self.running = True
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(max(1, self.cfg.file_concurrency)):
                    nursery.start_soon(self._supervised, self._upload_worker)
                nursery.start_soon(self._supervised, self._namespace_worker)
                await nursery.start(self.restorer.run)
                nursery.start_soon(self._supervised, self.remote.run)
                nursery.start_soon(self._supervised, self.parts.run)
                nursery.start_soon(self._supervised, self.members.run)
                task_status.started()
        finally:
            self.running = False
            with trio.CancelScope(shield=True):
                await self.members.leave()

    async def _supervised(self, fn) -> None:
        """Run a worker forever: a bug in tiering must never take the mount down with it.
        The failure is logged with its traceback and shown in status; the worker restarts."""
        while True:
            try:
                await fn()
                return
            except Exception as e:
                self.last_error = f"{time.strftime('%H:%M:%S')} internal: {e!r}"
                self.consecutive_failures += 1
                log.exception("tiering worker %s failed; restarting it", fn.__name__)
                await trio.sleep(self.cfg.retry_pause)

    def _recover(self) -> None:
        with self.index.tx():
            for ino, version in self.index.conn.execute(
                    "SELECT ino, version FROM inodes WHERE writing=1").fetchall():
                self.sets.supersede_content(ino, version, "the daemon crashed while a file was"
                                            " being written")
                self.index.update_inode(ino, version=version + 1, writing=0)
                node = self.core.inode_if_loaded(ino)
                if node is not None:
                    node.version, node.writing = version + 1, 0
            for s in self.sets.by_states(LIVE_STATES):
                missing = self.sets.missing_uploads(s.seq)
                stale = [m for m in missing if not self._content_present(m[0], m[1])]
                if stale:
                    self.sets.set_state(s.seq, "superseded", "a file changed after the commit,"
                                        " before its upload")
                    continue
                for ino, version, _ in missing:
                    self._enqueue(ino, version, prio=s.seq)
                if not missing:
                    self._events.append(("publish", s.seq))
            # The deletion's place in commit order is not recorded: after every set known now.
            horizon = self.sets.max_seq()
            for s in self.sets.by_states(("deleting",)):
                self._events.append(("unpublish", s.seq, s.path, horizon))
            # Closed files whose current content is not uploaded yet.
            for ino, version in self.index.conn.execute(
                    "SELECT ino, version FROM inodes WHERE (mode & 61440) = 32768 AND nlink > 0"
                    " AND writing = 0 AND cached = 1 AND (obj_version IS NULL OR"
                    " obj_version != version)").fetchall():
                self._enqueue(ino, version)
        self._events.append(("gc",))
        n_live = len(self.sets.by_states(LIVE_STATES))
        if n_live or self._jobs:
            log.info("tiering: resuming %d sets, %d uploads", n_live, len(self._jobs))

    def _content_present(self, ino: int, version: int) -> bool:
        row = self.index.conn.execute(
            "SELECT version, nlink, cached FROM inodes WHERE ino=?", (ino,)).fetchone()
        return row is not None and row[0] == version and row[1] > 0 and row[2] == 1

    def _next_job(self) -> _Job | None:
        if not self._jobs:
            return None
        key = min(self._jobs, key=lambda k: self._jobs[k].prio)
        return self._jobs.pop(key)

    async def _upload_worker(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                self._wake_uploads = trio.Event() if self._wake_uploads.is_set() else \
                    self._wake_uploads
                await self._wake_uploads.wait()
                continue
            await self._upload(job)

    def _valid(self, ino: int, version: int) -> bool:
        node = self.core.inode_if_loaded(ino)
        if node is not None:
            return node.version == version and node.nlink > 0 and not node.writers
        return self._content_present(ino, version)

    async def _upload(self, job: _Job) -> None:
        ino, version = job.ino, job.version
        if not self._valid(ino, version):
            return
        row = self.index.conn.execute(
            "SELECT obj_version, size FROM inodes WHERE ino=?", (ino,)).fetchone()
        if row is None or row[0] == version:
            return  # already uploaded (e.g. enqueued twice)
        node = self.core.inode_if_loaded(ino)
        size = node.size if node is not None else row[1]
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
        self._running[(ino, version)] = job
        job.cancel = trio.CancelScope()
        obj: StoredObject | None = None
        try:
            with job.cancel:
                obj = await self.uploader.upload_file(
                    self.core.data_path(ino), key, size=size,
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
        if obj is None:
            if job.cancel.cancelled_caught:
                self.uploads_cancelled += 1
            return
        self.consecutive_failures = 0
        self.uploads_done += 1
        with self.index.tx():
            if self.index.get_inode(ino) is None:
                waiting: list[int] = []
            else:
                waiting = self.sets.record_upload(ino, version, json.dumps(obj.to_json()))
        for seq in waiting:
            if not self.sets.missing_uploads(seq):
                self._events.append(("publish", seq))
        row = self.index.conn.execute(
            "SELECT parent FROM dentries WHERE ino=? LIMIT 1", (ino,)).fetchone()
        if row is not None and (row[0] in self.parts.published or
                                (row[0] != 1 and self.sets.in_open_set(row[0]))):
            self.parts.mark(row[0])  # its entry in the part record now has its object
        self._wake_ns.set()
        self._changed_now()

    def _failed(self, job: _Job, key: str, e: Exception) -> None:
        self.consecutive_failures += 1
        self.last_error = f"{time.strftime('%H:%M:%S')} upload {key}: {e}"
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
        self.last_error = f"{time.strftime('%H:%M:%S')} {why}"
        with self.index.tx():
            for seq in self.sets.live_sets_of(job.ino, job.version):
                self.sets.set_state(seq, "failed", why)
        self._changed_now()

    def _requeue_later(self, job: _Job) -> None:
        async def later():
            await trio.sleep(self.cfg.retry_pause)
            if self._valid(job.ino, job.version):
                self._enqueue(job.ino, job.version, prio=job.prio)
        self._nursery_soon(later)

    def _nursery_soon(self, fn) -> None:
        self._spawn.append(fn)
        self._wake_ns.set()

    def _progress(self, n: int) -> None:
        self.bytes_uploaded += n
        self._rate.append((time.monotonic(), self.bytes_uploaded))

    # -- namespace worker: publish, unpublish, gc, retention ----------------------------------

    async def _namespace_worker(self) -> None:
        async with trio.open_nursery() as helpers:
            while True:
                while self._spawn:
                    helpers.start_soon(self._spawn.pop(0))
                if not self._events:
                    self._wake_ns = trio.Event()
                    await self._wake_ns.wait()
                    continue
                ev = self._events.popleft()
                if ev[0] == "release":
                    self._release_blocked()
                    continue
                try:
                    if ev[0] == "publish":
                        await self._publish(ev[1])
                    elif ev[0] == "unpublish":
                        if len(ev) > 3 and self.sets.earlier_live(ev[3] + 1) is not None:
                            self._blocked_unpublish.append(ev)  # see _release_blocked
                            continue
                        await self._unpublish(ev[1], ev[2])
                    elif ev[0] == "gc":
                        if ("gc",) not in self._events:  # coalesce bursts
                            await self._gc()
                except StoreError as e:
                    self.consecutive_failures += 1
                    self.last_error = f"{time.strftime('%H:%M:%S')} {ev[0]}: {e}"
                    if e.transient:
                        log.warning("%s failed (%s); retrying in %.1fs", ev, e,
                                    self.cfg.retry_pause)
                        await trio.sleep(self.cfg.retry_pause)
                        self._events.appendleft(ev)
                    elif ev[0] == "publish":
                        log.error("set %d cannot be published: %s", ev[1], e)
                        with self.index.tx():
                            self.sets.set_state(ev[1], "failed", f"the store refused its"
                                                f" manifest: {e}")
                        self._changed_now()
                    else:
                        log.error("%s failed for good: %s", ev, e)

    async def _publish(self, seq: int) -> None:
        s = self.sets.get(seq)
        if s is None or s.state not in LIVE_STATES or self.sets.missing_uploads(seq):
            return
        if _gathers(s) and seq not in self._foreign:
            # Other nodes may hold files of this set: wait for them first (its own task, so
            # the FIFO goes on); it queues this publish again when they are all durable.
            if seq not in self._gathering:
                self._gathering.add(seq)
                self._nursery_soon(lambda: self._gather(seq))
            return
        earlier = self.sets.earlier_live(seq)
        if earlier is not None:
            # Publication follows commit order: the store never shows a set (a `latest` link,
            # a newer checkpoint) before one this node committed earlier is published or has
            # failed. Re-queued by `_release_blocked` once `earlier` leaves the live states.
            self._blocked[seq] = earlier
            return
        self._blocked.pop(seq, None)
        files = []
        for rel, _ino, _version, _size, mode, mtime_ns, obj_json in self.sets.files(seq):
            obj = json.loads(obj_json)
            files.append({"path": rel, "size": obj["size"], "mode": mode, "mtime_ns": mtime_ns,
                          "object": obj})
        foreign = self._foreign.get(seq, [])
        files = sorted(files + foreign, key=lambda f: f["path"])
        # Verify every object is really there (a GC of another set, or a store losing data,
        # must not publish a manifest pointing at nothing).
        bad = await self._check_objects(files)
        if bad is not None:
            self._fail(seq, s.path, f"object {bad} vanished from the store before publication")
            return
        m = mf.build(path=s.path, kind=s.kind, seq=seq, node=self.node, reason=s.reason,
                     committed_ns=s.committed_ns, layout=json.loads(s.layout), files=files)
        nodes = sorted({self.node} | {f["node"] for f in foreign if "node" in f})
        if len(nodes) > 1:
            m["commit"]["nodes"] = nodes
        for f in m["files"]:
            f.pop("node", None)
        # The set may have been superseded or deleted while we checked.
        s = self.sets.get(seq)
        if s is None or s.state not in LIVE_STATES:
            return
        try:
            etag = await self._put_manifest(s, m)
        except _LostRace as lost:
            with self.index.tx():
                self.sets.set_state(seq, "superseded", str(lost))
            log.warning("set %d (%s): %s", seq, s.path, lost)
            self._foreign.pop(seq, None)
            self._changed_now()
            return
        self._foreign.pop(seq, None)
        with self.index.tx():
            s2 = self.sets.get(seq)
            # Superseded while the PUT was in flight (a later commit of the same path, its
            # content changed, absorbed): its manifest is now the store's at its path, in place
            # of the older durable one, and it is whole. Taking it back out would leave the path
            # with no manifest until its successor publishes (a crash in between: a published
            # `latest.pt` gone from the store). It stays, as durable; its successor replaces it
            # in commit order.
            kept = s2 is not None and s2.state == "superseded"
            if s2 is None or (s2.state not in LIVE_STATES and not kept):
                # Deleted while the PUT was in flight: take the manifest back out.
                self.sets.set_etag(seq, etag)
                self._events.appendleft(("unpublish", seq, s.path))
                if s2 is not None and s2.state == "deleted":
                    self.sets.set_state(seq, "deleting")
                return
            self.sets.set_state(seq, "durable")
            self.sets.set_etag(seq, etag)
            if foreign and not kept:
                # The committing node shows the set as published: the other nodes' files
                # appear beside its own, read by range from the store as on any node.
                self.remote.complete_local(seq, s2.root_ino, foreign)
            for old in self.sets.at_or_under(s.path, ("durable",)):
                if old.seq != seq and old.path == s.path:
                    self.sets.set_state(old.seq, "replaced", f"replaced by set {seq}")
            for old_seq, old_path in self._absorb.pop(seq, set()):
                old = self.sets.get(old_seq)
                if old is not None and old.state == "durable":
                    if old_path == s.path:
                        self.sets.set_state(old_seq, "replaced", f"replaced by set {seq}")
                    else:
                        self.sets.set_state(old_seq, "deleting", f"absorbed by set {seq}")
                        self._events.append(("unpublish", old_seq, old_path))
        log.info("set %d durable: %s (%d files, %d bytes)", seq, s.path, len(files),
                 m["total_bytes"])
        self._changed_now()
        self._events.append(("gc",))
        self._retention()

    async def _check_objects(self, files: list[dict]) -> str | None:
        """HEAD every object a manifest will name, 16 at a time; the key of one that is
        missing, else None. A size mismatch is a StoreError (retried)."""
        missing: list[str] = []
        errors: list[StoreError] = []
        limiter = trio.CapacityLimiter(16)

        async def one(f: dict) -> None:
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

    async def _put_manifest(self, s, m: dict) -> str:
        """PUT the manifest of set `s` so that concurrent commits of one path from several nodes
        end in a defined state: the PUT is conditional on the manifest this node last saw there
        (If-Match its etag, or If-None-Match when it saw none). When another node's manifest is
        there instead, the commit with the later `committed_ns` (ties: the larger node id) wins:
        if that is this one it replaces the other (If-Match its etag), else it raises _LostRace.
        Returns the new manifest's etag."""
        key = mf.manifest_key(s.path)
        data = mf.dumps(m)
        if not self.store.supports_conditional_put:
            return (await self.store.put(key, data)).etag
        expect = self.sets.known_etag(s.path)
        ours = (s.committed_ns, self.node)
        for _attempt in range(8):
            try:
                if expect is None:
                    info = await self.store.put(key, data, if_none_match=True)
                else:
                    info = await self.store.put(key, data, if_match=expect)
                return info.etag
            except PreconditionFailed:
                pass
            except NotFound:
                # If-Match on a key with no object: S3 answers 404 NoSuchKey, not 412 (the
                # manifest this node knew was deleted meanwhile, e.g. by a rotation racing a
                # re-commit of the path). Nothing to replace: create it.
                expect = None
                continue
            try:
                cur_info = await self.store.head(key)
                cur = mf.loads(await self.store.get(key), key)
            except NotFound:
                expect = None
                continue
            except mf.ManifestError:
                cur = {"commit": {}}
                cur_info = await self.store.head(key)
            c = cur.get("commit", {})
            if c.get("node") == self.node and c.get("seq") == m["commit"]["seq"]:
                return cur_info.etag  # this very set, PUT before a crash or a lost reply
            theirs = (int(c.get("committed_ns") or 0), str(c.get("node") or ""))
            if theirs > ours:
                raise _LostRace(f"a concurrent commit of {s.path} on node {theirs[1]}, later"
                                f" than this one, is in the store")
            log.info("set %d (%s): replacing an earlier concurrent commit from node %s",
                     m["commit"]["seq"], s.path, theirs[1])
            expect = cur_info.etag
        raise StoreError(f"the manifest of {s.path} kept changing under conditional PUTs")

    # -- multi-node commits ---------------------------------------------------------------------

    def _dcp_required(self, seq: int) -> set[str] | None:
        """Storage files named by the set's `.metadata` (None: not readable)."""
        for rel, ino, _version, _size, _mode, _mtime, _obj in self.sets.files(seq):
            if rel == DCP_METADATA:
                try:
                    with open(self.core.data_path(ino), "rb") as f:
                        data = f.read()
                except OSError as e:
                    log.warning("set %d: cannot read its .metadata: %s", seq, e)
                    return None
                if not data and self.index.conn.execute(
                        "SELECT cached FROM inodes WHERE ino=?", (ino,)).fetchone()[0] == 0:
                    return None  # evicted; the caller fetches it first
                required = storage_files(data)  # names as DCP wrote them (os-style str)
                return None if required is None else {names.from_str(n) for n in required}
        return None

    async def _gather(self, seq: int) -> None:
        """Wait until every file of set `seq` written by other nodes is durable, then queue
        its publish with them (docs/ARCHITECTURE.md "Many nodes"). What the set must include:
          * DCP: every storage file its `.metadata` names (the ones not in this node's
            directory must come from other nodes' part records, durable);
          * otherwise (a directory renamed into place, `ckptfs commit`), or when `.metadata`
            cannot be read: every file another node announced under the set's path or the path
            it was renamed from, each durable. Closes do not wait for their records, so first
            every other live node acknowledges the commit's intent, which it does once its
            records under those paths are in the store (cachemgr.members); a node alone pays
            one LIST of the members.
        Fails the set after `commit_timeout` seconds since its commit."""
        acks = None
        try:
            s = self.sets.get(seq)
            if s is None:
                return
            layout = json.loads(s.layout)
            roots = [s.path] + ([layout["from"]] if layout.get("from") else [])
            local = {r[0] for r in self.sets.files(seq)}
            required = None
            if s.reason == "dcp":
                for rel, ino, *_ in self.sets.files(seq):
                    if rel == DCP_METADATA and not self.core.inode(ino).cached:
                        try:
                            await self.restorer.ensure_all(ino)
                        except (FsError, StoreError, OSError) as e:
                            log.warning("set %d: cannot bring its .metadata back: %s", seq, e)
                required = self._dcp_required(seq)
            if required is None:
                acks = self.members.commit_acks(seq, s.path, roots)
            cache: dict = {}
            pause = 0.1
            while True:
                s = self.sets.get(seq)
                if s is None or s.state not in LIVE_STATES:
                    self._waiting.pop(seq, None)
                    return
                foreign: dict[str, dict] = {}
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
                        self._fail(seq, s.path, f"part record {key} is invalid: {why}")
                        return
                if required is not None:
                    waiting = sorted(required - local - set(foreign))
                else:
                    waiting = sorted(pending)
                if not waiting and not unacked:
                    break
                waited = (time.time_ns() - s.committed_ns) / 1e9
                nodes = sorted({e["node"] for e in foreign.values()})
                self._waiting[seq] = {"files": waiting[:50], "missing": len(waiting),
                                      "nodes_seen": nodes, "waited_s": round(waited, 1),
                                      "timeout_s": self.cfg.commit_timeout}
                if unacked:
                    self._waiting[seq]["acks_from"] = unacked[:50]
                if waited >= self.cfg.commit_timeout:
                    what = (f"{len(waiting)} file(s) from other nodes: {', '.join(waiting[:10])}"
                            if not unacked else
                            f"acknowledgements from node(s) {', '.join(unacked[:10])}")
                    self._fail(seq, s.path,
                               f"commit timed out after {waited:.0f}s waiting for {what}")
                    return
                if pause >= 1.0 or len(self._waiting) == 1:
                    if unacked:
                        log.info("set %d (%s) waits for acknowledgements from node(s) %s"
                                 " (%.0fs)", seq, s.path, ", ".join(unacked[:10]), waited)
                    else:
                        log.info("set %d (%s) waits for %d file(s) from other nodes (%.0fs)",
                                 seq, s.path, len(waiting), waited)
                self._changed_now()
                await trio.sleep(min(pause, max(0.01, self.cfg.commit_timeout - waited)))
                pause = min(pause * 2, self.cfg.gather_poll)
            self._waiting.pop(seq, None)
            self._foreign[seq] = [dict(e["file"], node=e["node"]) for e in foreign.values()]
            if foreign:
                log.info("set %d (%s): %d file(s) from node(s) %s are durable", seq, s.path,
                         len(foreign), ", ".join(sorted({e["node"] for e in foreign.values()})))
            self._events.append(("publish", seq))
            self._wake_ns.set()
        finally:
            self._gathering.discard(seq)
            if acks is not None and not acks.done:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await acks.close()

    def _fail(self, seq: int, path: str, msg: str) -> None:
        """Set `seq` can never be published as committed: `failed`, with `msg` as its error."""
        log.error("set %d (%s) failed: %s", seq, path, msg)
        with self.index.tx():
            self.sets.set_state(seq, "failed", msg)
        self._waiting.pop(seq, None)
        self._foreign.pop(seq, None)
        self._changed_now()

    async def _collect(self, roots: list[str], local: set[str], cache: dict,
                       bad: dict[str, str]) -> tuple[dict[str, dict], set[str]]:
        """Other nodes' files under `roots`, by path inside the set: ({rel: {"node", "file"}}
        of durable ones, {rel} of announced ones not durable yet). A path this node has
        itself is never taken from another node; a path several nodes have is taken from the
        newest durable copy."""
        foreign: dict[str, dict] = {}
        pending: set[str] = set()
        for root in roots:
            for rec in await read_records(self.store, root, self.node, cache, bad):
                d = rec["dir"]
                sub = "" if d == root else d[len(root) + 1:]
                for f in rec["files"]:  # validated (cachemgr.validate.part_record)
                    rel = f"{sub}/{f['name']}" if sub else f["name"]
                    if rel in local:
                        continue
                    if f["object"] is None:
                        pending.add(rel)
                        continue
                    entry = {"path": rel, "size": f["size"], "mode": f["mode"],
                             "mtime_ns": f["mtime_ns"], "object": f["object"]}
                    old = foreign.get(rel)
                    if old is None or entry["mtime_ns"] > old["file"]["mtime_ns"]:
                        foreign[rel] = {"node": rec["node"], "file": entry}
        return foreign, pending - set(foreign)

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
            await self.store.delete(mf.manifest_key(path))
            if s is not None and s.origin != "local":
                # A set restored from another node's manifest: its objects are not in this
                # node's `objects` table, so GC would never collect them. The manifest is gone;
                # its objects go too, but only those that another node wrote (this node's own
                # are its GC's) and that no other set here and no other manifest in the store
                # (as of the last listing) names: a planted manifest naming another set's
                # objects must not take them with it.
                keys = {json.loads(obj_json)["key"] for *_rest, obj_json in self.sets.files(seq)
                        if obj_json}
                keys = {k for k in keys if not validate.is_own_object(k, self.node)}
                keys -= self.sets.keys_named_by_others(seq, keys)
                keys -= self.remote.keys_named_elsewhere(path, keys)
                for key in sorted(keys):
                    await self.store.delete(key)
        with self.index.tx():
            s = self.sets.get(seq)
            if s is not None and s.state == "deleting":
                self.sets.set_state(seq, "deleted")
        self._changed_now()
        self._events.append(("gc",))

    async def _gc(self) -> None:
        keys = [k for k in self.sets.garbage() if k not in self._gc_refused]
        done = 0
        for key in keys:
            try:
                await self.store.delete(key)
            except StoreError as e:
                if e.transient:
                    raise  # retried as a whole after a pause
                # Refused for good (e.g. a symlink planted in a file:// store): this key is
                # left alone, logged once, and the garbage after it is still collected.
                self._gc_refused.add(key)
                self.last_error = f"{time.strftime('%H:%M:%S')} gc: {e}"
                log.warning("gc: cannot delete %s: %s; leaving it", key, e)
                continue
            with self.index.tx():
                self.sets.forget_object(key)
            done += 1
        if done:
            log.info("gc: deleted %d unreferenced objects", done)

    # -- eviction -----------------------------------------------------------------------------

    def _retention(self) -> None:
        n = self.cfg.keep_local
        if n is None:
            return
        durable = [s for s in self.sets.by_states(("durable",)) if s.kind != "symlink"]
        for s in durable[:max(0, len(durable) - n)]:
            for _rel, ino, version, *_ in self.sets.files(s.seq):
                if self.core.evict(ino, version):
                    self.restorer.forget(ino)

    def make_room(self, need: int, protect: set[int] | frozenset[int] = frozenset()) -> bool:
        """Evict durable data, least recently used first, until `need` more bytes fit under
        --cache-size. Returns True if they fit. Files in `protect` are never evicted (a
        prefetch does not evict its own set)."""
        limit = self.cfg.cache_size
        if limit is None:
            return True
        if self.core.cached_bytes + need <= limit:
            return True
        newest = self.sets.by_states(("durable",))
        keep = {r[1] for r in self.sets.files(newest[-1].seq)} if newest else set()
        cands = [c for c in self.core.eviction_candidates() if c[0] not in protect]
        # The newest durable set goes last, not never: when it is all that can make room (a
        # file being written plus the last checkpoint exceed the limit), skipping it would
        # block the writer forever.
        for ino, version in ([c for c in cands if c[0] not in keep] +
                             [c for c in cands if c[0] in keep]):
            if self.core.evict(ino, version):
                self.restorer.forget(ino)
            if self.core.cached_bytes + need <= limit:
                return True
        # Then the chunks of partly restored files nobody has open (they count too).
        return self.restorer.drop_partials(need, protect)

    async def wait_for_room(self, need: int) -> None:
        """Backpressure for writers: block until `need` bytes fit under --cache-size."""
        warned = False
        while not self.make_room(need):
            if not warned:
                log.warning("cache full (%d of %d bytes, none evictable yet): writers wait for"
                            " uploads", self.core.cached_bytes, self.cfg.cache_size)
                warned = True
            await self._changed.wait()

    # -- read-through of evicted data ----------------------------------------------------------

    async def fetch(self, ino: int) -> None:
        """Bring an evicted file's data back into its cache file (concurrent callers share one
        download)."""
        ev = self._fetches.get(ino)
        if ev is not None:
            await ev.wait()
            return
        ev = self._fetches[ino] = trio.Event()
        try:
            row = self.index.conn.execute(
                "SELECT obj, obj_version, version, cached FROM inodes WHERE ino=?",
                (ino,)).fetchone()
            if row is None or row[3] == 1:
                return
            if row[0] is None or row[1] != row[2]:
                raise FsError(errno.EIO, f"inode {ino} is evicted but has no object")
            obj = StoredObject.from_json(json.loads(row[0]))
            await self.wait_for_room(obj.size)
            last: Exception | None = None
            # Under the file's lock (cachemgr.filecache): no write or truncating open lands in
            # the cache file while the download fills it.
            async with self.core.files.exclusive(ino):
                node = self.core.inode(ino)
                if node.cached or self.restorer.obj_of(ino) != obj:
                    return  # rewritten (O_TRUNC) while we waited for room
                for _attempt in range(3):
                    try:
                        await download_file(self.store, obj, self.core.data_path(ino))
                        break
                    except StoreError as e:  # IntegrityError included: fetch again
                        last = e
                        log.warning("fetch of inode %d (%s) failed: %s", ino, obj.key, e)
                else:
                    raise FsError(errno.EIO, f"cannot fetch {obj.key} from the store: {last}")
                self.core.fetched(ino, obj.size)
            self.restorer.forget(ino)
        finally:
            ev.set()
            del self._fetches[ino]

    # ==========================================================================================
    # questions

    def upload_rate(self) -> float:
        now = time.monotonic()
        pts = [(t, b) for t, b in self._rate if now - t <= 10]
        if len(pts) < 2 or pts[-1][0] == pts[0][0]:
            return 0.0
        return (pts[-1][1] - pts[0][1]) / (now - pts[0][0])

    def health(self) -> str:
        if self.consecutive_failures == 0:
            return "normal"
        return "unstable" if self.consecutive_failures < 5 else "down"

    def status(self, limit: int = 50) -> dict:
        sets = []
        pending = 0
        for s in self.sets.recent(limit):
            files = self.sets.files(s.seq)
            total = sum(f[3] for f in files)
            done = sum(json.loads(f[6])["size"] for f in files if f[6])
            if s.state in LIVE_STATES:
                pending += total - done
            row = {"seq": s.seq, "path": s.path, "kind": s.kind, "state": s.state,
                   "reason": s.reason, "files": len(files), "bytes": total,
                   "bytes_uploaded": done, "committed_ns": s.committed_ns,
                   "durable_ns": s.durable_ns, "error": s.error, "origin": s.origin}
            if s.seq in self._waiting:
                # waited_s as of now, not as of the gather loop's last look
                row["waiting_for"] = dict(self._waiting[s.seq], waited_s=round(
                    (time.time_ns() - s.committed_ns) / 1e9, 1))
            if s.seq in self._blocked and s.state in LIVE_STATES:
                row["after_set"] = self._blocked[s.seq]  # published once that one is
            sets.append(row)
        live = self.sets.by_states(LIVE_STATES)
        retry = getattr(self.store, "stats", None)  # RetryingStore: transient errors ridden out
        return {
            "store": {"url": self.store.url, "node": self.node, "health": self.health(),
                      "last_error": self.last_error,
                      "consecutive_failures": self.consecutive_failures,
                      "retries": getattr(retry, "retries", 0),
                      "retry_failures": getattr(retry, "failures", 0)},
            "uploads": {"queued": len(self._jobs), "running": len(self._running),
                        "done": self.uploads_done, "cancelled": self.uploads_cancelled,
                        "bytes_uploaded": self.bytes_uploaded,
                        "rate_bytes_per_s": self.upload_rate()},
            "restore": self.restorer.status(),
            "filecache": self.core.files.statistics(),
            "remote": self.remote.status(),
            "parts": self.parts.status(),
            "members": self.members.status(),
            "pending_sets": len(live),
            # of which waiting for files other nodes write, or published after such a set
            # (commit order): nothing this node can finish
            # deletions whose manifest waits for sets committed before them (commit order)
            "deletes_waiting": len(self._blocked_unpublish),
            "waiting_sets": len([s for s in live if self._waiting and
                                 s.seq >= min(self._waiting)]),
            "pending_bytes": pending,
            "sets": sets,
        }

    def statistics(self) -> dict:
        """Counters and totals for metrics (ckptfs.metrics): what `status` shows, over every set
        instead of the recent ones, and without per-set detail. Plain data, copied: the caller
        may keep it after the loop has moved on."""
        retry = getattr(self.store, "stats", None)  # RetryingStore; absent: a bare store
        up = self.uploader.statistics()
        r = self.restorer
        return {
            "sets": self.sets.statistics(),
            "store": {"health": self.health(), "consecutive_failures": self.consecutive_failures,
                      "requests": dict(getattr(retry, "by_op", {})),
                      "retries": dict(getattr(retry, "by_error", {})),
                      "errors": dict(getattr(retry, "errors", {}))},
            "uploads": {"done": self.uploads_done, "cancelled": self.uploads_cancelled,
                        "bytes": self.bytes_uploaded, "stored_bytes": up.stored_bytes,
                        "parts": up.parts, "running": len(self._running),
                        "queued": len(self._jobs)},
            "restore": {"bytes": r.bytes_fetched, "chunks": r.chunks_fetched,
                        "integrity_errors": r.integrity_errors,
                        "damaged_cache_chunks": r.damaged_chunks},
            "cache_size": self.cfg.cache_size,
        }

    async def wait(self, path: str, timeout: float | None) -> dict:
        """Wait until the set holding `path` is durable (following supersession to the newest
        set of that path). Returns {"state", "seq", "path", "error"}. `path` as os functions
        give it (`ckptfs wait PATH`). A directory that is not (inside) one set is waited for
        as a whole (`_wait_dir`)."""
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
                await self._changed.wait()
        s = self.sets.holding(path)
        return {"state": "timeout", "seq": s.seq if s else None, "path": s.path if s else None,
                "error": f"not durable after {timeout}s (state {s.state if s else '?'})"}

    # -- waiting for a directory of many sets (docs/SEMANTICS.md "Waiting for a directory") ----
    #
    # What is waited for is fixed at the call: the newest commit of each path at or under the
    # directory, if it is committed, uploading or durable, and every file under it that is
    # open for writing (it commits at its last close, or the wait says why not). A set that
    # ended (failed, deleted) or a file in no set ends the wait with the reason. One request,
    # woken by `_changed` (every set state change, and closes and removals: `_wake_waiters`);
    # each wake re-reads the pending sets in one query.

    def _wake_waiters(self) -> None:
        """Wake `wait` requests (a file closed or removed: a directory wait may be waiting for
        it), without the namespace work of `_changed_now`."""
        self._changed.set()
        self._changed = trio.Event()

    def _newest_under(self, path: str) -> dict[str, SetRow]:
        """The newest set (any state) of each path at or under `path` ("" = the mount root)."""
        rows = (self.sets.at_or_under(path, _ALL_STATES) if path
                else self.sets.by_states(_ALL_STATES))
        return {r.path: r for r in rows}  # ordered by seq: the newest of each path wins

    def _dir_ino(self, path: str) -> int | None:
        try:
            ino = self._resolve(path) if path else 1
            return ino if self.core.inode(ino).is_dir else None
        except FsError:
            return None

    def _at_path(self, path: str) -> int | None:
        """The inode at `path` now, None if there is none."""
        try:
            return self._resolve(path)
        except FsError:
            return None

    async def _wait_dir(self, path: str, dir_ino: int, newest: dict[str, SetRow],
                        timeout: float | None) -> dict:
        where = path or "/"
        prefix = path + "/" if path else ""
        pending: set[int] = set()
        for p, r in newest.items():
            if r.state in KEPT_STATES:
                pending.add(r.seq)
            elif r.state == "failed" and self._at_path(p) == r.root_ino and not any(
                    q.startswith(p + "/") and x.seq > r.seq for q, x in newest.items()):
                # Still there and not written anew below: the directory cannot be durable.
                return {"state": "failed", "seq": r.seq, "path": r.path, "error": r.error}
        # Every file under the directory must be in one of those sets (its current content),
        # or be open for writing (waited for): anything else is in no set, and nothing will
        # commit it on its own (a temporary name, a directory that is not committed yet).
        contents = {(ino, version) for (ino, version) in self.index.conn.execute(
            "SELECT ino, version FROM set_files WHERE seq IN (SELECT value FROM json_each(?))",
            (json.dumps(sorted(pending)),))}
        set_paths = {newest_path for newest_path, r in newest.items() if r.seq in pending}
        files, layout = self.sets.snapshot(dir_ino)
        writing: dict[int, str] = {}  # ino -> path of files open for writing, waited for
        loose: list[str] = []
        for rel, ino, version, *_ in files:
            if (ino, version) not in contents:
                if self.core.inode(ino).writers:
                    writing[ino] = prefix + rel
                else:
                    loose.append(prefix + rel)
        for link in layout["symlinks"]:
            p = prefix + link["path"]
            parts = p.split("/")
            if not any("/".join(parts[:i]) in set_paths for i in range(len(parts), 0, -1)):
                loose.append(p)
        if loose:
            return _uncommitted(where, sorted(loose))
        if not pending and not writing:
            return {"state": "none", "path": path,
                    "error": f"{where} holds no committed set"}
        log.info("wait %s: %d set(s) committed under it, %d file(s) open for writing", where,
                 len(pending), len(writing))
        durable: set[int] = set()
        with trio.move_on_after(math.inf if timeout is None else timeout):
            while True:
                ended = self._dir_step(pending, durable, writing)
                if ended is not None:
                    return ended
                if not pending and not writing:
                    log.info("wait %s: %d sets durable", where, len(durable))
                    return {"state": "durable", "path": path, "sets": len(durable)}
                await self._changed.wait()
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
        return [SetRow(*r) for r in self.index.conn.execute(
            f"SELECT {_SETROW_COLS} FROM sets WHERE seq IN (SELECT value FROM json_each(?))",
            (json.dumps(sorted(seqs)),))]

    def _dir_step(self, pending: set[int], durable: set[int],
                  writing: dict[int, str]) -> dict | None:
        """One look at what a directory wait waits for: moves durable sets out of `pending`,
        follows sets replaced by a newer commit, turns closed files into their sets. Returns
        the reply that ends the wait, or None to go on waiting."""
        for ino, p in list(writing.items()):
            try:
                node = self.core.inode(ino)
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
            if r.kind == "file" and self.core.inode(ino).is_reg:
                pending.discard(r.seq)  # the file is waited for: its next commit, at its close
                writing[ino] = r.path
                return self._dir_step(pending, durable, writing)
            # A directory set one of whose files was rewritten: waits for its next commit.
        return None


class _LostRace(Exception):
    pass


def _gathers(s) -> bool:
    """Can other nodes hold files of set `s`? Directories committed by DCP, a rename or a
    request can; single files and symlinks commit on the node that has them."""
    return s.kind == "dir" and s.reason in ("dcp", "rename", "request")


# Set states in which a set no longer holds its path's content: a directory that held one
# of these and was written file by file since is waited for as a directory (`Tiering.wait`).
_ENDED = ("superseded", "failed", "deleting", "deleted")
_SETROW_COLS = ", ".join(f.name for f in fields(SetRow))  # the columns, in SetRow's order
_ALL_STATES = ("committed", "uploading", "durable", "failed", "superseded", "replaced",
               "deleting", "deleted")


def _some(paths: list[str], n: int = 5) -> str:
    """The first `n` of `paths`, and how many more."""
    more = f" and {len(paths) - n} more" if len(paths) > n else ""
    return ", ".join(paths[:n]) + more


def _uncommitted(where: str, paths: list[str], closed: bool = False) -> dict:
    """The reply of a directory wait that found files in no committed set (`closed`: a file it
    waited for was closed and nothing committed it)."""
    what = (f"{where} was closed but is in no committed set" if closed else
            f"{where} holds {len(paths)} file(s) in no committed set: {_some(paths)}")
    return {"state": "uncommitted", "path": where, "files": paths[:50], "count": len(paths),
            "error": f"{what}; not durable (a temporary name, or in a directory not committed"
                     " yet: nothing commits it on its own; `ckptfs commit` it, or remove it)"}


def object_key(node: str, ino: int, version: int, path: str) -> str:
    """The key of the object holding content (ino, version) of the file at `path` (escaped
    form, cachemgr.names: valid UTF-8 whatever the name's bytes). The name is a hint for humans
    browsing the store, nothing reads it back (the manifest names the key); cut so a 255-byte
    file name, or its escaped form of up to 765, still makes a key every store can hold."""
    full = path.rsplit("/", 1)[-1]
    name = full[:100]
    if names.is_escaped(full):
        cut = name.rfind("%", len(name) - 2)
        if cut >= 0:
            name = name[:cut]  # not half an escape
    return f"data/{node}/{ino}/{version}/{name}"


def _s(name: bytes) -> str:
    return name.decode("utf-8", "surrogateescape")


def _kind_of(index, ino: int) -> str:
    row = index.get_inode(ino)
    if row is None:
        return "?"
    mode = row[1]
    return "dir" if stat.S_ISDIR(mode) else "symlink" if stat.S_ISLNK(mode) else "file"

