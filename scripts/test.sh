#!/usr/bin/env bash
# The README's second command: set up (idempotent) and run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k rename -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
