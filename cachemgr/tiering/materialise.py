"""Materialising a manifest in the local namespace: the tree changes
`cachemgr.tiering.remote.RemoteSync` makes to apply another node's set here, and those a committer
makes to show the files other nodes wrote into its own multi-node set (`complete_local`).

`Materialiser.install` makes the entry at a manifest's path the manifest's set: new entries are
evicted files (`inodes.cached = 0`, version 0, the manifest's object recorded) whose data
`cachemgr.restore.restorer.Restorer` serves on demand; this node's own files of the set (its
objects, `data/<this node>/...`, still the content of their inode) are moved into place instead of
being fetched again, and directories the move left empty are removed (`_drop_emptied`). Local data
the manifest does not name is never removed: `InTheWay` is raised instead.

State, its owner and its guards: this module holds no state of its own. It changes the index
and the core's in-memory inodes only through the core's `raw_*` / `remove_tree` calls, inside the
caller's transaction (`CacheFs.transaction` for an apply, the publish's for `complete_local`), on
the daemon's trio thread with no await: the FUSE loop never sees half a set. It touches no cache
file: removed entries' cache files are deleted by the core once the transaction committed, and
new entries have none until the Restorer fills them (through `cachemgr.core.filecache.FileCache`).

Invariants: an entry is removed only if it is the replaced set's (restored from an older
manifest, or this node's own commit that lost to a later one), is not open, and holds no file
this node keeps; a file of this node's is moved only if its inode still has the content whose
object the manifest names, is closed, and sits where the manifest says (at its path or the path
the set was renamed from). Crash states: none of its own: the caller's transaction commits whole
or not at all; cache files of removed entries left by a crash are purged by the core's recovery.
"""

from __future__ import annotations

import json
import logging
import stat
from typing import TYPE_CHECKING

from cachemgr.core.hooks import KernelNotifier
from cachemgr.core.sets import KEPT_STATES, SetRow
from cachemgr.format import validate
from cachemgr.format.docs import FileDoc, GatheredFile, ManifestDoc
from cachemgr.format.names import escape_path, unescape_name, unescape_path
from cachemgr.format.objects import StoredObject

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import InodeTable
    from cachemgr.core.rawtree import RawTree
    from cachemgr.core.sets import SetRegistry

log = logging.getLogger(__name__)

# A manifest as cachemgr.format.manifest.loads returns it (validated).
Manifest = ManifestDoc
# A file of a set, as SetRegistry.record_remote / add_file take it:
# (rel path, ino, version, size, mode, mtime_ns, object JSON).
SetFile = tuple[str, int, int, int, int, int, str]


class InTheWay(Exception):
    """Local data not in the manifest is where the set goes: nothing was changed (the caller's
    transaction rolls back)."""


def _b(s: str) -> bytes:
    """The name (bytes) of one component of a set path. Paths in the index and in manifests
    (as mf.loads returns them) are in the escaped form of cachemgr.format.names."""
    return unescape_name(s)


class _Build:
    """What one `Materialiser._materialise` creates, moves and adopts."""

    def __init__(self, keep: dict[str, int], own: dict[str, int]) -> None:
        self.keep = keep
        self.own = own
        self.files: list[SetFile] = []
        self.moved: list[tuple[int, bytes]] = []
        self.emptied: set[int] = set()
        self.adopted = 0


class Materialiser:
    """The namespace side of applying a manifest; see the module docstring."""

    def __init__(self, *, table: InodeTable, tree: RawTree, index: Index, sets: SetRegistry,
                 kernel: KernelNotifier, node: str) -> None:
        self.table = table
        self.tree = tree
        self.kernel = kernel  # entries changed behind the kernel's back (ckptfs.fuse.KERNEL)
        self.index = index
        self.sets = sets
        self.node = node

    # -- this node's own files of a manifest --------------------------------------------------

    def invalidate(self, parent: int, name: bytes) -> None:
        """Tell the kernel entry `name` of `parent` changed behind its back."""
        self.kernel.invalidate_entry(parent, name)

    def own(self, m: Manifest) -> dict[str, int]:
        """{rel: ino} of the manifest's files whose object is this node's upload of a content
        its inode still has (closed, not open for writing), and whose inode is where the set
        says it was: at the same `rel` under the set's path or under the path the set was
        renamed from (`commit.from`). A manifest can move nothing else of this node's: not a
        file elsewhere, not a file of a set this node committed at another path."""
        out = {}
        roots = [m["path"]] + ([m["commit"]["from"]] if "from" in m["commit"] else [])
        for f in m["files"]:
            key = f["object"]["key"]
            if not validate.is_own_object(key, self.node):
                continue
            ino = self._own_current(key)
            if ino is None or self.table.get(ino).writers:
                continue
            where = self.index.path_of(ino)
            at = [root for root in roots
                  if where == (f"{root}/{f['path']}" if f["path"] else root)]
            if not at:
                log.warning("set %s names this node's object %s, whose file is at %s: not"
                            " moved", m["path"], key, where)
                continue
            owner = self.sets.set_of_file(ino)
            if owner is not None and owner.origin == "local" and not (
                    owner.path == m["path"] or owner.path.startswith(m["path"] + "/")):
                # Part of a set this node committed elsewhere, `commit.from` included: a
                # manifest claiming a rename of this node's own set must not take its files.
                continue
            out[f["path"]] = ino
        return out

    def _own_current(self, key: str) -> int | None:
        """The inode whose current content is this node's object `key`: linked, closed in
        the index, and uploaded as that object; or None."""
        content = self.sets.object_content(key)
        if content is None:
            return None
        ino, version = content
        row = self.index.inode_fields(ino, "version", "obj_version", "nlink", "writing")
        if row is None or row[0] != version or row[1] != version or row[2] <= 0 or row[3] != 0:
            return None
        return ino

    def _tree(self, root: int) -> dict[str, tuple[int, int, int, bytes]]:
        """{rel: (ino, mode, parent, name)} of everything under directory `root`."""
        out = {}
        for d, rel, row in self.index.walk_with_inodes(root):
            ino = row[1]
            out[rel] = (ino, self.table.get(ino).mode, d, row[0])
        return out

    def busy(self, ino: int) -> bool:
        """Is a file at or under `ino` open?"""
        node = self.table.get(ino)
        if node.is_reg:
            return node.opens > 0
        if not node.is_dir:
            return False
        return any(self.table.get(row[1]).opens > 0
                   for _d, _rel, row in self.index.walk_with_inodes(ino)
                   if stat.S_ISREG(row[2]))

    # -- installing a manifest's set -----------------------------------------------------------

    def install(self, m: Manifest, parent: int, name: bytes, cur: SetRow | None
                ) -> tuple[int, list[SetFile], list[tuple[int, bytes]], int]:
        """Make the entry `name` in `parent` the manifest's set. Returns (root ino, set files,
        moved entries, adopted count); raises InTheWay (nothing changed: the caller's
        transaction rolls back) when local data not in the manifest is there."""
        own = self.own(m)
        restored = cur is not None and (cur.origin != "local" or cur.state not in KEPT_STATES)
        # Files of the set the manifest replaces (restored from an older manifest, or this
        # node's own commit of the path that lost to a later one) may go; nothing else may.
        replaceable = ({r[1] for r in self.sets.files(cur.seq)} if cur is not None and restored
                       else set())
        existing = self.index.lookup(parent, name)
        if existing is not None:
            node = self.table.get(existing)
            kind = "dir" if node.is_dir else "symlink" if stat.S_ISLNK(node.mode) else "file"
            if kind != m["kind"] or m["kind"] == "symlink" or (
                    m["kind"] == "file" and own.get("") != existing):
                if not (restored and cur is not None and cur.root_ino == existing) or \
                        self.busy(existing):
                    raise InTheWay(f"a local {kind} is at {m['path']}")
                self.tree.remove_tree(parent, name)
                existing = None
        keep: dict[str, int] = {}
        if existing is not None and m["kind"] == "dir":
            keep = self._clear_dir(m, existing, own, restored, replaceable)
        elif existing is not None:  # a file set: this node's own file, already in place
            keep[""] = existing
        return self._materialise(m, parent, name, existing, _Build(keep, own))

    def _clear_dir(self, m: Manifest, existing: int, own: dict[str, int], restored: bool,
                   replaceable: set[int]) -> dict[str, int]:
        """The directory `existing` at the set's path becomes the set: remove what the manifest
        does not name and may go; return {rel: ino} of the entries kept (this node's own files,
        matching symlinks). InTheWay if anything else is there."""
        want_files = {f["path"]: f for f in m["files"]}
        want_links = {s["path"]: s["target"] for s in m.get("symlinks", [])}
        want_dirs = {d["path"] for d in m.get("dirs", [])}
        for rel in list(want_files) + list(want_links):
            p = rel.rsplit("/", 1)[0] if "/" in rel else ""
            while p:
                want_dirs.add(p)
                p = p.rsplit("/", 1)[0] if "/" in p else ""
        keep: dict[str, int] = {}
        remove = []
        for rel, (ino, mode, d, n) in sorted(self._tree(existing).items()):
            if stat.S_ISDIR(mode):
                if rel not in want_dirs:
                    remove.append((rel, d, n))
            elif stat.S_ISREG(mode):
                if own.get(rel) == ino:
                    keep[rel] = ino
                elif (self.table.get(ino).version == 0 or ino in replaceable) and \
                        restored and not self.table.get(ino).opens:
                    remove.append((rel, d, n))
                else:
                    raise InTheWay(f"{m['path']}/{rel} holds data this node has and the"
                                   " manifest does not name")
            elif stat.S_ISLNK(mode):
                target = self.table.get(ino).target or b""
                if want_links.get(rel) == escape_path(target):
                    keep[rel] = ino
                elif restored:
                    remove.append((rel, d, n))
                else:
                    raise InTheWay(f"a local symlink is at {m['path']}/{rel}")
            else:
                raise InTheWay(f"a local special file is at {m['path']}/{rel}")
        # A directory to remove must hold nothing this node keeps.
        for rel, _d, _n in remove:
            if any(k.startswith(rel + "/") for k in keep):
                raise InTheWay(f"{m['path']}/{rel} holds files this node wrote")
        for _rel, d, n in sorted(remove, key=lambda x: x[0].count("/")):
            if self.index.lookup(d, n) is not None:
                self.tree.remove_tree(d, n)
        return keep

    def _place(self, b: _Build, d: int, fname: bytes, f: FileDoc, rel: str) -> None:
        """The manifest's file `f` (at `rel`) as entry `fname` of directory `d`: this node's
        own copy if it has one (kept in place, or moved here), else a new evicted file."""
        obj = StoredObject.from_json(f["object"])  # validates
        obj_json = json.dumps(obj.to_json())
        mode = stat.S_IMODE(f.get("mode", 0o644))
        ino = b.keep.get(rel)
        if ino is None and rel in b.own:
            # This node's own copy, elsewhere in the tree: move it into place.
            ino = b.own[rel]
            entry = self.index.dentry_of(ino)
            if entry is None:
                ino = None
            else:
                self.tree.raw_move(entry[0], entry[1], d, fname)
                b.moved.append(entry)
                b.emptied.add(entry[0])
        if ino is not None:
            node = self.table.get(ino)
            b.files.append((rel, ino, node.version, f["size"], mode, f.get("mtime_ns", 0),
                            obj_json))
            b.adopted += 1
            return
        ino = self.tree.raw_create(d, fname, stat.S_IFREG | mode, size=f["size"],
                                   mtime_ns=f.get("mtime_ns"), obj=obj_json)
        b.files.append((rel, ino, 0, f["size"], mode, f.get("mtime_ns", 0), obj_json))
        if validate.is_takeover_object(obj.key, self.node):
            # An object this node uploaded when it took over a lost node's replica
            # (cachemgr.tiering.replicate.Takeover): no inode of this node's had that content
            # until now, so nothing owned it. It is owned by the file that now holds it: the
            # GC (SetRegistry.garbage) deletes it once that content is no longer kept (the
            # path re-committed, replaced or deleted), as any object this node uploaded. A
            # later manifest naming it again moves the row to its file (INSERT OR REPLACE).
            self.sets.add_object(obj.key, ino, 0, obj.stored_size)

    def _place_new(self, b: _Build, known: dict[str, int],
                   files: list[FileDoc]) -> None:
        """The manifest's files under `root`, a directory this apply has just created (so no
        name is taken: a manifest names each path once, cachemgr.format.validate): this
        node's own copies moved in one by one (`_place`), every other file created with its
        directory's siblings in one step (`RawTree.raw_create_files`: two statements per
        directory instead of ~7 per file). The objects were validated with the manifest
        (validate.stored_object: the same checks and the same fields as StoredObject), so
        their JSON is written as it is."""
        by_dir: dict[int, list[tuple[int, bytes, FileDoc, str]]] = {}
        for i, f in enumerate(files):
            rel = f["path"]
            last = rel.rpartition("/")[2]
            d = self._under(known, rel)[0]
            if rel in b.own:
                self._place(b, d, _b(last), f, rel)
            else:
                by_dir.setdefault(d, []).append((i, _b(last), f, json.dumps(f["object"])))
        placed: list[tuple[int, SetFile]] = []
        for d, entries in by_dir.items():
            inos = self.tree.raw_create_files(d, [
                (fname, f.get("mode", 0o644), f["size"], f.get("mtime_ns"), obj_json)
                for _i, fname, f, obj_json in entries])
            for ino, (i, _fname, f, obj_json) in zip(inos, entries, strict=True):
                mode = stat.S_IMODE(f.get("mode", 0o644))
                placed.append((i, (f["path"], ino, 0, f["size"], mode, f.get("mtime_ns", 0),
                                   obj_json)))
                if validate.is_takeover_object(f["object"]["key"], self.node):
                    # as in _place
                    self.sets.add_object(f["object"]["key"], ino, 0, f["object"]["stored_size"])
        b.files.extend(row for _i, row in sorted(placed, key=lambda x: x[0]))

    def _under(self, known: dict[str, int], rel: str) -> tuple[int, bytes]:
        """(directory, name) of `rel` under the set's root, creating missing directories.
        `known` ({rel dir: ino}, "" the root) is this apply's memo of the directories found or
        made: a path costs one seek per directory not yet known, so a set of depth d costs
        O(d) seeks, not O(d^2) (a 1,500-level tree: ~1.1 million seeks, 5 s on the loop,
        before the memo)."""
        head, _sep, leaf = rel.rpartition("/")
        missing: list[str] = []
        p = head
        while p not in known:
            missing.append(p)
            p = p.rpartition("/")[0]
        d = known[p]
        for q in reversed(missing):
            name = _b(q.rpartition("/")[2])
            child = self.index.lookup(d, name)
            d = known[q] = child if child is not None else self.tree.raw_create(
                d, name, stat.S_IFDIR | 0o755)
        return d, _b(leaf)

    def _materialise(self, m: Manifest, parent: int, name: bytes, existing: int | None,
                     b: _Build) -> tuple[int, list[SetFile], list[tuple[int, bytes]], int]:
        raw = self.tree.raw_create
        if m["kind"] == "file":
            (f,) = m["files"]
            self._place(b, parent, name, f, "")
            self._drop_emptied(b.emptied, parent)
            return b.files[0][1], b.files, b.moved, b.adopted
        if m["kind"] == "symlink":
            root = raw(parent, name, stat.S_IFLNK | 0o777, target=unescape_path(m["target"]))
            return root, b.files, b.moved, b.adopted
        root = existing if existing is not None else \
            raw(parent, name, stat.S_IFDIR | stat.S_IMODE(m.get("mode", 0o755)))
        known = {"": root}  # this apply's directories by relative path (_under)
        for d in sorted(m.get("dirs", []), key=lambda x: x["path"]):
            pd, dn = self._under(known, d["path"])
            ino = self.index.lookup(pd, dn)
            known[d["path"]] = ino if ino is not None else raw(
                pd, dn, stat.S_IFDIR | stat.S_IMODE(d.get("mode", 0o755)),
                mtime_ns=d.get("mtime_ns"))
        if existing is None:
            self._place_new(b, known, m["files"])
        else:
            for f in m["files"]:
                pd, fn = self._under(known, f["path"])
                if f["path"] not in b.keep and self.index.lookup(pd, fn) is not None:
                    raise InTheWay(f"{m['path']}/{f['path']} exists here")
                self._place(b, pd, fn, f, f["path"])
        for s in m.get("symlinks", []):
            if s["path"] in b.keep:
                continue
            pd, sn = self._under(known, s["path"])
            raw(pd, sn, stat.S_IFLNK | 0o777, target=unescape_path(s["target"]))
        # Creating entries touched their directories: put the manifest's mtimes back last.
        for d in m.get("dirs", []):
            mtime_ns = d["mtime_ns"]
            if mtime_ns is None:
                continue
            ino = known.get(d["path"])
            if ino is not None:
                self.tree.raw_set_mtime(ino, mtime_ns)
        self._drop_emptied(b.emptied, root)
        return root, b.files, b.moved, b.adopted

    def _drop_emptied(self, dirs: set[int], keep_ino: int) -> None:
        """Directories this node's files were moved out of, now empty (its own copy of a
        directory another node renamed): removed, and their parents likewise, up to the first
        one that is not empty, is a set, or is an ancestor of the new set."""
        for d in dirs:
            cur = d
            while cur != 1 and cur != keep_ino and not self.index.has_children(cur) and \
                    not self.sets.is_dir_set_root(cur) and \
                    not self.index.is_ancestor(cur, keep_ino):
                entry = self.index.dentry_of(cur)
                if entry is None:
                    break
                self.tree.remove_tree(*entry)
                self.invalidate(*entry)
                cur = entry[0]

    # -- the committing node's own multi-node set ------------------------------------------

    def complete_local(self, seq: int, root: int, foreign: list[GatheredFile]) -> int:
        """Set `seq`, committed here and just published with files other nodes wrote
        (`foreign`: manifest file entries), shows them too: each becomes an evicted file under
        the set's root whose data the Restorer serves, and a file of the set. Runs inside the
        publish's transaction. An entry in the way (created here after the commit) is left
        alone and logged. Returns the number of files added."""
        added: list[tuple[int, bytes]] = []
        for f in sorted(foreign, key=lambda x: x["path"]):
            parts = f["path"].split("/")
            d = root
            blocked = False
            for p in parts[:-1]:
                child = self.index.lookup(d, _b(p))
                if child is None:
                    child = self.tree.raw_create(d, _b(p), stat.S_IFDIR | 0o755)
                    added.append((d, _b(p)))
                elif not self.table.get(child).is_dir:
                    blocked = True
                    break
                d = child
            name = _b(parts[-1])
            if blocked or self.index.lookup(d, name) is not None:
                log.warning("set %d: %s from node %s not shown here: a local entry is in the"
                            " way", seq, f["path"], f.get("node", "?"))
                continue
            obj = StoredObject.from_json(f["object"])  # validates
            obj_json = json.dumps(obj.to_json())
            mode = stat.S_IMODE(f.get("mode", 0o644))
            ino = self.tree.raw_create(d, name, stat.S_IFREG | mode, size=f["size"],
                                       mtime_ns=f.get("mtime_ns"), obj=obj_json)
            self.sets.add_file(seq, (f["path"], ino, 0, f["size"], mode,
                                     f.get("mtime_ns", 0), obj_json))
            added.append((d, name))
        for d, name in added:
            self.invalidate(d, name)
        return len(added)
