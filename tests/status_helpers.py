"""`ckptfs status MOUNTPOINT --json` run as the command, its JSON (tests/mount/test_status.py,
test_unsaved.py).
"""

import json

from tests.conftest import run_cli


def status(m) -> dict:
    res = run_cli("status", str(m.path), "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)
