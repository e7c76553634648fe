#!/usr/bin/env bash
# Azure's official Python SDKs, pinned, in a virtual environment of their own
# (.tools/azure-sdk): the clients that prove the fake ARM server speaks
# Azure's wire format (clouds/azure/tests/sdk). Installs them when missing
# (PyPI) and prints the environment's python.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.tools/azure-sdk"
# Pinned: the SDK test is written against these versions.
packages=(
    azure-identity==1.27.0
    azure-mgmt-network==33.1.0
    azure-mgmt-compute==39.0.0
    azure-mgmt-trafficmanager==2.0.0
    azure-mgmt-dns==9.0.0
)
stamp="$venv/.versions-$(printf '%s\n' "${packages[@]}" | cksum | cut -d' ' -f1)"
log() { echo "azure-sdk.sh: $*" >&2; }
if [ ! -x "$venv/bin/python" ] || [ ! -f "$stamp" ]; then
    python=${PYTHON:-python3}
    if ! "$python" -m venv --help >/dev/null 2>&1 || ! "$python" -c 'import ensurepip' 2>/dev/null; then
        log "installing python3-venv (apt-get)"
        sudo=
        [ "$(id -u)" = 0 ] || sudo=sudo
        timeout 600 $sudo apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive timeout 900 $sudo apt-get install -y -qq --no-install-recommends python3-venv >&2
        python=python3
    fi
    log "installing ${packages[*]} into $venv (pip)"
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2
    timeout 900 "$venv/bin/pip" install -q --disable-pip-version-check "${packages[@]}" >&2
    touch "$stamp"
fi
echo "$venv/bin/python"
