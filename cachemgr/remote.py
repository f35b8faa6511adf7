"""Sets committed elsewhere appear here: `RemoteSync` lists the store's manifests every
`interval` seconds and materialises the sets other nodes (or an earlier cache of this node)
published, as evicted files whose data `cachemgr.restore.Restorer` serves on demand.

What happens to a listed manifest at path P (docs/SEMANTICS.md "Many nodes"):

  * nothing at P here: the set is created (names, sizes, modes, times from the manifest). Files
    of the set that *this* node wrote (its own objects, `data/<this node>/...`) are not fetched
    again: their cached inodes are moved into place (e.g. this node's `step_100.tmp/__3_0.distcp`
    when another node renamed its `step_100.tmp` to `step_100`), and directories the move left
    empty are removed — the rename happens on every node;
  * a directory at P that is not a set here and holds only this node's own files of the
    manifest (the DCP shards this node wrote into the directory rank 0 committed): the set is
    completed in place around them (*adoption*);
  * a set at P restored from an older manifest: replaced (files still open keep it until the
    next listing);
  * a set committed here and still uploading: left alone (the conditional manifest PUT decides
    which commit wins, cachemgr.tiering); a set committed here and durable whose manifest was
    since replaced by another node's later commit: replaced like a restored one;
  * anything else (local data the manifest does not name, open files): left alone, logged, and
    retried at the next listing.

A restored set whose manifest left the store is removed here.

Concurrency: runs on the daemon's trio thread; each apply is one index transaction (an apply
refused half-way by a name conflict rolls back whole).
"""

from __future__ import annotations

import json
import logging
import stat
import time

import trio

from . import manifest as mf
from . import validate
from .errors import FsError
from .names import escape_name, escape_path, to_str, unescape_name, unescape_path
from .sets import KEPT_STATES
from .store import NotFound, StoreError
from .transfer import StoredObject

log = logging.getLogger(__name__)

# Manifest GETs in flight during one listing: a fresh node lists every set once, and a GET is
# ~5 ms against the test store and 10-30 ms against S3, so 1,000 sets take ~0.3-2 s at 16.
_GET_CONCURRENCY = 16
# JSON bytes of manifests read and held at once by one listing step (each at most
# validate.MAX_DOCUMENT_BYTES): what bounds a listing's memory, whatever the store holds.
_HOLD_BYTES = 64 << 20


class _InTheWay(Exception):
    pass


def _b(s: str) -> bytes:
    """The name (bytes) of one component of a set path. Paths in the index and in manifests
    (as mf.loads returns them) are in the escaped form of cachemgr.names."""
    return unescape_name(s)


class RemoteSync:
    """Materialise the store's sets in the local namespace; see the module docstring."""

    def __init__(self, tiering, interval: float) -> None:
        self.t = tiering
        self.core = tiering.core
        self.index = tiering.index
        self.interval = interval
        self.syncs = 0
        self.last_sync: float | None = None
        self.applied = 0
        self.adopted_files = 0
        self.removed = 0
        self._blocked: dict[str, str] = {}  # path -> why it was not applied (logged once)
        # Manifests that failed validation: key -> (etag, why); skipped until their etag
        # changes, so each is logged once (cachemgr.validate).
        self._invalid: dict[str, tuple[str, str]] = {}
        # Set paths of hashed manifest keys (cachemgr.keys), learned from their documents.
        self._long: dict[str, str] = {}
        # Object keys each listed manifest of another node names (key -> keys), so that deleting
        # a set here never deletes an object another manifest still names.
        self._named: dict[str, frozenset[str]] = {}
        # Set once the first listing finished (applied, or failed: `first_error`). The mount
        # reports ready only after it (ckptfs.mount), so a job resuming right after `ckptfs
        # mount` sees every set the store held then.
        self.first_listing = trio.Event()
        self.first_error: str | None = None

    async def run(self) -> None:
        """List the store every `interval` seconds. The first listing is what a mount waits for
        (`first_listing`): `ckptfs mount` returns only once the namespace holds every set the
        store listed then. With interval 0 the store is listed once (until a listing
        succeeds)."""
        while True:
            try:
                await self.sync_once()
                self.first_error = None
            except StoreError as e:
                log.warning("listing the store's sets failed: %s", e)
                if self.syncs == 0:
                    self.first_error = str(e)
            self.first_listing.set()
            if self.interval <= 0 and self.syncs:
                return
            await trio.sleep(self.interval if self.interval > 0 else 1.0)

    async def sync_once(self) -> None:
        """One listing of the store, applied as one step: every manifest that changed is read
        first (concurrently, no namespace change meanwhile), then all of them are applied with
        no await in between, so the FUSE loop (the same trio thread) never serves a request
        that sees half a listing. Sets are applied in commit order, symlinks after every other
        set, and sets that left the store are removed last: a `latest` link never shows before
        the checkpoint it names, and the checkpoint it named before goes only after it moved.

        Every manifest is validated (cachemgr.validate) before use; one that fails is skipped
        and reported once (`invalid`, until its etag changes), and the rest apply. Memory is
        bounded: a manifest over MAX_DOCUMENT_BYTES is not read, and the changed manifests of
        one listing are read and applied in steps of at most _HOLD_BYTES of JSON (a listing
        of more than that applies in several steps, each in commit order)."""
        listed: dict[str, object] = {}  # manifest key -> ObjectInfo
        for info in await self.t.store.list(mf.MANIFEST_PREFIX):
            if mf.is_manifest_key(info.key):
                listed[info.key] = info
        # Forget what no longer is: bad documents replaced or gone, paths of hashed keys.
        for d in (self._invalid, self._long, self._named):
            for key in [k for k in d if k not in listed or (
                    d is self._invalid and d[k][0] != listed[k].etag)]:
                del d[key]
        todo = []
        for key, info in sorted(listed.items()):
            if key in self._invalid:
                continue  # reported once; read again when its etag changes
            path = mf.path_of_manifest_key(key) or self._long.get(key)
            if path is None or self._wanted(path, info.etag):
                todo.append((key, info))
        while todo:
            batch, size = [], 0
            while todo and (not batch or size + todo[0][1].size <= _HOLD_BYTES):
                key, info = todo.pop(0)
                batch.append((key, info))
                size += info.size
            await self._sync_batch(batch)
        for s in self.t.sets.by_states(("durable",)):
            if s.origin != "local" and mf.manifest_key(s.path) not in listed:
                try:
                    self._remove(s)
                    self._blocked.pop(s.path, None)
                except Exception as e:  # a full disk, a bug: the others go on, retried later
                    why = f"left the store, not removed here: {e}"
                    if self._blocked.get(s.path) != why:
                        log.warning("set %s %s", s.path, why,
                                    exc_info=not isinstance(e, FsError))
                        self._blocked[s.path] = why
        self.syncs += 1
        self.last_sync = time.time()

    async def _sync_batch(self, batch: list) -> None:
        """Read the manifests of `batch` ([(key, info)]), then apply them in one step."""
        got: dict[str, dict] = {}
        limiter = trio.CapacityLimiter(_GET_CONCURRENCY)

        async def get_one(key: str, info) -> None:
            if info.size > validate.MAX_DOCUMENT_BYTES:
                self._reject(key, info.etag, f"it is {info.size} bytes, more than the"
                             f" {validate.MAX_DOCUMENT_BYTES} a manifest may have")
                return
            async with limiter:
                try:
                    data = await self.t.store.get(key)
                except NotFound:
                    return  # deleted between the listing and the GET: a set being deleted
            try:
                got[key] = mf.loads(data, key)
            except mf.ManifestError as e:
                self._reject(key, info.etag, str(e))

        async with trio.open_nursery() as n:
            for key, info in batch:
                n.start_soon(get_one, key, info)
        # From here on: no await until the batch is applied.
        ready = [(key, info, got[key]) for key, info in batch if key in got]
        ready.sort(key=lambda x: (x[2]["kind"] == "symlink", x[2]["commit"]["committed_ns"],
                                  x[2]["path"]))
        for key, info, m in ready:
            path = m["path"]
            if mf.path_of_manifest_key(key) is None:
                self._long[key] = path
            if m["commit"]["node"] == self.t.node:
                continue  # published by this cache
            # Remembered until the set is applied here (the index knows its objects then).
            self._named[key] = frozenset(f["object"]["key"] for f in m["files"])
            if self._wanted(path, info.etag):  # again: a local commit may have come meanwhile
                try:
                    if self._apply(m, info.etag, self.t.sets.newest_at(path)):
                        self._named.pop(key, None)
                except Exception as e:  # one set must not stop the others
                    # A bug, not bad input (that is refused above): the set's transaction
                    # rolled back whole, the next listing tries again.
                    why = f"internal error {e!r}"
                    if self._blocked.get(path) != why:
                        log.exception("store set %s not restored", path)
                        self._blocked[path] = why

    def _reject(self, key: str, etag: str, why: str) -> None:
        """Manifest `key` (at `etag`) must not be used: skipped, logged once, shown in status."""
        self._invalid[key] = (etag, why)
        log.warning("skipping manifest %s: %s", key, why)

    def keys_named_elsewhere(self, path: str, keys: set[str]) -> set[str]:
        """Those of `keys` (object keys) that a manifest of the store other than `path`'s
        names, as of the last listing (sets applied here: see SetRegistry)."""
        mine = mf.manifest_key(path)
        out: set[str] = set()
        for key, named in self._named.items():
            if key != mine:
                out |= keys & named
        return out

    def _wanted(self, path: str, etag: str) -> bool:
        """Should the listed manifest of `path` (with `etag`) be applied here?"""
        cur = self.t.sets.newest_at(path)
        if cur is not None and cur.etag == etag:
            return False
        # Ours and pending (its conditional PUT settles the race), being deleted, or
        # published before manifests' etags were recorded: local wins.
        return not (cur is not None and cur.origin == "local" and (
            cur.state in ("committed", "uploading", "deleting") or
            (cur.state == "durable" and cur.etag is None)))

    # -- applying one manifest ---------------------------------------------------------------

    def _apply(self, m: dict, etag: str, cur) -> bool:
        """Make the manifest's set the one at its path here; False if it was not applied."""
        path = m["path"]
        parts = path.split("/")
        name = _b(parts[-1])
        moved: list[tuple[int, bytes]] = []
        try:
            # One transaction tied to memory (CacheFs.transaction): if the apply fails half
            # way, the index, the in-memory inodes and the cache files are as they were (cache
            # files of removed entries are deleted only once it committed).
            with self.core.transaction():
                # ensure_dirs takes names as os functions do (undecodable bytes as surrogates).
                parent = self.core.ensure_dirs([to_str(p) for p in parts[:-1]])
                root, files, moved, adopted = self._install(m, parent, name, cur)
                if cur is not None and cur.state in KEPT_STATES:
                    self.t.sets.set_state(cur.seq, "replaced", "a newer manifest in the store")
                self.t.sets.record_remote(m, root, etag, files)
        except _InTheWay as e:
            if self._blocked.get(path) != str(e):
                log.info("store set %s not restored here: %s", path, e)
                self._blocked[path] = str(e)
            return False
        except FsError as e:
            if self._blocked.get(path) != str(e):
                log.warning("store set %s not restored: %s", path, e)
                self._blocked[path] = str(e)
            return False
        self._blocked.pop(path, None)
        self.applied += 1
        self.adopted_files += adopted
        log.info("restored set %s from the store (%d files, %d of them written here, %d bytes,"
                 " committed by node %s)", path, len(m["files"]), adopted,
                 m.get("total_bytes", 0), m["commit"].get("node"))
        for d, n in moved:
            self.core.invalidate_entry(d, n)
        self.core.invalidate_entry(parent, name)
        self.t.parts.mark_all()
        self.t._changed_now()
        return True

    def _own(self, m: dict) -> dict[str, int]:
        """{rel: ino} of the manifest's files whose object is this node's upload of a content
        its inode still has (closed, not open for writing), and whose inode is where the set
        says it was: at the same `rel` under the set's path or under the path the set was
        renamed from (`commit.from`). A manifest can move nothing else of this node's: not a
        file elsewhere, not a file of a set this node committed at another path."""
        out = {}
        roots = [m["path"]] + ([m["commit"]["from"]] if "from" in m["commit"] else [])
        for f in m["files"]:
            key = f["object"]["key"]
            if not validate.is_own_object(key, self.t.node):
                continue
            r = self.index.conn.execute(
                "SELECT o.ino FROM objects o JOIN inodes i ON i.ino = o.ino WHERE o.key=? AND"
                " i.version = o.version AND i.obj_version = o.version AND i.nlink > 0 AND"
                " i.writing = 0", (key,)).fetchone()
            if r is None or self.core.inode(r[0]).writers:
                continue
            where = self.index.path_of(r[0])
            at = [root for root in roots
                  if where == (f"{root}/{f['path']}" if f["path"] else root)]
            if not at:
                log.warning("set %s names this node's object %s, whose file is at %s: not"
                            " moved", m["path"], key, where)
                continue
            owner = self.t.sets.set_of_file(r[0])
            if owner is not None and owner.origin == "local" and not (
                    owner.path == m["path"] or owner.path.startswith(m["path"] + "/")):
                # Part of a set this node committed elsewhere, `commit.from` included: a
                # manifest claiming a rename of this node's own set must not take its files.
                continue
            out[f["path"]] = r[0]
        return out

    def _tree(self, root: int) -> dict[str, tuple[int, int, int, bytes]]:
        """{rel: (ino, mode, parent, name)} of everything under directory `root`."""
        out = {}
        stack = [(root, "")]
        while stack:
            d, prefix = stack.pop()
            for _id, name, ino in self.index.list_dentries(d, 0, 1 << 30):
                name = bytes(name)
                rel = prefix + escape_name(name)
                mode = self.core.inode(ino).mode
                out[rel] = (ino, mode, d, name)
                if stat.S_ISDIR(mode):
                    stack.append((ino, rel + "/"))
        return out

    def _install(self, m: dict, parent: int, name: bytes, cur):
        """Make the entry `name` in `parent` the manifest's set. Returns (root ino, set files,
        moved entries, adopted count); raises _InTheWay (nothing changed: the caller's
        transaction rolls back) when local data not in the manifest is there."""
        own = self._own(m)
        restored = cur is not None and (cur.origin != "local" or cur.state not in KEPT_STATES)
        # Files of the set the manifest replaces (restored from an older manifest, or this
        # node's own commit of the path that lost to a later one) may go; nothing else may.
        replaceable = {r[1] for r in self.t.sets.files(cur.seq)} if restored else set()
        existing = self.index.lookup(parent, name)
        if existing is not None:
            node = self.core.inode(existing)
            kind = "dir" if node.is_dir else "symlink" if stat.S_ISLNK(node.mode) else "file"
            if kind != m["kind"] or m["kind"] == "symlink" or (
                    m["kind"] == "file" and own.get("") != existing):
                if not (restored and cur.root_ino == existing) or self._busy(existing):
                    raise _InTheWay(f"a local {kind} is at {m['path']}")
                self.core.remove_tree(parent, name)
                existing = None
        keep: dict[str, int] = {}
        if existing is not None and m["kind"] == "dir":
            want_files = {f["path"]: f for f in m["files"]}
            want_links = {s["path"]: s["target"] for s in m.get("symlinks", [])}
            want_dirs = {d["path"] for d in m.get("dirs", [])}
            for rel in list(want_files) + list(want_links):
                p = rel.rsplit("/", 1)[0] if "/" in rel else ""
                while p:
                    want_dirs.add(p)
                    p = p.rsplit("/", 1)[0] if "/" in p else ""
            tree = self._tree(existing)
            remove = []
            for rel, (ino, mode, d, n) in sorted(tree.items()):
                if stat.S_ISDIR(mode):
                    if rel not in want_dirs:
                        remove.append((rel, d, n))
                elif stat.S_ISREG(mode):
                    if own.get(rel) == ino:
                        keep[rel] = ino
                    elif (self.core.inode(ino).version == 0 or ino in replaceable) and \
                            restored and not self.core.inode(ino).opens:
                        remove.append((rel, d, n))
                    else:
                        raise _InTheWay(f"{m['path']}/{rel} holds data this node has and the"
                                        " manifest does not name")
                elif stat.S_ISLNK(mode):
                    target = self.core.inode(ino).target or b""
                    if want_links.get(rel) == escape_path(target):
                        keep[rel] = ino
                    elif restored:
                        remove.append((rel, d, n))
                    else:
                        raise _InTheWay(f"a local symlink is at {m['path']}/{rel}")
                else:
                    raise _InTheWay(f"a local special file is at {m['path']}/{rel}")
            # A directory to remove must hold nothing this node keeps.
            for rel, _d, _n in remove:
                if any(k.startswith(rel + "/") for k in keep):
                    raise _InTheWay(f"{m['path']}/{rel} holds files this node wrote")
            for rel, d, n in sorted(remove, key=lambda x: x[0].count("/")):
                if self.index.lookup(d, n) is not None:
                    self.core.remove_tree(d, n)
        elif existing is not None:  # a file set: this node's own file, already in place
            keep[""] = existing
        return self._materialise(m, parent, name, existing, keep, own)

    def _busy(self, ino: int) -> bool:
        """Is a file at or under `ino` open? (An explicit stack: trees may be deep.)"""
        stack = [ino]
        while stack:
            node = self.core.inode(stack.pop())
            if node.is_reg:
                if node.opens > 0:
                    return True
            elif node.is_dir:
                stack.extend(c for _i, _n, c in self.index.list_dentries(node.ino, 0, 1 << 30))
        return False

    def _materialise(self, m: dict, parent: int, name: bytes, existing: int | None,
                     keep: dict[str, int], own: dict[str, int]):
        raw = self.core.raw_create
        files: list[tuple] = []
        moved: list[tuple[int, bytes]] = []
        emptied: set[int] = set()
        adopted = 0

        def place(d: int, fname: bytes, f: dict, rel: str) -> None:
            nonlocal adopted
            obj = StoredObject.from_json(f["object"])  # validates
            obj_json = json.dumps(obj.to_json())
            mode = stat.S_IMODE(f.get("mode", 0o644))
            ino = keep.get(rel)
            if ino is None and rel in own:
                # This node's own copy, elsewhere in the tree: move it into place.
                ino = own[rel]
                row = self.index.conn.execute(
                    "SELECT parent, name FROM dentries WHERE ino=? LIMIT 1", (ino,)).fetchone()
                if row is None:
                    ino = None
                else:
                    self.core.raw_move(row[0], bytes(row[1]), d, fname)
                    moved.append((row[0], bytes(row[1])))
                    emptied.add(row[0])
            if ino is not None:
                node = self.core.inode(ino)
                files.append((rel, ino, node.version, f["size"], mode, f.get("mtime_ns", 0),
                              obj_json))
                adopted += 1
                return
            ino = raw(d, fname, stat.S_IFREG | mode, size=f["size"], mtime_ns=f.get("mtime_ns"),
                      obj=obj_json)
            files.append((rel, ino, 0, f["size"], mode, f.get("mtime_ns", 0), obj_json))

        if m["kind"] == "file":
            (f,) = m["files"]
            place(parent, name, f, "")
            self._drop_emptied(emptied, parent)
            return files[0][1], files, moved, adopted
        if m["kind"] == "symlink":
            root = raw(parent, name, stat.S_IFLNK | 0o777, target=unescape_path(m["target"]))
            return root, files, moved, adopted
        root = existing if existing is not None else \
            raw(parent, name, stat.S_IFDIR | stat.S_IMODE(m.get("mode", 0o755)))

        def under(rel: str) -> tuple[int, bytes]:
            parts = rel.split("/")
            d = root
            for p in parts[:-1]:
                child = self.index.lookup(d, _b(p))
                d = child if child is not None else raw(d, _b(p), stat.S_IFDIR | 0o755)
            return d, _b(parts[-1])

        for d in sorted(m.get("dirs", []), key=lambda x: x["path"]):
            pd, dn = under(d["path"])
            if self.index.lookup(pd, dn) is None:
                raw(pd, dn, stat.S_IFDIR | stat.S_IMODE(d.get("mode", 0o755)),
                    mtime_ns=d.get("mtime_ns"))
        for f in m["files"]:
            pd, fn = under(f["path"])
            if f["path"] in keep:
                place(pd, fn, f, f["path"])
                continue
            if self.index.lookup(pd, fn) is not None:
                raise _InTheWay(f"{m['path']}/{f['path']} exists here")
            place(pd, fn, f, f["path"])
        for s in m.get("symlinks", []):
            if s["path"] in keep:
                continue
            pd, sn = under(s["path"])
            raw(pd, sn, stat.S_IFLNK | 0o777, target=unescape_path(s["target"]))
        # Creating entries touched their directories: put the manifest's mtimes back last.
        for d in m.get("dirs", []):
            if d.get("mtime_ns") is None:
                continue
            pd, dn = under(d["path"])
            ino = self.index.lookup(pd, dn)
            if ino is not None:
                self.core.raw_set_mtime(ino, d["mtime_ns"])
        self._drop_emptied(emptied, root)
        return root, files, moved, adopted

    def _drop_emptied(self, dirs: set[int], keep_ino: int) -> None:
        """Directories this node's files were moved out of, now empty (its own copy of a
        directory another node renamed): removed, and their parents likewise, up to the first
        one that is not empty, is a set, or is an ancestor of the new set."""
        for d in dirs:
            cur = d
            while cur != 1 and cur != keep_ino and not self.index.has_children(cur) and \
                    not self.t.sets.is_dir_set_root(cur) and not self._is_ancestor(cur, keep_ino):
                row = self.index.conn.execute(
                    "SELECT parent, name FROM dentries WHERE ino=? LIMIT 1", (cur,)).fetchone()
                if row is None:
                    break
                self.core.remove_tree(row[0], bytes(row[1]))
                self.core.invalidate_entry(row[0], bytes(row[1]))
                cur = row[0]

    def _is_ancestor(self, a: int, b: int) -> bool:
        cur = b
        while cur != 1:
            if cur == a:
                return True
            row = self.index.conn.execute(
                "SELECT parent FROM dentries WHERE ino=? LIMIT 1", (cur,)).fetchone()
            if row is None:
                return False
            cur = row[0]
        return a == 1

    # -- the committing node's own multi-node set ------------------------------------------

    def complete_local(self, seq: int, root: int, foreign: list[dict]) -> int:
        """Set `seq`, committed here and just published with files other nodes wrote
        (`foreign`: manifest file entries), shows them too: each becomes an evicted file under
        the set's root whose data the Restorer serves, and a file of the set. Runs inside the
        publish's transaction. An entry in the way (created here after the commit) is left
        alone and logged. Returns the number of files added."""
        added: list[tuple[int, bytes]] = []
        for f in sorted(foreign, key=lambda x: x["path"]):
            parts = f["path"].split("/")
            d: int | None = root
            for p in parts[:-1]:
                child = self.index.lookup(d, _b(p))
                if child is None:
                    child = self.core.raw_create(d, _b(p), stat.S_IFDIR | 0o755)
                    added.append((d, _b(p)))
                elif not self.core.inode(child).is_dir:
                    d = None
                    break
                d = child
            name = _b(parts[-1])
            if d is None or self.index.lookup(d, name) is not None:
                log.warning("set %d: %s from node %s not shown here: a local entry is in the"
                            " way", seq, f["path"], f.get("node", "?"))
                continue
            obj = StoredObject.from_json(f["object"])  # validates
            obj_json = json.dumps(obj.to_json())
            mode = stat.S_IMODE(f.get("mode", 0o644))
            ino = self.core.raw_create(d, name, stat.S_IFREG | mode, size=f["size"],
                                       mtime_ns=f.get("mtime_ns"), obj=obj_json)
            self.t.sets.add_file(seq, (f["path"], ino, 0, f["size"], mode,
                                       f.get("mtime_ns", 0), obj_json))
            added.append((d, name))
        for d, name in added:
            self.core.invalidate_entry(d, name)
        return len(added)

    # -- a set that left the store -----------------------------------------------------------

    def _remove(self, s) -> None:
        parts = s.path.split("/")
        parent = 1
        for p in parts[:-1]:
            child = self.index.lookup(parent, _b(p))
            if child is None:
                parent = None
                break
            parent = child
        name = _b(parts[-1])
        with self.index.tx():
            if parent is not None and self.index.lookup(parent, name) == s.root_ino and \
                    not self._busy(s.root_ino):
                self.core.remove_tree(parent, name)
            self.t.sets.set_state(s.seq, "deleted", "its manifest left the store")
        self.removed += 1
        log.info("set %s left the store; removed it here", s.path)
        if parent is not None:
            self.core.invalidate_entry(parent, name)
        self.t.parts.mark_all()
        self.t._changed_now()

    def status(self) -> dict:
        return {"interval_s": self.interval, "syncs": self.syncs, "last_sync": self.last_sync,
                "restored_sets": self.applied, "adopted_files": self.adopted_files,
                "removed_sets": self.removed, "not_restored": dict(self._blocked),
                "invalid_manifests": {k: why for k, (_e, why) in
                                      sorted(self._invalid.items())[:100]},
                "invalid_count": len(self._invalid)}
