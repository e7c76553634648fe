#!/usr/bin/env bash
# A throwaway AWS API (moto's server) for the tests of the aws cloud driver.
#
#   scripts/moto.sh start   installs moto's server if missing (PyPI, into
#                           .tools/moto), starts it on 127.0.0.1 and a free
#                           port with TLS, and prints its endpoint URL
#   scripts/moto.sh url     prints the endpoint URL of the running server
#   scripts/moto.sh ca      prints the path of the CA certificate (PEM) that
#                           signed the server's certificate (IP 127.0.0.1 only)
#   scripts/moto.sh stop    stops the server and removes its files
#
# moto keeps its state in memory: every test uses names of its own. Its files
# live in $LBSCALE_MOTO_DIR (default /tmp/lbscale-moto-$UID).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${LBSCALE_MOTO_DIR:-/tmp/lbscale-moto-$(id -u)}
venv="$root/.tools/moto"
# Pinned: the driver's tests are written against this version's API shapes.
moto_version=5.2.5
cmd=${1:-}

log() { echo "moto.sh: $*" >&2; }
# shellcheck source=scripts/lib.sh
. "$root/scripts/lib.sh"

install() {
    if [ -x "$venv/bin/moto_server" ] && [ -f "$venv/.version-$moto_version" ]; then
        return 0
    fi
    local python=${PYTHON:-python3}
    if ! "$python" -m venv --help >/dev/null 2>&1 || ! "$python" -c 'import ensurepip' 2>/dev/null; then
        log "installing python3-venv (apt-get), for moto's virtual environment"
        local sudo=
        [ "$(id -u)" = 0 ] || sudo=sudo
        timeout 600 $sudo apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive timeout 900 $sudo apt-get install -y -qq --no-install-recommends python3-venv >&2
        python=python3
    fi
    command -v openssl >/dev/null || {
        log "installing openssl (apt-get), for the server's TLS certificate"
        local sudo=
        [ "$(id -u)" = 0 ] || sudo=sudo
        DEBIAN_FRONTEND=noninteractive timeout 900 $sudo apt-get install -y -qq --no-install-recommends openssl >&2
    }
    log "installing moto[server]==$moto_version into $venv (pip)"
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
    timeout 900 "$venv/bin/pip" install -q --disable-pip-version-check "moto[server]==$moto_version" >&2
    touch "$venv/.version-$moto_version"
}

# A throwaway CA and a certificate it signed for 127.0.0.1.
make_certificates() {
    make_tls_certificates "$dir/tls" "lbscale moto CA"
}

running() {
    [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null
}

start() {
    if running && [ -f "$dir/url" ]; then
        cat "$dir/url"
        return 0
    fi
    install
    rm -rf "$dir"
    mkdir -p "$dir"
    make_certificates
    local port url
    port=$(free_port)
    url="https://127.0.0.1:$port"
    # Its own session, so that a test's process-group kill cannot reach it.
    setsid "$venv/bin/moto_server" -H 127.0.0.1 -p "$port" \
        -c "$dir/tls/server.crt" -k "$dir/tls/server.key" >"$dir/server.log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    for _ in $(seq 1 100); do
        if curl -sf --max-time 2 --cacert "$dir/tls/ca.pem" "$url/moto-api/data.json" >/dev/null 2>&1; then
            echo "$url" >"$dir/url"
            echo "$url"
            return 0
        fi
        if ! running; then
            log "moto's server exited at start; its log:"
            tail -n 30 "$dir/server.log" >&2
            exit 1
        fi
        sleep 0.2
    done
    log "moto's server did not answer on $url within 20s; its log:"
    tail -n 30 "$dir/server.log" >&2
    exit 1
}

stop() {
    if running; then
        kill "$(cat "$dir/pid")" 2>/dev/null || true
    fi
    rm -rf "$dir"
}

case "$cmd" in
start) start ;;
stop) stop ;;
url) cat "$dir/url" ;;
ca) echo "$dir/tls/ca.pem" ;;
*)
    echo "usage: $0 start|stop|url|ca" >&2
    exit 2
    ;;
esac
