#!/usr/bin/env bash
# Install ShardMQ as a systemd service on a Debian 12 host (docs/deploy.md, "systemd").
#
#   deploy/install.sh [--wheel FILE.whl] [--prefix /opt/shardmq] [--no-enable] [--dry-run]
#                     [--stage-dir DIR]
#
# Installs the package (from the wheel, or from this repository) into PREFIX/venv, creates the
# `shardmq` system user, the data dir /var/lib/shardmq, /etc/shardmq/{shardmq.ini,shardmq.env}
# (kept when they exist; the env file gets a generated default-user password), the unit
# /etc/systemd/system/shardmq.service, and enables and starts it. --dry-run prints every command
# and changes nothing (the tests run it that way); --stage-dir keeps the generated env file and
# unit there for review (default: a temporary directory, removed at exit).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
PREFIX=/opt/shardmq
WHEEL=""
ENABLE=1
DRY_RUN=0
STAGE=""
PYTHON="${PYTHON:-python3}"
SERVICE_USER=shardmq
DATA_DIR=/var/lib/shardmq
CONF_DIR=/etc/shardmq
UNIT_DIR=/etc/systemd/system

die() { echo "install.sh: error: $*" >&2; exit 2; }
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) [ $# -ge 2 ] || die "--wheel needs a file"; WHEEL="$2"; shift 2 ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; PREFIX="$2"; shift 2 ;;
        --no-enable) ENABLE=0; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --stage-dir) [ $# -ge 2 ] || die "--stage-dir needs a directory"; STAGE="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
done
case "$PREFIX" in /*) ;; *) die "--prefix must be an absolute path: $PREFIX" ;; esac
if [ -n "$WHEEL" ]; then
    [ -f "$WHEEL" ] || die "--wheel $WHEEL: no such file"
    case "$WHEEL" in *.whl) ;; *) die "--wheel $WHEEL: not a .whl file" ;; esac
    WHEEL="$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")"
fi
[ "$DRY_RUN" -eq 1 ] || [ "$(id -u)" -eq 0 ] || die "run as root (or with --dry-run to see what it would do)"
if [ -n "$STAGE" ]; then
    mkdir -p "$STAGE"
else
    STAGE="$(mktemp -d)"
    trap 'rm -rf "$STAGE"' EXIT
fi

# run CMD...: run it, or print it under --dry-run.
run() {
    if [ "$DRY_RUN" -eq 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

# install_new SRC DEST MODE: install a config file unless the operator already has one.
install_new() {
    if [ -e "$2" ]; then
        echo "keeping existing $2"
    else
        run install -m "$3" -o root -g "$SERVICE_USER" "$1" "$2"
    fi
}

echo "installing ShardMQ into $PREFIX (data $DATA_DIR, config $CONF_DIR)"
if ! getent passwd "$SERVICE_USER" >/dev/null; then
    run useradd --system --user-group --home-dir "$DATA_DIR" --no-create-home \
        --shell /usr/sbin/nologin --comment "ShardMQ broker" "$SERVICE_USER"
fi
run install -d -m 0755 "$PREFIX"
run "$PYTHON" -m venv "$PREFIX/venv"
run "$PREFIX/venv/bin/pip" install --quiet --upgrade pip
run "$PREFIX/venv/bin/pip" install --quiet "${WHEEL:-$REPO}"
run install -d -m 0700 -o "$SERVICE_USER" -g "$SERVICE_USER" "$DATA_DIR"
run install -d -m 0750 -o root -g "$SERVICE_USER" "$CONF_DIR"
install_new "$HERE/systemd/shardmq.ini" "$CONF_DIR/shardmq.ini" 0640
run install -m 0640 -o root -g "$SERVICE_USER" "$HERE/systemd/shardmq.ini.example" "$CONF_DIR/shardmq.ini.example"
if [ -e "$CONF_DIR/shardmq.env" ]; then
    echo "keeping existing $CONF_DIR/shardmq.env"
else
    # A generated password for the default user instead of the example's placeholder.
    password="$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(24))')"
    env_file="$STAGE/shardmq.env"
    sed "s/^SHARDMQ_DEFAULT_PASS=.*/SHARDMQ_DEFAULT_PASS=$password/" "$HERE/systemd/shardmq.env.example" > "$env_file"
    run install -m 0640 -o root -g "$SERVICE_USER" "$env_file" "$CONF_DIR/shardmq.env"
    echo "default user password: in $CONF_DIR/shardmq.env (SHARDMQ_DEFAULT_PASS)"
fi
unit="$STAGE/shardmq.service"
sed "s|/opt/shardmq/venv/bin/shardmq|$PREFIX/venv/bin/shardmq|" "$HERE/systemd/shardmq.service" > "$unit"
run install -m 0644 "$unit" "$UNIT_DIR/shardmq.service"
run systemctl daemon-reload
if [ "$ENABLE" -eq 1 ]; then
    run systemctl enable --now shardmq.service
    echo "started: systemctl status shardmq; health: curl -fsS http://127.0.0.1:15672/api/health/checks/ready"
else
    echo "installed, not enabled: systemctl enable --now shardmq.service"
fi
