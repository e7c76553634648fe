#!/usr/bin/env bash
# Puts protoc and its well-known types (google/protobuf/*.proto) into
# <repo>/.tools/protoc/{bin,include}, which scripts/protoc runs (.cargo/config.toml points PROTOC there).
# They come from crates.io's protoc-bin-vendored crate at the version pinned in
# Cargo.lock (lbscale-proto's build dependency), so a machine needs no system
# protoc (Debian's protobuf-compiler without libprotobuf-dev lacks the includes).
# Prints the protoc path on stdout; progress and errors go to stderr.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
dest="$root/.tools/protoc"
die() { echo "install-protoc: ERROR: $*" >&2; exit 1; }

case "$(uname -s)-$(uname -m)" in
  Linux-x86_64) crate=protoc-bin-vendored-linux-x86_64 ;;
  Linux-aarch64) crate=protoc-bin-vendored-linux-aarch_64 ;;
  *) die "no vendored protoc for $(uname -s) $(uname -m); set PROTOC to a protoc 3.15 or newer" ;;
esac

# Where cargo unpacked the crate (the registry, a vendor directory, ...):
# cargo metadata knows, downloading it first if needed.
src=$(timeout 600 cargo metadata --format-version 1 --locked --manifest-path "$root/Cargo.toml" |
  python3 -c '
import json, os, sys
crate = sys.argv[1]
for p in json.load(sys.stdin)["packages"]:
    if p["name"] == crate:
        print(os.path.dirname(p["manifest_path"]))
        break
' "$crate") || die "cargo metadata failed (see above)"
[ -n "$src" ] || die "$crate is not in Cargo.lock (lbscale-proto's build dependency protoc-bin-vendored)"
[ -x "$src/bin/protoc" ] && [ -f "$src/include/google/protobuf/empty.proto" ] ||
  die "$src holds no bin/protoc with include/google/protobuf"

if ! cmp -s "$src/bin/protoc" "$dest/bin/protoc" 2>/dev/null; then
  rm -rf "$dest.new"
  mkdir -p "$dest.new"
  cp -R "$src/bin" "$src/include" "$dest.new/"
  rm -rf "$dest"
  mv "$dest.new" "$dest"
  echo "install-protoc: $($dest/bin/protoc --version) from $crate" >&2
fi
echo "$dest/bin/protoc"
