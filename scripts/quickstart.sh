#!/usr/bin/env bash
# lbscale quickstart: builds everything, applies examples/quickstart on the local
# cloud, then runs one whole autoscaling cycle with real traffic: load through the
# DNS distributor, a scale-out, the new node serving, the load stopping, a drain
# and a scale-in. It ends with the group's timeline and a chart of nodes and load.
#
#   ./scripts/quickstart.sh            set up, apply, scale out and in, plan, destroy
#   ./scripts/quickstart.sh --keep     leave the fleet, the daemon and the backends running
#   ./scripts/quickstart.sh --destroy  destroy what an earlier --keep left running
#
# Steps:
#   1. scripts/setup.sh: apt packages (dig, curl), protoc into .tools/protoc,
#      Terraform 1.0.3 into .tools/bin, `cargo build` of the provider, lbscale-node and lbscale;
#   2. scripts/package-provider.sh packages that debug build as a registry release
#      (with lbscale-node in the zip) into the filesystem mirror .tools/mirror; a
#      Terraform CLI configuration of its own (.tools/quickstart/terraformrc) takes
#      lbscale/lbscale from that mirror only, and `terraform init` installs it from
#      there (offline), writing examples/quickstart/.terraform.lock.hcl;
#   3. three HTTP backends on 127.0.0.1:18101-18103 that answer "backend-N" on /
#      and 64 KiB on /blob;
#   4. terraform apply in examples/quickstart (a dns distributor, a group of
#      real lbscale-node processes in one AZ, 1 to 2 nodes, scaled on throughput,
#      an SE group, an HTTP vserver);
#   5. `lbscale daemon` in the background (log: .tools/quickstart/daemon.log);
#   6. a DNS query to the distributor and a few requests through the node;
#   7. phase 1: `lbscale load` sends ~13 Mbps (24 requests/s of 64 KiB) through
#      the distributor, re-resolving every 2 s; above 8 Mbps per node for 3 s the
#      daemon scales out; the new node answers;
#   8. phase 2: the load stops; below 1 Mbps for 3 s the daemon scales in (the
#      node leaves DNS, drains, is deleted);
#   9. terraform plan -detailed-exitcode: nothing to change;
#  10. the timeline (`lbscale events`) and a chart, .tools/quickstart/scaling.svg;
#  11. terraform destroy (drains and removes every node); daemon and backends stopped.
#
# Environment:
#   LBSCALE_ADDRESS_PREFIX   loopback prefix of node addresses (default 127.0.)
#   LBSCALE_BACKEND_PORTS    backend ports on 127.0.0.1 (default "18101 18102 18103")
#   LBSCALE_DAEMON_PORT      port of the daemon's HTTP API on 127.0.0.1 (default 9464)
#   LBSCALE_LOAD_RATE        requests/s of the load generator (default 24)
#   LBSCALE_SKIP_SETUP=1     do not run scripts/setup.sh (already set up)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
example="$root/examples/quickstart"
work="$root/.tools/quickstart"
terraform="$root/.tools/bin/terraform"
domain="app.lbscale.test"
vs_port=8080
group="quickstart"
lbscale="$root/target/debug/lbscale"
state_url="sqlite://.lbscale/state.db" # relative to examples/quickstart, as in main.tf
daemon_port="${LBSCALE_DAEMON_PORT:-9464}"
daemon_api="http://127.0.0.1:$daemon_port"
load_rate="${LBSCALE_LOAD_RATE:-24}"
# The thresholds of examples/quickstart/main.tf, for the chart.
max_mbps=8
min_mbps=1

keep=0
destroy_only=0
for arg in "$@"; do
  case "$arg" in
    --keep) keep=1 ;;
    --destroy) destroy_only=1 ;;
    -h | --help)
      sed -n '2,40p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
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
daemon_pidfile="$work/daemon.pid"
samples="$work/samples.csv"

# --- Terraform, installing the provider from the mirror ----------------------------
mirror="$root/.tools/mirror"
export TF_CLI_CONFIG_FILE="$work/terraformrc"
cat >"$TF_CLI_CONFIG_FILE" <<EOF
# Written by scripts/quickstart.sh: lbscale/lbscale from the filesystem mirror that
# scripts/package-provider.sh fills with the provider built in this repository.
provider_installation {
  filesystem_mirror {
    path    = "$mirror"
    include = ["lbscale/lbscale"]
  }
  direct {
    exclude = ["lbscale/lbscale"]
  }
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

stop_daemon() {
  [ -f "$daemon_pidfile" ] || return 0
  local pid
  pid=$(cat "$daemon_pidfile")
  rm -f "$daemon_pidfile"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  # SIGTERM: the daemon finishes the evaluation in flight and gives up its claims.
  kill -TERM "$pid" 2>/dev/null || true
  timeout 20 bash -c "while kill -0 $pid 2>/dev/null; do sleep 0.2; done" ||
    { echo "quickstart: the daemon did not stop within 20 s of SIGTERM; killing it" >&2; kill -KILL "$pid" 2>/dev/null || true; }
}

# Background helpers of this run (load generator, sampler), ended by their pid.
helper_pids=()
stop_helpers() {
  local pid
  for pid in "${helper_pids[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
  for pid in "${helper_pids[@]}"; do
    timeout 10 bash -c "while kill -0 $pid 2>/dev/null; do sleep 0.1; done" || kill -KILL "$pid" 2>/dev/null || true
  done
  helper_pids=()
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
  stop_daemon
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
for bin in terraform-provider-lbscale lbscale-node lbscale; do
  [ -x "$root/target/debug/$bin" ] || die "target/debug/$bin was not built"
done
[ -x "$terraform" ] || die "$terraform was not installed"
info "terraform:  $terraform ($("$terraform" version | head -n1))"

has_resources() {
  [ -f "$example/terraform.tfstate" ] &&
    python3 -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get("resources") else 1)' \
      "$example/terraform.tfstate" 2>/dev/null
}
if has_resources; then
  die "examples/quickstart already has a fleet (an earlier --keep?): run ./scripts/quickstart.sh --destroy first"
fi

step "package the provider into the filesystem mirror $mirror"
"$root/scripts/package-provider.sh" --bin-dir "$root/target/debug" --mirror "$mirror" >/dev/null 2>"$work/package.log" ||
  { cat "$work/package.log" >&2; die "scripts/package-provider.sh failed (above)"; }
grep -E '^package-provider: (version|zip sha256)' "$work/package.log" | sed 's/^package-provider: /    /'

step "terraform init: lbscale/lbscale from the mirror (offline, $TF_CLI_CONFIG_FILE)"
# Each run packages a new build under the same version, whose hashes are not the
# ones an earlier run's lock file pinned: start from a fresh lock. (A user of a
# released version keeps the lock, and init checks the package against it.)
rm -rf "$example/.terraform" "$example/.terraform.lock.hcl"
if ! timeout 120 "$terraform" -chdir="$example" init -input=false -no-color >"$work/init.log" 2>&1; then
  cat "$work/init.log" >&2
  if grep -q "cannot search" "$work/init.log"; then
    die "there is no mirror at $mirror: make it with ./scripts/package-provider.sh --bin-dir target/debug --mirror $mirror"
  elif grep -q "checksums" "$work/init.log"; then
    die "the mirror's package is not the build examples/quickstart/.terraform.lock.hcl pins: delete that lock file (a new build of the same version has new hashes), or package the pinned build again"
  fi
  die "terraform init could not install lbscale/lbscale from $mirror (error above, log $work/init.log): package it there again with ./scripts/package-provider.sh --bin-dir target/debug --mirror $mirror"
fi
grep -E '^- (Installing|Installed)' "$work/init.log" | sed 's/^/    /'
lock_hash=$(grep -o '"h1:[^"]*"' "$example/.terraform.lock.hcl" | tr -d '"' || true)
[ -n "$lock_hash" ] || die "terraform init wrote no h1: hash into examples/quickstart/.terraform.lock.hcl"
info "examples/quickstart/.terraform.lock.hcl pins lbscale/lbscale $lock_hash"

# --- 2. backends -------------------------------------------------------------------
applied=0
finished=0
on_exit() {
  local rc=$?
  stop_helpers
  if [ "$keep" = 0 ] || [ "$finished" = 0 ]; then
    stop_daemon
  fi
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

if curl -s -o /dev/null --max-time 2 "$daemon_api/"; then
  die "127.0.0.1:$daemon_port is already in use; set LBSCALE_DAEMON_PORT to a free port"
fi

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
  # 64 KiB for the load generator: 24 requests/s of it are about 13 Mbps.
  head -c 65536 /dev/zero | tr '\0' 'x' >"$dir/blob"
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
applied=1
timeout 600 "$terraform" -chdir="$example" apply -auto-approve -no-color

dns_server=$(timeout 60 "$terraform" -chdir="$example" output -raw dns_server)
node_json=$(timeout 60 "$terraform" -chdir="$example" output -json nodes)
vip_json=$(timeout 60 "$terraform" -chdir="$example" output -json vip)
step "the fleet"
info "DNS server of the distributor: $dns_server"
python3 -c 'import json,sys; [print("    node", n) for n in json.loads(sys.argv[1])]' "$node_json"
info "vserver vip: $vip_json"

# --- 4. the daemon -----------------------------------------------------------------
# Helpers over the daemon's HTTP API (/v1/groups) and the store (lbscale status/events).
group_field() { # group_field EXPR: a Python expression over the group's first AZ `az`
  curl -s --max-time 2 "$daemon_api/v1/groups" | python3 -c '
import json, sys
try:
    gs = [g for g in json.load(sys.stdin)["groups"] if g["name"] == sys.argv[1]]
    az = gs[0]["azs"][0] if gs and gs[0]["azs"] else None
    g = gs[0] if gs else None
    print(eval(sys.argv[2]) if az else "")
except Exception:
    print("")
' "$group" "$1"
}
lbscale_in_example() { (cd "$example" && "$lbscale" "$@"); }

step "lbscale daemon --state $state_url --listen 127.0.0.1:$daemon_port (in examples/quickstart)"
(
  cd "$example"
  exec setsid "$lbscale" daemon --state "$state_url" --listen "127.0.0.1:$daemon_port" \
    --address-prefix "$TF_VAR_address_prefix" --node-binary "$root/target/debug/lbscale-node" \
    >"$work/daemon.log" 2>&1 </dev/null
) &
echo $! >"$daemon_pidfile"
info "log: $work/daemon.log"
timeout 20 bash -c "until curl -s --max-time 1 $daemon_api/healthz | grep -q ok; do sleep 0.2; done" ||
  die "the daemon did not answer on $daemon_api/healthz within 20 s (see $work/daemon.log)"
info "waiting (at most 20 s) for the daemon to claim group $group and evaluate it"
deadline=$((SECONDS + 20))
until [ "$(group_field 'g["owner"] == "self" and az["phase"] == "evaluating" and az["sample"] is not None')" = True ]; do
  [ $SECONDS -lt $deadline ] || die "the daemon did not start evaluating group $group within 20 s (see $work/daemon.log)"
  sleep 0.5
done
info "the daemon evaluates $group every second: $(group_field '"%d serving, sample %.2f Mbps per node" % (az["serving"], az["sample"]["throughput"])')"
lbscale_in_example status --state "$state_url" | sed 's/^/    /'

# --- 5. requests -------------------------------------------------------------------
dns_ip=${dns_server%:*}
dns_port=${dns_server##*:}
resolve() { timeout 15 dig @"$dns_ip" -p "$dns_port" "$domain" A +short +time=2 +tries=3 | grep -E '^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$' | sort || true; }
step "dig @$dns_ip -p $dns_port $domain A +short"
mapfile -t addresses < <(resolve)
[ ${#addresses[@]} -gt 0 ] || die "the distributor answered no address for $domain"
for a in "${addresses[@]}"; do info "$domain A $a"; done

# One request through node address $1; prints node, backend and status.
show_request() {
  local addr=$1 label=$2 headers="$work/headers" body node service status
  if body=$(curl -s --max-time 5 -D "$headers" --resolve "$domain:$vs_port:$addr" "http://$domain:$vs_port/"); then
    node=$(grep -i '^x-lbscale-node:' "$headers" | cut -d: -f2- | tr -d ' \r' || true)
    service=$(grep -i '^x-lbscale-service:' "$headers" | cut -d: -f2- | tr -d ' \r' || true)
    status=$(head -n1 "$headers" | tr -d '\r')
    printf '    %-4s %-15s node=%-28s service=%-10s body=%s  (%s)\n' \
      "$label" "$addr" "${node:--}" "${service:--}" "$(printf '%s' "$body" | tr -d '\n')" "$status"
    case "$status" in *" 200"*) return 0 ;; esac
  else
    printf '    %-4s %-15s request failed\n' "$label" "$addr"
  fi
  return 1
}
step "6 requests to http://$domain:$vs_port/ (round robin over the backends)"
ok=0
for n in $(seq 1 6); do
  if show_request "${addresses[$(((n - 1) % ${#addresses[@]}))]}" "#$n"; then ok=$((ok + 1)); fi
done
[ "$ok" -gt 0 ] || die "no request was answered"
info "$ok/6 requests answered with 200"

# --- 6. the scaling cycle ----------------------------------------------------------
# A sampler writes one line a second: the group as the daemon sees it and what the
# load generator received; the chart is drawn from it.
load_csv="$work/load.csv"
rm -f "$load_csv"
python3 - "$daemon_api" "$group" "$load_csv" "$samples" <<'PY' &
import json, os, sys, time, urllib.request
api, group, load_csv, out = sys.argv[1:5]
with open(out, "w") as f:
    f.write("t_ms,serving,provisioned,phase,load_mbps,sample_mbps\n")
    nxt = time.time()
    while True:
        serving = provisioned = phase = sample = ""
        try:
            with urllib.request.urlopen(api + "/v1/groups", timeout=1) as r:
                for g in json.load(r)["groups"]:
                    if g["name"] == group and g["azs"]:
                        az = g["azs"][0]
                        serving, provisioned, phase = az["serving"], az["provisioned"], az["phase"]
                        if az.get("sample"):
                            sample = "%.3f" % az["sample"]["throughput"]
        except Exception:
            pass
        load = 0.0
        try:
            with open(load_csv) as lf:
                last = lf.read().strip().splitlines()[-1].split(",")
            if last[0].isdigit() and time.time() * 1000 - int(last[0]) < 2500:
                load = float(last[2])
        except Exception:
            pass
        f.write("%d,%s,%s,%s,%.3f,%s\n" % (time.time() * 1000, serving, provisioned, phase, load, sample))
        f.flush()
        nxt += 1.0
        time.sleep(max(0.0, nxt - time.time()))
PY
helper_pids+=($!)

# The sampler's latest line as shell variables.
read_sample() {
  local line
  line=$(tail -n1 "$samples" 2>/dev/null || true)
  IFS=, read -r s_t s_serving s_provisioned s_phase s_load s_sample <<<"$line"
}
cycle_start=$SECONDS
progress() {
  read_sample
  printf '    t+%3ss  serving %-2s in cloud %-2s %-14s load %6.1f Mbps   daemon sample %6s Mbps/node\n' \
    "$((SECONDS - cycle_start))" "${s_serving:--}" "${s_provisioned:--}" "${s_phase:--}" "${s_load:-0}" "${s_sample:--}"
}
# wait_until WHAT SECONDS CONDITION: progress every 2 s until CONDITION holds.
wait_until() {
  local what=$1 limit=$2 cond=$3 deadline=$((SECONDS + $2))
  info "waiting (at most ${limit} s) for $what"
  while :; do
    read_sample
    if eval "$cond"; then progress; return 0; fi
    [ $SECONDS -lt $deadline ] || { progress; die "$what did not happen within ${limit} s (see $work/daemon.log)"; }
    progress
    sleep 2
  done
}

step "phase 1: load through the distributor ($load_rate requests/s of 64 KiB, about $((load_rate * 66 * 8 / 1000)) Mbps)"
info "lbscale load --url http://$domain:$vs_port/blob --dns $dns_server --rate $load_rate (log: $work/load.log)"
info "it asks the distributor for $domain every 2 s (the TTL), as a client would, and spreads requests over the answer"
info "the group scales out when the mean throughput per serving node stays above $max_mbps Mbps for 3 samples"
"$lbscale" load --url "http://$domain:$vs_port/blob" --dns "$dns_server" --resolve-every 2s \
  --rate "$load_rate" --connections 4 --duration 180s --report 2s --csv "$load_csv" \
  >"$work/load.log" 2>&1 </dev/null &
load_pid=$!
helper_pids+=("$load_pid")
load_started=$SECONDS
wait_until "the scale-out: 2 nodes serving" 60 '[ "${s_serving:-0}" = 2 ]'
mapfile -t addresses2 < <(resolve)
new_addr=
for a in "${addresses2[@]}"; do
  case " ${addresses[*]} " in *" $a "*) ;; *) new_addr=$a ;; esac
done
[ -n "$new_addr" ] || die "the distributor does not hand out a new address: ${addresses2[*]}"
step "the new node $new_addr is in DNS ($domain A: ${addresses2[*]}) and serves"
show_request "$new_addr" "new" || die "the new node $new_addr does not answer"
took_ms=$(grep -o 'decision_to_serving_ms=[0-9]*' "$work/daemon.log" | tail -n1 | cut -d= -f2 || true)
[ -z "$took_ms" ] || info "from the confirmed breach (the daemon's scale_out decision) to the new node serving: $took_ms ms"
info "slow start: the new node's backends ramp (1 request/s more every 2 s); what they may not take"
info "yet, the new node passes on to the older node. As the new node reports it (/v1/groups):"
ramp_seen=0
deadline=$((SECONDS + 40))
while [ $SECONDS -lt $deadline ]; do
  ramp=$(group_field '"; ".join("%s %.0f/%.0f" % (r["service"], r["requests_per_second"], r["cap_per_second"]) for r in az.get("slow_start", []))')
  if [ -n "$ramp" ]; then
    ramp_seen=1
    info "  t+$((SECONDS - cycle_start))s  in slow start (req/s received / cap): $ramp"
  elif [ "$ramp_seen" = 1 ]; then
    info "  t+$((SECONDS - cycle_start))s  the ramp is over: the new node takes its full share"
    break
  fi
  sleep 1
done
[ "$ramp_seen" = 1 ] || info "  (no sample caught the ramp: it ended between two of the daemon's samples)"
info "keeping the load on for 6 s: both nodes share it (the load generator's view: per node)"
for _ in 1 2 3; do
  progress
  sleep 2
done
grep '^load: .*nodes:' "$work/load.log" | tail -n1 | sed 's/^/    /'

step "phase 2: the load stops; below $min_mbps Mbps per node for 3 samples the group scales in"
kill -INT "$load_pid" 2>/dev/null || true
timeout 15 bash -c "while kill -0 $load_pid 2>/dev/null; do sleep 0.1; done" || die "the load generator did not stop within 15 s"
load_secs=$((SECONDS - load_started))
tail -n1 "$work/load.log" | sed 's/^/    /'
wait_until "the scale-in: back to 1 node serving and 1 in the cloud" 60 \
  '[ "${s_serving:-0}" = 1 ] && [ "${s_provisioned:-0}" = 1 ] && [ "${s_phase:-}" = evaluating ]'
cycle_secs=$((SECONDS - cycle_start))
mapfile -t addresses3 < <(resolve)
info "$domain A: ${addresses3[*]}"
sleep 2 # one more sample of the idle group for the chart

# --- 7. plan -----------------------------------------------------------------------
step "terraform plan -detailed-exitcode: nothing should change (the daemon's nodes are not drift)"
set +e
timeout 300 "$terraform" -chdir="$example" plan -detailed-exitcode -no-color
plan_rc=$?
set -e
case "$plan_rc" in
  0) info "plan is empty (exit code 0)" ;;
  2) die "the plan after the scaling cycle is not empty (exit code 2)" ;;
  *) die "terraform plan failed (exit code $plan_rc)" ;;
esac

# --- 8. timeline and chart ---------------------------------------------------------
stop_helpers
step "timeline: lbscale events --state $state_url --group $group"
lbscale_in_example events --state "$state_url" --group "$group" | sed 's/^/    /'
curl -s --max-time 5 "$daemon_api/v1/events?group=$group" >"$work/events.json" ||
  die "could not read $daemon_api/v1/events?group=$group"
step "chart of nodes and load over time"
"$lbscale" chart --samples "$samples" --events "$work/events.json" --out "$work/scaling.svg" \
  --max-mbps "$max_mbps" --min-mbps "$min_mbps" \
  --title "lbscale quickstart: group $group scales out under load and back in" >/dev/null
info "samples: $samples"
info "chart:   $work/scaling.svg"
info "load ran ${load_secs} s; the cycle (load start to back at 1 node) took ${cycle_secs} s"

# --- 9. destroy --------------------------------------------------------------------
if [ "$keep" = 1 ]; then
  finished=1
  step "kept running (--keep): the fleet, the daemon (pid $(cat "$daemon_pidfile")) and the backends"
  info "DNS:      dig @$dns_ip -p $dns_port $domain A +short"
  info "requests: curl -si --resolve $domain:$vs_port:${addresses3[0]:-${addresses[0]}} http://$domain:$vs_port/"
  info "load:     $lbscale load --url http://$domain:$vs_port/blob --dns $dns_server --rate $load_rate --duration 60s"
  info "status:   curl -s $daemon_api/v1/groups   (or: cd examples/quickstart && $lbscale status --state $state_url)"
  info "clean up: ./scripts/quickstart.sh --destroy"
  exit 0
fi
step "stopping the daemon (SIGTERM)"
stop_daemon
destroy
finished=1
stop_backends
step "done in $((SECONDS))s: the fleet is gone, the daemon and the backends are stopped"
