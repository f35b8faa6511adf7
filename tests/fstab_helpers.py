"""The fstab and systemd tests' helpers (tests/unit/test_fstab.py, tests/mount/test_fstab_mount.py):
the paths of the whole machine they need, installed for them if absent (`helper`: the symlink
/sbin/mount.fuse.ckptfs -> <venv>/bin/mount.fuse.ckptfs; `cli_link`: /usr/local/bin/ckptfs),
and the ckptfs@.service unit as systemd reads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptfs.mount import pid_running as _alive
from tests.conftest import IN_CI, REPO, require_fuse

VENV_BIN = Path(sys.executable).parent
HELPER = Path("/sbin/mount.fuse.ckptfs")
CLI_LINK = Path("/usr/local/bin/ckptfs")
# HELPER and CLI_LINK are paths of the whole machine, used by the fstab tests on every xdist
# worker at once (`xdist_group` + `--dist loadgroup` no longer keep them on one worker under
# pytest 9: one worker's teardown removed /usr/local/bin/ckptfs while another's test ran its
# unit's ExecStop). So their users are counted across processes (`_link`).
USERS_DIR = Path(tempfile.gettempdir()) / "ckptfs-test-system-paths"
UNIT = REPO / "scripts" / "systemd" / "ckptfs@.service"


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
