#!/usr/bin/env bash
# Runs the whole test suite: unit, property, golden, data-plane and the
# acceptance tests that drive the real Terraform CLI against the freshly built
# provider. Installs what it needs first (scripts/setup.sh), and starts a
# throwaway PostgreSQL server for the PostgreSQL store's tests
# (scripts/postgres.sh) and moto's server for the aws driver's tests
# (scripts/moto.sh) and the fake Azure API (scripts/azure-fake.sh), stopped
# again when the suite ends.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
"$root/scripts/setup.sh"
export LBSCALE_TERRAFORM="$root/.tools/bin/terraform"
# The Terraforms that the lifecycle and install tests run under: the pinned one,
# and the `terraform` on PATH when it is another version (what users run). A list
# of your own (colon-separated paths) wins; each entry must answer `version`.
tf_version() { CHECKPOINT_DISABLE=1 timeout 60 "$1" version -json 2>/dev/null | sed -n 's/.*"terraform_version": *"\([^"]*\)".*/\1/p'; }
if [ -z "${LBSCALE_TERRAFORMS:-}" ]; then
    LBSCALE_TERRAFORMS=$LBSCALE_TERRAFORM
    if current=$(command -v terraform) &&
        [ "$(tf_version "$current")" != "$(tf_version "$LBSCALE_TERRAFORM")" ]; then
        LBSCALE_TERRAFORMS="$LBSCALE_TERRAFORMS:$current"
    elif [ -z "${current:-}" ]; then
        echo "test.sh: no terraform on PATH: only the pinned 1.0.3 is tested; the tests of import blocks (1.5+) and terraform test (1.6+) are skipped, and fail under CI=true" >&2
    fi
fi
IFS=: read -r -a tf_list <<<"$LBSCALE_TERRAFORMS"
for tf in "${tf_list[@]}"; do
    [ -n "$tf" ] || continue
    if [ -z "$(tf_version "$tf")" ]; then
        echo "test.sh: LBSCALE_TERRAFORMS: $tf is not a Terraform CLI (no version from \`$tf version -json\`); fix the list (colon-separated paths) or unset it to test the pinned $LBSCALE_TERRAFORM and the terraform on PATH" >&2
        exit 2
    fi
    echo "test.sh: Terraform $(tf_version "$tf") ($tf)" >&2
done
export LBSCALE_TERRAFORMS
# Two cores: run test binaries with two threads each; the acceptance tests
# pace themselves (each uses its own loopback prefix and store).
# What this script started, stopped at exit (and only that: a server given
# through the environment is the caller's).
started=()
watcher=
cleanup() {
    # `|| true`: under set -e a watcher that already ended must not cut the
    # cleanup short before the servers are stopped.
    { [ -n "$watcher" ] && kill "$watcher" 2>/dev/null; } || true
    for s in "${started[@]}"; do "$root/scripts/$s.sh" stop || true; done
}
trap cleanup EXIT
if [ -z "${LBSCALE_TEST_POSTGRES_URL:-}" ]; then
    started+=(postgres)
    LBSCALE_TEST_POSTGRES_URL=$("$root/scripts/postgres.sh" start)
    LBSCALE_TEST_POSTGRES_CA=$("$root/scripts/postgres.sh" ca)
    export LBSCALE_TEST_POSTGRES_URL LBSCALE_TEST_POSTGRES_CA
    "$root/scripts/postgres.sh" watch &
    watcher=$!
fi
# moto's server (a real implementation of the AWS APIs) for the aws driver's tests.
if [ -z "${LBSCALE_TEST_AWS_ENDPOINT:-}" ]; then
    started+=(moto)
    LBSCALE_TEST_AWS_ENDPOINT=$("$root/scripts/moto.sh" start)
    LBSCALE_TEST_AWS_CA=$("$root/scripts/moto.sh" ca)
    export LBSCALE_TEST_AWS_ENDPOINT LBSCALE_TEST_AWS_CA
fi
# The fake Azure Resource Manager (it follows Azure's published API
# definitions; no emulator of these APIs exists) for the azure driver's tests.
# Its VMs run their custom data with the lbscale-node that setup.sh built.
if [ -z "${LBSCALE_TEST_AZURE_ENDPOINT:-}" ]; then
    started+=(azure-fake)
    LBSCALE_TEST_AZURE_ENDPOINT=$("$root/scripts/azure-fake.sh" start --run-custom-data --node-bin "$root/target/debug/lbscale-node")
    LBSCALE_TEST_AZURE_CA=$("$root/scripts/azure-fake.sh" ca)
    export LBSCALE_TEST_AZURE_ENDPOINT LBSCALE_TEST_AZURE_CA
fi
# --no-fail-fast: one run reports every failing test binary, not only the first.
cargo test --workspace --no-fail-fast -- --test-threads=2 "$@"
