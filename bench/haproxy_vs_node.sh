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
# Round robin everywhere. Each proxy gets one core (taskset -c $PROXY_CPU, one
# thread: HAProxy nbthread 1, lbscale-node's runtime sizes itself to its affinity).
#
# Output: requests/s, p50 and p99 latency for both, and the ratios
# node/haproxy (goal: rps >= 0.80, p99 <= 1.5).
set -euo pipefail

DURATION=${DURATION:-10s}
REPEAT=${REPEAT:-3}
CONNS=${CONNS:-50}
THREADS=${THREADS:-1}
PROXY_CPU=${PROXY_CPU:-1}
LOAD_CPU=${LOAD_CPU:-0}
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
  taskset -c "$LOAD_CPU" nginx -p "$d" -c "$d/nginx.conf" >"$d/logs/out.log" 2>&1 &
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
taskset -c "$PROXY_CPU" haproxy -f "$work/haproxy.cfg" -db >"$work/haproxy.log" 2>&1 &
pids+=($!)
wait_port $HA_HTTP "haproxy http"
wait_port $HA_TCP "haproxy tcp"

for mode in http tcp; do
  port=$NODE_HTTP; [ $mode = tcp ] && port=$NODE_TCP
  RUST_LOG=warn taskset -c "$PROXY_CPU" "$NODE_BIN" standalone --listen "$IP:$port" \
    --mode $mode --lb-method ROUNDROBIN --service "$IP:$B1" --service "$IP:$B2" \
    >"$work/node-$mode.out" 2>"$work/node-$mode.log" &
  pids+=($!)
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

# Prints "rps p50_ms p99_ms" for one wrk run against a port.
run_wrk() {
  local port=$1 out
  # Warm-up (connection pools, caches), then the measured run.
  timeout 30 taskset -c "$LOAD_CPU" wrk -t"$THREADS" -c"$CONNS" -d2s "http://$IP:$port/" >/dev/null 2>&1 || true
  out=$(timeout 120 taskset -c "$LOAD_CPU" wrk -t"$THREADS" -c"$CONNS" -d"$DURATION" --latency "http://$IP:$port/")
  echo "$out" >>"$work/wrk.log"
  if echo "$out" | grep -q "Non-2xx"; then
    say "warning: non-2xx responses on port $port:"; echo "$out" | grep -E "Non-2xx|errors" >&2
  fi
  local rps p50 p99
  rps=$(echo "$out" | awk '/^Requests\/sec:/{print $2}')
  p50=$(to_ms "$(echo "$out" | awk '$1=="50%"{print $2}')")
  p99=$(to_ms "$(echo "$out" | awk '$1=="99%"{print $2}')")
  echo "$rps $p50 $p99"
}

median() { printf '%s\n' "$@" | sort -g | awk '{v[NR]=$1} END{print v[int((NR+1)/2)]}'; }

printf '\nwrk -t%s -c%s -d%s x%s (medians), proxy on cpu %s, wrk+backends on cpu %s\n\n' \
  "$THREADS" "$CONNS" "$DURATION" "$REPEAT" "$PROXY_CPU" "$LOAD_CPU"
printf '%-4s %-13s %12s %10s %10s   %s\n' layer proxy "req/s" "p50 ms" "p99 ms" "runs (req/s)"
for layer in L7 L4; do
  if [ $layer = L7 ]; then hp=$HA_HTTP; np=$NODE_HTTP; else hp=$HA_TCP; np=$NODE_TCP; fi
  hr=(); h5=(); h9=(); nr=(); n5=(); n9=()
  for _ in $(seq 1 "$REPEAT"); do
    read -r a b c < <(run_wrk $hp); hr+=("$a"); h5+=("$b"); h9+=("$c")
    read -r a b c < <(run_wrk $np); nr+=("$a"); n5+=("$b"); n9+=("$c")
  done
  h_rps=$(median "${hr[@]}"); h_p50=$(median "${h5[@]}"); h_p99=$(median "${h9[@]}")
  n_rps=$(median "${nr[@]}"); n_p50=$(median "${n5[@]}"); n_p99=$(median "${n9[@]}")
  printf '%-4s %-13s %12s %10s %10s   %s\n' $layer haproxy "$h_rps" "$h_p50" "$h_p99" "${hr[*]}"
  printf '%-4s %-13s %12s %10s %10s   %s\n' $layer lbscale-node "$n_rps" "$n_p50" "$n_p99" "${nr[*]}"
  awk -v l=$layer -v hr="$h_rps" -v nr="$n_rps" -v h50="$h_p50" -v n50="$n_p50" -v h99="$h_p99" -v n99="$n_p99" 'BEGIN{
    r = nr/hr; q50 = n50/h50; q99 = n99/h99;
    ok = (r >= 0.80 && q99 <= 1.5) ? "meets goal" : "BELOW GOAL";
    printf "%-4s ratio node/haproxy: rps %.2f  p50 %.2f  p99 %.2f  (goal rps >= 0.80, p99 <= 1.50): %s\n\n", l, r, q50, q99, ok }'
done
printf 'load average during the run: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
