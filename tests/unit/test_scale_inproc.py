"""Costs that must not grow with the size of a set, a directory or a store (issue 35), checked
in process without timing anything: what is counted is SQLite's work (statements, and the
virtual machine's steps through a progress handler: rows visited show up there), store
requests, and time on a trio `MockClock` that only the test moves.

  1. a DCP save into one directory: closing the N-th shard costs the index the same work at
     N = 100 as at N = 800; a landed upload of a set of F files costs the same at F = 50 as at
     F = 400 (it asked the index for the set's every missing file: O(F) per upload, O(F^2)
     per set); the upload queue hands out jobs in priority order however they were queued,
     re-prioritised or dropped;
  2. part records: a directory's record is written again in the background no sooner than
     SPACING times as long as its last write took (so record writing holds at most
     1/(SPACING + 1) of the daemon's thread, whatever the directory's size), and a `sync`
     (another node's commit asking) does not wait for that;
  3. a fresh node's first listing of 2,000 sets: one LIST, one GET per manifest, no manifest
     read twice, at most a step's worth of manifests read and not yet applied at any time,
     and the index work per set the same for the last 1,500 sets as for the first 500.
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import time
from pathlib import Path

import trio
from trio.testing import MockClock

from cachemgr.format import manifest as mf
from cachemgr.format import validate
from cachemgr.store import LocalStore
from cachemgr.tiering import parts as parts_mod
from cachemgr.tiering.remote import RemoteSync
from cachemgr.tiering.uploadqueue import _UNCOMMITTED
from tests.inproc import OTHER, Harness, Node, run_nodes, until


class IndexWork:
    """Counts the SQL statements and virtual machine steps of an index connection while
    active (`with work:`)."""

    STEP = 100  # the progress handler runs every STEP VM instructions

    def __init__(self, conn) -> None:
        self.conn = conn
        self.statements = 0
        self.steps = 0

    def _stmt(self, _sql: str) -> None:
        self.statements += 1

    def _step(self) -> int:
        self.steps += self.STEP
        return 0

    def __enter__(self) -> IndexWork:
        self.conn.set_trace_callback(self._stmt)
        self.conn.set_progress_handler(self._step, self.STEP)
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.set_trace_callback(None)
        self.conn.set_progress_handler(None, 0)


# ----------------------------------------------------------------------------------------------
# 1. a big DCP save


def _shard(i: int) -> str:
    return f"ck/step/__{i}_0.distcp"


def test_closing_a_shard_costs_the_same_in_a_big_directory(tmp_path):
    """The index's work for one shard (create, write, flush, release: the close hooks mark
    the directory's part record and queue the upload) is the same with 100 shards in the
    directory as with 800."""
    node = Node(tmp_path / "a", LocalStore(tmp_path / "store"))
    node.mkdir("ck")
    node.mkdir("ck/step")
    work = {}
    data = b"x" * 100
    i = 0
    for at in (100, 800):
        while i < at:
            node.write(_shard(i), data)
            i += 1
        with IndexWork(node.core.index.conn) as w:
            for _ in range(10):
                node.write(_shard(i), data)
                i += 1
        work[at] = w
    assert work[800].statements == work[100].statements
    assert work[800].steps <= 1.2 * work[100].steps, (work[100].steps, work[800].steps)
    assert node.core.check_consistency() == []
    node.core.close()


def _upload_work(tmp_path: Path, nfiles: int) -> list[int]:
    """VM steps of each landed upload (`UploadQueue._uploaded`) of a directory set of
    `nfiles` files, committed before any upload ran."""
    store = LocalStore(tmp_path / f"store{nfiles}")
    node = Node(tmp_path / f"n{nfiles}", store)
    node.mkdir("ck")
    for i in range(nfiles):
        node.write(f"ck/f{i}", b"y" * 64)
    seq = node.t.commit_path("ck")
    q = node.t.uploads
    real = q._uploaded
    steps: list[int] = []

    def counted(ino, version, obj):
        with IndexWork(node.core.index.conn) as w:
            real(ino, version, obj)
        steps.append(w.steps)

    q._uploaded = counted

    async def body():
        await until(lambda: node.sets.get(seq).state == "durable", "the set durable")
    run_nodes([node], body)
    assert len(steps) == nfiles
    node.core.close()
    return steps


def test_a_landed_upload_costs_the_same_in_a_big_set(tmp_path):
    small = statistics.median(_upload_work(tmp_path, 50))
    big = statistics.median(_upload_work(tmp_path, 400))
    assert big <= 1.3 * small, (small, big)


def test_the_upload_queue_hands_out_jobs_by_priority(tmp_path):
    """Jobs queued in any order, some made more urgent later and some dropped, come out in
    priority order (a heap with stale entries skipped), each once."""
    node = Node(tmp_path / "a", LocalStore(tmp_path / "store"))
    q = node.t.uploads
    rnd = random.Random(35)
    prio = {}
    for ino in rnd.sample(range(10, 2010), 2000):
        prio[ino] = rnd.randrange(1, 500)
        q._enqueue(ino, 1, prio[ino])
    for ino in rnd.sample(sorted(prio), 300):  # more urgent: the old entry goes stale
        prio[ino] = min(prio[ino], rnd.randrange(1, 500))
        q._enqueue(ino, 1, prio[ino])
    for ino in rnd.sample(sorted(prio), 200):
        q._drop(ino, 1)
        del prio[ino]
    q._drop_inode(next(iter(prio)))
    del prio[next(iter(prio))]
    q._enqueue(7, 3, None)  # closed, in no set: after every committed set
    out = []
    while (job := q._next_job()) is not None:
        out.append((job.prio, job.ino))
    assert [p for p, _ in out[:-1]] == sorted(prio.values())
    assert sorted(i for _, i in out[:-1]) == sorted(prio)
    assert out[-1][1] == 7 and out[-1][0] > _UNCOMMITTED
    assert q.queued() == 0
    node.core.close()


# ----------------------------------------------------------------------------------------------
# 2. part records


class SlowParts(LocalStore):
    """A LocalStore whose part record PUTs take (virtual) time in proportion to the record:
    `per_entry` seconds of the MockClock per file it lists; logged as (start, end, files) and
    kept in memory (no worker thread: the clock moves only when the test's tasks wait)."""

    def __init__(self, root: Path, clock: MockClock, per_entry: float) -> None:
        super().__init__(root)
        self.clock = clock
        self.per_entry = per_entry
        self.record_puts: list[tuple[float, float, int]] = []

    async def put(self, key, data, **kw):
        if not key.startswith(parts_mod.PREFIX):
            return await super().put(key, data, **kw)
        n = len(parts_mod.loads(data, key)["files"])
        start = trio.current_time()
        await trio.sleep(self.per_entry * n)
        self.record_puts.append((start, trio.current_time(), n))
        return None


async def _inline(fn, *args):
    return fn(*args)


def test_a_big_directorys_part_record_is_spaced_by_its_cost(tmp_path, monkeypatch):
    # the record's digest and JSON run inline: in a worker thread their real time became
    # virtual time (the autojumping clock moves while the loop waits for the thread), a
    # nondeterministic amount that spaced the writes out further on a loaded CI machine
    monkeypatch.setattr(parts_mod, "off_loop", _inline)
    clock = MockClock(autojump_threshold=0)
    store = SlowParts(tmp_path / "store", clock, per_entry=0.0001)
    node = Node(tmp_path / "a", store)
    p = node.t.parts
    node.mkdir("ck")
    node.mkdir("ck/step")
    n = 0

    async def main():
        nonlocal n
        await node.t.members.register()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(p.run)
            for n in range(600):  # a shard closed every virtual millisecond
                node.write(_shard(n), b"z")
                await trio.sleep(0.001)
            # another node's commit asks for the record now: no spacing (at most a pass in
            # flight first, then its own)
            node.write(_shard(600), b"z")
            asked = trio.current_time()
            await p.sync([node.core.index.resolve("ck/step")])
            assert trio.current_time() - asked <= 2 * 601 * store.per_entry + 1e-9
            assert store.record_puts[-1][2] == 601
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    puts = store.record_puts[:-1]
    assert len(puts) >= 5
    for (s0, e0, _n0), (s1, _e1, _n1) in itertools.pairwise(puts):
        assert s1 - e0 >= parts_mod.SPACING * (e0 - s0) - 1e-9
    # record writing took at most 1/(SPACING + 1) of the time, plus the last write
    busy = sum(e - s for s, e, _ in puts)
    span = puts[-1][1] - puts[0][0]
    assert busy <= span / (parts_mod.SPACING + 1) + (puts[-1][1] - puts[-1][0]) + 1e-9
    node.core.close()


class HeldParts(LocalStore):
    """A LocalStore whose first part record PUT says `entered` and waits for `release` (a store
    that hangs, for as long as the test says); every record PUT is logged as (virtual start
    time, the generation it carries) and kept in memory: no worker thread, whose real time the
    autojumping MockClock would turn into virtual time (5 ms per `until` poll, as fast as the
    loop spins: a thread slowed 0.2 s by a loaded machine was 50 virtual seconds)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.entered = trio.Event()
        self.release = trio.Event()
        self.record_puts: list[tuple[float, int]] = []

    async def put(self, key, data, **kw):
        if key.startswith(parts_mod.PREFIX):
            self.record_puts.append((trio.current_time(),
                                     parts_mod.loads(data, key)["generation"]))
            if len(self.record_puts) == 1:
                self.entered.set()
                await self.release.wait()
            return None
        return await super().put(key, data, **kw)


def test_a_record_written_across_a_new_lease_generation_is_written_again_at_once(tmp_path,
                                                                               monkeypatch):
    """Issue 36 (the fault loop, a black hole): a record write that hung 14 s ended just after
    the node registered again (its lease ran out meanwhile); spaced by SPACING x 14 s, the
    record under the new generation came 112 s later, and the committer on the other node,
    which ignores the old generation's records, waited that long. Gated: the write is held in
    the store while the lease lapses and the node registers again; 100 s pass (virtual) before
    the store answers; the record under the new generation follows at once."""
    monkeypatch.setattr(parts_mod, "off_loop", _inline)  # no worker thread's real time
    clock = MockClock(autojump_threshold=0)
    store = HeldParts(tmp_path / "store")
    node = Node(tmp_path / "a", store, lease=0.3)
    p = node.t.parts
    lease = node.t.lease
    node.mkdir("ck")
    node.mkdir("ck/step")

    async def main():
        await node.t.members.register()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(p.run)
            node.write(_shard(0), b"z")
            await store.entered.wait()           # the record's write is in the store
            old = store.record_puts[0][1]
            await trio.sleep(100)                # and hangs there (virtual time)
            # the lease (real time) runs out meanwhile; the node registers again
            await trio.to_thread.run_sync(time.sleep, lease.left_s() + 0.01)
            assert await lease.renew()
            assert lease.generation != old
            # from here on the lease holds, however loaded the machine: a 0.3 s lease (real
            # time) running out again while the threads below work would register the node
            # once more and retry after a pause, a delay this test is not about
            lease.lease = 3600.0
            p.mark_all(now=True)                 # what the members' renewal does next
            released = trio.current_time()
            store.release.set()
            # (no worker thread runs from here on: virtual time moves only by `until`'s polls;
            # the spacing would be SPACING x 100 s)
            await until(lambda: len(store.record_puts) >= 2, "the record's second write",
                        timeout=50)
            start, gen = store.record_puts[1]
            assert gen != old
            assert start - released < 1, (start - released, parts_mod.SPACING)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    node.core.close()


# ----------------------------------------------------------------------------------------------
# 3. a fresh node on a big store


class CountingStore(LocalStore):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gets: list[str] = []
        self.lists = 0
        self.applied = lambda: 0
        self.held_max = 0  # manifests read and not yet applied, at most

    async def list(self, prefix: str = ""):
        self.lists += 1
        return await super().list(prefix)

    async def get(self, key, *args, **kw):
        out = await super().get(key, *args, **kw)
        self.gets.append(key)
        self.held_max = max(self.held_max, len(self.gets) - self.applied())
        return out


def _fill(store: Path, first: int, count: int, per_set: int = 2) -> int:
    """Manifests of sets first..first+count-1 of node OTHER, written straight into the store's
    directory (their objects are never read); the size of the biggest."""
    biggest = 0
    for i in range(first, first + count):
        path = f"ckpt/run{i // 500}/step_{i:05d}"
        files = [{"path": f"__{r}_0.distcp", "size": 10, "mode": 0o644, "mtime_ns": 1,
                  "object": {"key": f"data/{OTHER}/{i}/{r}/x", "size": 10, "stored_size": 10,
                             "crc32c": 0, "compression": "none", "frame_size": 0,
                             "frames": None, "chunk_size": 4096, "chunk_crcs": [0]}}
                 for r in range(per_set)]
        m = mf.build(path=path, kind="dir", seq=i + 1, node=OTHER, reason="dcp",
                     committed_ns=10**18 + i, layout={"dirs": [], "symlinks": []},
                     files=files)
        f = store / "objects" / mf.manifest_key(path)
        f.parent.mkdir(parents=True, exist_ok=True)
        data = mf.dumps(m)
        f.write_bytes(data)
        biggest = max(biggest, len(data))
    return biggest


def test_a_fresh_nodes_first_listing_of_2000_sets_is_applied_in_bounded_steps(tmp_path):
    store = CountingStore(tmp_path / "store")
    h = Harness(tmp_path, store)
    hold = 64 << 10
    remote = RemoteSync(table=h.core.cache.table, tree=h.core.cache.tree, index=h.core.index,
                        sets=h.sets, store=store, kernel=h.remote.mat.kernel,
                        node=h.t.node, interval=0, mark_parts=h.t.parts.mark_all,
                        changed=h.t._changed_now, hold_bytes=hold)
    store.applied = lambda: remote.applied
    biggest = _fill(store.root, 0, 500)
    with IndexWork(h.core.index.conn) as first:
        trio.run(remote.sync_once)
    assert remote.applied == 500 and store.lists == 1 and len(store.gets) == 500
    biggest = max(biggest, _fill(store.root, 500, 1500))
    store.gets.clear()
    store.held_max = 0
    with IndexWork(h.core.index.conn) as rest:
        trio.run(remote.sync_once)
    # every new manifest read once, none of the 500 already applied read again
    assert remote.applied == 2000 and store.lists == 2
    assert len(store.gets) == len(set(store.gets)) == 1500
    # memory: a step holds at most `hold` bytes of manifests (one, if bigger) and is applied
    # before the next is read
    smallest = min(os.path.getsize(p) for p in (store.root / "objects").rglob("*.json"))
    assert store.held_max <= hold // smallest + 1, store.held_max
    assert store.held_max < 1500
    # the index's work per set applied does not grow with the sets already there
    assert rest.statements / 1500 <= first.statements / 500 * 1.1, (first.statements,
                                                                    rest.statements)
    assert rest.steps / 1500 <= first.steps / 500 * 1.3, (first.steps, rest.steps)
    assert h.core.index.resolve("ckpt/run3/step_01999/__1_0.distcp") is not None
    store.gets.clear()
    trio.run(remote.sync_once)
    assert store.gets == []  # unchanged manifests cost nothing
    assert h.core.check_consistency() == []
    h.close()


def test_a_manifest_no_reader_would_accept_fails_its_set(tmp_path, monkeypatch):
    """A manifest over validate.MAX_DOCUMENT_BYTES (lowered here) is not PUT: its set fails,
    saying why, instead of being marked durable while every reader refuses it."""
    monkeypatch.setattr(validate, "MAX_DOCUMENT_BYTES", 2000)
    store = LocalStore(tmp_path / "store")
    node = Node(tmp_path / "a", store)
    node.mkdir("ck")
    for i in range(10):
        node.write(f"ck/f{i}", b"m")
    seq = node.t.commit_path("ck")

    async def body():
        await until(lambda: node.sets.get(seq).state == "failed", "the set failed")
    run_nodes([node], body)
    assert "a reader accepts" in node.sets.get(seq).error
    assert not trio.run(store.list, mf.MANIFEST_PREFIX)
    node.core.close()
