#!/usr/bin/env bash
# A stand-in for Google's Compute Engine and Cloud DNS APIs (clouds/gcp/fake),
# for the tests of the gcp cloud driver. Python's standard library and openssl
# only: nothing to install.
#
#   scripts/gcp-fake.sh start   starts the fake on 127.0.0.1 and a free port with
#                               TLS, and prints its endpoint URL
#   scripts/gcp-fake.sh url     prints the endpoint URL of the running fake
#   scripts/gcp-fake.sh ca      prints the CA certificate (PEM) of its TLS
#   scripts/gcp-fake.sh key     prints the path of its service-account key (JSON)
#   scripts/gcp-fake.sh metadata  prints its metadata server's host:port
#   scripts/gcp-fake.sh stop    stops it and removes its files
#
# With $LBSCALE_GCP_FAKE_NODE_BIN (a directory holding lbscale-node), an
# instance whose private address is on loopback (a subnetwork of 127.x made
# through /_fake/subnetworks) runs its startup script as its boot would, and is
# stopped when it is deleted or the fake stops.
#
# Its files live in $LBSCALE_GCP_FAKE_DIR (default /tmp/lbscale-gcp-fake-$UID);
# each test of the driver starts its own in a directory of its own.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${LBSCALE_GCP_FAKE_DIR:-/tmp/lbscale-gcp-fake-$(id -u)}
cmd=${1:-}

log() { echo "gcp-fake.sh: $*" >&2; }
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
    command -v openssl >/dev/null || { log "openssl is needed (the TLS certificate and the service-account key)"; exit 1; }
    rm -rf "$dir"
    mkdir -p "$dir"
    make_tls_certificates "$dir/tls" "lbscale gcp fake CA"
    local port meta url
    port=$(free_port)
    meta=$(free_port)
    url="https://127.0.0.1:$port"
    # Its own session, so that a test's process-group kill cannot reach it.
    local boot=()
    [ -z "${LBSCALE_GCP_FAKE_NODE_BIN:-}" ] || boot=(--node-bin "$LBSCALE_GCP_FAKE_NODE_BIN")
    setsid python3 "$root/clouds/gcp/fake/gcp_fake.py" --dir "$dir" --port "$port" --metadata-port "$meta" \
        --cert "$dir/tls/server.crt" --key "$dir/tls/server.key" "${boot[@]}" >"$dir/server.log" 2>&1 </dev/null &
    echo $! >"$dir/pid"
    for _ in $(seq 1 100); do
        if curl -sf --max-time 2 --cacert "$dir/tls/ca.pem" -X POST "$url/_fake/state" >/dev/null 2>&1; then
            echo "$url" >"$dir/url"
            echo "127.0.0.1:$meta" >"$dir/metadata"
            echo "$url"
            return 0
        fi
        if ! running; then
            log "the fake exited at start; its log:"
            tail -n 30 "$dir/server.log" >&2
            exit 1
        fi
        sleep 0.1
    done
    log "the fake did not answer on $url within 10s; its log:"
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
key) echo "$dir/service-account.json" ;;
metadata) cat "$dir/metadata" ;;
*)
    echo "usage: $0 start|stop|url|ca|key|metadata" >&2
    exit 2
    ;;
esac
