#!/usr/bin/env bash
# Benchmark: daemons against many groups on PostgreSQL, nodes simulated.
# Not a test: it prints figures.
#
#   bench/daemon_scale.sh                          # 10,000 groups, one daemon
#   DAEMONS=3 FAILOVER=1 bench/daemon_scale.sh     # three daemons, one killed
#
# GROUP_COUNT groups x 3 AZs x 2 nodes are written straight into a database
# of their own (daemon/examples/sim_fleet.rs `setup`: no Terraform, no
# provisioning), each with its own DNS distributor, min 2 / max 3 nodes per
# AZ, cpu thresholds 10..90. One process (`sim_fleet nodes`) serves every
# node's management API on one wildcard port, behind the same API as a real
# node: TLS with a certificate of the group's CA for the node's name, the
# engine's client certificate required, the node's token on every call; nodes
# are told apart by the loopback address a connection is made to (one each,
# in 127.100.0.0/16). They report cpu 50 % (no scaling), except the nodes of
# the first HOT groups (cpu 95 %: those scale out to max, so evaluations act).
# The daemons (`sim_fleet daemon`: the daemon's own code, with the cloud of
# simulated nodes registered as `local`) claim, resume, sample over TLS,
# step the policy, persist its state and run workflows as `lbscale daemon`.
#
# Once every group has been evaluated with a sample, it measures
# INTERVALS stats intervals and prints, per interval and per daemon: CPU (user
# + system, % of one core), resident memory (VmRSS; VmHWM at the end), store
# statements (round trips to PostgreSQL) and evaluations, and the lag from
# each group's due time to its evaluation (p50, p99 interpolated within the
# daemon's histogram buckets; max exact); per evaluation, the statements and
# the CPU time (what a shared machine's load distorts least), and the 1-minute
# load average at the end of the interval. With DAEMONS > 1: each daemon's
# share of the claims; with FAILOVER=1 one daemon is then killed (SIGKILL)
# and it prints how long until the survivors hold every group, and the
# longest time any group went without an evaluation meanwhile.
#
# Environment (all optional):
#   GROUP_COUNT=10000   groups (at most 10,800: one /16 of node addresses)
#   STATS_INTERVAL=60s  the groups' stats_interval
#   INTERVALS=3         intervals measured
#   DAEMONS=1           daemons on the store
#   FAILOVER=0          1: kill one daemon after measuring, time the takeover
#   HOT=5               groups whose nodes report cpu 95 %
#   PROFILE=release     cargo profile (release|dev)
#   BIN_DIR=path        use the sim_fleet binary there instead of building
#   NODE_PORT=29431     the simulated nodes' API port (0.0.0.0)
#   DAEMON_PORT=9480    the first daemon's HTTP port (127.0.0.1), then +1...
#   PG_URL=...          an admin URL of a PostgreSQL server; default:
#                       $LBSCALE_TEST_POSTGRES_URL (e.g. from
#                       `LBSCALE_PG_DIR=/tmp/pg-bench scripts/postgres.sh start`),
#                       whose server gets a database bench_daemon_scale (dropped
#                       and made again)
#   KEEP=0              1: keep the database and logs at the end
#   DAEMON_NOFILE=N     each daemon's limit on open files; default: the hard
#                       limit divided by DAEMONS
#
# File descriptors: the daemon keeps a connection per node between samples
# up to its open files limit less 2,048, and the simulated nodes hold the
# other end of each, in one process; the script raises `ulimit -n` to its
# hard limit and gives each daemon an equal part of it (on a machine whose
# hard limit is 20,000, one daemon keeps about 18,000 of the 60,000 nodes of
# 10,000 groups and dials the rest at every sample; three keep about 4,600
# each). Real nodes are hosts of their own: the daemons' limits need not
# add up to anything there.
set -euo pipefail

GROUP_COUNT=${GROUP_COUNT:-10000}
STATS_INTERVAL=${STATS_INTERVAL:-60s}
INTERVALS=${INTERVALS:-3}
DAEMONS=${DAEMONS:-1}
FAILOVER=${FAILOVER:-0}
HOT=${HOT:-5}
PROFILE=${PROFILE:-release}
NODE_PORT=${NODE_PORT:-29431}
DAEMON_PORT=${DAEMON_PORT:-9480}
KEEP=${KEEP:-0}
PG_URL=${PG_URL:-${LBSCALE_TEST_POSTGRES_URL:-}}
[ -n "$PG_URL" ] || { echo "daemon_scale: set PG_URL (or LBSCALE_TEST_POSTGRES_URL) to an admin URL of a PostgreSQL server; scripts/postgres.sh start prints one" >&2; exit 1; }
interval_s=${STATS_INTERVAL%s}
case "$interval_s" in *[!0-9]*) echo "daemon_scale: STATS_INTERVAL must be whole seconds (60s)" >&2; exit 1 ;; esac

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
if [ -z "${BIN_DIR:-}" ]; then
  echo "building sim_fleet (cargo --profile $PROFILE)" >&2
  (cd "$repo" && cargo build --profile "$PROFILE" -p lbscale-daemon --example sim_fleet >&2)
  dir=$PROFILE
  [ "$PROFILE" = dev ] && dir=debug
  BIN_DIR="$repo/target/$dir/examples"
fi
sim=$BIN_DIR/sim_fleet
[ -x "$sim" ] || { echo "daemon_scale: $sim is missing" >&2; exit 1; }

ulimit -n "$(ulimit -Hn)"
# The simulated nodes hold the other end of every daemon's kept connections
# in one process, under the same limit: the daemons share it.
DAEMON_NOFILE=${DAEMON_NOFILE:-$(( $(ulimit -Hn) / DAEMONS ))}
db=bench_daemon_scale
base=${PG_URL%/*}
query=
case "$PG_URL" in *\?*) query="?${PG_URL#*\?}" ;; esac
url="$base/$db$query"
if [ -n "${LBSCALE_TEST_POSTGRES_CA:-}" ] && [ -z "$query" ]; then
  url="$url?sslmode=verify-full&sslrootcert=$LBSCALE_TEST_POSTGRES_CA"
fi
psql -q "$PG_URL" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null
sql() { psql -qAt "$base/$db$query" -c "$1"; }

work=$(mktemp -d /tmp/lbscale-bench-scale.XXXXXX)
pids=()
finished=0
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    timeout 20 bash -c "while kill -0 $p 2>/dev/null; do sleep 0.2; done" || kill -9 "$p" 2>/dev/null || true
  done
  if [ "$finished" = 1 ] && [ "$KEEP" != 1 ]; then
    rm -rf "$work"
    psql -q "$PG_URL" -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true
  else
    echo "daemon_scale: logs kept in $work (database $db)" >&2
  fi
}
trap cleanup EXIT

start=$SECONDS
(cd "$work" && "$sim" setup "$url" "$GROUP_COUNT" "$NODE_PORT" "$STATS_INTERVAL") >"$work/setup.log" 2>&1 ||
  { tail -5 "$work/setup.log" >&2; exit 1; }
echo "setup: $(tail -1 "$work/setup.log")" >&2

(cd "$work" && exec "$sim" nodes "$url" "$NODE_PORT" "$HOT") >"$work/nodes.log" 2>&1 </dev/null &
nodes_pid=$!
pids+=("$nodes_pid")
timeout 120 bash -c "until grep -q serving '$work/nodes.log'; do kill -0 $nodes_pid || exit 1; sleep 0.5; done" ||
  { echo "daemon_scale: the simulated nodes did not start:" >&2; tail -5 "$work/nodes.log" >&2; exit 1; }
echo "nodes: $(head -1 "$work/nodes.log")" >&2

daemon_pids=()
for i in $(seq 0 $((DAEMONS - 1))); do
  (cd "$work" && ulimit -Sn "$DAEMON_NOFILE" && ulimit -Hn "$DAEMON_NOFILE" &&
    LBSCALE_LOG=${LBSCALE_LOG:-warn} exec "$sim" daemon "$url" "127.0.0.1:$((DAEMON_PORT + i))" "$NODE_PORT") \
    >"$work/daemon-$i.log" 2>&1 </dev/null &
  daemon_pids+=($!)
  pids+=($!)
done
t_started=$SECONDS

metrics() { curl -s --max-time 10 "http://127.0.0.1:$1/metrics" || true; }
# Groups with a live claim, per holder.
claims() {
  sql "SELECT holder, count(*) FROM leases WHERE group_id LIKE 'daemon/%' AND expires_ms > (extract(epoch from clock_timestamp()) * 1000)::bigint GROUP BY holder ORDER BY holder"
}
# AZs with a sample in the policy state's store rows is not enough: every
# group evaluated with a sample shows in the daemons' lbscale_sample series.
sampled() {
  local total=0 i n
  for i in $(seq 0 $((DAEMONS - 1))); do
    kill -0 "${daemon_pids[$i]}" 2>/dev/null || { echo "daemon_scale: daemon $i exited:" >&2; tail -5 "$work/daemon-$i.log" >&2; exit 1; }
    n=$(metrics $((DAEMON_PORT + i)) | grep -c '^lbscale_sample{.*metric="cpu"}' || true)
    total=$((total + n))
  done
  echo $((total / 3))
}
wait_s=$((600 + GROUP_COUNT / 10))
deadline=$((SECONDS + wait_s))
until [ "$(sampled)" -ge "$GROUP_COUNT" ]; do
  [ $SECONDS -lt $deadline ] || { echo "daemon_scale: $(sampled) of $GROUP_COUNT groups sampled within $wait_s s (see $work)" >&2; exit 1; }
  sleep 5
done
startup=$((SECONDS - t_started))
echo "every group claimed, resumed and sampled $startup s after the daemons started; measuring $INTERVALS intervals of $STATS_INTERVAL" >&2

# One line per daemon per interval, from /proc and /metrics.
snapshot() { # daemon index -> "cpu_ticks rss_kb statements evaluations lag_buckets... lag_max"
  local i=$1 pid=${daemon_pids[$1]}
  local m
  m=$(metrics $((DAEMON_PORT + i)))
  python3 -c '
import sys
stat = open(f"/proc/{sys.argv[1]}/stat").read().rsplit(")", 1)[1].split()
ticks = int(stat[11]) + int(stat[12])
rss = [l.split()[1] for l in open(f"/proc/{sys.argv[1]}/status") if l.startswith("VmRSS")][0]
vals = {}
buckets = []
for l in sys.stdin:
    if l.startswith("#"):
        continue
    name, _, v = l.rpartition(" ")
    if name.startswith("lbscale_evaluation_lag_seconds_bucket"):
        buckets.append(f"{name.split(chr(34))[1]}={v.strip()}")
    else:
        vals[name] = v.strip()
print(ticks, rss, vals.get("lbscale_store_statements_total", "0"), vals.get("lbscale_evaluations_total", "0"),
      vals.get("lbscale_evaluation_lag_max_seconds", "0"), ",".join(buckets))
' "$pid" <<<"$m"
}
report() { # before after seconds label
  python3 - "$@" <<'EOF'
import os, sys
b, a, secs, label = sys.argv[1].split(), sys.argv[2].split(), float(sys.argv[3]), sys.argv[4]
hz = os.sysconf("SC_CLK_TCK")
cpu = (int(a[0]) - int(b[0])) / hz / secs * 100
def buckets(s):
    out = []
    for kv in s.split(","):
        k, v = kv.split("=")
        out.append((float("inf") if k == "+Inf" else float(k), int(v)))
    return out
bb, ab = buckets(b[5]), buckets(a[5])
d = [(le, av - bv) for (le, bv), (_, av) in zip(bb, ab)]
n = d[-1][1]
def q(p):
    if n == 0:
        return float("nan")
    want, lo, prev = p * n, 0.0, 0
    for le, c in d:
        if c >= want:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (want - prev) / max(c - prev, 1)
        lo, prev = le, c
    return lo
top = max((le for i, (le, c) in enumerate(d) if c > (d[i - 1][1] if i else 0)), default=0)
evals = int(a[3]) - int(b[3])
statements = int(a[2]) - int(b[2])
cpu_s = (int(a[0]) - int(b[0])) / hz
# Per evaluation: what load on a shared machine distorts least.
per = (f"  per evaluation: {statements / evals:5.1f} statements, {cpu_s / evals * 1000:5.2f} ms cpu"
       if evals else "")
load = open("/proc/loadavg").read().split()[0]
print(f"  {label:<14} cpu {cpu:5.1f} %  rss {int(a[1]) / 1024:6.1f} MiB  statements {statements:7d}"
      f"  evaluations {evals:6d} ({evals / secs:5.1f}/s)  lag p50 {q(0.5) * 1000:7.1f} ms  p99 {q(0.99) * 1000:7.1f} ms"
      f"  max {'<= ' + str(top) + ' s' if top != float('inf') else '> 60 s'} (since start: {float(a[4]):.3f} s){per}  load {load}")
EOF
}

echo "daemon at scale: $GROUP_COUNT groups x 3 AZs x 2 nodes, stats_interval $STATS_INTERVAL, $DAEMONS daemon(s), PostgreSQL, $PROFILE build"
echo "  startup (claim, resume, first sample of every group): $startup s"
declare -a snap
for i in $(seq 0 $((DAEMONS - 1))); do snap[$i]=$(snapshot "$i"); done
first=("${snap[@]}")
# The daemons' CPU since they started: what the start cost them (the machine's
# other processes, the simulated nodes and PostgreSQL, share its wall time).
for i in $(seq 0 $((DAEMONS - 1))); do
  python3 -c 'import os, sys
snap, i, groups = sys.argv[1].split(), sys.argv[2], int(sys.argv[3]) / int(sys.argv[4])
s = int(snap[0]) / os.sysconf("SC_CLK_TCK")
print(f"  d{i} during the startup: CPU {s:.1f} s; per group (the groups shared evenly): {s * 1000 / groups:.2f} ms, {int(snap[2]) / groups:.1f} store statements")' \
    "${snap[$i]}" "$i" "$GROUP_COUNT" "$DAEMONS"
done
for k in $(seq 1 "$INTERVALS"); do
  t0=$(date +%s.%N)
  sleep "$interval_s"
  t1=$(date +%s.%N)
  for i in $(seq 0 $((DAEMONS - 1))); do
    now=$(snapshot "$i")
    report "${snap[$i]}" "$now" "$(echo "$t1 - $t0" | bc)" "interval $k d$i"
    snap[$i]=$now
  done
done
for i in $(seq 0 $((DAEMONS - 1))); do
  report "${first[$i]}" "${snap[$i]}" "$((INTERVALS * interval_s))" "all d$i"
  hwm=$(awk '/^VmHWM/ {print $2}' "/proc/${daemon_pids[$i]}/status")
  thr=$(awk '/^Threads/ {print $2}' "/proc/${daemon_pids[$i]}/status")
  kept=$(metrics $((DAEMON_PORT + i)) | awk '/^lbscale_node_connections_kept /{print $2}')
  limit=$(metrics $((DAEMON_PORT + i)) | awk '/^lbscale_node_connections_kept_limit /{print $2}')
  fds=$(find "/proc/${daemon_pids[$i]}/fd" -mindepth 1 -maxdepth 1 | wc -l)
  echo "  d$i peak rss $((hwm / 1024)) MiB, $thr threads, ${kept:-?} node connections kept (limit ${limit:-?}), $fds open files"
done
ps -o rss=,time= -p "$nodes_pid" | awk '{printf "  simulated nodes process: rss %.0f MiB, cpu time %s\n", $1/1024, $2}'

if [ "$DAEMONS" -gt 1 ]; then
  echo "  claims per daemon (groups: $GROUP_COUNT, a third: $((GROUP_COUNT / DAEMONS))):"
  claims | sed 's/^/    /'
fi

if [ "$FAILOVER" = 1 ] && [ "$DAEMONS" -gt 1 ]; then
  victim=${daemon_pids[0]}
  # Which holder is daemon 0: its claims are the ones that stop being renewed.
  holder0=$(grep -o 'holder=[^ ]*' "$work/daemon-0.log" | head -1 | cut -d= -f2 || true)
  [ -n "$holder0" ] || holder0=$(sql "SELECT DISTINCT holder FROM leases WHERE group_id LIKE 'daemon/%' AND holder LIKE 'daemon-$victim-%'")
  held=$(sql "SELECT count(*) FROM leases WHERE group_id LIKE 'daemon/%' AND holder = '$holder0' AND expires_ms > 0")
  kill -9 "$victim"
  t_kill=$(date +%s.%N)
  echo "  killed daemon 0 ($holder0, $held groups) with SIGKILL"
  deadline=$((SECONDS + 30 * interval_s + 120))
  until [ "$(sql "SELECT count(*) FROM leases WHERE group_id LIKE 'daemon/%' AND holder <> '$holder0' AND expires_ms > (extract(epoch from clock_timestamp()) * 1000)::bigint")" -ge "$GROUP_COUNT" ]; do
    [ $SECONDS -lt $deadline ] || { echo "daemon_scale: the survivors did not claim every group in time" >&2; break; }
    sleep 1
  done
  t_all=$(date +%s.%N)
  took=$(echo "$t_all - $t_kill" | bc | xargs printf '%.1f')
  echo "  every group claimed by the survivors $took s after the kill (claim TTL: 5 stats intervals, at least 10 s;"
  echo "  a group of the killed daemon went at most $took s + one interval ($interval_s s) without an evaluation)"
  for i in $(seq 1 $((DAEMONS - 1))); do snap[$i]=$(snapshot "$i"); done
  t0=$(date +%s.%N)
  sleep "$interval_s"
  t1=$(date +%s.%N)
  for i in $(seq 1 $((DAEMONS - 1))); do
    report "${snap[$i]}" "$(snapshot "$i")" "$(echo "$t1 - $t0" | bc)" "after d$i"
  done
  claims | sed 's/^/    /'
fi
finished=1
