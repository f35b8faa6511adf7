"""The cache index: the tree and per-inode metadata of one cache directory, in SQLite.

Owns `index.sqlite` in the cache directory, and every SQL statement on its `meta`, `inodes`,
`dentries` and `xattrs` tables: other modules ask the methods here (the tree questions in
`TreeQueries`, the per-inode content ones in `ContentQueries`) and write no SQL of their own on
those tables. The `sets`, `set_files` and `objects` tables are `cachemgr.core.sets.SetRegistry`'s
(same connection, same transactions). `schema.sql` beside this file is the reference for
the layout; `LAYOUT_VERSION` must match its header and `PRAGMA user_version`.

Concurrency: one `Index` per daemon, used only from the trio thread that runs the FUSE loop, so
there is no locking here. The cache-dir lock (see `ckptfs.mount`) guarantees one daemon per index.

Crash contract: every public mutating method runs inside `tx()`, which commits one transaction;
SQLite's WAL makes each transaction all-or-nothing across a crash of the daemon. `sync()` makes
every committed transaction durable across a crash of the machine. Callers tie their in-memory
state to a transaction with `on_rollback()` (undo, run exactly when it rolls back) and
`after_commit()` (run once it committed), see `cachemgr.core.inodes.InodeTable.tx`.

A full cache disk: the index owns `index.reserve` beside `index.sqlite`, a preallocated file of
`RESERVE_BYTES` (created at open). When SQLite reports SQLITE_FULL ("database or disk is full"),
`tx()` rolls the transaction back, deletes the reserve and raises `IndexFull(released=True)`: the
caller runs its operation again, and the index now has room for its writes. That is what lets
a user delete an old checkpoint to make room on a full disk (an unlink is an index write before
it frees anything). SQLITE_FULL with no reserve left raises `IndexFull(released=False)`, ENOSPC
to the caller. The reserve is made again after a commit that finds the space back.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from cachemgr.core.errors import IndexError_, IndexFull
from cachemgr.format.names import escape_name, unescape_name
from cachemgr.host.nodefiles import FILE_MODE, fsync_dir, open_private, restrict

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
# schema.sql's index of the inodes' object keys, for caches made before it (Index._add_indexes)
OBJ_KEY_INDEX = ("CREATE INDEX IF NOT EXISTS inodes_by_obj_key ON inodes(json_extract(obj, "
                 "'$.key')) WHERE obj IS NOT NULL")
# ... and of the sets by their root inode (SetRegistry.dir_set_of, asked at every close in a
# directory: without it a scan of every set the index holds)
SETS_BY_ROOT_INDEX = "CREATE INDEX IF NOT EXISTS sets_by_root ON sets(root_ino, seq)"
# ... the entries of a directory named `*.distcp` (SetRegistry.is_dcp_dir, asked at every close
# in a directory: without it O(entries of the directory) per close), a partial index on the
# suffix has_entry_like looks for; and the objects by content (SetRegistry.object_key at every
# upload, the candidates of an incremental GC pass: without it a scan of every object)
INDEXED_SUFFIX = ".distcp"
DENTRIES_SUFFIX_INDEX = ("CREATE INDEX IF NOT EXISTS dentries_distcp ON dentries(parent) WHERE"
                         f" CAST(name AS TEXT) LIKE '%{INDEXED_SUFFIX}'")
OBJECTS_BY_CONTENT_INDEX = ("CREATE INDEX IF NOT EXISTS objects_by_content ON"
                            " objects(ino, version)")
ROOT_INO = 1

# Room kept for the index's own writes on a full cache disk. The WAL is reused from its start
# after every checkpoint, so it allocates new blocks only while it grows towards the
# auto-checkpoint size: 1000 frames of 4 KiB pages + 24 B headers = 3.9 MiB (SQLite's defaults;
# it starts empty at every mount, `close()` truncates it). A checkpoint then copies those pages
# into `index.sqlite`, which grows by at most as many pages when they are new (3.9 MiB more).
# 8 MiB covers both, so the transactions that follow a release (an unlink, rmdir, rename of an
# old checkpoint: a few dozen pages each) fit with plenty to spare, while costing under 0.01%
# of a 100 GiB cache disk. A single transaction larger than that (a commit of a set of tens of
# thousands of files) can still fail with ENOSPC when the disk is full.
RESERVE_BYTES = 8 << 20
RESERVE_NAME = "index.reserve"
SQLITE_FULL = 13  # sqlite3.h; sqlite_errorcode & 0xff is the primary result code

INODE_COLUMNS = (
    "ino", "mode", "uid", "gid", "size", "atime_ns", "mtime_ns", "ctime_ns", "nlink", "rdev",
    "target", "version", "writing", "cached",
)
_INODE_SELECT = "SELECT " + ", ".join(INODE_COLUMNS) + " FROM inodes"
_FIELDS = frozenset((*INODE_COLUMNS, "obj", "obj_version", "present"))


class TreeQueries:
    """The directory-entry half of `Index` (a mixin without state of its own: the connection
    and its transactions are Index's). Every question about the tree is answered here, once:
    lookup, resolve, path_of, parent_of, dentry_of, is_ancestor, children, walk. Every other
    module asks these methods; none writes SQL on `dentries` of its own."""

    conn: sqlite3.Connection

    def lookup(self, parent: int, name: bytes) -> int | None:
        row = self.conn.execute(
            "SELECT ino FROM dentries WHERE parent=? AND name=?", (parent, name)
        ).fetchone()
        return row[0] if row else None

    def resolve(self, path: str) -> int | None:
        """The inode at `path` (escaped form, cachemgr.format.names; "" is the root), or None."""
        ino = ROOT_INO
        for part in path.split("/") if path else ():
            child = self.lookup(ino, unescape_name(part))
            if child is None:
                return None
            ino = child
        return ino

    def add_dentry(self, parent: int, name: bytes, ino: int) -> None:
        self.conn.execute(
            "INSERT INTO dentries (parent, name, ino) VALUES (?, ?, ?)", (parent, name, ino)
        )

    def remove_dentry(self, parent: int, name: bytes) -> None:
        self.conn.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))

    def move_dentry(self, parent: int, name: bytes, new_parent: int, new_name: bytes) -> None:
        self.conn.execute(
            "UPDATE dentries SET parent=?, name=? WHERE parent=? AND name=?",
            (new_parent, new_name, parent, name),
        )

    def set_dentry_ino(self, parent: int, name: bytes, ino: int) -> None:
        self.conn.execute(
            "UPDATE dentries SET ino=? WHERE parent=? AND name=?", (ino, parent, name)
        )

    def list_dentries(self, parent: int, after_id: int, limit: int) -> list[tuple[int, bytes, int]]:
        return self.conn.execute(
            "SELECT id, name, ino FROM dentries WHERE parent=? AND id>? ORDER BY id LIMIT ?",
            (parent, after_id, limit),
        ).fetchall()

    def has_children(self, parent: int) -> bool:
        return (
            self.conn.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (parent,))
            .fetchone() is not None
        )

    def parent_of(self, ino: int) -> int | None:
        """The directory holding `ino` (directories have exactly one entry)."""
        entry = self.dentry_of(ino)
        return entry[0] if entry else None

    def dentry_of(self, ino: int) -> tuple[int, bytes] | None:
        """(parent, name) of an entry naming `ino` (directories have exactly one), or None."""
        row = self.conn.execute(
            "SELECT parent, name FROM dentries WHERE ino=? LIMIT 1", (ino,)
        ).fetchone()
        return (row[0], bytes(row[1])) if row else None

    def is_ancestor(self, maybe_ancestor: int, ino: int) -> bool:
        """True if directory `maybe_ancestor` is `ino` or contains it."""
        cur: int | None = ino
        while cur is not None and cur != ROOT_INO:
            if cur == maybe_ancestor:
                return True
            cur = self.parent_of(cur)
        return maybe_ancestor == ROOT_INO

    def children(self, parent: int) -> list[tuple[bytes, int]]:
        """(name, ino) of every entry of `parent`, in readdir order."""
        return [(bytes(name), ino)
                for _id, name, ino in self.list_dentries(parent, 0, 1 << 62)]

    def walk(self, top: int) -> Iterator[tuple[int, bytes, int, str]]:
        """(parent, name, ino, rel) of every entry below directory `top`, in the order of
        `walk_with_inodes`."""
        for parent, rel, row in self.walk_with_inodes(top):
            yield parent, row[0], row[1], rel

    def walk_with_inodes(self, top: int) -> Iterator[tuple[int, str, tuple[Any, ...]]]:
        """(parent, rel, row) of every entry below directory `top`, depth first in readdir
        order (an entry, then everything below it, then its next sibling); `row` is the
        entry's `children_with_inodes` row, `rel` its path below `top` in escaped form
        (cachemgr.format.names). The one subtree walk. Iterative: a tree of any depth is fine. Reads
        as it goes: a caller that changes the tree meanwhile sees each directory as it is
        when it is reached."""
        stack: list[tuple[int, str, list[tuple[Any, ...]]]] = [
            (top, "", self.children_with_inodes(top)[::-1])]
        while stack:
            d, prefix, rows = stack[-1]
            if not rows:
                stack.pop()
                continue
            row = rows.pop()
            rel = prefix + escape_name(row[0])
            yield d, rel, row
            if stat.S_ISDIR(row[2]):
                stack.append((row[1], rel + "/", self.children_with_inodes(row[1])[::-1]))

    def children_with_inodes(self, parent: int) -> list[tuple[Any, ...]]:
        """(name, ino, mode, size, mtime_ns, version, writing, target, obj, obj_version) of
        every entry of `parent`: a directory listing with its inodes' index rows (the sizes
        of files open for writing are newer in memory: InodeTable.if_loaded)."""
        return [(bytes(r[0]), *r[1:]) for r in self.conn.execute(
            "SELECT d.name, i.ino, i.mode, i.size, i.mtime_ns, i.version, i.writing, i.target,"
            " i.obj, i.obj_version FROM dentries d JOIN inodes i ON i.ino = d.ino"
            " WHERE d.parent=? ORDER BY d.id", (parent,))]

    def all_dentries(self) -> list[tuple[int, int]]:
        """(parent, ino) of every directory entry (consistency checks)."""
        return self.conn.execute("SELECT parent, ino FROM dentries").fetchall()

    def path_of(self, ino: int) -> str | None:
        """The path of `ino` relative to the root ('' for the root), or None if unlinked, in the
        escaped form of cachemgr.format.names (valid UTF-8 whatever the names' bytes: it is the set
        path in the index and in the store's keys)."""
        parts: list[str] = []
        cur = ino
        while cur != ROOT_INO:
            entry = self.dentry_of(cur)
            if entry is None:
                return None
            parts.append(escape_name(entry[1]))
            cur = entry[0]
        return "/".join(reversed(parts))

    def has_entry_like(self, parent: int, names: tuple[str, ...],
                       suffix: str = INDEXED_SUFFIX) -> bool:
        """Does `parent` hold an entry named one of `names`, or whose name ends in `suffix`
        (case-insensitively for ASCII, as LIKE)? Asked at every close in a directory: a seek
        of the unique (parent, name) index per name, and one of the partial index
        `dentries_distcp` for the suffix, so O(len(names) * log D) for a directory of D
        entries, never a pass over them. Only the indexed suffix is accepted."""
        if suffix != INDEXED_SUFFIX:
            raise ValueError(f"no index of entries ending in {suffix!r}")
        if any(self.lookup(parent, n.encode()) is not None for n in names):
            return True
        like = (f"SELECT 1 FROM dentries {{}} WHERE parent=? AND CAST(name AS TEXT) LIKE"
                f" '%{INDEXED_SUFFIX}' LIMIT 1")
        try:
            row = self.conn.execute(like.format("INDEXED BY dentries_distcp"),
                                    (parent,)).fetchone()
        except sqlite3.OperationalError as e:
            if "no such index" not in str(e):
                raise
            # a cache the index could not be added to (Index._add_indexes): a scan
            row = self.conn.execute(like.format(""), (parent,)).fetchone()
        return row is not None

    def count_dentries(self) -> int:
        return int(self.conn.execute("SELECT COUNT(*) FROM dentries").fetchone()[0])


class ContentQueries:
    """The per-inode content half of `Index` (a mixin without state of its own, like
    TreeQueries): which content of a file is cached, uploaded, being written; its object and
    chunk bitmap. Every question the tiering and restore services ask about `inodes` is
    answered here."""

    conn: sqlite3.Connection

    def inode_fields(self, ino: int, *cols: str) -> tuple[Any, ...] | None:
        """The columns `cols` (of INODE_COLUMNS, obj, obj_version, present) of `ino`'s row, or
        None if there is no such inode."""
        bad = set(cols) - _FIELDS
        if bad or not cols:
            raise ValueError(f"not an inode column: {sorted(bad)}")
        row: tuple[Any, ...] | None = self.conn.execute(
            f"SELECT {', '.join(cols)} FROM inodes WHERE ino=?", (ino,)).fetchone()
        return row

    def inos_of_object(self, key: str, limit: int = 4) -> list[int]:
        """Inodes whose recorded object (`obj`) has key `key` (the peer server's look-up of a
        chunk request: cachemgr.restore.chunkfetch.ChunkFetcher.serve_chunk), through the
        `inodes_by_obj_key` index (the WHERE clause is the index's own expression and
        condition, so SQLite uses it); its caller keeps the answers it used."""
        rows = self.conn.execute(
            "SELECT ino FROM inodes WHERE obj IS NOT NULL AND json_extract(obj, '$.key') = ? "
            "LIMIT ?", (key, limit)).fetchall()
        return [int(r[0]) for r in rows]

    def writing_files(self) -> list[tuple[int, int]]:
        """(ino, version) of every file marked open for writing (after a crash: interrupted)."""
        return self.conn.execute("SELECT ino, version FROM inodes WHERE writing=1").fetchall()

    def unuploaded_files(self) -> list[tuple[int, int]]:
        """(ino, version) of linked, closed, cached regular files whose current content is not
        uploaded (obj_version != version)."""
        return self.conn.execute(
            "SELECT ino, version FROM inodes WHERE (mode & 61440) = 32768 AND nlink > 0"
            " AND writing = 0 AND cached = 1 AND (obj_version IS NULL OR"
            " obj_version != version)").fetchall()

    def live_contents(self) -> set[tuple[int, int]]:
        """(ino, version) of the current content of every linked inode."""
        return {(i, v) for i, v in self.conn.execute(
            "SELECT ino, version FROM inodes WHERE nlink > 0")}

    def evictable_files(self) -> list[tuple[int, int, int]]:
        """(ino, version, mtime_ns) of cached regular files whose current content is uploaded
        (obj_version = version), linked, closed and not empty: what eviction may drop."""
        return self.conn.execute(
            "SELECT ino, version, mtime_ns FROM inodes WHERE (mode & 61440) = 32768 AND"
            " cached = 1 AND writing = 0 AND nlink > 0 AND obj_version = version AND size > 0"
        ).fetchall()

    def uploaded_version(self, ino: int) -> int | None:
        """The content version of `ino` whose object is in the store (obj_version), or None."""
        row = self.inode_fields(ino, "obj_version")
        return row[0] if row else None

    def set_cached(self, ino: int, cached: int) -> None:
        """Mark the cache file whole (1) or evicted (0); either way no chunk bitmap applies."""
        self.conn.execute("UPDATE inodes SET cached=?, present=NULL WHERE ino=?", (cached, ino))

    def clear_present(self, ino: int) -> None:
        """Forget the chunk bitmap of a partly restored file (its chunks were dropped)."""
        self.conn.execute("UPDATE inodes SET present=NULL WHERE ino=?", (ino,))

    def set_restored_object(self, ino: int, obj: str | None) -> None:
        """A file restored from the store: its data is object `obj`, not yet fetched."""
        self.conn.execute("UPDATE inodes SET obj=?, obj_version=0, cached=0 WHERE ino=?",
                          (obj, ino))

    def set_uploaded(self, ino: int, version: int, obj_json: str) -> None:
        """Content `version` of `ino` is in the store as `obj_json` (nothing if the file has
        changed since: its current version is another)."""
        self.conn.execute("UPDATE inodes SET obj=?, obj_version=? WHERE ino=? AND version=?",
                          (obj_json, version, ino, version))

    def set_present(self, ino: int, bitmap: bytes) -> None:
        """The chunk bitmap of a partly restored file (bit i: chunk i is in the cache file)."""
        self.conn.execute("UPDATE inodes SET present=? WHERE ino=?", (bitmap, ino))


class Index(TreeQueries, ContentQueries):
    """SQLite-backed inode and directory-entry store of one cache directory."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *,
                 reserve_bytes: int = RESERVE_BYTES) -> None:
        self.conn = conn
        self.path = path
        self._depth = 0
        self._next_ino: int | None = None  # see insert_inode
        self._undo: list[Callable[[], None]] = []    # on_rollback() of the open transaction
        self._after: list[Callable[[], None]] = []   # after_commit() of the open transaction
        self._serial = 0  # counts outermost transactions: names the open one (tx_serial)
        self.reserve_path = path.with_name(RESERVE_NAME)
        self.reserve_bytes = reserve_bytes
        self.reserve_held = False
        if reserve_bytes:
            self._make_reserve(at_open=True)

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path, *, uid: int, gid: int, root_mode: int = 0o40755,
             reserve_bytes: int = RESERVE_BYTES) -> Index:
        if not path.exists():
            cls._create(path, uid, gid, root_mode)
        for p in (path, *cls._sidecars(path), path.with_name(RESERVE_NAME)):
            restrict(p, FILE_MODE)  # an index made by an older ckptfs was 0644
        conn = cls._connect(path)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version != LAYOUT_VERSION:
            conn.close()
            raise IndexError_(
                f"cache index {path} has layout version {version}, this ckptfs reads "
                f"version {LAYOUT_VERSION}; use a matching ckptfs or a new --cache-dir"
            )
        cls._add_indexes(conn, path)
        return cls(conn, path, reserve_bytes=reserve_bytes)

    @staticmethod
    def _add_indexes(conn: sqlite3.Connection, path: Path) -> None:
        """Indexes schema.sql gained after layout version 1 (any ckptfs reads a cache with
        them), made in a cache created before them. A cache disk too full for one leaves it
        out, logged: its queries then scan, and the next open tries again."""
        for ddl, what in ((OBJ_KEY_INDEX, "object-key"), (SETS_BY_ROOT_INDEX, "set-root"),
                          (DENTRIES_SUFFIX_INDEX, "entry-suffix"),
                          (OBJECTS_BY_CONTENT_INDEX, "object-content")):
            try:
                conn.execute(ddl)
            except sqlite3.OperationalError as e:
                log.warning("cache index %s: cannot add the %s index (%s); its look-ups scan "
                            "until a later mount adds it", path, what, e)

    # -- the reserve -------------------------------------------------------------------------

    def _make_reserve(self, *, at_open: bool = False) -> None:
        """Preallocate the reserve file (blocks really allocated, not a sparse file)."""
        try:
            if self.reserve_path.stat().st_size == self.reserve_bytes:
                self.reserve_held = True
                return
        except FileNotFoundError:
            pass
        if not at_open:
            # Only when the space is clearly back: take the reserve from the disk only while
            # at least as much again stays free for file data.
            st = os.statvfs(self.reserve_path.parent)
            if st.f_bavail * st.f_frsize < 2 * self.reserve_bytes:
                return
        try:
            fd = open_private(self.reserve_path, os.O_WRONLY)
            try:
                os.posix_fallocate(fd, 0, self.reserve_bytes)
            finally:
                os.close(fd)
        except OSError as e:
            self.reserve_path.unlink(missing_ok=True)
            log.warning("cannot make the index reserve %s (%s); made again when there is room",
                        self.reserve_path, e)
            return
        self.reserve_held = True
        if not at_open:
            log.info("cache disk has room again: index reserve of %d MiB made again",
                     self.reserve_bytes >> 20)

    def data_may_take(self, directory: str | os.PathLike[str], n: int) -> bool:
        """May `n` more bytes of file data be written on the cache disk (`directory` on it)?
        While the reserve is released (the disk was full), only if the disk has the reserve's
        size free besides them: the room that freed is for the index writes of the deletes
        that make room. Every writer of cache file data asks: the trainer's writes
        (FileOps.before_write) and restored chunks (cachemgr.restore.chunkfetch)."""
        if self.reserve_held or not self.reserve_bytes:
            return True
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize >= self.reserve_bytes + n

    def _release_reserve(self) -> bool:
        if not self.reserve_held:
            return False
        self.reserve_path.unlink(missing_ok=True)
        self.reserve_held = False
        return True

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so one operation is exactly one
        # transaction. check_same_thread=False: the daemon closes the index from the thread
        # that runs shutdown, never concurrently with the FUSE loop.
        conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    @staticmethod
    def _sidecars(path: Path) -> tuple[Path, Path, Path]:
        return Path(f"{path}-wal"), Path(f"{path}-shm"), Path(f"{path}-journal")

    @classmethod
    def _create(cls, path: Path, uid: int, gid: int, root_mode: int) -> None:
        """Build a new index beside `path` and rename it into place: a crash during creation
        leaves no half-made index, only a stray .tmp that the next attempt overwrites."""
        tmp = path.with_name(path.name + ".tmp")
        for p in (tmp, *cls._sidecars(tmp)):
            p.unlink(missing_ok=True)
        # Created 0600 before SQLite opens it (SQLite would create it 0644 & ~umask): SQLite
        # gives its -journal, -wal and -shm files the database file's mode.
        os.close(open_private(tmp, os.O_WRONLY | os.O_EXCL))
        schema = resources.files(__package__).joinpath("schema.sql").read_text()
        now = time.time_ns()
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            conn.executescript(schema)
            conn.execute(
                "INSERT INTO meta VALUES ('layout_version', ?), ('created_ns', ?), ('node_id', ?)",
                (str(LAYOUT_VERSION), str(now), os.urandom(4).hex()),
            )
            conn.execute(
                "INSERT INTO inodes (ino, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns,"
                " nlink) VALUES (?, ?, ?, ?, 0, ?, ?, ?, 2)",
                (ROOT_INO, root_mode, uid, gid, now, now, now),
            )
            conn.execute(f"PRAGMA user_version={LAYOUT_VERSION}")
        finally:
            conn.close()
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.rename(tmp, path)
        fsync_dir(path.parent)

    def meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return str(row[0]) if row else None

    def set_meta(self, key: str, value: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def delete_meta(self, key: str) -> None:
        self.conn.execute("DELETE FROM meta WHERE key=?", (key,))

    def meta_with_prefix(self, prefix: str) -> list[tuple[str, str]]:
        """(key, value) of every meta row whose key starts with `prefix` (no LIKE wildcards in
        it: the prefix is matched literally)."""
        return [(str(k), str(v)) for k, v in self.conn.execute(
            "SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?", (len(prefix), prefix))]

    def close(self) -> None:
        try:
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.OperationalError as e:
            if not is_disk_full(e):
                raise
            # Every transaction is committed in the WAL; the next open checkpoints it.
            log.warning("cache disk full: index WAL left for the next mount to checkpoint")
        finally:
            self.conn.close()

    # -- transactions ------------------------------------------------------------------------

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction; nested calls join the outer one. SQLITE_FULL raises `IndexFull`."""
        if self._depth:
            self._depth += 1
            try:
                yield self.conn
            finally:
                self._depth -= 1
            return
        self._undo.clear()
        self._after.clear()
        self._depth = 1
        self._serial += 1
        try:
            self.conn.execute("BEGIN IMMEDIATE")
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException as e:
            self._depth = 0
            self._rollback()
            if isinstance(e, sqlite3.OperationalError) and is_disk_full(e):
                released = self._release_reserve()
                if released:
                    log.warning("cache disk full: released the %d MiB index reserve to write the"
                                " index; retrying", self.reserve_bytes >> 20)
                raise IndexFull(f"cache disk full: cannot write the index ({e})",
                                released=released) from None
            raise
        self._depth = 0
        self._undo.clear()
        after, self._after = self._after, []
        for fn in after:
            fn()
        if self.reserve_bytes and not self.reserve_held:
            self._make_reserve()

    def _rollback(self) -> None:
        try:
            # SQLITE_FULL (and a few other errors) already rolled the transaction back.
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
        finally:
            undo, self._undo = self._undo, []
            self._after.clear()
            for fn in reversed(undo):
                fn()

    def on_rollback(self, fn: Callable[[], None]) -> None:
        """Run `fn` if the open transaction rolls back (undo callbacks run last first)."""
        assert self._depth, "on_rollback() outside a transaction"
        self._undo.append(fn)

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run `fn` once the open transaction committed (not at all if it rolls back)."""
        assert self._depth, "after_commit() outside a transaction"
        self._after.append(fn)

    def when_committed(self, fn: Callable[[], None]) -> None:
        """Run `fn` now outside a transaction, else once the open one committed: a change to
        memory that follows an index change takes effect only if that change does."""
        if self._depth:
            self._after.append(fn)
        else:
            fn()

    @property
    def tx_serial(self) -> int | None:
        """A number naming the open transaction (None outside one): owners of memory state
        that must roll back with it record their undo once per transaction (on_rollback)."""
        return self._serial if self._depth else None

    def sync(self) -> None:
        """Make every committed transaction durable on the cache disk (syncs the WAL)."""
        self.conn.execute("PRAGMA synchronous=FULL")
        try:
            # A write transaction is needed for SQLite to sync the WAL under FULL; touching the
            # meta row is the cheapest one.
            with self.tx():
                self.conn.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('last_sync_ns', ?)", (str(time.time_ns()),)
                )
        finally:
            self.conn.execute("PRAGMA synchronous=NORMAL")

    def sync_wal(self) -> None:
        """Make every committed transaction durable on the cache disk, as `sync` does, from any
        thread: it fsyncs the WAL through a descriptor of its own and never touches the
        connection (the loop thread's). Under synchronous=NORMAL a commit is in the WAL, not yet
        synced; a checkpoint syncs the WAL before it and the database after it, so what was
        checkpointed (or a WAL gone with it) is durable already."""
        try:
            fd = os.open(f"{self.path}-wal", os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- inodes ------------------------------------------------------------------------------

    def get_inode(self, ino: int) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self.conn.execute(
            _INODE_SELECT + " WHERE ino=?", (ino,)).fetchone()
        return row

    def insert_inode(
        self, *, mode: int, uid: int, gid: int, now: int, nlink: int, size: int = 0,
        rdev: int = 0, target: bytes | None = None,
    ) -> int:
        # Inode numbers are never reused: (ino, version) names one content in the set records
        # and in object keys (data/<node>/<ino>/<version>/...), which outlive the inode. The
        # rowid alone would hand the newest deleted inode's number out again, and its upload
        # would overwrite an object a published manifest still names.
        if self._next_ino is None:
            self._next_ino = self._high_water() + 1
        ino = self._next_ino
        self.conn.execute(
            "INSERT INTO inodes (ino, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, nlink,"
            " rdev, target) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (ino, mode, uid, gid, size, now, now, now, nlink, rdev, target),
        )
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('ino_high_water', ?)", (str(ino),))
        self._next_ino = ino + 1  # a rolled-back insert only leaves a gap
        return ino

    def insert_restored_files(self, parent: int, rows: list[tuple[bytes, int, int, int, str]],
                              *, uid: int, gid: int, now: int) -> list[int]:
        """New evicted regular files in directory `parent`, as many `insert_inode` +
        `set_restored_object` + `add_dentry` would make them: rows (name, mode, size,
        mtime_ns, obj). Names must be free and distinct. Their inode numbers, in order. Two
        statements for all of them (a restored set of F files: cachemgr.core.rawtree)."""
        if not rows:
            return []
        if self._next_ino is None:
            self._next_ino = self._high_water() + 1
        first = self._next_ino
        inos = list(range(first, first + len(rows)))
        self.conn.executemany(
            "INSERT INTO inodes (ino, mode, uid, gid, size, atime_ns, mtime_ns, ctime_ns, nlink,"
            " obj, obj_version, cached) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?, 0, 0)",
            [(ino, mode, uid, gid, size, now, mtime, now, obj)
             for ino, (_n, mode, size, mtime, obj) in zip(inos, rows, strict=True)])
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('ino_high_water', ?)",
                          (str(inos[-1]),))
        self._next_ino = inos[-1] + 1
        self.conn.executemany("INSERT INTO dentries (parent, name, ino) VALUES (?, ?, ?)",
                              [(parent, r[0], ino) for ino, r in zip(inos, rows, strict=True)])
        return inos

    def _high_water(self) -> int:
        """The highest inode number ever handed out (see insert_inode)."""
        row = self.conn.execute(
            "SELECT MAX(n) FROM (SELECT MAX(ino) AS n FROM inodes UNION ALL"
            " SELECT MAX(ino) FROM set_files UNION ALL SELECT MAX(ino) FROM objects UNION ALL"
            " SELECT CAST(value AS INTEGER) FROM meta WHERE key='ino_high_water')"
        ).fetchone()
        return int(row[0] or ROOT_INO)

    def update_inode(self, ino: int, **fields: int) -> None:
        cols = ", ".join(f"{k}=?" for k in fields)
        self.conn.execute(f"UPDATE inodes SET {cols} WHERE ino=?", (*fields.values(), ino))

    def delete_inode(self, ino: int) -> None:
        self.conn.execute("DELETE FROM xattrs WHERE ino=?", (ino,))
        self.conn.execute("DELETE FROM inodes WHERE ino=?", (ino,))

    def orphan_inodes(self) -> list[int]:
        return [r[0] for r in self.conn.execute("SELECT ino FROM inodes WHERE nlink=0")]

    def regular_files(self) -> list[tuple[int, int]]:
        """(ino, size) of every regular file (S_IFREG = 0o100000)."""
        return self.conn.execute(
            "SELECT ino, size FROM inodes WHERE (mode & 61440) = 32768"
        ).fetchall()

    def evicted_files(self) -> set[int]:
        return {r[0] for r in self.conn.execute(
            "SELECT ino FROM inodes WHERE (mode & 61440) = 32768 AND cached = 0")}

    def cached_bytes(self) -> int:
        return int(self.conn.execute(
            "SELECT COALESCE(SUM(size), 0) FROM inodes WHERE (mode & 61440) = 32768 AND"
            " cached = 1 AND nlink > 0").fetchone()[0])

    def all_inode_rows(self) -> dict[int, tuple[Any, ...]]:
        """Every inode row (INODE_COLUMNS), by ino (consistency checks)."""
        return {r[0]: r for r in self.conn.execute(_INODE_SELECT)}

    def all_inos(self) -> set[int]:
        return {r[0] for r in self.conn.execute("SELECT ino FROM inodes")}

    def totals(self) -> dict[str, int]:
        """Counts and bytes by file type (S_IFREG = 32768, S_IFDIR = 16384, S_IFLNK = 40960)."""
        out = {"files": 0, "dirs": 0, "symlinks": 0, "bytes": 0}
        for fmt, n, total in self.conn.execute(
            "SELECT mode & 61440, COUNT(*), SUM(size) FROM inodes WHERE nlink > 0 GROUP BY 1"
        ):
            key = {32768: "files", 16384: "dirs", 40960: "symlinks"}.get(fmt)
            if key:
                out[key] = n
            if fmt == 32768:
                out["bytes"] = total or 0
        return out

    # -- xattrs ------------------------------------------------------------------------------

    def xattr_inos(self) -> set[int]:
        return {r[0] for r in self.conn.execute("SELECT DISTINCT ino FROM xattrs")}

    def get_xattr(self, ino: int, name: bytes) -> bytes | None:
        row = self.conn.execute(
            "SELECT value FROM xattrs WHERE ino=? AND name=?", (ino, name)
        ).fetchone()
        return bytes(row[0]) if row else None

    def set_xattr(self, ino: int, name: bytes, value: bytes) -> None:
        self.conn.execute("INSERT OR REPLACE INTO xattrs VALUES (?, ?, ?)", (ino, name, value))

    def remove_xattr(self, ino: int, name: bytes) -> bool:
        cur = self.conn.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name))
        return cur.rowcount > 0

    def list_xattrs(self, ino: int) -> list[bytes]:
        return [bytes(r[0]) for r in self.conn.execute(
            "SELECT name FROM xattrs WHERE ino=? ORDER BY name", (ino,))]


def is_disk_full(e: BaseException) -> bool:
    """SQLite's "database or disk is full" (SQLITE_FULL): its unix VFS reports a write that
    failed with ENOSPC this way."""
    code = getattr(e, "sqlite_errorcode", None)
    return isinstance(e, sqlite3.OperationalError) and code is not None and \
        code & 0xFF == SQLITE_FULL
