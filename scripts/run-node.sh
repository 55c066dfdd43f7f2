#!/usr/bin/env bash
# Run one standalone ShardMQ node (no etcd) with the default data dir; arguments go to `shardmq`.
set -euo pipefail
source "$(dirname "$0")/_common.sh"

ensure_venv
ensure_project
compile_sources
exec "$VENV/bin/shardmq" "$@"
