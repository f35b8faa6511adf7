"""Where the file:// store (cachemgr/store/local.py) keeps an object's sidecar
(tests/stores/test_localstore_trust.py, tests/mount/test_localstore_trust_mount.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def sidecar(root: Path, key: str) -> Path:
    h = hashlib.sha1(key.encode()).hexdigest()
    return root / "meta" / h[:2] / f"{h}.json"
