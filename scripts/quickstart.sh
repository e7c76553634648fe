#!/usr/bin/env bash
# lbscale quickstart: builds everything, then applies examples/quickstart on the
# local cloud and shows requests flowing through the autoscaled fleet.
#
#   ./scripts/quickstart.sh            set up, apply, query, plan, destroy
#   ./scripts/quickstart.sh --keep     leave the fleet and the backends running
#   ./scripts/quickstart.sh --destroy  destroy what an earlier --keep left running
#
# Steps:
#   1. scripts/setup.sh: apt packages (protoc, dig, curl), Terraform 1.0.3 into
#      .tools/bin, `cargo build` of the provider, lbscale-node and lbscale;
#   2. a Terraform CLI configuration of its own (.tools/quickstart/terraformrc)
#      with dev_overrides for lbscale/lbscale -> target/debug, so no registry and
#      no `terraform init` are needed;
#   3. three HTTP backends on 127.0.0.1:18101-18103 that answer "backend-N";
#   4. terraform apply in examples/quickstart (a dns distributor, a group of
#      real lbscale-node processes in two AZs, an SE group, an HTTP vserver);
#   5. a DNS query to the distributor, then requests to app.lbscale.test:8080 on
#      each resolved node, printing which node and which backend answered;
#   6. terraform plan -detailed-exitcode: nothing to change;
#   7. terraform destroy (drains and removes every node), backends stopped.
#
# Environment:
#   LBSCALE_ADDRESS_PREFIX   loopback prefix of node addresses (default 127.0.)
#   LBSCALE_BACKEND_PORTS    backend ports on 127.0.0.1 (default "18101 18102 18103")
#   LBSCALE_SKIP_SETUP=1     do not run scripts/setup.sh (already set up)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
example="$root/examples/quickstart"
work="$root/.tools/quickstart"
terraform="$root/.tools/bin/terraform"
domain="app.lbscale.test"
vs_port=8080

keep=0
destroy_only=0
for arg in "$@"; do
  case "$arg" in
    --keep) keep=1 ;;
    --destroy) destroy_only=1 ;;
    -h | --help)
      sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "quickstart: unknown argument $arg (try --help)" >&2
      exit 2
      ;;
  esac
done

step() { printf '\n==> %s\n' "$*"; }
info() { printf '    %s\n' "$*"; }
die() {
  printf 'quickstart: error: %s\n' "$*" >&2
  exit 1
}

read -r -a backend_ports <<<"${LBSCALE_BACKEND_PORTS:-18101 18102 18103}"
[ ${#backend_ports[@]} -gt 0 ] || die "LBSCALE_BACKEND_PORTS is empty"

mkdir -p "$work"
pidfile="$work/backends.pids"

# --- Terraform, talking to the freshly built provider ------------------------------
export TF_CLI_CONFIG_FILE="$work/terraformrc"
cat >"$TF_CLI_CONFIG_FILE" <<EOF
# Written by scripts/quickstart.sh: use the provider built in this repository.
provider_installation {
  dev_overrides {
    "lbscale/lbscale" = "$root/target/debug"
  }
  direct {}
}
EOF
export CHECKPOINT_DISABLE=1
export TF_INPUT=0
export TF_IN_AUTOMATION=1
export TF_VAR_address_prefix="${LBSCALE_ADDRESS_PREFIX:-127.0.}"
TF_VAR_backend_ports="[$(
  IFS=,
  echo "${backend_ports[*]}"
)]"
export TF_VAR_backend_ports

stop_backends() {
  [ -f "$pidfile" ] || return 0
  local pid
  while read -r pid; do
    [ -n "$pid" ] || continue
    # Each backend runs in its own session (setsid): end its process group.
    kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
  done <"$pidfile"
  rm -f "$pidfile"
}

clean_example() {
  rm -rf "$example/.lbscale" "$example/terraform.tfstate" "$example/terraform.tfstate.backup"
}

destroy() {
  step "terraform destroy: drain and remove every node, deregister every address"
  if timeout 600 "$terraform" -chdir="$example" destroy -auto-approve -no-color; then
    clean_example
  else
    echo "quickstart: terraform destroy failed; the state is kept in $example" >&2
    return 1
  fi
}

if [ "$destroy_only" = 1 ]; then
  [ -x "$terraform" ] || die "$terraform is missing: run ./scripts/quickstart.sh first"
  if [ -f "$example/terraform.tfstate" ]; then destroy; else info "no state in $example: nothing to destroy"; fi
  stop_backends
  step "done"
  exit 0
fi

# --- 1. setup ----------------------------------------------------------------------
if [ "${LBSCALE_SKIP_SETUP:-0}" = 1 ]; then
  step "setup skipped (LBSCALE_SKIP_SETUP=1)"
else
  step "setup: packages, Terraform, cargo build (the first build takes a few minutes)"
  "$root/scripts/setup.sh"
fi
for bin in terraform-provider-lbscale lbscale-node; do
  [ -x "$root/target/debug/$bin" ] || die "target/debug/$bin was not built"
done
[ -x "$terraform" ] || die "$terraform was not installed"
info "terraform:  $terraform ($("$terraform" version | head -n1))"
info "provider:   $root/target/debug/terraform-provider-lbscale (dev_overrides in $TF_CLI_CONFIG_FILE)"

has_resources() {
  [ -f "$example/terraform.tfstate" ] &&
    python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get("resources") else 1)' \
      "$example/terraform.tfstate" 2>/dev/null
}
if has_resources; then
  die "examples/quickstart already has a fleet (an earlier --keep?): run ./scripts/quickstart.sh --destroy first"
fi

# --- 2. backends -------------------------------------------------------------------
applied=0
finished=0
on_exit() {
  local rc=$?
  if [ "$finished" = 0 ] && [ "$applied" = 1 ] && [ "$keep" = 0 ]; then
    echo "quickstart: failed; destroying what was created" >&2
    destroy || true
  fi
  if [ "$keep" = 0 ] || [ "$finished" = 0 ]; then
    stop_backends
  fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

step "starting ${#backend_ports[@]} HTTP backends on 127.0.0.1"
stop_backends
: >"$pidfile"
i=0
for port in "${backend_ports[@]}"; do
  i=$((i + 1))
  if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$port/"; then
    die "127.0.0.1:$port is already in use; set LBSCALE_BACKEND_PORTS to free ports"
  fi
  dir="$work/backend-$i"
  mkdir -p "$dir"
  printf 'backend-%s\n' "$i" >"$dir/index.html"
  setsid nohup python3 -m http.server "$port" --bind 127.0.0.1 --directory "$dir" \
    >"$work/backend-$i.log" 2>&1 </dev/null &
  echo $! >>"$pidfile"
done
i=0
for port in "${backend_ports[@]}"; do
  i=$((i + 1))
  timeout 20 bash -c "until curl -s -o /dev/null http://127.0.0.1:$port/; do sleep 0.2; done" ||
    die "backend-$i did not start on 127.0.0.1:$port (see $work/backend-$i.log)"
  info "backend-$i on 127.0.0.1:$port answers \"$(curl -s --max-time 2 "http://127.0.0.1:$port/")\""
done

# --- 3. apply ----------------------------------------------------------------------
step "terraform apply in examples/quickstart (address prefix $TF_VAR_address_prefix)"
info "no terraform init: dev_overrides point Terraform at target/debug"
applied=1
timeout 600 "$terraform" -chdir="$example" apply -auto-approve -no-color

dns_server=$(timeout 60 "$terraform" -chdir="$example" output -raw dns_server)
node_json=$(timeout 60 "$terraform" -chdir="$example" output -json nodes)
vip_json=$(timeout 60 "$terraform" -chdir="$example" output -json vip)
step "the fleet"
info "DNS server of the distributor: $dns_server"
python3 -c 'import json,sys; [print("    node", n) for n in json.loads(sys.argv[1])]' "$node_json"
info "vserver vip: $vip_json"

# --- 4. requests -------------------------------------------------------------------
dns_ip=${dns_server%:*}
dns_port=${dns_server##*:}
step "dig @$dns_ip -p $dns_port $domain A +short"
answer=$(timeout 15 dig @"$dns_ip" -p "$dns_port" "$domain" A +short +time=2 +tries=3) ||
  die "the DNS query to $dns_server failed"
mapfile -t addresses < <(printf '%s\n' "$answer" | grep -E '^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$' || true)
[ ${#addresses[@]} -gt 0 ] || die "the distributor answered no address for $domain: '$answer'"
for a in "${addresses[@]}"; do info "$domain A $a"; done

step "12 requests to http://$domain:$vs_port/, one resolved node after another"
ok=0
for n in $(seq 1 12); do
  addr=${addresses[$(((n - 1) % ${#addresses[@]}))]}
  headers="$work/headers"
  if body=$(curl -s --max-time 5 -D "$headers" --resolve "$domain:$vs_port:$addr" "http://$domain:$vs_port/"); then
    node=$(grep -i '^x-lbscale-node:' "$headers" | cut -d: -f2- | tr -d ' \r' || true)
    service=$(grep -i '^x-lbscale-service:' "$headers" | cut -d: -f2- | tr -d ' \r' || true)
    status=$(head -n1 "$headers" | tr -d '\r')
    printf '    #%-2s %-15s node=%-28s service=%-10s body=%s  (%s)\n' \
      "$n" "$addr" "${node:--}" "${service:--}" "$(printf '%s' "$body" | tr -d '\n')" "$status"
    case "$status" in *" 200"*) ok=$((ok + 1)) ;; esac
  else
    printf '    #%-2s %-15s request failed\n' "$n" "$addr"
  fi
done
[ "$ok" -gt 0 ] || die "no request was answered"
info "$ok/12 requests answered with 200"

# --- 5. plan -----------------------------------------------------------------------
step "terraform plan -detailed-exitcode: nothing should change"
set +e
timeout 300 "$terraform" -chdir="$example" plan -detailed-exitcode -no-color
plan_rc=$?
set -e
case "$plan_rc" in
  0) info "plan is empty (exit code 0)" ;;
  2) die "the plan after apply is not empty (exit code 2)" ;;
  *) die "terraform plan failed (exit code $plan_rc)" ;;
esac

# --- 6. destroy --------------------------------------------------------------------
if [ "$keep" = 1 ]; then
  finished=1
  step "kept running (--keep)"
  info "DNS:      dig @$dns_ip -p $dns_port $domain A +short"
  info "requests: curl -si --resolve $domain:$vs_port:${addresses[0]} http://$domain:$vs_port/"
  info "clean up: ./scripts/quickstart.sh --destroy"
  exit 0
fi
destroy
finished=1
stop_backends
step "done: the fleet is gone and the backends are stopped"
