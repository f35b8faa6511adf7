"""Waiting with deadlines, shared by the test suite (tests/conftest.py,
tests/faults/test_tiering_crash.py) and scripts/fault_loop.py: poll a condition until it holds, and
read a child process's stdout one line at a time. Neither ever blocks without a deadline, and
neither sleeps to wait for something: a poll backs off briefly between looks at the condition
itself."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 30.0, what: str = "condition",
             exc: type[Exception] = AssertionError) -> T:
    """Poll `cond` until it returns a truthy value (returned) or raise `exc` after `timeout`
    seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise exc(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


class Events:
    """Line events from a child's stdout pipe, read with deadlines (never blocks forever)."""

    def __init__(self, proc: subprocess.Popen[bytes],
                 exc: type[Exception] = AssertionError) -> None:
        assert proc.stdout is not None, "Events reads a child started with stdout=PIPE"
        self.proc, self.fd, self.buf, self.eof = proc, proc.stdout.fileno(), b"", False
        self.exc = exc

    def next(self, timeout: float) -> str | None:
        """The next line, or None at EOF; `exc` after `timeout` seconds without one."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            if self.eof:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.exc(f"no event from pid {self.proc.pid} for {timeout:.0f}s")
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    self.eof = True
                    if self.buf:
                        self.buf += b"\n"
                else:
                    self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def rest(self, timeout: float = 30.0) -> list[str]:
        """Every line until EOF (each within `timeout`)."""
        out = []
        while (ev := self.next(timeout)) is not None:
            out.append(ev)
        return out
