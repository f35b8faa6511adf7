# shellcheck shell=bash
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
    load_peer_config
}

# whole_number KEY MIN MAX: KEY's value is a number from MIN to MAX (at most 5 digits, read as
# decimal: "0070" is 70, not octal), or fail.
whole_number() {
    local key=$1 min=$2 max=$3 v=${!1}
    case $v in '' | *[!0-9]*) v=x ;; *) [ "${#v}" -le 5 ] && v=$((10#$v)) || v=x ;; esac
    if [ "$v" = x ] || [ "$v" -lt "$min" ] || [ "$v" -gt "$max" ]; then
        fail 1 "$key must be a number from $min to $max, not '${!1}'"
    fi
    printf -v "$key" '%s' "$v"
}

# load_peer_config: the --peers keys (README.md "Peers"), on only when CKPTFS_SLURM_PEER_SECRET
# is set. Sets PEER_PORT, the port of this job's peers: the same on every node of the job, and
# in job mode one per job among CKPTFS_SLURM_PEER_PORTS (jobs sharing a node need their own).
load_peer_config() {
    CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE=${CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE:-0}
    case $CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE in 0 | 1) ;; *)
        fail 1 "CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE must be 0 or 1, not '$CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE'" ;;
    esac
    if [ -z "${CKPTFS_SLURM_PEER_SECRET:-}" ]; then
        # without peers an empty namespace is an empty fresh cache: the job would start over
        [ "$CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE" = 0 ] ||
            fail 1 "CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE=1 needs peers (CKPTFS_SLURM_PEER_SECRET)"
        return 0
    fi
    case $CKPTFS_SLURM_PEER_SECRET in /?*) ;; *)
        fail 1 "CKPTFS_SLURM_PEER_SECRET must be an absolute path, not '$CKPTFS_SLURM_PEER_SECRET'" ;;
    esac
    case " ${CKPTFS_SLURM_OPTIONS:-}" in *' --peer'* | *' --replicas'* | *' --allow-empty-namespace'*)
        fail 1 "CKPTFS_SLURM_OPTIONS may not hold --peer*, --replicas or --allow-empty-namespace when CKPTFS_SLURM_PEER_SECRET is set" ;;
    esac
    CKPTFS_SLURM_PEER_PORT=${CKPTFS_SLURM_PEER_PORT:-7070}
    CKPTFS_SLURM_PEER_PORTS=${CKPTFS_SLURM_PEER_PORTS:-1000}
    whole_number CKPTFS_SLURM_PEER_PORT 1 65535
    whole_number CKPTFS_SLURM_PEER_PORTS 1 65535
    if [ -n "${CKPTFS_SLURM_PEER_REPLICAS:-}" ]; then
        whole_number CKPTFS_SLURM_PEER_REPLICAS 0 16  # ckptfs's own bounds (--replicas)
    fi
    case ${CKPTFS_SLURM_PEER_ADDRESS:-} in *[!A-Za-z0-9.:_-]*)
        fail 1 "CKPTFS_SLURM_PEER_ADDRESS must be a host name or address, not '$CKPTFS_SLURM_PEER_ADDRESS'" ;;
    esac
    PEER_PORT=$CKPTFS_SLURM_PEER_PORT
    if [ "$CKPTFS_SLURM_MODE" = job ]; then
        # every job id must get a port in range, not only this one: checked for the last
        [ $((PEER_PORT + CKPTFS_SLURM_PEER_PORTS - 1)) -le 65535 ] ||
            fail 1 "CKPTFS_SLURM_PEER_PORT + CKPTFS_SLURM_PEER_PORTS - 1 must be at most 65535, not $((PEER_PORT + CKPTFS_SLURM_PEER_PORTS - 1))"
        local id=${SLURM_JOB_ID//_/}
        id=${id:$((${#id} > 15 ? ${#id} - 15 : 0))}  # 15 digits: no overflow in $(( ))
        PEER_PORT=$((PEER_PORT + 10#$id % CKPTFS_SLURM_PEER_PORTS))
    fi
}

# Seeds passed to ckptfs at most (its --peer-seeds limit); one answering seed names the others.
MAX_PEER_SEEDS=64

# peer_mount_args: PEER_ARGS, the `ckptfs mount` options of load_peer_config's settings (none
# when peers are off); the seeds are the job's nodes (`scontrol show hostnames`), each at
# PEER_PORT. Fails (exit 1) when the secret file is missing or the node list unknown.
peer_mount_args() {
    PEER_ARGS=()
    [ -n "${CKPTFS_SLURM_PEER_SECRET:-}" ] || return 0
    if ! [ -f "$CKPTFS_SLURM_PEER_SECRET" ] || ! [ -r "$CKPTFS_SLURM_PEER_SECRET" ]; then
        fail 1 "job $SLURM_JOB_ID: peer secret $CKPTFS_SLURM_PEER_SECRET (CKPTFS_SLURM_PEER_SECRET) is not a readable file"
    fi
    [ -n "${SLURM_JOB_NODELIST:-}" ] ||
        fail 1 "job $SLURM_JOB_ID: SLURM_JOB_NODELIST is not set: the peers are the job's nodes"
    local out rc host seeds="" n=0
    out=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>&1)
    rc=$?
    if [ "$rc" -ne 0 ] || [ -z "$out" ]; then
        fail 1 "job $SLURM_JOB_ID: scontrol show hostnames '$SLURM_JOB_NODELIST' failed (exit $rc): $(printf '%s' "$out" | head -n 1)"
    fi
    while IFS= read -r host; do
        [ -n "$host" ] || continue
        case $host in *[!A-Za-z0-9.:_-]*)
            fail 1 "job $SLURM_JOB_ID: scontrol named '$host', not a host name" ;;
        esac
        n=$((n + 1))
        [ "$n" -le "$MAX_PEER_SEEDS" ] || break
        seeds=${seeds:+$seeds,}$host:$PEER_PORT
    done <<<"$out"
    PEER_ARGS=(--peers --peer-secret-file "$CKPTFS_SLURM_PEER_SECRET"
        --peer-listen "0.0.0.0:$PEER_PORT" --peer-seeds "$seeds")
    [ -n "${CKPTFS_SLURM_PEER_ADDRESS:-}" ] && PEER_ARGS+=(--peer-address "$CKPTFS_SLURM_PEER_ADDRESS")
    [ -n "${CKPTFS_SLURM_PEER_REPLICAS:-}" ] && PEER_ARGS+=(--replicas "$CKPTFS_SLURM_PEER_REPLICAS")
    [ "$CKPTFS_SLURM_ALLOW_EMPTY_NAMESPACE" = 1 ] && PEER_ARGS+=(--allow-empty-namespace)
    return 0
}

# job_paths: MP (the mount point), CACHE (its cache dir), LOG (its log) for this job.
#   job:  <mount root>/<job id>, <cache root>/job-<job id>, <log dir>/job-<job id>.log
#   node: <mount root>, <cache root>/node, <log dir>/node.log; each user's jobs get
#         <mount root>/<user>/
# shellcheck disable=SC2034  # MP, CACHE, LOG: read by the script that sources this
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
