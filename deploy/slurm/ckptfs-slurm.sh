# Shared by prolog.sh and epilog.sh (sourced, not run): configuration and the job's paths.
# README.md here says what each setting means and when each script fails.

CKPTFS_SLURM_TAG="ckptfs-slurm ${CKPTFS_SLURM_STEP:-?}"

# say LINE: one line to stdout (Slurm keeps it where it keeps prolog/epilog output) and, where
# logger(1) exists, to syslog/the journal (journalctl -t ckptfs-slurm).
say() {
    printf '%s: %s\n' "$CKPTFS_SLURM_TAG" "$*"
    if command -v logger >/dev/null 2>&1; then
        logger -t ckptfs-slurm -- "$*" 2>/dev/null || true
    fi
}

# fail CODE LINE: say it on stderr too, and exit CODE.
fail() {
    local code=$1
    shift
    printf '%s: %s\n' "$CKPTFS_SLURM_TAG" "$*" >&2
    if command -v logger >/dev/null 2>&1; then
        logger -t ckptfs-slurm -p user.err -- "$*" 2>/dev/null || true
    fi
    exit "$code"
}

# load_config: KEY=VALUE lines of $CKPTFS_SLURM_CONF (default /etc/ckptfs/slurm.conf; a
# missing file is fine when the environment sets what is needed). Only CKPTFS_* and AWS_*
# keys, no shell: the file is read, never sourced. The environment wins over the file.
load_config() {
    local conf=${CKPTFS_SLURM_CONF:-/etc/ckptfs/slurm.conf} line key value n=0
    if [ -e "$conf" ]; then
        [ -r "$conf" ] || fail 1 "cannot read $conf"
        while IFS= read -r line || [ -n "$line" ]; do
            n=$((n + 1))
            line=${line#"${line%%[![:space:]]*}"}
            case $line in '' | '#'*) continue ;; esac
            key=${line%%=*}
            value=${line#*=}
            case $key in
                CKPTFS_[A-Z0-9_]* | AWS_[A-Z0-9_]*) ;;
                *) fail 1 "$conf line $n: expected CKPTFS_*=VALUE or AWS_*=VALUE, got '$line'" ;;
            esac
            case $key in *[!A-Z0-9_]*) fail 1 "$conf line $n: bad key '$key'" ;; esac
            value=${value%\"}
            value=${value#\"}
            if [ -z "${!key+set}" ]; then
                export "$key=$value"
            fi
        done <"$conf"
    fi
    CKPTFS_BIN=${CKPTFS_BIN:-ckptfs}
    CKPTFS_SLURM_MODE=${CKPTFS_SLURM_MODE:-job}
    CKPTFS_SLURM_MOUNT_ROOT=${CKPTFS_SLURM_MOUNT_ROOT:-/ckpt}
    CKPTFS_SLURM_CACHE_ROOT=${CKPTFS_SLURM_CACHE_ROOT:-/var/cache/ckptfs/slurm}
    CKPTFS_SLURM_LOG_DIR=${CKPTFS_SLURM_LOG_DIR:-/var/log/ckptfs}
    CKPTFS_SLURM_DRAIN_TIMEOUT=${CKPTFS_SLURM_DRAIN_TIMEOUT:-600}
    CKPTFS_SLURM_ON_RISK=${CKPTFS_SLURM_ON_RISK:-drain}
    CKPTFS_SLURM_KEEP_CACHE=${CKPTFS_SLURM_KEEP_CACHE:-0}
    CKPTFS_SLURM_PYTHON=${CKPTFS_SLURM_PYTHON:-python3}
    local where="(${conf} or the environment)"
    [ -n "${CKPTFS_SLURM_STORE:-}" ] || fail 1 "CKPTFS_SLURM_STORE is not set $where: the store, s3://bucket/prefix"
    case $CKPTFS_SLURM_STORE in s3://?* | file:///*) ;; *)
        fail 1 "CKPTFS_SLURM_STORE must be s3://bucket[/prefix] or file:///dir, not '$CKPTFS_SLURM_STORE'" ;;
    esac
    case $CKPTFS_SLURM_MODE in job | node) ;; *)
        fail 1 "CKPTFS_SLURM_MODE must be job or node, not '$CKPTFS_SLURM_MODE'" ;;
    esac
    case $CKPTFS_SLURM_ON_RISK in drain | keep) ;; *)
        fail 1 "CKPTFS_SLURM_ON_RISK must be drain or keep, not '$CKPTFS_SLURM_ON_RISK'" ;;
    esac
    case $CKPTFS_SLURM_DRAIN_TIMEOUT in '' | *[!0-9]*)
        fail 1 "CKPTFS_SLURM_DRAIN_TIMEOUT must be whole seconds, not '$CKPTFS_SLURM_DRAIN_TIMEOUT'" ;;
    esac
    case $CKPTFS_SLURM_MOUNT_ROOT$CKPTFS_SLURM_CACHE_ROOT$CKPTFS_SLURM_LOG_DIR in *' '*)
        fail 1 "CKPTFS_SLURM_MOUNT_ROOT, _CACHE_ROOT and _LOG_DIR may not hold spaces" ;;
    esac
    for key in CKPTFS_SLURM_MOUNT_ROOT CKPTFS_SLURM_CACHE_ROOT CKPTFS_SLURM_LOG_DIR; do
        case ${!key} in /?*) ;; *) fail 1 "$key must be an absolute path, not '${!key}'" ;; esac
    done
    command -v "$CKPTFS_BIN" >/dev/null 2>&1 || fail 1 "ckptfs not found (CKPTFS_BIN=$CKPTFS_BIN)"
    [ -n "${SLURM_JOB_ID:-}" ] || fail 1 "SLURM_JOB_ID is not set: run by slurmd as Prolog/Epilog"
    case $SLURM_JOB_ID in *[!0-9_]*) fail 1 "SLURM_JOB_ID '$SLURM_JOB_ID' is not a job id" ;; esac
}

# job_paths: MP (the mount point), CACHE (its cache dir), LOG (its log) for this job.
#   job:  <mount root>/<job id>, <cache root>/job-<job id>, <log dir>/job-<job id>.log
#   node: <mount root>, <cache root>/node, <log dir>/node.log; each user's jobs get
#         <mount root>/<user>/
job_paths() {
    if [ "$CKPTFS_SLURM_MODE" = job ]; then
        MP=$CKPTFS_SLURM_MOUNT_ROOT/$SLURM_JOB_ID
        CACHE=$CKPTFS_SLURM_CACHE_ROOT/job-$SLURM_JOB_ID
        LOG=$CKPTFS_SLURM_LOG_DIR/job-$SLURM_JOB_ID.log
    else
        MP=$CKPTFS_SLURM_MOUNT_ROOT
        CACHE=$CKPTFS_SLURM_CACHE_ROOT/node
        LOG=$CKPTFS_SLURM_LOG_DIR/node.log
    fi
}

# is_ckptfs_mount DIR: DIR is a ckptfs mount (findmnt-free: /proc/self/mountinfo).
is_ckptfs_mount() {
    awk -v mp="$1" '{ for (i = 7; i <= NF; i++) if ($i == "-") { if ($5 == mp && $(i + 1) == "fuse.ckptfs") found = 1; break } } END { exit !found }' /proc/self/mountinfo
}
