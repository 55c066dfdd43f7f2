#!/usr/bin/env bash
# Run the whole suite N times in a row on a clean clone of HEAD; stop at the first failure.
#   scripts/test-loop.sh N [pytest args...]
# The clone lives in a temp dir (kept on failure for its logs, removed on success) and gets its own
# .venv, made by scripts/test.sh on the first run (that run's time includes the install). It never
# shares this checkout's .venv: test.sh installs the project editable, which would repoint a shared
# venv at the temporary clone. Each run's wall time is printed, then the total.
set -euo pipefail
source "$(dirname "$0")/_common.sh"

[ $# -ge 1 ] && [[ "$1" =~ ^[1-9][0-9]*$ ]] || die "usage: scripts/test-loop.sh N [pytest args...] (N >= 1)"
runs="$1"
shift

head="$(git -C "$REPO_ROOT" rev-parse HEAD)"
[ -z "$(git -C "$REPO_ROOT" status --porcelain --untracked-files=no)" ] \
    || log "note: uncommitted changes are not tested (the clone is of HEAD $head)"
work="$(mktemp -d "${TMPDIR:-/tmp}/shardmq-test-loop.XXXXXX")"
log "cloning HEAD $head into $work/repo"
git clone -q --no-hardlinks "$REPO_ROOT" "$work/repo"
git -C "$work/repo" checkout -q --detach "$head"

total_start=$(date +%s)
for ((i = 1; i <= runs; i++)); do
    start=$(date +%s)
    log "run $i/$runs"
    if ! (cd "$work/repo" && ./scripts/test.sh "$@") >"$work/run-$i.log" 2>&1; then
        tail -n 60 "$work/run-$i.log" >&2
        die "run $i/$runs FAILED after $(( $(date +%s) - start ))s; full output: $work/run-$i.log"
    fi
    log "run $i/$runs passed in $(( $(date +%s) - start ))s: $(grep -E '^[0-9]+ passed' "$work/run-$i.log" | tail -n 1)"
done
log "all $runs runs passed in $(( $(date +%s) - total_start ))s (HEAD $head)"
rm -rf "$work"
