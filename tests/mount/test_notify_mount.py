"""systemd's notify protocol and log rotation, through the real daemon: `ckptfs mount` with
$NOTIFY_SOCKET naming a real unix datagram socket (tests/sdlisten.py stands in for systemd),
and a real logrotate run on deploy/logrotate/ckptfs. (The protocol in process, and the shipped
logrotate config: tests/unit/test_notify.py.)

What a unit relies on (scripts/systemd/ckptfs@.service, Type=notify): READY=1 comes from the
daemon, names it as MAINPID, and only once the mount serves its whole namespace; STATUS= says
what is at risk; SIGHUP reopens the log between RELOADING=1 and READY=1 and never unmounts;
STOPPING=1 at the unmount.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

from ckptfs import sdnotify
from ckptfs.daemon import STATUS_INTERVAL_S
from ckptfs.mount import EXIT_OK
from tests.conftest import REPO, ckptfs_cmd, is_mounted, run_cli, wait_for
from tests.notify_helpers import LOGROTATE_CONF, short_dir
from tests.sdlisten import Message, NotifyListener

__all__ = ["short_dir"]  # the fixture, imported for these tests


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
