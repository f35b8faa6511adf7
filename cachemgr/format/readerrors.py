"""The errors of the mount-less readers (cachemgr.format.storeread, restoreto, resumable) and
the exit codes of scripts/ckpt_restore.py they stand for; `ckptfs` maps the classes to its own
codes (ckptfs/storetools.py). Standard library only.

Each error is one line (`str()` joins any line breaks): what a user sees on stderr.
"""

from __future__ import annotations

import os

# Exit codes of scripts/ckpt_restore.py (its docstring); `ckptfs` maps the classes to its own.
EXIT_OK = 0
EXIT_NO_SET = 1
EXIT_USAGE = 2
EXIT_CORRUPT = 3
EXIT_DEST = 4
EXIT_STORE = 5


class RestoreError(Exception):
    """A restore that cannot go on; str() is one line, exit_code what main() exits with."""

    exit_code = EXIT_CORRUPT

    def __str__(self) -> str:
        return " ".join(super().__str__().splitlines())


class NoSuchSet(RestoreError):
    exit_code = EXIT_NO_SET


class UsageError(RestoreError):
    exit_code = EXIT_USAGE


class CorruptError(RestoreError):
    """Invalid or corrupt data in the store."""
    exit_code = EXIT_CORRUPT


class DestinationError(RestoreError):
    exit_code = EXIT_DEST


class StoreError(RestoreError):
    exit_code = EXIT_STORE


def show(b: bytes | str) -> str:
    """A name for a one-line message."""
    return repr(os.fsdecode(b) if isinstance(b, bytes) else b)

