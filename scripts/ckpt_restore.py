#!/usr/bin/env python3
"""Restore a checkpoint from a ckptfs store without ckptfs: manifests, objects, lz4 frames and
CRC32C, exactly as docs/FORMAT.md describes (needs only boto3 for s3://, lz4 and crc32c, and
the modules of this checkout listed in MODULES below, which need nothing else: no trio, nothing
of ckptfs).

    python scripts/ckpt_restore.py list    file:///var/lib/ckptfs/store
    python scripts/ckpt_restore.py restore s3://bucket/prefix ckpt/step_100 ./restored \\
        [--endpoint-url URL]

Nothing read from the store is trusted. Every manifest passes cachemgr.format.validate (the rules
ckptfs itself reads the store with) before it is used; `list` reports an invalid one on stderr
in one line and goes on. Every object is streamed to its file a few MiB at a time (lz4 frame by
frame, each frame bounded by its raw length), its size, CRC32C and chunk CRC32Cs checked as it
arrives. A set is built under a temporary name next to its target with file-descriptor-relative
calls that never follow a symlink (neither one the manifest makes, nor one already in DEST) and
renamed into place only when every file checked out; on any error nothing is left at the target.
The target DEST/<set path> must not exist (a directory set may replace an empty directory);
ckpt_restore never overwrites or merges. DEST itself is taken as given (created if missing);
directories between DEST and the target are created as needed and must be real directories,
not symlinks. Symlinks of the set are created last, as links (their targets may be absolute or
hold '..'; they are never followed). Permission bits come from the manifest, masked by the
validator (never setuid, setgid, sticky or world-writable).

Exit codes (one line on stderr for each failure, never a traceback; the same under python -O):
  0  done
  1  no such set in the store
  2  usage: bad arguments, an unsupported store URL, a SET_PATH that is not a set path
  3  invalid or corrupt data in the store: a manifest that fails validation (or is bigger than
     cachemgr.format.validate.MAX_DOCUMENT_BYTES), an object missing, of the wrong size, failing its
     CRC32C (whole or per chunk), or an lz4 frame that is not exactly its raw length
  4  the destination: the target exists, a symlink or a file is in the way, a write failed
  5  the store cannot be read (I/O error, network, permissions; boto3 missing for s3://)

The implementation is cachemgr/format/storeread.py (manifests, objects) over
cachemgr/format/decode.py (the one decoder of stored objects, also the mount's) and
cachemgr/format/restoreto.py (the destination), shared with `ckptfs restore` (which adds
parallel ranged reads, resuming and a progress bar, and reads the store as the mount does). This
file is its plain command line: it keeps working without ckptfs installed, from a copy of this file
and the modules in MODULES. The tests and the main job use the same functions (re-exported here)
to check what ckptfs published.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# The modules this script runs on, relative to the checkout: the standard library, lz4 and
# crc32c are all they need (no trio; boto3 only for s3://). A copy of this file beside exactly
# these runs (tests/test_ckpt_restore.py copies this list). This checkout's copy is used when
# ckptfs is not installed (and when it is installed in editable mode from elsewhere: an entry of
# sys.path comes before the editable finder); a regular install comes first.
MODULES = [
    "cachemgr/__init__.py",
    "cachemgr/format/__init__.py",
    "cachemgr/format/names.py",          # path escaping
    "cachemgr/format/keys.py",           # the key layout
    "cachemgr/format/validate.py",       # every document checked before use
    "cachemgr/format/readerrors.py",     # the errors and their exit codes
    "cachemgr/format/decode.py",         # the one decoder of stored objects
    "cachemgr/format/views.py",          # file:// and s3:// store views
    "cachemgr/format/storeread.py",      # manifests and objects
    "cachemgr/format/restoreto.py",      # the atomic restore into DEST
]
_REPO = Path(__file__).resolve().parent.parent
if all((_REPO / m).is_file() for m in MODULES) and str(_REPO) not in sys.path:
    sys.path.append(str(_REPO))
from collections.abc import Callable

from cachemgr.format import storeread
from cachemgr.format.names import unescape_name, unescape_path
from cachemgr.format.readerrors import (
    EXIT_CORRUPT,
    EXIT_DEST,
    EXIT_NO_SET,
    EXIT_OK,
    EXIT_STORE,
    EXIT_USAGE,
    CorruptError,
    DestinationError,
    NoSuchSet,
    RestoreError,
    StoreError,
    UsageError,
)
from cachemgr.format.restoreto import restore_to
from cachemgr.format.storeread import Manifest, decode, find_set, load_manifest, restore
from cachemgr.format.views import FileStoreView, S3StoreView, StoreView, open_view

# What the tests, the fault loop and train_demo import from here.
__all__ = [
    "EXIT_CORRUPT", "EXIT_DEST", "EXIT_NO_SET", "EXIT_OK", "EXIT_STORE", "EXIT_USAGE",
    "MODULES", "CorruptError", "DestinationError", "FileStoreView", "NoSuchSet", "RestoreError",
    "S3StoreView", "StoreError", "UsageError", "decode", "find_set", "load_manifest", "main",
    "manifests", "open_view", "restore", "restore_to", "unescape_name", "unescape_path",
]


def _warn(msg: str) -> None:
    print(f"ckpt_restore: skipped {msg}", file=sys.stderr)


def manifests(view: StoreView, on_error: Callable[[str], None] = _warn) -> dict[str, Manifest]:
    """storeread.manifests, reporting each invalid manifest on stderr (one line)."""
    return storeread.manifests(view, on_error)


def _show(b: bytes) -> str:
    return repr(os.fsdecode(b))


# -- the command line --------------------------------------------------------------------------

def _run(a: argparse.Namespace) -> int:
    view = open_view(a.store, a.endpoint_url)
    if a.cmd == "list":
        for path, m in sorted(manifests(view).items()):
            print(f"{m['kind']:<8} {m['total_bytes']:>14}  {path}")
        return EXIT_OK
    m = find_set(view, a.set_path)
    out = restore_to(view, m, a.dest)
    # The escaped form and repr(): stdout may not take the bytes of a name (strict UTF-8).
    print(f"restored {m['path']} to {_show(os.fsencode(out))} (every CRC32C checked)")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="exit codes: 0 done, 1 no such set, 2 usage, 3 invalid or corrupt data in the "
               "store, 4 destination refused or not writable, 5 store unreadable",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="list the published sets (invalid manifests: stderr)")
    ls.add_argument("store")
    r = sub.add_parser("restore", help="restore one set into a directory")
    r.add_argument("store")
    r.add_argument("set_path")
    r.add_argument("dest", type=Path)
    for q in (ls, r):
        q.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL"))
    a = p.parse_args(argv)  # exits 2 on bad arguments
    try:
        return _run(a)
    except RestoreError as e:
        print(f"ckpt_restore: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("ckpt_restore: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
