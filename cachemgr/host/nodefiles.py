"""Modes of what ckptfs keeps on the node: private to the daemon's user.

The cache directory holds users' checkpoint bytes (`data/<ino>`), the index (every name, size
and object key of the mount) and the daemon's state; the log names paths and errors. The mount
presents the users' own modes; the cache behind it is the daemon's alone: files FILE_MODE
(0600), directories DIR_MODE (0700). Modes are set explicitly (`os.open` mode, then `fchmod` /
`chmod`), so neither a loose umask nor a tight one changes them.

Exceptions, documented in docs/ARCHITECTURE.md "Control socket": the runtime dir, the
registration and the control socket of a root daemon (0755 / 0644 / 0666) must be reachable by
the non-root users it serves; every control request is checked against the caller's
SO_PEERCRED credentials. They are set in ckptfs.mount and ckptfs.control, not here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def make_dirs(path: Path) -> None:
    """`mkdir -p path`: each directory created here gets DIR_MODE; existing ones keep theirs
    (a cache dir the administrator made, a shared parent). Iterative: any depth."""
    missing = []
    p = Path(path)
    while not p.is_dir() and p.parent != p:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            continue  # made by a racer, or a file (the next mkdir below it says ENOTDIR)
        os.chmod(d, DIR_MODE)


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """os.open with O_CREAT and FILE_MODE, and FILE_MODE forced on the open file (fchmod), for
    a file created now (whatever the umask) or one an older ckptfs made group/world-readable
    (only a regular file this process owns: a --log-file of /dev/stderr keeps its mode)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        _force(os.fstat(fd), lambda m: os.fchmod(fd, m), FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def restrict(path: Path | str, mode: int) -> None:
    """Give an existing regular file or directory this process owns exactly `mode` (caches
    made by an older ckptfs were 0644/0755); no-op for anything else, a symlink included."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    _force(st, lambda m: os.chmod(path, m), mode)


def _force(st: os.stat_result, chmod: Callable[[int], None], mode: int) -> None:
    if (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)) and \
            st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
        chmod(mode)


def fsync_dir(path: Path | str) -> None:
    """fsync directory `path`: a rename or create in it is then durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all, durably: a temp file beside it (FILE_MODE),
    fsynced, renamed over `path`, then the directory fsynced."""
    tmp = path.with_name(path.name + ".tmp")
    fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)

