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
