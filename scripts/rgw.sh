#!/usr/bin/env bash
# A one-node Ceph RADOS Gateway (S3) on 127.0.0.1, for the tests and by hand: a real S3
# implementation next to moto (docs/STORES.md says what differs and how ckptfs copes).
#
#   bash scripts/rgw.sh install          apt packages (ceph-mon ceph-osd radosgw ceph-common), once
#   bash scripts/rgw.sh start DIR        start (or find running) in DIR; prints the endpoint URL
#   bash scripts/rgw.sh stop DIR         stop what `start DIR` started (by its PIDs), remove DIR
#
# One monitor, one OSD on memstore (RAM: it grows with what the tests keep, ~120 MB idle), one
# radosgw (beast frontend), auth off inside the cluster, every address 127.0.0.1, ports picked
# free at start. S3 credentials: RGW_ACCESS_KEY / RGW_SECRET_KEY (default testing / testing,
# the same as the tests give moto). Started in about 10 s on this 2-core VM (measured). Debian
# 12 ships Ceph 16.2 (pacific), the version the conformance suite's expectations name.
#
# Exit codes: 0 ok; 1 a step failed (its log is named); 2 usage; 3 cannot install.
set -euo pipefail

ACCESS="${RGW_ACCESS_KEY:-testing}"
SECRET="${RGW_SECRET_KEY:-testing}"
PKGS=(ceph-mon ceph-osd radosgw ceph-common)

usage() { echo "usage: rgw.sh install | start DIR | stop DIR" >&2; exit 2; }
die() { echo "rgw.sh: $*" >&2; exit 1; }

installed() {
    command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null &&
        command -v radosgw >/dev/null && command -v radosgw-admin >/dev/null &&
        command -v monmaptool >/dev/null && command -v ceph >/dev/null
}

install() {
    installed && return 0
    echo "rgw.sh: installing ${PKGS[*]} (apt, ~250 MB, once)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # Another apt run (setup.sh, unattended upgrades) may hold the lock: wait for it.
    if ! apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${PKGS[@]}" \
            >/dev/null 2>&1; then
        apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null 2>&1 || true
        apt-get -o DPkg::Lock::Timeout=300 install -y -q --no-install-recommends "${PKGS[@]}" \
            >/dev/null || { echo "rgw.sh: cannot install ${PKGS[*]}" >&2; exit 3; }
    fi
    installed || { echo "rgw.sh: ${PKGS[*]} installed but a command is missing" >&2; exit 3; }
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

answers() { curl -s -o /dev/null --max-time 2 "$1/" 2>/dev/null; }

# wait_for SECONDS WHAT COMMAND...: run COMMAND every 0.2 s until it succeeds
wait_for() {
    local limit=$1 what=$2 i
    shift 2
    for ((i = 0; i < limit * 5; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    die "$what did not come up within ${limit}s (logs in $D/log)"
}

start() {
    D="$(realpath -m "$1")"
    if [ -s "$D/endpoint" ] && alive "$D/pids/mon" && alive "$D/pids/osd" &&
            alive "$D/pids/rgw" && answers "$(cat "$D/endpoint")"; then
        cat "$D/endpoint"
        return 0
    fi
    [ -e "$D" ] && stop "$D" quiet
    install
    # A one-node cluster sometimes never gets its OSD up (the monitor answers its first command
    # with 'wrong fsid'; seen about once in ten starts here): then the whole cluster is made
    # again, with a new fsid, up to three times. Each try runs in a subshell, whose `die` ends
    # only that try; the daemons it started are stopped by their PIDs before the next.
    local attempt
    for attempt in 1 2 3; do
        if (start_once); then
            return 0
        fi
        [ -d "$D/log" ] && cp -r "$D/log" "$D.log-try$attempt" 2>/dev/null
        stop "$D" quiet
        echo "rgw.sh: start $attempt of 3 failed (its logs: $D.log-try$attempt)" >&2
    done
    die "Ceph RGW did not start in 3 tries"
}

start_once() {
    local i
    mkdir -p "$D"/{log,run,pids,mon.a,osd.0,rgw}
    local mon_port rgw_port fsid conf="$D/ceph.conf"
    mon_port=$(free_port)
    rgw_port=$(free_port)
    fsid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    # Ceph's src/vstart.sh is the reference; these are the settings one node on loopback needs.
    # `ms mon client mode = crc`: without it radosgw loops on get_initial_auth_request -13.
    cat >"$conf" <<EOF
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$mon_port
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
ms mon client mode = crc
ms bind msgr2 = false
run dir = $D/run
admin socket = $D/run/\$name.asok
log file = $D/log/\$name.log
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon allow pool delete = true
mon max pg per osd = 1000
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
[mon]
mon data = $D/mon.\$id
[osd]
osd data = $D/osd.\$id
osd objectstore = memstore
memstore device bytes = 8589934592
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$rgw_port
rgw data = $D/rgw
rgw dns name = localhost
EOF
    local ceph=(timeout 20 ceph -c "$conf")
    monmaptool --create --add a "v1:127.0.0.1:$mon_port" --fsid "$fsid" "$D/monmap" \
        >"$D/log/mkfs.log" 2>&1 || die "monmaptool failed ($D/log/mkfs.log)"
    ceph-mon -c "$conf" --mkfs -i a --monmap "$D/monmap" >>"$D/log/mkfs.log" 2>&1 \
        || die "ceph-mon --mkfs failed ($D/log/mkfs.log)"
    # -f: in the foreground of a background job, so that the PID recorded is the daemon's
    setsid ceph-mon -c "$conf" -i a -f >>"$D/log/mon.out" 2>&1 </dev/null &
    echo $! >"$D/pids/mon"
    wait_for 30 "ceph-mon" "${ceph[@]}" mon stat

    local uuid id
    uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
    id=$("${ceph[@]}" osd new "$uuid" 2>>"$D/log/mkfs.log") || die "ceph osd new failed"
    [ "$id" = 0 ] || die "expected osd id 0, got $id"
    # The OSD must find itself in the map it boots with, else the monitor answers its first
    # command with 'wrong fsid' and it never comes up (seen when it started right after
    # `osd new`): wait for the entry, and give the OSD a second start if it still does not boot.
    in_map() { "${ceph[@]}" osd dump 2>/dev/null | grep -q "^osd\.0 .*$uuid"; }
    wait_for 30 "osd.0 in the OSD map" in_map
    ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$uuid" >>"$D/log/mkfs.log" 2>&1 \
        || die "ceph-osd --mkfs failed ($D/log/mkfs.log)"
    osd_up() { "${ceph[@]}" osd dump 2>/dev/null | grep -q '^osd\.0 up'; }
    local try
    for try in 1 2 3; do
        setsid ceph-osd -c "$conf" -i 0 -f >>"$D/log/osd.out" 2>&1 </dev/null &
        echo $! >"$D/pids/osd"
        for ((i = 0; i < 100; i++)); do
            osd_up && break
            kill -0 "$(cat "$D/pids/osd")" 2>/dev/null || break
            sleep 0.2
        done
        osd_up && break
        echo "rgw.sh: ceph-osd did not boot (try $try), starting it again" >&2
        kill -KILL "$(cat "$D/pids/osd")" 2>/dev/null || true
        wait "$(cat "$D/pids/osd")" 2>/dev/null || true
    done
    osd_up || die "ceph-osd did not come up (logs in $D/log)"

    setsid radosgw -c "$conf" -n client.rgw.a -f >>"$D/log/rgw.out" 2>&1 </dev/null &
    echo $! >"$D/pids/rgw"
    local url="http://127.0.0.1:$rgw_port"
    wait_for 90 "radosgw" answers "$url"
    timeout 60 radosgw-admin -c "$conf" user create --uid=ckptfs --display-name=ckptfs \
        --access-key="$ACCESS" --secret="$SECRET" >>"$D/log/mkfs.log" 2>&1 \
        || die "radosgw-admin user create failed ($D/log/mkfs.log)"
    echo "$url" >"$D/endpoint"
    echo "$url"
}

stop() {
    D="$(realpath -m "$1")"
    local quiet="${2:-}" name pid i
    # Stop in the reverse order of start, each by the PID start recorded, never by name.
    for name in rgw osd mon; do
        [ -s "$D/pids/$name" ] || continue
        pid=$(cat "$D/pids/$name")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for ((i = 0; i < 50; i++)); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.2
            done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$D/pids/$name"
    done
    # Only a directory this script made (it has ceph.conf or pids/) is removed.
    if [ -e "$D/ceph.conf" ] || [ -d "$D/pids" ]; then
        rm -rf "$D"
    fi
    [ -n "$quiet" ] || echo "rgw.sh: stopped ($D)" >&2
}

case "${1:-}" in
    install) [ "$#" -eq 1 ] || usage; install ;;
    start) [ "$#" -eq 2 ] || usage; start "$2" ;;
    stop) [ "$#" -eq 2 ] || usage; stop "$2" ;;
    *) usage ;;
esac
