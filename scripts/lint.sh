#!/usr/bin/env bash
# Static checks, configured in pyproject.toml ([tool.ruff.lint], [tool.mypy], [tool.importlinter]):
# ruff on all Python in the repository, mypy on the packages and scripts/ (strict on cachemgr/
# and on the bench and fault harnesses in scripts/), and
# import-linter's contract that each layer of cachemgr/ imports only the layers below it. Uses the tools of the virtual
# environment that scripts/setup.sh installs (the `test` extra pins them). Exit status is non-zero
# on any finding; both tools run so one report shows everything.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPTFS_VENV:-$ROOT/.venv}"
cd "$ROOT"
rc=0
"$VENV/bin/ruff" check ckptfs cachemgr tests scripts || rc=1
"$VENV/bin/mypy" || rc=1
"$VENV/bin/lint-imports" --no-cache || rc=1
exit "$rc"
