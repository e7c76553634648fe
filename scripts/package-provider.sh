#!/usr/bin/env bash
# Packages terraform-provider-lbscale as a registry release and installs it into a
# Terraform filesystem mirror, so that `terraform init` installs it as it installs
# any provider (offline, with a lock file).
#
#   scripts/package-provider.sh                 release build (lto: takes minutes)
#   scripts/package-provider.sh --debug         the debug build (`cargo build`, as setup.sh)
#   scripts/package-provider.sh --bin-dir DIR   the binaries already in DIR; builds nothing
#
# Options:
#   --mirror DIR   the filesystem mirror to install into (default .tools/mirror)
#   --dist DIR     where the release files go (default target/dist)
#
# Prints the zip's path on stdout; progress and errors go to stderr.
#
# The package is terraform-provider-lbscale_VERSION_OS_ARCH.zip (VERSION from the
# crate, `cargo metadata`). It holds the provider as terraform-provider-lbscale_vVERSION
# and, beside it, lbscale-node: the local cloud starts nodes and distributors from
# the lbscale-node next to the provider, and Terraform unpacks the whole zip.
# The zip is reproducible: the same binaries give the same bytes (fixed dates).
#
# Release files in --dist, as a registry expects them:
#   terraform-provider-lbscale_VERSION_OS_ARCH.zip
#   terraform-provider-lbscale_VERSION_manifest.json   (= terraform-registry-manifest.json:
#                                                       plugin protocol 6.0)
#   terraform-provider-lbscale_VERSION_SHA256SUMS      (sha256sum format, both files above)
# Not made: SHA256SUMS.sig (a registry wants it signed with the publisher's GPG key).
#
# The mirror is in the packed layout, as `terraform providers mirror` writes it:
#   MIRROR/registry.terraform.io/lbscale/lbscale/terraform-provider-lbscale_VERSION_OS_ARCH.zip
#   MIRROR/registry.terraform.io/lbscale/lbscale/index.json, VERSION.json
# (the JSON files make the same directory a network mirror when served over HTTPS).
# Packed, not unpacked: Terraform then verifies the zip itself, so a lock file that
# records the zip's SHA-256 (`zh:`, as a registry's SHA256SUMS gives it) is checked
# against it; `terraform init` from it records the `h1:` hash of the zip's contents.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
profile=release
bin_dir=
mirror="$root/.tools/mirror"
dist="$root/target/dist"

die() {
  printf 'package-provider: error: %s\n' "$*" >&2
  exit 1
}
info() { printf 'package-provider: %s\n' "$*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --debug) profile=debug ;;
    --bin-dir)
      [ $# -ge 2 ] || die "--bin-dir needs a directory"
      bin_dir=$2
      shift
      ;;
    --mirror)
      [ $# -ge 2 ] || die "--mirror needs a directory"
      mirror=$2
      shift
      ;;
    --dist)
      [ $# -ge 2 ] || die "--dist needs a directory"
      dist=$2
      shift
      ;;
    -h | --help)
      sed -n '2,33p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *) die "unknown argument $1 (try --help)" ;;
  esac
  shift
done

command -v python3 >/dev/null || die "python3 is needed to write the zip and the JSON files; install python3"

version=$(cd "$root" && cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "terraform-provider-lbscale"))
') || die "could not read the provider's version with cargo metadata (run from a checkout with cargo on PATH)"

case "$(uname -s)_$(uname -m)" in
  Linux_x86_64) target=linux_amd64 ;;
  Linux_aarch64) target=linux_arm64 ;;
  *) die "unsupported platform $(uname -s) $(uname -m): the provider is built for linux_amd64 and linux_arm64" ;;
esac

if [ -z "$bin_dir" ]; then
  if [ "$profile" = release ]; then
    info "cargo build --release (lto = \"fat\", one codegen unit: this takes minutes; --debug packages the debug build)"
    (cd "$root" && cargo build --release --quiet -p terraform-provider-lbscale -p lbscale-node)
  else
    # The same command as scripts/setup.sh, so that after setup nothing is rebuilt.
    info "cargo build --workspace --bins (debug)"
    (cd "$root" && cargo build --workspace --bins --quiet)
  fi
  bin_dir="$root/target/$profile"
fi
for bin in terraform-provider-lbscale lbscale-node; do
  [ -x "$bin_dir/$bin" ] ||
    die "$bin_dir/$bin is missing: build it first (cargo build --workspace --bins) or give --bin-dir the directory that holds it"
done

name="terraform-provider-lbscale_${version}"
zip="${name}_${target}.zip"
mkdir -p "$dist" || die "cannot create $dist"
mirror_dir="$mirror/registry.terraform.io/lbscale/lbscale"
mkdir -p "$mirror_dir" || die "cannot create the mirror directory $mirror_dir"
# Absolute: the CLI configuration printed below must not depend on the directory.
mirror=$(cd "$mirror" && pwd)
dist=$(cd "$dist" && pwd)
mirror_dir="$mirror/registry.terraform.io/lbscale/lbscale"

h1=$(python3 - "$bin_dir" "$dist" "$mirror_dir" "$version" "$target" <<'PY'
import base64, hashlib, json, os, shutil, sys, zipfile

bin_dir, dist, mirror_dir, version, target = sys.argv[1:6]
name = "terraform-provider-lbscale_" + version
zip_name = "%s_%s.zip" % (name, target)
# Name in the zip -> file: the provider as the registry names it, lbscale-node beside it.
members = [
    ("terraform-provider-lbscale_v" + version, os.path.join(bin_dir, "terraform-provider-lbscale")),
    ("lbscale-node", os.path.join(bin_dir, "lbscale-node")),
]

def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

tmp = os.path.join(dist, zip_name + ".tmp")
with zipfile.ZipFile(tmp, "w") as z:
    for arcname, path in members:
        info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
        info.create_system = 3  # unix: the mode below is honoured on unpacking
        info.external_attr = (0o100755 & 0xFFFF) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        with open(path, "rb") as src, z.open(info, "w") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
os.replace(tmp, os.path.join(dist, zip_name))

manifest = json.dumps({"version": 1, "metadata": {"protocol_versions": ["6.0"]}}, indent=2) + "\n"
for f in ["terraform-registry-manifest.json", name + "_manifest.json"]:
    with open(os.path.join(dist, f), "w") as out:
        out.write(manifest)

released = [zip_name, name + "_manifest.json"]
with open(os.path.join(dist, name + "_SHA256SUMS"), "w") as out:
    for f in sorted(released):
        out.write("%s  %s\n" % (sha256_file(os.path.join(dist, f)), f))

# The mirror: the zip, and the network mirror protocol's index files (what
# `terraform providers mirror` writes): h1 is Terraform's hash of the contents.
shutil.copyfile(os.path.join(dist, zip_name), os.path.join(mirror_dir, zip_name))
lines = ["%s  %s\n" % (sha256_file(p), n) for n, p in sorted(members)]
h1 = "h1:" + base64.b64encode(hashlib.sha256("".join(lines).encode()).digest()).decode()
archives = {}
version_file = os.path.join(mirror_dir, version + ".json")
if os.path.exists(version_file):
    with open(version_file) as f:
        archives = json.load(f).get("archives", {})
archives[target] = {"url": zip_name, "hashes": [h1]}
with open(version_file, "w") as f:
    json.dump({"archives": archives}, f, indent=2)
    f.write("\n")
versions = sorted(
    fn[: -len(".json")] for fn in os.listdir(mirror_dir) if fn.endswith(".json") and fn != "index.json"
)
with open(os.path.join(mirror_dir, "index.json"), "w") as f:
    json.dump({"versions": {v: {} for v in versions}}, f, indent=2)
    f.write("\n")
print(h1)
PY
) || die "could not write the package (see the Python error above)"

zip_sha=$(cut -d' ' -f1 < <(grep " $zip\$" "$dist/${name}_SHA256SUMS"))
info "version $version ($target), from $bin_dir"
info "release files in $dist: $zip, ${name}_manifest.json, ${name}_SHA256SUMS"
info "zip sha256 (a lock file's zh:): $zip_sha; contents (the h1: terraform init records): $h1"
info "installed into the filesystem mirror $mirror"
info "use it with a Terraform CLI configuration (TF_CLI_CONFIG_FILE) holding:"
cat >&2 <<EOF
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
info "then terraform init; after repackaging a changed build of the same version, delete the"
info "configuration's .terraform.lock.hcl first (its hashes pin the earlier build)"
echo "$dist/$zip"
