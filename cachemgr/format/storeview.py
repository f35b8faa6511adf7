"""The store view of ckptfs's mount-less tools (`ckptfs ls`, `restore`, `fsck`): the blocking
face (cachemgr.format.views `StoreView`, `Reader`) of an async cachemgr.store `ObjectStore`,
so the tools read the store through the layer the mount reads it through (the same backends,
`RetryingStore`'s retries, S3Store's per-class deadlines) and decode what they read with the
one decoder (cachemgr.format.storeread over cachemgr.format.decode).

Threads and state
    `StoreLoop` runs one trio loop on a thread of its own for the life of a tool command; any
    other thread (the command's, the worker threads of cachemgr.format.resumable) calls into it
    with `call` (trio.from_thread) and blocks until the store answers, so the calling thread
    keeps Ctrl-C and the progress display. The store's own bounds apply unchanged (S3Store's
    `max_connections` caps the requests in flight, LocalStore's `threads` its worker threads),
    whatever the number of calling threads. A view holds no state but the store and the loop:
    safe from any thread.

Errors and bounds
    Every failure of the store is a cachemgr.format.readerrors `StoreError` (the tools' "store
    unusable"), an absent key is None (`get`, `head`, `open`), a document bigger than the
    `max_bytes` asked is a `CorruptError` after reading at most `max_bytes + 1` bytes of it, and
    a ranged read that comes back short (the object shrank or was replaced) is a
    `CorruptError`. scripts/ckpt_restore.py does not use this module (no trio there): it reads
    the store through its own minimal views, the format's independent reference reader.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from cachemgr.format import readerrors
from cachemgr.store.base import NotFound, ObjectInfo, ObjectStore
from cachemgr.store.base import StoreError as Unusable

T = TypeVar("T")


class StoreLoop:
    """A trio loop on a thread of its own (daemon: a stuck store call never keeps the process
    alive past its command); any thread may call into it. `close` ends it."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._done: trio.Event | None = None  # set to end the loop
        self._thread = threading.Thread(target=trio.run, args=(self._main,),
                                        name="ckptfs-store", daemon=True)
        self._thread.start()
        self._ready.wait()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        self._ready.set()
        await self._done.wait()

    def call(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """afn(*args) run on the loop; its result or its exception, in the calling thread."""
        return trio.from_thread.run(afn, *args, trio_token=self._token)

    def close(self) -> None:
        if self._thread.is_alive() and self._done is not None:
            try:
                trio.from_thread.run_sync(self._done.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
            self._thread.join()


class ObjectReader:
    """An object of the store read by ranges (views.Reader); holds no descriptor (the store
    opens per read), so any number may stay open."""

    def __init__(self, view: ObjectStoreView, key: str, size: int) -> None:
        self.view, self.key, self.size = view, key, size

    def read(self, offset: int, n: int) -> bytes:
        """Exactly bytes [offset, offset+n) of the object: one ranged GET (retried by the
        store's wrapper), CorruptError if fewer come back."""
        if n <= 0:
            return b""
        data = self.view.call(self.view.store.get, self.key, offset, n)
        if len(data) != n:
            raise readerrors.CorruptError(f"{self.key}: {len(data)} bytes at {offset}, expected "
                                          f"{n} (the object is shorter than it was)")
        return data

    def close(self) -> None:
        pass


class ObjectStoreView:
    """views.StoreView (listing, get, open) over an ObjectStore run on `loop`, plus what fsck
    needs (`infos` with etag and mtime, `head`, `delete`). `url` names the store in errors."""

    def __init__(self, loop: StoreLoop, store: ObjectStore, url: str) -> None:
        self.loop, self.store, self.url = loop, store, url

    def call(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """afn(*args) on the loop; NotFound passes through (the callers make it None), every
        other failure becomes readerrors.StoreError (one line)."""
        try:
            return self.loop.call(afn, *args)
        except NotFound:
            raise
        except Unusable as e:
            raise readerrors.StoreError(f"object store {self.url}: {e}") from None
        except readerrors.RestoreError:
            raise
        except Exception as e:  # noqa: BLE001 - botocore credential/config errors, a stopped loop
            raise readerrors.StoreError(f"object store {self.url}: {type(e).__name__}: "
                                        f"{e}") from None

    def infos(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key (the store's listing)."""
        return self.call(self.store.list, prefix)

    def listing(self, prefix: str) -> list[tuple[str, int]]:
        return [(i.key, i.size) for i in self.infos(prefix)]

    def get(self, key: str, max_bytes: int | None = None) -> bytes | None:
        """The whole object (a document), None if absent; never more than max_bytes + 1 bytes
        read: CorruptError past max_bytes."""
        try:
            data = self.call(self.store.get, key, 0,
                             None if max_bytes is None else max_bytes + 1)
        except NotFound:
            return None
        if max_bytes is not None and len(data) > max_bytes:
            raise readerrors.CorruptError(f"{key} is more than {max_bytes} bytes")
        return data

    def head(self, key: str) -> ObjectInfo | None:
        try:
            return self.call(self.store.head, key)
        except NotFound:
            return None

    def open(self, key: str) -> ObjectReader | None:
        info = self.head(key)
        return None if info is None else ObjectReader(self, key, info.size)

    def delete(self, key: str) -> None:
        self.call(self.store.delete, key)
