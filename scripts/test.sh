#!/usr/bin/env bash
# Runs the whole test suite: unit, property, golden, data-plane and the
# acceptance tests that drive the real Terraform CLI against the freshly built
# provider. Installs what it needs first (scripts/setup.sh).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
"$root/scripts/setup.sh"
export LBSCALE_TERRAFORM="$root/.tools/bin/terraform"
# Two cores: run test binaries with two threads each; the acceptance tests
# pace themselves (each uses its own loopback prefix and store).
exec cargo test --workspace -- --test-threads=2 "$@"
