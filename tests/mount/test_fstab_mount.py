"""fstab and systemd: ckptfs mounted by mount(8) through its helper /sbin/mount.fuse.ckptfs,
unmounted by umount(8), and the ckptfs@.service unit's own command lines run for real (the -o
mapping and the unit file without a mount: tests/unit/test_fstab.py).

Needs root: mount(8) looks for helpers only in /sbin, so the helper symlink
/sbin/mount.fuse.ckptfs -> <venv>/bin/mount.fuse.ckptfs is installed for these tests if it is
absent (and removed afterwards); the unit's ExecStop needs /usr/local/bin/ckptfs likewise. A
different file already at either path is not touched: the tests that need it fail with CI=true
(and skip otherwise). /etc/fstab is never read: `mount --fstab FILE` takes a test's own table.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from ckpt_restore import FileStoreView, manifests, restore
from procwait import Events

from ckptfs.config import default_store_url
from ckptfs.mount import find_mount
from ckptfs.mount import pid_running as _alive
from tests.conftest import REPO, hold_uploads, is_mounted, run_cli, wait_for
from tests.fstab_helpers import UNIT, cli_link, escape_path, helper, parse_env_file, parse_unit, run
from tests.sdlisten import NotifyListener

__all__ = ["cli_link", "helper"]  # the fixtures, imported for these tests


def daemon_pid(res: subprocess.CompletedProcess) -> int:
    m = re.search(r"pid (\d+)", res.stdout)
    assert m, (res.stdout, res.stderr)
    return int(m.group(1))


def mount_flags(mp: Path) -> set[str]:
    """The per-mount flags (mountinfo field 6: rw,nosuid,nodev,...)."""
    with open("/proc/self/mountinfo") as f:
        rows = [ln.split() for ln in f if ln.split()[4] == str(mp)]
    assert rows, f"{mp} not in mountinfo"
    return set(rows[-1][5].split(","))


def sets(m) -> dict[str, str]:
    return {s["path"]: s["state"] for s in m.status()["tiering"]["sets"]}


# ----------------------------------------------------------------------------------------------
# mount(8) and umount(8)


def test_mount_t_then_plain_umount_leaves_uploads_to_the_next_mount(helper, mount_factory,
                                                                    tmp_path):
    m = mount_factory()
    url = f"file://{m.store_dir}"
    opts = (f"cache_dir={m.cache_dir},log_file={m.log_file},_netdev,nofail,defaults,"
            "no_passthrough,compress=off,nosuid,nodev")
    gate = tmp_path / "uploads-held"
    res = run(["mount", "-t", "fuse.ckptfs", url, str(m.path), "-o", opts],
              env={**os.environ, **hold_uploads(gate)})
    assert res.returncode == 0, res.stderr
    m.pid = daemon_pid(res)
    entry = find_mount(m.path)
    assert entry["fstype"] == "fuse.ckptfs" and entry["source"] == url  # df shows the store
    assert {"nosuid", "nodev"} <= mount_flags(m.path)
    st = m.status()
    assert st["pid"] == m.pid
    assert st["cache_dir"] == str(m.cache_dir)
    assert st["tiering"]["store"]["url"] == url
    assert st["data_path"]["mode"] != "passthrough"
    assert "--no-passthrough" in st["data_path"]["off_reason"]
    data = os.urandom(1 << 20)
    (m.path / "ckpt.pt").write_bytes(data)
    wait_for(lambda: "holding put" in m.log_text(), what="the upload to be held")
    assert sets(m)["ckpt.pt"] != "durable"

    # Plain umount(8): no drain. The daemon exits; nothing of the set is published.
    res = run(["umount", str(m.path)])
    assert res.returncode == 0, res.stderr
    pid, m.pid = m.pid, None
    wait_for(lambda: not _alive(pid), timeout=60, what="the daemon to exit")
    assert not is_mounted(m.path)
    assert "ckpt.pt" not in manifests(FileStoreView(m.store_dir))

    # The next mount of the cache dir (no faults now) has the file and resumes its upload.
    res = run(["mount", "-t", "fuse.ckptfs", url, str(m.path), "-o", opts])
    assert res.returncode == 0, res.stderr
    m.pid = daemon_pid(res)
    assert (m.path / "ckpt.pt").read_bytes() == data
    res = run_cli("wait", str(m.path / "ckpt.pt"), "--timeout", "60")
    assert res.returncode == 0, res.stderr
    view = FileStoreView(m.store_dir)
    assert list(restore(view, manifests(view)["ckpt.pt"]).values()) == [data]
    m.stop()
    assert not m.unexpected_errors()


def test_fstab_line_mounts_with_mount_dir_and_mount_a_is_idempotent(helper, mount_factory,
                                                                    tmp_path):
    m = mount_factory()
    url = f"file://{m.store_dir}"
    fstab = tmp_path / "fstab"
    fstab.write_text(
        "# a test's own table: /etc/fstab is not touched\n"
        f"{url} {m.path} fuse.ckptfs cache_dir={m.cache_dir},log_file={m.log_file},_netdev,"
        "nofail,x-systemd.after=network-online.target,comment=ckptfs,refresh_interval=2,"
        "no_passthrough 0 0\n")
    res = run(["mount", "--fstab", str(fstab), str(m.path)])
    assert res.returncode == 0, res.stderr
    m.pid = daemon_pid(res)
    st = m.status()
    assert st["tiering"]["store"]["url"] == url and st["cache_dir"] == str(m.cache_dir)
    assert st["data_path"]["mode"] != "passthrough"
    # mount -a again: the line is recognised as mounted (the mount's source is the store URL)
    res = run(["mount", "--fstab", str(fstab), "-a"])
    assert res.returncode == 0, res.stderr
    with open("/proc/self/mountinfo") as f:
        assert sum(ln.split()[4] == str(m.path) for ln in f) == 1
    (m.path / "a.pt").write_bytes(b"fstab")
    res = run(["umount", str(m.path)])
    assert res.returncode == 0, res.stderr
    pid, m.pid = m.pid, None
    wait_for(lambda: not _alive(pid), timeout=60, what="the daemon to exit")
    res = run(["mount", "--fstab", str(fstab), str(m.path)])
    assert res.returncode == 0, res.stderr
    m.pid = daemon_pid(res)
    assert (m.path / "a.pt").read_bytes() == b"fstab"
    m.stop()
    assert not m.unexpected_errors()


def test_source_none_is_the_shared_default_store_and_says_so(helper, mount_factory):
    """`none` mounts the embedded default store (root's /var/lib/ckptfs/store here); the mount
    says it is shared. The test writes nothing into that store, and removes /var/lib/ckptfs
    again if it made it."""
    url = default_store_url()
    top = Path(url.removeprefix("file://")).parent
    existed = top.exists()
    m = mount_factory()
    try:
        res = run(["mount", "-t", "fuse.ckptfs", "none", str(m.path), "-o",
                   f"cache_dir={m.cache_dir},log_file={m.log_file}"])
        assert res.returncode == 0, res.stderr
        m.pid = daemon_pid(res)
        assert f"store {url} (embedded default store, shared by every mount" in res.stdout
        assert "without --store" in res.stdout
        assert "shared by every mount" in m.log_text()
        assert m.status()["tiering"]["store"]["url"] == url
        m.stop()
    finally:
        m.cleanup()
        if not existed:
            shutil.rmtree(top, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# systemd: scripts/systemd/ckptfs@.service


def command(line: str, instance: str, mp: Path, env: dict[str, str]) -> list[str]:
    """An Exec line as systemd runs it: specifiers %i %I %f %%, then "${VAR}" as one word and
    $VAR split at whitespace (systemd.service(5) "Command lines")."""
    assert not line.startswith(("-", "@", "+", "!", ":")), line
    line = re.sub(r"%(.)", lambda m: {"i": instance, "I": str(mp).lstrip("/"), "f": str(mp),
                                      "%": "%"}[m.group(1)], line)
    argv: list[str] = []
    for word in shlex.split(line):
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            argv.append(env.get(m.group(1), ""))
        elif m := re.fullmatch(r"\$(\w+)", word):
            argv += env.get(m.group(1), "").split()
        else:
            assert "$" not in word, word
            argv.append(word)
    return argv


def test_unit_start_and_stop_commands_mount_and_drain(helper, cli_link, mount_factory,
                                                      tmp_path):
    """ExecStart mounts from the instance's environment file and, as systemd runs it (its own
    pid in $SYSTEMD_EXEC_PID, a notify socket), the forked daemon says READY=1 with itself as
    MAINPID before the start command returns; ExecReload (SIGHUP) reopens the log and the mount
    stays; ExecStop waits until the set is durable (uploads held, then released), then
    unmounts (STOPPING=1) and the daemon is gone."""
    u = parse_unit(UNIT)
    m = mount_factory()
    instance = escape_path(m.path)
    url = f"file://{m.store_dir}"
    assert u["Service.EnvironmentFile"] == ["/etc/ckptfs/%i.conf"]
    conf = tmp_path / f"{instance}.conf"  # stands in for /etc/ckptfs/<instance>.conf
    gate = tmp_path / "uploads-held"
    held = hold_uploads(gate)["CKPTFS_FAULTS"]
    conf.write_text(f"CKPTFS_SOURCE={url}\n"
                    f"CKPTFS_OPTIONS=cache_dir={m.cache_dir},log_file={m.log_file}\n"
                    f"CKPTFS_FAULTS={held}\n")
    unit_env = parse_env_file(conf)
    env = {**os.environ, **unit_env}

    sock_dir = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))  # AF_UNIX: a short path
    with NotifyListener(str(sock_dir / "notify")) as sd:
        try:
            _start_stop_as_systemd(u, m, instance, unit_env, {**env, "NOTIFY_SOCKET": sd.address},
                                   url, gate, sd)
        finally:
            shutil.rmtree(sock_dir, ignore_errors=True)
    assert not m.unexpected_errors()


def _start_stop_as_systemd(u, m, instance, unit_env, env, url, gate, sd) -> None:
    start = command(u["Service.ExecStart"][0], instance, m.path, unit_env)
    # systemd execs the command line in the pid it names in $SYSTEMD_EXEC_PID
    env.pop("SYSTEMD_EXEC_PID", None)
    as_systemd = ["sh", "-c", 'SYSTEMD_EXEC_PID=$$ exec "$@"', "sh", *start]
    proc = subprocess.Popen(as_systemd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)
    helper_pid = proc.pid
    out, err = proc.communicate(timeout=float(u["Service.TimeoutStartSec"][0]))
    assert proc.returncode == 0, (start, err)
    m.pid = daemon_pid(subprocess.CompletedProcess(start, 0, out, err))
    assert _alive(m.pid)  # the daemon stays, the start command has returned
    # sent before the daemon told the helper (ckptfs.daemon._Daemon._ready), so systemd knows
    # the main process when the helper exits
    ready = sd.wait(lambda x: x.get("READY") == "1")
    assert ready.pid == m.pid != helper_pid and ready.get("MAINPID") == str(m.pid)
    assert (ready.get("STATUS") or "").startswith(f"serving {m.path}: ")
    assert m.status()["tiering"]["store"]["url"] == url

    n = len(sd.snapshot())
    reload_cmd = command(u["Service.ExecReload"][0], instance, m.path,
                         {**unit_env, "MAINPID": str(m.pid)})
    res = run(reload_cmd, env=env)
    assert res.returncode == 0, res.stderr
    reloading = sd.wait(lambda x: x.get("RELOADING") == "1", after=n)
    sd.wait(lambda x: x.get("READY") == "1", after=sd.index(reloading) + 1)
    assert "reopened the log file" in m.log_text()
    assert is_mounted(m.path) and _alive(m.pid)
    data = os.urandom(1 << 20)
    (m.path / "step_1.pt").write_bytes(data)
    wait_for(lambda: "holding put" in m.log_text(), what="the upload to be held")

    stop = command(u["Service.ExecStop"][0], instance, m.path, unit_env)
    proc = subprocess.Popen(stop, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=REPO)
    try:
        ev = Events(proc)
        line = ev.next(timeout=60)
        # the drain's plain (not a terminal) progress line, ckptfs/ui.py
        assert line is not None and line.startswith("uploads:") and "pending" in line, line
        # draining: still mounted, nothing published while the upload is held
        assert proc.poll() is None and is_mounted(m.path)
        assert "step_1.pt" not in manifests(FileStoreView(m.store_dir))
        gate.unlink()
        rest = "\n".join(ev.rest(timeout=float(u["Service.TimeoutStopSec"][0])))
        proc.wait(timeout=60)
    finally:
        gate.unlink(missing_ok=True)  # a failed check above must not leave the drain held
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest
    assert "unmounted" in rest
    assert not is_mounted(m.path)
    assert not _alive(m.pid)
    assert any(x.get("STOPPING") == "1" and x.pid == m.pid for x in sd.snapshot()[n:])
    m.pid = None
    view = FileStoreView(m.store_dir)
    assert list(restore(view, manifests(view)["step_1.pt"]).values()) == [data]
