"""systemd's readiness protocol (sd_notify(3)), without libsystemd: one datagram of
newline-separated `KEY=VALUE` lines to the AF_UNIX socket named by `$NOTIFY_SOCKET`.

The daemon (ckptfs/daemon.py) tells the service manager:
  READY=1 (+ MAINPID=)   the mount answers (the moment `ckptfs mount` returns); MAINPID= when
                         the daemon is not the process systemd started (the mount helper forks
                         it: `ckptfs@.service` has NotifyAccess=all for that)
  STATUS=...             one line for `systemctl status`, refreshed while serving
  RELOADING=1 + MONOTONIC_USEC=, then READY=1   around a SIGHUP reload (systemd 253+ needs the
                         timestamp to match the reload it started: systemd.service(5)
                         Type=notify-reload)
  STOPPING=1             unmounting

`$NOTIFY_SOCKET` is a filesystem path, or an abstract socket name written with a leading `@`.
Unset (not run by systemd), or another address family (`vsock:`): every call is a no-op.

Whose messages: a `ckptfs mount` run by a process inside some other service (a job script under
a service with NotifyAccess=all) inherits that service's `$NOTIFY_SOCKET`; its daemon must not
tell that service it is ready or that the daemon is its main process. systemd (248+) sets
`$SYSTEMD_EXEC_PID` to the pid it started: the daemon speaks only if that is itself or its
parent (the helper that forked it), or if the variable is unset (an older systemd).

Never raises: a failed send is logged once at debug level; systemd notices a missing READY=1
by its start timeout, and nothing else the daemon does depends on being heard.

State: `Notifier` is owned by the daemon's trio loop thread (and the main thread before the
loop starts); it holds only the address and whether a failure was logged.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger(__name__)


def socket_address(value: str | None) -> str | bytes | None:
    """`$NOTIFY_SOCKET` as an address for `socket.sendto`: a path, an abstract name (bytes
    with a leading NUL), or None for unset/empty/unsupported (vsock:, relative paths)."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def speaks_for(env: dict[str, str], pid: int, ppid: int) -> bool:
    """Whether a daemon of `pid` (child of `ppid`) may notify the service in `env` (see the
    module docstring: `$SYSTEMD_EXEC_PID` names itself or its parent, or is unset)."""
    started = env.get("SYSTEMD_EXEC_PID")
    if not started:
        return True
    try:
        return int(started) in (pid, ppid)
    except ValueError:
        return False


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, as MONOTONIC_USEC= wants it."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """The daemon's messages to the service manager; every method is a no-op outside systemd.
    Build it in the daemon process (after the fork): it decides from the environment and pids
    at construction."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        pid, ppid = os.getpid(), os.getppid()
        addr = socket_address(env.get("NOTIFY_SOCKET"))
        self.address = addr if addr is not None and speaks_for(env, pid, ppid) else None
        # MAINPID= only when systemd did not start this process itself
        self._main_pid = None if env.get("SYSTEMD_EXEC_PID") == str(pid) else pid
        self._failed = False
        self._last_status: str | None = None
        self._ready = False     # READY=1 sent: STOPPING=1 means something only after it
        self._stopping = False  # STOPPING=1 sent (once: a signal, then the loop's end)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """One datagram `KEY=VALUE\\n...` (keyword order kept); True if it was sent."""
        if self.address is None:
            return False
        msg = "".join(f"{k}={v}\n" for k, v in fields.items())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.setblocking(False)  # a full receive queue must not stall the event loop
                s.sendto(msg.encode(), self.address)
            return True
        except OSError as e:
            if not self._failed:
                self._failed = True
                log.debug("sd_notify to %r failed: %s", self.address, e)
            return False

    def ready(self, status: str) -> None:
        extra = {} if self._main_pid is None else {"MAINPID": self._main_pid}
        self._last_status = status
        self._ready = True
        self.send(**extra, READY=1, STATUS=status)

    def status(self, status: str) -> None:
        """STATUS=, only when it changed since the last one sent."""
        if status != self._last_status:
            self._last_status = status
            self.send(STATUS=status)

    def reloading(self, status: str) -> None:
        self._last_status = status
        self.send(RELOADING=1, MONOTONIC_USEC=monotonic_usec(), STATUS=status)

    def reloaded(self, status: str) -> None:
        self._last_status = status
        self.send(READY=1, STATUS=status)

    def stopping(self, status: str) -> None:
        """STOPPING=1, once, and only after READY=1 (a mount that never became ready fails
        its start by its exit status instead)."""
        if self._ready and not self._stopping:
            self._stopping = True
            self._last_status = status
            self.send(STOPPING=1, STATUS=status)
