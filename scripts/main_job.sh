#!/usr/bin/env bash
# The README's main job: set up everything (idempotent: apt packages, .venv, ckptfs, torch CPU),
# then run the demo (scripts/train_demo.py): a training run checkpointing into ckptfs is killed
# with SIGKILL and resumes bit-exactly from its torch.save and DCP checkpoints; the ckptfs
# daemon itself is killed with SIGKILL and every checkpoint is verified after a remount; every
# checkpoint becomes durable in the object store; a new "node" with an empty cache on the same
# store sees them all and resumes training from the store bit-exactly.
# Prints each step; exit status 0 only if every check passed. Takes about a minute.
#
# Options (passed to scripts/train_demo.py): --work DIR (default <repo>/demo-work, wiped at
# start), --steps N, --every N, --kill-at STEP.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

WORK="$ROOT/demo-work"
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --work) [ $# -ge 2 ] || { echo "main_job: --work needs a directory" >&2; exit 2; }
                WORK="$(realpath -m "$2")"; shift 2 ;;
        --work=*) WORK="$(realpath -m "${1#--work=}")"; shift ;;
        *) args+=("$1"); shift ;;
    esac
done

source "$ROOT/scripts/setup.sh"

# Belt and braces: the driver unmounts in its own `finally`; this catches a driver that was
# itself killed, so a run never leaves its mount behind.
cleanup() {
    for mnt in "$WORK/node2-mnt" "$WORK/mnt"; do
        if grep -q " $mnt " /proc/self/mountinfo 2>/dev/null; then
            "$VENV/bin/ckptfs" umount --no-wait "$mnt" >/dev/null 2>&1 \
                || fusermount3 -u -z "$mnt" 2>/dev/null || true
        fi
    done
}
trap cleanup EXIT

"$VENV/bin/python" "$ROOT/scripts/train_demo.py" demo --work "$WORK" "${args[@]+"${args[@]}"}"
