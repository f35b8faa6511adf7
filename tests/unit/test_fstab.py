"""fstab and systemd: ckptfs mounted by mount(8) through its helper /sbin/mount.fuse.ckptfs,
unmounted by umount(8), and the ckptfs@.service unit's own command lines run for real.

Needs root: mount(8) looks for helpers only in /sbin, so the helper symlink
/sbin/mount.fuse.ckptfs -> <venv>/bin/mount.fuse.ckptfs is installed for these tests if it is
absent (and removed afterwards); the unit's ExecStop needs /usr/local/bin/ckptfs likewise. A
different file already at either path is not touched: the tests that need it fail with CI=true
(and skip otherwise). /etc/fstab is never read: `mount --fstab FILE` takes a test's own table.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpt_restore import FileStoreView, manifests, restore
from conftest import IN_CI, REPO, hold_uploads, is_mounted, require_fuse, run_cli, wait_for
from procwait import Events
from sdlisten import NotifyListener

import ckptfs
from ckptfs.cli import mount_parser
from ckptfs.config import default_store_url
from ckptfs.mount import EXIT_USAGE, READY_TIMEOUT_S, find_mount
from ckptfs.mount import pid_running as _alive
from ckptfs.mounthelper import IGNORED, mount_options, translate

VENV_BIN = Path(sys.executable).parent
HELPER = Path("/sbin/mount.fuse.ckptfs")
CLI_LINK = Path("/usr/local/bin/ckptfs")
# HELPER and CLI_LINK are paths of the whole machine, used by this module's tests on every xdist
# worker at once (`xdist_group` + `--dist loadgroup` no longer keep them on one worker under
# pytest 9: one worker's teardown removed /usr/local/bin/ckptfs while another's test ran its
# unit's ExecStop). So their users are counted across processes (`_link`).
USERS_DIR = Path(tempfile.gettempdir()) / "ckptfs-test-system-paths"
UNIT = REPO / "scripts" / "systemd" / "ckptfs@.service"
EXAMPLE_CONF = REPO / "scripts" / "systemd" / "ckptfs.conf.example"


def _need(cond: bool, why: str) -> None:
    if not cond:
        if IN_CI:
            pytest.fail(why)
        pytest.skip(why)


@contextlib.contextmanager
def _users(link: Path) -> Iterator[dict]:
    """The record of `link`'s users, {"pids": [...], "made": bool}, under an exclusive flock
    shared by every test process of the machine; what the block leaves in it is written back.
    Pids of processes that are gone (a killed worker) are dropped first."""
    USERS_DIR.mkdir(mode=0o700, exist_ok=True)
    name = str(link).strip("/").replace("/", "-")
    with open(USERS_DIR / f"{name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state_file = USERS_DIR / f"{name}.json"
        try:
            state = json.loads(state_file.read_text())
        except (FileNotFoundError, ValueError):
            state = {"pids": [], "made": False}
        state["pids"] = [p for p in state["pids"] if _alive(p)]
        yield state
        state_file.write_text(json.dumps(state))


def _link(link: Path, target: Path):
    """`link` -> `target` for the tests of this process: installed by the first user on the
    machine unless it is there already, removed by the last one if a test installed it; yields."""
    _need(os.geteuid() == 0, f"installing {link} needs root")
    _need(target.exists(), f"{target} missing: reinstall the package (pip install -e .)")
    with _users(link) as state:
        if os.path.lexists(link):
            _need(os.path.realpath(link) == os.path.realpath(target),
                  f"{link} exists and is not a link to {target}; not replacing it (remove it, "
                  f"or run the tests from the checkout it belongs to)")
            if not state["pids"]:
                state["made"] = False  # there before any test: never ours to remove
        else:
            os.symlink(target, link)
            state["made"] = True
        state["pids"].append(os.getpid())
    try:
        yield link
    finally:
        with _users(link) as state:
            state["pids"] = [p for p in state["pids"] if p != os.getpid()]
            if not state["pids"] and state["made"]:
                if os.path.islink(link) and os.readlink(link) == str(target):
                    os.unlink(link)
                state["made"] = False


@pytest.fixture(scope="module")
def helper():
    require_fuse()
    yield from _link(HELPER, VENV_BIN / "mount.fuse.ckptfs")


@pytest.fixture(scope="module")
def cli_link():
    yield from _link(CLI_LINK, VENV_BIN / "ckptfs")


def run(argv: list[str], env: dict | None = None, timeout: float = 120,
        cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env)


def daemon_pid(res: subprocess.CompletedProcess) -> int:
    m = re.search(r"pid (\d+)", res.stdout)
    assert m, (res.stdout, res.stderr)
    return int(m.group(1))


def one_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: "), res.stderr
    return lines[0]


def mount_flags(mp: Path) -> set[str]:
    """The per-mount flags (mountinfo field 6: rw,nosuid,nodev,...)."""
    with open("/proc/self/mountinfo") as f:
        rows = [ln.split() for ln in f if ln.split()[4] == str(mp)]
    assert rows, f"{mp} not in mountinfo"
    return set(rows[-1][5].split(","))


def sets(m) -> dict[str, str]:
    return {s["path"]: s["state"] for s in m.status()["tiering"]["sets"]}


# ----------------------------------------------------------------------------------------------
# the -o mapping (no mount)


def test_every_mount_option_has_an_o_spelling():
    """Every option `ckptfs mount --help` lists is spellable with -o, and setting it through
    the helper changes exactly that option of the parsed command line."""
    # wide: argparse wraps help text at hyphens otherwise
    res = run([sys.executable, "-m", "ckptfs", "mount", "--help"],
              env={**os.environ, "COLUMNS": "10000"})
    assert res.returncode == 0, res.stderr
    listed = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", res.stdout)) - {"--help"}
    known = mount_options()
    assert listed == {opt for opt, _ in known.values()}
    assert not set(known) & IGNORED  # no ckptfs option is swallowed as a generic one
    p = mount_parser()
    defaults = vars(p.parse_args(["/mnt/x"]))
    for name, (_opt, act) in known.items():
        if act.nargs == 0:
            item = name
        elif act.choices:
            default = defaults[act.dest]
            item = f"{name}={next(c for c in act.choices if c != default)}"
        elif act.dest == "store":
            item = f"{name}=s3://bucket/prefix"
        else:
            item = f"{name}=7"  # a number, a size, a path and a string alike
        argv, warnings = translate("none", "/mnt/x", [item])
        assert argv[:2] == ["mount", "/mnt/x"] and not warnings
        got = vars(p.parse_args(argv[1:]))
        changed = {k for k in got if got[k] != defaults[k]}
        assert changed == {act.dest}, (item, argv, changed)


def test_source_and_generic_options():
    argv, _ = translate("s3://b/p", "/mnt/c", ["cache_dir=/nvme/c", "_netdev", "nofail",
                                               "defaults", "rw", "x-systemd.automount",
                                               "comment=hi", "users", "no_passthrough"])
    assert argv == ["mount", "/mnt/c", "--store", "s3://b/p", "--cache-dir=/nvme/c",
                    "--no-passthrough"]
    # ckptfs / none: the default store, so no --store; store= may say it instead of SOURCE
    assert translate("none", "/m", [])[0] == ["mount", "/m"]
    assert translate("ckptfs", "/m", ["store=file:///s"])[0] == ["mount", "/m", "--store",
                                                                 "file:///s"]
    # -s (sloppy): an unknown option is a warning
    argv, warnings = translate("none", "/m", ["bogus"], sloppy=True)
    assert argv == ["mount", "/m"] and len(warnings) == 1


@pytest.mark.parametrize("args,why", [
    (["none", "/mnt/x", "-o", "bogus=1"], "unknown mount option 'bogus'"),
    (["none", "/mnt/x", "-o", "sync"], "unknown mount option 'sync'"),
    (["none", "/mnt/x", "-o", "ro=1"], "takes no value"),
    (["none", "/mnt/x", "-o", "no_passthrough=1"], "takes no value"),
    (["none", "/mnt/x", "-o", "cache_dir"], "needs a value"),
    (["s4://b", "/mnt/x"], "SOURCE must be"),
    (["s3://a", "/mnt/x", "-o", "store=s3://b"], "disagree"),
    (["none"], "expected SOURCE and DIR"),
    (["none", "/mnt/x", "-t", "fuse.sshfs"], "helper of fuse.ckptfs"),
    (["none", "/mnt/x", "-N", "/proc/1/ns/mnt"], "not supported"),
    (["none", "/mnt/x", "-o", "cache_size=lots"], "not a size"),
])
def test_bad_helper_command_line_exits_2_with_one_line(args, why):
    res = run([str(VENV_BIN / "mount.fuse.ckptfs"), *args])
    assert res.returncode == EXIT_USAGE, (res.stdout, res.stderr)
    assert why in one_line(res)


def test_fake_mount_checks_options_and_mounts_nothing(tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = run([str(VENV_BIN / "mount.fuse.ckptfs"), f"file://{tmp_path}/s", str(mp), "-fv",
               "-o", f"cache_dir={tmp_path}/c,compress=lz4"])
    assert res.returncode == 0, res.stderr
    assert f"--store file://{tmp_path}/s --cache-dir={tmp_path}/c --compress=lz4" in res.stderr
    assert not is_mounted(mp) and not (tmp_path / "c").exists()


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


def test_unknown_option_through_mount8_exits_2(helper, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = run(["mount", "-t", "fuse.ckptfs", f"file://{tmp_path}/s", str(mp), "-o",
               f"cache_dir={tmp_path}/c,_netdev,bogus"])
    assert res.returncode == EXIT_USAGE, res.stderr
    assert "unknown mount option 'bogus'" in one_line(res)
    assert not is_mounted(mp) and not (tmp_path / "c").exists()


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


def parse_unit(path: Path) -> dict[str, list[str]]:
    """'Section.Key' -> values, in order (systemd keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def parse_env_file(path: Path) -> dict[str, str]:
    env = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and line[0] not in "#;":
            k, _, v = line.partition("=")
            env[k.strip()] = v.strip().strip('"')
    return env


def escape_path(p: Path) -> str:
    """`systemd-escape --path` (the instance name of a mount point); where systemd-escape is
    not installed, its rules for the paths these tests make (no leading dot, no '//')."""
    if shutil.which("systemd-escape"):
        return run(["systemd-escape", "--path", str(p)]).stdout.strip()
    return "".join("-" if c == "/" else c if c.isascii() and (c.isalnum() or c in ":_.")
                   else "".join(f"\\x{b:02x}" for b in c.encode())
                   for c in str(p).strip("/"))


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


def test_unit_passes_systemd_analyze_verify(helper, cli_link, tmp_path):
    """Skips when systemd-analyze is not installed (only this check; the unit's commands are
    run by the next test either way)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed: unit file not verified by systemd")
    inst = tmp_path / f"ckptfs@{escape_path(Path('/mnt/ckpt'))}.service"
    shutil.copy(UNIT, inst)
    res = run(["systemd-analyze", "verify", str(inst)])
    assert res.returncode == 0, res.stdout + res.stderr
    assert UNIT.name.split("@")[0] not in res.stdout + res.stderr, res.stdout + res.stderr


def test_unit_orders_and_bounds_the_drain():
    u = parse_unit(UNIT)
    assert "network-online.target" in " ".join(u["Unit.After"] + u["Unit.Wants"]).split()
    assert "%i.mount" in " ".join(u["Unit.Before"]).split()
    # Type=notify: the daemon the helper forks says READY=1 + MAINPID= itself, hence
    # NotifyAccess=all (the start test below checks the messages); SIGHUP is its reload
    assert u["Service.Type"] == ["notify"]
    assert u["Service.NotifyAccess"] == ["all"]
    assert u["Service.ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    stop = shlex.split(u["Service.ExecStop"][0])
    assert stop[1:3] == ["umount", "%f"] and "--timeout" in stop
    n = float(stop[stop.index("--timeout") + 1])
    stop_timeout = float(u["Service.TimeoutStopSec"][0])
    assert n < stop_timeout <= n + 60, (n, stop_timeout)
    assert float(u["Service.TimeoutStartSec"][0]) > READY_TIMEOUT_S


def test_example_conf_is_accepted_by_the_helper():
    env = parse_env_file(EXAMPLE_CONF)
    res = run([str(VENV_BIN / "mount.fuse.ckptfs"), env["CKPTFS_SOURCE"], "/mnt/ckpt", "-f",
               "-o", env["CKPTFS_OPTIONS"]])
    assert res.returncode == 0, res.stderr


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


# ----------------------------------------------------------------------------------------------
# one version


def test_version_is_the_installed_distributions(tmp_path):
    """`ckptfs --version` (the installed console script) prints the version the installed
    distribution carries, which pyproject takes from ckptfs.__version__. Asked from another
    directory: a stale ckptfs.egg-info in the checkout must not answer for the install."""
    res = run([str(VENV_BIN / "ckptfs"), "--version"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    probe = "import importlib.metadata as m; print(m.version('ckptfs'))"
    meta = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert meta.returncode == 0, meta.stderr
    assert res.stdout.strip() == f"ckptfs {meta.stdout.strip()}"
    assert meta.stdout.strip() == ckptfs.__version__
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ckptfs.__version__"}
