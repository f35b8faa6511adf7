#!/usr/bin/env bash
# The README's second command: set up (idempotent) and run the whole test suite.
# With no arguments: the static checks (scripts/lint.sh: ruff, mypy), then the whole suite (FUSE
# passthrough on, wherever it works), then the operations, torch and crash tests again with the
# daemon's own data path (--no-passthrough), so both paths stay correct, then the store-facing
# tests (marker `s3`) again against a one-node Ceph RGW (scripts/rgw.sh) instead of moto, so
# what a real S3 server does differently is found here (docs/STORES.md). Extra arguments go
# to one pytest run instead, e.g.
# `bash scripts/test.sh -k rename -x` (CKPTFS_TEST_DATA_PATH=fuse to run it without passthrough).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
if [ "$#" -gt 0 ]; then
    exec "$VENV/bin/python" -m pytest "$@"
fi
# Ceph RGW for the store conformance suite and the RGW pass (apt, once; ~250 MB).
bash "$ROOT/scripts/rgw.sh" install
echo "test.sh: static checks (ruff, mypy)"
bash "$ROOT/scripts/lint.sh"
"$VENV/bin/python" -m pytest
echo "test.sh: the operations, torch and crash tests again with --no-passthrough"
CKPTFS_TEST_DATA_PATH=fuse "$VENV/bin/python" -m pytest \
    tests/test_ops.py tests/test_torch.py tests/test_crash.py tests/test_setid.py
echo "test.sh: the store-facing tests (marked s3) again on a real S3 server, Ceph RGW"
CKPTFS_TEST_S3=rgw exec "$VENV/bin/python" -m pytest -m s3
