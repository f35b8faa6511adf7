"""Costs that must not grow with history or directory size (issue 35, "Production scale").

Not timed: each test counts what SQLite does. `Steps` counts the virtual-machine instructions
the index runs (`set_progress_handler`, every 100 instructions), which grows with every row a
statement visits: a scan of a table that grows with history shows as steps that grow with it.
The workload is the one measured in the issue: each set a 4 KiB file renamed into place, every
10th a DCP-like directory of 8 shards and `.metadata`, committed through the core with the
tiering services running (uploads, publication, GC) on a file:// store.

  * a round of commits costs as many steps (within a small slack) after 1,500 sets as after 50,
    in the foreground (the FUSE operations) and in the background (uploads, publication, GC),
    and with --keep-local after 800 durable sets as after 50 (retention);
  * creating a file in a directory of 3,000 entries costs what it does in one of 30;
  * the statements of the write path use an index (EXPLAIN QUERY PLAN has no SCAN of a table
    that grows with history);
  * history is pruned: after 600 re-commits of a few paths, the index holds about
    `history_keep` sets, not 600 (cachemgr.tiering.history).
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
from collections.abc import Callable

import pytest

from cachemgr.core.index import ROOT_INO
from tests.inproc import Node, run_nodes, until

SLACK = 1.3  # steps may differ a little (B-tree depth, which rows share a page)


class Steps:
    """VM steps (in hundreds) the connection runs, and the statements it ran."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.n = 0
        self.statements: dict[str, str] = {}  # each statement's shape -> one run of it

    def __enter__(self) -> Steps:
        self.conn.set_progress_handler(self._tick, 100)
        self.conn.set_trace_callback(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.set_progress_handler(None, 0)
        self.conn.set_trace_callback(None)

    def _tick(self) -> int:
        self.n += 1
        return 0

    def uncounted(self, fn: Callable[[], bool]) -> bool:
        """`fn()` (the test's own look at the index) neither counted nor recorded: a poll that
        runs every 5 ms until the round settles would make the count follow wall time."""
        self.__exit__()
        try:
            return fn()
        finally:
            self.__enter__()

    def _trace(self, sql: str) -> None:
        self.statements.setdefault(re.sub(r"'[^']*'|\b\d+\b", "?", sql), sql)


def one_set(node: Node, i: int) -> None:
    if i % 10 == 9:
        d = node.mkdir(f"d{i}")
        for r in range(8):
            node.write(f"d{i}/__{r}_0.distcp", b"x" * 4096)
        node.write(f"d{i}/.metadata.tmp", b"m" * 100)
        node.core.rename(d, b".metadata.tmp", d, b".metadata", 0)
    else:
        node.write(f"f{i}.tmp", b"y" * 4096)
        node.core.rename(ROOT_INO, f"f{i}.tmp".encode(), ROOT_INO, f"f{i}".encode(), 0)


def settled(node: Node) -> bool:
    return (not node.sets.by_states(("committed", "uploading", "deleting"))
            and node.t.publisher.idle() and not node.t.uploads.queued()
            and not node.t.uploads.running())


@pytest.fixture
def quiet_logs():
    logging.disable(logging.WARNING)  # the fake .metadata is no pickle: one warning per set
    yield
    logging.disable(logging.NOTSET)


@pytest.fixture
def node(tmp_path, store, quiet_logs):
    # no periodic listing of the store: its cost follows the store's size by design
    n = Node(tmp_path / "a", store, refresh_interval=3600.0)
    yield n
    assert n.core.check_consistency() == []
    n.core.close()


@pytest.fixture
def store(tmp_path):
    from cachemgr.store import LocalStore
    return LocalStore(tmp_path / "store")


def round_costs(node: Node, sizes: tuple[int, int]) -> tuple[dict[str, tuple[int, int]],
                                                              dict[str, str]]:
    """Steps of a round of 20 commits (foreground; background until it settled) once the
    index holds each of `sizes` sets, and the statements they ran."""
    conn = node.core.index.conn
    out: dict[str, tuple[int, int]] = {}
    statements: dict[str, str] = {}

    async def body():
        nonlocal statements
        built = 0
        for target, label in zip(sizes, ("small", "large")):
            while built < target:
                for i in range(built, min(target, built + 100)):
                    one_set(node, i)
                built = min(target, built + 100)
                await until(lambda: settled(node), "history to settle", timeout=300)
            with Steps(conn) as fg:
                for i in range(10_000 + built, 10_000 + built + 20):
                    one_set(node, i)
            with Steps(conn) as bg:
                await until(lambda: bg.uncounted(lambda: settled(node)), "the round to settle",
                            timeout=60)
            out[label] = (fg.n, bg.n)
            statements |= fg.statements | bg.statements
    run_nodes([node], body)
    return out, statements


def test_commit_costs_do_not_grow_with_history(node):
    conn = node.core.index.conn
    out, statements = round_costs(node, (50, 1500))
    (fg_small, bg_small), (fg_large, bg_large) = out["small"], out["large"]
    assert node.sets.row_counts()["sets"] > 1500
    assert fg_large <= fg_small * SLACK + 20, out
    assert bg_large <= bg_small * SLACK + 20, out
    # no statement run by a commit scans a table that grows with history
    grows = ("sets", "set_files", "objects", "inodes", "dentries")
    for sql in statements.values():
        if sql.startswith(("BEGIN", "COMMIT", "ROLLBACK", "PRAGMA")):
            continue
        plan = [r[3] for r in conn.execute("EXPLAIN QUERY PLAN " + sql)]
        scans = [p for p in plan if any(re.match(rf"SCAN ({t}|\w)\b(?! VIRTUAL)", p)
                                        for t in grows)]
        assert not scans, (sql, plan)


def test_keep_local_retention_does_not_walk_durable_sets(tmp_path, store, quiet_logs):
    """--keep-local 2: the retention after each publication costs as much after 800 durable
    sets as after 50 (cachemgr.tiering.space: a watermark, not a walk of every durable set),
    and it still evicts each file of every durable set but the newest 2, once."""
    node = Node(tmp_path / "a", store, refresh_interval=3600.0, keep_local=2)
    out, _ = round_costs(node, (50, 800))
    (fg_small, bg_small), (fg_large, bg_large) = out["small"], out["large"]
    assert fg_large <= fg_small * SLACK + 20, out
    assert bg_large <= bg_small * SLACK + 20, out
    durable = node.sets.by_states(("durable",))
    assert len(durable) > 800
    files = sum(len(node.sets.files(s.seq)) for s in durable[:-2])
    assert node.t.space.statistics().evicted == files
    assert node.core.check_consistency() == []
    node.core.close()


def test_create_cost_does_not_grow_with_directory_size(node):
    conn = node.core.index.conn
    costs = {}
    for label, d, n in (("small", "small", 30), ("large", "large", 3000)):
        node.mkdir(d)
        node.mkdir(f"{d}/x.tmp")  # in an open set: every close asks is_dcp_dir / in_open_set
        for i in range(n):
            node.write(f"{d}/x.tmp/e{i:05d}", b"")
        with Steps(conn) as s:
            for i in range(20):
                node.write(f"{d}/x.tmp/new{i}", b"z" * 10)
        costs[label] = s.n
    assert costs["large"] <= costs["small"] * SLACK + 10, costs


def test_history_is_pruned(tmp_path, store, quiet_logs):
    """600 commits of a few paths (a `latest` file re-saved, checkpoints rotated): once the
    sets have ended and history ran, the index holds the newest `history_keep` sets plus the
    newest of each path, not 600; objects no set holds are gone from it with their objects."""
    node = Node(tmp_path / "a", store, refresh_interval=3600.0, history_keep=50,
                history_age=0.0)

    async def body():
        for i in range(600):
            node.write("latest.pt", os.urandom(64) + bytes([i % 256]))
            if i % 100 == 99:
                await until(lambda: settled(node), "settle", timeout=120)
        await until(lambda: settled(node), "settle", timeout=120)
        await node.t.history.prune()
    run_nodes([node], body)
    rows = node.sets.row_counts()
    assert rows["sets"] <= 50 + 1, rows
    assert rows["set_files"] <= 50 + 1, rows
    assert rows["objects"] <= 2, rows  # the durable set's object, at most one more in flight
    assert node.sets.newest_at("latest.pt").state == "durable"
    assert node.t.history.statistics().pruned >= 540
    assert node.core.check_consistency() == []
    node.core.close()
