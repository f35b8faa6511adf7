"""A stand-in for systemd's notify socket (sd_notify(3)): a real AF_UNIX datagram socket that
records every message with the sender's pid (SO_PASSCRED, as systemd reads it), for
tests/unit/test_notify.py, tests/mount/test_notify_mount.py and tests/mount/test_fstab_mount.py.

    with NotifyListener.at(path_or_@name) as sd:
        env["NOTIFY_SOCKET"] = sd.address
        ...
        msg = sd.wait(lambda m: m.get("READY") == "1")

`on_message(msg)` runs on the listener's thread as each message arrives, before the next one is
read: what a test checks there is checked at the moment systemd would act on it.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Message:
    pid: int                      # the sender (SCM_CREDENTIALS)
    fields: dict[str, str]
    at: float = field(default_factory=time.monotonic)
    seen: dict = field(default_factory=dict)  # what on_message recorded

    def get(self, key: str) -> str | None:
        return self.fields.get(key)


class NotifyListener:
    def __init__(self, address: str, on_message: Callable[[Message], None] | None = None):
        self.address = address  # as $NOTIFY_SOCKET spells it
        self.on_message = on_message
        self.messages: list[Message] = []
        self._cond = threading.Condition()  # guards messages
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        bind = b"\0" + address[1:].encode() if address.startswith("@") else address
        self._sock.bind(bind)
        self._sock.settimeout(0.2)  # so stop() is noticed
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="sd-listener")

    def __enter__(self) -> NotifyListener:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join(timeout=10)
        self._sock.close()
        if not self.address.startswith("@"):
            try:
                os.unlink(self.address)
            except FileNotFoundError:
                pass

    def _run(self) -> None:
        creds = struct.calcsize("3i")
        while not self._stop:
            try:
                data, anc, _flags, _addr = self._sock.recvmsg(4096, socket.CMSG_SPACE(creds))
            except TimeoutError:
                continue
            except OSError:
                return
            pid = -1
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:creds])[0]
            lines = [ln for ln in data.decode().split("\n") if ln]
            msg = Message(pid, dict(ln.split("=", 1) for ln in lines))
            if self.on_message is not None:
                self.on_message(msg)
            with self._cond:
                self.messages.append(msg)
                self._cond.notify_all()

    def wait(self, pred: Callable[[Message], bool], timeout: float = 60.0,
             after: int = 0) -> Message:
        """The first message from index `after` on that satisfies `pred`; AssertionError on
        timeout (with every message seen)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for m in self.messages[after:]:
                    if pred(m):
                        return m
                left = deadline - time.monotonic()
                assert left > 0, f"no such notify message within {timeout}s: {self.messages}"
                self._cond.wait(left)

    def index(self, msg: Message) -> int:
        with self._cond:
            return next(i for i, m in enumerate(self.messages) if m is msg)

    def snapshot(self) -> list[Message]:
        with self._cond:
            return list(self.messages)
