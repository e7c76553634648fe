# shellcheck shell=bash
# Shell functions shared by the scripts that run throwaway test servers
# (postgres.sh, moto.sh). Sourced, not run. Each caller defines `log`.

# A free TCP port on 127.0.0.1 (one nothing answers on), printed.
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

# make_tls_certificates DIR CA_NAME: a throwaway CA (DIR/ca.pem, its key
# deleted) and a server certificate it signed for IP 127.0.0.1 only
# (DIR/server.crt, DIR/server.key mode 0600). openssl's output goes to
# DIR/openssl.log, shown when it fails.
make_tls_certificates() {
    local t=$1 ca_name=$2
    mkdir -p "$t"
    (
        cd "$t"
        openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=$ca_name" \
            -keyout ca.key -out ca.pem
        openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" -keyout server.key -out server.csr
        printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' >server.ext
        openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
            -extfile server.ext -out server.crt
    ) >"$t/openssl.log" 2>&1 || { cat "$t/openssl.log" >&2; exit 1; }
    rm -f "$t/ca.key" "$t/server.csr"
    chmod 600 "$t/server.key"
    chmod 644 "$t/ca.pem"
}
