#!/usr/bin/env bash
# Idempotent setup for a fresh Debian/Ubuntu machine (run as root, or with sudo available):
# system packages for FUSE and fio, a virtual environment in .venv, and ckptfs installed into it.
# Re-running does only what is missing. Sourced by scripts/main_job.sh and scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPTFS_VENV:-$ROOT/.venv}"

need_pkgs=()
for p in fuse3 libfuse3-dev pkg-config fio python3-venv gcc python3-dev patch debian-archive-keyring logrotate; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need_pkgs+=("$p")
done
# python3-venv / python3-dev are only needed when the python3 on PATH is Debian's own.
if [ "$(command -v python3)" != "/usr/bin/python3" ]; then
    tmp=(); for p in "${need_pkgs[@]}"; do case "$p" in python3-venv|python3-dev) ;; *) tmp+=("$p");; esac; done
    need_pkgs=("${tmp[@]+"${tmp[@]}"}")
fi
if [ "${#need_pkgs[@]}" -gt 0 ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup: installing ${need_pkgs[*]} (apt)"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

stamp="$VENV/.ckptfs-setup"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating virtual environment $VENV"
    python3 -m venv "$VENV"
fi
# The FUSE binding with kernel passthrough (libfuse 3.17 + patched pyfuse3, built once and cached
# in $VENV/native); before the packages, so pip finds pyfuse3 satisfied and builds no other one.
# Never fatal: without it ckptfs runs its user-space data path.
bash "$ROOT/ckptfs/native/build.sh" "$VENV"  # the same as `ckptfs setup-native --venv $VENV`
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "setup: installing Python packages into $VENV (torch==2.13.0 CPU build)"
    "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
    "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test]" 2>&1 | grep -v "^WARNING: Location" || true
    { "$VENV/bin/python" -c "import pyfuse3, trio, torch, boto3, lz4, prometheus_client, rich, pytest, hypothesis, moto, mypy" \
        && "$VENV/bin/ruff" --version >/dev/null; } \
        || { echo "setup: Python packages failed to install" >&2; exit 1; }
    echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
