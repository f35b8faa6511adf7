"""The directory tree operations of the filesystem core: lookup, create, link, remove, rename.

`Namespace` owns no state of its own: it changes the index's dentries and the inodes of
`InodeTable`, each operation in one `InodeTable.tx` (see cachemgr.core.inodes for the discipline),
and tells `FsHooks` (cachemgr.core.hooks) what changed inside that same transaction, so a commit a
rename or a removal triggers is durable exactly when the operation is.

Crash states: every operation is one committed index transaction; a regular file's cache file is
created inside the transaction that creates its inode (a crash before COMMIT leaves a stray
cache file, deleted by `CacheFs.recover()`, never an inode without its cache file).
"""

from __future__ import annotations

import errno
import stat
from collections.abc import Iterator

from cachemgr.core.errors import FsError
from cachemgr.core.filecache import FileCache
from cachemgr.core.hooks import FsHooks
from cachemgr.core.index import ROOT_INO, Index
from cachemgr.core.inodes import Inode, InodeTable, now_ns, retry_when_full

NAME_MAX = 255
SYMLINK_MAX = 4095
RENAME_NOREPLACE = 1  # linux/fs.h
RENAME_EXCHANGE = 2
READDIR_BATCH = 256  # entries fetched from the index per readdir round trip


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
    if not name or b"/" in name or name in (b".", b".."):
        raise FsError(errno.EINVAL, f"invalid name {name!r}")


class Namespace:
    """POSIX operations on the directory tree."""

    def __init__(self, index: Index, table: InodeTable, files: FileCache,
                 hooks: FsHooks) -> None:
        self.index = index
        self.table = table
        self.files = files
        self.hooks = hooks

    # -- helpers -------------------------------------------------------------------------------

    def dir(self, ino: int) -> Inode:
        node = self.table.get(ino)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        return node

    def child(self, parent: int, name: bytes) -> Inode:
        ino = self.index.lookup(parent, name)
        if ino is None:
            raise FsError(errno.ENOENT)
        return self.table.get(ino)

    def touch_dir(self, d: Inode, now: int) -> None:
        self.table.touch_dir(d, now)

    def new_inode(self, parent: Inode, name: bytes, mode: int, uid: int, gid: int, *,
                  target: bytes | None = None) -> Inode:
        check_name(name)
        if self.index.lookup(parent.ino, name) is not None:
            raise FsError(errno.EEXIST)
        now = now_ns()
        is_dir = stat.S_ISDIR(mode)
        with self.table.tx(parent):
            ino = self.index.insert_inode(
                mode=mode, uid=uid, gid=gid, now=now, nlink=2 if is_dir else 1,
                size=len(target) if target is not None else 0, target=target,
            )
            if stat.S_ISREG(mode):
                # Create the cache file inside the transaction: a crash before COMMIT leaves a
                # stray file (deleted by recover()), never an inode without its cache file.
                self.files.create(ino)
                self.index.on_rollback(lambda: self.files.unlink(ino))
            self.index.add_dentry(parent.ino, name, ino)
            if is_dir:
                parent.nlink += 1
            self.touch_dir(parent, now)
            node = self.table.get(ino)
            self.table.unload_on_rollback(ino)
            node.new_file = stat.S_ISREG(mode)
            node.lookups += 1
        return node

    # -- lookups -------------------------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Inode:
        """Resolve `name` in `parent` and take one kernel reference on the result."""
        d = self.dir(parent)
        if name == b".":
            node = d
        elif name == b"..":
            node = self.table.get(self.index.parent_of(parent) or ROOT_INO)
        else:
            if len(name) > NAME_MAX:
                raise FsError(errno.ENAMETOOLONG)
            node = self.child(parent, name)
        node.lookups += 1
        return node

    def forget(self, ino: int, nlookup: int) -> None:
        node = self.table.if_loaded(ino)
        if node is None:
            return
        node.lookups = max(0, node.lookups - nlookup)
        self.table.maybe_drop(node)

    def readdir(self, ino: int, start_id: int) -> Iterator[tuple[int, bytes, Inode]]:
        """Yield (next_id, name, inode) for entries after `start_id`, in `id` order. The caller
        takes a lookup reference (`ref()`) for each entry it actually hands to the kernel."""
        after = start_id
        while True:
            rows = self.index.list_dentries(ino, after, READDIR_BATCH)
            if not rows:
                return
            for dent_id, name, child in rows:
                yield dent_id, bytes(name), self.table.get(child)
                after = dent_id

    def readlink(self, ino: int) -> bytes:
        node = self.table.get(ino)
        if not stat.S_ISLNK(node.mode):
            raise FsError(errno.EINVAL, "not a symlink")
        assert node.target is not None
        return node.target

    # -- creating --------------------------------------------------------------------------------

    @retry_when_full
    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        d = self.dir(parent)
        return self.new_inode(d, name, stat.S_IFDIR | stat.S_IMODE(mode), uid, gid)

    @retry_when_full
    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        d = self.dir(parent)
        if len(target) > SYMLINK_MAX:
            raise FsError(errno.ENAMETOOLONG, f"symlink target longer than {SYMLINK_MAX} bytes")
        with self.table.tx():  # the symlink and the commit it may trigger: one transaction
            node = self.new_inode(d, name, stat.S_IFLNK | 0o777, uid, gid, target=target)
            self.hooks.on_symlink(node, parent, name)
        return node

    @retry_when_full
    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int, gid: int) -> Inode:
        if not stat.S_ISREG(mode):
            # Checkpoint directories hold regular files, directories and symlinks only.
            raise FsError(errno.EPERM, "only regular files, directories and symlinks")
        d = self.dir(parent)
        return self.new_inode(d, name, stat.S_IFREG | stat.S_IMODE(mode), uid, gid)

    def link(self, ino: int, new_parent: int, new_name: bytes) -> Inode:
        # EPERM is what link(2) returns when "the filesystem does not support the creation of
        # hard links". Hard links would make a file belong to two shard sets at once.
        raise FsError(errno.EPERM, "hard links are not supported")

    # -- removing --------------------------------------------------------------------------------

    def _path_for_hooks(self, ino: int) -> str | None:
        return self.index.path_of(ino)

    @retry_when_full
    def unlink(self, parent: int, name: bytes) -> None:
        d = self.dir(parent)
        node = self.child(parent, name)
        if node.is_dir:
            raise FsError(errno.EISDIR)
        now = now_ns()
        path = self._path_for_hooks(node.ino)
        with self.table.tx(node, d):
            self.index.remove_dentry(parent, name)
            node.nlink -= 1
            node.ctime_ns = now
            self.table.save(node, "nlink", "ctime_ns")
            self.touch_dir(d, now)
            if path is not None:
                self.hooks.on_remove(node, path)
        self.table.maybe_drop(node)

    @retry_when_full
    def rmdir(self, parent: int, name: bytes) -> None:
        d = self.dir(parent)
        node = self.child(parent, name)
        if not node.is_dir:
            raise FsError(errno.ENOTDIR)
        if self.index.has_children(node.ino):
            raise FsError(errno.ENOTEMPTY)
        now = now_ns()
        path = self._path_for_hooks(node.ino)
        with self.table.tx(node, d):
            self.index.remove_dentry(parent, name)
            node.nlink = 0
            self.table.save(node, "nlink")
            d.nlink -= 1
            self.touch_dir(d, now)
            if path is not None:
                self.hooks.on_remove(node, path)
        self.table.maybe_drop(node)

    # -- renaming --------------------------------------------------------------------------------

    @retry_when_full
    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int = 0) -> None:
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or flags == (
            RENAME_NOREPLACE | RENAME_EXCHANGE
        ):
            raise FsError(errno.EINVAL, f"unsupported rename flags {flags:#x}")
        od = self.dir(old_parent)
        nd = self.dir(new_parent)
        check_name(new_name)
        src = self.child(old_parent, old_name)
        dst_ino = self.index.lookup(new_parent, new_name)
        dst = self.table.get(dst_ino) if dst_ino is not None else None
        if flags & RENAME_EXCHANGE:
            if dst is None:
                raise FsError(errno.ENOENT)
            return self._exchange(od, old_name, src, nd, new_name, dst)
        if dst is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if dst.ino == src.ino:
                return None  # POSIX: same file, do nothing
        if src.is_dir and new_parent != old_parent and self.index.is_ancestor(src.ino,
                                                                              new_parent):
            raise FsError(errno.EINVAL, "cannot move a directory into itself")
        if dst is not None:
            if src.is_dir and not dst.is_dir:
                raise FsError(errno.ENOTDIR)
            if not src.is_dir and dst.is_dir:
                raise FsError(errno.EISDIR)
            if dst.is_dir and self.index.has_children(dst.ino):
                raise FsError(errno.ENOTEMPTY)
        self._move(od, old_name, src, nd, new_name, dst)
        if dst is not None:
            self.table.maybe_drop(dst)
        return None

    def _move(self, od: Inode, old_name: bytes, src: Inode, nd: Inode, new_name: bytes,
              dst: Inode | None) -> None:
        """The checked rename of `src` over `dst` (None: the name is free), one transaction."""
        now = now_ns()
        old_parent, new_parent = od.ino, nd.ino
        old_path = self._path_for_hooks(src.ino)
        with self.table.tx(src, od, nd, *([dst] if dst is not None else [])):
            if dst is not None:
                # The target entry keeps its row (its id = readdir position) and now names
                # src: a listing under way sees the replaced name exactly once.
                self.index.set_dentry_ino(new_parent, new_name, src.ino)
                self.index.remove_dentry(old_parent, old_name)
                if dst.is_dir:
                    dst.nlink = 0
                    nd.nlink -= 1
                else:
                    dst.nlink -= 1
                dst.ctime_ns = now
                self.table.save(dst, "nlink", "ctime_ns")
            else:
                self.index.move_dentry(old_parent, old_name, new_parent, new_name)
            if src.is_dir and old_parent != new_parent:
                od.nlink -= 1
                nd.nlink += 1
            src.ctime_ns = now
            self.table.save(src, "ctime_ns")
            self.touch_dir(od, now)
            if nd is not od:
                self.touch_dir(nd, now)
            if old_path is not None:
                # Inside the rename's transaction: the commit it triggers (if any) is durable
                # exactly when the rename is.
                self.hooks.on_rename(src, dst, old_parent, old_name, new_parent, new_name,
                                     old_path)

    def _exchange(self, od: Inode, old_name: bytes, a: Inode, nd: Inode, new_name: bytes,
                  b: Inode) -> None:
        if od is not nd:
            for moving, into in ((a, nd), (b, od)):
                if moving.is_dir and self.index.is_ancestor(moving.ino, into.ino):
                    raise FsError(errno.EINVAL, "cannot move a directory into itself")
        now = now_ns()
        with self.table.tx(a, b, od, nd):
            self.index.set_dentry_ino(od.ino, old_name, b.ino)
            self.index.set_dentry_ino(nd.ino, new_name, a.ino)
            if od is not nd and a.is_dir != b.is_dir:
                delta = 1 if a.is_dir else -1  # a moves into nd, b into od
                nd.nlink += delta
                od.nlink -= delta
            for n in (a, b):
                n.ctime_ns = now
                self.table.save(n, "ctime_ns")
            self.touch_dir(od, now)
            if nd is not od:
                self.touch_dir(nd, now)
