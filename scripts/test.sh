#!/usr/bin/env bash
# The README's second command: set up (idempotent) and run the whole test suite.
# With no arguments: the static checks (scripts/lint.sh: ruff, mypy), then the whole suite (FUSE
# passthrough on, wherever it works), then the operations, torch and crash tests again with the
# daemon's own data path (--no-passthrough), so both paths stay correct. Extra arguments go
# to one pytest run instead, e.g.
# `bash scripts/test.sh -k rename -x` (CKPTFS_TEST_DATA_PATH=fuse to run it without passthrough).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then
    exec "$VENV/bin/python" -m pytest "$@"
fi
echo "test.sh: static checks (ruff, mypy)"
bash "$ROOT/scripts/lint.sh"
"$VENV/bin/python" -m pytest
echo "test.sh: the operations, torch and crash tests again with --no-passthrough"
CKPTFS_TEST_DATA_PATH=fuse exec "$VENV/bin/python" -m pytest \
    tests/test_ops.py tests/test_torch.py tests/test_crash.py tests/test_setid.py
