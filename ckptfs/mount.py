"""Mount lifecycle: preflight checks, the cache-dir lock, spawning the daemon, readiness, unmount.

Order at mount (each step undone in reverse at exit):
  1. preflight (in the CLI process, so errors print directly): FUSE present, cache dir and mount
     point do not overlap, mount point usable (a stale mount of a dead daemon is cleaned up),
     cache dir a ckptfs cache or empty (then claimed: layout.json), writable and not locked;
  2. fork (unless --foreground); the child starts a new session and logs to the log file;
  3. the daemon (ckptfs/daemon.py, its docstring has the full start and teardown order) takes the
     cache-dir lock (`CacheLock`: fcntl.flock on <cache>/lock, held for the daemon's lifetime, so
     two daemons can never share a cache dir; the kernel drops it if the daemon dies), opens the
     cache (index + crash recovery) and the store, builds the services, mounts (pyfuse3.init)
     and starts the FUSE loop;
  4. readiness: stat the mount point through the kernel from a worker thread (proves the loop
     answers), tune the backing device's readahead, register in the runtime dir (root's
     /run/ckptfs or the user's private one, checked in the preflight too), tell the parent
     through the pipe `start` reads (`Notify`).
At exit (unmounted by `ckptfs umount`/fusermount3, or SIGTERM/SIGINT): the loop ends, the session
is closed (unmounting if still mounted), the cache persists its in-memory state, the registration
and the lock go.

State: none in memory; the registration files in the runtime dir and the lock file belong to the
daemon that wrote them (`unregister` removes only its own).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import select
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cachemgr.host.nodefiles import FILE_MODE, make_dirs, open_private

from . import logsafe
from .config import (
    ROOT_RUNTIME_DIR,
    MountConfig,
    runtime_dir,
    user_runtime_dirs,
)

log = logging.getLogger(__name__)

# Documented exit codes (README "Exit codes"); the CLI returns these.
EXIT_OK = 0
EXIT_ERROR = 1          # anything unexpected; umount of a busy mount
EXIT_USAGE = 2          # bad command line or option value
EXIT_MOUNTPOINT = 3     # mount point missing, not a directory, not empty, (not) mounted
EXIT_CACHE_DIR = 4      # cache dir unwritable, in use by another daemon, incompatible
EXIT_NO_FUSE = 5        # /dev/fuse or fusermount3 missing
EXIT_NOT_READY = 6      # the daemon died or did not answer before the mount was ready
                        # (or could not start it: the --metrics port cannot be bound)
EXIT_STORE = 7          # the object store is unusable (no bucket, access denied, bad URL);
                        # `wait`/`umount`: timed out with uploads still pending
EXIT_NO_SET = 8         # `wait`: the path is in no committed set (a directory: holds none,
                        # or a closed file in none)
EXIT_ACCESS = 9         # control request refused: the caller may not read/write the path
EXIT_UNSAVED = 12       # `umount`: unmounted, but files in no committed set stay only in the
                        # cache dir (named; --allow-unsaved: exit 0; files uploaded for another
                        # node's commit are named, not counted)

READY_TIMEOUT_S = 90.0  # generous: recovery of a large cache index runs before readiness
# The first listing of the store's sets runs before readiness too: RetryingStore gives a
# failing LIST about 15 s of retries (8 attempts, backoff capped at 5 s), and one that does not
# answer two LIST deadlines (30 s, cachemgr.store.s3.Deadlines), so this bounds only a listing
# of many pages from a slow store.
FIRST_LISTING_TIMEOUT_S = 60.0


class MountError(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


# ----------------------------------------------------------------------------------------------
# /proc/self/mountinfo


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) + 0 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def find_mount(path: Path) -> dict | None:
    """The mountinfo entry whose mount point is `path` (the last one, if stacked)."""
    target = os.path.abspath(path)
    found = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split()
                sep = parts.index("-")
                mp = _unescape(parts[4])
                if mp == target:
                    found = {"mountpoint": mp, "fstype": parts[sep + 1],
                             "source": _unescape(parts[sep + 2]),
                             "options": parts[sep + 3] if len(parts) > sep + 3 else ""}
    except OSError:
        return None
    return found


def _stat_state(path: Path) -> int:
    """0 if the mount answers, else the errno (ENOTCONN: a FUSE daemon died). statvfs, not stat:
    FUSE always asks the daemon for statfs, while a stat of the mount point is answered from the
    kernel's attribute cache (for up to --attr-timeout) even when the daemon is dead."""
    try:
        os.statvfs(path)
        return 0
    except OSError as e:
        return e.errno or errno.EIO


def _fusermount_unmount(path: Path, lazy: bool) -> subprocess.CompletedProcess:
    args = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [str(path)]
    return subprocess.run(args, check=False, capture_output=True, text=True)


# ----------------------------------------------------------------------------------------------
# preflight


def check_fuse() -> None:
    if not os.path.exists("/dev/fuse"):
        raise MountError(EXIT_NO_FUSE, "/dev/fuse is missing: load the fuse module (modprobe "
                         "fuse) or, in a container, pass --device /dev/fuse")
    if not any(os.access(os.path.join(d, "fusermount3"), os.X_OK)
               for d in os.environ.get("PATH", "/usr/bin:/bin").split(":")):
        raise MountError(EXIT_NO_FUSE, "fusermount3 not found: install the fuse3 package")


def check_mountpoint(mp: Path) -> None:
    entry = find_mount(mp)
    if entry is not None:
        state = _stat_state(mp)
        # ECONNABORTED: a request that was in flight while the dying daemon's connection was
        # aborted; the mount is just as dead.
        if (state in (errno.ENOTCONN, errno.ECONNABORTED)
                and entry["fstype"].startswith("fuse")):
            res = _fusermount_unmount(mp, lazy=True)
            if res.returncode != 0:
                raise MountError(EXIT_MOUNTPOINT, f"{mp}: stale mount of a dead daemon and "
                                 f"fusermount3 -u -z failed: {res.stderr.strip()}; run "
                                 f"'umount -l {mp}' as root")
            print(f"ckptfs: cleaned up a stale mount at {mp} left by a dead daemon",
                  file=sys.stderr)
        else:
            raise MountError(EXIT_MOUNTPOINT, f"{mp} is already mounted ({entry['fstype']}); "
                             f"unmount it first: ckptfs umount {mp}")
    if not mp.exists():
        raise MountError(EXIT_MOUNTPOINT, f"mount point {mp} does not exist")
    if not mp.is_dir():
        raise MountError(EXIT_MOUNTPOINT, f"mount point {mp} is not a directory")
    try:
        if any(os.scandir(mp)):
            raise MountError(EXIT_MOUNTPOINT, f"mount point {mp} is not empty (mounting over "
                             "files would hide them)")
    except PermissionError:
        raise MountError(EXIT_MOUNTPOINT, f"mount point {mp} is not readable") from None


def check_overlap(cache_dir: Path, mp: Path, log_file: Path | None = None) -> None:
    """Refuse a cache dir and a mount point that overlap (compared as resolved real paths, so a
    symlink does not hide it). A cache dir at or inside the mount point is reached through the
    daemon's own mount once it is mounted: the daemon then waits on itself (D state, for good).
    A mount point inside the cache dir hides part of the cache under the mount. A log file
    inside the mount point hangs the daemon the same way."""
    cache_real = Path(os.path.realpath(cache_dir))
    mp_real = Path(os.path.realpath(mp))
    if log_file is not None and Path(os.path.realpath(log_file)).is_relative_to(mp_real):
        raise MountError(EXIT_USAGE, f"--log-file {log_file} is inside the mount point {mp}: "
                         "the daemon would write its log through its own mount and hang")
    hang = ("the daemon would reach its own cache through its own mount and hang; use a cache "
            "dir outside the mount point")
    if cache_real == mp_real:
        why, fix = f"cache dir {cache_dir} is the mount point {mp}", hang
    elif cache_real.is_relative_to(mp_real):
        why, fix = f"cache dir {cache_dir} is inside the mount point {mp}", hang
    elif mp_real.is_relative_to(cache_real):
        why, fix = (f"mount point {mp} is inside the cache dir {cache_dir}",
                    "the mount would hide part of the cache; use a mount point outside it")
    else:
        return
    if cache_real != cache_dir or mp_real != mp:
        why += f" (resolved: {cache_real} and {mp_real})"
    raise MountError(EXIT_CACHE_DIR, f"{why}: {fix}")


# Entries a directory may hold and still count as empty for a new cache: the root of a freshly
# formatted ext4 filesystem (a dedicated NVMe) has lost+found; the others are this preflight's
# own short-lived files (several `ckptfs mount` racing for one new cache dir).
FRESH_DIR_ENTRIES = frozenset({"lost+found"})
_OWN_TMP_PREFIXES = (".probe-", ".layout-")


def check_cache_dir(cache_dir: Path) -> None:
    """The cache dir exists (or is created), is a ckptfs cache or empty, is writable and is not
    locked. A directory that holds files but no `layout.json` is refused before anything in it
    is created or changed: crash recovery deletes every file in `data/` it does not know, and
    the lock file is truncated. A new (empty) cache dir is claimed here by writing
    `layout.json`, so the daemon later finds a cache, not an empty directory beside its log and
    lock files."""
    try:
        st = os.stat(cache_dir)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as e:
        raise MountError(EXIT_CACHE_DIR, f"cache dir {cache_dir}: {e.strerror}") from None
    layout = cache_dir / "layout.json"
    if st is None:
        try:
            make_dirs(cache_dir)  # 0700: the cache is the daemon's alone (cachemgr.host.nodefiles)
        except OSError as e:
            raise MountError(EXIT_CACHE_DIR, f"cannot create cache dir {cache_dir}: "
                             f"{e.strerror}") from None
    elif not stat.S_ISDIR(st.st_mode):
        raise MountError(EXIT_CACHE_DIR, f"cache dir {cache_dir} is not a directory")
    elif not os.path.lexists(layout):
        try:
            names = [e.name for e in os.scandir(cache_dir)]
            # layout.json showing up now: a racing preflight just claimed the dir.
            foreign = [] if "layout.json" in names else sorted(
                n for n in names
                if n not in FRESH_DIR_ENTRIES and not n.startswith(_OWN_TMP_PREFIXES))
        except OSError as e:
            raise MountError(EXIT_CACHE_DIR, f"cache dir {cache_dir} is not readable: "
                             f"{e.strerror}") from None
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise MountError(EXIT_CACHE_DIR, f"cache dir {cache_dir} is not empty and is not "
                             f"a ckptfs cache (no layout.json; it holds {shown}); ckptfs "
                             "would delete files in it: use an empty or new directory")
    if not os.path.lexists(layout):
        from cachemgr.core.cache import LAYOUT

        # Written whole under a name of its own, then linked into place: of several mounts
        # racing for one new cache dir, the first link wins and every one sees a whole file.
        try:
            fd, name = tempfile.mkstemp(prefix=".layout-", suffix=".tmp", dir=cache_dir)
            tmp = Path(name)
            os.fchmod(fd, FILE_MODE)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(LAYOUT) + "\n")
            try:
                os.link(tmp, layout)
            except FileExistsError:
                pass
            except OSError:  # no hard links on this filesystem: a rename is whole too
                os.replace(tmp, layout)
            tmp.unlink(missing_ok=True)
        except OSError as e:
            raise MountError(EXIT_CACHE_DIR, f"cache dir {cache_dir} is not writable: "
                             f"{e.strerror}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=cache_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise MountError(EXIT_CACHE_DIR, f"cache dir {cache_dir} is not writable: "
                         f"{e.strerror}") from None
    lock = CacheLock(cache_dir)
    lock.acquire()
    lock.release()


class CacheLock:
    """An exclusive flock on <cache_dir>/lock; its content is the holder's pid, for messages."""

    def __init__(self, cache_dir: Path) -> None:
        self.path = cache_dir / "lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        # O_NOFOLLOW: a `lock` symlink planted in the cache dir must not make the daemon
        # truncate the file it points to.
        try:
            fd = open_private(self.path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as e:
            raise MountError(EXIT_CACHE_DIR, f"cannot open the lock file {self.path}: "
                             f"{e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            msg = (f"cache dir {self.path.parent} is in use by another ckptfs daemon "
                   f"(pid {holder}); one cache dir per mount")
            raise MountError(EXIT_CACHE_DIR, msg) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)  # closing drops the flock
            self.fd = None


# ----------------------------------------------------------------------------------------------
# registration (mount point -> daemon), for `ckptfs umount|status|wait|commit|prefetch`
#
# A daemon registers in its own runtime dir: /run/ckptfs for root (0755; registration 0644,
# socket 0666, every request checked against the caller's SO_PEERCRED), else the user's
# private runtime dir (0700). A client believes a registration only from a directory owned by
# root or by itself that nobody else can write (opened with O_NOFOLLOW, checked on the open
# descriptor), and only a control socket served by that directory's owner (SO_PEERCRED on the
# client's end): another user can plant a directory, a file or a socket, but never one that
# passes these checks. Threat model: docs/ARCHITECTURE.md "Control socket".


def _reg_key(mp: Path) -> str:
    import hashlib

    return hashlib.sha1(os.path.abspath(mp).encode()).hexdigest()[:16]


def _runtime_dir_problem(d: Path, st: os.stat_result, uid: int, private: bool) -> str | None:
    """Why the registration dir `d` (lstat'ed as `st`) cannot be trusted for a daemon of
    `uid`, or None."""
    if stat.S_ISLNK(st.st_mode):
        return f"runtime dir {d} is a symlink (another user may have planted it); remove it"
    if not stat.S_ISDIR(st.st_mode):
        return f"runtime dir {d} is not a directory; remove it"
    if st.st_uid != uid:
        return (f"runtime dir {d} belongs to uid {st.st_uid}, not to uid {uid} (another user "
                "may have planted it); remove it, or set XDG_RUNTIME_DIR to a private directory")
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & 0o077:
        return (f"runtime dir {d} has mode {mode:04o}; it must be private to its user (0700): "
                f"chmod 700 {d}")
    if mode & 0o022:
        return f"runtime dir {d} has mode {mode:04o}, writable by others: chmod 755 {d}"
    return None


def own_runtime_dir() -> Path:
    """Create (if needed) and check the directory this process's daemon registers in; raise
    MountError(EXIT_CACHE_DIR) if it cannot be trusted: its clients would refuse it too."""
    d = runtime_dir()
    uid = os.getuid()
    try:
        if uid == 0:
            d.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(d, 0o755 if uid == 0 else 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise MountError(EXIT_CACHE_DIR, f"cannot create runtime dir {d}: {e.strerror}") from None
    try:
        st = os.lstat(d)
    except OSError as e:
        raise MountError(EXIT_CACHE_DIR, f"runtime dir {d}: {e.strerror}") from None
    why = _runtime_dir_problem(d, st, uid, private=uid != 0)
    if why:
        raise MountError(EXIT_CACHE_DIR, why)
    if uid == 0 and stat.S_IMODE(st.st_mode) != 0o755:
        os.chmod(d, 0o755)  # e.g. created under umask 077: other users must reach the socket
    return d


def check_runtime_dir() -> None:
    """Preflight: the registration dir can be used (see own_runtime_dir)."""
    own_runtime_dir()


def control_path(mp: Path) -> Path:
    """The control socket of this process's daemon for `mp` (creates and checks the dir)."""
    return own_runtime_dir() / f"{_reg_key(mp)}.sock"


def control_mode() -> int:
    """A root daemon answers every user (each request checked against the caller's
    credentials); a user's daemon only that user (its socket is in a 0700 dir anyway)."""
    return 0o666 if os.getuid() == 0 else 0o600


def register(cfg: MountConfig) -> None:
    d = own_runtime_dir()
    key = _reg_key(cfg.mountpoint)
    data = json.dumps({"pid": os.getpid(), "uid": os.getuid(),
                       "mountpoint": str(cfg.mountpoint), "cache_dir": str(cfg.cache_dir),
                       "control": str(d / f"{key}.sock")}).encode()
    tmp = d / f"{key}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    try:
        os.write(fd, data)
        os.fchmod(fd, 0o644)  # readable by the users a root daemon serves, whatever the umask
    finally:
        os.close(fd)
    os.replace(tmp, d / f"{key}.json")


def mount_owner(entry: dict | None) -> int | None:
    """The uid that mounted a FUSE mount (its `user_id=` super option: set by the kernel's
    mount for root, by fusermount3 to the real uid otherwise), or None if not shown."""
    for opt in (entry or {}).get("options", "").split(","):
        if opt.startswith("user_id="):
            try:
                return int(opt[len("user_id="):])
            except ValueError:
                return None
    return None


def _read_registration(d: Path, key: str, owners: set[int], private: bool,
                       notes: list[str] | None) -> dict | None:
    """The registration `key` in `d` if `d` is a directory owned by one of `owners` that no one
    else can write (0700 if `private`) and the file is a regular file of the same owner."""
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if notes is not None and e.errno == errno.ELOOP:
            notes.append(f"ignored {d}: a symlink")
        return None
    try:
        st = os.fstat(dfd)
        mode = stat.S_IMODE(st.st_mode)
        why = (f"owned by uid {st.st_uid}" if st.st_uid not in owners
               else f"mode {mode:04o}" if mode & (0o077 if private else 0o022) else None)
        if why:
            if notes is not None:
                notes.append(f"ignored untrusted {d} ({why})")
            return None
        try:
            fd = os.open(f"{key}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError:
            return None
        try:
            fst = os.fstat(fd)
            if (not stat.S_ISREG(fst.st_mode) or fst.st_uid != st.st_uid
                    or fst.st_mode & 0o022):
                if notes is not None:
                    notes.append(f"ignored {d / key}.json: not a regular file of uid "
                                 f"{st.st_uid} writable only by it")
                return None
            reg = json.loads(os.read(fd, 1 << 16))
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
    finally:
        os.close(dfd)
    if not isinstance(reg, dict) or reg.get("uid", st.st_uid) != st.st_uid:
        return None
    # The socket is the one beside the file, never a path the file names; the daemon must run
    # as the directory's owner (checked on connect).
    reg["control"] = str(d / f"{key}.sock")
    reg["daemon_uid"] = st.st_uid
    return reg


def registration(mp: Path, notes: list[str] | None = None) -> dict | None:
    """The registration of the daemon serving the mount at `mp`, from a directory the caller
    can trust: its own runtime dir and /run/ckptfs (root's); root also looks in the usual
    runtime dirs of the mount's owner. `notes` collects why candidates were ignored."""
    me = os.getuid()
    owner = mount_owner(find_mount(mp))
    cands: list[tuple[Path, set[int], bool]] = [(runtime_dir(), {me, 0}, me != 0)]
    if me != 0:
        cands.append((ROOT_RUNTIME_DIR, {0}, False))
        if owner == 0:
            cands.reverse()
    elif owner not in (None, 0):
        cands += [(d, {owner}, True) for d in user_runtime_dirs(owner)]
    key = _reg_key(mp)
    for d, owners, private in cands:
        reg = _read_registration(d, key, owners, private, notes)
        if reg is None or reg.get("mountpoint") != os.path.abspath(mp):
            continue
        if owner is not None and reg["daemon_uid"] != owner:
            if notes is not None:
                notes.append(f"ignored a registration in {d} of uid {reg['daemon_uid']}: the "
                             f"mount belongs to uid {owner}")
            continue
        return reg
    return None


def unregister(mp: Path) -> None:
    p = runtime_dir() / f"{_reg_key(mp)}.json"
    try:
        reg = json.loads(p.read_text())
    except (OSError, ValueError):
        return
    if isinstance(reg, dict) and reg.get("pid") == os.getpid():
        p.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# helpers of the daemon (ckptfs/daemon.py) and its spawning


class LogFile(logging.FileHandler):
    """The daemon's log file, reopened at its path on SIGHUP (`reopen_logs`), so logrotate's
    rename-then-signal works (deploy/logrotate/ckptfs). Opened through `open_private`: a file
    (re)created at the path is 0600 whatever the umask. Chosen over logging's
    WatchedFileHandler, which stats the path before every record (a syscall per log line on the
    event loop) and recreates the file with the umask's mode.

    Guarded by the handler's own lock (`Handler.lock`): a record is written to the old stream
    or to the new one, never to a closed one."""

    def _open(self):
        fd = open_private(self.baseFilename, os.O_WRONLY | os.O_APPEND)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)

    def reopen(self) -> None:
        """Open the path anew (created if it was renamed away), then switch to it and close the
        old file. If it cannot be opened, logging goes on to the old file and this raises."""
        new = self._open()
        with self.lock:  # type: ignore[union-attr]  # always set by Handler.__init__
            old, self.stream = self.stream, new
        if old is not None:
            old.close()


def reopen_logs() -> list[str]:
    """Reopen every `LogFile` of the root logger (the daemon's SIGHUP); the paths reopened.
    Raises OSError if one cannot be opened (that handler keeps its old file)."""
    done = []
    for h in logging.getLogger().handlers:
        if isinstance(h, LogFile):
            h.reopen()
            done.append(h.baseFilename)
    return done


def setup_logging(cfg: MountConfig) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    target = cfg.effective_log_file
    handler: logging.Handler
    if target is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        make_dirs(target.parent)
        handler = LogFile(target)  # 0600 before a line lands (LogFile._open)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(logsafe.RedactSecrets())
    root.addHandler(handler)
    root.setLevel(cfg.log_level.upper())
    # pyfuse3 logs every FUSEError at debug level; keep that out unless asked for.
    logging.getLogger("pyfuse3").setLevel(max(logging.INFO, root.level))
    logsafe.cap_aws_loggers(root.level)


def mount_source(store_url: str) -> str:
    """The mount's source in /proc/self/mountinfo (`df`, `findmnt`): the store URL, as fstab
    names it, so `mount -a` sees an fstab line with that SOURCE as mounted already. libfuse
    splits options at commas and pyfuse3 passes them as ASCII: any other URL shows "ckptfs"."""
    ok = store_url.isascii() and store_url.isprintable() and not any(
        c in store_url for c in ", \\")
    return store_url if ok else "ckptfs"


def tune_readahead(mp: Path, kb: int) -> None:
    """Raise the mount's readahead (the FUSE bdi defaults to 128 KiB); measured in
    docs/ARCHITECTURE.md to bring cold sequential reads close to the raw disk."""
    if kb <= 0:
        return
    dev = os.stat(mp).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kb))
    except OSError as e:
        log.info("could not set %s to %d (%s); keeping the kernel default", path, kb, e.strerror)


Notify = Callable[[int, str], None]


def start(cfg: MountConfig, run: Callable[[MountConfig, Notify], int]) -> tuple[int, str]:
    """Mount in the background: fork a daemon, which runs `run(cfg, notify)` (the CLI gives
    ckptfs.daemon.run_daemon), and return (code, message) once it is ready or has failed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the daemon
        code = EXIT_ERROR
        try:
            os.close(r)
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            setup_logging(cfg)

            def notify(c: int, msg: str) -> None:
                try:
                    os.write(w, f"{c} {msg}\n".encode())
                    os.close(w)
                except OSError:
                    pass

            code = run(cfg, notify)
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + READY_TIMEOUT_S
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return EXIT_NOT_READY, (f"daemon (pid {pid}) not ready after {READY_TIMEOUT_S:.0f}s; "
                                    f"see {cfg.effective_log_file}")
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buf += chunk
    os.close(r)
    if b"\n" not in buf:
        return EXIT_NOT_READY, (f"daemon (pid {pid}) exited before the mount was ready; see "
                                f"{cfg.effective_log_file}")
    code_s, _, msg = buf.decode(errors="replace").partition(" ")
    return int(code_s), msg.strip()


def pid_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie. The daemon is reparented to PID 1 once the
    mounting CLI exits; a PID 1 that reaps late (or never: a shell as a container's init) leaves
    it a zombie after it has finished, which `kill(pid, 0)` alone would count as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def umount(mp: Path, *, timeout: float = 300.0) -> tuple[int, str]:
    entry = find_mount(mp)
    if entry is None:
        return EXIT_MOUNTPOINT, f"{mp} is not mounted"
    if entry["fstype"] != "fuse.ckptfs":
        return EXIT_MOUNTPOINT, f"{mp} is not a ckptfs mount ({entry['fstype']})"
    reg = registration(mp)
    res = _fusermount_unmount(mp, lazy=False)
    if res.returncode != 0:
        err = res.stderr.strip()
        if "busy" in err.lower():
            return EXIT_ERROR, (f"{mp} is busy: a process still has files open or its working "
                                f"directory there (see: fuser -vm {mp})")
        return EXIT_ERROR, f"fusermount3 -u {mp} failed: {err}"
    if reg is not None:
        pid = int(reg["pid"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pid_running(pid):
                break
            time.sleep(0.05)
        else:
            return EXIT_ERROR, f"unmounted {mp}, but daemon pid {pid} is still running"
    return EXIT_OK, f"unmounted {mp}"
