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
# The deploy tests run a real haproxy in front of nodes and `systemd-analyze verify` on the units.
command -v haproxy >/dev/null || APT_PACKAGES+=(haproxy)
command -v systemd-analyze >/dev/null || APT_PACKAGES+=(systemd)
# deploy/systemd/shardmq-etcd.service runs Debian's /usr/bin/etcd (verified, and its flags checked).
[ -x /usr/bin/etcd ] || APT_PACKAGES+=(etcd-server)
# deploy/install.sh is checked with shellcheck.
command -v shellcheck >/dev/null || APT_PACKAGES+=(shellcheck)
[ "${#APT_PACKAGES[@]}" -eq 0 ] || apt_install "${APT_PACKAGES[@]}"

ensure_venv
ensure_project "test,spark"
# The chart tests (tests/test_helm_chart.py) run the pinned helm.
ensure_helm

cd "$REPO_ROOT"
status=0
log "ruff check ."
"$VENV/bin/ruff" check . || status=1
log "pytest -q -p no:cacheprovider $*"
"$VENV/bin/pytest" -q -p no:cacheprovider "$@" || status=$?
exit "$status"
