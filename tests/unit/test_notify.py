"""systemd's notify protocol and log rotation without a mount: ckptfs.sdnotify in process, on a
real unix datagram socket (tests/sdlisten.py stands in for systemd), and the shipped
deploy/logrotate/ckptfs, which logrotate accepts and whose postrotate signals every registered
daemon. (Through the real daemon, what a unit relies on: tests/mount/test_notify_mount.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ckptfs import sdnotify
from tests.notify_helpers import LOGROTATE_CONF, short_dir
from tests.sdlisten import NotifyListener

__all__ = ["short_dir"]  # the fixture, imported for these tests


# ----------------------------------------------------------------------------------------------
# the protocol, in process


def test_socket_address_spellings():
    assert sdnotify.socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert sdnotify.socket_address("@abstract/name") == b"\0abstract/name"
    for nothing in (None, "", "vsock:2:1234", "relative/path"):
        assert sdnotify.socket_address(nothing) is None


def test_speaks_only_for_the_service_that_started_it():
    # systemd started the helper (the parent) or the daemon itself; unset: an older systemd
    assert sdnotify.speaks_for({"SYSTEMD_EXEC_PID": "10"}, pid=11, ppid=10)
    assert sdnotify.speaks_for({"SYSTEMD_EXEC_PID": "11"}, pid=11, ppid=10)
    assert sdnotify.speaks_for({}, pid=11, ppid=10)
    # a job inside another service ran `ckptfs mount`: that service's socket is not ours
    assert not sdnotify.speaks_for({"SYSTEMD_EXEC_PID": "3"}, pid=11, ppid=10)
    assert not sdnotify.speaks_for({"SYSTEMD_EXEC_PID": "x"}, pid=11, ppid=10)


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_notifier_messages_and_their_order(short_dir, kind):
    addr = str(short_dir / "n.sock") if kind == "path" else f"@ckptfs-test-{os.getpid()}"
    with NotifyListener(addr) as sd:
        n = sdnotify.Notifier({"NOTIFY_SOCKET": addr, "SYSTEMD_EXEC_PID": str(os.getpid())})
        assert n.enabled
        n.stopping("too early")  # before READY=1: nothing (the start fails by exit status)
        n.ready("serving")
        n.status("serving")      # unchanged: not sent again
        n.status("serving more")
        before = sdnotify.monotonic_usec()
        n.reloading("reloading")
        n.reloaded("serving again")
        n.stopping("unmounting")
        n.stopping("unmounting again")  # once
        n.send(X_END=1)  # datagrams keep their order: once this is in, all the others are
        sd.wait(lambda m: m.get("X_END") == "1")
        got = [m.fields for m in sd.snapshot()][:-1]
        last = sd.snapshot()[-2]
    assert all(m.pid == os.getpid() for m in sd.snapshot())
    # systemd started this very process (SYSTEMD_EXEC_PID): no MAINPID=
    assert got[0] == {"READY": "1", "STATUS": "serving"}
    assert got[1] == {"STATUS": "serving more"}
    assert got[2]["RELOADING"] == "1" and got[2]["STATUS"] == "reloading"
    assert before <= int(got[2]["MONOTONIC_USEC"]) <= sdnotify.monotonic_usec()
    assert got[3] == {"READY": "1", "STATUS": "serving again"}
    assert got[4] == {"STOPPING": "1", "STATUS": "unmounting"} == last.fields
    assert len(got) == 5


def test_notifier_is_a_no_op_without_a_socket_and_never_raises(short_dir):
    off = sdnotify.Notifier({})
    assert not off.enabled and not off.send(READY=1)
    off.ready("x")
    # a socket path nobody listens on (ENOENT), and one that is not a socket (ECONNREFUSED)
    (short_dir / "file").write_text("")
    for addr in (str(short_dir / "none.sock"), str(short_dir / "file"), "@ckptfs-nobody"):
        n = sdnotify.Notifier({"NOTIFY_SOCKET": addr})
        assert n.enabled and not n.send(READY=1)
        n.ready("x")
        n.reloading("y")
        n.stopping("z")
    # another service's socket (a job's `ckptfs mount` under it): never used
    with NotifyListener(str(short_dir / "other.sock")) as sd:
        n = sdnotify.Notifier({"NOTIFY_SOCKET": sd.address, "SYSTEMD_EXEC_PID": "1"})
        assert not n.enabled and not n.send(READY=1)
    assert sd.snapshot() == []


# ----------------------------------------------------------------------------------------------
# the shipped logrotate config


def test_shipped_logrotate_config_parses_and_signals_every_registered_daemon(short_dir):
    """logrotate accepts the config (debug mode: nothing rotated, nothing run); its postrotate
    finds the pid in a registration file as ckptfs.mount.register writes it."""
    res = subprocess.run(["logrotate", "-d", "-s", str(short_dir / "state"),
                          str(LOGROTATE_CONF)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    script = LOGROTATE_CONF.read_text().split("postrotate\n")[1].split("endscript")[0]
    assert "kill -HUP" in script and "/run/ckptfs/*.json" in script
    # run the loop on a registration dir of our own, signalling a process of our own
    import json

    regdir = short_dir / "run"
    regdir.mkdir()
    # SIGHUP at its default in the target whatever the test runner ignores (nohup): it puts it
    # back itself and says so before the script runs
    target = subprocess.Popen(
        [sys.executable, "-c", ("import signal, time; "
                                "signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                                "print('ready', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline() == "ready\n"
        (regdir / "k.json").write_text(json.dumps({"pid": target.pid, "uid": 0}))
        res = subprocess.run(["sh", "-c", script.replace("/run/ckptfs", str(regdir))],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        assert target.wait(timeout=30) == -signal.SIGHUP
    finally:
        if target.poll() is None:
            target.kill()
            target.wait()
