"""The in-process harnesses of the unit tests (tests/unit), no FUSE and no daemon:

  * `Node`: a cache directory opened as the daemon opens it (Cache.open, Engine(cache, store,
    cfg), then CacheFs over both), its services run in one trio loop with others on one store
    (`run_nodes`), a test polling a condition (`until`), never sleeping to wait; `Recorder`,
    the LocalStore with a log of its writes (key, in order) and gates that hold the PUTs of
    chosen keys, so that a test decides the interleaving (tests/unit/test_services_inproc.py,
    test_amend.py, test_manifest_writer.py, test_scale.py, test_scale_inproc.py).
  * `Harness`: a real `CacheFs`, a real `SetRegistry` on its index and a real `LocalStore`, and
    a RemoteSync built on them as `cachemgr.engine.Engine` builds it, with `StandIn` giving the
    interfaces the Engine gives (tests/unit/test_remote_inproc.py, test_scale_inproc.py).
  * `memory_matches_index`: every in-memory inode equals its index row, and `cached_bytes` is
    what the cache files hold (tests/unit/test_diskfull.py, test_remote_inproc.py).
"""

from __future__ import annotations

import functools
import json
import os
import stat
import time
from pathlib import Path

import trio

from cachemgr.core.cache import Cache
from cachemgr.core.fs import CacheFs
from cachemgr.core.hooks import NO_HOOKS, NO_KERNEL, NO_LIMIT
from cachemgr.core.index import INODE_COLUMNS, ROOT_INO
from cachemgr.core.sets import SetRegistry
from cachemgr.engine import Engine, EngineConfig
from cachemgr.format import manifest as mf
from cachemgr.format.keys import manifest_key
from cachemgr.format.objects import StoredObject
from cachemgr.host.foreground import Foreground
from cachemgr.restore.restorer import Restorer
from cachemgr.store import (
    LocalStore,
    StoreError,
    TransientStoreError,
    crc32c,
)
from cachemgr.tiering.remote import RemoteSync
from cachemgr.transfer.upload import TransferConfig

# ----------------------------------------------------------------------------------------------
# Node: nodes of services on one store, in one trio loop (tests/unit/test_services_inproc.py)

O_W = os.O_WRONLY | os.O_CREAT
CHUNK = 4096
TIMEOUT = 30.0


class Recorder(LocalStore):
    """A LocalStore that logs every write and read (("put"|"delete"|"get", key), in order) and
    holds the PUTs and GETs of keys that start with a gated prefix until the test opens the
    gate."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.log: list[tuple[str, str]] = []
        self.gates: dict[str, trio.Event] = {}
        self.held: set[str] = set()
        self.refused: set[str] = set()  # PUTs of keys with these prefixes are refused for good
        self.flaky: dict[str, int] = {}  # prefix -> how many more PUTs of it fail (503)
        self.shield = False  # PUTs ignore their caller's cancellation (see put)
        # the replies of DELETEs of these prefixes wait (the DELETE itself is done)
        self.delete_gates: dict[str, trio.Event] = {}
        self.deletes_held: set[str] = set()

    def gate(self, prefix: str) -> trio.Event:
        ev = self.gates[prefix] = trio.Event()
        return ev

    async def _hold(self, key: str) -> None:
        for prefix, ev in self.gates.items():
            if key.startswith(prefix) and not ev.is_set():
                self.held.add(key)
                try:
                    await ev.wait()
                finally:
                    self.held.discard(key)

    async def put(self, key, data, **kw):
        # shielded (`shield`): like a boto3 call in a worker thread, a request runs to its end
        # even if its caller is cancelled meanwhile
        with trio.CancelScope(shield=self.shield):
            await self._hold(key)
            if any(key.startswith(p) for p in self.refused):
                raise StoreError(f"AccessDenied: Access Denied ({key})", key=key)  # for good
            for p, n in self.flaky.items():
                if key.startswith(p) and n > 0:
                    self.flaky[p] = n - 1
                    raise TransientStoreError(f"503 SlowDown ({key})", key=key)
            out = await super().put(key, data, **kw)
            self.log.append(("put", key))
        return out

    async def publish_staged(self, staged):
        # a whole cache file copied in (file://): its object appears here, as at a put
        with trio.CancelScope(shield=self.shield):
            await self._hold(staged.key)
            if any(staged.key.startswith(p) for p in self.refused):
                raise StoreError(f"AccessDenied: Access Denied ({staged.key})", key=staged.key)
            out = await super().publish_staged(staged)
            self.log.append(("put", staged.key))
        return out

    async def complete_multipart(self, key, upload_id, parts, crc32c):
        await self._hold(key)
        out = await super().complete_multipart(key, upload_id, parts, crc32c)
        self.log.append(("put", key))
        return out

    async def get(self, key, *args, **kw):
        await self._hold(key)
        out = await super().get(key, *args, **kw)
        self.log.append(("get", key))
        return out

    async def delete(self, key):
        await super().delete(key)
        self.log.append(("delete", key))
        for prefix, ev in self.delete_gates.items():
            if key.startswith(prefix) and not ev.is_set():
                self.deletes_held.add(key)
                try:
                    await ev.wait()
                finally:
                    self.deletes_held.discard(key)

    def puts(self, pred=lambda k: True) -> list[str]:
        return [k for op, k in self.log if op == "put" and pred(k)]


def config(**kw) -> EngineConfig:
    """4 KiB chunks; the store listed, records polled and leases renewed every 50 ms."""
    base = {"transfer": TransferConfig(frame_size=CHUNK, compress="off"),
            "file_concurrency": 2, "retry_pause": 0.01, "prefetch": "none",
            "refresh_interval": 0.05, "gather_poll": 0.05, "register_timeout": 5.0,
            "lease": 30.0}
    base.update(kw)
    return EngineConfig(**base)


class Node:
    def __init__(self, cache_dir: Path, store: LocalStore, **cfg) -> None:
        self.store = store
        cache = Cache.open(cache_dir)
        self.t = Engine(cache, store, config(**cfg), foreground=Foreground(),
                         kernel=NO_KERNEL)
        self.core = CacheFs(cache, hooks=self.t.commits, reads=self.t.restorer,
                            room=self.t.space)
        self.sets = SetRegistry(self.core.index)

    def mkdir(self, path: str) -> int:
        parent, name = self.split(path)
        return self.core.mkdir(parent, name, 0o755, 0, 0).ino

    def split(self, path: str) -> tuple[int, bytes]:
        if "/" not in path:
            return ROOT_INO, path.encode()
        d, n = path.rsplit("/", 1)
        ino = self.core.index.resolve(d)
        assert ino is not None, d
        return ino, n.encode()

    def open_write(self, path: str) -> int:
        parent, name = self.split(path)
        ino = self.core.index.lookup(parent, name)
        if ino is None:
            return self.core.create(parent, name, 0o644, O_W, 0, 0)[0].fh
        return self.core.open(ino, os.O_WRONLY).fh

    def close(self, fh: int) -> None:
        self.core.flush(fh)
        self.core.release(fh)

    def write(self, path: str, data: bytes) -> None:
        fh = self.open_write(path)
        self.core.write(fh, 0, data)
        self.close(fh)

    def state(self, path: str) -> str | None:
        s = self.sets.newest_at(path)
        return None if s is None else s.state

    def quiet(self) -> bool:
        st = self.t.status()
        return (not self.sets.by_states(("committed", "uploading", "deleting"))
                and st["uploads"]["queued"] == 0 and st["uploads"]["running"] == 0
                and self.t.publisher.idle())


async def until(cond, what: str, timeout: float = TIMEOUT):
    """Poll `cond` (a condition, never a fixed pause) until it holds."""
    with trio.fail_after(timeout):
        while not (v := cond()):
            await trio.sleep(0.005)
    return v


def run_nodes(nodes: list[Node], body) -> None:
    """Run every node's tiering service and `body()` in one trio loop, then stop them."""
    async def main() -> None:
        async with trio.open_nursery() as n:
            for node in nodes:
                await n.start(node.t.run)
            await body()
            n.cancel_scope.cancel()
    trio.run(main)


def read_manifest(store: LocalStore, path: str) -> dict:
    raw = trio.run(store.get, manifest_key(path))
    return json.loads(raw)


# ----------------------------------------------------------------------------------------------
# Harness: a cache, a file:// store and a RemoteSync between them
# (tests/unit/test_remote_inproc.py)

OTHER = "0be1b2c3"  # the node that publishes the sets these tests restore


class _Parts:
    """cachemgr.tiering.parts.PartPublisher as RemoteSync uses it."""

    def __init__(self) -> None:
        self.marked = 0

    def mark_all(self) -> None:
        self.marked += 1


class StandIn:
    """The interfaces cachemgr.engine.Engine gives RemoteSync and the Restorer, and the
    core's hooks that the changes RemoteSync makes call (a purge, freed space), with a real Restorer
    behind them."""

    def __init__(self, cache: Cache, store: LocalStore) -> None:
        self.cache = cache
        self.index = cache.index
        self.store = store
        self.sets = SetRegistry(cache.index)
        self.node = cache.index.meta("node_id")
        self.parts = _Parts()
        self.changes = 0
        self.restorer = Restorer(table=cache.table, files=cache.files,
                                 residency=cache.residency, cache_dir=cache.cache_dir,
                                 index=cache.index, sets=self.sets, store=store,
                                 cache_size=None, make_room=self._make_room,
                                 fetch_whole=self._fetch,
                                 live_members=self._live, mode="none")
        # what the cache's owners tell, subscribed as the Engine subscribes its services
        cache.table.on_purged(self.on_purge)
        cache.files.on_space_freed(self.on_space_freed)

    def _make_room(self, need: int, protect: set[int]) -> bool:
        return True  # no --cache-size

    async def _fetch(self, ino: int) -> None:
        raise AssertionError("these tests store objects with chunk checksums")

    async def _live(self) -> dict[str, float]:
        return {}

    def _changed_now(self) -> None:
        self.changes += 1

    def on_purge(self, ino: int) -> None:
        self.restorer.forget(ino)

    def on_space_freed(self) -> None:
        self._changed_now()


class Harness:
    """A cache (CacheFs + SetRegistry), a file:// store and a RemoteSync between them."""

    def __init__(self, root: Path, store: LocalStore | None = None) -> None:
        self.root = root
        self.cache_dir = root / "cache"
        cache = Cache.open(self.cache_dir)
        self.store = store if store is not None else LocalStore(root / "store")
        self.t = StandIn(cache, self.store)
        self.core = CacheFs(cache, hooks=NO_HOOKS, reads=self.t.restorer, room=NO_LIMIT)
        self.sets = self.t.sets
        self.remote = RemoteSync(table=cache.table, tree=cache.tree, index=cache.index,
                                 sets=self.sets, store=self.store, kernel=NO_KERNEL,
                                 node=self.t.node, interval=0,
                                 mark_parts=self.t.parts.mark_all, changed=self.t._changed_now)
        self._objects = 0
        self._seq = 0

    # -- the store, as another node writes it ---------------------------------------------------

    def put(self, key: str, data: bytes):
        return trio.run(functools.partial(self.store.put, key, data))

    def delete(self, key: str) -> None:
        trio.run(self.store.delete, key)

    def obj(self, data: bytes, node: str = OTHER, chunk_size: int = 0) -> dict:
        """Put `data` as an object of `node`: its StoredObject JSON (uncompressed)."""
        self._objects += 1
        key = f"data/{node}/{self._objects}/1/f"
        self.put(key, data)
        crcs = None
        if chunk_size:
            crcs = [crc32c(data[i:i + chunk_size]) for i in range(0, len(data), chunk_size)]
        return StoredObject(key=key, size=len(data), stored_size=len(data), crc32c=crc32c(data),
                            chunk_size=chunk_size, chunk_crcs=crcs).to_json()

    def manifest(self, path: str, files: dict[str, bytes], *, dirs=(), links=None,
                 kind: str = "dir", target: str | None = None, node: str = OTHER,
                 modes: dict[str, int] | None = None, mode: int = 0o755,
                 chunk_size: int = 0) -> dict:
        """A manifest of `node` for the set at `path` (escaped form) holding `files` ({rel:
        bytes}, objects put now), `dirs` and `links` ({rel: target}); committed after every
        manifest this harness built before."""
        self._seq += 1
        fj = [{"path": rel, "size": len(data), "mode": (modes or {}).get(rel, 0o644),
               "mtime_ns": 1_000_000 + self._seq,
               "object": self.obj(data, node, chunk_size)} for rel, data in files.items()]
        layout: dict = {"dirs": [{"path": d, "mode": 0o755, "mtime_ns": 2_000_000}
                                 for d in dirs],
                        "symlinks": [{"path": r, "target": t}
                                     for r, t in (links or {}).items()],
                        "mode": mode}
        if kind == "symlink":
            layout["target"] = target
        return mf.build(path=path, kind=kind, seq=self._seq, node=node, reason="dcp",
                        committed_ns=time.time_ns() - 10**12 + self._seq, layout=layout,
                        files=fj)

    def publish(self, m: dict, key: str | None = None) -> str:
        """Put manifest `m` (at its own key unless `key`); returns its etag."""
        return self.put(key or mf.manifest_key(m["path"]), mf.dumps(m)).etag

    # -- this node --------------------------------------------------------------------------------

    def sync(self) -> None:
        trio.run(self.remote.sync_once)

    def close(self) -> None:
        self.core.close()


# ----------------------------------------------------------------------------------------------
# the core's memory against its index


def memory_matches_index(fs: CacheFs) -> list[str]:
    """Every in-memory inode equals its index row (a dirty file's size and times may be newer),
    and `cached_bytes` is what the cache files hold (their sizes less their holes)."""
    problems = []
    for node in fs.table.loaded():
        ino = node.ino
        row = fs.index.get_inode(ino)
        if row is None:
            problems.append(f"inode {ino} in memory, not in the index")
            continue
        for col, raw in zip(INODE_COLUMNS, row):
            value = bytes(raw) if col == "target" and raw is not None else raw
            if node.dirty and col in ("size", "mtime_ns", "ctime_ns"):
                continue
            if getattr(node, col) != value:
                problems.append(f"inode {ino} {col}: memory {getattr(node, col)!r} != index"
                                f" {value!r}")
    want = 0
    for ino, mode, row_size, cached in fs.index.conn.execute(
            "SELECT ino, mode, size, cached FROM inodes"):
        if stat.S_ISREG(mode) and cached:
            node = fs.cache.table.if_loaded(ino)
            size = node.size if node is not None else row_size
            # --cache-size counts blocks: a hole a file was grown over does not count.
            hole = fs.files.hole(ino)
            if not 0 <= hole <= size:
                problems.append(f"inode {ino} hole {hole} outside its size {size}")
            want += size - hole
    if fs.files.cached_bytes != want:
        problems.append(f"cached_bytes {fs.files.cached_bytes} != {want}")
    return problems
