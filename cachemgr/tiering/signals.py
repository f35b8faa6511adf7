"""The wake-ups the tiering services send each other, and the store's health record.

`Signals` is one small object shared by the tiering services (cachemgr.tiering.commit, .uploadqueue,
.publish, .gather, .space, .progress): a service that must tell another "there is work for you"
or "a set's state changed" sets an event here instead of holding a reference to the other
service. Three wake-ups, each with one kind of waiter:

  * `uploads`: the upload workers (cachemgr.tiering.uploadqueue) — a job was queued;
  * `ns`: the namespace worker (cachemgr.tiering.publish) — an event was queued in its FIFO, or a
    helper task is to be started;
  * `changed`: `wait` requests and writers waiting for room (cachemgr.tiering.progress, .space) — a
    set changed state, a file was closed or removed, the cache holds fewer bytes.

`changed_now()` is "a set's state changed": it wakes the `changed` waiters, then calls the
listeners registered with `on_set_changed` (the publisher: a set that left the live states may
release sets held back behind it in commit order).

Invariants: an event is replaced by a fresh one by its waiter (uploads, ns) or at once after
it is set (changed), so a wake-up set before a waiter looks is never lost: each waiter looks at
its own queue before it waits, and everything runs on the trio thread (no locks; no other
thread touches these objects). Nothing here is durable: after a crash every queue is rebuilt
from the index (cachemgr.tiering.commit `recover`), and the wake-ups with it.

`StoreHealth` is the one record of the store's health (`last_error`, `consecutive_failures`):
written by the upload workers, the namespace worker, GC, the part records publisher and the
service supervisor; read by status and metrics. Trio thread only; in memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import trio


class Signals:
    """Wake-ups between the tiering services (trio thread only)."""

    def __init__(self) -> None:
        self._uploads = trio.Event()
        self._ns = trio.Event()
        self._changed = trio.Event()
        self._listeners: list[Callable[[], None]] = []

    # -- senders -----------------------------------------------------------------------------

    def poke(self) -> None:
        """Wake the upload workers and the namespace worker."""
        self._uploads.set()
        self._ns.set()

    def wake_uploads(self) -> None:
        self._uploads.set()

    def wake_ns(self) -> None:
        self._ns.set()

    def wake_waiters(self) -> None:
        """Wake `wait` requests and writers waiting for room (a file closed or removed, space
        freed), without the namespace work of `changed_now`."""
        self._changed.set()
        self._changed = trio.Event()

    def changed_now(self) -> None:
        """A set's state changed (or may have): wake the waiters, tell the listeners."""
        self.wake_waiters()
        for fn in self._listeners:
            fn()

    def on_set_changed(self, fn: Callable[[], None]) -> None:
        """Call `fn` at each `changed_now` (synchronously, on the trio thread)."""
        self._listeners.append(fn)

    # -- waiters -----------------------------------------------------------------------------

    async def wait_uploads(self) -> None:
        """For the upload workers, after they found their queue empty."""
        if self._uploads.is_set():
            self._uploads = trio.Event()
        await self._uploads.wait()

    async def wait_ns(self) -> None:
        """For the namespace worker, after it found its FIFO empty."""
        self._ns = trio.Event()
        await self._ns.wait()

    async def wait_changed(self) -> None:
        """Until the next `wake_waiters` / `changed_now`."""
        await self._changed.wait()


@dataclass(frozen=True, slots=True)
class HealthStats:
    """`StoreHealth.statistics()`: the store's health (`dataclasses.asdict` for JSON)."""

    health: str
    last_error: str | None
    consecutive_failures: int


class StoreHealth:
    """The store's health as the services see it (trio thread only)."""

    def __init__(self) -> None:
        self.last_error: str | None = None
        self.consecutive_failures = 0

    def failed(self, what: str) -> None:
        """A store operation failed (`what`: what and why, for status)."""
        self.consecutive_failures += 1
        self.error(what)

    def error(self, what: str) -> None:
        """Record `what` as the last error without counting a failure."""
        self.last_error = f"{time.strftime('%H:%M:%S')} {what}"

    def record(self, text: str) -> None:
        """Record `text`, already stamped with its time by the caller, as the last error
        (cachemgr.tiering.parts reports the part records it could not write)."""
        self.last_error = text

    def succeeded(self) -> None:
        self.consecutive_failures = 0

    def health(self) -> str:
        if self.consecutive_failures == 0:
            return "normal"
        return "unstable" if self.consecutive_failures < 5 else "down"

    def statistics(self) -> HealthStats:
        return HealthStats(health=self.health(), last_error=self.last_error,
                           consecutive_failures=self.consecutive_failures)
