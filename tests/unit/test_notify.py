"""systemd's notify protocol and log rotation, through the real daemon: `ckptfs mount` with
$NOTIFY_SOCKET naming a real unix datagram socket (tests/sdlisten.py stands in for systemd),
and a real logrotate run on deploy/logrotate/ckptfs.

What a unit relies on (scripts/systemd/ckptfs@.service, Type=notify): READY=1 comes from the
daemon, names it as MAINPID, and only once the mount serves its whole namespace; STATUS= says
what is at risk; SIGHUP reopens the log between RELOADING=1 and READY=1 and never unmounts;
STOPPING=1 at the unmount.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REPO, ckptfs_cmd, is_mounted, run_cli, wait_for
from sdlisten import Message, NotifyListener

from ckptfs import sdnotify
from ckptfs.daemon import STATUS_INTERVAL_S
from ckptfs.mount import EXIT_OK

LOGROTATE_CONF = REPO / "deploy" / "logrotate" / "ckptfs"


@pytest.fixture
def short_dir():
    """A directory with a short path: AF_UNIX socket paths are limited to 107 bytes, and
    pytest's tmp_path can be longer."""
    d = tempfile.mkdtemp(prefix="sd-", dir="/tmp")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def daemon_env(notify_socket: str) -> dict[str, str]:
    env = {**os.environ, "NOTIFY_SOCKET": notify_socket}
    env.pop("SYSTEMD_EXEC_PID", None)  # as an older systemd: the daemon speaks (sdnotify)
    return env


def mount_with(m, env: dict[str, str], *extra: str) -> subprocess.Popen:
    """`ckptfs mount` of Mount `m` as conftest's Mount.start runs it, with `env`; not waited."""
    return subprocess.Popen(
        ckptfs_cmd("mount", str(m.path), "--cache-dir", str(m.cache_dir), "--log-file",
                   str(m.log_file), "--store", f"file://{m.store_dir}", *extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def finish_mount(m, proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_OK, err
    found = re.search(r"pid (\d+)", out)
    assert found, out
    m.pid = int(found.group(1))


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
# the daemon


def test_ready_only_once_the_mount_serves_the_stores_sets(mount_factory, short_dir):
    """A set made durable by an earlier mount is in the store only (a fresh cache dir): at the
    moment READY=1 arrives, the mount lists it and reads it back, and `ckptfs mount` has not
    returned yet. READY=1 comes from the daemon and names it as MAINPID."""
    first = mount_factory("first")
    first.start()
    data = os.urandom(1 << 16)
    (first.path / "step_1.pt").write_bytes(data)
    assert run_cli("wait", str(first.path / "step_1.pt"), "--timeout", "60").returncode == 0
    first.stop()

    m = mount_factory("m")
    m.store_dir = first.store_dir
    proc: subprocess.Popen | None = None

    def at_ready(msg: Message) -> None:
        if msg.get("READY") == "1":
            msg.seen["listing"] = sorted(os.listdir(m.path))
            msg.seen["data"] = (m.path / "step_1.pt").read_bytes()
            msg.seen["mount_returned"] = proc is not None and proc.poll() is not None

    with NotifyListener(str(short_dir / "notify.sock"), at_ready) as sd:
        proc = mount_with(m, daemon_env(sd.address))
        finish_mount(m, proc)
        ready = sd.wait(lambda x: x.get("READY") == "1")
        first_msgs = sd.snapshot()[:sd.index(ready) + 1]
    assert ready.seen["listing"] == ["step_1.pt"] and ready.seen["data"] == data
    assert ready.seen["mount_returned"] is False
    assert [x.fields for x in first_msgs if x is not ready] == []  # nothing before READY=1
    assert ready.pid == m.pid and ready.get("MAINPID") == str(m.pid)
    # the store's set counts as durable here too: it is listed before READY=1
    assert ready.get("STATUS") == (f"serving {m.path}: 1 set durable, 0 pending (0 B not yet "
                                   "durable), store normal")
    m.stop()
    assert not m.unexpected_errors()


def test_status_reload_rotation_and_stopping(mount_factory, short_dir):
    """STATUS= follows the sets; SIGHUP after logrotate renamed the log (the shipped config,
    its paths and signal aimed at this daemon) reopens a new 0600 file at the path between
    RELOADING=1 and READY=1, and the mount still serves; `ckptfs umount` sends STOPPING=1."""
    m = mount_factory()
    with NotifyListener(str(short_dir / "notify.sock")) as sd:
        finish_mount(m, mount_with(m, daemon_env(sd.address)))
        sd.wait(lambda x: x.get("READY") == "1")

        (m.path / "a.pt").write_bytes(os.urandom(1 << 16))
        assert run_cli("wait", str(m.path / "a.pt"), "--timeout", "60").returncode == 0
        st = sd.wait(lambda x: "1 set durable" in (x.get("STATUS") or ""),
                     timeout=STATUS_INTERVAL_S * 6)
        assert st.pid == m.pid and "READY" not in st.fields and "0 pending" in st.get("STATUS")

        # logrotate: the shipped config, aimed at this log and this daemon only (its own
        # postrotate signals every root daemon of the machine: other tests' too)
        before = m.log_text()
        assert "mounted" in before
        conf = short_dir / "logrotate.conf"
        conf.write_text(rotate_config(m.log_file, m.pid))
        n = len(sd.snapshot())
        res = subprocess.run(["logrotate", "-f", "-s", str(short_dir / "state"), str(conf)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        rotated = m.log_file.with_name(m.log_file.name + ".1")
        reloading = sd.wait(lambda x: x.get("RELOADING") == "1", after=n)
        again = sd.wait(lambda x: x.get("READY") == "1", after=sd.index(reloading) + 1)
        assert reloading.pid == again.pid == m.pid
        assert int(reloading.get("MONOTONIC_USEC")) <= sdnotify.monotonic_usec()
        assert again.get("STATUS").startswith(f"serving {m.path}: 1 set durable")
        wait_for(lambda: "reopened the log file" in m.log_text(), what="the reopened log")
        assert stat.S_IMODE(os.stat(m.log_file).st_mode) == 0o600
        assert rotated.read_text().startswith(before)  # the old lines stay in the .1 file
        assert is_mounted(m.path)

        # still serving, and logging to the new file only
        (m.path / "b.pt").write_bytes(b"after the rotation")
        assert run_cli("wait", str(m.path / "b.pt"), "--timeout", "60").returncode == 0
        assert (m.path / "b.pt").read_bytes() == b"after the rotation"
        old_len = len(rotated.read_text())

        n = len(sd.snapshot())
        m.stop()
        stopping = sd.wait(lambda x: x.get("STOPPING") == "1", after=n)
        assert stopping.pid is not None and stopping.get("STATUS") == f"unmounting {m.path}"
    assert "daemon exiting" in m.log_text()
    assert len(rotated.read_text()) == old_len  # nothing more went to the renamed file
    assert not m.unexpected_errors()


def rotate_config(log_file: Path, pid: int) -> str:
    """deploy/logrotate/ckptfs with its paths replaced by `log_file` and its postrotate by a
    SIGHUP to `pid`."""
    text = LOGROTATE_CONF.read_text()
    head, brace, rest = text.partition(" {\n")
    assert brace and head.splitlines()[-1].startswith("/"), text
    body, _, _ = rest.partition("    postrotate\n")
    assert "nocreate" in body and "delaycompress" in body, body
    paths = "\n".join(head.splitlines()[:-1])
    return (f"{paths}\n{log_file} {{\n{body}    postrotate\n        kill -HUP {pid}\n"
            "    endscript\n}\n")


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
