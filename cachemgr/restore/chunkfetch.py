"""The chunk fetch-and-fill path of restore: chunks of a file whose data is not (all) in the
cache come from the store by range, are verified against the manifest's per-chunk CRC32C, and
are written into the file's cache file; chunks of a cached file are checked on their first read.

`ChunkFetcher` is what `cachemgr.restore.restorer.Restorer` (reads) and
`cachemgr.restore.prefetch.Prefetcher` (prefetch jobs, read-ahead) call: `ensure_chunk` (one chunk,
for a read or a prefetch), `ensure_run` (adjacent chunks in one GET, for a prefetch),
`verify_cached` (a cached file's first reads in this daemon's life), `fetch` (one verified chunk,
not stored).

State, its owner and its guards (all on the daemon's trio thread, no lock needed between awaits):

  * `inodes.present` (index) and `_bitmaps` (its in-memory copy per file being restored): which
    chunks of an incomplete cache file hold verified data. A bit is set only after the chunk's
    bytes are in the file (`FileCache.fill` returned); the row is written after the bits.
  * `_inflight`: (ino, chunk) -> event, at most one fetch or check of a chunk at a time; other
    readers wait for the event and re-check (the fetch may have failed).
  * `_partial` and `_reserved`: --cache-size accounting. Bytes restored into files not yet
    complete count in `core.cached_bytes` (a complete file counts its size instead, through
    `core.fetched`); `_partial` says how many per file, so they leave `cached_bytes` with the
    file's cache state (`forget`). `_reserved`: bytes of chunk GETs in flight; room is made
    for a chunk before its GET.
  * `_objs`, `_verified`, `clean`: per-file caches of the stored object, the chunks checked in
    this run, and the files that need no check any more (the read hot path tests `clean`).
    All are dropped with the file's cache state (`forget`): evicted, rewritten, fetched whole,
    deleted.

Peers (--peers): `fetch` and `_fetch_run` ask `peers` (cachemgr.peer.client.PeerClient, which
verifies every chunk against its CRC32C) before the store; what they return goes through the same
`_store_chunks` fill as store bytes. `serve_chunk` is the peer server's source
(cachemgr.peer.server): it reads a chunk of a file held verified (cached whole with its
current content's object, or its bit in `present`), checks it, and hands it out; `_by_key` (object
key -> ino, re-checked on each use) and `_not_here` (keys no file has, for NOT_HERE_S) spare it a
scan of the inode table per request; both bounded, trio thread only.

Cache files are written only through `cachemgr.core.filecache.FileCache` (`fill`: in a worker
thread, under the file's lock, after `still_valid()` said the file's content is still the one
the chunks belong to), and read there for checks (`read`). The one other touch is dropping the
chunks of an incomplete file nobody uses (`drop_partials`: truncate to 0 on the event loop),
skipped while FileCache holds the file (`busy`).

Crash states: a fill interrupted by a crash leaves bytes no bit records: fetched again. Bits
recorded in `inodes.present` survive a crash: a restore resumes where it stopped. A file whose
every chunk is in is marked cached (`core.fetched`, which clears `present`) in one transaction.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import trio

from cachemgr.core.errors import FsError
from cachemgr.format.objects import StoredObject, chunk_count, chunk_span, verify_chunk
from cachemgr.peer.client import PeerClient
from cachemgr.store import IntegrityError, ObjectStore, StoreError
from cachemgr.transfer.download import download_chunk, download_chunks

if TYPE_CHECKING:
    from pathlib import Path

    from cachemgr.core.filecache import FileCache
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.core.rawtree import Residency

log = logging.getLogger(__name__)

FETCH_ATTEMPTS = 3
# A peer's request for an object this node does not hold is answered 404 without a look-up for
# this long: each look-up scans the inode table (Index.inos_of_object); a file restored here
# meanwhile is served once it passes.
NOT_HERE_S = 10.0

# make_room(need, protect): evict until `need` more bytes fit under --cache-size, never a file
# of `protect`; True if they fit (Engine.make_room).
MakeRoom = Callable[[int, set[int]], bool]


@dataclass(frozen=True, slots=True)
class ChunkStats:
    """`ChunkFetcher.statistics()`: chunk fetches (`dataclasses.asdict` for JSON)."""

    bytes_fetched: int            # from the store
    chunks_fetched: int
    peer_bytes: int               # from peers (cachemgr.peer.client), verified alike
    peer_chunks: int
    gets: int
    in_flight_chunks: int
    integrity_errors: int
    damaged_cache_chunks: int
    partial_files: int
    partial_bytes: int


class ChunkFetcher:
    """Chunks from the store into cache files; see the module docstring."""

    def __init__(self, *, table: InodeTable, files: FileCache, residency: Residency,
                 cache_dir: Path, index: Index, store: ObjectStore, cache_size: int | None,
                 make_room: MakeRoom, peers: PeerClient | None = None) -> None:
        """`make_room`: the --cache-size policy (evicts, then calls `drop_partials`). Dropped
        chunks free room through `FileCache.chunks_out`, which tells writers waiting for it.
        `peers` (--peers): asked for a chunk before the store."""
        self.table = table
        self.files = files
        self.residency = residency
        self.cache_dir = cache_dir  # measured for the disk's room (disk_room, data_may_take)
        self.index = index
        self.store = store
        self.cache_size = cache_size
        self._make_room = make_room
        self.peers = peers
        self._by_key: dict[str, int] = {}  # object key -> ino (serve_chunk), checked on use
        self._not_here: dict[str, float] = {}  # object key -> until when it is a 404 unasked
        self._bitmaps: dict[int, bytearray] = {}
        self._inflight: dict[tuple[int, int], trio.Event] = {}
        self._objs: dict[int, tuple[int, StoredObject | None]] = {}  # ino -> (version, obj)
        self._verified: dict[int, set[int]] = {}
        # Files needing no more checks this run (all chunks verified, or nothing to verify
        # against): the read hot path tests membership only.
        self.clean: set[int] = set()
        self.partial: dict[int, int] = {}  # ino -> bytes restored into its incomplete file
        self._reserved = 0
        self._warned_full = False
        # statistics
        self.bytes_fetched = 0
        self.chunks_fetched = 0
        self.gets = 0                 # GET requests that returned data
        self.peer_bytes = 0
        self.peer_chunks = 0
        self.integrity_errors = 0
        self.damaged_chunks = 0

    # -- objects and bitmaps -----------------------------------------------------------------

    def obj_of(self, ino: int) -> StoredObject | None:
        """The uploaded object of `ino`'s current content, or None."""
        node = self.table.get(ino)
        hit = self._objs.get(ino)
        if hit is not None and hit[0] == node.version:
            return hit[1]
        row = self.index.inode_fields(ino, "obj", "obj_version")
        obj = None
        if row is not None and row[0] is not None and row[1] == node.version:
            obj = StoredObject.from_json(row[0])
        self._objs[ino] = (node.version, obj)
        return obj

    def _bitmap(self, ino: int, n: int) -> bytearray:
        bm = self._bitmaps.get(ino)
        if bm is None:
            row = self.index.inode_fields(ino, "present")
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
        freed = self.partial.pop(ino, 0)
        if freed:
            self.files.chunks_out(freed)
        self._bitmaps.pop(ino, None)
        self._verified.pop(ino, None)
        self._objs.pop(ino, None)
        self.clean.discard(ino)

    def trusted(self, ino: int) -> bool:
        """The cache file of `ino` may be read without this daemon checking each chunk (FUSE
        passthrough: the kernel reads it directly): it was written or checked in this run, or
        there is nothing to check it against."""
        if ino in self.clean:
            return True
        obj = self.obj_of(ino)
        return obj is None or obj.chunk_crcs is None

    # -- bringing chunks in --------------------------------------------------------------------

    async def ensure_chunk(self, ino: int, obj: StoredObject, i: int,
                           limiter: trio.CapacityLimiter | None = None,
                           protect: set[int] | None = None) -> bool:
        """Bring chunk `i` in. `protect` (a prefetch: the inos of its set) makes it give up
        and return False when --cache-size has no room for the chunk without evicting them;
        a read always proceeds (over the limit if nothing can be evicted)."""
        n = chunk_count(obj)
        while True:
            node = self.table.get(ino)
            if node.cached or self.obj_of(ino) != obj:
                return True  # completed, or rewritten/evicted meanwhile: the caller re-checks
            if self._has(self._bitmap(ino, n), i):
                return True
            ev = self._inflight.get((ino, i))
            if ev is not None:
                await ev.wait()
                continue  # re-check: the other fetch may have failed
            length = chunk_span(obj, i)[1]
            if protect is None and not self.disk_room(length):
                # Keep the cache disk's reserve for the trainer's writes: the caller (a read)
                # is served from the store without caching (FuseOps.read).
                raise OSError(errno.ENOSPC, "the cache disk is at its reserve")
            if not self.room(length, {ino} | (protect or set())):
                if protect is not None:
                    return False
                if not self._warned_full:
                    self._warned_full = True
                    log.warning("cache full (%d of %d bytes, nothing evictable): reads of data "
                                "not in the cache go over --cache-size", self.files.cached_bytes,
                                self.cache_size)
            ev = self._inflight[(ino, i)] = trio.Event()
            self._reserved += length
            try:
                raw = await self.fetch(obj, i, limiter)
                await self._store_chunks(ino, obj, [(i, raw)], n)
            finally:
                self._reserved -= length
                del self._inflight[(ino, i)]
                ev.set()
            return True

    def _next_group(self, ino: int, first: int, last: int, n: int) -> list[int]:
        """The next contiguous group of chunks in [first, last] that are neither here nor
        being fetched."""
        bm = self._bitmap(ino, n)
        g: list[int] = []
        for i in range(first, last + 1):
            if not self._has(bm, i) and (ino, i) not in self._inflight:
                if g and g[-1] != i - 1:
                    break
                g.append(i)
            elif g:
                break
        return g

    async def ensure_run(self, ino: int, obj: StoredObject, first: int, last: int,
                         protect: set[int]) -> str | None:
        """Bring chunks [first, last] in for a prefetch. None when they are in (or the file
        changed meanwhile), else why the prefetch must stop (no room)."""
        n = chunk_count(obj)
        while True:
            # The next group is picked and registered with no await in between (a read may
            # have taken some of them while the previous group was in flight).
            node = self.table.get(ino)
            if node.cached or self.obj_of(ino) != obj:
                return None
            g = self._next_group(ino, first, last, n)
            if not g:
                break
            length = sum(chunk_span(obj, i)[1] for i in g)
            if not self.room(length, {ino} | protect):
                return f"the cache is full (--cache-size {self.cache_size} bytes)"
            if not self.disk_room(length):
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
            if not await self.ensure_chunk(ino, obj, i, protect=protect):
                return f"the cache is full (--cache-size {self.cache_size} bytes)"
        return None

    # -- room ----------------------------------------------------------------------------------

    def room(self, need: int, protect: set[int]) -> bool:
        """Make room under --cache-size for `need` more bytes (plus the chunks in flight):
        evict whole files (least recently used first), then chunks of incomplete files,
        never those of `protect`."""
        if self.cache_size is None:
            return True
        return self._make_room(need + self._reserved, protect)

    def drop_partials(self, need: int, protect: set[int] | frozenset[int]) -> bool:
        """Part of Engine.make_room: drop chunks restored into incomplete files (not open,
        not in `protect`) until `need` more bytes fit under --cache-size."""
        limit = self.cache_size
        if limit is None:
            return True
        for ino in list(self.partial):
            if self.files.cached_bytes + need <= limit:
                return True
            if ino not in protect:
                self._drop_partial(ino)
        return self.files.cached_bytes + need <= limit

    def _drop_partial(self, ino: int) -> bool:
        """Drop the chunks of an incomplete, unused file from the cache (they come back from
        the store when read)."""
        node = self.table.get(ino)
        if node.cached or node.opens or any(k[0] == ino for k in self._inflight) or \
                self.files.busy(ino):
            return False
        os.truncate(self.files.path(ino), 0)
        with self.index.tx():
            self.index.clear_present(ino)
        self.forget(ino)
        log.debug("dropped the restored chunks of inode %d", ino)
        return True

    def disk_room(self, need: int) -> bool:
        """Does a prefetch of `need` more bytes leave the cache disk its reserve? The reserve
        (5% of the disk, at most 256 MiB) keeps room for the trainer's next checkpoint writes
        and the index; a prefetch never takes it, reads by range still may."""
        try:
            st = os.statvfs(self.cache_dir)
        except OSError:
            return True
        free = st.f_bavail * st.f_frsize
        reserve = min(256 << 20, st.f_blocks * st.f_frsize // 20)
        return free - self._reserved - need >= reserve

    # -- the store -----------------------------------------------------------------------------

    async def fetch(self, obj: StoredObject, i: int,
                    limiter: trio.CapacityLimiter | None = None) -> bytes:
        """Chunk `i` of `obj`, verified; FsError(EIO) when the store fails (the store wrapper,
        RetryingStore, has already retried transient errors) or the chunk's bytes fail their
        check FETCH_ATTEMPTS times (only that is retried here: a re-read may be clean)."""
        raw = await self._from_peers(obj, i)
        if raw is not None:
            return raw
        last: Exception | None = None
        for _attempt in range(FETCH_ATTEMPTS):
            try:
                if limiter is None:
                    raw = await download_chunk(self.store, obj, i)
                else:
                    async with limiter:
                        raw = await download_chunk(self.store, obj, i)
                self.chunks_fetched += 1
                self.bytes_fetched += len(raw)
                self.gets += 1
                return raw
            except IntegrityError as e:
                last = e
                self.integrity_errors += 1
                log.warning("fetch of %s chunk %d failed: %s", obj.key, i, e)
            except StoreError as e:
                last = e
                break
        log.error("giving up on %s chunk %d: %s", obj.key, i, last)
        raise FsError(errno.EIO, f"cannot read {obj.key} chunk {i} from the store: {last}")

    async def _fetch_run(self, obj: StoredObject, first: int,
                         last: int) -> list[bytes | memoryview]:
        if first == last:
            return [await self.fetch(obj, first, None)]
        if self.peers is not None and obj.chunk_crcs is not None:
            got = [await self._from_peers(obj, i) for i in range(first, last + 1)]
            if any(r is not None for r in got):
                # what no peer had comes from the store, chunk by chunk (fetch asks the peers
                # again: a miss is remembered, so that costs no request)
                return [r if r is not None else await self.fetch(obj, first + k, None)
                        for k, r in enumerate(got)]
        last_err: Exception | None = None
        for _attempt in range(FETCH_ATTEMPTS):
            try:
                raws = await download_chunks(self.store, obj, first, last)
                self.chunks_fetched += len(raws)
                self.bytes_fetched += sum(len(r) for r in raws)
                self.gets += 1
                return raws
            except IntegrityError as e:  # a re-read may be clean; the wrapper retried the rest
                last_err = e
                self.integrity_errors += 1
                log.warning("fetch of %s chunks %d..%d failed: %s", obj.key, first, last, e)
            except StoreError as e:
                log.error("fetch of %s chunks %d..%d failed: %s", obj.key, first, last, e)
                raise FsError(errno.EIO, f"cannot read {obj.key} chunks {first}..{last} from "
                              f"the store: {e}") from e
        # Fall back to single chunks: one bad chunk must not fail its neighbours.
        log.info("fetching %s chunks %d..%d one by one after: %s", obj.key, first, last, last_err)
        return [await self.fetch(obj, i, None) for i in range(first, last + 1)]

    async def _from_peers(self, obj: StoredObject, i: int) -> bytes | None:
        """Chunk `i` of `obj` from a peer, verified against its CRC32C there (PeerClient), or
        None: no peers, nothing to verify against, or no peer had it."""
        if self.peers is None or obj.chunk_crcs is None:
            return None
        raw = await self.peers.fetch(obj, i)
        if raw is not None:
            self.peer_chunks += 1
            self.peer_bytes += len(raw)
        return raw

    # -- serving peers (cachemgr.peer.server) ----------------------------------------------

    def _ino_serving(self, key: str, crc: int) -> tuple[int, StoredObject] | None:
        """The file whose current content is the object `key` (with whole-content CRC `crc`)
        and that nobody writes, with its object; None if there is none. The last answer per
        key is kept (`_by_key`, checked on use); a key no file has is not looked up again for
        NOT_HERE_S (`_not_here`): a look-up scans the inode table."""
        hit = self._by_key.get(key)
        if hit is not None:
            found = self._serving_ino(hit, key, crc)
            if found is not False:
                return found
            del self._by_key[key]
        if self._not_here.get(key, 0.0) > time.monotonic():
            return None
        for ino in self.index.inos_of_object(key):
            found = self._serving_ino(ino, key, crc)
            if found is not False:
                if len(self._by_key) >= 4096:
                    self._by_key.clear()  # bounded; refilled by the next requests
                self._by_key[key] = ino
                return found
        if len(self._not_here) >= 4096:
            self._not_here.clear()  # bounded; the next requests scan again
        self._not_here[key] = time.monotonic() + NOT_HERE_S
        return None

    def _serving_ino(self, ino: int, key: str,
                     crc: int) -> tuple[int, StoredObject] | Literal[False] | None:
        """(ino, obj) if `ino`'s current content is object `key` with CRC `crc` and nobody
        writes it; None if it is that object but not servable now (a wrong CRC asked, being
        written); False if it is not that object's file."""
        try:
            node = self.table.get(ino)
        except FsError:
            return False
        # from the index, not `_objs`: a file written here gets its object when its upload
        # finishes, which nothing here is told of
        row = self.index.inode_fields(ino, "obj", "obj_version")
        if row is None or row[0] is None or row[1] != node.version:
            return False
        obj = StoredObject.from_json(row[0])
        if obj.key != key:
            return False
        if obj.crc32c != crc or obj.chunk_crcs is None or node.writers or node.nlink == 0:
            return None
        return ino, obj

    async def serve_chunk(self, key: str, crc: int, i: int) -> bytes | None:
        """Raw chunk `i` of object `key` for a peer, when this cache holds it verified: a
        cached file (whole) whose current content is that object, or a chunk an incomplete
        restore has in; read in a worker thread and checked against its CRC32C before it is
        handed out (a damaged cache file is never served). None: not held here (404). Never
        fetches from the store."""
        found = self._ino_serving(key, crc)
        if found is None:
            return None
        ino, obj = found
        n = chunk_count(obj)
        if not 0 <= i < n:
            return None
        node = self.table.get(ino)
        if not node.cached and not self._has(self._bitmap(ino, n), i):
            return None
        off, length = chunk_span(obj, i)

        def read_checked() -> bytes | None:
            with open(self.files.path(ino), "rb") as f:
                data = os.pread(f.fileno(), length, off)
            return data if verify_chunk(obj, i, data) else None

        try:
            return await trio.to_thread.run_sync(read_checked)
        except OSError as e:
            log.warning("peer request for %s chunk %d: cache file of inode %d: %s", key, i, ino, e)
            return None

    async def _store_chunks(self, ino: int, obj: StoredObject,
                            chunks: list[tuple[int, bytes | memoryview]], n: int) -> None:
        """Write verified chunks [(index, raw), ...] of `obj` into the cache file of `ino` (one
        worker thread, one open for all of them, under the file's lock: FileCache), then mark
        them present (one index update). Nothing is written if the file's content changed
        since the chunks were fetched."""
        def still_valid() -> bool:
            return not self.table.get(ino).cached and self.obj_of(ino) == obj

        if not self.index.data_may_take(self.cache_dir, sum(len(r) for _, r in chunks)):
            # the index reserve is released: what is left is for the index (Index.data_may_take)
            raise OSError(errno.ENOSPC, "the cache disk is full (what is left is kept for the "
                          "index)")
        wrote = await self.files.fill(
            ino, [(chunk_span(obj, i)[0], raw) for i, raw in chunks], size=obj.size,
            still_valid=still_valid)
        if not wrote:
            return
        node = self.table.get(ino)
        if node.cached or self.obj_of(ino) != obj:
            return
        bm = self._bitmap(ino, n)
        for i, raw in chunks:
            if not self._has(bm, i):
                self.partial[ino] = self.partial.get(ino, 0) + len(raw)
                self.files.chunks_in(len(raw))
            bm[i >> 3] |= 1 << (i & 7)
        if all(self._has(bm, j) for j in range(n)):
            # fetched() counts the size instead
            self.files.chunks_out(self.partial.pop(ino, 0), freed=False)
            self._bitmaps.pop(ino, None)
            self._verified[ino] = set(range(n))
            self.clean.add(ino)
            self.residency.fetched(ino, obj.size)
        else:
            with self.index.tx():
                self.index.set_present(ino, bytes(bm))

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
            node = self.table.get(ino)
            return node.version == version and bool(node.cached) and not node.writers and \
                node.nlink > 0

        data = await self.files.read(ino, c_off, c_len)
        if not unchanged():
            return False
        if not await trio.to_thread.run_sync(verify_chunk, obj, i, data):
            self.damaged_chunks += 1
            log.error("cache file of inode %d (%s) is damaged in chunk %d: fetching it again",
                      ino, obj.key, i)
            raw = await self.fetch(obj, i, None)
            # Written only if nobody opened the file for writing (or truncated it) since the
            # check: FileCache holds the file's lock across the check and the write.
            if not await self.files.fill(ino, [(c_off, raw)], size=None,
                                              still_valid=unchanged, sync=True):
                return False
        return True

    def statistics(self) -> ChunkStats:
        return ChunkStats(bytes_fetched=self.bytes_fetched, chunks_fetched=self.chunks_fetched,
                          peer_bytes=self.peer_bytes, peer_chunks=self.peer_chunks,
                          gets=self.gets, in_flight_chunks=len(self._inflight),
                          integrity_errors=self.integrity_errors,
                          damaged_cache_chunks=self.damaged_chunks, partial_files=len(self.partial),
                          partial_bytes=sum(self.partial.values()))
