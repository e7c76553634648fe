#!/usr/bin/env bash
# A throwaway Azure Resource Manager (clouds/azure/fake: a fake that follows
# Azure's published OpenAPI definitions) for the tests of the azure driver.
#
#   scripts/azure-fake.sh start   starts it on 127.0.0.1 and a free port with
#                                 TLS (Python 3's standard library only) and
#                                 prints its endpoint URL
#   scripts/azure-fake.sh url     prints the endpoint URL of the running fake
#   scripts/azure-fake.sh ca      prints the path of the CA certificate (PEM)
#   scripts/azure-fake.sh stop    stops it (and what its VMs run) and removes
#                                 its files
#
# The fake is also Azure's login endpoint (AZURE_AUTHORITY_HOST) and the
# instance metadata identity endpoint (AZURE_POD_IDENTITY_AUTHORITY_HOST).
# Its state is in memory: each test uses a resource group of its own. Its
# files live in $LBSCALE_AZURE_FAKE_DIR (default /tmp/lbscale-azure-fake-$UID).
# Extra arguments after `start` go to the fake (see its --help).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${LBSCALE_AZURE_FAKE_DIR:-/tmp/lbscale-azure-fake-$(id -u)}
cmd=${1:-}
[ $# -gt 0 ] && shift

log() { echo "azure-fake.sh: $*" >&2; }
# shellcheck source=scripts/lib.sh
. "$root/scripts/lib.sh"

running() {
    [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null
}

start() {
    if running && [ -f "$dir/url" ]; then
        cat "$dir/url"
        return 0
    fi
    command -v openssl >/dev/null || {
        log "installing openssl (apt-get), for the fake's TLS certificate"
        local sudo=
        [ "$(id -u)" = 0 ] || sudo=sudo
        DEBIAN_FRONTEND=noninteractive timeout 900 $sudo apt-get install -y -qq --no-install-recommends openssl >&2
    }
    rm -rf "$dir"
    mkdir -p "$dir/vms"
    make_tls_certificates "$dir/tls" "lbscale azure fake CA"
    local port url
    port=$(free_port)
    url="https://127.0.0.1:$port"
    # Its own session, so that a test's process-group kill cannot reach it.
    setsid python3 "$root/clouds/azure/fake/azure_fake.py" --port "$port" \
        --cert "$dir/tls/server.crt" --key "$dir/tls/server.key" --vm-dir "$dir/vms" "$@" \
        >"$dir/server.log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    for _ in $(seq 1 100); do
        if curl -s --max-time 2 --cacert "$dir/tls/ca.pem" "$url/_fake/grants" >/dev/null 2>&1; then
            echo "$url" >"$dir/url"
            echo "$url"
            return 0
        fi
        if ! running; then
            log "the fake exited at start; its log:"
            tail -n 30 "$dir/server.log" >&2
            exit 1
        fi
        sleep 0.2
    done
    log "the fake did not answer on $url within 20s; its log:"
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
start) start "$@" ;;
stop) stop ;;
url) cat "$dir/url" ;;
ca) echo "$dir/tls/ca.pem" ;;
*)
    echo "usage: $0 start [fake options]|stop|url|ca" >&2
    exit 2
    ;;
esac
