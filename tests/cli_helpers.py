"""The command-line tests' helpers (tests/unit/test_cli.py, test_cli_conventions.py,
test_access.py and their mount halves in tests/mount): a failure's one line on stderr
(`one_line_error`), a mount through the CLI on a store of the test's own, a refused call's errno.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from tests.conftest import _alive, is_mounted, run_cli, wait_for


def one_line_error(res: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Assert `res` failed with `code` and exactly one `ckptfs: ` line on stderr containing every
    needle; return that line."""
    lines = res.stderr.splitlines()
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert len(lines) == 1, f"stderr is not one line: {res.stderr!r}"
    line = lines[0]
    assert line.startswith("ckptfs: "), line
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    for n in needles:
        assert n in line, f"{n!r} not in {line!r}"
    assert res.stdout == "", f"unexpected stdout on failure: {res.stdout!r}"
    return line


def _undo_mount(res: subprocess.CompletedProcess, mp: Path) -> None:
    """A mount that a test expected to be refused happened (the bug under test): take it down
    without going through it (the daemon may be stuck on its own mount): kill -9 the daemon,
    then a lazy unmount."""
    import re

    if not is_mounted(mp):
        return
    m = re.search(r"pid (\d+)", res.stdout)
    if m and _alive(int(m.group(1))):
        os.kill(int(m.group(1)), signal.SIGKILL)
        wait_for(lambda: not _alive(int(m.group(1))), what="daemon to die")
    subprocess.run(["fusermount3", "-u", "-z", str(mp)], capture_output=True, check=False)


def store_opt(tmp_path: Path) -> list[str]:
    """A file:// store of the test's own (not the user's shared embedded default)."""
    return ["--store", f"file://{tmp_path / 'store'}"]


def mount_cli(mp: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli("mount", str(mp), "--cache-dir", str(cache),
                   *store_opt(mp.parent), *extra)


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` with its content (None for directories)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def _refused(op, *args) -> int:
    try:
        op(*args)
    except OSError as e:
        return e.errno
    return 0
