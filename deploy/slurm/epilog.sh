#!/usr/bin/env bash
# Slurm Epilog (slurm.conf: Epilog=/etc/ckptfs/slurm/epilog.sh, run by slurmd as root on each
# node once the job's processes are gone): make what the job saved durable in the store,
# within a bound, then (job mode) unmount and remove the job's cache. README.md here.
#
# The drain: `ckptfs wait <dir> --timeout CKPTFS_SLURM_DRAIN_TIMEOUT` (the job's mount, or in
# node mode the user's directory), answered by the daemon when its sets are durable.
# Exit 0: every set the job committed is in the store (job mode: unmounted, cache removed
#         unless CKPTFS_SLURM_KEEP_CACHE=1), or nothing was mounted.
# Not drained in time (the store is down or slow, or a set failed for good): one line says how
#         many bytes in how many sets are only in this node's cache, and where. Job mode
#         unmounts anyway and KEEPS the cache dir (the pending uploads resume when it is
#         mounted again: README.md "Recovering a kept cache"). Then
#         CKPTFS_SLURM_ON_RISK=drain (default): exit 1, so Slurm drains the node: its disk
#           holds the only copy of a checkpoint, and it must not be reimaged or handed to the
#           next job before someone resumes the uploads. Where scontrol exists, the node's
#           reason says what is at risk.
#         CKPTFS_SLURM_ON_RISK=keep: exit 0 (the node keeps taking jobs; the kept cache waits for
#           a sweep). For sites whose store outages would otherwise drain every node at once.
# Exit 1 also when the unmount fails (a process of the job survived and holds files open).
set -uo pipefail
CKPTFS_SLURM_STEP=epilog
# shellcheck source=ckptfs-slurm.sh  # followed: .shellcheckrc here
. "$(dirname "${BASH_SOURCE[0]}")/ckptfs-slurm.sh"

load_config
job_paths
if ! is_ckptfs_mount "$MP"; then
    [ "$CKPTFS_SLURM_MODE" = job ] && rmdir "$MP" 2>/dev/null
    exit 0  # the prolog did not mount (it failed, or ckptfs is not used on this node)
fi
target=$MP
[ "$CKPTFS_SLURM_MODE" = node ] && target=$MP/${SLURM_JOB_USER:-uid-${SLURM_JOB_UID:-?}}

# at_risk: "BYTES SETS PENDING FAILED" from `ckptfs status --json` (mount-wide): committed
# sets this node can still finish and failed ones, i.e. what is only in this cache.
at_risk() {
    "$CKPTFS_BIN" status "$MP" --json 2>/dev/null | "$CKPTFS_SLURM_PYTHON" -c '
import json, sys
t = json.load(sys.stdin)["tiering"]
pending = t["pending_sets"] - t.get("waiting_sets", 0)
print(t["pending_bytes"] + t.get("failed_bytes", 0), pending + t.get("failed_sets", 0),
      pending, t.get("failed_sets", 0))'
}

human() {
    awk -v n="$1" 'BEGIN { split("B KiB MiB GiB TiB", u); i = 1
        while (n >= 1024 && i < 5) { n /= 1024; i++ }
        printf(i == 1 ? "%d %s" : "%.1f %s", n, u[i]) }'
}

started=$(date +%s)
out=$("$CKPTFS_BIN" wait "$target" --timeout "$CKPTFS_SLURM_DRAIN_TIMEOUT" 2>&1)
rc=$?
drained=1
case $rc in
    0) ;;
    8)  # no committed set under it, or a file in none (a *.tmp a killed save left):
        # neither is an upload to wait for. Job mode: what is still pending in the mount
        # decides; node mode: the mount's pending sets are other jobs' too, not this one's
        if [ "$CKPTFS_SLURM_MODE" = job ]; then
            risk=$(at_risk) || risk="? ? ? ?"
            [ "${risk%% *}" = 0 ] || drained=0
        fi ;;
    *) drained=0 ;;
esac
if [ "$drained" = 0 ]; then
    risk=$(at_risk) || risk=""
    read -r bytes sets pending failed <<<"${risk:-? ? ? ?}"
    took=$(($(date +%s) - started))
    reason="${out#ckptfs: }"
    if [ "$bytes" = "?" ]; then
        risk_text="an unknown amount (ckptfs status failed)"
    else
        risk_text="$(human "$bytes") in $sets set(s) ($pending pending, $failed failed)"
    fi
    say "job $SLURM_JOB_ID on ${SLURMD_NODENAME:-$(hostname)}: drain of $target not finished" \
        "within ${CKPTFS_SLURM_DRAIN_TIMEOUT}s (after ${took}s: $reason): $risk_text NOT in the" \
        "store, only in the cache $CACHE (log $LOG)"
fi

if [ "$CKPTFS_SLURM_MODE" = job ]; then
    # drained: nothing left to wait for; not drained: the cache keeps it for a later mount
    uout=$("$CKPTFS_BIN" umount "$MP" --no-wait 2>&1)
    urc=$?
    if [ "$urc" -eq 12 ]; then
        # unmounted, but files in no committed set are only in the cache: keep it, say so
        say "job $SLURM_JOB_ID: ${uout#ckptfs: } (cache $CACHE kept)"
        drained=0
        risk_text="files in no committed set"
    elif [ "$urc" -ne 0 ]; then
        fail 1 "job $SLURM_JOB_ID: unmount of $MP failed (ckptfs exit $urc): ${uout#ckptfs: }"
    fi
    rmdir "$MP" 2>/dev/null
    if [ "$drained" = 1 ]; then
        [ "$CKPTFS_SLURM_KEEP_CACHE" = 1 ] || rm -rf -- "$CACHE"
        say "job $SLURM_JOB_ID: every set durable in $CKPTFS_SLURM_STORE; unmounted $MP"
    fi
elif [ "$drained" = 1 ]; then
    say "job $SLURM_JOB_ID: every set under $target durable in $CKPTFS_SLURM_STORE"
fi

if [ "$drained" = 0 ] && [ "$CKPTFS_SLURM_ON_RISK" = drain ]; then
    if command -v scontrol >/dev/null 2>&1 && [ -n "${SLURMD_NODENAME:-}" ]; then
        scontrol update NodeName="$SLURMD_NODENAME" State=DRAIN \
            Reason="ckptfs: job $SLURM_JOB_ID left ${risk_text%% (*} only in $CACHE" >/dev/null 2>&1
    fi
    exit 1
fi
exit 0
