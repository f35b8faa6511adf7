"""The tests' hooks in a ckptfs daemon, injected through its composition root.

tests/conftest.py puts this directory on PYTHONPATH, so every Python process the tests start
imports this module at startup. In a process whose environment asks for them, it sets
`ckptfs.daemon.INJECTED` before the daemon starts; ckptfs itself reads neither variable:

  CKPTFS_FAULTS="put=every:3,upload_part=next:5,get=every:4"
      the object store is wrapped in a FaultyStore (cachemgr.store.wrappers) that fails those
      calls with a transient 503/500 (every k-th call, or the next n calls), below the retry
      layer, so tests can show that throttling loses nothing; `put@data/=hold:/tmp/gate` makes
      PUTs of keys under data/ wait while /tmp/gate exists.
  CKPTFS_TEST_HOLD_FILL=<gate path>
      a restore fill's worker thread waits while the gate file exists (after creating
      `<gate>.held`), so a test can run FUSE operations while a fill is in flight and then
      release it.
"""

from __future__ import annotations

import logging
import os
import time


def faulty_store(spec: str):
    """A `wrap_store` for the CKPTFS_FAULTS `spec` (see the module docstring)."""
    from cachemgr.store import FaultyStore

    def wrap(store):
        faulty = FaultyStore(store)
        for item in spec.split(","):
            op, _, rule = item.strip().partition("=")
            op, _, prefix = op.partition("@")
            kind, _, n = rule.partition(":")
            if kind == "every":
                faulty.fail_every(op, int(n))
            elif kind == "next":
                faulty.fail_next(op, int(n))
            elif kind == "hold":
                faulty.hold(op, n, prefix)
            else:
                raise ValueError(f"bad CKPTFS_FAULTS item {item!r}")
        logging.getLogger("ckptfs.daemon").warning("fault injection active: %s", spec)
        return faulty
    return wrap


def hold_fill(gate: str):
    """A `before_fill` that waits while `gate` exists (in the fill's worker thread)."""
    def wait() -> None:
        if not os.path.exists(gate):
            return
        try:
            with open(gate + ".held", "w"):
                pass
        except OSError:
            pass
        while os.path.exists(gate):
            time.sleep(0.01)
    return wait


def _inject() -> None:
    faults = os.environ.get("CKPTFS_FAULTS") or None
    gate = os.environ.get("CKPTFS_TEST_HOLD_FILL") or None
    if faults is None and gate is None:
        return
    from ckptfs import daemon

    daemon.INJECTED = daemon.Injected(
        wrap_store=faulty_store(faults) if faults else None,
        before_fill=hold_fill(gate) if gate else None)


_inject()
