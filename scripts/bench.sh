#!/usr/bin/env bash
# One command for the performance numbers of docs/PERFORMANCE.md:
#   bash scripts/bench.sh --quick     # < 5 minutes: 256 MiB per workload, 1 repeat
#   bash scripts/bench.sh [--full]    # the write-path overhead on RAM-backed ext4 (7 rounds),
#                                     # then fio 1 GiB, 512 MiB checkpoints, 3 repeats (~35 min)
# Extra arguments go to scripts/bench_perf.py (see its --help), e.g. --no-docs.
# Installs what it needs first, idempotently: scripts/setup.sh (FUSE, fio, the venv, ckptfs),
# apt packages s3fs and rclone (the FUSE peers), and the `bench` extra of pyproject.toml
# (matplotlib, s3torchconnector, py-spy) with torch kept at 2.13.0. Needs root.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
VENV="${CKPTFS_VENV:-$ROOT/.venv}"

need=()
for p in s3fs rclone fio; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ "${#need[@]}" -gt 0 ]; then
    echo "bench: installing ${need[*]} (apt)"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    # a failure here is not fatal: the harness reports the peer as not available, with why
    { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; } ||
        echo "bench: apt-get install ${need[*]} failed; those peers will be reported as not available"
fi

stamp="$VENV/.ckptfs-bench"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "bench: installing the bench extra (matplotlib, s3torchconnector, py-spy; torch stays 2.13.0)"
    # torch==2.13.0 on the same command line: pip may never replace the CPU build
    "$VENV/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" -e "$ROOT[bench]" 2>&1 \
        | grep -v "^WARNING: Location" || true
    "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
        || { echo "bench: torch is no longer 2.13.0" >&2; exit 1; }
    "$VENV/bin/python" -c "import matplotlib" && echo "$want" > "$stamp" || true
fi

cd "$ROOT"
# --full (the default) first measures the write path's own overhead on a RAM-backed ext4
# (scripts/bench_overhead.py, ~15 minutes): docs/bench/overhead.json, a section of
# docs/PERFORMANCE.md. Not with --quick, --no-docs or --sections.
case " $* " in
    *" --quick "*|*" --no-docs "*|*" --sections "*) ;;
    *) "$VENV/bin/python" "$ROOT/scripts/bench_overhead.py" --rounds 7 \
           --json "$ROOT/docs/bench/overhead.json" ;;
esac
exec "$VENV/bin/python" "$ROOT/scripts/bench_perf.py" "$@"
