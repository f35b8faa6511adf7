#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=/etc/ckptfs/slurm/prolog.sh, run by slurmd as root on each
# node of a job before it starts): mount ckptfs for the job. README.md here has the settings.
#
#   job mode (default)  a mount per job at <mount root>/<job id>, its own cache dir, the whole
#                       tree owned by the job's user (--uid/--gid; root mode 0700); unmounted
#                       by the epilog
#   node mode           one mount per node at <mount root>, mounted by the first job's prolog
#                       (serialized by a lock), kept across jobs; each user gets
#                       <mount root>/<user>/ (0700)
#   peers (opt-in)      CKPTFS_SLURM_PEER_SECRET set: --peers, the job's nodes (scontrol show
#                       hostnames) as --peer-seeds, a port per job (README.md "Peers")
#
# Exit 0: mounted (or mounted already: a requeued job, node mode). Exit 1: a bad
# configuration or a failed mount, with one line saying why; Slurm then drains the node and
# requeues the job (a job must not start without the checkpoints it would resume from).
set -uo pipefail
CKPTFS_SLURM_STEP=prolog
# shellcheck source=ckptfs-slurm.sh  # followed: .shellcheckrc here
. "$(dirname "${BASH_SOURCE[0]}")/ckptfs-slurm.sh"

load_config
job_paths
[ -n "${SLURM_JOB_UID:-}" ] || fail 1 "SLURM_JOB_UID is not set: run by slurmd as Prolog"
gid=${SLURM_JOB_GID:-$(id -g "$SLURM_JOB_UID" 2>/dev/null)}
[ -n "$gid" ] || fail 1 "job $SLURM_JOB_ID: no group for uid $SLURM_JOB_UID (SLURM_JOB_GID unset)"

mount_it() {
    if is_ckptfs_mount "$MP"; then
        return 0  # a requeued job's rerun prolog, or node mode's later jobs
    fi
    peer_mount_args  # PEER_ARGS: --peers and the job's nodes as seeds, if configured
    mkdir -p "$MP" "$CKPTFS_SLURM_CACHE_ROOT" "$CKPTFS_SLURM_LOG_DIR" ||
        fail 1 "job $SLURM_JOB_ID: cannot create $MP, $CKPTFS_SLURM_CACHE_ROOT or $CKPTFS_SLURM_LOG_DIR"
    local out rc
    # 9>&-: the daemon must not inherit node mode's lock (it would hold it for good)
    # job mode: the whole tree is the job user's (--uid/--gid: every inode reports that owner,
    # the checkpoints restored from the store included), so a resumed job writes anywhere in it
    local owner=()
    [ "$CKPTFS_SLURM_MODE" = job ] && owner=(--uid "$SLURM_JOB_UID" --gid "$gid")
    # shellcheck disable=SC2086  # CKPTFS_SLURM_OPTIONS: mount options, split at spaces
    out=$("$CKPTFS_BIN" mount "$MP" --store "$CKPTFS_SLURM_STORE" --cache-dir "$CACHE" \
        --log-file "$LOG" "${owner[@]}" "${PEER_ARGS[@]}" ${CKPTFS_SLURM_OPTIONS:-} 2>&1 9>&-)
    rc=$?
    if [ "$rc" -ne 0 ]; then
        [ "$CKPTFS_SLURM_MODE" = job ] && rmdir "$MP" 2>/dev/null
        fail 1 "job $SLURM_JOB_ID: mount of $MP failed (ckptfs exit $rc): ${out#ckptfs: }"
    fi
    say "job $SLURM_JOB_ID: ${out#ckptfs: }"
}

if [ "$CKPTFS_SLURM_MODE" = node ]; then
    mkdir -p "$CKPTFS_SLURM_CACHE_ROOT" || fail 1 "cannot create $CKPTFS_SLURM_CACHE_ROOT"
    exec 9>"$CKPTFS_SLURM_CACHE_ROOT/.prolog.lock" || fail 1 "cannot open the prolog lock"
    # the jobs starting at once on a node: one mounts, the others find it mounted
    flock -w 300 9 || fail 1 "job $SLURM_JOB_ID: another prolog held $CKPTFS_SLURM_CACHE_ROOT/.prolog.lock for 300s"
    mount_it
    exec 9>&-
    userdir=$MP/${SLURM_JOB_USER:-uid-$SLURM_JOB_UID}
    if [ ! -d "$userdir" ]; then
        # shellcheck disable=SC2015  # any step failing fails the prolog
        mkdir "$userdir" && chown "$SLURM_JOB_UID:$gid" "$userdir" && chmod 0700 "$userdir" ||
            fail 1 "job $SLURM_JOB_ID: cannot create $userdir for uid $SLURM_JOB_UID"
    fi
else
    mount_it
    # the mount's root is the job's: its user writes there, nobody else reads it
    # shellcheck disable=SC2015  # any step failing fails the prolog
    chown "$SLURM_JOB_UID:$gid" "$MP" && chmod 0700 "$MP" ||
        fail 1 "job $SLURM_JOB_ID: cannot hand $MP to uid $SLURM_JOB_UID"
fi
exit 0
