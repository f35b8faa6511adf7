"""`ckptfs status` of a path that is not mounted: exit 3 and one line (the status of real mounts:
tests/mount/test_status.py)."""

from tests.conftest import run_cli


def test_status_of_unmounted_path_fails_with_code_3(tmp_path):
    res = run_cli("status", str(tmp_path))
    assert res.returncode == 3
    assert res.stderr.startswith("ckptfs: ") and len(res.stderr.strip().splitlines()) == 1
