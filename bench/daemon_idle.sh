#!/usr/bin/env bash
# Benchmark: what the sidecar daemon costs while it watches many idle groups.
# Not a test: it prints figures.
#
#   bench/daemon_idle.sh             # run from anywhere
#
# It applies GROUP_COUNT autoscale groups (one node each, behind one DNS distributor,
# stats_interval 1 s: every node sampled every second, the busiest the daemon gets
# short of scaling) with the real Terraform CLI and the provider, starts
# `lbscale daemon` on the same store, waits until it has claimed and sampled every
# group, then measures it over SECONDS_MEASURED seconds from /proc: CPU (user +
# system, in % of one core), resident memory (VmRSS, VmHWM) and threads.
# Everything is destroyed at the end.
#
# Environment (all optional):
#   GROUP_COUNT=100              groups (and node processes)
#   SECONDS_MEASURED=30     measuring window
#   STATS_INTERVAL=1s       the groups' stats_interval
#   PROFILE=release         cargo profile of the binaries (release|dev)
#   BIN_DIR=path            use the binaries there instead of building
#   ADDRESS_PREFIX=127.86.  loopback prefix of the nodes (one /16 of its own)
#   DAEMON_PORT=9474        the daemon's HTTP API on 127.0.0.1
#   SETUP=terraform         how the groups are made: terraform (apply, destroy at
#                           the end) or engine (the many_groups example writes them
#                           straight into a throwaway store: for 1,000 groups, where
#                           an apply takes long; its nodes are stopped at the end)
#
# Besides CPU it prints the CPU time per loop tick (the daemon wakes every 200 ms
# to look for due groups, and evaluates each group every stats_interval): the
# cost of one tick at GROUP_COUNT idle groups, evaluations included.
#
#   GROUP_COUNT=1000 STATS_INTERVAL=10s SETUP=engine bench/daemon_idle.sh
set -euo pipefail

GROUP_COUNT=${GROUP_COUNT:-100}
SECONDS_MEASURED=${SECONDS_MEASURED:-30}
STATS_INTERVAL=${STATS_INTERVAL:-1s}
PROFILE=${PROFILE:-release}
ADDRESS_PREFIX=${ADDRESS_PREFIX:-127.86.}
DAEMON_PORT=${DAEMON_PORT:-9474}
SETUP=${SETUP:-terraform}

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
terraform=$("$repo/scripts/install-terraform.sh")

if [ -z "${BIN_DIR:-}" ]; then
  echo "building lbscale, lbscale-node and the provider (cargo --profile $PROFILE)" >&2
  (cd "$repo" && cargo build --profile "$PROFILE" -p lbscale-cli -p lbscale-node -p terraform-provider-lbscale >&2)
  (cd "$repo" && cargo build --profile "$PROFILE" -p lbscale-daemon --example many_groups >&2)
  dir=$PROFILE
  [ "$PROFILE" = dev ] && dir=debug
  BIN_DIR="$repo/target/$dir"
fi
many_groups=$BIN_DIR/many_groups
[ -x "$many_groups" ] || many_groups=$BIN_DIR/examples/many_groups
for b in lbscale lbscale-node terraform-provider-lbscale; do
  [ -x "$BIN_DIR/$b" ] || { echo "daemon_idle: $BIN_DIR/$b is missing" >&2; exit 1; }
done

work=$(mktemp -d /tmp/lbscale-bench-daemon.XXXXXX)
daemon_pid=
applied=0
finished=0
cleanup() {
  if [ -n "$daemon_pid" ]; then
    kill "$daemon_pid" 2>/dev/null || true
    timeout 20 bash -c "while kill -0 $daemon_pid 2>/dev/null; do sleep 0.2; done" ||
      kill -9 "$daemon_pid" 2>/dev/null || true
  fi
  if [ "$applied" = 1 ] && [ "$SETUP" = engine ]; then
    # The example's nodes are local processes under the throwaway store.
    pids=$(pgrep -f "lbscale-node.*$ADDRESS_PREFIX" || true)
    [ -z "$pids" ] || kill $pids 2>/dev/null || true
    destroyed=1
  elif [ "$applied" = 1 ]; then
    echo "destroying the $GROUP_COUNT groups" >&2
    timeout 900 "$terraform" -chdir="$work" destroy -auto-approve -no-color >"$work/destroy.log" 2>&1 ||
      echo "daemon_idle: destroy failed, see $work/destroy.log" >&2
  fi
  # The logs are kept when something failed.
  if [ "$finished" = 1 ] && { [ "${destroyed:-0}" = 1 ] || grep -q "Destroy complete" "$work/destroy.log" 2>/dev/null; }; then
    rm -rf "$work"
  else
    echo "daemon_idle: logs kept in $work" >&2
  fi
  return 0
}
trap cleanup EXIT

export TF_CLI_CONFIG_FILE="$work/terraformrc" CHECKPOINT_DISABLE=1 TF_INPUT=0 TF_IN_AUTOMATION=1
cat >"$TF_CLI_CONFIG_FILE" <<EOF
provider_installation {
  dev_overrides {
    "lbscale/lbscale" = "$BIN_DIR"
  }
  direct {}
}
EOF
cat >"$work/main.tf" <<EOF
terraform {
  required_providers {
    lbscale = { source = "lbscale/lbscale" }
  }
}
provider "lbscale" {
  local {
    address_prefix = "$ADDRESS_PREFIX"
    node_binary    = "$BIN_DIR/lbscale-node"
  }
}
resource "lbscale_traffic_distributor" "dns" {
  name   = "bench-idle"
  cloud  = "local"
  mode   = "dns"
  domain = "idle.lbscale.test"
  ttl    = "1s"
}
resource "lbscale_autoscale_group" "g" {
  count                  = $GROUP_COUNT
  name                   = "idle-\${count.index}"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.dns.id
  min_nodes              = 1
  max_nodes              = 2
  stats_interval         = "$STATS_INTERVAL"
  watch_time             = "3s"
  drain_timeout          = "1s"
  threshold {
    metric = "cpu"
    min    = 10
    max    = 90
  }
  node {
    memory_limit_mb = 64
  }
}
EOF

applied=1
start=$SECONDS
if [ "$SETUP" = engine ]; then
  [ -x "$many_groups" ] || { echo "daemon_idle: $many_groups is missing" >&2; exit 1; }
  echo "many_groups: $GROUP_COUNT groups, one node each ($work)" >&2
  mkdir -p "$work/.lbscale"
  LBSCALE_NODE="$BIN_DIR/lbscale-node" timeout 3600 "$many_groups" "$work/.lbscale" "$ADDRESS_PREFIX" "$GROUP_COUNT" "$STATS_INTERVAL" \
    >"$work/apply.log" 2>&1 || { tail -20 "$work/apply.log" >&2; exit 1; }
else
  echo "terraform apply: $GROUP_COUNT groups, one node each ($work)" >&2
  timeout 1800 "$terraform" -chdir="$work" apply -auto-approve -no-color -parallelism=10 >"$work/apply.log" 2>&1 ||
    { tail -20 "$work/apply.log" >&2; exit 1; }
fi
echo "applied in $((SECONDS - start)) s" >&2

(cd "$work" && exec "$BIN_DIR/lbscale" daemon --state sqlite://.lbscale/state.db --listen "127.0.0.1:$DAEMON_PORT" \
  --address-prefix "$ADDRESS_PREFIX" --node-binary "$BIN_DIR/lbscale-node" \
  >"$work/daemon.log" 2>&1 </dev/null) &
daemon_pid=$!

# Every group claimed by this daemon and sampled at least once.
sampled() {
  curl -s --max-time 2 "http://127.0.0.1:$DAEMON_PORT/v1/groups" | python3 -c '
import json, sys
try:
    gs = json.load(sys.stdin)["groups"]
except Exception:
    print(0); sys.exit()
print(sum(1 for g in gs if g.get("owner") == "self" and g["azs"] and all(a.get("sample") is not None for a in g["azs"])))
'
}
wait_s=$((120 + GROUP_COUNT / 10))
deadline=$((SECONDS + wait_s))
until [ "$(sampled)" -ge "$GROUP_COUNT" ]; do
  kill -0 "$daemon_pid" 2>/dev/null || { echo "daemon_idle: the daemon exited:" >&2; tail -5 "$work/daemon.log" >&2; exit 1; }
  [ $SECONDS -lt $deadline ] || { echo "daemon_idle: the daemon sampled $(sampled) of $GROUP_COUNT groups within $wait_s s (see $work/daemon.log)" >&2; exit 1; }
  sleep 1
done
echo "the daemon claims and samples all $GROUP_COUNT groups; measuring for $SECONDS_MEASURED s" >&2

ticks=$(getconf CLK_TCK)
cpu_ticks() { awk '{print $14 + $15}' "/proc/$daemon_pid/stat"; }
t0=$(cpu_ticks)
s0=$(date +%s.%N)
sleep "$SECONDS_MEASURED"
t1=$(cpu_ticks)
s1=$(date +%s.%N)
rss=$(awk '/^VmRSS/ {print $2}' "/proc/$daemon_pid/status")
hwm=$(awk '/^VmHWM/ {print $2}' "/proc/$daemon_pid/status")
threads=$(awk '/^Threads/ {print $2}' "/proc/$daemon_pid/status")
nodes=$(pgrep -f -c "lbscale-node.*$ADDRESS_PREFIX" || true) # the nodes and the distributor
still=$(sampled)

python3 - "$t0" "$t1" "$s0" "$s1" "$ticks" "$rss" "$hwm" "$threads" "$GROUP_COUNT" "$nodes" "$still" "$STATS_INTERVAL" "$PROFILE" <<'EOF'
import sys
t0, t1, s0, s1, hz = (float(x) for x in sys.argv[1:6])
rss, hwm, threads, groups, nodes, still = (int(x) for x in sys.argv[6:12])
interval, profile = sys.argv[12], sys.argv[13]
cpu = (t1 - t0) / hz / (s1 - s0) * 100
print(f"daemon idle with {groups} groups ({nodes} lbscale-node processes: the nodes and the DNS distributor; stats_interval {interval}; {profile} build):")
print(f"  CPU      {cpu:.1f} % of one core over {s1 - s0:.0f} s")
print(f"  memory   {rss / 1024:.1f} MB resident (peak {hwm / 1024:.1f} MB)")
print(f"  threads  {threads}")
print(f"  per loop tick (200 ms)  {(t1 - t0) / hz * 1000 / ((s1 - s0) / 0.2):.1f} ms of CPU")
print(f"  groups still sampled by this daemon at the end: {still}")
EOF
finished=1
