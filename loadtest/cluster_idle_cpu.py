"""What an idle cluster costs: CPU per second of each node (node process + its workers) and of etcd.

    python -m loadtest.cluster_idle_cpu                          # 3 nodes, 20 s, lease TTL 10 s
    python -m loadtest.cluster_idle_cpu --runs 3 --seconds 30 --lease-ttl 1
    python -m loadtest.cluster_idle_cpu --tree /tmp/base         # nodes from another checkout (A/B)

Starts a private one-member etcd and ``--nodes`` ``--cluster`` nodes on loopback (n1 leads, the
others follow), waits until every follower is in the ISR, lets start-up work settle, then reads
the CPU time (user + system, /proc) of every process tree over ``--seconds``. Nothing is
published: this is the floor the coordination (etcd lease, leader watch), replication heartbeats
and the workers' timers cost. State the machine's load average with the numbers (it is printed).
Everything runs in a temp dir on free ports and is stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from loadtest import repl_ratio
from loadtest.etcd import EtcdCluster

_SETTLE_S = 3.0


def measure(workdir: Path, nodes_n: int, seconds: float, ttl: int, node_args: list[str]) -> dict:
    """One cluster, one measurement: {"per_s_ms": {tree: {role: ms}}, "total_ms": .., "loadavg": ..}."""
    etcd = EtcdCluster(1, workdir / "etcd").start()
    secret = workdir / "secret"
    secret.write_text(os.urandom(16).hex())
    prefix = f"idle{os.getpid()}"
    nodes: list[repl_ratio.Node] = []
    try:
        repl_ratio.start_synced_cluster(nodes, workdir, etcd.endpoints, prefix, secret, ttl, nodes_n, node_args)
        time.sleep(_SETTLE_S)  # start-up work (full syncs, imports, first stats) is not the idle floor
        trees = {n.name: n.proc.pid for n in nodes}
        trees["etcd"] = etcd.members[0].proc.pid
        before = {name: repl_ratio.tree_cpu(pid) for name, pid in trees.items()}
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        after = {name: repl_ratio.tree_cpu(pid) for name, pid in trees.items()}
        per_s = {name: {role: round((t - before[name].get(role, 0.0)) / elapsed * 1000, 1)
                        for role, t in after[name].items()} for name in trees}
        cluster_ms = sum(sum(v.values()) for name, v in per_s.items() if name != "etcd")
        return {"nodes": nodes_n, "lease_ttl": ttl, "seconds": round(elapsed, 1), "per_s_ms": per_s,
                "cluster_ms_per_s": round(cluster_ms, 1),
                "etcd_ms_per_s": round(sum(per_s["etcd"].values()), 1), "loadavg": os.getloadavg()}
    finally:
        for n in reversed(nodes):
            n.stop()
        etcd.stop()


def _fmt(r: dict) -> str:
    trees = "; ".join(f"{name} " + "+".join(f"{role} {ms:.1f}" for role, ms in sorted(roles.items()))
                      for name, roles in r["per_s_ms"].items() if name != "etcd")
    load = " ".join(f"{x:.2f}" for x in r["loadavg"])
    return (f"cluster {r['cluster_ms_per_s']:.1f} ms CPU/s (etcd {r['etcd_ms_per_s']:.1f}) over {r['seconds']} s, "
            f"lease TTL {r['lease_ttl']} s [{trees}]  load {load}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.cluster_idle_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3, help="cluster size (default 3)")
    ap.add_argument("--seconds", type=float, default=20.0, help="measurement window (default 20)")
    ap.add_argument("--runs", type=int, default=1, help="clusters measured one after the other (default 1)")
    ap.add_argument("--lease-ttl", type=int, default=10, help="--lease-ttl of every node (default 10, the node's)")
    ap.add_argument("--tree", help="run the nodes from this checkout (A/B a revision; default: this one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = ap.parse_args(argv)
    if args.tree:
        repl_ratio.REPO_ROOT = Path(args.tree).resolve()
    workdir = Path(tempfile.mkdtemp(prefix="shardmq-idle-"))
    try:
        for i in range(args.runs):
            r = measure(workdir / f"run{i}", args.nodes, args.seconds, args.lease_ttl, [])
            print(json.dumps(r) if args.json else f"run {i + 1}  {_fmt(r)}", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
