"""A reference test of the core and tiering without FUSE (issue 11; Mountpoint-S3's reftests
are the model): a hypothesis state machine drives a real `CacheFs` (cachemgr.core.fs) with a real
`Engine` (cachemgr.engine) and a file:// `LocalStore`, in-process, against a plain model.

What the machine does (rules), on a small name space so that sequences collide often:
top-level files `a`, `b` (their last close commits them) and `t.tmp` (a temporary name: no
commit at close), directories `ck.tmp`, `ck1`, `ck2` (files `x`, `y` are written in `ck.tmp`
only; a directory rename commits the directory at its new path).

  * write at an offset (opening the file for writing on its first write: a new content version),
    fsync, close (the last close of `a`/`b` commits it);
  * rename of files and of directories, over existing targets (an empty directory, a file), and
    onto a non-empty directory (ENOTEMPTY, nothing changes);
  * unlink, rm -r, mkdir, `Engine.commit_path` (EBUSY for a file open for writing);
  * settle: the tiering service runs (trio, in-process) until nothing is left to upload, publish
    or delete: every set the model says is committed and still current is then in the store;
  * evict (`CacheFs.evict` of uploaded data) and read (through `Restorer.ensure_range`, a chunk
    fill, as FuseOps.read does);
  * crash: every in-memory object is dropped without a close or release (kill -9 with the page
    cache intact), and the cache directory is opened again with `CacheFs.load` and a new
    `Engine` (cachemgr/core/fs.py and cachemgr/core/fsck.py crash contract, docs/SEMANTICS.md);
  * restore: a second node (a new cache directory on the same store) lists the store once
    (`RemoteSync.sync_once`): what it sees must be exactly the model's sets in the store, each
    whole, with the content it had at its commit, never torn.

Invariants after every step: the tree (names, kinds, sizes; content of every cached file)
equals the model's, and `CacheFs.check_consistency()` is clean.

The model of the store: a commit records the content of its path at that moment (the files'
identities too). A commit is dropped when one of its files is opened for writing or removed
before it is published (superseded: docs/SEMANTICS.md "What a set goes through", whether or
not its upload had finished), when a later commit absorbs its path (a rename away, a
directory committed over it) or when its path is deleted. What a commit dropped by a later
commit had absorbed, that commit removes; what a commit dropped by a content change had
absorbed, the next commit of its path, or of a path it is renamed to, removes, or the
deletion of its path; what a commit dropped by a deletion had absorbed, the deletion removes.
Settle applies what is left, in commit order: a commit puts its content at its path and
removes what it absorbed; a deletion removes the path. A removal never takes out a set
committed after what it removes (cachemgr/tiering/publish.py `_unpublish` leaves a newer set's
manifest alone). A crash forgets the absorbed paths a commit would remove (they are in memory
only: cachemgr/tiering/publish.py keeps `_absorb` in memory, "visible but never torn"); everything
else in the model survives it (the index is durable). A crash inside the service leaves each
pending commit published or not; one that is then dropped by a content change may stay in the
store (a durable set is not superseded), until a later commit or deletion of its path.

`test_core_reftest` is deterministic (derandomize, no example database) and bounded: a run takes
seconds. `test_core_reftest_random` runs new random seeds for CKPTFS_REFTEST_BUDGET_S seconds
(default 75) in a child process, printing each seed and the command that replays it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import hypothesis
import pytest
import trio
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cachemgr.core.cache import Cache
from cachemgr.core.errors import FsError
from cachemgr.core.fs import CacheFs
from cachemgr.core.hooks import NO_KERNEL
from cachemgr.core.index import ROOT_INO
from cachemgr.core.sets import SetRegistry, is_temp_name
from cachemgr.engine import Engine, EngineConfig
from cachemgr.host.foreground import Foreground
from cachemgr.store import LocalStore
from cachemgr.transfer.upload import TransferConfig

TOP_FILES = ("a", "b", "t.tmp")
DIRS = ("ck.tmp", "ck1", "ck2")
INNER = ("x", "y")
WRITABLE = TOP_FILES + tuple(f"ck.tmp/{n}" for n in INNER)
OFFSETS = (0, 1, 100, 4095, 4096, 5000)
SETTLE_TIMEOUT = 30.0
O_W = os.O_WRONLY | os.O_CREAT
# What the runs did (the test asserts that each kind of step happened with something at stake).
SEEN: Counter[str] = Counter()


def config() -> EngineConfig:
    # 4 KiB chunks (frame size), so a file of a few KiB is several chunks: a read fills some
    # of them. One listing of the store per run of the service (refresh_interval 0).
    return EngineConfig(transfer=TransferConfig(frame_size=4096, compress="off"),
                         file_concurrency=2, retry_pause=0.01, prefetch="none",
                         refresh_interval=0, gather_poll=0.05, register_timeout=5.0)


class BudgetStore(LocalStore):
    """A LocalStore that, once `budget` is set, takes that many more writes of objects and
    manifests (PUT, multipart complete, DELETE) and holds every later one forever: the daemon
    is then killed with its service stopped anywhere between two such writes. (Membership and
    part records pass: they say nothing about what a set holds.)"""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.budget: int | None = None
        self.stuck = False

    async def _spend(self, key: str) -> None:
        if self.budget is not None and key.startswith(("data/", "manifests/")):
            if self.budget <= 0:
                self.stuck = True
                await trio.sleep_forever()
            self.budget -= 1

    async def put(self, key, data, **kw):
        await self._spend(key)
        return await super().put(key, data, **kw)

    async def complete_multipart(self, key, upload_id, parts, crc32c):
        await self._spend(key)
        return await super().complete_multipart(key, upload_id, parts, crc32c)

    async def delete(self, key):
        await self._spend(key)
        await super().delete(key)


class Node:
    """A cache directory opened as the daemon opens it: CacheFs + Engine on a LocalStore."""

    def __init__(self, cache_dir: Path, store_dir: Path) -> None:
        self.store = BudgetStore(store_dir)
        cache = Cache.open(cache_dir)
        self.t = Engine(cache, self.store, config(), foreground=Foreground(),
                         kernel=NO_KERNEL)
        self.core = CacheFs(cache, hooks=self.t.commits, reads=self.t.restorer,
                            room=self.t.space)
        self.sets = SetRegistry(self.core.index)

    # -- the tree ----------------------------------------------------------------------------

    def resolve(self, path: str) -> int | None:
        return self.core.index.resolve(path)

    def entries(self, ino: int) -> dict[str, int]:
        fh = self.core.opendir(ino)
        return {name.decode(): node.ino for _, name, node in self.core.readdir(fh, 0)}

    def fill(self, ino: int, off: int = 0, size: int | None = None) -> None:
        """What FuseOps does before a read or a write-open of data not in the cache."""
        if self.core.cache.residency.needs_fetch(ino):
            if size is None:
                trio.run(self.t.restorer.ensure_all, ino)
            else:
                trio.run(functools.partial(self.t.restorer.ensure_range, ino, off, size))

    def read(self, ino: int, off: int = 0, size: int | None = None) -> bytes:
        n = self.core.getattr(ino).size if size is None else size
        self.fill(ino, off, None if size is None else max(size, 1))
        res = self.core.open(ino, os.O_RDONLY)
        try:
            return self.core.read(res.fh, off, n)
        finally:
            self.core.release(res.fh)

    def tree(self, *, fetch: bool) -> dict:
        """{name: bytes | None (evicted, not fetched) | {name: ...}} of the whole tree."""
        def walk(ino: int) -> dict:
            out: dict = {}
            for name, child in self.entries(ino).items():
                node = self.core.getattr(child)
                if stat.S_ISDIR(node.mode):
                    out[name] = walk(child)
                elif not fetch and self.core.cache.residency.needs_fetch(child):
                    out[name] = ("evicted", node.size)
                else:
                    out[name] = self.read(child)
            return out
        return walk(ROOT_INO)

    # -- the service -------------------------------------------------------------------------

    def quiet(self) -> bool:
        st_ = self.t.status()
        return (not self.sets.by_states(("committed", "uploading", "deleting"))
                and st_["uploads"]["queued"] == 0 and st_["uploads"]["running"] == 0
                and st_["deletes_waiting"] == 0 and self.t.remote.first_listing.is_set())

    def settle(self, budget: int | None = None) -> bool:
        """Run the tiering service until it has nothing left to do (a condition, polled), or,
        with a `budget`, until it has made that many store writes and waits to make another.
        True if it stopped there."""
        self.store.budget, self.store.stuck = budget, False

        async def main() -> None:
            async with trio.open_nursery() as n:
                await n.start(self.t.run)
                with trio.fail_after(SETTLE_TIMEOUT):
                    while not (self.store.stuck or self.quiet()):
                        await trio.sleep(0.005)  # a poll of the condition above
                n.cancel_scope.cancel()
        trio.run(main)
        self.store.budget = None
        return self.store.stuck

    def crash(self) -> None:
        """kill -9: nothing is released, flushed or closed; only the index connection goes
        (the process's sqlite handle dies with it)."""
        self.core.index.conn.close()


# ----------------------------------------------------------------------------------------------
# the model


@dataclass
class Commit:
    path: str
    content: object                    # bytes (a file) or {name: bytes} (a directory)
    ids: frozenset[int]                # the files' identities (inodes) in it
    serial: int = 0                    # the order of commits and deletions (a set's seq)
    maybe_done: bool = False           # a service that crashed may have published it
    # (path, serial of the commit that absorbed it): what goes from the store with this set
    absorb: list[tuple[str, int]] = field(default_factory=list)


ABSENT = None  # no manifest at a path


def freeze(content):
    """A set's content as a set member: bytes, or the items of a directory's {name: bytes}."""
    return frozenset(content.items()) if isinstance(content, dict) else content


def _at_or_under(p: str, root: str) -> bool:
    return p == root or p.startswith(root + "/")


def pwrite(old: bytes, off: int, data: bytes) -> bytes:
    buf = bytearray(old)
    if off > len(buf):
        buf.extend(b"\0" * (off - len(buf)))
    buf[off:off + len(data)] = data
    return bytes(buf)


class CoreMachine(RuleBasedStateMachine):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[str, bytes] = {}   # path -> content
        self.ids: dict[str, int] = {}       # path -> identity (kept by renames)
        self.dirs: set[str] = set()
        self.open: dict[str, int] = {}      # path -> fh of the one writer
        # ("commit", Commit) | ("maybe", Commit) | ("delete", path, serial, absorbed), in order
        self.pending: list[tuple] = []
        # set path -> what its manifest in the store may hold: contents (frozen), ABSENT
        self.store: dict[str, set] = {}
        # path -> what commits of it dropped by a content change had absorbed: the next commit
        # of that path removes it (cachemgr.tiering.publish: Publisher.inherit_superseded)
        self.orphans: dict[str, list[tuple[str, int]]] = {}
        # path -> serial of the newest commit put there (put_serial), or maybe put there by a
        # service that crashed (maybe_serial): what a deletion of older sets leaves alone
        self.put_serial: dict[str, int] = {}
        self.maybe_serial: dict[str, int] = {}
        self.serial = 0
        self.next_id = 0
        self.restores = 0

    @initialize()
    def start(self) -> None:
        SEEN["example"] += 1
        self.root = Path(TMP.mkdtemp())
        self.node = Node(self.root / "cache", self.root / "store")

    def teardown(self) -> None:
        node = getattr(self, "node", None)
        if node is not None:
            with contextlib.suppress(sqlite3.ProgrammingError):  # closed: crashed
                node.core.close()

    # -- model helpers -----------------------------------------------------------------------

    def parent_exists(self, path: str) -> bool:
        return "/" not in path or path.rsplit("/", 1)[0] in self.dirs

    def under(self, root: str) -> list[str]:
        return [p for p in self.files if _at_or_under(p, root)]

    def snapshot(self, path: str) -> Commit:
        if path in self.files:
            return Commit(path, self.files[path], frozenset({self.ids[path]}))
        content = {p[len(path) + 1:]: self.files[p] for p in self.under(path)}
        return Commit(path, content, frozenset(self.ids[p] for p in self.under(path)))

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def take_orphans(self, paths: list[str]) -> list[tuple[str, int]]:
        """What commits at or under `paths` dropped by a content change had absorbed."""
        out: list[tuple[str, int]] = []
        for k in [k for k in self.orphans if any(_at_or_under(k, p) for p in paths)]:
            out += self.orphans.pop(k)
        return out

    def commit(self, path: str, absorb: list[str]) -> None:
        c = self.snapshot(path)
        c.serial = self.next_serial()
        absorb = [p for p in absorb if p]
        # Live commits at or under this path or an absorbed path are superseded, earlier
        # commits of this very path included (docs/SEMANTICS.md "What a set goes through":
        # a newer commit of the same path supersedes a set not yet durable, for good, even
        # if the newer one never becomes durable either); the store's sets there go when this
        # one is published. One a crashed service may have published stays possible.
        # What a commit dropped here had absorbed, this one removes (Publisher.inherit), and
        # so does what commits at or under its path or an absorbed path dropped by a content
        # change had absorbed (Publisher.inherit_superseded).
        keep, inherited = [], self.take_orphans([path, *absorb])
        for op in self.pending:
            if op[0] == "commit" and any(_at_or_under(op[1].path, p) for p in absorb + [path]):
                inherited += op[1].absorb
                if op[1].maybe_done:
                    keep.append(("maybe", op[1]))
                continue
            keep.append(op)
        self.pending = keep
        c.absorb = [(p, c.serial) for p in absorb] + inherited
        self.pending.append(("commit", c))

    def delete(self, path: str) -> None:
        """`path` is removed or renamed away: the commits at or under it are dropped, and what
        they had absorbed goes from the store with the path (Publisher.unpublish_absorbed: a
        path renamed away must not outlive the removal of its new name); so does what commits
        there dropped by a content change had absorbed."""
        keep, absorbed = [], self.take_orphans([path])
        for op in self.pending:
            if op[0] == "commit" and _at_or_under(op[1].path, path):
                absorbed += op[1].absorb
            else:
                keep.append(op)
        self.pending = keep + [("delete", path, self.next_serial(), absorbed)]

    def content_changes(self, ident: int) -> None:
        """A file's content is about to change or it is gone: commits holding it never
        publish."""
        keep = []
        for op in self.pending:
            if op[0] == "commit" and ident in op[1].ids:
                self.orphans.setdefault(op[1].path, []).extend(op[1].absorb)
                if op[1].maybe_done:
                    # It may be durable already (a crashed service may have published it),
                    # and a rewrite supersedes a set only before it is durable
                    # (docs/SEMANTICS.md "What a set goes through"): until a later commit
                    # replaces it or a deletion takes it out, the store may hold it.
                    keep.append(("maybe", op[1]))
            else:
                keep.append(op)
        self.pending = keep

    def expect_error(self, err: int, fn, *args) -> None:
        with pytest.raises(FsError) as ei:
            fn(*args)
        assert ei.value.errno == err, (ei.value, err)

    def ino(self, path: str) -> int:
        ino = self.node.resolve(path)
        assert ino is not None, path
        return ino

    def parent_and_name(self, path: str) -> tuple[int, bytes]:
        if "/" in path:
            d, n = path.rsplit("/", 1)
            return self.ino(d), n.encode()
        return ROOT_INO, path.encode()

    # -- rules: data -------------------------------------------------------------------------

    def writable(self) -> list[str]:
        return [p for p in WRITABLE if self.parent_exists(p)]

    def busy(self, path: str) -> bool:
        return any(_at_or_under(p, path) for p in self.open)

    def idle(self, paths) -> list[str]:
        """Those of `paths` that exist with nothing open at or under them."""
        return sorted(p for p in paths
                      if (p in self.files or p in self.dirs) and not self.busy(p))

    @rule(pick=st.data(), off=st.sampled_from(OFFSETS),
          data=st.binary(min_size=1, max_size=3000), then_close=st.booleans())
    def write(self, pick, off: int, data: bytes, then_close: bool) -> None:
        """pwrite at `off` (opening the file on its first write), and with `then_close` the
        close too (the usual save: most files are written and closed in one go)."""
        path = pick.draw(st.sampled_from(self.writable()))
        core = self.node.core
        if path not in self.open:
            parent, name = self.parent_and_name(path)
            if path in self.files:
                ino = self.ino(path)
                self.node.fill(ino)  # FuseOps.open: the data first, then the write-open
                res = core.open(ino, os.O_WRONLY)
                self.content_changes(self.ids[path])
            else:
                res, _node = core.create(parent, name, 0o644, O_W, 0, 0)
                self.files[path] = b""
                self.next_id += 1
                self.ids[path] = self.next_id
            self.open[path] = res.fh
        assert core.write(self.open[path], off, data) == len(data)
        SEEN["write"] += 1
        self.files[path] = pwrite(self.files[path], off, data)
        if then_close:
            self.close_path(path)

    @precondition(lambda self: any(p in self.files for p in WRITABLE))
    @rule(data=st.data(), size=st.sampled_from((0, 1, 4096, 6000)))
    def truncate(self, data, size: int) -> None:
        """truncate(2) of a path (a SETATTR, no open). A file nobody writes gets a new content
        version, complete at once: as a close, it commits a file at the top level (CacheFs.
        _closed). In a file open for writing it is part of the version being written."""
        # Of the files writes go to: in a directory committed whole (ck1, ck2), a file whose
        # set was superseded would commit on its own ("ck2/x"), which the model leaves out.
        path = data.draw(st.sampled_from([p for p in WRITABLE if p in self.files]))
        ino = self.ino(path)
        self.node.fill(ino)  # FuseOps.setattr: the data first
        self.node.core.setattr(ino, size=size)
        old = self.files[path]
        self.files[path] = old[:size] + b"\0" * max(0, size - len(old))
        SEEN["truncate"] += 1
        if path not in self.open:
            self.content_changes(self.ids[path])
            if "/" not in path and not is_temp_name(path):
                self.commit(path, [])

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def fsync(self, data) -> None:
        path = data.draw(st.sampled_from(sorted(self.open)))
        self.node.core.fsync(self.open[path], False)

    @precondition(lambda self: self.open)
    @rule(data=st.data())
    def close(self, data) -> None:
        self.close_path(data.draw(st.sampled_from(sorted(self.open))))

    def close_path(self, path: str) -> None:
        fh = self.open.pop(path)
        self.node.core.flush(fh)
        self.node.core.release(fh)
        if "/" not in path and not is_temp_name(path):
            self.commit(path, [])  # the last close of a file at the top level commits it
            SEEN["commit at close"] += 1

    # -- rules: namespace --------------------------------------------------------------------

    @rule(name=st.sampled_from(DIRS))
    def mkdir(self, name: str) -> None:
        if name in self.dirs:
            self.expect_error(errno.EEXIST, self.node.core.mkdir, ROOT_INO, name.encode(),
                              0o755, 0, 0)
            return
        self.node.core.mkdir(ROOT_INO, name.encode(), 0o755, 0, 0)
        self.dirs.add(name)

    @precondition(lambda self: self.idle(TOP_FILES))
    @rule(data=st.data())
    def rename_file(self, data) -> None:
        src = data.draw(st.sampled_from(self.idle(TOP_FILES)))
        dst = data.draw(st.sampled_from([p for p in TOP_FILES if p != src]))
        if self.busy(dst):
            return  # (renaming over a file open for writing: not modelled)
        self.node.core.rename(ROOT_INO, src.encode(), ROOT_INO, dst.encode(), 0)
        replaced = dst in self.files
        SEEN["file rename" + (" over a file" if replaced else "")] += 1
        if replaced:
            self.content_changes(self.ids[dst])
        self.files[dst] = self.files.pop(src)
        self.ids[dst] = self.ids.pop(src)
        if not is_temp_name(dst):
            self.commit(dst, [src])
        else:
            self.delete(src)
            if replaced:
                self.delete(dst)

    @precondition(lambda self: self.idle(DIRS))
    @rule(data=st.data())
    def rename_dir(self, data) -> None:
        src = data.draw(st.sampled_from(self.idle(DIRS)))
        dst = data.draw(st.sampled_from([p for p in DIRS if p != src]))
        core = self.node.core
        if dst in self.dirs and self.under(dst):
            self.expect_error(errno.ENOTEMPTY, core.rename, ROOT_INO, src.encode(), ROOT_INO,
                              dst.encode(), 0)
            return
        replaced = dst in self.dirs
        core.rename(ROOT_INO, src.encode(), ROOT_INO, dst.encode(), 0)
        self.dirs.discard(src)
        self.dirs.add(dst)
        for p in self.under(src):
            q = dst + p[len(src):]
            self.files[q] = self.files.pop(p)
            self.ids[q] = self.ids.pop(p)
        self.commit(dst, [src, dst])  # a directory renamed is committed at its new path
        SEEN["directory rename" + (" over a directory" if replaced else "")] += 1

    @rule(data=st.data())
    def remove(self, data) -> None:
        """rm -r PATH (unlink every file, then rmdir); ENOENT for a path that is not there."""
        core = self.node.core
        path = data.draw(st.sampled_from([p for p in TOP_FILES + DIRS if not self.busy(p)]))
        if path not in self.files and path not in self.dirs:
            self.expect_error(errno.ENOENT, core.unlink, ROOT_INO, path.encode())
            return
        for p in sorted(self.under(path)):
            parent, name = self.parent_and_name(p)
            core.unlink(parent, name)
            self.content_changes(self.ids.pop(p))
            del self.files[p]
            self.delete(p)
        if path in self.dirs:
            core.rmdir(ROOT_INO, path.encode())
            self.dirs.discard(path)
            self.delete(path)

    @rule(data=st.data())
    def commit_path(self, data) -> None:
        """`ckptfs commit PATH`: ENOENT if absent, EBUSY for a file open for writing. (Not of
        a directory with a file being written in it: what the set holds is then not fixed.)"""
        path = data.draw(st.sampled_from([p for p in TOP_FILES + DIRS
                                          if p in self.files or not self.busy(p)]))
        if path not in self.files and path not in self.dirs:
            self.expect_error(errno.ENOENT, self.node.t.commit_path, path)
            return
        if path in self.open:
            self.expect_error(errno.EBUSY, self.node.t.commit_path, path)
            return
        self.node.t.commit_path(path)
        self.commit(path, [path])
        SEEN["commit_path"] += 1

    # -- rules: the service, eviction, crash, a second node -----------------------------------

    def apply(self, *, maybe: bool) -> None:
        """The store after the pending work ran: all of it, in order; or (`maybe`) any part of
        it (each manifest may or may not have been written or removed yet)."""
        def put(k: str, v, surely: bool = True) -> None:
            if maybe or not surely:
                self.store.setdefault(k, {ABSENT}).add(v)
            else:
                self.store[k] = {v}

        def remove(root: str, since: int, but: str | None = None, surely: bool = True) -> None:
            """The sets at or under `root` committed before `since` go. A deletion never
            takes out a newer set's manifest (docs/SEMANTICS.md "Many nodes, one store":
            deleting a set deletes its manifest only if the store still holds the one this
            node knows; cachemgr/tiering/publish.py `_unpublish`): a commit put there later stays,
            and one a crashed service may have put there may stay."""
            for k in [k for k in self.store if _at_or_under(k, root) and k != but]:
                if self.put_serial.get(k, 0) < since:
                    put(k, ABSENT, surely=surely and self.maybe_serial.get(k, 0) < since)
        for op in self.pending:
            if op[0] == "delete":
                remove(op[1], op[2])
                for p, since in op[3]:
                    remove(p, since)
                continue
            c = op[1]
            surely = op[0] == "commit"  # else "maybe": published or not before its drop
            for p, since in c.absorb:
                remove(p, since, but=c.path, surely=surely)
            remove(c.path, c.serial, but=c.path, surely=surely)
            put(c.path, freeze(c.content), surely=surely)
            if maybe:
                c.maybe_done = True
            serials = self.put_serial if surely and not maybe else self.maybe_serial
            serials[c.path] = max(serials.get(c.path, 0), c.serial)
        if not maybe:
            self.pending = []

    @precondition(lambda self: not self.open)
    @rule()
    def settle(self) -> None:
        self.node.settle()
        SEEN["settle with work"] += bool(self.pending)
        self.apply(maybe=False)

    @precondition(lambda self: not self.open and self.pending)
    @rule(budget=st.integers(0, 8))
    def crash_in_service(self, budget: int) -> None:
        """The service runs until it has made `budget` store writes, and the daemon dies there:
        whatever it did so far, every set in the store is whole (checked by `restore` once the
        pending work is done)."""
        # Whether it stopped there or finished depends on the trio scheduler: the model does
        # not ask (hypothesis replays must draw alike), it allows either.
        SEEN["crash in the service"] += self.node.settle(budget)
        self.apply(maybe=True)
        self.crash_now()

    @rule(pick=st.integers(0, 3), then_read=st.booleans(), off=st.sampled_from(OFFSETS))
    def evict(self, pick: int, then_read: bool, off: int) -> None:
        """Evict uploaded data; with `then_read`, read 100 bytes of it back at `off` (a chunk
        fill from the store)."""
        # (What is uploaded after a crash inside the service depends on the trio scheduler:
        # no precondition may depend on it, or hypothesis's replays diverge.)
        cands = self.node.core.cache.residency.eviction_candidates()
        if cands:
            ino, version = cands[pick % len(cands)]
            assert self.node.core.cache.residency.evict(ino, version)
            SEEN["evict"] += 1
            if then_read:
                path = next(p for p in self.files if self.node.resolve(p) == ino)
                SEEN["read of evicted data"] += 1
                got = self.node.read(ino, off, 100)
                assert got == self.files[path][off:off + 100], path

    @precondition(lambda self: self.files)
    @rule(data=st.data(), off=st.sampled_from(OFFSETS), size=st.sampled_from((1, 100, 5000)))
    def read(self, data, off: int, size: int) -> None:
        path = data.draw(st.sampled_from(sorted(self.files)))
        want = self.files[path][off:off + size]
        SEEN["read of evicted data"] += self.node.core.cache.residency.needs_fetch(self.ino(path))
        assert self.node.read(self.ino(path), off, size) == want, path

    @precondition(lambda self: self.open or self.pending)
    @rule()
    def crash(self) -> None:
        self.crash_now()

    def crash_now(self) -> None:
        SEEN["crash" + (" with writers" if self.open else "") +
             (" with work pending" if self.pending else "")] += 1
        self.node.crash()
        self.open.clear()  # the writers died with the daemon; their data is in the page cache
        for op in self.pending:
            if op[0] in ("commit", "maybe"):
                op[1].absorb = []  # Publisher._absorb is in memory
        self.orphans.clear()
        self.node = Node(self.root / "cache", self.root / "store")
        self.node.core.cache.recover()
        # The mount: the service's recovery runs before the first request is served (a file
        # open for writing at the crash supersedes the sets holding it). No object or manifest
        # is written here (budget 0): that is for `settle`.
        self.node.settle(budget=0)

    @precondition(lambda self: not self.open)
    @rule()
    def restore(self) -> None:
        """Settle, then a second node lists the store once."""
        if self.pending:
            self.settle()
        self.restores += 1
        other = Node(self.root / f"node{self.restores}", self.root / "store")
        try:
            trio.run(other.t.remote.sync_once)
            seen = other.tree(fetch=True)
            assert other.core.check_consistency() == []
        finally:
            other.core.close()
        for k in set(seen) | set(self.store):
            got = freeze(seen.get(k, ABSENT))
            assert got in self.store.get(k, {ABSENT}), (
                k, got, self.store.get(k), [(r.seq, r.path, r.state, r.reason, r.error)
                                            for r in self.node.sets.recent(100)])
        SEEN["restore of sets"] += bool(seen)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def tree_matches(self) -> None:
        if not hasattr(self, "node"):
            return
        want: dict = {}
        for d in self.dirs:
            want[d] = {}
        for p, data in self.files.items():
            if "/" in p:
                d, n = p.split("/", 1)
                want[d][n] = data
            else:
                want[p] = data
        got = self.node.tree(fetch=False)

        def cmp(g: dict, w: dict, where: str) -> None:
            assert sorted(g) == sorted(w), (where, sorted(g), sorted(w))
            for k, v in g.items():
                if isinstance(v, dict):
                    cmp(v, w[k], f"{where}/{k}")
                elif isinstance(v, tuple):  # evicted: its size, the bytes are in the store
                    assert v[1] == len(w[k]), (where, k)
                else:
                    assert v == w[k], (where, k, len(v), len(w[k]))
        cmp(got, want, "")

    @invariant()
    def consistent(self) -> None:
        SEEN["step"] += 1
        if hasattr(self, "node"):
            assert self.node.core.check_consistency() == []


class _Tmp:
    """Temporary directories of one test (set by the test: pytest's tmp_path)."""

    base: Path | None = None
    n = 0

    def mkdtemp(self) -> str:
        assert self.base is not None
        self.n += 1
        d = self.base / f"run{self.n}"
        d.mkdir()
        return str(d)


TMP = _Tmp()

# No shrinking unless asked (CKPTFS_REFTEST_SHRINK=1): a failure prints its whole sequence, which
# the derandomized run reproduces; shrinking one of these sequences can take longer than the
# test's timeout, and a timeout inside trio.run leaves the process unable to run trio again.
REFTEST = settings(max_examples=int(os.environ.get("CKPTFS_REFTEST_EXAMPLES", "30")),
                   stateful_step_count=50,
                   derandomize=not os.environ.get("CKPTFS_REFTEST_RANDOM"), database=None,
                   deadline=None,
                   phases=tuple(Phase) if os.environ.get("CKPTFS_REFTEST_SHRINK")
                   else (Phase.explicit, Phase.generate),
                   suppress_health_check=[HealthCheck.too_slow,
                                          HealthCheck.filter_too_much])


@pytest.fixture
def fast_tmp(tmp_path):
    """A temporary directory in memory where the machine has one (/dev/shm): the machine's
    steps fsync the index and cache files, which says nothing here and costs seconds on a
    busy disk."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(prefix="ckptfs-reftest-", dir=shm))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_core_reftest(fast_tmp):
    TMP.base, TMP.n = fast_tmp, 0
    SEEN.clear()
    run_state_machine_as_test(CoreMachine, settings=REFTEST)
    print(dict(SEEN))
    if os.environ.get("CKPTFS_REFTEST_RANDOM"):
        return  # what a random run covers is not known in advance
    for what in ("commit at close", "file rename over a file", "directory rename",
                 "commit_path", "settle with work", "evict", "read of evicted data",
                 "crash with writers", "crash with work pending", "crash in the service",
                 "restore of sets"):
        # (by prefix: "crash with writers with work pending" is a crash with writers too)
        assert sum(n for k, n in SEEN.items() if k.startswith(what)) > 0, (what, dict(SEEN))


# ----------------------------------------------------------------------------------------------
# random runs for a time budget: new sequences in every CI run, each seed printed for a replay

# Seconds of random examples (CKPTFS_REFTEST_BUDGET_S raises it for long runs and the fault loop),
# examples per seed, and one seed to replay (then the budget is not used).
BUDGET_S = float(os.environ.get("CKPTFS_REFTEST_BUDGET_S", "75"))
SEED_EXAMPLES = int(os.environ.get("CKPTFS_REFTEST_SEED_EXAMPLES", "25"))
REPLAY_SEED = os.environ.get("CKPTFS_REFTEST_SEED")
REPO = Path(__file__).resolve().parents[2]


def replay_command(seed: int, examples: int) -> str:
    """The command that runs exactly what seed `seed` ran (add --shrink to shrink it: no
    pytest timeout applies to it)."""
    return (f"cd {REPO} && {sys.executable} -m tests.unit.test_core_reftest --seed {seed}"
            f" --examples {examples}")


def random_runs(base: Path, *, seconds: float, examples: int, seed: int | None = None,
                shrink: bool = False) -> int:
    """Run the machine, `examples` examples per seed, with fresh random seeds until `seconds`
    have passed (or with `seed` alone). Every seed is printed before it runs; the first one
    that fails ends the runs with its replay command. 0 if none failed, else 1."""
    deadline = time.monotonic() + seconds
    rng = random.SystemRandom()
    n_seeds = n_examples = n_steps = 0
    while True:
        s = seed if seed is not None else rng.getrandbits(32)
        print(f"reftest seed {s}: {examples} examples; replay: {replay_command(s, examples)}",
              flush=True)
        TMP.base, TMP.n = Path(tempfile.mkdtemp(prefix=f"seed{s}-", dir=base)), 0
        SEEN.clear()
        machine = hypothesis.seed(s)(type("CoreMachineSeeded", (CoreMachine,), {}))
        t0 = time.monotonic()
        try:
            run_state_machine_as_test(machine, settings=settings(
                REFTEST, max_examples=examples, derandomize=False, print_blob=True,
                phases=tuple(Phase) if shrink else (Phase.explicit, Phase.generate)))
        except Exception:  # noqa: BLE001 - any failure of a seed: reported with the seed
            traceback.print_exc()
            print(f"reftest seed {s}: FAILED in example {SEEN['example']} after"
                  f" {time.monotonic() - t0:.0f}s; replay: {replay_command(s, examples)}",
                  flush=True)
            return 1
        finally:
            shutil.rmtree(TMP.base, ignore_errors=True)
        n_seeds += 1
        n_examples += SEEN["example"]
        n_steps += SEEN["step"]
        print(f"reftest seed {s}: ok, {SEEN['example']} examples, {SEEN['step']} steps in"
              f" {time.monotonic() - t0:.0f}s", flush=True)
        if seed is not None or time.monotonic() >= deadline:
            break
    print(f"reftest: {n_seeds} seeds, {n_examples} examples, {n_steps} steps, no failure",
          flush=True)
    return 0


@pytest.mark.slow  # tens of seconds: not in scripts/test.sh --quick
@pytest.mark.timeout(max(300, BUDGET_S + 240))
def test_core_reftest_random(fast_tmp):
    """The machine with random seeds for CKPTFS_REFTEST_BUDGET_S seconds (default 75): new
    sequences in every run, where the derandomized test repeats the same ones. It runs in a
    child process (`python -m tests.unit.test_core_reftest`): a run stopped half-way (its own time
    limit, or a hang) is killed there, and never inside this process's trio.run, which a
    timeout there once left unable to run trio (every later in-process test failed). Every
    seed is printed with the command that replays it; a failure names its seed."""
    cmd = [sys.executable, "-m", "tests.unit.test_core_reftest", "--base", str(fast_tmp),
           "--seconds", str(BUDGET_S), "--examples", str(SEED_EXAMPLES)]
    if REPLAY_SEED:
        cmd += ["--seed", REPLAY_SEED]
    limit = BUDGET_S + 180  # past the budget: the seed under way, then the report
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:  # killed: the seed under way hung
        out, rc = _text(e.stdout) + _text(e.stderr), None
    seeds = [line for line in out.splitlines() if line.startswith("reftest")]
    print("\n".join(seeds))
    if rc == 0:
        return
    started = [line.split()[2].rstrip(":") for line in seeds if "examples; replay:" in line]
    what = "failed" if rc is not None else f"did not finish within {limit:.0f}s"
    pytest.fail(f"random reftest seed {started[-1] if started else '?'} {what}: replay with"
                f" the command printed for it (add --shrink to shrink)\n{out[-20000:]}")


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _main() -> int:
    p = argparse.ArgumentParser(description="random runs of CoreMachine (see random_runs)")
    p.add_argument("--seconds", type=float, default=BUDGET_S)
    p.add_argument("--examples", type=int, default=SEED_EXAMPLES)
    p.add_argument("--seed", type=int, help="run this seed only")
    p.add_argument("--shrink", action="store_true", help="shrink a failure (may take long)")
    p.add_argument("--base", type=Path, help="for the temporary directories (else /dev/shm)")
    a = p.parse_args()
    shm = Path("/dev/shm")
    base = a.base or (shm if shm.is_dir() and os.access(shm, os.W_OK) else None)
    base = Path(tempfile.mkdtemp(prefix="ckptfs-reftest-", dir=base))
    try:
        return random_runs(base, seconds=a.seconds, examples=a.examples, seed=a.seed,
                           shrink=a.shrink)
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# what the machine found, as plain tests


def seen_by_another_node(tmp: Path) -> list[str]:
    """The top-level names a second node shows after one listing of the store in `tmp`."""
    other = Node(tmp / "other", tmp / "store")
    try:
        trio.run(other.t.remote.sync_once)
        return sorted(other.entries(ROOT_INO))
    finally:
        other.core.close()


def test_renamed_away_path_leaves_the_store_when_the_rename_commit_is_superseded(fast_tmp):
    node = Node(fast_tmp / "cache", fast_tmp / "store")
    try:
        res, _ = node.core.create(ROOT_INO, b"b", 0o644, O_W, 0, 0)
        node.core.write(res.fh, 0, b"v1")
        node.core.release(res.fh)  # commits b
        node.settle()
        assert node.sets.newest_at("b").state == "durable"
        node.core.rename(ROOT_INO, b"b", ROOT_INO, b"a", 0)  # commits a, absorbing b
        node.t.commit_path("a")  # a later commit of a: the rename's set is superseded
        node.settle()
        assert node.sets.newest_at("a").state == "durable"
        seen = seen_by_another_node(fast_tmp)
        assert seen == ["a"], seen  # the writer has no b; the store still shows it
    finally:
        node.core.close()


@pytest.mark.parametrize("then", ["rewrite", "rename-again"])
def test_renamed_away_path_leaves_the_store_when_the_rename_set_never_becomes_durable(
        fast_tmp, then):
    """The same loss by the two other ways a rename's set can end before it is durable: its
    file is rewritten (its content changes, then its last close commits the path again), or
    it is renamed on (the next rename's set absorbs it). Either way `b`, renamed away, must
    leave the store once what replaced the rename is durable."""
    node = Node(fast_tmp / "cache", fast_tmp / "store")
    try:
        res, _ = node.core.create(ROOT_INO, b"b", 0o644, O_W, 0, 0)
        node.core.write(res.fh, 0, b"v1")
        node.core.release(res.fh)
        node.settle()
        node.core.rename(ROOT_INO, b"b", ROOT_INO, b"a", 0)  # commits a, absorbing b
        if then == "rewrite":
            ino = node.core.lookup(ROOT_INO, b"a").ino
            res = node.core.open(ino, os.O_WRONLY)
            node.core.write(res.fh, 0, b"v2")
            node.core.release(res.fh)  # a new content of a, committed at its close
            want = ["a"]
        else:
            node.core.rename(ROOT_INO, b"a", ROOT_INO, b"c", 0)  # commits c, absorbing a
            want = ["c"]
        node.settle()
        seen = seen_by_another_node(fast_tmp)
        assert seen == want, seen
    finally:
        node.core.close()


def write_top(node: Node, name: bytes, data: bytes, *, close: bool = True) -> int | None:
    """Write `data` at offset 0 of top-level file `name` (created if absent, else opened for
    writing without O_TRUNC); the fh if not `close`d."""
    try:
        ino = node.core.lookup(ROOT_INO, name).ino
    except FsError:
        res, _ = node.core.create(ROOT_INO, name, 0o644, O_W, 0, 0)
    else:
        node.fill(ino)
        res = node.core.open(ino, os.O_WRONLY)
    node.core.write(res.fh, 0, data)
    if not close:
        return res.fh
    node.core.flush(res.fh)
    node.core.release(res.fh)
    return None


@pytest.mark.parametrize("then", ["close", "crash-while-writing"])
def test_a_set_committed_by_request_and_rewritten_before_it_is_durable_is_not_published(
        fast_tmp, then):
    """Shape (c) of the random runs: `ckptfs commit t.tmp` of a file whose content was already
    uploaded (closed, then the service ran), then a rewrite of t.tmp before the set is durable.
    A rewrite supersedes the set (docs/SEMANTICS.md "What a set goes through"); the store
    published it all the same, with the content the file no longer has, because the rewrite
    superseded only sets still waiting for the upload of the old content. (t.tmp is a
    temporary name: its close commits nothing, so nothing ever replaced that manifest.)"""
    node = Node(fast_tmp / "cache", fast_tmp / "store")
    try:
        write_top(node, b"t.tmp", b"v1")
        node.settle()  # v1 is uploaded; no set holds it
        node.t.commit_path("t.tmp")  # a set whose objects are all in: queued for publication
        fh = write_top(node, b"t.tmp", b"v2", close=then == "close")
        if then == "crash-while-writing":
            assert fh is not None
            node.crash()
            node = Node(fast_tmp / "cache", fast_tmp / "store")
            node.core.cache.recover()
        node.settle()
        assert node.sets.newest_at("t.tmp").state == "superseded"
        seen = seen_by_another_node(fast_tmp)
        assert seen == [], seen
    finally:
        with contextlib.suppress(sqlite3.ProgrammingError):
            node.core.close()




def test_a_file_renamed_into_place_and_rewritten_before_its_set_is_durable_keeps_the_old_set(
        fast_tmp):
    """Random seeds 2360012042 and 2110877611 (60 examples): the same with a set committed by a
    rename (torch.save's `t.tmp` -> `b`) of a file whose content was uploaded, then `b` opened
    for writing and the daemon killed. The rename's set was published all the same, and a
    second node showed that content at `b`; the rewrite superseded it, so the store keeps the
    `b` it had (docs/SEMANTICS.md "What a set goes through")."""
    node = Node(fast_tmp / "cache", fast_tmp / "store")
    try:
        write_top(node, b"b", b"old b")
        write_top(node, b"t.tmp", b"new b")
        node.settle()  # b durable; t.tmp uploaded, in no set
        node.core.rename(ROOT_INO, b"t.tmp", ROOT_INO, b"b", 0)  # commits b: all uploaded
        assert write_top(node, b"b", b"NEW", close=False) is not None
        node.crash()
        node = Node(fast_tmp / "cache", fast_tmp / "store")
        node.core.cache.recover()
        node.settle()
        other = Node(fast_tmp / "other", fast_tmp / "store")
        try:
            trio.run(other.t.remote.sync_once)
            assert other.read(other.resolve("b")) == b"old b"
        finally:
            other.core.close()
    finally:
        with contextlib.suppress(sqlite3.ProgrammingError):
            node.core.close()


@pytest.mark.parametrize("then", ["remove", "rename-to-a-temporary-name"])
def test_renamed_away_path_leaves_the_store_when_its_new_name_goes_before_it_is_durable(
        fast_tmp, then):
    """Shape (a) of the random runs (seed 2275615589, 25 examples): `b` durable, renamed to
    `a` (a commits, absorbing b), then `a` removed (or renamed to a temporary name, which
    commits nothing) before the rename's set is durable. The rename's set is deleted, and
    what it was to take from the store once durable went with it: `b` stayed in the store
    for good, a checkpoint shown by every other node that no tree holds any more (nothing
    could remove it through this mount)."""
    node = Node(fast_tmp / "cache", fast_tmp / "store")
    try:
        write_top(node, b"b", b"v1")
        node.settle()
        assert node.sets.newest_at("b").state == "durable"
        node.core.rename(ROOT_INO, b"b", ROOT_INO, b"a", 0)  # commits a, absorbing b
        if then == "remove":
            node.core.unlink(ROOT_INO, b"a")
        else:
            node.core.rename(ROOT_INO, b"a", ROOT_INO, b"t.tmp", 0)
        node.settle()
        seen = seen_by_another_node(fast_tmp)
        assert seen == [], seen
    finally:
        node.core.close()


def write_in(node: Node, d: bytes, name: bytes, data: bytes) -> None:
    """Create or rewrite (without O_TRUNC) top-level directory `d`'s file `name`, and close."""
    dino = node.core.lookup(ROOT_INO, d).ino
    try:
        ino = node.core.lookup(dino, name).ino
    except FsError:
        res, _ = node.core.create(dino, name, 0o644, O_W, 0, 0)
    else:
        res = node.core.open(ino, os.O_WRONLY)
    node.core.write(res.fh, 0, data)
    node.core.flush(res.fh)
    node.core.release(res.fh)


@pytest.mark.parametrize("then", ["remove", "rename-on"])
def test_renamed_away_directory_leaves_the_store_after_a_rewrite_supersedes_the_rename(
        fast_tmp, then):
    """The same loss when the rename's set ends by a rewrite of one of its files: `ck1`
    durable, renamed to `ck.tmp` (ck.tmp commits, absorbing ck1), `ck.tmp/x` rewritten (the
    set is superseded: what it absorbed waits for the next commit of ck.tmp), then ck.tmp
    removed, or renamed on to `ck2` (which commits ck2, absorbing ck.tmp). Neither took what
    the superseded set had absorbed: ck1 stayed in the store."""
    node = Node(fast_tmp / "cache", fast_tmp / "store")
    try:
        node.core.mkdir(ROOT_INO, b"ck1", 0o755, 0, 0)
        write_in(node, b"ck1", b"x", b"v1")
        node.t.commit_path("ck1")
        node.settle()
        assert node.sets.newest_at("ck1").state == "durable"
        node.core.rename(ROOT_INO, b"ck1", ROOT_INO, b"ck.tmp", 0)  # commits ck.tmp
        write_in(node, b"ck.tmp", b"x", b"v2")  # supersedes it
        assert node.sets.newest_at("ck.tmp").state == "superseded"
        if then == "remove":
            dino = node.core.lookup(ROOT_INO, b"ck.tmp").ino
            node.core.unlink(dino, b"x")
            node.core.rmdir(ROOT_INO, b"ck.tmp")
            want = []
        else:
            node.core.rename(ROOT_INO, b"ck.tmp", ROOT_INO, b"ck2", 0)  # commits ck2
            want = ["ck2"]
        node.settle()
        seen = seen_by_another_node(fast_tmp)
        assert seen == want, seen
    finally:
        node.core.close()



# -- sequences of the machine itself, replayed step by step -------------------------------------


class Draws:
    """The values a rule draws from its `st.data()` argument, in order (a sequence the machine
    ran, replayed without hypothesis). Each must be one the rule could have drawn."""

    def __init__(self, *values) -> None:
        self.values = list(values)

    def draw(self, strategy, label=None):
        value = self.values.pop(0)
        elements = getattr(strategy, "elements", None)
        assert elements is None or value in elements, (value, elements)
        return value


def replay(tmp: Path, steps: list[tuple[str, dict]]) -> CoreMachine:
    """Run `steps` ((rule name, its arguments)) on a CoreMachine as hypothesis runs a
    sequence: the invariants after the start and after every step, teardown at the end."""
    TMP.base, TMP.n = tmp, 0
    machine = CoreMachine()
    try:
        machine.start()
        for name, kwargs in [("", {}), *steps]:
            if name:
                getattr(machine, name)(**kwargs)
            machine.consistent()
            machine.tree_matches()
    finally:
        machine.teardown()
    return machine


def test_model_a_path_a_rename_absorbed_keeps_what_is_committed_there_later(fast_tmp):
    """Random seed 1293966045 (60 examples), a fault of the model: `ck2` renamed to `ck1`
    (ck1's commit absorbs the path ck2), `ck.tmp` renamed to a new `ck2`, then `ck1` renamed
    to `ck.tmp` before anything was durable (ck.tmp's commit takes over what ck1's had
    absorbed). The model, which recorded absorbed *paths*, removed the new ck2 from the store
    with them; the product absorbs *sets* (cachemgr/tiering/commit.py: the sets at the path at the
    commit), and a deletion never takes out a newer set's manifest (cachemgr/tiering/publish.py
    `_unpublish`), so ck2 stays (docs/SEMANTICS.md "What the store guarantees": the store
    shows every durable set). The model now records when a path was absorbed."""
    replay(fast_tmp, [
        ("mkdir", {"name": "ck2"}),
        ("mkdir", {"name": "ck.tmp"}),
        ("rename_dir", {"data": Draws("ck2", "ck1")}),
        ("mkdir", {"name": "ck2"}),
        ("rename_dir", {"data": Draws("ck.tmp", "ck2")}),
        ("rename_dir", {"data": Draws("ck1", "ck.tmp")}),
        ("restore", {}),
    ])



def test_model_a_path_a_rewritten_rename_absorbed_keeps_what_is_committed_there_later(fast_tmp):
    """Random seeds 3149713760 and 730230201 (60 examples): the same fault of the model by the
    way of a rewrite. `t.tmp` renamed to `b`, `b` renamed to `a` (a's commit absorbs b), a new
    `b` written (committed), then `a` truncated: its rename's set is superseded and the commit
    of the truncate takes over what it had absorbed, the path b among it. The model removed
    the new b with it when that commit was applied; the product's absorbed set at b is the
    one the rename took (superseded, never durable), and the new b stays."""
    replay(fast_tmp, [
        ("write", {"pick": Draws("t.tmp"), "off": 0, "data": b"v1", "then_close": True}),
        ("rename_file", {"data": Draws("t.tmp", "b")}),
        ("rename_file", {"data": Draws("b", "a")}),
        ("write", {"pick": Draws("b"), "off": 0, "data": b"v2", "then_close": True}),
        ("truncate", {"data": Draws("a"), "size": 1}),
        ("settle", {}),
        ("restore", {}),
    ])


def test_model_a_deletion_left_pending_by_a_crash_spares_a_set_published_after_it(fast_tmp):
    """Random seed 2309853593 (60 examples), a fault of the model: `b` durable, renamed to
    t.tmp (its set deleted) and back (b committed again), the service killed after it had
    done both (the manifest deleted, the new one published), then `b` rewritten. The model
    kept the deletion pending (it could not know it was done), dropped the commit after it
    (the rewrite), and applied the deletion again at the next settle: b absent. The product
    shows the commit, durable before the rewrite (a rewrite supersedes only a set not yet
    durable, docs/SEMANTICS.md "What a set goes through"), and a deletion never takes out a
    newer set's manifest (cachemgr/tiering/publish.py `_unpublish`)."""
    replay(fast_tmp, [
        ("write", {"pick": Draws("b"), "off": 0, "data": b"v1", "then_close": True}),
        ("settle", {}),
        ("rename_file", {"data": Draws("b", "t.tmp")}),
        ("rename_file", {"data": Draws("t.tmp", "b")}),
        ("crash_in_service", {"budget": 8}),
        ("write", {"pick": Draws("b"), "off": 0, "data": b"v2", "then_close": False}),
        ("crash", {}),
        ("restore", {}),
    ])


def test_model_a_deletion_left_pending_by_a_crash_spares_a_set_absorbed_after_it(fast_tmp):
    """Random seed 1030344987 (60 examples), the same fault of the model by another way: the
    commit after the pending deletion is absorbed by a rename (ck2 -> ck1) instead of
    rewritten, and a crash then forgets what the rename's set was to take from the store
    (cachemgr/tiering/publish.py: `_absorb` is in memory, "visible, never torn"). ck2, published by
    the crashed service, stays; the model applied the deletion again and said absent."""
    replay(fast_tmp, [
        ("mkdir", {"name": "ck2"}),
        ("commit_path", {"data": Draws("ck2")}),
        ("settle", {}),
        ("remove", {"data": Draws("ck2")}),
        ("mkdir", {"name": "ck2"}),
        ("commit_path", {"data": Draws("ck2")}),
        ("crash_in_service", {"budget": 8}),
        ("rename_dir", {"data": Draws("ck2", "ck1")}),
        ("crash", {}),
        ("restore", {}),
    ])


def test_model_a_later_commit_of_a_path_supersedes_an_earlier_one_for_good(fast_tmp):
    """Random seed 48732167 (25 examples), a fault of the model (shape (b) of the issue: a set
    the model holds durable is not in the store): `ckptfs commit ck.tmp` (empty), a file
    written in it, `ckptfs commit ck.tmp` again, then that file rewritten. The model kept the
    first commit pending behind the second (the later one would overwrite it), so when the
    rewrite dropped the second, the first came back: ck.tmp = {} in the store. A newer commit
    of the same path supersedes the earlier one for good (docs/SEMANTICS.md "What a set goes
    through"), and the rewrite supersedes the newer: nothing of ck.tmp is published."""
    replay(fast_tmp, [
        ("mkdir", {"name": "ck.tmp"}),
        ("commit_path", {"data": Draws("ck.tmp")}),
        ("write", {"pick": Draws("ck.tmp/x"), "off": 0, "data": b"v1", "then_close": True}),
        ("commit_path", {"data": Draws("ck.tmp")}),
        ("write", {"pick": Draws("ck.tmp/x"), "off": 0, "data": b"v2", "then_close": True}),
        ("restore", {}),
    ])


def test_the_recorded_failure_of_a_request_commit_rewritten_before_it_is_durable(fast_tmp):
    """The failure recorded in the issue (hypothesis 6.170.17, `@reproduce_failure` blob
    'AXicNU+xDcJADLTzHyAkhAakLMAY...'), step by step: t.tmp (b's content, b renamed to it) is
    committed by `ckptfs commit`, then rewritten; with crashes and other sets in between, a
    second node showed t.tmp with the content of the commit the rewrite had superseded
    (test_a_set_committed_by_request_and_rewritten_before_it_is_durable_is_not_published)."""
    w = "write"
    replay(fast_tmp, [
        ("mkdir", {"name": "ck2"}),
        ("rename_dir", {"data": Draws("ck2", "ck.tmp")}),
        (w, {"pick": Draws("b"), "off": 1, "then_close": False,
             "data": b"\x91=\x05\xfdY\xff\xbf\x0cn\xeeq\xb2\xe9\xc8\xb8\x9e"}),
        (w, {"pick": Draws("b"), "off": 1, "then_close": True, "data": b"?\x7f"}),
        ("crash_in_service", {"budget": 8}),
        ("mkdir", {"name": "ck.tmp"}),
        ("evict", {"off": 0, "pick": 2, "then_read": True}),
        ("rename_file", {"data": Draws("b", "t.tmp")}),
        ("rename_dir", {"data": Draws("ck.tmp", "ck1")}),
        ("rename_dir", {"data": Draws("ck1", "ck2")}),
        ("rename_dir", {"data": Draws("ck2", "ck1")}),
        ("crash", {}),
        ("crash_in_service", {"budget": 0}),
        ("crash_in_service", {"budget": 2}),
        ("commit_path", {"data": Draws("t.tmp")}),
        (w, {"pick": Draws("t.tmp"), "off": 1, "then_close": True, "data": b"\x04\xa2"}),
        ("rename_dir", {"data": Draws("ck1", "ck2")}),
        (w, {"pick": Draws("t.tmp"), "off": 4096, "then_close": False,
             "data": b"\x14\xe1\x0f\x15\xe2\x18\x82\x18\xd6\xac\xffF\xad\xbb"}),
        ("crash", {}),
        ("evict", {"off": 4096, "pick": 2, "then_read": False}),
        ("truncate", {"data": Draws("t.tmp"), "size": 6000}),
        ("truncate", {"data": Draws("t.tmp"), "size": 6000}),
        ("crash", {}),
        ("commit_path", {"data": Draws("ck2")}),
        ("truncate", {"data": Draws("t.tmp"), "size": 1}),
        ("evict", {"off": 5000, "pick": 0, "then_read": True}),
        ("read", {"data": Draws("t.tmp"), "off": 4095, "size": 1}),
        ("commit_path", {"data": Draws("ck1")}),
        ("evict", {"off": 1, "pick": 2, "then_read": False}),
        ("evict", {"off": 5000, "pick": 1, "then_read": True}),
        (w, {"pick": Draws("b"), "off": 4095, "then_close": True, "data": b"\x9a[%\xef"}),
        ("settle", {}),
        ("restore", {}),
    ])


if __name__ == "__main__":
    sys.exit(_main())
