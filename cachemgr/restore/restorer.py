"""Restore: sets that live in the store come back into the cache, by range and in parallel.

`Restorer` serves reads of files whose data is not (all) in the cache (`cached = 0`: restored
from the store, or evicted): a read waits only for the chunks it covers (one ranged GET each,
verified against the manifest's per-chunk CRC32C). It is the face the FUSE layer and tiering
call, over two parts:

  * `cachemgr.restore.chunkfetch.ChunkFetcher`: the chunk fetch-and-fill path (which chunks are in,
    one fetch per chunk in flight, --cache-size accounting of restored chunks, the checks of
    cached files against their CRC32C);
  * `cachemgr.restore.prefetch.Prefetcher`: the restore policy (`--prefetch`: set, file, reads,
  none,
    auto), prefetch jobs and read-ahead (docs/ARCHITECTURE.md "Restore policy").

Chunks already in the cache file are recorded in `inodes.present`, so a restore interrupted by a
crash resumes where it stopped. Restored chunks count against --cache-size: room is made before
each chunk's GET (whole files first, then chunks of incomplete files nobody has open); a prefetch
never evicts files of its own set and stops when nothing else can go; a read proceeds over the
limit when nothing can be evicted. A fully cached file whose content is in the store and that was
not written by this daemon (data at rest across a restart) has each chunk checked against its
CRC32C on its first read in this daemon's life; a damaged chunk is logged and fetched again. A
read the cache disk has no room for is served from the store without caching (`read_uncached`).

Sets published by other nodes appear in the namespace through `cachemgr.tiering.remote.RemoteSync`,
as evicted files whose data this module then serves.

State and guards: this class holds none of its own beyond its two parts and one warning flag;
see their module docstrings. Everything runs on the daemon's trio thread; chunk writes and
checks run in worker threads only inside `cachemgr.core.filecache.FileCache` (under the file's
lock).
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from cachemgr.core.errors import FsError
from cachemgr.format.objects import StoredObject, chunk_span
from cachemgr.peer.client import PeerClient
from cachemgr.restore.chunkfetch import ChunkFetcher, ChunkStats, MakeRoom
from cachemgr.restore.prefetch import FetchWhole, Job, LiveMembers, Prefetcher, PrefetchStats
from cachemgr.store import ObjectStore

if TYPE_CHECKING:
    from pathlib import Path

    from cachemgr.core.filecache import FileCache
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.core.rawtree import Residency
    from cachemgr.core.sets import SetRegistry

log = logging.getLogger(__name__)

__all__ = ["Restorer"]


@dataclass(frozen=True, slots=True)
class RestoreStats:
    """`Restorer.statistics()`: its chunk fetcher's and its prefetcher's."""

    chunks: ChunkStats
    prefetch: PrefetchStats


class Restorer:
    """Reads of data not in the cache, and what comes in ahead of them; see the docstring."""

    def __init__(self, *, table: InodeTable, files: FileCache, residency: Residency,
                 cache_dir: Path, index: Index, sets: SetRegistry, store: ObjectStore,
                 cache_size: int | None, make_room: MakeRoom, fetch_whole: FetchWhole,
                 live_members: LiveMembers, peers: PeerClient | None = None,
                 concurrency: int = 8,
                 range_size: int = 64 << 20, mode: str = "auto") -> None:
        """`make_room(need, protect)`: the --cache-size policy (Engine.make_room).
        `fetch_whole(ino)`: download an object stored without chunk checksums whole (Engine.fetch).
        `live_members()`: the other live nodes (Members.live), for policy auto."""
        self.table = table
        self.residency = residency
        self.chunks = ChunkFetcher(table=table, files=files, residency=residency,
                                   cache_dir=cache_dir, index=index, store=store,
                                   cache_size=cache_size, make_room=make_room, peers=peers)
        self.prefetch = Prefetcher(chunks=self.chunks, table=table, index=index, sets=sets,
                                   fetch_whole=fetch_whole, live_members=live_members,
                                   mode=mode, concurrency=concurrency, range_size=range_size)
        self._fetch_whole = fetch_whole
        self.mode = mode
        self._warned_disk = False
        self._peers = peers

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with trio.open_nursery() as nursery:
            if self._peers is not None:  # its list of live peers, refreshed in the background
                nursery.start_soon(self._peers.run)
            await nursery.start(self.prefetch.run)
            task_status.started()

    # -- what tiering and the FUSE layer call ------------------------------------------------

    @property
    def clean(self) -> set[int]:
        """Files needing no more checks this run (the read hot path tests membership)."""
        return self.chunks.clean

    def obj_of(self, ino: int) -> StoredObject | None:
        """The uploaded object of `ino`'s current content, or None."""
        return self.chunks.obj_of(ino)

    def forget(self, ino: int) -> None:
        """The file's cache state changed behind us (evicted, rewritten, fetched, deleted)."""
        self.chunks.forget(ino)
        self.prefetch.forget(ino)

    def trusted(self, ino: int) -> bool:
        """The cache file of `ino` may be read without this daemon checking each chunk (FUSE
        passthrough: the kernel reads it directly)."""
        return self.chunks.trusted(ino)

    def drop_partials(self, need: int, protect: set[int] | frozenset[int]) -> bool:
        """Part of Engine.make_room (ChunkFetcher.drop_partials)."""
        return self.chunks.drop_partials(need, protect)

    def on_open(self, ino: int) -> None:
        """A file is being opened for reading: start what the restore policy fetches."""
        self.prefetch.on_open(ino)

    def prefetch_path(self, path: str) -> Job:
        """`ckptfs prefetch PATH`: the set holding PATH, or every file under PATH."""
        return self.prefetch.prefetch_path(path)

    async def verify_cached(self, ino: int, off: int, size: int) -> None:
        """First reads of a cached file whose content is in the store: checked, repaired."""
        await self.chunks.verify_cached(ino, off, size)

    # -- reads of files not (all) in the cache -----------------------------------------------

    async def ensure_range(self, ino: int, off: int, size: int, *, read: bool = False) -> None:
        """Return once bytes [off, off+size) of `ino` are in its cache file. `read`: a reader's
        read (FuseOps.read), which may start a read-ahead (Prefetcher.on_read)."""
        node = self.table.get(ino)
        if node.cached:
            return
        obj = self.chunks.obj_of(ino)
        if obj is None:
            raise FsError(errno.EIO, f"inode {ino} is not cached and has no object in the store")
        if obj.chunk_crcs is None:
            await self._fetch_whole(ino)  # an object without chunk checksums: whole download
            return
        if obj.size == 0:
            self.residency.fetched(ino, 0)  # nothing to fetch: the empty cache file is the file
            return
        end = min(off + size, obj.size)
        if end <= off:
            return
        cs = obj.chunk_size
        if read:
            self.prefetch.on_read(ino, obj, off, end)
        for i in range(off // cs, (end - 1) // cs + 1):
            await self.chunks.ensure_chunk(ino, obj, i)

    async def ensure_all(self, ino: int) -> None:
        node = self.table.get(ino)
        if not node.cached:
            await self.ensure_range(ino, 0, max(node.size, 1))

    async def read_uncached(self, ino: int, off: int, size: int) -> bytes:
        """Bytes [off, off+size) of `ino` straight from the store (each chunk verified), not
        stored in the cache: a read of a file the cache disk has no room for."""
        obj = self.chunks.obj_of(ino)
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
            raw = await self.chunks.fetch(obj, i, None)
            c_off = chunk_span(obj, i)[0]
            out.append(bytes(memoryview(raw)[max(0, off - c_off):end - c_off]))
        return b"".join(out)

    # -- statistics --------------------------------------------------------------------------

    def statistics(self) -> RestoreStats:
        return RestoreStats(chunks=self.chunks.statistics(), prefetch=self.prefetch.statistics())
