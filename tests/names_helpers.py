"""JSON parsed as a strict parser would (a lone surrogate refused): the documents of the non-UTF-8
names tests (tests/unit/test_names.py, tests/mount/test_names_mount.py).
"""

from __future__ import annotations

import json


def _strict(data: bytes) -> dict:
    """Parse like a strict JSON parser: a lone surrogate (\\udcXX) is refused."""
    doc = json.loads(data.decode("utf-8"))

    def walk(x):
        if isinstance(x, str):
            x.encode("utf-8")
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(doc)
    return doc
