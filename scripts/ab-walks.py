#!/usr/bin/env python3
"""Shard CPU with many idle queues, and connection churn with a consumer, against source trees, alternating.

    scripts/ab-walks.py TREE[,TREE...] [RUNS] [QUEUES] [IDLE_SECONDS] [CONNECTIONS]

Each run starts a fresh node from a tree (its defaults), declares QUEUES durable queues
(default 100,000; `shardmq-perf amqp queue-count --keep`), waits 5 s, then measures:

- idle: every shard's CPU (user+system, /proc/PID/stat) over IDLE_SECONDS (default 30), in ms per
  second: what the shard does with nothing to do (the periodic sync, timers);
- churn: CONNECTIONS times (default 300) open a connection, a channel, basic.consume on one of the
  queues (a different one each time), close the connection; the node's and each worker's CPU per
  connection in µs. With many queues a channel's close used to walk every queue of its shard.

The perf client runs from this script's tree. AB_NODE_ARGS: extra node arguments for every run.
Quote `uptime` with the numbers: the machine is shared.
"""
import argparse
import os
import subprocess
import time

import pika
from ab_node import PY, process_name, start_node, stop_node

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> int:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])






def run(tree: str, queues: int, idle_s: float, connections: int) -> None:
    node, port, data = start_node(tree, "ab-walks-")
    try:
        uri = f"amqp://guest:guest@127.0.0.1:{port}/"
        time.sleep(0.5)
        children = subprocess.run(["pgrep", "-P", str(node.pid)], capture_output=True, text=True).stdout.split()
        pids = [node.pid, *map(int, children)]
        before = {p: _cpu(p) for p in pids}
        t0 = time.monotonic()
        subprocess.run([PY, "-m", "loadtest.cli", "amqp", "queue-count", "--uri", uri, "--count", str(queues),
                        "--durable", "--keep", "--queue", "w", "--time", "900", "--json"],
                       env=dict(os.environ, PYTHONPATH=HERE), capture_output=True, text=True, check=True)
        declared_s = time.monotonic() - t0
        per_declare = {process_name(p): (_cpu(p) - before[p]) * TICK_US / queues for p in pids}
        time.sleep(5)
        shards = [p for p in pids if process_name(p).startswith("sh")]
        load = open("/proc/loadavg").read().split()[0]
        before = {p: _cpu(p) for p in shards}
        t0 = time.monotonic()
        time.sleep(idle_s)
        took = time.monotonic() - t0
        idle = {process_name(p): (_cpu(p) - before[p]) * TICK_US / 1000 / took for p in shards}
        params = pika.URLParameters(uri)
        before = {p: _cpu(p) for p in pids}
        t0 = time.monotonic()
        for i in range(connections):
            conn = pika.BlockingConnection(params)
            ch = conn.channel()
            ch.basic_consume(f"w-{(i * 7919) % queues}", lambda *_a: None)
            conn.close()
        churn_s = time.monotonic() - t0
        per_conn = {process_name(p): (_cpu(p) - before[p]) * TICK_US / connections for p in pids}
        load2 = open("/proc/loadavg").read().split()[0]
        print(f"{tree}: {queues} queues declared in {declared_s:.0f} s; load {load}/{load2}\n"
              f"  declare CPU µs/queue: " + " ".join(f"{k}={v:.0f}" for k, v in sorted(per_declare.items()))
              + f" (node total {sum(per_declare.values()):.0f})\n"
              f"  idle shard CPU ms/s: " + " ".join(f"{k}={v:.2f}" for k, v in sorted(idle.items()))
              + f" (sum {sum(idle.values()):.2f})\n"
              f"  churn: {connections} conns in {churn_s:.1f} s; CPU µs/conn: "
              + " ".join(f"{k}={v:.0f}" for k, v in sorted(per_conn.items()))
              + f" (node total {sum(per_conn.values()):.0f})", flush=True)
    finally:
        stop_node(node, data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", metavar="TREE[,TREE...]", help="source trees, comma-separated")
    parser.add_argument("runs", metavar="RUNS", type=int, nargs="?", default=2, help="rounds over the trees (2)")
    parser.add_argument("queues", metavar="QUEUES", type=int, nargs="?", default=100_000,
                        help="durable queues declared (100000)")
    parser.add_argument("idle_s", metavar="IDLE_SECONDS", type=float, nargs="?", default=30.0,
                        help="idle CPU measured over (30)")
    parser.add_argument("connections", metavar="CONNECTIONS", type=int, nargs="?", default=300,
                        help="connections churned (300)")
    args = parser.parse_args()
    trees = args.trees.split(",")
    for tree in trees:
        if not os.path.isfile(os.path.join(tree, "broker", "cli.py")):
            parser.error(f"TREE {tree!r} is not a ShardMQ source tree (no broker/cli.py)")
    for name in ("runs", "queues", "connections"):
        if getattr(args, name) < 1:
            parser.error(f"{name.upper()} must be at least 1")
    runs, queues, idle_s, connections = args.runs, args.queues, args.idle_s, args.connections
    for _ in range(runs):
        for tree in trees:
            run(tree, queues, idle_s, connections)


if __name__ == "__main__":
    main()
