"""How fast a follower takes the leadership after the leader dies (kill -9), seen from etcd.

    python -m loadtest.cluster_takeover --runs 3                 # 3 nodes, lease TTL 1 s
    python -m loadtest.cluster_takeover --tree /tmp/base         # nodes from another checkout (A/B)

Each run: a private etcd and a fresh cluster (n1 leads), every follower in the ISR, then SIGKILL of
the leader's process group. Printed: seconds from the kill until etcd deleted the leader key (the
lease expiring: etcd's part) and from then until a follower wrote it (the followers' reaction and
campaign: ShardMQ's part). The promotion (spawning the workers) comes after and is not included.
This tool reads the key every 2 ms, so its own load is in the numbers; state the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadtest import repl_ratio
from loadtest.etcd import EtcdCluster


def _leader(client, prefix: str) -> str | None:
    raw, _meta = client.get(f"/{prefix}/leader")
    return json.loads(raw)["name"] if raw else None


def measure(workdir: Path, nodes_n: int, ttl: int) -> dict:
    from replication.coordination import etcd3  # the node's import: pure-Python protobuf set up

    etcd = EtcdCluster(1, workdir / "etcd").start()
    secret = workdir / "secret"
    secret.write_text(os.urandom(16).hex())
    prefix = f"takeover{os.getpid()}"
    nodes: list[repl_ratio.Node] = []
    host, port = etcd.endpoints.split(",")[0].rsplit(":", 1)
    client = etcd3.client(host=host, port=int(port))
    try:
        repl_ratio.start_synced_cluster(nodes, workdir, etcd.endpoints, prefix, secret, ttl, nodes_n)
        repl_ratio._wait(lambda: all(n.ready() for n in nodes[1:]), 60, "the followers to proxy")
        assert _leader(client, prefix) == "n1"
        t_kill = time.monotonic()
        os.killpg(nodes[0].proc.pid, signal.SIGKILL)
        nodes[0].proc.wait()
        deadline = t_kill + 10 * ttl + 30
        gone = None
        while time.monotonic() < deadline:
            name = _leader(client, prefix)
            now = time.monotonic()
            if name is None and gone is None:
                gone = now
            elif name is not None and name != "n1":
                return {"key_gone_s": round((gone or now) - t_kill, 3),
                        "taken_s": round(now - (gone or now), 3), "new_leader": name,
                        "lease_ttl": ttl, "loadavg": os.getloadavg()}
            time.sleep(0.002)
        raise TimeoutError("no follower took over")
    finally:
        client.close()
        for n in reversed(nodes):
            n.stop()
        etcd.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cluster_takeover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3, help="cluster size (default 3)")
    ap.add_argument("--runs", type=int, default=3, help="clusters, one kill each (default 3)")
    ap.add_argument("--lease-ttl", type=int, default=1, help="--lease-ttl of every node (default 1)")
    ap.add_argument("--tree", help="run the nodes from this checkout (A/B a revision; default: this one)")
    args = ap.parse_args(argv)
    if args.tree:
        repl_ratio.REPO_ROOT = Path(args.tree).resolve()
    workdir = Path(tempfile.mkdtemp(prefix="shardmq-takeover-"))
    taken = []
    try:
        for i in range(args.runs):
            r = measure(workdir / f"run{i}", args.nodes, args.lease_ttl)
            taken.append(r["taken_s"])
            load = " ".join(f"{x:.2f}" for x in r["loadavg"])
            print(f"run {i + 1}  leader key gone {r['key_gone_s']:.3f} s after the kill, taken by "
                  f"{r['new_leader']} {r['taken_s'] * 1000:.0f} ms later  load {load}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"taken after the key was gone: median {statistics.median(taken) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
