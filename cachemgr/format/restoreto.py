"""The destination of a restore, and the script's restore into it (`restore_to`).

Owns how a restored set is written: every path resolved inside DEST with directory-fd-relative
calls that never follow a symlink (`opendir`, `Tree`, `path_names`, `split`, `set_dirs`,
`target_free`, `rmtree`: shared with cachemgr.format.resumable), and `restore_to`, the one
scripts/ckpt_restore.py runs: sequential and atomic, the set built under a temporary name beside
its target and renamed into place; the target must not exist; nothing is left on error. Objects
come through cachemgr.format.storeread (decoded and checked by cachemgr.format.decode).
Standard library only (with what storeread needs).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path

from cachemgr.format.docs import ObjectDoc
from cachemgr.format.names import unescape_path
from cachemgr.format.readerrors import CorruptError, DestinationError, show
from cachemgr.format.storeread import Manifest, checked, open_object, stream_object
from cachemgr.format.views import StoreView

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _name(c: bytes) -> bytes:
    if c in (b"", b".", b"..") or b"/" in c or b"\0" in c:
        raise CorruptError(f"{show(c)} is not a name")  # the validator refuses these first
    return c


def opendir(fd: int, name: bytes, shown: str, create: bool = False) -> int:
    """The directory `name` in directory `fd`, never through a symlink; created if missing
    and `create`."""
    for _ in range(3):
        try:
            return os.open(_name(name), DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise DestinationError(f"{shown} vanished") from None
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise DestinationError(f"cannot create {shown}: {e.strerror}") from None
        except (NotADirectoryError, OSError) as e:
            if isinstance(e, NotADirectoryError) or e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise DestinationError(f"{shown} is not a directory (a symlink or a file is "
                                       "in the way)") from None
            raise DestinationError(f"{shown}: {e.strerror}") from None
    raise DestinationError(f"{shown} keeps changing")


class Tree:
    """Directories under one directory fd, opened component by component with O_NOFOLLOW; the
    last one opened is kept (entries come sorted, so siblings share it)."""

    def __init__(self, root_fd: int, shown: bytes) -> None:
        self.root_fd, self.shown = root_fd, shown
        self.cur: tuple[tuple[bytes, ...], int] | None = None

    def dir(self, comps: tuple[bytes, ...]) -> int:
        if not comps:
            return self.root_fd
        if self.cur and self.cur[0] == comps:
            return self.cur[1]
        self.close()
        fd = self.root_fd
        try:
            for i, c in enumerate(comps):
                nfd = opendir(fd, c, show(b"/".join((self.shown,) + comps[:i + 1])))
                if fd != self.root_fd:
                    os.close(fd)
                fd = nfd
        except BaseException:
            if fd != self.root_fd:
                os.close(fd)
            raise
        self.cur = (comps, fd)
        return fd

    def close(self) -> None:
        if self.cur:
            os.close(self.cur[1])
            self.cur = None


def path_names(path: str) -> tuple[bytes, ...]:
    """The names (bytes) of a validated escaped-form path, each checked again."""
    return tuple(_name(c) for c in unescape_path(path).split(b"/"))


def split(path: str) -> tuple[tuple[bytes, ...], bytes]:
    comps = path_names(path)
    return comps[:-1], comps[-1]


def set_dirs(m: Manifest) -> dict[tuple[bytes, ...], int]:
    """{directory of a dir set (names): its mode}: the manifest's directories and those only
    implied by its entries (0o755)."""
    modes: dict[tuple[bytes, ...], int] = {}
    for d in m["dirs"]:
        modes[path_names(d["path"])] = d["mode"]
    for e in m["files"] + m["symlinks"] + m["dirs"]:
        cs = path_names(e["path"])
        for i in range(1, len(cs)):
            modes.setdefault(cs[:i], 0o755)
    return modes


def _write_file(view: StoreView, obj: ObjectDoc, dir_fd: int, name: bytes, mode: int,
                shown: str) -> None:
    """A new file `name` in `dir_fd` (O_EXCL|O_NOFOLLOW: never an existing one, never through a
    symlink) holding the checked content of `obj`, then `mode`. On error it is removed."""
    src = open_object(view, obj)
    try:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                         os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        except OSError as e:
            raise DestinationError(f"cannot create {shown}: {e.strerror}") from None
        try:
            def sink(data: bytes | memoryview) -> None:
                mv = memoryview(data)
                while mv:
                    try:
                        mv = mv[os.write(fd, mv):]
                    except OSError as e:
                        raise DestinationError(f"writing {shown}: {e.strerror}") from None

            stream_object(src, obj, sink)
            try:
                os.fchmod(fd, mode)
            except OSError as e:
                raise DestinationError(f"chmod {shown}: {e.strerror}") from None
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise
        os.close(fd)
    finally:
        src.close()


def _build_dir(view: StoreView, m: Manifest, fd: int, shown: bytes) -> None:
    """The entries of dir set `m` inside the new empty directory `fd`: directories, files,
    then symlinks, then the directories' modes (deepest first, so that a mode without write or
    search permission does not get in the way)."""
    modes = set_dirs(m)
    tree = Tree(fd, shown)
    try:
        for comps in sorted(modes, key=lambda c: (len(c), c)):
            pfd = tree.dir(comps[:-1])
            try:
                os.mkdir(comps[-1], 0o700, dir_fd=pfd)
            except OSError as e:
                raise DestinationError(f"cannot create {show(b'/'.join((shown,) + comps))}: "
                                       f"{e.strerror}") from None
        for f in sorted(m["files"], key=lambda f: unescape_path(f["path"])):
            parent, name = split(f["path"])
            _write_file(view, f["object"], tree.dir(parent), name, f["mode"],
                        show(shown + b"/" + unescape_path(f["path"])))
        for s in m["symlinks"]:
            parent, name = split(s["path"])
            try:
                os.symlink(unescape_path(s["target"]), name, dir_fd=tree.dir(parent))
            except OSError as e:
                raise DestinationError(f"cannot create symlink "
                                       f"{show(shown + b'/' + unescape_path(s['path']))}: "
                                       f"{e.strerror}") from None
        for comps in sorted(modes, key=lambda c: (-len(c), c)):
            parent, name = comps[:-1], comps[-1]
            dfd = opendir(tree.dir(parent), name, show(b"/".join((shown,) + comps)))
            try:
                os.fchmod(dfd, modes[comps])
            except OSError as e:
                raise DestinationError(f"chmod: {e.strerror}") from None
            finally:
                os.close(dfd)
    finally:
        tree.close()


def target_free(parent_fd: int, name: bytes, kind: str, shown: str) -> None:
    """The set's target must not exist; a dir set may take the place of an empty directory."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as e:
        raise DestinationError(f"{shown}: {e.strerror}") from None
    if kind == "dir" and stat.S_ISDIR(st.st_mode):
        fd = opendir(parent_fd, name, shown)
        try:
            empty = not os.listdir(fd)
        finally:
            os.close(fd)
        if empty:
            return
    raise DestinationError(f"{shown} exists (a restore never replaces anything: remove it "
                           "or restore elsewhere)")


def restore_to(view: StoreView, m: Manifest, dest: Path) -> Path:
    """Materialise set `m` at DEST/<set path> (as a user restoring without ckptfs would), with
    the exact byte names of the manifest; returns that path. Every path is resolved inside
    DEST without following a symlink; the set is built under a temporary name beside its
    target and renamed into place only when every object checked out (nothing is left behind
    on error). RestoreError (one line) if anything is wrong."""
    m = checked(m)
    dest_b = os.fsencode(dest)
    parents, name = split(m["path"])
    target = os.path.join(dest_b, *parents, name)
    shown = show(target)
    try:
        os.makedirs(dest_b, exist_ok=True)
        dfd = os.open(dest_b, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise DestinationError(f"{show(dest_b)}: {e.strerror}") from None
    fds = [dfd]
    try:
        for i, c in enumerate(parents):
            fds.append(opendir(fds[-1], c, show(os.path.join(dest_b, *parents[:i + 1])),
                                create=True))
        pfd = fds[-1]
        target_free(pfd, name, m["kind"], shown)
        if m["kind"] == "symlink":
            try:
                os.symlink(unescape_path(m["target"]), name, dir_fd=pfd)
            except OSError as e:
                raise DestinationError(f"cannot create symlink {shown}: {e.strerror}") from None
            return Path(os.fsdecode(target))
        tmp = b".ckpt_restore-" + secrets.token_hex(8).encode() + b".tmp"
        if m["kind"] == "file":
            f = m["files"][0]
            _write_file(view, f["object"], pfd, tmp, f["mode"], shown)
        else:
            try:
                os.mkdir(tmp, 0o700, dir_fd=pfd)
            except OSError as e:
                raise DestinationError(f"cannot create a directory in "
                                       f"{show(os.path.dirname(target))}: {e.strerror}") from None
            try:
                tfd = opendir(pfd, tmp, shown)
                try:
                    _build_dir(view, m, tfd, target)
                    os.fchmod(tfd, m["mode"])
                finally:
                    os.close(tfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    rmtree(pfd, tmp)
                raise
        try:
            target_free(pfd, name, m["kind"], shown)  # again: nothing appeared meanwhile
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except BaseException as e:
            with contextlib.suppress(OSError):
                rmtree(pfd, tmp)
            if isinstance(e, OSError):
                raise DestinationError(f"cannot rename into {shown}: {e.strerror}") from None
            raise
        return Path(os.fsdecode(target))
    finally:
        for fd in fds:
            os.close(fd)


def rmtree(dir_fd: int, name: bytes) -> None:
    """Remove `name` in `dir_fd` (a file or a tree we made); never follows a symlink."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, 0o700)  # its modes may already be applied
        with os.scandir(fd) as it:
            entries = [e.name for e in it]
    finally:
        os.close(fd)
    if entries:
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.rmdir(name, dir_fd=dir_fd)
