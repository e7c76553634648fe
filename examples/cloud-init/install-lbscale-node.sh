#!/bin/sh
# Installs lbscale-node on a machine that is to become a node image (an AMI):
# downloads it from URL, refuses it unless its SHA-256 is SHA256, installs it as
# /usr/local/bin/lbscale-node, and installs and enables lbscale-node.service,
# which runs it with the settings a node's user data writes to /etc/lbscale at
# its first boot (see docs/image.md).
#
#   install-lbscale-node.sh URL SHA256
#
# URL is the release zip (terraform-provider-lbscale_VERSION_linux_ARCH.zip, which
# holds lbscale-node; SHA256 from its SHA256SUMS) or the lbscale-node binary
# itself; https:// (http:// only for a mirror you trust on your own network).
# ROOT=DIR installs into DIR instead of / (a tree for an image; the tests).
# Needs curl or wget, sha256sum, and python3 for a zip.
set -eu

die() {
    echo "install-lbscale-node: $*" >&2
    exit 1
}

[ $# -eq 2 ] || die "usage: install-lbscale-node.sh URL SHA256 (got $# arguments)"
url=$1
want=$(printf '%s' "$2" | tr 'A-F' 'a-f')
root=${ROOT:-}

case $url in
    https://* | http://*) ;;
    *) die "URL must start with https:// (or http://), got \"$url\"" ;;
esac
case $want in
    *[!0-9a-f]*) die "SHA256 must be 64 hex digits, got \"$2\"" ;;
esac
[ ${#want} -eq 64 ] || die "SHA256 must be 64 hex digits, got \"$2\""
command -v sha256sum >/dev/null || die "sha256sum is needed (coreutils)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Every try has a deadline; a slow mirror fails rather than hangs the boot.
if command -v curl >/dev/null; then
    curl -fsSL --proto '=https,http' --connect-timeout 10 --max-time 300 \
        --retry 3 -o "$work/download" "$url" || die "cannot download $url"
elif command -v wget >/dev/null; then
    wget -q --timeout=60 --tries=3 -O "$work/download" "$url" || die "cannot download $url"
else
    die "curl or wget is needed to download $url"
fi

got=$(sha256sum "$work/download" | cut -d' ' -f1)
[ "$got" = "$want" ] ||
    die "SHA-256 mismatch for $url: expected $want, got $got; nothing installed"

# A zip (it starts with "PK\3\4") holds the binary; anything else is the binary.
if [ "$(head -c 4 "$work/download" | od -An -c | tr -d ' ')" = 'PK003004' ]; then
    command -v python3 >/dev/null || die "python3 is needed to unpack the zip $url"
    python3 - "$work/download" "$work/lbscale-node" <<'EOF' || die "$url holds no lbscale-node"
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("lbscale-node"))
EOF
else
    mv "$work/download" "$work/lbscale-node"
fi
chmod 0755 "$work/lbscale-node"
# A binary for another architecture (or not a binary at all) stops here.
"$work/lbscale-node" --help >/dev/null 2>&1 ||
    die "the lbscale-node from $url does not run on this machine ($(uname -m))"

install -d -m 0755 "$root/usr/local/bin" "$root/etc/systemd/system/multi-user.target.wants"
install -d -m 0700 "$root/etc/lbscale"
install -m 0755 "$work/lbscale-node" "$root/usr/local/bin/.lbscale-node.new"
mv -f "$root/usr/local/bin/.lbscale-node.new" "$root/usr/local/bin/lbscale-node"

cat > "$root/etc/systemd/system/lbscale-node.service" <<'EOF'
# lbscale-node, a load-balancer node of an lbscale autoscale group; installed
# by install-lbscale-node.sh (examples/cloud-init). What each setting is and
# where it comes from: docs/image.md.

[Unit]
Description=lbscale-node: a load-balancer node of an lbscale autoscale group
Wants=network-online.target
After=network-online.target
# The node's settings are written by its user data at first boot: an instance
# without them (the one an image is made on) starts no node.
ConditionPathExists=/etc/lbscale/node.env
StartLimitIntervalSec=0

[Service]
Type=exec
# LBSCALE_NODE_ID, LBSCALE_LISTEN_IP, LBSCALE_API_ADDRESS, LBSCALE_API_PORT.
EnvironmentFile=/etc/lbscale/node.env
# The API's files are root's only (mode 0600); systemd hands the node a copy
# that its own user alone can read, in %d.
LoadCredential=token:/etc/lbscale/token
LoadCredential=ca.pem:/etc/lbscale/ca.pem
LoadCredential=node.pem:/etc/lbscale/node.pem
LoadCredential=node-key.pem:/etc/lbscale/node-key.pem
ExecStart=/usr/local/bin/lbscale-node serve --node-id ${LBSCALE_NODE_ID} --listen-ip ${LBSCALE_LISTEN_IP} --api-address ${LBSCALE_API_ADDRESS} --api-port ${LBSCALE_API_PORT} --token-file %d/token --tls-ca %d/ca.pem --tls-cert %d/node.pem --tls-key %d/node-key.pem --stats instance
# SIGTERM: the node stops at once; the engine drains a node before it removes it.
KillSignal=SIGTERM
Restart=always
RestartSec=2s
# Every client connection and every connection to a backend is a descriptor.
LimitNOFILE=1048576

# Sandbox. The node listens on the vservers' ports (any, 80 and 443 too),
# connects to backends and peers, and reads /proc/stat, /proc/meminfo and its
# cgroup's memory files for its statistics; it writes nothing.
DynamicUser=yes
AmbientCapabilities=CAP_NET_BIND_SERVICE
CapabilityBoundingSet=CAP_NET_BIND_SERVICE
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes
PrivateDevices=yes
DevicePolicy=closed
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
ProtectProc=invisible
RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
MemoryDenyWriteExecute=yes
RemoveIPC=yes
SystemCallArchitectures=native
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM
UMask=0077

[Install]
WantedBy=multi-user.target
EOF
chmod 0644 "$root/etc/systemd/system/lbscale-node.service"
# Enabled as `systemctl enable` would, which needs no running systemd.
ln -sf /etc/systemd/system/lbscale-node.service \
    "$root/etc/systemd/system/multi-user.target.wants/lbscale-node.service"
if [ -z "$root" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
fi
echo "install-lbscale-node: installed $root/usr/local/bin/lbscale-node (sha256 $want) and lbscale-node.service"
