#!/usr/bin/env bash
# Make sure a Docker Engine answers, starting a local one if needed; print the DOCKER_HOST to use.
#
#   export DOCKER_HOST="$(deploy/docker-engine.sh)"     # ensure running (idempotent)
#   deploy/docker-engine.sh stop                        # stop the engine this script started
#
# Used by the runtime-driver tests, the dev stack and CI on bare Debian 12 machines where no engine
# runs and no systemd manages one. Production GPU hosts run their distribution's Docker Engine
# with the NVIDIA Container Toolkit instead; this script leaves any answering engine alone.
#
# What it does when no engine answers (on $DOCKER_HOST, else the default socket):
#   1. installs Debian's `docker.io` with apt-get if `dockerd` is missing (services are not
#      started by the package: we start our own daemon below);
#   2. starts `dockerd --iptables=false --bridge=none` in the background with its own data root,
#      pidfile, exec root and log, using overlay2 when this kernel/filesystem can mount it and vfs
#      otherwise;
#   3. waits (bounded) until it answers, and fails with the log tail if it does not.
#
# --iptables=false / --bridge=none: sandboxes and CI VMs often lack the netfilter modules, and the
# training harness needs no network. Consequence: no default bridge and no NAT; the runtime driver
# gives each rental a user-defined internal network with no address of the host on its bridge,
# and the agent declares at join that it cannot filter a rental's internet (which needs the
# engine's iptables, DOCKER-USER, for NAT and for the rules keeping rentals off private ranges):
# such a node is given rentals with network "internal" only.
#
# Settings (environment):
#   GPUMARKET_DOCKER_ROOT     data root            (default /var/lib/gpumarket-docker)
#   GPUMARKET_DOCKER_SOCK     socket path          (default /var/run/docker.sock)
#   GPUMARKET_DOCKER_STORAGE  force a storage driver (overlay2 | vfs); default: probe
#   GPUMARKET_DOCKER_WAIT_S   seconds to wait for the engine to answer (default 60)
#   GPUMARKET_DOCKER_RUN_DIR  pidfile and exec root (default /var/run/gpumarket-docker)
#   GPUMARKET_DOCKER_LOG      daemon log (default /var/log/gpumarket-dockerd.log)
# All progress goes to stderr; stdout carries only the DOCKER_HOST value.
set -euo pipefail

DATA_ROOT="${GPUMARKET_DOCKER_ROOT:-/var/lib/gpumarket-docker}"
SOCK="${GPUMARKET_DOCKER_SOCK:-/var/run/docker.sock}"
RUN_DIR="${GPUMARKET_DOCKER_RUN_DIR:-/var/run/gpumarket-docker}"
PIDFILE="$RUN_DIR/dockerd.pid"
LOG="${GPUMARKET_DOCKER_LOG:-/var/log/gpumarket-dockerd.log}"
WAIT_S="${GPUMARKET_DOCKER_WAIT_S:-60}"

log() { echo "docker-engine: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

answers() {  # $1: docker host URL
    timeout 10 docker -H "$1" info >/dev/null 2>&1
}

daemon_pid() {  # prints the pid of our dockerd if it is alive
    [[ -s "$PIDFILE" ]] || return 1
    local pid
    pid="$(cat "$PIDFILE")"
    [[ -d "/proc/$pid" ]] && grep -q dockerd "/proc/$pid/comm" 2>/dev/null || return 1
    echo "$pid"
}

ensure_client_and_daemon_binaries() {
    if command -v dockerd >/dev/null 2>&1 && command -v docker >/dev/null 2>&1; then
        return 0
    fi
    [[ "$(id -u)" == 0 ]] || die "dockerd is missing and installing it needs root"
    log "installing docker.io from the Debian archive"
    # The package's maintainer scripts would start the stock service (with iptables and a
    # bridge); a policy-rc.d that denies starts keeps them from doing so.
    local created_policy=""
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends docker.io >&2; then
        apt-get update -q >&2
        apt-get install -y -q --no-install-recommends docker.io >&2
    fi
    if [[ -n "$created_policy" ]]; then rm -f /usr/sbin/policy-rc.d; fi
    command -v dockerd >/dev/null 2>&1 || die "docker.io installed but dockerd not found"
}

probe_storage_driver() {
    if [[ -n "${GPUMARKET_DOCKER_STORAGE:-}" ]]; then
        echo "$GPUMARKET_DOCKER_STORAGE"
        return
    fi
    # overlay2 fails on some backing filesystems (overlayfs itself, some network filesystems)
    # and in restricted sandboxes; a throw-away mount in the data root tells us for sure.
    local probe="$DATA_ROOT/.overlay-probe"
    rm -rf "$probe"
    mkdir -p "$probe"/{lower,upper,work,merged}
    if mount -t overlay overlay \
        -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" \
        "$probe/merged" 2>/dev/null; then
        umount "$probe/merged"
        rm -rf "$probe"
        echo overlay2
    else
        rm -rf "$probe"
        echo vfs
    fi
}

start_daemon() {
    [[ "$(id -u)" == 0 ]] || die "starting dockerd needs root"
    mkdir -p "$DATA_ROOT" "$RUN_DIR" "$(dirname "$SOCK")"
    local storage
    storage="$(probe_storage_driver)"
    if [[ -n "$(ls -A "$DATA_ROOT/image" 2>/dev/null)" ]] &&
        [[ ! -d "$DATA_ROOT/image/$storage" ]]; then
        log "note: $DATA_ROOT has images of another storage driver; they are not visible with $storage"
    fi
    rm -f "$PIDFILE"
    if [[ -S "$SOCK" ]]; then rm -f "$SOCK"; fi
    log "starting dockerd (storage $storage, data root $DATA_ROOT, log $LOG)"
    # setsid + full redirection: the daemon must outlive this script and must not hold the
    # caller's stdout open (a caller capturing our output would otherwise never see EOF).
    setsid dockerd \
        --iptables=false --ip-masq=false --bridge=none \
        --storage-driver="$storage" \
        --data-root="$DATA_ROOT" \
        --exec-root="$RUN_DIR/exec" \
        --pidfile="$PIDFILE" \
        --host="unix://$SOCK" \
        </dev/null >>"$LOG" 2>&1 &
}

wait_until_answers() {  # $1: docker host URL
    local deadline=$((SECONDS + WAIT_S))
    while ((SECONDS < deadline)); do
        answers "$1" && return 0
        if [[ -s "$PIDFILE" ]] && ! daemon_pid >/dev/null; then
            break  # it wrote a pidfile and died: no point waiting further
        fi
        sleep 0.5
    done
    log "the engine did not answer on $1 within ${WAIT_S}s; last lines of $LOG:"
    tail -n 30 "$LOG" >&2 || true
    return 1
}

cmd_stop() {
    local pid
    if pid="$(daemon_pid)"; then
        log "stopping dockerd (pid $pid)"
        kill -TERM "$pid"
        for _ in $(seq 1 60); do
            [[ -d "/proc/$pid" ]] || return 0
            sleep 0.5
        done
        die "dockerd (pid $pid) did not stop within 30s"
    fi
    log "no dockerd started by this script is running"
}

cmd_ensure() {
    local host="${DOCKER_HOST:-unix://$SOCK}"
    if command -v docker >/dev/null 2>&1 && answers "$host"; then
        log "engine already answers on $host"
        echo "$host"
        return 0
    fi
    if [[ -n "${DOCKER_HOST:-}" && "$DOCKER_HOST" != "unix://$SOCK" ]]; then
        die "DOCKER_HOST=$DOCKER_HOST does not answer; unset it to start a local engine"
    fi
    ensure_client_and_daemon_binaries
    # A daemon of ours may still be starting up (e.g. a parallel caller started it).
    if ! daemon_pid >/dev/null; then
        start_daemon
    else
        log "dockerd already started (pid $(daemon_pid)); waiting for it to answer"
    fi
    wait_until_answers "$host" || {
        # overlay2 can pass the mount probe yet be refused by the daemon (e.g. on an unsupported
        # backing filesystem); retry once with vfs, which works everywhere, only slower.
        if [[ -z "${GPUMARKET_DOCKER_STORAGE:-}" ]] && grep -qi "overlay" "$LOG" &&
            ! daemon_pid >/dev/null; then
            log "retrying with the vfs storage driver"
            GPUMARKET_DOCKER_STORAGE=vfs start_daemon
            wait_until_answers "$host" || die "dockerd did not start (see $LOG)"
        else
            die "dockerd did not start (see $LOG)"
        fi
    }
    log "engine answers on $host"
    echo "$host"
}

case "${1:-ensure}" in
    ensure) cmd_ensure ;;
    stop) cmd_stop ;;
    *) die "usage: $0 [ensure|stop]" ;;
esac
