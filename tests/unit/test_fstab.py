"""fstab and systemd: the -o mapping of mount(8)'s helper /sbin/mount.fuse.ckptfs, its refusals,
and the ckptfs@.service unit as systemd reads it. ckptfs mounted by mount(8) through the helper,
unmounted by umount(8), and the unit's own command lines run for real:
tests/mount/test_fstab_mount.py.

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
import sys
import tomllib
from pathlib import Path

import pytest

import ckptfs
from ckptfs.cli import mount_parser
from ckptfs.mount import EXIT_USAGE, READY_TIMEOUT_S
from ckptfs.mounthelper import IGNORED, mount_options, translate
from tests.conftest import REPO, is_mounted
from tests.fstab_helpers import (
    UNIT,
    VENV_BIN,
    cli_link,
    escape_path,
    helper,
    parse_env_file,
    parse_unit,
    run,
)

__all__ = ["cli_link", "helper"]  # the fixtures, imported for these tests


EXAMPLE_CONF = REPO / "scripts" / "systemd" / "ckptfs.conf.example"


def one_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfs: "), res.stderr
    return lines[0]


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


def test_unknown_option_through_mount8_exits_2(helper, tmp_path):
    mp = tmp_path / "mnt"
    mp.mkdir()
    res = run(["mount", "-t", "fuse.ckptfs", f"file://{tmp_path}/s", str(mp), "-o",
               f"cache_dir={tmp_path}/c,_netdev,bogus"])
    assert res.returncode == EXIT_USAGE, res.stderr
    assert "unknown mount option 'bogus'" in one_line(res)
    assert not is_mounted(mp) and not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------------------------
# systemd: scripts/systemd/ckptfs@.service


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
