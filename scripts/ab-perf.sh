#!/usr/bin/env bash
# A/B the broker at two revisions with shardmq-perf: a node (1 frontend, 1 shard) from a git worktree of
# BASE_REV and one from this checkout, alternating, REPEATS times each, on loopback ports. Prints one
# line per run; take medians. Used to check that features leave the plain path as fast as before.
#   scripts/ab-perf.sh BASE_REV REPEATS -- SHARDMQ_PERF_THROUGHPUT_ARGS...
#   e.g. scripts/ab-perf.sh 168545f 3 -- -x 1 -y 1 -s 16 -z 10
set -euo pipefail
source "$(dirname "$0")/_common.sh"
[ $# -ge 3 ] && [ "$3" = "--" ] || die "usage: $0 BASE_REV REPEATS -- PERF_ARGS..."
BASE_REV=$1 REPEATS=$2; shift 3
ensure_venv
# Install only into a venv that lacks the dependencies: worktrees share one venv, and a reinstall from
# here would repoint its editable install at this checkout. Both trees run with cwd = their own tree.
"$VENV/bin/python" -c 'import msgpack, pamqp, uvloop, zmq' 2>/dev/null || ensure_project
PY="$VENV/bin/python"
BASE_TREE=$(mktemp -d /tmp/shardmq-ab-base.XXXXXX)
git -C "$REPO_ROOT" worktree add -q --detach "$BASE_TREE" "$BASE_REV"
pid=""
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    git -C "$REPO_ROOT" worktree remove --force "$BASE_TREE"
}
trap cleanup EXIT
for r in $(seq 1 "$REPEATS"); do
    for tree in "$BASE_TREE" "$REPO_ROOT"; do
        port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        data=$(mktemp -d)
        # Listeners with fixed default ports are turned off where the tree has them, so runs never collide.
        extra=()
        grep -q '"http_port"' "$tree/broker/config.py" && extra+=(--http-port 0)
        grep -q '"prometheus_port"' "$tree/broker/config.py" && extra+=(--prometheus-port 0)
        grep -q '"mqtt_port"' "$tree/broker/config.py" && extra+=(--mqtt-port 0)
        grep -q '"ws_port"' "$tree/broker/config.py" && extra+=(--ws-port 0)
        (cd "$tree" && exec "$PY" -m broker.cli --data-dir "$data" --port "$port" --frontends 1 --shards 1 \
            --log-level warning "${extra[@]}") &
        pid=$!
        for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
        out=$(cd "$REPO_ROOT" && "$PY" -m loadtest.cli amqp throughput \
            --uri "amqp://guest:guest@127.0.0.1:$port/" --json "$@" 2>&1 | tail -1)
        label=$([ "$tree" = "$REPO_ROOT" ] && echo "HEAD" || echo "$BASE_REV")
        echo "$label run$r $(echo "$out" | "$PY" -c 'import json, sys; d = json.loads(sys.stdin.read()); lat = d.get("latency_us") or {}; print("publish %.0f consume %.0f msgs/s" % (d["publish_rate"], d["consume_rate"]) + (" latency p50 %s p99 %s us" % (lat["p50"], lat["p99"]) if lat.get("p50") is not None else ""))' 2>/dev/null || echo "$out")"
        kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
        rm -rf "$data"
    done
done
