"""Restore: sets that live in the store come back into the cache, by range and in parallel, and
sets committed by other nodes appear in the namespace.

`Restorer` serves reads of files whose data is not (all) in the cache (`cached = 0`: restored
from the store, or evicted): a read waits only for the chunks it covers (one ranged GET each,
verified against the manifest's per-chunk CRC32C). What else comes in, and when, is the restore
policy (`--prefetch`, docs/ARCHITECTURE.md "Restore policy"):

  set    opening a file of a set prefetches the whole set in the background;
  file   opening a file prefetches that file only;
  reads  nothing at open: a read that continues a file's sequential stream reads ahead of it,
         by a window of 1/RA_DIV of what the stream has read so far (at most range_size); a
         short read followed by a jump back fetches the range between (`_read_ahead`);
  none   only the chunks reads cover (`--no-prefetch`);
  auto   (default) per set, decided at its first open from what the daemon knows without
         reading any file's content: `set` when one node wrote the set and no other live node
         (members/) but its writer is mounted on the store (a single-node restore); otherwise
         `reads` for DCP shard files (`__<rank>_<n>.distcp`: a rank reads only its ranges) and
         `file` for any other file (a per-rank torch.save file is read whole by one rank).

Background fetches run `concurrency` GETs at a time (memory: concurrency x range_size).
Chunks already in the cache file are recorded in `inodes.present`, so a restore interrupted by a
crash resumes where it stopped. Restored chunks count against --cache-size: room is made before
each chunk's GET (whole files first, then chunks of incomplete files nobody has open); a prefetch
never evicts files of its own set and stops when nothing else can go; a read proceeds over the
limit when nothing can be evicted. A fully cached file whose content is in the store and that was
not written by this daemon (data at rest across a restart) has each chunk checked against its
CRC32C on its first read in this daemon's life; a damaged chunk is logged and fetched again.

Sets published by other nodes appear in the namespace through `cachemgr.remote.RemoteSync`,
as evicted files whose data this module then serves.

Concurrency: everything runs on the daemon's trio thread; chunk downloads and file writes run
in worker threads. Per (ino, chunk) at most one fetch is in flight (`_inflight`); other readers
wait for it and re-check.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time

import trio

from . import names
from .errors import FsError
from .sets import KEPT_STATES
from .store import IntegrityError, StoreError
from .transfer import (
    StoredObject,
    chunk_count,
    chunk_span,
    fetch_chunk,
    fetch_chunks,
    verify_chunk,
)

log = logging.getLogger(__name__)

FETCH_ATTEMPTS = 3

MODES = ("auto", "set", "file", "reads", "none")
# `reads`: the read-ahead window is 1/RA_DIV of the bytes the stream has read so far, so what a
# stream fetches beyond its last read is at most 1/RA_DIV of what it read (plus the chunk that
# read ends in): the 1.2x fetched/read target of docs/ARCHITECTURE.md "Restore policy" with room
# for chunk rounding.
RA_DIV = 8
# DCP's shard files: each rank of a load reads only the ranges of its tensors from them.
_DCP_SHARD = re.compile(r"__\d+_\d+\.distcp")


class Restorer:
    def __init__(self, tiering, *, concurrency: int = 8,
                 range_size: int = 64 << 20, mode: str = "auto") -> None:
        self.t = tiering
        self.core = tiering.core
        self.index = tiering.index
        self.concurrency = concurrency
        self.mode = mode
        if self.mode not in MODES:
            raise ValueError(f"restore policy must be one of {', '.join(MODES)}")
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
        # A prefetch GETs runs of adjacent chunks of up to range_size bytes at once (reads of
        # data not yet in fetch just their chunks): see docs/ARCHITECTURE.md for the numbers.
        self.range_size = range_size
        self._limiter = trio.CapacityLimiter(max(1, concurrency))
        self._bitmaps: dict[int, bytearray] = {}
        self._inflight: dict[tuple[int, int], trio.Event] = {}
        self._objs: dict[int, tuple[int, StoredObject | None]] = {}  # ino -> (version, obj)
        self._verified: dict[int, set[int]] = {}
        # Files needing no more checks this run (all chunks verified, or nothing to verify
        # against): the read hot path tests membership only.
        self.clean: set[int] = set()
        self._jobs: dict[str, dict] = {}
        # --cache-size: bytes of chunks restored by this run into files not yet complete (counted
        # in core.cached_bytes; a complete file counts its size instead), and of chunk fetches
        # in flight (room is made for a chunk before its GET).
        self._partial: dict[int, int] = {}
        self._reserved = 0
        self._warned_full = False
        self._warned_disk = False
        self.nursery: trio.Nursery | None = None
        self.bytes_fetched = 0
        self.chunks_fetched = 0
        self.gets = 0                 # GET requests that returned data
        self.readahead_bytes = 0      # bytes asked for by read-ahead (policy reads)
        self._ahead_running = 0       # read-ahead tasks started and not yet ended
        self.integrity_errors = 0
        self.damaged_chunks = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as n:
            self.nursery = n
            task_status.started()
            await trio.sleep_forever()

    # -- objects and bitmaps -----------------------------------------------------------------

    def obj_of(self, ino: int) -> StoredObject | None:
        """The uploaded object of `ino`'s current content, or None."""
        node = self.core.inode(ino)
        hit = self._objs.get(ino)
        if hit is not None and hit[0] == node.version:
            return hit[1]
        row = self.index.conn.execute(
            "SELECT obj, obj_version FROM inodes WHERE ino=?", (ino,)).fetchone()
        obj = None
        if row is not None and row[0] is not None and row[1] == node.version:
            obj = StoredObject.from_json(row[0])
        self._objs[ino] = (node.version, obj)
        return obj

    def _bitmap(self, ino: int, n: int) -> bytearray:
        bm = self._bitmaps.get(ino)
        if bm is None:
            row = self.index.conn.execute(
                "SELECT present FROM inodes WHERE ino=?", (ino,)).fetchone()
            bm = bytearray(row[0]) if row and row[0] else bytearray((n + 7) // 8)
            if len(bm) != (n + 7) // 8:
                bm = bytearray((n + 7) // 8)
            self._bitmaps[ino] = bm
        return bm

    @staticmethod
    def _has(bm: bytearray, i: int) -> bool:
        return bool(bm[i >> 3] & (1 << (i & 7)))

    def forget(self, ino: int) -> None:
        """The file's cache state changed behind us (evicted, rewritten, fetched, deleted)."""
        freed = self._partial.pop(ino, 0)
        if freed:
            self.core.cached_bytes -= freed
            self.t.on_space_freed()
        self._bitmaps.pop(ino, None)
        self._verified.pop(ino, None)
        self._objs.pop(ino, None)
        self._streams.pop(ino, None)
        self._whole_set_files.discard(ino)
        self.clean.discard(ino)

    def trusted(self, ino: int) -> bool:
        """The cache file of `ino` may be read without this daemon checking each chunk (FUSE
        passthrough: the kernel reads it directly): it was written or checked in this run, or
        there is nothing to check it against."""
        if ino in self.clean:
            return True
        obj = self.obj_of(ino)
        return obj is None or obj.chunk_crcs is None

    # -- reads of files not (all) in the cache -----------------------------------------------

    async def ensure_range(self, ino: int, off: int, size: int, *, read: bool = False) -> None:
        """Return once bytes [off, off+size) of `ino` are in its cache file. `read`: a reader's
        read (FuseOps.read), which may start a read-ahead (policy reads, `_read_ahead`)."""
        node = self.core.inode(ino)
        if node.cached:
            return
        obj = self.obj_of(ino)
        if obj is None:
            raise FsError(errno.EIO, f"inode {ino} is not cached and has no object in the store")
        if obj.chunk_crcs is None:
            await self.t.fetch(ino)  # an object without chunk checksums: whole-file download
            return
        if obj.size == 0:
            self.core.fetched(ino, 0)  # nothing to fetch: the empty cache file is the file
            return
        end = min(off + size, obj.size)
        if end <= off:
            return
        cs = obj.chunk_size
        if read and (self.mode == "reads"
                     or self.mode == "auto" and ino not in self._whole_set_files) \
                and self.nursery is not None:
            self._read_ahead(ino, obj, off, end)
        for i in range(off // cs, (end - 1) // cs + 1):
            await self._ensure_chunk(ino, obj, i)

    def _read_ahead(self, ino: int, obj: StoredObject, off: int, end: int) -> None:
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
            self.nursery.start_soon(self._ahead, ino, obj, i, j)

    async def _ahead(self, ino: int, obj: StoredObject, first: int, last: int) -> None:
        """One read-ahead run. Nothing raised here may leave the task (the nursery is the
        daemon's): a failure is logged and the reader fetches what it needs itself."""
        try:
            async with self._limiter:
                await self._ensure_run(ino, obj, first, last, set())
        except (FsError, StoreError, OSError) as e:
            log.info("read-ahead of inode %d chunks %d..%d stopped: %s", ino, first, last, e)
        except Exception:  # a bug: this read-ahead ends, the daemon goes on
            log.exception("read-ahead of inode %d chunks %d..%d failed", ino, first, last)
        finally:
            self._ahead_running -= 1

    async def ensure_all(self, ino: int) -> None:
        node = self.core.inode(ino)
        if not node.cached:
            await self.ensure_range(ino, 0, max(node.size, 1))

    async def _ensure_chunk(self, ino: int, obj: StoredObject, i: int,
                            limiter: trio.CapacityLimiter | None = None,
                            protect: set[int] | None = None) -> bool:
        """Bring chunk `i` in. `protect` (a prefetch: the inos of its set) makes it give up
        and return False when --cache-size has no room for the chunk without evicting them;
        a read always proceeds (over the limit if nothing can be evicted)."""
        n = chunk_count(obj)
        while True:
            node = self.core.inode(ino)
            if node.cached or self.obj_of(ino) != obj:
                return True  # completed, or rewritten/evicted meanwhile: the caller re-checks
            if self._has(self._bitmap(ino, n), i):
                return True
            ev = self._inflight.get((ino, i))
            if ev is not None:
                await ev.wait()
                continue  # re-check: the other fetch may have failed
            length = chunk_span(obj, i)[1]
            if protect is None and not self._disk_room(length):
                # Keep the cache disk's reserve for the trainer's writes: the caller (a read)
                # is served from the store without caching (FuseOps.read).
                raise OSError(errno.ENOSPC, "the cache disk is at its reserve")
            if not self._room(length, {ino} | (protect or set())):
                if protect is not None:
                    return False
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("cache full (%d of %d bytes, nothing evictable): reads of data "
                                "not in the cache go over --cache-size", self.core.cached_bytes,
                                self.t.cfg.cache_size)
            ev = self._inflight[(ino, i)] = trio.Event()
            self._reserved += length
            try:
                raw = await self._fetch(obj, i, limiter)
                await self._store_chunk(ino, obj, i, raw, n)
            finally:
                self._reserved -= length
                del self._inflight[(ino, i)]
                ev.set()
            return True

    def _room(self, need: int, protect: set[int]) -> bool:
        """Make room under --cache-size for `need` more bytes (plus the chunks in flight):
        evict whole files (least recently used first), then chunks of incomplete files,
        never those of `protect`."""
        limit = self.t.cfg.cache_size
        if limit is None:
            return True
        return self.t.make_room(need + self._reserved, protect)

    def drop_partials(self, need: int, protect: set[int] | frozenset[int]) -> bool:
        """Part of Tiering.make_room: drop chunks restored into incomplete files (not open,
        not in `protect`) until `need` more bytes fit under --cache-size."""
        limit = self.t.cfg.cache_size
        if limit is None:
            return True
        for ino in list(self._partial):
            if self.core.cached_bytes + need <= limit:
                return True
            if ino not in protect:
                self._drop_partial(ino)
        return self.core.cached_bytes + need <= limit

    def _drop_partial(self, ino: int) -> bool:
        """Drop the chunks of an incomplete, unused file from the cache (they come back from
        the store when read)."""
        node = self.core.inode(ino)
        if node.cached or node.opens or any(k[0] == ino for k in self._inflight) or \
                self.core.files.busy(ino):
            return False
        os.truncate(self.core.data_path(ino), 0)
        with self.index.tx():
            self.index.conn.execute("UPDATE inodes SET present=NULL WHERE ino=?", (ino,))
        self.forget(ino)
        log.debug("dropped the restored chunks of inode %d", ino)
        return True

    async def _fetch(self, obj: StoredObject, i: int,
                     limiter: trio.CapacityLimiter | None) -> bytes:
        last: Exception | None = None
        for _attempt in range(FETCH_ATTEMPTS):
            try:
                if limiter is None:
                    raw = await fetch_chunk(self.t.store, obj, i)
                else:
                    async with limiter:
                        raw = await fetch_chunk(self.t.store, obj, i)
                self.chunks_fetched += 1
                self.bytes_fetched += len(raw)
                self.gets += 1
                return raw
            except StoreError as e:  # IntegrityError included: a re-read may be clean
                last = e
                if isinstance(e, IntegrityError):
                    self.integrity_errors += 1
                log.warning("fetch of %s chunk %d failed: %s", obj.key, i, e)
        log.error("giving up on %s chunk %d after %d attempts: %s", obj.key, i, FETCH_ATTEMPTS,
                  last)
        raise FsError(errno.EIO, f"cannot read {obj.key} chunk {i} from the store: {last}")

    async def _store_chunk(self, ino: int, obj: StoredObject, i: int,
                           raw: bytes | memoryview, n: int) -> None:
        await self._store_chunks(ino, obj, [(i, raw)], n)

    async def _store_chunks(self, ino: int, obj: StoredObject,
                            chunks: list[tuple[int, bytes | memoryview]], n: int) -> None:
        """Write verified chunks [(index, raw), ...] of `obj` into the cache file of `ino` (one
        worker thread, one open for all of them, under the file's lock: FileCache), then mark
        them present (one index update). Nothing is written if the file's content changed
        since the chunks were fetched."""
        def still_valid() -> bool:
            return not self.core.inode(ino).cached and self.obj_of(ino) == obj

        wrote = await self.core.files.fill(
            ino, [(chunk_span(obj, i)[0], raw) for i, raw in chunks], size=obj.size,
            still_valid=still_valid)
        if not wrote:
            return
        node = self.core.inode(ino)
        if node.cached or self.obj_of(ino) != obj:
            return
        bm = self._bitmap(ino, n)
        for i, raw in chunks:
            if not self._has(bm, i):
                self._partial[ino] = self._partial.get(ino, 0) + len(raw)
                self.core.cached_bytes += len(raw)
            bm[i >> 3] |= 1 << (i & 7)
        if all(self._has(bm, j) for j in range(n)):
            self.core.cached_bytes -= self._partial.pop(ino, 0)  # fetched() counts the size
            self._bitmaps.pop(ino, None)
            self._verified[ino] = set(range(n))
            self.clean.add(ino)
            self.core.fetched(ino, obj.size)
        else:
            with self.index.tx():
                self.index.conn.execute(
                    "UPDATE inodes SET present=? WHERE ino=?", (bytes(bm), ino))

    # -- damaged cache files --------------------------------------------------------------------

    async def verify_cached(self, ino: int, off: int, size: int) -> None:
        """First read of each chunk of a cached file whose content is in the store: check it
        against the chunk's CRC32C; a damaged chunk is fetched again."""
        obj = self.obj_of(ino)
        if obj is None or obj.chunk_crcs is None:
            self.clean.add(ino)
            return
        seen = self._verified.setdefault(ino, set())
        end = min(off + size, obj.size)
        if end <= off:
            return
        cs = obj.chunk_size
        for i in range(off // cs, (end - 1) // cs + 1):
            while i not in seen:
                # Concurrent reads of one chunk (the kernel splits and reads ahead) check it
                # once: the others wait for that check (and its repair) and re-check.
                ev = self._inflight.get((ino, i))
                if ev is not None:
                    await ev.wait()
                    if self._verified.get(ino) is not seen:
                        return  # rewritten meanwhile
                    continue
                ev = self._inflight[(ino, i)] = trio.Event()
                try:
                    if not await self._verify_chunk(ino, obj, i):
                        return  # rewritten meanwhile
                    seen.add(i)
                finally:
                    del self._inflight[(ino, i)]
                    ev.set()
        if len(seen) == chunk_count(obj):
            self.clean.add(ino)

    async def _verify_chunk(self, ino: int, obj: StoredObject, i: int) -> bool:
        """Check chunk `i` of a cached file; fetch it again if damaged. False if the file was
        rewritten meanwhile."""
        c_off, c_len = chunk_span(obj, i)
        version = self._objs.get(ino, (-1,))[0]

        def unchanged() -> bool:
            node = self.core.inode(ino)
            return node.version == version and node.cached and not node.writers and \
                node.nlink > 0

        data = await self.core.files.read(ino, c_off, c_len)
        if not unchanged():
            return False
        if not verify_chunk(obj, i, data):
            self.damaged_chunks += 1
            log.error("cache file of inode %d (%s) is damaged in chunk %d: fetching it again",
                      ino, obj.key, i)
            raw = await self._fetch(obj, i, None)
            # Written only if nobody opened the file for writing (or truncated it) since the
            # check: FileCache holds the file's lock across the check and the write.
            if not await self.core.files.fill(ino, [(c_off, raw)], size=None,
                                              still_valid=unchanged, sync=True):
                return False
        return True

    # -- prefetch ------------------------------------------------------------------------------

    def on_open(self, ino: int) -> None:
        """A file is being opened for reading: start what the restore policy fetches ahead of
        its reads, in the background (see the module docstring)."""
        if self.mode in ("none", "reads") or self.nursery is None:
            return
        s = self.t.sets.set_of_file(ino)
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
        if self.index.get_inode(ino) is None or self.core.inode(ino).cached:
            return
        path = self.index.path_of(ino)
        if path is not None and not (path in self._jobs and not self._jobs[path]["finished"]):
            self._start(path, [ino])

    def _start_set(self, s) -> None:
        if s.path in self._jobs and not self._jobs[s.path]["finished"]:
            return
        inos = [f[1] for f in self.t.sets.files(s.seq)]
        if any(not self.core.inode(i).cached for i in inos if self.index.get_inode(i)):
            self._start(s.path, inos)

    def _open_split(self, ino: int) -> None:
        """auto, a set several nodes restore: a DCP shard file is read by ranges (reads); any
        other file is fetched whole (file)."""
        path = self.index.path_of(ino)
        if path is not None and not _DCP_SHARD.fullmatch(path.rsplit("/", 1)[-1]):
            self._start_file(ino)

    async def _decide(self, s) -> None:
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
            self._whole_set_files.update(f[1] for f in self.t.sets.files(s.seq))
            self._start_set(s)
        else:
            for ino in opened:
                self._open_split(ino)

    async def _choose(self, s) -> str:
        """auto: choose the policy of set `s` at its first open. `set` when one node wrote it
        and no other live node than that writer is mounted on the store (a single-node
        restore: the whole set is wanted here), else `split`. The writers come from the
        objects' keys (data/<node>/..., validated); the live nodes from the members/ records
        (one LIST). A store that cannot be listed gives `set` (the behaviour before policies)."""
        writers: set[str] = set()
        for f in self.t.sets.files(s.seq):
            obj = self.obj_of(f[1]) if self.index.get_inode(f[1]) else None
            if obj is not None and obj.key.startswith("data/"):
                writers.add(obj.key.split("/", 2)[1])
        others: set[str] = set()
        why = "one writer"
        if len(writers) > 1:
            policy, why = "split", f"{len(writers)} nodes wrote it"
        else:
            try:
                others = set(await self.t.members.live()) - writers
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

    def prefetch_path(self, path: str) -> dict:
        """`ckptfs prefetch PATH`: the set holding PATH, or every file under PATH."""
        path = names.from_str(path.strip("/"))
        s = self.t.sets.holding(path) if path else None
        if s is not None and s.state in KEPT_STATES:
            inos = [f[1] for f in self.t.sets.files(s.seq)]
            key = s.path
        else:
            root = self.t._resolve(path) if path else 1
            inos = self._files_under(root)
            key = path or "/"
        return self._start(key, inos)

    def _files_under(self, ino: int) -> list[int]:
        """Regular files at or below `ino`, depth first (an explicit stack: any depth)."""
        out: list[int] = []
        stack = [ino]
        while stack:
            node = self.core.inode(stack.pop())
            if node.is_reg:
                out.append(node.ino)
            elif node.is_dir:
                kids = [c for _id, _name, c in self.index.list_dentries(node.ino, 0, 1 << 30)]
                stack.extend(reversed(kids))  # popped in name-list order, as before
        return out

    def _start(self, key: str, inos: list[int]) -> dict:
        work = []
        for ino in inos:
            if self.index.get_inode(ino) is None or self.core.inode(ino).cached:
                continue
            obj = self.obj_of(ino)
            if obj is not None:
                work.append((ino, obj))
        total = sum(o.size for _, o in work)
        job = {"path": key, "files": len(work), "bytes_total": total, "bytes_done": 0,
               "finished": not work, "error": None, "started": time.time()}
        self._jobs[key] = job
        if work and self.nursery is not None:
            self.nursery.start_soon(self._prefetch, job, work, set(inos))
            log.info("prefetch %s: %d files, %d bytes", key, len(work), total)
        return job

    async def _prefetch(self, job: dict, work: list[tuple[int, StoredObject]],
                        protect: set[int]) -> None:
        """`protect`: the files of the set (or tree) being prefetched: never evicted to make
        room for each other; when nothing else can go, the prefetch stops. Nothing raised here
        may leave this task (the Restorer's nursery is the daemon's): every failure ends the
        prefetch with its reason in `job["error"]` (shown by `ckptfs status` and `ckptfs
        prefetch`) and one log line; reads fetch what the prefetch did not."""
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

    async def _prefetch_all(self, job: dict, work: list[tuple[int, StoredObject]],
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

    async def _run(self, job: dict, ino: int, obj: StoredObject, first: int, last: int,
                   protect: set[int]) -> None:
        """Prefetch chunks [first, last] of one file: the missing ones not already being
        fetched come with one GET per contiguous group."""
        try:
            if job.get("cache_full"):
                return
            why = await self._ensure_run(ino, obj, first, last, protect)
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

    def _stop(self, job: dict, why: str) -> None:
        if job.get("cache_full"):
            return
        job["cache_full"] = True
        job["error"] = f"{why}: prefetch stopped; reads fetch the rest from the store"
        log.info("prefetch %s stopped after %d of %d bytes: %s", job["path"], job["bytes_done"],
                 job["bytes_total"], why)

    async def _ensure_run(self, ino: int, obj: StoredObject, first: int, last: int,
                          protect: set[int]) -> str | None:
        """Bring chunks [first, last] in for a prefetch. None when they are in (or the file
        changed meanwhile), else why the prefetch must stop (no room)."""
        n = chunk_count(obj)
        node = self.core.inode(ino)
        if node.cached or self.obj_of(ino) != obj:
            return None
        while True:
            # The next contiguous group of chunks that are neither here nor being fetched,
            # picked and registered with no await in between (a read may have taken some of
            # them while the previous group was in flight).
            node = self.core.inode(ino)
            if node.cached or self.obj_of(ino) != obj:
                return None
            bm = self._bitmap(ino, n)
            g: list[int] = []
            for i in range(first, last + 1):
                if not self._has(bm, i) and (ino, i) not in self._inflight:
                    if g and g[-1] != i - 1:
                        break
                    g.append(i)
                elif g:
                    break
            if not g:
                break
            length = sum(chunk_span(obj, i)[1] for i in g)
            if not self._room(length, {ino} | protect):
                return f"the cache is full (--cache-size {self.t.cfg.cache_size} bytes)"
            if not self._disk_room(length):
                return "the cache disk is full"
            events = {i: trio.Event() for i in g}
            for i, ev in events.items():
                self._inflight[(ino, i)] = ev
            self._reserved += length
            try:
                raws = await self._fetch_run(obj, g[0], g[-1])
                await self._store_chunks(ino, obj, list(zip(g, raws, strict=True)), n)
            finally:
                self._reserved -= length
                for i, ev in events.items():
                    del self._inflight[(ino, i)]
                    ev.set()
        # Chunks others were fetching: wait for them (or fetch them if that failed).
        for i in range(first, last + 1):
            if not await self._ensure_chunk(ino, obj, i, protect=protect):
                return f"the cache is full (--cache-size {self.t.cfg.cache_size} bytes)"
        return None

    def _disk_room(self, need: int) -> bool:
        """Does a prefetch of `need` more bytes leave the cache disk its reserve? The reserve
        (5% of the disk, at most 256 MiB) keeps room for the trainer's next checkpoint writes
        and the index; a prefetch never takes it, reads by range still may."""
        try:
            st = os.statvfs(self.core.cache_dir)
        except OSError:
            return True
        free = st.f_bavail * st.f_frsize
        reserve = min(256 << 20, st.f_blocks * st.f_frsize // 20)
        return free - self._reserved - need >= reserve

    async def read_uncached(self, ino: int, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of `ino` straight from the store (each chunk verified), not
        stored in the cache: a read of a file the cache disk has no room for."""
        obj = self.obj_of(ino)
        if obj is None or obj.chunk_crcs is None:
            raise FsError(errno.EIO, f"inode {ino}: the cache disk is full and its object"
                          " cannot be read by range")
        end = min(off + size, obj.size)
        if end <= off:
            return b""
        cs = obj.chunk_size
        if not self._warned_disk:
            self._warned_disk = True
            log.warning("the cache disk is full: reads of data not in the cache are served "
                        "from the store without caching")
        out = []
        for i in range(off // cs, (end - 1) // cs + 1):
            raw = await self._fetch(obj, i, None)
            c_off = chunk_span(obj, i)[0]
            out.append(bytes(memoryview(raw)[max(0, off - c_off):end - c_off]))
        return b"".join(out)

    async def _fetch_run(self, obj: StoredObject, first: int,
                         last: int) -> list[bytes | memoryview]:
        if first == last:
            return [await self._fetch(obj, first, None)]
        last_err: Exception | None = None
        for _attempt in range(FETCH_ATTEMPTS):
            try:
                raws = await fetch_chunks(self.t.store, obj, first, last)
                self.chunks_fetched += len(raws)
                self.bytes_fetched += sum(len(r) for r in raws)
                self.gets += 1
                return raws
            except StoreError as e:
                last_err = e
                if isinstance(e, IntegrityError):
                    self.integrity_errors += 1
                log.warning("fetch of %s chunks %d..%d failed: %s", obj.key, first, last, e)
        # Fall back to single chunks: one bad chunk must not fail its neighbours.
        log.info("fetching %s chunks %d..%d one by one after: %s", obj.key, first, last, last_err)
        return [await self._fetch(obj, i, None) for i in range(first, last + 1)]

    async def _whole(self, job: dict, ino: int, obj: StoredObject) -> None:
        try:
            await self.t.fetch(ino)
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

    def status(self) -> dict:
        return {"policy": self.mode, "bytes_fetched": self.bytes_fetched,
                "chunks_fetched": self.chunks_fetched, "gets": self.gets,
                "readahead_bytes": self.readahead_bytes,
                "readahead_running": self._ahead_running,
                "in_flight_chunks": len(self._inflight),
                "set_policies": dict(list(self._policy_paths.items())[-20:]),
                "integrity_errors": self.integrity_errors,
                "damaged_cache_chunks": self.damaged_chunks,
                "jobs": [dict(j) for j in list(self._jobs.values())[-20:]]}
