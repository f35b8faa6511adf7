"""Shard sets: what a commit is, when one happens, and their durable records in the index.

A *shard set* is what becomes visible in the object store atomically: a directory (its whole
subtree), a single regular file, or a symlink, named by its path in the mount at commit time.
The commit rules (docs/SEMANTICS.md "Shard sets") are decided here, from the namespace alone:

  * DCP: a file renamed to `.metadata` commits its directory.
  * A directory renamed (e.g. `step_100.tmp` -> `step_100`) commits the directory at its new name.
  * A regular file closed by its last writer commits itself, if it is *outside any open set*:
    its own name does not look temporary and no directory above it is open (temporary-looking
    name, a DCP directory, or a directory that is already a set). A file renamed from a
    temporary name to a final one outside any open set commits too (torch.save `x.tmp` -> `x`).
  * A symlink created, or renamed into place, outside any open set commits itself (`latest`).
  * `ckptfs commit PATH` commits any file or directory.

This module is synchronous and runs inside the core's index transactions: a commit is recorded
in the same transaction as the rename that triggered it, so after a crash a set is committed if
and only if its triggering operation completed.
"""

from __future__ import annotations

import json
import re
import sqlite3
import stat
import time
from dataclasses import dataclass
from typing import Any

from cachemgr.core.index import ROOT_INO, Index
from cachemgr.format.docs import ManifestDoc
from cachemgr.format.names import escape_name, escape_path

# Names that mark a file or directory as still being written. Sources: torch.save callers
# (`x.tmp`), DCP (`.metadata.tmp`), HF Trainer (`tmp-checkpoint-500`), Orbax
# (`<step>.orbax-checkpoint-tmp-<ts>`), Lightning/fsspec (`.tmp` suffixes), rsync (`.~tmp~`).
_TEMP_RE = re.compile(
    r"(\.tmp$|\.temp$|\.partial$|\.part$|^\.?tmp|^\.?temp[-_.]|[-_.]tmp[-_.]|~tmp~|"
    r"orbax-checkpoint-tmp)",
    re.IGNORECASE,
)
DCP_METADATA = ".metadata"
LIVE_STATES = ("committed", "uploading")
# "replicated": another node's set materialised from the replicas peers hold, its store
# manifest not listed here yet (cachemgr.tiering.peernamespace; docs/SEMANTICS.md "Replicated")
KEPT_STATES = ("committed", "uploading", "durable", "replicated")
# A directory whose newest set is in one of these states is a committed directory: a file
# closed in it later amends that set (SetRegistry.amend_target; docs/SEMANTICS.md "Files written
# into a committed directory"). `superseded`/`failed`: a commit of it that will not publish as
# it was (a file rewritten before it was durable, a refusal); the amend is its next commit.
AMENDABLE_STATES = ("committed", "uploading", "durable", "superseded", "failed")
# The states in which a set holds its objects in the store: garbage collection keeps every object
# such a set names. A set leaving them (superseded, failed, replaced, deleted) makes its
# contents candidates of the next GC pass (SetRegistry.set_state).
HOLDING_STATES = (*KEPT_STATES, "deleting")
# The states a set never leaves: its row is history, pruned by SetRegistry.prune once nothing
# needs it (docs/SEMANTICS.md "How long the index remembers a set").
ENDED_STATES = ("superseded", "failed", "replaced", "deleted")


def _rowid(cur: sqlite3.Cursor) -> int:
    """The seq an INSERT into `sets` just made."""
    if cur.lastrowid is None:  # never after an INSERT
        raise RuntimeError("INSERT INTO sets made no row")
    return cur.lastrowid


def is_temp_name(name: str) -> bool:
    return bool(_TEMP_RE.search(name))


def _name(b: bytes) -> str:
    # Set paths, `rel`s and symlink targets are in the escaped form (cachemgr.format.names): valid
    # UTF-8 for SQLite, the store's keys and the manifests, and exactly reversible.
    return escape_name(b)


@dataclass(frozen=True, slots=True)
class SetRow:
    seq: int
    path: str
    kind: str
    root_ino: int
    state: str
    reason: str
    committed_ns: int
    durable_ns: int | None
    error: str | None
    layout: str
    origin: str = "local"
    etag: str | None = None


_SET_COLS = ("seq, path, kind, root_ino, state, reason, committed_ns, durable_ns, error, layout,"
             " origin, etag")
_S_COLS = ", ".join("s." + c.strip() for c in _SET_COLS.split(","))  # the same, of `sets s`
# An object `o` that is garbage: no set holding objects names its content, and it is not the
# current content of a linked file (seeks of `set_files_by_content` and the inodes' key).
_UNREFERENCED = (
    "NOT EXISTS (SELECT 1 FROM set_files f JOIN sets s ON s.seq=f.seq WHERE f.ino=o.ino AND"
    f" f.version=o.version AND s.state IN {HOLDING_STATES}) AND NOT EXISTS (SELECT 1 FROM"
    " inodes i WHERE i.ino=o.ino AND i.version=o.version AND i.nlink > 0)")


@dataclass(frozen=True, slots=True)
class SetStats:
    """`SetRegistry.statistics()`: every set (`dataclasses.asdict` for JSON)."""

    by_state: dict[str, int]
    pending_files: int
    pending_bytes: int
    oldest_live_committed_ns: int | None


@dataclass(frozen=True, slots=True)
class Unsaved:
    """`SetRegistry.unsaved()`: closed files in no set, at risk (`paths`: the first few)."""

    files: int
    bytes: int
    paths: list[str]
    handed: int


class SetRegistry:
    """The `sets`, `set_files` and `objects` tables: their one owner, and the only code that
    writes SQL on them (the SQL on `dentries`, `inodes` and `meta` is `Index`'s, asked through
    its methods). Every method runs inside the caller's transaction.

    Besides the tables it keeps one piece of memory, `_unreferenced`: the contents (ino,
    version) that may have lost their last reason to stay in the store since the last GC pass
    (a set holding them left HOLDING_STATES, `set_state`; the file's content changed or the
    file went, `note_unreferenced`/`note_inode`). A GC pass (`garbage_of`) looks only at those,
    so its cost follows what changed, not how many objects the store holds. Guarded by the trio
    thread (the only one that calls here). A superset is harmless (each candidate is checked
    against the tables): a transaction that rolls back leaves its candidates, and is not
    undone; a candidate lost in a crash is found by the full pass recovery runs (`garbage`)."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self.conn = index.conn
        self._unreferenced: set[tuple[int, int]] = set()

    # -- namespace questions -----------------------------------------------------------------

    def is_dcp_dir(self, dir_ino: int) -> bool:
        return self.index.has_entry_like(dir_ino, (DCP_METADATA, DCP_METADATA + ".tmp"),
                                         ".distcp")

    def is_dir_set_root(self, ino: int) -> bool:
        return self.conn.execute(
            f"SELECT 1 FROM sets WHERE root_ino=? AND kind='dir' AND state IN {KEPT_STATES}"
            " LIMIT 1", (ino,)
        ).fetchone() is not None

    def dir_set_of(self, ino: int) -> SetRow | None:
        """The newest set rooted at directory `ino` (index `sets_by_root`: one seek)."""
        r = self.conn.execute(
            f"SELECT {_SET_COLS} FROM sets WHERE root_ino=? AND kind='dir' ORDER BY seq DESC"
            " LIMIT 1", (ino,)).fetchone()
        return SetRow(*r) if r else None

    def amend_target(self, dir_ino: int) -> SetRow | None:
        """The committed directory set that a file closed (renamed in, linked) in directory
        `dir_ino` amends, or None. Walking up from `dir_ino`: a directory with a temporary
        name, or a DCP directory that is no set yet, means the file belongs to a set still being
        built (None); among the directories above that are this node's committed sets (their
        newest set in AMENDABLE_STATES, committed here, at the directory's current path), the
        one committed last: the set that holds the directory now (a later commit of a
        directory above absorbed the ones below it). Cost: O(depth) index seeks."""
        best: SetRow | None = None
        cur = dir_ino
        while cur != ROOT_INO:
            entry = self.index.dentry_of(cur)
            if entry is None or is_temp_name(_name(entry[1])):
                return None
            s = self.dir_set_of(cur)
            if s is not None and s.origin == "local" and s.state in AMENDABLE_STATES and \
                    s.path == self.index.path_of(cur):
                if best is None or s.seq > best.seq:
                    best = s
            elif best is None and self.is_dcp_dir(cur):
                return None
            cur = entry[0]
        return best

    def dcp_save_under_way(self, s: SetRow) -> bool:
        """Is a DCP save into set `s`'s directory under way: a `.metadata.tmp` there, or a DCP
        file (`*.distcp`, `.metadata`) whose content is not the one `s` holds? Then a late file
        does not amend `s` (it would publish a mix of two saves): the save's own `.metadata`
        rename commits the directory, late files included. O(files of the set)."""
        if self.index.lookup(s.root_ino, DCP_METADATA.encode() + b".tmp") is not None:
            return True
        held = {(r[0]): (r[1], r[2]) for r in self.conn.execute(
            "SELECT rel, ino, version FROM set_files WHERE seq=?", (s.seq,))}
        files, _layout = self.snapshot(s.root_ino)
        for rel, ino, version, *_ in files:
            base = rel.rsplit("/", 1)[-1]
            if (base.endswith(".distcp") or base == DCP_METADATA) and \
                    held.get(rel) != (ino, version):
                return True
        return False

    def in_open_set(self, parent_ino: int) -> bool:
        """True if a file in directory `parent_ino` belongs to a set being built (or already
        committed) above it, rather than being a set of its own."""
        cur = parent_ino
        while cur != ROOT_INO:
            entry = self.index.dentry_of(cur)
            if entry is None:
                return True  # an unlinked directory: nothing in it commits
            if is_temp_name(_name(entry[1])) or self.is_dcp_dir(cur) or \
                    self.is_dir_set_root(cur):
                return True
            cur = entry[0]
        return False

    # -- commits -----------------------------------------------------------------------------

    def snapshot(self, root_ino: int) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
        """Files (rel, ino, version, size, mode, mtime_ns) and layout {dirs, symlinks} of the
        subtree at `root_ino` as it is now."""
        files: list[tuple[Any, ...]] = []
        dirs: list[dict[str, Any]] = []
        links: list[dict[str, Any]] = []
        for _d, rel, row in self.index.walk_with_inodes(root_ino):
            _n, ino, mode, size, mtime_ns, version, _w, target = row[:8]
            if stat.S_ISDIR(mode):
                dirs.append({"path": rel, "mode": stat.S_IMODE(mode), "mtime_ns": mtime_ns})
            elif stat.S_ISLNK(mode):
                links.append({"path": rel, "target": escape_path(bytes(target))})
            elif stat.S_ISREG(mode):
                files.append((rel, ino, version, size, stat.S_IMODE(mode), mtime_ns))
        files.sort()
        dirs.sort(key=lambda x: x["path"])
        links.sort(key=lambda x: x["path"])
        return files, {"dirs": dirs, "symlinks": links}

    def commit(self, path: str, root_ino: int, reason: str, from_path: str | None = None) -> int:
        """Record a commit of the set at `path` (rooted at `root_ino`); returns its seq.
        Earlier sets at the same path that are not durable yet are superseded. `from_path`:
        where a renamed directory came from (other nodes' files of the set may still be
        announced there, cachemgr.tiering.parts)."""
        row = self.index.get_inode(root_ino)
        assert row is not None
        mode = row[1]
        now = time.time_ns()
        layout: dict[str, Any] = {"dirs": [], "symlinks": []}
        if stat.S_ISDIR(mode):
            kind = "dir"
            files, layout = self.snapshot(root_ino)
            layout["mode"] = stat.S_IMODE(mode)
            if from_path and from_path != path:
                layout["from"] = from_path
        elif stat.S_ISLNK(mode):
            kind = "symlink"
            files = []
            layout["target"] = escape_path(bytes(row[10]))
        else:
            kind = "file"
            files = [("", root_ino, row[11], row[4], stat.S_IMODE(mode), row[6])]
        for (old,) in self.conn.execute(
                f"SELECT seq FROM sets WHERE path=? AND +state IN {LIVE_STATES}",
                (path,)).fetchall():
            self.set_state(old, "superseded", "a later commit of the same path")
        cur = self.conn.execute(
            "INSERT INTO sets (path, kind, root_ino, state, reason, committed_ns, layout)"
            " VALUES (?, ?, ?, 'committed', ?, ?, ?)",
            (path, kind, root_ino, reason, now, json.dumps(layout)),
        )
        seq = _rowid(cur)
        for rel, ino, version, size, fmode, mtime_ns in files:
            obj = self.index.inode_fields(ino, "obj", "obj_version")
            self.conn.execute(
                "INSERT INTO set_files (seq, rel, ino, version, size, mode, mtime_ns, obj)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (seq, rel, ino, version, size, fmode, mtime_ns,
                 obj[0] if obj and obj[1] == version else None),
            )
        return seq

    def record_remote(self, m: ManifestDoc, root_ino: int, etag: str,
                      files: list[tuple[Any, ...]], state: str = "durable") -> int:
        """A set materialised from another node's manifest `m`: durable from the start (or
        `state` "replicated": from a manifest peers built from their replicas).
        `files`: (rel, ino, version, size, mode, mtime_ns, obj_json); version 0 for files
        created from the manifest, the inode's own for files this node wrote (adopted)."""
        layout = {"dirs": m.get("dirs", []), "symlinks": m.get("symlinks", [])}
        if "mode" in m:
            layout["mode"] = m["mode"]
        if m["kind"] == "symlink":
            layout["target"] = m["target"]
        now = time.time_ns()
        cur = self.conn.execute(
            "INSERT INTO sets (path, kind, root_ino, state, reason, committed_ns, durable_ns,"
            " layout, origin, etag) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (m["path"], m["kind"], root_ino, state,
             ("store:" if state == "durable" else "peers:") + m["commit"].get("reason", "?"),
             m["commit"].get("committed_ns", now), now if state == "durable" else None,
             json.dumps(layout),
             m["commit"].get("node", "?"), etag))
        seq = _rowid(cur)
        self.conn.executemany(
            "INSERT INTO set_files (seq, rel, ino, version, size, mode, mtime_ns, obj)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", [(seq, *f) for f in files])
        return seq

    def add_file(self, seq: int, row: tuple[Any, ...]) -> None:
        """Add (rel, ino, version, size, mode, mtime_ns, obj_json) to set `seq`: a file another
        node wrote, shown on the node that published the set (cachemgr.tiering.remote)."""
        self.conn.execute(
            "INSERT INTO set_files (seq, rel, ino, version, size, mode, mtime_ns, obj)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (seq, *row))

    def newest_at(self, path: str) -> SetRow | None:
        r = self.conn.execute(
            f"SELECT {_SET_COLS} FROM sets WHERE path=? ORDER BY seq DESC LIMIT 1",
            (path,)).fetchone()
        return SetRow(*r) if r else None

    def set_of_file(self, ino: int) -> SetRow | None:
        """The newest kept set holding the current content of file `ino`."""
        current = self.index.inode_fields(ino, "version")
        if current is None:
            return None
        r = self.conn.execute(
            f"SELECT {_S_COLS} FROM sets s"
            f" JOIN set_files f ON f.seq = s.seq WHERE f.ino=? AND f.version=? AND s.state IN"
            f" {KEPT_STATES} ORDER BY s.seq DESC LIMIT 1", (ino, current[0])).fetchone()
        return SetRow(*r) if r else None

    def supersede_content(self, ino: int, version: int, why: str, *,
                          uploaded_too: bool = False) -> list[int]:
        """A file's content (ino, version) is about to change or go away: every live set that
        still needs to upload it can no longer become durable as committed. A set whose copy
        of it is already in the store is unaffected (it publishes exactly what was committed)
        unless `uploaded_too`: a rewrite of the file supersedes every live set holding the old
        content, uploaded or not (docs/SEMANTICS.md "What a set goes through": a rewrite of one
        of its files before it is durable supersedes it; whether the upload had finished must
        not decide what the store shows)."""
        uploaded = "" if uploaded_too else " AND f.obj IS NULL"
        seqs = [r[0] for r in self.conn.execute(
            f"SELECT DISTINCT s.seq FROM sets s JOIN set_files f ON f.seq = s.seq"
            f" WHERE f.ino=? AND f.version=?{uploaded} AND s.state IN {LIVE_STATES}",
            (ino, version))]
        for seq in seqs:
            self.set_state(seq, "superseded", why)
        return seqs

    def set_file_object(self, seq: int, rel: str, obj_json: str) -> None:
        """File `rel` of set `seq` is stored as `obj_json` (the same content under another
        key: cachemgr.tiering.publish, a set a buddy took over)."""
        self.conn.execute("UPDATE set_files SET obj=? WHERE seq=? AND rel=?",
                          (obj_json, seq, rel))

    def record_upload(self, ino: int, version: int, obj_json: str) -> list[int]:
        """The content (ino, version) is in the store as `obj_json`; returns the live sets that
        were waiting for it."""
        self.index.set_uploaded(ino, version, obj_json)
        self.conn.execute(
            "UPDATE set_files SET obj=? WHERE ino=? AND version=? AND obj IS NULL",
            (obj_json, ino, version))
        return self.live_sets_of(ino, version)

    # -- queries -----------------------------------------------------------------------------

    def live_sets_of(self, ino: int, version: int) -> list[int]:
        """Live (committed/uploading) sets holding the content (ino, version)."""
        return [r[0] for r in self.conn.execute(
            f"SELECT DISTINCT s.seq FROM sets s JOIN set_files f ON f.seq = s.seq"
            f" WHERE f.ino=? AND f.version=? AND s.state IN {LIVE_STATES}", (ino, version))]

    def get(self, seq: int) -> SetRow | None:
        r = self.conn.execute(f"SELECT {_SET_COLS} FROM sets WHERE seq=?", (seq,)).fetchone()
        return SetRow(*r) if r else None

    def by_states(self, states: tuple[str, ...]) -> list[SetRow]:
        q = ",".join("?" * len(states))
        return [SetRow(*r) for r in self.conn.execute(
            f"SELECT {_SET_COLS} FROM sets WHERE state IN ({q}) ORDER BY seq", states)]

    def statistics(self) -> SetStats:
        """Totals over every set (metrics): sets by state; the files and bytes of live sets not
        uploaded yet (each content once, however many live sets hold it); and when the oldest
        live set was committed (None when none is live)."""
        by_state = dict(self.conn.execute("SELECT state, COUNT(*) FROM sets GROUP BY state"))
        files, nbytes = self.conn.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM (SELECT DISTINCT f.ino, f.version,"
            " f.size FROM set_files f JOIN sets s ON s.seq = f.seq"
            f" WHERE s.state IN {LIVE_STATES} AND f.obj IS NULL)").fetchone()
        oldest = self.conn.execute(
            f"SELECT MIN(committed_ns) FROM sets WHERE state IN {LIVE_STATES}").fetchone()[0]
        return SetStats(by_state=by_state, pending_files=files, pending_bytes=nbytes,
                        oldest_live_committed_ns=oldest)

    def unsaved(self, limit: int) -> Unsaved:
        """The regular files of this cache, closed, whose current content is in no kept set
        (nor in a failed one: status names those as failed sets already):
        nothing will put them in the store as they are (a temporary name never renamed, shards
        of a DCP directory whose `.metadata` never came, a file in a directory that is no
        set). `handed`: how many of them are uploaded and named in this node's part record of
        their directory (cachemgr.tiering.parts): in the store, for a commit of that directory
        on another node to publish, if one comes (at risk all the same: no manifest names them
        until then, and this node cannot know that one will). One pass over the inodes with a
        seek of `set_files_by_content` each: O(files in the cache); asked by status, metrics
        and umount, never by a file operation."""
        rows = self.conn.execute(
            "SELECT i.ino, i.size, i.obj_version IS i.version AND EXISTS (SELECT 1 FROM meta m"
            " WHERE m.key = 'part:' || d.parent) FROM inodes i JOIN dentries d ON d.ino = i.ino"
            " WHERE (i.mode & 61440) = 32768 AND i.writing = 0 AND NOT EXISTS (SELECT 1 FROM"
            " set_files f JOIN sets s ON s.seq = f.seq WHERE f.ino = i.ino AND"
            f" f.version = i.version AND s.state IN {(*KEPT_STATES, 'failed')})"
            " ORDER BY i.ino").fetchall()
        named = [p for p in (self.index.path_of(r[0]) for r in rows[:limit]) if p]
        return Unsaved(files=len(rows), bytes=sum(r[1] for r in rows), paths=named,
                       handed=sum(1 for r in rows if r[2]))

    def failed_newest(self) -> list[tuple[SetRow, int]]:
        """Failed sets that are still the newest set of their path (no later commit of the same
        path, in any state), each with the bytes of its files, oldest first. Over every set:
        one query on `sets_by_state` and `sets_by_path` (cachemgr.tiering.progress
        `Progress.failed_sets` decides which of them are still unresolved)."""
        return [(SetRow(*r[:-1]), r[-1]) for r in self.conn.execute(
            f"SELECT {_S_COLS}, (SELECT COALESCE(SUM(f.size), 0) FROM set_files f"
            f" WHERE f.seq = s.seq) FROM sets s WHERE s.state = 'failed' AND NOT EXISTS"
            f" (SELECT 1 FROM sets t WHERE t.path = s.path AND t.seq > s.seq) ORDER BY s.seq")]

    def recent(self, limit: int) -> list[SetRow]:
        return [SetRow(*r) for r in self.conn.execute(
            f"SELECT {_SET_COLS} FROM sets ORDER BY seq DESC LIMIT ?", (limit,))][::-1]

    def at_or_under(self, path: str, states: tuple[str, ...]) -> list[SetRow]:
        """The sets in `states` whose path is `path` or below it, in seq order. Two ranges of
        `sets_by_path` (the path itself; the paths from `path/` up to `path0`, '0' being the
        character after '/'), `+state` keeping the planner off `sets_by_state` (which would
        visit every durable set): O(log N + the sets at or under `path`, in any state)."""
        q = ",".join("?" * len(states))
        return [SetRow(*r) for r in self.conn.execute(
            f"SELECT {_SET_COLS} FROM sets WHERE path=? AND +state IN ({q}) UNION ALL"
            f" SELECT {_SET_COLS} FROM sets WHERE path>=? AND path<? AND +state IN ({q})"
            " ORDER BY seq", (path, *states, path + "/", path + "0", *states))]

    def holding(self, path: str) -> SetRow | None:
        """The newest set whose path is `path` or one of its ancestors."""
        parts = path.split("/")
        cands = ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]
        q = ",".join("?" * len(cands))
        r = self.conn.execute(
            f"SELECT {_SET_COLS} FROM sets WHERE path IN ({q}) ORDER BY seq DESC LIMIT 1",
            cands).fetchone()
        return SetRow(*r) if r else None

    def rows(self, seqs: set[int]) -> list[SetRow]:
        """The sets `seqs`, in one query (a directory wait looks at all of them at each wake)."""
        return [SetRow(*r) for r in self.conn.execute(
            f"SELECT {_SET_COLS} FROM sets WHERE seq IN (SELECT value FROM json_each(?))",
            (json.dumps(sorted(seqs)),))]

    def contents_of(self, seqs: set[int]) -> set[tuple[int, int]]:
        """(ino, version) of every file of the sets `seqs`."""
        return {(ino, version) for ino, version in self.conn.execute(
            "SELECT ino, version FROM set_files WHERE seq IN (SELECT value FROM json_each(?))",
            (json.dumps(sorted(seqs)),))}

    def files(self, seq: int) -> list[tuple[Any, ...]]:
        """(rel, ino, version, size, mode, mtime_ns, obj_json) of a set."""
        return self.conn.execute(
            "SELECT rel, ino, version, size, mode, mtime_ns, obj FROM set_files WHERE seq=?"
            " ORDER BY rel", (seq,)).fetchall()

    def missing_uploads(self, seq: int) -> list[tuple[int, int, int]]:
        """(ino, version, size) of the set's files not uploaded yet."""
        return self.conn.execute(
            "SELECT ino, version, size FROM set_files WHERE seq=? AND obj IS NULL", (seq,)
        ).fetchall()

    def set_etag(self, seq: int, etag: str) -> None:
        """The etag of the manifest this set published (the If-Match of the next commit of its
        path from this node)."""
        self.conn.execute("UPDATE sets SET etag=? WHERE seq=?", (etag, seq))

    def known_etag(self, path: str) -> str | None:
        """Etag of the manifest this node believes is at `path`: that of the newest durable set
        there, None if there is none (then a publish expects no manifest)."""
        s = self.known_set(path)
        return None if s is None else s.etag

    def known_set(self, path: str) -> SetRow | None:
        """The set whose manifest this node believes is at `path` (`known_etag`): the newest
        durable set there, None if there is none."""
        r = self.conn.execute(
            f"SELECT {_SET_COLS} FROM sets WHERE path=? AND state IN ('durable', 'deleting',"
            " 'deleted', 'replaced') ORDER BY seq DESC LIMIT 1", (path,)).fetchone()
        s = SetRow(*r) if r else None
        return s if s is not None and s.state == "durable" else None

    def set_state(self, seq: int, state: str, error: str | None = None) -> None:
        """Every change of a set's state. Into a state that holds no object (not in
        HOLDING_STATES): the set's contents become GC candidates (O(files of the set))."""
        durable = time.time_ns() if state == "durable" else None
        self.conn.execute(
            "UPDATE sets SET state=?, error=COALESCE(?, error),"
            " durable_ns=COALESCE(?, durable_ns) WHERE seq=?",
            (state, error, durable, seq))
        if state not in HOLDING_STATES:
            self._unreferenced.update(
                (ino, version) for ino, version in self.conn.execute(
                    "SELECT ino, version FROM set_files WHERE seq=?", (seq,)))

    def max_seq(self) -> int:
        """The newest commit's seq (0 when none)."""
        return int(self.conn.execute("SELECT COALESCE(MAX(seq), 0) FROM sets").fetchone()[0])

    def earlier_live(self, seq: int) -> int | None:
        """The newest live set committed before `seq` (publication waits for it), or None.
        One seek per live state in `sets_by_state` (state, seq): O(log N)."""
        r = self.conn.execute(
            f"SELECT MAX(seq) FROM sets INDEXED BY sets_by_state WHERE state IN {LIVE_STATES}"
            " AND seq < ?",
            (seq,)).fetchone()
        return r[0] if r else None

    # -- retention (cachemgr.tiering.space) -----------------------------------------------------

    def newest_durable(self, skip: int = 0, symlinks: bool = True) -> int | None:
        """The seq of the newest durable set after skipping the `skip` newest (symlink sets
        left out unless `symlinks`), or None. A backward walk of `sets_by_state` (state, seq)
        over `skip` + 1 rows (and the symlink sets among them): O(log N + skip)."""
        kinds = "" if symlinks else " AND kind != 'symlink'"
        r = self.conn.execute(
            "SELECT seq FROM sets INDEXED BY sets_by_state WHERE state = 'durable'"
            f"{kinds} ORDER BY seq DESC LIMIT 1 OFFSET ?", (skip,)).fetchone()
        return r[0] if r else None

    def durable_between(self, lo: int, hi: int) -> list[int]:
        """Seqs of the durable sets, symlinks aside, with lo <= seq <= hi, in seq order: a
        range of `sets_by_state` (state, seq), O(log N + the sets in it)."""
        return [r[0] for r in self.conn.execute(
            "SELECT seq FROM sets INDEXED BY sets_by_state WHERE state = 'durable' AND"
            " seq BETWEEN ? AND ? AND kind != 'symlink' ORDER BY seq", (lo, hi))]

    def live_commit_seq(self, ino: int, version: int) -> int | None:
        r = self.conn.execute(
            f"SELECT MIN(s.seq) FROM set_files f JOIN sets s ON s.seq=f.seq WHERE f.ino=? AND"
            f" f.version=? AND s.state IN {LIVE_STATES}", (ino, version)).fetchone()
        return r[0] if r else None

    # -- history (cachemgr.tiering.history) ---------------------------------------------------

    def prunable(self, before_seq: int, before_ns: int) -> list[int]:
        """Seqs of the sets that ended (ENDED_STATES) before seq `before_seq`, committed before
        `before_ns`, that a later set of their path replaces (or `deleted`), in seq order. A
        walk of `sets_by_state` over the ended sets (which pruning keeps few) with one seek of
        `sets_by_path` each; never over the sets that hold data."""
        return [r[0] for r in self.conn.execute(
            f"SELECT s.seq FROM sets s WHERE s.state IN {ENDED_STATES} AND s.seq < ? AND"
            " s.committed_ns < ? AND (s.state = 'deleted' OR EXISTS (SELECT 1 FROM sets t"
            " WHERE t.path = s.path AND t.seq > s.seq)) ORDER BY s.seq",
            (before_seq, before_ns))]

    def prune(self, seqs: list[int]) -> None:
        """Forget the sets `seqs` (rows of `sets` and `set_files`): O(log N) per row."""
        arg = json.dumps(seqs)
        self.conn.execute("DELETE FROM set_files WHERE seq IN (SELECT value FROM json_each(?))",
                          (arg,))
        self.conn.execute("DELETE FROM sets WHERE seq IN (SELECT value FROM json_each(?))",
                          (arg,))

    def row_counts(self) -> dict[str, int]:
        """Rows of each table this registry owns (status, tests): O(rows), not for a hot path."""
        return {t: int(self.conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0])
                for t in ("sets", "set_files", "objects")}

    # -- objects (for garbage collection) ----------------------------------------------------

    def object_key(self, ino: int, version: int) -> str | None:
        r = self.conn.execute(
            "SELECT key FROM objects WHERE ino=? AND version=?", (ino, version)).fetchone()
        return r[0] if r else None

    def object_content(self, key: str) -> tuple[int, int] | None:
        """(ino, version) of this node's object `key`, or None if it is not one."""
        r = self.conn.execute("SELECT ino, version FROM objects WHERE key=?", (key,)).fetchone()
        return (r[0], r[1]) if r else None

    def add_object(self, key: str, ino: int, version: int, size: int) -> None:
        self.conn.execute("INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?)",
                          (key, ino, version, size))

    def note_unreferenced(self, ino: int, version: int) -> None:
        """Content (ino, version) may have lost its last reference (the file's content changed,
        an upload of content no longer current ended): a candidate of the next GC pass."""
        self._unreferenced.add((ino, version))

    def note_inode(self, ino: int) -> None:
        """File `ino` was removed or purged: each of its objects is a candidate of the next GC
        pass (a seek of `objects_by_content`, O(log N + its objects))."""
        self._unreferenced.update(
            (ino, v) for (v,) in self.conn.execute("SELECT version FROM objects WHERE ino=?",
                                                   (ino,)))

    def noted(self, ino: int, version: int) -> bool:
        """Content (ino, version) is a candidate of the next GC pass."""
        return (ino, version) in self._unreferenced

    def take_unreferenced(self) -> set[tuple[int, int]]:
        """The GC candidates noted since the last call (and forget them)."""
        out, self._unreferenced = self._unreferenced, set()
        return out

    def garbage(self) -> list[str]:
        """Keys of objects no set in HOLDING_STATES refers to and that are not the current
        content of a linked file. A `deleting` set counts: its manifest may still be in the
        store (its unpublish waits in commit order, or is queued behind this GC), and an
        object it names must outlive it. Every object: O(objects * log N), run by recovery
        (cachemgr.tiering.commit `recover`), once per mount; the passes after each change
        look only at what changed (`garbage_of`)."""
        return [key for (key,) in self.conn.execute(
            f"SELECT o.key FROM objects o WHERE {_UNREFERENCED}")]

    def garbage_of(self, contents: set[tuple[int, int]]) -> list[str]:
        """`garbage`, of the objects of `contents` only (the candidates `take_unreferenced`
        gave): O(len(contents) * log N) whatever the index holds."""
        return [key for (key,) in self.conn.execute(
            f"SELECT o.key FROM json_each(?) c JOIN objects o ON o.ino = c.value ->> 0 AND"
            f" o.version = c.value ->> 1 WHERE {_UNREFERENCED} ORDER BY o.key",
            (json.dumps(sorted(contents)),))]

    def keys_named_by_others(self, seq: int, keys: set[str]) -> set[str]:
        """Those of `keys` (object keys) that a set other than `seq` names, in a kept, live or
        deleting state: objects that deleting set `seq` must not take with it."""
        return {k for (k,) in self.conn.execute(
            f"SELECT DISTINCT json_extract(f.obj, '$.key') FROM set_files f JOIN sets s ON"
            f" s.seq=f.seq WHERE s.seq != ? AND f.obj IS NOT NULL AND s.state IN"
            f" {HOLDING_STATES}", (seq,)) if k in keys}

    def forget_object(self, key: str) -> None:
        self.conn.execute("DELETE FROM objects WHERE key=?", (key,))
