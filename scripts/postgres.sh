#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests of the PostgreSQL store.
#
#   scripts/postgres.sh start   installs PostgreSQL if missing (apt-get), starts a
#                               private cluster on 127.0.0.1 and a free port, and
#                               prints its URL (user lbscale, a random password)
#   scripts/postgres.sh url     prints the URL of the running cluster
#   scripts/postgres.sh ca      prints the path of the CA certificate (PEM) that
#                               signed the server's TLS certificate (the server
#                               takes TLS and plain connections; the certificate
#                               names IP 127.0.0.1 only)
#   scripts/postgres.sh watch   runs until the server exits, then says when (run
#                               it in the background beside a test suite: a dead
#                               server is otherwise only "error connecting to server")
#   scripts/postgres.sh stop    stops the cluster and removes its files; if the
#                               server had died, prints the end of its log
#
# The cluster lives in $LBSCALE_PG_DIR (default /tmp/lbscale-pg-$UID). As root, the
# server runs as the `postgres` user (PostgreSQL refuses to run as root).
set -euo pipefail
dir=${LBSCALE_PG_DIR:-/tmp/lbscale-pg-$(id -u)}
cmd=${1:-}

log() { echo "postgres.sh: $*" >&2; }
# shellcheck source=scripts/lib.sh
. "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"

as_server_user() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

# The newest installed server's bin directory (initdb and pg_ctl; the client
# package alone has the directory without them).
bindir() {
    local d
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -rV); do
        if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ]; then
            echo "$d"
            return 0
        fi
    done
    if command -v initdb >/dev/null && command -v pg_ctl >/dev/null; then
        dirname "$(command -v pg_ctl)"
    fi
}

install() {
    if ! command -v openssl >/dev/null; then
        log "installing openssl (apt-get), for the test server's TLS certificates"
        local s=
        [ "$(id -u)" = 0 ] || s=sudo
        $s apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive $s apt-get install -y -qq --no-install-recommends openssl >&2
    fi
    [ -n "$(bindir)" ] && return 0
    log "installing PostgreSQL (apt-get)"
    local sudo=
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends postgresql >&2
    # The package starts the distribution's own cluster; the tests do not use it.
    $sudo service postgresql stop >/dev/null 2>&1 || true
    [ -n "$(bindir)" ] || { log "PostgreSQL is not installed"; exit 1; }
}

start() {
    # A pid file whose process is gone (the machine was restarted) is stale:
    # the cluster is made again below.
    if [ -f "$dir/url" ] && [ -f "$dir/data/postmaster.pid" ] &&
        kill -0 "$(head -1 "$dir/data/postmaster.pid")" 2>/dev/null; then
        cat "$dir/url"
        return 0
    fi
    install
    local bin port password
    bin=$(bindir)
    rm -rf "$dir"
    mkdir -p "$dir/data" "$dir/sock"
    password=$(head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n')
    printf '%s\n' "$password" >"$dir/pwfile"
    if [ "$(id -u)" = 0 ]; then
        chown -R postgres:postgres "$dir"
    fi
    chmod 700 "$dir"
    as_server_user "$bin/initdb" -D "$dir/data" -U lbscale --pwfile="$dir/pwfile" \
        --auth-local=trust --auth-host=scram-sha-256 -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    rm -f "$dir/pwfile"
    make_certificates
    port=$(free_port)
    echo "$port" >"$dir/port"
    run_server "$bin" "$port" || exit 1
    echo "postgres://lbscale:$password@127.0.0.1:$port/postgres" >"$dir/url"
    chmod 600 "$dir/url"
    cat "$dir/url"
}

# A throwaway CA and a server certificate it signed, for the TLS tests.
make_certificates() {
    local t="$dir/tls"
    make_tls_certificates "$t" "lbscale test CA"
    if [ "$(id -u)" = 0 ]; then
        chown -R postgres:postgres "$t"
    fi
}

# Starts the cluster's server on `port` and waits (bounded) until it takes
# connections; the options are the same at every start (see `watch`).
run_server() {
    local bin=$1 port=$2 ok=
    as_server_user "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir/sock -c max_connections=300 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c ssl=on -c ssl_cert_file=$dir/tls/server.crt -c ssl_key_file=$dir/tls/server.key" \
        start >/dev/null || { cat "$dir/server.log" >&2; return 1; }
    for _ in $(seq 1 60); do
        if as_server_user "$bin/pg_isready" -q -h 127.0.0.1 -p "$port"; then ok=1; break; fi
        sleep 0.5
    done
    [ -n "$ok" ] || { log "the server did not become ready"; cat "$dir/server.log" >&2; return 1; }
}

server_pid() {
    head -1 "$dir/data/postmaster.pid" 2>/dev/null || true
}

# What is known about a server that is gone: the end of its log, and the
# kernel's last lines if they can be read (an OOM kill is only seen there).
report_death() {
    log "the PostgreSQL server (pid $1) is gone at $(date -u +%T); the end of its log:"
    tail -n 30 "$dir/server.log" 2>/dev/null | sed 's/^/    /' >&2 || true
    if dmesg >/dev/null 2>&1; then
        log "the kernel's last lines:"
        dmesg 2>/dev/null | tail -n 10 | sed 's/^/    /' >&2 || true
    fi
}

# The suite shares one server: should it die under the tests (it has happened
# once in CI, cause unknown), say so loudly with its log, and start it again on
# the same port and data (at most 3 times), so that only the tests that ran at
# that moment fail and the cause is in the output.
watch() {
    local pid restarts=0
    pid=$(server_pid)
    [ -n "$pid" ] || { log "no server is running in $dir"; exit 1; }
    while :; do
        while kill -0 "$pid" 2>/dev/null; do
            sleep 2
        done
        # A deliberate stop is neither reported nor undone.
        if [ ! -d "$dir" ] || [ -f "$dir/stopping" ]; then
            return 0
        fi
        report_death "$pid"
        [ "$restarts" -lt 3 ] || { log "not restarting it again"; return 0; }
        restarts=$((restarts + 1))
        log "starting it again on port $(cat "$dir/port") (restart $restarts of at most 3)"
        as_server_user rm -f "$dir/data/postmaster.pid"
        run_server "$(bindir)" "$(cat "$dir/port")" || return 0
        pid=$(server_pid)
    done
}

stop() {
    local bin pid
    touch "$dir/stopping" 2>/dev/null || true
    bin=$(bindir)
    pid=$(server_pid)
    if [ -n "$bin" ] && [ -n "$pid" ]; then
        if kill -0 "$pid" 2>/dev/null; then
            as_server_user "$bin/pg_ctl" -D "$dir/data" -m immediate -w -t 30 stop >/dev/null || true
        else
            report_death "$pid"
        fi
    fi
    rm -rf "$dir"
}

case "$cmd" in
start) start ;;
stop) stop ;;
watch) watch ;;
url) cat "$dir/url" ;;
ca) echo "$dir/tls/ca.pem" ;;
*)
    echo "usage: $0 start|stop|url|ca|watch" >&2
    exit 2
    ;;
esac
