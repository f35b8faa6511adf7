"""FaultyStore: an object store in between that fails or holds calls on purpose, for the tests.

    faulty = FaultyStore(store)                  # a real store below, never a mock
    faulty.fail_next("put", 2)                   # the next 2 puts: a transient 503 SlowDown
    faulty.fail_every("get", 4)                  # every 4th get: a transient 500 InternalError
    faulty.hold("put", "/tmp/gate", "data/")     # puts of data/... wait while /tmp/gate exists
    store = RetryingStore(faulty)                # below the retries, as a mount has it

Failures are deterministic (every k-th call of an operation, or the next n calls) so tests
provoke them on purpose; `calls` and `injected` count, by operation, what it saw and what it
failed. In-process tests build it themselves; a daemon gets it from CKPTFS_FAULTS
(tests/daemon_hooks/sitecustomize.py wraps `ckptfs.daemon.open_backend` with it). It subclasses
the store's own delegating base (`cachemgr.store.wrappers._Wrapper`, which RetryingStore and
ReadOnlyStore share, as tests/unit/test_transfer.py's wrappers do) so that every ObjectStore call,
and each one the interface gains, passes through `_do` without a copy of the interface here.
State: only the trio tasks calling it touch it (one loop, no lock).
"""

from __future__ import annotations

import logging
import os
from typing import Any, ClassVar

import trio

from cachemgr.store import ObjectStore, TransientStoreError
from cachemgr.store.wrappers import _Wrapper

log = logging.getLogger(__name__)


class FaultyStore(_Wrapper):
    """Injects failures: `fail_next(op, n, exc)` makes the next n calls of `op` raise `exc`
    (default: a transient 503 SlowDown) before reaching the inner store; `fail_every(op, k)`
    makes every k-th call fail."""

    @property
    def stages_files(self) -> bool:
        # Uploads through a fault-injecting store keep to put and the multipart calls, the
        # operations its rules name.
        return False

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._next: dict[str, list[Exception]] = {}
        self._every: dict[str, tuple[int, Exception]] = {}
        self._holds: dict[str, list[tuple[str, str]]] = {}
        self.calls: dict[str, int] = {}
        self.injected: dict[str, int] = {}

    def fail_next(self, op: str, n: int = 1, exc: Exception | None = None) -> None:
        exc = exc or TransientStoreError("injected 503 SlowDown")
        self._next.setdefault(op, []).extend([exc] * n)

    def fail_every(self, op: str, k: int, exc: Exception | None = None) -> None:
        self._every[op] = (k, exc or TransientStoreError("injected 500 InternalError"))

    # A whole-file PUT or GET of the native data path (cachemgr.store.crt) is the data PUT /
    # part upload, or the data GET, that a rule names: its rules apply to it too, so a test's
    # faults reach the store whichever client moves the bytes.
    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "put_file": ("put", "upload_part"), "get_file": ("get",)}

    def hold(self, op: str, gate: str, prefix: str = "") -> None:
        """Calls of `op` on keys starting with `prefix` wait while the file `gate` exists (a
        test opens the gate by deleting it): a store that is slow for one node, on demand."""
        self._holds.setdefault(op, []).append((prefix, gate))

    async def _do(self, op: str, *args: Any, **kw: Any) -> Any:
        names = (op, *self.ALIASES.get(op, ()))
        for name in names:
            for prefix, gate in self._holds.get(name, ()):
                key = args[0] if args else ""
                if isinstance(key, str) and key.startswith(prefix) and os.path.exists(gate):
                    log.info("holding %s %s until %s is removed", op, key, gate)
                    while os.path.exists(gate):
                        await trio.sleep(0.05)
        exc = None
        for name in names:
            n = self.calls[name] = self.calls.get(name, 0) + 1
            pending = self._next.get(name)
            if exc is not None:
                continue
            if pending:
                exc = pending.pop(0)
            elif name in self._every and n % self._every[name][0] == 0:
                exc = self._every[name][1]
        if exc is not None:
            self.injected[op] = self.injected.get(op, 0) + 1
            raise exc
        return await getattr(self.inner, op)(*args, **kw)
