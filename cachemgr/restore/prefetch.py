"""The restore policy: what comes into the cache ahead of reads, and when (`--prefetch`,
docs/ARCHITECTURE.md "Restore policy"). `Prefetcher` decides and runs it; the chunks themselves
come through `cachemgr.restore.chunkfetch.ChunkFetcher`.

  set    opening a file of a set prefetches the whole set in the background;
  file   opening a file prefetches that file only;
  reads  nothing at open: a read that continues a file's sequential stream reads ahead of it,
         by a window of 1/RA_DIV of what the stream has read so far (at most range_size); a
         short read followed by a jump back fetches the range between (`on_read`);
  none   only the chunks reads cover (`--no-prefetch`);
  auto   (default) per set, decided at its first open from what the daemon knows without
         reading any file's content: `set` when one node wrote the set and no other live node
         (members/) but its writer is mounted on the store (a single-node restore); otherwise
         `reads` for DCP shard files (`__<rank>_<n>.distcp`: a rank reads only its ranges) and
         `file` for any other file (a per-rank torch.save file is read whole by one rank).

A prefetch job (`ckptfs prefetch PATH`, or an open under policy set/file) GETs runs of
adjacent chunks of up to range_size bytes, `concurrency` GETs at a time (memory: concurrency x
range_size); a prefetch never evicts files of its own set and stops when nothing else can go,
or when the cache disk would go into its reserve. Reads fetch what a prefetch did not.

State, its owner and its guards: `Prefetcher` owns the policy chosen per set (`_policy`,
"deciding" while `_decide` runs; the files opened meanwhile in `_deciding`), the files of sets
that chose `set` (`_whole_set_files`: their reads need no read-ahead), each file's sequential
read stream (`_streams`), the jobs (`_jobs`, by path; status shows the last 20) and the tasks it
starts in its nursery (`run`). All of it is in memory, on the daemon's trio thread; per-file
state is dropped with the file's cache state (`forget`). Nothing raised in a background task
leaves it (the nursery is the daemon's): a failure ends that job or read-ahead, with its reason
in the job and one log line. Crash states: none of its own (a restart starts no prefetch; the
chunks a prefetch brought in are recorded by ChunkFetcher).
"""

from __future__ import annotations

import errno
import logging
import re
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from cachemgr.core.errors import FsError
from cachemgr.core.sets import KEPT_STATES, SetRow
from cachemgr.format import names
from cachemgr.format.objects import StoredObject, chunk_count, chunk_span
from cachemgr.restore.chunkfetch import ChunkFetcher
from cachemgr.store import StoreError

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.core.sets import SetRegistry

log = logging.getLogger(__name__)

MODES = ("auto", "set", "file", "reads", "none")
# `reads`: the read-ahead window is 1/RA_DIV of the bytes the stream has read so far, so what a
# stream fetches beyond its last read is at most 1/RA_DIV of what it read (plus the chunk that
# read ends in): the 1.2x fetched/read target of docs/ARCHITECTURE.md "Restore policy" with room
# for chunk rounding.
RA_DIV = 8
# DCP's shard files: each rank of a load reads only the ranges of its tensors from them.
_DCP_SHARD = re.compile(r"__\d+_\d+\.distcp")

# fetch_whole(ino): bring an object stored without chunk checksums back whole (Engine.fetch).
FetchWhole = Callable[[int], Awaitable[None]]
# live_members(): {node: mtime} of the other live nodes on the store (Members.live).
LiveMembers = Callable[[], Awaitable[dict[str, float]]]
Job = dict[str, Any]


@dataclass(frozen=True, slots=True)
class PrefetchStats:
    """`Prefetcher.statistics()`: the restore policy (`dataclasses.asdict` for JSON)."""

    policy: str
    readahead_bytes: int
    readahead_running: int
    set_policies: dict[str, str]
    jobs: list[dict[str, Any]]


class Prefetcher:
    """The restore policy, prefetch jobs and read-ahead; see the module docstring."""

    def __init__(self, *, chunks: ChunkFetcher, table: InodeTable, index: Index,
                 sets: SetRegistry, fetch_whole: FetchWhole, live_members: LiveMembers,
                 mode: str, concurrency: int, range_size: int) -> None:
        if mode not in MODES:
            raise ValueError(f"restore policy must be one of {', '.join(MODES)}")
        self.chunks = chunks
        self.table = table
        self.index = index
        self.sets = sets
        self._fetch_whole = fetch_whole
        self._live_members = live_members
        self.mode = mode
        self.concurrency = concurrency
        # A prefetch GETs runs of adjacent chunks of up to range_size bytes at once (reads of
        # data not yet in fetch just their chunks): see docs/ARCHITECTURE.md for the numbers.
        self.range_size = range_size
        self._limiter = trio.CapacityLimiter(max(1, concurrency))
        # auto: the policy chosen for each set (seq -> "set" | "split"), "deciding" meanwhile.
        self._policy: dict[int, str] = {}
        self._policy_paths: dict[str, str] = {}  # set path -> policy, for status
        self._deciding: dict[int, list[int]] = {}  # seq -> files opened while deciding
        # auto: files of sets that chose `set` (their reads need no read-ahead: the whole set
        # is coming); dropped with the file's cache state (forget).
        self._whole_set_files: set[int] = set()
        # reads: per file being read, its sequential stream: [first byte, end of the furthest
        # read, first chunk not yet asked for]. Dropped with the file's cache state (forget).
        self._streams: dict[int, list[int]] = {}
        self._jobs: dict[str, Job] = {}
        self.nursery: trio.Nursery | None = None
        # statistics
        self.readahead_bytes = 0      # bytes asked for by read-ahead (policy reads)
        self._ahead_running = 0       # read-ahead tasks started and not yet ended

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """The nursery of the prefetch and read-ahead tasks (the daemon's)."""
        async with trio.open_nursery() as n:
            self.nursery = n
            task_status.started()
            await trio.sleep_forever()

    def forget(self, ino: int) -> None:
        """The file's cache state changed behind us (evicted, rewritten, fetched, deleted)."""
        self._streams.pop(ino, None)
        self._whole_set_files.discard(ino)

    # -- read-ahead (policy reads, and auto's split sets) -------------------------------------

    def on_read(self, ino: int, obj: StoredObject, off: int, end: int) -> None:
        """A reader's read of bytes [off, end) of a file not all in the cache: start the
        read-ahead its policy asks for (`_read_ahead`), never waited for by the read."""
        if (self.mode == "reads" or (self.mode == "auto" and ino not in self._whole_set_files)) \
                and self.nursery is not None:
            self._read_ahead(self.nursery, ino, obj, off, end)

    def _read_ahead(self, nursery: trio.Nursery, ino: int, obj: StoredObject, off: int,
                    end: int) -> None:
        """Policy reads: a read inside the file's current stream (from a chunk before its start
        to a chunk past what was asked for) extends it, and the chunks up to RA_DIV-th of the
        stream's length ahead of its furthest read are fetched in the background (runs of at
        most range_size, `concurrency` GETs at a time, never waited for by the read); any other
        read starts a new stream with no read-ahead, unless it jumps back after a short read
        (below). So a reader that jumps around fetches its chunks only, and one that goes on
        reading gets ahead of it."""
        cs = obj.chunk_size
        st = self._streams.get(ino)
        if st is None or not (st[0] - cs <= off <= st[2] * cs + cs):
            prev = st
            st = self._streams[ino] = [off, end, (end - 1) // cs + 1]
            if prev is None or not (off < prev[0] and prev[1] - prev[0] <= cs):
                return
            # A short read, then a jump back before it: the reader looked at the end of a
            # range first and now reads it from its start (torch.load reads a zip's directory
            # at its end: each DCP item, each torch.save file), so the whole range between is
            # wanted: fetch it now, `concurrency` GETs in parallel.
            last = (min(obj.size, prev[1]) - 1) // cs
            parts = self.concurrency
        else:
            st[1] = max(st[1], end)
            window = min(self.range_size, (st[1] - st[0]) // RA_DIV)
            last = (min(obj.size, st[1] + window) - 1) // cs
            parts = 4  # a large window is several GETs in flight at once
        first = max(st[2], (end - 1) // cs + 1)
        if last < first:
            return
        st[2] = last + 1
        per = max(1, self.range_size // cs)
        step = max(1, min(per, -(-(last - first + 1) // parts)))
        for i in range(first, last + 1, step):
            j = min(i + step, last + 1) - 1
            self.readahead_bytes += sum(chunk_span(obj, k)[1] for k in range(i, j + 1))
            self._ahead_running += 1
            nursery.start_soon(self._ahead, ino, obj, i, j)

    async def _ahead(self, ino: int, obj: StoredObject, first: int, last: int) -> None:
        """One read-ahead run. Nothing raised here may leave the task (the nursery is the
        daemon's): a failure is logged and the reader fetches what it needs itself."""
        try:
            async with self._limiter:
                await self.chunks.ensure_run(ino, obj, first, last, set())
        except (FsError, StoreError, OSError) as e:
            log.info("read-ahead of inode %d chunks %d..%d stopped: %s", ino, first, last, e)
        except Exception:  # a bug: this read-ahead ends, the daemon goes on
            log.exception("read-ahead of inode %d chunks %d..%d failed", ino, first, last)
        finally:
            self._ahead_running -= 1

    # -- the policy at open ----------------------------------------------------------------------

    def on_open(self, ino: int) -> None:
        """A file is being opened for reading: start what the restore policy fetches ahead of
        its reads, in the background (see the module docstring)."""
        if self.mode in ("none", "reads") or self.nursery is None:
            return
        s = self.sets.set_of_file(ino)
        if s is None or self.mode == "file":
            self._start_file(ino)
            return
        if self.mode == "auto":
            policy = self._policy.get(s.seq)
            if policy is None:
                self._policy[s.seq] = "deciding"
                self._deciding[s.seq] = [ino]
                self.nursery.start_soon(self._decide, s)
                return
            if policy == "deciding":
                self._deciding[s.seq].append(ino)  # _decide starts what the policy asks
                return
            if policy == "split":
                self._open_split(ino)
                return
        self._start_set(s)

    def _start_file(self, ino: int) -> None:
        if self.index.get_inode(ino) is None or self.table.get(ino).cached:
            return
        path = self.index.path_of(ino)
        if path is not None and not (path in self._jobs and not self._jobs[path]["finished"]):
            self._start(path, [ino])

    def _start_set(self, s: SetRow) -> None:
        if s.path in self._jobs and not self._jobs[s.path]["finished"]:
            return
        inos = [f[1] for f in self.sets.files(s.seq)]
        if any(not self.table.get(i).cached for i in inos if self.index.get_inode(i)):
            self._start(s.path, inos)

    def _open_split(self, ino: int) -> None:
        """auto, a set several nodes restore: a DCP shard file is read by ranges (reads); any
        other file is fetched whole (file)."""
        path = self.index.path_of(ino)
        if path is not None and not _DCP_SHARD.fullmatch(path.rsplit("/", 1)[-1]):
            self._start_file(ino)

    async def _decide(self, s: SetRow) -> None:
        """Nothing raised here may leave the task (the nursery is the daemon's): a failure
        falls back to the whole set, today's behaviour."""
        try:
            policy = await self._choose(s)
        except Exception:  # a bug: logged with its traceback, the daemon goes on
            log.exception("restore policy of %s: choosing failed; whole set", s.path)
            policy = "set"
        self._policy[s.seq] = policy
        self._policy_paths[s.path] = policy
        while len(self._policy_paths) > 100:  # status shows the recent ones
            self._policy_paths.pop(next(iter(self._policy_paths)))
        opened = self._deciding.pop(s.seq, [])
        if policy == "set":
            self._whole_set_files.update(f[1] for f in self.sets.files(s.seq))
            self._start_set(s)
        else:
            for ino in opened:
                self._open_split(ino)

    async def _choose(self, s: SetRow) -> str:
        """auto: choose the policy of set `s` at its first open. `set` when one node wrote it
        and no other live node than that writer is mounted on the store (a single-node
        restore: the whole set is wanted here), else `split`. The writers come from the
        objects' keys (data/<node>/..., validated); the live nodes from the members/ records
        (one LIST). A store that cannot be listed gives `set` (the behaviour before policies)."""
        writers: set[str] = set()
        for f in self.sets.files(s.seq):
            obj = self.chunks.obj_of(f[1]) if self.index.get_inode(f[1]) else None
            if obj is not None and obj.key.startswith("data/"):
                writers.add(obj.key.split("/", 2)[1])
        others: set[str] = set()
        why = "one writer"
        if len(writers) > 1:
            policy, why = "split", f"{len(writers)} nodes wrote it"
        else:
            try:
                others = set(await self._live_members()) - writers
            except StoreError as e:
                log.warning("restore policy of %s: cannot list the live nodes (%s): whole set",
                            s.path, e)
            policy = "split" if others else "set"
            if others:
                why = f"{len(others)} other live node(s) may restore it too"
            else:
                why = "one writer, no other reader mounted"
        log.info("restore policy of %s: %s (%s)", s.path,
                 "whole set" if policy == "set" else "ranges read (DCP shards), files opened",
                 why)
        return policy

    # -- prefetch jobs ---------------------------------------------------------------------------

    def prefetch_path(self, path: str) -> Job:
        """`ckptfs prefetch PATH`: the set holding PATH, or every file under PATH."""
        path = names.from_str(path.strip("/"))
        s = self.sets.holding(path) if path else None
        if s is not None and s.state in KEPT_STATES:
            inos = [f[1] for f in self.sets.files(s.seq)]
            key = s.path
        else:
            root = self.index.resolve(path) if path else 1
            if root is None:
                raise FsError(errno.ENOENT, f"no such file: {path}")
            inos = self._files_under(root)
            key = path or "/"
        return self._start(key, inos)

    def _files_under(self, ino: int) -> list[int]:
        """Regular files at or below `ino`, depth first in name-list order."""
        node = self.table.get(ino)
        if node.is_reg:
            return [ino]
        if not node.is_dir:
            return []
        return [row[1] for _d, _rel, row in self.index.walk_with_inodes(ino)
                if stat.S_ISREG(row[2])]

    def _start(self, key: str, inos: list[int]) -> Job:
        work = []
        for ino in inos:
            if self.index.get_inode(ino) is None or self.table.get(ino).cached:
                continue
            obj = self.chunks.obj_of(ino)
            if obj is not None:
                work.append((ino, obj))
        total = sum(o.size for _, o in work)
        job: Job = {"path": key, "files": len(work), "bytes_total": total, "bytes_done": 0,
                    "finished": not work, "error": None, "started": time.time()}
        self._jobs[key] = job
        if work and self.nursery is not None:
            self.nursery.start_soon(self._prefetch, job, work, set(inos))
            log.info("prefetch %s: %d files, %d bytes", key, len(work), total)
        return job

    async def _prefetch(self, job: Job, work: list[tuple[int, StoredObject]],
                        protect: set[int]) -> None:
        """`protect`: the files of the set (or tree) being prefetched: never evicted to make
        room for each other; when nothing else can go, the prefetch stops. Nothing raised here
        may leave this task (the nursery is the daemon's): every failure ends the prefetch with
        its reason in `job["error"]` (shown by `ckptfs status` and `ckptfs prefetch`) and one
        log line; reads fetch what the prefetch did not."""
        try:
            await self._prefetch_all(job, work, protect)
        except Exception as e:  # a bug: logged with its traceback, the daemon goes on
            log.exception("prefetch %s failed", job["path"])
            job["error"] = job["error"] or f"internal error: {e!r}"
        finally:
            job["finished"] = True
            job["seconds"] = time.time() - job["started"]
            if job["error"] is None:
                log.info("prefetch %s done: %d bytes in %.1fs", job["path"], job["bytes_done"],
                         job["seconds"])

    async def _prefetch_all(self, job: Job, work: list[tuple[int, StoredObject]],
                            protect: set[int]) -> None:
        async with trio.open_nursery() as n:
            for ino, obj in work:
                if obj.chunk_crcs is None:
                    n.start_soon(self._whole, job, ino, obj)
                    continue
                per = max(1, self.range_size // max(1, obj.chunk_size))
                for i in range(0, chunk_count(obj), per):
                    last = min(i + per, chunk_count(obj)) - 1
                    await self._limiter.acquire_on_behalf_of((job["path"], ino, i))
                    if job.get("cache_full"):
                        self._limiter.release_on_behalf_of((job["path"], ino, i))
                        break
                    n.start_soon(self._run, job, ino, obj, i, last, protect)
                if job.get("cache_full"):
                    break

    async def _run(self, job: Job, ino: int, obj: StoredObject, first: int, last: int,
                   protect: set[int]) -> None:
        """Prefetch chunks [first, last] of one file: the missing ones not already being
        fetched come with one GET per contiguous group."""
        try:
            if job.get("cache_full"):
                return
            why = await self.chunks.ensure_run(ino, obj, first, last, protect)
            if why is None:
                job["bytes_done"] += sum(chunk_span(obj, i)[1] for i in range(first, last + 1))
            else:
                # The rest would evict what this prefetch brought in, or does not fit on the
                # cache disk: stop here; reads fetch the rest by range on demand.
                self._stop(job, why)
        except FsError as e:
            job["error"] = e.msg  # a read of that range will retry and answer EIO if it must
        except OSError as e:  # the cache disk refused (ENOSPC, EDQUOT, EIO): stop, say why
            self._stop(job, f"the cache disk refused a write ({e.strerror or e})")
        except StoreError as e:
            job["error"] = f"the store failed: {e}"
        except Exception as e:  # a bug: this prefetch ends, the daemon goes on
            log.exception("prefetch %s: chunks %d..%d of inode %d failed", job["path"], first,
                          last, ino)
            job["error"] = f"internal error: {e!r}"
        finally:
            self._limiter.release_on_behalf_of((job["path"], ino, first))

    def _stop(self, job: Job, why: str) -> None:
        if job.get("cache_full"):
            return
        job["cache_full"] = True
        job["error"] = f"{why}: prefetch stopped; reads fetch the rest from the store"
        log.info("prefetch %s stopped after %d of %d bytes: %s", job["path"], job["bytes_done"],
                 job["bytes_total"], why)

    async def _whole(self, job: Job, ino: int, obj: StoredObject) -> None:
        """Prefetch a file whose object has no chunk checksums: the whole object at once."""
        try:
            await self._fetch_whole(ino)
            job["bytes_done"] += obj.size
        except FsError as e:
            job["error"] = e.msg
        except OSError as e:
            self._stop(job, f"the cache disk refused a write ({e.strerror or e})")
        except StoreError as e:
            job["error"] = f"the store failed: {e}"
        except Exception as e:  # a bug: this prefetch ends, the daemon goes on
            log.exception("prefetch %s: inode %d failed", job["path"], ino)
            job["error"] = f"internal error: {e!r}"

    def statistics(self) -> PrefetchStats:
        return PrefetchStats(policy=self.mode, readahead_bytes=self.readahead_bytes,
                             readahead_running=self._ahead_running,
                             set_policies=dict(list(self._policy_paths.items())[-20:]),
                             jobs=[dict(j) for j in list(self._jobs.values())[-20:]])
