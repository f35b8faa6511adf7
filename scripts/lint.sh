#!/usr/bin/env bash
# Static checks, configured in pyproject.toml ([tool.ruff.lint], [tool.mypy], [tool.importlinter]):
#   ruff          all Python in the repository
#   mypy          ckptfs/ (the default checks), cachemgr/ and every script in scripts/ (strict)
#   lint-imports  each layer of cachemgr/ imports only the layers below it
#   sizes.py      modules <= 1000, classes <= 400, functions <= 120 code lines in ckptfs/,
#                 cachemgr/ and scripts/ (scripts/sizes.py says what counts)
# Uses the tools of the virtual environment that scripts/setup.sh installs (the `test` extra pins
# them). Exit status is non-zero on any finding; every check runs so one report shows everything.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPTFS_VENV:-$ROOT/.venv}"
cd "$ROOT"
rc=0
"$VENV/bin/ruff" check ckptfs cachemgr tests scripts || rc=1
"$VENV/bin/mypy" || rc=1
"$VENV/bin/lint-imports" --no-cache || rc=1
"$VENV/bin/python" scripts/sizes.py ckptfs cachemgr scripts || rc=1
exit "$rc"
