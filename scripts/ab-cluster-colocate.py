#!/usr/bin/env python3
"""A cluster leader with paired workers (``--colocate on``) against split ones (``off``), alternating.

    scripts/ab-cluster-colocate.py RUNS [perf args...]
    e.g. scripts/ab-cluster-colocate.py 3 -x 1 -y 1 -s 16 --rate 1000 -z 6

Each run starts a private one-member etcd and a fresh two-node cluster from this tree (leader +
one follower in the ISR, ``--frontends 1 --shards 1`` unless AB_NODE_ARGS says otherwise; the
helpers of loadtest/repl_ratio.py), runs ``python -m loadtest.cli amqp throughput`` against the
leader and prints one JSON line: the setting, msg/s, latency p50/p99 and the CPU µs per message of
the leader, the follower, etcd and the load generator, and the load average. Runs alternate on,
off, on, off...
"""
import json
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loadtest.repl_ratio import run_cluster  # noqa: E402

RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
PERF = sys.argv[2:] or ["-x", "1", "-y", "1", "-s", "16", "--rate", "1000", "-z", "6"]
NODE_ARGS = shlex.split(os.environ.get("AB_NODE_ARGS", "--frontends 1 --shards 1"))
SETTINGS = os.environ.get("AB_SETTINGS", "on,off").split(",")


def main() -> None:
    os.environ.pop("SHARDMQ_COLOCATE", None)
    for _ in range(RUNS):
        for setting in SETTINGS:
            workdir = Path(tempfile.mkdtemp(prefix="ab-cluster-colo-"))
            try:
                res = run_cluster(workdir, [*NODE_ARGS, "--colocate", setting], PERF, 1)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            print(json.dumps({"colocate": setting, **res}), flush=True)


if __name__ == "__main__":
    main()
