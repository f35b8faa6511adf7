"""The store tools tests' helpers (tests/mount/test_storetools.py,
tests/unit/test_storetools_unit.py): node ids and objects planted in a file:// store by hand, and
a failure's one line on stderr.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

DEAD, LIVE = "deadbeef", "a1b2c3d4"  # node ids planted in the store (the mount's is random)


def one_line(err: str) -> bool:
    return err.count("\n") == 1 and err.startswith("ckptfs: ") and "Traceback" not in err


def put(store_dir: Path, key: str, data: bytes, age: float = 0.0) -> None:
    """Plant object `key` in a file:// store, `age` seconds old (its mtime is LastModified)."""
    p = store_dir / "objects" / key
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    if age:
        t = time.time() - age
        os.utime(p, (t, t))
