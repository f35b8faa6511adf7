"""The layers of cachemgr/ are enforced: scripts/lint.sh runs import-linter's contract
(pyproject.toml `[tool.importlinter]`), which fails a change that imports against them.

Run on a copy of the packages, so the check of a bad import never touches the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} missing: scripts/setup.sh installs the test extra")
    for pkg in ("ckptfs", "cachemgr"):
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.mark.parametrize(("module", "bad", "message"), [
    ("cachemgr/core/hooks.py", "from cachemgr.tiering import commit",
     "cachemgr.core is not allowed to import cachemgr.tiering"),
    ("cachemgr/store/base.py", "from cachemgr.format import keys",
     "cachemgr.store is not allowed to import cachemgr.format"),
    ("cachemgr/core/fs.py", "from cachemgr.transfer import upload",
     "cachemgr.core is not allowed to import cachemgr.transfer"),
    ("cachemgr/host/foreground.py", "import ckptfs.fuse",
     "cachemgr.host is not allowed to import ckptfs"),
    # restore never imports tiering (its own contract, beside the layers), nor tiering
    # restore: the two are siblings, which only the engine composes
    ("cachemgr/restore/wholefile.py", "from cachemgr.tiering import space",
     "cachemgr.restore is not allowed to import cachemgr.tiering"),
    ("cachemgr/tiering/space.py", "from cachemgr.restore import fetch",
     "cachemgr.tiering is not allowed to import cachemgr.restore"),
    ("cachemgr/tiering/uploadqueue.py", "from cachemgr import engine",
     "cachemgr.tiering is not allowed to import cachemgr.engine"),
    # peer knows no replicas: the transport imports none of the services above it
    ("cachemgr/peer/server.py", "from cachemgr.tiering import replicaproto",
     "cachemgr.peer is not allowed to import cachemgr.tiering"),
    ("cachemgr/peer/client.py", "from cachemgr.restore import chunkfetch",
     "cachemgr.peer is not allowed to import cachemgr.restore"),
    ("cachemgr/peer/proto.py", "from cachemgr.core import sets",
     "cachemgr.peer is not allowed to import cachemgr.core"),
])
def test_an_import_against_the_layers_fails_the_contract(copy, module, bad, message):
    assert lint_imports(copy).returncode == 0  # the copy as it is keeps the contract
    with open(copy / module, "a") as f:
        f.write(f"\n{bad}  # noqa\n")
    res = lint_imports(copy)
    assert res.returncode != 0
    assert message in res.stdout, res.stdout[-2000:]


def test_the_peer_transport_names_no_replica():
    """"peer knows no replicas" beyond its imports: no module of cachemgr/peer names them (a
    route that means a replica is tiering's, cachemgr.tiering.replicaproto, handed to the
    server by the engine)."""
    hits = [f"{p.name}:{i}" for p in sorted((REPO / "cachemgr" / "peer").glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if "replica" in line.lower()]
    assert hits == []
