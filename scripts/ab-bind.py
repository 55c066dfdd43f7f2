#!/usr/bin/env python3
"""Bind + unbind round trips (`shardmq-perf amqp bind-churn`) against source trees, alternating.

    scripts/ab-bind.py TREE[,TREE...] [RUNS] [SECONDS]

Each run starts a fresh node from a tree (its defaults: 2 frontends + 2 shards on 2 cores), runs
the bind loop, and prints pairs/s, the node's and every worker's CPU per operation (user+system
µs, /proc/PID/stat) and voluntary context switches per operation (wake-ups: /proc/PID/status).
Wall-clock pairs/s swing with the load of a shared machine; CPU and wake-ups per operation hardly
do. The perf client runs from this script's tree. AB_NODE_ARGS: extra node arguments for every
run (e.g. "--frontends 1 --shards 1").
"""
import json
import os
import subprocess
import sys
import time

from ab_node import PY, process_name, start_node, stop_node

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stat(pid: int) -> tuple[int, int, int]:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    vol = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("voluntary_ctxt"))
    return int(f[11]), int(f[12]), vol






def run(tree: str, seconds: float) -> None:
    node, port, data = start_node(tree, "ab-bind-")
    try:
        time.sleep(0.5)
        children = subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True, text=True).stdout.split()
        pids = [node.pid, *map(int, children)]
        before = {p: _stat(p) for p in pids}
        load = open("/proc/loadavg").read().split()[0]
        out = subprocess.run([PY, "-m", "loadtest.cli", "amqp", "bind-churn", "--uri",
                              f"amqp://guest:guest@127.0.0.1:{port}/", "--time", str(seconds), "--json"],
                             env=dict(os.environ, PYTHONPATH=HERE), capture_output=True, text=True, check=True).stdout
        after = {p: _stat(p) for p in pids}
        pairs = json.loads(out)["extra"]["bind_unbind_pairs"]
        ops = 2 * pairs
        tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
        total = 0.0
        roles = []
        for p in pids:
            user = (after[p][0] - before[p][0]) * tick_us / ops
            system = (after[p][1] - before[p][1]) * tick_us / ops
            total += user + system
            roles.append(f"{process_name(p)} {user:.0f}+{system:.0f}us {(after[p][2] - before[p][2]) / ops:.2f}w")
        print(f"{tree}  pairs/s {pairs / seconds:6.0f}  cpu/op {total:4.0f}us  load {load} | "
              + " | ".join(roles), flush=True)
    finally:
        stop_node(node, data)


def main() -> None:
    trees = [os.path.abspath(t) for t in sys.argv[1].split(",")]
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 5.0
    for _ in range(runs):
        for tree in trees:
            run(tree, seconds)


if __name__ == "__main__":
    main()
