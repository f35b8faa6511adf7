"""A fleet of in-process nodes on one store, with every request counted (issue 35): a test and
simulation tool, not product code (scripts/sim_fleet.py, tests/unit/test_fleet.py).

  * `MemStore`: an `ObjectStore` in memory with S3's semantics as ckptfs uses them (conditional
    PUTs on etags, sorted listings by prefix, multipart, ranges, head, idempotent delete),
    optionally with a fixed latency per request (a trio sleep: thousands of requests in flight
    cost nothing).
  * `RequestLog`: counts requests by node, operation and key prefix, and by second for rates.
  * `NodeView`: what one node's `Engine` is given: any store (a `MemStore`, an `S3Store` on
    moto) whose every call is counted in the log under that node's name.
  * `FleetNode`: a real `CacheFs` + `Engine` over a cache directory (tests/inproc.py's `Node`,
    without the asserts), on its own `NodeView`.
  * `dcp_metadata(files)`: bytes a DCP `.metadata` reader (cachemgr.format.dcp) takes for a
    checkpoint of these storage files, without torch.

Prefixes: the first two components of the key's directory (`data/<node>`, `parts/<set's first
component>`, `members`, `intents`, `acks/<intent>`, `manifests`), and for a LIST those of the
prefix listed. S3 partitions a bucket by key prefix wherever it finds load, so this is the
granularity at which the layout lets a busy prefix be split, not S3's actual partitions.
LISTs are counted in pages of 1,000 keys (S3's page size), one request each.
"""

from __future__ import annotations

import bisect
import builtins
import collections
import dataclasses
import itertools
import os
import pickle
import time
from pathlib import Path
from typing import Any

import trio

from cachemgr.core.cache import Cache
from cachemgr.core.fs import CacheFs
from cachemgr.core.hooks import NO_KERNEL
from cachemgr.core.index import ROOT_INO
from cachemgr.core.sets import SetRegistry
from cachemgr.engine import Engine, EngineConfig
from cachemgr.host.foreground import Foreground
from cachemgr.store.base import (
    NotFound,
    ObjectInfo,
    ObjectStore,
    Part,
    PreconditionFailed,
    crc32c,
)

LIST_PAGE = 1000  # keys per LIST response (S3 ListObjectsV2's MaxKeys)
# S3's published request rates per partitioned prefix (docs.aws.amazon.com, "Best practices
# design patterns: optimizing Amazon S3 performance")
S3_PUT_PER_S = 3500   # PUT/COPY/POST/DELETE
S3_GET_PER_S = 5500   # GET/HEAD (LIST counted here too: a GET on the bucket)
PUT_CLASS = frozenset({"put", "delete", "create_multipart", "upload_part", "complete_multipart",
                       "abort_multipart"})


def prefix_of(key: str) -> str:
    """The first two components of `key`'s directory ('members/@n.json' -> 'members')."""
    head = key.rsplit("/", 1)[0] if "/" in key else ""
    return "/".join(head.split("/")[:2]) or "(root)"


@dataclasses.dataclass
class _Obj:
    data: bytes
    etag: str
    crc: int
    mtime: float


class MemStore(ObjectStore):
    """An object store in a dict (see the module docstring). Safe from many trio tasks: every
    method is atomic between its awaits (the latency sleep comes first)."""

    url = "mem://fleet"

    def __init__(self, latency: float = 0.0) -> None:
        self.latency = latency
        self._objs: dict[str, _Obj] = {}
        self._keys: list[str] = []  # sorted
        self._uploads: dict[str, tuple[str, dict[int, bytes]]] = {}
        self._seq = itertools.count(1)

    @property
    def supports_conditional_put(self) -> bool:
        return True

    async def _wait(self) -> None:
        if self.latency:
            await trio.sleep(self.latency)
        else:
            await trio.lowlevel.checkpoint()

    def _store(self, key: str, data: bytes, crc: int | None = None) -> ObjectInfo:
        if key not in self._objs:
            bisect.insort(self._keys, key)
        obj = self._objs[key] = _Obj(data, f'"{next(self._seq):x}"',
                                     crc32c(data) if crc is None else crc, time.time())
        return self._info(key, obj)

    @staticmethod
    def _info(key: str, o: _Obj) -> ObjectInfo:
        return ObjectInfo(key, len(o.data), o.etag, o.crc, o.mtime)

    async def put(self, key: str, data: bytes | memoryview, *, if_none_match: bool = False,
                  if_match: str | None = None) -> ObjectInfo:
        await self._wait()
        cur = self._objs.get(key)
        if if_none_match and cur is not None:
            raise PreconditionFailed(f"{key} exists", key=key)
        if if_match is not None:
            if cur is None:
                raise NotFound(f"no object {key}", key=key)  # AWS: If-Match on a missing key
            if cur.etag.strip('"') != if_match.strip('"'):
                raise PreconditionFailed(f"{key} changed", key=key)
        return self._store(key, bytes(data))

    async def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        await self._wait()
        o = self._objs.get(key)
        if o is None:
            raise NotFound(f"no object {key}", key=key)
        return o.data[start:] if length is None else o.data[start:start + length]

    async def head(self, key: str) -> ObjectInfo:
        await self._wait()
        o = self._objs.get(key)
        if o is None:
            raise NotFound(f"no object {key}", key=key)
        return self._info(key, o)

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        await self._wait()
        i = bisect.bisect_left(self._keys, prefix)
        out = []
        while i < len(self._keys) and self._keys[i].startswith(prefix):
            k = self._keys[i]
            out.append(self._info(k, self._objs[k]))
            i += 1
        return out

    async def delete(self, key: str) -> None:
        await self._wait()
        if self._objs.pop(key, None) is not None:
            del self._keys[bisect.bisect_left(self._keys, key)]

    async def create_multipart(self, key: str) -> str:
        await self._wait()
        uid = f"u{next(self._seq)}"
        self._uploads[uid] = (key, {})
        return uid

    async def upload_part(self, key: str, upload_id: str, number: int,
                          data: bytes | memoryview) -> Part:
        await self._wait()
        if upload_id not in self._uploads:
            raise NotFound(f"no multipart upload {upload_id}", key=key)
        b = bytes(data)
        self._uploads[upload_id][1][number] = b
        return Part(number, f'"p{next(self._seq)}"', crc32c(b), len(b))

    async def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[Part],
                                 crc32c: int) -> ObjectInfo:
        await self._wait()
        up = self._uploads.pop(upload_id, None)
        if up is None:
            raise NotFound(f"no multipart upload {upload_id}", key=key)
        data = b"".join(up[1][p.number] for p in sorted(parts, key=lambda p: p.number))
        return self._store(key, data, crc32c)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        await self._wait()
        self._uploads.pop(upload_id, None)

    def backdate(self, key: str, seconds: float) -> None:
        """Make `key` look written `seconds` earlier (its LastModified), as a dead node's."""
        self._objs[key].mtime -= seconds

    def list_keys(self, prefix: str = "") -> builtins.list[str]:
        return [k for k in self._keys if k.startswith(prefix)]


class RequestLog:
    """Requests counted by (phase, node, op, prefix) and by (phase, second, class, prefix).
    `phase` is whatever the caller set last (`phase = "commit"`)."""

    def __init__(self) -> None:
        self.phase = "start"
        self.t0 = time.monotonic()
        self.by_node: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
        self.by_second: collections.Counter[tuple[str, int, str, str]] = collections.Counter()

    def count(self, node: str, op: str, key: str, n: int = 1) -> None:
        p = prefix_of(key)
        self.by_node[self.phase, node, op, p] += n
        cls = "PUT" if op in PUT_CLASS else "GET"
        self.by_second[self.phase, int(time.monotonic() - self.t0), cls, p] += n

    def per_node(self, phase: str, nodes: builtins.list[str], *,
                 only: set[tuple[str, str]] | None = None,
                 exclude: set[tuple[str, str]] | None = None) -> dict[str, dict[str, int]]:
        """{node: {op: requests}} in `phase` (every node named, those without requests too);
        `only`/`exclude`: those (op, prefix) pairs."""
        out: dict[str, dict[str, int]] = {n: {} for n in nodes}
        for (ph, node, op, p), c in self.by_node.items():
            if only is not None and (op, p) not in only:
                continue
            if exclude is not None and (op, p) in exclude:
                continue
            if ph == phase and node in out:
                out[node][op] = out[node].get(op, 0) + c
        return out

    def per_prefix(self, phase: str | None = None) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = collections.defaultdict(dict)
        for (ph, _node, op, p), c in self.by_node.items():
            if phase is None or ph == phase:
                out[p][op] = out[p].get(op, 0) + c
        return dict(out)

    def peak_rates(self, phase: str | None = None) -> dict[tuple[str, str], int]:
        """{(class, prefix): the most requests of that class to that prefix in one second}."""
        out: dict[tuple[str, str], int] = {}
        for (ph, _s, cls, p), c in self.by_second.items():
            if phase is None or ph == phase:
                out[cls, p] = max(out.get((cls, p), 0), c)
        return out


class NodeView(ObjectStore):
    """`base` as one node sees it: every request counted in `log` under `node`."""

    def __init__(self, base: ObjectStore, log: RequestLog, node: str) -> None:
        self.base = base
        self.log = log
        self.node = node
        self.url = base.url

    @property
    def supports_conditional_put(self) -> bool:
        return self.base.supports_conditional_put

    @property
    def conditional(self) -> Any:
        return self.base.conditional

    async def probe_conditional(self) -> Any:
        return await self.base.probe_conditional()

    async def put(self, key: str, data: bytes | memoryview, *, if_none_match: bool = False,
                  if_match: str | None = None) -> ObjectInfo:
        self.log.count(self.node, "put", key)
        return await self.base.put(key, data, if_none_match=if_none_match, if_match=if_match)

    async def get(self, key: str, start: int = 0, length: int | None = None) -> bytes:
        self.log.count(self.node, "get", key)
        return await self.base.get(key, start, length)

    async def head(self, key: str) -> ObjectInfo:
        self.log.count(self.node, "head", key)
        return await self.base.head(key)

    async def list(self, prefix: str = "") -> builtins.list[ObjectInfo]:
        out = await self.base.list(prefix)
        # pages of LIST_PAGE keys; the prefix as a key's directory ("manifests/" -> manifests)
        self.log.count(self.node, "list", prefix.rstrip("/") + "/x",
                       max(1, -(-len(out) // LIST_PAGE)))
        return out

    async def delete(self, key: str) -> None:
        self.log.count(self.node, "delete", key)
        await self.base.delete(key)

    async def create_multipart(self, key: str) -> str:
        self.log.count(self.node, "create_multipart", key)
        return await self.base.create_multipart(key)

    async def upload_part(self, key: str, upload_id: str, number: int,
                          data: bytes | memoryview) -> Part:
        self.log.count(self.node, "upload_part", key)
        return await self.base.upload_part(key, upload_id, number, data)

    async def complete_multipart(self, key: str, upload_id: str, parts: builtins.list[Part],
                                 crc32c: int) -> ObjectInfo:
        self.log.count(self.node, "complete_multipart", key)
        return await self.base.complete_multipart(key, upload_id, parts, crc32c)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        self.log.count(self.node, "abort_multipart", key)
        await self.base.abort_multipart(key, upload_id)


class FleetNode:
    """A real CacheFs + Engine over `cache_dir` on its own counted view of `base`."""

    def __init__(self, cache_dir: Path, base: ObjectStore, log: RequestLog,
                 cfg: EngineConfig) -> None:
        cache = Cache.open(cache_dir)
        self.id = cache.index.meta("node_id") or "node"
        self.store = NodeView(base, log, self.id)
        self.t = Engine(cache, self.store, cfg, foreground=Foreground(), kernel=NO_KERNEL)
        self.core = CacheFs(cache, hooks=self.t.commits, reads=self.t.restorer,
                            room=self.t.space)
        self.sets = SetRegistry(self.core.index)

    def split(self, path: str) -> tuple[int, bytes]:
        if "/" not in path:
            return ROOT_INO, path.encode()
        d, n = path.rsplit("/", 1)
        ino = self.core.index.resolve(d)
        assert ino is not None, d
        return ino, n.encode()

    def makedirs(self, path: str) -> None:
        parts = path.split("/")
        for i in range(len(parts)):
            sub = "/".join(parts[:i + 1])
            if self.core.index.resolve(sub) is None:
                parent, name = self.split(sub)
                self.core.mkdir(parent, name, 0o755, 0, 0)

    def write(self, path: str, data: bytes) -> None:
        parent, name = self.split(path)
        fh = self.core.create(parent, name, 0o644, os.O_WRONLY | os.O_CREAT, 0, 0)[0].fh
        self.core.write(fh, 0, data)
        self.core.flush(fh)
        self.core.release(fh)

    def rename(self, src: str, dst: str) -> None:
        sp, sn = self.split(src)
        dp, dn = self.split(dst)
        self.core.rename(sp, sn, dp, dn, 0)

    def state(self, path: str) -> str | None:
        s = self.sets.newest_at(path)
        return None if s is None else s.state

    def close(self) -> None:
        self.core.close()


# -- a DCP `.metadata` without torch ------------------------------------------------------------
# cachemgr.format.dcp resolves every class of the pickle to an inert stub and reads
# `storage_data[*].relative_path`: these classes pickle to that shape.


class Metadata:
    def __init__(self, storage_data: dict[str, Any]) -> None:
        self.storage_data = storage_data


class _StorageInfo:
    def __init__(self, relative_path: str, offset: int, length: int) -> None:
        self.relative_path = relative_path
        self.offset = offset
        self.length = length


def dcp_metadata(files: builtins.list[str]) -> bytes:
    return pickle.dumps(Metadata({f"item{i}": _StorageInfo(f, 0, 1)
                                  for i, f in enumerate(files)}))


# -- the scenario: a multi-node DCP commit, a steady pass, a restore ------------------------------


def sim_config(interval: float, lease: float, **kw: Any) -> EngineConfig:
    """Small chunks, every listing and poll every `interval` seconds (a pass is short)."""
    from cachemgr.transfer.upload import TransferConfig

    base: dict[str, Any] = {
        "transfer": TransferConfig(frame_size=4096, compress="off"), "file_concurrency": 1,
        "retry_pause": 0.05, "refresh_interval": interval, "gather_poll": interval,
        "register_timeout": 30.0, "lease": lease, "commit_timeout": 600.0}
    base.update(kw)
    return EngineConfig(**base)


@dataclasses.dataclass
class FleetResult:
    nodes: builtins.list[str]        # the writers
    readers: builtins.list[str]      # the fresh nodes that restored
    log: RequestLog
    publish_s: float                 # the .metadata rename to the committer's set durable
    visible_s: float                 # ... to every writer holding the set durable
    restore_s: float                 # fresh nodes started to every one having read its files
    idle_s: float                    # the steady window's length
    start_s: float                   # every writer registered
    records: int                     # store keys under each protocol prefix at the end
    keys: dict[str, int]


async def _until(cond: Any, what: str, timeout: float) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.01)


async def run_fleet(workdir: Path, base: ObjectStore, n: int, readers: int, *,
                    interval: float, lease: float, idle: float, shard: int = 4096,
                    timeout: float = 600.0, cfg: dict[str, Any] | None = None) -> FleetResult:
    """`n` nodes write one DCP shard each into `ck/step1`, node 0 renames `.metadata` into
    place; once every node holds the set durable, a steady window of `idle` seconds; then
    `readers` fresh nodes list the store and read the set (each its rank's shard and
    `.metadata`). Every request is counted by phase: start, commit, idle, restore."""
    log = RequestLog()
    config = sim_config(interval, lease, **(cfg or {}))
    writers = [FleetNode(workdir / f"w{i}", base, log, config) for i in range(n)]
    path = "ck/step1"
    shards = [f"__{i}_0.distcp" for i in range(n)]
    data = [(f"rank {i} ".encode() * (shard // 7 + 1))[:shard] for i in range(n)]
    fresh: builtins.list[FleetNode] = []
    out: dict[str, float] = {}
    try:
        async with trio.open_nursery() as nursery:
            t = time.monotonic()
            for w in writers:
                await nursery.start(w.t.run)
            out["start"] = time.monotonic() - t

            log.phase = "commit"
            t = time.monotonic()
            for i, w in enumerate(writers):
                w.makedirs(path)
                w.write(f"{path}/{shards[i]}", data[i])
            # the barrier (DCP's gather of write results), then rank 0 writes the metadata
            w0 = writers[0]
            w0.write(f"{path}/.metadata.tmp", dcp_metadata(shards))
            t_commit = time.monotonic()
            w0.rename(f"{path}/.metadata.tmp", f"{path}/.metadata")
            await _until(lambda: w0.state(path) == "durable", "the committer to publish",
                         timeout)
            out["publish"] = time.monotonic() - t_commit
            await _until(lambda: all(w.state(path) == "durable" for w in writers),
                         "every node to hold the set", timeout)
            out["visible"] = time.monotonic() - t_commit
            del t

            log.phase = "idle"
            t = time.monotonic()
            await trio.sleep(idle)
            out["idle"] = time.monotonic() - t

            log.phase = "restore"
            t = time.monotonic()
            for i in range(readers):
                r = FleetNode(workdir / f"r{i}", base, log, config)
                fresh.append(r)
                await nursery.start(r.t.run)

            async def restore(i: int, r: FleetNode) -> None:
                await _until(lambda: r.core.index.resolve(f"{path}/.metadata") is not None,
                             "the set listed", timeout)
                rank = i % n
                for name, want in ((".metadata", None), (shards[rank], data[rank])):
                    ino = r.core.index.resolve(f"{path}/{name}")
                    assert ino is not None
                    await r.t.restorer.ensure_all(ino)
                    fh = r.core.open(ino, os.O_RDONLY).fh
                    got = r.core.read(fh, 0, shard + 1)
                    r.core.release(fh)
                    assert want is None or got == want, (name, len(got))

            async with trio.open_nursery() as rn:
                for i, r in enumerate(fresh):
                    rn.start_soon(restore, i, r)
            out["restore"] = time.monotonic() - t
            log.phase = "end"
            nursery.cancel_scope.cancel()
    finally:
        for node in writers + fresh:
            node.close()
    keys: dict[str, int] = {}
    if isinstance(base, MemStore):
        for k in base.list_keys():
            keys[k.split("/", 1)[0]] = keys.get(k.split("/", 1)[0], 0) + 1
    return FleetResult(nodes=[w.id for w in writers], readers=[r.id for r in fresh], log=log,
                       publish_s=out["publish"], visible_s=out["visible"],
                       restore_s=out["restore"], idle_s=out["idle"], start_s=out["start"],
                       records=sum(keys.values()), keys=keys)
