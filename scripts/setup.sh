#!/usr/bin/env bash
# Installs what lbscale needs to build and test on a Debian machine, then builds
# the workspace. Idempotent: a second run only rebuilds what changed.
#   - protoc with its well-known types, into .tools/protoc, from the crates.io
#     crate protoc-bin-vendored (scripts/install-protoc.sh): the gRPC code of
#     tf-provider and of lbscale-node's management API is generated at build
#     time, and no system protoc is needed;
#   - dig (dnsutils), curl: the quickstart and the tests query the local DNS
#     distributor and the vservers with real clients;
#   - systemd-analyze (systemd; it need not be running): the daemon's unit in
#     examples/systemd is checked with it;
#   - faketime (libfaketime): a test runs a daemon whose clock is 30 s fast;
#   - Terraform 1.0.3, into .tools/bin (scripts/install-terraform.sh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

need=()
command -v dig >/dev/null 2>&1 || need+=(dnsutils)
command -v curl >/dev/null 2>&1 || need+=(curl)
command -v faketime >/dev/null 2>&1 || need+=(faketime) # tests/acceptance/tests/daemon_clock_skew.rs
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd) # systemd-analyze, systemd-sysusers: cli/tests/daemon_reference.rs checks examples/systemd
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]} (apt)" >&2
  if [ "$(id -u)" -ne 0 ]; then sudo=sudo; else sudo=; fi
  timeout 600 $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive timeout 900 $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

protoc=$("$root/scripts/install-protoc.sh")
echo "setup: protoc at $protoc" >&2

terraform=$("$root/scripts/install-terraform.sh")
echo "setup: terraform at $terraform" >&2

echo "setup: building the workspace (cargo build)" >&2
cargo build --workspace --bins --quiet
echo "setup: done" >&2
