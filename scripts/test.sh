#!/usr/bin/env bash
# Install what the test suite needs, then lint and run it; arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/_common.sh"

# Debian packages the suite needs (installed when missing, as root).
APT_PACKAGES=()
# pyspark needs a Java runtime (17+ for pyspark 4; Debian 12's default is 17).
command -v java >/dev/null || APT_PACKAGES+=(default-jre-headless)
# The bench tests start a private RabbitMQ (loadtest/rabbitmq.py) side by side with ShardMQ.
[ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || APT_PACKAGES+=(rabbitmq-server)
command -v mount >/dev/null || APT_PACKAGES+=(mount)  # tests/test_safety_full_disk.py mounts a small tmpfs
[ "${#APT_PACKAGES[@]}" -eq 0 ] || apt_install "${APT_PACKAGES[@]}"

ensure_venv
ensure_project "test,spark"

cd "$REPO_ROOT"
status=0
log "ruff check ."
"$VENV/bin/ruff" check . || status=1
log "pytest -q -p no:cacheprovider $*"
"$VENV/bin/pytest" -q -p no:cacheprovider "$@" || status=$?
exit "$status"
