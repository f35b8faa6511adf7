"""Stores that wrap stores: retries with backoff, and read-only.

`RetryingStore` retries transient failures (throttling, 5xx, timeouts, resets, read-back
integrity mismatches) with exponential backoff and full jitter, up to `RetryPolicy.attempts`
tries per call (8 by default: at most 6.35 s of backoff), of which at most
`RetryPolicy.deadline_attempts` (2) may end at their deadline (`DeadlineExceeded`: the store did
not answer; asking a black hole eight times would only make the caller wait eight deadlines);
so a call's worst case is known per class of request (docs/ARCHITECTURE.md "Store deadlines").
It counts every retry in `statistics()`, which only the trio tasks calling it touch (one loop,
no lock).
`ReadOnlyStore` refuses every call that would change the store (a read-only mount's guarantee
that it never uploads, publishes or deletes, whatever a service tries).
"""

from __future__ import annotations

import builtins
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from cachemgr.store.base import (
    ConditionalWrites,
    DataClientStats,
    DeadlineExceeded,
    ObjectInfo,
    ObjectStore,
    Part,
    Pause,
    RangeCrcs,
    RetryStats,
    Staged,
    StoreError,
)

log = logging.getLogger(__name__)


@dataclass
class RetryPolicy:
    attempts: int = 8          # total tries per call
    # tries of one call that may end at their deadline (DeadlineExceeded): a store that did not
    # answer twice in a row is not asked again by this call; its caller (an upload worker, the
    # namespace worker, a listing) retries the work later and says so in status
    deadline_attempts: int = 2
    base_delay: float = 0.05   # first backoff ceiling, seconds
    max_delay: float = 5.0     # backoff ceiling cap
    # Full jitter (sleep uniform(0, ceiling)): AWS's recommendation for throttled clients, it
    # spreads retries of many uploaders instead of synchronising them.


class _Wrapper(ObjectStore):
    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.url = inner.url

    @property
    def supports_conditional_put(self) -> bool:
        return self.inner.supports_conditional_put

    @property
    def conditional(self) -> ConditionalWrites | None:
        return self.inner.conditional

    async def probe_conditional(self) -> ConditionalWrites:
        found: ConditionalWrites = await self._do("probe_conditional")
        return found

    async def _do(self, op: str, *args: Any, **kw: Any) -> Any:
        """Call `op` of the inner store (what each wrapper changes); the typed methods below
        give the result its type back."""
        return await getattr(self.inner, op)(*args, **kw)

    async def put(self, key: str, data: bytes | memoryview, *, if_none_match: bool = False,
                  if_match: str | None = None) -> ObjectInfo:
        info: ObjectInfo = await self._do("put", key, data, if_none_match=if_none_match,
                                          if_match=if_match)
        return info

    async def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        data: bytes = await self._do("get", key, start, length)
        return data

    async def head(self, key: str) -> ObjectInfo:
        info: ObjectInfo = await self._do("head", key)
        return info

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        infos: builtins.list[ObjectInfo] = await self._do("list", prefix)
        return infos

    async def delete(self, key: str) -> None:
        await self._do("delete", key)

    async def create_multipart(self, key: str) -> str:
        upload_id: str = await self._do("create_multipart", key)
        return upload_id

    async def upload_part(self, key: str, upload_id: str, number: int,
                          data: bytes | memoryview) -> Part:
        part: Part = await self._do("upload_part", key, upload_id, number, data)
        return part

    async def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[Part],
                                 crc32c: int) -> ObjectInfo:
        info: ObjectInfo = await self._do("complete_multipart", key, upload_id, parts, crc32c)
        return info

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._do("abort_multipart", key, upload_id)

    @property
    def stages_files(self) -> bool:
        return self.inner.stages_files

    async def stage_file(self, key: str, fd: int, size: int,
                         inspect: Callable[[memoryview], int],
                         pause: Callable[[], None] | None = None) -> Staged:
        staged: Staged = await self._do("stage_file", key, fd, size, inspect, pause)
        return staged

    async def stage_path(self, key: str, path: str, size: int,
                         inspect: Callable[[memoryview], int],
                         skip: Callable[[int], bool]) -> Staged | None:
        staged: Staged | None = await self._do("stage_path", key, path, size, inspect, skip)
        return staged

    async def publish_staged(self, staged: Staged) -> ObjectInfo:
        info: ObjectInfo = await self._do("publish_staged", staged)
        return info

    async def discard_staged(self, staged: Staged) -> None:
        await self._do("discard_staged", staged)

    @property
    def data_path(self) -> str:
        return self.inner.data_path

    def data_statistics(self) -> DataClientStats:
        return self.inner.data_statistics()

    def retry_statistics(self) -> RetryStats | None:
        return self.inner.retry_statistics()

    @property
    def sends_files(self) -> bool:
        return self.inner.sends_files

    @property
    def gets_files(self) -> bool:
        return self.inner.gets_files

    async def put_file(self, key: str, fd: int, size: int, crc32c: int,
                       ranges: RangeCrcs | None = None,
                       pause: Pause | None = None) -> ObjectInfo:
        info: ObjectInfo = await self._do("put_file", key, fd, size, crc32c, ranges, pause)
        return info

    async def get_file(self, key: str, fd: int, start: int, length: int) -> None:
        await self._do("get_file", key, fd, start, length)

    async def aclose(self) -> None:
        await self.inner.aclose()


class RetryingStore(_Wrapper):
    def __init__(self, inner: ObjectStore, policy: RetryPolicy | None = None,
                 rng: random.Random | None = None) -> None:
        super().__init__(inner)
        self.policy = policy or RetryPolicy()
        self._rng = rng or random.Random()
        self.stats = RetryStats()

    def statistics(self) -> RetryStats:
        return self.stats

    def retry_statistics(self) -> RetryStats:
        return self.stats

    async def _do(self, op: str, *args: Any, **kw: Any) -> Any:
        p = self.policy
        st = self.stats
        st.calls += 1
        st.by_op[op] = st.by_op.get(op, 0) + 1
        unanswered = 0
        for attempt in range(1, p.attempts + 1):
            try:
                return await getattr(self.inner, op)(*args, **kw)
            except Exception as e:
                unanswered += isinstance(e, DeadlineExceeded)
                if not getattr(e, "transient", False) or attempt == p.attempts or \
                        unanswered >= p.deadline_attempts:
                    if getattr(e, "transient", False):
                        self.stats.failures += 1
                        log.warning("%s failed after %d attempts: %s", op, attempt, e)
                    kind = (op, type(e).__name__)
                    st.errors[kind] = st.errors.get(kind, 0) + 1
                    raise
                name = type(e).__name__
                self.stats.retries += 1
                self.stats.by_error[name] = self.stats.by_error.get(name, 0) + 1
                ceiling = min(p.max_delay, p.base_delay * 2 ** (attempt - 1))
                delay = self._rng.uniform(0, ceiling)
                log.info("%s: %s; retry %d/%d in %.3fs", op, e, attempt, p.attempts - 1, delay)
                await trio.sleep(delay)
        raise AssertionError("unreachable")


class ReadOnlyStore(_Wrapper):
    """Reads pass; every call that writes, deletes or probes by writing raises StoreError (not
    transient: nothing retries it) and is counted in `refused` (trio thread only)."""

    # put_file is refused too (WRITES); get_file passes, as get does
    WRITES = frozenset({"put", "put_file", "delete", "create_multipart", "upload_part",
                        "complete_multipart", "abort_multipart", "stage_file", "stage_path",
                        "publish_staged", "discard_staged", "probe_conditional"})

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.refused: dict[str, int] = {}

    @property
    def stages_files(self) -> bool:
        return False

    async def _do(self, op: str, *args: Any, **kw: Any) -> Any:
        if op in self.WRITES:
            self.refused[op] = self.refused.get(op, 0) + 1
            log.error("read-only mount: refused %s %s", op, args[0] if args else "")
            raise StoreError(f"read-only mount: {op} refused", key=args[0] if args and
                             isinstance(args[0], str) else None)
        return await getattr(self.inner, op)(*args, **kw)
