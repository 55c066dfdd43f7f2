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
# Node.js amqplib compatibility tests (tests/node_clients.py installs amqplib with npm).
command -v node >/dev/null || APT_PACKAGES+=(nodejs)
command -v npm >/dev/null || APT_PACKAGES+=(npm)
# The management UI test drives a real headless Chromium through Selenium (tests/test_management_ui.py).
command -v chromium >/dev/null || APT_PACKAGES+=(chromium)
command -v chromedriver >/dev/null || APT_PACKAGES+=(chromium-driver)
# The PROXY protocol tests put a real haproxy (send-proxy, send-proxy-v2) in front of a node.
command -v haproxy >/dev/null || APT_PACKAGES+=(haproxy)
# The MQTT perf-tool test runs shardmq-perf against a private mosquitto (loadtest/mosquitto.py).
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || APT_PACKAGES+=(mosquitto)
# The cluster tests start private etcd servers (loadtest/etcd.py) and the drill puts haproxy in front.
[ -x /usr/bin/etcd ] || APT_PACKAGES+=(etcd-server)
# The deploy tests run `systemd-analyze verify` on the units and shellcheck on deploy/install.sh.
command -v systemd-analyze >/dev/null || APT_PACKAGES+=(systemd)
command -v shellcheck >/dev/null || APT_PACKAGES+=(shellcheck)
command -v mount >/dev/null || APT_PACKAGES+=(mount)  # tests/test_safety_full_disk.py mounts a small tmpfs
# The partition drill (tests/test_drill_partition.py) puts each node in a network namespace (ip netns, veth).
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || APT_PACKAGES+=(iproute2)
[ "${#APT_PACKAGES[@]}" -eq 0 ] || apt_install "${APT_PACKAGES[@]}"

ensure_venv
if [ "${SHARDMQ_SHARED_VENV:-0}" = 1 ]; then
    # .venv is shared with other checkouts (scripts/test-loop.sh with SHARDMQ_LOOP_VENV): never
    # reinstall into it (that would repoint its editable install here); run this tree from source.
    export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    ensure_project "test,spark"
fi
compile_sources
# The chart tests (tests/test_helm_chart.py) run the pinned helm.
ensure_helm

cd "$REPO_ROOT"
status=0
log "ruff check ."
"$VENV/bin/ruff" check . || status=1
# --tb=native: pytest's own traceback formatting parses source with ast, and CPython 3.11's ast
# can raise "SystemError: AST constructor recursion depth mismatch" there (gh-106905), which turns
# one failing test into an INTERNALERROR that ends the whole run without its summary.
# Two pytest-xdist workers, each given whole modules (--dist loadfile: a module's shared node and
# etcd stay one): most tests wait on nodes, clients and timers more than they compute, so on the
# 2-core CI machine one process left a core idle much of the run. SHARDMQ_TEST_WORKERS=0 runs in one.
# Not --dist loadgroup: pytest-xdist 3.8 groups by a suffix it writes to item._nodeid, which
# pytest 9.2 no longer reads (Node.nodeid is _id), so every test went alone and modules were split
# (pytest-dev/pytest-xdist#1386, fix proposed in #1388).
WORKERS=(-n "${SHARDMQ_TEST_WORKERS:-2}" --dist loadfile)
log "pytest -q -p no:cacheprovider --tb=native ${WORKERS[*]} $*"
"$VENV/bin/pytest" -q -p no:cacheprovider --tb=native "${WORKERS[@]}" "$@" || status=$?
exit "$status"
