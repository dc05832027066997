#!/usr/bin/env bash
# shellcheck disable=SC2317  # functions run through run_check "$@" and trap
# Build and run docker-compose.yml on a real Docker engine, as a user would.
#
#   sudo scripts/compose_check.sh          # as root; ~10 min the first time, less after
#
# Run it whenever the Dockerfile, the compose files, worker/launch.py or the server's
# lifecycle change, and record its summary in docs/deploy.md (section 1). CI has no
# engine: tests/system/test_docker_static.py and tests/system/test_compose.py check the files without
# one.
#
# What it does:
# - installs Docker from the distribution's packages when `dockerd` is missing (Debian:
#   docker.io, and docker-compose when there is no `docker compose` plugin), with
#   services kept from starting on install;
# - starts its own dockerd (its own socket, pid file, exec root; images kept in
#   $HYBRIDPS_CHECK_CACHE for the next run) with no bridge, no iptables rules and no IP
#   forwarding: every container of the check uses the host's network through an
#   override file written here (network_mode: host), the server listens on 127.0.0.1 on
#   a free port, and nothing is sent to an address outside loopback;
# - stand-ins when the registries are out of reach: the base image `python:3.11-slim`
#   (tried first) becomes a minimal Debian with python3 made by debootstrap from the
#   host's own apt mirror; torch comes from a local index served on 127.0.0.1, filled
#   by `pip download torch==$TORCH_VERSION` (which takes the wheel from this machine's
#   pip sources); HYBRIDPS_BASE_IMAGE / HYBRIDPS_TORCH_INDEX_URL skip either;
# - runs the checks below, each PASS/FAIL with its seconds, then stops what it started
#   (the daemon by its PID) and removes its containers, network-less volume and files.
#
# Checks (exit 1 when one fails):
#   build       `build`: the image builds (time, size)
#   up-1, up-2  plain `up` from scratch, twice: returns 0, both containers exit 0
#   up-code     `up --abort-on-container-exit --exit-code-from worker`: returns 0
#   stats       `exec worker python -m ps.admin stats` while a job runs (`up -d`)
#   stop        `stop`: worker exits 143 and its last line is the launcher's; ps exits 0
#   resume      the documented `up` again: resumes from a checkpoint, returns 0
#   failure     a rank killed with no restart left: the documented `up` returns non-zero
#
# Environment: HYBRIDPS_CHECK_STEPS (30: the short runs), HYBRIDPS_CHECK_CACHE (the
# engine's images between runs; default ~/.cache/hybridps-compose-check; `--clean`
# removes it first), HYBRIDPS_CHECK_KEEP=1 keeps the work directory (logs).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STEPS=${HYBRIDPS_CHECK_STEPS:-30}
CACHE=${HYBRIDPS_CHECK_CACHE:-${HOME:-/root}/.cache/hybridps-compose-check}
TORCH_VERSION=${HYBRIDPS_CHECK_TORCH_VERSION:-2.13.0}
PROJECT=hybridps-check
STANDIN=hybridps-check/python:3.11-slim

if [[ ${1:-} == --clean ]]; then
    rm -rf "$CACHE"
elif [[ -n ${1:-} ]]; then
    sed -n '3,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
if [[ $(id -u) != 0 ]]; then
    echo "compose_check: run as root (it installs packages and starts dockerd)" >&2
    exit 2
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/hybridps-compose-check.XXXXXX")
LOGS=$WORK/logs
SUMMARY=$WORK/summary.txt
mkdir -p "$LOGS" "$CACHE"
DOCKERD_PID=""
INDEX_PID=""
FAILED=0
export DOCKER_HOST="unix://$WORK/docker.sock"

log() { printf '[compose_check %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

cleanup() {
    local rc=$?
    set +e
    if [[ -n $DOCKERD_PID ]]; then
        compose down -v --remove-orphans >"$LOGS/down.log" 2>&1
        log "stopping dockerd (pid $DOCKERD_PID)"
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
        if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then  # what it left mounted in $WORK
            awk -v work="$WORK/" 'index($2, work) == 1 {print $2}' /proc/mounts | sort -r \
                | while read -r mount; do umount "$mount"; done
        fi
    fi
    if [[ -n $INDEX_PID ]]; then
        kill -TERM "$INDEX_PID" 2>/dev/null
        wait "$INDEX_PID" 2>/dev/null
    fi
    [[ -f $SUMMARY ]] && cat "$SUMMARY"
    if [[ ${HYBRIDPS_CHECK_KEEP:-0} == 1 || $rc != 0 || $FAILED != 0 ]]; then
        log "logs kept in $WORK"
    else
        rm -rf "$WORK"
    fi
}
trap cleanup EXIT

# -- 1. the engine ---------------------------------------------------------------------
install_docker() {
    local packages=()
    command -v dockerd >/dev/null || packages+=(docker.io)
    if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
        packages+=(docker-compose)
    fi
    command -v debootstrap >/dev/null || packages+=(debootstrap)
    [[ ${#packages[@]} == 0 ]] && return
    log "installing ${packages[*]} (apt-get)"
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e $policy ]]; then  # keep the packages' services from starting
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${packages[@]}" >"$LOGS/apt.log" 2>&1 || { cat "$LOGS/apt.log" >&2; return 1; }
    [[ $made_policy == 1 ]] && rm -f "$policy"
    return 0
}

start_dockerd() {
    log "starting dockerd (no bridge, no iptables, no forwarding; images in $CACHE)"
    dockerd --bridge=none --iptables=false --ip6tables=false --ip-forward=false \
        --ip-masq=false --data-root "$CACHE/docker" --exec-root "$WORK/exec" \
        --pidfile "$WORK/dockerd.pid" --host "$DOCKER_HOST" >"$LOGS/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        docker version >/dev/null 2>&1 && return 0
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 1
    done
    log "dockerd did not come up:"
    tail -20 "$LOGS/dockerd.log" >&2
    return 1
}

COMPOSE=()
pick_compose() {
    if docker compose version >/dev/null 2>&1; then
        COMPOSE=(docker compose)
    else
        COMPOSE=(docker-compose)
    fi
    log "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short 2>/dev/null || true))"
}

compose() {
    "${COMPOSE[@]}" -p "$PROJECT" -f "$REPO/docker-compose.yml" -f "$WORK/override.yml" "$@"
}

# -- 2. stand-ins for what the registries would give -------------------------------------
apt_mirror() {  # the host's own Debian mirror and suite
    local uri suite
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    suite=$(awk '/^Suites:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        || true)
    if [[ -z $uri ]]; then
        read -r _ uri suite _ < <(grep -h '^deb ' /etc/apt/sources.list 2>/dev/null | head -1)
    fi
    [[ -n $uri && -n $suite ]] || { log "no Debian mirror in /etc/apt: set HYBRIDPS_BASE_IMAGE"; return 1; }
    echo "$uri $suite"
}

base_image() {  # BASE: python:3.11-slim, else a stand-in made from the host's apt mirror
    if [[ -n ${HYBRIDPS_BASE_IMAGE:-} ]]; then
        BASE=$HYBRIDPS_BASE_IMAGE
        return
    fi
    if timeout 60 docker pull python:3.11-slim >"$LOGS/pull.log" 2>&1; then
        BASE=python:3.11-slim
        return
    fi
    local mirror suite rootfs_image
    read -r mirror suite < <(apt_mirror)
    rootfs_image=hybridps-check/debian-python3:$suite
    if ! docker image inspect "$rootfs_image" >/dev/null 2>&1; then
        log "python:3.11-slim cannot be pulled: making $rootfs_image (debootstrap $suite)"
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
            "$suite" "$WORK/rootfs" "$mirror" >"$LOGS/debootstrap.log" 2>&1 \
            || { tail -20 "$LOGS/debootstrap.log" >&2; return 1; }
        tar -C "$WORK/rootfs" -c . | docker import \
            -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            -c 'CMD ["python3"]' - "$rootfs_image" >/dev/null
        rm -rf "$WORK/rootfs"
    fi
    # The host's CA bundle too: where the registries are reached through a TLS-inspecting
    # proxy, its CA is in there, and pip (which has its own bundle) is pointed at it.
    mkdir -p "$WORK/standin"
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/standin/" 2>/dev/null \
        || : >"$WORK/standin/ca-certificates.crt"
    cat >"$WORK/standin/Dockerfile" <<EOF
FROM $rootfs_image
COPY ca-certificates.crt /usr/local/share/hybridps-check/host-ca.crt
RUN cat /usr/local/share/hybridps-check/host-ca.crt >>/etc/ssl/certs/ca-certificates.crt
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
EOF
    docker build -q --network none -t "$STANDIN" "$WORK/standin" >"$LOGS/standin.log" 2>&1 \
        || { cat "$LOGS/standin.log" >&2; return 1; }
    BASE=$STANDIN
}

free_port() {  # [PORT]: PORT when it is free on 127.0.0.1, else one the kernel picks
    python3 - "${1:-0}" <<'EOF'
import socket, sys
for port in (int(sys.argv[1]), 0):
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            print(s.getsockname()[1])
            break
    except OSError:
        continue
EOF
}

INDEX_URL=""
torch_index() {  # INDEX_URL: a PEP 503 index of torch and its dependencies on 127.0.0.1
    if [[ -n ${HYBRIDPS_TORCH_INDEX_URL:-} ]]; then
        INDEX_URL=$HYBRIDPS_TORCH_INDEX_URL
        return
    fi
    local python=python3 wheels=$WORK/wheels port
    [[ -x $REPO/.venv/bin/python ]] && python=$REPO/.venv/bin/python
    "$python" -m pip download -q "torch==$TORCH_VERSION" -d "$wheels" >"$LOGS/pip-download.log" 2>&1 \
        || { tail -20 "$LOGS/pip-download.log" >&2; return 1; }
    local wheel name
    for wheel in "$wheels"/*.whl; do
        name=$(basename "$wheel")
        name=$(echo "${name%%-*}" | tr 'A-Z_.' 'a-z--')
        mkdir -p "$WORK/index/simple/$name"
        ln -f "$wheel" "$WORK/index/simple/$name/"
    done
    # The port of the last run when it is free: the index's URL is a build argument, and
    # a new one would rebuild every layer after it (torch included).
    port=$(free_port "$(cat "$CACHE/index.port" 2>/dev/null || echo 0)")
    echo "$port" >"$CACHE/index.port"
    python3 -m http.server --bind 127.0.0.1 --directory "$WORK/index" "$port" \
        >"$LOGS/index.log" 2>&1 &
    INDEX_PID=$!
    INDEX_URL="http://127.0.0.1:$port/simple"
}

write_override() {  # host network, loopback only, a free port, small tables (module doc)
    local port=$1 python=python3
    [[ -x $REPO/.venv/bin/python ]] && python=$REPO/.venv/bin/python
    "$python" - "$REPO/docker-compose.yml" "$port" >"$WORK/override.yml" <<'EOF'
import json, socket, sys
import yaml
spec = yaml.safe_load(open(sys.argv[1]))
port = sys.argv[2]
def local(args):
    return [a.replace("0.0.0.0", "127.0.0.1").replace("50051", port) for a in args]
ps, worker = spec["services"]["ps"], spec["services"]["worker"]
host = {"network_mode": "host", "build": {"network": "host"}}
override = {"services": {
    "ps": {**host, "command": local(ps["command"]),
           "healthcheck": {"test": local(ps["healthcheck"]["test"])}},
    "worker": {**host, "command": local(worker["command"]), "extra_hosts": [
                   # the host's name too: torchrun's rendezvous store is reached by it
                   "ps:127.0.0.1", f"{socket.gethostname()}:127.0.0.1"],
               "environment": {
                   "GLOO_SOCKET_IFNAME": "lo",
                   "HYBRIDPS_NUM_ROWS": "${HYBRIDPS_NUM_ROWS:-20000}",
                   "HYBRIDPS_FAULT_KILL": "${HYBRIDPS_FAULT_KILL:-}"}}}}
json.dump(override, sys.stdout, indent=1)  # JSON is YAML
EOF
}

# -- 3. the checks ---------------------------------------------------------------------
container() {  # the container id of service $1 (running or exited)
    docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1" | head -1
}
exit_code() { docker inspect -f '{{.State.ExitCode}}' "$(container "$1")"; }
last_line() { docker logs "$(container "$1")" 2>&1 | tail -1; }
fresh() { compose down -v --remove-orphans >/dev/null 2>&1 || true; }

NOTE=""
run_check() {  # NAME FUNCTION: runs it, logs to $LOGS/NAME.log, one summary line
    local name=$1 start result
    shift
    NOTE=""
    start=$(date +%s)
    log "check $name"
    if "$@" >"$LOGS/$name.log" 2>&1; then result=PASS; else result=FAIL; FAILED=1; fi
    printf '%-9s %s %5ss  %s\n' "$name" "$result" "$(($(date +%s) - start))" "$NOTE" \
        | tee -a "$SUMMARY" >&2
    if [[ $result == FAIL ]]; then tail -15 "$LOGS/$name.log" | sed 's/^/    /' >&2; fi
}

check_build() {
    compose build || return 1
    local bytes
    bytes=$(docker image inspect -f '{{.Size}}' "hybridps:$HYBRIDPS_TAG")
    NOTE="image hybridps:$HYBRIDPS_TAG $((bytes / 1000000)) MB (base $BASE)"
}

# TEXT PATTERN: whether a line of TEXT has PATTERN. Not `cmd | grep -q` under pipefail:
# grep -q exits at the first match, and a writer still writing gets SIGPIPE, which fails
# the pipeline although the line was there.
has_line() { grep -- "$2" <<<"$1" >/dev/null; }

finished_at() { date -d "$(docker inspect -f '{{.State.FinishedAt}}' "$(container "$1")")" +%s.%N; }

both_exit_0() {  # and how long the server outlived the worker
    local ps worker margin
    ps=$(exit_code ps) worker=$(exit_code worker)
    margin=$(python3 -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.1f}')" \
        "$(finished_at ps)" "$(finished_at worker)")
    NOTE="$NOTE ps=$ps worker=$worker (ps exited ${margin}s after the worker)"
    [[ $ps == 0 && $worker == 0 ]]
}

check_plain_up() {
    fresh
    local rc=0
    HYBRIDPS_STEPS=$STEPS compose up || rc=$?
    NOTE="up rc=$rc"
    both_exit_0 && [[ $rc == 0 ]] \
        && has_line "$(docker logs "$(container worker)" 2>&1)" "steps $STEPS"
}

check_exit_code_up() {
    fresh
    local rc=0
    HYBRIDPS_STEPS=$STEPS compose up --abort-on-container-exit --exit-code-from worker || rc=$?
    NOTE="up rc=$rc"
    [[ $rc == 0 ]] && both_exit_0
}

wait_for() {  # SERVICE PATTERN SECONDS: until the service's log has the pattern
    for _ in $(seq "$3"); do
        has_line "$(docker logs "$(container "$1")" 2>&1)" "$2" && return 0
        sleep 1
    done
    echo "no '$2' in $1's log after $3 s"
    return 1
}

LONG_STEPS=$((STEPS * 20))  # stopped after its first checkpoint, resumed to its end
check_stats_while_running() {
    fresh
    HYBRIDPS_STEPS=$LONG_STEPS HYBRIDPS_CHECKPOINT_EVERY=$STEPS compose up -d || return 1
    wait_for worker "checkpoint step" 600 || return 1
    local out
    # exec, not `run --rm`: compose 1.29 links a `run` container to its dependencies,
    # which host networking refuses.
    out=$(compose exec -T worker python -m ps.admin stats --ps "ps:$PORT") || return 1
    echo "$out"
    NOTE="$(echo "$out" | grep -c . ) lines"
    has_line "$out" "active"
}

check_stop() {
    local rc=0 worker ps line
    compose stop || rc=$?
    worker=$(exit_code worker) ps=$(exit_code ps) line=$(last_line worker)
    NOTE="stop rc=$rc worker=$worker ps=$ps, last line: ${line:0:70}"
    [[ $rc == 0 && $worker == 143 && $ps == 0 && $line == *"hybridps-run: stopped by SIGTERM"* ]]
}

check_resume() {
    local rc=0 from
    HYBRIDPS_STEPS=$LONG_STEPS HYBRIDPS_CHECKPOINT_EVERY=$STEPS \
        compose up --abort-on-container-exit --exit-code-from worker || rc=$?
    from=$(docker logs "$(container worker)" 2>&1 | grep -o "resumed from [^ ]* (step [0-9]*" | head -1)
    NOTE="up rc=$rc, ${from:-no resume line}"
    [[ $rc == 0 && -n $from ]] && both_exit_0
}

check_failure() {
    fresh
    local rc=0 worker
    HYBRIDPS_STEPS=$STEPS HYBRIDPS_FAULT_KILL=1:5 HYBRIDPS_MAX_RESTARTS=0 \
        compose up --abort-on-container-exit --exit-code-from worker || rc=$?
    worker=$(exit_code worker)
    NOTE="up rc=$rc worker=$worker"
    [[ $rc != 0 && $worker != 0 ]]
}

# -- main ------------------------------------------------------------------------------
install_docker
start_dockerd
pick_compose
BASE=""
base_image
PORT=$(free_port)
write_override "$PORT"
export HYBRIDPS_TAG=check HYBRIDPS_BASE_IMAGE=$BASE
torch_index
export HYBRIDPS_TORCH_INDEX_URL=$INDEX_URL
log "base $BASE, torch from $HYBRIDPS_TORCH_INDEX_URL, server on 127.0.0.1:$PORT"
{
    echo "compose_check: $(date -u +%Y-%m-%dT%H:%MZ), ${COMPOSE[*]} $("${COMPOSE[@]}" version --short 2>/dev/null), engine $(docker version -f '{{.Server.Version}}'), $STEPS steps"
} >"$SUMMARY"

run_check build check_build
if [[ $FAILED == 0 ]]; then
    run_check up-1 check_plain_up
    run_check up-2 check_plain_up
    run_check up-code check_exit_code_up
    run_check stats check_stats_while_running
    run_check stop check_stop
    run_check resume check_resume
    run_check failure check_failure
fi
[[ $FAILED == 0 ]] && echo "all checks passed" >>"$SUMMARY"
exit "$FAILED"
