"""When a commit happens: the hooks the core calls inside its transactions, `ckptfs commit`, and
crash recovery at mount.

`Committer` turns namespace operations into set records (cachemgr.core.sets decides the commit
rules) and work for the other tiering services: content to upload
(cachemgr.tiering.uploadqueue), sets to publish or unpublish and garbage to collect
(cachemgr.tiering.publish), part records to bring up to date (cachemgr.tiering.parts), waiters
to wake (cachemgr.tiering.signals).

The hooks (`on_*`, `announce_dir`) are synchronous and run on the trio thread inside the index
transaction of the FUSE operation that triggers them: they only record facts in the index and
queue work, never do I/O to the store, never wait — the trainer never waits for the store. A
commit is recorded in the same transaction as the operation that triggered it, so after a
crash a set is committed if and only if its triggering operation completed.

State: none of its own beyond the index (the set registry) and what it hands to the queues.

Crash states and recovery (`recover`, at mount, before any request is served): a file open
for writing at the crash (`writing = 1`) has its version bumped and every live set holding the
old content superseded; live sets re-queue their missing uploads (keys are per (ino, version),
so a re-upload overwrites the same object) unless that content is gone from the cache (the set
is superseded); sets whose objects are all in are re-published (the manifest PUT is
idempotent); `deleting` sets have their manifest deletion retried (their place in commit order
is not recorded: after every set known now); closed files whose content is not uploaded yet
are queued; garbage is collected.
"""

from __future__ import annotations

import errno
import json
import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cachemgr.core.errors import FsError
from cachemgr.core.sets import (
    DCP_METADATA,
    KEPT_STATES,
    LIVE_STATES,
    SetRegistry,
    SetRow,
    is_temp_name,
)
from cachemgr.format import names

if TYPE_CHECKING:
    from cachemgr.core.index import Index
    from cachemgr.core.inodes import Inode, InodeTable
    from cachemgr.tiering.publish import Publisher
    from cachemgr.tiering.signals import Signals
    from cachemgr.tiering.uploadqueue import UploadQueue

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CommitStats:
    """`Committer.statistics()`: commits (`dataclasses.asdict` for JSON)."""

    commits: int
    deletes: int


class Committer:
    """Commit triggers and recovery (see the module docstring)."""

    def __init__(self, *, table: InodeTable, index: Index, sets: SetRegistry, uploads: UploadQueue,
                 publisher: Publisher, signals: Signals, forget: Callable[[int], None],
                 written: Callable[[int], None], mark_dir: Callable[[int], object],
                 mark_moved: Callable[[list[str], list[int]], None]) -> None:
        self.table = table
        self.index = index
        self.sets = sets
        self.uploads = uploads
        self.publisher = publisher
        self.signals = signals
        self._forget = forget      # restore.restorer: drop what it knows of a file's content
        self._written = written    # cachemgr.restore.restorer: written here, no check on its reads
        self._mark_dir = mark_dir  # tiering.parts: a directory's record is to be brought up
        self._mark_moved = mark_moved  # ... the records at or under moved paths, of dirs
        self.commits = 0
        self.deletes = 0

    # -- hooks from the core (synchronous, inside the operation's transaction) ----------------

    def on_content_change(self, ino: int, old_version: int) -> None:
        """A file's content (ino, old_version) is about to change (write-open or truncate)."""
        for seq in self.sets.supersede_content(ino, old_version, "a file was modified before"
                                               " the set became durable", uploaded_too=True):
            log.info("set %d superseded: content of inode %d changed", seq, ino)
        self.sets.note_unreferenced(ino, old_version)  # its object, if any, may be garbage now
        self._forget(ino)
        self.uploads.drop(ino, old_version)
        self.signals.changed_now()

    def on_close(self, node: Inode, parent_ino: int, name: bytes) -> None:
        """The last writer of a regular file closed it."""
        # Written through this daemon: nothing to check against the store on its reads (the
        # per-chunk check is for data at rest across restarts, see cachemgr.restore.restorer).
        self._written(node.ino)
        self.uploads.enqueue(node.ino, node.version)
        if self.sets.in_open_set(parent_ino):
            if is_temp_name(_s(name)) or not self.amend(parent_ino, _s(name)):
                self._mark_dir(parent_ino)  # another node may commit this directory
        elif not is_temp_name(_s(name)):
            path = self.index.path_of(node.ino)
            if path:
                self.commit(path, node.ino, "close")
        self.signals.wake_waiters()  # a directory wait may wait for this close

    def announce_dir(self, node: Inode) -> None:
        """A writer of `node` is closing (flush): if the file is in an open set, its directory's
        part record is brought up to date in the background (cachemgr.tiering.parts). Never waits:
        a commit on another node that needs the record asks for it (cachemgr.tiering.members)."""
        if node.nlink == 0 or node.writers != 1:
            return
        parent = self.index.parent_of(node.ino)
        if parent is not None and parent != 1 and self.sets.in_open_set(parent):
            self._mark_dir(parent)

    def on_rename(self, src: Inode, dst: Inode | None, old_parent: int, old_name: bytes,
                  new_parent: int, new_name: bytes, old_path: str) -> None:
        new_path = self.index.path_of(src.ino)
        if new_path is None:
            return
        moved = self.sets.at_or_under(old_path, KEPT_STATES) if old_path else []
        committed = commits_at_close = False
        # record keys follow their directories' paths; the two directories' file lists changed
        self._mark_moved([p for p in (old_path, new_path) if p], [old_parent, new_parent])
        if stat.S_ISDIR(src.mode):
            self.commit(new_path, src.ino, "rename", absorb_paths=[old_path, new_path],
                        from_path=old_path)
            committed = True
        elif _s(new_name) == DCP_METADATA:
            dir_path = self.index.path_of(new_parent)
            if dir_path:  # the mount root itself is never a set
                self.commit(dir_path, new_parent, "dcp", absorb_paths=[dir_path, old_path])
                committed = True
        elif not is_temp_name(_s(new_name)) and not self.sets.in_open_set(new_parent):
            if stat.S_ISREG(src.mode) and src.writing:
                commits_at_close = True
            else:
                self.commit(new_path, src.ino, "rename", absorb_paths=[old_path])
                committed = True
        amends = (not committed and not commits_at_close and not is_temp_name(_s(new_name))
                  and not stat.S_ISDIR(src.mode) and self.sets.in_open_set(new_parent))
        if amends and stat.S_ISREG(src.mode) and src.writing:
            amends = False  # its last close amends (on_close)
        if not committed:
            # The old path is gone, and so is whatever the rename replaced at the new path.
            replaced = self.sets.at_or_under(new_path, KEPT_STATES) if dst is not None else []
            if commits_at_close:
                # A file still open for writing (its close's RELEASE may reach the daemon after
                # the rename: `close(); os.replace(tmp, "latest.pt")`) commits at its last
                # close as `new_path`, and that commit replaces the set there once it is
                # published. Deleting that set now would take its manifest out of the store
                # before its successor is in: a crash in between would leave no `latest.pt`.
                replaced = [x for x in replaced if x.path != new_path]
            paths = [old_path] if old_path else []
            if dst is not None and not commits_at_close:
                paths.append(new_path)
            self.delete_sets(moved + replaced, f"renamed away ({old_path} -> {new_path})",
                             paths)
        if amends:
            self.amend(new_parent, _s(new_name))

    def on_remove(self, node: Inode, path: str) -> None:
        """`path` (a file, empty directory or symlink) was unlinked/removed."""
        self.delete_sets(self.sets.at_or_under(path, KEPT_STATES), "deleted through the mount",
                         [path])
        parent = self.index.resolve(path.rpartition("/")[0])
        self._mark_moved([path], [] if parent is None else [parent])
        if stat.S_ISREG(node.mode):
            # A set that still needed this file's upload can never be published as committed.
            for seq in self.sets.supersede_content(node.ino, node.version, f"{path} was deleted"
                                                   " before its upload"):
                log.info("set %d superseded: %s deleted before its upload", seq, path)
            self.uploads.drop_inode(node.ino)
            self.sets.note_inode(node.ino)
        self.publisher.gc()
        self.signals.wake_ns()
        self.signals.wake_waiters()  # a directory wait may wait for this file

    def on_symlink(self, node: Inode, parent_ino: int, name: bytes) -> None:
        if is_temp_name(_s(name)):
            return
        if not self.sets.in_open_set(parent_ino):
            path = self.index.path_of(node.ino)
            if path:
                self.commit(path, node.ino, "symlink")
        else:
            self.amend(parent_ino, _s(name))

    def amend(self, dir_ino: int, name: str) -> bool:
        """A file `name` was closed (renamed in, linked) in directory `dir_ino`, inside an open
        set: if that set is a committed directory (SetRegistry.amend_target), commit it again,
        whole, as `amend` (docs/SEMANTICS.md "Files written into a committed directory"); the
        new commit supersedes the earlier one if it is not durable yet, and replaces its
        manifest once durable itself. Its unchanged files keep their objects (keys are per
        content), so only the new bytes are uploaded. Not while a DCP save into the directory
        is under way (its `.metadata` rename commits it) nor for DCP's own files. True if it
        committed."""
        if name.endswith(".distcp") or name == DCP_METADATA:
            return False
        target = self.sets.amend_target(dir_ino)
        if target is None or self.sets.dcp_save_under_way(target):
            return False
        # where the amended set was renamed from: other nodes' files of it are announced
        # under that path (their own directories keep it), and the amend gathers them again
        came_from = json.loads(target.layout).get("from")
        self.commit(target.path, target.root_ino, "amend", absorb_paths=[target.path],
                    from_path=came_from if isinstance(came_from, str) else None)
        return True

    def on_purge(self, ino: int) -> None:
        self._forget(ino)  # a partly restored file's chunks leave the cache with it
        self.sets.note_inode(ino)
        self.publisher.gc()
        self.signals.wake_ns()

    # -- commits and deletions ----------------------------------------------------------------

    def resolve(self, path: str) -> int:
        """The inode at `path` (escaped form, cachemgr.format.names)."""
        ino = self.index.resolve(path)
        if ino is None:
            raise FsError(errno.ENOENT, f"no such file: {path}")
        return ino

    def commit_path(self, path: str) -> int:
        """`ckptfs commit PATH` (PATH relative to the mount root, as os functions give it)."""
        path = names.from_str(path.strip("/"))
        if not path:
            raise FsError(errno.EINVAL, "the mount root cannot be a set; commit a directory in it")
        ino = self.resolve(path)
        with self.index.tx():
            node = self.table.get(ino)
            if node.is_reg and node.writers:
                raise FsError(errno.EBUSY, f"{path} is still open for writing")
            return self.commit(path, ino, "request", absorb_paths=[path])

    def commit(self, path: str, root_ino: int, reason: str,
               absorb_paths: list[str] | None = None, from_path: str | None = None) -> int:
        """Commit the set at `path` (its root `root_ino`); its seq."""
        with self.index.tx():
            # Sets under the new set's path (or at the path it came from) are absorbed: their
            # manifests go once this one is durable.
            absorbed: list[SetRow] = []
            for p in absorb_paths or []:
                if p:
                    absorbed += [s for s in self.sets.at_or_under(p, KEPT_STATES)
                                 if s.path != path or s.kind != self._kind_of(root_ino)]
            for s in self.sets.at_or_under(path, LIVE_STATES):
                if s.path != path and s not in absorbed:
                    absorbed.append(s)
            seq = self.sets.commit(path, root_ino, reason, from_path)
            for s in absorbed:
                if s.state in LIVE_STATES:
                    self.sets.set_state(s.seq, "superseded", f"absorbed by set {seq} ({path})")
                self.publisher.absorb(seq, s.seq, s.path)
                self.publisher.inherit(seq, s.seq)
            # Earlier sets at this path or at what it absorbs that will never be durable
            # (superseded by this commit or by a change of their content): what they absorbed
            # goes when this one is durable.
            self.publisher.inherit_superseded(seq, [path, *[p for p in absorb_paths or [] if p]])
            missing = self.sets.missing_uploads(seq)
        for ino, version, _size in missing:
            self.uploads.enqueue(ino, version, prio=seq)
        log.info("commit %d: %s (%s), %d files to upload", seq, path, reason, len(missing))
        if not missing:
            self.publisher.publish(seq)
        self.commits += 1
        self.signals.poke()
        self.signals.changed_now()
        return seq

    def delete_sets(self, victims: list[SetRow], why: str,
                    paths: list[str] | None = None) -> None:
        """Delete `victims` (the sets at or under `paths`, the paths deleted or renamed away;
        by default the victims' own paths), and what those paths' sets that will never be
        durable were to take from the store (Publisher.unpublish_absorbed)."""
        for s in victims:
            # Durable: its manifest must go from the store. Live ones too: a crash between a
            # manifest PUT and the index recording it leaves a live set whose manifest is in
            # the store (and so may a superseded one's be, at the same path); unpublishing a
            # path with no manifest costs one DELETE.
            self.sets.set_state(s.seq, "deleting", why)
            # In commit order too: the deletion comes after every set committed so far, so
            # its manifest goes only once they are published or gone (a rotation must not
            # delete the checkpoint the store's `latest` still names while the new `latest`
            # waits for its upload).
            self.publisher.unpublish(s.seq, s.path, self.sets.max_seq())
            self.deletes += 1
            log.info("set %d (%s) %s", s.seq, s.path, why)
        absorbed = self.publisher.unpublish_absorbed(
            paths if paths is not None else [s.path for s in victims], self.sets.max_seq(),
            f"{why}: what took its place is gone")
        for seq in absorbed:
            self.deletes += 1
            log.info("set %d deleted with the set that absorbed it (%s)", seq, why)
        if not victims and not absorbed:
            return
        self.signals.poke()
        self.signals.changed_now()

    def _kind_of(self, ino: int) -> str:
        row = self.index.get_inode(ino)
        if row is None:
            return "?"
        mode = row[1]
        return "dir" if stat.S_ISDIR(mode) else "symlink" if stat.S_ISLNK(mode) else "file"

    # -- recovery -----------------------------------------------------------------------------

    def recover(self) -> None:
        """Rebuild the queues from the index after a restart (see the module docstring)."""
        with self.index.tx():
            for ino, version in self.index.writing_files():
                self.sets.supersede_content(ino, version, "the daemon crashed while a file was"
                                            " being written")
                self.index.update_inode(ino, version=version + 1, writing=0)
                node = self.table.if_loaded(ino)
                if node is not None:
                    node.version, node.writing = version + 1, 0
            for s in self.sets.by_states(LIVE_STATES):
                missing = self.sets.missing_uploads(s.seq)
                stale = [m for m in missing if not self.uploads.content_present(m[0], m[1])]
                if stale:
                    self.sets.set_state(s.seq, "superseded", "a file changed after the commit,"
                                        " before its upload")
                    continue
                for ino, version, _ in missing:
                    self.uploads.enqueue(ino, version, prio=s.seq)
                if not missing:
                    self.publisher.publish(s.seq)
            # The deletion's place in commit order is not recorded: after every set known now.
            horizon = self.sets.max_seq()
            for s in self.sets.by_states(("deleting",)):
                self.publisher.unpublish(s.seq, s.path, horizon)
            # Closed files whose current content is not uploaded yet.
            for ino, version in self.index.unuploaded_files():
                self.uploads.enqueue(ino, version)
        self.publisher.gc(full=True)  # every object, once: candidates noted before are gone
        n_live = len(self.sets.by_states(LIVE_STATES))
        if n_live or self.uploads.queued():
            log.info("tiering: resuming %d sets, %d uploads", n_live, self.uploads.queued())

    def statistics(self) -> CommitStats:
        return CommitStats(commits=self.commits, deletes=self.deletes)


def _s(name: bytes) -> str:
    return name.decode("utf-8", "surrogateescape")
