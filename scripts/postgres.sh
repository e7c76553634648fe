#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests of the PostgreSQL store.
#
#   scripts/postgres.sh start   installs PostgreSQL if missing (apt-get), starts a
#                               private cluster on 127.0.0.1 and a free port, and
#                               prints its URL (user lbscale, a random password)
#   scripts/postgres.sh url     prints the URL of the running cluster
#   scripts/postgres.sh stop    stops the cluster and removes its files
#
# The cluster lives in $LBSCALE_PG_DIR (default /tmp/lbscale-pg-$UID). As root, the
# server runs as the `postgres` user (PostgreSQL refuses to run as root).
set -euo pipefail
dir=${LBSCALE_PG_DIR:-/tmp/lbscale-pg-$(id -u)}
cmd=${1:-}

log() { echo "postgres.sh: $*" >&2; }

as_server_user() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

bindir() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
    if [ -z "$d" ] && command -v pg_ctl >/dev/null; then
        d=$(dirname "$(command -v pg_ctl)")
    fi
    echo "$d"
}

install() {
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

free_port() {
    local p
    for _ in $(seq 1 50); do
        p=$((20000 + RANDOM % 20000))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
            echo "$p"
            return 0
        fi
    done
    log "no free port found"
    exit 1
}

start() {
    if [ -f "$dir/url" ] && [ -f "$dir/data/postmaster.pid" ]; then
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
    port=$(free_port)
    as_server_user "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 30 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir/sock -c max_connections=300 -c fsync=off -c synchronous_commit=off -c full_page_writes=off" \
        start >/dev/null || { cat "$dir/server.log" >&2; exit 1; }
    # Bounded wait until it takes connections on the port.
    local ok=
    for _ in $(seq 1 60); do
        if as_server_user "$bin/pg_isready" -q -h 127.0.0.1 -p "$port"; then ok=1; break; fi
        sleep 0.5
    done
    [ -n "$ok" ] || { log "the server did not become ready"; cat "$dir/server.log" >&2; exit 1; }
    echo "postgres://lbscale:$password@127.0.0.1:$port/postgres" >"$dir/url"
    chmod 600 "$dir/url"
    cat "$dir/url"
}

stop() {
    local bin
    bin=$(bindir)
    if [ -n "$bin" ] && [ -f "$dir/data/postmaster.pid" ]; then
        as_server_user "$bin/pg_ctl" -D "$dir/data" -m immediate -w -t 30 stop >/dev/null || true
    fi
    rm -rf "$dir"
}

case "$cmd" in
start) start ;;
stop) stop ;;
url) cat "$dir/url" ;;
*)
    echo "usage: $0 start|stop|url" >&2
    exit 2
    ;;
esac
