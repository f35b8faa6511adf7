"""The tests' hooks in a ckptfs daemon, patched in from outside before it starts.

tests/conftest.py puts this directory on PYTHONPATH, so every Python process the tests start
imports this module at startup. In a process whose environment asks for them, it wraps two
functions of ckptfs, which looks both up when it uses them; ckptfs itself reads neither variable
and holds no hook for them:

  CKPTFS_FAULTS="put=every:3,upload_part=next:5,get=every:4"
      `ckptfs.daemon.open_backend` (the store a mount's URL names, the bottom of its store
      stack) returns that store wrapped in a FaultyStore (tests/faultstore.py) that fails those
      calls with a transient 503/500 (every k-th call, or the next n calls), below the retry
      layer the daemon puts over it, so tests can show that throttling loses nothing;
      `put@data/=hold:/tmp/gate` makes PUTs of keys under data/ wait while /tmp/gate exists.
  CKPTFS_TEST_HOLD_FILL=<gate path>
      `cachemgr.core.filecache.write_fill` (a restore fill's writes, in its worker thread, the
      file's lock held) first waits while the gate file exists (after creating `<gate>.held`),
      so a test can run FUSE operations while a fill is in flight and then release it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from pathlib import Path


def _faultstore():
    """tests/faultstore.py, loaded by its path: a daemon's sys.path need not hold the tests."""
    name = "faultstore"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parent.parent / "faultstore.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def faulty_store(spec: str):
    """A wrapper of a store opener that applies the CKPTFS_FAULTS `spec` (see the module
    docstring) to the store it opens."""
    faulty_store_class = _faultstore().FaultyStore

    def wrap(store):
        faulty = faulty_store_class(store)
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

    def opener(open_store):
        def open_faulty(*args, **kw):
            return wrap(open_store(*args, **kw))
        return open_faulty
    return opener


def hold_fill(gate: str):
    """A wrapper of a fill's writer that first waits while `gate` exists (in the fill's worker
    thread, before it writes)."""
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

    def held(write):
        def write_held(*args, **kw):
            wait()
            return write(*args, **kw)
        return write_held
    return held


def _inject() -> None:
    faults = os.environ.get("CKPTFS_FAULTS") or None
    gate = os.environ.get("CKPTFS_TEST_HOLD_FILL") or None
    if faults is not None:
        from ckptfs import daemon

        daemon.open_backend = faulty_store(faults)(daemon.open_backend)
    if gate is not None:
        from cachemgr.core import filecache

        filecache.write_fill = hold_fill(gate)(filecache.write_fill)


_inject()
