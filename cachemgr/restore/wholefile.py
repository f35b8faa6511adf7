"""Read-through of evicted data: an evicted file's whole object back into its cache file.

The other side of eviction (cachemgr.tiering.space): `WholeFileFetcher.fetch(ino)` downloads the
object that holds a file's current content (`transfer.download_file`, every chunk checked) into
its cache file, after waiting for room under --cache-size, and records it cached in the core.
Partial, by-range restores of sets from other nodes are cachemgr.restore.restorer's.

State: `_fetches` (ino -> the event the callers of one download share), trio thread only, in
memory. Invariants: at most one download per file at a time; the download fills the cache
file under the file's exclusive lock (cachemgr.core.filecache), so no write or truncating open
lands in it meanwhile; a file rewritten while the fetch waited for room is not fetched.
Crash states: a download cut short leaves the file evicted in the index (`cached = 0`, set
only by `core.fetched` after the download); the partial cache file is overwritten by the next
fetch.
"""

from __future__ import annotations

import errno
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from cachemgr.core.errors import FsError
from cachemgr.format.objects import StoredObject
from cachemgr.store import IntegrityError, ObjectStore, StoreError
from cachemgr.transfer.download import download_file

if TYPE_CHECKING:
    from cachemgr.core.filecache import FileCache
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.core.rawtree import Residency

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FetchStats:
    """`WholeFileFetcher.statistics()`: whole-file downloads (`dataclasses.asdict` for JSON)."""

    in_flight: int
    fetched: int


class WholeFileFetcher:
    """Whole-object downloads of evicted files (see the module docstring)."""

    def __init__(self, *, table: InodeTable, files: FileCache, residency: Residency, index: Index,
                 store: ObjectStore,
                 wait_for_room: Callable[[int], Awaitable[None]],
                 obj_of: Callable[[int], StoredObject | None],
                 forget: Callable[[int], None]) -> None:
        self.table = table
        self.files = files
        self.residency = residency
        self.index = index
        self.store = store
        self._wait_for_room = wait_for_room  # cachemgr.tiering.space
        self._obj_of = obj_of                # restore.restorer: the object of a file's content
        self._forget = forget                # cachemgr.restore.restorer: the file is whole again
        self._fetches: dict[int, trio.Event] = {}
        self.fetched = 0

    async def fetch(self, ino: int) -> None:
        """Bring an evicted file's data back into its cache file (concurrent callers share one
        download)."""
        ev = self._fetches.get(ino)
        if ev is not None:
            await ev.wait()
            return
        ev = self._fetches[ino] = trio.Event()
        try:
            row = self.index.inode_fields(ino, "obj", "obj_version", "version", "cached")
            if row is None or row[3] == 1:
                return
            if row[0] is None or row[1] != row[2]:
                raise FsError(errno.EIO, f"inode {ino} is evicted but has no object")
            obj = StoredObject.from_json(json.loads(row[0]))
            await self._wait_for_room(obj.size)
            # Under the file's lock (cachemgr.core.filecache): no write or truncating open lands in
            # the cache file while the download fills it.
            async with self.files.exclusive(ino):
                node = self.table.get(ino)
                if node.cached or self._obj_of(ino) != obj:
                    return  # rewritten (O_TRUNC) while we waited for room
                await self._download(ino, obj)
                self.residency.fetched(ino, obj.size)
            self.fetched += 1
            self._forget(ino)
        finally:
            ev.set()
            del self._fetches[ino]

    async def _download(self, ino: int, obj: StoredObject) -> None:
        last: Exception | None = None
        for _attempt in range(3):
            try:
                await download_file(self.store, obj, self.files.path(ino))
                return
            except IntegrityError as e:  # the bytes failed their check: fetch again
                last = e
                log.warning("fetch of inode %d (%s) failed: %s", ino, obj.key, e)
            except StoreError as e:  # the store wrapper (RetryingStore) retried it already
                last = e
                break
        raise FsError(errno.EIO, f"cannot fetch {obj.key} from the store: {last}")

    def statistics(self) -> FetchStats:
        return FetchStats(in_flight=len(self._fetches), fetched=self.fetched)
