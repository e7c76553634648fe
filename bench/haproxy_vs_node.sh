#!/usr/bin/env bash
# Benchmark: HAProxy (Debian package) vs lbscale-node, side by side on loopback,
# same two backends, same core budget. Not a test: it prints figures.
#
#   bench/haproxy_vs_node.sh            # run from the repository root (or anywhere)
#
# Environment (all optional):
#   DURATION=10s CONNS=50 THREADS=1     wrk settings
#   REPEAT=3                            runs per proxy and layer, alternating
#                                       haproxy/node; the medians are printed
#   PROXY_CPU=1 LOAD_CPU=0              cores: each proxy is pinned to PROXY_CPU,
#                                       wrk and the backends to LOAD_CPU
#   PIN=0                               pin nothing (the scheduler places everything)
#   NODE_THREADS=1                      lbscale-node --threads (1: one event loop,
#                                       as HAProxy's nbthread 1); empty: not passed
#                                       (the node sizes itself to its cores)
#   NODE_BIN=path                       use this lbscale-node instead of building
#   SKIP_INSTALL=1                      do not apt-get install haproxy/wrk/nginx
#   BENCH_IP=127.84.0.1                 loopback address for everything (ports 18080-18190)
#
# Backends: two nginx instances (Debian's nginx-light), one worker each, answering
# a 13-byte body from `return 200` (no disk access), keep-alive on.
# L7: HAProxy `mode http` (keep-alive both sides, http-reuse always) vs an
#     lbscale-node standalone HTTP vserver.
# L4: HAProxy `mode tcp` vs an lbscale-node TCP vserver; the traffic is still HTTP
#     (wrk keep-alive connections relayed as byte streams).
# Round robin everywhere. Each proxy gets one thread (HAProxy nbthread 1,
# lbscale-node --threads 1), pinned to one core (taskset -c $PROXY_CPU) unless PIN=0.
#
# Output: requests/s, p50 and p99 latency and CPU per request (the proxy
# process's user + system time over the measured run, divided by its requests)
# for both, and the ratios node/haproxy (goal: rps >= 1.0, p99 <= 1.0, CPU per
# request <= 1.0). Run CONNS=1 as well as the default 50.
set -euo pipefail

DURATION=${DURATION:-10s}
REPEAT=${REPEAT:-3}
CONNS=${CONNS:-50}
THREADS=${THREADS:-1}
PROXY_CPU=${PROXY_CPU:-1}
LOAD_CPU=${LOAD_CPU:-0}
PIN=${PIN:-1}
NODE_THREADS=${NODE_THREADS-1}
threads_arg=()
[ -n "$NODE_THREADS" ] && threads_arg=(--threads "$NODE_THREADS")
IP=${BENCH_IP:-127.84.0.1}   # a loopback address of its own, away from other services
B1=18081 B2=18082 HA_HTTP=18080 HA_TCP=18090 NODE_HTTP=18180 NODE_TCP=18190

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
work=$(mktemp -d /tmp/lbscale-bench.XXXXXX)
pids=()

cleanup() {
  local p
  for p in "${pids[@]:-}"; do
    [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  # Bounded wait for them to go, then force.
  for _ in $(seq 1 50); do
    local alive=0
    for p in "${pids[@]:-}"; do
      [ -n "$p" ] && kill -0 "$p" 2>/dev/null && alive=1
    done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]:-}"; do
    [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

say() { printf '%s\n' "$*" >&2; }

# Command prefixes that put a process on its core (none with PIN=0). Not a
# function: a backgrounded function would be a subshell, and $! not the process.
px=(); ld=()
if [ "$PIN" != 0 ]; then px=(taskset -c "$PROXY_CPU"); ld=(taskset -c "$LOAD_CPU"); fi

# --- tools ---------------------------------------------------------------------
need_install=()
command -v haproxy >/dev/null || need_install+=(haproxy)
command -v wrk >/dev/null || need_install+=(wrk)
command -v nginx >/dev/null || need_install+=(nginx-light)
command -v taskset >/dev/null || need_install+=(util-linux)
if [ "${#need_install[@]}" -gt 0 ]; then
  if [ "${SKIP_INSTALL:-0}" = 1 ]; then
    say "missing: ${need_install[*]} (SKIP_INSTALL=1)"; exit 1
  fi
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  say "installing ${need_install[*]} ..."
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 $sudo apt-get install -y "${need_install[@]}" >/dev/null 2>&1 || {
    timeout 300 $sudo apt-get update >/dev/null
    timeout 300 $sudo apt-get install -y "${need_install[@]}" >/dev/null
  }
fi

if [ -z "${NODE_BIN:-}" ]; then
  say "building lbscale-node (release) ..."
  (cd "$repo" && cargo build --release -p lbscale-node >&2)
  tdir=${CARGO_TARGET_DIR:-$repo/target}
  NODE_BIN=$tdir/release/lbscale-node
fi
[ -x "$NODE_BIN" ] || { say "no lbscale-node binary at $NODE_BIN"; exit 1; }

# Waits (bounded) until HOST:PORT accepts connections.
wait_port() {
  local port=$1 what=$2
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/$IP/$port") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  say "timed out after 10 s waiting for $what on $IP:$port; logs:"
  tail -n 20 "$work"/*.log "$work"/nginx-*/logs/*.log >&2 2>/dev/null || true
  exit 1
}

# --- backends -----------------------------------------------------------------
for port in $B1 $B2; do
  d=$work/nginx-$port; mkdir -p "$d/logs"
  cat >"$d/nginx.conf" <<NGX
worker_processes 1;
daemon off;
pid $d/nginx.pid;
error_log $d/logs/error.log crit;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 60s;
  client_body_temp_path $d/tmp;
  server {
    listen $IP:$port reuseport;
    location / { return 200 "hello, world\n"; }
  }
}
NGX
  "${ld[@]}" nginx -p "$d" -c "$d/nginx.conf" >"$d/logs/out.log" 2>&1 &
  pids+=($!)
  wait_port "$port" "nginx backend"
done

# --- proxies ------------------------------------------------------------------
cat >"$work/haproxy.cfg" <<HAP
global
  nbthread 1
  maxconn 4000
  log stderr local0 emerg
defaults
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend http_in
  mode http
  option http-keep-alive
  bind $IP:$HA_HTTP
  default_backend http_be
backend http_be
  mode http
  balance roundrobin
  http-reuse always
  server s1 $IP:$B1
  server s2 $IP:$B2
listen tcp_in
  mode tcp
  bind $IP:$HA_TCP
  balance roundrobin
  server s1 $IP:$B1
  server s2 $IP:$B2
HAP
"${px[@]}" haproxy -f "$work/haproxy.cfg" -db >"$work/haproxy.log" 2>&1 &
pids+=($!)
ha_pid=$!
wait_port $HA_HTTP "haproxy http"
wait_port $HA_TCP "haproxy tcp"

for mode in http tcp; do
  port=$NODE_HTTP; [ $mode = tcp ] && port=$NODE_TCP
  RUST_LOG=warn "${px[@]}" "$NODE_BIN" standalone --listen "$IP:$port" \
    --mode $mode --lb-method ROUNDROBIN --service "$IP:$B1" --service "$IP:$B2" \
    "${threads_arg[@]}" >"$work/node-$mode.out" 2>"$work/node-$mode.log" &
  pids+=($!)
  eval "node_${mode}_pid=$!"
  wait_port "$port" "lbscale-node $mode"
done

# --- load ---------------------------------------------------------------------
to_ms() { # wrk latency value (e.g. 512.00us, 1.23ms, 2.00s) -> ms
  awk -v v="$1" 'BEGIN{
    if (v ~ /us$/) { sub(/us$/,"",v); printf "%.3f", v/1000 }
    else if (v ~ /ms$/) { sub(/ms$/,"",v); printf "%.3f", v }
    else if (v ~ /m$/) { sub(/m$/,"",v); printf "%.3f", v*60000 }
    else if (v ~ /s$/) { sub(/s$/,"",v); printf "%.3f", v*1000 }
    else printf "%s", v }'
}

# CPU time (user + system) of a process so far, in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)

# Prints "rps p50_ms p99_ms cpu_us_per_request" for one wrk run against a
# port served by process PID.
run_wrk() {
  local port=$1 pid=$2 out t0 t1
  # Warm-up (connection pools, caches), then the measured run.
  timeout 30 "${ld[@]}" wrk -t"$THREADS" -c"$CONNS" -d2s "http://$IP:$port/" >/dev/null 2>&1 || true
  t0=$(cpu_ticks "$pid")
  out=$(timeout 120 "${ld[@]}" wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" --latency "http://$IP:$port/")
  t1=$(cpu_ticks "$pid")
  echo "$out" >>"$work/wrk.log"
  if echo "$out" | grep -q "Non-2xx"; then
    say "warning: non-2xx responses on port $port:"; echo "$out" | grep -E "Non-2xx|errors" >&2
  fi
  local rps p50 p99 reqs cpu
  rps=$(echo "$out" | awk '/^Requests\/sec:/{print $2}')
  p50=$(to_ms "$(echo "$out" | awk '$1=="50%"{print $2}')")
  p99=$(to_ms "$(echo "$out" | awk '$1=="99%"{print $2}')")
  reqs=$(echo "$out" | awk '/requests in/{print $1}')
  cpu=$(awk -v a="$t0" -v b="$t1" -v hz="$hz" -v n="$reqs" 'BEGIN{printf "%.2f", (b - a) / hz * 1e6 / n}')
  echo "$rps $p50 $p99 $cpu"
}

median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END{print v[int((NR+1)/2)]}'; }

if [ "$PIN" = 0 ]; then where="nothing pinned"; else
  where="proxy on cpu $PROXY_CPU, wrk+backends on cpu $LOAD_CPU"; fi
printf '\nwrk -t%s -c%s -d%s x%s (medians), %s, lbscale-node --threads %s\n\n' \
  "$THREADS" "$CONNS" "$DURATION" "$REPEAT" "$where" "${NODE_THREADS:-(default)}"
printf '%-4s %-13s %12s %10s %10s %12s   %s\n' layer proxy "req/s" "p50 ms" "p99 ms" "CPU us/req" "runs (req/s p99)"
for layer in L7 L4; do
  # The machine's load before each layer: figures of a busy machine are read as such.
  printf '(load average before %s: %s)\n' $layer "$(cut -d' ' -f1-3 /proc/loadavg)"
  if [ $layer = L7 ]; then hp=$HA_HTTP; np=$NODE_HTTP; npid=$node_http_pid
  else hp=$HA_TCP; np=$NODE_TCP; npid=$node_tcp_pid; fi
  hr=(); h5=(); h9=(); hc=(); nr=(); n5=(); n9=(); nc=()
  for _ in $(seq 1 "$REPEAT"); do
    read -r a b c d < <(run_wrk $hp $ha_pid); hr+=("$a"); h5+=("$b"); h9+=("$c"); hc+=("$d")
    read -r a b c d < <(run_wrk $np $npid); nr+=("$a"); n5+=("$b"); n9+=("$c"); nc+=("$d")
  done
  h_rps=$(median "${hr[@]}"); h_p50=$(median "${h5[@]}"); h_p99=$(median "${h9[@]}"); h_cpu=$(median "${hc[@]}")
  n_rps=$(median "${nr[@]}"); n_p50=$(median "${n5[@]}"); n_p99=$(median "${n9[@]}"); n_cpu=$(median "${nc[@]}")
  hruns=""; nruns=""
  for i in "${!hr[@]}"; do hruns+="${hr[$i]} ${h9[$i]}, "; nruns+="${nr[$i]} ${n9[$i]}, "; done
  printf '%-4s %-13s %12s %10s %10s %12s   %s\n' $layer haproxy "$h_rps" "$h_p50" "$h_p99" "$h_cpu" "${hruns%, }"
  printf '%-4s %-13s %12s %10s %10s %12s   %s\n' $layer lbscale-node "$n_rps" "$n_p50" "$n_p99" "$n_cpu" "${nruns%, }"
  awk -v l=$layer -v hr="$h_rps" -v nr="$n_rps" -v h50="$h_p50" -v n50="$n_p50" -v h99="$h_p99" -v n99="$n_p99" \
      -v hc="$h_cpu" -v nc="$n_cpu" 'BEGIN{
    r = nr/hr; q50 = n50/h50; q99 = n99/h99; c = nc/hc;
    ok = (r >= 1.0 && q99 <= 1.0 && c <= 1.0) ? "meets goal" : "BELOW GOAL";
    printf "%-4s ratio node/haproxy: rps %.2f  p50 %.2f  p99 %.2f  CPU/req %.2f  (goal rps >= 1.0, p99 <= 1.0, CPU/req <= 1.0): %s\n\n", l, r, q50, q99, c, ok }'
done
printf 'load average during the run: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
